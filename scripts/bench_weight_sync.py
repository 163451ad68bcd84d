"""Weight-sync benchmark: full update of a synthetic ~1 GB M3-shaped model vs a raw broadcast.

    python scripts/bench_weight_sync.py                      # CPU, gloo, 1 rollout rank
    python scripts/bench_weight_sync.py --receivers 2 --ep   # 2 rollout ranks, EP=2 expert slices
    python scripts/bench_weight_sync.py --backend nccl       # GPUs: rank i on cuda:i (trainer cuda:0)

One trainer process (rank 0) and R rollout processes form a weight-sync group. Measured in the
same run, per receiving rank:
  raw       the same bytes (same bucket sizes) broadcast from preallocated buffers: the transport
            ceiling (no packing, checksum, validation or copies);
  atomic=false / atomic=true   full updates through WeightSender / WeightReceiver (bucket packing
            with casts, checksums, finite checks, copies into the parameters; atomic also stages
            in host memory and commits after the status exchange).
GB/s = update bytes / receiver wall time; "pause" = the receiver's receive + commit time, the
time generation is stopped under ``weight_sync.in_flight=continue`` (for raw: the bare transfer).
Each figure is the median of --repeats updates after one warm-up, the modes interleaved. Appends a section to docs/benchmarks.md unless --no-write.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
import traceback

import torch
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from m3_rollout.model import M3ForCausalLM, iter_released_tensors  # noqa: E402
from m3_rollout.model.configuration import tiny_config  # noqa: E402
from m3_rollout.weight_sync import (BroadcastChannel, WeightReceiver, WeightSender,  # noqa: E402
                                    WeightSyncGroup, plan_buckets)


def synthetic_config():
    """M3-shaped (spec §1 structure: dense layer 0, sparse-attention MoE layers, sigmoid router
    with bias, shared expert, untied head) at ~0.5 G parameters (~1 GB in bf16)."""
    return tiny_config(vocab_size=32768, hidden_size=1024, num_hidden_layers=5, num_attention_heads=16,
                       num_key_value_heads=2, head_dim=64, intermediate_size=1024, shared_intermediate_size=1024,
                       dense_intermediate_size=4096, num_local_experts=32, num_experts_per_tok=4,
                       moe_layer_freq=[0, 1, 1, 1, 1], sparse_attention_freq=[0, 1, 1, 1, 1],
                       sparse_disable_index_value=[0, 1, 1, 1, 1], sparse_index_dim=64, sparse_num_index_heads=2)


def build_model(seed: int, dtype: torch.dtype, device: str, ep_rank: int | None = None, ep_size: int = 1):
    """The synthetic model in ``dtype`` (router fp32) with cheap random weights, no fp32 init pass."""
    cfg = synthetic_config()
    with torch.device("meta"):
        model = M3ForCausalLM(cfg)
    if ep_rank is not None and ep_size > 1:
        from m3_rollout.parallel import shard_experts
        shard_experts(model, ep_rank, ep_size, None)
    model.cast_for_inference(dtype)
    model.to_empty(device=device)
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.uniform_(-0.02, 0.02, generator=g)
    return model.eval()


def _device(backend: str, rank: int) -> str:
    return f"cuda:{rank % max(torch.cuda.device_count(), 1)}" if backend == "nccl" else "cpu"


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def _raw_broadcast(group: WeightSyncGroup, plan, device: str) -> float:
    bufs = [torch.empty(max(b.wire_bytes for b in plan), dtype=torch.uint8, device=device) for _ in range(2)]
    _sync(device)
    t0 = time.perf_counter()
    works = []
    for k, b in enumerate(plan):
        works.append(group.broadcast(bufs[k % 2][:b.wire_bytes], async_op=True))
        if len(works) > 2:
            group.wait(works.pop(0))
    for w in works:
        group.wait(w)
    _sync(device)
    return time.perf_counter() - t0


def _rank_main(rank: int, args, port: int, results) -> None:
    try:
        torch.set_num_threads(args.threads)
        dtype = getattr(torch, args.dtype)
        device = _device(args.backend, rank)
        world = 1 + args.receivers
        bucket_bytes = int(args.bucket_mb * 2**20)
        if rank == 0:
            model = build_model(1, dtype, device)
        else:
            ep_size = args.receivers if args.ep else 1
            model = build_model(0, dtype, device, rank - 1, ep_size)
        group = WeightSyncGroup("127.0.0.1", port, rank, world, args.backend, timeout_s=600, device=device)
        named = list(iter_released_tensors(model)) if rank == 0 else None
        entries = [(tuple(t.shape), t.dtype) for _, t in named] if rank == 0 else None
        # every rank needs the plan for the raw baseline: rank 0 computes it and ships it
        plan = plan_buckets(group.exchange_objects(entries)[0], bucket_bytes)
        total = sum(b.data_bytes for b in plan)
        out = {"rank": rank, "bytes": total, "buckets": len(plan)}
        if rank == 0:
            sender = WeightSender(lambda: iter_released_tensors(model), BroadcastChannel(group, True),
                                  args.bucket_mb, None)
            sender.handshake()
        else:
            rx = WeightReceiver(model, atomic=False, double_buffer=True)
            rx.handshake(group)
        version = 0
        modes = ("raw", "atomic=false", "atomic=true")
        times: dict[str, list[float]] = {m: [] for m in modes}
        # NOTE: modes are interleaved within each repeat so that load from other processes on the
        # machine hits all of them alike.
        for rep in range(args.repeats + 1):
            for mode in modes:
                group.exchange_objects(None)  # start together
                if mode == "raw":
                    dt = _raw_broadcast(group, plan, device)
                elif rank == 0:
                    version += 1
                    _sync(device)
                    t0 = time.perf_counter()
                    sender.update(version, include_frozen=True)
                    _sync(device)
                    dt = time.perf_counter() - t0
                else:
                    version += 1
                    rx.atomic = mode == "atomic=true"
                    t0 = time.perf_counter()
                    r = rx.receive_update(group, bucket_bytes)
                    _sync(device)
                    dt = time.perf_counter() - t0
                    assert r.ok, r.errors
                if rep > 0:
                    times[mode].append(dt)
        for mode in modes:
            out[mode] = {"seconds": statistics.median(times[mode]), "pause": statistics.median(times[mode]),
                         "all": times[mode]}
        results.put(out)
        group.close()
    except Exception:  # noqa: BLE001
        results.put({"rank": rank, "error": traceback.format_exc()})


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    ap.add_argument("--receivers", type=int, default=1)
    ap.add_argument("--ep", action="store_true", help="rollout ranks hold EP slices of the experts")
    ap.add_argument("--bucket-mb", type=float, default=64.0)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    from m3_rollout.parallel import free_port

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, args, port, results)) for r in range(1 + args.receivers)]
    for p in procs:
        p.start()
    got = {}
    for _ in procs:
        r = results.get(timeout=1800)
        if "error" in r:
            for p in procs:
                p.kill()
            raise SystemExit(f"rank {r['rank']} failed:\n{r['error']}")
        got[r["rank"]] = r
    for p in procs:
        p.join(timeout=60)
    gb = got[0]["bytes"] / 1e9
    rows = []
    for rank in range(1, 1 + args.receivers):
        r = got[rank]
        raw = gb / r["raw"]["seconds"]
        for mode in ("raw", "atomic=false", "atomic=true"):
            rate = gb / r[mode]["seconds"]
            rows.append((rank, mode, r[mode]["seconds"], rate, rate / raw, r[mode]["pause"]))
    machine = (f"{_cpu_name()}, {os.cpu_count()} cores" if args.backend == "gloo"
               else f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}")
    head = (f"## Weight sync (bench_weight_sync.py), {datetime.date(2026, 11, 29)}, {machine}, {args.backend}\n\n"
            f"Synthetic M3-shaped model: {gb:.3f} GB in {args.dtype} (router fp32), {got[0]['buckets']} buckets of "
            f"<= {args.bucket_mb:g} MiB, {args.receivers} rollout rank(s){' (EP slices)' if args.ep else ''}, "
            f"median of {args.repeats} interleaved repeats after a warm-up, torch threads per process = {args.threads}.\n\n"
            "| rank | mode | seconds | GB/s per receiving rank | vs raw broadcast | pause (s) |\n"
            "|---|---|---|---|---|---|\n")
    body = "".join(f"| {rk} | {m} | {s:.3f} | {g:.3f} | {x:.2f} | {p:.3f} |\n" for rk, m, s, g, x, p in rows)
    text = head + body
    print(text)
    if not args.no_write:
        with open(os.path.join(ROOT, "docs", "benchmarks.md"), "a") as f:
            f.write("\n" + text)


if __name__ == "__main__":
    main()

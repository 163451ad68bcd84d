"""Weight-sync benchmark: full update of a synthetic ~1 GB M3-shaped model vs a raw baseline.

    python scripts/bench_weight_sync.py                      # CPU, gloo, 1 rollout rank
    python scripts/bench_weight_sync.py --receivers 2 --ep   # 2 rollout ranks, EP=2 expert slices
    python scripts/bench_weight_sync.py --backend nccl       # GPUs: rank i on cuda:i (trainer cuda:0)
    python scripts/bench_weight_sync.py --method colocated --device cuda   # trainer + rollout on one GPU
    python scripts/bench_weight_sync.py --method colocated --device cuda --sweep-kernel --kernel best
    python scripts/bench_weight_sync.py --gb 10 ...          # scale the synthetic model (default ~1 GB)
    python scripts/bench_weight_sync.py --backend nccl --real-shapes [--gb N] [--receivers 3]
                                                             # the released M3 layer shapes, largest that fits

--method broadcast (default):

One trainer process (rank 0) and R rollout processes form a weight-sync group. Measured in the
same run, per receiving rank:
  raw       the same bytes (same bucket sizes) broadcast from preallocated buffers: the transport
            ceiling (no packing, checksum, validation or copies);
  atomic=false / atomic=true   full updates through WeightSender / WeightReceiver (bucket packing
            with casts, checksums, finite checks, copies into the parameters; atomic also stages
            in host memory and commits after the status exchange).
GB/s = update bytes / receiver wall time; "pause" = the receiver's receive + commit time, the
time generation is stopped under ``weight_sync.in_flight=continue`` (for raw: the bare transfer).
Each figure is the median of --repeats updates after one warm-up, the modes interleaved.

--real-shapes (broadcast over NCCL only): instead of the synthetic model, a slice of M3 at the
released layer shapes (configs/bench/m3_slice_real.json: layer 0 dense attention + dense MLP, then
MSA sparse-attention + MoE layers of 128 experts of width 3072, hidden 6144, 64 q / 4 KV heads;
vocabulary 32768), ~14.8 GB of bf16 per MoE layer. --gb N: the number of MoE layers closest to N
GB; without --gb, the largest number that fits (``real_shapes_plan``): every GPU of the run
holds its model (the trainer the whole slice, a receiver the whole slice or its EP slice) plus
wire buffers and a reserve, and the host holds every receiver's pinned atomic stage (the
receiver's bytes) within 80 % of MemAvailable. A --gb that does not fit is refused before any
rank starts, naming the GPU or the host memory.

--method colocated (weight_sync.method=colocated): trainer and rollout share one
device (NCCL cannot put two ranks on one GPU), so both live in this one process on --device. The
trainer is what ``Policy`` holds at policy.precision=bfloat16: fp32 masters and their bf16 compute
copy, refreshed by the attested cast (``weight_sync.cast_copy.CastCopy``). Measured in the same
run, on the same bytes (the compute copy's), modes interleaved:
  raw flat copy             one copy_ of a flat buffer of the same bytes: the device copy ceiling
            (every ratio is against it);
  raw copy_ per parameter   rollout_param.copy_(trainer_param) for every parameter;
  direct atomic=false / atomic=true, attested   WeightSender(ReleasedTensors with the cast) +
            ColocatedChannel(direct=True) + WeightReceiver: the compute copy is sent and validated
            from the cast's flags (one 4-byte read), then one fused copy pass (copy_plan.py);
  direct ..., check pass    the same bytes without the attestation: a fused check pass, then copy;
  raw bucket copies   the update's wire buckets copied buffer to buffer through a ring of three
            slots, one device copy per bucket: the loopback's stand-in for the broadcast, alone;
  ..., buckets   the bucketed broadcast pipeline in loopback (ColocatedChannel(direct=False)): the
            sender packs each bucket (fused cast + copy, checksum trailer) into a ring of three wire
            buffers on its side stream; a device-to-device copy on a transfer stream STANDS IN FOR
            THE BROADCAST into the receiver's ring; the receiver checksums, flags non-finite values
            and unpacks (non-atomic: into the parameters; atomic: into the pinned host stage, then
            commits) on its own side stream; events order the three; the verdict is read on the
            host once per update. On CUDA two more bucketed updates per atomic mode run under
            torch.cuda.set_sync_debug_mode("warn") (the first after the other mode, then a steady
            one) and the report gives their counts of synchronizing CUDA calls with the source
            line of each (the pipeline's target: the one verdict read);
  ipc ...   a rollout worker PROCESS on the same device (weight_sync/ipc.py) refit from the
            trainer's attested compute copy itself ('copy': one device copy per update) and from the
            stage the trainer fills first ('stage', the fallback): whole update, the trainer's part
            before the worker reads, worker refit (unless --no-ipc);
  the trainer's cast (fp32 masters -> bf16 copy + flags, once per optimizer step): the fused pass
            against the per-parameter copy_ it replaced.
host ms = until update() returned (the rest is device time: the copy is asynchronous). GB/s =
update bytes / wall time (CUDA synchronized before and after). Correctness, checked after timing
for each direct mode: the rollout is scrambled, updated, then every parameter is bitwise equal
to the trainer's copy with data_ptr unchanged, the receiver on the new version and validated the
expected way (attested / checked); the copy itself is bitwise torch's cast of the masters.

--sweep-kernel (with --method colocated --device cuda): first times every copy-plan kernel
variant (copy_plan.KERNELS, or --variants a,b) on the refit's own pairs against a flat copy of the
same bytes (CUDA events): copy, check (reads only), cast (fp32 -> bf16 + flags), plus
torch._foreach_copy_ over the same runs; --kernel best then runs the rest with the fastest copy.

Appends a section to docs/benchmarks.md (or --write PATH) unless --no-write; colocated writes
nothing when a correctness check fails.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
import traceback
import warnings

import torch
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))  # benchlib, also when imported from a test

from benchlib import GIB, GPU_RESERVE, REAL_SLICE, bench_config, gpu_shortfalls, machine, run_date  # noqa: E402

from m3_rollout.model import M3ForCausalLM, iter_released_tensors  # noqa: E402
from m3_rollout.model.configuration import M3Config, tiny_config  # noqa: E402
from m3_rollout.weight_sync import (  # noqa: E402
    BroadcastChannel,
    CastCopy,
    ColocatedChannel,
    IpcChannel,
    IpcRolloutSync,
    ReleasedTensors,
    WeightReceiver,
    WeightSender,
    WeightSyncGroup,
    copy_plan,
    plan_buckets,
)
from m3_rollout.weight_sync.copy_plan import CopyPlan  # noqa: E402


def _shaped_config(width: int, moe_layers: int):
    """M3-shaped (spec §1 structure: dense layer 0, then ``moe_layers`` sparse-attention MoE layers,
    sigmoid router with bias, shared expert, untied head) at hidden size ``width``: 32 experts top-4,
    head_dim 64, vocab 32 * width, expert / shared intermediate = width, dense intermediate = 4 * width."""
    n = 1 + moe_layers
    freq = [0] + [1] * moe_layers
    return tiny_config(
        vocab_size=32 * width,
        hidden_size=width,
        num_hidden_layers=n,
        num_attention_heads=max(width // 64, 2),
        num_key_value_heads=2,
        head_dim=64,
        intermediate_size=width,
        shared_intermediate_size=width,
        dense_intermediate_size=4 * width,
        num_local_experts=32,
        num_experts_per_tok=4,
        moe_layer_freq=freq,
        sparse_attention_freq=freq,
        sparse_disable_index_value=freq,
        sparse_index_dim=64,
        sparse_num_index_heads=2,
    )


def model_bytes(cfg, dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes of every parameter of ``cfg``'s model cast for inference to ``dtype`` (router fp32);
    built on the meta device, nothing allocated."""
    with torch.device("meta"):
        model = M3ForCausalLM(cfg)
    model.cast_for_inference(dtype)
    return sum(p.numel() * p.element_size() for p in model.parameters())


def synthetic_config(gb: float | None = None, dtype: torch.dtype = torch.bfloat16):
    """The synthetic M3-shaped model config.

    ``gb=None``: hidden 1024, 1 dense + 4 MoE layers, ~0.5 G parameters (1.016 GB in bf16; the
    figures already in docs/benchmarks.md). ``gb``: the widest hidden size in (1024, 512, 256, 128)
    whose dense + one-MoE-layer model fits in ``gb`` GB (1e9 bytes) of ``dtype``, then the number of
    MoE layers that lands closest to ``gb`` (at least one). Raises ValueError for gb <= 0.
    """
    if gb is None:
        return _shaped_config(1024, 4)
    if not gb > 0:
        raise ValueError(f"--gb={gb}: the model size must be > 0 GB")
    target = gb * 1e9
    for width in (1024, 512, 256, 128):
        one, two = model_bytes(_shaped_config(width, 1), dtype), model_bytes(_shaped_config(width, 2), dtype)
        if one <= target or width == 128:
            per_layer, fixed = two - one, 2 * one - two
            return _shaped_config(width, max(1, round((target - fixed) / per_layer)))
    raise AssertionError("unreachable")


HOST_FRACTION = 0.8  # of MemAvailable, for the receivers' pinned atomic stages


def real_shapes_config(moe_layers: int) -> M3Config:
    """M3 at the released layer shapes (configs/bench/m3_slice_real.json): layer 0 full attention +
    dense MLP, then ``moe_layers`` MSA sparse-attention + 128-expert MoE layers."""
    return bench_config(
        REAL_SLICE,
        num_hidden_layers=1 + moe_layers,
        layer_types=["full_attention"] + ["minimax_m3_sparse"] * moe_layers,
        mlp_layer_types=["dense"] + ["sparse"] * moe_layers,
    )


def rank_bytes(cfg, ep_size: int = 1, dtype: torch.dtype = torch.bfloat16) -> int:
    """Parameter bytes of one rank holding ``cfg``'s model cast to ``dtype`` (router fp32), with the
    experts of EP rank 0 of ``ep_size`` only when ``ep_size`` > 1; built on ``meta``."""
    with torch.device("meta"):
        model = M3ForCausalLM(cfg)
    if ep_size > 1:
        from m3_rollout.parallel import shard_experts

        shard_experts(model, 0, ep_size, None)
    model.cast_for_inference(dtype)
    return sum(p.numel() * p.element_size() for p in model.parameters())


def real_shapes_plan(
    gb: float | None,
    gpu_free: list[int],
    host_free: int,
    receivers: int,
    ep: bool,
    bucket_bytes: int,
    dtype: torch.dtype = torch.bfloat16,
) -> dict:
    """How many real-shape MoE layers the --real-shapes run uses, and what each GPU / the host needs.

    Args:
        gb: target size in GB (1e9 bytes): the layer count closest to it (at least 1); None = the
            largest count that fits.
        gpu_free: free bytes of GPU 0 (the trainer) .. GPU ``receivers`` (the receivers).
        host_free: the host's available bytes (MemAvailable).
        receivers / ep: the run's rollout ranks and whether they hold EP slices of the experts.
        bucket_bytes: the wire bucket size (each end keeps a ring of them).
    Returns:
        {"moe_layers", "config", "bytes" (the update), "receiver_bytes", "gpu_need" [per GPU],
        "host_need"}.
    Raises:
        SystemExit: the plan does not fit (or not even one MoE layer does), naming the GPU or the
            host memory and the estimate.
    """
    ep_size = receivers if ep else 1

    def plan(n: int) -> dict:
        cfg = real_shapes_config(n)
        full, recv = rank_bytes(cfg, 1, dtype), rank_bytes(cfg, ep_size, dtype)
        wire = 8 * bucket_bytes + GPU_RESERVE  # rings, raw-broadcast buffers, reserve
        return {
            "moe_layers": n,
            "config": cfg,
            "bytes": full,
            "receiver_bytes": recv,
            "gpu_need": [full + wire] + [recv + wire] * receivers,
            "host_need": receivers * recv,
        }

    def problems(p: dict) -> list[str]:
        out = gpu_shortfalls(p["gpu_need"], gpu_free)
        if p["host_need"] > HOST_FRACTION * host_free:
            out.append(
                f"host: the {receivers} pinned atomic stage(s) need ~{p['host_need'] / GIB:.1f} GiB, over "
                f"{HOST_FRACTION:.0%} of the {host_free / GIB:.1f} GiB available"
            )
        return out

    one, two = plan(1), plan(2)
    per_layer, fixed = two["bytes"] - one["bytes"], 2 * one["bytes"] - two["bytes"]
    if gb is not None:
        if not gb > 0:
            raise ValueError(f"--gb={gb}: the model size must be > 0 GB")
        chosen = plan(max(1, round((gb * 1e9 - fixed) / per_layer)))
    else:
        chosen = one
        n = 2
        while True:
            nxt = plan(n)
            if problems(nxt):
                break
            chosen, n = nxt, n + 1
    bad = problems(chosen)
    if bad:
        raise SystemExit(
            f"--real-shapes: {chosen['moe_layers']} MoE layer(s) ({chosen['bytes'] / 1e9:.1f} GB) do not fit: "
            + "; ".join(bad)
            + (" (use a smaller --gb)" if gb is not None and chosen["moe_layers"] > 1 else "")
        )
    return chosen


def host_available_bytes() -> int:
    """MemAvailable of /proc/meminfo in bytes (0 when unreadable)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def build_model(seed: int, dtype: torch.dtype, device: str, ep_rank: int | None = None, ep_size: int = 1, cfg=None):
    """The synthetic model (``cfg``, default ``synthetic_config()``) in ``dtype`` (router fp32) with
    cheap random weights U(-0.02, 0.02) from ``seed``, no fp32 init pass, on ``device``."""
    cfg = cfg if cfg is not None else synthetic_config()
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
        works.append(group.broadcast(bufs[k % 2][: b.wire_bytes], async_op=True))
        if len(works) > 2:
            group.wait(works.pop(0))
    for w in works:
        group.wait(w)
    _sync(device)
    return time.perf_counter() - t0


def _rank_main(rank: int, args, port: int, results) -> None:
    try:
        torch.set_num_threads(args.threads or 1)
        dtype = getattr(torch, args.dtype)
        device = _device(args.backend, rank)
        world = 1 + args.receivers
        bucket_bytes = int(args.bucket_mb * 2**20)
        cfg = real_shapes_config(args.moe_layers) if args.real_shapes else synthetic_config(args.gb, dtype)
        if rank == 0:
            model = build_model(1, dtype, device, cfg=cfg)
        else:
            ep_size = args.receivers if args.ep else 1
            model = build_model(0, dtype, device, rank - 1, ep_size, cfg=cfg)
        group = WeightSyncGroup("127.0.0.1", port, rank, world, args.backend, timeout_s=600, device=device)
        named = list(iter_released_tensors(model)) if rank == 0 else None
        entries = [(tuple(t.shape), t.dtype) for _, t in named] if rank == 0 else None
        # every rank needs the plan for the raw baseline: rank 0 computes it and ships it
        plan = plan_buckets(group.exchange_objects(entries)[0], bucket_bytes)
        total = sum(b.data_bytes for b in plan)
        out = {"rank": rank, "bytes": total, "buckets": len(plan)}
        if rank == 0:
            source = ReleasedTensors(model)  # what Policy.named_released_tensors gives
            sender = WeightSender(lambda: source, BroadcastChannel(group, True), args.bucket_mb, None)
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
            out[mode] = {
                "seconds": statistics.median(times[mode]),
                "pause": statistics.median(times[mode]),
                "all": times[mode],
            }
        results.put(out)
        group.close()
    except Exception:  # noqa: BLE001
        results.put({"rank": rank, "error": traceback.format_exc()})


# ---------------------------------------------------------------------------- colocated (one device)
DIRECT_MODES = (
    "direct atomic=false, attested",
    "direct atomic=true, attested",
    "direct atomic=false, check pass",
    "direct atomic=true, check pass",
)
COLOCATED_MODES = (
    "raw flat copy",
    "raw copy_ per parameter",
    "raw bucket copies",
    *DIRECT_MODES,
    "atomic=false, buckets",
    "atomic=true, buckets",
)
# the trainer's cast fp32 masters -> bf16 copy (once per optimizer step, not part of a refit)
CAST_MODES = ("trainer cast: fused copy + flags (CastCopy)", "trainer cast: copy_ per parameter (before)")


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as a flat uint8 tensor (bitwise comparison: -0.0 != 0.0, NaN payloads kept)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def sync_mismatches(trainer: torch.nn.Module, rollout) -> list[str]:
    """Names of the rollout parameters whose bytes differ from the trainer's same-named parameter
    (shape or dtype differences count too). [] = bitwise equal. ``rollout``: a module with the
    same parameter names (the same config, no EP slicing) or a {name: tensor} dict of them (an
    IPC worker's parameters, shared back by handle)."""
    t_params = dict(trainer.named_parameters())
    bad = []
    items = rollout.items() if isinstance(rollout, dict) else rollout.named_parameters()
    for name, p in items:
        q = t_params.get(name)
        if q is None or q.shape != p.shape or q.dtype != p.dtype or not torch.equal(_bits(p), _bits(q)):
            bad.append(name)
    return bad


def _scramble(model: torch.nn.Module, seed: int) -> None:
    """Overwrite every parameter in place with U(-0.5, 0.5) from ``seed`` (differs from the
    U(-0.02, 0.02) weights of ``build_model``, so an update that skips a tensor is caught)."""
    dev = next(model.parameters()).device
    g = torch.Generator(device=dev).manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.uniform_(-0.5, 0.5, generator=g)


def trainer_pair(cfg, dtype: torch.dtype, device: str):
    """The trainer as ``Policy`` holds it at ``policy.precision=bfloat16``: fp32 masters (seed 1),
    their ``dtype`` compute copy and the ``CastCopy`` between them, refreshed once."""
    master = build_model(1, torch.float32, device, cfg=cfg)
    compute = build_model(2, dtype, device, cfg=cfg)
    cast = CastCopy(master, compute)
    cast.refresh()
    return master, cast


def run_colocated(cast: CastCopy, rollout: torch.nn.Module, bucket_mb: float, repeats: int, log=None) -> dict:
    """Time colocated full updates trainer -> ``rollout`` (one device) against raw copies of the
    same bytes, then check correctness. Leaves ``rollout`` equal to the trainer's copy.

    Args:
        cast: the trainer (``trainer_pair``): ``cast.master`` fp32 masters, ``cast.copy`` their
            compute copy in the rollout's dtypes (the bytes every mode moves).
        rollout: M3ForCausalLM with the same config and dtypes on the same device (EP=1).
        bucket_mb: weight_sync.bucket_size_mb of the ``..., buckets`` modes.
        repeats: timed repeats per mode (after one warm-up), modes interleaved.
        log: optional callable(str) for progress lines.
    Returns:
        dict with ``bytes`` (update bytes = every parameter incl. frozen ones), ``buckets`` (of the
        ``..., buckets`` modes), ``tensors`` (released tensors sent), ``seconds`` {mode: median
        wall s} over COLOCATED_MODES + CAST_MODES, ``host`` {direct mode: median s until
        ``update`` returned (the rest is device time)}, ``all`` {mode: [s]}, ``checks`` {direct
        mode, and "cast": {"mismatched_before": int (> 0 or the check proves nothing),
        "mismatched": [names], "moved": [names whose data_ptr changed], "version",
        "expected_version", "valid", "verdict" (how the receiver validated), "ok"}}.
    Raises ValueError when the models do not share one device.
    """
    master, trainer = cast.master, cast.copy
    dev = next(trainer.parameters()).device
    if next(rollout.parameters()).device != dev:
        raise ValueError(
            f"colocated: trainer on {dev} but rollout on {next(rollout.parameters()).device}; "
            "put both on the same device"
        )
    dtype = trainer.lm_head.weight.dtype
    t_params = [p.detach() for p in trainer.parameters()]
    r_params = [p.detach() for p in rollout.parameters()]
    m_params = [p.detach() for p in master.parameters()]
    total = sum(p.numel() * p.element_size() for p in t_params)
    # raw flat copy: one buffer of the same bytes copied into another (allocated once, outside timing)
    flat_src = torch.empty(total, dtype=torch.uint8, device=dev)
    flat_dst = torch.empty_like(flat_src)
    flat_src.fill_(1)
    flat_dst.fill_(0)
    fused_cast = CopyPlan(r_params, m_params)  # CastCopy's pass, written into the rollout (no attestation moves)

    # one receiver per source list, so each keeps its cached plan (both write the same rollout)
    rx_att = WeightReceiver(rollout, atomic=False)
    rx_chk = WeightReceiver(rollout, atomic=False)
    named = ReleasedTensors(master, cast=cast)  # what Policy.named_released_tensors gives
    attested = WeightSender(lambda: named, ColocatedChannel([rx_att], dev, direct=True), bucket_mb, dtype)
    checked = WeightSender(lambda: cast.released, ColocatedChannel([rx_chk], dev, direct=True), bucket_mb, dtype)
    # the compute copy's ReleasedTensors (as Policy hands them over): resolved once, not per update
    bucketed = WeightSender(lambda: cast.released, ColocatedChannel([rx_chk], dev, direct=False), bucket_mb, None)
    for s in (attested, checked, bucketed):
        s.handshake()
    # raw bucket copies: the same wire buckets through a ring of three slot pairs (outside timing)
    plan = plan_buckets([(tuple(t.shape), t.dtype) for _, t in iter_released_tensors(trainer)], int(bucket_mb * 2**20))
    wire = max(b.wire_bytes for b in plan)
    ring_src = [torch.ones(wire, dtype=torch.uint8, device=dev) for _ in range(3)]
    ring_dst = [torch.zeros(wire, dtype=torch.uint8, device=dev) for _ in range(3)]
    ptrs = {n: p.data_ptr() for n, p in rollout.named_parameters()}
    version = 0

    def update(mode: str) -> WeightReceiver:
        nonlocal version
        version += 1
        if mode.endswith("buckets"):
            sender, rx = bucketed, rx_chk
        else:
            sender, rx = (attested, rx_att) if mode.endswith("attested") else (checked, rx_chk)
        rx.atomic = "atomic=true" in mode
        sender.update(version, include_frozen=True)  # raises WeightUpdateError
        return rx

    host: dict[str, list[float]] = {m: [] for m in DIRECT_MODES}

    def timed(mode: str) -> tuple[float, float]:
        """(wall seconds, seconds until the host was done: ``update`` returned)."""
        _sync(str(dev))
        t0 = time.perf_counter()
        t_host = None
        with torch.no_grad():
            if mode == "raw copy_ per parameter":
                for d, src in zip(r_params, t_params):
                    d.copy_(src)
            elif mode == "raw flat copy":
                flat_dst.copy_(flat_src)
            elif mode == "raw bucket copies":
                for k, b in enumerate(plan):
                    ring_dst[k % 3][: b.wire_bytes].copy_(ring_src[k % 3][: b.wire_bytes])
            elif mode == CAST_MODES[0]:
                fused_cast.copy_check()
            elif mode == CAST_MODES[1]:
                for d, src in zip(r_params, m_params):
                    d.copy_(src)
            else:
                update(mode)
                t_host = time.perf_counter() - t0
        _sync(str(dev))
        return time.perf_counter() - t0, t_host

    modes = COLOCATED_MODES + CAST_MODES
    times: dict[str, list[float]] = {m: [] for m in modes}
    for rep in range(repeats + 1):  # rep 0 = warm-up (allocations, stage pinning, kernels)
        for mode in modes:
            dt, t_host = timed(mode)
            if rep > 0:
                times[mode].append(dt)
                if mode in host:
                    host[mode].append(t_host)
            if log is not None:
                log(f"repeat {rep}{' (warm-up)' if rep == 0 else ''}: {mode} {dt:.4f} s")
    stats = dict(bucketed.stats)
    del flat_src, flat_dst, ring_src, ring_dst

    syncs, sync_sites = {}, {}
    # the first update of a mode after the other mode (the receiver alternates modes and paths in
    # the timing loop), then a steady one; every sync with the line that made it
    first = " (first after atomic={})"
    if dev.type == "cuda":
        update("atomic=true, buckets")
    for mode, other in (("atomic=false, buckets", "true"), ("atomic=true, buckets", "false")):
        for label in (mode + first.format(other), mode):
            syncs[label] = None
            if dev.type == "cuda":
                syncs[label], sync_sites[label] = count_syncs(lambda m=mode: update(m), str(dev))

    checks = {}
    for k, mode in enumerate(DIRECT_MODES + ("atomic=false, buckets", "atomic=true, buckets")):
        _scramble(rollout, 1000 + k)
        before = len(sync_mismatches(trainer, rollout))
        rx = update(mode)
        _sync(str(dev))
        bad = sync_mismatches(trainer, rollout)
        moved = [n for n, p in rollout.named_parameters() if p.data_ptr() != ptrs[n]]
        want = "attested" if mode.endswith("attested") else "checked"
        verdict_ok = mode.endswith("buckets") or rx.last_verdict == want
        checks[mode] = {
            "mismatched_before": before,
            "mismatched": bad,
            "moved": moved,
            "version": rx.version,
            "expected_version": version,
            "valid": rx.valid,
            "verdict": rx.last_verdict,
            "ok": before > 0 and not bad and not moved and rx.version == version and rx.valid and verdict_ok,
        }
    # the copy the attested modes send is the masters' cast, bit for bit (torch's rounding)
    m = dict(master.named_parameters())
    bad = [n for n, p in trainer.named_parameters() if not torch.equal(_bits(p), _bits(m[n].to(p.dtype)))]
    checks["cast"] = {
        "mismatched_before": len(m),
        "mismatched": bad,
        "moved": [],
        "version": 0,
        "expected_version": 0,
        "valid": True,
        "verdict": "",
        "ok": not bad,
    }
    return {
        "bytes": total,
        "buckets": stats.get("buckets", 0),
        "tensors": len(attested.manifest or []),
        "seconds": {m: statistics.median(v) for m, v in times.items()},
        "host": {m: statistics.median(v) for m, v in host.items()},
        "all": times,
        "checks": checks,
        "syncs": syncs,
        "sync_sites": sync_sites,
    }


def count_syncs(fn, device: str) -> tuple[int, list[str]]:
    """(synchronizing CUDA calls made by ``fn()``, where each was made: 'file:line' of the Python
    line that called into torch), by torch.cuda.set_sync_debug_mode("warn")."""
    _sync(device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    sites = [f"{os.path.relpath(w.filename, ROOT)}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)]
    return len(sites), sites


def _colocated_device(name: str) -> torch.device:
    dev = torch.device(name)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit(f"--device {name}: CUDA is not available on this machine; use --device cpu")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(dev)
    elif dev.type != "cpu":
        raise SystemExit(f"--device {name}: use cpu or cuda[:N]")
    return dev


# ---------------------------------------------------------------------------- copy-plan kernel sweep
def _event_ms(fn, repeats: int) -> float:
    """Median device milliseconds of ``fn()`` over ``repeats`` runs (CUDA events), after one warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def run_kernel_sweep(cast: CastCopy, rollout: torch.nn.Module, variants: list[str], repeats: int, log=None) -> dict:
    """Time every copy-plan variant on the refit's own pairs (``cast.copy``'s released tensors into
    ``rollout``'s views, the receiver's plan) against a flat copy of the same bytes, each variant
    next to its own flat-copy figure. Modes: copy (the attested refit, the IPC worker), check
    (the fallback's validation pass: reads only), cast (CastCopy's copy + check from the fp32
    masters). Plus ``torch._foreach_copy_`` over the same runs as a reference.

    Returns {"bytes": update bytes, "tensors", "runs" (of the plan), "flat_ms": median, "rows":
    {variant: {"copy_ms", "check_ms", "cast_ms", "flat_ms"}}, "foreach_ms": float}. CUDA only."""
    rx = WeightReceiver(rollout)
    src = dict(cast.released)
    pairs = [(v, src[n]) for n, v in rx.views.items() if v is not None]
    dsts, srcs = [d for d, _ in pairs], [s for _, s in pairs]
    c_params = [p.detach() for p in cast.copy.parameters()]
    m_params = [p.detach() for p in cast.master.parameters()]
    total = sum(d.numel() * d.element_size() for d in dsts)
    flat_src = torch.ones(total, dtype=torch.uint8, device=dsts[0].device)
    flat_dst = torch.zeros_like(flat_src)
    rows, flats = {}, []
    for name in variants:
        plan = CopyPlan(dsts, srcs, config=name)
        cast_plan = CopyPlan(c_params, m_params, config=name)
        row = {
            "flat_ms": _event_ms(lambda: flat_dst.copy_(flat_src), repeats),
            "copy_ms": _event_ms(plan.copy, repeats),
            "check_ms": _event_ms(plan.check, repeats),
            "cast_ms": _event_ms(cast_plan.copy_check, repeats),
        }
        assert not plan.any_bad() and not cast_plan.any_bad(), "the sweep's weights are finite"
        rows[name] = row
        flats.append(row["flat_ms"])
        if log is not None:
            log(f"sweep {name}: " + ", ".join(f"{k} {v:.3f}" for k, v in row.items()))
        del plan, cast_plan  # (the casts rewrote the copy with the bits it held: same masters, same rounding)
    ref = CopyPlan(dsts, srcs)
    run_dsts, run_srcs = [r.dst for r in ref.runs], [r.src for r in ref.runs]
    foreach = _event_ms(lambda: torch._foreach_copy_(run_dsts, run_srcs), repeats)
    return {
        "bytes": total,
        "tensors": len(pairs),
        "runs": len(ref.runs),
        "flat_ms": statistics.median(flats),
        "rows": rows,
        "foreach_ms": foreach,
    }


def sweep_report(sw: dict, cfg) -> str:
    """The markdown section of ``run_kernel_sweep``: bandwidth = bytes read + written per second,
    ratio = that over the flat copy's (the check pass reads only, the cast reads 4 B and writes 2 B
    per bf16 element)."""
    gb = sw["bytes"] / 1e9
    head = (
        f"## Copy-plan kernel sweep (bench_weight_sync.py --sweep-kernel), {run_date()}, {machine('cuda')}, "
        f"torch {torch.__version__}\n\n"
        f"The refit's own pairs: {gb:.3f} GB, {sw['tensors']} released tensors in {sw['runs']} runs of an M3-shaped "
        f"model ({cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}); device time (CUDA events), median, "
        f"each variant beside its own flat copy of the same bytes (median flat copy {sw['flat_ms']:.3f} ms = "
        f"{2e3 * gb / sw['flat_ms']:.0f} GB/s read + written). x = achieved bandwidth / the flat copy's. copy: the "
        "attested refit and the IPC worker; check: the fallback's validation pass (reads only); cast: CastCopy's "
        "fp32 -> bf16 copy + flags (reads 4 B, writes 2 B per element). Variants: copy_plan.KERNELS.\n\n"
        "| variant | copy ms | copy x | check ms | check x | cast ms | cast x |\n|---|---|---|---|---|---|---|\n"
    )
    body = ""
    for name, r in sw["rows"].items():
        f = r["flat_ms"]
        body += (
            f"| {name}{' (default)' if name == copy_plan.DEFAULT_KERNEL else ''} | {r['copy_ms']:.3f} | "
            f"{f / r['copy_ms']:.2f} | {r['check_ms']:.3f} | {f / (2 * r['check_ms']):.2f} | {r['cast_ms']:.3f} | "
            f"{1.5 * f / r['cast_ms']:.2f} |\n"
        )
    body += f"| torch._foreach_copy_ over the runs (reference) | {sw['foreach_ms']:.3f} | "
    body += f"{sw['flat_ms'] / sw['foreach_ms']:.2f} | | | | |\n"
    return head + body


def best_variant(sw: dict) -> str:
    """The variant with the best copy ratio (the refit's hot path)."""
    return max(sw["rows"], key=lambda n: sw["rows"][n]["flat_ms"] / sw["rows"][n]["copy_ms"])


# ---------------------------------------------------------------------------- IPC (two processes)
# (source, atomic) of the IPC rows: the worker reads the trainer's compute copy (one device copy per
# update), or the stage the trainer fills first (the fallback: two); the worker alternates atomic
IPC_MODES = ("copy, atomic=false", "copy, atomic=true", "stage, atomic=false", "stage, atomic=true")


def _ipc_worker(endpoint, cfg, dtype: torch.dtype, device: str, kernel: str, params_q, done, results) -> None:
    """Rollout worker of ``run_ipc``: its own rollout copy on ``device`` (the trainer's), refit
    through ``IpcRolloutSync`` with copy-plan variant ``kernel``; alternates atomic=false (odd
    versions) / atomic=true (even). At the trainer's close it shares its parameters back by
    handle (``params_q``), waits for ``done`` and reports per-update figures by value."""
    try:
        copy_plan.DEFAULT_KERNEL = kernel
        if device.startswith("cuda"):
            torch.cuda.set_device(device)
        torch.set_num_threads(1)
        model = build_model(0, dtype, device, cfg=cfg)
        rx = WeightReceiver(model, atomic=False, version=0)
        ptrs = [p.data_ptr() for p in model.parameters()]
        log = []

        def on_update(outcome) -> None:
            r = outcome.result
            log.append(
                {"version": r.version, "ok": r.ok, "atomic": rx.atomic, "seconds": r.seconds, "errors": r.errors}
            )
            rx.atomic = (r.version + 1) % 2 == 0

        IpcRolloutSync(rx, endpoint, timeout_s=600).serve(on_update)
        moved = [p.data_ptr() for p in model.parameters()] != ptrs
        params_q.put({n: p.detach() for n, p in model.named_parameters()})
        done.wait(600)
        results.put({"log": log, "moved": moved, "version": rx.version})
    except Exception:  # noqa: BLE001
        results.put({"error": traceback.format_exc()})


def run_ipc(cast: CastCopy, cfg, repeats: int, log=None) -> dict:
    """Time IPC updates (weight_sync/ipc.py) from the trainer (``trainer_pair``: the sender sends
    its attested compute copy) to a rollout worker PROCESS on the same device, from both sources
    (``IPC_MODES``: the worker reads the compute copy itself, or the stage the trainer fills, the
    channel's ``share_copy`` switched between updates), then check its weights bitwise against the
    trainer's cast (shared back by handle).

    Returns {"seconds": {mode: median whole update s (trainer side: flags / fill + worker refit +
    acks)}, "fill": {mode: median trainer s before the workers are told (copy: the cast's flags
    and its completion; stage: the fill)}, "refit": {mode: median worker receive-to-finish s},
    "sources": {mode: the source the channel reported}, "ok": bool, "mismatched": [names],
    "moved": bool (a worker data_ptr changed)}. Raises RuntimeError with the worker's traceback
    when it fails.
    """
    master, trainer = cast.master, cast.copy
    dev = next(trainer.parameters()).device
    dtype = trainer.lm_head.weight.dtype
    ctx = mp.get_context("spawn")
    params_q, results, done = ctx.Queue(), ctx.Queue(), ctx.Event()
    channel = IpcChannel(1, dev, timeout_s=600, share_copy=True)
    args = (channel.endpoint, cfg, dtype, str(dev), copy_plan.DEFAULT_KERNEL, params_q, done, results)
    proc = ctx.Process(target=_ipc_worker, args=args)
    proc.start()
    named = ReleasedTensors(master, cast=cast)
    sender = WeightSender(lambda: named, channel, 512, dtype)
    times = {m: [] for m in IPC_MODES}
    fills = {m: [] for m in IPC_MODES}
    sources = {}
    version = 0
    try:
        for rep in range(repeats + 1):
            for mode in IPC_MODES:  # the worker alternates atomic=false / atomic=true by version
                version += 1
                channel.share_copy = mode.startswith("copy")
                _sync(str(dev))
                t0 = time.perf_counter()
                sender.update(version, include_frozen=True)
                _sync(str(dev))
                dt = time.perf_counter() - t0
                sources[mode] = channel.stats["source"]
                if rep > 0:
                    times[mode].append(dt)
                    fills[mode].append(channel.stats["fill_seconds"])
                if log is not None:
                    log(f"ipc repeat {rep}{' (warm-up)' if rep == 0 else ''}: {mode} {dt:.4f} s ({sources[mode]})")
        _scramble(master, 4242)  # new masters: the sender re-casts, the worker is checked bitwise
        version += 1
        channel.share_copy = True
        sender.update(version, include_frozen=True)
        channel.close()
        try:
            shared = params_q.get(timeout=600)
            mismatched = sync_mismatches(trainer, shared)
            del shared
        finally:
            done.set()
        got = results.get(timeout=600)
    finally:
        done.set()
        proc.join(600)
        if proc.is_alive():
            proc.kill()
    if "error" in got:
        raise RuntimeError(f"IPC worker failed:\n{got['error']}")
    refit = {m: [] for m in IPC_MODES}
    for i, e in enumerate(got["log"][len(IPC_MODES) : -1]):  # skip the warm-up round and the final checked update
        refit[IPC_MODES[i % len(IPC_MODES)]].append(e["seconds"])
    expected = {m: m.split(",")[0] for m in IPC_MODES}
    return {
        "seconds": {m: statistics.median(v) for m, v in times.items()},
        "fill": {m: statistics.median(v) for m, v in fills.items()},
        "refit": {m: statistics.median(v) for m, v in refit.items()},
        "sources": sources,
        "ok": not mismatched
        and not got["moved"]
        and got["version"] == version
        and all(e["ok"] for e in got["log"])
        and sources == expected,
        "mismatched": mismatched,
        "moved": got["moved"],
    }


def colocated_report(r: dict, ipc: dict | None, cfg, args, device_type: str) -> str:
    """The markdown section of a colocated run (``run_colocated`` + optional ``run_ipc``)."""
    gb = r["bytes"] / 1e9
    flat = r["seconds"]["raw flat copy"]
    now = f"{run_date()} {datetime.datetime.now().strftime('%H:%M')}"
    where = f"{machine(device_type)}, torch {torch.__version__}"
    stand_in = r["seconds"]["raw bucket copies"]
    rows = [(m, r["seconds"][m], r["host"].get(m)) for m in COLOCATED_MODES]
    if ipc is not None:
        for m in IPC_MODES:
            src = m.split(",")[0]
            before = "the cast's flags + its completion" if src == "copy" else "fill: copy + flags into the stage"
            rows.append((f"ipc {m}, two processes: whole update", ipc["seconds"][m], None))
            rows.append((f"ipc {m}: trainer, before the worker reads ({before})", ipc["fill"][m], None))
            rows.append((f"ipc {m}: worker refit ({src} -> parameters)", ipc["refit"][m], None))
    head = (
        f"## Weight sync, colocated refit (bench_weight_sync.py --method colocated), {now}, {where}, "
        f"{device_type}, copy-plan kernel {copy_plan.DEFAULT_KERNEL}\n\n"
        f"Synthetic M3-shaped model ({cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
        f"{cfg.num_local_experts} experts): {gb:.3f} GB in {args.dtype} (router fp32), {r['tensors']} released "
        f"tensors; trainer (fp32 masters + their {args.dtype} compute copy, as Policy at policy.precision="
        f"{args.dtype}) and rollout on one {device_type} device. 'direct ..., attested': WeightSender("
        "Policy-style ReleasedTensors with its CastCopy) + ColocatedChannel + WeightReceiver: the compute copy is "
        "sent, validated from the flags of the cast that wrote it (one 4-byte read), then one fused copy pass; "
        "'direct ..., check pass': the same bytes without the attestation (check pass, then copy pass); "
        f"'..., buckets': the bucketed broadcast pipeline in loopback ({r['buckets']} buckets of "
        f"<= {args.bucket_mb:g} MiB; sender packs on its side stream into a ring of 3 wire buffers, a "
        "device-to-device copy on a transfer stream stands in for the NCCL broadcast, the receiver checksums, "
        "flags non-finite values and unpacks on its own side stream, one host read of the verdict per update; "
        "atomic stages in pinned host memory and commits after the verdict); 'raw bucket copies': that "
        "stand-in transfer alone (the same buckets, one device copy each); 'ipc': a rollout worker process on "
        "the same device (weight_sync/ipc.py) refit from the trainer's attested compute copy itself ('copy': "
        "opened once by CUDA IPC handle, validated from the cast's flags, one device copy per update) or from "
        "the stage the trainer fills from that copy first ('stage', the fallback: two copies). host ms = until "
        f"update() returned (the rest is device time). Median of {args.repeats} repeats after a warm-up; "
        "ratios = GB/s over the raw flat copy's and, for the bucket rows, over the raw bucket copies'.\n\n"
        "| mode | seconds | host ms | GB/s | vs raw flat copy | vs raw bucket copies |\n"
        "|---|---|---|---|---|---|\n"
    )
    body = "".join(
        f"| {m} | {t:.4f} | {'' if h is None else f'{h * 1e3:.2f}'} | {gb / t:.1f} | {flat / t:.2f} | "
        + (f"{stand_in / t:.2f}" if m.endswith("buckets") else "-")
        + " |\n"
        for m, t, h in rows
    )
    # the trainer's cast moves 6 bytes per bf16 element (reads fp32, writes bf16): 1.5x the flat copy's
    body += "\nThe trainer's cast of its masters (once per optimizer step, not part of a refit; x = read + write "
    body += "bandwidth over the flat copy's):\n\n| cast | seconds | x flat copy |\n|---|---|---|\n"
    body += "".join(f"| {m} | {r['seconds'][m]:.4f} | {1.5 * flat / r['seconds'][m]:.2f} |\n" for m in CAST_MODES)
    n_params = r["n_params"]
    checks = "; ".join(
        f"{m}: {'pass' if c['ok'] else 'FAIL'} ({len(c['mismatched'])} of {n_params} parameters differ after the "
        f"update, {c['mismatched_before']} before; data_ptr moved: {len(c['moved'])}; version "
        f"{c['version']}/{c['expected_version']}, valid={c['valid']}"
        + (f", verdict {c['verdict']})" if c["verdict"] else ")")
        for m, c in r["checks"].items()
        if m != "cast"
    )
    c = r["checks"]["cast"]
    checks += (
        f"; compute copy = torch cast of the masters: {'pass' if c['ok'] else 'FAIL'} ({len(c['mismatched'])} differ)"
    )
    if ipc is not None:
        checks += (
            f"; ipc: {'pass' if ipc['ok'] else 'FAIL'} ({len(ipc['mismatched'])} of {n_params} worker parameters "
            f"differ from the trainer's after the last update; data_ptr moved: {ipc['moved']})"
        )
    syncs = ""
    if any(v is not None for v in r.get("syncs", {}).values()):
        sites = r.get("sync_sites", {})

        def where(m: str) -> str:
            return f" ({', '.join(sites[m])})" if sites.get(m) else ""

        syncs = (
            "\nSynchronizing CUDA calls in one bucketed update (torch.cuda.set_sync_debug_mode('warn'), with "
            "the line that made each; the pipeline's one is the verdict read, weight_sync/unpack.py "
            "read_verdict): " + ", ".join(f"{m}: {v}{where(m)}" for m, v in r["syncs"].items()) + ".\n"
        )
    return head + body + "\nCorrectness (bitwise): " + checks + ".\n" + syncs


def main_colocated(args) -> None:
    """--method colocated: trainer and rollout in this process on --device (plus an IPC worker
    process unless --no-ipc; first the kernel sweep with --sweep-kernel); prints (and appends)
    the tables."""
    dev = _colocated_device(args.device or "cpu")
    if args.threads or dev.type == "cpu":
        torch.set_num_threads(args.threads or 1)
    if args.sweep_kernel and dev.type != "cuda":
        raise SystemExit("--sweep-kernel times the Triton kernel: it needs --device cuda")
    if args.kernel == "best" and not args.sweep_kernel:
        raise SystemExit("--kernel best picks the sweep's fastest variant: add --sweep-kernel")
    if args.kernel not in ("best", *copy_plan.KERNELS):
        raise SystemExit(f"--kernel {args.kernel}: one of best, {', '.join(copy_plan.KERNELS)}")
    dtype = getattr(torch, args.dtype)
    gb = args.gb if args.gb is not None or dev.type != "cuda" else 8.0  # real M3-shaped size on a GPU
    cfg = synthetic_config(gb, dtype)
    t_start = time.perf_counter()
    log = lambda m: print(f"[{time.perf_counter() - t_start:6.1f} s] {m}", flush=True)  # noqa: E731
    master, cast = trainer_pair(cfg, dtype, str(dev))
    rollout = build_model(0, dtype, str(dev), cfg=cfg)
    texts = []
    if args.sweep_kernel:
        variants = list(copy_plan.KERNELS) if not args.variants else args.variants.split(",")
        sw = run_kernel_sweep(cast, rollout, variants, max(args.repeats, 5), log=log)
        texts.append(sweep_report(sw, cfg))
        print(texts[-1])
        if args.kernel == "best":
            args.kernel = best_variant(sw)
            log(f"best copy variant: {args.kernel}")
    copy_plan.DEFAULT_KERNEL = args.kernel if args.kernel != "best" else copy_plan.DEFAULT_KERNEL
    cast = CastCopy(master, cast.copy)  # its plan in the chosen variant
    cast.refresh()
    r = run_colocated(cast, rollout, args.bucket_mb, args.repeats, log=log)
    r["n_params"] = len(list(rollout.parameters()))
    del rollout
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    ipc = None if args.no_ipc else run_ipc(cast, cfg, args.repeats, log=log)
    texts.append(colocated_report(r, ipc, cfg, args, dev.type))
    print(texts[-1])
    log("done")
    ok = all(c["ok"] for c in r["checks"].values()) and (ipc is None or ipc["ok"])
    if not ok:
        for m, c in r["checks"].items():
            if not c["ok"]:
                print(
                    f"{m}: mismatched {c['mismatched'][:8]}, moved {c['moved'][:8]}, verdict {c['verdict']}",
                    file=sys.stderr,
                )
        if ipc is not None and not ipc["ok"]:
            print(f"ipc: mismatched {ipc['mismatched'][:8]}, moved {ipc['moved']}", file=sys.stderr)
        raise SystemExit("colocated weight sync correctness check FAILED; nothing written to docs/benchmarks.md")
    for text in texts:
        _append(args, text)


def _append(args, text: str) -> None:
    """Append a section to --write PATH (default docs/benchmarks.md) unless --no-write."""
    if args.no_write:
        return
    path = args.write or os.path.join(ROOT, "docs", "benchmarks.md")
    with open(path, "a") as f:
        f.write("\n" + text)
    print(f"appended to {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--method",
        choices=("broadcast", "colocated"),
        default="broadcast",
        help="weight_sync.method: broadcast = trainer + rollout processes over a group; "
        "colocated = both copies in one process on --device",
    )
    ap.add_argument(
        "--device",
        default=None,
        help="colocated only: cpu (default) or cuda[:N]; broadcast picks devices from --backend",
    )
    ap.add_argument(
        "--gb",
        type=float,
        default=None,
        help="synthetic model size in GB (1e9 bytes) of --dtype; default: 8 for --method colocated on a GPU "
        "(a real M3-shaped refit), else the 1.016 GB bf16 model; with --real-shapes: the MoE layer count closest "
        "to it (default: the largest that fits)",
    )
    ap.add_argument(
        "--real-shapes",
        action="store_true",
        help="broadcast over nccl: M3 at the released layer shapes (1 dense + N MoE layers of 128 experts); "
        "N from --gb, else the largest that fits",
    )
    ap.add_argument("--backend", choices=("gloo", "nccl"), default="gloo", help="broadcast only")
    ap.add_argument("--receivers", type=int, default=1, help="broadcast only")
    ap.add_argument("--ep", action="store_true", help="broadcast only: rollout ranks hold EP slices of the experts")
    ap.add_argument("--bucket-mb", type=float, default=64.0)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads per process (default 1; colocated on CUDA: torch's default)",
    )
    ap.add_argument(
        "--write",
        default=None,
        metavar="PATH",
        help="append the markdown section to PATH instead of docs/benchmarks.md (e.g. $OUT/ws.md)",
    )
    ap.add_argument("--no-write", action="store_true", help="print only; append nothing")
    ap.add_argument(
        "--no-ipc", action="store_true", help="colocated only: skip the two-process IPC refit (a spawned worker)"
    )
    ap.add_argument(
        "--sweep-kernel",
        action="store_true",
        help="colocated on CUDA: first time every copy-plan kernel variant (copy_plan.KERNELS) against a flat "
        "copy on the refit's own pairs, print and append the table",
    )
    ap.add_argument("--variants", default=None, help="--sweep-kernel: comma-separated variant names (default all)")
    ap.add_argument(
        "--kernel",
        default=copy_plan.DEFAULT_KERNEL,
        help="colocated: the copy-plan variant every plan of the run uses (a copy_plan.KERNELS name, or best = "
        "the sweep's fastest copy; default copy_plan.DEFAULT_KERNEL)",
    )
    args = ap.parse_args()
    args.moe_layers = None
    if args.real_shapes and (args.method != "broadcast" or args.backend != "nccl"):
        ap.error("--real-shapes is for --method broadcast --backend nccl (one GPU per rank; ~14.8 GB per MoE layer)")
    if args.method == "colocated":
        if args.receivers != 1 or args.ep or args.backend != "gloo":
            ap.error("--receivers/--ep/--backend are for --method broadcast; colocated runs one rollout copy")
        main_colocated(args)
        return
    if args.no_ipc or args.sweep_kernel:
        ap.error("--no-ipc / --sweep-kernel are for --method colocated")
    if args.device is not None:
        ap.error("--device is for --method colocated; broadcast picks devices from --backend (nccl = cuda:rank)")
    from m3_rollout.parallel import free_port

    if args.backend == "nccl":
        n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n_gpus < 1 + args.receivers:
            raise SystemExit(
                f"--backend nccl with --receivers {args.receivers} needs {1 + args.receivers} GPUs "
                f"(trainer on cuda:0, receiver r on cuda:r); found {n_gpus}"
            )
    if args.real_shapes:
        free = [torch.cuda.mem_get_info(i)[0] for i in range(1 + args.receivers)]
        dtype = getattr(torch, args.dtype)
        plan = real_shapes_plan(
            args.gb, free, host_available_bytes(), args.receivers, args.ep, int(args.bucket_mb * 2**20), dtype
        )
        args.moe_layers = plan["moe_layers"]
        print(
            f"--real-shapes: {plan['moe_layers']} MoE layer(s), {plan['bytes'] / 1e9:.1f} GB "
            f"({'the largest that fits' if args.gb is None else f'closest to --gb {args.gb:g}'}); GPU free "
            + ", ".join(f"{f / GIB:.0f}" for f in free)
            + f" GiB; host available {host_available_bytes() / GIB:.0f} GiB",
            flush=True,
        )

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
    where = machine("cpu" if args.backend == "gloo" else "cuda")
    if args.real_shapes:
        model = (
            f"M3 at the released layer shapes (--real-shapes: 1 dense + {args.moe_layers} MoE layers of 128 experts "
            f"of width 3072, hidden 6144, 64 q / 4 KV heads, vocabulary 32768; "
            f"{'the largest that fits' if args.gb is None else f'--gb {args.gb:g}'})"
        )
    else:
        model = "Synthetic M3-shaped model"
    head = (
        f"## Weight sync (bench_weight_sync.py), {run_date()}, {where}, {args.backend}\n\n"
        f"{model}: {gb:.3f} GB in {args.dtype} (router fp32), {got[0]['buckets']} buckets of "
        f"<= {args.bucket_mb:g} MiB, {args.receivers} rollout rank(s){' (EP slices)' if args.ep else ''}, "
        f"median of {args.repeats} interleaved repeats after a warm-up, torch threads per process = "
        f"{args.threads or 1}.\n\n"
        "| rank | mode | seconds | GB/s per receiving rank | vs raw broadcast | pause (s) |\n"
        "|---|---|---|---|---|---|\n"
    )
    body = "".join(f"| {rk} | {m} | {s:.3f} | {g:.3f} | {x:.2f} | {p:.3f} |\n" for rk, m, s, g, x, p in rows)
    text = head + body
    print(text)
    _append(args, text)


if __name__ == "__main__":
    main()

"""Expert-parallel MoE step cost: dispatch / combine time vs expert compute, EP=1 vs EP=2.

    python scripts/bench_ep.py [--tokens 16 128 1024] [--steps 20] [--dtype bfloat16] [--no-write]

Each EP rank is a process (gloo on CPU, one torch thread each; NCCL with one GPU per rank when
``--device cuda`` and >= 2 GPUs). Every rank holds the MoE layers of the main job's model (tiny
M3: H 128, E 8, K 2, I 32, 3 MoE layers) with its expert shard and pushes ``T`` tokens per rank
through all of them once per "step" (a decode step of T rows), ``--steps`` times after a warm-up.
Reported per step (rank 0; summed over the 3 layers): the MoE time, and at EP=2 its parts from
``EPStats``: dispatch (counts exchange + token all-to-all), local expert compute, combine
(reverse all-to-all + weighted sum). The baseline, measured in the same run, is EP=1: the same
layers with all experts local (routed-expert time = the grouped experts call). Figures are
appended to docs/benchmarks.md with machine and date; absolute CPU times only compare within
a run (the CPU is shared).
"""

from __future__ import annotations

import argparse
import datetime
import queue
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchlib import machine  # noqa: E402

from m3_rollout.model.configuration import tiny_config  # noqa: E402
from m3_rollout.model.moe import M3MoE  # noqa: E402
from m3_rollout.parallel import EPGroupSpec, destroy_ep_group, free_port, init_ep_group  # noqa: E402
from m3_rollout.parallel.ep_moe import EPExperts, EPStats  # noqa: E402
from m3_rollout.parallel.expert_sharding import expert_range  # noqa: E402

N_MOE = 3


def _layers(world: int, rank: int, group, dtype, device) -> tuple[list[M3MoE], EPStats]:
    cfg = tiny_config(sparse_local_block=2)
    torch.manual_seed(0)
    layers = [M3MoE(cfg) for _ in range(N_MOE)]
    a, b = expert_range(cfg.num_local_experts, world, rank)
    stats = EPStats(N_MOE, b - a, world)
    for slot, moe in enumerate(layers):
        full = moe.experts
        moe.experts = EPExperts(cfg, (a, b), group, stats, slot)
        with torch.no_grad():
            moe.experts.w13.copy_(full.w13[a:b])
            moe.experts.w2.copy_(full.w2[a:b])
        with torch.no_grad():
            moe.gate.weight.mul_(4.0)
        moe.to(device)
        moe.to(dtype)
        moe.gate.float()
    return layers, stats


def _rank(rank: int, spec: EPGroupSpec, tokens: list[int], steps: int, dtype_name: str, device: str, out) -> None:
    try:
        torch.set_num_threads(1)
        dev = torch.device(device, rank) if device == "cuda" else torch.device("cpu")
        group = init_ep_group(spec, rank, dev)
        dtype = getattr(torch, dtype_name)
        layers, stats = _layers(spec.world_size, rank, group, dtype, dev)
        sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
        rows = []
        for t in tokens:
            x = torch.randn(t, 128, generator=torch.Generator().manual_seed(rank)).to(dev, dtype)
            expert_time = [0.0]
            if spec.world_size == 1:  # time the routed experts call (baseline breakdown)
                for moe in layers:
                    inner = moe.experts.forward

                    def timed(xx, ids, w, inner=inner):
                        sync()
                        t0 = time.perf_counter()
                        y = inner(xx, ids, w)
                        sync()
                        expert_time[0] += time.perf_counter() - t0
                        return y

                    moe.experts.forward = timed
            with torch.no_grad():
                for _ in range(3):
                    for moe in layers:
                        moe(x)
                stats.reset()
                expert_time[0] = 0.0
                sync()
                t0 = time.perf_counter()
                for _ in range(steps):
                    for moe in layers:
                        moe(x)
                sync()
                total = time.perf_counter() - t0
            if spec.world_size == 1:
                for moe in layers:
                    del moe.experts.forward
            s = stats.snapshot()
            expert_s = expert_time[0] if spec.world_size == 1 else s["expert_s"]
            rows.append(
                {
                    "T": t,
                    "moe_ms": 1e3 * total / steps,
                    "dispatch_ms": 1e3 * s["dispatch_s"] / steps,
                    "expert_ms": 1e3 * expert_s / steps,
                    "combine_ms": 1e3 * s["combine_s"] / steps,
                }
            )
        out.put((rank, rows))
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        import traceback

        out.put((rank, traceback.format_exc()))
        raise exc
    finally:
        destroy_ep_group()


def run(world: int, tokens: list[int], steps: int, dtype: str, device: str) -> list[dict]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    spec = EPGroupSpec(world, "127.0.0.1", free_port(), "nccl" if device == "cuda" else "gloo", timeout_s=120)
    procs = [
        ctx.Process(target=_rank, args=(r, spec, tokens, steps, dtype, device, out), daemon=True) for r in range(world)
    ]
    for p in procs:
        p.start()
    got = {}
    try:
        for _ in range(world):
            rank, rows = out.get(timeout=900)
            if isinstance(rows, str):
                raise RuntimeError(f"rank {rank} failed:\n{rows}")
            got[rank] = rows
    except queue.Empty:
        raise RuntimeError("benchmark ranks did not answer within 900 s") from None
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return got[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[16, 128, 1024], help="tokens per rank per step")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--no-write", action="store_true", help="do not append to docs/benchmarks.md")
    args = ap.parse_args()
    if args.device == "cuda" and torch.cuda.device_count() < 2:
        raise SystemExit("--device cuda needs >= 2 GPUs (one per EP rank)")
    base = {r["T"]: r for r in run(1, args.tokens, args.steps, args.dtype, args.device)}
    ep2 = run(2, args.tokens, args.steps, args.dtype, args.device)
    lines = [
        "| EP | T / rank | MoE ms/step | dispatch ms | expert ms | combine ms | (dispatch+combine) / expert "
        "| MoE time vs EP=1 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in ep2:
        b = base[r["T"]]
        lines.append(f"| 1 | {r['T']} | {b['moe_ms']:.2f} | - | {b['expert_ms']:.2f} | - | - | 1.00x |")
        comm = r["dispatch_ms"] + r["combine_ms"]
        lines.append(
            f"| 2 | {r['T']} | {r['moe_ms']:.2f} | {r['dispatch_ms']:.2f} | {r['expert_ms']:.2f} | "
            f"{r['combine_ms']:.2f} | {comm / max(r['expert_ms'], 1e-9):.1f}x | "
            f"{r['moe_ms'] / max(b['moe_ms'], 1e-9):.2f}x |"
        )
    table = "\n".join(lines)
    print(table)
    if not args.no_write:
        date = datetime.date(2026, 11, 29).isoformat()
        text = (
            f"\n## Expert parallelism (bench_ep.py), {date}, {machine(args.device)}\n\n"
            f"{args.dtype}, {args.steps} steps, 3 MoE layers of the main job's tiny M3 (H 128, E 8, K 2, I 32), "
            f"T tokens per rank per step, rank 0's times per step summed over the layers; "
            f"{'gloo, one torch thread per rank' if args.device == 'cpu' else 'NCCL, one GPU per rank'}. "
            f"EP=1 (same run) is the baseline.\n\n{table}\n"
        )
        with open(ROOT / "docs" / "benchmarks.md", "a") as f:
            f.write(text)


if __name__ == "__main__":
    main()

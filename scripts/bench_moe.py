"""Benchmark the fused MoE (kernels/fused_moe.py, issue 5) on one GPU; rows into docs/benchmarks.md.

For each token count T: the fused op (default tiles; eager and CUDA-graph replay), the PyTorch
per-expert loop (`moe.grouped_experts`, the reference path), and one dense bf16 GEMM of the same
FLOPs ([T*K, H] x [H, 3I]). Reports achieved TFLOP/s (useful FLOPs 2 * T*K * 3*I*H, padding not
counted) and GB/s of expert weights read (distinct local experts hit x 3*I*H*2 bytes) against
the H200 targets of the issue: >= 50% of 790 TFLOP/s bf16 (large T), >= 60% of 4.4 TB/s (small T).
`--sweep` also times each grouped GEMM over a few tile choices on the real shape (to pick
`default_config`).

Usage: python scripts/bench_moe.py [--shape real|bench300m|both] [--tokens 1 32 256 4096] [--sweep]
       [--write docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path

import torch

from kernels.fused_moe import GemmTile, default_config, fused_experts, moe_down, moe_gate_up
from kernels.moe_align import align_by_expert
from m3_rollout.model.moe import grouped_experts, route, swiglu_oai

PEAK_TFLOPS, PEAK_GBS = 790.0, 4400.0  # H200 measured bf16 dense peak / HBM3e bandwidth (issue 5)
ALPHA, LIMIT, BETA, SCALING = 1.702, 7.0, 1.0, 2.0
SHAPES = {  # (H, I, E, K)
    "real": (6144, 3072, 128, 4),  # spec §1.2
    "bench300m": (1024, 512, 16, 4),  # ../shared/bench/m3_bench_300m.json
}
DATE = "2026-11-29"


def time_ms(fn, iters: int = 20, reps: int = 5) -> float:
    """Median over `reps` of the mean time of `iters` back-to-back calls, CUDA events, ms."""
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        out.append(start.elapsed_time(end) / iters)
    return statistics.median(out)


def graph_time_ms(fn, iters: int = 20, reps: int = 5) -> float:
    """time_ms of replaying `fn` captured in a CUDA graph (no launch overhead, decode-style)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return time_ms(g.replay, iters, reps)


def make_inputs(shape: str, t: int, seed: int = 0):
    h, inter, e, k = SHAPES[shape]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    w13 = (torch.randn(e, 2 * inter, h, device="cuda", generator=gen) * h**-0.5).bfloat16()
    w2 = (torch.randn(e, h, inter, device="cuda", generator=gen) * inter**-0.5).bfloat16()
    x = torch.randn(t, h, device="cuda", generator=gen).bfloat16()
    weights, ids = route(torch.randn(t, e, device="cuda", generator=gen), None, k, SCALING)
    return x, ids, weights, w13, w2


def act(g, u):
    return swiglu_oai(g, u, ALPHA, LIMIT, BETA)


def bench_one(shape: str, t: int, w13, w2, sweep: bool) -> dict:
    h, inter, e, k = SHAPES[shape]
    x, ids, weights, _, _ = make_inputs(shape, t, seed=t)
    fused = lambda: fused_experts(x, ids, weights, w13, w2, alpha=ALPHA, limit=LIMIT, beta=BETA)  # noqa: E731
    loop = lambda: grouped_experts(x, ids, weights, w13, w2, act)  # noqa: E731
    a_dense = torch.randn(t * k, h, device="cuda").bfloat16()
    w_dense = torch.randn(3 * inter, h, device="cuda").bfloat16()
    dense = lambda: torch.nn.functional.linear(a_dense, w_dense)  # noqa: E731

    err = (fused().float() - loop().float()).abs().max().item()
    flops = 2.0 * t * k * 3 * inter * h
    n_hit = int(torch.unique(ids).numel())
    weight_bytes = n_hit * 3 * inter * h * 2
    row = {
        "shape": shape, "T": t, "experts_hit": n_hit, "max_abs_diff_vs_loop": err,
        "fused_ms": time_ms(fused), "fused_graph_ms": graph_time_ms(fused),
        "loop_ms": time_ms(loop, iters=3 if t >= 1024 else 10), "dense_ms": time_ms(dense),
        "config": str(default_config(t * k, e, h, inter)),
    }
    best = min(row["fused_ms"], row["fused_graph_ms"])
    row["tflops"] = flops / best / 1e9
    row["gbs"] = weight_bytes / best / 1e6
    row["dense_tflops"] = flops / row["dense_ms"] / 1e9
    if sweep:
        row["sweep"] = sweep_tiles(x, ids, weights, w13, w2, k)
    return row


SWEEP_BM = {16: [16], 32: [16, 32], 64: [32, 64], 128: [64, 128]}
SMALL_TILES = [GemmTile(32, 128, 4, 4), GemmTile(64, 128, 4, 3), GemmTile(32, 256, 4, 3), GemmTile(16, 256, 4, 4)]
LARGE_TILES = [GemmTile(128, 64, 8, 3), GemmTile(128, 64, 8, 4), GemmTile(256, 64, 8, 3), GemmTile(128, 128, 8, 3)]


def sweep_tiles(x, ids, weights, w13, w2, k) -> list[dict]:
    """Time each grouped GEMM alone (graph replay) per block_m and tile; skips tiles that fail to compile."""
    t = x.shape[0]
    e = w13.shape[0]
    rows_per_expert = t * k / e
    key = min((b for b in SWEEP_BM if rows_per_expert <= b), default=128)
    results = []
    for bm in SWEEP_BM[key]:
        aligned = align_by_expert(ids, (0, e), bm)
        tiles = SMALL_TILES if bm <= 32 else LARGE_TILES
        act_buf = moe_gate_up(x, w13, aligned, k, tiles[0], ALPHA, LIMIT, BETA)
        for tile in tiles:
            for name, fn in (
                ("w13", lambda: moe_gate_up(x, w13, aligned, k, tile, ALPHA, LIMIT, BETA)),
                ("w2", lambda: moe_down(act_buf, w2, aligned, weights, tile)),
            ):
                try:
                    ms = graph_time_ms(fn, iters=10, reps=3)
                except Exception as exc:  # noqa: BLE001 - out of shared memory etc.: report and go on
                    results.append({"gemm": name, "block_m": bm, "tile": str(tile), "error": repr(exc)[:120]})
                    continue
                results.append({"gemm": name, "block_m": bm, "tile": str(tile), "ms": ms})
    return results


def markdown(rows: list[dict], device: str) -> str:
    lines = [
        f"## Fused MoE (bench_moe.py), {DATE}, {device}",
        "",
        "bf16, random routing (sigmoid top-K of N(0,1) logits). fused = kernels/fused_moe.py incl. alignment "
        "and combine (best of eager / CUDA-graph replay, both shown); loop = PyTorch per-expert loop "
        "(grouped_experts, eager); dense = one bf16 GEMM [T*K, H] x [H, 3I] of the same FLOPs. "
        f"Targets: >= {0.5 * PEAK_TFLOPS:.0f} TFLOP/s (50% of {PEAK_TFLOPS:.0f}) at large T, "
        f">= {0.6 * PEAK_GBS:.0f} GB/s of expert weights (60% of {PEAK_GBS:.0f}) at small T.",
        "",
        "| shape (H/I/E/K) | T | experts hit | fused eager ms | fused graph ms | loop ms | dense ms "
        "| vs loop | vs dense | TFLOP/s | % of 790 | weight GB/s | % of 4400 |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        h, inter, e, k = SHAPES[r["shape"]]
        best = min(r["fused_ms"], r["fused_graph_ms"])
        lines.append(
            f"| {r['shape']} ({h}/{inter}/{e}/{k}) | {r['T']} | {r['experts_hit']} | {r['fused_ms']:.3f} "
            f"| {r['fused_graph_ms']:.3f} | {r['loop_ms']:.3f} | {r['dense_ms']:.3f} "
            f"| {r['loop_ms'] / best:.2f}x | {r['dense_ms'] / best:.2f}x | {r['tflops']:.0f} "
            f"| {100 * r['tflops'] / PEAK_TFLOPS:.0f}% | {r['gbs']:.0f} | {100 * r['gbs'] / PEAK_GBS:.0f}% |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=["real", "bench300m", "both"], default="both")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 32, 256, 4096])
    ap.add_argument("--sweep", action="store_true", help="also time tile choices per grouped GEMM")
    ap.add_argument("--sweep-min-tokens", type=int, default=1, help="sweep only token counts >= this")
    ap.add_argument("--write", type=Path, default=None, help="append the markdown table to this file")
    ap.add_argument("--json", type=Path, default=None, help="write all figures (and sweep) as JSON here")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_moe.py needs a CUDA GPU (absolute times count only from the GPU)")
    device = torch.cuda.get_device_name()
    shapes = ["real", "bench300m"] if args.shape == "both" else [args.shape]
    rows = []
    for shape in shapes:
        _, _, _, w13, w2 = make_inputs(shape, 1)
        for t in args.tokens:
            row = bench_one(shape, t, w13, w2, args.sweep and shape == "real" and t >= args.sweep_min_tokens)
            rows.append(row)
            print(json.dumps({key: v for key, v in row.items() if key != "sweep"}), flush=True)
            for s in row.get("sweep", []):
                print("   sweep", json.dumps(s), flush=True)
        del w13, w2
        torch.cuda.empty_cache()
    table = markdown(rows, device)
    print(table)
    if args.json:
        args.json.write_text(json.dumps({"device": device, "date": DATE, "rows": rows}, indent=1))
    if args.write:
        with args.write.open("a") as f:
            f.write("\n" + table)
    print(f"written {DATE} {datetime.datetime.now().isoformat(timespec='seconds')}")


if __name__ == "__main__":
    main()

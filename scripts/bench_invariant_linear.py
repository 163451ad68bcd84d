"""Launch configurations of the batch-invariant linear (kernels/invariant_ops.py) on one GPU.

For each candidate ``LinearConfig`` (tile rows / columns / K step, warps, stages; K chunk fixed at
the dtype's ``k_chunk``), on the 300M benchmark model's and real M3 projection shapes, bf16:
- ``same bits``: whether every output element equals the dtype's configuration's, on 4,096 random
  rows and on 1 and 32 of those rows alone (the split-K decode launch). A configuration may stand
  in for another at some row counts only if this holds: the bits must not depend on T.
- ms per call at T = 1 and 32 (CUDA-graph replay) and T = 16,384 (eager), against ``F.linear``
  (cuBLAS) in the same run.

Usage: python scripts/bench_invariant_linear.py [--quick] [--write]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from bench_msa import graph_ms, time_ms
from benchlib import emit_section

from m3_kernels import invariant_ops as inv

SHAPES = {  # name: (N, K)
    "bench qkv": (2560, 1024),
    "bench down": (1024, 2048),
    "bench lm_head": (32000, 1024),
    "M3 q|k|v": (9216, 6144),
    "M3 o": (6144, 8192),
}
CANDIDATES = {  # name: (block_m, block_n, block_k, warps, stages, flat K loop)
    "64x64 w4 s4 (middle band)": (64, 64, 64, 4, 4, False),
    "64x64 w4 s4 flat": (64, 64, 64, 4, 4, True),
    "128x128 w8 s3": (128, 128, 64, 8, 3, False),
    "128x128 w8 s3 flat": (128, 128, 64, 8, 3, True),
    "128x128 w8 s4 flat": (128, 128, 64, 8, 4, True),
    "128x256 w8 s3 flat": (128, 256, 64, 8, 3, True),
    "64x128 w4 s4 flat": (64, 128, 64, 4, 4, True),
    "16x64 w4 s4": (16, 64, 64, 4, 4, False),
    "16x128 w4 s4": (16, 128, 64, 4, 4, False),
    "32x64 w4 s4": (32, 64, 64, 4, 4, False),
}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="bench shapes only")
    ap.add_argument("--write", action="store_true", help="append the table to docs/benchmarks.md")
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    base = inv.linear_config(torch.bfloat16)
    rows = [
        "| shape (N x K) | config | same bits | T=1 ms | T=32 ms | T=16384 ms | vs cuBLAS at 16384 |",
        "|---|---|---|---|---|---|---|",
    ]
    shapes = {k: v for k, v in SHAPES.items() if not (args.quick and k.startswith("M3"))}
    for name, (n, k) in shapes.items():
        g = torch.Generator(device=dev).manual_seed(n + k)
        x = torch.randn(16384, k, generator=g, device=dev).to(torch.bfloat16)
        w = (torch.randn(n, k, generator=g, device=dev) * k**-0.5).to(torch.bfloat16)
        ref = inv.linear(x[:4096], w)
        ref1, ref32 = inv.linear(x[7:8], w), inv.linear(x[100:132], w)
        cublas = (
            graph_ms(lambda: F.linear(x[:1], w)),
            graph_ms(lambda: F.linear(x[:32], w)),
            time_ms(lambda: F.linear(x, w)),
        )
        rows.append(f"| {name} ({n} x {k}) | cuBLAS | - | {cublas[0]:.4f} | {cublas[1]:.4f} | {cublas[2]:.3f} | 1.00 |")
        for cname, (bm, bn, bk, nw, ns, flat) in CANDIDATES.items():
            cfg = inv.LinearConfig(bm, bn, bk, nw, ns, base.k_chunk, flat)
            try:
                same = (
                    torch.equal(inv.linear(x[:4096], w, cfg=cfg), ref)
                    and torch.equal(inv.linear(x[7:8], w, cfg=cfg), ref1)
                    and torch.equal(inv.linear(x[100:132], w, cfg=cfg), ref32)
                    and torch.equal(ref1, ref[7:8])
                )
                t = (
                    graph_ms(lambda: inv.linear(x[:1], w, cfg=cfg)),
                    graph_ms(lambda: inv.linear(x[:32], w, cfg=cfg)),
                    time_ms(lambda: inv.linear(x, w, cfg=cfg)),
                )
            except Exception as e:  # noqa: BLE001 - a config that does not compile is a result too
                rows.append(f"| {name} ({n} x {k}) | {cname} | failed: {type(e).__name__} | - | - | - | - |")
                continue
            ratio = t[2] / cublas[2]
            ms = f"{t[0]:.4f} | {t[1]:.4f} | {t[2]:.3f}"
            rows.append(f"| {name} ({n} x {k}) | {cname} | {same} | {ms} | {ratio:.2f} |")
        print("\n".join(rows[-len(CANDIDATES) - 1 :]), flush=True)
    notes = (
        f"bf16, K chunk {base.k_chunk}; same bits = every output equal to the "
        "configuration linear picks (4,096 rows: the prefill band's; 1 and 32 rows alone: the decode band's, split-K); "
        "T=1 / 32 CUDA-graph replays, T=16384 eager."
    )
    emit_section("Batch-invariant linear launch configurations (bench_invariant_linear.py)", notes, rows, args.write)


if __name__ == "__main__":
    main()

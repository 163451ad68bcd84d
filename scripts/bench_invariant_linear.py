"""Launch configurations of the batch-invariant linear (kernels/invariant_ops.py) on one GPU.

For each candidate ``LinearConfig`` (tile rows / columns / K step, warps, stages; K chunk fixed at
the dtype's ``k_chunk``), on the 300M benchmark model's and real M3 projection shapes, bf16:
- ``same bits``: whether every output element equals the dtype's configuration's, on 4,096 random
  rows and on 1 and 32 of those rows alone (the decode band). A configuration may stand
  in for another at some row counts only if this holds: the bits must not depend on T.
- ms per call at T = 1 and 32 (CUDA-graph replay) and T = 16,384 (eager), against ``F.linear``
  (cuBLAS) in the same run.

``--decode``: the decode band's 16-row candidates at three split-K thresholds at T = 1 / 32 only, on
every projection shape of the 300M bench model and four M3 ones.

Usage: python scripts/bench_invariant_linear.py [--quick | --decode] [--write]
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
# --decode: the decode band's candidates (16-row tiles), each with the split-K thresholds of
# SPLIT_CHOICES; T = 1 / 32 only.
DECODE_CANDIDATES = {
    "16x64 K128 w4 s4 flat (decode band)": (16, 64, 128, 4, 4, True),
    "16x64 K64 w4 s4 (decode band until 2026-12-06)": (16, 64, 64, 4, 4, False),
    "16x64 K64 w4 s4 flat": (16, 64, 64, 4, 4, True),
    "16x32 w4 s4": (16, 32, 64, 4, 4, False),
    "16x16 w4 s4": (16, 16, 64, 4, 4, False),
    "16x32 w2 s4": (16, 32, 64, 2, 4, False),
    "16x64 w2 s6": (16, 64, 64, 2, 6, False),
    "16x128 w4 s4": (16, 128, 64, 4, 4, False),
}
# --decode: split-K below this many output tiles (LinearConfig.split_k_below; 0 = never)
SPLIT_CHOICES = {"below 64 tiles (decode band)": 64, "below 264 tiles": 264, "none": 0}
DECODE_SHAPES = {
    "bench qkv": (3712, 1024),
    "bench o / down": (1024, 2048),
    "bench gate_up": (4096, 1024),
    "bench shared gate_up": (1024, 1024),
    "bench shared down": (1024, 512),
    "bench lm_head": (32000, 1024),
    "M3 q|k|v": (9216, 6144),
    "M3 o": (6144, 8192),
    "M3 dense down": (6144, 12288),
    "M3 shared down": (6144, 3072),
}


def decode_sweep(dev: torch.device, base: inv.LinearConfig) -> list[str]:
    """The --decode table: T = 1 / 32 CUDA-graph ms of each decode candidate at each split-K
    threshold of SPLIT_CHOICES, against cuBLAS; same bits = equal to ``linear``'s own choice on 1 and 32 rows alone and
    to rows of a 4,096-row call (the prefill band)."""
    rows = [
        "| shape (N x K) | config | split-K | same bits | T=1 ms | T=32 ms |",
        "|---|---|---|---|---|---|",
    ]
    for name, (n, k) in DECODE_SHAPES.items():
        g = torch.Generator(device=dev).manual_seed(n + k)
        x = torch.randn(4096, k, generator=g, device=dev).to(torch.bfloat16)
        w = (torch.randn(n, k, generator=g, device=dev) * k**-0.5).to(torch.bfloat16)
        ref = inv.linear(x, w)
        ref1, ref32 = inv.linear(x[7:8], w), inv.linear(x[100:132], w)
        rows_alone_ok = torch.equal(ref1, ref[7:8]) and torch.equal(ref32, ref[100:132])
        t1, t32 = graph_ms(lambda: F.linear(x[:1], w)), graph_ms(lambda: F.linear(x[:32], w))
        rows.append(f"| {name} ({n} x {k}) | cuBLAS | - | - | {t1:.4f} | {t32:.4f} |")
        for cname, (bm, bn, bk, nw, ns, flat) in DECODE_CANDIDATES.items():
            for split, below in SPLIT_CHOICES.items():
                cfg = inv.LinearConfig(bm, bn, bk, nw, ns, base.k_chunk, flat, split_k_below=below)
                try:
                    same = (
                        rows_alone_ok
                        and torch.equal(inv.linear(x[7:8], w, cfg=cfg), ref1)
                        and torch.equal(inv.linear(x[100:132], w, cfg=cfg), ref32)
                    )
                    t1 = graph_ms(lambda: inv.linear(x[:1], w, cfg=cfg))
                    t32 = graph_ms(lambda: inv.linear(x[:32], w, cfg=cfg))
                except Exception as e:  # noqa: BLE001 - a config that does not compile is a result too
                    rows.append(f"| {name} ({n} x {k}) | {cname} | {split} | failed: {type(e).__name__} | - | - |")
                    continue
                rows.append(f"| {name} ({n} x {k}) | {cname} | {split} | {same} | {t1:.4f} | {t32:.4f} |")
        print("\n".join(rows[-len(SPLIT_CHOICES) * len(DECODE_CANDIDATES) - 1 :]), flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="bench shapes only")
    ap.add_argument("--write", action="store_true", help="append the table to docs/benchmarks.md")
    ap.add_argument("--decode", action="store_true", help="the decode band's candidates at T = 1 / 32 only")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (it times the Triton kernels against cuBLAS)")
    dev = torch.device("cuda")
    base = inv.linear_config(torch.bfloat16)
    if args.decode:
        notes = (
            f"bf16, K chunk {base.k_chunk}, CUDA-graph replays; split-K 'below N tiles' = a launch of fewer "
            "output tiles runs its K chunks as separate programs; same bits = equal to linear's own choice "
            "on 1 and 32 rows alone, which equal rows of a 4,096-row call."
        )
        rows = decode_sweep(dev, base)
        emit_section(
            "Batch-invariant linear, decode band (bench_invariant_linear.py --decode)", notes, rows, args.write
        )
        return
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
                    and torch.equal(ref32, ref[100:132])
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
        "configuration linear picks (4,096 rows: the prefill band's; 1 and 32 rows alone: the decode band's); "
        "T=1 / 32 CUDA-graph replays, T=16384 eager."
    )
    emit_section("Batch-invariant linear launch configurations (bench_invariant_linear.py)", notes, rows, args.write)


if __name__ == "__main__":
    main()

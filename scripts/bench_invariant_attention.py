"""Batch-invariant MSA attention (kernels/invariant_attention.py) against the fast kernels, on one GPU.

Real M3 shapes (64 q heads / 4 KV heads / d 128 / block 128 / top-k 16), bf16, one layer, the
same random paged batch for both (``scripts/bench_msa.py``'s ``batch``, "smooth" index queries):
- decode, batch 1 and 32, contexts 8K and 32K: the sparse layer's call (fast
  ``msa_fused_decode.msa_attention`` vs ``invariant_msa_attention``) and the dense layer's
  (``msa_paged_attention.paged_attention`` vs ``invariant_paged_attention``), CUDA-graph replays;
- prefill of one 32K-token chunk: the same two pairs, eager.
Prints ms per call and the invariant / fast ratio (issue 24's target: decode tokens/s and 32K
prefill within 15% of the fast mode for the whole model; attention is one part of it).

Usage: python scripts/bench_invariant_attention.py [--quick]
"""

from __future__ import annotations

import argparse

import torch
from bench_msa import DI, SCALE, K, batch, graph_ms, time_ms

from m3_kernels.invariant_attention import invariant_index_topk, invariant_msa_attention, invariant_paged_attention
from m3_kernels.msa_fused_decode import msa_attention
from m3_kernels.msa_paged_attention import paged_attention
from m3_kernels.msa_synthetic import make_paged_batch


def pair(b, timer) -> list[tuple[str, float, float]]:
    """(layer kind, fast ms, invariant ms) for the sparse and the dense layer's call on batch b."""
    args = (b.q, b.iq, b.k, b.v, b.ik, b.meta, SCALE, K)
    sparse = (timer(lambda: msa_attention(*args)), timer(lambda: invariant_msa_attention(*args)))
    dense = (
        timer(lambda: paged_attention(b.q, b.k, b.v, b.meta, SCALE)),
        timer(lambda: invariant_paged_attention(b.q, b.k, b.v, b.meta, SCALE)),
    )
    return [("sparse", *sparse), ("dense", *dense)]


def tile_sweep() -> None:
    """Attention tile height (dot rows) x warps of the invariant kernel: prefill of 16K tokens and
    decode at 8K context (batch 1 / 32), dense and sparse (top-16 of the invariant selection), for
    the 300M bench model's heads (16 q / 4 KV) and M3's (64 / 4)."""
    print(
        f"{'heads':6s} {'layer':7s} {'tile x warps':13s} {'prefill 16K ms':>15s} {'dec b1 ms':>10s} {'dec b32 ms':>11s}"
    )
    for nh in (16, 64):
        mk = dict(page_size=128, kv_heads=4, q_heads=nh, head_dim=128, index_dim=DI, dtype=torch.bfloat16)
        pre = make_paged_batch([(0, 16384)], 0, device="cuda", seed=0, spare_pages=0, **mk)
        decs = [make_paged_batch([(8191, 1)] * n, n, device="cuda", seed=1, spare_pages=0, **mk) for n in (1, 32)]
        sels = {id(b): invariant_index_topk(b.iq, b.ik, b.meta, K) for b in (pre, *decs)}
        for dense in (True, False):
            kind = "dense" if dense else "sparse"
            for rows, warps in ((16, 4), (32, 4), (64, 4), (64, 8), (128, 8), (128, 4)):

                def call(b, rows=rows, warps=warps, dense=dense):
                    ids = None if dense else sels[id(b)]
                    return invariant_paged_attention(b.q, b.k, b.v, b.meta, SCALE, ids, tile_rows=rows, warps=warps)

                try:
                    t = (
                        time_ms(lambda: call(pre), iters=3, reps=3),
                        graph_ms(lambda: call(decs[0])),
                        graph_ms(lambda: call(decs[1])),
                    )
                except Exception as e:  # noqa: BLE001 - a tile that does not compile is a result too
                    print(f"{nh:<6d} {kind:7s} {rows:>4d} x {warps:<6d} failed: {type(e).__name__}")
                    continue
                ms = f"{t[0]:15.3f} {t[1]:10.4f} {t[2]:11.4f}"
                print(f"{nh:<6d} {kind:7s} {rows:>4d} x {warps:<6d} {ms}", flush=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="decode at 8K only, prefill of 8K tokens")
    ap.add_argument("--tile-sweep", action="store_true", help="only the attention tile x warps sweep")
    args = ap.parse_args(argv)
    if args.tile_sweep:
        tile_sweep()
        return
    print(f"{'case':34s} {'layer':7s} {'fast ms':>9s} {'invariant ms':>13s} {'ratio':>6s}")
    ctxs = (8192,) if args.quick else (8192, 32768)
    for n in (1, 32):
        for ctx in ctxs:
            b = batch([(ctx - 1, 1)] * n, n, smooth=True)
            for kind, fast, inv in pair(b, graph_ms):
                print(f"{f'decode batch {n} ctx {ctx}':34s} {kind:7s} {fast:9.4f} {inv:13.4f} {inv / fast:6.2f}")
    n_pre = 8192 if args.quick else 32768
    b = batch([(0, n_pre)], 0, smooth=True)
    for kind, fast, inv in pair(b, time_ms):
        print(f"{f'prefill {n_pre} tokens':34s} {kind:7s} {fast:9.3f} {inv:13.3f} {inv / fast:6.2f}")


if __name__ == "__main__":
    main()

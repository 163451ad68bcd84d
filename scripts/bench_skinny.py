"""Launch configurations of the decode skinny GEMM (kernels/fused_layers.py ``skinny_linear``) on one GPU.

For the projection shapes of the real-shape slice (configs/bench/m3_slice_real.json) and of the 300M
bench model, at 1 and 16 tokens, bf16, CUDA-graph replay: the launch ``skinny_config`` picks, the
launch used before it (BLOCK_N 16 up to 2,048 outputs else 32, BLOCK_K 256, 4 warps, 4 stages:
the baseline, same run) and every candidate of a grid (BLOCK_N 16/32/64 x BLOCK_K 128/256 x 4/8 warps
x 3/4/6 stages); TB/s counts the weight bytes. The SwiGLU rows are the gate|up GEMM with the
activation in its epilogue ([2N, K] weight -> [T, N]); their baseline is the plain gate|up GEMM
(old launch) followed by the ``swiglu`` kernel, two launches. Every launch's output is checked
against the baseline's (max abs difference printed; they differ only by fp32 summation order).

Usage: python scripts/bench_skinny.py [--tokens 1 16] [--write]
"""

from __future__ import annotations

import argparse
import itertools
import sys

import torch
import triton
from bench_msa import graph_ms
from benchlib import emit_section

from m3_kernels import fused_layers as fl

SHAPES = {  # name: (N output columns, K, SwiGLU epilogue: the weight has 2N rows)
    "M3 qkv+index": (9856, 6144, False),
    "M3 o": (6144, 8192, False),
    "M3 MLP gate_up": (12288, 6144, True),
    "M3 MLP down": (6144, 12288, False),
    "M3 shared gate_up": (3072, 6144, True),
    "M3 shared down": (6144, 3072, False),
    "300M qkv+index": (3712, 1024, False),
    "300M o": (1024, 2048, False),
    "300M MLP gate_up": (2048, 1024, True),
    "300M MLP down": (1024, 2048, False),
    "300M shared gate_up": (512, 1024, True),
    "300M shared down": (1024, 512, False),
}
GRID = list(itertools.product((16, 32, 64), (128, 256), (4, 8), (3, 4, 6)))  # BLOCK_N, BLOCK_K, warps, stages
SWIGLU = (1.702, 7.0, 1.0)  # alpha, limit, beta (spec §3.7)


def old_config(n: int) -> tuple[int, int, int, int]:
    """The launch ``skinny_linear`` used before ``skinny_config`` (the baseline)."""
    return (16 if n <= 2048 else 32), 256, 4, 4


def launch(x, w, out, swiglu: bool, cfg: tuple[int, int, int, int]) -> None:
    """One ``_skinny_gemm_kernel`` launch of x [T, K] @ w [N or 2N, K]^T into out [T, N] with cfg."""
    bn, bk, warps, stages = cfg
    n, k = out.shape[1], w.shape[1]
    alpha, limit, beta = SWIGLU if swiglu else (1.0, 1.0, 1.0)
    fl._skinny_gemm_kernel[(triton.cdiv(n, bn),)](
        x, w, w[n:] if swiglu else w, out, x.shape[0], n, k, x.stride(0), w.stride(0), out.stride(0),
        alpha, limit, beta,
        SWIGLU=swiglu, BLOCK_T=16, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages,
    )  # fmt: skip


def baseline(x, w, n: int, swiglu: bool) -> torch.Tensor:
    """The launch before ``skinny_config`` -> [T, n]; SwiGLU: the plain gate|up GEMM, then the ``swiglu`` kernel."""
    out = torch.empty(x.shape[0], w.shape[0], device=x.device, dtype=x.dtype)
    launch(x, w, out, False, old_config(w.shape[0]))
    return fl.swiglu(out, *SWIGLU) if swiglu else out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="*", default=[1, 16], help="decode tokens (1..16)")
    ap.add_argument("--write", action="store_true", help="append the table to docs/benchmarks.md")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_skinny.py needs a CUDA GPU")
    if any(not 1 <= t <= fl.SKINNY_MAX_TOKENS for t in args.tokens):
        sys.exit(f"--tokens {args.tokens}: each must be in 1..{fl.SKINNY_MAX_TOKENS}")
    rows = ["| tokens | shape (N x K) | before (us, TB/s) | skinny_config (us, TB/s) | best of the grid (us, TB/s) |"]
    rows.append("|---|---|---|---|---|")
    for t in args.tokens:
        tot = [0.0, 0.0, 0.0]
        for name, (n, k, sw) in SHAPES.items():
            g = torch.Generator(device="cuda").manual_seed(n + k)
            w = (torch.randn(2 * n if sw else n, k, generator=g, device="cuda") * k**-0.5).to(torch.bfloat16)
            x = torch.randn(t, k, generator=g, device="cuda").to(torch.bfloat16)
            ref = baseline(x, w, n, sw)
            gb = w.numel() * 2e-9

            def timed(cfg, x=x, w=w, sw=sw):
                out = torch.empty_like(ref)
                if cfg is None:
                    run = lambda: baseline(x, w, out.shape[1], sw)  # noqa: E731
                    got = run()
                else:
                    run = lambda: launch(x, w, out, sw, cfg)  # noqa: E731
                    got = (run(), out)[1]
                err = (got.float() - ref.float()).abs().max().item()
                return graph_ms(run), err

            base, _ = timed(None)
            chosen, err = timed(fl.skinny_config(n, sw))
            best = (float("inf"), None)
            for cfg in GRID:
                try:
                    best = min(best, (timed(cfg)[0], cfg))
                except Exception:  # noqa: BLE001 - a launch that does not fit (shared memory) is skipped
                    continue
            for i, ms in enumerate((base, chosen, best[0])):
                tot[i] += ms
            cell = lambda ms: f"{ms * 1e3:.1f}, {gb / ms:.2f}"  # noqa: E731
            rows.append(
                f"| {t} | {name} {w.shape[0]} x {k}{' + SwiGLU' if sw else ''} | {cell(base)} | {cell(chosen)} "
                f"(max diff {err:.1e}) | {cell(best[0])}, bn{best[1][0]} bk{best[1][1]} w{best[1][2]} s{best[1][3]} |"
            )
            print(rows[-1], flush=True)
        gain = tot[0] / tot[1]
        rows.append(f"| {t} | sum | {tot[0] * 1e3:.1f} | {tot[1] * 1e3:.1f} ({gain:.2f}x) | {tot[2] * 1e3:.1f} |")
    notes = (
        f"torch {torch.__version__}, triton {triton.__version__}; bf16, CUDA-graph replay; before = the launch "
        "used before `skinny_config` (the baseline, same run; SwiGLU rows: the plain gate|up GEMM then the `swiglu` "
        "kernel); TB/s counts the weight bytes."
    )
    emit_section("Skinny decode GEMM launches (bench_skinny.py)", notes, rows, args.write)


if __name__ == "__main__":
    main()

"""Triton helpers of the FP8 (e4m3) index-key cache: quantize in the write kernel, score in the readers.

Format (one power-of-two scale per token, why per token and why a power of two):
kernels/paged_layout.py, "FP8 index-key format"; ``paged_layout.quantize_index_keys`` is the
PyTorch reference these helpers equal bit for bit.

Governing idea: every inexact step is done in integer arithmetic on fp32 bit patterns, so the
codes do not depend on the backend's float -> fp8 conversion (the Triton interpreter rounds ties
away from zero; sm90's ``cvt.rn.satfinite`` and torch round to nearest even): ``e4m3_round``
rounds to the nearest e4m3 value (ties to even) in fp32, and the final ``.to(float8e4nv)`` only
converts values it represents exactly. The scale is an exponent-field computation
(``e4m3_scale_bits``). Readers multiply block scores by the per-token scales before the block
max (the scales differ per key) and by a query's scale after it (one positive power of two per
row commutes with the max, exactly).

Host side: ``split_index_cache`` unpacks an index-cache argument (a ``[P, ps, di]`` tensor or a
``paged_layout.FP8IndexCache``) for the kernels' launchers; ``quantize_rows`` quantizes index
query rows in one launch for the prefill score kernel (msa_index_topk, "qpre").
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from m3_kernels.msa_checks import check_pow2_dim
from m3_kernels.paged_layout import E4M3_SCALE_SHIFT, FP8IndexCache

_SHIFT = tl.constexpr(E4M3_SCALE_SHIFT)


@triton.jit
def _nan_max(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def e4m3_scale(amax):
    """(scale, 1/scale) fp32 powers of two, scale = 2**(ceil(log2 amax) - 8), clamped to
    [2**-126, 2**126]; amax >= 0 fp32 (NaN -> a finite scale). Same bits as
    ``paged_layout.e4m3_pow2_scales``."""
    bits = amax.to(tl.int32, bitcast=True)
    e_ceil = (bits >> 23) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    e_ceil = tl.where(amax != amax, 255, e_ceil)
    se = tl.minimum(tl.maximum(e_ceil - _SHIFT, 1), 253)
    scale = (se << 23).to(tl.float32, bitcast=True)
    inv = ((254 - se) << 23).to(tl.float32, bitcast=True)
    return scale, inv


@triton.jit
def e4m3_round(x):
    """fp32 x (|x| <= 448) -> the nearest e4m3 value as fp32, ties to even; NaN stays NaN.

    |x| >= 2**-6 (normal e4m3): keep 3 mantissa bits of the fp32 pattern (round half to even on
    the 20 dropped bits; a carry moves into the exponent). Below: multiples of 2**-9 (subnormal
    e4m3) from the 24-bit significand shifted right with the same rounding.
    """
    bits = x.to(tl.int32, bitcast=True)
    mag = bits & 0x7FFFFFFF
    sign = bits & -2147483648
    keep = (mag >> 20) & 1
    normal = ((mag + 0x7FFFF + keep) & -1048576) | sign  # low 20 bits cleared
    ef = mag >> 23
    sh = tl.minimum(tl.maximum(141 - ef, 1), 30)  # x = M * 2**(ef - 150); codes count units of 2**-9
    m = (mag & 0x7FFFFF) | 0x800000
    q = m >> sh
    rem = m - (q << sh)
    half = 1 << (sh - 1)
    q += ((rem > half) | ((rem == half) & ((q & 1) == 1))).to(tl.int32)
    sub = (q.to(tl.float32) * 0.001953125).to(tl.int32, bitcast=True) | sign  # q * 2**-9
    out = tl.where(mag >= 0x3C800000, normal, sub)  # 0x3C800000 = 2**-6
    return tl.where(x != x, x, out.to(tl.float32, bitcast=True))


@triton.jit
def quantize_rows_e4m3(x):
    """Rows of x [M, N] (any float dtype) -> (codes [M, N] float8e4nv, scales [M] fp32), one scale per row."""
    xf = x.to(tl.float32)
    amax = tl.reduce(tl.abs(xf), 1, _nan_max)
    scale, inv = e4m3_scale(amax)
    return e4m3_round(xf * inv[:, None]).to(tl.float8e4nv), scale


@triton.jit
def index_dot(q, k):
    """[M, N] fp32 <q_m, k_n> of q [M, D] and k [N, D]: fp32 q -> IEEE fp32 dot (no tf32); fp8
    keys with a non-fp8 q are converted to q's dtype (exact); fp8 x fp8 -> fp8 tensor-core dot."""
    if k.dtype != q.dtype:
        k = k.to(q.dtype)
    if q.dtype == tl.float32:
        return tl.dot(q, tl.trans(k), input_precision="ieee")
    return tl.dot(q, tl.trans(k))


def index_format(index_cache_l) -> str:
    """The index-key format of an index-cache argument: "bf16" (a plain key tensor, any float dtype),
    "fp8" (``FP8IndexCache``, queries kept) or "fp8q" (``FP8IndexCache`` quantizing queries); the keys
    of the per-format launch tables (``msa_index_topk.DECODE_SCORE_CONFIGS``, ``msa_fused_decode.INDEX_TOPK_PDL``)."""
    if not isinstance(index_cache_l, FP8IndexCache):
        return "bf16"
    return "fp8q" if index_cache_l.quantize_queries else "fp8"


def split_index_cache(index_cache_l) -> tuple[torch.Tensor, torch.Tensor | None, bool]:
    """(keys [P, ps, di], per-token scales [P, ps] fp32 or None, quantize queries) of an index-cache argument.

    index_cache_l: a [P, ps, di] fp32/fp16/bf16 tensor, or a ``paged_layout.FP8IndexCache``.
    Raises ValueError for an FP8 cache whose keys are not float8_e4m3fn [P, ps, di] with a
    contiguous last dim or whose scales are not fp32 [P, ps] with contiguous pages.
    """
    if not isinstance(index_cache_l, FP8IndexCache):
        return index_cache_l, None, False
    keys, scales = index_cache_l.keys, index_cache_l.scales
    if (
        keys.dtype != torch.float8_e4m3fn
        or keys.dim() != 3
        or keys.stride(2) != 1
        or scales.dtype != torch.float32
        or tuple(scales.shape) != tuple(keys.shape[:2])
        or scales.stride(1) != 1
    ):
        raise ValueError(
            f"FP8 index cache: keys {keys.dtype} {tuple(keys.shape)} strides {keys.stride()}, scales "
            f"{scales.dtype} {tuple(scales.shape)}; need float8_e4m3fn [P, ps, di] (last dim contiguous) "
            "and fp32 [P, ps] (kernels/paged_layout.py)"
        )
    return keys, scales, index_cache_l.quantize_queries


@triton.jit
def _quantize_rows_kernel(x_ptr, codes_ptr, scales_ptr, n_rows, stride_x, N: tl.constexpr, BLOCK_R: tl.constexpr):
    """BLOCK_R rows of x [n_rows, N] (row stride stride_x, unit column stride) -> codes [n_rows, N]
    float8e4nv and scales [n_rows] fp32 (contiguous): ``quantize_rows_e4m3`` of each row."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, N)
    ok = rows < n_rows
    x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_x + cols[None, :], mask=ok[:, None], other=0.0)
    codes, scales = quantize_rows_e4m3(x)
    tl.store(codes_ptr + rows[:, None].to(tl.int64) * N + cols[None, :], codes, mask=ok[:, None])
    tl.store(scales_ptr + rows, scales, mask=ok)


QUANTIZE_ROWS_BLOCK = 32  # rows per program of ``quantize_rows``


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Index query rows x [..., di] (fp32 / fp16 / bf16) -> (codes [..., di] float8_e4m3fn, scales
    [...] fp32), contiguous: the same bits as ``quantize_rows_e4m3`` inside a kernel and as
    ``paged_layout.quantize_index_keys``. The prefill score launch of quantized queries
    (msa_index_topk ``PREFILL_SCORE_FORMAT`` "qpre") runs it first and loads the fp8 codes, so its
    dot reads the query tile from shared memory. One pass over x (a copy first where its rows are
    not one stride apart). Raises ValueError unless di is a power of two in [16, 256]."""
    di = x.shape[-1]
    check_pow2_dim("quantize_rows: row length (sparse_index_dim)", di)
    rows = x.reshape(-1, di)
    if rows.shape[0] and rows.stride(-1) != 1:
        rows = rows.contiguous()
    codes = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    n = rows.shape[0]
    if n:
        _quantize_rows_kernel[(triton.cdiv(n, QUANTIZE_ROWS_BLOCK),)](
            rows, codes, scales, n, rows.stride(0), N=di, BLOCK_R=QUANTIZE_ROWS_BLOCK, num_warps=4
        )
    return codes, scales

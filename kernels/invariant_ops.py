"""Batch-invariant non-attention ops of the paged forward and the sampler (issue 24, design.md §4.6).

Governing idea: a token's result is bitwise the same whatever else is in the step (batch size,
other sequences, chunk boundaries, prefix-cache hits, CUDA-graph padding) when every reduction
that produces it runs in one fixed order. A GPU kernel's reduction order is fixed by its compiled
code: tile sizes, warps, MMA instruction shape and the sequence of K steps. So each op here fixes
the sequence of additions that makes an output element per activation dtype, whatever the number
of rows T: no autotuning, no split-K whose split depends on T, no atomic adds of values. Where a
launch configuration does follow T (``linear``'s three row bands: 16-row tiles for decode, bf16's
with 128-wide K steps in one pipelined loop; 128 x 256 tiles with one pipelined K loop for
prefill), the configurations differ only in how many rows and columns share a program, the K step
of a dot and the loop's shape, and a row's bits are the same under each (checked on the H200 and
the H100).
``linear`` and the routed experts' GEMMs sum K in fixed chunks whose fp32 partials are added in
chunk order, by one program or, for decode-sized launches, by separate programs whose
partials the last program of the output tile to finish adds up (kernels/split_k.py: an atomic
ticket decides WHO combines, never the order): the same additions either way.
A row then meets the same additions in the same order whether it is alone or row 17 of 300,
in whichever tile position: tiles never
mix rows (each output element is the dot product of its own row with its own column), and rows
past T are masked loads that only feed outputs which are never stored.

The configuration does not depend on N (the output width) either, so a packed q|k|v or gate|up
GEMM gives each column the bits a GEMM over that projection alone gives (the trainer runs the
projections unpacked).

Ops:
- ``linear(x [T, K], weight [N, K], bias=None) -> [T, N]`` in x.dtype: every projection, the dense
  MLP and shared expert, lm_head, and (fp32 x / weight, exact fp32 products) the router GEMM.
- ``fused_experts``: ``m3_kernels.fused_moe.fused_experts`` with the fixed tile config
  ``INVARIANT_MOE_CONFIG`` (16-row tiles up to ``MOE_DECODE_ROWS`` tokens) instead of
  ``default_config``, which picks tile heights and the ragged 128-row + tail layout from T (a
  row's MMA shape then depends on the batch). The aligned layout is row-independent (each tile
  row is one (token, slot) pair; padding rows are never stored), both GEMMs sum K in chunks
  (``k_chunk``, split over programs at decode sizes: kernels/moe_chunked.py) and the combine sums a
  token's K slots in slot order k = 0..K-1 in fp32.
- ``rms_norm`` / ``add_rms_norm``: ``m3_kernels.fused_layers.add_rms_norm`` itself. It is already
  invariant: one program per row, the row read in one BLOCK = next_pow2(N) vector, one ``tl.sum``
  tree and num_warps both fixed by N alone; nothing is duplicated here. The same holds (and the
  invariant table reuses them) for ``qkv_norm_rope_write`` (one program per (token, head), block
  next_pow2(head dim)), ``swiglu`` (element-wise) and ``router_topk`` (one program per row).
  Its sibling ``router_gemm_topk`` is row-invariant too, but the model takes it only for
  decode-sized steps (``router_gemm_topk_ok(T, ...)``), so the choice between it and a GEMM +
  ``router_topk`` depends on T: the invariant table answers ``router_gemm_topk_never`` and the
  router logits always come from ``linear`` in fp32.
- ``token_logprobs(logits [N, V], tokens [N]) -> fp32 [N]``: log_softmax(row)[token], one program
  per row, the vocabulary walked in fixed LOGPROB_BLOCK chunks (max, then sum of exp), the same
  in the eager sampler, the decode graphs and (later) the trainer's loss.

Cost: fixed tiles are the compromise between decode (few rows: the GEMM is bound by streaming the
weights) and prefill (many rows); the MoE pads every expert to 64 rows (16 in its decode band). H200, 300M bench model
(2026-12-03, profile_engine.py): decode step linear 221 / 261 us (batch 1 / 32, 40 launches) vs
the fast mode's skinny GEMM + cuBLAS 186 / 163 us; MoE GEMMs 108 / 193 vs 69 / 145 us; 16K-token
prefill linear 9.0 ms vs cuBLAS 4.3 ms (12.8 ms before the row bands; issue 24 target for the
whole step: <= 15% slower than the fast mode).

Not here: attention (the other half of issue 24, ``kernels/invariant_attention.py``); the EP
combine across ranks (``m3_rollout/parallel/ep_moe.py``: each rank runs ``fused_experts`` on its
received pairs with K = 1 and their routing weights, the owning rank sums the slots in slot order
in fp32 as ``moe_combine`` does); the sampler's top-k / top-p (``m3_rollout/engine/sampler.py``,
PyTorch ops with a fixed order); the trainer's use of these ops.

Shape legend: T rows (tokens), K reduction width, N output width, V vocabulary.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from m3_kernels import fused_layers as fl
from m3_kernels import fused_moe as fm
from m3_kernels.moe_tiles import GemmTile, dot_precision
from m3_kernels.split_k import combine_chunks, fold_chunk, last_to_arrive, reset_counter, tile_counters

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - triton without host-side TMA descriptors
    TensorDescriptor = None

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class LinearConfig:
    """A launch configuration of ``linear`` (``linear_config`` picks one from the dtype and T's band;
    no field depends on N). block_m / block_n: output tile; block_k: K step of the dot; flat: one
    software-pipelined K loop whose chunk partials fold into the accumulator at chunk ends (else
    one loop per chunk, nested); the same additions either way. tma (with flat, unsplit launches of
    TMA-aligned operands): the x / weight tiles come through TMA descriptors (``_linear_tma_kernel``)
    instead of pointer loads; the same tiles, dots and additions.

    k_chunk: the K axis is summed in chunks of this many columns (a multiple of 2 x block_k): each
    chunk's partial dot product starts from zero and the partials are added in chunk order in
    fp32. That fixed association lets a launch with few output tiles (decode) run the chunks as
    separate programs and add their partials afterwards (split-K) with the same bits as one
    program walking all chunks (prefill): the split changes where a partial is added, never the
    order.

    split_k_below: split the K chunks over programs when the launch has fewer output tiles than
    this (None: ``SPLIT_K_BELOW_PROGRAMS``); where the work is split, never what is added.
    """

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    k_chunk: int
    flat: bool = False
    tma: bool = False
    split_k_below: int | None = None


# The launch configuration by row count T (``linear_config``). Every one of them sums an output
# element in the same sequence: K chunks of ``k_chunk`` from zero, each chunk a chain of 16-deep
# tensor-core MMA steps (BLOCK_K = 64 or, bf16 decode band, 128 per dot: the same chain; fp32: one
# FMA chain in 32-wide steps, every band), chunk
# partials added in chunk order, so the bits do not depend on which one a step takes. What differs
# is how many rows and columns share a program (and with it the MMA instruction: Hopper mma.sync
# for 16-row tiles, wgmma for 64 / 128), the K step of a dot and whether the K loop is one pipelined
# loop (``flat``). That a row's bits are the same under every tile shape and K step is a property
# of the hardware's MMA (one fixed order per output element), checked on the H200 / H100 by
# tests/gpu/test_invariant_ops_gpu.py and scripts/bench_invariant_linear.py (all candidate shapes:
# same bits on 4,096 random rows, 2026-12-03; K step 128 vs 64 at 1 / 32 rows on 13 projection
# shapes of the bench model and M3, H100 2026-12-06). Under the interpreter a dot is one matmul
# per K step, so there the step does set the order: only bf16 (never run there) mixes steps.
# H200, bench shapes (scripts/bench_invariant_linear.py, 2026-12-03): 16-row tiles take 25-45 %
# less time than 64-row ones at T = 1 and 32 (decode: the weights stream either way, more programs
# in flight); at 16,384 rows 128x128 tiles with the flat loop take 1.7-2.0x cuBLAS's time where
# the 64x64 nested loop took 2.6-3.2x. fp32 (exact "ieee" products, FMA units; the router GEMM):
# a small tile up to FP32_PREFILL_ROWS rows, a wide unsplit one from there (below).
LINEAR_CONFIGS = {  # middle row counts
    torch.bfloat16: LinearConfig(64, 64, 64, 4, 4, 256),
    torch.float16: LinearConfig(64, 64, 64, 4, 4, 256),
    torch.float32: LinearConfig(32, 32, 32, 4, 2, 64),
}
# Decode band, bf16: one pipelined loop (flat) of 128-wide K steps, the skinny GEMM's streaming
# pattern (16 x 64 tiles): M3 q|k|v at 1 / 32 rows 50.2 / 60.4 -> 43.0 / 44.7 us against 16 x 64 x 64
# split programs of one chunk each, skinny GEMM 42.2 us, cuBLAS 41.3 / 42.3 (H100, 2026-12-06).
LINEAR_DECODE_CONFIGS = {  # T <= LINEAR_DECODE_ROWS
    torch.bfloat16: LinearConfig(16, 64, 128, 4, 4, 256, flat=True, split_k_below=64),
    torch.float16: LinearConfig(16, 64, 64, 4, 4, 256),
}
# The prefill band loads its tiles through TMA descriptors (H200, 16,384 rows, bf16, same bits as the
# pointer loads, scratch A/B of 2026-12-04 21:31 UTC: bench q|k|v 0.311 -> 0.255 ms, down 0.181 -> 0.133,
# gate_up 0.370 -> 0.272, lm_head 2.81 -> 2.13, M3 q|k|v 4.71 -> 3.35, M3 o 4.18 -> 3.06; 1.30-1.42x
# cuBLAS instead of 1.73-1.92x; 128 x 256 tiles at 3 or 4 stages alike, 2 stages or 256 x 128 slower).
# fp32 (the router GEMM: N = 128 experts at M3, one column tile of most shapes) has its own prefill
# band from FP32_PREFILL_ROWS rows: 64 x 128 tiles, one pipelined loop per tile, never split (a
# split there would write [96, T, 128] fp32 partials, 768 MiB at 16K rows). M3's router [T, 6144] x
# [128, 6144] (H100, 2026-12-06, same bits as the 32 x 32 tile at every T): T = 4,096 / 8,192 /
# 16,384 1.01 / 1.02 / 1.37 ms against 1.13 / 2.13 / 4.03 with 32 x 32 tiles (cuBLAS 0.21 / 0.33 /
# 0.59); below 4,096 rows the unsplit wide tile loses (T = 512: 0.93 vs 0.19 ms), so the middle
# band's small tile stays there.
LINEAR_PREFILL_CONFIGS = {  # T >= LINEAR_PREFILL_ROWS (fp32: FP32_PREFILL_ROWS)
    torch.bfloat16: LinearConfig(128, 256, 64, 8, 3, 256, flat=True, tma=True),
    torch.float16: LinearConfig(128, 256, 64, 8, 3, 256, flat=True, tma=True),
    torch.float32: LinearConfig(64, 128, 32, 4, 3, 64, flat=True, split_k_below=0),
}
LINEAR_DECODE_ROWS = 32
LINEAR_PREFILL_ROWS = 512
FP32_PREFILL_ROWS = 4096
# Split the K chunks over programs when the (row tile, column tile) grid has fewer programs than
# this (decode-sized steps: a 1-row x 1024-wide projection is 16 programs otherwise). The choice
# depends on T; the bits do not (LinearConfig.k_chunk). The bf16 decode band sets its own 64
# (``LinearConfig.split_k_below``, about half the SMs of an H100 / H200): from 64 output tiles up
# its one pipelined K loop per tile streams the weights at the skinny GEMM's rate, where split
# programs of one 32 KB chunk each ran 10-100 % slower (M3's projections at 1 and 32 rows, H100
# 2026-12-06, docs/benchmarks.md). The other bands (nested chunk loops in the middle band, not
# measured at M3 shapes) and the fp32 router GEMM's small-tile bands (1-4 tiles at decode: always
# split) keep this one; fp32's prefill band never splits.
SPLIT_K_BELOW_PROGRAMS = 264  # 2 x the H200's 132 SMs


# The split launch combines its chunk partials itself: the last program of each output tile to
# finish adds them in chunk order (kernels/split_k.py), saving the combine launch (~1.9 us each,
# 39 per bench-model decode step). False (or no counter buffer: first call inside a CUDA-graph
# capture): a separate _linear_combine_kernel pass. Same bits every way.
SPLIT_K_FUSED_COMBINE = True

# The routed experts' tiles: aligned layout (every local expert padded to 64 rows), no TMA, no
# permuted copy, no ragged tiles; K summed in chunks of 256 (H 1024: 4 chunks, I 512: 2), split
# over programs below SPLIT_K_BELOW_PROGRAMS tiles (decode: 4 active 64-row tiles at T=1 would
# give the gate/up GEMM 32 programs), same bits either way (kernels/moe_chunked.py). Untuned first
# choice, see the module docstring. flat (one pipelined K loop per unsplit tile, the linear's
# prefill rule; same additions) is off until measured on a GPU: at real M3 shapes the chunked MoE
# is half of the invariant prefill's extra time (16K tokens: 51.9 vs 26.2 ms, H100 2026-12-06);
# ``profile_engine.py --variants invariant invariant+moe_flat --prefill-kernel-table`` is the A/B.
INVARIANT_MOE_CONFIG = fm.MoEKernelConfig(
    64,
    GemmTile(64, 64, 4, 3, 4),
    GemmTile(64, 64, 4, 3, 4),
    k_chunk=256,
    split_k_below=SPLIT_K_BELOW_PROGRAMS,
)

# Decode band of the routed experts: up to MOE_DECODE_ROWS tokens, every active expert is padded to
# 16 rows instead of 64 (at batch 32 of the bench model, 16 experts top-4: ~8 rows per expert, so
# 4x fewer padded rows gathered and multiplied).
MOE_DECODE_ROWS = 32
MOE_DECODE_BLOCK_M = 16

LOGPROB_BLOCK = 1024  # vocabulary chunk of token_logprobs


def linear_config(dtype: torch.dtype, t: int | None = None) -> LinearConfig:
    """The launch configuration of ``linear`` for activations of ``dtype`` and ``t`` rows (None: the
    middle one, whose ``k_chunk`` every configuration of the dtype shares): ``LINEAR_DECODE_CONFIGS``
    up to ``LINEAR_DECODE_ROWS`` rows, ``LINEAR_PREFILL_CONFIGS`` from ``LINEAR_PREFILL_ROWS`` (fp32:
    ``FP32_PREFILL_ROWS``), ``LINEAR_CONFIGS`` between (same bits every way, see above). Raises
    ValueError for dtypes the kernel does not take."""
    if dtype not in LINEAR_CONFIGS:
        raise ValueError(f"invariant linear: dtype {dtype} not supported (bf16 / fp16 / fp32)")
    if t is not None and t <= LINEAR_DECODE_ROWS and dtype in LINEAR_DECODE_CONFIGS:
        return LINEAR_DECODE_CONFIGS[dtype]
    prefill_rows = FP32_PREFILL_ROWS if dtype == torch.float32 else LINEAR_PREFILL_ROWS
    if t is not None and t >= prefill_rows and dtype in LINEAR_PREFILL_CONFIGS:
        return LINEAR_PREFILL_CONFIGS[dtype]
    return LINEAR_CONFIGS[dtype]


def moe_config(dtype: torch.dtype, t: int | None = None) -> fm.MoEKernelConfig:
    """The fused-MoE config of ``fused_experts`` for activations of ``dtype`` and ``t`` tokens (None:
    the middle one; fp32 pipelines less deep): ``INVARIANT_MOE_CONFIG``, with ``MOE_DECODE_BLOCK_M``
    rows per tile (the per-expert padding) up to ``MOE_DECODE_ROWS`` tokens. Only the tile height
    changes, so a (token, slot) row meets the same K chunks and K steps (same bits, as ``linear``'s
    row bands)."""
    cfg = INVARIANT_MOE_CONFIG
    if t is not None and t <= MOE_DECODE_ROWS:
        cfg = dataclasses.replace(cfg, block_m=MOE_DECODE_BLOCK_M)
    return fm.config_for_dtype(cfg, dtype)


# ----------------------------------------------------------------------------- GEMM
@triton.jit
def _chunk_dot(
    x_ptrs,
    w_ptrs,
    mm,
    mn,
    ok,
    k_lo,
    K,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    K_CHUNK: tl.constexpr,
    PRECISION: tl.constexpr,
):
    # sum over k in [k_lo, min(k_lo + K_CHUNK, K)) of x[m, k] * w[n, k], from zero, in BLOCK_K steps
    part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    x_ptrs += k_lo
    w_ptrs += k_lo
    for k0 in range(k_lo, tl.minimum(k_lo + K_CHUNK, K), BLOCK_K):
        mk = ok < K - k0
        a = tl.load(x_ptrs, mask=mm[:, None] & mk[None, :], other=0.0)
        b = tl.load(w_ptrs, mask=mk[:, None] & mn[None, :], other=0.0)
        part = tl.dot(a, b, part, input_precision=PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    return part


@triton.jit(do_not_specialize=["M"])  # one compiled kernel for every T: no specialisation on the row count
def _linear_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    out_ptr,
    part_ptr,
    count_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    K_CHUNK: tl.constexpr,
    SPLIT: tl.constexpr,
    FUSED_COMBINE: tl.constexpr,
    PRECISION: tl.constexpr,
    FLAT: tl.constexpr = False,
):
    # out[m, n] = sum_k x[m, k] * w[n, k] (+ b[n]). Program (row tile, column tile[, K chunk]).
    # SPLIT=False: this program sums every K chunk's partial (each from zero) in chunk order into
    # an fp32 accumulator, adds the bias, rounds once. SPLIT=True: it stores its one chunk's
    # partial (fp32) to part_ptr[chunk, m, n]; then the same additions are made by the tile's last
    # program to finish (FUSED_COMBINE, kernels/split_k.py) or by _linear_combine_kernel.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    om = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    on = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = tl.arange(0, BLOCK_K)
    mm = om < M
    mn = on < N
    x_ptrs = x_ptr + om[:, None].to(tl.int64) * stride_xm + ok[None, :]  # [BM, BK]
    w_ptrs = w_ptr + on[None, :].to(tl.int64) * stride_wn + ok[:, None]  # [BK, BN]
    o_ptrs = out_ptr + om[:, None].to(tl.int64) * stride_om + on[None, :]
    if SPLIT:
        n_chunks = tl.cdiv(K, K_CHUNK)
        p_ptrs = part_ptr + om[:, None].to(tl.int64) * N + on[None, :]  # chunk 0's [BM, BN] block
        c = tl.program_id(2)  # this program's K chunk
        part = _chunk_dot(x_ptrs, w_ptrs, mm, mn, ok, c * K_CHUNK, K, BLOCK_M, BLOCK_N, BLOCK_K, K_CHUNK, PRECISION)
        tl.store(p_ptrs + c * (M.to(tl.int64) * N), part, mask=mm[:, None] & mn[None, :])
        if FUSED_COMBINE:
            tile = pid_m * tl.num_programs(1) + pid_n
            if last_to_arrive(count_ptr + tile, tl.num_programs(2)):
                acc = combine_chunks(p_ptrs, M.to(tl.int64) * N, n_chunks, mm[:, None] & mn[None, :], BLOCK_M, BLOCK_N)
                if HAS_BIAS:
                    acc += tl.load(b_ptr + on, mask=mn, other=0.0).to(tl.float32)[None, :]
                tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mm[:, None] & mn[None, :])
                reset_counter(count_ptr + tile)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if FLAT:
            # one software-pipelined loop over BLOCK_K steps; at each chunk end the chunk's partial
            # (from zero) is added to acc and restarts from zero: the nested loop's additions, in its
            # order, without a pipeline drain at every chunk (H200: ~1.2-1.5x faster at 16K rows)
            part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                mk = ok < K - k0
                a = tl.load(x_ptrs + k0, mask=mm[:, None] & mk[None, :], other=0.0)
                b = tl.load(w_ptrs + k0, mask=mk[:, None] & mn[None, :], other=0.0)
                part = tl.dot(a, b, part, input_precision=PRECISION)
                acc, part = fold_chunk(acc, part, k0, K, BLOCK_K, K_CHUNK)
        else:
            for k_lo in range(0, K, K_CHUNK):
                acc += _chunk_dot(x_ptrs, w_ptrs, mm, mn, ok, k_lo, K, BLOCK_M, BLOCK_N, BLOCK_K, K_CHUNK, PRECISION)
        if HAS_BIAS:
            acc += tl.load(b_ptr + on, mask=mn, other=0.0).to(tl.float32)[None, :]
        tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mm[:, None] & mn[None, :])


@triton.jit(do_not_specialize=["M"])
def _linear_tma_kernel(
    x_desc,
    w_desc,
    b_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_om,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    K_CHUNK: tl.constexpr,
):
    # _linear_kernel's FLAT, unsplit loop with the x [BM, BK] and weight [BN, BK] tiles loaded by TMA
    # (x_desc over x [M, K], w_desc over weight [N, K]; out-of-range elements read as zero, as the
    # pointer loads' masks give): the same dots in the same K steps, chunk partials added in order.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    om = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    on = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = x_desc.load([pid_m * BLOCK_M, k0])
        b = w_desc.load([pid_n * BLOCK_N, k0])
        part = tl.dot(a, tl.trans(b), part)
        acc, part = fold_chunk(acc, part, k0, K, BLOCK_K, K_CHUNK)
    mm = om < M
    mn = on < N
    if HAS_BIAS:
        acc += tl.load(b_ptr + on, mask=mn, other=0.0).to(tl.float32)[None, :]
    o_ptrs = out_ptr + om[:, None].to(tl.int64) * stride_om + on[None, :]
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mm[:, None] & mn[None, :])


def _tma_aligned(*tensors: torch.Tensor) -> bool:
    """Whether TMA descriptors can cover these 2-D tensors: the descriptor class exists, 16-byte
    aligned bases and row strides, contiguous last dim."""
    return TensorDescriptor is not None and all(
        t.stride(1) == 1 and t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0 for t in tensors
    )


@triton.jit(do_not_specialize=["M"])
def _linear_combine_kernel(
    part_ptr, b_ptr, out_ptr, M, N, n_chunks, stride_om, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr
):
    # out[m, n] = ((0 + part[0, m, n]) + part[1, m, n]) + ... (+ b[n]), rounded once: the additions
    # _linear_kernel makes without SPLIT, in the same order. One program per BLOCK elements of row m.
    m = tl.program_id(0).to(tl.int64)
    on = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mn = on < N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for c in range(0, n_chunks):
        acc += tl.load(part_ptr + (c * M + m) * N + on, mask=mn, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + on, mask=mn, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * stride_om + on, acc.to(out_ptr.dtype.element_ty), mask=mn)


def _check_linear_config(cfg: LinearConfig, dtype: torch.dtype) -> None:
    """Raises ValueError, naming the rule, unless ``cfg`` is a launch configuration ``linear`` can
    run for ``dtype`` and sums K as every band's configuration of ``dtype`` does (``linear``'s cfg
    argument): int fields; block_m / block_n powers of two >= 16; warps 1-16 (a power of two),
    stages >= 1; split_k_below None or >= 0; the dtype's k_chunk (another chunk changes the bits);
    the dtype's block_k, except for bf16, where any power of two >= 16 that divides half a chunk
    gives the same bits (a chain of 16-deep MMAs either way: tests/gpu/test_invariant_ops_gpu.py;
    the decode band steps 128, the others 64), and never a one-step chunk (the compiler may fold
    a chunk's single dot into the running sum)."""
    own = linear_config(dtype)
    fields = ("block_m", "block_n", "block_k", "num_warps", "num_stages", "k_chunk")
    bad = [f for f in fields if type(getattr(cfg, f)) is not int]  # noqa: E721 - bool / float are refused
    if bad:
        raise ValueError(f"invariant linear: cfg {bad} must be ints, got {cfg}")
    pow2 = lambda v: v >= 16 and v & (v - 1) == 0  # noqa: E731
    if not (pow2(cfg.block_m) and pow2(cfg.block_n)):
        raise ValueError(f"invariant linear: cfg tile {cfg.block_m} x {cfg.block_n}; both must be powers of two >= 16")
    if cfg.num_warps not in (1, 2, 4, 8, 16) or cfg.num_stages < 1:
        raise ValueError(
            f"invariant linear: cfg num_warps {cfg.num_warps} / num_stages {cfg.num_stages}; "
            "warps 1, 2, 4, 8 or 16 and stages >= 1"
        )
    below = cfg.split_k_below
    if below is not None and (type(below) is not int or below < 0):  # noqa: E721
        raise ValueError(f"invariant linear: cfg split_k_below {below!r}; None or an int >= 0 (output tiles)")
    if cfg.k_chunk != own.k_chunk:
        raise ValueError(
            f"invariant linear: cfg k_chunk {cfg.k_chunk}; {dtype} sums K in chunks of {own.k_chunk} "
            "(another chunk changes the bits)"
        )
    if dtype == torch.bfloat16:
        if not pow2(cfg.block_k) or cfg.k_chunk % (2 * cfg.block_k):
            raise ValueError(
                f"invariant linear: cfg block_k {cfg.block_k}; bf16 takes K steps that are powers of two >= 16 "
                f"dividing half the k_chunk {cfg.k_chunk} (at least two steps per chunk)"
            )
    elif cfg.block_k != own.block_k:
        raise ValueError(
            f"invariant linear: cfg block_k {cfg.block_k}; {dtype} sums each chunk in K steps of "
            f"{own.block_k} (another step gives other bits here)"
        )


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, cfg: LinearConfig | None = None
) -> torch.Tensor:
    """Batch-invariant ``F.linear``: x [T, K] @ weight [N, K]^T (+ bias [N]) -> [T, N] in x.dtype.

    x, weight: one dtype of bf16 / fp16 / fp32, last dim contiguous (row strides free); bias any
    float dtype, added in fp32 before the one rounding. fp32 inputs use exact fp32 products
    ("ieee", no TF32): the router GEMM. T may be 0. Row t of the result depends only on x[t] and
    the weights (module docstring); it equals ``F.linear`` up to fp32 summation order. A launch of
    fewer than ``cfg.split_k_below`` (default ``SPLIT_K_BELOW_PROGRAMS``) output tiles with more
    than one K chunk runs its chunks as separate programs (fp32 partials [chunks, T, N]; the last
    program of each output tile to finish adds them, or ``_linear_combine_kernel`` without
    ``SPLIT_K_FUSED_COMBINE``): the same additions in the same order, so the same bits
    (``LinearConfig.k_chunk``).
    cfg: a launch configuration other than the dtype's (scripts/bench_invariant_linear.py sweeps
    them; the engine never passes one); its k_chunk must be the dtype's and its block_k too, except
    for bf16, which takes any K step >= 16 dividing half a chunk (``_check_linear_config``: another
    K chunk gives other bits, and a k_chunk that is not a multiple of block_k would sum a chunk's
    overhang twice). Raises ValueError on shape / dtype / layout mismatches and on such a cfg.
    """
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(
            f"invariant linear: x {tuple(x.shape)} and weight {tuple(weight.shape)} must be [T, K], [N, K]"
        )
    if weight.dtype != x.dtype:
        raise ValueError(f"invariant linear: weight dtype {weight.dtype} != x dtype {x.dtype}")
    if cfg is None:
        cfg = linear_config(x.dtype, x.shape[0])
    else:
        _check_linear_config(cfg, x.dtype)
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("invariant linear: x and weight need a contiguous last dim")
    t, k = x.shape
    n = weight.shape[0]
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"invariant linear: bias {tuple(bias.shape)}, expected [{n}]")
    out = torch.empty(t, n, dtype=x.dtype, device=x.device)
    if t == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_() if bias is None else out.copy_(bias.expand(t, n))
    tiles = (triton.cdiv(t, cfg.block_m), triton.cdiv(n, cfg.block_n))
    chunks = triton.cdiv(k, cfg.k_chunk)
    below = SPLIT_K_BELOW_PROGRAMS if cfg.split_k_below is None else cfg.split_k_below
    split = chunks > 1 and tiles[0] * tiles[1] < below
    if cfg.tma and cfg.flat and not split and x.dtype != torch.float32 and _tma_aligned(x, weight):
        _linear_tma_kernel[tiles](
            TensorDescriptor.from_tensor(x, [cfg.block_m, cfg.block_k]),
            TensorDescriptor.from_tensor(weight, [cfg.block_n, cfg.block_k]),
            bias if bias is not None else weight,
            out,
            t,
            n,
            k,
            out.stride(0),
            HAS_BIAS=bias is not None,
            BLOCK_M=cfg.block_m,
            BLOCK_N=cfg.block_n,
            BLOCK_K=cfg.block_k,
            K_CHUNK=cfg.k_chunk,
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )
        return out
    part = torch.empty(chunks, t, n, dtype=torch.float32, device=x.device) if split else out
    counters = tile_counters(x.device, tiles[0] * tiles[1]) if split and SPLIT_K_FUSED_COMBINE else None
    _linear_kernel[(*tiles, chunks) if split else tiles](
        x,
        weight,
        bias if bias is not None else weight,
        out,
        part,
        counters if counters is not None else part,
        t,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        HAS_BIAS=bias is not None,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        K_CHUNK=cfg.k_chunk,
        SPLIT=split,
        FUSED_COMBINE=counters is not None,
        PRECISION=dot_precision(x.dtype),
        FLAT=cfg.flat,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if split and counters is None:
        block = 1024
        _linear_combine_kernel[(t, triton.cdiv(n, block))](
            part, bias if bias is not None else part, out, t, n, chunks, out.stride(0),
            HAS_BIAS=bias is not None, BLOCK=block, num_warps=4,
        )  # fmt: skip
    return out


# ----------------------------------------------------------------------------- norms, router
add_rms_norm = fl.add_rms_norm  # already row-invariant (module docstring): the same function


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma RMSNorm of x [T, N] (scale 1 + weight [N]) -> [T, N] in x.dtype: ``add_rms_norm``
    without residual; one program per row (invariant, see the module docstring)."""
    return fl.add_rms_norm(x, weight, eps)[0]


def router_gemm_topk_never(num_tokens: int, gate_weight: torch.Tensor) -> bool:
    """``PagedOps.router_gemm_topk_ok`` of the invariant table: always False, so every step takes
    the same router route (fp32 ``linear`` + ``router_topk``) whatever its number of tokens."""
    return False


# ----------------------------------------------------------------------------- routed experts
def fused_experts(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    *,
    alpha: float,
    limit: float,
    beta: float = 1.0,
    expert_range: tuple[int, int] | None = None,
) -> torch.Tensor:
    """``m3_kernels.fused_moe.fused_experts`` (same arguments, shapes and maths: x [T, H], ids /
    weights [T, K], w13 [E, 2I, H], w2 [E, H, I] -> [T, H] in x.dtype) with the tile config
    ``moe_config(x.dtype, T)``: token t's output depends only on x[t], its ids and weights (module
    docstring), whichever way the K chunks run (one program, or split at decode sizes).
    Cost: every local expert with rows is padded to 64 rows (16 up to ``MOE_DECODE_ROWS`` tokens)."""
    return fm.fused_experts(
        x,
        ids,
        weights,
        w13,
        w2,
        alpha=alpha,
        limit=limit,
        beta=beta,
        expert_range=expert_range,
        config=moe_config(x.dtype, x.shape[0]),
    )


# ----------------------------------------------------------------------------- log-softmax
@triton.jit
def _token_logprob_kernel(x_ptr, tok_ptr, out_ptr, stride_x, V, BLOCK: tl.constexpr):
    # out[r] = x[r, tok[r]] - (max_r + log(sum_v exp(x[r, v] - max_r))) in fp32; chunks of BLOCK
    # in order, per-lane partial sums, one tl.sum tree at the end.
    r = tl.program_id(0).to(tl.int64)
    row = x_ptr + r * stride_x
    offs = tl.arange(0, BLOCK)
    m = tl.full((BLOCK,), float("-inf"), tl.float32)
    for v0 in range(0, V, BLOCK):
        xv = tl.load(row + v0 + offs, mask=offs < V - v0, other=float("-inf")).to(tl.float32)
        m = tl.maximum(m, xv)
    mx = tl.max(m, axis=0)
    s = tl.zeros((BLOCK,), dtype=tl.float32)
    for v0 in range(0, V, BLOCK):
        xv = tl.load(row + v0 + offs, mask=offs < V - v0, other=float("-inf")).to(tl.float32)
        s += tl.exp(xv - mx)
    lse = mx + tl.log(tl.sum(s, axis=0))
    tok = tl.load(tok_ptr + r).to(tl.int64)
    tl.store(out_ptr + r, tl.load(row + tok).to(tl.float32) - lse)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log_softmax(logits[r])[tokens[r]] for every row r, batch-invariant.

    logits: [N, V] bf16 / fp16 / fp32 (upcast to fp32 in the kernel), last dim contiguous;
    tokens: [N] integer ids in [0, V) (not checked on the device). Returns fp32 [N]. One program
    per row walks the vocabulary in LOGPROB_BLOCK chunks in order (max pass, then sum-of-exp
    pass), so a row's value does not depend on N; equals ``torch.log_softmax(...).gather(...)``
    up to fp32 summation order. Raises ValueError on bad shapes / dtypes.
    """
    if logits.dim() != 2 or logits.dtype not in _DTYPES or logits.stride(1) != 1:
        raise ValueError(
            f"token_logprobs: logits must be [N, V] bf16/fp16/fp32 with a contiguous last dim, "
            f"got {tuple(logits.shape)} {logits.dtype}"
        )
    n, v = logits.shape
    if tuple(tokens.shape) != (n,) or tokens.dtype.is_floating_point:
        raise ValueError(f"token_logprobs: tokens must be integer [{n}], got {tuple(tokens.shape)} {tokens.dtype}")
    out = torch.empty(n, dtype=torch.float32, device=logits.device)
    if n == 0:
        return out
    _token_logprob_kernel[(n,)](logits, tokens.contiguous(), out, logits.stride(0), v, BLOCK=LOGPROB_BLOCK, num_warps=4)
    return out

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
ticket decides WHO combines, never the order): the same additions either way. With ``WHOLE_K``
(on by default) a bf16 / fp16 GEMM whose K is at least ``WHOLE_K_MIN_K`` sums K as one chain instead, in
every band, never split (the rule reads K alone, so it is the same in every band too).
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
- ``fused_experts``: ``m3_kernels.fused_moe.fused_experts`` with the tile configs of
  ``moe_config`` (aligned 16-row tiles up to ``MOE_DECODE_ROWS`` tokens, aligned 64-row tiles,
  ragged tiles from ``MOE_PREFILL_ROWS``) instead of ``default_config``. Every layout is
  row-independent (each tile row is one (token, slot) pair; padding rows are never stored), both
  GEMMs sum K in chunks (``k_chunk``, split over programs at decode sizes: kernels/moe_chunked.py;
  folded at chunk ends in one loop otherwise, kernels/moe_ragged.py too), so a row's bits do not
  depend on the tile it lands in, and the combine sums a token's K slots in slot order
  k = 0..K-1 in fp32.
- ``rms_norm`` / ``add_rms_norm``: ``m3_kernels.fused_layers.add_rms_norm`` itself. It is already
  invariant: one program per row, the row read in one BLOCK = next_pow2(N) vector, one ``tl.sum``
  tree and num_warps both fixed by N alone; nothing is duplicated here. The same holds (and the
  invariant table reuses them) for ``qkv_norm_rope_write`` (one program per (token, head), block
  next_pow2(head dim)), ``swiglu`` (element-wise) and ``router_topk`` (one program per row).
  Its sibling ``fused_layers.router_gemm_topk`` is row-invariant too, but its per-token GEMM sums
  H in another order than ``linear``, and the model takes it only for decode-sized steps
  (``router_gemm_topk_ok(T, ...)``): a choice that depends on T must not change the bits, so the
  invariant table has its own ``router_gemm_topk`` (below).
- ``router_gemm_topk(x [T, H], W_gate [E, H] fp32, bias, top_k, scaling) -> (weights, ids)``: the
  fp32 router logits with ``linear(x.float(), W_gate)``'s bits (its fp32 K chunks and steps, one
  program per token and chunk, the partials added in chunk order by the token's last program) and
  ``router_topk``'s top-k on them (the same jit helper), in one launch: the bits of ``linear`` +
  ``router_topk``, so the table's ``router_gemm_topk_ok`` may follow T (decode-sized steps of a
  small router; ``router_gemm_topk_never`` / ``ROUTER_GEMM_TOPK_FUSE`` off: always two launches).
- ``linear_swiglu(x [T, K], gate_up [2I, K], alpha, limit, beta) -> [T, I]``: decode-sized steps'
  gate|up GEMM with SwiGLU-OAI in its epilogue, each program a gate tile and its up tile summed as
  ``linear`` sums them, rounded as ``linear`` stores them, then ``swiglu``'s expression: the bits
  of ``linear`` + ``swiglu`` in one launch (``linear_swiglu_ok``: T <= ``LINEAR_DECODE_ROWS``).
- ``token_logprobs(logits [N, V], tokens [N]) -> fp32 [N]``: log_softmax(row)[token]: each fixed
  LOGPROB_SEGMENT-wide vocabulary segment's max and sum of exp in its own program, then one
  program per row combining them in one fixed tree; the same op in the eager sampler, the decode
  graphs (with the temperature division in the launch) and the trainer's scorer.

Cost: fixed tiles are the compromise between decode (few rows: the GEMM is bound by streaming the
weights) and prefill (many rows); the MoE pads every expert to 64 rows (16 in its decode band and
from MOE_PREFILL_ROWS, its ragged prefill band). H200, 300M bench model
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
from m3_kernels.fused_layers import swiglu_oai_act, topk_store
from m3_kernels.moe_tiles import GemmTile, dot_precision
from m3_kernels.split_k import (
    WHOLE_K_CHUNK,
    combine_chunks,
    k_step,
    k_step_pair,
    last_to_arrive,
    reset_counter,
    tile_counters,
)

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
# On the H100 (2026-12-06, M3's seven prefill GEMM shapes at 16,384 rows, same bits) 4 stages beat 3:
# 34.2 vs 37.7 ms in all (cuBLAS 26.8; at 2,048 rows 3.32 vs 3.38, cuBLAS 2.42); 128 x 128 tiles
# (no spills) 36.0 / 34.6 ms at 64 / 128-wide K steps (3 stages); grouping the programs by 4-32 row
# tiles for L2 reuse of x changed the sum by -1.7 % to +1.4 %. The chunk fold's own cost: one
# chunk for all of K (other bits, a bound) 22.8 against 26.0 ms on six of the shapes at 3 stages.
# fp32 (the router GEMM: N = 128 experts at M3, one column tile of most shapes) has its own prefill
# band from FP32_PREFILL_ROWS rows: 64 x 128 tiles, one pipelined loop per tile, never split (a
# split there would write [96, T, 128] fp32 partials, 768 MiB at 16K rows). M3's router [T, 6144] x
# [128, 6144] (H100, 2026-12-06, same bits as the 32 x 32 tile at every T): T = 4,096 / 8,192 /
# 16,384 1.01 / 1.02 / 1.37 ms against 1.13 / 2.13 / 4.03 with 32 x 32 tiles (cuBLAS 0.21 / 0.33 /
# 0.59); below 4,096 rows the unsplit wide tile loses (T = 512: 0.93 vs 0.19 ms), so the middle
# band's small tile stays there.
LINEAR_PREFILL_CONFIGS = {  # T >= LINEAR_PREFILL_ROWS (fp32: FP32_PREFILL_ROWS)
    torch.bfloat16: LinearConfig(128, 256, 64, 8, 4, 256, flat=True, tma=True),
    torch.float16: LinearConfig(128, 256, 64, 8, 4, 256, flat=True, tma=True),
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

# Whole-K weights (issue 24's prefill cost at real M3 shapes), on since checked on a GPU: the K
# chunks let a decode launch too narrow to fill the GPU split K over programs; at M3's widths the
# fused path's decode GEMMs fill it unsplit (packed q|k|v|index 9,856 columns, o / down 6,144,
# routed experts 4 x 48-96 column tiles), so the fold buys them nothing and costs their prefill
# GEMMs a second accumulator (M3's six bf16 prefill shapes at 16K rows: 26.0 ms folded, 22.8 ms
# with one chunk for all of K; routed experts at 16K tokens w13 / w2 12.4 / 4.9 ms folded, 7.9 / 4.3
# in the fast mode's loop; H100 2026-12-06). True: a bf16 / fp16 GEMM whose K is at least
# WHOLE_K_MIN_K (``linear`` / ``linear_swiglu``: the weight's K; the routed experts: min(H, I), one
# choice for both GEMMs) sums K as one chain from zero in every band, never split: other bits than
# the chunked sum, the same in every band. Every M3 bf16 projection qualifies (K = 3,072 to
# 12,288), none of the 300M bench model's (K <= 2,048). The rule reads K only: the same for a packed
# weight and its parts (q|k|v vs k_proj alone), on every EP rank (the EP path's one-slot calls),
# whatever T or a scheduling constant, so the bits stay batch-invariant. Cost of reading K rather
# than N: a narrow weight run on its own (the unfused fallbacks: k_proj's 512 or the indexer
# key's 128 columns) decodes through a few unsplit programs. Checked on an H100 (2026-12-06): every band
# gives one set of bits at M3 shapes (tests/gpu/test_invariant_ops_gpu.py -k whole_k); the real-shape
# slice's 32K prefill went from +18.0 % to +9.3 % over the fast mode, its decode step +4.9 / +3.6 %.
WHOLE_K = True
WHOLE_K_MIN_K = 3072


def whole_k(dtype: torch.dtype, k: int) -> bool:
    """Whether a batch-invariant GEMM of ``dtype`` sums its reduction axis of length ``k`` in one
    chunk: ``WHOLE_K`` on, bf16 / fp16, k >= ``WHOLE_K_MIN_K``. Depends on k alone (``linear``: the
    weight's K; ``fused_experts``: min(H, I))."""
    return WHOLE_K and dtype in (torch.bfloat16, torch.float16) and k >= WHOLE_K_MIN_K


def _k_plan(dtype: torch.dtype, k: int, cfg: LinearConfig, tiles: tuple[int, int]) -> tuple[bool, int, int, bool]:
    """(whole, K_CHUNK, chunks, split) of a ``linear`` / ``linear_swiglu`` launch of ``tiles``
    output tiles over a K of ``k``: a whole-K weight (``whole_k``) sums K as one chain (K_CHUNK 0,
    one chunk, never split); otherwise chunks of ``cfg.k_chunk``, split over programs when there is
    more than one and fewer output tiles than ``cfg.split_k_below`` (default
    ``SPLIT_K_BELOW_PROGRAMS``)."""
    if whole_k(dtype, k):
        return True, 0, 1, False
    chunks = triton.cdiv(k, cfg.k_chunk)
    below = SPLIT_K_BELOW_PROGRAMS if cfg.split_k_below is None else cfg.split_k_below
    return False, cfg.k_chunk, chunks, chunks > 1 and tiles[0] * tiles[1] < below


# The routed experts' tiles: aligned layout (every local expert padded to 64 rows), no TMA, no
# permuted copy; K summed in chunks of 256 (H 1024: 4 chunks, I 512: 2), split over programs
# below SPLIT_K_BELOW_PROGRAMS tiles (decode: 4 active 64-row tiles at T=1 would give the gate/up
# GEMM 32 programs), an unsplit launch in one pipelined K loop that folds each chunk at its end
# (16K tokens at real M3 shapes: 48.6 ms against 52.5 for one loop per chunk, H100 2026-12-06),
# same bits every way (kernels/moe_chunked.py).
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

# Prefill band of the routed experts, from MOE_PREFILL_ROWS tokens: the fast mode's ragged tiles
# (each expert padded to 16 rows, 128-row tiles plus a 16- to 128-row tail, weights through TMA;
# kernels/moe_ragged.py) with the same 256-wide K chunks folded at their ends: the chunked
# kernels' additions in their order, so the same bits (a row's bits do not depend on its tile's
# MMA height, 16 to 128, nor on the K step; tests/gpu/test_invariant_ops_gpu.py). The chunk
# partials double the accumulators: the fast mode's 128 / 256-column tiles then spill a little
# (ptxas for sm_90: 100-200 bytes of spill stores per thread) and still beat narrower tiles that do not.
# Real M3 shapes (128 experts top-4, H 6144, I 3072), H100 2026-12-06, w13 / w2 ms at 16,384
# tokens: these tiles 12.39 / 4.92 (the fast mode 7.87 / 4.28; the aligned chunked kernels
# 15.2 / 9.9; 64 / 128-column tiles 15.92 / 5.67, with 128-wide K steps 13.91 / 5.51; the fat
# tail 14.3 / 6.1); at 2,048 tokens 3.77 / 1.85 (fast 3.46 / 1.84; the whole aligned chunked call,
# alignment and combine included, 6.31).
MOE_PREFILL_ROWS = 512
INVARIANT_MOE_PREFILL_CONFIG = fm.MoEKernelConfig(
    128,
    GemmTile(128, 64, 8, 3, 4),
    GemmTile(256, 64, 8, 4, 4),
    ragged=True,
    k_chunk=256,
)

LOGPROB_SEGMENT = 2048  # vocabulary entries per program of token_logprobs' first launch


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
    rows per tile (the per-expert padding) up to ``MOE_DECODE_ROWS`` tokens, and
    ``INVARIANT_MOE_PREFILL_CONFIG`` (ragged tiles) from ``MOE_PREFILL_ROWS``. Only the tiles
    change, so a (token, slot) row meets the same K chunks in the same order (same bits, as
    ``linear``'s row bands)."""
    cfg = INVARIANT_MOE_CONFIG
    if t is not None and t <= MOE_DECODE_ROWS:
        cfg = dataclasses.replace(cfg, block_m=MOE_DECODE_BLOCK_M)
    elif t is not None and t >= MOE_PREFILL_ROWS:
        cfg = INVARIANT_MOE_PREFILL_CONFIG
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
                acc, part = k_step(acc, part, a, b, k0, K, BLOCK_K, K_CHUNK, PRECISION)
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
    PRECISION: tl.constexpr,
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
        acc, part = k_step(acc, part, a, tl.trans(b), k0, K, BLOCK_K, K_CHUNK, PRECISION)
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
    whole, k_chunk, chunks, split = _k_plan(x.dtype, k, cfg, tiles)
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
            K_CHUNK=k_chunk,
            PRECISION=dot_precision(x.dtype),
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
        K_CHUNK=k_chunk,
        SPLIT=split,
        FUSED_COMBINE=counters is not None,
        PRECISION=dot_precision(x.dtype),
        FLAT=cfg.flat or whole,
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


# ----------------------------------------------------------------------------- GEMM + SwiGLU (decode)
# The dense MLP's / shared expert's gate|up GEMM with SwiGLU-OAI in its epilogue for decode-sized
# steps (``linear_swiglu_ok``): one launch where ``linear`` + ``fused_layers.swiglu`` take two, the
# same bits (bench model, 8 per decode step, H100 2026-12-06, ``invariant+noswiglu_fuse`` A/B:
# decode forward 0.487 -> 0.482 ms at batch 1, 0.751 -> 0.739 ms at batch 32). False: the two launches
# (``scripts/profile_engine.py --variants invariant+noswiglu_fuse``; read when engine/ops.py
# ``invariant_fields`` builds the table).
LINEAR_SWIGLU_FUSE = True


@triton.jit
def _chunk_dot_pair(
    x_ptrs,
    wg_ptrs,
    wu_ptrs,
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
    # _chunk_dot of the gate tile (wg_ptrs) and of the up tile (wu_ptrs) in one loop: each partial
    # from zero, the same dots in the same K steps (so each has _chunk_dot's bits), the x tile
    # loaded once per step and both weight tiles' loads in flight together
    part_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    part_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_lo, tl.minimum(k_lo + K_CHUNK, K), BLOCK_K):
        mk = ok < K - k0
        a = tl.load(x_ptrs + k0, mask=mm[:, None] & mk[None, :], other=0.0)
        bg = tl.load(wg_ptrs + k0, mask=mk[:, None] & mn[None, :], other=0.0)
        bu = tl.load(wu_ptrs + k0, mask=mk[:, None] & mn[None, :], other=0.0)
        part_g = tl.dot(a, bg, part_g, input_precision=PRECISION)
        part_u = tl.dot(a, bu, part_u, input_precision=PRECISION)
    return part_g, part_u


@triton.jit(do_not_specialize=["M"])
def _linear_swiglu_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    part_ptr,
    count_ptr,
    M,
    I,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    alpha,
    limit,
    beta,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    K_CHUNK: tl.constexpr,
    SPLIT: tl.constexpr,
    PRECISION: tl.constexpr,
    FLAT: tl.constexpr,
):
    # out[m, n] = swiglu(round(x[m] . w[n]), round(x[m] . w[I + n])) for the packed gate|up weight
    # w [2I, K]. Program (row tile, column tile[, K chunk]) sums the gate tile (weight rows n) and
    # the up tile (rows I + n) as _linear_kernel sums any tile of the [T, 2I] product: the same K
    # chunks from zero, K steps, chunk fold (FLAT) or nested chunk loops, partials added in chunk
    # order; rounds each to the output dtype as _linear_kernel stores it (no bias: the MLP's
    # Linears have none), then fused_layers.swiglu_oai_act, the expression of fused_layers.swiglu's
    # kernel, rounded once. SPLIT: the chunk's gate and up partials go to part[chunk, m, n] and
    # part[chunk, m, I + n] (linear's layout of the packed product); the tile's last program to
    # finish combines both in chunk order (kernels/split_k.py), then applies the epilogue.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    om = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    on = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = tl.arange(0, BLOCK_K)
    mm = om < M
    mn = on < I
    mo = mm[:, None] & mn[None, :]
    ACT = out_ptr.dtype.element_ty
    x_ptrs = x_ptr + om[:, None].to(tl.int64) * stride_xm + ok[None, :]  # [BM, BK]
    wg_ptrs = w_ptr + on[None, :].to(tl.int64) * stride_wn + ok[:, None]  # gate rows, [BK, BN]
    wu_ptrs = w_ptr + (on[None, :] + I).to(tl.int64) * stride_wn + ok[:, None]  # up rows
    o_ptrs = out_ptr + om[:, None].to(tl.int64) * stride_om + on[None, :]
    if SPLIT:
        n_chunks = tl.cdiv(K, K_CHUNK)
        chunk = M.to(tl.int64) * (2 * I)  # elements per chunk of part [chunks, M, 2I]
        pg_ptrs = part_ptr + om[:, None].to(tl.int64) * (2 * I) + on[None, :]  # chunk 0's gate block
        pu_ptrs = pg_ptrs + I
        c = tl.program_id(2)  # this program's K chunk
        g, u = _chunk_dot_pair(
            x_ptrs, wg_ptrs, wu_ptrs, mm, mn, ok, c * K_CHUNK, K, BLOCK_M, BLOCK_N, BLOCK_K, K_CHUNK, PRECISION
        )
        tl.store(pg_ptrs + c * chunk, g, mask=mo)
        tl.store(pu_ptrs + c * chunk, u, mask=mo)
        tile = pid_m * tl.num_programs(1) + pid_n
        if last_to_arrive(count_ptr + tile, tl.num_programs(2)):
            acc_g = combine_chunks(pg_ptrs, chunk, n_chunks, mo, BLOCK_M, BLOCK_N)
            acc_u = combine_chunks(pu_ptrs, chunk, n_chunks, mo, BLOCK_M, BLOCK_N)
            act = swiglu_oai_act(acc_g.to(ACT).to(tl.float32), acc_u.to(ACT).to(tl.float32), alpha, limit, beta)
            tl.store(o_ptrs, act.to(ACT), mask=mo)
            reset_counter(count_ptr + tile)
    else:
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if FLAT:  # _linear_kernel's flat loop, the gate and up tiles side by side
            part_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            part_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                mk = ok < K - k0
                a = tl.load(x_ptrs + k0, mask=mm[:, None] & mk[None, :], other=0.0)
                bg = tl.load(wg_ptrs + k0, mask=mk[:, None] & mn[None, :], other=0.0)
                bu = tl.load(wu_ptrs + k0, mask=mk[:, None] & mn[None, :], other=0.0)
                acc_g, part_g, acc_u, part_u = k_step_pair(
                    acc_g, part_g, acc_u, part_u, a, bg, bu, k0, K, BLOCK_K, K_CHUNK, PRECISION
                )
        else:
            for k_lo in range(0, K, K_CHUNK):
                g, u = _chunk_dot_pair(
                    x_ptrs, wg_ptrs, wu_ptrs, mm, mn, ok, k_lo, K, BLOCK_M, BLOCK_N, BLOCK_K, K_CHUNK, PRECISION
                )
                acc_g += g
                acc_u += u
        act = swiglu_oai_act(acc_g.to(ACT).to(tl.float32), acc_u.to(ACT).to(tl.float32), alpha, limit, beta)
        tl.store(o_ptrs, act.to(ACT), mask=mo)


def linear_swiglu_ok(num_tokens: int) -> bool:
    """``PagedOps.linear_swiglu_ok`` of the invariant table: whether a step of ``num_tokens`` rows
    runs the dense MLP's / shared expert's gate|up GEMM as ``linear_swiglu`` (one launch): up to
    ``LINEAR_DECODE_ROWS`` rows, the decode band. The rule depends on T alone, and either route
    gives the same bits; the middle and prefill bands keep ``linear`` + ``swiglu``."""
    return num_tokens <= LINEAR_DECODE_ROWS


def linear_swiglu(x: torch.Tensor, weight: torch.Tensor, alpha: float, limit: float, beta: float = 1.0) -> torch.Tensor:
    """``fused_layers.swiglu(linear(x, weight), alpha, limit, beta)`` in one launch, bitwise equal.

    x: [T, K] with T <= ``LINEAR_DECODE_ROWS`` (decode-sized; ``linear_swiglu_ok``); weight: the
    packed gate|up weight [2I, K] (gate rows first), x's dtype, one of bf16 / fp16 / fp32; last dims
    contiguous (row strides free). Returns SwiGLU-OAI [T, I] in x.dtype (spec §3.7). Each program
    computes a gate tile and the matching up tile with ``linear``'s configuration for T rows
    (``linear_config``; half its block_n per tile, so a program streams as many weight rows as a
    ``linear`` program of the packed GEMM), the same K chunks, K steps and fold order, so gate and
    up each have ``linear``'s bits (a row's bits depend on neither the tile width nor its position,
    see ``LINEAR_CONFIGS``), rounded to x.dtype as ``linear`` stores them; then the activation with
    ``swiglu``'s expression in fp32, rounded once. Fewer output tiles than the band's split_k_below
    (``SPLIT_K_BELOW_PROGRAMS``) with several K chunks: the chunks run as separate programs and the
    last one of a tile combines gate and up in chunk order before the epilogue; without an in-kernel
    combine (``SPLIT_K_FUSED_COMBINE`` off, or no counter buffer during a CUDA-graph capture) the
    two launches run instead (same bits). Raises ValueError on shape / dtype / layout mismatches,
    an odd weight row count or T > ``LINEAR_DECODE_ROWS``.
    """
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1] or weight.shape[0] % 2:
        raise ValueError(
            f"invariant linear_swiglu: x {tuple(x.shape)} and weight {tuple(weight.shape)} must be [T, K], "
            "[2I, K] (packed gate|up)"
        )
    if weight.dtype != x.dtype:
        raise ValueError(f"invariant linear_swiglu: weight dtype {weight.dtype} != x dtype {x.dtype}")
    t, k = x.shape
    if t > LINEAR_DECODE_ROWS:
        raise ValueError(
            f"invariant linear_swiglu: {t} rows; the fused launch is for decode-sized steps (<= "
            f"{LINEAR_DECODE_ROWS}): use linear + fused_layers.swiglu"
        )
    cfg = linear_config(x.dtype, t)  # ValueError for dtypes linear does not take
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("invariant linear_swiglu: x and weight need a contiguous last dim")
    i = weight.shape[0] // 2
    if t == 0 or i == 0 or k == 0:  # nothing to sum: the two-launch definition
        return fl.swiglu(linear(x, weight), alpha, limit, beta)
    block_n = max(16, cfg.block_n // 2)
    tiles = (triton.cdiv(t, cfg.block_m), triton.cdiv(i, block_n))
    whole, k_chunk, chunks, split = _k_plan(x.dtype, k, cfg, tiles)  # linear's choice for this weight
    counters = tile_counters(x.device, tiles[0] * tiles[1]) if split and SPLIT_K_FUSED_COMBINE else None
    if split and counters is None:
        return fl.swiglu(linear(x, weight), alpha, limit, beta)
    out = torch.empty(t, i, dtype=x.dtype, device=x.device)
    part = torch.empty(chunks, t, 2 * i, dtype=torch.float32, device=x.device) if split else out
    _linear_swiglu_kernel[(*tiles, chunks) if split else tiles](
        x,
        weight,
        out,
        part,
        counters if counters is not None else part,
        t,
        i,
        k,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        alpha,
        limit,
        beta,
        BLOCK_M=cfg.block_m,
        BLOCK_N=block_n,
        BLOCK_K=cfg.block_k,
        K_CHUNK=k_chunk,
        SPLIT=split,
        PRECISION=dot_precision(x.dtype),
        FLAT=cfg.flat or whole,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out


# ----------------------------------------------------------------------------- norms, router
add_rms_norm = fl.add_rms_norm  # already row-invariant (module docstring): the same function


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma RMSNorm of x [T, N] (scale 1 + weight [N]) -> [T, N] in x.dtype: ``add_rms_norm``
    without residual; one program per row (invariant, see the module docstring)."""
    return fl.add_rms_norm(x, weight, eps)[0]


def router_gemm_topk_never(num_tokens: int, gate_weight: torch.Tensor) -> bool:
    """``PagedOps.router_gemm_topk_ok`` of the invariant table with ``ROUTER_GEMM_TOPK_FUSE`` off:
    always False, so every step takes the two-launch router route (fp32 ``linear`` +
    ``router_topk``) whatever its number of tokens (the same bits as ``router_gemm_topk``)."""
    return False


# The router's fp32 GEMM and its top-k in one launch for decode-sized steps of a small router
# (``router_gemm_topk_ok``): where ``linear`` + ``router_topk`` take two launches (bench model: a
# split-K ``linear`` of 16 chunk programs, then ``router_topk``, 1.9 us), the same bits. False: the
# two launches at every T (``router_gemm_topk_never``; ``scripts/profile_engine.py --variants
# invariant+norouter_fuse``; read when engine/ops.py ``invariant_fields`` builds the table).
ROUTER_GEMM_TOPK_FUSE = True
# Size limit of the fused router launch, in T x E x H weight elements read. Every (token, K chunk)
# program reads its chunk's [E, 64] slice of W_gate (from L2 after the first token's program: W_gate
# comes from HBM once), so a launch reads T x E x H fp32 through L2, and the last program of a
# token adds H / 64 partials of E values. Up to 1 << 20 elements (4 MB of L2 reads; the bench
# model's 16 x 1024 router up to 32 rows: 2 MB) that is a few hundred ns of L2 bandwidth, less than
# the launch it saves; M3's 128 x 6144 router (3 MB) fits at 1 row only (96 chunk programs, as many
# as ``linear`` runs per column tile there), and from 2 rows the split ``linear`` over 32 x 32 tiles
# (each weight element read once per 32 rows) + ``router_topk`` reads less. The limit itself is not
# tuned; the fusion was measured on the bench model (``profile_engine.py --variants invariant
# invariant+norouter_fuse``, H100 2026-12-06, decode forward at 192 tokens of context): batch 32
# 0.753 -> 0.739 ms (7 routers per step); batch 1 0.549 -> 0.482 ms, more than the launch it saves
# can explain (that model's batch-1 graph time moves by tens of us between graphs of one code).
ROUTER_FUSE_MAX_ELEMS = 1 << 20
ROUTER_FUSE_ROWS = 16  # tile rows of the fused router's dot (tl.dot needs 16); one of them holds its token


@triton.jit(do_not_specialize=["T"])
def _router_gemm_topk_kernel(
    x_ptr,
    gw_ptr,
    bias_ptr,
    w_ptr,
    ids_ptr,
    part_ptr,
    count_ptr,
    T,
    H,
    stride_x,
    stride_gw,
    scaling,
    E: tl.constexpr,
    TOP_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    K_CHUNK: tl.constexpr,
    BLOCK_TOP: tl.constexpr,
):
    # Program (token t, K chunk c): the chunk's partial of t's fp32 logits x[t] . W_gate[e] over all
    # E experts, from zero in BLOCK_K steps of exact fp32 products ("ieee": _chunk_dot's loop with
    # x upcast, exact), in a [BLOCK_M, BLOCK_E] dot tile whose row 0 is the token (the other rows
    # are masked to zero and never stored: a row's FMA chain does not depend on its tile position,
    # see LINEAR_CONFIGS), stored at part[c, t, :]. The token's last program to finish adds its
    # chunks' partials in chunk order (kernels/split_k.py): the logits of linear(x.float(), W_gate),
    # bit for bit; then fused_layers.topk_store, the top-k of router_topk, on them. One token per
    # program so the tokens' top-k runs in parallel.
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    om = tl.arange(0, BLOCK_M)
    oe = tl.arange(0, BLOCK_E)
    ok = tl.arange(0, BLOCK_K)
    mm = om == 0
    me = oe < E
    x_ptrs = x_ptr + t * stride_x + om[:, None] * 0 + ok[None, :]  # [BM, BK], every row the token's
    w_ptrs = gw_ptr + oe[None, :].to(tl.int64) * stride_gw + ok[:, None]  # [BK, BE]
    part = tl.zeros((BLOCK_M, BLOCK_E), dtype=tl.float32)
    k_lo = c * K_CHUNK
    for k0 in range(k_lo, tl.minimum(k_lo + K_CHUNK, H), BLOCK_K):
        mk = ok < H - k0
        a = tl.load(x_ptrs + k0, mask=mm[:, None] & mk[None, :], other=0.0).to(tl.float32)
        b = tl.load(w_ptrs + k0, mask=mk[:, None] & me[None, :], other=0.0)
        part = tl.dot(a, b, part, input_precision="ieee")
    chunk = T.to(tl.int64) * E  # elements per chunk of part [chunks, T, E]
    p_ptrs = part_ptr + t * E + oe[None, :]  # [1, BE]: token t's logits in chunk 0
    tl.store(p_ptrs + c * chunk + om[:, None] * 0, part, mask=mm[:, None] & me[None, :])
    if last_to_arrive(count_ptr + t, tl.num_programs(1)):
        acc = combine_chunks(p_ptrs, chunk, tl.num_programs(1), me[None, :], 1, BLOCK_E)
        topk_store(
            tl.reshape(acc, (BLOCK_E,)), bias_ptr, w_ptr, ids_ptr, t, scaling, E, TOP_K, HAS_BIAS, BLOCK_E, BLOCK_TOP
        )
        reset_counter(count_ptr + t)


def router_gemm_topk_ok(num_tokens: int, gate_weight: torch.Tensor) -> bool:
    """``PagedOps.router_gemm_topk_ok`` of the invariant table: whether a step of ``num_tokens``
    tokens routes through ``router_gemm_topk`` (one launch): decode-sized steps (up to
    ``LINEAR_DECODE_ROWS`` rows) of a small router (T x E x H <= ``ROUTER_FUSE_MAX_ELEMS``). Either
    route gives the same bits, so the choice may follow T."""
    return num_tokens <= LINEAR_DECODE_ROWS and num_tokens * gate_weight.numel() <= ROUTER_FUSE_MAX_ELEMS


def router_gemm_topk(
    x: torch.Tensor, gate_weight: torch.Tensor, bias: torch.Tensor | None, top_k: int, scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``fused_layers.router_topk(linear(x.float(), gate_weight), bias, top_k, scaling)`` in one launch,
    bitwise equal (weights and ids): the batch-invariant router of decode-sized steps.

    x: [T, H] activations (bf16 / fp16 / fp32, last dim contiguous; upcast to fp32 in the kernel,
    exact); gate_weight: [E, H] fp32, last dim contiguous; bias: [E] fp32 or None (selection only).
    Returns (weights [T, K] fp32, ids [T, K] int64) as ``router_topk``: the unbiased sigmoid scores
    of the K experts with the largest biased scores (ties to the lower expert id), renormalised and
    times ``scaling``. The logits sum H in ``linear``'s fp32 K chunks and K steps, chunk partials
    added in chunk order (one program per token and chunk; the token's last program adds them and
    runs ``router_topk``'s top-k, ``fused_layers.topk_store``). Every program reads its chunk of
    W_gate: meant for few tokens and a small router (``router_gemm_topk_ok``), though any T works.
    Without an in-kernel combine (``SPLIT_K_FUSED_COMBINE`` off, or no counter buffer during a
    CUDA-graph capture) the two launches run instead (same bits). Raises ValueError on shape /
    dtype / layout mismatches or top_k outside [1, E].
    """
    if x.dim() != 2 or x.dtype not in _DTYPES or x.stride(1) != 1:
        raise ValueError(
            f"invariant router_gemm_topk: x must be [T, H] bf16/fp16/fp32 with a contiguous last dim, "
            f"got {tuple(x.shape)} {x.dtype}"
        )
    if gate_weight.dim() != 2 or gate_weight.dtype != torch.float32 or gate_weight.stride(1) != 1:
        raise ValueError(
            f"invariant router_gemm_topk: gate_weight must be fp32 [E, H] with a contiguous last dim, got "
            f"{tuple(gate_weight.shape)} {gate_weight.dtype}"
        )
    t, h = x.shape
    e = gate_weight.shape[0]
    if gate_weight.shape[1] != h or not 1 <= top_k <= e:
        raise ValueError(
            f"invariant router_gemm_topk: gate_weight {tuple(gate_weight.shape)} vs x {tuple(x.shape)}, top_k={top_k}"
        )
    if bias is not None and tuple(bias.shape) != (e,):
        raise ValueError(f"invariant router_gemm_topk: bias {tuple(bias.shape)}, expected [{e}]")
    cfg = linear_config(torch.float32)  # every fp32 band shares its k_chunk and block_k
    counters = tile_counters(x.device, t) if SPLIT_K_FUSED_COMBINE and t > 0 else None
    if t == 0 or h == 0 or counters is None:  # the two-launch definition
        return fl.router_topk(linear(x.float(), gate_weight), bias, top_k, scaling)
    w = torch.empty(t, top_k, dtype=torch.float32, device=x.device)
    ids = torch.empty(t, top_k, dtype=torch.int64, device=x.device)
    chunks = triton.cdiv(h, cfg.k_chunk)
    part = torch.empty(chunks, t, e, dtype=torch.float32, device=x.device)
    block_e = max(16, triton.next_power_of_2(e))  # tl.dot's smallest width
    _router_gemm_topk_kernel[(t, chunks)](
        x,
        gate_weight,
        bias if bias is not None else gate_weight,
        w,
        ids,
        part,
        counters,
        t,
        h,
        x.stride(0),
        gate_weight.stride(0),
        scaling,
        E=e,
        TOP_K=top_k,
        HAS_BIAS=bias is not None,
        BLOCK_M=ROUTER_FUSE_ROWS,
        BLOCK_E=block_e,
        BLOCK_K=cfg.block_k,
        K_CHUNK=cfg.k_chunk,
        BLOCK_TOP=triton.next_power_of_2(top_k),
        num_warps=1 if block_e <= 32 else 4,  # E <= 32: one warp holds the [16, E] tile
    )
    return w, ids


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
    docstring), whichever way the K chunks run (one program, or split at decode sizes) and
    whichever tiles hold its rows. Cost: below ``MOE_PREFILL_ROWS`` tokens every local expert with
    rows is padded to 64 rows (16 up to ``MOE_DECODE_ROWS`` tokens); from there to 16.
    ``whole_k`` of min(H, I): both GEMMs sum K in one chunk (``split_k.WHOLE_K_CHUNK``) in every band."""
    cfg = moe_config(x.dtype, x.shape[0])
    if whole_k(x.dtype, min(w13.shape[2], w2.shape[2])):
        cfg = dataclasses.replace(cfg, k_chunk=WHOLE_K_CHUNK)
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
        config=cfg,
    )


# ----------------------------------------------------------------------------- log-softmax
@triton.jit
def _scaled_logit(x, t, SCALED: tl.constexpr):
    # process_logits' division by the row's fp32 temperature, IEEE-rounded as torch divides
    # (Triton's "/" on fp32 is an approximate division).
    if SCALED:
        x = tl.math.div_rn(x, t)
    return x


@triton.jit
def _logit_chunk(row, v0, offs, V, t, SCALED: tl.constexpr):
    # chunk [v0, v0 + BLOCK) of the row in fp32 (scaled), -inf past V
    xv = tl.load(row + v0 + offs, mask=offs < V - v0, other=float("-inf")).to(tl.float32)
    return _scaled_logit(xv, t, SCALED)


@triton.jit
def _row_temperature(temp_ptr, raw_ptr, r, SCALED: tl.constexpr):
    # the row's fp32 temperature (1 on a raw row, or when not SCALED)
    t = 1.0
    if SCALED:
        t = tl.where(tl.load(raw_ptr + r) != 0, 1.0, tl.load(temp_ptr + r).to(tl.float32))
    return t


@triton.jit
def _logsumexp_part_kernel(x_ptr, temp_ptr, raw_ptr, part_ptr, stride_x, V, S, SEG: tl.constexpr, SCALED: tl.constexpr):
    # program (r, j): vocabulary segment j (SEG entries) of row r -> part[0, r, j] = its max m,
    # part[1, r, j] = sum exp(y - m) over it (one tl.max / tl.sum tree each; 0 for an all -inf
    # segment, e.g. past a top-k mask)
    r = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    t = _row_temperature(temp_ptr, raw_ptr, r, SCALED)
    y = _logit_chunk(x_ptr + r * stride_x, j * SEG, tl.arange(0, SEG), V, t, SCALED)
    m = tl.max(y, axis=0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    total = tl.sum(tl.exp(y - m_safe), axis=0)
    tl.store(part_ptr + r * S + j, m)
    tl.store(part_ptr + (tl.num_programs(0).to(tl.int64) + r) * S + j, total)


@triton.jit
def _token_logprob_kernel(
    x_ptr, tok_ptr, temp_ptr, raw_ptr, part_ptr, out_ptr, stride_x, S, BLOCK_S: tl.constexpr, SCALED: tl.constexpr
):
    # row r: lse = M + log(sum_j part[1, r, j] * exp(part[0, r, j] - M)), M = max_j part[0, r, j]
    # (one tl.sum tree over the BLOCK_S segment slots); out[r] = y[r, tok[r]] - lse
    r = tl.program_id(0).to(tl.int64)
    n = tl.num_programs(0).to(tl.int64)
    js = tl.arange(0, BLOCK_S)
    m = tl.load(part_ptr + r * S + js, mask=js < S, other=float("-inf"))
    total = tl.load(part_ptr + (n + r) * S + js, mask=js < S, other=0.0)
    mx = tl.max(m, axis=0)
    lse = mx + tl.log(tl.sum(total * tl.exp(m - mx), axis=0))
    t = _row_temperature(temp_ptr, raw_ptr, r, SCALED)
    tok = tl.load(tok_ptr + r).to(tl.int64)
    lp = _scaled_logit(tl.load(x_ptr + r * stride_x + tok).to(tl.float32), t, SCALED) - lse
    tl.store(out_ptr + r, lp.to(out_ptr.dtype.element_ty))


def token_logprobs(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    *,
    temperature: torch.Tensor | None = None,
    raw: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """log_softmax(logits[r])[tokens[r]] for every row r, batch-invariant; optionally of the
    temperature-scaled row, the division inside the same launches.

    Args:
        logits: [N, V] bf16 / fp16 / fp32 (upcast to fp32 in the kernel), last dim contiguous.
        tokens: [N] integer ids in [0, V) (not checked on the device).
        temperature: None, or float64 / float32 [N] > 0: the row is first divided by its
            temperature rounded to fp32, with IEEE division (``sampler.process_logits``' fp32
            ``x / T``, so the bits equal this op on that processed row).
        raw: with ``temperature``, integer / bool [N] or None: nonzero rows are not scaled (a
            "raw" logprob row: the division by 1.0 is exact).
        out: None, or a contiguous fp32 / fp64 [N] tensor written in place (fp64 holds the fp32
            value exactly: the decode graphs' logprob row).

    Returns fp32 [N] (or ``out``). Two launches: one program per row and LOGPROB_SEGMENT-wide
    vocabulary segment computes the segment's max m_j and sum_v exp(y_v - m_j); then one program
    per row combines its segments, lse = M + log(sum_j s_j exp(m_j - M)) with M = max_j m_j
    (log-sum-exp over a partition, exact in real arithmetic; the split is fixed by V, so a row's
    value does not depend on N; it equals ``torch.log_softmax(...).gather(...)`` up to fp32
    rounding). The segments make a row's walk one load deep instead of V / 1,024 chunks in
    sequence (a decode step's rows are few: the one-program walk was latency-bound). The bits
    depend on the logits' dtype: a segment's sums follow its load layout, which Triton picks by
    element size (8 bf16 / fp16 or 4 fp32 values per thread on sm_90), so callers that compare
    bits pass the same dtype (the engine and the trainer's scorer pass fp32 rows). Raises
    ValueError on bad shapes / dtypes.
    """
    if logits.dim() != 2 or logits.dtype not in _DTYPES or logits.stride(1) != 1:
        raise ValueError(
            f"token_logprobs: logits must be [N, V] bf16/fp16/fp32 with a contiguous last dim, "
            f"got {tuple(logits.shape)} {logits.dtype}"
        )
    n, v = logits.shape
    if tuple(tokens.shape) != (n,) or tokens.dtype.is_floating_point:
        raise ValueError(f"token_logprobs: tokens must be integer [{n}], got {tuple(tokens.shape)} {tokens.dtype}")
    scaled = temperature is not None
    if scaled and (tuple(temperature.shape) != (n,) or temperature.dtype not in (torch.float32, torch.float64)):
        raise ValueError(
            f"token_logprobs: temperature must be fp32/fp64 [{n}], got {tuple(temperature.shape)} {temperature.dtype}"
        )
    if raw is not None and (not scaled or tuple(raw.shape) != (n,) or raw.dtype.is_floating_point):
        raise ValueError(
            f"token_logprobs: raw must be an integer / bool [{n}] beside a temperature, got "
            f"{tuple(raw.shape)} {raw.dtype} (temperature given: {scaled})"
        )
    if out is None:
        out = torch.empty(n, dtype=torch.float32, device=logits.device)
    elif tuple(out.shape) != (n,) or out.dtype not in (torch.float32, torch.float64) or not out.is_contiguous():
        raise ValueError(f"token_logprobs: out must be contiguous fp32/fp64 [{n}], got {tuple(out.shape)} {out.dtype}")
    if n == 0:
        return out
    if scaled and raw is None:
        raw = torch.zeros(n, dtype=torch.int8, device=logits.device)
    temp_arg = temperature.contiguous() if scaled else tokens
    raw_arg = raw.contiguous() if scaled else tokens
    segs = triton.cdiv(v, LOGPROB_SEGMENT)
    part = torch.empty(2, n, segs, dtype=torch.float32, device=logits.device)
    _logsumexp_part_kernel[(n, segs)](
        logits, temp_arg, raw_arg, part, logits.stride(0), v, segs, SEG=LOGPROB_SEGMENT, SCALED=scaled, num_warps=4
    )
    _token_logprob_kernel[(n,)](
        logits,
        tokens.contiguous(),
        temp_arg,
        raw_arg,
        part,
        out,
        logits.stride(0),
        segs,
        BLOCK_S=triton.next_power_of_2(segs),
        SCALED=scaled,
        num_warps=4,
    )
    return out

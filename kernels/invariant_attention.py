"""Batch-invariant MSA attention: index scores + top-k and paged attention whose bits do not depend on the batch.

Which path is this: the attention ops of the engine's batch-invariant mode (issue 24, design
"bitwise on-policy"): ``invariant_paged_attention`` and ``invariant_msa_attention`` have the
``PagedOps`` signatures (m3_rollout/model/paged_ops.py) and replace the fast kernels of
``msa_paged_attention`` / ``msa_fused_decode`` / ``msa_index_topk`` there. Spec §3.4-3.5.

Governing idea (the reduction-order argument): a result element is a function of its inputs and
of the sequence of floating-point operations that produce it. Each op here computes the value of
one (query token, head) row with a sequence that depends only on that row's own data, never on
the launch:
- one kernel, one set of compile-time constants that shape the arithmetic (tile shapes,
  ``num_warps``, ``num_stages``, IEEE or tensor-core dots) for decode rows and prefill rows alike
  (the decode launches compile variants that differ only in how work leaves a program: the
  attention's ``PARTIAL``, the scores' blocks per program; the per-page / per-block code is the
  same). The tile shapes depend only on the model (head counts, dims, page size, top-k), not on
  the batch, the chunk or the context; the
  integer arguments that vary with the step (row offset, tiles per row, block-table width, token
  count) are not specialized on, so every step runs the same compiled kernel;
- a tensor-core (or interpreter) dot of a fixed ``[M, k] x [k, n]`` shape computes row m from row m
  of the left operand alone, in an order fixed by the shape: other rows of the tile (other tokens
  of a prefill chunk, or zero padding rows of a decode step) cannot change it. A decode token is
  therefore padded into the prefill tile shape (``BLOCK_M`` tokens), never run in a smaller tile;
- no reduction crosses a row boundary, and the KV reduction of a row is split at FIXED points:
  blocks are grouped in splits of ``ATTN_SPLIT_BLOCKS`` (split = block id // ATTN_SPLIT_BLOCKS, a
  constant), each split runs a fresh online softmax over the row's keys in it (ascending block
  id), and the splits are folded into the total in ascending split order by one formula
  (``_merge_split``, explicit fma). The split points and the fold order depend only on the row's
  own blocks, never on the batch, the chunk or the launch; which program computes a split does
  not change its bits: a prefill tile folds its splits in registers, a decode tile spreads them
  over programs (a work split, ``DECODE_PROGRAMS``), each writing fp32 (m, l, acc) partials
  that ``_inv_merge_kernel`` folds in the same order with the same formula (exactly the values
  the prefill tile holds in registers: fp32 stores are exact);
- reductions whose order does not matter are free to be split: a block's index score is a max
  (exact), and each block's score is computed by one program from that block alone, so the score
  kernel splits blocks over programs; the top-k compares integer keys (exact).
Rows that share a tile but not a KV page: a tile walks the union of what its rows need; a row that
does not need a step's page sees only masked keys, and an online-softmax update with all keys
masked is an exact no-op (m unchanged, alpha = exp2(0) = 1, p = 0, acc + 0, l + 0), so each row's
effective sequence of updates is its own keys, page by page, in ascending block id. Likewise a
split in which a row has no key folds in as an exact no-op (``_merge_split`` keeps the total when
the split's max is -inf), and a row's first non-empty split becomes its total as is, so a row whose
keys lie in one split gets the unsplit walk's bits and the decode kernel may write it directly.
NOTE: that no-op needs finite K/V in the masked slots a row reads (0 x inf = NaN); the engine
zero-fills its pages and only writes finite keys, the same assumption the fast kernels make.

Ops
---
1. ``invariant_index_topk`` (one launch for decode rows, two for prefill rows):
   - ``_inv_scores_kernel``: grid (row tiles, block splits). A program takes ``BLOCK_M`` tokens x
     all G index heads (``INDEX_TILE_ROWS`` = 64 dot rows at M3 shapes: 16 tokens x 4 heads) and
     ``SCORE_SPLIT_BLOCKS`` consecutive blocks (``SCORE_SPLIT_BLOCKS_DECODE`` for decode rows); per
     block one ``[M, di] x [di, ps]`` dot (fp32 accumulation; IEEE for fp32), causal mask, max over
     the block's keys (NaN propagates, then -1e30). Writes a ``[T, G, NBP]`` fp32 scratch (only
     each token's causal blocks are written).
   - ``_inv_topk_kernel``: ``TOPK_ROWS`` (token, head) rows per program (4 = one token x 4 heads
     at M3 shapes, 4 warps); per row the candidates ``0..pos // ps``, key = order-preserving
     int of (+inf for forced local/init blocks, else the score) << 32 | (bias - block id), so a
     larger int64 = "forced first, score desc, ties to the lower block id", and the keys of a row
     are distinct. The blocks stream in chunks of ``TOPK_CHUNK`` (128; the next chunk's scores load
     while this one is merged). A chunk where no row has a key above its own K-th kept key is skipped;
     otherwise ``tl.topk`` (a bitonic network: exact compare-exchanges) takes the chunk's KP
     largest keys in descending order, and they merge into the row's running KP (descending) by
     one bitonic split (elementwise max against the reversed chunk list: the KP largest of the
     union) and one bitonic merge (log2 KP steps). Every step is an exact integer compare, so the
     result is the KP largest keys in order whatever the chunking or the neighbouring rows. Output
     ``[T, G, K]`` int32, -1 padded: exactly ``index_topk_ref``'s list.
   - Decode rows (``DECODE_FUSED_TOPK``): no top-k launch. The score launch's split programs of a
     tile that hold causal blocks count themselves in on a ``split_k`` counter (the others return at
     once; a tile with one such split needs no counter); the last one runs the same row walk
     (``_inv_topk_rows``) over the tile's tokens, reading the scores back from L2. The ids are the
     same integers whichever program ranks them (H200, 2026-12-03: ~1 % of a batch-1 decode step).
   - Short rows (``TOPK_SHORT_PATH``, both launches): a program whose rows have at most KP
     candidates each sorts their KP keys ([rows, KP], one bitonic sort) instead of streaming
     TOPK_CHUNK-wide chunks; all of a row's keys sorted are its KP largest in order: the same ids.
2. ``invariant_paged_attention`` (``inv_attn_kernel``, launched once for the decode rows and once
   for the prefill rows with the same constants, then ``_inv_merge_kernel`` for the decode tokens
   whose keys span several splits): a program takes ``BLOCK_M`` consecutive query tokens of one row
   x the RH query heads of one KV head (``SPARSE_TILE_ROWS`` = 64 dot rows for sparse layers: 4
   tokens x 16 heads at M3 shapes, 16 x 4 for the 300M bench model; ``DENSE_TILE_ROWS`` = 128 for
   dense layers; a decode row = 1 token + zero tokens). It walks one page
   (= block, ``ps`` keys) per step in ascending block id, split by split (``ATTN_SPLIT_BLOCKS``
   blocks): dense layers every block up to the tile's last position; sparse layers (with
   ``sparse_impl="union"``; the default runs page partials, below) the sorted distinct valid
   blocks the tile's tokens selected (the union, walked by repeated min-reductions over the
   tile's entries), each row masked to its own token's set and causal cut. Online softmax
   in base 2 (scale x log2 e), fp32 m / l / acc; fp16/bf16 inputs round the probabilities to the
   input dtype for the PV dot (as the fast kernels do); fp32 inputs use IEEE dots.
   - prefill launch: one program per tile walks all its splits, folding each into the total.
   - decode launch: grid axis 2 = up to ``DECODE_PROGRAMS`` / (tiles x G) programs per tile, program z
     taking the tile's non-empty splits z, z + Z, ... (one-token rows in a grid of at most
     ``DECODE_PIPELINE_PROGRAMS``: a split's pages in a ``for`` loop over the token's
     sorted distinct blocks, ``_walk_one``, instead of the union walk; the same updates); per split,
     a row whose keys all lie in it writes its output, a row with keys in several writes the
     split's fp32 (m, l, acc) to a per-call scratch ([decode tokens, nh, slots] with slots = the
     table's splits, dense, or K, sparse: a split's slot is the first selection slot holding one
     of its blocks); the merge
     kernel (grid decode tokens x G) folds a token's non-empty splits in ascending order. Launched
     only when the block table spans more than one split (else every token is written directly).
3. ``invariant_msa_attention``: 1 then 2 (three or four launches for any mix of decode and prefill
   rows), the choice copied into ``sel_out``.

Consequences (what the CPU tests check bitwise, and the GPU tests at M3 shapes): the output and the
selection of a position are identical whether it is the last token of a decode step (also of a
speculative-verify row), row i of a prefill chunk, in one chunk or several, after a prefix-cache
hit, beside other sequences or CUDA-graph padding rows; with the union walk, a sparse layer whose
selection holds all causal blocks gives the dense layer's bits (page partials reduce in another
order). The selection equals the reference's whenever the scores do (fp32 up to summation order;
the order here is the kernel's, fixed).
NOTE: under the Triton interpreter ``tl.dot`` is numpy's BLAS matmul, whose result for a row
depends on the row's place in the tile; the CPU tests therefore run with
``msa_interpret.fixed_order_dot``. That the GPU's fixed-shape dot is row-invariant (the premise of
the second rule above) is checked only by tests/gpu/test_invariant_attention_gpu.py.

Sparse attention by page partials (``sparse_impl="page_partials"``, the default
``DEFAULT_SPARSE_IMPL``; chosen per ops table by ``EngineConfig.invariant_sparse_attention``;
with ``sparse_impl="union"`` the sparse layers run all of the above, as the dense layers always
do). Sparse layers run kernels/invariant_page_partials.py: prefill rows take the fast path's KV-major
kernels (``msa_paged_attention.kv_seg_attn_kernel``: one block-normalised partial + base-2 LSE per
(token, KV head, slot j) entry, each page's K/V loaded once per segment; ``kv_major_merge_kernel``
folds a token's partials in slot order j) at every length, with one launch set
(``PAGE_PARTIALS_LAUNCH``); decode rows run ``pp_decode_kernel``, one program per entry, which puts
the entry's query rows in the same [TOK x RHP, d] tile and runs kv_seg's own loop helper with the
same constexprs, warps and stages, then the same merge. An entry's partial depends only on its own
rows and one page (rule 2 for the tile's other rows), the merge only on the token's partials, so
decode and prefill give the same bits, whatever the batch, chunking or pass size; other bits than
"union" (another reduction order). The ops table then takes the KV-major scratch. On an H100
(2026-12-05; docs/benchmarks.md) its bits are as designed (tests/gpu/test_invariant_ops_gpu.py, the
GRPO loop bitwise on-policy) and it meets issue 24's 32K-prefill target (+8.4 % over the fast mode
against +34.6 % for the union walk); decode costs one program per entry and one page load each
(step 0.5-1 % slower than the union walk). Hence the default since 2026-12-05, after the GPU checks
on an H100 80GB HBM3 (torch 2.11, triton 3.6): 20 GRPO steps on configs/grpo_h200.yaml bitwise
on-policy (token_mult_prob_error 1.0, gen_kl 0 on every step); tests/gpu/test_invariant_ops_gpu.py,
test_invariant_attention_gpu.py and test_sampler_invariant_gpu.py passed.
"union" stays a choice (its bits: a sparse layer selecting every causal block gives the dense
layer's). The CPU checks page partials under the interpreter and that both kernels compile to the
same sm_90 MMA code (kernels/mma_check.py, tests/test_invariant_page_partials.py).

Cost against the fast kernels (expected; measure on the H200, issue 24's benchmark)
-----------------------------------------------------------------------------------
- Decode attention splits a token's keys at fixed ``ATTN_SPLIT_BLOCKS`` (8) block boundaries, one
  program per non-empty split (while fewer than ``DECODE_PROGRAMS`` programs in all), plus a merge
  launch. A program's serial walk is at most 8 pages: at batch 1, 8K context (64 blocks), a dense
  layer runs 4 x 8 programs of 8 pages instead of 4 of 64, a sparse layer (16 selected blocks,
  usually spread over the 8 splits) 4 x <= 8 programs of ~2 pages instead of 4 of 16. The fast
  kernels split finer (up to 256 / (tokens x G) programs, chosen from the batch), so at batch 1
  they keep an edge on long dense walks. Added cost: fp32 partials ([RH, d] per token, head
  group and split: ~1/30 of the split's K/V bytes at ps 128) written and read back, and the merge
  launch (a few us in a CUDA graph) whenever the block table spans more than one split (the
  engine's graphs use max_model_len / ps wide tables, so at every decode step). Prefill pays one
  fold of a [64, d] accumulator per 8 pages (negligible).
- Short contexts (the profile of issue 24: 2-3 pages at ps 128, one split): a program is latency-
  bound on its serial pages (block-table load -> K load -> dot -> softmax -> V load -> dot). The earlier
  kernel also counted the tile's distinct blocks with a [E, E] comparison (E = BLOCK_M x KP = 256
  entries for the 300M bench model, 64K integer compares per program); the walk now stops on
  "no entry left" instead, and programs with nothing to do return before loading the query tile.
  Each page step now issues the K and V loads together and the next page's block-table entry
  before its dots (the sparse walk used to load V after the QK dot and softmax, and every step
  loaded its page id first): about one memory round trip per page instead of two or three.
  The page loop itself spilled at 4 warps (sm_90 ptxas at bench shapes, bf16: 255 registers,
  ~540 local loads and ~2.6K instructions per thread per page; ~650 with the split's second
  accumulator); at 8 warps (d >= 128) ~90 local loads and ~1.8K instructions. Expected:
  most of the per-page latency at batch 1. Measured (2026-12-03, tile sweep): sparse layers are
  faster at 4 warps after all (two CTAs per SM outweigh the spills: 16K prefill 4.1 vs 6.8 ms,
  decode batch 32 0.10 vs 0.12 ms), dense layers at 128 rows x 8 warps (``DENSE_TILE_ROWS``).
  One-token decode rows in small grids (batch 1 to ~8 at M3's 4 KV heads) walk a split's pages in
  a ``for`` loop over their sorted blocks (``_walk_one``; K / V staged two pages ahead): decode
  forward of the 300M bench model at 2.3K context 0.78 -> 0.66 ms at batch 1 and 0.85 -> 0.77 ms
  at batch 4 (2026-12-03, H200; the figures at ``DECODE_STAGES``). Tried and dropped the same day: a
  16-row, one-warp decode tile (the GPU tests found its bits equal to the 64-row, 4-warp prefill
  tile's) was 1.3-2x slower per step.
  Since 2026-12-03 the decode launch compiles without the prefill's running total (``PARTIAL``):
  ptxas then reported 32-84 spilled registers across the four variants (dense / sparse x decode /
  prefill, sampled with V still loaded after the softmax in the decode ones) against 118 / 168
  (4 / 8 warps) for the one kernel before; decode forward 3-5 % faster at batch 32 on the H200.
- Decode tiles are padded to the prefill shape: 64 dot rows for 16 useful (attention) and for 4
  useful (scores); the tensor-core work grows 4x / 16x, but decode is bound by reading K/V and index
  keys, so this should cost little.
- Sparse prefill always takes the union-of-tile walk (4 tokens per tile, every row pays for the
  union of its tile's blocks, ~1-3x the selected work); the fast kernel switches to the KV-major
  path (each page read once per segment of entries) from 16K prefill tokens, so long sparse
  prefills are expected ~1.5-2x slower in attention.
- Dense prefill: 128-row tiles (``DENSE_TILE_ROWS``: 8 tokens x 16 heads at M3 shapes), as many
  rows as the fast kernel's, so each K/V page is read as often; decode pads one token into them.
- The MSA decode step is two launches (scores with the top-k, attention) plus the merge (PDL-chained
  to the attention) like the fused path's two, and the score
  kernel has no unmasked fast loop, register cap or key sub-tiles: a few microseconds per sparse
  layer and decode step.
- The [T, G, NBP] fp32 score scratch goes through memory for decode as for prefill. Score programs
  of a split past the tile's causal blocks return before loading anything (at decode most of the
  ``cdiv(NBP, SCORE_SPLIT_BLOCKS_DECODE)`` splits). Decode takes 2-block programs: with 16 (the
  prefill's) a batch-1 step at 2.3K context walked 16 pages in one program, 28 us per layer on
  the H200; 5 us with 2 (2026-12-03).
- Top-k: a chunk costs a fixed network of ~27 compare-exchange steps on a [4, 128] int64 tile
  (22 for ``tl.topk`` of KP = 16 from 128, 5 for the merge; 4 keys per thread, each step a
  register swap or a warp shuffle, if the compiler keeps a row in one warp), independent of the batch. Decode at
  short contexts (one chunk per row, one program per token): expected ~2-4 us per launch at batch
  1 and 32 alike (the earlier kernel, K serial rounds of two cross-warp max-reductions over a
  [32, 128] tile, took ~90 us on the H200). Long rows: 1M context = 8192 blocks at ps 128 is 64
  chunks per row, mostly skipped after the first ones when scores are random, expected tens of us
  per launch (one program per token; rows are not split over programs). Prefill: one program per
  token, cost ~ sum over tokens of ceil((pos // ps + 1) / 128) chunk steps.

Shape legend: T query tokens, R rows, P pages, ps page (= block) size, G KV heads (= index heads),
nh query heads, RH = nh / G, d head dim, di index dim, K top-k blocks, NBP block-table width.
Layout of every cache and of ``PagedMetadata``: kernels/paged_layout.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from m3_kernels.invariant_page_partials import page_partials_attention
from m3_kernels.msa_checks import SM90_SMEM_BYTES, next_pow2
from m3_kernels.msa_fp8 import index_dot, quantize_rows_e4m3, split_index_cache
from m3_kernels.msa_index_topk import MAX_TOPK, block_selection_keys, check_index_inputs
from m3_kernels.msa_paged_attention import LOG2E, check_attention_inputs, check_kv_major_scratch
from m3_kernels.paged_layout import FP8IndexCache, PagedMetadata
from m3_kernels.split_k import last_to_arrive, reset_counter, tile_counters

# The sparse layers' attention (module docstring, "Sparse attention by page partials"), the ops'
# ``sparse_impl`` keyword: "union" = inv_attn_kernel's walk of its tiles' union; "page_partials" =
# kernels/invariant_page_partials.py (KV-major per-page partials + merge for prefill and decode
# rows; the default: issue 24's 32K-prefill target met, GPU-checked on an H100 2026-12-05, module
# docstring). Dense layers take inv_attn_kernel either way. The
# engine chooses per ops table (EngineConfig.invariant_sparse_attention -> engine/ops.py
# invariant_attention_fields, which binds the choice into the table's ops); nothing reads a global.
SPARSE_IMPLS = ("union", "page_partials")
DEFAULT_SPARSE_IMPL = "page_partials"

# Dot rows per program (tokens x heads), fixed by the model's shapes and the layer kind only: a layer
# keeps its kind's tile for decode (padded) and prefill, so its bits stay one function of the row;
# the kinds never mix in one layer. H200, 16K-token prefill of one layer, bf16
# (scripts/bench_invariant_attention.py --tile-sweep, 2026-12-03), 16 / 64 query heads: dense
# 128 rows x 8 warps 3.5 / 12.6 ms vs 64 x 8 6.2 / 19.8 ms (each K/V page read by half as many
# tiles); sparse 64 x 4 4.1 / 9.9 ms vs 64 x 8 6.8 / 15.7 ms (a bigger tile walks a bigger union
# of its rows' blocks; at 4 warps two programs share an SM). Decode at 8K, batch 32: dense 0.29 vs
# 0.26 ms, sparse 0.10 vs 0.12 ms.
DENSE_TILE_ROWS = 128
DENSE_WARPS = 8
SPARSE_TILE_ROWS = 64
SPARSE_WARPS = 4
INDEX_TILE_ROWS = 64
# Blocks (= pages) per attention split: a token's keys are attended split by split (ascending), each
# split's online softmax folded into the total in ascending split order, for decode (one program per
# split + ``_inv_merge_kernel``) and prefill (in registers) alike. A constant, never from the batch.
ATTN_SPLIT_BLOCKS = 8
PDL = True  # CUDA: launch the decode merge with programmatic dependent launch (hides its launch latency)
DECODE_PROGRAMS = 256  # decode attention programs aimed at (tiles x KV heads x splits); work split only
SCORE_SPLIT_BLOCKS = 16  # blocks per score program (a block's score never depends on another block)
# ... of the decode launch: few row tiles, so many short programs (a batch-1 step at 2.3K context,
# 18 blocks, took 28 us per layer with 16-block programs: one program walked 16 pages in series)
SCORE_SPLIT_BLOCKS_DECODE = 2
# Decode launches with one query token per row (no speculative-verify rows) and at most
# DECODE_PIPELINE_PROGRAMS programs (batch 1 to a few rows: latency-bound): the page walk is a ``for``
# loop over the token's sorted blocks (``_walk_one``), DECODE_STAGES deep for Triton's pipeliner.
# The split's page ids are read as one vector before the loop, so no load in it feeds another; the
# pipeliner then stages the K / V tiles (async copies) DECODE_STAGES - 1 pages ahead (sm_90 TTGIR as
# launched, triton 3.6: 163,840 B of shared memory for the dense tile at 2 stages, 229,376 B at 3).
# Load scheduling only: the per-page arithmetic is the prefill's (``_attend_page`` on the same tile).
# H200, 300M bench model, decode forward at 2.3K context (2026-12-03, one process): batch 1 union walk
# 0.775 ms, page id loaded in the loop at 2 stages 0.72 (earlier calls), ids as one vector at 2 stages
# 0.682, at 3 stages 0.657; batch 4 0.846 / 0.803 / 0.770.
# Larger grids keep the union walk, which measured faster there (decode forward at batch 32, 2 stages:
# 1.24 -> 1.32 ms at 2.3K context, 1.70 -> 1.82 ms at 8K). False: always the union walk (A/B).
DECODE_PIPELINE = True
DECODE_STAGES = 3
DECODE_PIPELINE_PROGRAMS = 132  # the H200's SMs
# Decode rows' top-k in their score launch (the last split program of a tile ranks the tile's tokens:
# one launch fewer per sparse layer and step). False: ``_inv_topk_kernel`` for every row (A/B).
DECODE_FUSED_TOPK = True
TOPK_CHUNK = 128  # blocks per step of the streaming top-k (one bitonic top-KP of [rows, TOPK_CHUNK] keys)
TOPK_ROWS = 4  # (token, head) rows per top-k program: one warp per row, 4 keys per thread
TOPK_WARPS = 4
# Programs whose rows have at most KP (= next_pow2(topk)) candidate blocks each (contexts up to
# KP * ps tokens: 2K at M3's top-16 x 128) sort their KP keys in one [rows, KP] bitonic sort instead
# of the streaming walk's CH-wide top-k + merge (``_inv_topk_rows``' SHORT; the same ids). Both top-k
# launches (the decode score launch's fused top-k and ``_inv_topk_kernel``). False: the walk for
# every length (A/B: scripts/profile_engine.py invariant+topk_long). H100, bf16, 4 heads x 128, top-16,
# CUDA-graph replays (2026-12-06): the decode score + top-k launch at position 200 (2 blocks) 6.5 ->
# 5.1 us at batch 1 and 7.0 -> 5.5 us at batch 32, at 2047 7.8 -> 6.2 us (batch 1); the top-k launch
# alone 3.0-3.9 -> 1.6-1.8 us. Rows past KP blocks (3K, 5K) take the walk: the same time with a
# 256-block table, ~1 us more per fused launch with a table of 24 / 40 blocks (not profiled; likely
# the other Triton specialization of score rows whose stride is no multiple of 16; the engine's
# graphs use max_model_len / ps wide tables).
TOPK_SHORT_PATH = True
_BIG_ID = tl.constexpr(2147483647)  # "no block" in the union walk (above every block id)
_KEY_EMPTY = tl.constexpr(-(2**63))  # below every top-k key


def decode_walk_stages(ieee: bool, rows: int = 128, d: int = 128, ps: int = 128, elt: int = 2) -> int:
    """Pipeline depth of the one-token decode walk (``_walk_one``) for a tile of ``rows`` dot rows,
    head dim d, page size ps and elt-byte inputs: 1 for fp32 (IEEE) inputs (at 2 stages the fp32
    dense tile asked 262,144 B of shared memory, H200, 2026-12-03), else the largest depth <=
    ``DECODE_STAGES`` whose query tile plus staged K and V pages, elt * d * (rows + 2 * stages * ps)
    bytes, fit sm_90's SM90_SMEM_BYTES (M3's 128 x 128 tiles: 229,376 B at 3; d 256 with 64-key pages
    would ask 262,144 B at 3 and take 2). kernels/smem_check.py compiles the choice for sm_90."""
    if ieee:
        return 1
    stages = DECODE_STAGES
    while stages > 1 and elt * d * (rows + 2 * stages * ps) > SM90_SMEM_BYTES:
        stages -= 1
    return stages


def attn_block_m(rh: int, tile_rows: int) -> int:
    """Query tokens per attention tile for RH query heads per KV head: tile_rows // next_pow2(RH), >= 1."""
    return max(1, tile_rows // next_pow2(rh))


def index_block_m(g: int) -> int:
    """Query tokens per score tile for G index heads: INDEX_TILE_ROWS // next_pow2(G), >= 1."""
    return max(1, INDEX_TILE_ROWS // next_pow2(g))


@triton.jit(do_not_specialize=["row_offset", "n_qtiles", "stride_bt_r", "topk"])
def _inv_scores_kernel(
    iq_ptr,
    ik_ptr,
    iks_ptr,
    bt_ptr,
    qsl_ptr,
    pos_ptr,
    score_ptr,
    ids_ptr,
    cnt_ptr,
    row_offset,
    n_qtiles,
    topk,
    init_blocks,
    local_blocks,
    stride_iq_t,
    stride_iq_g,
    stride_ik_p,
    stride_ik_o,
    stride_iks_p,
    stride_bt_r,
    stride_s_t,
    stride_s_g,
    G: tl.constexpr,
    GP: tl.constexpr,
    DI: tl.constexpr,
    PS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    SPLIT_B: tl.constexpr,
    KSCALE: tl.constexpr,
    QFP8: tl.constexpr,
    TOPK_KP: tl.constexpr = 0,
    TOPK_CH: tl.constexpr = 128,
    TOPK_SHORT: tl.constexpr = False,
):
    """Block-max index scores of BLOCK_M tokens x G heads (row m = token m // GP, head m % GP) over
    blocks [split * SPLIT_B, (split + 1) * SPLIT_B) of their causal range; one block per step.

    score[t, g, b] = max over block b's keys u <= pos(t) of <iq[t, g], ik[u]> (x the key's scale with
    KSCALE; x the query row's scale after the max with QFP8), NaN -> -1e30; written for b <= pos(t) // PS.
    TOPK_KP > 0 (decode launches): the top-k too. Every split program of a tile that holds causal
    blocks counts itself in at the tile's counter cnt_ptr[pid] (``split_k.last_to_arrive``); the last
    one runs ``_inv_topk_rows`` (TOPK_CH, TOPK_KP, TOPK_SHORT) over the tile's tokens, the scores read
    back from L2, and re-arms the counter (a tile with one such split ranks in it, no counter): the
    ids of ``_inv_topk_kernel`` (exact integer keys), with no launch of its own.
    """
    pid = tl.program_id(0)
    split = tl.program_id(1)
    row = row_offset + pid // n_qtiles
    qtile = pid % n_qtiles
    q_lo = tl.load(qsl_ptr + row)
    q_hi = tl.load(qsl_ptr + row + 1)
    t0 = q_lo + qtile * BLOCK_M
    if t0 >= q_hi:
        return
    offs_m = tl.arange(0, BLOCK_M * GP)
    tok = t0 + offs_m // GP
    head = offs_m % GP
    m_ok = (tok < q_hi) & (head < G)
    qpos = tl.load(pos_ptr + tok, mask=m_ok, other=-1).to(tl.int32)  # [M]
    n_blk = tl.max(qpos, axis=0) // PS + 1
    # The tile's splits that hold causal blocks (every program of the tile computes the same number
    # from the same positions; >= 1, and never more than the grid has, so the counter below always
    # completes). A split past them (most of the grid at decode: it spans the whole block table)
    # returns before loading the queries, and with the top-k no longer counts itself in: it writes
    # no score, so the last of the active splits already sees every score the top-k reads, and the
    # ids cannot change. One active split (contexts up to SPLIT_B blocks) is the last by
    # construction: it ranks without the atomic (the counter is never touched). H100, bench shapes
    # (2026-12-06, short path off in both): batch 32 at position 200 with a 256-block table 31.5 ->
    # 9.4 us per launch (every split program used to count in), at 2047 34.8 -> 14.3; batch 1 at 200
    # 7.3 -> 6.5 us (no atomic).
    n_act = tl.minimum(tl.maximum((n_blk + SPLIT_B - 1) // SPLIT_B, 1), tl.num_programs(1))
    if split >= n_act:
        return
    b_lo = split * SPLIT_B
    b_hi = tl.minimum(b_lo + SPLIT_B, n_blk)
    offs_d = tl.arange(0, DI)
    offs_o = tl.arange(0, PS)
    q = tl.load(
        iq_ptr + tok[:, None].to(tl.int64) * stride_iq_t + head[:, None] * stride_iq_g + offs_d[None, :],
        mask=m_ok[:, None] & (b_lo < b_hi),
        other=0.0,
    )  # [M, DI]
    q_scale = tl.full([BLOCK_M * GP], 1.0, tl.float32)
    if QFP8:
        q, q_scale = quantize_rows_e4m3(q)
    srow = score_ptr + tok.to(tl.int64) * stride_s_t + head * stride_s_g  # [M]
    for b in range(b_lo, b_hi):
        page = tl.load(bt_ptr + row * stride_bt_r + b).to(tl.int64)
        k = tl.load(ik_ptr + page * stride_ik_p + offs_o[:, None] * stride_ik_o + offs_d[None, :])  # [PS, DI]
        s = index_dot(q, k)  # [M, PS] fp32
        if KSCALE:
            s = s * tl.load(iks_ptr + page * stride_iks_p + offs_o)[None, :]
        s = tl.where((b * PS + offs_o)[None, :] <= qpos[:, None], s, float("-inf"))
        smax = tl.max(s, axis=1)  # [M]
        if QFP8:
            smax = smax * q_scale
        # a NaN among the causal keys poisons the block (reference: amax propagates NaN, then -1e30)
        smax = tl.where(tl.max((s != s).to(tl.int32), axis=1) > 0, -1e30, smax)
        tl.store(srow + b, smax, mask=m_ok & (b <= qpos // PS))
    if TOPK_KP > 0:
        last = n_act == 1
        if n_act > 1:
            last = last_to_arrive(cnt_ptr + pid, n_act)
        else:
            tl.debug_barrier()  # this program's score stores, seen by all its threads (as last_to_arrive)
        if last:
            if n_act > 1:
                reset_counter(cnt_ptr + pid)
            offs_g = tl.arange(0, GP)
            for tt in range(t0, tl.minimum(t0 + BLOCK_M, q_hi)):  # the tile's tokens (a decode row: 1)
                _inv_topk_rows(
                    score_ptr, pos_ptr, ids_ptr, offs_g * 0 + tt, offs_g, offs_g < G, topk, init_blocks,
                    local_blocks, stride_s_t, stride_s_g, G, PS, TOPK_CH, TOPK_KP, ".cg", TOPK_SHORT,
                )  # fmt: skip


@triton.jit
def _inv_topk_walk(
    srow, nxt, n_cand, topk, init_blocks, local_blocks, CH: tl.constexpr, KP: tl.constexpr, CACHE: tl.constexpr
):
    """[R, KP] int64: the KP largest selection keys of each row (descending; the empty key past its
    candidates) by the chunk walk of ``_inv_topk_rows``. srow: [R] score row pointers; nxt: [R, CH] fp32,
    the first chunk's scores (already loaded, masked to the candidates); n_cand: [R] int32."""
    offs_k = tl.arange(0, KP)
    offs_c = tl.arange(0, CH)
    best = tl.full([n_cand.shape[0], KP], _KEY_EMPTY, tl.int64)  # running top KP keys, descending
    for c0 in range(0, tl.max(n_cand, axis=0), CH):
        b = c0 + offs_c
        cand = b[None, :] < n_cand[:, None]  # [R, CH]
        s = nxt
        nb = b + CH
        nxt = tl.load(srow[:, None] + nb[None, :], mask=nb[None, :] < n_cand[:, None], other=0.0, cache_modifier=CACHE)
        key = block_selection_keys(s, b, cand, n_cand, init_blocks, local_blocks)
        kth = tl.max(tl.where((offs_k == topk - 1)[None, :], best, _KEY_EMPTY), axis=1)  # [R]
        if tl.max(tl.max((key > kth[:, None]).to(tl.int32), axis=1), axis=0) > 0:
            top = tl.topk(key, KP)  # [R, KP] descending
            best = tl.bitonic_merge(tl.maximum(best, tl.flip(top, 1)), descending=True)
    return best


@triton.jit
def _inv_topk_rows(
    score_ptr,
    pos_ptr,
    ids_ptr,
    t,
    g,
    r_ok,
    topk,
    init_blocks,
    local_blocks,
    stride_s_t,
    stride_s_g,
    G: tl.constexpr,
    PS: tl.constexpr,
    CH: tl.constexpr,
    KP: tl.constexpr,
    CACHE: tl.constexpr,
    SHORT: tl.constexpr,
):
    """Top-k block ids of rows (token t[r], head g[r]) where r_ok[r], from the scores.

    Each row's candidates 0..pos // PS stream in chunks of CH blocks (``_inv_topk_walk``; the next
    chunk's scores are loaded while this one is merged). Per chunk: int64 keys
    (``msa_index_topk.block_selection_keys``); a chunk where no row has a key above its own K-th
    kept key is skipped; else the chunk's KP
    largest keys (``tl.topk``: bitonic, sorted descending) are merged with the row's running KP
    largest (sorted descending) by one bitonic split (elementwise max against the reversed list =
    the KP largest of the union) and one bitonic merge (log2 KP compare-exchange steps). Integer
    keys are distinct per row (the block id is in them) and every step is an exact compare: the
    result is the KP largest keys in order, whatever the chunking, the rows sharing the program or
    the launch it runs in. Writes ids[t, g, 0..K-1], -1 past the row's candidates. CACHE: the score
    loads' cache modifier ("", or ".cg" = from L2 when other programs of the same launch wrote them).
    SHORT (``TOPK_SHORT_PATH``): when no row of the program has more than KP candidates (a runtime
    scalar test: no host sync, CUDA-graph safe), load only KP scores per row and sort their keys
    descending over KP lanes (``tl.topk(key, KP)`` = a full bitonic sort of [R, KP]) instead of the
    chunk walk's CH-wide network. The same ids: the keys are distinct per row, so the sorted list of
    all a row's candidates (then empty keys) is its KP largest in order, which the walk also returns.
    """
    p = tl.load(pos_ptr + t, mask=r_ok, other=0).to(tl.int32)
    n_cand = tl.where(r_ok, p // PS + 1, 0)  # [R]
    offs_k = tl.arange(0, KP)
    offs_c = tl.arange(0, CH)
    srow = score_ptr + t.to(tl.int64) * stride_s_t + g * stride_s_g  # [R]
    # the walk's first chunk, issued before the short path's test: the walk-only variant (SHORT off)
    # then compiles to the code the kernel had before that path (sm_90 SASS the same length)
    nxt = tl.load(
        srow[:, None] + offs_c[None, :], mask=offs_c[None, :] < n_cand[:, None], other=0.0, cache_modifier=CACHE
    )
    if SHORT:
        if tl.max(n_cand, axis=0) <= KP:
            # short contexts (decode at <= KP * PS tokens, every step of the bench profile): KP scores,
            # log2(KP) (log2(KP) + 1) / 2 compare-exchange steps on [R, KP] keys (10 at KP 16) instead
            # of >= 27 on [R, CH] (a chunk's top-KP and the merge)
            k_ok = offs_k[None, :] < n_cand[:, None]  # [R, KP]
            s_k = tl.load(srow[:, None] + offs_k[None, :], mask=k_ok, other=0.0, cache_modifier=CACHE)
            best = tl.topk(block_selection_keys(s_k, offs_k, k_ok, n_cand, init_blocks, local_blocks), KP)
        else:
            best = _inv_topk_walk(srow, nxt, n_cand, topk, init_blocks, local_blocks, CH, KP, CACHE)
    else:  # the walk for every length, compiled alone (A/B)
        best = _inv_topk_walk(srow, nxt, n_cand, topk, init_blocks, local_blocks, CH, KP, CACHE)
    bid = 0x7FFFFFFF - (best & 0xFFFFFFFF).to(tl.int32)
    bid = tl.where(best == _KEY_EMPTY, -1, bid)
    tl.store(
        ids_ptr + (t.to(tl.int64) * G + g)[:, None] * topk + offs_k[None, :],
        bid,
        mask=r_ok[:, None] & (offs_k < topk)[None, :],
    )


@triton.jit(do_not_specialize=["t_lo", "n_tok"])
def _inv_topk_kernel(
    score_ptr,
    pos_ptr,
    ids_ptr,
    t_lo,
    n_tok,
    topk,
    init_blocks,
    local_blocks,
    stride_s_t,
    stride_s_g,
    G: tl.constexpr,
    GP: tl.constexpr,
    TOK: tl.constexpr,
    PS: tl.constexpr,
    CH: tl.constexpr,
    KP: tl.constexpr,
    SHORT: tl.constexpr,
):
    """``_inv_topk_rows`` of TOK tokens (from token t_lo on, up to n_tok) x their G heads (row r =
    token r // GP, head r % GP); SHORT: ``TOPK_SHORT_PATH``."""
    offs_r = tl.arange(0, TOK * GP)
    t = t_lo + tl.program_id(0) * TOK + offs_r // GP
    g = offs_r % GP
    _inv_topk_rows(
        score_ptr, pos_ptr, ids_ptr, t, g, (t < n_tok) & (g < G), topk, init_blocks, local_blocks,
        stride_s_t, stride_s_g, G, PS, CH, KP, "", SHORT,
    )  # fmt: skip


@triton.jit
def _merge_split(m_t, l_t, acc_t, m_s, l_s, acc_s):
    """Fold one split's partial softmax (m_s, l_s, acc_s) [M], [M], [M, D] into the running total
    (m_t, l_t, acc_t); base-2 maxima. Exact cases: a row whose split is empty (m_s = -inf) keeps its
    total bit for bit; the first non-empty split of a row (m_t = -inf) becomes the total as is. Else
    l = fma(l_s, 2^(m_s - m), l_t 2^(m_t - m)), acc likewise, m = max(m_t, m_s) (explicit fma: the
    same rounding in the attention kernel and in ``_inv_merge_kernel``)."""
    has = m_s > float("-inf")
    first = m_t == float("-inf")
    m_new = tl.maximum(m_t, m_s)
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    a = tl.exp2(m_t - m_use)
    c = tl.exp2(m_s - m_use)
    l_new = tl.where(first, l_s, tl.fma(l_s, c, l_t * a))
    acc_new = tl.where(first[:, None], acc_s, tl.fma(acc_s, c[:, None], acc_t * a[:, None]))
    return (
        tl.where(has, m_new, m_t),
        tl.where(has, l_new, l_t),
        tl.where(has[:, None], acc_new, acc_t),
    )


@triton.jit
def _attend_k(q, m_i, l_i, k, b, row_ok, qpos, qk_scale, offs_o, PS: tl.constexpr, IEEE: tl.constexpr):
    """First half of ``attend_block``'s online-softmax update (msa_paged_attention, the same
    operations in the same order) on a K tile already loaded: key u of block b enters row m iff
    row_ok[m] and b * PS + u <= qpos[m]. Returns (m_new, l_new, p [M, PS] fp32, alpha [M]); a row
    with no such key gets m, l unchanged, p = 0 and alpha = 1 (``_attend_v`` then leaves it as is)."""
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))  # [M, PS] fp32
    s = s * qk_scale
    keep = row_ok[:, None] & ((b * PS + offs_o)[None, :] <= qpos[:, None])
    s = tl.where(keep, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    return m_new, l_i, p, alpha


@triton.jit
def _attend_v(acc, p, alpha, v, IEEE: tl.constexpr):
    """Second half of the update: acc * alpha + p @ V (p rounded to V's dtype unless IEEE)."""
    if IEEE:
        pv = tl.dot(p, v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    return acc * alpha[:, None] + pv


@triton.jit
def _attend_page(
    q,
    m_i,
    l_i,
    acc,
    kg_ptr,
    vg_ptr,
    page,
    stride_kp,
    stride_ko,
    offs_o,
    offs_d,
    b,
    row_ok,
    qpos,
    qk_scale,
    PS: tl.constexpr,
    IEEE: tl.constexpr,
):
    """One page's online-softmax update (``_attend_k`` then ``_attend_v``), the K and V loads issued
    together before any math (the V load overlaps the QK dot and the softmax). 2026-12-03, H200:
    loading V after the softmax (one [PS, D] tile live instead of two) was 1-2 % slower at decode."""
    koff = page.to(tl.int64) * stride_kp + offs_o[:, None] * stride_ko + offs_d[None, :]
    k = tl.load(kg_ptr + koff)
    v = tl.load(vg_ptr + koff)
    m_i, l_i, p, alpha = _attend_k(q, m_i, l_i, k, b, row_ok, qpos, qk_scale, offs_o, PS, IEEE)
    return m_i, l_i, _attend_v(acc, p, alpha, v, IEEE)


@triton.jit
def _walk_one(
    q, m_i, l_i, acc, kg_ptr, vg_ptr, bt_row, offs_k, j_lo, j_hi, blocks,
    stride_kp, stride_ko, offs_o, offs_d, row_ok, qpos, qk_scale,
    PS: tl.constexpr, IEEE: tl.constexpr, DENSE: tl.constexpr, STAGES: tl.constexpr, SPLIT_B: tl.constexpr,
):  # fmt: skip
    """One split of a one-token decode tile: ``_attend_page`` on blocks j_lo..j_hi-1 (DENSE: block j;
    else ``blocks[j]``, the token's sorted [KP] list) in a ``for`` loop given to Triton's pipeliner
    STAGES deep (the page ids are one vector load before the loop; Triton stages K / V STAGES - 1 pages
    ahead). Every row of the tile
    takes every block (its causal cut aside): the same update sequence as the union walk's."""
    if DENSE:  # the split's pages, one vector load before the loop: no load feeds another in it
        offs_s = tl.arange(0, SPLIT_B)
        pages = tl.load(bt_row + j_lo + offs_s, mask=offs_s < j_hi - j_lo, other=0)
    else:
        pages = tl.load(bt_row + blocks, mask=offs_k < j_hi, other=0)
    for j in tl.range(j_lo, j_hi, num_stages=STAGES):
        if DENSE:
            b = j
            page = tl.sum(tl.where(offs_s == j - j_lo, pages, 0), axis=0)
        else:
            b = tl.sum(tl.where(offs_k == j, blocks, 0), axis=0)
            page = tl.sum(tl.where(offs_k == j, pages, 0), axis=0)
        m_i, l_i, acc = _attend_page(
            q, m_i, l_i, acc, kg_ptr, vg_ptr, page, stride_kp, stride_ko, offs_o, offs_d, b, row_ok, qpos, qk_scale,
            PS, IEEE,
        )  # fmt: skip
    return m_i, l_i, acc


@triton.jit
def _next_split(ev, b, SPLIT_B: tl.constexpr):
    """The smallest entry of ``ev`` in a later split than block b (_BIG_ID: none)."""
    return tl.min(tl.where(ev >= (b // SPLIT_B + 1) * SPLIT_B, ev, _BIG_ID), axis=0)


@triton.jit
def _store_split(
    o_ptr,
    pm_ptr,
    pl_ptr,
    pacc_ptr,
    m_i,
    l_i,
    acc,
    s,
    tok,
    head,
    m_ok,
    row_first,
    row_last,
    slot,
    n_slots,
    stride_ot,
    stride_oh,
    offs_d,
    NH: tl.constexpr,
    D: tl.constexpr,
):
    """Decode: split s's partial of each row. A row whose keys all lie in split s writes its output
    (``_merge_split`` of one split is the split itself, so these are the bits the merge would give); a
    row with keys in several splits writes (m, l, acc) to slot ``slot`` [M] (_BIG_ID: the row has no
    key in split s) of pm / pl / pacc[token, head, slot] for ``_inv_merge_kernel``."""
    one = m_ok & (row_first == s) & (row_last == s)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        o_ptr + tok[:, None].to(tl.int64) * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
        out.to(o_ptr.dtype.element_ty),
        mask=one[:, None],
    )
    p_rows = m_ok & (row_first < row_last) & (slot != _BIG_ID)
    pidx = (tok.to(tl.int64) * NH + head) * n_slots + slot  # [M]
    tl.store(pm_ptr + pidx, m_i, mask=p_rows)
    tl.store(pl_ptr + pidx, l_i, mask=p_rows)
    tl.store(pacc_ptr + pidx[:, None] * D + offs_d[None, :], acc, mask=p_rows[:, None])


@triton.jit(do_not_specialize=["row_offset", "n_qtiles", "stride_bt_r", "split_step", "n_slots"])
def inv_attn_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    bt_ptr,
    qsl_ptr,
    pos_ptr,
    sel_ptr,
    o_ptr,
    pm_ptr,
    pl_ptr,
    pacc_ptr,
    qk_scale,
    row_offset,
    n_qtiles,
    topk,
    split_step,
    n_slots,
    stride_qt,
    stride_qh,
    stride_kp,
    stride_kg,
    stride_ko,
    stride_bt_r,
    stride_sel_t,
    stride_sel_g,
    stride_ot,
    stride_oh,
    NH: tl.constexpr,
    RH: tl.constexpr,
    RHP: tl.constexpr,
    D: tl.constexpr,
    PS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    KP: tl.constexpr,
    SPLIT_B: tl.constexpr,
    DENSE: tl.constexpr,
    IEEE: tl.constexpr,
    PDL: tl.constexpr,
    PARTIAL: tl.constexpr,
    ONE: tl.constexpr = False,
    STAGES: tl.constexpr = 1,
):
    """BLOCK_M query tokens of one row x KV head g's RH query heads (row m = token m // RHP, head
    m % RHP). The tile's keys are walked one page per step in ascending block id: every block up to
    the tile's last position (DENSE), else the sorted distinct valid blocks of the tokens' selections,
    row m masked to its token's set. Blocks are grouped in splits of SPLIT_B (split = block // SPLIT_B);
    each split runs a fresh online softmax. Decode and prefill rows alike.

    PARTIAL = False (prefill launch, split_step = 1, one program per tile): the splits are folded into
    the total in ascending order in registers (``_merge_split``), then o is written. PARTIAL = True
    (decode launch, grid axis 2 = split_step programs per tile): program z takes the tile's non-empty
    splits z, z + split_step, ... (a work split only: a split's bits do not depend on its program) and
    writes each through ``_store_split``; a sparse row with no valid block gets zeros from z = 0.
    The decode variant holds no running total: 64 fewer live fp32 registers per thread at 64 x 128
    tiles and 4 warps (the kernel spills at 255 registers; module docstring, "Cost"; decode
    forward 3-5 % faster at batch 32 on the H200, 2026-12-03); both variants run
    ``_attend_k`` / ``_attend_v`` on the same tile shape and warps, i.e. the same per-row
    operations (tests/gpu/test_invariant_attention_gpu.py checks decode = prefill bits).
    ONE (decode launches of one-token rows in small grids): a split's pages come from ``_walk_one``,
    a ``for`` loop over the token's sorted distinct blocks (dense: the split's blocks), STAGES deep
    for the pipeliner, instead of the union walk's data-dependent ``while``; the same update sequence.
    PDL (CUDA, both launches): let ``_inv_merge_kernel`` (launched with programmatic dependent
    launch) be scheduled now; it waits for this grid's stores."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    pid = tl.program_id(0)
    g = tl.program_id(1)
    z = tl.program_id(2)
    row = row_offset + pid // n_qtiles
    qtile = n_qtiles - 1 - pid % n_qtiles  # NOTE: latest (longest) tiles first: scheduling only
    q_lo = tl.load(qsl_ptr + row)
    q_hi = tl.load(qsl_ptr + row + 1)
    t0 = q_lo + qtile * BLOCK_M
    if t0 >= q_hi:
        return
    offs_m = tl.arange(0, BLOCK_M * RHP)
    tok = t0 + offs_m // RHP
    h = offs_m % RHP
    m_ok = (tok < q_hi) & (h < RH)
    qpos = tl.load(pos_ptr + tok, mask=m_ok, other=-1).to(tl.int32)  # [M]
    bt_row = bt_ptr + row * stride_bt_r
    offs_k = tl.arange(0, KP)
    if DENSE:
        n_blk = tl.max(qpos, axis=0) // PS + 1
        if z * SPLIT_B >= n_blk:
            return  # a decode program past the tile's splits (z = 0 never is)
        row_first = tl.zeros([BLOCK_M * RHP], tl.int32)
        row_last = tl.where(m_ok, qpos, 0) // PS // SPLIT_B
    else:
        # the tile's (token, slot) entries: valid = 0 <= id <= pos // PS
        offs_e = tl.arange(0, BLOCK_M * KP)
        etok = t0 + offs_e // KP
        ej = offs_e % KP
        e_ok = (etok < q_hi) & (ej < topk)
        eb = tl.load(sel_ptr + etok.to(tl.int64) * stride_sel_t + g * stride_sel_g + ej, mask=e_ok, other=-1)
        epos = tl.load(pos_ptr + etok, mask=e_ok, other=-1).to(tl.int32)
        e_ok = e_ok & (eb >= 0) & (eb <= epos // PS)
        ev = tl.where(e_ok, eb, _BIG_ID)
        b = tl.min(ev, axis=0)  # the tile's first block, then skip to its z-th non-empty split
        u = 0
        while (u < z) & (b < _BIG_ID):
            b = _next_split(ev, b, SPLIT_B)
            u += 1
        if (b == _BIG_ID) & (z > 0):
            return  # a decode program past the tile's non-empty splits
        sel_rows = tl.load(
            sel_ptr + tok[:, None].to(tl.int64) * stride_sel_t + g * stride_sel_g + offs_k[None, :],
            mask=m_ok[:, None] & (offs_k[None, :] < topk),
            other=-1,
        )  # [M, KP] each row's own token's selection
        sel_ok = (sel_rows >= 0) & (sel_rows <= (qpos // PS)[:, None])
        sel_split = tl.where(sel_ok, sel_rows // SPLIT_B, _BIG_ID)  # [M, KP]
        row_first = tl.min(sel_split, axis=1)  # _BIG_ID: no valid block
        row_last = tl.max(tl.where(sel_ok, sel_rows // SPLIT_B, -1), axis=1)
    head = g * RH + h
    offs_d = tl.arange(0, D)
    offs_o = tl.arange(0, PS)
    q = tl.load(
        q_ptr + tok[:, None].to(tl.int64) * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=m_ok[:, None],
        other=0.0,
    )  # [M, D]
    m_t = tl.full([BLOCK_M * RHP], float("-inf"), tl.float32)
    l_t = tl.zeros([BLOCK_M * RHP], tl.float32)
    acc_t = tl.zeros([BLOCK_M * RHP, D], tl.float32)
    kg_ptr = k_ptr + g * stride_kg
    vg_ptr = v_ptr + g * stride_kg
    if DENSE:
        for s in range(z, tl.cdiv(n_blk, SPLIT_B), split_step):
            m_i = tl.full([BLOCK_M * RHP], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_M * RHP], tl.float32)
            acc = tl.zeros([BLOCK_M * RHP, D], tl.float32)
            b_end = tl.minimum(s * SPLIT_B + SPLIT_B, n_blk)
            if ONE:  # decode: the one-token walk, same per-page math
                m_i, l_i, acc = _walk_one(
                    q, m_i, l_i, acc, kg_ptr, vg_ptr, bt_row, offs_k, s * SPLIT_B, b_end, s * SPLIT_B,
                    stride_kp, stride_ko, offs_o, offs_d, m_ok, qpos, qk_scale, PS, IEEE, True, STAGES, SPLIT_B
                )  # fmt: skip
            else:
                page = tl.load(bt_row + s * SPLIT_B)
                for b in range(s * SPLIT_B, b_end):
                    nxt = tl.load(bt_row + b + 1, mask=b + 1 < b_end, other=0)  # next page id, under this page
                    m_i, l_i, acc = _attend_page(
                        q,
                        m_i,
                        l_i,
                        acc,
                        kg_ptr,
                        vg_ptr,
                        page,
                        stride_kp,
                        stride_ko,
                        offs_o,
                        offs_d,
                        b,
                        m_ok,
                        qpos,
                        qk_scale,
                        PS,
                        IEEE,
                    )
                    page = nxt
            if PARTIAL:
                slot = tl.where(s <= row_last, s, _BIG_ID)
                _store_split(
                    o_ptr,
                    pm_ptr,
                    pl_ptr,
                    pacc_ptr,
                    m_i,
                    l_i,
                    acc,
                    s,
                    tok,
                    head,
                    m_ok,
                    row_first,
                    row_last,
                    slot,
                    n_slots,
                    stride_ot,
                    stride_oh,
                    offs_d,
                    NH,
                    D,
                )
            else:
                m_t, l_t, acc_t = _merge_split(m_t, l_t, acc_t, m_i, l_i, acc)
    else:
        if ONE:  # the one token's distinct valid blocks, ascending (_BIG_ID after them)
            v1 = tl.where(sel_ok, sel_rows, _BIG_ID)  # [M, KP]: rows of the padding tokens all _BIG_ID
            v1 = tl.min(v1, axis=0)  # [KP] the token's ids (every valid row holds the same list)
            dup = (v1[:, None] == v1[None, :]) & (offs_k[None, :] < offs_k[:, None])  # [j, i]: i < j, same id
            srt = tl.sort(tl.where(tl.max(dup.to(tl.int32), axis=1) > 0, _BIG_ID, v1))
        while b < _BIG_ID:  # one non-empty split of the tile per iteration
            s = b // SPLIT_B
            m_i = tl.full([BLOCK_M * RHP], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_M * RHP], tl.float32)
            acc = tl.zeros([BLOCK_M * RHP, D], tl.float32)
            if ONE:  # the split's blocks by the one-token walk over the sorted list; every valid row takes each
                j_lo = tl.sum((srt < s * SPLIT_B).to(tl.int32), axis=0)
                j_hi = tl.sum((srt < s * SPLIT_B + SPLIT_B).to(tl.int32), axis=0)
                m_i, l_i, acc = _walk_one(
                    q, m_i, l_i, acc, kg_ptr, vg_ptr, bt_row, offs_k, j_lo, j_hi, srt,
                    stride_kp, stride_ko, offs_o, offs_d, m_ok, qpos, qk_scale, PS, IEEE, False, STAGES, SPLIT_B
                )  # fmt: skip
                b = _next_split(ev, b, SPLIT_B)
            else:
                page = tl.load(bt_row + b)
                while b < s * SPLIT_B + SPLIT_B:  # the split's blocks of the union, ascending
                    nb = tl.min(tl.where(ev > b, ev, _BIG_ID), axis=0)  # next larger block id
                    nxt = tl.load(bt_row + nb, mask=nb < _BIG_ID, other=0)  # its page id, under this page
                    row_ok = m_ok & (tl.sum(tl.where(sel_rows == b, 1, 0), axis=1) > 0)
                    m_i, l_i, acc = _attend_page(
                        q,
                        m_i,
                        l_i,
                        acc,
                        kg_ptr,
                        vg_ptr,
                        page,
                        stride_kp,
                        stride_ko,
                        offs_o,
                        offs_d,
                        b,
                        row_ok,
                        qpos,
                        qk_scale,
                        PS,
                        IEEE,
                    )
                    page = nxt
                    b = nb
            if PARTIAL:
                # a row's slot for split s: its first selection slot holding a block of s
                slot = tl.min(tl.where(sel_split == s, offs_k[None, :], _BIG_ID), axis=1)
                _store_split(
                    o_ptr,
                    pm_ptr,
                    pl_ptr,
                    pacc_ptr,
                    m_i,
                    l_i,
                    acc,
                    s,
                    tok,
                    head,
                    m_ok,
                    row_first,
                    row_last,
                    slot,
                    n_slots,
                    stride_ot,
                    stride_oh,
                    offs_d,
                    NH,
                    D,
                )
                u = 1
                while (u < split_step) & (b < _BIG_ID):  # skip the other programs' splits
                    b = _next_split(ev, b, SPLIT_B)
                    u += 1
            else:
                m_t, l_t, acc_t = _merge_split(m_t, l_t, acc_t, m_i, l_i, acc)
    # prefill: every row; decode: the rows without any valid block (zeros), once
    o_rows = m_ok
    if PARTIAL:  # acc_t is never updated here (the constant zeros)
        o_rows = m_ok & (row_first == _BIG_ID) & (z == 0)
    out = acc_t / tl.where(l_t > 0, l_t, 1.0)[:, None]
    tl.store(
        o_ptr + tok[:, None].to(tl.int64) * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
        out.to(o_ptr.dtype.element_ty),
        mask=o_rows[:, None],
    )


@triton.jit(do_not_specialize=["topk", "n_slots"])
def _inv_merge_kernel(
    pos_ptr,
    sel_ptr,
    o_ptr,
    pm_ptr,
    pl_ptr,
    pacc_ptr,
    topk,
    n_slots,
    stride_sel_t,
    stride_sel_g,
    stride_ot,
    stride_oh,
    NH: tl.constexpr,
    RH: tl.constexpr,
    RHP: tl.constexpr,
    D: tl.constexpr,
    PS: tl.constexpr,
    KP: tl.constexpr,
    SPLIT_B: tl.constexpr,
    DENSE: tl.constexpr,
    PDL: tl.constexpr,
):
    """One decode token t x KV head g's RH heads: fold the partials of the token's non-empty splits
    in ascending split order (``_merge_split``, as a prefill tile does in registers) and write o.
    Tokens whose keys lie in one split (or none) were written by the attention kernel: skipped.
    PDL: launched before the attention kernel finished: wait for its stores first."""
    if PDL:
        tl.extra.cuda.gdc_wait()
    t = tl.program_id(0)
    g = tl.program_id(1)
    p = tl.load(pos_ptr + t).to(tl.int32)
    offs_k = tl.arange(0, KP)
    if DENSE:
        sid = offs_k  # unused
        first = 0
        last = p // PS // SPLIT_B
    else:
        ids = tl.load(sel_ptr + t.to(tl.int64) * stride_sel_t + g * stride_sel_g + offs_k, mask=offs_k < topk, other=-1)
        ok = (ids >= 0) & (ids <= p // PS)
        sid = tl.where(ok, ids // SPLIT_B, _BIG_ID)  # [KP]
        first = tl.min(sid, axis=0)
        last = tl.max(tl.where(ok, ids // SPLIT_B, -1), axis=0)
    if first >= last:
        return
    offs_h = tl.arange(0, RHP)
    offs_d = tl.arange(0, D)
    h_ok = offs_h < RH
    head = g * RH + offs_h
    pbase = (t.to(tl.int64) * NH + head) * n_slots  # [RHP]
    m_t = tl.full([RHP], float("-inf"), tl.float32)
    l_t = tl.zeros([RHP], tl.float32)
    acc_t = tl.zeros([RHP, D], tl.float32)
    s = first
    while s <= last:
        if DENSE:
            slot = s
        else:
            slot = tl.min(tl.where(sid == s, offs_k, _BIG_ID), axis=0)
        m_s = tl.load(pm_ptr + pbase + slot, mask=h_ok, other=float("-inf"))
        l_s = tl.load(pl_ptr + pbase + slot, mask=h_ok, other=0.0)
        acc_s = tl.load(pacc_ptr + (pbase + slot)[:, None] * D + offs_d[None, :], mask=h_ok[:, None], other=0.0)
        m_t, l_t, acc_t = _merge_split(m_t, l_t, acc_t, m_s, l_s, acc_s)
        if DENSE:
            s += 1
        else:
            s = tl.min(tl.where(sid > s, sid, _BIG_ID), axis=0)
    out = acc_t / tl.where(l_t > 0, l_t, 1.0)[:, None]
    tl.store(
        o_ptr + t.to(tl.int64) * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
        out.to(o_ptr.dtype.element_ty),
        mask=h_ok[:, None],
    )


def _row_ranges(meta: PagedMetadata) -> list[tuple[int, int, int]]:
    """(first row, end row, query tokens per row bound) of the decode rows and of the prefill rows.

    The two launches of one kernel differ only in their grid (tiles per row), never in constants."""
    nd, r = meta.num_decodes, meta.num_rows
    out = []
    if nd > 0:
        out.append((0, nd, max(meta.decode_query_len, 1)))
    if r > nd:
        out.append((nd, r, max(meta.max_query_len, 1)))
    return out


def _decode_split_programs(n_splits: int, n_tiles: int, max_sparse_splits: int) -> int:
    """Programs per decode tile (grid axis 2): enough for about ``DECODE_PROGRAMS`` in all, at most
    the table's splits (and, sparse, the tile's ``max_sparse_splits`` non-empty ones; 0 = dense).
    A work split only: which program computes a split never changes its bits."""
    z = min(n_splits, max(1, triton.cdiv(DECODE_PROGRAMS, n_tiles)))
    return min(z, max_sparse_splits) if max_sparse_splits > 0 else z


def check_sparse_impl(sparse_impl: str) -> str:
    """``sparse_impl`` if it is one of ``SPARSE_IMPLS``; else ValueError naming it."""
    if sparse_impl not in SPARSE_IMPLS:
        raise ValueError(f"invariant_attention: sparse_impl={sparse_impl!r}; one of {SPARSE_IMPLS}")
    return sparse_impl


def _check_attention_inputs(q, k_cache_l, v_cache_l, topk_ids) -> None:
    """``check_attention_inputs`` of the fast op, plus the top-k width this kernel's sort holds."""
    check_attention_inputs(q, k_cache_l, v_cache_l, topk_ids, op="invariant_paged_attention")
    if topk_ids is not None and not 1 <= topk_ids.shape[2] <= MAX_TOPK:
        raise ValueError(f"invariant_paged_attention: top-k width {topk_ids.shape[2]}; 1..{MAX_TOPK} supported")


def _check_meta(meta: PagedMetadata, t: int, op: str) -> None:
    """Raises ValueError naming ``op`` unless ``meta`` describes the T = ``t`` query tokens: positions
    [T], decode tokens (num_decodes x decode_query_len) at most T, block_tables and query_start_loc
    covering the R = ``meta.num_rows`` rows, num_decodes <= R (host shapes only, no sync). The
    kernels index positions and tables by token and row: a mismatch reads past them."""
    nd, r = meta.num_decodes, meta.num_rows
    if tuple(meta.positions.shape) != (t,) or nd * meta.decode_query_len > t or not 0 <= nd <= r:
        raise ValueError(
            f"{op}: metadata of {tuple(meta.positions.shape)} positions, {nd} decode rows x "
            f"{meta.decode_query_len} tokens of {r} rows for T={t} query tokens; positions must be [T]"
        )
    if meta.block_tables.dim() != 2 or meta.block_tables.shape[0] < r or meta.query_start_loc.shape[0] < r + 1:
        raise ValueError(
            f"{op}: block_tables {tuple(meta.block_tables.shape)} / query_start_loc "
            f"{tuple(meta.query_start_loc.shape)} do not cover the metadata's {r} rows"
        )


def _check_tile_choice(tile_rows: int | None, warps: int | None) -> None:
    """Raises ValueError unless tile_rows is None or a power of two >= 16 (the smallest dot M) and
    warps None or a power of two in 1..16 (``invariant_paged_attention``'s keywords)."""
    if tile_rows is not None and (tile_rows < 16 or tile_rows & (tile_rows - 1)):
        raise ValueError(f"invariant_paged_attention: tile_rows {tile_rows}; a power of two >= 16")
    if warps is not None and warps not in (1, 2, 4, 8, 16):
        raise ValueError(f"invariant_paged_attention: warps {warps}; 1, 2, 4, 8 or 16")


def invariant_paged_attention(
    q: torch.Tensor,
    k_cache_l: torch.Tensor,
    v_cache_l: torch.Tensor,
    meta: PagedMetadata,
    scale: float,
    topk_ids: torch.Tensor | None = None,
    tile_rows: int | None = None,
    warps: int | None = None,
    scratch: torch.Tensor | None = None,
    sparse_impl: str = DEFAULT_SPARSE_IMPL,
) -> torch.Tensor:
    """Batch-invariant ``paged_attention`` (PagedOps field; reference ``paged_attention_ref``, spec §3.5).

    q: [T, nh, d] fp32 / fp16 / bf16 (decode rows first, kernels/paged_layout.py); k_cache_l,
    v_cache_l: [P, G, ps, d] same dtype, contiguous pages; scale: softmax scale (1/sqrt(d));
    topk_ids: [T, G, K] integer block ids (-1 = empty; ids past a token's own block are ignored;
    a repeated id counts once) or None = dense causal. Returns [T, nh, d] in q.dtype; each token's
    bits depend only on its own query, position, block ids and the K/V it attends (module
    docstring). CUDA-graph safe (grids from host ints and shapes, no host sync).
    Raises ValueError for unsupported dtypes or sizes (d, ps powers of two in [16, 256], nh % G,
    K in 1..64, tile_rows / warps below), naming the field. tile_rows / warps: another tile height
    (dot rows, a power of two >= 16) / warp count (a power of two <= 16)
    than the layer kind's ``DENSE_TILE_ROWS`` / ``SPARSE_TILE_ROWS`` and ``DENSE_WARPS`` / ``SPARSE_WARPS``
    (scripts/bench_invariant_attention.py --tile-sweep; a layer must keep one choice for decode and
    prefill, the engine never passes one); not read by sparse layers with ``sparse_impl`` "page_partials".
    Sparse layers follow ``sparse_impl`` (one of ``SPARSE_IMPLS``; default ``DEFAULT_SPARSE_IMPL``,
    "page_partials"; the engine's ops table binds its config's choice): "page_partials" computes them
    with ``invariant_page_partials.page_partials_attention``, whose KV-major partials use ``scratch``
    (None or a contiguous uint8 vector on q's device, kernels/paged_layout.py; the engine binds
    its own when the table says ``takes_prefill_scratch``); "union" ignores it. Raises ValueError
    for a bad scratch, an unknown ``sparse_impl`` or a ``meta`` that does not describe q's T tokens
    (``_check_meta``).
    """
    _check_attention_inputs(q, k_cache_l, v_cache_l, topk_ids)
    _check_meta(meta, q.shape[0], "invariant_paged_attention")
    _check_tile_choice(tile_rows, warps)
    check_kv_major_scratch(scratch, q.device, "invariant_paged_attention")
    sparse_impl = check_sparse_impl(sparse_impl)
    t, nh, d = q.shape
    g, ps = k_cache_l.shape[1], k_cache_l.shape[2]
    out = torch.empty_like(q)
    if t == 0:
        return out
    dense = topk_ids is None
    # the kernels read a token's K slots at unit stride: any other layout is copied first
    sel = q.new_empty((1, 1, 1), dtype=torch.int32) if dense else topk_ids.to(torch.int32).contiguous()
    if not dense and sparse_impl == "page_partials":
        return page_partials_attention(q, k_cache_l, v_cache_l, meta, scale, sel, out, scratch)
    topk = 0 if dense else int(topk_ids.shape[2])
    rh = nh // g
    rhp = next_pow2(rh)
    bm = attn_block_m(rh, tile_rows or (DENSE_TILE_ROWS if dense else SPARSE_TILE_ROWS))
    kp = max(next_pow2(topk), 2)
    ieee = q.dtype == torch.float32
    pdl = q.is_cuda and PDL
    n_splits = triton.cdiv(meta.block_tables.shape[1], ATTN_SPLIT_BLOCKS)
    n_slots = n_splits if dense else topk  # partial slots per (decode token, head)
    t_dec = min(t, meta.num_decodes * meta.decode_query_len)
    merge = t_dec > 0 and n_splits > 1  # with one split every decode token is written directly
    if merge:
        pm = torch.empty(t_dec * nh * n_slots, dtype=torch.float32, device=q.device)
        pl = torch.empty_like(pm)
        pacc = torch.empty(t_dec * nh * n_slots * d, dtype=torch.float32, device=q.device)
    else:
        pm = pl = pacc = torch.empty(1, dtype=torch.float32, device=q.device)
    for r0, r1, qlen in _row_ranges(meta):
        n_qtiles = triton.cdiv(qlen, bm)
        decode = r0 < meta.num_decodes
        z = _decode_split_programs(n_splits, (r1 - r0) * n_qtiles * g, topk * min(qlen, bm)) if decode else 1
        # one-token decode rows in a small grid: the one-token walk (_walk_one)
        one = decode and qlen == 1 and DECODE_PIPELINE and (r1 - r0) * g * z <= DECODE_PIPELINE_PROGRAMS
        inv_attn_kernel[((r1 - r0) * n_qtiles, g, z)](
            q,
            k_cache_l,
            v_cache_l,
            meta.block_tables,
            meta.query_start_loc,
            meta.positions,
            sel,
            out,
            pm,
            pl,
            pacc,
            float(scale) * LOG2E,
            r0,
            n_qtiles,
            topk,
            z,
            n_slots,
            q.stride(0),
            q.stride(1),
            k_cache_l.stride(0),
            k_cache_l.stride(1),
            k_cache_l.stride(2),
            meta.block_tables.stride(0),
            sel.stride(0),
            sel.stride(1),
            out.stride(0),
            out.stride(1),
            NH=nh,
            RH=rh,
            RHP=rhp,
            D=d,
            PS=ps,
            BLOCK_M=bm,
            KP=kp,
            SPLIT_B=ATTN_SPLIT_BLOCKS,
            DENSE=dense,
            IEEE=ieee,
            PDL=pdl,
            PARTIAL=decode,
            ONE=one,
            STAGES=decode_walk_stages(ieee, bm * rhp, d, ps, q.element_size()) if one else 1,  # only the walk reads it
            num_warps=warps or ((DENSE_WARPS if dense else SPARSE_WARPS) if d >= 128 else 4),
            num_stages=1 if ieee else 2,
        )
        if decode and merge:  # before the prefill launch: PDL chains it to the decode launch
            _inv_merge_kernel[(t_dec, g)](
                meta.positions,
                sel,
                out,
                pm,
                pl,
                pacc,
                topk,
                n_slots,
                sel.stride(0),
                sel.stride(1),
                out.stride(0),
                out.stride(1),
                NH=nh,
                RH=rh,
                RHP=rhp,
                D=d,
                PS=ps,
                KP=kp,
                SPLIT_B=ATTN_SPLIT_BLOCKS,
                DENSE=dense,
                PDL=pdl,
                num_warps=4,
                **({"launch_pdl": True} if pdl else {}),
            )
    return out


def _check_ids_out(ids: torch.Tensor, t: int, g: int, topk: int, op: str) -> None:
    """The top-k kernels write ids[t, g, k] at (t * G + g) * K + k: a contiguous int32 [T, G, K]."""
    if ids.dtype != torch.int32 or tuple(ids.shape) != (t, g, topk) or not ids.is_contiguous():
        raise ValueError(
            f"{op}: the ids output must be a contiguous int32 [T={t}, G={g}, K={topk}] tensor; got "
            f"{ids.dtype} {tuple(ids.shape)} with strides {ids.stride()} (copy into a strided record afterwards)"
        )


def invariant_index_scores(
    iq: torch.Tensor, index_cache_l, meta: PagedMetadata, decode_topk: dict | None = None
) -> tuple[torch.Tensor, int]:
    """[T, G, NBP] fp32 block-max index scores (spec §3.4), batch-invariant; entries past a token's
    own block are unwritten (garbage).

    iq: [T, G, di] fp32/fp16/bf16; index_cache_l: [P, ps, di] same dtype or an ``FP8IndexCache``.
    Entry [t, g, b], b <= pos(t) // ps: max over block b's keys u <= pos(t) of <iq[t, g], ik[u]>
    (dequantized keys / queries for FP8), NaN -> -1e30.
    decode_topk: {"ids": [T, G, K] int32, "topk", "init_blocks", "local_blocks"}: the decode rows'
    launch also writes their top-k ids (``_inv_scores_kernel``'s TOPK_KP, ``DECODE_FUSED_TOPK``)
    when the device's split-K counters allow it (``split_k.tile_counters``). Returns (scores, the
    number of leading tokens whose ids were written so: the decode tokens, or 0). Raises ValueError
    for a ``meta`` that does not describe iq's T tokens (``_check_meta``) or a bad ids output.
    """
    t, g, di = iq.shape
    _check_meta(meta, t, "invariant_index_scores")
    if decode_topk is not None:
        _check_ids_out(decode_topk["ids"], t, g, decode_topk["topk"], "invariant_index_scores")
    nbp = meta.block_tables.shape[1]
    scores = torch.empty(t, g, nbp, dtype=torch.float32, device=iq.device)
    if t == 0:
        return scores, 0
    keys, kscales, qfp8 = split_index_cache(index_cache_l)
    gp = next_pow2(g)
    bm = index_block_m(g)
    ieee = iq.dtype == torch.float32 and not qfp8
    done = 0
    for r0, r1, qlen in _row_ranges(meta):
        n_qtiles = triton.cdiv(qlen, bm)
        decode = r0 < meta.num_decodes
        split_b = SCORE_SPLIT_BLOCKS_DECODE if decode else SCORE_SPLIT_BLOCKS
        cnt = None
        if decode and decode_topk is not None and DECODE_FUSED_TOPK:
            cnt = tile_counters(iq.device, (r1 - r0) * n_qtiles)
        if cnt is not None:  # the fused top-k's outputs and arguments
            ids, counters = decode_topk["ids"], cnt
            topk, init, local = decode_topk["topk"], decode_topk["init_blocks"], decode_topk["local_blocks"]
            kp = max(next_pow2(topk), 2)
        else:  # TOPK_KP = 0: the pointers and values are not read
            ids, counters, topk, init, local, kp = scores, scores, 0, 0, 1, 0
        _inv_scores_kernel[((r1 - r0) * n_qtiles, triton.cdiv(nbp, split_b))](
            iq,
            keys,
            keys if kscales is None else kscales,
            meta.block_tables,
            meta.query_start_loc,
            meta.positions,
            scores,
            ids,
            counters,
            r0,
            n_qtiles,
            topk,
            init,
            local,
            iq.stride(0),
            iq.stride(1),
            keys.stride(0),
            keys.stride(1),
            0 if kscales is None else kscales.stride(0),
            meta.block_tables.stride(0),
            scores.stride(0),
            scores.stride(1),
            G=g,
            GP=gp,
            DI=di,
            PS=keys.shape[1],
            BLOCK_M=bm,
            SPLIT_B=split_b,
            KSCALE=kscales is not None,
            QFP8=qfp8,
            TOPK_KP=kp,
            TOPK_CH=max(TOPK_CHUNK, kp),
            TOPK_SHORT=TOPK_SHORT_PATH and kp > 0,  # (no top-k: one compiled variant whatever the switch)
            num_warps=4,
            num_stages=1 if ieee else 2,
        )
        if cnt is not None:
            done = meta.num_decodes * meta.decode_query_len
    return scores, done


def invariant_select_blocks(
    scores: torch.Tensor,
    meta: PagedMetadata,
    topk: int,
    page_size: int,
    init_blocks: int = 0,
    local_blocks: int = 1,
    out: torch.Tensor | None = None,
    first_token: int = 0,
) -> torch.Tensor:
    """[T, G, K] int32 top-k block ids from ``invariant_index_scores``: forced local / init blocks first
    (lower id first), then score desc with ties to the lower id, -1 past min(K, pos // ps + 1).
    out / first_token: write into ``out`` ([T, G, K] int32) the tokens from ``first_token`` on only
    (the earlier ones' ids came from the decode score launch)."""
    t, g, _ = scores.shape
    if out is None:
        out = torch.empty(t, g, topk, dtype=torch.int32, device=scores.device)
    _check_ids_out(out, t, g, topk, "invariant_select_blocks")
    if t <= first_token:
        return out
    gp = next_pow2(g)
    tok = max(1, TOPK_ROWS // gp)
    kp = max(next_pow2(topk), 2)
    _inv_topk_kernel[(triton.cdiv(t - first_token, tok),)](
        scores,
        meta.positions,
        out,
        first_token,
        t,
        topk,
        init_blocks,
        local_blocks,
        scores.stride(0),
        scores.stride(1),
        G=g,
        GP=gp,
        TOK=tok,
        PS=page_size,
        CH=max(TOPK_CHUNK, kp),
        KP=kp,
        SHORT=TOPK_SHORT_PATH,
        num_warps=TOPK_WARPS,
    )
    return out


def invariant_index_topk(
    iq: torch.Tensor,
    index_cache_l: torch.Tensor | FP8IndexCache,
    meta: PagedMetadata,
    topk: int,
    init_blocks: int = 0,
    local_blocks: int = 1,
) -> torch.Tensor:
    """Batch-invariant ``index_topk`` (reference ``index_topk_ref``, spec §3.4): [T, G, K] int32.

    iq: [T, G, di] post-norm post-RoPE index queries (fp32/fp16/bf16); index_cache_l: [P, ps, di]
    same dtype (already holding this step's keys) or an ``FP8IndexCache``. The decode rows' ids come
    from their score launch (``DECODE_FUSED_TOPK``), the prefill rows' from ``_inv_topk_kernel``;
    the same integer ranking either way. Raises ValueError for unsupported dtypes or sizes, naming
    the field.
    """
    check_index_inputs(iq, index_cache_l, topk, op="invariant_index_topk")
    out = torch.empty(iq.shape[0], iq.shape[1], topk, dtype=torch.int32, device=iq.device)
    fused = dict(ids=out, topk=topk, init_blocks=init_blocks, local_blocks=local_blocks)
    scores, done = invariant_index_scores(iq, index_cache_l, meta, fused)
    ps = split_index_cache(index_cache_l)[0].shape[1]
    return invariant_select_blocks(scores, meta, topk, ps, init_blocks, local_blocks, out=out, first_token=done)


def invariant_msa_attention(
    q: torch.Tensor,
    iq: torch.Tensor,
    k_cache_l: torch.Tensor,
    v_cache_l: torch.Tensor,
    index_cache_l: torch.Tensor | FP8IndexCache,
    meta: PagedMetadata,
    scale: float,
    topk: int,
    init_blocks: int = 0,
    local_blocks: int = 1,
    sel_out: torch.Tensor | None = None,
    scratch: torch.Tensor | None = None,
    sparse_impl: str = DEFAULT_SPARSE_IMPL,
) -> torch.Tensor:
    """Batch-invariant ``msa_attention`` (PagedOps field; reference ``msa_attention_ref``, spec §3.4-3.5).

    q: [T, nh, d]; iq: [T, G, di]; k_cache_l, v_cache_l: [P, G, ps, d]; index_cache_l: [P, ps, di]
    or an ``FP8IndexCache`` (all already holding this step's keys); meta: ``PagedMetadata``
    (decode rows first). ``invariant_index_topk`` then ``invariant_paged_attention`` over the
    choice, for decode and prefill rows alike. sel_out: optional [T, G, K] integer tensor (any
    strides; the engine's block-selection record) receiving the choice. scratch, sparse_impl:
    handed to ``invariant_paged_attention`` (scratch read with "page_partials"). Returns [T, nh, d]
    in q.dtype. Raises ValueError for unsupported dtypes or sizes, naming the field, or an unknown
    ``sparse_impl``.
    """
    sparse_impl = check_sparse_impl(sparse_impl)
    if iq.shape[:2] != (q.shape[0], k_cache_l.shape[1]):
        raise ValueError(
            f"invariant_msa_attention: iq {tuple(iq.shape)} needs [T={q.shape[0]}, G={k_cache_l.shape[1]}, di]"
        )
    ids = invariant_index_topk(iq, index_cache_l, meta, topk, init_blocks, local_blocks)
    if sel_out is not None:
        sel_out.copy_(ids)
    return invariant_paged_attention(
        q, k_cache_l, v_cache_l, meta, scale, ids, scratch=scratch, sparse_impl=sparse_impl
    )

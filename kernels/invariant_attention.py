"""Batch-invariant MSA attention: index scores + top-k and paged attention whose bits do not depend on the batch.

Which path is this: the attention ops of the engine's batch-invariant mode (issue 24, design
"bitwise on-policy"): ``invariant_paged_attention`` and ``invariant_msa_attention`` have the
``PagedOps`` signatures (m3_rollout/model/paged_ops.py) and replace the fast kernels of
``msa_paged_attention`` / ``msa_fused_decode`` / ``msa_index_topk`` there. Spec §3.4-3.5.

Governing idea (the reduction-order argument): a result element is a function of its inputs and
of the sequence of floating-point operations that produce it. Each op here computes the value of
one (query token, head) row with a sequence that depends only on that row's own data, never on
the launch:
- one kernel, one set of compile-time constants (tile shapes, ``num_warps``, ``num_stages``, IEEE
  or tensor-core dots) for decode rows and prefill rows alike. The tile shapes depend only on the
  model (head counts, dims, page size, top-k), not on the batch, the chunk or the context; the
  integer arguments that vary with the step (row offset, tiles per row, block-table width, token
  count) are not specialized on, so every step runs the same compiled kernel;
- a tensor-core (or interpreter) dot of a fixed ``[M, k] x [k, n]`` shape computes row m from row m
  of the left operand alone, in an order fixed by the shape: other rows of the tile (other tokens
  of a prefill chunk, or zero padding rows of a decode step) cannot change it. A decode token is
  therefore padded into the prefill tile shape (``BLOCK_M`` tokens), never run in a smaller tile;
- no reduction crosses a row boundary or a launch: no split-K over the KV (so no merge whose
  weights or count depend on the batch), no cross-program combine;
- reductions whose order does not matter are free to be split: a block's index score is a max
  (exact), and each block's score is computed by one program from that block alone, so the score
  kernel splits blocks over programs; the top-k compares integer keys (exact).
Rows that share a tile but not a KV page: a tile walks the union of what its rows need; a row that
does not need a step's page sees only masked keys, and an online-softmax update with all keys
masked is an exact no-op (m unchanged, alpha = exp2(0) = 1, p = 0, acc + 0, l + 0), so each row's
effective sequence of updates is its own keys, page by page, in ascending block id.
NOTE: that no-op needs finite K/V in the masked slots a row reads (0 x inf = NaN); the engine
zero-fills its pages and only writes finite keys, the same assumption the fast kernels make.

Ops
---
1. ``invariant_index_topk`` (two launches):
   - ``_inv_scores_kernel``: grid (row tiles, block splits). A program takes ``BLOCK_M`` tokens x
     all G index heads (``INDEX_TILE_ROWS`` = 64 dot rows at M3 shapes: 16 tokens x 4 heads) and
     ``SCORE_SPLIT_BLOCKS`` consecutive blocks; per block one ``[M, di] x [di, ps]`` dot (fp32
     accumulation; IEEE for fp32), causal mask, max over the block's keys (NaN propagates, then
     -1e30). Writes a ``[T, G, NBP]`` fp32 scratch (only each token's causal blocks are written).
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
2. ``invariant_paged_attention`` (one kernel, ``_inv_attn_kernel``, launched once for the decode
   rows and once for the prefill rows with the same constants): a program takes ``BLOCK_M``
   consecutive query tokens of one row x the RH query heads of one KV head (``ATTN_TILE_ROWS`` = 64
   dot rows at M3 shapes: 4 tokens x 16 heads; a decode row = 1 token + 3 zero tokens). It walks
   one page (= block, ``ps`` keys) per step in ascending block id: dense layers every block up to
   the tile's last position; sparse layers the sorted distinct valid blocks the tile's tokens
   selected (the union), each row masked to its own token's set and causal cut. Online softmax in
   base 2 (scale x log2 e), fp32 m / l / acc; fp16/bf16 inputs round the probabilities to the
   input dtype for the PV dot (as the fast kernels do); fp32 inputs use IEEE dots.
3. ``invariant_msa_attention``: 1 then 2 (three launches for any mix of decode and prefill rows),
   the choice copied into ``sel_out``.

Consequences (what the CPU tests check bitwise, and the GPU tests at M3 shapes): the output and the
selection of a position are identical whether it is the last token of a decode step (also of a
speculative-verify row), row i of a prefill chunk, in one chunk or several, after a prefix-cache
hit, beside other sequences or CUDA-graph padding rows; a sparse layer whose selection holds all
causal blocks gives the dense layer's bits. The selection equals the reference's whenever the
scores do (fp32 up to summation order; the order here is the kernel's, fixed).
NOTE: under the Triton interpreter ``tl.dot`` is numpy's BLAS matmul, whose result for a row
depends on the row's place in the tile; the CPU tests therefore run with
``msa_interpret.fixed_order_dot``. That the GPU's fixed-shape dot is row-invariant (the premise of
the second rule above) is checked only by tests/gpu/test_invariant_attention_gpu.py.

Cost against the fast kernels (expected; measure on the H200, issue 24's benchmark)
-----------------------------------------------------------------------------------
- Decode attention has no split-K: one program per (token, KV head) walks its K selected pages
  (sparse) or every causal page (dense) serially, where ``msa_paged_attention`` / the fused decode
  split the walk over up to 256 / (tokens x G) programs and merge. At batch 1 (4 programs) a sparse
  layer's step is latency-bound on 16 sequential page steps (a few x the fused kernel's time);
  a dense layer at 32K context walks 256 pages in one program (the worst case; 3 of M3's 60 layers).
  At batch >= 32 there are enough programs and the gap mostly closes. If it is over budget, split
  by a FIXED number of pages (say 16 per split, merged in ascending split order): still invariant.
- Decode tiles are padded to the prefill shape: 64 dot rows for 16 useful (attention) and for 4
  useful (scores); the tensor-core work grows 4x / 16x, but decode is bound by reading K/V and index
  keys, so this should cost little.
- Sparse prefill always takes the union-of-tile walk (4 tokens per tile, every row pays for the
  union of its tile's blocks, ~1-3x the selected work); the fast kernel switches to the KV-major
  path (each page read once per segment of entries) from 16K prefill tokens, so long sparse
  prefills are expected ~1.5-2x slower in attention.
- Dense prefill: 4-token tiles (64 rows) where the fast kernel takes 8 (128 rows), so every K/V page
  is read twice as often; expected up to ~1.5x slower on dense layers' long prefills.
- The MSA decode step is three launches (scores, top-k, attention) instead of the fused two with
  programmatic dependent launch, and the score kernel has no unmasked fast loop, register cap or
  key sub-tiles: a few microseconds per sparse layer and decode step.
- The [T, G, NBP] fp32 score scratch goes through memory for decode as for prefill. Score programs
  of a split past the tile's causal blocks return before loading anything (at decode most of the
  ``cdiv(NBP, SCORE_SPLIT_BLOCKS)`` splits).
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

from m3_kernels.msa_checks import next_pow2
from m3_kernels.msa_fp8 import index_dot, quantize_rows_e4m3, split_index_cache
from m3_kernels.msa_index_topk import MAX_TOPK, check_index_inputs
from m3_kernels.msa_paged_attention import LOG2E, attend_block, check_attention_inputs
from m3_kernels.paged_layout import FP8IndexCache, PagedMetadata

# Dot rows per program (tokens x heads). Fixed by the model's shapes only; 64 = the smallest M of a
# Hopper warpgroup MMA, so decode (padded) and prefill tiles run one instruction shape.
ATTN_TILE_ROWS = 64
INDEX_TILE_ROWS = 64
SCORE_SPLIT_BLOCKS = 16  # blocks per score program (a block's score never depends on another block)
TOPK_CHUNK = 128  # blocks per step of the streaming top-k (one bitonic top-KP of [rows, TOPK_CHUNK] keys)
TOPK_ROWS = 4  # (token, head) rows per top-k program: one warp per row, 4 keys per thread
TOPK_WARPS = 4
_BIG_ID = tl.constexpr(2147483647)  # "no block" in the union walk (above every block id)
_KEY_EMPTY = tl.constexpr(-(2**63))  # below every top-k key


def attn_block_m(rh: int) -> int:
    """Query tokens per attention tile for RH query heads per KV head: ATTN_TILE_ROWS // next_pow2(RH), >= 1."""
    return max(1, ATTN_TILE_ROWS // next_pow2(rh))


def index_block_m(g: int) -> int:
    """Query tokens per score tile for G index heads: INDEX_TILE_ROWS // next_pow2(G), >= 1."""
    return max(1, INDEX_TILE_ROWS // next_pow2(g))


@triton.jit(do_not_specialize=["row_offset", "n_qtiles", "stride_bt_r"])
def _inv_scores_kernel(
    iq_ptr,
    ik_ptr,
    iks_ptr,
    bt_ptr,
    qsl_ptr,
    pos_ptr,
    score_ptr,
    row_offset,
    n_qtiles,
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
):
    """Block-max index scores of BLOCK_M tokens x G heads (row m = token m // GP, head m % GP) over
    blocks [split * SPLIT_B, (split + 1) * SPLIT_B) of their causal range; one block per step.

    score[t, g, b] = max over block b's keys u <= pos(t) of <iq[t, g], ik[u]> (x the key's scale with
    KSCALE; x the query row's scale after the max with QFP8), NaN -> -1e30; written for b <= pos(t) // PS.
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
    b_lo = split * SPLIT_B
    b_hi = tl.minimum(b_lo + SPLIT_B, n_blk)
    if b_lo >= b_hi:
        return  # a split past the tile's causal blocks (most of the grid at decode): no query load
    offs_d = tl.arange(0, DI)
    offs_o = tl.arange(0, PS)
    q = tl.load(
        iq_ptr + tok[:, None].to(tl.int64) * stride_iq_t + head[:, None] * stride_iq_g + offs_d[None, :],
        mask=m_ok[:, None],
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


@triton.jit
def _inv_topk_chunk_keys(s, b, cand, n_cand, init_blocks, local_blocks):
    """[R, CH] int64 keys of candidate blocks b ([CH] ids, ``cand`` [R, CH] = b < n_cand): the
    order-preserving int32 of the score (+inf for forced blocks, NaN -> -1e30, -0.0 -> +0.0) << 32
    | (0x7FFFFFFF - b), so a larger key = forced first, then score desc, ties to the lower id;
    ``_KEY_EMPTY`` (below every key) where not a candidate."""
    s = tl.where(s != s, -1e30, s)  # the score kernel already did it; NaN must never reach a key
    forced = cand & ((b[None, :] >= n_cand[:, None] - local_blocks) | (b < init_blocks)[None, :])
    s = tl.where(forced, float("inf"), s) + 0.0  # + 0.0: -0.0 -> +0.0 (equal in the reference)
    bits = s.to(tl.int32, bitcast=True)
    bits = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # order-preserving float -> signed int
    key = (bits.to(tl.int64) << 32) | (0x7FFFFFFF - b).to(tl.int64)[None, :]
    return tl.where(cand, key, _KEY_EMPTY)


@triton.jit(do_not_specialize=["n_tok"])
def _inv_topk_kernel(
    score_ptr,
    pos_ptr,
    ids_ptr,
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
):
    """Top-k block ids of TOK tokens x their G heads (row r = token r // GP, head r % GP) from the scores.

    Each row's candidates 0..pos // PS stream in chunks of CH blocks (the next chunk's scores are
    loaded while this one is merged). Per chunk: int64 keys (``_inv_topk_chunk_keys``); a chunk where
    no row has a key above its own K-th kept key is skipped; else the chunk's KP largest keys
    (``tl.topk``: bitonic, sorted descending) are merged with the row's running KP largest (sorted
    descending) by one bitonic split (elementwise max against the reversed list = the KP largest
    of the union) and one bitonic merge (log2 KP compare-exchange steps). Integer keys are
    distinct per row (the block id is in them) and every step is an exact compare: the result is
    the KP largest keys in order, whatever the chunking or the rows sharing the program.
    Writes ids[t, g, 0..K-1], -1 past the row's candidates.
    """
    offs_r = tl.arange(0, TOK * GP)
    t = tl.program_id(0) * TOK + offs_r // GP
    g = offs_r % GP
    r_ok = (t < n_tok) & (g < G)
    p = tl.load(pos_ptr + t, mask=r_ok, other=0).to(tl.int32)
    n_cand = tl.where(r_ok, p // PS + 1, 0)  # [R]
    offs_k = tl.arange(0, KP)
    offs_c = tl.arange(0, CH)
    best = tl.full([TOK * GP, KP], _KEY_EMPTY, tl.int64)  # running top KP keys, descending
    srow = score_ptr + t.to(tl.int64) * stride_s_t + g * stride_s_g  # [R]
    nxt = tl.load(srow[:, None] + offs_c[None, :], mask=offs_c[None, :] < n_cand[:, None], other=0.0)
    for c0 in range(0, tl.max(n_cand, axis=0), CH):
        b = c0 + offs_c
        cand = b[None, :] < n_cand[:, None]  # [R, CH]
        s = nxt
        nb = b + CH
        nxt = tl.load(srow[:, None] + nb[None, :], mask=nb[None, :] < n_cand[:, None], other=0.0)
        key = _inv_topk_chunk_keys(s, b, cand, n_cand, init_blocks, local_blocks)
        kth = tl.max(tl.where((offs_k == topk - 1)[None, :], best, _KEY_EMPTY), axis=1)  # [R]
        if tl.max(tl.max((key > kth[:, None]).to(tl.int32), axis=1), axis=0) > 0:
            top = tl.topk(key, KP)  # [R, KP] descending
            best = tl.bitonic_merge(tl.maximum(best, tl.flip(top, 1)), descending=True)
    bid = 0x7FFFFFFF - (best & 0xFFFFFFFF).to(tl.int32)
    bid = tl.where(best == _KEY_EMPTY, -1, bid)
    tl.store(
        ids_ptr + (t.to(tl.int64) * G + g)[:, None] * topk + offs_k[None, :],
        bid,
        mask=r_ok[:, None] & (offs_k < topk)[None, :],
    )


@triton.jit(do_not_specialize=["row_offset", "n_qtiles", "stride_bt_r"])
def _inv_attn_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    bt_ptr,
    qsl_ptr,
    pos_ptr,
    sel_ptr,
    o_ptr,
    qk_scale,
    row_offset,
    n_qtiles,
    topk,
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
    RH: tl.constexpr,
    RHP: tl.constexpr,
    D: tl.constexpr,
    PS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    KP: tl.constexpr,
    DENSE: tl.constexpr,
    IEEE: tl.constexpr,
):
    """BLOCK_M query tokens of one row x KV head g's RH query heads (row m = token m // RHP, head
    m % RHP), one page per step in ascending block id: every block up to the tile's last position
    (DENSE), else the sorted distinct valid blocks of the tokens' selections, row m masked to its
    token's set. Decode and prefill rows alike."""
    pid = tl.program_id(0)
    g = tl.program_id(1)
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
    head = g * RH + h
    offs_d = tl.arange(0, D)
    offs_o = tl.arange(0, PS)
    q = tl.load(
        q_ptr + tok[:, None].to(tl.int64) * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=m_ok[:, None],
        other=0.0,
    )  # [M, D]
    qpos = tl.load(pos_ptr + tok, mask=m_ok, other=-1).to(tl.int32)  # [M]
    m_i = tl.full([BLOCK_M * RHP], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M * RHP], tl.float32)
    acc = tl.zeros([BLOCK_M * RHP, D], tl.float32)
    kg_ptr = k_ptr + g * stride_kg
    vg_ptr = v_ptr + g * stride_kg
    bt_row = bt_ptr + row * stride_bt_r
    if DENSE:
        n_blk = tl.max(qpos, axis=0) // PS + 1
        for b in range(0, n_blk):
            page = tl.load(bt_row + b)
            m_i, l_i, acc = attend_block(
                q,
                m_i,
                l_i,
                acc,
                kg_ptr,
                vg_ptr,
                page,
                b,
                m_ok,
                qpos,
                qk_scale,
                stride_kp,
                stride_ko,
                offs_o,
                offs_d,
                PS,
                IEEE,
            )
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
        earlier = tl.sum(tl.where((ev[:, None] == ev[None, :]) & (offs_e[None, :] < offs_e[:, None]), 1, 0), axis=1)
        n_u = tl.sum((e_ok & (earlier == 0)).to(tl.int32), axis=0)  # distinct valid blocks of the tile
        offs_k = tl.arange(0, KP)
        sel_rows = tl.load(
            sel_ptr + tok[:, None].to(tl.int64) * stride_sel_t + g * stride_sel_g + offs_k[None, :],
            mask=m_ok[:, None] & (offs_k[None, :] < topk),
            other=-1,
        )  # [M, KP] each row's own token's selection
        b = tl.min(ev, axis=0)
        for _u in range(0, n_u):
            page = tl.load(bt_row + b)
            row_ok = m_ok & (tl.sum(tl.where(sel_rows == b, 1, 0), axis=1) > 0)
            m_i, l_i, acc = attend_block(
                q,
                m_i,
                l_i,
                acc,
                kg_ptr,
                vg_ptr,
                page,
                b,
                row_ok,
                qpos,
                qk_scale,
                stride_kp,
                stride_ko,
                offs_o,
                offs_d,
                PS,
                IEEE,
            )
            b = tl.min(tl.where(ev > b, ev, _BIG_ID), axis=0)  # next larger block id
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        o_ptr + tok[:, None].to(tl.int64) * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
        out.to(o_ptr.dtype.element_ty),
        mask=m_ok[:, None],
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


def _check_attention_inputs(q, k_cache_l, v_cache_l, topk_ids) -> None:
    """``check_attention_inputs`` of the fast op, plus the top-k width this kernel's sort holds."""
    check_attention_inputs(q, k_cache_l, v_cache_l, topk_ids, op="invariant_paged_attention")
    if topk_ids is not None and not 1 <= topk_ids.shape[2] <= MAX_TOPK:
        raise ValueError(f"invariant_paged_attention: top-k width {topk_ids.shape[2]}; 1..{MAX_TOPK} supported")


def invariant_paged_attention(
    q: torch.Tensor,
    k_cache_l: torch.Tensor,
    v_cache_l: torch.Tensor,
    meta: PagedMetadata,
    scale: float,
    topk_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Batch-invariant ``paged_attention`` (PagedOps field; reference ``paged_attention_ref``, spec §3.5).

    q: [T, nh, d] fp32 / fp16 / bf16 (decode rows first, kernels/paged_layout.py); k_cache_l,
    v_cache_l: [P, G, ps, d] same dtype, contiguous pages; scale: softmax scale (1/sqrt(d));
    topk_ids: [T, G, K] integer block ids (-1 = empty; ids past a token's own block are ignored;
    a repeated id counts once) or None = dense causal. Returns [T, nh, d] in q.dtype; each token's
    bits depend only on its own query, position, block ids and the K/V it attends (module
    docstring). CUDA-graph safe (grids from host ints and shapes, no host sync).
    Raises ValueError for unsupported dtypes or sizes (d, ps powers of two in [16, 256], nh % G,
    K in 1..64), naming the field.
    """
    _check_attention_inputs(q, k_cache_l, v_cache_l, topk_ids)
    t, nh, d = q.shape
    g, ps = k_cache_l.shape[1], k_cache_l.shape[2]
    out = torch.empty_like(q)
    if t == 0:
        return out
    dense = topk_ids is None
    sel = q.new_empty((1, 1, 1), dtype=torch.int32) if dense else topk_ids.to(torch.int32)
    topk = 0 if dense else int(topk_ids.shape[2])
    rh = nh // g
    rhp = next_pow2(rh)
    bm = attn_block_m(rh)
    ieee = q.dtype == torch.float32
    for r0, r1, qlen in _row_ranges(meta):
        n_qtiles = triton.cdiv(qlen, bm)
        _inv_attn_kernel[((r1 - r0) * n_qtiles, g)](
            q,
            k_cache_l,
            v_cache_l,
            meta.block_tables,
            meta.query_start_loc,
            meta.positions,
            sel,
            out,
            float(scale) * LOG2E,
            r0,
            n_qtiles,
            topk,
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
            RH=rh,
            RHP=rhp,
            D=d,
            PS=ps,
            BLOCK_M=bm,
            KP=max(next_pow2(topk), 2),
            DENSE=dense,
            IEEE=ieee,
            num_warps=4 if d <= 128 else 8,
            num_stages=1 if ieee else 2,
        )
    return out


def invariant_index_scores(iq: torch.Tensor, index_cache_l, meta: PagedMetadata) -> torch.Tensor:
    """[T, G, NBP] fp32 block-max index scores (spec §3.4), batch-invariant; entries past a token's
    own block are unwritten (garbage).

    iq: [T, G, di] fp32/fp16/bf16; index_cache_l: [P, ps, di] same dtype or an ``FP8IndexCache``.
    Entry [t, g, b], b <= pos(t) // ps: max over block b's keys u <= pos(t) of <iq[t, g], ik[u]>
    (dequantized keys / queries for FP8), NaN -> -1e30.
    """
    t, g, di = iq.shape
    nbp = meta.block_tables.shape[1]
    scores = torch.empty(t, g, nbp, dtype=torch.float32, device=iq.device)
    if t == 0:
        return scores
    keys, kscales, qfp8 = split_index_cache(index_cache_l)
    gp = next_pow2(g)
    bm = index_block_m(g)
    ieee = iq.dtype == torch.float32 and not qfp8
    n_splits = triton.cdiv(nbp, SCORE_SPLIT_BLOCKS)
    for r0, r1, qlen in _row_ranges(meta):
        n_qtiles = triton.cdiv(qlen, bm)
        _inv_scores_kernel[((r1 - r0) * n_qtiles, n_splits)](
            iq,
            keys,
            keys if kscales is None else kscales,
            meta.block_tables,
            meta.query_start_loc,
            meta.positions,
            scores,
            r0,
            n_qtiles,
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
            SPLIT_B=SCORE_SPLIT_BLOCKS,
            KSCALE=kscales is not None,
            QFP8=qfp8,
            num_warps=4,
            num_stages=1 if ieee else 2,
        )
    return scores


def invariant_select_blocks(
    scores: torch.Tensor, meta: PagedMetadata, topk: int, page_size: int, init_blocks: int = 0, local_blocks: int = 1
) -> torch.Tensor:
    """[T, G, K] int32 top-k block ids from ``invariant_index_scores``: forced local / init blocks first
    (lower id first), then score desc with ties to the lower id, -1 past min(K, pos // ps + 1)."""
    t, g, _ = scores.shape
    out = torch.empty(t, g, topk, dtype=torch.int32, device=scores.device)
    if t == 0:
        return out
    gp = next_pow2(g)
    tok = max(1, TOPK_ROWS // gp)
    kp = max(next_pow2(topk), 2)
    _inv_topk_kernel[(triton.cdiv(t, tok),)](
        scores,
        meta.positions,
        out,
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
    same dtype (already holding this step's keys) or an ``FP8IndexCache``. Raises ValueError for
    unsupported dtypes or sizes, naming the field.
    """
    check_index_inputs(iq, index_cache_l, topk, op="invariant_index_topk")
    scores = invariant_index_scores(iq, index_cache_l, meta)
    ps = split_index_cache(index_cache_l)[0].shape[1]
    return invariant_select_blocks(scores, meta, topk, ps, init_blocks, local_blocks)


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
) -> torch.Tensor:
    """Batch-invariant ``msa_attention`` (PagedOps field; reference ``msa_attention_ref``, spec §3.4-3.5).

    q: [T, nh, d]; iq: [T, G, di]; k_cache_l, v_cache_l: [P, G, ps, d]; index_cache_l: [P, ps, di]
    or an ``FP8IndexCache`` (all already holding this step's keys); meta: ``PagedMetadata``
    (decode rows first). ``invariant_index_topk`` then ``invariant_paged_attention`` over the
    choice, for decode and prefill rows alike. sel_out: optional [T, G, K] integer tensor (any
    strides; the engine's block-selection record) receiving the choice. Returns [T, nh, d] in
    q.dtype. Raises ValueError for unsupported dtypes or sizes, naming the field.
    """
    if iq.shape[:2] != (q.shape[0], k_cache_l.shape[1]):
        raise ValueError(
            f"invariant_msa_attention: iq {tuple(iq.shape)} needs [T={q.shape[0]}, G={k_cache_l.shape[1]}, di]"
        )
    ids = invariant_index_topk(iq, index_cache_l, meta, topk, init_blocks, local_blocks)
    if sel_out is not None:
        sel_out.copy_(ids)
    return invariant_paged_attention(q, k_cache_l, v_cache_l, meta, scale, ids)

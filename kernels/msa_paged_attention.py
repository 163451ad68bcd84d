"""Triton GQA attention over the paged K/V cache, for given block ids (sparse) or all causal keys (dense).

Which path is this: attention only (spec §3.5, §4.3), the block ids already chosen
(``msa_index_topk.index_topk``) or none (dense layers: every causal key). Decode rows run a split-K
kernel over the selected entries / blocks plus a merge launch; prefill rows run the tiled prefill
kernels below. The sparse layers' decode step normally takes the fused path instead
(``msa_fused_decode.py``: index scores + in-register top-k + attention + merge in two launches);
this module's decode kernel serves the dense layers, and the sparse decode rows when the block ids
are given.

Governing idea: one program owns one KV head's whole GQA group (all R = nh/G query heads share
the group's selected blocks), walks pages through the block table and keeps an online softmax in
base 2 (scale pre-multiplied by log2 e) with fp32 accumulation.
- Decode (rows 0..num_decodes-1, each ``decode_query_len`` >= 1 tokens with their own causal
  cut-off and their own selection): split-K over the selected entries (or over the blocks for
  dense layers); every split writes a normalised partial output and its base-2 log-sum-exp, a
  merge kernel combines them with weights exp2(lse - max). Grid = (decode tokens, G, splits),
  fixed by the batch shape.
- Prefill, dense layers: a program tiles BLOCK_M consecutive query tokens x RH heads and walks
  every causal block.
- Prefill, sparse: two exact paths, chosen from host-known shapes (graph-safe):
  * union-list tiles (fewer than KV_MAJOR_MIN_TOKENS prefill tokens): a small pass lists, per
    tile of BLOCK_M tokens and KV head, the sorted distinct valid selected blocks, their pages and a
    per-token membership bit mask; the attention loop walks that list branch-free (its loads
    software-pipeline), each row masked to its own token's blocks. Every row of the tile pays for
    every block of the union (union/K x the useful work).
  * KV-major (from KV_MAJOR_MIN_TOKENS on): the (token, slot j) entries are bucketed by (KV head,
    row, block) with a device sort; a program takes a segment of up to KV_SEGMENT entries of one
    bucket (the bucket id gives head, block and page), loads the page's K/V once and streams the
    entries' query rows through it (TOK tokens x RH heads per tensor-core tile, every row useful;
    the next tile's entry ids, positions and query rows are loaded before this tile's dots),
    writing per entry a block-normalised partial
    output and its base-2 LSE; a merge kernel combines each token's K partials with weights
    exp2(lse - max) (the decode split-K rule). Cost: the partials ([tokens, G, K, RH, d] in the
    input dtype, prefill processed in passes of ``kv_chunk`` tokens) go through device memory: a
    scratch buffer the caller hands in (``scratch=``: the engine's, allocated once inside its memory
    budget; layout and size in kernels/paged_layout.py) or, without one, a buffer of
    KV_CHUNK_TOKENS tokens allocated per call.
Invalid entries (-1 or >= nb(t)) contribute nothing. Empty splits give lse = -inf.
NOTE: fp32 inputs use ``input_precision="ieee"`` (no tf32); bf16/fp16 inputs cast the softmax
probabilities to the input dtype for the PV tensor-core dot (flash-attention practice); the
KV-major path also rounds each block's partial output to the input dtype before the merge.

Shape legend: T query tokens, R rows, P pages, ps page size, G KV heads, nh query heads,
RH = nh/G heads per group, d head dim, K top-k entries, S decode splits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from m3_kernels.msa_checks import check_pow2_dim, check_pow2_knob, next_pow2
from m3_kernels.msa_kv_segment_sm90 import (
    KV_SEG_SM90_STAGES,
    check_kv_seg_sm90,
    kv_seg_attn_sm90_kernel,
    sm90_unsupported,
)
from m3_kernels.paged_layout import (
    KV_CHUNK_TOKENS,
    KV_MAJOR_MIN_TOKENS,
    PagedMetadata,
    kv_major_partial_dtype,
    kv_major_token_bytes,
)

LOG2E = 1.4426950408889634
# Sparse prefill path choice (host-known shapes only, graph-safe): the KV-major path (every K/V page
# read once per segment of entries, partial outputs merged by LSE) from KV_MAJOR_MIN_TOKENS prefill
# tokens on, the union-list tiles below it. Figures: docs/benchmarks.md (MSA attention kernels).
# Prefill tokens per KV-major pass without a caller's scratch: KV_CHUNK_TOKENS (the partial-output
# scratch [chunk, G, K, nh/G, d], one buffer reused by every pass: 4160 MiB at M3 shapes in bf16;
# H200, 128K: 32K-token passes 41.1 ms (8.6 GB), 16K 42.2 ms, 8K 44.7 ms (2.1 GB)). Both constants
# live in kernels/paged_layout.py (the engine sizes its scratch from them without importing Triton).
KV_SEGMENT = 128  # entries per KV-major program (the page's K/V tile is loaded once per segment)
# The segment loop's default for 16-bit inputs: entry ids gathered from registers, query rows staged
# by the compiler's pipeliner this many deep (H200 2026-12-04, bench 128K: 41.3 / 42.4 -> 39.9 / 41.0
# ms, same bits; 3 or 4 stages were slower: 43.5-45.3 ms). fp32 (IEEE dots) keeps the one-ahead prefetch.
KV_SEG_PIPELINE_STAGES = 2
# The segment loop for 16-bit inputs: "deferred" (the pipelined loop that issues the next tile's QK dot
# before this tile's softmax; H200 2026-12-04, bench 128K, same bits: 40.5 / 40.7 -> 38.5 / 38.3 ms,
# 38.5 ms at 2 stages, 42.1 at 1, 63.8 at 3 (spills)) or "pipeline" (without the look-ahead dot).
KV_SEG_LOOPS = ("pipeline", "deferred")
KV_SEG_LOOP = "deferred"
# The Hopper segment kernel (kernels/msa_kv_segment_sm90.py, Gluon): prefill_config prefetch="sm90".
KV_SEG_SM90 = "sm90"
# Without a prefetch knob, launches the Hopper kernel can run (``sm90_unsupported``) take it: the same
# bits, H100 2026-12-06, bench 128K attention call alone, 6 rounds: 41.9-44.2 -> 40.0-41.7 ms, 0.6-4.0 ms
# less in each (docs/benchmarks.md).
KV_SEG_SM90_DEFAULT = True


@triton.jit
def attend_block(
    q,
    m_i,
    l_i,
    acc,
    k_ptr,
    v_ptr,
    page,
    b,
    row_ok,
    qpos,
    qk_scale,
    stride_kp,
    stride_ko,
    offs_o,
    offs_d,
    PS: tl.constexpr,
    IEEE: tl.constexpr,
):
    """Online-softmax update of (m_i, l_i, acc) [M], [M], [M, D] with page ``page`` = block b: key u
    of the page enters row m iff row_ok[m] and b * PS + u <= qpos[m]; a row with no such key is left
    bit-for-bit unchanged (alpha = 1, p = 0). kernels/invariant_attention.py runs the same update on
    K / V tiles it loads itself (``_attend_kv``)."""
    koff = page.to(tl.int64) * stride_kp + offs_o[:, None] * stride_ko + offs_d[None, :]
    k = tl.load(k_ptr + koff)  # [PS, D]
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
    v = tl.load(v_ptr + koff)
    if IEEE:
        pv = tl.dot(p, v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    acc = acc * alpha[:, None] + pv
    return m_new, l_i, acc


@triton.jit
def _decode_attn_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    bt_ptr,
    pos_ptr,
    sel_ptr,
    o_ptr,
    opart_ptr,
    lse_ptr,
    qk_scale,
    dql,
    n_entries,
    entries_per_split,
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
    DENSE: tl.constexpr,
    SPLIT: tl.constexpr,
    IEEE: tl.constexpr,
    KP: tl.constexpr = 2,
):
    """One (decode token, KV head, split): partial softmax over its share of the entries.

    Sparse: the token's KP-padded selection is a set (a block id repeated at a later slot is skipped)."""
    t = tl.program_id(0).to(tl.int64)  # int64 offsets (t * stride_qt)
    g = tl.program_id(1)
    s_id = tl.program_id(2)
    n_split = tl.num_programs(2)
    row = t // dql
    p = tl.load(pos_ptr + t)
    n_blk = p // PS + 1
    offs_h = tl.arange(0, RHP)
    offs_d = tl.arange(0, D)
    offs_o = tl.arange(0, PS)
    h_ok = offs_h < RH
    head = g * RH + offs_h
    q = tl.load(q_ptr + t * stride_qt + head[:, None] * stride_qh + offs_d[None, :], mask=h_ok[:, None], other=0.0)
    qpos = tl.zeros([RHP], dtype=tl.int32) + p
    m_i = tl.full([RHP], float("-inf"), tl.float32)
    l_i = tl.zeros([RHP], tl.float32)
    acc = tl.zeros([RHP, D], tl.float32)
    e_lo = s_id * entries_per_split
    e_hi = tl.minimum(e_lo + entries_per_split, n_entries)
    if DENSE:
        e_hi = tl.minimum(e_hi, n_blk)
    kg_ptr = k_ptr + g * stride_kg
    vg_ptr = v_ptr + g * stride_kg
    if not DENSE:
        offs_k = tl.arange(0, KP)
        row_ids = tl.load(sel_ptr + t * stride_sel_t + g * stride_sel_g + offs_k, mask=offs_k < n_entries, other=-1)
    for e in range(e_lo, e_hi):
        if DENSE:
            b = e
            first = True
        else:
            b = tl.load(sel_ptr + t * stride_sel_t + g * stride_sel_g + e)
            first = tl.sum(tl.where((row_ids == b) & (offs_k < e), 1, 0)) == 0  # not at an earlier slot
        if (b >= 0) & (b < n_blk) & first:
            page = tl.load(bt_ptr + row * stride_bt_r + b)
            m_i, l_i, acc = attend_block(
                q,
                m_i,
                l_i,
                acc,
                kg_ptr,
                vg_ptr,
                page,
                b,
                h_ok,
                qpos,
                qk_scale,
                stride_kp,
                stride_ko,
                offs_o,
                offs_d,
                PS,
                IEEE,
            )
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_safe[:, None]
    if SPLIT:
        lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
        base = (t * tl.num_programs(1) + g) * n_split + s_id
        tl.store(lse_ptr + base * RHP + offs_h, lse)
        tl.store(opart_ptr + (base * RHP + offs_h[:, None]) * D + offs_d[None, :], out)
    else:
        tl.store(
            o_ptr + t * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
            out.to(o_ptr.dtype.element_ty),
            mask=h_ok[:, None],
        )


@triton.jit
def _decode_merge_kernel(
    opart_ptr,
    lse_ptr,
    o_ptr,
    stride_ot,
    stride_oh,
    RH: tl.constexpr,
    RHP: tl.constexpr,
    D: tl.constexpr,
    S: tl.constexpr,
):
    """Combine the S splits of one (decode token, KV head): weights exp2(lse_s - max_s lse)."""
    t = tl.program_id(0).to(tl.int64)  # int64 offsets (t * stride_ot)
    g = tl.program_id(1)
    base = (t * tl.num_programs(1) + g) * S
    offs_s = tl.arange(0, S)
    offs_h = tl.arange(0, RHP)
    offs_d = tl.arange(0, D)
    lse = tl.load(lse_ptr + (base + offs_s[:, None]) * RHP + offs_h[None, :])  # [S, RHP]
    m = tl.max(lse, axis=0)  # [RHP]; finite: every token's own block is in some split
    w = tl.exp2(lse - m[None, :])  # [S, RHP]; -inf lse -> 0
    w = w / tl.sum(w, axis=0)[None, :]
    out = tl.zeros([RHP, D], tl.float32)
    for s in range(S):
        o_s = tl.load(opart_ptr + ((base + s) * RHP + offs_h[:, None]) * D + offs_d[None, :])
        w_s = tl.sum(tl.where(offs_s[:, None] == s, w, 0.0), axis=0)  # [RHP]
        out += w_s[:, None] * o_s
    head = g * RH + offs_h
    tl.store(
        o_ptr + t * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
        out.to(o_ptr.dtype.element_ty),
        mask=(offs_h < RH)[:, None],
    )


@triton.jit
def _load_query_tile(
    q_ptr,
    pos_ptr,
    t0,
    q_hi,
    g,
    stride_qt,
    stride_qh,
    RH: tl.constexpr,
    RHP: tl.constexpr,
    D: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """Query rows of a prefill tile: BLOCK_M tokens from t0 (cut at q_hi) x KV head g's RH heads, row m =
    token m // RHP, head m % RHP. Returns (ti [M] token index in the tile, tok [M] int64, head [M], m_ok [M],
    q [M, D], qpos [M] positions as stored, -1 for masked rows)."""
    offs_m = tl.arange(0, BLOCK_M * RHP)
    ti = offs_m // RHP
    tok = (t0 + ti).to(tl.int64)  # int64 offsets: tok * stride_qt passes 2**31 from 262,144 tokens at nh * d = 8192
    h = offs_m % RHP
    m_ok = (tok < q_hi) & (h < RH)
    head = g * RH + h
    offs_d = tl.arange(0, D)
    q = tl.load(
        q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :], mask=m_ok[:, None], other=0.0
    )  # [M, D]
    qpos = tl.load(pos_ptr + tok, mask=m_ok, other=-1)  # [M]
    return ti, tok, head, m_ok, q, qpos


@triton.jit
def _prefill_attn_kernel(
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
    """BLOCK_M query tokens x one KV head's group over the union of their selected blocks."""
    pid = tl.program_id(0)
    g = tl.program_id(1)
    row = row_offset + pid // n_qtiles
    qtile = n_qtiles - 1 - pid % n_qtiles  # NOTE: longest tiles first
    q_lo = tl.load(qsl_ptr + row)
    q_hi = tl.load(qsl_ptr + row + 1)
    t0 = q_lo + qtile * BLOCK_M
    if t0 >= q_hi:
        return
    _, tok, head, m_ok, q, qpos = _load_query_tile(
        q_ptr, pos_ptr, t0, q_hi, g, stride_qt, stride_qh, RH, RHP, D, BLOCK_M
    )
    offs_d = tl.arange(0, D)
    offs_o = tl.arange(0, PS)
    m_i = tl.full([BLOCK_M * RHP], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M * RHP], tl.float32)
    acc = tl.zeros([BLOCK_M * RHP, D], tl.float32)
    kg_ptr = k_ptr + g * stride_kg
    vg_ptr = v_ptr + g * stride_kg
    if DENSE:
        n_blk = tl.max(qpos, axis=0) // PS + 1
        for b in range(0, n_blk):
            page = tl.load(bt_ptr + row * stride_bt_r + b)
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
        offs_k = tl.arange(0, KP)
        sel_rows = tl.load(
            sel_ptr + tok[:, None] * stride_sel_t + g * stride_sel_g + offs_k[None, :],
            mask=m_ok[:, None] & (offs_k[None, :] < topk),
            other=-1,
        )  # [M, KP]
        offs_i = tl.arange(0, BLOCK_M)
        tile_tok_ok = (t0 + offs_i) < q_hi
        sel_tile = tl.load(
            sel_ptr + (t0 + offs_i)[:, None] * stride_sel_t + g * stride_sel_g + offs_k[None, :],
            mask=tile_tok_ok[:, None] & (offs_k[None, :] < topk),
            other=-1,
        )  # [BLOCK_M, KP]
        n_tok = tl.minimum(q_hi - t0, BLOCK_M)
        for i in range(0, n_tok):
            p_i = tl.load(pos_ptr + t0 + i)
            for j in range(0, topk):
                b = tl.load(sel_ptr + (t0 + i) * stride_sel_t + g * stride_sel_g + j)
                # a block already walked for an earlier token of the tile is skipped
                dup = tl.sum(tl.where((sel_tile == b) & (offs_i[:, None] < i), 1, 0))
                if (b >= 0) & (b <= p_i // PS) & (dup == 0):
                    page = tl.load(bt_ptr + row * stride_bt_r + b)
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
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        o_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
        out.to(o_ptr.dtype.element_ty),
        mask=m_ok[:, None],
    )


@triton.jit
def _or_combine(a, b):
    return a | b


@triton.jit
def tile_union_kernel(
    sel_ptr,
    qsl_ptr,
    pos_ptr,
    bt_ptr,
    ulist_ptr,
    umask_ptr,
    upage_ptr,
    ucount_ptr,
    row_offset,
    n_qtiles,
    topk,
    stride_sel_t,
    stride_sel_g,
    stride_bt_r,
    PS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    KP: tl.constexpr,
):
    """Sorted distinct valid blocks of one prefill tile (BLOCK_M tokens, one KV head) + membership.

    Writes, for slot = (tile, g): ulist[slot, :n] the n distinct valid selected block ids of the
    tile's tokens in ascending order (the causal-diagonal blocks come last), umask[slot, u] the
    bit set of the tile tokens (bit i = token t0 + i) that selected ulist[slot, u], ucount[slot] = n.
    Valid = 0 <= b <= pos // PS (later ids hold no causal key; -1 = empty slot).
    """
    pid = tl.program_id(0)
    g = tl.program_id(1)
    slot = pid * tl.num_programs(1) + g
    row = row_offset + pid // n_qtiles
    qtile = pid % n_qtiles
    q_lo = tl.load(qsl_ptr + row)
    q_hi = tl.load(qsl_ptr + row + 1)
    t0 = q_lo + qtile * BLOCK_M
    offs = tl.arange(0, BLOCK_M * KP)  # entry e = token e // KP, slot e % KP
    ti = offs // KP
    tok = t0 + ti
    ok = (tok < q_hi) & (offs % KP < topk)
    b = tl.load(sel_ptr + tok * stride_sel_t + g * stride_sel_g + offs % KP, mask=ok, other=-1)
    p = tl.load(pos_ptr + tok, mask=ok, other=-1)
    ok = ok & (b >= 0) & (b <= p // PS)
    v = tl.where(ok, b, 2147483647)
    eq = v[:, None] == v[None, :]  # [E, E]
    earlier = tl.sum(tl.where(eq & (offs[None, :] < offs[:, None]), 1, 0), axis=1)
    first = ok & (earlier == 0)  # first occurrence of each distinct valid block
    rank = tl.sum(tl.where(first[None, :] & (v[None, :] < v[:, None]), 1, 0), axis=1)
    bits = tl.reduce(tl.where(eq & ok[None, :], 1 << ti[None, :], 0), 1, _or_combine)
    base = slot * (BLOCK_M * topk)
    tl.store(ulist_ptr + base + rank, v, mask=first)
    tl.store(umask_ptr + base + rank, bits, mask=first)
    page = tl.load(bt_ptr + row * stride_bt_r + v, mask=first, other=0)
    tl.store(upage_ptr + base + rank, page, mask=first)
    tl.store(ucount_ptr + slot, tl.sum(first.to(tl.int32), axis=0))


@triton.jit
def _prefill_union_attn_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    qsl_ptr,
    pos_ptr,
    ulist_ptr,
    umask_ptr,
    upage_ptr,
    ucount_ptr,
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
    stride_ot,
    stride_oh,
    RH: tl.constexpr,
    RHP: tl.constexpr,
    D: tl.constexpr,
    PS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    IEEE: tl.constexpr,
):
    """BLOCK_M query tokens x one KV head's group over the tile's union list (``tile_union_kernel``).

    A branch-free loop over the distinct blocks (row r attends block u iff its token's bit is set
    in umask), so the K/V page loads software-pipeline.
    """
    pid = tl.program_id(0)
    g = tl.program_id(1)
    qtile = n_qtiles - 1 - pid % n_qtiles  # NOTE: longest tiles first
    tile = (pid // n_qtiles) * n_qtiles + qtile
    row = row_offset + pid // n_qtiles
    q_lo = tl.load(qsl_ptr + row)
    q_hi = tl.load(qsl_ptr + row + 1)
    t0 = q_lo + qtile * BLOCK_M
    if t0 >= q_hi:
        return
    slot = tile * tl.num_programs(1) + g
    ti, tok, head, m_ok, q, qpos = _load_query_tile(
        q_ptr, pos_ptr, t0, q_hi, g, stride_qt, stride_qh, RH, RHP, D, BLOCK_M
    )
    qpos = qpos.to(tl.int32)
    offs_d = tl.arange(0, D)
    offs_o = tl.arange(0, PS)
    m_i = tl.full([BLOCK_M * RHP], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M * RHP], tl.float32)
    acc = tl.zeros([BLOCK_M * RHP, D], tl.float32)
    kg_ptr = k_ptr + g * stride_kg
    vg_ptr = v_ptr + g * stride_kg
    n_u = tl.load(ucount_ptr + slot)
    base = slot * (BLOCK_M * topk)
    for u in range(0, n_u):
        b = tl.load(ulist_ptr + base + u)
        bits = tl.load(umask_ptr + base + u)
        page = tl.load(upage_ptr + base + u)
        row_ok = m_ok & (((bits >> ti) & 1) != 0)
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
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        o_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
        out.to(o_ptr.dtype.element_ty),
        mask=m_ok[:, None],
    )


@triton.jit
def _gather_q_rows(q_ptr, tok, head, m_ok, offs_d, stride_qt, stride_qh):
    """[M, D] query rows q[tok[m], head[m], :] (rows with m_ok False: zeros)."""
    return tl.load(
        q_ptr + tok[:, None].to(tl.int64) * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=m_ok[:, None],
        other=0.0,
    )


@triton.jit
def _kv_seg_qk(q, k, IEEE: tl.constexpr):
    """[M, PS] fp32 raw scores q @ k^T of one KV-major tile (query rows q [M, D], page keys k [PS, D])."""
    if IEEE:
        return tl.dot(q, tl.trans(k), input_precision="ieee")
    return tl.dot(q, tl.trans(k))


@triton.jit
def _kv_seg_finish(
    s,
    v,
    e,
    qpos,
    m_ok,
    b,
    h,
    offs_d,
    offs_o,
    opart_ptr,
    lse_ptr,
    qk_scale,
    RH: tl.constexpr,
    D: tl.constexpr,
    PS: tl.constexpr,
    IEEE: tl.constexpr,
):
    """The rest of a KV-major tile after its QK dot: from the raw scores s [M, PS] (fp32), the causal
    cut at qpos [M], base-2 softmax, PV dot with the page's v [PS, D]; writes each row's
    block-normalised partial output opart[e, h, :] and base-2 log-sum-exp lse[e, h] (rows with m_ok
    False: none)."""
    s = s * qk_scale
    keep = m_ok[:, None] & ((b * PS + offs_o)[None, :] <= qpos[:, None])
    s = tl.where(keep, s, float("-inf"))
    m = tl.max(s, axis=1)
    m = tl.where(m == float("-inf"), 0.0, m)
    p = tl.exp2(s - m[:, None])
    l_i = tl.sum(p, axis=1)
    if IEEE:
        o = tl.dot(p, v, input_precision="ieee")
    else:
        o = tl.dot(p.to(v.dtype), v)
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    o = o / l_safe[:, None]
    lse = tl.where(l_i > 0, m + tl.log2(l_safe), float("-inf"))
    tl.store(lse_ptr + e * RH + h, lse, mask=m_ok)
    tl.store(
        opart_ptr + (e * RH + h)[:, None].to(tl.int64) * D + offs_d[None, :],
        o.to(opart_ptr.dtype.element_ty),
        mask=m_ok[:, None],
    )


@triton.jit
def _kv_seg_load_q(
    q_ptr,
    perm_ptr,
    epos_ptr,
    ei,
    m_ok,
    t_base,
    g,
    h,
    offs_d,
    stride_qt,
    stride_qh,
    G: tl.constexpr,
    RH: tl.constexpr,
    topk,
):
    """Entry ids, query positions and [M, D] query rows of the tile's entries ``ei`` (one gather level)."""
    e = tl.load(perm_ptr + ei, mask=m_ok, other=0).to(tl.int32)  # [M] entry (t * G + g) * topk + j
    qpos = tl.load(epos_ptr + ei, mask=m_ok, other=-1)
    t = e // (G * topk)
    q = _gather_q_rows(q_ptr, t_base + t, g * RH + h, m_ok, offs_d, stride_qt, stride_qh)  # [M, D]
    return e, qpos, q


@triton.jit
def _kv_seg_gather_tile(
    q_ptr,
    perm_v,
    epos_v,
    c,
    n,
    t_base,
    topk,
    g,
    h,
    offs_m,
    offs_d,
    stride_qt,
    stride_qh,
    G: tl.constexpr,
    RH: tl.constexpr,
    RHP: tl.constexpr,
    SEG: tl.constexpr,
):
    """Entry ids e [M], query positions qpos [M], row mask m_ok [M] and query rows q [M, D] of the
    tile that starts at segment-local entry c, gathered from the segment's id / position vectors
    perm_v, epos_v [SEGP] (n valid lanes; rows past them masked, their q zeros)."""
    li = c + offs_m // RHP  # [M] segment-local entry of each row
    m_ok = (li < n) & (h < RH)
    lic = tl.minimum(li, SEG - 1)
    e = tl.gather(perm_v, lic, 0)
    qpos = tl.where(m_ok, tl.gather(epos_v, lic, 0), -1)
    t = e // (G * topk)
    q = _gather_q_rows(q_ptr, t_base + t, g * RH + h, m_ok, offs_d, stride_qt, stride_qh)  # [M, D]
    return e, qpos, m_ok, q


@triton.jit
def kv_seg_entries(
    q_ptr,
    v,
    k,
    perm_v,
    epos_v,
    n,
    opart_ptr,
    lse_ptr,
    qk_scale,
    t_base,
    topk,
    b,
    g,
    h,
    offs_m,
    offs_d,
    offs_o,
    stride_qt,
    stride_qh,
    G: tl.constexpr,
    RH: tl.constexpr,
    RHP: tl.constexpr,
    D: tl.constexpr,
    PS: tl.constexpr,
    TOK: tl.constexpr,
    SEG: tl.constexpr,
    IEEE: tl.constexpr,
    DEFERRED: tl.constexpr,
):
    """The pipelined entry loop over one page's segment: entry ids perm_v and positions epos_v
    ([SEGP] int32 vectors in registers, n valid lanes), TOK entries per tile. DEFERRED: the next
    tile's QK dot is issued before this tile's softmax and PV dot (its scores are loop-carried), so
    the tensor cores work on one tile while the other's softmax runs (the overlap FA3 builds by
    hand: Shah et al. 2024, §3.2); the same tiles and ops, so the same values. The last
    iteration's look-ahead tile has no valid row."""
    if DEFERRED:
        e, qpos, m_ok, q = _kv_seg_gather_tile(
            q_ptr, perm_v, epos_v, 0, n, t_base, topk, g, h, offs_m, offs_d, stride_qt, stride_qh, G, RH, RHP, SEG
        )
        s = _kv_seg_qk(q, k, IEEE)
        for c in range(0, n, TOK):
            e_n, qpos_n, m_ok_n, q_n = _kv_seg_gather_tile(
                q_ptr, perm_v, epos_v, c + TOK, n, t_base, topk, g, h, offs_m, offs_d, stride_qt, stride_qh, G, RH,
                RHP, SEG,
            )  # fmt: skip
            s_n = _kv_seg_qk(q_n, k, IEEE)
            _kv_seg_finish(s, v, e, qpos, m_ok, b, h, offs_d, offs_o, opart_ptr, lse_ptr, qk_scale, RH, D, PS, IEEE)
            s, e, qpos, m_ok = s_n, e_n, qpos_n, m_ok_n
    else:
        for c in range(0, n, TOK):
            e, qpos, m_ok, q = _kv_seg_gather_tile(
                q_ptr, perm_v, epos_v, c, n, t_base, topk, g, h, offs_m, offs_d, stride_qt, stride_qh, G, RH, RHP, SEG
            )
            s = _kv_seg_qk(q, k, IEEE)
            _kv_seg_finish(s, v, e, qpos, m_ok, b, h, offs_d, offs_o, opart_ptr, lse_ptr, qk_scale, RH, D, PS, IEEE)


@triton.jit
def kv_bucket_kernel(
    sel_ptr,  # int32 [Tc * G * K]: the pass's selected blocks (-1: none)
    row_ptr,  # int64 [Tp]: prefill-local row of each prefill token
    blk_ptr,  # int64 [Tp]: the token's own block (position // page size)
    out_ptr,  # int32 [Tc * G * K]: bucket id, N_BKT for an entry that attends nothing
    n_entries,
    c0,  # the pass's first prefill token
    rp,
    nbp,
    n_bkt,
    GK: tl.constexpr,
    K: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One launch for the KV-major prefill's bucket ids: entry (t, g, k) of the pass goes to bucket
    (g * rp + row(t)) * nbp + sel when 0 <= sel <= the token's own block, else to n_bkt."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n_entries
    t = c0 + i // GK
    gi = (i % GK) // K
    sel = tl.load(sel_ptr + i, mask=m, other=-1).to(tl.int64)
    row = tl.load(row_ptr + t, mask=m, other=0)
    blk = tl.load(blk_ptr + t, mask=m, other=0)
    bucket = (gi * rp + row) * nbp + sel
    tl.store(out_ptr + i, tl.where((sel >= 0) & (sel <= blk), bucket, n_bkt).to(tl.int32), mask=m)


KV_BUCKET_BLOCK = 1024


def _kv_major_step_index(meta, g: int, nbp: int, ps: int, nd: int, td: int, t_all: int) -> tuple:
    """(bkt_page int32 [n_bkt], row_of_tok int64 [Tp], blk_of_tok int64 [Tp], bkt_ids int32
    [n_bkt + 1]), n_bkt = G * Rp * nbp: the page of each (KV head, prefill row, block) bucket, each
    prefill token's prefill-local row and own block, and the bucket ids 0..n_bkt (the edges the
    sorted entries are searched for). The same for every sparse layer of the step: built once,
    kept in ``meta.memo``."""
    r = meta.num_rows
    key = ("kv_major", g, nbp, ps, nd, td, t_all, r)  # everything the tensors below are built from
    got = meta.memo.get(key)
    if got is None:
        dev = meta.positions.device
        # bucket (g * rp + row) * nbp + b; rows past r (a table with spare rows) are not prefill rows
        bkt_page = meta.block_tables[nd:r].to(torch.int32).repeat(g, 1).reshape(-1)
        row_of_tok = torch.searchsorted(
            meta.query_start_loc[nd + 1 :].long(), torch.arange(td, t_all, device=dev), right=True
        )
        bkt_ids = torch.arange(bkt_page.numel() + 1, device=dev, dtype=torch.int32)
        got = meta.memo[key] = (bkt_page, row_of_tok, meta.positions[td:t_all] // ps, bkt_ids)
    return got


@triton.jit
def kv_seg_attn_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    epos_ptr,
    seg_bkt_ptr,
    bkt_start_ptr,
    bkt_seg0_ptr,
    bkt_end_ptr,
    bkt_page_ptr,
    perm_ptr,
    opart_ptr,
    lse_ptr,
    qk_scale,
    t_base,
    topk,
    nbp,
    bkt_per_head,
    stride_qt,
    stride_qh,
    stride_kp,
    stride_kg,
    stride_ko,
    G: tl.constexpr,
    RH: tl.constexpr,
    RHP: tl.constexpr,
    D: tl.constexpr,
    PS: tl.constexpr,
    TOK: tl.constexpr,
    SEG: tl.constexpr,
    SEGP: tl.constexpr,
    IEEE: tl.constexpr,
    PREFETCH: tl.constexpr = True,
    PIPELINE: tl.constexpr = False,
    DEFERRED: tl.constexpr = False,
):
    """One segment (up to SEG entries) of one KV-major bucket (KV head g, row, block b).

    The bucket's entries are the (token, slot j) pairs that selected b, in ``perm`` order (entry id
    e = (t * G + g) * topk + j, t chunk-local; ``epos`` = their query positions in the same order).
    The bucket id gives g, b and the page; the page's K/V tile is loaded once; the entries stream
    through it TOK at a time (TOK x RH query rows per tensor-core tile, causal cut at each token's
    position), writing per entry the block-normalised partial output opart[e, h, :] and its base-2
    log-sum-exp lse[e, h]. PREFETCH: the next tile's entry ids and query rows are loaded before
    this tile's dots (hides the gather latency behind the tensor-core work). PIPELINE (instead of
    PREFETCH): the segment's entry ids and query positions are read as two [SEGP] vectors (SEGP =
    SEG rounded up to a power of two) before the
    loop and each tile's come out of them by ``tl.gather``, so no load in the loop feeds another
    load's address and the compiler's pipeliner stages ``num_stages - 1`` tiles of query rows ahead
    (the same tiles and dots: the same values). DEFERRED (with PIPELINE): each iteration issues the
    next tile's QK dot before this tile's softmax and PV dot (same values).
    """
    seg = tl.program_id(0)
    bkt = tl.load(seg_bkt_ptr + seg)
    if bkt < 0:
        return
    e_lo = (tl.load(bkt_start_ptr + bkt) + (seg - tl.load(bkt_seg0_ptr + bkt)) * SEG).to(tl.int32)
    e_hi = tl.minimum(tl.load(bkt_end_ptr + bkt), e_lo + SEG).to(tl.int32)
    page = tl.load(bkt_page_ptr + bkt)
    g = bkt // bkt_per_head
    b = bkt % nbp
    offs_m = tl.arange(0, TOK * RHP)  # row m = entry m // RHP, head m % RHP
    h = offs_m % RHP
    offs_d = tl.arange(0, D)
    offs_o = tl.arange(0, PS)
    koff = page.to(tl.int64) * stride_kp + g * stride_kg + offs_o[:, None] * stride_ko + offs_d[None, :]
    k = tl.load(k_ptr + koff)  # [PS, D], loaded once per segment
    v = tl.load(v_ptr + koff)
    if PIPELINE:
        # the segment's ids and positions perm[e_lo:e_hi], epos[e_lo:e_hi] in registers (vectors of
        # SEGP = SEG rounded up to a power of two, as tl.arange needs; lanes past its n entries masked)
        n = e_hi - e_lo
        offs_s = tl.arange(0, SEGP)
        perm_v = tl.load(perm_ptr + e_lo + offs_s, mask=offs_s < n, other=0).to(tl.int32)  # [SEGP]
        epos_v = tl.load(epos_ptr + e_lo + offs_s, mask=offs_s < n, other=-1).to(tl.int32)
        kv_seg_entries(
            q_ptr, v, k, perm_v, epos_v, n, opart_ptr, lse_ptr, qk_scale, t_base, topk, b, g, h, offs_m, offs_d,
            offs_o, stride_qt, stride_qh, G, RH, RHP, D, PS, TOK, SEG, IEEE, DEFERRED,
        )  # fmt: skip
        return
    if PREFETCH:  # the first tile's entries; each iteration then loads the next tile's
        ei = e_lo + offs_m // RHP
        m_ok = (ei < e_hi) & (h < RH)
        e, qpos, q = _kv_seg_load_q(
            q_ptr, perm_ptr, epos_ptr, ei, m_ok, t_base, g, h, offs_d, stride_qt, stride_qh, G, RH, topk
        )
    for c in range(e_lo, e_hi, TOK):
        if PREFETCH:
            ei_n = c + TOK + offs_m // RHP
            m_ok_n = (ei_n < e_hi) & (h < RH)
            e_n, qpos_n, q_n = _kv_seg_load_q(
                q_ptr, perm_ptr, epos_ptr, ei_n, m_ok_n, t_base, g, h, offs_d, stride_qt, stride_qh, G, RH, topk
            )
        else:
            ei = c + offs_m // RHP
            m_ok = (ei < e_hi) & (h < RH)
            e, qpos, q = _kv_seg_load_q(
                q_ptr, perm_ptr, epos_ptr, ei, m_ok, t_base, g, h, offs_d, stride_qt, stride_qh, G, RH, topk
            )
        s = _kv_seg_qk(q, k, IEEE)
        _kv_seg_finish(s, v, e, qpos, m_ok, b, h, offs_d, offs_o, opart_ptr, lse_ptr, qk_scale, RH, D, PS, IEEE)
        if PREFETCH:
            e, qpos, q, m_ok = e_n, qpos_n, q_n, m_ok_n


@triton.jit
def _merge_slot(
    opart_ptr, lse_ptr, row, j, topk, ok_bits, mx, inv_den, h_ok, offs_h, offs_d, RH: tl.constexpr, D: tl.constexpr
):
    # kv_major_merge_kernel's slot j: its weight w_j [RHP] = exp2(lse_j - max) / sum and its partial
    # o_j [RHP, D] in fp32; (0, 0) for an invalid slot or j >= topk
    ok_j = (j < topk) & (((ok_bits >> tl.minimum(j, 63)) & 1) != 0)
    lse_j = tl.load(lse_ptr + (row + j) * RH + offs_h, mask=h_ok & ok_j, other=float("-inf"))
    w_j = tl.exp2(lse_j - mx) * inv_den  # [RHP]
    o_j = tl.load(
        opart_ptr + ((row + j) * RH + offs_h[:, None]).to(tl.int64) * D + offs_d[None, :],
        mask=h_ok[:, None] & ok_j,
        other=0.0,
    )
    return w_j, o_j.to(tl.float32)


@triton.jit
def kv_major_merge_kernel(
    opart_ptr,
    lse_ptr,
    sel_ptr,
    pos_ptr,
    o_ptr,
    t_base,
    topk,
    stride_ot,
    stride_oh,
    G: tl.constexpr,
    RH: tl.constexpr,
    RHP: tl.constexpr,
    D: tl.constexpr,
    PS: tl.constexpr,
    KP: tl.constexpr,
):
    """out[t, g's heads] = sum_j w_j opart[(t, g, j)], w = exp2(lse_j - max) / sum, over the valid distinct j."""
    t = tl.program_id(0)
    g = tl.program_id(1)
    p = tl.load(pos_ptr + t_base + t)
    offs_k = tl.arange(0, KP)
    offs_h = tl.arange(0, RHP)
    offs_d = tl.arange(0, D)
    row = (t * G + g) * topk
    b = tl.load(sel_ptr + row + offs_k, mask=offs_k < topk, other=-1)
    dup = tl.sum(tl.where((b[:, None] == b[None, :]) & (offs_k[None, :] < offs_k[:, None]), 1, 0), axis=1)
    ok = (offs_k < topk) & (b >= 0) & (b <= p // PS) & (dup == 0)  # [KP]
    lse = tl.load(
        lse_ptr + (row + offs_k[:, None]) * RH + offs_h[None, :],
        mask=ok[:, None] & (offs_h < RH)[None, :],
        other=float("-inf"),
    )  # [KP, RHP]
    mx = tl.max(lse, axis=0)  # [RHP]; finite: the own block is always valid
    inv_den = 1.0 / tl.sum(tl.exp2(lse - mx[None, :]), axis=0)  # [RHP]
    # NOTE: the loop re-reads lse_j (cached) and tests a bit mask instead of extracting row j of the
    # register tiles: no cross-thread reduction per partial, the loop is a stream of loads. Four
    # slots' loads are issued before their four adds (one memory round trip per four slots; the
    # adds in slot order, as one slot per step makes them); a slot past topk reads as invalid and
    # adds 0 * 0 = +0.0 to a sum that is never -0.0 (it starts at +0.0): the same bits.
    ok_bits = tl.sum(tl.where(ok, tl.full([KP], 1, tl.int64) << offs_k.to(tl.int64), 0), axis=0)
    h_ok = offs_h < RH
    out = tl.zeros([RHP, D], tl.float32)
    for j in range(0, topk, 4):
        w0, o0 = _merge_slot(opart_ptr, lse_ptr, row, j, topk, ok_bits, mx, inv_den, h_ok, offs_h, offs_d, RH, D)
        w1, o1 = _merge_slot(opart_ptr, lse_ptr, row, j + 1, topk, ok_bits, mx, inv_den, h_ok, offs_h, offs_d, RH, D)
        w2, o2 = _merge_slot(opart_ptr, lse_ptr, row, j + 2, topk, ok_bits, mx, inv_den, h_ok, offs_h, offs_d, RH, D)
        w3, o3 = _merge_slot(opart_ptr, lse_ptr, row, j + 3, topk, ok_bits, mx, inv_den, h_ok, offs_h, offs_d, RH, D)
        out += w0[:, None] * o0
        out += w1[:, None] * o1
        out += w2[:, None] * o2
        out += w3[:, None] * o3
    head = g * RH + offs_h
    tl.store(
        o_ptr + (t_base + t).to(tl.int64) * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
        out.to(o_ptr.dtype.element_ty),
        mask=(offs_h < RH)[:, None],
    )


def _pow2_floor(n: int) -> int:
    return 1 << (max(int(n), 1).bit_length() - 1)


def decode_splits(n_tokens: int, n_kv_heads: int, n_entries: int) -> int:
    """Decode split-K count: the largest power of two <= min(n_entries, 256 / (tokens * G)).

    Depends only on the batch shape (tokens, heads, top-k or block-table width): graph-safe.
    """
    return _pow2_floor(min(n_entries, max(1, 256 // max(1, n_tokens * n_kv_heads))))


def kv_major_capacity(scratch: torch.Tensor | None, num_heads: int, head_dim: int, topk: int, dtype) -> int | None:
    """Prefill tokens one KV-major pass can hold in ``scratch`` at these shapes (layout:
    kernels/paged_layout.py); None when no scratch is given (the pass allocates its own)."""
    if scratch is None:
        return None
    return scratch.numel() // max(kv_major_token_bytes(num_heads, head_dim, topk, dtype), 1)


def kv_major_partial_buffers(
    scratch: torch.Tensor | None, n_tokens: int, g: int, topk: int, rh: int, d: int, dtype, device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(opart [n_tokens * G * K * RH * d] in ``kv_major_partial_dtype(dtype)``, lse [n_tokens * G * K * RH]
    fp32): the partial outputs and base-2 LSEs of ``n_tokens`` tokens' KV-major entries, carved from
    the head of ``scratch`` (the caller's uint8 buffer, layout kernels/paged_layout.py, holding at
    least n_tokens: ``kv_major_capacity``; d >= 16 keeps the LSE offset 4-byte aligned) or, with
    None, new buffers of that size."""
    odt = kv_major_partial_dtype(dtype)
    n_o, n_l = n_tokens * g * topk * rh * d, n_tokens * g * topk * rh
    if scratch is None:
        return torch.empty(n_o, dtype=odt, device=device), torch.empty(n_l, dtype=torch.float32, device=device)
    o_bytes = n_o * odt.itemsize
    return scratch[:o_bytes].view(odt), scratch[o_bytes : o_bytes + n_l * 4].view(torch.float32)


def check_kv_major_scratch(scratch: torch.Tensor | None, device: torch.device, op: str = "paged_attention") -> None:
    """Raises ValueError naming ``op`` unless ``scratch`` is None or a contiguous uint8 vector on ``device``
    starting at a 4-byte aligned address (the KV-major partials' buffer, kernels/paged_layout.py:
    fp32 / 16-bit partials and fp32 LSEs are carved from it)."""
    if scratch is not None and (
        scratch.dtype != torch.uint8 or scratch.dim() != 1 or not scratch.is_contiguous() or scratch.device != device
    ):
        raise ValueError(
            f"{op}: scratch must be a contiguous uint8 vector on {device}, got {scratch.dtype} "
            f"{tuple(scratch.shape)} on {scratch.device}"
        )
    if scratch is not None and (scratch.storage_offset() % 4 or scratch.data_ptr() % 4):
        raise ValueError(
            f"{op}: scratch must start 4-byte aligned (its fp32 partials and LSEs are views of it), got an "
            f"offset of {scratch.storage_offset()} bytes into its storage"
        )


def check_attention_inputs(q, k_cache_l, v_cache_l, topk_ids, op: str = "paged_attention") -> None:
    """The input rules of a paged attention op (``paged_attention``; the batch-invariant one names
    itself with ``op``): q [T, nh, d] and k/v caches [P, G, ps, d] of one fp32/fp16/bf16 dtype in
    the paged_layout.py layout, d and ps powers of two in [16, 256], nh a multiple of G, topk_ids
    None or [T, G, K]. Raises ValueError naming ``op`` and the offending field."""
    t, nh, d = q.shape
    _, g, ps, dk = k_cache_l.shape
    if (
        q.dtype not in (torch.float32, torch.float16, torch.bfloat16)
        or k_cache_l.dtype != q.dtype
        or v_cache_l.dtype != q.dtype
    ):
        raise ValueError(
            f"{op}: dtypes q={q.dtype}, k={k_cache_l.dtype}, v={v_cache_l.dtype}; the "
            "Triton kernel supports fp32/fp16/bf16 with equal dtypes"
        )
    check_pow2_dim("head_dim", d)
    check_pow2_dim("page_size (sparse_block_size)", ps)
    if dk != d or v_cache_l.shape != k_cache_l.shape:
        raise ValueError(f"{op}: q head_dim {d} vs caches {tuple(k_cache_l.shape)}/{tuple(v_cache_l.shape)}")
    if nh % g:
        raise ValueError(f"{op}: num_attention_heads={nh} is not a multiple of num_key_value_heads={g}")
    if k_cache_l.stride()[1:] != (ps * d, d, 1) or k_cache_l.stride() != v_cache_l.stride():
        raise ValueError(f"{op}: k/v caches must have the paged_cache.py layout (contiguous pages)")
    if q.stride(2) != 1:
        raise ValueError(f"{op}: q {tuple(q.shape)} with strides {q.stride()}: head_dim must be at unit stride")
    if topk_ids is not None and (topk_ids.dim() != 3 or topk_ids.shape[:2] != (t, g)):
        raise ValueError(f"{op}: topk_ids shape {tuple(topk_ids.shape)}, expected [T={t}, G={g}, K]")


def paged_attention(
    q: torch.Tensor,
    k_cache_l: torch.Tensor,
    v_cache_l: torch.Tensor,
    meta: PagedMetadata,
    scale: float,
    topk_ids: torch.Tensor | None = None,
    prefill_block_m: int | None = None,
    prefill_config: dict | None = None,
    scratch: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton version of ``m3_rollout.engine.reference_ops.paged_attention_ref`` (same arguments and output, spec §3.5).

    q: [T, nh, d]; k_cache_l, v_cache_l: [P, G, ps, d] (contiguous pages), same dtype as q
    (fp32/fp16/bf16); topk_ids: [T, G, K] int32 block ids (-1 = empty) or None for dense causal.
    prefill_block_m: query tokens per prefill program (default 4 sparse, 8 dense).
    prefill_config: benchmark knobs of the sparse prefill: ``impl`` ("kv" KV-major, "union" tiles,
    "loop" = the older per-entry loop; default by prefill token count, see KV_MAJOR_MIN_TOKENS),
    ``num_warps``, ``num_stages``, ``maxnreg``; KV-major only: ``tok`` (tokens per tile), ``seg``
    (entries per program), ``kv_chunk`` (tokens per bucketing pass, at most the scratch's
    capacity), ``merge_warps``, ``prefetch`` (True: load the next tile's query rows before this
    tile's dots, H200 128K 43.5 -> 40.9 ms, the fp32 default; "pipeline": the segment's entry ids
    read once as vectors and the query rows staged by the compiler, ``KV_SEG_PIPELINE_STAGES`` deep
    unless ``num_stages`` says, 128K -> 39.9-41.0 ms; "deferred": "pipeline" with the next tile's
    QK dot issued before this tile's softmax, 128K -> 38.3-38.5 ms (the H200 figures so far), the
    16-bit default off sm_90 (``KV_SEG_LOOP``); "sm90": the Gluon kernel of
    kernels/msa_kv_segment_sm90.py (compute capability 9.x, 16-bit, M3's tile: the same bits as
    "deferred", on an H100 41.9-44.2 -> 40.0-41.7 ms against it), taken by default where it can run
    (``KV_SEG_SM90_DEFAULT``), ``num_stages`` its query-tile stages (2 or 3), ``num_warps`` /
    ``maxnreg`` unused, a launch it cannot run refused with ValueError; False: none of these).
    scratch: the KV-major path's partial outputs and log-sum-exps (uint8 [bytes], contiguous, on
    q's device; layout: kernels/paged_layout.py; the engine's buffer, allocated once inside its
    memory budget). Its passes then hold ``kv_major_capacity`` tokens each (however many prefill
    tokens the call has; the pass size changes which entries share a tile, not what an entry
    computes: the same output up to the rounding of a row's dot at another tile place) and
    allocate no partials of their own. A scratch that holds no token at these shapes (e.g.
    empty) turns the KV-major path off: sparse prefill takes the union-list tiles at every length.
    None: passes of KV_CHUNK_TOKENS tokens in a buffer allocated per call. Ignored by decode rows
    and dense layers.
    Returns [T, nh, d] in q.dtype.
    Raises ValueError for an unsupported dtype, d/ps not a power of two in [16, 256], nh not a
    multiple of G, topk_ids of the wrong shape, a scratch that is not a contiguous uint8 vector on
    q's device, or ``impl="kv"`` with a scratch that holds no token.
    """
    check_attention_inputs(q, k_cache_l, v_cache_l, topk_ids)
    check_kv_major_scratch(scratch, q.device)
    t, nh, d = q.shape
    g, ps = k_cache_l.shape[1], k_cache_l.shape[2]
    out = torch.empty_like(q)
    if t == 0:
        return out
    dense = topk_ids is None
    sel = q.new_empty(0, dtype=torch.int32) if dense else topk_ids.to(torch.int32)
    ssel = (0, 0) if dense else (sel.stride(0), sel.stride(1))
    topk = 0 if dense else topk_ids.shape[2]
    rh = nh // g
    rhp = max(next_pow2(rh), 16)
    ieee = q.dtype == torch.float32
    qk_scale = float(scale) * LOG2E
    nbp = meta.block_tables.shape[1]
    common = (
        q.stride(0),
        q.stride(1),
        k_cache_l.stride(0),
        k_cache_l.stride(1),
        k_cache_l.stride(2),
        meta.block_tables.stride(0),
        ssel[0],
        ssel[1],
        out.stride(0),
        out.stride(1),
    )
    nd, r = meta.num_decodes, meta.num_rows
    t_dec = nd * meta.decode_query_len
    if t_dec > 0:
        n_entries = nbp if dense else topk
        splits = decode_splits(t_dec, g, n_entries)
        per = triton.cdiv(n_entries, splits)
        split = splits > 1
        opart = torch.empty(t_dec * g * splits * rhp * d if split else 1, dtype=torch.float32, device=q.device)
        lse = torch.empty(t_dec * g * splits * rhp if split else 1, dtype=torch.float32, device=q.device)
        _decode_attn_kernel[(t_dec, g, splits)](
            q,
            k_cache_l,
            v_cache_l,
            meta.block_tables,
            meta.positions,
            sel,
            out,
            opart,
            lse,
            qk_scale,
            meta.decode_query_len,
            n_entries,
            per,
            *common,
            RH=rh,
            RHP=rhp,
            D=d,
            PS=ps,
            DENSE=dense,
            SPLIT=split,
            IEEE=ieee,
            KP=max(next_pow2(topk), 2),
            num_warps=4,
            num_stages=1 if ieee else 2,
        )
        if split:
            _decode_merge_kernel[(t_dec, g)](
                opart, lse, out, out.stride(0), out.stride(1), RH=rh, RHP=rhp, D=d, S=splits, num_warps=4
            )
    if r > nd:
        _prefill_launch(
            q,
            k_cache_l,
            v_cache_l,
            meta,
            sel,
            out,
            qk_scale,
            topk,
            common,
            rh,
            dense,
            ieee,
            prefill_block_m,
            check_prefill_config(prefill_config or {}),
            scratch,
        )
    return out


_PREFILL_POW2_KNOBS = ("num_warps", "merge_warps", "tok")
_PREFILL_POSITIVE_KNOBS = ("num_stages", "maxnreg", "seg", "kv_chunk")


def check_prefill_config(cfg: dict) -> dict:
    """Validate ``paged_attention``'s ``prefill_config`` knobs; returns cfg.

    Raises ValueError naming the knob: unknown key, ``impl`` not in kv/union/loop, ``prefetch`` not
    True / False / "pipeline" / "deferred" / "sm90", a warp count or ``tok`` not a power of two >= 1,
    or ``num_stages`` / ``maxnreg`` / ``seg`` / ``kv_chunk`` < 1. (Whether the "sm90" kernel can run
    a launch is checked at the launch: ``msa_kv_segment_sm90.check_kv_seg_sm90``.)
    """
    allowed = {"impl", "prefetch", *_PREFILL_POW2_KNOBS, *_PREFILL_POSITIVE_KNOBS}
    for key, val in cfg.items():
        if key not in allowed:
            raise ValueError(f"paged_attention: unknown prefill_config key {key!r}; known: {sorted(allowed)}")
        # 1 == True, but not `is`
        if key == "prefetch" and not (isinstance(val, bool) or val in (*KV_SEG_LOOPS, KV_SEG_SM90)):
            raise ValueError(
                f"paged_attention: prefill_config prefetch={val!r}; use True, False, 'pipeline', 'deferred' or "
                f"{KV_SEG_SM90!r}"
            )
        if key == "impl" and val not in ("kv", "union", "loop"):
            raise ValueError(f"paged_attention: prefill_config impl={val!r}; use 'kv', 'union' or 'loop'")
        if key in _PREFILL_POW2_KNOBS:
            check_pow2_knob("paged_attention", key, val)
        if key in _PREFILL_POSITIVE_KNOBS and (not isinstance(val, int) or val < 1):
            raise ValueError(f"paged_attention: prefill_config {key}={val!r}; needs an integer >= 1")
    return cfg


def _prefill_launch(
    q, k_cache_l, v_cache_l, meta, sel, out, qk_scale, topk, common, rh, dense, ieee, block_m, cfg, scratch
):
    """Prefill rows: dense causal walk, union-list tiles (one union pass first) or the KV-major path
    (from KV_MAJOR_MIN_TOKENS prefill tokens on, unless ``scratch`` holds no token)."""
    nd, r = meta.num_decodes, meta.num_rows
    rhp = next_pow2(rh)
    bm = block_m or (4 if not dense else 8)
    bm = max(bm, triton.cdiv(16, rhp))
    g = k_cache_l.shape[1]
    n_qtiles = triton.cdiv(max(meta.max_query_len, 1), bm)
    grid = ((r - nd) * n_qtiles, g)
    warps = cfg.get("num_warps", 4 if bm * rhp <= 64 else 8)
    stages = 1 if ieee else cfg.get("num_stages", 2)
    cap = None if dense else kv_major_capacity(scratch, q.shape[1], q.shape[2], topk, q.dtype)
    long = q.shape[0] - nd * meta.decode_query_len >= KV_MAJOR_MIN_TOKENS
    impl = "loop" if dense else cfg.get("impl", "kv" if long and cap != 0 else "union")
    if impl == "kv" and cap == 0:
        raise ValueError(
            f"paged_attention: prefill_config impl='kv' with a scratch of {scratch.numel()} bytes, which holds no "
            f"token of the KV-major path ({kv_major_token_bytes(q.shape[1], q.shape[2], topk, q.dtype)} bytes each)"
        )
    if impl == "union":  # H200: one stage (two programs per SM) beats two pipelined stages at 8K..128K
        stages = 1 if ieee else cfg.get("num_stages", 1)
    if impl == "kv":
        prefill_kv_major(q, k_cache_l, v_cache_l, meta, sel, out, qk_scale, rh, ieee, cfg, scratch, cap)
        return
    if impl == "loop":
        _prefill_attn_kernel[grid](
            q,
            k_cache_l,
            v_cache_l,
            meta.block_tables,
            meta.query_start_loc,
            meta.positions,
            sel,
            out,
            qk_scale,
            nd,
            n_qtiles,
            topk,
            *common,
            RH=rh,
            RHP=rhp,
            D=q.shape[2],
            PS=k_cache_l.shape[2],
            BLOCK_M=bm,
            KP=max(next_pow2(topk), 2),
            DENSE=dense,
            IEEE=ieee,
            num_warps=warps,
            num_stages=stages,
        )
        return
    if bm > 31:
        raise ValueError(f"paged_attention: prefill_block_m={bm} > 31 (the union membership is a 32-bit mask)")
    n_slots = grid[0] * g
    ulist = torch.empty(n_slots * bm * topk, dtype=torch.int32, device=q.device)
    umask = torch.empty(n_slots * bm * topk, dtype=torch.int32, device=q.device)
    upage = torch.empty(n_slots * bm * topk, dtype=torch.int32, device=q.device)
    ucount = torch.empty(n_slots, dtype=torch.int32, device=q.device)
    tile_union_kernel[grid](
        sel,
        meta.query_start_loc,
        meta.positions,
        meta.block_tables,
        ulist,
        umask,
        upage,
        ucount,
        nd,
        n_qtiles,
        topk,
        sel.stride(0),
        sel.stride(1),
        meta.block_tables.stride(0),
        PS=k_cache_l.shape[2],
        BLOCK_M=bm,
        KP=next_pow2(topk),
        num_warps=4,
    )
    qs, ks = common[0:2], common[2:5]
    _prefill_union_attn_kernel[grid](
        q,
        k_cache_l,
        v_cache_l,
        meta.query_start_loc,
        meta.positions,
        ulist,
        umask,
        upage,
        ucount,
        out,
        qk_scale,
        nd,
        n_qtiles,
        topk,
        *qs,
        *ks,
        out.stride(0),
        out.stride(1),
        RH=rh,
        RHP=rhp,
        D=q.shape[2],
        PS=k_cache_l.shape[2],
        BLOCK_M=bm,
        IEEE=ieee,
        num_warps=warps,
        num_stages=stages,
    )


def prefill_kv_major(q, k_cache_l, v_cache_l, meta, sel, out, qk_scale, rh, ieee, cfg, scratch, cap):
    """KV-major sparse prefill: bucket the (token, slot) entries by (KV head, row, block), attend each page
    once per segment of up to ``seg`` entries, ``tok`` tokens per tile (every row of a tile useful),
    then merge each token's K partials by LSE.

    Sync-free torch glue (sort, searchsorted, cumsum) builds the buckets; grids are fixed by the shape
    (an upper bound of segments; spare programs exit). Prefill tokens run in passes of
    min(``cfg["kv_chunk"]``, ``cap``) tokens (defaults: KV_CHUNK_TOKENS; ``cap`` = the scratch's
    capacity, None without one) to bound the partial-output scratch ([chunk, G, K, nh/G, d] in the
    input dtype, fp32 for fp32, + [chunk, G, K, nh/G] fp32 LSEs: 4160 MiB at M3 shapes in bf16 for
    16K tokens; one buffer serves every pass, stream-ordered): ``scratch`` (the caller's, uint8)
    or, when None, one allocated here. Every entry's partial and every token's merge are computed
    alone, so the pass size only regroups entries into tiles (equal passes: equal bits; other
    passes: within rounding; tests/test_kernels_msa.py). The per-pass glue (bucket ids, sort
    permutation, positions: a few tens of bytes per (token, KV head, slot) entry, 1-2 % of the
    partials' bytes at M3 shapes) is allocated per pass as before.
    Writes the prefill rows of ``out`` [T, nh, d]; sel: int32 [T, G, K] (rows at unit stride);
    qk_scale: scale x log2 e; rh: nh / G; ieee: fp32 inputs; cfg: ``prefill_config`` knobs. Also run
    by kernels/invariant_page_partials.py (the batch-invariant mode) with one fixed knob set.
    """
    nd, r = meta.num_decodes, meta.num_rows
    t_all = q.shape[0]
    td = int(nd * meta.decode_query_len)
    tp = t_all - td
    _, g, ps, d = k_cache_l.shape
    topk = sel.shape[2]
    rp = r - nd
    nbp = meta.block_tables.shape[1]
    rhp = next_pow2(rh)
    if tp == 0:  # only decode rows
        return
    tok = max(cfg.get("tok", 4), triton.cdiv(16, rhp))
    if cap is None:
        chunk = min(cfg.get("kv_chunk", KV_CHUNK_TOKENS), tp)
    else:  # the scratch bounds the pass; a kv_chunk knob may only shorten it
        chunk = min(cfg.get("kv_chunk", cap), cap, tp)
    dev = q.device
    n_bkt = g * rp * nbp
    # [n_bkt] page of each bucket (-1 = unused); [Tp] prefill-local row and own block of each token
    bkt_page, row_of_tok, blk_of_tok, bkt_ids = _kv_major_step_index(meta, g, nbp, ps, nd, td, t_all)
    opart_buf, lse_buf = kv_major_partial_buffers(scratch, chunk, g, topk, rh, d, q.dtype, dev)  # every pass
    seg_len = cfg.get("seg", KV_SEGMENT)
    prefetch = cfg.get("prefetch", True if ieee else KV_SEG_LOOP)
    sm90_stages = cfg.get("num_stages", KV_SEG_SM90_STAGES)  # query-tile stages of the Hopper kernel
    if prefetch == KV_SEG_SM90:  # asked for: refused before any pass's work if it cannot run
        check_kv_seg_sm90(q, k_cache_l, rh, tok, sm90_stages)
    elif "prefetch" not in cfg and KV_SEG_SM90_DEFAULT and sm90_unsupported(q, k_cache_l, rh, tok, sm90_stages) is None:
        prefetch = KV_SEG_SM90
    for c0 in range(0, tp, chunk):
        c1 = min(c0 + chunk, tp)
        tc = c1 - c0
        sel_c = sel[td + c0 : td + c1].contiguous()  # [Tc, G, K]
        pos_c = meta.positions[td + c0 : td + c1]
        n_ent = tc * g * topk
        bucket = torch.empty(n_ent, dtype=torch.int32, device=dev)  # [Tc*G*K]; invalid -> n_bkt
        kv_bucket_kernel[(triton.cdiv(n_ent, KV_BUCKET_BLOCK),)](
            sel_c, row_of_tok, blk_of_tok, bucket, n_ent, c0, rp, nbp, n_bkt, GK=g * topk, K=topk, BLOCK=KV_BUCKET_BLOCK
        )
        keys, perm = torch.sort(bucket)
        edges = torch.searchsorted(keys, bkt_ids)  # [n_bkt + 1]
        start, end = edges[:-1], edges[1:]
        opart, lse = opart_buf[: tc * g * topk * rh * d], lse_buf[: tc * g * topk * rh]
        common = (
            qk_scale,
            td + c0,
            topk,
            nbp,
            rp * nbp,
            q.stride(0),
            q.stride(1),
            k_cache_l.stride(0),
            k_cache_l.stride(1),
            k_cache_l.stride(2),
        )
        kw = dict(
            G=g,
            RH=rh,
            RHP=rhp,
            D=d,
            PS=ps,
            TOK=tok,
            IEEE=ieee,  # noqa: C408
            num_warps=cfg.get("num_warps", 4 if tok * rhp <= 64 else 8),
            **({"maxnreg": cfg["maxnreg"]} if cfg.get("maxnreg") else {}),
        )
        # segments of up to seg_len entries per bucket; one program per segment (fixed grid: a bound)
        n_segs = (end - start + seg_len - 1) // seg_len
        seg_end = torch.cumsum(n_segs, 0)
        max_segs = triton.cdiv(tc * g * topk, seg_len) + n_bkt
        seg_bkt = torch.searchsorted(seg_end, torch.arange(max_segs, device=dev), right=True)
        seg_bkt = torch.where(seg_bkt < n_bkt, seg_bkt, -1).to(torch.int32)
        epos = pos_c[perm // (g * topk)].to(torch.int32)  # [Tc*G*K] query position of each sorted entry
        if prefetch == KV_SEG_SM90:
            kv_seg_attn_sm90_kernel[(max_segs,)](
                q, k_cache_l, v_cache_l, epos, seg_bkt, start, seg_end - n_segs, end, bkt_page, perm, opart, lse,
                *common, G=g, RH=rh, D=d, PS=ps, TOK=tok, SEG=seg_len,
                STAGES=sm90_stages, num_warps=4,
            )  # fmt: skip
        else:
            kv_seg_attn_kernel[(max_segs,)](
                q,
                k_cache_l,
                v_cache_l,
                epos,
                seg_bkt,
                start,
                seg_end - n_segs,
                end,
                bkt_page,
                perm,
                opart,
                lse,
                *common,
                SEG=seg_len,
                PREFETCH=prefetch is True,
                PIPELINE=prefetch in KV_SEG_LOOPS,
                DEFERRED=prefetch == "deferred",
                SEGP=next_pow2(seg_len),  # the pipelined loop's vector width (tl.arange needs a power of two)
                num_stages=cfg.get("num_stages", KV_SEG_PIPELINE_STAGES if prefetch in KV_SEG_LOOPS else 1),
                **kw,
            )
        kv_major_merge_kernel[(tc, g)](
            opart,
            lse,
            sel_c,
            meta.positions,
            out,
            td + c0,
            topk,
            out.stride(0),
            out.stride(1),
            G=g,
            RH=rh,
            RHP=rhp,
            D=d,
            PS=ps,
            KP=max(next_pow2(topk), 2),
            num_warps=cfg.get("merge_warps", 4),
        )

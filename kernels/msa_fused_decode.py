"""Fused sparse-layer MSA decode step: index block scores [+ chunk top-k on wide tables], then top-k merge + attention.

Which decode path is this: the SPARSE layers' whole decode step (lightning-indexer scores, the
top-k block choice in registers, the attention over the chosen blocks and the split merge) for
the decode rows of a step; ``msa_attention`` (the engine's sparse-layer op on CUDA) runs it and
sends prefill rows to ``msa_index_topk.index_topk`` + ``msa_paged_attention.paged_attention``.
The other decode path, the split-K attention over GIVEN block ids or over all causal keys (dense
layers), is ``msa_paged_attention.paged_attention``.

Governing idea (spec §3.4-3.5, §4.3): a decode step at short context is latency-bound (a few
microseconds per launch, little data) and at long context bound by reading the index keys, so
the step runs as
- K1 ``_decode_scores_kernel``: block-max index scores of every (decode token, index head) over
  the row's causal blocks, split over blocks (grid = decode rows x block splits), into a scratch
  ``[T, G, NBP]`` fp32 buffer;
- K2 ``_decode_select_attend_kernel``: one program per (decode token, KV head, split) selects the
  top-k blocks in registers, attends to its share of them and merges.
  Selection keys: +inf for forced (local/init) blocks, else the score; rank(i) = #{candidates
  j beating i}, j beats i iff key_j > key_i or (key_j == key_i and j < i); rank < K is the
  selection and the rank is the slot, i.e. exactly ``m3_rollout.engine.reference_ops.index_topk_ref``'s list
  (forced first, lower id first among them, then score desc, ties to the lower id).
Block tables of at least ``SCORE_TOPK_MIN_BLOCKS`` pages (long contexts, bound by reading the index
keys) take ``LONG_DECODE_PATH`` by default, "index_topk": ``msa_index_topk``'s split-K block scores
and chunk top-k (one KP-key list per chunk of TOPK_CHUNK blocks), then K2 in MODE 2, which merges
the chunk lists of its (token, head) in its prologue (one tl.topk network) and attends: three
launches. The "score_topk" path runs K1 as ``msa_score_topk._decode_score_topk_kernel``: each score
program keeps the top-k selection keys of its slice of blocks in registers and writes only those
([Td, G, S, KP] int64 instead of [Td, G, NBP] fp32 scores); K2 (MODE 2) merges them the same way.
Same order and padding as the reference; design and cost model in kernels/msa_score_topk.py.
NOTE (H200, 2026-11-29): ranking in registers costs O(NBP^2) compares; per-chunk top-k in the
score kernel with the winners RANKED (O(n^2)) in K2 was measured for wide tables and lost to index_topk
(1M context: 227 us vs 87 us per step), as did a one-launch variant whose programs wait for each
other at 8K (14.5 us vs 12.5 us): neither is kept. The MODE 2 merge differs: a top-K network over
<= MAX_MERGE_CANDIDATES keys, not a ranking.
  Each split attends to slots [s*E, (s+1)*E) with an online softmax in base 2 (all RH query
  heads of the group together), writes its normalised partial output and base-2 LSE, and bumps a
  per-(token, head) arrival counter; the last split to arrive merges the S partials with weights
  exp2(lse_s - max) and resets the counter to 0, so the next launch (or CUDA-graph replay) starts
  from zero. No merge launch.
Memory ordering of the merge: every split stores its partial, passes a CTA barrier, then does an
acq_rel gpu-scope atomic add; the last one reads the partials with L1-bypassing loads.
NOTE: the counters live in a per-device buffer that is zero between launches; two streams must
not run this kernel concurrently on the same device (the engine runs one stream).

Launch chaining (CUDA, ``PDL``): K2 is launched with programmatic dependent launch; K1 signals
its dependents at its start, so K2's programs are scheduled while K1 runs and wait in
``griddepcontrol.wait`` (full completion and visibility of K1's stores) before reading them. On
the "index_topk" path the chunk top-k launch may be chained to the score launch the same way and
may trigger K2 at its start, per index-key format (``INDEX_TOPK_PDL``).
CUDA-graph safety: grids depend only on (decode tokens, G, block-table width, top-k); per-row
lengths are read on the device; no host syncs; PDL edges are captured by stream capture.
NOTE: fp32 inputs use ``input_precision="ieee"`` (no tf32); bf16/fp16 inputs run tensor-core dots
with fp32 accumulation and cast the softmax probabilities to the input dtype for the PV dot.

Shape legend: T decode tokens, G KV heads (= index heads), nh query heads, RH = nh/G,
d head dim, di index dim, ps page (= block) size, K top-k, NBP block-table width, S splits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from m3_kernels import msa_score_topk
from m3_kernels.msa_checks import check_pow2_dim, next_pow2
from m3_kernels.msa_fp8 import index_dot, index_format, quantize_rows_e4m3, split_index_cache
from m3_kernels.msa_score_topk import decode_score_topk, merge_candidates
from m3_kernels.paged_layout import FP8IndexCache, PagedMetadata

LOG2E = 1.4426950408889634
MAX_FUSED_BLOCKS = 256  # widest block table whose scores are ranked in the attention kernel (32K tokens)
MAX_TOPK = 64
RANK_CHUNK = 32  # candidates compared per step of the in-register ranking
PDL = True  # chain the decode launches with programmatic dependent launch on CUDA (~1 us less at 8K); False: none
# Block tables at least this wide take the "score_topk" path (fused score + partial top-k, merge in K2);
# narrower ones the "rank" path (scores, in-register rank in K2; H200 8K: 12.5 us per step). The rank
# path needs <= MAX_FUSED_BLOCKS pages. bench_msa.py times both paths at every decode context: the
# switch point is to be set from its 8K / 32K rows (GPU session).
SCORE_TOPK_MIN_BLOCKS = MAX_FUSED_BLOCKS + 1
DECODE_PATHS = ("rank", "score_topk", "index_topk")
# NOTE: the default route of tables from SCORE_TOPK_MIN_BLOCKS pages. "index_topk" is the faster one
# (bench_msa.py, H200 2026-12-04, 1M: 77-79 us bf16 vs 121 us for "score_topk"); "score_topk" passes
# the GPU tests (tests/gpu/test_msa_gpu.py) and is kept for the A/B.
LONG_DECODE_PATH = "index_topk"
# The "index_topk" decode path: the chunk winners of msa_index_topk.topk_chunk_keys go straight to K2,
# which merges them in its prologue (MODE 2, one tl.topk network): 3 launches (scores, chunk top-k,
# attention) instead of 4 (+ the top-k merge launch). False: index_topk's own merge, then K2 on the
# ids (kept for the A/B of bench_msa.py).
INDEX_TOPK_MERGE_IN_ATTENTION = True
# How the "index_topk" path chains its launches, per index-key format (the attention launch K2 is
# always launched with PDL on CUDA). Score -> chunk top-k: "off" (a plain launch after the scores),
# "exit" (the chunk top-k launched with PDL; let in as the score programs exit), "start" (the score
# programs trigger it at their start, so its programs can be resident and waiting); "+k2": the chunk
# top-k programs trigger K2 at their start (else K2 is let in as they exit). bench_msa.py times
# every mode in one run (docs/benchmarks.md).
INDEX_TOPK_PDL = {"bf16": "start+k2", "fp8": "exit", "fp8q": "exit+k2"}
INDEX_TOPK_PDL_MODES = ("off", "off+k2", "exit", "exit+k2", "start", "start+k2")


def index_topk_chain(fmt: str) -> tuple[str, bool]:
    """(score -> chunk top-k chaining: "off" | "exit" | "start", whether the chunk top-k triggers K2
    at its start) of index-key format ``fmt`` from ``INDEX_TOPK_PDL``. Raises ValueError naming the
    format and the allowed modes for a missing or unknown entry."""
    mode = INDEX_TOPK_PDL.get(fmt)
    if mode not in INDEX_TOPK_PDL_MODES:
        raise ValueError(f"msa decode: INDEX_TOPK_PDL[{fmt!r}] = {mode!r}; set it to one of {INDEX_TOPK_PDL_MODES}")
    chain, _, k2 = mode.partition("+")
    return chain, k2 == "k2"


@triton.jit
def _decode_scores_kernel(
    iq_ptr,
    ik_ptr,
    iks_ptr,
    bt_ptr,
    pos_ptr,
    score_ptr,
    dql,
    blocks_per_split,
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
    QP: tl.constexpr,
    DI: tl.constexpr,
    PS: tl.constexpr,
    KSCALE: tl.constexpr,
    QFP8: tl.constexpr,
    PDL: tl.constexpr,
):
    """Block-max index scores of one decode row's dql tokens x G heads over one split of blocks.

    KSCALE: FP8 keys with per-token scales (iks_ptr); QFP8: queries quantized to e4m3 here, one
    scale per (token, head) row applied to its block maxima (kernels/paged_layout.py format).
    """
    if PDL:  # let the attention kernel (launched with PDL) get scheduled now; it waits for our stores
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)  # int64 offsets (tok * stride_iq_t, tok * stride_s_t)
    split = tl.program_id(1)
    offs_m = tl.arange(0, QP * GP)  # m = token m // GP, head m % GP
    tok_i = offs_m // GP
    head = offs_m % GP
    m_ok = (tok_i < dql) & (head < G)
    tok = row * dql + tok_i
    offs_d = tl.arange(0, DI)
    offs_o = tl.arange(0, PS)
    q = tl.load(
        iq_ptr + tok[:, None] * stride_iq_t + head[:, None] * stride_iq_g + offs_d[None, :],
        mask=m_ok[:, None],
        other=0.0,
    )  # [M, DI]
    q_scale = tl.full([QP * GP], 1.0, tl.float32)
    if QFP8:
        q, q_scale = quantize_rows_e4m3(q)
    qpos = tl.load(pos_ptr + tok, mask=m_ok, other=-1)  # [M]
    n_blk = tl.max(qpos, axis=0) // PS + 1
    b_lo = split * blocks_per_split
    b_hi = tl.minimum(b_lo + blocks_per_split, n_blk)
    out_ptr = score_ptr + tok * stride_s_t + head * stride_s_g  # [M]
    for b in range(b_lo, b_hi):
        page = tl.load(bt_ptr + row * stride_bt_r + b)
        k = tl.load(ik_ptr + page.to(tl.int64) * stride_ik_p + offs_o[:, None] * stride_ik_o + offs_d[None, :])
        s = index_dot(q, k)  # [M, PS] fp32
        if KSCALE:
            s = s * tl.load(iks_ptr + page.to(tl.int64) * stride_iks_p + offs_o)[None, :]
        causal = (b * PS + offs_o)[None, :] <= qpos[:, None]
        s = tl.where(causal, s, float("-inf"))
        smax = tl.max(s, axis=1)
        # NaN anywhere in the block -> -1e30 (the reference's amax propagates NaN, spec §3.4)
        has_nan = tl.max(tl.where(s != s, 1, 0), axis=1) > 0
        smax = tl.where(has_nan, -1e30, smax)
        if QFP8:
            smax = smax * q_scale
        tl.store(out_ptr + b, smax, mask=m_ok)


@triton.jit
def _rank_keys(score_row_ptr, offs, n_blk, init_blocks, local_blocks):
    """Selection keys of blocks ``offs``: +inf forced, score otherwise, -inf past the candidates."""
    cand = offs < n_blk
    s = tl.load(score_row_ptr + offs, mask=cand, other=float("-inf"))
    forced = cand & ((offs >= n_blk - local_blocks) | (offs < init_blocks))
    return tl.where(forced, float("inf"), s), cand


@triton.jit
def _select_ranks(srow, base, n_blk, init_blocks, local_blocks, NBC: tl.constexpr, RC: tl.constexpr):
    """[NBC] rank of blocks base..base+NBC-1 in the selection order (NBC + 1 past the candidates).

    j beats i iff key_j > key_i or (key_j == key_i and j < i): forced blocks first (lower id
    first), then score desc, ties to the lower id (``m3_rollout.engine.reference_ops.index_topk_ref``'s order).
    """
    offs_b = base + tl.arange(0, NBC)
    key_b, cand = _rank_keys(srow, offs_b, n_blk, init_blocks, local_blocks)
    rank = tl.zeros([NBC], tl.int32)
    for j0 in tl.static_range(0, NBC, RC):
        offs_j = base + j0 + tl.arange(0, RC)
        key_j, cand_j = _rank_keys(srow, offs_j, n_blk, init_blocks, local_blocks)
        beats = cand_j[None, :] & (
            (key_j[None, :] > key_b[:, None])
            | ((key_j[None, :] == key_b[:, None]) & (offs_j[None, :] < offs_b[:, None]))
        )
        rank += tl.sum(beats.to(tl.int32), axis=1)
    return tl.where(cand, rank, NBC + 1)


@triton.jit
def _load_q_group(q_ptr, t, g, stride_qt, stride_qh, RH: tl.constexpr, RHP: tl.constexpr, D: tl.constexpr):
    """[RHP, D] queries of KV head g's RH query heads of token t (rows >= RH zero)."""
    offs_h = tl.arange(0, RHP)
    offs_d = tl.arange(0, D)
    head = g * RH + offs_h
    return tl.load(
        q_ptr + t * stride_qt + head[:, None] * stride_qh + offs_d[None, :], mask=(offs_h < RH)[:, None], other=0.0
    )


@triton.jit
def _attend_split(
    q,
    k_ptr,
    v_ptr,
    bt_ptr,
    ids_row,
    rank,
    blk,
    pages,
    g,
    row,
    p,
    qk_scale,
    topk,
    e_lo,
    e_hi,
    stride_kp,
    stride_kg,
    stride_ko,
    stride_bt_r,
    RHP: tl.constexpr,
    D: tl.constexpr,
    PS: tl.constexpr,
    NBC: tl.constexpr,
    SELECT: tl.constexpr,
    IEEE: tl.constexpr,
    KP: tl.constexpr,
):
    """Online softmax (base 2) of one KV head's query group q [RHP, D] over list slots [e_lo, e_hi).

    SELECT: slot e holds the block ``blk`` [NBC] of the lane of rank e (``rank`` [NBC]) whose page
    is in ``pages`` [NBC] (preloaded); else slot e of the top-k row ``ids_row``, a set: a block id
    repeated at a later slot counts once (as in the reference). Invalid slots (-1, >= nb, past the
    candidates) are masked (no branch in the loop, so the K/V loads of the next slot can be issued
    early). Returns (m [RHP], l [RHP], acc [RHP, D]).
    """
    n_blk = p // PS + 1
    offs_d = tl.arange(0, D)
    offs_o = tl.arange(0, PS)
    if SELECT:
        e_hi = tl.minimum(e_hi, tl.minimum(topk, n_blk))
    m_i = tl.full([RHP], float("-inf"), tl.float32)
    l_i = tl.zeros([RHP], tl.float32)
    acc = tl.zeros([RHP, D], tl.float32)
    kg_ptr = k_ptr + g * stride_kg
    vg_ptr = v_ptr + g * stride_kg
    if not SELECT:
        offs_k = tl.arange(0, KP)
        row_ids = tl.load(ids_row + offs_k, mask=offs_k < topk, other=-1)  # [KP] the whole selection
    for e in range(e_lo, e_hi):
        if SELECT:
            hit = rank == e
            b = tl.sum(tl.where(hit, blk, 0))
            page = tl.sum(tl.where(hit, pages, 0))
            ok = b >= 0
        else:
            b = tl.load(ids_row + e)
            first = tl.sum(tl.where((row_ids == b) & (offs_k < e), 1, 0)) == 0  # not at an earlier slot
            ok = (b >= 0) & (b < n_blk) & first
            page = tl.load(bt_ptr + row * stride_bt_r + b, mask=ok, other=0)
        koff = page.to(tl.int64) * stride_kp + offs_o[:, None] * stride_ko + offs_d[None, :]
        k = tl.load(kg_ptr + koff, mask=ok, other=0.0)  # [PS, D]
        v = tl.load(vg_ptr + koff, mask=ok, other=0.0)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))  # [RHP, PS] fp32
        keep = ok & ((b * PS + offs_o) <= p)
        s = tl.where(keep[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        pr = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(pr, axis=1)
        if IEEE:
            pv = tl.dot(pr, v, input_precision="ieee")
        else:
            pv = tl.dot(pr.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _finish_split(
    m_i,
    l_i,
    acc,
    o_ptr,
    opart_ptr,
    lse_ptr,
    cnt_ptr,
    t,
    g,
    s_id,
    n_g,
    stride_ot,
    stride_oh,
    RH: tl.constexpr,
    RHP: tl.constexpr,
    D: tl.constexpr,
    S: tl.constexpr,
):
    """Store the output (S == 1) or the split's partial; the last of the S splits to arrive merges
    them (weights exp2(lse_s - max)) and re-arms the (token, head) counter."""
    offs_h = tl.arange(0, RHP)
    offs_d = tl.arange(0, D)
    head = g * RH + offs_h
    o_ptrs = o_ptr + t * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
    o_mask = (offs_h < RH)[:, None]
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    if S == 1:
        tl.store(o_ptrs, (acc / l_safe[:, None]).to(o_ptr.dtype.element_ty), mask=o_mask)
    else:
        lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
        tg = t * n_g + g
        base = tg * S + s_id
        tl.store(lse_ptr + base * RHP + offs_h, lse)
        tl.store(opart_ptr + (base * RHP + offs_h[:, None]) * D + offs_d[None, :], acc / l_safe[:, None])
        tl.debug_barrier()  # every thread's partial stores precede the release below
        arrived = tl.atomic_add(cnt_ptr + tg, 1, sem="acq_rel", scope="gpu")
        if arrived == S - 1:  # last split of this (token, head): merge, then re-arm the counter
            tl.atomic_xchg(cnt_ptr + tg, 0, sem="relaxed", scope="gpu")
            offs_s = tl.arange(0, S)
            lse_all = tl.load(
                lse_ptr + (tg * S + offs_s[:, None]) * RHP + offs_h[None, :], cache_modifier=".cg"
            )  # [S, RHP]
            m = tl.max(lse_all, axis=0)  # finite: the own block is in some split
            w = tl.exp2(lse_all - m[None, :])
            w = w / tl.sum(w, axis=0)[None, :]
            res = tl.zeros([RHP, D], tl.float32)
            for s in tl.static_range(S):
                o_s = tl.load(
                    opart_ptr + ((tg * S + s) * RHP + offs_h[:, None]) * D + offs_d[None, :], cache_modifier=".cg"
                )
                w_s = tl.sum(tl.where(offs_s[:, None] == s, w, 0.0), axis=0)  # [RHP]
                res += w_s[:, None] * o_s
            tl.store(o_ptrs, res.to(o_ptr.dtype.element_ty), mask=o_mask)


@triton.jit
def _decode_select_attend_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    bt_ptr,
    pos_ptr,
    score_ptr,
    ids_ptr,
    o_ptr,
    opart_ptr,
    lse_ptr,
    cnt_ptr,
    qk_scale,
    dql,
    topk,
    init_blocks,
    local_blocks,
    entries_per_split,
    cand_splits,
    cand_blocks,
    stride_qt,
    stride_qh,
    stride_kp,
    stride_kg,
    stride_ko,
    stride_bt_r,
    stride_s_t,
    stride_s_g,
    stride_ids_t,
    stride_ids_g,
    stride_ot,
    stride_oh,
    RH: tl.constexpr,
    RHP: tl.constexpr,
    D: tl.constexpr,
    PS: tl.constexpr,
    NBC: tl.constexpr,
    RC: tl.constexpr,
    KP: tl.constexpr,
    MODE: tl.constexpr,
    WRITE_IDS: tl.constexpr,
    S: tl.constexpr,
    IEEE: tl.constexpr,
    PDL: tl.constexpr,
    NCAND: tl.constexpr = 16,
    MERGE_NET: tl.constexpr = False,
):
    """One (decode token, KV head, split): [top-k in registers], partial softmax, last arrival merges.

    MODE 0: block ids from a top-k buffer (ids_ptr); 1: rank selection from the scores
    (score_ptr [T, G, NBP]) in the reference's order; 2: merge of the score programs' candidate
    keys (score_ptr [T, G, cand_splits, KP] int64 from ``msa_score_topk.decode_score_topk``, lists
    of cand_blocks blocks; NCAND = next_pow2(cand_splits) x KP, NBC = KP). MODE 1 / 2 write the
    selection to ids_ptr when WRITE_IDS.
    """
    t = tl.program_id(0).to(tl.int64)  # int64 offsets (t * stride_qt, t * stride_s_t, t * stride_ot)
    g = tl.program_id(1)
    s_id = tl.program_id(2)
    row = t // dql
    p = tl.load(pos_ptr + t)
    if PDL:  # launched before the score / top-k kernel finished: wait for its stores
        tl.extra.cuda.gdc_wait()
    n_blk = p // PS + 1
    ids_row = ids_ptr + t * stride_ids_t + g * stride_ids_g
    q = _load_q_group(q_ptr, t, g, stride_qt, stride_qh, RH, RHP, D)
    rank = tl.zeros([NBC], tl.int32)
    blk = tl.arange(0, NBC)
    pages = rank
    if MODE == 1:
        pages = tl.load(bt_ptr + row * stride_bt_r + blk, mask=blk < n_blk, other=0)  # before the ranks
        rank = _select_ranks(score_ptr + t * stride_s_t + g * stride_s_g, 0, n_blk, init_blocks, local_blocks, NBC, RC)
        if WRITE_IDS:
            if s_id == 0:
                tl.store(ids_row + rank, blk, mask=rank < topk)
                offs_k = tl.arange(0, KP)
                tl.store(ids_row + offs_k, tl.full([KP], -1, tl.int32), mask=(offs_k < topk) & (offs_k >= n_blk))
    if MODE == 2:  # slot e = rank e: the merged selection in registers (NBC == KP)
        blk = merge_candidates(
            score_ptr + t * stride_s_t + g * stride_s_g, cand_splits, cand_blocks, n_blk, topk, NCAND, KP, MERGE_NET
        )
        rank = tl.arange(0, NBC)
        pages = tl.load(bt_ptr + row * stride_bt_r + blk, mask=blk >= 0, other=0)
        if WRITE_IDS:
            if s_id == 0:
                tl.store(ids_row + rank, blk, mask=rank < topk)
    e_lo = s_id * entries_per_split
    e_hi = tl.minimum(e_lo + entries_per_split, topk)
    m_i, l_i, acc = _attend_split(
        q,
        k_ptr,
        v_ptr,
        bt_ptr,
        ids_row,
        rank,
        blk,
        pages,
        g,
        row,
        p,
        qk_scale,
        topk,
        e_lo,
        e_hi,
        stride_kp,
        stride_kg,
        stride_ko,
        stride_bt_r,
        RHP,
        D,
        PS,
        NBC,
        MODE != 0,
        IEEE,
        KP,
    )
    _finish_split(
        m_i,
        l_i,
        acc,
        o_ptr,
        opart_ptr,
        lse_ptr,
        cnt_ptr,
        t,
        g,
        s_id,
        tl.num_programs(1),
        stride_ot,
        stride_oh,
        RH,
        RHP,
        D,
        S,
    )


_COUNTERS: dict[torch.device, list[torch.Tensor]] = {}


def arrival_counters(n: int, device: torch.device) -> torch.Tensor:
    """A zeroed int32 buffer of >= n counters on ``device``, kept for the process lifetime.

    Every launch leaves its counters at 0 again, so one buffer serves every layer and step.
    NOTE: a grown buffer replaces the old one for new calls, but the old one stays alive: a CUDA
    graph captured earlier keeps pointing at it.
    """
    bufs = _COUNTERS.setdefault(torch.device(device), [])
    if not bufs or bufs[-1].numel() < n:
        bufs.append(torch.zeros(max(n, 1024), dtype=torch.int32, device=device))
    return bufs[-1]


def default_splits(n_tokens: int, n_kv_heads: int, topk: int) -> int:
    """Attention splits per (decode token, KV head): the largest power of two <= min(topk, 16) with
    tokens x heads x splits <= 512 programs. Depends on the batch shape only (graph-safe).

    H200, 8K context, one sequence (bench, 2026-11-29): 16 splits (one block per program) 12.5 us
    per step, 8 splits 12.8 us, 4 splits 15.2 us, 1 split 36 us.
    """
    s = 16
    while s > 1 and (s > topk or n_tokens * n_kv_heads * s > 512):
        s //= 2
    return s


def default_score_blocks(nbp: int, n_rows: int) -> int:
    """Blocks per score program: 1 at short context, growing so the grid stays <= ~1024
    programs. Depends on the batch shape only."""
    return max(1, triton.cdiv(nbp * n_rows, 1024))


def decode_scores(
    iq: torch.Tensor,
    index_cache_l: torch.Tensor | FP8IndexCache,
    meta: PagedMetadata,
    n_rows: int,
    *,
    blocks_per_split: int | None = None,
    num_warps: int | None = None,
    num_stages: int = 2,
    pdl: bool = False,
) -> torch.Tensor:
    """Block-max index scores of the first ``n_rows`` decode rows (K1; spec §3.4).

    iq: [T, G, di] (the decode tokens first); index_cache_l: [P, ps, di] or an ``FP8IndexCache``
    (scores of the dequantized keys / queries). Returns [Td, G, NBP] fp32 with Td = n_rows *
    decode_query_len; entry [t, g, b] is valid for b <= pos(t) // ps (other entries are unwritten).
    NaN block scores become -1e30. pdl: the next kernel is launched with programmatic dependent
    launch (signal it early; GPU only).
    """
    keys, kscales, qfp8 = split_index_cache(index_cache_l)
    _, g, di = iq.shape
    ps = keys.shape[1]
    dql = meta.decode_query_len
    nbp = meta.block_tables.shape[1]
    td = n_rows * dql
    scores = torch.empty(td, g, nbp, dtype=torch.float32, device=iq.device)
    if td == 0:
        return scores
    bps = blocks_per_split or default_score_blocks(nbp, n_rows)
    num_warps = num_warps or (8 if bps == 1 else 4)
    gp = next_pow2(g)
    qp = max(next_pow2(dql), triton.cdiv(16, gp))
    ieee = iq.dtype == torch.float32 and not qfp8
    _decode_scores_kernel[(n_rows, triton.cdiv(nbp, bps))](
        iq,
        keys,
        keys if kscales is None else kscales,
        meta.block_tables,
        meta.positions,
        scores,
        dql,
        bps,
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
        QP=qp,
        DI=di,
        PS=ps,
        KSCALE=kscales is not None,
        QFP8=qfp8,
        PDL=pdl,
        num_warps=num_warps,
        num_stages=1 if ieee else num_stages,
    )
    return scores


def decode_select_attend(
    q: torch.Tensor,
    k_cache_l: torch.Tensor,
    v_cache_l: torch.Tensor,
    meta: PagedMetadata,
    scale: float,
    topk: int,
    *,
    scores: torch.Tensor | None = None,
    topk_ids: torch.Tensor | None = None,
    cands: tuple[torch.Tensor, int] | None = None,
    init_blocks: int = 0,
    local_blocks: int = 1,
    ids_out: torch.Tensor | None = None,
    splits: int | None = None,
    num_warps: int = 8,
    num_stages: int = 2,
    pdl: bool = False,
) -> torch.Tensor:
    """Top-k selection in registers (or given block ids), then sparse attention (K2; spec §3.5).

    q: [T, nh, d] with the Td decode tokens first; k_cache_l, v_cache_l: [P, G, ps, d]. Exactly
    one selection source: scores [Td, G, NBP] fp32 from ``decode_scores`` (NBP <=
    MAX_FUSED_BLOCKS), topk_ids [Td, G, K] int32 (-1 = empty), or cands = (candidate keys
    [Td, G, S, KP] int64, blocks per split) from ``msa_score_topk.decode_score_topk`` with the same
    topk / init_blocks / local_blocks, or from ``msa_index_topk.topk_chunk_keys`` (lists of chunk
    blocks; merged in the kernel's prologue). ids_out: optional
    [Td, G, K] int32 or int16 (unit stride over K) that receives the selection from scores or
    cands in the reference's order, -1 padding.
    pdl: launch with programmatic dependent launch (GPU only; the kernel waits for the previous
    kernel before reading its inputs). Returns [Td, nh, d] in q.dtype.
    """
    if sum(x is not None for x in (scores, topk_ids, cands)) != 1:
        raise ValueError("decode_select_attend: pass exactly one of scores / topk_ids / cands")
    td = (scores if scores is not None else topk_ids if topk_ids is not None else cands[0]).shape[0]
    _, nh, d = q.shape
    _, g, ps, _ = k_cache_l.shape
    out = torch.empty(td, nh, d, dtype=q.dtype, device=q.device)
    if td == 0:
        return out
    rh = nh // g
    rhp = max(next_pow2(rh), 16)
    s = splits or default_splits(td, g, topk)
    per = triton.cdiv(topk, s)
    kp = next_pow2(topk)
    n_splits, c_blocks, ncand = 1, 1, 16
    if topk_ids is not None:
        mode, nbc, srcs, ids = (
            0,
            16,
            torch.empty(1, 1, 1, dtype=torch.float32, device=q.device),
            topk_ids.to(torch.int32),
        )
    else:
        ids = ids_out if ids_out is not None else torch.empty(1, 1, 1, dtype=torch.int32, device=q.device)
        if ids_out is not None and (ids_out.stride(2) != 1 or ids_out.dtype not in (torch.int16, torch.int32)):
            raise ValueError("decode_select_attend: ids_out must be int16 / int32 with unit stride over K")
    if cands is not None:
        srcs, c_blocks = cands
        mode, nbc, n_splits = 2, kp, srcs.shape[2]
        ncand = next_pow2(n_splits) * kp
        if srcs.dtype != torch.int64 or srcs.shape[3] != kp or srcs.stride(3) != 1 or srcs.stride(2) != kp:
            raise ValueError(
                f"decode_select_attend: cands {srcs.dtype} {tuple(srcs.shape)} strides {srcs.stride()}; need "
                f"int64 [Td, G, S, {kp}] with contiguous lists (msa_score_topk.decode_score_topk or "
                "msa_index_topk.topk_chunk_keys)"
            )
    elif scores is not None:
        mode, srcs, nbc = 1, scores, max(next_pow2(scores.shape[2]), 16)
        if nbc > MAX_FUSED_BLOCKS:
            raise ValueError(
                f"decode_select_attend: block-table width {scores.shape[2]} > {MAX_FUSED_BLOCKS}; "
                "pass topk_ids from index_topk instead"
            )
    if s > 1:
        opart = torch.empty(td * g * s * rhp * d, dtype=torch.float32, device=q.device)
        lse = torch.empty(td * g * s * rhp, dtype=torch.float32, device=q.device)
        cnt = arrival_counters(td * g, q.device)
    else:
        opart = lse = cnt = out
    ieee = q.dtype == torch.float32
    _decode_select_attend_kernel[(td, g, s)](
        q,
        k_cache_l,
        v_cache_l,
        meta.block_tables,
        meta.positions,
        srcs,
        ids,
        out,
        opart,
        lse,
        cnt,
        float(scale) * LOG2E,
        meta.decode_query_len,
        topk,
        init_blocks,
        local_blocks,
        per,
        n_splits,
        c_blocks,
        q.stride(0),
        q.stride(1),
        k_cache_l.stride(0),
        k_cache_l.stride(1),
        k_cache_l.stride(2),
        meta.block_tables.stride(0),
        srcs.stride(0),
        srcs.stride(1),
        ids.stride(0),
        ids.stride(1),
        out.stride(0),
        out.stride(1),
        RH=rh,
        RHP=rhp,
        D=d,
        PS=ps,
        NBC=nbc,
        RC=min(RANK_CHUNK, nbc),
        KP=kp,
        MODE=mode,
        WRITE_IDS=mode != 0 and ids_out is not None,
        S=s,
        IEEE=ieee,
        PDL=pdl,
        NCAND=ncand,
        MERGE_NET=msa_score_topk.MERGE_NETWORK and kp >= 2,
        num_warps=num_warps,
        num_stages=1 if ieee else num_stages,
        **({"launch_pdl": True} if pdl else {}),
    )
    return out


def check_decode_inputs(q, iq, k_cache_l, v_cache_l, index_cache_l, topk: int) -> None:
    """Raise ValueError naming the field for inputs the fused decode kernels do not support
    (index_cache_l: a [P, ps, di] tensor or an ``FP8IndexCache``)."""
    index_cache_l, kscales, _ = split_index_cache(index_cache_l)
    _, nh, d = q.shape
    _, g, ps, dk = k_cache_l.shape
    dt = q.dtype
    if (
        dt not in (torch.float32, torch.float16, torch.bfloat16)
        or any(x.dtype != dt for x in (iq, k_cache_l, v_cache_l))
        or (kscales is None and index_cache_l.dtype != dt)
    ):
        raise ValueError(
            f"msa decode: dtypes q={q.dtype}, iq={iq.dtype}, k={k_cache_l.dtype}, v={v_cache_l.dtype}, "
            f"index cache={index_cache_l.dtype}; fp32/fp16/bf16 with equal dtypes are supported (index keys "
            "also as an FP8IndexCache)"
        )
    check_pow2_dim("head_dim", d)
    check_pow2_dim("page_size (sparse_block_size)", ps)
    check_pow2_dim("sparse_index_dim", iq.shape[2])
    if dk != d or v_cache_l.shape != k_cache_l.shape or index_cache_l.shape[1:] != (ps, iq.shape[2]):
        raise ValueError(
            f"msa decode: shapes q {tuple(q.shape)}, k/v {tuple(k_cache_l.shape)}/{tuple(v_cache_l.shape)}, "
            f"iq {tuple(iq.shape)}, index cache {tuple(index_cache_l.shape)} do not match"
        )
    if nh % g or iq.shape[1] != g:
        raise ValueError(
            f"msa decode: {nh} q heads / {g} KV heads / {iq.shape[1]} index heads; need nh % G == 0 "
            "and one index head per KV head"
        )
    if not 1 <= topk <= MAX_TOPK:
        raise ValueError(f"msa decode: topk={topk} unsupported; 1..{MAX_TOPK}")
    if (
        k_cache_l.stride()[1:] != (ps * d, d, 1)
        or k_cache_l.stride() != v_cache_l.stride()
        or q.stride(2) != 1
        or iq.stride(2) != 1
        or index_cache_l.stride(2) != 1
    ):
        raise ValueError("msa decode: caches need the paged_cache.py layout and q/iq a contiguous last dim")


def msa_decode(
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
    ids_out: torch.Tensor | None = None,
    decode_path: str | None = None,
) -> torch.Tensor:
    """Sparse-layer output of the decode tokens (rows 0..num_decodes-1) of ``meta`` (spec §3.4-3.5).

    q: [T, nh, d], iq: [T, G, di] (decode tokens first; only the first num_decodes *
    decode_query_len are read); caches in the paged_cache.py layout (index keys: a tensor or an
    ``FP8IndexCache``). The paths (``select_decode_path``): "rank" (block tables
    narrower than SCORE_TOPK_MIN_BLOCKS: scores; top-k in registers + attention + merge),
    "score_topk" (scores with a partial top-k per program; candidate merge + attention + merge);
    "index_topk" (wider tables by default, LONG_DECODE_PATH: ``msa_index_topk`` block scores and
    chunk top-k on the decode rows, then the candidate merge + attention + merge launch;
    three launches). decode_path: None (by width) or one of DECODE_PATHS.
    ids_out: optional [Td, G, K] int32 / int16 receiving the selection (see decode_select_attend).
    Returns [Td, nh, d] in q.dtype. Raises ValueError for an unknown path or "rank" on a table
    wider than MAX_FUSED_BLOCKS.
    """
    check_decode_inputs(q, iq, k_cache_l, v_cache_l, index_cache_l, topk)
    if ids_out is not None and (ids_out.dtype not in (torch.int16, torch.int32) or ids_out.stride(2) != 1):
        raise ValueError("msa_decode: ids_out must be int16 / int32 with unit stride over K")  # every route
    nd = meta.num_decodes
    td = nd * meta.decode_query_len
    pdl = q.is_cuda and PDL
    path = select_decode_path(meta.block_tables.shape[1], decode_path)
    if path == "score_topk":
        cands = decode_score_topk(iq, index_cache_l, meta, nd, topk, init_blocks, local_blocks, pdl=pdl)
        return decode_select_attend(q, k_cache_l, v_cache_l, meta, scale, topk, cands=cands, ids_out=ids_out, pdl=pdl)
    if path == "rank":
        scores = decode_scores(iq, index_cache_l, meta, nd, pdl=pdl)
        return decode_select_attend(
            q,
            k_cache_l,
            v_cache_l,
            meta,
            scale,
            topk,
            scores=scores,
            init_blocks=init_blocks,
            local_blocks=local_blocks,
            ids_out=ids_out,
            pdl=pdl,
        )
    from m3_kernels.msa_index_topk import index_block_scores, index_topk, topk_chunk_keys, topk_chunk_size

    dmeta = decode_part(meta)
    nbp = meta.block_tables.shape[1]
    chunk = topk_chunk_size(td * iq.shape[1], nbp)
    n_cand = next_pow2(triton.cdiv(nbp, chunk)) * next_pow2(topk)  # K2's NCAND for these chunk lists
    if INDEX_TOPK_MERGE_IN_ATTENTION and n_cand <= msa_score_topk.MAX_MERGE_CANDIDATES:
        # scores, chunk winners; their merge in K2's prologue (wider tables: index_topk's merge launch)
        chain, k2 = index_topk_chain(index_format(index_cache_l)) if pdl else ("off", False)
        scores = index_block_scores(iq[:td], index_cache_l, dmeta, pdl=chain == "start")
        ps = k_cache_l.shape[2]
        cands = topk_chunk_keys(
            scores, dmeta, topk, ps, init_blocks, local_blocks, chunk, pdl=chain != "off", trigger=k2
        )
        return decode_select_attend(q, k_cache_l, v_cache_l, meta, scale, topk, cands=cands, ids_out=ids_out, pdl=pdl)
    ids = index_topk(iq[:td], index_cache_l, dmeta, topk, init_blocks, local_blocks)
    if ids_out is not None:
        ids_out.copy_(ids)
    return decode_select_attend(q, k_cache_l, v_cache_l, meta, scale, topk, topk_ids=ids, pdl=pdl)


def select_decode_path(nbp: int, decode_path: str | None = None) -> str:
    """The decode path for a block table of ``nbp`` pages: ``decode_path`` when given (checked),
    else "rank" below SCORE_TOPK_MIN_BLOCKS (and within MAX_FUSED_BLOCKS), LONG_DECODE_PATH from there.
    Raises ValueError for a path not in DECODE_PATHS or "rank" on a table wider than MAX_FUSED_BLOCKS."""
    if decode_path is None:
        return "rank" if nbp < SCORE_TOPK_MIN_BLOCKS and nbp <= MAX_FUSED_BLOCKS else LONG_DECODE_PATH
    if decode_path not in DECODE_PATHS:
        raise ValueError(f"msa decode: decode_path={decode_path!r}; one of {DECODE_PATHS} or None")
    if decode_path == "rank" and nbp > MAX_FUSED_BLOCKS:
        raise ValueError(f"msa decode: decode_path='rank' needs a block table <= {MAX_FUSED_BLOCKS} pages, got {nbp}")
    return decode_path


def decode_part(meta: PagedMetadata) -> PagedMetadata:
    """Metadata of the decode rows only (device slices, no host sync; max_seq_len kept as a bound)."""
    nd, td = meta.num_decodes, meta.num_decodes * meta.decode_query_len
    return PagedMetadata(
        meta.positions[:td],
        meta.slot_mapping[:td],
        meta.block_tables[:nd],
        meta.context_lens[:nd],
        meta.seq_lens[:nd],
        meta.query_start_loc[: nd + 1],
        nd,
        meta.decode_query_len,
        meta.decode_query_len,
        meta.max_seq_len,
    )


def prefill_part(meta: PagedMetadata) -> PagedMetadata:
    """Metadata of the prefill rows only, tokens rebased to 0 (device ops, no host sync)."""
    nd, td = meta.num_decodes, meta.num_decodes * meta.decode_query_len
    qsl = meta.query_start_loc
    return PagedMetadata(
        meta.positions[td:],
        meta.slot_mapping[td:],
        meta.block_tables[nd:],
        meta.context_lens[nd:],
        meta.seq_lens[nd:],
        qsl[nd:] - qsl[nd],
        0,
        meta.decode_query_len,
        meta.max_query_len,
        meta.max_seq_len,
    )


def msa_attention(
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
    decode_path: str | None = None,
) -> torch.Tensor:
    """Triton sparse-layer attention of a whole step (the engine's ``PagedOps.msa_attention`` on CUDA;
    ``m3_rollout.engine.reference_ops.msa_attention_ref`` is the PyTorch version).

    q: [T, nh, d]; iq: [T, G, di]; k_cache_l, v_cache_l: [P, G, ps, d]; index_cache_l: [P, ps, di]
    or an ``FP8IndexCache`` (already holding this step's keys); meta: ``PagedMetadata`` (decode rows first).
    Decode rows -> ``msa_decode``; prefill rows -> ``msa_index_topk.index_topk`` +
    ``msa_paged_attention.paged_attention`` on the prefill part of ``meta``. Returns [T, nh, d]
    in q.dtype. Raises ValueError for unsupported sizes or dtypes (naming the field).

    sel_out: optional [T, G, K] integer tensor (int16 / int32, unit stride over K; the engine's
    block-selection record) that receives the selection in ``index_topk_ref``'s order: the fused
    decode kernel stores its in-register choice there (no extra launch, CUDA-graph safe; every
    decode path, except index_topk rows with more chunk keys than MAX_MERGE_CANDIDATES, which copy
    ``index_topk``'s ids); prefill rows copy the ``index_topk`` result in. decode_path: the decode
    rows' path (``msa_decode``; None = by width).
    scratch: the KV-major prefill's buffer, handed to ``paged_attention`` (its ``scratch``; the
    engine binds its own, kernels/paged_layout.py); decode rows never touch it.
    """
    # NOTE: imported at call time so the interpreter tests' reloaded modules (msa_interpret) are used.
    from m3_kernels.msa_index_topk import index_topk
    from m3_kernels.msa_paged_attention import paged_attention

    nd, r = meta.num_decodes, meta.num_rows
    if nd == 0 or q.shape[0] == 0:
        ids = index_topk(iq, index_cache_l, meta, topk, init_blocks, local_blocks)
        if sel_out is not None:
            sel_out.copy_(ids)
        return paged_attention(q, k_cache_l, v_cache_l, meta, scale, ids, scratch=scratch)
    td = nd * meta.decode_query_len
    dec = msa_decode(
        q,
        iq,
        k_cache_l,
        v_cache_l,
        index_cache_l,
        meta,
        scale,
        topk,
        init_blocks,
        local_blocks,
        ids_out=None if sel_out is None else sel_out[:td],
        decode_path=decode_path,
    )
    if nd == r:
        return dec
    pmeta = prefill_part(meta)
    ids = index_topk(iq[td:], index_cache_l, pmeta, topk, init_blocks, local_blocks)
    if sel_out is not None:
        sel_out[td:].copy_(ids)
    pre = paged_attention(q[td:], k_cache_l, v_cache_l, pmeta, scale, ids, scratch=scratch)
    return torch.cat([dec, pre])

"""Long-context MSA decode: index block scores fused with a partial top-k per program, merged in the attention kernel.

Which path is this: the block choice of the sparse layers' DECODE rows for block tables of at least
``msa_fused_decode.SCORE_TOPK_MIN_BLOCKS`` pages (long contexts, the "score_topk" path; issue 23).
``msa_fused_decode.msa_decode`` runs it as two launches (chained by programmatic dependent launch
on CUDA, as the short-context path):
- ``_decode_score_topk_kernel`` (here): one program per (decode row, block split) scores its
  slice of the row's causal blocks for all the row's tokens x G index heads (block max of
  q_index . k_index, spec §3.4) and keeps, per (token, head), the top-K of its slice as K int64
  selection keys in registers; only those K keys per program reach memory;
- ``msa_fused_decode._decode_select_attend_kernel`` (MODE 2): each (token, KV head, split) program
  merges the n_splits x K candidate keys of its (token, head) in its prologue (``merge_candidates``:
  one top-K bitonic network over at most MAX_MERGE_CANDIDATES keys), then attends and merges the
  splits as in the short-context path. The "index_topk" decode path hands the same kernel the
  chunk winners of ``msa_index_topk.topk_chunk_keys`` (one list per chunk of blocks).

Why a partial top-K per program: at 1M context (8,192 blocks of 128) the step was bound by
reading the index keys (268 MB bf16, 134 MB + 4 MB scales FP8) plus a separate top-k pass of two
launches (chunk winners + merge, ~10 us on the H200, mostly serial max-and-remove rounds and
launch gaps, not bytes): with the score pass at the bytes floor that pass alone capped the FP8
step near 9.6x dense. A program's top-K over its slice contains every block of the row's global
top-K that lies in the slice (exact, no approximation), so the global top-K is the top-K of the
union of the per-program lists; the per-block list update (one compare, one select and one K-wide
min per block and row) runs while the next pages are in flight, so the score pass stays memory
bound and the separate top-k launches disappear.

Selection keys (one int64 per candidate, ``pack_block_keys``): high 32 bits the order-preserving
integer of the fp32 key score (+inf for forced local/init blocks, -0.0 folded into +0.0), low 32
bits 0x7FFFFFFF - block id, so "score desc, ties to the lower block id" is an integer max and
every key of a row is distinct. The order, forced blocks and -1 padding equal
``m3_rollout.engine.reference_ops.index_topk_ref`` (and ``msa_index_topk.index_topk``) exactly
when the block scores are equal bitwise. NaN block maxima become -1e30 (after the query scale of
quantized queries, as the reference scores dequantized queries).
Per-program list: K slots start as distinct sentinels EMPTY + j (below every real key); a block's
key replaces the list minimum iff it is larger (blocks arrive in id order, so an equal score loses
the tie, as it must), then the minimum is recomputed: the list is always the top-K of the blocks
seen. Non-candidate blocks (past a token's position) get key EMPTY and never enter. Sentinels are
stored as EMPTY; the merge maps EMPTY to block -1.

Candidate scratch: ``[Td, G, S, KP]`` int64 (S splits per row, KP = next_pow2(K)), i.e.
Td x G x S x KP x 8 bytes: 1M context, one sequence, M3 shapes (G 4, K 16, S 256): 128 KiB
(the score scratch it replaces: Td x G x NBP x 4 = 128 KiB; the bytes were never the cost).
S per row: the largest power of two <= min(SCORE_TOPK_PROGRAMS / rows, MAX_MERGE_CANDIDATES / KP,
NBP / SCORE_TOPK_MIN_SPLIT_BLOCKS) (a function of the batch shape only: CUDA-graph safe).
Programs past a row's last causal block exit without writing; the merge masks their lists.

Expected cost model (an estimate, not a measurement; ``scripts/bench_msa.py`` measures it): one
step = score pass + merge + attention. Score pass = index-key bytes / achieved bandwidth + one list
store (1M context: 268 MB bf16 keys -> ~65 us at the 4.1 TB/s the previous bf16 score kernel
reached on the H200; 134 MB FP8 codes + 4 MB scales -> ~60 us at the ~2.3 TB/s the previous FP8
score kernel reached, ~33 us at 4.1 TB/s). Merge: K rounds of max-and-remove over S x KP = 4,096
keys in each attention program, ~1-2 us, replacing the ~10 us of top-k launches. Attention +
split merge: ~9 us as before. Against dense cuDNN at 1M (~480 us): bf16 ~75 us (~6.4x, target 6x);
FP8 ~70 us (~6.9x) at today's FP8 score bandwidth and ~43 us (~11x, target 10x) only if the FP8
score pass also reaches ~4 TB/s (per page it converts the e4m3 keys to the query dtype for the dot:
the likely limit). Knobs for the measurement: ``splits``, ``num_warps``, ``num_stages`` of
``decode_score_topk`` (``bench_msa.py --topk-sweep``).

Shape legend: Td decode tokens, G index heads (= KV heads), di index dim, ps page (= block) size,
K top-k, KP next_pow2(K), NBP block-table width, S splits (programs) per row, M = QP x GP rows of a
program (dql tokens x G heads, padded).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from m3_kernels.msa_checks import next_pow2
from m3_kernels.msa_fp8 import index_dot, quantize_rows_e4m3, split_index_cache
from m3_kernels.paged_layout import FP8IndexCache, PagedMetadata

SCORE_TOPK_PROGRAMS = 256  # target score programs per launch (~2 per H200 SM); tune with bench_msa.py --topk-sweep
SCORE_TOPK_MIN_SPLIT_BLOCKS = 8  # fewest blocks per score program (below: more programs than bytes to read)
MAX_MERGE_CANDIDATES = 4096  # candidate keys one merge program reads per (token, head): S x KP
# The candidate merge (``merge_candidates``) as one tl.topk network (False: topk rounds of max-and-remove,
# kept for the A/B of bench_msa.py); K = 1 always takes the round (tl.topk(x, 1) fails to build).
MERGE_NETWORK = True
EMPTY_KEY = -(2**63)  # below every real key (the key of a -inf score is > EMPTY_KEY + 2**32)

_EMPTY = tl.constexpr(EMPTY_KEY)
_MAX_KEY = tl.constexpr(2**63 - 1)


@triton.jit
def pack_block_keys(score, b):
    """int64 selection keys of fp32 ``score`` (any shape, no NaN) and block ids ``b`` (int32, same
    shape or broadcast): score desc, ties to the lower id, as one integer order."""
    bits = (score + 0.0).to(tl.int32, bitcast=True)  # + 0.0 turns -0.0 into +0.0 (equal in the reference)
    bits = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # order-preserving float -> signed int
    low = (0x7FFFFFFF - b) + tl.zeros_like(bits)  # b may be a Python int (interpreter loop variable)
    return (bits.to(tl.int64) << 32) | low.to(tl.int64)


@triton.jit
def key_block_id(key):
    """Block id of a selection key; -1 for EMPTY."""
    bid = 0x7FFFFFFF - (key & 0xFFFFFFFF).to(tl.int32)
    return tl.where(key == _EMPTY, -1, bid)


@triton.jit
def merge_candidates(
    crow_ptr, n_splits, blocks_per_split, n_blk, topk, NC: tl.constexpr, KP: tl.constexpr, NET: tl.constexpr = False
):
    """[KP] int32 top-k block ids of one (token, head) from its per-program candidate lists.

    crow_ptr: the row's candidates [S, KP] int64 (contiguous); list s is read iff s < n_splits and
    s * blocks_per_split < n_blk (its program had blocks of this token), slot j iff j < topk.
    NC = next_pow2(S) * KP. Slot e < min(topk, n_blk) holds the e-th largest key's block id, the
    rest -1 (``index_topk_ref``'s order and padding). NET (2 <= KP <= NC): one ``tl.topk`` bitonic
    network instead of topk rounds of max-and-remove (the keys are distinct: the same ids).
    """
    offs = tl.arange(0, NC)
    sp = offs // KP
    ok = (sp < n_splits) & (sp * blocks_per_split < n_blk) & (offs % KP < topk)
    key = tl.load(crow_ptr + offs, mask=ok, other=_EMPTY)
    offs_k = tl.arange(0, KP)
    if NET:
        return tl.where(offs_k < tl.minimum(topk, n_blk), key_block_id(tl.topk(key, KP)), -1)
    sel = tl.full([KP], -1, tl.int32)
    for e in range(tl.minimum(topk, n_blk)):
        best = tl.max(key, axis=0)
        key = tl.where(key == best, _EMPTY, key)  # keys are distinct: removes one (or all EMPTY)
        sel = tl.where(offs_k == e, key_block_id(best), sel)
    return sel


@triton.jit
def _decode_score_topk_kernel(
    iq_ptr,
    ik_ptr,
    iks_ptr,
    bt_ptr,
    pos_ptr,
    cand_ptr,
    dql,
    blocks_per_split,
    topk,
    init_blocks,
    local_blocks,
    stride_iq_t,
    stride_iq_g,
    stride_ik_p,
    stride_ik_o,
    stride_iks_p,
    stride_bt_r,
    stride_c_t,
    stride_c_g,
    G: tl.constexpr,
    GP: tl.constexpr,
    QP: tl.constexpr,
    DI: tl.constexpr,
    PS: tl.constexpr,
    KP: tl.constexpr,
    KSCALE: tl.constexpr,
    QFP8: tl.constexpr,
    PDL: tl.constexpr,
):
    """Block-max index scores of one decode row's dql tokens x G heads over one split of blocks,
    reduced to each (token, head)'s top-``topk`` selection keys of the split (module docstring).

    KSCALE: FP8 keys with per-token scales (iks_ptr); QFP8: queries quantized to e4m3 here, one
    scale per (token, head) row applied to its block maxima (kernels/paged_layout.py format).
    Writes cand[tok, head, split, :topk] (EMPTY where the split has fewer candidate blocks).
    """
    if PDL:  # let the attention kernel (launched with PDL) get scheduled now; it waits for our stores
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)  # int64 offsets (tok * stride_iq_t, tok * stride_c_t)
    split = tl.program_id(1)
    offs_m = tl.arange(0, QP * GP)  # m = token m // GP, head m % GP
    tok_i = offs_m // GP
    head = offs_m % GP
    m_ok = (tok_i < dql) & (head < G)
    tok = row * dql + tok_i
    qpos = tl.load(pos_ptr + tok, mask=m_ok, other=-1)  # [M]
    n_blk = tl.max(qpos, axis=0) // PS + 1
    b_lo = split * blocks_per_split
    if b_lo >= n_blk:  # past the row's blocks: the merge does not read this list
        return
    b_hi = tl.minimum(b_lo + blocks_per_split, n_blk)
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
    n_cand = tl.where(m_ok, qpos // PS + 1, 0)  # [M] candidate blocks of each (token, head)
    offs_k = tl.arange(0, KP)
    # slots >= topk hold the largest key (never the minimum); the others distinct sentinels
    lst = tl.zeros([QP * GP, KP], tl.int64) + tl.where(offs_k < topk, _EMPTY + offs_k.to(tl.int64), _MAX_KEY)[None, :]
    lo = tl.min(lst, axis=1)  # [M] the list minimum
    for b in range(b_lo, b_hi):
        page = tl.load(bt_ptr + row * stride_bt_r + b)
        k = tl.load(ik_ptr + page.to(tl.int64) * stride_ik_p + offs_o[:, None] * stride_ik_o + offs_d[None, :])
        s = index_dot(q, k)  # [M, PS] fp32
        if KSCALE:
            s = s * tl.load(iks_ptr + page.to(tl.int64) * stride_iks_p + offs_o)[None, :]
        s = tl.where((b * PS + offs_o)[None, :] <= qpos[:, None], s, float("-inf"))
        smax = tl.max(s, axis=1)
        has_nan = tl.max(tl.where(s != s, 1, 0), axis=1) > 0
        if QFP8:
            smax = smax * q_scale
        smax = tl.where(has_nan, -1e30, smax)  # the reference's amax propagates NaN -> -1e30 (spec §3.4)
        forced = (b >= n_cand - local_blocks) | (b < init_blocks)
        key = pack_block_keys(tl.where(forced, float("inf"), smax), b)
        key = tl.where(b < n_cand, key, _EMPTY)  # [M]
        ins = key > lo
        lst = tl.where((lst == lo[:, None]) & ins[:, None], key[:, None], lst)
        lo = tl.min(lst, axis=1)
    out = tl.where(lst < _EMPTY + KP, _EMPTY, lst)  # sentinels -> EMPTY
    c_ptrs = cand_ptr + tok[:, None] * stride_c_t + head[:, None] * stride_c_g + split * KP + offs_k[None, :]
    tl.store(c_ptrs, out, mask=m_ok[:, None] & (offs_k < topk)[None, :])


def score_topk_splits(nbp: int, n_rows: int, topk: int) -> int:
    """Score programs (block splits) per decode row: the largest power of two <= min(SCORE_TOPK_PROGRAMS /
    n_rows, MAX_MERGE_CANDIDATES / next_pow2(topk), ceil(nbp / SCORE_TOPK_MIN_SPLIT_BLOCKS)), at least 1.
    Depends on the batch shape only (graph-safe). 1M context, one row, K 16: 256 splits of 32 blocks."""
    cap = min(
        SCORE_TOPK_PROGRAMS // max(n_rows, 1),
        MAX_MERGE_CANDIDATES // next_pow2(topk),
        triton.cdiv(nbp, SCORE_TOPK_MIN_SPLIT_BLOCKS),
    )
    s = 1
    while s * 2 <= cap:
        s *= 2
    return s


def decode_score_topk(
    iq: torch.Tensor,
    index_cache_l: torch.Tensor | FP8IndexCache,
    meta: PagedMetadata,
    n_rows: int,
    topk: int,
    init_blocks: int = 0,
    local_blocks: int = 1,
    *,
    splits: int | None = None,
    num_warps: int = 4,
    num_stages: int = 3,
    pdl: bool = False,
) -> tuple[torch.Tensor, int]:
    """Per-split top-k selection keys of the first ``n_rows`` decode rows (score pass of the long-context path).

    iq: [T, G, di] (the decode tokens first); index_cache_l: [P, ps, di] or an ``FP8IndexCache``.
    splits: block splits per row (default ``score_topk_splits``; next_pow2(splits) x next_pow2(topk)
    must be <= MAX_MERGE_CANDIDATES). pdl: the next kernel is launched with programmatic dependent
    launch (GPU only). Returns (cand, blocks_per_split): cand [Td, G, S, KP] int64 with Td = n_rows x
    decode_query_len; cand[t, g, s, :topk] are the top-k keys (``pack_block_keys``; EMPTY_KEY
    padding, unsorted) of blocks [s x blocks_per_split, (s + 1) x blocks_per_split) for lists whose
    first block is causal for the row (others unwritten). Raises ValueError for a too large split count.
    """
    keys, kscales, qfp8 = split_index_cache(index_cache_l)
    _, g, di = iq.shape
    ps = keys.shape[1]
    dql = meta.decode_query_len
    nbp = meta.block_tables.shape[1]
    kp = next_pow2(topk)
    s = splits or score_topk_splits(nbp, n_rows, topk)
    bps = triton.cdiv(nbp, s)
    s = triton.cdiv(nbp, bps)
    if next_pow2(s) * kp > MAX_MERGE_CANDIDATES:
        raise ValueError(
            f"decode_score_topk: {s} splits x {kp} keys > MAX_MERGE_CANDIDATES={MAX_MERGE_CANDIDATES} per (token, head)"
        )
    td = n_rows * dql
    cand = torch.empty(td, g, s, kp, dtype=torch.int64, device=iq.device)
    if td == 0:
        return cand, bps
    gp = next_pow2(g)
    qp = max(next_pow2(dql), triton.cdiv(16, gp))
    ieee = iq.dtype == torch.float32 and not qfp8
    _decode_score_topk_kernel[(n_rows, s)](
        iq,
        keys,
        keys if kscales is None else kscales,
        meta.block_tables,
        meta.positions,
        cand,
        dql,
        bps,
        topk,
        init_blocks,
        local_blocks,
        iq.stride(0),
        iq.stride(1),
        keys.stride(0),
        keys.stride(1),
        0 if kscales is None else kscales.stride(0),
        meta.block_tables.stride(0),
        cand.stride(0),
        cand.stride(1),
        G=g,
        GP=gp,
        QP=qp,
        DI=di,
        PS=ps,
        KP=kp,
        KSCALE=kscales is not None,
        QFP8=qfp8,
        PDL=pdl,
        num_warps=num_warps,
        num_stages=1 if ieee else num_stages,
    )
    return cand, bps


def candidate_block_ids(cand: torch.Tensor, blocks_per_split: int, positions: torch.Tensor, page_size: int, topk: int):
    """PyTorch merge of ``decode_score_topk`` output (tests and debugging; the kernels merge in
    ``merge_candidates``): [Td, G, topk] int32 block ids in the selection order, -1 padding.
    positions: [Td] decode-token positions (lists past a token's last causal block are ignored)."""
    td, g, s, _ = cand.shape
    n_blk = (positions[:td].long() // page_size + 1)[:, None, None, None]  # [Td, 1, 1, 1]
    first = torch.arange(s, device=cand.device)[None, None, :, None] * blocks_per_split
    keys = torch.where(first < n_blk, cand[..., :topk], EMPTY_KEY).reshape(td, g, -1)
    best = keys.sort(-1, descending=True).values[..., :topk]
    ids = (0x7FFFFFFF - (best & 0xFFFFFFFF)).to(torch.int32)
    ids = torch.where(best == EMPTY_KEY, -1, ids)
    if ids.shape[-1] < topk:
        ids = torch.nn.functional.pad(ids, (0, topk - ids.shape[-1]), value=-1)
    return ids

"""Triton lightning-indexer block scores and top-k block selection over the paged index-key cache.

Governing idea (spec §3.4, §4.3): one kernel writes the block-max score of every causal block for
every (query token, index head) into a scratch ``[T, G, NBP]`` fp32 buffer; a selection kernel
then packs (score, block id) into one order-preserving int64 key per block and picks the top K
(one ``tl.topk`` bitonic network per chunk, ``TOPK_NETWORK``; or K rounds of max-and-remove), so
"score desc, ties to the lower block id" is a plain integer order.
Forced local/init blocks get score +inf (ties among them again go to the lower id), exactly the
order of ``m3_rollout.engine.reference_ops.index_topk_ref``. Long rows are split into chunks (split-K): each chunk
keeps its own top K keys, a merge kernel picks the final K from the chunk winners. Prefill-sized
batches (one chunk per row) run ``_topk_rows_kernel`` instead: 32-bit keys (the order-preserving
score bits alone) and two 32-bit reductions per pick (max key, then the lowest block id holding
it; the same order), over a key tile sized on the device to the rows' causal candidates (a causal
prefill's early tokens scan 1/8 of the table; H200 at 128K: 5.0 -> 2.5 ms).

Scoring tiles ``BLOCK_M`` query tokens x all G index heads against one page of keys per step
(the single index-key head is shared by all index heads, MQA style), so prefill runs real
``[BLOCK_M*G, di] x [di, ps]`` tensor-core tiles; decode rows split their blocks over
``n_splits`` programs. Prefill on the GPU (``PREFILL_SCORE_CONFIG``): blocks wholly before the
tile's first token skip the causal mask, and a 128-register cap lets two programs share an SM so
one's tensor-core work overlaps the other's block-max reductions; FP8 keys are read through TMA
in 64-token tiles, and FP8 queries are quantized before the launch so the dot reads them from
shared memory (``PREFILL_SCORE_FORMAT``). Prefill top-k runs TOPK_ROWS
(token, head) rows per program.

CUDA-graph safety: grids depend only on (rows, tokens, block-table width, decode_query_len,
max_query_len); per-row lengths are read on the device; no host syncs.
NOTE: fp32 inputs use ``input_precision="ieee"`` (no tf32), so fp32 scores match the reference to
fp32 summation order; bf16/fp16 inputs run bf16/fp16 tensor-core dots with fp32 accumulation.

Shape legend: T query tokens, R rows, P pages, ps page (= block) size, G index heads (= KV heads),
di index dim, K top-k blocks, NBP block-table width (pages per row), NCH chunks per row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from m3_kernels.msa_checks import check_pow2_dim, check_pow2_knob, next_pow2
from m3_kernels.msa_fp8 import index_dot, index_format, quantize_rows, quantize_rows_e4m3, split_index_cache
from m3_kernels.paged_layout import PagedMetadata

# Sentinel key: below every real key (the key of a -inf score is > INT64_MIN).
_KEY_EMPTY = -(2**63)
_ID_BIAS = 0x7FFFFFFF  # low 32 bits hold _ID_BIAS - block_id, so lower ids win ties
MAX_TOPK = 64
TOPK_CHUNK = 256  # blocks per selection chunk (split-K of the top-k)
# Prefill score kernel on the GPU: unmasked loop over blocks before the tile, masked diagonal; a
# 128-register cap gives 2 programs per SM (H200: 33 -> 16 ms at 128K, docs/benchmarks.md). Key
# sub-tiles per page (nsub; bf16: two 64-key sub-tiles keep the score tile in registers, 16.3 -> 15.2
# ms), key reads and tile size: per format, PREFILL_SCORE_FORMAT.
PREFILL_SCORE_CONFIG = {"split_causal": True, "maxnreg": 128}
# Per index-key format: page ids of the prefill score loop's unmasked blocks read as vectors of this
# many blocks (0: one load per block in the loop). H200 2026-12-04, 128K: fp8q 18.5-18.7 -> 15.4-15.5
# ms with 32 (64 / 128: 17.7), same bits; bf16 15.1-15.9 -> 16.5-16.7 with 32 (slower, kept off);
# fp8 (bf16 queries): 32 (H100 2026-12-06, with store_b 4: 24.9-25.4 -> 24.0-24.5 ms).
PREFILL_SCORE_PVC = {"bf16": 0, "fp8": 32, "fp8q": 32}
# Per index-key format: blocks per store tile of the prefill score loop (``store_b``; each block's
# maxima are put in a register tile [M, store_b] that is written when full; 1: stored at once). The
# per-block select and predicated store cost ~store_b instructions per row. H100 2026-12-06, 128K,
# 3 rounds: fp8q 15.1-15.8 (16) -> 12.4-13.1 ms (4), 13.7-14.2 (1); bf16 15.0-16.6 -> 14.0-16.2 (4,
# within the spread), 17.9-18.9 (1); fp8 26.1-26.4 -> 24.9-25.4 (4). Same bits at every width.
PREFILL_SCORE_STORE_B = {"bf16": 4, "fp8": 4, "fp8q": 4}
# Per index-key format: the prefill score launch's key reads and tile. "tma": each key sub-tile read
# through a tensor descriptor (one bulk copy instead of a [keys, di] pointer tensor per sub-tile);
# "tile": (tokens, rows) = BLOCK_M tokens per program while BLOCK_M x G <= rows, else half as many.
# Applies to fp16 / bf16 queries; fp32 queries (IEEE dots) take the bf16 entry.
# H100 2026-12-06, 128K, 3 rounds, same bits: fp8q 12.4-12.7 -> 10.5-11.0 ms with TMA, one
# 128-key sub-tile and 64 tokens (TMA alone 12.1-12.5; 64 tokens without TMA 13.0-13.2 on
# 2026-12-06 14:46); fp8 (bf16 queries, converted in registers) 24.0-24.6 -> 19.2-19.7 with TMA and 64 tokens;
# bf16: no variant outside its spread (14.6-17.0), kept as it was.
# "qpre" (FP8 queries): the query rows quantized before the launch (msa_fp8.quantize_rows), so the dot
# reads the loaded codes from shared memory instead of a register copy reloaded every k-step (sm_90
# spills 404 -> 96 bytes; kernels/ptxas_check.py). H100 2026-12-07, 128K, same bits, alternating A/B:
# 10.4-10.9 -> 9.8-10.3 ms (9.6-9.8 in a later call; 2 / 4 key sub-tiles with it: 10.6-11.4 /
# 13.1-13.4; 32-token tiles 10.5-10.9).
PREFILL_SCORE_FORMAT = {
    "bf16": {"tma": False, "nsub": 2, "tile": (32, 128)},
    "fp8": {"tma": True, "nsub": 2, "tile": (64, 256)},
    "fp8q": {"tma": True, "nsub": 1, "tile": (64, 256), "qpre": True},
}
TOPK_ROWS = 2  # (token, head) rows per one-chunk top-k program (one warp: H200 128K 6.0 -> 5.1 ms)
TOPK_ROWS_MIN = 1024  # ... from this many rows on (prefill)
TOPK_ROWS_WARPS = 1
# Decode-sized selection (chunk + merge kernels): one tl.topk bitonic network per chunk and for the
# merge instead of K rounds of a block-wide max (16 serial reductions at K = 16). Same keys, same
# order (the keys of a row are distinct). False: the rounds (kept for the A/B of bench_msa.py).
# NOTE: K = 1 always takes the one round: tl.topk(x, 1) reduces to a scalar and fails to build.
TOPK_NETWORK = True
# Decode score launches on CUDA (bf16/fp16 queries): keys through TMA (one bulk copy per page), and per
# index-key format (programs in all, num_warps, num_stages), from a sweep of 4 program counts x 3 warp
# counts x 4 depths, with and without TMA, 1 sequence at 128K and 1M (H200, docs/benchmarks.md
# 2026-12-03): bf16 1M 65.4 -> 63.8 us, 128K 11.1 -> 6.8; fp8 59.5 -> 49.9, 14.8 -> 8.3; fp8q
# 43.9 -> 38.5, 10.1 -> 7.3. FP8 keys with bf16 queries convert every key in registers (more work per
# byte): many short programs; the others: fewer, deeper-pipelined ones.
# Since 2026-12-04 the launch reads each split's page ids as one vector before its loop (the key pages
# are then really staged num_stages - 1 deep; see the kernel) and the configs were swept again (H200,
# docs/benchmarks.md): 1M fp8q 40.3 -> 38.8 us, 128K fp8q 8.3 -> 7.4; bf16 63.0 -> 63.2 (a streaming
# kernel reading the same pages: 62.7 us), fp8 unchanged; the whole 1M fp8q step 55.6 -> 54.2 us.
DECODE_SCORE_TMA = True
DECODE_SCORE_CONFIGS = {"bf16": (264, 4, 3), "fp8": (2048, 4, 2), "fp8q": (528, 4, 3)}
DECODE_PAGE_VECTOR_MAX = 1024  # widest split whose page ids are preloaded as a vector (4 KB of int32)
DECODE_SCORE_SMEM = 196608  # bytes of pipelined key pages per program (H200: ~227 KB shared memory per block)


@triton.jit
def _max_propagate_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _block_max(
    q,
    qpos,
    ik_ptr,
    iks_ptr,
    page,
    b,
    stride_ik_p,
    stride_ik_o,
    stride_iks_p,
    offs_o,
    offs_d,
    PS: tl.constexpr,
    KSCALE: tl.constexpr,
    TMA: tl.constexpr = False,
):
    """[M] max over block b's causal keys (cache page ``page``) of <q_m, ik_u> (x the key's scale with
    KSCALE); NaN -> -1e30, no causal key -> -inf. TMA: ik_ptr is a tensor descriptor over the
    [P * ps, di] keys (one bulk copy per page)."""
    if TMA:
        k = ik_ptr.load([page * PS, 0])
    else:
        k = tl.load(ik_ptr + page.to(tl.int64) * stride_ik_p + offs_o[:, None] * stride_ik_o + offs_d[None, :])
    s = index_dot(q, k)  # [M, PS] fp32
    if KSCALE:
        s = s * tl.load(iks_ptr + page.to(tl.int64) * stride_iks_p + offs_o)[None, :]
    causal = (b * PS + offs_o)[None, :] <= qpos[:, None]
    smax = tl.reduce(tl.where(causal, s, float("-inf")), 1, _max_propagate_nan)  # [M]
    # the reference's amax propagates NaN and then replaces it by -1e30 (spec §3.4)
    return tl.where(smax != smax, -1e30, smax)


@triton.jit
def _block_max_sub(
    q,
    qpos,
    ik_ptr,
    iks_ptr,
    page,
    b,
    stride_ik_p,
    stride_ik_o,
    stride_iks_p,
    offs_d,
    PS: tl.constexpr,
    NSUB: tl.constexpr,
    MASK: tl.constexpr,
    KSCALE: tl.constexpr,
    TMA: tl.constexpr = False,
):
    """``_block_max`` over the page as NSUB key sub-tiles of PS/NSUB keys (smaller score tiles, so more
    query rows fit in registers); MASK=False for blocks wholly before every row's position. TMA:
    ik_ptr is a tensor descriptor over the [P * ps, di] keys with a [PS/NSUB, di] box."""
    PSN: tl.constexpr = PS // NSUB
    offs_n = tl.arange(0, PSN)
    res = tl.full([q.shape[0]], float("-inf"), tl.float32)
    for sub in tl.static_range(NSUB):
        if TMA:
            k = ik_ptr.load([page * PS + sub * PSN, 0])
        else:
            k = tl.load(
                ik_ptr + page.to(tl.int64) * stride_ik_p + (sub * PSN + offs_n)[:, None] * stride_ik_o + offs_d[None, :]
            )
        s = index_dot(q, k)
        if KSCALE:
            s = s * tl.load(iks_ptr + page.to(tl.int64) * stride_iks_p + sub * PSN + offs_n)[None, :]
        if MASK:
            s = tl.where((b * PS + sub * PSN + offs_n)[None, :] <= qpos[:, None], s, float("-inf"))
        res = _max_propagate_nan(res, tl.reduce(s, 1, _max_propagate_nan))
    return tl.where(res != res, -1e30, res)


@triton.jit
def _store_tile_step(tile, smax, b, b_lo, b_hi, row_ptr, m_valid, offs_j, STORE_B: tl.constexpr):
    """Put block b's maxima in column (b - b_lo) % STORE_B; flush the tile when full or at b_hi - 1.
    STORE_B == 1: store them at once (the tile is unused)."""
    if STORE_B == 1:
        tl.store(row_ptr + b, smax, mask=m_valid)
        return tile
    j = (b - b_lo) % STORE_B
    tile = tl.where(offs_j[None, :] == j, smax[:, None], tile)
    b0 = b - j
    flush = (j == STORE_B - 1) | (b == b_hi - 1)
    tl.store(
        row_ptr[:, None] + (b0 + offs_j)[None, :], tile, mask=m_valid[:, None] & ((b0 + offs_j) <= b)[None, :] & flush
    )
    return tile


@triton.jit
def _prefill_block_step(
    tile,
    q,
    qpos,
    q_scale,
    ik_ptr,
    iks_ptr,
    page,
    b,
    b_lo,
    b_hi,
    row_ptr,
    m_valid,
    offs_j,
    stride_ik_p,
    stride_ik_o,
    stride_iks_p,
    offs_d,
    PS: tl.constexpr,
    NSUB: tl.constexpr,
    MASK: tl.constexpr,
    KSCALE: tl.constexpr,
    QFP8: tl.constexpr,
    STORE_B: tl.constexpr,
    TMA: tl.constexpr = False,
):
    """One block of the prefill score loop: block b's maxima (``_block_max_sub`` on cache page
    ``page``; x the row's query scale with QFP8) put in the store tile (``_store_tile_step``)."""
    smax = _block_max_sub(
        q, qpos, ik_ptr, iks_ptr, page, b, stride_ik_p, stride_ik_o, stride_iks_p, offs_d, PS, NSUB, MASK, KSCALE, TMA
    )
    if QFP8:
        smax = smax * q_scale
    return _store_tile_step(tile, smax, b, b_lo, b_hi, row_ptr, m_valid, offs_j, STORE_B)


@triton.jit
def index_scores_kernel(
    iq_ptr,
    iqs_ptr,
    ik_ptr,
    iks_ptr,
    bt_ptr,
    qsl_ptr,
    pos_ptr,
    score_ptr,
    row_offset,
    n_qtiles,
    blocks_per_split,
    stride_iq_t,
    stride_iq_g,
    stride_iqs_t,
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
    STORE_B: tl.constexpr,
    KSCALE: tl.constexpr,
    QFP8: tl.constexpr,
    SPLIT_CAUSAL: tl.constexpr = False,
    NSUB: tl.constexpr = 1,
    TMA: tl.constexpr = False,
    PV: tl.constexpr = 0,
    PDL: tl.constexpr = False,
    PVC: tl.constexpr = 0,
    QPRE: tl.constexpr = False,
):
    """Block-max index scores of BLOCK_M query tokens x G heads over one split of causal blocks.

    KSCALE: FP8 keys with per-token scales (iks_ptr); QFP8: the query rows are quantized to e4m3
    here (one scale per row, applied to the row's block maxima). Format: kernels/paged_layout.py.
    TMA (decode launches on CUDA): ik_ptr is a tensor descriptor of the keys (``_block_max``).
    PV (decode, a power of two >= blocks_per_split, or 0): the split's page ids are loaded as one
    [PV] vector before the block loop.
    PDL (decode on CUDA): let the next launch (the chunk top-k, launched with PDL) be scheduled now;
    it waits for this grid's stores in griddepcontrol.wait.
    PVC (prefill with SPLIT_CAUSAL, a power of two, or 0): the unmasked blocks' page ids are read PVC
    at a time as a vector, so no load in the inner block loop feeds another load's address.
    QPRE (with QFP8): the query rows come quantized (``msa_fp8.quantize_rows``): iq_ptr holds their
    e4m3 codes and iqs_ptr [T, G] their scales (row stride stride_iqs_t); the same values as
    quantizing here, but the dot then reads the loaded tile from shared memory (no register copy of
    the query operand).
    """
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    pid = tl.program_id(0)
    split = tl.program_id(1)
    row = row_offset + pid // n_qtiles
    qtile = n_qtiles - 1 - pid % n_qtiles  # NOTE: latest (longest) tiles first for load balance
    q_lo = tl.load(qsl_ptr + row)
    q_hi = tl.load(qsl_ptr + row + 1)
    t0 = q_lo + qtile * BLOCK_M
    if t0 >= q_hi:
        return
    offs_m = tl.arange(0, BLOCK_M * GP)  # row m = token m // GP, head m % GP
    tok = t0 + offs_m // GP
    head = offs_m % GP
    m_valid = (tok < q_hi) & (head < G)
    offs_d = tl.arange(0, DI)
    offs_o = tl.arange(0, PS)
    q = tl.load(
        iq_ptr + tok[:, None].to(tl.int64) * stride_iq_t + head[:, None] * stride_iq_g + offs_d[None, :],
        mask=m_valid[:, None],
        other=0.0,
    )  # [M, DI]
    tl.static_assert(QFP8 or not QPRE, "QPRE needs QFP8: the loaded codes' scales are applied with QFP8")
    if QPRE:
        q_scale = tl.load(iqs_ptr + tok.to(tl.int64) * stride_iqs_t + head, mask=m_valid, other=1.0)
    else:
        q_scale = tl.full([BLOCK_M * GP], 1.0, tl.float32)
        if QFP8:
            q, q_scale = quantize_rows_e4m3(q)
    qpos = tl.load(pos_ptr + tok, mask=m_valid, other=-1).to(tl.int32)  # [M]
    n_blk = tl.max(qpos, axis=0) // PS + 1
    b_lo = split * blocks_per_split
    b_hi = tl.minimum(b_lo + blocks_per_split, n_blk)
    # NOTE: int64 offsets: a 128K-token chunk at 1M context has T x G x NBP = 2**32 scores
    row_ptr = score_ptr + tok.to(tl.int64) * stride_s_t + head * stride_s_g  # [M]
    if STORE_B == 0:  # decode: few rows, a plain pipelined loop
        # NOTE: the split's page ids are read as one vector before the loop (PV > 0), so no load in it
        # feeds another load's address and the pipeliner stages num_stages - 1 key pages ahead (sm_90,
        # triton 3.6: 168,232 B of shared memory for bf16 pages at 6 stages, 69,912 B with the id loaded
        # in the loop, i.e. one page ahead whatever num_stages said)
        if PV > 0:
            offs_v = tl.arange(0, PV)
            pages_v = tl.load(bt_ptr + row * stride_bt_r + b_lo + offs_v, mask=b_lo + offs_v < b_hi, other=0)
        for b in range(b_lo, b_hi):
            if PV > 0:
                page = tl.sum(tl.where(offs_v == b - b_lo, pages_v, 0))
            else:
                page = tl.load(bt_ptr + row * stride_bt_r + b)
            smax = _block_max(
                q,
                qpos,
                ik_ptr,
                iks_ptr,
                page,
                b,
                stride_ik_p,
                stride_ik_o,
                stride_iks_p,
                offs_o,
                offs_d,
                PS,
                KSCALE,
                TMA,
            )
            if QFP8:
                smax = smax * q_scale
            tl.store(row_ptr + b, smax, mask=m_valid)
    else:
        # NOTE: prefill: STORE_B blocks' maxima are gathered in registers and written as one
        # [M, STORE_B] tile (contiguous per score row, not 4-byte scatters); the loop stays free of
        # control flow so the loads pipeline.
        offs_j = tl.arange(0, STORE_B)
        tile = tl.full([BLOCK_M * GP, STORE_B], float("-inf"), tl.float32)
        b_mid = b_lo
        if SPLIT_CAUSAL:
            # blocks ending at or before every valid row's position need no causal mask
            p_min = tl.min(tl.where(m_valid, qpos, 2147483647), axis=0)
            b_mid = tl.minimum(tl.maximum((p_min + 1) // PS, b_lo), b_hi)
            if PVC > 0:
                offs_c = tl.arange(0, PVC)
                for b0 in range(b_lo, b_mid, PVC):
                    pages_c = tl.load(bt_ptr + row * stride_bt_r + b0 + offs_c, mask=b0 + offs_c < b_mid, other=0)
                    for j in range(0, tl.minimum(PVC, b_mid - b0)):
                        b = b0 + j
                        page = tl.sum(tl.where(offs_c == j, pages_c, 0))
                        tile = _prefill_block_step(
                            tile,
                            q,
                            qpos,
                            q_scale,
                            ik_ptr,
                            iks_ptr,
                            page,
                            b,
                            b_lo,
                            b_hi,
                            row_ptr,
                            m_valid,
                            offs_j,
                            stride_ik_p,
                            stride_ik_o,
                            stride_iks_p,
                            offs_d,
                            PS,
                            NSUB,
                            False,
                            KSCALE,
                            QFP8,
                            STORE_B,
                            TMA,
                        )
            else:
                for b in range(b_lo, b_mid):
                    page = tl.load(bt_ptr + row * stride_bt_r + b)
                    tile = _prefill_block_step(
                        tile,
                        q,
                        qpos,
                        q_scale,
                        ik_ptr,
                        iks_ptr,
                        page,
                        b,
                        b_lo,
                        b_hi,
                        row_ptr,
                        m_valid,
                        offs_j,
                        stride_ik_p,
                        stride_ik_o,
                        stride_iks_p,
                        offs_d,
                        PS,
                        NSUB,
                        False,
                        KSCALE,
                        QFP8,
                        STORE_B,
                        TMA,
                    )
        for b in range(b_mid, b_hi):
            page = tl.load(bt_ptr + row * stride_bt_r + b)
            tile = _prefill_block_step(
                tile,
                q,
                qpos,
                q_scale,
                ik_ptr,
                iks_ptr,
                page,
                b,
                b_lo,
                b_hi,
                row_ptr,
                m_valid,
                offs_j,
                stride_ik_p,
                stride_ik_o,
                stride_iks_p,
                offs_d,
                PS,
                NSUB,
                True,
                KSCALE,
                QFP8,
                STORE_B,
                TMA,
            )


@triton.jit
def block_selection_keys(s, b, cand, n_cand, init_blocks, local_blocks):
    """[R, CH] int64 selection keys of candidate blocks b ([CH] ids; ``cand`` [R, CH] = b < n_cand,
    n_cand [R]): the order-preserving int32 of the score (+inf for forced local / init blocks, NaN ->
    -1e30, -0.0 -> +0.0) << 32 | (_ID_BIAS - b), so a larger key = forced first, then score desc,
    ties to the lower id; the empty key (below every key) where not a candidate. The batch-invariant
    top-k (kernels/invariant_attention.py) ranks these."""
    s = tl.where(s != s, -1e30, s)  # the score kernels already did it; NaN must never reach a key
    forced = cand & ((b[None, :] >= n_cand[:, None] - local_blocks) | (b < init_blocks)[None, :])
    s = tl.where(forced, float("inf"), s) + 0.0  # + 0.0: -0.0 -> +0.0 (equal in the reference)
    bits = s.to(tl.int32, bitcast=True)
    bits = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # order-preserving float -> signed int
    key = (bits.to(tl.int64) << 32) | (0x7FFFFFFF - b).to(tl.int64)[None, :]
    return tl.where(cand, key, -9223372036854775807 - 1)


@triton.jit
def _key_block_ids(key, n_cand):
    """Block ids of selection keys (any shape, int64: score bits << 32 | _ID_BIAS - id); -1 for the
    empty key and for ids past the row's n_cand candidates."""
    ids = 0x7FFFFFFF - (key & 0xFFFFFFFF).to(tl.int32)
    return tl.where((key == -9223372036854775807 - 1) | (ids >= n_cand), -1, ids)


@triton.jit
def _topk_chunk_kernel(
    score_ptr,
    pos_ptr,
    key_ptr,
    ids_ptr,
    n_chunks,
    topk,
    init_blocks,
    local_blocks,
    stride_s_t,
    stride_s_g,
    G: tl.constexpr,
    PS: tl.constexpr,
    CHUNK: tl.constexpr,
    KP: tl.constexpr,
    FINAL: tl.constexpr,
    NET: tl.constexpr = False,
    PDL_WAIT: tl.constexpr = False,
    PDL_TRIGGER: tl.constexpr = False,
):
    """Top-k keys of one chunk of one (token, head) row; FINAL (one chunk): write block ids. NET:
    ``tl.topk`` (needs KP <= CHUNK) instead of K rounds of max-and-remove; the same keys, in order.
    Not FINAL: the chunk's KP-slot key list key[(rid * n_chunks + chunk) * KP + :KP], its top ``topk``
    keys first (NET: the next KP - topk keys of the chunk after them, rounds: the empty key)."""
    rid = tl.program_id(0).to(tl.int64)  # t * G + g (int64: the key lists' offsets pass 2**31 at long tables)
    chunk = tl.program_id(1)
    t = rid // G
    g = rid % G
    p = tl.load(pos_ptr + t)
    if PDL_TRIGGER:  # let the (PDL-launched) attention launch be scheduled now
        tl.extra.cuda.gdc_launch_dependents()
    if PDL_WAIT:  # launched with PDL while the score launch ran: wait for the scores
        tl.extra.cuda.gdc_wait()
    n_cand = p // PS + 1
    b = chunk * CHUNK + tl.arange(0, CHUNK)
    cand = b < n_cand
    s = tl.load(score_ptr + t.to(tl.int64) * stride_s_t + g * stride_s_g + b, mask=cand, other=float("-inf"))
    s = tl.where(s != s, -1e30, s)  # NaN -> -1e30 (spec §3.4; a NaN's bits would sort above the forced +inf)
    forced = cand & ((b >= n_cand - local_blocks) | (b < init_blocks))
    s = tl.where(forced, float("inf"), s) + 0.0  # + 0.0 turns -0.0 into +0.0 (equal in the reference)
    bits = s.to(tl.int32, bitcast=True)
    bits = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # order-preserving float -> signed int
    key = (bits.to(tl.int64) << 32) | (0x7FFFFFFF - b).to(tl.int64)
    if not FINAL:
        if chunk * CHUNK >= n_cand:  # chunk past the candidates: empty winners
            offs_k = tl.arange(0, KP)
            empty = tl.full([KP], -9223372036854775807 - 1, tl.int64)
            tl.store(key_ptr + (rid * n_chunks + chunk) * KP + offs_k, empty)
            return
    if NET:  # one bitonic top-KP network (keys are distinct: the block id is in them), sorted descending
        top = tl.topk(key, KP)
        offs_k = tl.arange(0, KP)
        if FINAL:
            tl.store(ids_ptr + rid * topk + offs_k, _key_block_ids(top, n_cand), mask=offs_k < topk)
        else:
            tl.store(key_ptr + (rid * n_chunks + chunk) * KP + offs_k, top)
    else:  # K rounds of max-and-remove
        if not FINAL:
            offs_k = tl.arange(0, KP)
            tl.store(
                key_ptr + (rid * n_chunks + chunk) * KP + offs_k,
                tl.full([KP], -9223372036854775807 - 1, tl.int64),
                mask=offs_k >= topk,
            )
        for k in range(topk):
            best = tl.max(key, axis=0)
            key = tl.where(key == best, -9223372036854775807 - 1, key)
            if FINAL:
                tl.store(ids_ptr + rid * topk + k, _key_block_ids(best, n_cand))
            else:
                tl.store(key_ptr + (rid * n_chunks + chunk) * KP + k, best)


@triton.jit
def _topk_rows_tile(
    score_ptr,
    ids_ptr,
    rid,
    r_ok,
    t,
    g,
    n_cand_r,
    topk,
    init_blocks,
    local_blocks,
    stride_s_t,
    stride_s_g,
    CH: tl.constexpr,
):
    """Top-k block ids of ROWS rows whose candidates all lie in blocks [0, CH): int32 keys, two 32-bit
    reductions per pick (max key, then the lowest block id holding it) instead of one int64 max."""
    n_cand = n_cand_r[:, None]
    b = tl.arange(0, CH)[None, :]
    cand = (b < n_cand) & r_ok[:, None]
    s = tl.load(score_ptr + t[:, None].to(tl.int64) * stride_s_t + g[:, None] * stride_s_g + b, mask=cand, other=0.0)
    s = tl.where(s != s, -1e30, s)  # NaN -> -1e30 as in the reference (the score kernel already does it)
    forced = cand & ((b >= n_cand - local_blocks) | (b < init_blocks))
    s = tl.where(forced, float("inf"), s) + 0.0  # + 0.0 turns -0.0 into +0.0 (equal in the reference)
    bits = s.to(tl.int32, bitcast=True)
    key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # order-preserving float -> signed int (-inf > INT32_MIN)
    key = tl.where(cand, key, -2147483648)  # INT32_MIN: not a candidate / already picked
    for k in range(topk):
        best = tl.max(key, axis=1)  # [ROWS]
        bid = tl.min(tl.where(key == best[:, None], b, CH), axis=1)  # ties -> the lower block id
        key = tl.where(b == bid[:, None], -2147483648, key)
        bid = tl.where(best == -2147483648, -1, bid)
        tl.store(ids_ptr + rid * topk + k, bid, mask=r_ok)


@triton.jit
def _topk_rows_kernel(
    score_ptr,
    pos_ptr,
    ids_ptr,
    n_rows,
    topk,
    init_blocks,
    local_blocks,
    stride_s_t,
    stride_s_g,
    G: tl.constexpr,
    PS: tl.constexpr,
    CHUNK: tl.constexpr,
    ROWS: tl.constexpr,
):
    """Final top-k of ROWS (token, head) rows per program (one chunk of <= CHUNK blocks per row).

    The key tile is sized to the program's causal candidates: CHUNK/8, /4, /2 or CHUNK blocks
    (one branch per size, chosen on the device: a causal prefill's early tokens do 1/8 of the work).
    """
    rid = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # t * G + g
    r_ok = rid < n_rows
    t = rid // G
    g = rid % G
    p = tl.load(pos_ptr + t, mask=r_ok, other=0)
    n_cand_r = tl.where(r_ok, p // PS + 1, 0).to(tl.int32)  # [ROWS]
    n_max = tl.max(n_cand_r, axis=0)
    if CHUNK >= 64:
        if n_max <= CHUNK // 8:
            _topk_rows_tile(
                score_ptr,
                ids_ptr,
                rid,
                r_ok,
                t,
                g,
                n_cand_r,
                topk,
                init_blocks,
                local_blocks,
                stride_s_t,
                stride_s_g,
                CHUNK // 8,
            )
        elif n_max <= CHUNK // 4:
            _topk_rows_tile(
                score_ptr,
                ids_ptr,
                rid,
                r_ok,
                t,
                g,
                n_cand_r,
                topk,
                init_blocks,
                local_blocks,
                stride_s_t,
                stride_s_g,
                CHUNK // 4,
            )
        elif n_max <= CHUNK // 2:
            _topk_rows_tile(
                score_ptr,
                ids_ptr,
                rid,
                r_ok,
                t,
                g,
                n_cand_r,
                topk,
                init_blocks,
                local_blocks,
                stride_s_t,
                stride_s_g,
                CHUNK // 2,
            )
        else:
            _topk_rows_tile(
                score_ptr,
                ids_ptr,
                rid,
                r_ok,
                t,
                g,
                n_cand_r,
                topk,
                init_blocks,
                local_blocks,
                stride_s_t,
                stride_s_g,
                CHUNK,
            )
    else:
        _topk_rows_tile(
            score_ptr,
            ids_ptr,
            rid,
            r_ok,
            t,
            g,
            n_cand_r,
            topk,
            init_blocks,
            local_blocks,
            stride_s_t,
            stride_s_g,
            CHUNK,
        )


@triton.jit
def _topk_merge_kernel(
    key_ptr,
    pos_ptr,
    ids_ptr,
    n_keys,
    topk,
    PS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    G: tl.constexpr,
    KP: tl.constexpr = 16,
    NET: tl.constexpr = False,
):
    """Final top-k over the chunk winners of one (token, head) row (NET: one ``tl.topk`` network)."""
    rid = tl.program_id(0).to(tl.int64)  # int64: rid * n_keys passes 2**31 at long tables
    p = tl.load(pos_ptr + rid // G)
    n_cand = p // PS + 1
    offs = tl.arange(0, BLOCK_N)
    key = tl.load(key_ptr + rid * n_keys + offs, mask=offs < n_keys, other=-9223372036854775807 - 1)
    if NET:
        top = tl.topk(key, KP)
        offs_k = tl.arange(0, KP)
        tl.store(ids_ptr + rid * topk + offs_k, _key_block_ids(top, n_cand), mask=offs_k < topk)
    else:
        for k in range(topk):
            best = tl.max(key, axis=0)
            key = tl.where(key == best, -9223372036854775807 - 1, key)
            tl.store(ids_ptr + rid * topk + k, _key_block_ids(best, n_cand))


def score_warps(cfg: dict, block_m: int, gp: int) -> int:
    """Warps of a score launch: the ``num_warps`` knob, else 4 for tiles of <= 64 (token, head) rows
    (block_m tokens x gp padded heads) and 8 above."""
    return cfg.get("num_warps", 4 if block_m * gp <= 64 else 8)


def _score_launch(
    iq,
    index_cache_l,
    meta,
    scores,
    rows: tuple[int, int],
    block_m: int,
    n_splits: int,
    cfg: dict | None = None,
):
    """Launch the score kernel over rows [r0, r1) with query tiles of block_m tokens (cfg: prefill knobs)."""
    cfg = cfg or {}
    r0, r1 = rows
    if r1 <= r0:
        return
    keys, kscales, qfp8 = split_index_cache(index_cache_l)
    ieee = iq.dtype == torch.float32 and not qfp8
    t_g, g, di = iq.shape
    ps = keys.shape[1]
    ik = keys
    nbp = meta.block_tables.shape[1]
    decode = r0 < meta.num_decodes
    nsub = cfg.get("nsub", 1)
    tma = bool(cfg.get("tma")) and (decode or n_splits == 1)
    if tma:  # a descriptor over the [P * ps, di] keys: decode one [ps, di] box per page, prefill per sub-tile
        ik = TensorDescriptor.from_tensor(keys.view(-1, di), [ps if decode else ps // nsub, di])
    gp = next_pow2(g)
    block_m = max(block_m, 16 // gp if gp < 16 else 1)
    qlen = meta.decode_query_len if decode else meta.max_query_len
    n_qtiles = triton.cdiv(max(qlen, 1), block_m)
    per_split = triton.cdiv(nbp, n_splits)
    n_splits = triton.cdiv(nbp, per_split)
    grid = ((r1 - r0) * n_qtiles, n_splits)
    qpre = qfp8 and not decode and bool(cfg.get("qpre"))
    iq_scales = iq
    if qpre:  # the prefill's query rows quantized in one pass first (all rows: decode rows are not read)
        iq, iq_scales = quantize_rows(iq)
    index_scores_kernel[grid](
        iq,
        iq_scales,
        ik,
        keys if kscales is None else kscales,
        meta.block_tables,
        meta.query_start_loc,
        meta.positions,
        scores,
        r0,
        n_qtiles,
        per_split,
        iq.stride(0),
        iq.stride(1),
        iq_scales.stride(0),
        keys.stride(0),
        keys.stride(1),
        0 if kscales is None else kscales.stride(0),
        meta.block_tables.stride(0),
        scores.stride(0),
        scores.stride(1),
        G=g,
        GP=gp,
        DI=di,
        PS=ps,
        BLOCK_M=block_m,
        # NOTE: a descriptor (TMA) takes the plain decode loop also with one split (a one-page table, or
        # more decode rows than the format's programs): the tile loop does pointer arithmetic on ik_ptr
        STORE_B=0 if n_splits > 1 or (tma and decode) else cfg.get("store_b", 16),
        KSCALE=kscales is not None,
        QFP8=qfp8,
        SPLIT_CAUSAL=cfg.get("split_causal", False),
        NSUB=nsub,
        TMA=tma,
        PV=next_pow2(per_split) if tma and decode and per_split <= DECODE_PAGE_VECTOR_MAX else 0,
        PDL=bool(cfg.get("pdl")),
        PVC=cfg.get("pvc", 0),
        QPRE=qpre,
        num_warps=score_warps(cfg, block_m, gp),
        num_stages=1 if ieee else cfg.get("num_stages", 3),
        **({"maxnreg": cfg["maxnreg"]} if cfg.get("maxnreg") else {}),
    )


def check_index_inputs(iq, index_cache_l, topk: int, op: str = "index_topk") -> None:
    """The input rules of an index top-k op (``index_topk``; the batch-invariant one names itself
    with ``op``): fp32/fp16/bf16 queries iq [T, G, di] with keys [P, ps, di] of the same dtype or an
    ``FP8IndexCache``, ps and di powers of two in [16, 256], topk in 1..MAX_TOPK, contiguous last
    dims. Raises ValueError naming ``op`` and the offending field."""
    keys, kscales, _ = split_index_cache(index_cache_l)
    di = iq.shape[2]
    ps = keys.shape[1]
    if iq.dtype not in (torch.float32, torch.float16, torch.bfloat16) or (kscales is None and keys.dtype != iq.dtype):
        raise ValueError(
            f"{op}: dtype iq={iq.dtype}, index cache={keys.dtype}; the Triton "
            "indexer supports fp32/fp16/bf16 queries with keys of the same dtype or an FP8IndexCache"
        )
    check_pow2_dim("page_size (sparse_block_size)", ps)
    check_pow2_dim("sparse_index_dim", di)
    if keys.shape[2] != di:
        raise ValueError(f"{op}: iq dim {di} != index cache dim {keys.shape[2]}")
    if not 1 <= topk <= MAX_TOPK:
        raise ValueError(f"{op}: topk={topk} unsupported; the Triton top-k handles 1..{MAX_TOPK}")
    if iq.stride(2) != 1 or keys.stride(2) != 1:
        raise ValueError(f"{op}: iq and index_cache_l need a contiguous last dim")


def tma_keys_ok(keys: torch.Tensor) -> bool:
    """Whether index keys [P, ps, di] can be read through a [P * ps, di] tensor descriptor: contiguous
    pages at a 16-byte aligned base (rows are di * elt >= 16 bytes: di >= 16, elt >= 1)."""
    return keys.is_contiguous() and keys.data_ptr() % 16 == 0


def decode_score_config(iq: torch.Tensor, index_cache_l) -> dict:
    """Launch knobs of the decode score launch: on CUDA with fp16/bf16 queries and keys that pass
    ``tma_keys_ok``, TMA plus the format's ``DECODE_SCORE_CONFIGS`` entry (programs, num_warps,
    num_stages); otherwise {} (the pointer loads and the default split)."""
    keys, _, _ = split_index_cache(index_cache_l)
    if not (iq.is_cuda and DECODE_SCORE_TMA and iq.dtype != torch.float32 and tma_keys_ok(keys)):
        return {}
    programs, warps, stages = DECODE_SCORE_CONFIGS[index_format(index_cache_l)]
    page_bytes = keys.shape[1] * keys.shape[2] * keys.element_size()
    stages = max(2, min(stages, DECODE_SCORE_SMEM // page_bytes))  # pages larger than M3's 32 KB: fewer stages
    return {"tma": True, "programs": programs, "num_warps": warps, "num_stages": stages}


def prefill_score_config(iq: torch.Tensor, index_cache_l) -> dict:
    """The prefill score launch's knobs on CUDA: ``PREFILL_SCORE_CONFIG`` plus the index-key format's
    ``PREFILL_SCORE_PVC``, ``PREFILL_SCORE_STORE_B`` and ``PREFILL_SCORE_FORMAT`` entries (key reads
    through TMA, key sub-tiles, tokens per program for iq's G heads). fp32 queries take the bf16
    entry (pointer loads, the 32-token tile) whatever the keys' format."""
    fmt = index_format(index_cache_l)
    per_fmt = PREFILL_SCORE_FORMAT["bf16" if iq.dtype == torch.float32 else fmt]
    bm, rows = per_fmt["tile"]
    return dict(
        PREFILL_SCORE_CONFIG,
        pvc=PREFILL_SCORE_PVC.get(fmt, 0),
        store_b=PREFILL_SCORE_STORE_B.get(fmt, 16),
        tma=per_fmt["tma"],
        nsub=per_fmt["nsub"],
        qpre=per_fmt.get("qpre", False),
        block_m=bm if iq.shape[1] * bm <= rows else max(1, bm // 2),
    )


def index_block_scores(
    iq: torch.Tensor, index_cache_l, meta: PagedMetadata, prefill_config: dict | None = None, *, pdl: bool = False
) -> torch.Tensor:
    """[T, G, NBP] fp32 block-max index scores (spec §3.4); entries past a token's causal blocks are garbage.

    Entry [t, g, b] for b <= pos(t) // ps: max over block b's causal keys of <iq[t, g], ik[u]>,
    NaN -> -1e30; for an ``FP8IndexCache`` ik[u] is the dequantized key (and iq[t, g] the
    dequantized query when it quantizes queries). prefill_config: benchmark knobs of the prefill
    score kernel over the CUDA defaults of ``prefill_score_config`` (``block_m``, ``num_warps``,
    ``num_stages``, ``split_causal``, ``nsub``, ``pvc``: page
    ids read as vectors of that many blocks, default per format ``PREFILL_SCORE_PVC``; ``store_b``:
    blocks per store tile, a power of two, default per format ``PREFILL_SCORE_STORE_B``; a ``store_b``
    or ``pvc`` that is not a power of two raises ValueError, ``pvc`` 0 is off; ``tma``: key sub-tiles read
    through a tensor descriptor, same bits, where ``tma_keys_ok``; ``qpre``: with a quantizing
    ``FP8IndexCache``, the query rows quantized by ``msa_fp8.quantize_rows`` before the launch, same
    bits). pdl (decode launches
    with a TMA config, ``decode_score_config``, only): the decode score programs trigger the next
    launch at their start, for a ``topk_chunk_keys(pdl=True)`` that follows (programmatic dependent
    launch; otherwise no effect: that launch is then let in as the score programs exit).
    """
    t, g, di = iq.shape
    nbp = meta.block_tables.shape[1]
    scores = torch.empty(t, g, nbp, dtype=torch.float32, device=iq.device)  # [T, G, NBP] scratch
    if t == 0:
        return scores
    nd, r = meta.num_decodes, meta.num_rows
    for key in ("store_b", "pvc"):  # the caller's knobs (prefill_score_config's defaults are valid)
        if key in (prefill_config or {}):
            check_pow2_knob("index_block_scores", key, prefill_config[key], zero_ok=key == "pvc")
    cfg = dict(prefill_score_config(iq, index_cache_l) if iq.is_cuda else {}, **(prefill_config or {}))
    if cfg.get("tma") and not tma_keys_ok(split_index_cache(index_cache_l)[0]):
        cfg["tma"] = False  # keys a descriptor cannot cover: the pointer loads (same bits)
    if nd > 0:
        # Split-K over blocks (fixed by shape): on CUDA the format's DECODE_SCORE_CONFIGS program count,
        # elsewhere ~1024 programs in all with >= 8 blocks each.
        dcfg = decode_score_config(iq, index_cache_l)
        if dcfg and pdl:
            dcfg["pdl"] = True
        if dcfg:
            splits = max(1, min(nbp, dcfg["programs"] // nd))
        else:
            splits = max(1, min(triton.cdiv(nbp, 8), 1024 // nd))
        bm = next_pow2(max(meta.decode_query_len, 1))
        _score_launch(iq, index_cache_l, meta, scores, (0, nd), bm, splits, dcfg)
    if r > nd:
        _score_launch(iq, index_cache_l, meta, scores, (nd, r), cfg.get("block_m", 32 if g * 32 <= 128 else 16), 1, cfg)
    return scores


def select_topk_blocks(
    scores: torch.Tensor,
    meta: PagedMetadata,
    topk: int,
    page_size: int,
    init_blocks: int = 0,
    local_blocks: int = 1,
    rows_per_program: int = TOPK_ROWS,
    num_warps: int = TOPK_ROWS_WARPS,
) -> torch.Tensor:
    """[T, G, K] int32 top-k block ids from ``index_block_scores`` output (forced blocks, ties to lower id).

    rows_per_program > 1 (power of two): the one-chunk case with >= TOPK_ROWS_MIN rows runs that many rows per
    program (one [rows, chunk] key tile, ``num_warps`` warps; the tile is sized to the rows' causal candidates).
    """
    if rows_per_program < 1 or rows_per_program & (rows_per_program - 1):
        raise ValueError(f"select_topk_blocks: rows_per_program={rows_per_program}; needs a power of two >= 1")
    t, g, nbp = scores.shape
    out = torch.empty(t, g, topk, dtype=torch.int32, device=scores.device)
    if t == 0:
        return out
    ps = page_size
    chunk = topk_chunk_size(t * g, nbp)
    n_chunks = triton.cdiv(nbp, chunk)
    if n_chunks == 1 and rows_per_program > 1 and t * g >= TOPK_ROWS_MIN:  # prefill-sized; decode: one row each
        _topk_rows_kernel[(triton.cdiv(t * g, rows_per_program),)](
            scores,
            meta.positions,
            out,
            t * g,
            topk,
            init_blocks,
            local_blocks,
            scores.stride(0),
            scores.stride(1),
            G=g,
            PS=ps,
            CHUNK=chunk,
            ROWS=rows_per_program,
            num_warps=num_warps,
        )
        return out
    if n_chunks == 1:
        _topk_chunk_kernel[(t * g, 1)](
            scores,
            meta.positions,
            out,
            out,
            1,
            topk,
            init_blocks,
            local_blocks,
            scores.stride(0),
            scores.stride(1),
            G=g,
            PS=ps,
            CHUNK=chunk,
            KP=next_pow2(topk),
            FINAL=True,
            NET=TOPK_NETWORK and 2 <= next_pow2(topk) <= chunk,
            num_warps=4,
        )
        return out
    keys, _ = topk_chunk_keys(scores, meta, topk, ps, init_blocks, local_blocks, chunk)
    kp = keys.shape[3]
    n_keys = n_chunks * kp
    _topk_merge_kernel[(t * g,)](
        keys,
        meta.positions,
        out,
        n_keys,
        topk,
        PS=ps,
        BLOCK_N=next_pow2(n_keys),
        G=g,
        KP=kp,
        NET=TOPK_NETWORK and 2 <= kp,
        num_warps=4 if n_keys <= 1024 else 8,
    )
    return out


def topk_chunk_size(n_rows: int, nbp: int) -> int:
    """Blocks per selection chunk for n_rows (token, head) rows over NBP-wide tables: few rows
    (decode): TOPK_CHUNK (split-K over many programs); many (prefill): one chunk of up to 1024."""
    return min(TOPK_CHUNK if n_rows < 1024 else 1024, next_pow2(nbp))


def topk_chunk_keys(
    scores: torch.Tensor,
    meta: PagedMetadata,
    topk: int,
    page_size: int,
    init_blocks: int = 0,
    local_blocks: int = 1,
    chunk: int | None = None,
    *,
    pdl: bool = False,
    trigger: bool = False,
) -> tuple[torch.Tensor, int]:
    """The split-K stage of ``select_topk_blocks``: each chunk of ``chunk`` blocks of a (token, head)
    row keeps its own top keys (int64 selection keys: score bits << 32 | _ID_BIAS - id, forced
    blocks +inf, NaN -1e30; the empty key past the row's candidates).

    scores: [T, G, NBP] fp32 from ``index_block_scores``. chunk: blocks per chunk (a power of two
    <= next_pow2(NBP); default ``topk_chunk_size``). Returns (keys [T, G, NCH, KP] int64, chunk),
    KP = next_pow2(topk): each list holds the chunk's top ``topk`` keys first. The row's top-k is
    the top-k of its NCH x KP keys (``_topk_merge_kernel``, or the attention kernel's prologue:
    ``msa_fused_decode.decode_select_attend(cands=...)``). pdl (CUDA): launched with programmatic
    dependent launch after the score launch; its programs wait for the scores in griddepcontrol.wait.
    trigger (CUDA): its programs let a PDL-launched next kernel be scheduled at their start. Both
    are ignored off CUDA (the interpreter has no launch dependencies).
    """
    t, g, nbp = scores.shape
    chunk = chunk or topk_chunk_size(t * g, nbp)
    n_chunks = triton.cdiv(nbp, chunk)
    kp = max(next_pow2(topk), 1)
    keys = torch.empty(t, g, n_chunks, kp, dtype=torch.int64, device=scores.device)  # chunk winners
    if t == 0:
        return keys, chunk
    pdl, trigger = pdl and scores.is_cuda, trigger and scores.is_cuda  # PDL is a CUDA launch attribute
    _topk_chunk_kernel[(t * g, n_chunks)](
        scores,
        meta.positions,
        keys,
        keys,
        n_chunks,
        topk,
        init_blocks,
        local_blocks,
        scores.stride(0),
        scores.stride(1),
        G=g,
        PS=page_size,
        CHUNK=chunk,
        KP=kp,
        FINAL=False,
        NET=TOPK_NETWORK and 2 <= kp <= chunk,
        PDL_WAIT=pdl,
        PDL_TRIGGER=trigger,
        num_warps=4,
        **({"launch_pdl": True} if pdl else {}),
    )
    return keys, chunk


def index_topk(
    iq: torch.Tensor,
    index_cache_l,
    meta: PagedMetadata,
    topk: int,
    init_blocks: int = 0,
    local_blocks: int = 1,
    prefill_config: dict | None = None,
) -> torch.Tensor:
    """Triton version of ``m3_rollout.engine.reference_ops.index_topk_ref`` (same arguments, same output, spec §3.4).

    iq: [T, G, di] fp32/fp16/bf16 index queries; index_cache_l: [P, ps, di] same dtype, page-major
    contiguous pages, or a ``paged_layout.FP8IndexCache`` (e4m3 keys + per-token scales; scores
    on the dequantized keys, and queries, when it quantizes them). Returns [T, G, K] int32 block
    ids: forced blocks first (lower id first), then by block-max score desc with ties to the lower
    id; -1 past min(K, nb(t)).
    prefill_config: benchmark knobs of the prefill score kernel (see ``index_block_scores``).
    Raises ValueError for an unsupported dtype, ps/di not a power of two in [16, 256], topk outside
    [1, 64], or iq heads/dim not matching the cache.
    """
    check_index_inputs(iq, index_cache_l, topk)
    scores = index_block_scores(iq, index_cache_l, meta, prefill_config)
    return select_topk_blocks(
        scores, meta, topk, split_index_cache(index_cache_l)[0].shape[1], init_blocks, local_blocks
    )

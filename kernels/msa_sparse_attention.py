"""Triton sparse (and dense causal) GQA attention over the paged K/V cache (spec §3.5, §4.3).

Governing idea: one program owns one KV head's whole GQA group (all R = nh/G query heads share
the group's selected blocks), walks pages through the block table and keeps an online softmax in
base 2 (scale pre-multiplied by log2 e) with fp32 accumulation.
- Decode (rows 0..num_decodes-1, each ``decode_query_len`` >= 1 tokens with their own causal
  cut-off and their own selection): split-K over the selected entries (or over the blocks for
  dense layers); every split writes a normalised partial output and its base-2 log-sum-exp, a
  merge kernel combines them with weights exp2(lse - max). Grid = (decode tokens, G, splits),
  fixed by the batch shape.
- Prefill (remaining rows): a program tiles BLOCK_M consecutive query tokens x R heads
  (M = BLOCK_M*R rows of the tensor-core tile) and walks the union of the tile's selected blocks
  (each distinct block once; a row only attends to the blocks its own token selected, causal cut
  at its position); dense layers walk every causal block.
Invalid entries (-1 or >= nb(t)) contribute nothing. Empty splits give lse = -inf.
NOTE: fp32 inputs use ``input_precision="ieee"`` (no tf32); bf16/fp16 inputs cast the softmax
probabilities to the input dtype for the PV tensor-core dot (flash-attention practice).

Shape legend: T query tokens, R rows, P pages, ps page size, G KV heads, nh query heads,
RH = nh/G heads per group, d head dim, K top-k entries, S decode splits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.msa_checks import check_pow2_dim, next_pow2
from m3_rollout.engine.paged_cache import PagedMetadata

LOG2E = 1.4426950408889634


@triton.jit
def _attend_block(q, m_i, l_i, acc, k_ptr, v_ptr, page, b, row_ok, qpos, qk_scale, stride_kp, stride_ko,
                  offs_o, offs_d, PS: tl.constexpr, IEEE: tl.constexpr):
    """Online-softmax update of (m_i, l_i, acc) with one page; row_ok [M] masks rows."""
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
    q_ptr, k_ptr, v_ptr, bt_ptr, pos_ptr, sel_ptr, o_ptr, opart_ptr, lse_ptr,
    qk_scale, dql, n_entries, entries_per_split,
    stride_qt, stride_qh, stride_kp, stride_kg, stride_ko, stride_bt_r,
    stride_sel_t, stride_sel_g, stride_ot, stride_oh,
    RH: tl.constexpr, RHP: tl.constexpr, D: tl.constexpr, PS: tl.constexpr,
    DENSE: tl.constexpr, SPLIT: tl.constexpr, IEEE: tl.constexpr,
):
    """One (decode token, KV head, split): partial softmax over its share of the entries."""
    t = tl.program_id(0)
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
    for e in range(e_lo, e_hi):
        if DENSE:
            b = e
        else:
            b = tl.load(sel_ptr + t * stride_sel_t + g * stride_sel_g + e)
        if (b >= 0) & (b < n_blk):
            page = tl.load(bt_ptr + row * stride_bt_r + b)
            m_i, l_i, acc = _attend_block(q, m_i, l_i, acc, kg_ptr, vg_ptr, page, b, h_ok, qpos, qk_scale,
                                          stride_kp, stride_ko, offs_o, offs_d, PS, IEEE)
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_safe[:, None]
    if SPLIT:
        lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
        base = (t * tl.num_programs(1) + g) * n_split + s_id
        tl.store(lse_ptr + base * RHP + offs_h, lse)
        tl.store(opart_ptr + (base * RHP + offs_h[:, None]) * D + offs_d[None, :], out)
    else:
        tl.store(o_ptr + t * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=h_ok[:, None])


@triton.jit
def _decode_merge_kernel(opart_ptr, lse_ptr, o_ptr, stride_ot, stride_oh,
                         RH: tl.constexpr, RHP: tl.constexpr, D: tl.constexpr, S: tl.constexpr):
    """Combine the S splits of one (decode token, KV head): weights exp2(lse_s - max_s lse)."""
    t = tl.program_id(0)
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
    tl.store(o_ptr + t * stride_ot + head[:, None] * stride_oh + offs_d[None, :], out.to(o_ptr.dtype.element_ty),
             mask=(offs_h < RH)[:, None])


@triton.jit
def _prefill_attn_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, qsl_ptr, pos_ptr, sel_ptr, o_ptr,
    qk_scale, row_offset, n_qtiles, topk,
    stride_qt, stride_qh, stride_kp, stride_kg, stride_ko, stride_bt_r,
    stride_sel_t, stride_sel_g, stride_ot, stride_oh,
    RH: tl.constexpr, RHP: tl.constexpr, D: tl.constexpr, PS: tl.constexpr, BLOCK_M: tl.constexpr,
    KP: tl.constexpr, DENSE: tl.constexpr, IEEE: tl.constexpr,
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
    offs_m = tl.arange(0, BLOCK_M * RHP)  # row m = token m // RHP, head m % RHP
    tok = t0 + offs_m // RHP
    h = offs_m % RHP
    m_ok = (tok < q_hi) & (h < RH)
    head = g * RH + h
    offs_d = tl.arange(0, D)
    offs_o = tl.arange(0, PS)
    q = tl.load(q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=m_ok[:, None], other=0.0)  # [M, D]
    qpos = tl.load(pos_ptr + tok, mask=m_ok, other=-1)  # [M]
    m_i = tl.full([BLOCK_M * RHP], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M * RHP], tl.float32)
    acc = tl.zeros([BLOCK_M * RHP, D], tl.float32)
    kg_ptr = k_ptr + g * stride_kg
    vg_ptr = v_ptr + g * stride_kg
    if DENSE:
        n_blk = tl.max(qpos, axis=0) // PS + 1
        for b in range(0, n_blk):
            page = tl.load(bt_ptr + row * stride_bt_r + b)
            m_i, l_i, acc = _attend_block(q, m_i, l_i, acc, kg_ptr, vg_ptr, page, b, m_ok, qpos, qk_scale,
                                          stride_kp, stride_ko, offs_o, offs_d, PS, IEEE)
    else:
        offs_k = tl.arange(0, KP)
        sel_rows = tl.load(sel_ptr + tok[:, None] * stride_sel_t + g * stride_sel_g + offs_k[None, :],
                           mask=m_ok[:, None] & (offs_k[None, :] < topk), other=-1)  # [M, KP]
        offs_i = tl.arange(0, BLOCK_M)
        tile_tok_ok = (t0 + offs_i) < q_hi
        sel_tile = tl.load(sel_ptr + (t0 + offs_i)[:, None] * stride_sel_t + g * stride_sel_g + offs_k[None, :],
                           mask=tile_tok_ok[:, None] & (offs_k[None, :] < topk), other=-1)  # [BLOCK_M, KP]
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
                    m_i, l_i, acc = _attend_block(q, m_i, l_i, acc, kg_ptr, vg_ptr, page, b, row_ok, qpos,
                                                  qk_scale, stride_kp, stride_ko, offs_o, offs_d, PS, IEEE)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(o_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=m_ok[:, None])


def _pow2_floor(n: int) -> int:
    return 1 << (max(int(n), 1).bit_length() - 1)


def decode_splits(n_tokens: int, n_kv_heads: int, n_entries: int) -> int:
    """Decode split-K count: the largest power of two <= min(n_entries, 256 / (tokens * G)).

    Depends only on the batch shape (tokens, heads, top-k or block-table width): graph-safe.
    """
    return _pow2_floor(min(n_entries, max(1, 256 // max(1, n_tokens * n_kv_heads))))


def paged_attention(
    q: torch.Tensor,
    k_cache_l: torch.Tensor,
    v_cache_l: torch.Tensor,
    meta: PagedMetadata,
    scale: float,
    topk_ids: torch.Tensor | None = None,
    prefill_block_m: int | None = None,
) -> torch.Tensor:
    """Triton version of ``msa_reference.paged_attention_ref`` (same arguments and output, spec §3.5).

    q: [T, nh, d]; k_cache_l, v_cache_l: [P, G, ps, d] (contiguous pages), same dtype as q
    (fp32/fp16/bf16); topk_ids: [T, G, K] int32 block ids (-1 = empty) or None for dense causal.
    prefill_block_m: query tokens per prefill program (default 4 sparse, 8 dense).
    Returns [T, nh, d] in q.dtype.
    Raises ValueError for an unsupported dtype, d/ps not a power of two in [16, 256], nh not a
    multiple of G, or topk_ids of the wrong shape.
    """
    t, nh, d = q.shape
    _, g, ps, dk = k_cache_l.shape
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16) or k_cache_l.dtype != q.dtype \
            or v_cache_l.dtype != q.dtype:
        raise ValueError(f"paged_attention: dtypes q={q.dtype}, k={k_cache_l.dtype}, v={v_cache_l.dtype}; the "
                         "Triton kernel supports fp32/fp16/bf16 with equal dtypes")
    check_pow2_dim("head_dim", d)
    check_pow2_dim("page_size (sparse_block_size)", ps)
    if dk != d or v_cache_l.shape != k_cache_l.shape:
        raise ValueError(f"paged_attention: q head_dim {d} vs caches {tuple(k_cache_l.shape)}/{tuple(v_cache_l.shape)}")
    if nh % g:
        raise ValueError(f"paged_attention: num_attention_heads={nh} is not a multiple of num_key_value_heads={g}")
    if k_cache_l.stride()[1:] != (ps * d, d, 1) or k_cache_l.stride() != v_cache_l.stride() or q.stride(2) != 1:
        raise ValueError("paged_attention: k/v caches must have the paged_cache.py layout (contiguous pages)")
    if topk_ids is not None and (topk_ids.dim() != 3 or topk_ids.shape[:2] != (t, g)):
        raise ValueError(f"paged_attention: topk_ids shape {tuple(topk_ids.shape)}, expected [T={t}, G={g}, K]")
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
    common = (q.stride(0), q.stride(1), k_cache_l.stride(0), k_cache_l.stride(1), k_cache_l.stride(2),
              meta.block_tables.stride(0), ssel[0], ssel[1], out.stride(0), out.stride(1))
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
            q, k_cache_l, v_cache_l, meta.block_tables, meta.positions, sel, out, opart, lse,
            qk_scale, meta.decode_query_len, n_entries, per, *common,
            RH=rh, RHP=rhp, D=d, PS=ps, DENSE=dense, SPLIT=split, IEEE=ieee, num_warps=4, num_stages=1 if ieee else 2)
        if split:
            _decode_merge_kernel[(t_dec, g)](opart, lse, out, out.stride(0), out.stride(1),
                                             RH=rh, RHP=rhp, D=d, S=splits, num_warps=4)
    if r > nd:
        rhp_pf = next_pow2(rh)
        bm = prefill_block_m or (4 if not dense else 8)
        bm = max(bm, triton.cdiv(16, rhp_pf))
        n_qtiles = triton.cdiv(max(meta.max_query_len, 1), bm)
        _prefill_attn_kernel[((r - nd) * n_qtiles, g)](
            q, k_cache_l, v_cache_l, meta.block_tables, meta.query_start_loc, meta.positions, sel, out,
            qk_scale, nd, n_qtiles, topk, *common,
            RH=rh, RHP=rhp_pf, D=d, PS=ps, BLOCK_M=bm, KP=max(next_pow2(topk), 2), DENSE=dense, IEEE=ieee,
            num_warps=4 if bm * rhp_pf <= 64 else 8, num_stages=1 if ieee else 2)
    return out

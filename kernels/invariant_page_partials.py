"""Batch-invariant sparse attention by per-page partials: the fast KV-major prefill and a decode kernel of its bits.

Which path is this: the sparse layers' attention of the batch-invariant table built with
``sparse_impl="page_partials"`` (``EngineConfig.invariant_sparse_attention``; issue 24), the
default (``invariant_attention.DEFAULT_SPARSE_IMPL``) since 2026-12-05: on an H100 it meets issue
24's 32K-prefill target (invariant prefill +8.4 % over the fast mode against +34.6 % for the union
walk; decode step 0.5-1 % slower), and its bits are as designed (20 GRPO steps bitwise on-policy,
tests/gpu; docs/benchmarks.md). Dense layers and ``sparse_impl="union"`` keep ``inv_attn_kernel``.
Spec §3.5.

Governing idea: an "entry" is one (token t, KV head g, top-k slot j) with its block b =
topk_ids[t, g, j]. Its partial (the block-normalised output of t's RH query heads over b's
``ps`` keys, causal cut at t's position, and its base-2 log-sum-exp) is computed from t's own query
rows and one K/V page: in a tensor-core tile of ``TOK`` entries x ``RHP`` rows a row's QK and PV
dots do not depend on the tile's other rows (the premise of invariant_attention's rule 2), the QK
reduction is fixed by d and the PV reduction by ps. A token's output is
``msa_paged_attention.kv_major_merge_kernel``'s fold of its valid, distinct partials in slot
order j: a function of the token's own partials. So:
- prefill rows: ``msa_paged_attention.prefill_kv_major`` as it is (the fast path's
  ``kv_seg_attn_kernel``: entries bucketed by page, each page's K/V loaded once per segment, entries
  streamed TOK at a time), at every prefill length (no choice by size), with one set of launch
  constants (``PAGE_PARTIALS_LAUNCH``). The batch, the chunking, the pass size and the sort order
  only move an entry to another tile or another row of a tile;
- decode rows: ``pp_decode_kernel``, one program per entry (skipping -1, ids past the position
  and repeats exactly as the merge's validity test does): the page from the block table, its K/V
  loaded, then the SAME loop helper as kv_seg (``kv_seg_entries``, hence ``_kv_seg_qk`` /
  ``_kv_seg_finish``) on a one-entry segment: the entry's RH rows first in the same
  ``[TOK * RHP, d]`` tile, the other rows zero and masked, the same constexprs, warps and stages;
  the partial lands at the same entry index; then the same merge launch. A decode token's output
  is therefore the one its position gets as a prefill row.
The bits differ from the union walk's (another reduction order: per-page partials rounded to the
partial dtype, merged by LSE weights), so a run keeps one choice for the engine and the trainer's
scorer (one switch, read at each call).

Partials: per token ``[G, K, RH, d]`` in ``kv_major_partial_dtype`` then ``[G, K, RH]`` fp32 LSEs
(kernels/paged_layout.py). Prefill passes hold ``kv_major_capacity(scratch)`` tokens of the caller's
scratch (the engine's / the scorer's; an empty scratch: passes of ``KV_CHUNK_TOKENS`` in a buffer
allocated per call, as the fast path without one); decode takes the scratch's head when it holds the
decode tokens, else allocates tokens x G x K entries. Decode is CUDA-graph capturable: the grid
(tokens x G x K programs) and the buffers are sized by the token count only; two launches, no torch
glue (each program builds its one-entry id / position vectors itself), no host sync.

Shape legend: T query tokens, G KV heads, RH = nh / G query heads per KV head (RHP its power of
two), K top-k slots, d head dim, ps page size.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from m3_kernels.msa_checks import next_pow2
from m3_kernels.msa_paged_attention import (
    KV_SEG_LOOPS,
    KV_SEG_PIPELINE_STAGES,
    KV_SEGMENT,
    LOG2E,
    kv_major_capacity,
    kv_major_merge_kernel,
    kv_major_partial_buffers,
    kv_seg_entries,
    prefill_kv_major,
)
from m3_kernels.paged_layout import PagedMetadata

# The one set of launch constants of kv_seg_attn_kernel (prefill), pp_decode_kernel (decode) and
# kv_major_merge_kernel (both), whatever the token count (msa_paged_attention's prefill_config
# knobs): ``tok`` entries per tile (raised to 16 dot rows for RH <= 2, as the fast path does: 64
# rows at M3's 16 heads per KV head), 4 warps (the fast default for <= 64 rows), ``seg`` entries
# per prefill program, the "deferred" segment loop (the fast 16-bit default; decode runs the same
# loop helper, so fp32 takes it too, the same bits as the fp32 prefetch loop:
# tests/test_kernels_msa.py), 4 merge warps. IEEE dots for fp32 inputs, tensor-core dots otherwise.
PAGE_PARTIALS_LAUNCH = {"tok": 4, "num_warps": 4, "seg": KV_SEGMENT, "prefetch": "deferred", "merge_warps": 4}
# Pipeline stages by IEEE: 16-bit inputs the fast default; fp32 one (the fast fp32 loop's; its
# tiles are twice as large in shared memory). Load scheduling only.
PAGE_PARTIALS_STAGES = {False: KV_SEG_PIPELINE_STAGES, True: 1}


def page_partials_config(rh: int, ieee: bool) -> dict:
    """The launch constants for RH query heads per KV head and IEEE (fp32) dots: ``PAGE_PARTIALS_LAUNCH``
    with ``tok`` raised to >= 16 dot rows and ``num_stages``; a ``prefill_config`` of
    msa_paged_attention (whose prefill reads it as given: its own tok rule leaves this tok as it is)."""
    cfg = dict(PAGE_PARTIALS_LAUNCH)
    cfg["tok"] = max(cfg["tok"], triton.cdiv(16, next_pow2(rh)))
    cfg["num_stages"] = PAGE_PARTIALS_STAGES[ieee]
    assert cfg["prefetch"] in KV_SEG_LOOPS, "the decode kernel runs the pipelined segment loop"
    return cfg


@triton.jit
def pp_decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    bt_ptr,
    pos_ptr,
    sel_ptr,
    opart_ptr,
    lse_ptr,
    qk_scale,
    dql,
    topk,
    stride_qt,
    stride_qh,
    stride_kp,
    stride_kg,
    stride_ko,
    stride_bt_r,
    G: tl.constexpr,
    RH: tl.constexpr,
    RHP: tl.constexpr,
    D: tl.constexpr,
    PS: tl.constexpr,
    TOK: tl.constexpr,
    SEG: tl.constexpr,
    SEGP: tl.constexpr,
    KP: tl.constexpr,
    IEEE: tl.constexpr,
    DEFERRED: tl.constexpr,
):
    """One decode entry e = (t * G + g) * topk + j: the partial opart[e] / lse[e] of token t's KV head g
    over its slot-j block, computed as kv_seg_attn_kernel computes a prefill entry.

    sel: contiguous [T, G, K] int32. Entries the merge ignores (-1, past the position, a block
    repeated from an earlier slot) return before any load of K/V."""
    e = tl.program_id(0)
    t = e // (G * topk)
    g = (e // topk) % G
    j = e % topk
    p = tl.load(pos_ptr + t)
    b = tl.load(sel_ptr + e)
    offs_k = tl.arange(0, KP)
    earlier = tl.load(sel_ptr + (e - j) + offs_k, mask=offs_k < j, other=-1)  # slots 0..j-1
    dup = tl.sum(tl.where(earlier == b, 1, 0), axis=0)
    if (b < 0) | (b > p // PS) | (dup > 0):
        return
    page = tl.load(bt_ptr + (t // dql) * stride_bt_r + b)
    offs_m = tl.arange(0, TOK * RHP)  # row m = entry m // RHP (only entry 0 here), head m % RHP
    h = offs_m % RHP
    offs_d = tl.arange(0, D)
    offs_o = tl.arange(0, PS)
    koff = page.to(tl.int64) * stride_kp + g * stride_kg + offs_o[:, None] * stride_ko + offs_d[None, :]
    k = tl.load(k_ptr + koff)  # [PS, D]
    v = tl.load(v_ptr + koff)
    # NOTE: kv_seg_attn_kernel's own loop (same tile, dots, softmax and store) on a segment of one
    # entry, whose id and position vectors are built here with the values the prefill's loads give
    # (lane 0 = this entry, the others masked): no host-side id / position tensors
    offs_s = tl.arange(0, SEGP)
    perm_v = tl.where(offs_s == 0, e, 0)
    epos_v = tl.where(offs_s == 0, p.to(tl.int32), -1)
    kv_seg_entries(
        q_ptr, v, k, perm_v, epos_v, 1, opart_ptr, lse_ptr, qk_scale, 0, topk, b, g, h, offs_m, offs_d, offs_o,
        stride_qt, stride_qh, G, RH, RHP, D, PS, TOK, SEG, IEEE, DEFERRED,
    )  # fmt: skip


def page_partials_attention(
    q: torch.Tensor,
    k_cache_l: torch.Tensor,
    v_cache_l: torch.Tensor,
    meta: PagedMetadata,
    scale: float,
    sel: torch.Tensor,
    out: torch.Tensor,
    scratch: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sparse paged attention by per-page partials into ``out`` (module docstring); returns out.

    q: [T, nh, d] (decode rows first); k_cache_l, v_cache_l: [P, G, ps, d]; sel: contiguous int32
    [T, G, K] block ids (-1 = empty; ids past a token's block and repeats ignored); out: [T, nh, d]
    like q; scratch: None or the KV-major uint8 buffer (kernels/paged_layout.py). The caller
    (``invariant_paged_attention``) has checked the inputs. Launches, decode rows: ``pp_decode_kernel``
    (grid decode tokens x G x K) and ``kv_major_merge_kernel`` (decode tokens x G); prefill rows:
    ``prefill_kv_major`` (per pass: torch glue, ``kv_seg_attn_kernel``, the merge).
    """
    _, nh, d = q.shape
    g, ps = k_cache_l.shape[1], k_cache_l.shape[2]
    topk = sel.shape[2]
    rh = nh // g
    rhp = next_pow2(rh)
    kp = max(next_pow2(topk), 2)
    ieee = q.dtype == torch.float32
    qk_scale = float(scale) * LOG2E
    cfg = page_partials_config(rh, ieee)
    cap = kv_major_capacity(scratch, nh, d, topk, q.dtype)
    if cap == 0:  # a scratch that holds no token (the engine's "off"): this path cannot be off
        scratch, cap = None, None
    td = min(q.shape[0], meta.num_decodes * meta.decode_query_len)
    if td > 0:
        # the scratch's head when it holds the decode tokens, else buffers of their size
        opart, lse = kv_major_partial_buffers(
            scratch if cap is not None and cap >= td else None, td, g, topk, rh, d, q.dtype, q.device
        )
        pp_decode_kernel[(td * g * topk,)](
            q,
            k_cache_l,
            v_cache_l,
            meta.block_tables,
            meta.positions,
            sel,
            opart,
            lse,
            qk_scale,
            meta.decode_query_len,
            topk,
            q.stride(0),
            q.stride(1),
            k_cache_l.stride(0),
            k_cache_l.stride(1),
            k_cache_l.stride(2),
            meta.block_tables.stride(0),
            G=g,
            RH=rh,
            RHP=rhp,
            D=d,
            PS=ps,
            TOK=cfg["tok"],
            SEG=cfg["seg"],
            SEGP=next_pow2(cfg["seg"]),
            KP=kp,
            IEEE=ieee,
            DEFERRED=cfg["prefetch"] == "deferred",
            num_warps=cfg["num_warps"],
            num_stages=cfg["num_stages"],
        )
        # the prefill's merge launch (msa_paged_attention.prefill_kv_major), decode tokens from t = 0
        kv_major_merge_kernel[(td, g)](
            opart,
            lse,
            sel[:td],
            meta.positions,
            out,
            0,
            topk,
            out.stride(0),
            out.stride(1),
            G=g,
            RH=rh,
            RHP=rhp,
            D=d,
            PS=ps,
            KP=kp,
            num_warps=cfg["merge_warps"],
        )
    # prefill rows (none: returns at once); its passes may reuse the scratch: stream-ordered after the merge
    prefill_kv_major(q, k_cache_l, v_cache_l, meta, sel, out, qk_scale, rh, ieee, cfg, scratch, cap)
    return out

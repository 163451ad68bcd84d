"""PyTorch references of the MSA ops over the paged caches (spec §3.4-3.5, layout: engine/paged_cache.py).

Governing idea: gather each row's pages back into a contiguous ``[R, nb*ps, ...]`` key array in
which slot u holds position u, pad the flat query tokens to ``[R, max_query_len]``, and reuse the
model's own block-scoring, selection and masked-attention functions. Exact, simple, and the CPU
path of the engine; the Triton kernels beside this file must match it.

Shape legend: T query tokens, R rows, P pages, ps page size, G KV heads (= index heads),
nh query heads, d head dim, di index dim, K top-k blocks.
"""

from __future__ import annotations

import torch

from m3_rollout.engine.paged_cache import PagedMetadata
from m3_rollout.model.attention import masked_gqa_attention
from m3_rollout.model.indexer import block_scores, select_blocks, selected_key_mask


def _token_rows(meta: PagedMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """(row [T], offset inside the row's query chunk [T]) of every flat query token."""
    qsl = meta.query_start_loc.long()
    lens = qsl[1:] - qsl[:-1]  # [R]
    row = torch.repeat_interleave(torch.arange(meta.num_rows, device=qsl.device), lens)  # [T]
    off = torch.arange(row.shape[0], device=qsl.device) - qsl[row]
    return row, off


def pad_queries(x: torch.Tensor, meta: PagedMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat [T, ...] -> padded [R, Sq, ...] (Sq = max_query_len) and padded positions [R, Sq].

    Padding query slots get position 0 (they attend to key 0 only; their outputs are dropped).
    """
    row, off = _token_rows(meta)
    sq = meta.max_query_len
    out = x.new_zeros((meta.num_rows, sq) + tuple(x.shape[1:]))
    out[row, off] = x
    pos = torch.zeros(meta.num_rows, sq, dtype=torch.long, device=x.device)
    pos[row, off] = meta.positions.long()
    return out, pos


def unpad_queries(x: torch.Tensor, meta: PagedMetadata) -> torch.Tensor:
    """Padded [R, Sq, ...] -> flat [T, ...]."""
    row, off = _token_rows(meta)
    return x[row, off]


def gather_pages(cache_l: torch.Tensor, meta: PagedMetadata, head_axis: bool) -> torch.Tensor:
    """A layer's pages in logical order per row.

    cache_l: [P, G, ps, d] (head_axis=True) or [P, ps, di]. Returns [R, nb*ps, G, d] or
    [R, nb*ps, di] with nb = ceil(max_seq_len / ps); slot u holds position u. Slots past a row's
    seq_len hold arbitrary data (callers mask them by causality).
    """
    ps = cache_l.shape[2] if head_axis else cache_l.shape[1]
    nb = -(-meta.max_seq_len // ps)
    bt = meta.block_tables[:, :nb].long().clamp_min(0)  # [R, nb]
    pages = cache_l[bt]  # [R, nb, G, ps, d] or [R, nb, ps, di]
    r = bt.shape[0]
    if head_axis:
        return pages.permute(0, 1, 3, 2, 4).reshape(r, nb * ps, cache_l.shape[1], cache_l.shape[3])
    return pages.reshape(r, nb * ps, cache_l.shape[2])


def index_topk_ref(
    iq: torch.Tensor,
    index_cache_l: torch.Tensor,
    meta: PagedMetadata,
    topk: int,
    init_blocks: int = 0,
    local_blocks: int = 1,
) -> torch.Tensor:
    """Lightning-indexer block selection over the paged index-key cache (spec §3.4).

    iq: [T, G, di] post-norm post-RoPE index queries; index_cache_l: [P, ps, di] (already holding
    this step's keys). Returns [T, G, K] int32: per query token and index head the selected block
    ids (forced local/init blocks first, then by score desc, ties to the lower id), -1 padding.
    """
    ps = index_cache_l.shape[1]
    q, pos = pad_queries(iq, meta)  # [R, Sq, G, di], [R, Sq]
    keys = gather_pages(index_cache_l, meta, head_axis=False)  # [R, Sk, di]
    scores = block_scores(q, keys, pos, ps)  # [R, G, Sq, nb]
    sel = select_blocks(scores, pos, topk, ps, init_blocks, local_blocks)  # [R, G, Sq, K]
    return unpad_queries(sel.permute(0, 2, 1, 3), meta).to(torch.int32)  # [T, G, K]


def paged_attention_ref(
    q: torch.Tensor,
    k_cache_l: torch.Tensor,
    v_cache_l: torch.Tensor,
    meta: PagedMetadata,
    scale: float,
    topk_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """GQA attention of flat query tokens over paged K/V (spec §3.5; dense causal when topk_ids is None).

    q: [T, nh, d]; k_cache_l, v_cache_l: [P, G, ps, d]; topk_ids: [T, G, K] int block ids (-1 =
    empty) or None. Softmax in fp32 (fp64 for fp64 inputs). Returns [T, nh, d] in q.dtype.
    """
    ps = k_cache_l.shape[2]
    qp, pos = pad_queries(q, meta)  # [R, Sq, nh, d]
    k = gather_pages(k_cache_l, meta, head_axis=True)  # [R, Sk, G, d]
    v = gather_pages(v_cache_l, meta, head_axis=True)
    sk = k.shape[1]
    if topk_ids is None:
        kp = torch.arange(sk, device=q.device)
        mask = (kp[None, None, :] <= pos[:, :, None])[:, None]  # [R, 1, Sq, Sk]
    else:
        sel, _ = pad_queries(topk_ids.long(), meta)  # [R, Sq, G, K]
        sel = sel.permute(0, 2, 1, 3)  # [R, G, Sq, K]
        mask = selected_key_mask(sel, pos, sk, ps)  # [R, G, Sq, Sk]
    out = masked_gqa_attention(qp, k, v, mask, scale)  # [R, Sq, nh, d]
    return unpad_queries(out, meta)

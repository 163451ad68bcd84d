"""PyTorch references of the MSA ops over the paged caches (spec §3.4-3.5, layout: kernels/paged_layout.py).

Governing idea: gather each row's pages back into a contiguous ``[R, nb*ps, ...]`` key array in
which slot u holds position u, pad the flat query tokens to ``[R, max_query_len]``, and reuse the
model's own block-scoring, selection and masked-attention functions. Exact, simple, and the CPU
path of the engine (``engine/ops.py`` puts ``paged_attention_ref`` / ``msa_attention_ref`` into the
``PagedOps`` table off CUDA); the Triton kernels of kernels/msa_*.py must match it.

Shape legend: T query tokens, R rows, P pages, ps page size, G KV heads (= index heads),
nh query heads, d head dim, di index dim, K top-k blocks.
"""

from __future__ import annotations

import torch

from m3_kernels.paged_layout import FP8IndexCache, PagedMetadata, dequantize_index_keys, quantize_index_keys
from m3_rollout.model.attention import masked_gqa_attention
from m3_rollout.model.indexer import block_scores, select_blocks, selected_key_mask
from m3_rollout.model.numerics import compute_dtype


def token_rows(meta: PagedMetadata) -> tuple[torch.Tensor, torch.Tensor]:
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
    if meta.num_tokens == meta.num_rows * meta.max_query_len == meta.num_rows:  # plain decode: no padding
        return x[:, None], meta.positions.long()[:, None]
    row, off = token_rows(meta)
    sq = meta.max_query_len
    out = x.new_zeros((meta.num_rows, sq) + tuple(x.shape[1:]))
    out[row, off] = x
    pos = torch.zeros(meta.num_rows, sq, dtype=torch.long, device=x.device)
    pos[row, off] = meta.positions.long()
    return out, pos


def unpad_queries(x: torch.Tensor, meta: PagedMetadata) -> torch.Tensor:
    """Padded [R, Sq, ...] -> flat [T, ...]."""
    if meta.num_tokens == meta.num_rows * meta.max_query_len == meta.num_rows:
        return x[:, 0]
    row, off = token_rows(meta)
    return x[row, off]


def gather_pages(
    cache_l: torch.Tensor, meta: PagedMetadata, head_axis: bool, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """A layer's pages in logical order per row.

    cache_l: [P, G, ps, d] (head_axis=True) or [P, ps, di]. Returns [R, nb*ps, G, d] or
    [R, nb*ps, di] with nb = ceil(max_seq_len / ps), in ``dtype`` (default the cache's); slot u
    holds position u. Slots past a row's seq_len hold arbitrary data (callers mask them by
    causality). NOTE: the [R, nb*ps, G, d] result is a view of head-major [R, G, nb*ps, d]
    memory, the layout ``masked_gqa_attention`` multiplies without another copy.
    """
    ps = cache_l.shape[2] if head_axis else cache_l.shape[1]
    nb = -(-meta.max_seq_len // ps)
    bt = meta.block_tables[:, :nb].long().clamp_min(0)  # [R, nb]
    r = bt.shape[0]
    pages = cache_l.index_select(0, bt.reshape(-1)).view(
        r, nb, *cache_l.shape[1:]
    )  # [R, nb, G, ps, d] | [R, nb, ps, di]
    dtype = dtype or cache_l.dtype
    if head_axis:
        g, d = cache_l.shape[1], cache_l.shape[3]
        out = torch.empty(r, g, nb, ps, d, dtype=dtype, device=cache_l.device)
        out.copy_(pages.permute(0, 2, 1, 3, 4))  # [R, G, nb, ps, d]
        return out.view(r, g, nb * ps, d).permute(0, 2, 1, 3)  # [R, nb*ps, G, d] view
    return pages.reshape(r, nb * ps, cache_l.shape[2]).to(dtype)


def split_decodes(meta: PagedMetadata) -> tuple[PagedMetadata, PagedMetadata] | None:
    """(decode rows' metadata, prefill rows' metadata) when a step mixes both, else None.

    NOTE: the references pad every row's queries to ``max_query_len``; in a mixed step that pads
    each one-token decode row to the longest prefill chunk. Running the two parts separately is
    exact (rows are independent) and keeps a decode batch's cost independent of a prefill
    sharing its step. Tokens are decode-first, so outputs concatenate in token order.
    """
    nd, r = meta.num_decodes, meta.num_rows
    if nd == 0 or nd == r:
        return None
    qsl = meta.query_start_loc
    td = nd * meta.decode_query_len
    d_seq, p_seq = meta.seq_lens[:nd], meta.seq_lens[nd:]
    dec = PagedMetadata(
        meta.positions[:td],
        meta.slot_mapping[:td],
        meta.block_tables[:nd],
        meta.context_lens[:nd],
        d_seq,
        qsl[: nd + 1],
        nd,
        meta.decode_query_len,
        meta.decode_query_len,
        int(d_seq.max()),
    )
    pre = PagedMetadata(
        meta.positions[td:],
        meta.slot_mapping[td:],
        meta.block_tables[nd:],
        meta.context_lens[nd:],
        p_seq,
        qsl[nd:] - qsl[nd],
        0,
        meta.decode_query_len,
        meta.max_query_len,
        int(p_seq.max()),
    )
    return dec, pre


def gather_index_keys(index_cache_l: torch.Tensor | FP8IndexCache, meta: PagedMetadata, dtype: torch.dtype):
    """[R, nb*ps, di] index keys per row in logical order (``gather_pages``), in ``dtype``; an
    ``FP8IndexCache``'s keys dequantized (codes x per-token scale, exact in fp32)."""
    if not isinstance(index_cache_l, FP8IndexCache):
        return gather_pages(index_cache_l, meta, head_axis=False, dtype=dtype)
    codes = gather_pages(index_cache_l.keys, meta, head_axis=False)  # [R, Sk, di] float8_e4m3fn
    scales = gather_pages(index_cache_l.scales[..., None], meta, head_axis=False)[..., 0]  # [R, Sk]
    return dequantize_index_keys(codes, scales, dtype)


def index_topk_ref(
    iq: torch.Tensor,
    index_cache_l: torch.Tensor | FP8IndexCache,
    meta: PagedMetadata,
    topk: int,
    init_blocks: int = 0,
    local_blocks: int = 1,
) -> torch.Tensor:
    """Lightning-indexer block selection over the paged index-key cache (spec §3.4).

    iq: [T, G, di] post-norm post-RoPE index queries; index_cache_l: [P, ps, di] (already holding
    this step's keys), or an ``FP8IndexCache``: scores over the dequantized keys, and over the
    dequantized queries (each (token, head) row quantized as a key) when it quantizes queries.
    Returns [T, G, K] int32: per query token and index head the selected block ids (forced
    local/init blocks first, then by score desc, ties to the lower id), -1 padding.
    """
    parts = split_decodes(meta)
    if parts is not None:
        td = parts[0].num_tokens
        return torch.cat(
            [
                index_topk_ref(iq[:td], index_cache_l, parts[0], topk, init_blocks, local_blocks),
                index_topk_ref(iq[td:], index_cache_l, parts[1], topk, init_blocks, local_blocks),
            ]
        )
    scores, pos = index_block_scores_ref(iq, index_cache_l, meta)  # [R, G, Sq, nb], [R, Sq]
    sel = select_blocks(scores, pos, topk, index_page_size(index_cache_l), init_blocks, local_blocks)  # [R, G, Sq, K]
    return unpad_queries(sel.permute(0, 2, 1, 3), meta).to(torch.int32)  # [T, G, K]


def index_page_size(index_cache_l: torch.Tensor | FP8IndexCache) -> int:
    """Tokens per page (= MSA block) of a paged index-key cache, plain or FP8."""
    return index_cache_l.shape[1] if isinstance(index_cache_l, torch.Tensor) else index_cache_l.page_size


def index_block_scores_ref(
    iq: torch.Tensor, index_cache_l: torch.Tensor | FP8IndexCache, meta: PagedMetadata
) -> tuple[torch.Tensor, torch.Tensor]:
    """The lightning indexer's block scores over the paged index-key cache (spec §3.4), per row
    padded to max_query_len (``pad_queries``): ([R, G, Sq, nb] ``model.indexer.block_scores`` of
    the row's keys in logical order, [R, Sq] query positions).

    iq: [T, G, di] post-norm post-RoPE index queries; index_cache_l as ``index_topk_ref`` takes it
    (an ``FP8IndexCache``: dequantized keys, and dequantized queries, each (token, head) row
    quantized as a key, when it quantizes queries). Entry b of a token at position p: the max over
    keys u <= p of block b (b <= p // ps; -inf past it), in the compute dtype."""
    cdt = compute_dtype(iq.dtype)
    if isinstance(index_cache_l, FP8IndexCache) and index_cache_l.quantize_queries:
        iq = dequantize_index_keys(*quantize_index_keys(iq), cdt)
    q, pos = pad_queries(iq, meta)  # [R, Sq, G, di], [R, Sq]
    keys = gather_index_keys(index_cache_l, meta, cdt)  # [R, Sk, di]
    return block_scores(q, keys, pos, index_page_size(index_cache_l)), pos


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
    parts = split_decodes(meta)
    if parts is not None:
        td = parts[0].num_tokens
        ids = (None, None) if topk_ids is None else (topk_ids[:td], topk_ids[td:])
        return torch.cat(
            [
                paged_attention_ref(q[:td], k_cache_l, v_cache_l, parts[0], scale, ids[0]),
                paged_attention_ref(q[td:], k_cache_l, v_cache_l, parts[1], scale, ids[1]),
            ]
        )
    ps = k_cache_l.shape[2]
    qp, pos = pad_queries(q, meta)  # [R, Sq, nh, d]
    cdt = compute_dtype(q.dtype)
    k = gather_pages(k_cache_l, meta, head_axis=True, dtype=cdt)  # [R, Sk, G, d]
    v = gather_pages(v_cache_l, meta, head_axis=True, dtype=cdt)
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


def msa_attention_ref(
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
    """Sparse-layer MSA attention: indexer + top-k + sparse GQA attention in one call (spec §3.4-3.5).

    q: [T, nh, d]; iq: [T, G, di]; k_cache_l, v_cache_l: [P, G, ps, d]; index_cache_l: [P, ps, di]
    or an ``FP8IndexCache`` (already holding this step's keys); meta: ``PagedMetadata`` (decode rows first). Returns
    [T, nh, d] in q.dtype: ``paged_attention_ref(q, ..., index_topk_ref(iq, ...))``, the reference
    of ``m3_kernels.msa_fused_decode.msa_attention``. sel_out: optional [T, G, K] integer tensor
    (any strides; the engine's block-selection record) that receives the selection.
    """
    sel = index_topk_ref(iq, index_cache_l, meta, topk, init_blocks, local_blocks)  # [T, G, K]
    if sel_out is not None:
        sel_out.copy_(sel)
    return paged_attention_ref(q, k_cache_l, v_cache_l, meta, scale, sel)

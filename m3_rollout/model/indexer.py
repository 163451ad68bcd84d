"""Lightning-indexer block scoring and top-k block selection (spec §3.4), as pure functions.

Governing idea: every key block of `block_size` tokens gets one score per (index head, query):
the max over the block's causal keys of <iq, ik>. Each query keeps its forced blocks (the
`local_blocks` most recent ones, ending at its own block, and the first `init_blocks`) plus the
best-scoring others, up to `topk` blocks; index head g's choice applies to KV head g.

Shape legend:
  B   batch rows                  Sq  query tokens per row       Sk  key slots per row
  G   index heads (= KV heads)    D   index head dim             nb  key blocks (ceil(span / block))
  K   top-k blocks per (head, query)

Key slot u holds absolute position u unless `k_pos` gives explicit key positions (the no-cache
path, where slot s holds the token at positions[b, s]). Block id of a key = position // block_size.
"""

from __future__ import annotations

import torch

from .numerics import compute_dtype

# vLLM replaces NaN block scores with this constant before top-k (spec §3.4 step 1).
NAN_SCORE = -1e30


def _key_blocks(k_pos: torch.Tensor | None, sk: int, block_size: int, device: torch.device) -> tuple[torch.Tensor, int]:
    """Block id per key ([Sk] or [B, Sk]) and the number of blocks nb spanned by the keys."""
    if k_pos is None:
        return torch.arange(sk, device=device) // block_size, -(-sk // block_size)
    # NOTE: host sync; only the no-cache path passes k_pos.
    return k_pos // block_size, int(k_pos.max()) // block_size + 1


def block_scores(
    index_q: torch.Tensor,
    index_k: torch.Tensor,
    q_pos: torch.Tensor,
    block_size: int,
    k_pos: torch.Tensor | None = None,
) -> torch.Tensor:
    """Max-over-block index scores.

    index_q: [B, Sq, G, D]; index_k: [B, Sk, D] (one shared key head); q_pos: [B, Sq] int
    absolute query positions; k_pos: optional [B, Sk] int key positions (default: slot index).
    Returns [B, G, Sq, nb], fp32 (fp64 for fp64 inputs): for block b with b*block_size <= q_pos
    the max of <iq, ik[u]> over keys u of block b with pos(u) <= q_pos (no 1/sqrt(D) scale,
    spec §3.4), NaN replaced by -1e30; -inf for blocks starting after q_pos (not candidates),
    and for candidate blocks holding no key (only possible with k_pos).
    """
    bsz, sq, g, d = index_q.shape
    sk = index_k.shape[1]
    cdt = compute_dtype(index_q.dtype)
    key_block, nb = _key_blocks(k_pos, sk, block_size, index_q.device)
    ik = index_k.to(cdt)
    if k_pos is None and nb * block_size > sk:
        # Pad the (small) keys to whole blocks rather than the (large) scores; the padded slots are
        # masked to -inf with the future keys.
        ik = torch.nn.functional.pad(ik, (0, 0, 0, nb * block_size - sk))  # [B, nb*bs, D]
    iq = index_q.to(cdt).transpose(1, 2).reshape(bsz, g * sq, d)  # [B, G*Sq, D]
    s = torch.bmm(iq, ik.transpose(1, 2)).view(bsz, g, sq, -1)  # [B, G, Sq, Sk']
    if k_pos is None:
        slot = torch.arange(ik.shape[1], device=index_q.device)  # [Sk']
        s.masked_fill_(((slot[None, None, :] > q_pos[:, :, None]) | (slot >= sk))[:, None], float("-inf"))
        out = s.view(bsz, g, sq, nb, block_size).amax(dim=-1)  # [B, G, Sq, nb]
    else:
        s.masked_fill_((k_pos[:, None, :] > q_pos[:, :, None])[:, None], float("-inf"))
        idx = key_block[:, None, None, :].expand(bsz, g, sq, sk)
        out = torch.full((bsz, g, sq, nb), float("-inf"), dtype=cdt, device=s.device)
        out = out.scatter_reduce(-1, idx, s, reduce="amax", include_self=True)  # [B, G, Sq, nb]
    out = out.masked_fill(out.isnan(), NAN_SCORE)
    block_start = torch.arange(nb, device=out.device) * block_size  # [nb]
    not_candidate = block_start[None, None, :] > q_pos[:, :, None]  # [B, Sq, nb]
    return out.masked_fill(not_candidate[:, None], float("-inf"))


def select_blocks(
    scores: torch.Tensor,
    q_pos: torch.Tensor,
    topk: int,
    block_size: int,
    init_blocks: int,
    local_blocks: int,
) -> torch.Tensor:
    """Top-k block ids per (index head, query), forced blocks first.

    scores: [B, G, Sq, nb] from `block_scores`; q_pos: [B, Sq].
    Query t has candidates 0..n-1, n = q_pos // block_size + 1. Forced: blocks
    max(0, n - local_blocks)..n-1 and blocks < init_blocks. The rest of the K = topk slots go to
    the other candidates by score, descending, ties to the lower block id (stable sort: fully
    deterministic). Returns [B, G, Sq, K] int64: slots 0..min(K, n)-1 hold distinct block ids
    (forced ones first, lower id first among them), later slots -1.
    """
    bsz, g, sq, nb = scores.shape
    n_cand = (q_pos // block_size + 1)[:, :, None]  # [B, Sq, 1]
    bid = torch.arange(nb, device=scores.device)  # [nb]
    cand = bid < n_cand  # [B, Sq, nb]
    forced = cand & ((bid >= n_cand - local_blocks) | (bid < init_blocks))  # [B, Sq, nb]
    key = scores.masked_fill(forced[:, None], float("inf")).masked_fill(~cand[:, None], float("-inf"))
    # NOTE: a stable descending sort keeps equal keys in ascending block order, which gives the
    # "ties to the lower block id" rule (MSA reference, spec §3.4 step 5) and also keeps any
    # -inf candidate ahead of the (-inf, higher-id) non-candidates.
    order = torch.sort(key, dim=-1, descending=True, stable=True).indices  # [B, G, Sq, nb]
    sel = order[..., : min(topk, nb)]  # [B, G, Sq, min(K, nb)]
    sel = sel.masked_fill(sel >= n_cand[:, None], -1)
    if sel.shape[-1] < topk:
        sel = torch.nn.functional.pad(sel, (0, topk - sel.shape[-1]), value=-1)  # [B, G, Sq, K]
    return sel


def selected_key_mask(
    selected: torch.Tensor,
    q_pos: torch.Tensor,
    sk: int,
    block_size: int,
    k_pos: torch.Tensor | None = None,
) -> torch.Tensor:
    """Which key slots each (index head, query) may attend to.

    selected: [B, G, Sq, K] block ids (-1 = empty slot); q_pos: [B, Sq]; sk: number of key slots;
    k_pos: optional [B, Sk] key positions (default: slot index). Returns bool [B, G, Sq, Sk]:
    key in a selected block AND pos(key) <= q_pos.
    """
    bsz, g, sq, _ = selected.shape
    key_block, nb = _key_blocks(k_pos, sk, block_size, selected.device)
    # One-hot over blocks; -1 slots land in a spare column nb that no key maps to.
    hot = torch.zeros(bsz, g, sq, nb + 1, dtype=torch.bool, device=selected.device)
    hot.scatter_(-1, selected.masked_fill(selected < 0, nb), True)  # [B, G, Sq, nb+1]
    kb = key_block.expand(bsz, sk) if key_block.dim() == 1 else key_block  # [B, Sk]
    in_block = hot.gather(-1, kb[:, None, None, :].expand(bsz, g, sq, sk))  # [B, G, Sq, Sk]
    kp = torch.arange(sk, device=selected.device)[None, :] if k_pos is None else k_pos  # [1|B, Sk]
    causal = kp[:, None, None, :] <= q_pos[:, None, :, None]  # [B, 1, Sq, Sk]
    return in_block & causal

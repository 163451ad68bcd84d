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


def forced_blocks(q_pos: torch.Tensor, block_size: int, init_blocks: int, local_blocks: int) -> torch.Tensor:
    """The blocks every query must keep (spec §3.4): [B, Sq, local_blocks + init_blocks] int64 ids,
    the local ones (own block first, going back) then the init ones, -1 where a block does not
    exist (before block 0, or an init block past the query's own block)."""
    n_cand = (q_pos // block_size + 1)[..., None]  # [B, Sq, 1]
    local = n_cand - 1 - torch.arange(local_blocks, device=q_pos.device)  # [B, Sq, local]
    init = torch.arange(init_blocks, device=q_pos.device).expand(*q_pos.shape, init_blocks)  # [B, Sq, init]
    ids = torch.cat([local, init], dim=-1)
    return ids.masked_fill((ids < 0) | (ids >= n_cand), -1)


def replayed_blocks(
    own: torch.Tensor,
    recorded: torch.Tensor,
    q_pos: torch.Tensor,
    block_size: int,
    init_blocks: int,
    local_blocks: int,
) -> torch.Tensor:
    """The block choice of a replaying layer: the recorded blocks where a record exists.

    own: [B, G, Sq, K] from ``select_blocks``; recorded: [B, G, Sq, K] int block ids of another
    computation (the rollout engine's), -1 = empty slot; a row that is all -1 has no record and
    keeps ``own``. Recorded ids that are not causal candidates of the query (>= q_pos //
    block_size + 1) are dropped, and the forced local / init blocks are added, so replay can
    neither look ahead nor lose the forced blocks (for a record the engine made, both changes are
    no-ops). Returns [B, G, Sq, K + local_blocks + init_blocks] int64 block ids, -1 padding (a set:
    a repeated id counts once in ``selected_key_mask``).
    """
    rec = recorded.long()
    has = (rec >= 0).any(dim=-1, keepdim=True)  # [B, G, Sq, 1]
    n_cand = (q_pos // block_size + 1)[:, None, :, None]  # [B, 1, Sq, 1]
    rec = rec.masked_fill(rec >= n_cand, -1)
    forced = forced_blocks(q_pos, block_size, init_blocks, local_blocks)[:, None].expand(-1, rec.shape[1], -1, -1)
    replay = torch.cat([rec, forced], dim=-1)  # [B, G, Sq, K + F]
    pad = torch.nn.functional.pad(own.long(), (0, forced.shape[-1]), value=-1)
    return torch.where(has, replay, pad)


def selection_agreement(own: torch.Tensor, recorded: torch.Tensor) -> torch.Tensor:
    """How often a layer's own top-k equals a recorded one (the agreement metric's counts).

    own, recorded: [..., K] int block ids, -1 = empty slot; rows of ``recorded`` that are all -1
    are not counted. Returns float64 [3]: (rows compared, rows whose block SETS are equal, sum
    over those rows of |own ∩ recorded| / |recorded|).
    """
    rec = recorded.long()
    valid = (rec >= 0).any(dim=-1)  # [...]
    o = torch.sort(own.long().masked_fill(own < 0, 1 << 40), dim=-1).values
    r = torch.sort(rec.masked_fill(rec < 0, 1 << 40), dim=-1).values
    equal = (o == r).all(dim=-1) & valid
    hit = ((rec[..., :, None] == own.long()[..., None, :]).any(dim=-1) & (rec >= 0)).sum(dim=-1)  # [...]
    size = (rec >= 0).sum(dim=-1).clamp(min=1)
    overlap = torch.where(valid, hit.double() / size.double(), 0.0)
    return torch.stack([valid.sum().double(), equal.sum().double(), overlap.sum()])

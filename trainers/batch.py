"""TrainBatch: padded token-level tensors crossing from rollouts into the trainer.

Worked padded example (2 samples, pad id 0, lengths 5 and 3)::

    token_ids         [[p, p, g, g, g],      loss_mask [[0, 0, 1, 1, 1],
                       [p, g, g, 0, 0]]                 [0, 1, 1, 0, 0]]
    rollout_logprobs  logprob of token t given tokens < t at every t with loss_mask 1, else 0
    advantages        [A0, A1]  (one per sample, broadcast over its tokens)

Position 0 is never a sampled token (it is always prompt), so logprobs[:, 0] is 0 by convention.

Routing records (routing replay, optional): ``routed_experts[b, t, j, k]`` is the k-th expert the
rollout engine chose for token t of row b at the j-th MoE layer, for EVERY token (prompt and tool
tokens too, since the trainer routes them all); -1 = not recorded (the trainer's own router
decides that token), padding rows are -1.

Block-selection records (index replay and the selection-agreement metric, optional):
``block_selection[b, t, j, g, :]`` are the KV blocks the rollout engine's j-th sparse layer selected
for token t of row b and KV head g (a set; -1 = empty slot). A row that is all -1 (padding, tokens
the engine never ran, trajectories without a record) is not recorded: the trainer's own indexer
decides it, and the agreement metric skips it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from m3_rollout.rollout.trajectory import Trajectory


@dataclass
class TrainBatch:
    """Attributes (B samples, L = longest trajectory):
    token_ids: int64 [B, L], right-padded with ``pad_id``.
    loss_mask: float32 [B, L], 1 on sampled tokens.
    rollout_logprobs: float32 [B, L].
    advantages: float32 [B].
    lengths: int64 [B].
    routed_experts: int64 [B, L, n_moe_layers, K] or None (see module docstring).
    block_selection: int16 [B, L, S, G, K] or None (S sparse layers, G KV heads, K top-k blocks;
        see module docstring).
    """

    token_ids: torch.Tensor
    loss_mask: torch.Tensor
    rollout_logprobs: torch.Tensor
    advantages: torch.Tensor
    lengths: torch.Tensor
    routed_experts: torch.Tensor | None = None
    block_selection: torch.Tensor | None = None

    def validate(self) -> None:
        """Raises ValueError on inconsistent shapes or a loss mask on position 0 / padding."""
        b, l = self.token_ids.shape
        for name in ("loss_mask", "rollout_logprobs"):
            if tuple(getattr(self, name).shape) != (b, l):
                raise ValueError(f"TrainBatch.{name} has shape {tuple(getattr(self, name).shape)}, expected {(b, l)}")
        if tuple(self.advantages.shape) != (b,) or tuple(self.lengths.shape) != (b,):
            raise ValueError("TrainBatch.advantages and .lengths must be [B]")
        if bool(self.loss_mask[:, 0].any()):
            raise ValueError("TrainBatch.loss_mask[:, 0] must be 0: the first token has no logprob")
        pad = torch.arange(l)[None, :] >= self.lengths[:, None]
        if bool((self.loss_mask.bool() & pad).any()):
            raise ValueError("TrainBatch.loss_mask covers padding")
        if self.routed_experts is not None and (
            self.routed_experts.ndim != 4 or tuple(self.routed_experts.shape[:2]) != (b, l)
        ):
            raise ValueError(
                f"TrainBatch.routed_experts has shape {tuple(self.routed_experts.shape)}, "
                f"expected [B={b}, L={l}, n_moe_layers, top_k]"
            )
        sel = self.block_selection
        if sel is not None and (sel.ndim != 5 or tuple(sel.shape[:2]) != (b, l)):
            raise ValueError(
                f"TrainBatch.block_selection has shape {tuple(sel.shape)}, expected [B={b}, L={l}, S, G, K]"
            )

    def slice(self, idx: slice) -> TrainBatch:
        """Rows ``idx``, trimmed to their longest length."""
        lengths = self.lengths[idx]
        l = int(lengths.max())
        routed = None if self.routed_experts is None else self.routed_experts[idx, :l]
        sel = None if self.block_selection is None else self.block_selection[idx, :l]
        return TrainBatch(
            self.token_ids[idx, :l],
            self.loss_mask[idx, :l],
            self.rollout_logprobs[idx, :l],
            self.advantages[idx],
            lengths,
            routed,
            sel,
        )


def batch_from_trajectories(
    trajs: list[Trajectory],
    advantages: torch.Tensor,
    pad_id: int = 0,
    sample_mask: torch.Tensor | None = None,
    with_routing: bool = False,
    with_block_selection: bool = False,
) -> TrainBatch:
    """Pad trajectories into a :class:`TrainBatch` (row i = trajs[i]).

    Args:
        sample_mask: float [N] loss multiplier per trajectory (e.g. overlong filtering); a 0 row
            keeps its tokens but none of them count in the loss.
        with_routing: fill ``routed_experts`` from each trajectory's ``routed_experts`` array
            ([len, n_moe_layers, K], filled by the rollout when routing records are on); a
            trajectory without one (or a shorter one) gets -1 rows (own router).
        with_block_selection: fill ``block_selection`` from each trajectory's ``block_selection``
            record (``SelectionRecord``); None when no trajectory has one; unrecorded positions -1.
    """
    b, l = len(trajs), max(len(t.token_ids) for t in trajs)
    ids = torch.full((b, l), pad_id, dtype=torch.long)
    mask = torch.zeros((b, l))
    lps = torch.zeros((b, l))
    for i, t in enumerate(trajs):
        n = len(t.token_ids)
        ids[i, :n] = torch.tensor(t.token_ids)
        mask[i, :n] = torch.tensor(t.loss_mask, dtype=torch.float32)
        lps[i, :n] = torch.tensor(t.rollout_logprobs, dtype=torch.float32)
    if sample_mask is not None:
        mask = mask * sample_mask.float()[:, None]
    routed = None
    if with_routing:
        shapes = [tuple(t.routed_experts.shape[1:]) for t in trajs if t.routed_experts is not None]
        if shapes:
            routed = torch.full((b, l, *shapes[0]), -1, dtype=torch.long)
            for i, t in enumerate(trajs):
                if t.routed_experts is not None:
                    r = torch.as_tensor(t.routed_experts, dtype=torch.long)[: len(t.token_ids)]
                    routed[i, : r.shape[0]] = r
    sel = None
    recs = [t.block_selection for t in trajs] if with_block_selection else []
    dims = next((r.dims for r in recs if r is not None and r.dims is not None), None)
    if dims is not None:
        sel = torch.full((b, l, *dims), -1, dtype=torch.int16)
        for i, (t, r) in enumerate(zip(trajs, recs)):
            if r is not None and r.dims is not None:
                sel[i, : len(t.token_ids)] = torch.from_numpy(r.dense(len(t.token_ids)))
    lengths = torch.tensor([len(t.token_ids) for t in trajs])
    batch = TrainBatch(ids, mask, lps, advantages.float(), lengths, routed, sel)
    batch.validate()
    return batch

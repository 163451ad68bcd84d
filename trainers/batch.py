"""TrainBatch: padded token-level tensors crossing from rollouts into the trainer.

Worked padded example (2 samples, pad id 0, lengths 5 and 3)::

    token_ids         [[p, p, g, g, g],      loss_mask [[0, 0, 1, 1, 1],
                       [p, g, g, 0, 0]]                 [0, 1, 1, 0, 0]]
    rollout_logprobs  logprob of token t given tokens < t at every t with loss_mask 1, else 0
    advantages        [A0, A1]  (one per sample, broadcast over its tokens)

Position 0 is never a sampled token (it is always prompt), so logprobs[:, 0] is 0 by convention.
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
    """

    token_ids: torch.Tensor
    loss_mask: torch.Tensor
    rollout_logprobs: torch.Tensor
    advantages: torch.Tensor
    lengths: torch.Tensor

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

    def slice(self, idx: slice) -> "TrainBatch":
        """Rows ``idx``, trimmed to their longest length."""
        lengths = self.lengths[idx]
        l = int(lengths.max())
        return TrainBatch(self.token_ids[idx, :l], self.loss_mask[idx, :l], self.rollout_logprobs[idx, :l],
                          self.advantages[idx], lengths)


def batch_from_trajectories(trajs: list[Trajectory], advantages: torch.Tensor, pad_id: int = 0) -> TrainBatch:
    """Pad trajectories into a :class:`TrainBatch` (row i = trajs[i])."""
    b, l = len(trajs), max(len(t.token_ids) for t in trajs)
    ids = torch.full((b, l), pad_id, dtype=torch.long)
    mask = torch.zeros((b, l))
    lps = torch.zeros((b, l))
    for i, t in enumerate(trajs):
        n = len(t.token_ids)
        ids[i, :n] = torch.tensor(t.token_ids)
        mask[i, :n] = torch.tensor(t.loss_mask, dtype=torch.float32)
        lps[i, :n] = torch.tensor(t.rollout_logprobs, dtype=torch.float32)
    batch = TrainBatch(ids, mask, lps, advantages.float(), torch.tensor([len(t.token_ids) for t in trajs]))
    batch.validate()
    return batch

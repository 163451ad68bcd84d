"""Clipped policy-gradient loss for GRPO, NeMo RL style: configuration in the constructor, a pure
``__call__`` of tensors.

Source: PPO clipped surrogate (Schulman et al. 2017) with GRPO's group advantages:
  ratio_t = exp(logp_t - logp_old_t)
  L_t = -min(ratio_t * A, clip(ratio_t, 1 - eps_min, 1 + eps_max) * A)
averaged over sampled tokens with an explicit global normaliser (token-level loss), so micro-
batches add up to the loss of the whole global batch.
"""

from __future__ import annotations

import torch


def masked_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum()


class ClippedPGLossFn:
    """Args:
        ratio_clip_min, ratio_clip_max: eps_min, eps_max of the clip range [1-eps_min, 1+eps_max].
        token_level_loss: True = normalise by the global count of sampled tokens; False = mean
            over tokens per sequence, then over sequences (normaliser = global sequence count).
    """

    def __init__(self, ratio_clip_min: float = 0.2, ratio_clip_max: float = 0.2, token_level_loss: bool = True):
        self.eps_min, self.eps_max = ratio_clip_min, ratio_clip_max
        self.token_level_loss = token_level_loss

    def __call__(self, logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                 mask: torch.Tensor, global_normalizer: float) -> tuple[torch.Tensor, dict]:
        """Loss of one micro-batch.

        Args:
            logprobs: float32 [B, L] current-policy logprobs (with grad).
            old_logprobs: float32 [B, L] logprobs of the policy that the ratio is taken against.
            advantages: float32 [B].
            mask: float32 [B, L], 1 on sampled tokens.
            global_normalizer: sampled-token count (token level) or sequence count of the whole
                global batch.

        Returns:
            (scalar loss to backpropagate, metrics {"clip_fraction", "ratio_mean"} as sums over
            this micro-batch's tokens, to be divided by the caller).
        """
        ratio = torch.exp(logprobs - old_logprobs)
        adv = advantages[:, None]
        surrogate = torch.minimum(ratio * adv, torch.clamp(ratio, 1 - self.eps_min, 1 + self.eps_max) * adv)
        per_token = -surrogate
        if self.token_level_loss:
            loss = masked_sum(per_token, mask) / global_normalizer
        else:
            per_seq = (per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)
            loss = per_seq.sum() / global_normalizer
        with torch.no_grad():
            clipped = ((ratio < 1 - self.eps_min) | (ratio > 1 + self.eps_max)).float()
            metrics = {"clip_fraction_sum": float(masked_sum(clipped, mask)),
                       "ratio_sum": float(masked_sum(ratio, mask))}
        return loss, metrics

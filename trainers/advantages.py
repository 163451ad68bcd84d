"""GRPO advantages: rewards normalised within each group of samples of the same prompt.

Source: Shao et al. 2024 (DeepSeekMath, GRPO), outcome supervision: A_i = (r_i - mean_g) / std_g
for every token of sample i. Leave-one-out baseline (as in NeMo RL's option): the mean excludes
sample i itself, mean_{-i} = (sum_g - r_i) / (n - 1).
"""

from __future__ import annotations

import torch


def group_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, normalize: bool = True,
                     leave_one_out: bool = False, eps: float = 1e-6) -> torch.Tensor:
    """Per-sample advantages.

    Args:
        rewards: float [N].
        group_ids: int64 [N], samples with equal ids form a group.
        normalize: divide by the group's (unbiased) standard deviation; groups whose rewards
            are all equal get advantage 0.
        leave_one_out: baseline = mean of the other samples of the group (groups of size 1 then
            get advantage 0).
        eps: added to the standard deviation.

    Returns:
        float32 [N].
    """
    rewards = rewards.float()
    _, inv = torch.unique(group_ids, return_inverse=True)
    g = int(inv.max()) + 1 if inv.numel() else 0
    count = torch.zeros(g).index_add_(0, inv, torch.ones_like(rewards))
    total = torch.zeros(g).index_add_(0, inv, rewards)
    mean = total / count
    if leave_one_out:
        baseline = torch.where(count[inv] > 1, (total[inv] - rewards) / (count[inv] - 1).clamp(min=1), rewards)
    else:
        baseline = mean[inv]
    adv = rewards - baseline
    if normalize:
        sq = torch.zeros(g).index_add_(0, inv, (rewards - mean[inv]) ** 2)
        std = torch.sqrt(sq / (count - 1).clamp(min=1))
        adv = adv / (std[inv] + eps)
        adv = torch.where(std[inv] > 0, adv, torch.zeros_like(adv))
    return adv

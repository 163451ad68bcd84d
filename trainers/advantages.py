"""GRPO advantages and the group-level filters that decide which samples train.

Source: Shao et al. 2024 (DeepSeekMath, GRPO), outcome supervision: A_i = (r_i - mean_g) / std_g
for every token of sample i. Leave-one-out baseline (RLOO, Ahmadian et al. 2024; NeMo RL's
``use_leave_one_out_baseline``): the baseline excludes sample i itself,
mean_{-i} = (sum_g - r_i) / (n - 1), and so does the normaliser: std_{-i} is the (population)
standard deviation of the n - 1 other samples, as NeMo RL's ``calculate_baseline_and_std_per_prompt``
computes it; a sample whose std_{-i} is 0 (the others all agree) is not normalised, so it keeps
A_i = r_i - mean_{-i} (NeMo RL normalises only where std > 0). Dynamic sampling and overlong
filtering follow DAPO (Yu et al. 2025, §3.2 and §3.4).

NOTE: a group whose rewards are all equal carries no learning signal; its advantages are set to
exactly 0 by a max == min test rather than trusting the arithmetic (mean of ten 0.1s is not 0.1
in floating point, and a division by std + eps would amplify that residue). The same holds for the
others of one sample: std_{-i} is set to exactly 0 when their max equals their min.
"""

from __future__ import annotations

import torch


def _group_index(group_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    _, inv = torch.unique(group_ids, return_inverse=True)
    return inv, (int(inv.max()) + 1 if inv.numel() else 0)


def zero_variance_groups(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """bool [N]: True for samples whose group's rewards are all equal (max == min)."""
    inv, g = _group_index(group_ids)
    r = rewards.double()
    gmax = torch.full((g,), -torch.inf, dtype=torch.float64).scatter_reduce(0, inv, r, "amax")
    gmin = torch.full((g,), torch.inf, dtype=torch.float64).scatter_reduce(0, inv, r, "amin")
    return (gmax == gmin)[inv]


def leave_one_out_std(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """float64 [N]: population standard deviation of the OTHER samples of each sample's group.

    Exactly 0 when those others all have one reward (max == min, so floating-point residue never
    counts as spread) and for groups of size 1 or 2 (at most one other sample).

    Args:
        rewards: float [N]. group_ids: int64 [N], equal ids form a group.
    """
    r = rewards.double()
    inv, g = _group_index(group_ids)
    std = torch.zeros_like(r)
    for k in range(g):
        idx = (inv == k).nonzero().squeeze(1)
        n = idx.numel()
        if n < 3:
            continue
        x = r[idx].expand(n, n)  # [n, n], row i = the group's rewards
        others = ~torch.eye(n, dtype=torch.bool)  # row i: the samples other than i
        mean = torch.where(others, x, 0.0).sum(1) / (n - 1)  # [n]
        var = torch.where(others, (x - mean[:, None]) ** 2, 0.0).sum(1) / (n - 1)
        agree = torch.where(others, x, torch.inf).amin(1) == torch.where(others, x, -torch.inf).amax(1)
        std[idx] = torch.where(agree, torch.zeros_like(var), var.sqrt())
    return std


def group_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    normalize: bool = True,
    leave_one_out: bool = False,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Per-sample advantages.

    Args:
        rewards: float [N].
        group_ids: int64 [N], samples with equal ids form a group.
        normalize: divide by the group's (unbiased) standard deviation + eps; with
            ``leave_one_out``, by the standard deviation of the other samples
            (``leave_one_out_std``) + eps, and not at all where that is 0.
        leave_one_out: baseline = mean of the other samples of the group (groups of size 1 then
            get advantage 0).
        eps: added to the standard deviation.

    Returns:
        float32 [N]; exactly 0 for every sample of a group whose rewards are all equal.

    Raises:
        ValueError: shapes differ or a reward is not finite.
    """
    if rewards.shape != group_ids.shape or rewards.ndim != 1:
        raise ValueError(f"rewards {tuple(rewards.shape)} and group_ids {tuple(group_ids.shape)} must both be [N]")
    if not bool(torch.isfinite(rewards).all()):
        raise ValueError("rewards contain NaN/inf; fix the environment's reward")
    r = rewards.double()  # NOTE: fp64 so the per-group sums carry no visible residue
    inv, g = _group_index(group_ids)
    count = torch.zeros(g, dtype=torch.float64).index_add_(0, inv, torch.ones_like(r))
    total = torch.zeros(g, dtype=torch.float64).index_add_(0, inv, r)
    mean = total / count
    if leave_one_out:
        n = count[inv]
        baseline = torch.where(n > 1, (total[inv] - r) / (n - 1).clamp(min=1), r)
    else:
        baseline = mean[inv]
    adv = r - baseline
    if normalize and leave_one_out:
        std = leave_one_out_std(r, group_ids)
        adv = torch.where(std > 0, adv / (std + eps), adv)
    elif normalize:
        sq = torch.zeros(g, dtype=torch.float64).index_add_(0, inv, (r - mean[inv]) ** 2)
        std = torch.sqrt(sq / (count - 1).clamp(min=1))
        adv = adv / (std[inv] + eps)
    adv = torch.where(zero_variance_groups(rewards, group_ids), torch.zeros_like(adv), adv)
    return adv.float()


def overlong_filter_mask(finish_reasons: list[str]) -> torch.Tensor:
    """float32 [N] loss multiplier for DAPO overlong filtering: 0 for samples cut by a token limit
    (finish_reason "length"), 1 otherwise. Truncated samples then neither push nor pull the policy
    (their reward says nothing about an answer they never finished)."""
    return torch.tensor([0.0 if r == "length" else 1.0 for r in finish_reasons], dtype=torch.float32)


def apply_overlong_filter(trajs) -> int:
    """DAPO overlong filtering on the trajectories themselves: every model turn of a trajectory
    cut by a token limit (``overlong_filter_mask`` 0) gets loss_mask 0 and ``TurnRecord.masked``,
    so the trajectory's token counts, the batch built from it and a dump of it agree.

    Args:
        trajs: ``Trajectory`` records (changed in place).

    Returns:
        the number of trajectories filtered.
    """
    keep = overlong_filter_mask([t.finish_reason for t in trajs])
    for t, k in zip(trajs, keep.tolist()):
        if not k:
            for r in t.turns:
                t.mask_span(r.start, r.end)
                r.masked = True
    return int((keep == 0).sum())


class DynamicSampler:
    """DAPO dynamic sampling, bounded: keep drawing prompt batches and keep only groups with
    non-zero reward variance until ``target_groups`` are collected or ``max_batches`` batches have
    been drawn.

    Args:
        target_groups: groups wanted for one training step (``grpo.num_prompts_per_step``).
        max_batches: most generation batches per step (``grpo.dynamic_sampling.max_num_gen_batches``);
            when reached, the step trains on what was kept (possibly fewer groups; never 0 if any
            group had signal, else the last batch's groups, which all have advantage 0).

    Usage: ``while sampler.wants_more(): sampler.add(groups)``, then ``sampler.result()``.
    Each group is a list of objects with a ``reward`` attribute.
    """

    def __init__(self, target_groups: int, max_batches: int):
        if target_groups < 1 or max_batches < 1:
            raise ValueError(f"DynamicSampler: target_groups={target_groups}, max_batches={max_batches} must be >= 1")
        self.target, self.max_batches = target_groups, max_batches
        self.kept: list[list] = []
        self.batches = 0
        self.seen_groups = 0
        self.dropped_groups = 0
        self._last: list[list] = []

    def wants_more(self) -> bool:
        return len(self.kept) < self.target and self.batches < self.max_batches

    def add(self, groups: list[list]) -> None:
        """Add one generation batch of groups; zero-variance groups are dropped (counted)."""
        self.batches += 1
        self._last = groups
        for grp in groups:
            self.seen_groups += 1
            rewards = [float(t.reward) for t in grp]
            if max(rewards) == min(rewards):
                self.dropped_groups += 1
            elif len(self.kept) < self.target:
                self.kept.append(grp)

    def result(self) -> list[list]:
        """The groups to train on (see class docstring for the bound)."""
        return self.kept if self.kept else self._last

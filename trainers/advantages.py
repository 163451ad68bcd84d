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

Failed samples: a trajectory whose generation failed (``Trajectory.failed``, finish_reason
"error") has a placeholder reward 0, not a score. The advantage functions take ``valid`` (bool
[N], ``generated_mask``) and leave the invalid samples out of every group statistic: a group's mean,
std, leave-one-out mean and std and the max == min test are those of its valid samples alone, so
a group with a failed sample gets the advantages the group without it would get; the failed
sample itself gets exactly 0, and a group with too few valid samples for a statistic is treated
as a group that small (one valid sample, or none: no signal, all 0). Dynamic sampling judges a
group by its valid samples the same way, and ``mask_failed`` takes a failed trajectory's tokens
(those of turns before the failed request) out of the loss.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def _group_index(group_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    _, inv = torch.unique(group_ids, return_inverse=True)
    return inv, (int(inv.max()) + 1 if inv.numel() else 0)


def _valid_mask(rewards: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    """``valid`` checked against ``rewards`` (bool, same shape); all True when None."""
    if valid is None:
        return torch.ones(rewards.shape, dtype=torch.bool, device=rewards.device)
    if valid.dtype != torch.bool or valid.shape != rewards.shape:
        raise ValueError(
            f"valid must be a bool tensor shaped like rewards {tuple(rewards.shape)}, got {valid.dtype} "
            f"{tuple(valid.shape)}; build it with generated_mask(trajectories)"
        )
    return valid


def generated_mask(trajs: Sequence) -> torch.Tensor:
    """bool [N]: True for the trajectories that generated, False for those whose generation failed
    (``Trajectory.failed``); the ``valid`` argument of the functions of this module.

    Args:
        trajs: ``Trajectory`` records (any objects with a ``failed`` attribute).
    """
    return torch.tensor([not t.failed for t in trajs], dtype=torch.bool)


def zero_variance_groups(
    rewards: torch.Tensor, group_ids: torch.Tensor, valid: torch.Tensor | None = None
) -> torch.Tensor:
    """bool [N]: True for samples whose group's valid rewards are all equal (max == min), which
    includes a group with one valid sample or none.

    Args:
        rewards: float [N]. group_ids: int64 [N], equal ids form a group.
        valid: bool [N] (``generated_mask``), None = all valid; invalid samples' rewards are
            ignored (they get their group's answer).

    Raises:
        ValueError: ``valid`` is not a bool tensor shaped like ``rewards``.
    """
    v = _valid_mask(rewards, valid)
    inv, g = _group_index(group_ids)
    r = rewards.double()
    gmax = torch.full((g,), -torch.inf, dtype=torch.float64).scatter_reduce(
        0, inv, torch.where(v, r, -torch.inf), "amax"
    )
    gmin = torch.full((g,), torch.inf, dtype=torch.float64).scatter_reduce(0, inv, torch.where(v, r, torch.inf), "amin")
    none = torch.zeros(g, dtype=torch.int64).index_add_(0, inv, v.long()) == 0
    return ((gmax == gmin) | none)[inv]


def leave_one_out_std(
    rewards: torch.Tensor, group_ids: torch.Tensor, valid: torch.Tensor | None = None
) -> torch.Tensor:
    """float64 [N]: population standard deviation of the OTHER valid samples of each sample's group.

    Exactly 0 when those others all have one reward (max == min, so floating-point residue never
    counts as spread), for groups of 1 or 2 valid samples (at most one other) and for invalid samples.

    Args:
        rewards: float [N]. group_ids: int64 [N], equal ids form a group.
        valid: bool [N] (``generated_mask``), None = all valid; invalid samples are no one's others.

    Raises:
        ValueError: ``valid`` is not a bool tensor shaped like ``rewards``.
    """
    v = _valid_mask(rewards, valid)
    r = rewards.double()
    inv, g = _group_index(group_ids)
    std = torch.zeros_like(r)
    for k in range(g):
        idx = ((inv == k) & v).nonzero().squeeze(1)
        n = idx.numel()
        if n < 3:
            continue
        x = r[idx].expand(n, n)  # [n, n], row i = the group's valid rewards
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
    valid: torch.Tensor | None = None,
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
        valid: bool [N], False for samples whose generation failed (``generated_mask``); None =
            all valid. Every statistic above is over the group's valid samples only ("group",
            "size" and "other samples" mean its valid ones); an invalid sample's reward is ignored
            (need not be finite) and its advantage is exactly 0.

    Returns:
        float32 [N]; exactly 0 for every sample of a group whose valid rewards are all equal
        (one valid sample or none included) and for every invalid sample.

    Raises:
        ValueError: shapes differ, a valid sample's reward is not finite, or ``valid`` is not a
            bool tensor shaped like ``rewards``.
    """
    if rewards.shape != group_ids.shape or rewards.ndim != 1:
        raise ValueError(f"rewards {tuple(rewards.shape)} and group_ids {tuple(group_ids.shape)} must both be [N]")
    v = _valid_mask(rewards, valid)
    if not bool(torch.isfinite(rewards[v]).all()):
        raise ValueError("rewards contain NaN/inf; fix the environment's reward")
    # NOTE: fp64 so the per-group sums carry no visible residue; an invalid sample adds an exact 0
    # to every sum, so its group's figures are bit for bit those of the group without it.
    r = torch.where(v, rewards.double(), 0.0)
    w = v.double()
    inv, g = _group_index(group_ids)
    count = torch.zeros(g, dtype=torch.float64).index_add_(0, inv, w)
    total = torch.zeros(g, dtype=torch.float64).index_add_(0, inv, r)
    mean = total / count.clamp(min=1)
    if leave_one_out:
        n = count[inv]
        baseline = torch.where(n > 1, (total[inv] - r) / (n - 1).clamp(min=1), r)
    else:
        baseline = mean[inv]
    adv = r - baseline
    if normalize and leave_one_out:
        std = leave_one_out_std(r, group_ids, v)
        adv = torch.where(std > 0, adv / (std + eps), adv)
    elif normalize:
        sq = torch.zeros(g, dtype=torch.float64).index_add_(0, inv, w * (r - mean[inv]) ** 2)
        std = torch.sqrt(sq / (count - 1).clamp(min=1))
        adv = adv / (std[inv] + eps)
    no_signal = zero_variance_groups(r, group_ids, v) | ~v
    adv = torch.where(no_signal, torch.zeros_like(adv), adv)
    return adv.float()


def overlong_filter_mask(finish_reasons: list[str]) -> torch.Tensor:
    """float32 [N] loss multiplier for DAPO overlong filtering: 0 for samples cut by a token limit
    (finish_reason "length"), 1 otherwise. Truncated samples then neither push nor pull the policy
    (their reward says nothing about an answer they never finished)."""
    return torch.tensor([0.0 if r == "length" else 1.0 for r in finish_reasons], dtype=torch.float32)


def _mask_model_turns(t) -> None:
    """Every model turn of ``t`` out of the loss: loss_mask 0 and ``TurnRecord.masked``."""
    for r in t.turns:
        t.mask_span(r.start, r.end)
        r.masked = True


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
            _mask_model_turns(t)
    return int((keep == 0).sum())


def mask_failed(trajs) -> int:
    """Take every trajectory whose generation failed (``Trajectory.failed``) out of the loss, as
    ``apply_overlong_filter`` does for a cut one (loss_mask 0, ``TurnRecord.masked``).

    A request refused at turn 1 leaves no sampled token; one refused or lost at a later turn
    leaves the earlier turns' tokens, which have no outcome to learn from (their advantage is 0,
    ``group_advantages``) and would otherwise still count in a token-mean loss and in the KL
    penalty. So a failed sample trains nothing, whichever turn failed.

    Args:
        trajs: ``Trajectory`` records (changed in place).

    Returns:
        the number of failed trajectories.
    """
    failed = [t for t in trajs if t.failed]
    for t in failed:
        _mask_model_turns(t)
    return len(failed)


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
    Each group is a list of ``Trajectory`` records (objects with ``reward`` and ``failed``); a
    group's variance is that of its generated samples (``zero_variance_groups`` with
    ``generated_mask``), so one that has fewer than two generated samples, or whose generated
    samples all agree, is dropped however its failed samples' placeholder rewards differ.
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
        trajs = [t for grp in groups for t in grp]
        flat = zero_variance_groups(
            torch.tensor([float(t.reward) for t in trajs], dtype=torch.float64),
            torch.tensor([i for i, grp in enumerate(groups) for _ in grp], dtype=torch.int64),
            generated_mask(trajs),
        ).tolist()
        first = 0  # index of each group's first sample in ``flat``
        for grp in groups:
            self.seen_groups += 1
            no_signal = flat[first] if grp else True
            first += len(grp)
            if no_signal:
                self.dropped_groups += 1
            elif len(self.kept) < self.target:
                self.kept.append(grp)

    def result(self) -> list[list]:
        """The groups to train on (see class docstring for the bound)."""
        return self.kept if self.kept else self._last

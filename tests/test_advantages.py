"""trainers/advantages.py: hand-computed advantages, exact zeros for all-equal groups, failed
samples left out of their groups' statistics, bounded dynamic sampling and overlong filtering."""

from types import SimpleNamespace

import pytest
import torch

from m3_trainers.advantages import (
    DynamicSampler,
    generated_mask,
    group_advantages,
    leave_one_out_std,
    overlong_filter_mask,
    zero_variance_groups,
)


def test_mean_std_and_leave_one_out_hand_values():
    r = torch.tensor([1.0, 0.0, 0.5])
    g = torch.tensor([3, 3, 3])
    # mean 0.5, unbiased std sqrt((0.25 + 0.25 + 0) / 2) = 0.5
    assert group_advantages(r, g).tolist() == pytest.approx([0.5 / (0.5 + 1e-6), -0.5 / (0.5 + 1e-6), 0.0])
    # leave-one-out baselines: (0 + 0.5)/2, (1 + 0.5)/2, (1 + 0)/2
    assert group_advantages(r, g, normalize=False, leave_one_out=True).tolist() == pytest.approx([0.75, -0.75, 0.0])
    assert group_advantages(r, g, normalize=False).tolist() == pytest.approx([0.5, -0.5, 0.0])


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("loo", [True, False])
def test_all_equal_group_is_exactly_zero(normalize, loo):
    # 0.1 is not exactly representable: the mean of three 0.1s differs from 0.1 by an ulp, and
    # a division by std + eps would blow that residue up. The answer must be exactly 0.
    r = torch.tensor([0.1, 0.1, 0.1, 0.7, 0.2, 0.3])
    g = torch.tensor([0, 0, 0, 1, 1, 1])
    a = group_advantages(r, g, normalize=normalize, leave_one_out=loo)
    assert a[:3].tolist() == [0.0, 0.0, 0.0]
    assert (a[3:] != 0).all()
    assert zero_variance_groups(r, g).tolist() == [True] * 3 + [False] * 3


def test_leave_one_out_normalises_by_the_std_of_the_other_samples():
    # Rewards binary floating point cannot represent: the three 0.1s agree exactly, but their mean
    # and variance computed in floating point carry residue that must not count as spread.
    r = torch.tensor([0.7, 0.1, 0.1, 0.1, 0.3, 0.9, 0.6, 0.2], dtype=torch.float64)
    g = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    a = group_advantages(r, g, normalize=True, leave_one_out=True).double()
    # The singleton 0.7 among three equal 0.1s: the others have std 0 -> not normalised.
    assert a[0].item() == pytest.approx(0.7 - 0.1, rel=1e-6)
    for i in range(8):
        lo, hi = (0, 4) if i < 4 else (4, 8)
        others = [r[j].item() for j in range(lo, hi) if j != i]
        m = sum(others) / len(others)
        sd = (sum((x - m) ** 2 for x in others) / len(others)) ** 0.5  # population std of the others
        # (sd of three 0.1s computed this way is ~1e-17, not 0: exactly the residue to ignore)
        expect = r[i].item() - m if max(others) == min(others) else (r[i].item() - m) / (sd + 1e-6)
        assert a[i].item() == pytest.approx(expect, rel=1e-5), i
    # Not the whole group's std: sample 1's others are {0.7, 0.1, 0.1}, std 0.2828..., not 0.3.
    assert a[1].item() == pytest.approx((0.1 - 0.3) / (0.08**0.5 + 1e-6), rel=1e-5)
    assert leave_one_out_std(r, g)[0].item() == 0.0


def test_non_finite_rewards_rejected():
    with pytest.raises(ValueError, match="NaN"):
        group_advantages(torch.tensor([1.0, float("nan")]), torch.tensor([0, 0]))


def test_overlong_filter_mask():
    assert overlong_filter_mask(["stop", "length", "max_turns", "error"]).tolist() == [1.0, 0.0, 1.0, 1.0]


def _groups(*reward_lists, failed=()):
    """Groups of samples with the given rewards; ``failed``: (group, sample) pairs that failed."""
    return [
        [SimpleNamespace(reward=r, failed=(g, i) in failed) for i, r in enumerate(rs)]
        for g, rs in enumerate(reward_lists)
    ]


def test_dynamic_sampling_keeps_signal_groups_and_is_bounded():
    s = DynamicSampler(target_groups=2, max_batches=3)
    s.add(_groups([1, 1], [0, 1]))  # one zero-variance group dropped
    assert s.wants_more() and len(s.kept) == 1 and s.dropped_groups == 1
    s.add(_groups([0, 0], [1, 0], [0, 1]))  # one more kept, then full (third not needed)
    assert not s.wants_more() and len(s.result()) == 2 and s.batches == 2 and s.dropped_groups == 2
    # Bound: no group ever has signal -> stops after max_batches and trains on the last batch.
    s = DynamicSampler(target_groups=2, max_batches=2)
    while s.wants_more():
        s.add(_groups([0, 0], [1, 1]))
    assert s.batches == 2 and len(s.result()) == 2 and s.dropped_groups == 4
    with pytest.raises(ValueError, match="max_batches"):
        DynamicSampler(1, 0)


# Two groups with one failed sample each (placeholder reward 0) and the same groups without them.
FAILED_R = torch.tensor([1.0, 0.0, 0.5, 0.0, 0.25, 0.3, 0.9, 0.0, 0.6])
FAILED_G = torch.tensor([0, 0, 0, 0, 0, 1, 1, 1, 1])
FAILED_VALID = torch.tensor([True, True, True, False, True, True, True, False, True])


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("loo", [True, False])
def test_a_failed_sample_leaves_its_group_as_if_it_were_not_there(normalize, loo):
    a = group_advantages(FAILED_R, FAILED_G, normalize, loo, valid=FAILED_VALID)
    without = group_advantages(FAILED_R[FAILED_VALID], FAILED_G[FAILED_VALID], normalize, loo)
    assert torch.equal(a[FAILED_VALID], without)  # bit for bit: a failed sample adds exact zeros
    assert a[~FAILED_VALID].tolist() == [0.0, 0.0]
    # Counting the placeholder 0 as a reward (the old behaviour) gives other advantages.
    assert not torch.allclose(group_advantages(FAILED_R, FAILED_G, normalize, loo)[FAILED_VALID], without)


def test_failed_samples_hand_values():
    # Group 0 without its failed sample: [1, 0, 0.5, 0.25], mean 0.4375 (with it 0.35).
    a = group_advantages(FAILED_R, FAILED_G, normalize=False, valid=FAILED_VALID)
    assert a[:5].tolist() == pytest.approx([0.5625, -0.4375, 0.0625, 0.0, -0.1875])
    # Leave-one-out baseline of sample 0: mean of 0, 0.5, 0.25 (not of 0, 0.5, 0, 0.25).
    a = group_advantages(FAILED_R, FAILED_G, normalize=False, leave_one_out=True, valid=FAILED_VALID)
    assert a[0].item() == pytest.approx(1.0 - 0.75 / 3)
    # std_{-0} is that of {0, 0.5, 0.25}, std of a failed sample is 0.
    s = leave_one_out_std(FAILED_R, FAILED_G, FAILED_VALID)
    assert s[0].item() == pytest.approx((((0 - 0.25) ** 2 + (0.5 - 0.25) ** 2 + 0) / 3) ** 0.5)
    assert s[3].item() == 0.0 and s[7].item() == 0.0


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("loo", [True, False])
def test_groups_with_too_few_generated_samples_get_zero(normalize, loo):
    # One correct answer + failures: no signal (it was a group "with variance" before).
    # All failed: no signal. Two generated: leave-one-out baseline is the other one.
    r = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0])
    g = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 3])
    valid = torch.tensor([True, False, False, False, False, True, True, False, False])
    a = group_advantages(r, g, normalize, loo, valid=valid)
    assert a[:5].tolist() == [0.0] * 5 and a[7:].tolist() == [0.0, 0.0]
    assert (group_advantages(r, g, normalize, loo)[:3] != 0).any()  # the placeholder zeros counted
    if loo:  # 2 generated: std_{-i} is 0 (one other), so not normalised
        assert a[5:7].tolist() == [1.0, -1.0]
    else:
        hi = 0.5 / ((0.5**0.5) + 1e-6) if normalize else 0.5  # unbiased std of {1, 0}
        assert a[5:7].tolist() == pytest.approx([hi, -hi])


def test_zero_variance_ignores_failed_samples():
    r = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.5, 0.5])
    g = torch.tensor([0, 0, 1, 1, 1, 2, 2, 2, 3, 3])
    valid = torch.tensor([True, False, True, True, False, True, True, False, False, False])
    # group 0: one generated; 1: generated agree; 2: generated differ; 3: none generated
    assert zero_variance_groups(r, g, valid).tolist() == [True] * 5 + [False] * 3 + [True] * 2
    assert zero_variance_groups(r, g).tolist() == [False] * 8 + [True] * 2
    with pytest.raises(ValueError, match="bool tensor"):
        zero_variance_groups(r, g, valid.float())


def test_a_failed_samples_reward_is_not_checked_and_the_mask_comes_from_the_trajectories():
    r = torch.tensor([1.0, float("nan"), 0.0])
    valid = generated_mask([SimpleNamespace(failed=f) for f in (False, True, False)])
    assert valid.tolist() == [True, False, True]
    assert group_advantages(r, torch.zeros(3, dtype=torch.long), valid=valid).tolist() == pytest.approx(
        [0.5 / (0.5**0.5 + 1e-6), 0.0, -0.5 / (0.5**0.5 + 1e-6)]
    )
    with pytest.raises(ValueError, match="NaN"):
        group_advantages(r, torch.zeros(3, dtype=torch.long))


def test_dynamic_sampling_judges_a_group_by_its_generated_samples():
    s = DynamicSampler(target_groups=3, max_batches=1)
    # one right answer + failed samples (placeholder 0): no signal; [1, 1, failed]: no signal;
    # [1, 0, failed]: signal; every sample failed: none.
    groups = _groups([1, 0, 0], [1, 1, 0], [1, 0, 0], [0, 0], failed={(0, 1), (0, 2), (1, 2), (2, 2), (3, 0), (3, 1)})
    s.add(groups)
    assert s.dropped_groups == 3 and s.seen_groups == 4
    assert s.result() == [groups[2]] and s.result()[0] is groups[2]

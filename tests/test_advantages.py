"""trainers/advantages.py: hand-computed advantages, exact zeros for all-equal groups, bounded
dynamic sampling and overlong filtering."""

from types import SimpleNamespace

import pytest
import torch

from m3_trainers.advantages import (
    DynamicSampler,
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


def _groups(*reward_lists):
    return [[SimpleNamespace(reward=r) for r in rs] for rs in reward_lists]


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

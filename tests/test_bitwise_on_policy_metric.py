"""train/bitwise_on_policy must say NO when one sampled token's prev logprob differs by one ulp.

mismatch_metrics' token_mult_prob_error / gen_kl_error are fp64 means: a one-ulp difference at a
near-certain token (logprob -1e-6, |d| ~ 1e-13) is absorbed by a few thousand tokens' 1.0 terms,
and exp(d) - 1 - d rounds to exactly 0. The metric reads the exact max |d| instead.
"""

from __future__ import annotations

import torch

from m3_rollout.jobs.step_metrics import bitwise_on_policy
from m3_trainers.policy import mismatch_metrics


def _one_ulp_off(logprob: float, n: int = 4096):
    roll = torch.full((1, n), logprob, dtype=torch.float32)
    prev = roll.clone()
    prev[0, 5] = torch.nextafter(prev[0, 5], torch.tensor(0.0))
    return roll, prev, torch.ones(1, n)


def test_one_ulp_difference_is_not_bitwise_on_policy():
    roll, prev, mask = _one_ulp_off(-1e-6)
    m = mismatch_metrics(roll, prev, mask)
    # the means cannot see it (the old predicate said "yes")
    assert m["token_mult_prob_error"] == 1.0 and m["gen_kl_error"] == 0.0
    assert m["max_logprob_abs_diff"] > 0.0
    assert bitwise_on_policy(m) == 0.0


def test_equal_logprobs_are_bitwise_and_nan_is_not():
    roll, _, mask = _one_ulp_off(-0.5)
    assert bitwise_on_policy(mismatch_metrics(roll, roll.clone(), mask)) == 1.0
    prev = roll.clone()
    prev[0, 3] = float("nan")
    assert bitwise_on_policy(mismatch_metrics(roll, prev, mask)) == 0.0

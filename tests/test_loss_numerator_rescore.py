"""Batch-invariant mode over several optimizer steps (trainers/policy.py ``train_step``): on the
first step the numerator is the prev logprobs themselves (``prev_on_current_weights``), on a later
step it is re-scored on the updated weights, and the ratio then is exp(score(new) - prev(old))
with the scorer's value (not the training forward's). A fake scorer (the training forward rounded
to 2^-10, so its value is told apart from the forward's) stands for the engine's paged one."""

from __future__ import annotations

import torch
from paged_model_util import small_paged_model  # tests/ on sys.path

from m3_trainers.batch import TrainBatch
from m3_trainers.loss import ClippedPGLossFn
from m3_trainers.policy import Policy, token_logprobs


class _Scorer:
    def __init__(self):
        self.calls = 0

    @torch.no_grad()
    def __call__(self, model, rows, temperature):
        self.calls += 1
        out = []
        for ids in rows:
            lp = token_logprobs(model, torch.tensor([ids]), temperature)[0]
            out.append(torch.round(lp * 1024) / 1024)  # a value the training forward never gives
        return out


def _batch():
    g = torch.Generator().manual_seed(3)
    b, l = 4, 12
    tok = torch.randint(0, 96, (b, l), generator=g)
    lengths = torch.tensor([12, 9, 12, 7])
    mask = torch.zeros(b, l)
    for r, n in enumerate(lengths.tolist()):
        mask[r, 4:n] = 1
        tok[r, n:] = 0
    return TrainBatch(tok, mask, torch.zeros(b, l), torch.tensor([1.0, -1.0, 0.5, -0.5]), lengths)


def test_later_optimizer_step_rescores_the_numerator_on_the_new_weights():
    scorer = _Scorer()
    policy = Policy(small_paged_model(0), lr=1e-2, scorer=scorer)
    batch = _batch()
    fn = ClippedPGLossFn(0.2, 0.2, True)
    prev = policy.get_logprobs(batch, 1.0, micro_batch_size=2)
    assert scorer.calls == 1
    m1 = policy.train_step(batch, fn, 1.0, 2, prev_logprobs=prev, prev_on_current_weights=True)
    assert scorer.calls == 1  # reused: no second scoring on the same weights
    assert m1["probs_ratio_min"] == 1.0 and m1["probs_ratio_max"] == 1.0  # numerator == prev exactly
    want = policy.get_logprobs(batch, 1.0, micro_batch_size=2)  # the scorer on the updated weights
    calls = scorer.calls
    m2 = policy.train_step(batch, fn, 1.0, 2, prev_logprobs=prev, prev_on_current_weights=False)
    assert scorer.calls == calls + 1
    mask = batch.loss_mask.bool()
    ratio = torch.exp(want[mask].double() - prev[mask].double())
    assert ratio.max().item() != 1.0  # the update moved the scores
    # the loss computes the ratio in fp32: equal to its rounding (a stale numerator = prev gives 1.0)
    assert abs(m2["probs_ratio_max"] / ratio.max().item() - 1) < 1e-6
    assert abs(m2["probs_ratio_min"] / ratio.min().item() - 1) < 1e-6

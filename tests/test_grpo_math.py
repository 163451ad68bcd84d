"""Advantages, loss and batch building on tiny hand-computed inputs."""

import math

import pytest
import torch

from m3_rollout.rollout.trajectory import Trajectory
from m3_trainers.advantages import group_advantages
from m3_trainers.batch import batch_from_trajectories
from m3_trainers.loss import ClippedPGLossFn


def test_group_advantages_normalised():
    r = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    g = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    a = group_advantages(r, g)
    std = math.sqrt(((0.75**2) + 3 * (0.25**2)) / 3)  # unbiased std of group 0
    assert a[0].item() == pytest.approx(0.75 / (std + 1e-6), rel=1e-5)
    assert a[1].item() == pytest.approx(-0.25 / (std + 1e-6), rel=1e-5)
    assert torch.equal(a[4:], torch.zeros(4))  # all-equal group: no signal


def test_group_advantages_leave_one_out_unnormalised():
    r = torch.tensor([1.0, 0.0, 0.0, 2.0])
    g = torch.tensor([5, 5, 5, 9])
    a = group_advantages(r, g, normalize=False, leave_one_out=True)
    assert a.tolist() == pytest.approx([1.0, -0.5, -0.5, 0.0])


def test_clipped_loss_hand_computed():
    fn = ClippedPGLossFn(0.2, 0.2)
    old = torch.zeros(1, 3)
    new = torch.log(torch.tensor([[1.0, 1.5, 0.5]])).requires_grad_(True)
    mask = torch.tensor([[0.0, 1.0, 1.0]])
    adv = torch.tensor([2.0])
    loss, m = fn(new, old, adv, mask, global_normalizer=2.0)
    # token 1: ratio 1.5 -> clipped to 1.2 for A>0 -> 2.4; token 2: ratio 0.5 -> min(1.0, 1.6) = 1.0
    assert loss.item() == pytest.approx(-(2.4 + 1.0) / 2)
    assert m["clip_fraction_sum"] == 2.0
    loss.backward()
    # Clipped token (1) has no gradient; token 2 has d(-ratio*A)/dlogp = -ratio*A/2.
    assert new.grad[0, 1].item() == 0.0
    assert new.grad[0, 2].item() == pytest.approx(-0.5 * 2.0 / 2)


def test_batch_from_trajectories_padding_and_validation():
    t1 = Trajectory(0, 0, [], [], [], [], prompt_len=2)
    t1.append([5, 6], generated=False)
    t1.append([7, 8], generated=True, logprobs=[-0.1, -0.2], version=3)
    t2 = Trajectory(0, 1, [], [], [], [], prompt_len=2)
    t2.append([5, 6], generated=False)
    t2.append([9], generated=True, logprobs=[-0.3], version=3)
    b = batch_from_trajectories([t1, t2], torch.tensor([1.0, -1.0]), pad_id=0)
    assert b.token_ids.tolist() == [[5, 6, 7, 8], [5, 6, 9, 0]]
    assert b.loss_mask.tolist() == [[0, 0, 1, 1], [0, 0, 1, 0]]
    assert b.rollout_logprobs[1].tolist() == pytest.approx([0, 0, -0.3, 0])
    assert t1.weight_version == [-1, -1, 3, 3] and t1.turn_spans == [(2, 4)]
    b.loss_mask[1, 3] = 1
    with pytest.raises(ValueError, match="padding"):
        b.validate()


def test_combine_optimizer_steps_token_weighted():
    from m3_trainers.step import combine_optimizer_steps

    base = dict(
        probs_ratio=1.0,
        probs_ratio_clamped=1.0,
        clip_fraction=0.0,
        dual_clip_fraction=0.0,
        kl_penalty=0.0,
        sampling_importance_ratio=1.0,
        is_oob_ratio=0.0,
        approx_entropy=2.0,
        entropy=2.0,
        token_mult_prob_error=1.01,
        gen_kl_error=1e-3,
        policy_kl_error=1e-3,
        js_divergence_error=1e-4,
        num_tokens=30.0,
        logprob_seconds=1.0,
        train_seconds=2.0,
        train_flops=6e12,
        logprob_flops=1e12,
        train_tflops_per_s=3.0,
        probs_ratio_max=1.5,
        probs_ratio_min=0.8,
        max_logprob_abs_diff=0.1,
        loss=0.2,
        pg_loss=0.2,
        kl_loss=0.0,
        grad_norm=1.0,
        lr=1e-3,
        skipped_step=False,
    )
    other = {
        **base,
        "clip_fraction": 0.4,
        "entropy": 1.0,
        "num_tokens": 10.0,
        "train_flops": 2e12,
        "probs_ratio_max": 3.0,
        "probs_ratio_min": 0.5,
        "grad_norm": 3.0,
        "lr": 2e-3,
        "skipped_step": True,
    }
    m = combine_optimizer_steps([base, other])
    assert m["clip_fraction"] == pytest.approx(0.4 * 10 / 40)
    assert m["entropy"] == pytest.approx((2.0 * 30 + 1.0 * 10) / 40)
    assert m["num_tokens"] == 40 and m["train_seconds"] == 4.0 and m["probs_ratio_max"] == 3.0
    assert m["probs_ratio_min"] == 0.5
    assert m["grad_norm"] == 2.0 and m["lr"] == 1e-3 and m["skipped_step"] is True
    # throughput of the whole step: summed FLOPs over summed seconds, not a mean of rates
    assert m["train_flops"] == 8e12 and m["logprob_flops"] == 2e12 and m["train_tflops_per_s"] == pytest.approx(2.0)

"""trainers/loss.py against hand-computed values: clipping, dual clip, KL estimators, token vs
sequence mean, TIS/MIS, and masked NaN/inf that must not reach the loss or its gradient."""

import math

import pytest
import torch

from m3_trainers.loss import ClippedPGLossFn, importance_weights, kl_estimate


def _lp(*probs):
    return torch.log(torch.tensor([list(probs)], dtype=torch.float64)).requires_grad_(True)


def test_dual_clip_caps_negative_advantage_loss():
    fn = ClippedPGLossFn(0.2, 0.2, ratio_clip_c=3.0)
    new = _lp(5.0, 2.0)  # old = 0 -> ratios 5 and 2
    old = torch.zeros(1, 2, dtype=torch.float64)
    loss, m = fn(new, old, torch.tensor([-1.0], dtype=torch.float64), torch.ones(1, 2), global_normalizer=2.0)
    # ratio 5: -min(-5, -1.2) = 5 -> capped at c*|A| = 3; ratio 2: 2 (below the cap)
    assert loss.item() == pytest.approx((3.0 + 2.0) / 2)
    assert m["dual_clip_fraction_sum"] == 1.0 and m["clip_fraction_sum"] == 2.0
    assert m["ratio_max"] == pytest.approx(5.0) and m["ratio_sum"] == pytest.approx(7.0)
    loss.backward()
    assert new.grad[0, 0].item() == 0.0  # capped: constant
    assert new.grad[0, 1].item() == pytest.approx(-(-1.0 * 2.0) / 2)  # d(-r*A)/dlogp = -A*r, / 2
    # Without dual clip the first token costs 5.
    loss2, _ = ClippedPGLossFn(0.2, 0.2)(
        new.detach(), old, torch.tensor([-1.0], dtype=torch.float64), torch.ones(1, 2), 2.0
    )
    assert loss2.item() == pytest.approx((5.0 + 2.0) / 2)


def test_asymmetric_clip_range():
    fn = ClippedPGLossFn(ratio_clip_min=0.1, ratio_clip_max=0.3)
    new = _lp(1.5, 0.5)
    old = torch.zeros(1, 2, dtype=torch.float64)
    loss, m = fn(new, old, torch.tensor([1.0], dtype=torch.float64), torch.ones(1, 2), 2.0)
    # A>0: token 0 min(1.5, 1.3) = 1.3; token 1 min(0.5, 0.9) = 0.5
    assert loss.item() == pytest.approx(-(1.3 + 0.5) / 2)
    assert m["clip_fraction_sum"] == 2.0


def test_kl_estimators_hand_values():
    lp = torch.tensor([math.log(0.5)])
    ref = torch.tensor([math.log(0.25)])
    lr = math.log(0.5)  # log(ref/p)
    assert kl_estimate(lp, ref, "k1").item() == pytest.approx(-lr)
    assert kl_estimate(lp, ref, "k2").item() == pytest.approx(0.5 * lr * lr)
    assert kl_estimate(lp, ref, "k3").item() == pytest.approx(0.5 - 1 - lr)
    with pytest.raises(ValueError, match="k4"):
        kl_estimate(lp, ref, "k4")


@pytest.mark.parametrize(
    "kind, per_token", [("k1", -math.log(0.5)), ("k2", 0.5 * math.log(0.5) ** 2), ("k3", 0.5 - 1 - math.log(0.5))]
)
def test_kl_penalty_in_loss(kind, per_token):
    fn = ClippedPGLossFn(reference_policy_kl_penalty=0.1, reference_policy_kl_type=kind)
    assert fn.needs_reference
    lp = _lp(0.5, 0.5)
    ref = torch.log(torch.tensor([[0.25, 0.25]], dtype=torch.float64))
    loss, m = fn(lp, lp.detach(), torch.zeros(1, dtype=torch.float64), torch.ones(1, 2), 2.0, reference_logprobs=ref)
    assert loss.item() == pytest.approx(0.1 * per_token)  # advantage 0: only the KL term
    assert m["kl_sum"] == pytest.approx(2 * per_token)
    with pytest.raises(ValueError, match="reference_logprobs"):
        fn(lp, lp.detach(), torch.zeros(1, dtype=torch.float64), torch.ones(1, 2), 2.0)


def test_reference_skipped_when_penalty_zero():
    fn = ClippedPGLossFn(reference_policy_kl_penalty=0.0)
    assert not fn.needs_reference
    lp = _lp(0.5, 0.25)
    old = torch.log(torch.tensor([[0.4, 0.25]], dtype=torch.float64))
    adv = torch.tensor([1.0], dtype=torch.float64)
    a, _ = fn(lp, old, adv, torch.ones(1, 2), 2.0)  # no reference needed
    b, _ = fn(lp, old, adv, torch.ones(1, 2), 2.0, reference_logprobs=torch.full((1, 2), float("nan")))
    assert a.item() == b.item() == pytest.approx(-(1.2 + 1.0) / 2)  # 0.5/0.4 = 1.25 -> clipped 1.2


def test_token_level_vs_sequence_level_mean():
    mask = torch.tensor([[1.0, 0, 0], [1, 1, 1]])
    lp = torch.zeros(2, 3, dtype=torch.float64)  # ratio 1 -> per-token loss = -A
    adv = torch.tensor([1.0, -2.0], dtype=torch.float64)
    tok, _ = ClippedPGLossFn(token_level_loss=True)(lp, lp, adv, mask, global_normalizer=4.0)
    seq, _ = ClippedPGLossFn(token_level_loss=False)(lp, lp, adv, mask, global_normalizer=2.0)
    assert tok.item() == pytest.approx((-1 + 3 * 2) / 4)
    assert seq.item() == pytest.approx((-1 + 2) / 2)


def test_truncated_and_masked_importance_sampling():
    lp = torch.zeros(1, 2, dtype=torch.float64, requires_grad=True)
    prev = torch.zeros(1, 2, dtype=torch.float64)
    gen = torch.tensor([[-math.log(3.0), -math.log(1.5)]], dtype=torch.float64)  # w = 3, 1.5
    adv = torch.tensor([1.0], dtype=torch.float64)
    mask = torch.ones(1, 2)
    tis, m = ClippedPGLossFn(importance_sampling="tis", tis_max=2.0)(lp, prev, adv, mask, 2.0, generation_logprobs=gen)
    assert tis.item() == pytest.approx(-(2.0 + 1.5) / 2) and m["is_ratio_sum"] == pytest.approx(3.5)
    assert m["is_oob_sum"] == 1.0  # w = 3 > tis_max
    mis, m = ClippedPGLossFn(importance_sampling="mis", mis_min=0.5, mis_max=2.0)(
        lp, prev, adv, mask, 2.0, generation_logprobs=gen
    )
    assert mis.item() == pytest.approx(-1.5 / 2) and m["is_oob_sum"] == 1.0
    assert m["is_ratio_sum"] == pytest.approx(1.5)  # the dropped token counts 0
    mis.backward()
    assert lp.grad[0, 0].item() == 0.0 and lp.grad[0, 1].item() == pytest.approx(-1.5 / 2)
    w = importance_weights(prev, gen, mask, "none")
    assert torch.equal(w, torch.ones(1, 2, dtype=torch.float64))
    with pytest.raises(ValueError, match="generation_logprobs"):
        ClippedPGLossFn(importance_sampling="tis")(lp, prev, adv, mask, 2.0)


def test_masked_nan_and_inf_never_reach_loss_or_grad():
    kw = dict(
        ratio_clip_c=3.0, reference_policy_kl_penalty=0.05, reference_policy_kl_type="k3", importance_sampling="tis"
    )
    fn = ClippedPGLossFn(**kw)
    mask = torch.tensor([[0.0, 1, 1, 0], [0, 1, 0, 0]])
    clean_lp = torch.log(torch.tensor([[0.3, 0.5, 0.2, 0.7], [0.1, 0.6, 0.4, 0.8]], dtype=torch.float64))
    prev = torch.log(torch.tensor([[0.3, 0.4, 0.3, 0.7], [0.1, 0.7, 0.4, 0.8]], dtype=torch.float64))
    gen = prev - 0.1
    ref = prev + 0.2
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)

    def run(poison: bool):
        lp = clean_lp.clone()
        p, g, r = prev.clone(), gen.clone(), ref.clone()
        if poison:
            off = ~mask.bool()
            lp[off] = float("nan")
            p[off] = float("inf")
            g[off] = float("-inf")
            r[off] = float("nan")
            lp[0, 3] = float("inf")
        lp.requires_grad_(True)
        loss, m = fn(lp, p, adv, mask, 3.0, generation_logprobs=g, reference_logprobs=r)
        loss.backward()
        return loss, lp.grad, m

    clean, g_clean, m_clean = run(False)
    dirty, g_dirty, m_dirty = run(True)
    assert torch.isfinite(dirty) and dirty.item() == clean.item()
    assert torch.isfinite(g_dirty).all() and torch.equal(g_dirty, g_clean)
    assert (g_dirty[~mask.bool()] == 0).all() and (g_dirty[mask.bool()] != 0).all()
    assert m_dirty == m_clean
    # Hand value of the clean loss: per token w*pg + beta*k3, w = min(exp(0.1), 2).
    w = math.exp(0.1)
    total = 0.0
    for b, t in [(0, 1), (0, 2), (1, 1)]:
        r = math.exp(clean_lp[b, t].item() - prev[b, t].item())
        a = adv[b].item()
        pg = -min(r * a, min(max(r, 0.8), 1.2) * a)
        if a < 0:
            pg = min(pg, 3.0 * -a)
        lr = ref[b, t].item() - clean_lp[b, t].item()
        total += w * pg + 0.05 * (math.exp(lr) - 1 - lr)
    assert clean.item() == pytest.approx(total / 3, rel=1e-12)


def test_bad_options_named():
    with pytest.raises(ValueError, match="ratio_clip_c"):
        ClippedPGLossFn(ratio_clip_c=0.5)
    with pytest.raises(ValueError, match="importance_sampling"):
        ClippedPGLossFn(importance_sampling="xis")
    with pytest.raises(ValueError, match="advantages"):
        ClippedPGLossFn()(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(3), torch.ones(2, 3), 1.0)

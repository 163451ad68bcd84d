"""Policy: logprob scoring, frozen tensors, and that a GRPO step moves probability the right way."""

import torch

from m3_rollout.model import M3ForCausalLM, tiny_config
from trainers.batch import TrainBatch
from trainers.loss import ClippedPGLossFn
from trainers.policy import Policy, token_logprobs


def _model():
    torch.manual_seed(0)
    m = M3ForCausalLM(tiny_config(vocab_size=50, max_position_embeddings=128))
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.1 if p.ndim >= 2 else 0.05)
    return m


def test_token_logprobs_matches_manual_softmax():
    m = _model().double()
    ids = torch.randint(0, 50, (2, 12))
    lp = token_logprobs(m, ids, temperature=0.7)
    logits = m(ids).double() / 0.7
    manual = torch.log_softmax(logits[0, 4], -1)[ids[0, 5]]
    assert lp[0, 0] == 0 and torch.isclose(lp[0, 5], manual, atol=1e-12)


def test_grpo_step_raises_positive_advantage_sequences():
    m = _model()
    policy = Policy(m, lr=1e-2)
    ids = torch.randint(0, 50, (4, 10))
    mask = torch.zeros(4, 10)
    mask[:, 5:] = 1
    with torch.no_grad():
        before = token_logprobs(m, ids)
    frozen = {n: p.detach().clone() for n, p in m.named_parameters() if "index_" in n or "correction_bias" in n}
    batch = TrainBatch(ids, mask, before.clone() * mask, torch.tensor([1.0, 1.0, -1.0, -1.0]), torch.full((4,), 10))
    metrics = policy.train_step(batch, ClippedPGLossFn(), temperature=1.0, micro_batch_size=2)
    # rollout logprobs equal the trainer's (same fp32 weights): no mismatch.
    assert abs(metrics["token_mult_prob_error"] - 1.0) < 1e-5 and metrics["grad_norm"] > 0
    with torch.no_grad():
        after = token_logprobs(m, ids)
    gain = ((after - before) * mask).sum(-1)
    assert gain[0] > 0 and gain[1] > 0 and gain[2] < 0 and gain[3] < 0
    for n, p in m.named_parameters():
        if n in frozen:
            assert torch.equal(p, frozen[n]), f"{n} must stay frozen"
    assert frozen, "the tiny config has indexer and router-bias tensors"


def test_prev_logprobs_given_once_clip_later_steps():
    """Two optimizer steps on one rollout batch: with the rollout-time logprobs passed in, the second
    step's ratio is measured against them (non-zero clip fraction after a large first step)."""
    m = _model()
    policy = Policy(m, lr=5e-2)
    ids = torch.randint(0, 50, (4, 10))
    mask = torch.zeros(4, 10)
    mask[:, 5:] = 1
    batch = TrainBatch(ids, mask, torch.zeros(4, 10), torch.tensor([1.0, -1.0, 1.0, -1.0]), torch.full((4,), 10))
    prev = policy.get_logprobs(batch, 1.0, 4)
    first = policy.train_step(batch, ClippedPGLossFn(), 1.0, 4, prev_logprobs=prev)
    second = policy.train_step(batch, ClippedPGLossFn(), 1.0, 4, prev_logprobs=prev)
    assert first["clip_fraction"] == 0.0
    assert second["clip_fraction"] > 0.0
    # Without it the ratio restarts at 1: nothing is clipped.
    assert policy.train_step(batch, ClippedPGLossFn(), 1.0, 4)["clip_fraction"] == 0.0

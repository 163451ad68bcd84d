"""Policy: logprob scoring, frozen tensors, and that a GRPO step moves probability the right way."""

import torch

from m3_rollout.model import M3ForCausalLM, tiny_config
from m3_trainers.batch import TrainBatch
from m3_trainers.loss import ClippedPGLossFn
from m3_trainers.policy import Policy, token_logprobs


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


# ---------------------------------------------------------------- optimisation
import math  # noqa: E402

import pytest  # noqa: E402

from m3_trainers.policy import frozen_parameter_names, lr_factor, mismatch_metrics  # noqa: E402


def _batch(seed=1, b=4, l=10):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 50, (b, l), generator=g)
    mask = torch.zeros(b, l)
    mask[:, 4:] = 1
    mask[1, 8:] = 0  # rows of different lengths
    lengths = torch.full((b,), l)
    lengths[1] = 8
    return TrainBatch(ids, mask, torch.zeros(b, l), torch.tensor([1.0, -0.5, 0.25, -1.0])[:b], lengths)


@pytest.mark.parametrize("token_level", [True, False])
def test_micro_batching_accumulates_the_global_batch_gradient(token_level):
    """One micro-batch of 4 vs four of 1: same loss and the same gradients (fp64)."""
    grads, losses = [], []
    for mbs in (4, 1):
        m = _model().double()
        policy = Policy(m, lr=1e-3, max_grad_norm=1e9)
        batch = _batch()
        metrics = policy.train_step(batch, ClippedPGLossFn(token_level_loss=token_level), 1.0, mbs)
        losses.append(metrics["loss"])
        grads.append({n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None})
    assert losses[0] == pytest.approx(losses[1], rel=1e-10, abs=1e-12)
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for n in grads[0]:
        assert torch.allclose(grads[0][n], grads[1][n], rtol=1e-9, atol=1e-12), n


def test_max_grad_norm_clips_the_applied_gradient():
    m = _model()
    policy = Policy(m, lr=1e-3, max_grad_norm=1e-3)
    metrics = policy.train_step(_batch(), ClippedPGLossFn(), 1.0, 4)
    total = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in m.parameters() if p.grad is not None))
    assert metrics["grad_norm"] > 1e-3  # reported norm is the pre-clip one
    assert total == pytest.approx(1e-3, rel=1e-4)


def test_lr_warmup_and_schedules_hand_values():
    assert [lr_factor(s, 4, "constant", 10, 0.0) for s in (0, 1, 3, 4, 9)] == [0.25, 0.5, 1.0, 1.0, 1.0]
    # linear: after warmup 2, decays over 8 steps to 0.1
    assert lr_factor(2, 2, "linear", 10, 0.1) == pytest.approx(1.0)
    assert lr_factor(6, 2, "linear", 10, 0.1) == pytest.approx(1.0 - 0.9 * 0.5)
    assert lr_factor(10, 2, "linear", 10, 0.1) == pytest.approx(0.1)
    assert lr_factor(6, 2, "cosine", 10, 0.0) == pytest.approx(0.5)
    assert lr_factor(10, 2, "cosine", 10, 0.2) == pytest.approx(0.2)
    policy = Policy(_model(), lr=1e-2, warmup_steps=2)
    seen = []
    for _ in range(3):
        seen.append(policy.train_step(_batch(), ClippedPGLossFn(), 1.0, 4)["lr"])
    assert seen == pytest.approx([5e-3, 1e-2, 1e-2])


def test_freeze_policy_and_weight_decay_groups():
    m = _model()
    policy = Policy(m, lr=1e-2, weight_decay=0.1, freeze_patterns=[r"^model\.embed_tokens\."])
    frozen = frozen_parameter_names(m, True, True, [r"^model\.embed_tokens\."])
    assert "model.embed_tokens.weight" in frozen
    assert any("index_q_proj" in n for n in frozen) and any("e_score_correction_bias" in n for n in frozen)
    names = {id(p): n for n, p in m.named_parameters()}
    decay, no_decay = policy.optimizer.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    in_opt = {names[id(p)] for g in (decay, no_decay) for p in g["params"]}
    assert not (in_opt & frozen)  # frozen tensors are not in the optimizer (no decay either)
    assert all("norm" in names[id(p)] or p.ndim < 2 for p in no_decay["params"])
    assert not any("norm" in names[id(p)] for p in decay["params"])
    assert len(in_opt) + len(frozen) == len(names)
    before = {n: p.detach().clone() for n, p in m.named_parameters() if n in frozen}
    policy.train_step(_batch(), ClippedPGLossFn(), 1.0, 4)
    for n, p in m.named_parameters():
        if n in frozen:
            assert torch.equal(p, before[n]), n
    with pytest.raises(ValueError, match="matches no parameter"):
        frozen_parameter_names(m, True, True, ["no_such_tensor"])


def test_entropy_and_ratio_metrics():
    m = _model().double()
    policy = Policy(m, lr=1e-3)
    batch = _batch()
    with torch.no_grad():
        lp, ent = token_logprobs(m, batch.token_ids, 1.0, return_entropy=True)
        logits = m(batch.token_ids)[0, 4]
    p = torch.softmax(logits, -1)
    assert ent[0, 5].item() == pytest.approx(float(-(p * p.log()).sum()), rel=1e-10)
    metrics = policy.train_step(batch, ClippedPGLossFn(), 1.0, 4)
    mask = batch.loss_mask.bool()
    assert metrics["entropy"] == pytest.approx(float(ent[mask].mean()), rel=1e-9)
    assert metrics["probs_ratio"] == pytest.approx(1.0) and metrics["probs_ratio_max"] == pytest.approx(1.0)
    assert metrics["probs_ratio_min"] == pytest.approx(1.0) and metrics["probs_ratio_clamped"] == pytest.approx(1.0)
    # NeMo RL's estimates from the generator's samples (rollout logprobs = gen)
    gen = batch.rollout_logprobs.double()
    w = torch.exp(lp - gen)[mask]
    assert metrics["approx_entropy"] == pytest.approx(float(-(w * lp[mask]).mean()), rel=1e-9)
    assert metrics["sampling_importance_ratio"] == pytest.approx(float(w.mean()), rel=1e-9)  # reported, IS off
    assert metrics["is_oob_ratio"] == 0.0


def test_mismatch_metrics_hand_values():
    roll = torch.tensor([[0.0, -1.0, -2.0]])
    train = torch.tensor([[5.0, -1.5, -1.0]])  # position 0 is masked (ignored)
    mask = torch.tensor([[0.0, 1.0, 1.0]])
    m = mismatch_metrics(roll, train, mask)
    assert m["token_mult_prob_error"] == pytest.approx((math.exp(0.5) + math.exp(1.0)) / 2)
    d1, d2 = -0.5, 1.0  # log r = train - rollout
    assert m["gen_kl_error"] == pytest.approx(((math.exp(d1) - 1 - d1) + (math.exp(d2) - 1 - d2)) / 2)
    assert m["policy_kl_error"] == pytest.approx(((math.exp(-d1) - 1 + d1) + (math.exp(-d2) - 1 + d2)) / 2)
    jsd = 0.0
    for p, q in ((-1.5, -1.0), (-1.0, -2.0)):  # (trainer, rollout) logprobs of the sampled tokens
        mix = math.log((math.exp(p) + math.exp(q)) / 2)
        jsd += 0.5 * (math.exp(p - mix) - 1 - (p - mix)) + 0.5 * (math.exp(q - mix) - 1 - (q - mix))
    assert m["js_divergence_error"] == pytest.approx(jsd / 2)
    assert m["max_logprob_abs_diff"] == pytest.approx(1.0)


# ---------------------------------------------------------------- generator vs trainer mismatch
def _generator_batch(gen_dtype: torch.dtype, model):
    """Sample 8 continuations from a generator holding the SAME weights (temperature 1, no
    top-k/top-p), then return the TrainBatch of rollout logprobs."""
    from m3_rollout.engine.interface import GenerationRequest, SamplingParams

    gen_model = _model()
    gen_model.load_state_dict(model.state_dict())
    gen_model = gen_model.cast_for_inference(gen_dtype)
    from m3_rollout.engine.native_backend import NativeBackend

    backend = NativeBackend(gen_model, [49], max_model_len=64, max_num_seqs=8)
    prompts = [[1, 5, 9, 13, 2, 7], [3, 4, 8, 15, 16, 23, 42]]
    reqs = [
        GenerationRequest(f"r{i}", p, SamplingParams(n=4, temperature=1.0, max_new_tokens=20, seed=7))
        for i, p in enumerate(prompts)
    ]
    outs = backend.generate(reqs)
    rows = [(o.prompt_ids + o.output_ids, len(o.prompt_ids), o.logprobs) for o in outs]
    l = max(len(r[0]) for r in rows)
    b = len(rows)
    ids = torch.zeros(b, l, dtype=torch.long)
    mask = torch.zeros(b, l)
    lps = torch.zeros(b, l)
    for i, (toks, p, lp) in enumerate(rows):
        ids[i, : len(toks)] = torch.tensor(toks)
        mask[i, p : len(toks)] = 1
        lps[i, p : len(toks)] = torch.tensor(lp)
    return TrainBatch(ids, mask, lps, torch.zeros(b), torch.tensor([len(r[0]) for r in rows]))


def test_token_mult_prob_error_is_one_with_same_weights_fp32():
    """The native engine (paged KV, decode one token at a time) vs the trainer's full forward."""
    model = _model()
    policy = Policy(model, lr=1e-3)
    batch = _generator_batch(torch.float32, model)
    prev = policy.get_logprobs(batch, 1.0, 8)
    m = mismatch_metrics(batch.rollout_logprobs, prev, batch.loss_mask)
    assert batch.loss_mask.sum() >= 40
    assert abs(m["token_mult_prob_error"] - 1.0) < 1e-6, m
    assert m["gen_kl_error"] < 1e-10
    # bf16 generator, same weights: measurably worse (figure reported in docs/benchmarks.md)
    batch16 = _generator_batch(torch.bfloat16, model)
    m16 = mismatch_metrics(batch16.rollout_logprobs, policy.get_logprobs(batch16, 1.0, 8), batch16.loss_mask)
    print(
        f"\nfp32 token_mult_prob_error {m['token_mult_prob_error']:.9f} gen_kl {m['gen_kl_error']:.2e}"
        f" | bf16 {m16['token_mult_prob_error']:.6f} gen_kl {m16['gen_kl_error']:.2e}"
    )
    assert 1.0 + 1e-5 < m16["token_mult_prob_error"] < 1.2


def test_sequence_level_loss_averages_over_sequences_with_loss_tokens_only():
    """token_level_loss=false divided by every row of the batch, so an overlong-filtered or errored
    row (all-zero loss mask) halved the others' loss and gradient; NeMo RL divides by the valid
    sequences. Rows 0-1 alone vs rows 0-1 plus two masked rows: the same loss and gradients."""
    out = []
    for masked_rows in (0, 2):
        m = _model().double()
        policy = Policy(m, lr=1e-3, max_grad_norm=1e9)
        full = _batch(b=4)
        keep = 2 + masked_rows
        mask = full.loss_mask[:keep].clone()
        mask[2:] = 0
        batch = TrainBatch(
            full.token_ids[:keep], mask, full.rollout_logprobs[:keep], full.advantages[:keep], full.lengths[:keep]
        )
        metrics = policy.train_step(batch, ClippedPGLossFn(token_level_loss=False), 1.0, 4)
        out.append((metrics["loss"], {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}))
    (loss_a, grads_a), (loss_b, grads_b) = out
    assert loss_a == pytest.approx(loss_b, rel=1e-10) and loss_a != 0
    for n in grads_a:
        assert torch.allclose(grads_a[n], grads_b[n], rtol=1e-9, atol=1e-14), n

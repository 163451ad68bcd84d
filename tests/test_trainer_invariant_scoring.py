"""The trainer's prev logprobs through the engine's batch-invariant paged forward (issue 24; design.md §4.6).

On CPU (fp32, Triton interpreter): the engine in batch-invariant mode (invariant table with the
interpreted invariant attention, its sparse layers by page partials, the default, and in the first
test by the union walk too; the invariant logprob op) generates several prompts at once,
n > 1 samples each (the union walk's case: one each), prompts of different lengths, prefills
chunked by a small step budget; the trainer's ``Policy.get_logprobs`` with the job layer's
``PagedScorer`` (same table, another chunk size, the batch's sequences packed into its forwards)
gives every sampled token's logprob bitwise equal to the engine's recorded one, so the trainer's
mismatch metrics read exactly 1.0 / 0.0; a sequence scored alone, or packed with others in another
order, gives the same bits. The interpreter's ``tl.dot`` runs in a fixed per-row order
(``msa_interpret.fixed_order_dot``: numpy's BLAS is position-dependent on the CPU, the GPU is not).
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from paged_model_util import small_paged_model  # tests/ on sys.path

from m3_kernels.fused_interpret import interpreted_invariant_ops
from m3_kernels.msa_interpret import fixed_order_dot
from m3_rollout.engine.config import EngineConfig
from m3_rollout.engine.engine import LLMEngine
from m3_rollout.engine.interface import GenerationRequest, SampleOutput, SamplingParams
from m3_rollout.engine.ops import interpreted_paged_ops, invariant_attention_fields
from m3_rollout.engine.score import PagedScorer
from m3_rollout.model import M3ForCausalLM
from m3_trainers.batch import TrainBatch
from m3_trainers.loss import ClippedPGLossFn
from m3_trainers.policy import Policy, mismatch_metrics

PS = 16  # the invariant attention's smallest page / head dim
TEMPERATURE = 0.9


@pytest.fixture(autouse=True, scope="module")
def per_row_dot():
    with fixed_order_dot():
        yield


def _model() -> M3ForCausalLM:
    """One dense and one sparse layer: the interpreter runs every kernel program in Python, and the
    property (engine bits = trainer bits) is per layer kind."""
    return small_paged_model(0, vocab_size=96, head_dim=16, page_size=PS, layers=2)


def _table(sparse_impl: str | None = None):
    """The invariant table, interpreted; sparse_impl None = the default sparse attention (page partials)."""
    choice = {} if sparse_impl is None else {"invariant_sparse_attention": sparse_impl}
    return dataclasses.replace(
        interpreted_paged_ops(batch_invariant=True), **invariant_attention_fields(interpret=True, **choice)
    )


def _generate(model, ops, token_logprobs, n: int):
    """Three prompts (lengths 31, 6, 12; 31 + 3 > top-k 2 x block 16, so sparse layers select) x
    ``n`` samples, prefill chunked by 16 tokens; returns [(ids, generated from, recorded logprobs)]."""
    g = torch.Generator().manual_seed(5)
    prompts = {name: torch.randint(0, 96, (ln,), generator=g).tolist() for name, ln in (("a", 31), ("b", 6), ("c", 12))}
    cfg = EngineConfig(max_model_len=40, max_num_seqs=6, num_pages=20, max_num_batched_tokens=16, batch_invariant=True)
    engine = LLMEngine(model, cfg, ops=ops)
    engine.runner.token_logprobs = token_logprobs  # CPU: the engine leaves torch's (CUDA only)
    for name, ids in prompts.items():
        engine.add_request(
            GenerationRequest(name, ids, SamplingParams(n=n, temperature=TEMPERATURE, max_new_tokens=3, seed=3))
        )
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if isinstance(o, SampleOutput)]
    return [(o.prompt_ids + o.output_ids, len(o.prompt_ids), o.logprobs) for o in outs]


_SAMPLES: dict = {}


def _n(sparse_impl: str | None) -> int:
    """Samples per prompt: 2 with the default table; 1 with the union walk (what n > 1 adds, samples
    sharing their prompt's pages, is the engine's and the same for both choices; every sampled token
    is scored, so this halves the slowest case under the interpreter)."""
    return 2 if sparse_impl is None else 1


def _samples(sparse_impl: str | None = None):
    """The engine's samples of ``_generate`` on ``_model()`` with ``_table(sparse_impl)`` (cached per
    test session: the slowest part under the interpreter)."""
    if sparse_impl not in _SAMPLES:
        ops = _table(sparse_impl)
        _SAMPLES[sparse_impl] = _generate(_model(), ops, interpreted_invariant_ops().token_logprobs, _n(sparse_impl))
    return _SAMPLES[sparse_impl]


@pytest.fixture(scope="module")
def samples(per_row_dot):
    """The engine's samples with the default table (page partials)."""
    return _samples()


def _batch(samples) -> TrainBatch:
    b, l = len(samples), max(len(ids) for ids, _, _ in samples)
    tok, mask, lp = torch.zeros(b, l, dtype=torch.int64), torch.zeros(b, l), torch.zeros(b, l)
    for r, (ids, p, rec) in enumerate(samples):
        tok[r, : len(ids)] = torch.tensor(ids)
        mask[r, p : len(ids)] = 1
        lp[r, p : len(ids)] = torch.tensor(rec, dtype=torch.float32)
    lengths = torch.tensor([len(ids) for ids, _, _ in samples])
    return TrainBatch(tok, mask, lp, torch.linspace(-1, 1, b), lengths)


def _count_forwards(model) -> list[list[int]]:
    """Wrap ``model.forward_paged`` to record each forward's query lengths (tokens per sequence)."""
    seen, inner = [], model.forward_paged

    def forward_paged(input_ids, meta, *args):
        seen.append(meta.query_start_loc.diff().tolist())
        return inner(input_ids, meta, *args)

    model.forward_paged = forward_paged
    return seen


@pytest.mark.parametrize("sparse_impl", [None, "union"], ids=["default", "union"])
def test_trainer_prev_logprobs_equal_the_engines_bitwise(sparse_impl, per_row_dot):
    """The engine and the scorer built with one sparse attention: the default (page partials, whose
    table takes the KV-major scratch: the engine and the scorer bind their own) or the union walk."""
    ops, inv = _table(sparse_impl), interpreted_invariant_ops()
    want = "page_partials" if sparse_impl is None else sparse_impl
    assert ops.msa_attention.keywords["sparse_impl"] == want and ops.takes_prefill_scratch == (want != "union")
    samples = _samples(sparse_impl)
    master = _model()
    assert len(samples) == 3 * _n(sparse_impl) and len({len(s[0]) for s in samples}) >= 3
    assert max(len(s[0]) for s in samples) > 2 * PS + 1  # past top-k x block: the sparse layer selects
    batch = _batch(samples)
    scorer = PagedScorer(master.config, ops, 40, 11, torch.float32, "cpu", token_logprobs=inv.token_logprobs)
    policy = Policy(master, lr=1e-3, scorer=scorer)
    forwards = _count_forwards(policy.compute)
    prev = policy.get_logprobs(batch, TEMPERATURE, micro_batch_size=4)
    # packed: forwards of at most 11 tokens, some holding several sequences, long ones split
    assert max(sum(f) for f in forwards) == 11 and max(len(f) for f in forwards) >= 2
    assert sum(map(sum, forwards)) == sum(len(ids) - 1 for ids, _, _ in samples)  # each token once, last not run
    m = batch.loss_mask.bool()
    assert torch.equal(prev[m], batch.rollout_logprobs[m])
    if sparse_impl == "union":
        return  # the choice's own check ends here; the rest (alone, plain, train_step) does not depend on it
    # the longest sequence (its sparse layer selects) alone, a batch of one, gives the packed bits at
    # every position (shorter rows alone vs packed in two orders: test_packed_rows_score_as_alone)
    ids = samples[0][0]
    assert len(ids) > 2 * PS + 1
    assert torch.equal(scorer(policy.compute, [ids], TEMPERATURE)[0], prev[0, : len(ids)])
    got = mismatch_metrics(batch.rollout_logprobs, prev, batch.loss_mask)
    assert got["token_mult_prob_error"] == 1.0 and got["gen_kl_error"] == 0.0
    assert got["max_logprob_abs_diff"] == 0.0
    # the training forward (not on the invariant ops) agrees only to rounding
    plain = Policy(copy.deepcopy(master), lr=1e-3).get_logprobs(batch, TEMPERATURE, micro_batch_size=4)
    assert (plain[m] - prev[m]).abs().max() < 1e-4
    # train_step recomputes the prev logprobs through the scorer and reports the exact metrics (on 3
    # of the rows, 2 micro-batches: the wiring, not the scorer's bits, is checked here)
    sub = _batch(samples[2:5])
    step = policy.train_step(sub, ClippedPGLossFn(0.2, 0.2, True), TEMPERATURE, micro_batch_size=2)
    assert step["token_mult_prob_error"] == 1.0 and step["gen_kl_error"] == 0.0


def test_paged_scorer_errors():
    ops = _table()
    m = _model()
    with pytest.raises(ValueError, match="chunk_tokens"):
        PagedScorer(m.config, ops, 32, 0, torch.float32, "cpu")
    scorer = PagedScorer(m.config, ops, 8, 4, torch.float32, "cpu")
    with pytest.raises(ValueError, match="max_model_len=8"):
        scorer(m, [[1, 2], list(range(9))], 1.0)
    with pytest.raises(ValueError, match="0 tokens"):
        scorer(m, [[]], 1.0)
    forwards = _count_forwards(m)
    got = scorer(m, [[3], [5]], 1.0)  # a single token predicts nothing: no forward
    assert len(got) == 2 and all(torch.equal(g, torch.zeros(1)) for g in got) and not forwards
    assert scorer(m, [], 1.0) == []


def test_packed_rows_score_as_alone():
    """Sequences of different contents and lengths (split across forwards, sharing forwards, one
    of a single token) packed in two different orders: each row's logprobs are bitwise its own
    alone, so no row's logits or targets were taken from another's; the pages all go back."""
    ops, inv = _table(), interpreted_invariant_ops()
    m = _model()
    g = torch.Generator().manual_seed(11)
    rows = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (13, 5, 1, 4, 7)]
    scorer = PagedScorer(m.config, ops, 32, 11, torch.float32, "cpu", token_logprobs=inv.token_logprobs)
    alone = [scorer(m, [ids], TEMPERATURE)[0] for ids in rows]
    forwards = _count_forwards(m)
    orders = {"in order": list(range(len(rows))), "shuffled": [3, 0, 4, 2, 1]}
    for name, order in orders.items():
        got = scorer(m, [rows[i] for i in order], TEMPERATURE)
        for i, lp in zip(order, got):
            assert lp.shape == (len(rows[i]),) and lp[0] == 0, name
            assert torch.equal(lp, alone[i]), f"{name}: row {i}"
    assert max(len(f) for f in forwards) >= 2  # several rows in one forward
    assert scorer.block_manager.num_free_pages == scorer.block_manager.num_pages


def test_loss_numerator_takes_the_invariant_value_and_the_training_gradient(samples):
    """The ratio's numerator in ``train_step`` is the scorer's value (so against the rollout's own
    logprobs the ratio is exactly 1 on every token, where the training forward's is 1 only to
    rounding), and its gradient is the training forward's (the update equals the plain policy's
    to rounding). Three of the samples (one whose sparse layer selects), two micro-batches."""
    ops, inv = _table(), interpreted_invariant_ops()
    master = _model()
    batch = _batch(samples[1:4])
    assert batch.lengths.max() > 2 * PS + 1
    scorer = PagedScorer(master.config, ops, 40, 11, torch.float32, "cpu", token_logprobs=inv.token_logprobs)
    fn = ClippedPGLossFn(0.2, 0.2, True)
    policies = {"invariant": Policy(copy.deepcopy(master), lr=1e-2, scorer=scorer)}
    policies["plain"] = Policy(copy.deepcopy(master), lr=1e-2)
    got = {}
    for name, policy in policies.items():
        # prev = the rollout's logprobs, not on these weights' scoring: train_step scores the numerator itself
        got[name] = policy.train_step(batch, fn, TEMPERATURE, 2, prev_logprobs=batch.rollout_logprobs.clone())
    inv_m, plain_m = got["invariant"], got["plain"]
    assert inv_m["probs_ratio_min"] == 1.0 and inv_m["probs_ratio_max"] == 1.0
    assert inv_m["token_mult_prob_error"] == 1.0 and inv_m["clip_fraction"] == 0.0
    assert (plain_m["probs_ratio_min"], plain_m["probs_ratio_max"]) != (1.0, 1.0)  # rounding shows there
    assert abs(plain_m["probs_ratio_max"] - 1.0) < 1e-4 and abs(plain_m["probs_ratio_min"] - 1.0) < 1e-4
    assert inv_m["grad_norm"] > 0 and abs(inv_m["grad_norm"] - plain_m["grad_norm"]) < 1e-3 * plain_m["grad_norm"]
    grads = {
        name: [p.grad for p in pol.model.parameters() if p.requires_grad and p.grad is not None]
        for name, pol in policies.items()
    }
    assert len(grads["invariant"]) == len(grads["plain"]) > 0
    for gi, gp in zip(grads["invariant"], grads["plain"]):  # the gradient is the training forward's
        torch.testing.assert_close(gi, gp, rtol=1e-3, atol=1e-6 * plain_m["grad_norm"])

"""Prompt logprobs from the prefill (``SamplingParams.prompt_logprobs``, vLLM's way): every prompt
position's logprob, rank and top k, computed from the prefill chunks' own logits, equal the plain
scoring forward (``LLMEngine.top_logprobs(..., with_tokens=True)``, the server's path for backends
without them) on an fp64 model, whatever the chunking, with n > 1 (the leader scores, the samples
share), async scheduling with the staged decode graphs, a prompt whose pages sit in the prefix
cache (not read: the entries are whole) and a preemption mid-prompt (nothing scored twice);
asking changes no other row's bits; entries are stamped with the weight-write count (-1 on KV
from weights written over since)."""

import dataclasses

import pytest
import torch
from test_engine_async import _drive  # tests/ is on sys.path under pytest: run to the end, pages freed
from test_engine_core import _model

from m3_rollout.engine.config import EngineConfig
from m3_rollout.engine.engine import LLMEngine
from m3_rollout.engine.interface import GenerationRequest, SampleOutput, SamplingParams

V, EOS = 96, 3
MODEL64 = _model().double()


def _prompt(n, seed):
    return torch.randint(4, V, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _engine(model=MODEL64, **kw):
    kw.setdefault("max_model_len", 96)
    kw.setdefault("max_num_seqs", 16)
    kw.setdefault("async_scheduling", False)
    return LLMEngine(model, EngineConfig(eos_token_ids=(EOS,), **kw))


def _req(rid, prompt, k=3, **kw):
    kw = {"n": 1, "seed": 5, "max_new_tokens": 4, **kw}
    return GenerationRequest(rid, prompt, SamplingParams(prompt_logprobs=k, **kw))


def _check(eng, out: SampleOutput, params: SamplingParams, abs_tol=1e-9):
    """``out.prompt_logprobs`` against the scoring forward of its prompt in the same distribution."""
    p, k = out.prompt_ids, params.prompt_logprobs
    got = out.prompt_logprobs
    assert len(got) == len(p) and got[0] is None and len(out.prompt_weight_writes) == len(p) - 1
    want = eng.top_logprobs(p, 1, k, *params.logprob_filters(), with_tokens=True)
    for g, w in zip(got[1:], want, strict=True):
        assert g.logprob == pytest.approx(w.logprob, abs=abs_tol) or g.logprob == w.logprob == float("-inf")
        assert g.rank == w.rank
        assert [t for t, _ in g.top] == [t for t, _ in w.top] and len(g.top) <= k
        assert [v for _, v in g.top] == pytest.approx([v for _, v in w.top], abs=abs_tol)


REQS = [
    _req("a", _prompt(37, 1), 3, n=3, temperature=0.7),
    _req("b", _prompt(21, 2), 0, top_k=5, temperature=1.3),
    _req("c", _prompt(30, 3), 5, top_p=0.8, logprobs_mode="raw"),
    _req("d", _prompt(2, 4), 2),
    _req("e", _prompt(1, 5), 2),
]


@pytest.mark.parametrize("budget,async_mode", [(7, False), (16, True), (512, False)])
def test_prefill_prompt_logprobs_equal_the_scoring_forward(budget, async_mode):
    graphs = dict(enable_cuda_graphs="eager", cuda_graph_batch_sizes=(4, 16)) if async_mode else {}
    eng = _engine(max_num_batched_tokens=budget, async_scheduling=async_mode, **graphs)
    outs = _drive(eng, REQS)
    assert eng.stats.graph_steps > 0 or not async_mode  # the staged decode graphs still serve decodes
    params = {r.request_id: r.params for r in REQS}
    assert len(outs) == 7
    for (rid, _), o in outs.items():
        if rid != "e":  # one token: nothing to score
            _check(eng, o, params[rid])
        assert o.prompt_weight_writes == [0] * (len(o.prompt_ids) - 1)
    a = [outs[("a", i)].prompt_logprobs for i in range(3)]
    assert a[0] == a[1] == a[2]  # the leader's prefill scored them once for its group
    assert all(len(e.top) == 5 for e in outs[("c", 0)].prompt_logprobs[1:])  # raw: no filter removes any
    assert outs[("e", 0)].prompt_logprobs == [None] and outs[("e", 0)].prompt_weight_writes == []
    plain = _drive(_engine(max_num_batched_tokens=budget), [dataclasses.replace(REQS[0], params=SamplingParams())])
    assert plain[("a", 0)].prompt_logprobs is None and plain[("a", 0)].prompt_weight_writes == []


def test_a_cached_prompt_is_scored_whole():
    """The prompt's pages are in the prefix cache: a request asking for prompt logprobs reads none
    of them (every position's logits are computed); one that does not ask still hits."""
    eng = _engine(max_num_batched_tokens=8)
    prompt = _prompt(41, 7)
    _drive(eng, [_req("warm", prompt, None)])
    hits = eng.block_manager.hit_tokens
    outs = _drive(eng, [_req("asks", prompt, 2, n=2)])
    assert eng.block_manager.hit_tokens == hits  # no prefix-cache read
    for o in outs.values():
        _check(eng, o, SamplingParams(prompt_logprobs=2))
    _drive(eng, [_req("again", prompt, None)])
    assert eng.block_manager.hit_tokens > hits  # the cache still serves requests that do not ask


def test_preemption_mid_prompt_scores_nothing_twice():
    """A preemption by recompute in the middle of the prompt's prefill (``preempt_all`` after two
    chunks; and a page pool too small for the batch): the recompute scores only positions not
    scored yet, the entries equal one uninterrupted prefill's."""
    req = _req("p", _prompt(45, 9), 4, n=2, temperature=0.9)
    eng = _engine(max_num_batched_tokens=8)
    outs = _drive(eng, [req], lambda e, calls: e.preempt_all() if calls == 2 else None)
    assert eng.metrics()["num_preemptions"] == 1
    for o in outs.values():
        _check(eng, o, req.params)
    tight = _engine(max_num_batched_tokens=8, num_pages=30, max_model_len=64)
    many = [_req(f"r{i}", _prompt(30 + i, 20 + i), 2, n=2, max_new_tokens=24) for i in range(4)]
    outs = _drive(tight, many)
    assert tight.metrics()["num_preemptions"] > 0
    for (rid, _), o in outs.items():
        _check(tight, o, many[int(rid[1:])].params)


def test_asking_changes_no_other_rows_bits():
    model = _model()  # fp32: bits would show a changed forward
    others = [_req(f"o{i}", _prompt(9 + 5 * i, 30 + i), None, n=2, max_new_tokens=10) for i in range(3)]
    asker = _req("x", _prompt(33, 40), 5, max_new_tokens=10)
    base = _drive(
        _engine(model, max_num_batched_tokens=16),
        others + [dataclasses.replace(asker, params=SamplingParams(seed=5, max_new_tokens=10))],
    )
    got = _drive(_engine(model, max_num_batched_tokens=16), others + [asker])
    for key, o in base.items():
        assert got[key].output_ids == o.output_ids and got[key].logprobs == o.logprobs, key
        assert got[key].prompt_logprobs is None or key[0] == "x"


def test_batch_invariant_mode_takes_the_samplers_logprob_op():
    """The prompt tokens' own logprobs go through the sampler's logprob op (batch-invariant mode's
    fixed-order one), as the sampled tokens' do."""
    eng = _engine(max_num_batched_tokens=8)
    calls = []

    def op(x, t):
        calls.append(t.shape[0])
        return torch.log_softmax(x, dim=-1).gather(1, t[:, None])[:, 0]

    eng.runner.token_logprobs = op
    prompt = _prompt(20, 11)
    out = _drive(eng, [_req("i", prompt, 2, max_new_tokens=1)])[("i", 0)]
    assert sum(calls) >= len(prompt) - 1 + 1  # the prompt's 19 positions, then the sampled token
    _check(eng, out, SamplingParams(prompt_logprobs=2))


def test_a_weight_write_between_chunks_is_stamped():
    """An update lands after the prompt's first chunk and the request goes on (in_flight
    "continue" without recompute): the later entries ran on KV from the earlier weights, -1."""
    eng = _engine(max_num_batched_tokens=8)
    prompt = _prompt(20, 12)
    out = _drive(eng, [_req("w", prompt, 1)], lambda e, calls: e.count_weight_write() if calls == 1 else None)
    assert out[("w", 0)].prompt_weight_writes == [0] * 8 + [-1] * 11
    assert out[("w", 0)].token_weight_writes[0] == -1


def test_prompt_logprobs_param_checked():
    assert SamplingParams(prompt_logprobs=20).validate().prompt_logprobs == 20
    assert SamplingParams().validate().prompt_logprobs is None
    for bad in (21, -1, True, 1.5, "2"):
        with pytest.raises(ValueError, match=r"SamplingParams\.prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad).validate()


def test_a_top_list_longer_than_the_vocabulary_lists_it_once():
    """prompt_logprobs above V (a toy vocabulary of 12): each position lists the whole vocabulary,
    its own tokens only (the entries used to run into the next position's list: 20 entries, 8 of
    them another position's)."""
    from m3_rollout.model import M3ForCausalLM, tiny_config

    torch.manual_seed(0)
    cfg = tiny_config(vocab_size=12, max_position_embeddings=256, sparse_block_size=4, sparse_topk_blocks=3)
    eng = _engine(M3ForCausalLM(cfg).double().eval(), max_model_len=64)
    prompt = [5, 6, 7, 8, 9, 10]
    out = _drive(eng, [_req("v", prompt, 20, max_new_tokens=2)])[("v", 0)]
    _check(eng, out, SamplingParams(prompt_logprobs=20))
    assert [sorted(t for t, _ in e.top) for e in out.prompt_logprobs[1:]] == [list(range(12))] * 5

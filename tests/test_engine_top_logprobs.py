"""Top logprobs from the sampler (``SamplingParams.top_logprobs``): each generated token's top-k
alternatives, computed at sampling time from the distribution its logprob comes from, equal the
engine's scoring forward of the same sequence (``LLMEngine.top_logprobs``: log_softmax of the
processed logits, topk) on the eager and the staged CUDA-graph path; asking changes no sampled
token or logprob, and rows that do not ask get None."""

import dataclasses

import pytest
from test_engine_async import _drive, _engine, _grpo_requests

from m3_rollout.engine.interface import SamplingParams, StreamDelta


def _ask(reqs, k):
    return [
        dataclasses.replace(r, params=dataclasses.replace(r.params, top_logprobs=0 if i == 3 else k))
        for i, r in enumerate(reqs)
    ]


def _check_against_scoring(eng, outs, k):
    for o in outs.values():
        p = o.prompt_ids
        assert len(o.top_logprobs) == len(o.output_ids)
        req_p = o._params
        filters = (1.0, -1, 1.0) if req_p.logprobs_mode == "raw" else (req_p.temperature, req_p.top_k, req_p.top_p)
        want = eng.top_logprobs(p + o.output_ids, len(p), k, *filters)
        for got_row, want_row, tid, lp in zip(o.top_logprobs, want, o.output_ids, o.logprobs):
            assert [t for t, _ in got_row] == [t for t, _ in want_row]
            assert [v for _, v in got_row] == pytest.approx([v for _, v in want_row], abs=1e-4)
            assert len(got_row) <= k
            if tid in dict(got_row):  # the sampled token's entry is its sampled logprob
                assert dict(got_row)[tid] == pytest.approx(lp, abs=1e-5)


@pytest.mark.parametrize("staged", [False, True])
def test_sampler_top_logprobs_equal_scoring_forward(staged):
    kw = dict(enable_cuda_graphs="eager", cuda_graph_batch_sizes=(4, 16, 32)) if staged else {}
    reqs = _grpo_requests()[:4]
    base = _drive(_engine(staged, **kw), reqs)
    eng = _engine(staged, **kw)
    asked = _ask(reqs, 5)
    outs = _drive(eng, asked)
    if staged:
        assert eng.stats.graph_steps > 0
    params = {r.request_id: r.params for r in asked}
    for key, o in outs.items():  # asking changes no sampled token or logprob (bits)
        assert o.output_ids == base[key].output_ids and o.logprobs == base[key].logprobs
        o._params = params[o.request_id]
    _check_against_scoring(eng, {k: o for k, o in outs.items() if o._params.top_logprobs}, 5)
    assert all(o.top_logprobs is None for o in outs.values() if not o._params.top_logprobs)
    # processed and raw rows, a top-p row, and one that does not ask
    assert {p.logprobs_mode for p in params.values() if p.top_logprobs} == {"processed", "raw"}


def test_streamed_top_logprobs_equal_final():
    reqs = _ask(_grpo_requests()[:2], 3)
    eng = _engine(False)
    for r in reqs:
        eng.add_request(r, stream=True)
    streamed, final = {}, {}
    while eng.has_unfinished():
        for o in eng.step():
            key = (o.request_id, o.sample_index)
            if isinstance(o, StreamDelta):
                if o.top_logprobs is not None:
                    streamed.setdefault(key, []).extend(o.top_logprobs)
                    assert len(o.top_logprobs) == len(o.token_ids)
            else:
                final[key] = o
    asked = [k for k, o in final.items() if o.top_logprobs is not None]
    assert asked and all(streamed[k] == final[k].top_logprobs for k in asked)


def test_top_logprobs_param_checked():
    assert SamplingParams(top_logprobs=20).validate().top_logprobs == 20
    with pytest.raises(ValueError, match="top_logprobs"):
        SamplingParams(top_logprobs=21).validate()
    with pytest.raises(ValueError, match="top_logprobs"):
        SamplingParams(top_logprobs=-1).validate()


@pytest.mark.parametrize("staged", [False, True])
def test_top_logprobs_hold_the_penalties_the_sampled_logprob_holds(staged):
    """Penalties and logit biases are part of the processed distribution the token was sampled
    from, so its top list holds them too: the sampled token's entry equals its sampled logprob, and
    a token pushed up by a logit bias heads the list while raw rows keep the unbiased values."""
    kw = dict(enable_cuda_graphs="eager", cuda_graph_batch_sizes=(4, 16, 32)) if staged else {}
    reqs = _grpo_requests()[:2]
    boosted = 7
    pen = dict(top_logprobs=4, presence_penalty=1.5, frequency_penalty=0.5, logit_bias=((boosted, 8.0),))
    asked = [
        dataclasses.replace(r, params=dataclasses.replace(r.params, logprobs_mode=mode, top_k=-1, top_p=1.0, **pen))
        for r, mode in zip(reqs, ("processed", "raw"))
    ]
    eng = _engine(staged, **kw)
    outs = _drive(eng, asked)
    if staged:
        assert eng.stats.graph_steps > 0
    by_mode = {r.request_id: r.params.logprobs_mode for r in asked}
    seen = 0
    for o in outs.values():
        assert len(o.top_logprobs) == len(o.output_ids)
        for row, tid, lp in zip(o.top_logprobs, o.output_ids, o.logprobs):
            if tid in dict(row):
                assert dict(row)[tid] == pytest.approx(lp, abs=1e-5)
                seen += 1
            if by_mode[o.request_id] == "processed":
                assert row[0][0] == boosted  # +8 on a near-flat distribution: first in every list
    assert seen > 0
    raw = [o for o in outs.values() if by_mode[o.request_id] == "raw"]
    assert raw and any(row[0][0] != boosted for o in raw for row in o.top_logprobs)

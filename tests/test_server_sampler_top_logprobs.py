"""The OpenAI routes take generated tokens' top_logprobs from the sampler (``SampleOutput.
top_logprobs`` / streamed deltas), vLLM's way: no scoring forward runs for them (counted on the
engine's ``top_logprobs``), streamed chunks carry their tokens' lists (== the non-streamed
answer), n > 1 samples each get theirs, and they equal the engine's scoring forward of the same
sequence. Echoed prompt logprobs come from the engine's prefill: no forward either (only
``max_tokens=0`` scores the prompt, once for its n choices and both prompt fields)."""

import openai
import pytest
from server_util import MESSAGES, LiveServer, native_backend, served_model, tiny_model, tiny_tokenizer

MAX_LEN = 256


@pytest.fixture(scope="module")
def setup():
    tok = tiny_tokenizer()
    served = served_model(tok, len(tok), MAX_LEN)
    backend = native_backend(tiny_model(len(tok), seed=0, max_len=MAX_LEN), served)
    engine = backend.engine
    calls = []
    scoring = engine.top_logprobs

    def counted(*args, **kw):
        calls.append(args)
        return scoring(*args, **kw)

    engine.top_logprobs = counted
    srv = LiveServer(served, backend)
    yield srv, engine, scoring, calls, served
    srv.stop()


def _chat(srv, stream, n=2):
    c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x")
    kw = dict(model="tiny-m3", messages=MESSAGES, max_tokens=6, seed=11, n=n, temperature=0.8, top_p=0.9)
    kw.update(logprobs=True, top_logprobs=3, extra_body={"return_token_ids": True})
    if not stream:
        r = c.chat.completions.create(**kw)
        prompt = r.model_extra["prompt_token_ids"]
        return prompt, {ch.index: (ch.model_extra["token_ids"], ch.logprobs.content) for ch in r.choices}
    got: dict = {}
    for chunk in c.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            ids, entries = got.setdefault(ch.index, ([], []))
            ids += ch.model_extra.get("token_ids") or []
            entries += ch.logprobs.content if ch.logprobs and ch.logprobs.content else []
    return None, got


def test_chat_top_logprobs_come_from_the_sampler_without_a_scoring_forward(setup):
    srv, engine, scoring, calls, served = setup
    calls.clear()
    prompt, plain = _chat(srv, stream=False)
    _, streamed = _chat(srv, stream=True)
    assert calls == []  # no scoring forward for generated tokens' top lists (the old path ran one per answer / chunk)
    assert len(plain) == 2 and plain[0][0] != plain[1][0]
    for i, (ids, entries) in plain.items():
        want = scoring(prompt + ids, len(prompt), 3, 0.8, -1, 0.9)  # the processed distribution
        assert len(entries) == len(ids) == len(want)
        for e, row in zip(entries, want):
            assert [t.token for t in e.top_logprobs] == [served.decode([t]) for t, _ in row]
            assert [t.logprob for t in e.top_logprobs] == pytest.approx([v for _, v in row], abs=1e-4)
        s_ids, s_entries = streamed[i]
        assert s_ids == ids
        for a, b in zip(s_entries, entries, strict=True):  # (fp32 rounding may follow the step's batch)
            assert [t.token for t in a.top_logprobs] == [t.token for t in b.top_logprobs]
            assert [t.logprob for t in a.top_logprobs] == pytest.approx([t.logprob for t in b.top_logprobs], abs=1e-5)


def test_completion_top_logprobs_from_the_sampler_echo_from_the_prefill(setup):
    srv, engine, scoring, calls, served = setup
    c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x")
    calls.clear()
    r = c.completions.create(model="tiny-m3", prompt=[5, 6, 7, 8], max_tokens=5, seed=2, logprobs=2)
    assert calls == []
    lp = r.choices[0].logprobs
    assert len(lp.top_logprobs) == 5 and all(2 <= len(t) <= 3 for t in lp.top_logprobs)
    r = c.completions.create(model="tiny-m3", prompt=[5, 6, 7, 8], max_tokens=5, seed=2, logprobs=2, echo=True)
    assert calls == []  # the prompt's from the prefill (SampleOutput.prompt_logprobs)
    assert r.choices[0].logprobs.top_logprobs[4:] == lp.top_logprobs


def test_completion_echo_and_prompt_logprobs_share_the_prompt_scores(setup):
    """``echo`` with ``logprobs`` and vLLM's ``prompt_logprobs`` on /v1/completions: the prefill's
    prompt scores serve every choice's echo and prompt_logprobs with no forward, and
    ``max_tokens=0`` scores the prompt by one forward for both fields (was one per echoed choice
    plus one for prompt_logprobs); the answers equal those of either field asked alone."""
    srv, engine, scoring, calls, served = setup
    c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x")
    kw = dict(model="tiny-m3", prompt=[5, 6, 7, 8], max_tokens=4, seed=3, n=2)
    calls.clear()
    both = c.completions.create(**kw, logprobs=2, echo=True, extra_body={"prompt_logprobs": 3})
    assert calls == []  # the prefill scored the prompt for both choices and both fields
    echo_alone = c.completions.create(**kw, logprobs=2, echo=True)
    plp_alone = c.completions.create(**kw, extra_body={"prompt_logprobs": 3})
    assert both.choices[0].text != both.choices[1].text
    for a, e, p in zip(both.choices, echo_alone.choices, plp_alone.choices, strict=True):
        assert a.text == e.text and a.logprobs == e.logprobs
        assert a.model_extra["prompt_logprobs"] == p.model_extra["prompt_logprobs"]
        assert len(a.model_extra["prompt_logprobs"][1]) >= 3 and len(a.logprobs.top_logprobs[1]) <= 3
    calls.clear()  # max_tokens=0: the prompt alone, scored once for both fields
    kw0 = dict(model="tiny-m3", prompt=[5, 6, 7, 8], max_tokens=0, echo=True, n=2, logprobs=2)
    both = c.completions.create(**kw0, extra_body={"prompt_logprobs": 3})
    assert [len(a[0]) for a in calls] == [4]
    alone = c.completions.create(**kw0)
    assert [ch.logprobs for ch in both.choices] == [ch.logprobs for ch in alone.choices]

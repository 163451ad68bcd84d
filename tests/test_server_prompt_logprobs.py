"""Prompt logprobs on the real engine: /v1/completions ``echo`` with ``logprobs=k`` (through the
``openai`` client) returns the prompt tokens' logprobs first, equal to the engine's own scoring of
the same tokens (``LLMEngine.score`` / ``top_logprobs``), the first one null, text offsets that
index the echoed text, each top list the position's own token first, then the top k (vLLM's
way); ``max_tokens=0`` scores the prompt alone; /generate's ``sampling_params.prompt_logprobs``
and vLLM's ``prompt_logprobs`` on /v1/completions (per choice) and /v1/chat/completions (per
response) give vLLM's per-token shape (logprob, rank, decoded token, top k). They come from the
engine's prefill (no second forward), so a weight write between generation and the answer (the
same version number sent again, or re-sent with replace=True) leaves them the prompt's weights'
scores; for a backend whose outputs carry none, the scoring forward after generation gives the
note and empty entries, not the new weights' scores."""

import asyncio
import concurrent.futures
import copy
import dataclasses
import json
import time

import httpx
import openai
import pytest
import torch
from server_util import (  # tests/ on sys.path
    MESSAGES,
    LiveServer,
    native_backend,
    served_model,
    tiny_model,
    tiny_tokenizer,
)

from m3_rollout.model.loading import iter_released_tensors
from m3_rollout.server.control import Controller
from m3_rollout.server.openai_api import PROMPT_LOGPROB_FLOOR, OpenAIServing
from m3_rollout.server.protocol import CompletionRequest
from m3_rollout.server.runner import EngineRunner
from m3_rollout.weight_sync import LocalWeightSync

MAX_LEN = 160
TEXT = "What is 12 * 34? It is 408."  # ASCII: every token's text is a piece of the prompt's


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    return tiny_model(len(tok), seed=0, max_len=MAX_LEN)


@pytest.fixture(scope="module")
def served(tok):
    return served_model(tok, len(tok), MAX_LEN)


@pytest.fixture(scope="module")
def server(served, model):
    srv = LiveServer(served, native_backend(model, served))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def ref(served, model):
    """An engine of its own over the same weights: the reference scoring."""
    return native_backend(model, served).engine


def _client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _with_token(served, tid: int, lp: float, top: list[tuple[int, float]]) -> dict:
    """A completions top list as vLLM gives it: the position's own token ``tid`` (logprob ``lp``)
    first, then the top ``top`` without it, keyed by text (a text two ids share keeps the first)."""
    row = {}
    for i, v in [(tid, lp)] + [(i, v) for i, v in top if i != tid]:
        row.setdefault(served.decode([i]), v)
    return row


def _check_vllm_entries(entries, prompt, ref, model, served, k, temperature=1.0):
    """``entries`` (a ``prompt_logprobs`` list in vLLM's shape) against the engine's own scoring of
    ``prompt`` in the distribution at ``temperature`` (``LLMEngine.score`` / ``top_logprobs``) and
    the model's logits (the prompt token's 1-based rank, ties counted before it)."""
    assert len(entries) == len(prompt) and entries[0] is None
    want = ref.score(prompt, temperature=temperature)
    with torch.no_grad():
        full = model(torch.tensor([prompt[:-1]]))[0].float()  # [P - 1, V]: the raw logits order the ranks
    tops = ref.top_logprobs(prompt, 1, k, temperature) if k else [[] for _ in prompt[1:]]
    for i, (entry, want_top) in enumerate(zip(entries[1:], tops, strict=True), 1):
        own = entry[str(prompt[i])]
        assert own["logprob"] == pytest.approx(float(want[i]), abs=1e-4)
        assert own["rank"] == int((full[i - 1] >= full[i - 1, prompt[i]]).sum())  # 1-based, as vLLM's
        assert own["decoded_token"] == served.decode([prompt[i]])
        assert list(entry) == [str(prompt[i])] + [str(t) for t, _ in want_top if t != prompt[i]]  # k or k + 1
        for rank, (tid, v) in enumerate(want_top, 1):
            e = entry[str(tid)]
            assert e["logprob"] == pytest.approx(v, abs=1e-4) and e["decoded_token"] == served.decode([tid])
            assert e["rank"] == (own["rank"] if tid == prompt[i] else rank)


@pytest.mark.parametrize("mode,temperature", [("raw", 0.7), ("processed", 0.7), ("processed", 1.0)])
def test_echo_logprobs_equal_the_engines_scoring(server, ref, served, mode, temperature):
    c = _client(server)
    kw = dict(model="tiny-m3", prompt=TEXT, max_tokens=5, seed=3, temperature=temperature, logprobs=2)
    extra = {"return_token_ids": True, "logprobs_mode": mode}
    echo = c.completions.create(**kw, echo=True, extra_body=extra).choices[0]
    plain = c.completions.create(**kw, extra_body=extra).choices[0]
    prompt, out = echo.model_extra["prompt_token_ids"], echo.model_extra["token_ids"]
    assert out == plain.model_extra["token_ids"] and len(out) == 5
    ids, p = prompt + out, len(prompt)
    lp = echo.logprobs
    assert lp.tokens == [served.decode([t]) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing predicts the first token
    # the prompt's logprobs: the engine's scoring of the same tokens, in the request's distribution
    # ("raw": the model's own; "processed": / temperature, no filters here)
    want = ref.score(ids, temperature=1.0 if mode == "raw" else temperature)
    assert lp.token_logprobs[1:p] == pytest.approx(want[1:p].tolist(), abs=1e-4)
    # the generated ones: the sampler's, as the same request without echo returns them
    assert lp.token_logprobs[p:] == plain.logprobs.token_logprobs
    assert lp.top_logprobs[p:] == plain.logprobs.top_logprobs
    # each top list: the position's own token (the prompt's, then the sampled one) first, then the top 2
    tops = ref.top_logprobs(ids, 1, 2, 1.0 if mode == "raw" else temperature)
    for i, (row, want_top) in enumerate(zip(lp.top_logprobs[1:], tops, strict=True), 1):
        want_row = _with_token(served, ids[i], lp.token_logprobs[i], want_top)
        assert list(row) == list(want_row) and 2 <= len(row) <= 3
        assert list(row.values()) == pytest.approx(list(want_row.values()), abs=1e-4)
    # text offsets index the choice's text: the echoed prompt, then the generated text
    assert echo.text.startswith(TEXT) and echo.text == "".join(lp.tokens)
    assert lp.text_offset[0] == 0 and lp.text_offset[p] == len(TEXT)
    for t, off in zip(lp.tokens, lp.text_offset, strict=True):
        assert echo.text[off : off + len(t)] == t


def test_max_tokens_0_scores_the_prompt_alone(server, ref, served, tok):
    c = _client(server)
    r = c.completions.create(model="tiny-m3", prompt=TEXT, max_tokens=0, echo=True, logprobs=1, n=2)
    assert [ch.text for ch in r.choices] == [TEXT, TEXT] and [ch.index for ch in r.choices] == [0, 1]
    assert {ch.finish_reason for ch in r.choices} == {"length"}
    ids = served.encode(TEXT)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), 0)
    lp = r.choices[0].logprobs
    assert lp.tokens == [served.decode([t]) for t in ids] and lp.token_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx(ref.score(ids)[1:].tolist(), abs=1e-4)
    for row, t, v in zip(lp.top_logprobs[1:], ids[1:], lp.token_logprobs[1:], strict=True):
        assert 1 <= len(row) <= 2 and list(row.items())[0] == (served.decode([t]), v)  # the prompt token, top 1
    assert r.choices[1].logprobs.token_logprobs == lp.token_logprobs
    # a prompt that fills the context can be scored (nothing is generated after it)
    full = list(range(5, 5 + MAX_LEN))
    body = {"model": "tiny-m3", "prompt": full, "max_tokens": 0, "echo": True, "logprobs": 0}
    resp = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    got = resp.json()["choices"][0]["logprobs"]
    assert len(got["token_logprobs"]) == MAX_LEN and got["top_logprobs"][0] is None
    assert [list(r.values()) for r in got["top_logprobs"][1:]] == [[v] for v in got["token_logprobs"][1:]]  # k 0
    assert got["token_logprobs"][1:] == pytest.approx(ref.score(full)[1:].tolist(), abs=1e-4)


@pytest.mark.parametrize("mode", ["keep", "drain", "abort"])
def test_max_tokens_0_waits_at_the_admission_gate_while_paused(server, ref, served, mode):
    """A prompt-scoring request (max_tokens=0) is admitted like any other: while the server is
    paused it waits at the gate (it used to run its forward at once, under whichever weights the
    paused server held, ahead of an update the pause was made for), counted in ``waiting``, and is
    answered once /resume opens the gate."""
    ids = served.encode(TEXT)
    body = {"model": "tiny-m3", "prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 1}
    ctl = server.controller
    assert httpx.post(server.url + "/pause", json={"mode": mode}, timeout=60).json()["paused"]
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            fut = pool.submit(httpx.post, server.url + "/v1/completions", json=body, timeout=120)
            deadline = time.monotonic() + 60
            while ctl.waiting == 0 and not fut.done() and time.monotonic() < deadline:
                time.sleep(0.01)
            assert not fut.done() and ctl.waiting == 1  # held at the gate, not answered while paused
            assert httpx.post(server.url + "/resume", timeout=60).json() == {"paused": False}
            resp = fut.result(timeout=120)
    finally:
        httpx.post(server.url + "/resume", timeout=60)
    assert resp.status_code == 200, resp.text
    got = resp.json()["choices"][0]["logprobs"]["token_logprobs"]
    assert got[0] is None and got[1:] == pytest.approx(ref.score(ids)[1:].tolist(), abs=1e-4)
    assert ctl.waiting == 0 and not ctl.live


def _counting_forwards(monkeypatch, runner) -> list:
    """Record every scoring forward ``runner`` runs (``top_logprobs``: its token ids)."""
    calls, real = [], runner.top_logprobs

    async def counted(ids, *args):
        calls.append(list(ids))
        return await real(ids, *args)

    monkeypatch.setattr(runner, "top_logprobs", counted)
    return calls


def _aborted_note(note: str | None) -> bool:
    return note is not None and "aborted before its prompt's prefill ended" in note


@pytest.mark.parametrize("stream", [False, True])
def test_generate_prompt_logprobs_aborted_at_the_admission_gate_runs_no_forward(served, model, monkeypatch, stream):
    """Review finding: a /generate request with ``prompt_logprobs`` that /abort ended at the gate
    (while paused) still ran the scoring forward for its outputs, during the pause. It now runs no
    model work and is answered as a sample aborted before its prefill ended: no tokens, finish
    reason "abort", empty prompt_logprobs entries and the note saying why."""
    srv = LiveServer(served, native_backend(model, served))
    ctl = srv.controller
    calls = _counting_forwards(monkeypatch, ctl.runner)
    ids = served.encode(TEXT)
    sp = {"n": 2, "max_new_tokens": 4, "prompt_logprobs": 1}
    body = {"input_ids": ids, "rid": "held", "sampling_params": sp, "stream": stream}
    try:
        assert httpx.post(srv.url + "/pause", json={"mode": "abort"}, timeout=60).json()["paused"]
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            fut = pool.submit(httpx.post, srv.url + "/generate", json=body, timeout=120)
            deadline = time.monotonic() + 60
            while ctl.waiting == 0 and not fut.done() and time.monotonic() < deadline:
                time.sleep(0.01)
            assert ctl.waiting == 1
            assert httpx.post(srv.url + "/abort", json={"rid": "held"}, timeout=60).json() == {"aborted": 1}
            resp = fut.result(timeout=120)  # answered while the server is still paused
        assert resp.status_code == 200, resp.text
        if stream:
            events = [json.loads(x[6:]) for x in resp.text.split("\n\n") if x.startswith("data: {")]
            outs = sorted(events, key=lambda d: d["sample_index"])
        else:
            outs = resp.json()["outputs"]
    finally:
        httpx.post(srv.url + "/resume", timeout=60)
        srv.stop()
    assert calls == []  # no scoring forward
    got = [(o["sample_index"], o["finish_reason"], o["output_ids"]) for o in outs]
    assert got == [(0, "abort", []), (1, "abort", [])]
    for o in outs:
        assert o["prompt_logprobs"] == [None] + [{}] * (len(ids) - 1)
        assert _aborted_note(o["prompt_logprobs_note"])


def test_max_tokens_0_aborted_at_the_admission_gate_is_answered_as_any_aborted_request(served, model, monkeypatch):
    """Breaker finding: /abort (abort_all) did not reach a prompt-scoring request held at the gate;
    it was scored after /resume. It now ends there: every choice finishes "abort" and no forward
    runs. Review finding: its logprobs and prompt_logprobs were null, unlike any other request
    aborted at the gate; it is now answered as they are (a max_tokens=1 request shows it): the
    prompt tokens listed with null logprobs and empty top lists, empty prompt_logprobs entries, and
    the notes saying why."""
    runner = EngineRunner(native_backend(model, served))
    ctl = Controller(runner)
    serving = OpenAIServing(served, ctl)
    calls = _counting_forwards(monkeypatch, runner)
    body = {"model": "tiny-m3", "prompt": TEXT, "echo": True, "logprobs": 1, "prompt_logprobs": 1, "n": 2}

    async def ask(max_tokens: int):
        await ctl.pause("abort")
        req = CompletionRequest.model_validate({**body, "max_tokens": max_tokens})
        task = asyncio.ensure_future(serving.completion(req, serving.prepare_completion(req)))
        while ctl.waiting == 0:  # until it is held at the gate (an acknowledgement, not a timing)
            await asyncio.sleep(0)
        reply = await ctl.abort(None, True)
        answer = await asyncio.wait_for(task, 60)  # while the server is still paused
        await ctl.resume()
        return reply, answer

    try:
        (reply, answer), (_, other) = asyncio.run(ask(0)), asyncio.run(ask(1))
    finally:
        runner.shutdown()
    assert reply == {"aborted": 1} and calls == []
    assert [(c["index"], c["finish_reason"]) for c in answer["choices"]] == [(0, "abort"), (1, "abort")]
    assert answer["choices"] == other["choices"]
    n = len(served.encode(TEXT))
    for c in answer["choices"]:
        assert c["text"] == TEXT and c["logprobs"]["token_logprobs"] == [None] * n
        assert c["logprobs"]["top_logprobs"] == [None] + [{}] * (n - 1)
        assert c["prompt_logprobs"] == [None] + [{}] * (n - 1)
        assert _aborted_note(c["prompt_logprobs_note"]) and _aborted_note(c["top_logprobs_note"])
    assert not ctl.live and ctl.waiting == 0


def _streamed_logprobs(stream) -> tuple[dict, dict]:
    """Per choice index: the text and the four logprobs lists of a completions stream, each chunk's
    appended in order (chunks without tokens carry logprobs null)."""
    texts, lps = {}, {}
    for chunk in stream:
        for ch in chunk.choices:
            texts[ch.index] = texts.get(ch.index, "") + ch.text
            lp = lps.setdefault(ch.index, {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []})
            if ch.logprobs is not None:
                for key in lp:
                    lp[key] += getattr(ch.logprobs, key) or []
    return texts, lps


@pytest.mark.parametrize("k,stop", [(2, False), (0, False), (3, True)])
def test_streamed_completion_logprobs_equal_the_non_streamed(server, k, stop):
    """Streamed completions carry each chunk's tokens' logprobs (vLLM's way); concatenated they are
    the non-streamed answer's for the same seed: tokens and text offsets exactly, the sampler's
    logprobs and the top lists within 1e-5 / 1e-4 (other batches; one scoring forward per chunk vs
    one per answer)."""
    c = _client(server)
    kw = dict(model="tiny-m3", prompt=[TEXT, TEXT[:9]], max_tokens=8, seed=11, n=2, logprobs=k)
    if stop:  # a piece of the first choice's text: it ends that choice there (text held back, then cut)
        kw["stop"] = c.completions.create(**kw).choices[0].text[4:6]
    whole = c.completions.create(**kw)
    texts, lps = _streamed_logprobs(c.completions.create(**kw, stream=True))
    assert sorted(lps) == [0, 1, 2, 3] == [ch.index for ch in whole.choices]
    for ch in whole.choices:
        got, want = lps[ch.index], ch.logprobs
        assert texts[ch.index] == ch.text
        assert got["tokens"] == want.tokens and len(want.tokens) >= 1
        assert got["text_offset"] == want.text_offset
        # the sampler's (the streamed request runs its prompts one after the other, the other one
        # batches them: the CPU forward is not batch-invariant in the last bits)
        assert got["token_logprobs"] == pytest.approx(want.token_logprobs, abs=1e-5)
        assert len(got["top_logprobs"]) == len(want.top_logprobs)
        for row, want_row, t in zip(got["top_logprobs"], want.top_logprobs, want.tokens, strict=True):
            # the sampled token first, then the top k (k 0: the token alone); keyed by text: ids of one text merge
            assert 1 <= len(want_row) <= k + 1 and list(row) == list(want_row) and list(want_row)[0] == t
            assert list(row.values()) == pytest.approx(list(want_row.values()), abs=1e-4)
    if stop:
        assert whole.choices[0].finish_reason == "stop" and whole.choices[0].stop_reason == kw["stop"]


def _generate(srv, **body) -> dict:
    resp = httpx.post(srv.url + "/generate", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_generate_prompt_logprobs_in_vllms_shape(server, ref, served, model):
    prompt = served.encode(TEXT)
    sp = {"n": 2, "max_new_tokens": 3, "seed": 1, "prompt_logprobs": 3}
    reply = _generate(server, input_ids=prompt, sampling_params=sp)
    entries = reply["outputs"][0]["prompt_logprobs"]
    assert reply["outputs"][1]["prompt_logprobs"] == entries  # one prompt: the same scores for each sample
    _check_vllm_entries(entries, prompt, ref, model, served, 3)
    # 0: the prompt token alone; left out: no field; streamed: on each sample's final event
    zero = _generate(server, input_ids=prompt, sampling_params={**sp, "prompt_logprobs": 0})["outputs"][0]
    assert [list(e) for e in zero["prompt_logprobs"][1:]] == [[str(t)] for t in prompt[1:]]
    assert (
        "prompt_logprobs"
        not in _generate(server, input_ids=prompt, sampling_params={"max_new_tokens": 2})["outputs"][0]
    )
    with httpx.stream(
        "POST", server.url + "/generate", json={"input_ids": prompt, "stream": True, "sampling_params": sp}, timeout=120
    ) as resp:
        events = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
    finals = [e for e in events if "finish_reason" in e]
    assert len(finals) == 2 and all(e["prompt_logprobs"] == entries for e in finals)
    assert all("prompt_logprobs" not in e for e in events if "finish_reason" not in e)


def test_completions_prompt_logprobs_equal_the_engines_scoring(server, ref, served, model):
    """vLLM's ``prompt_logprobs`` on /v1/completions (an extra body field through the ``openai``
    client): each choice carries its prompt's list in vLLM's shape, equal to the engine's own
    scoring in the request's distribution (processed: / temperature 0.7), the same for the ``n``
    choices of a prompt; with ``echo`` and ``max_tokens=0`` it scores the prompt alone."""
    c = _client(server)
    prompts = [served.encode(TEXT), served.encode(TEXT[:12])]
    kw = dict(model="tiny-m3", prompt=prompts, max_tokens=3, n=2, seed=4, temperature=0.7)
    r = c.completions.create(**kw, extra_body={"prompt_logprobs": 3})
    assert [ch.index for ch in r.choices] == [0, 1, 2, 3]
    for ch in r.choices:  # choice index = prompt index * n + sample index
        extra = ch.model_extra
        _check_vllm_entries(extra["prompt_logprobs"], prompts[ch.index // 2], ref, model, served, 3, 0.7)
        assert "prompt_logprobs_note" not in extra
    assert r.choices[0].model_extra["prompt_logprobs"] == r.choices[1].model_extra["prompt_logprobs"]
    plain = c.completions.create(**kw)  # not asked: no field, the same samples
    assert "prompt_logprobs" not in plain.choices[0].model_extra
    assert [ch.text for ch in plain.choices] == [ch.text for ch in r.choices]
    alone = c.completions.create(
        model="tiny-m3", prompt=prompts[0], max_tokens=0, echo=True, n=2, extra_body={"prompt_logprobs": 0}
    )
    for ch in alone.choices:
        assert ch.text == TEXT and ch.logprobs is None
        _check_vllm_entries(ch.model_extra["prompt_logprobs"], prompts[0], ref, model, served, 0)


def test_chat_prompt_logprobs_equal_the_engines_scoring(server, ref, served, model):
    """vLLM's ``prompt_logprobs`` on /v1/chat/completions: one list on the response (the ``n``
    samples share the prompt, as in vLLM's response-level field) for the rendered prompt's ids (what
    /tokenize gives for the messages), equal to the engine's own scoring (processed: / 0.7)."""
    c = _client(server)
    extra = {"prompt_logprobs": 2, "return_token_ids": True}
    r = c.chat.completions.create(
        model="tiny-m3", messages=MESSAGES, max_tokens=3, n=2, seed=2, temperature=0.7, extra_body=extra
    )
    prompt = r.model_extra["prompt_token_ids"]
    assert prompt == httpx.post(server.url + "/tokenize", json={"messages": MESSAGES}, timeout=60).json()["tokens"]
    _check_vllm_entries(r.model_extra["prompt_logprobs"], prompt, ref, model, served, 2, 0.7)
    assert len(r.choices) == 2 and all("prompt_logprobs" not in ch.model_extra for ch in r.choices)
    assert "prompt_logprobs_note" not in r.model_extra


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_prompt_logprobs_takes_vllms_range_and_streaming(server, route):
    """``prompt_logprobs`` takes 0-20 (vLLM's -1, the whole vocabulary, and values above the
    server's cap are refused with a 400 naming the field); streamed, as vLLM's validators: k >= 1
    is refused, 0 is taken and the chunks carry no prompt logprobs."""
    c = _client(server)

    def call(k, stream=False):
        kw = dict(model="tiny-m3", max_tokens=2, seed=1, stream=stream, extra_body={"prompt_logprobs": k})
        if route == "chat":
            return c.chat.completions.create(messages=MESSAGES, **kw)
        return c.completions.create(prompt=TEXT, **kw)

    for k, stream, says in [(-1, False, "[0, 20]"), (21, False, "[0, 20]"), (1, True, "stream=true")]:
        with pytest.raises(openai.BadRequestError) as exc:
            call(k, stream)
        err = exc.value.response.json()["error"]
        assert err["param"] == "prompt_logprobs" and f"prompt_logprobs={k}" in err["message"] and says in err["message"]
    top = call(20)
    entries = (top.model_extra if route == "chat" else top.choices[0].model_extra)["prompt_logprobs"]
    assert entries[0] is None and all(20 <= len(e) <= 21 for e in entries[1:])
    chunks = list(call(0, stream=True))
    assert chunks and all("prompt_logprobs" not in json.dumps(ch.model_dump()) for ch in chunks)


@pytest.mark.parametrize("k", [0, 1, 3])
def test_completion_top_logprobs_hold_the_sampled_token(server, ref, served, k):
    """vLLM's completions ``top_logprobs``: per generated token the sampled token first, with its
    sampler logprob (``token_logprobs``), then the top k from the engine's scoring, so k + 1
    entries when it is not among them (OpenAI's "up to logprobs + 1"); k 0: the token alone."""
    c = _client(server)
    kw = dict(model="tiny-m3", prompt=TEXT, max_tokens=8, n=2, seed=7, temperature=2.0, logprobs=k)
    r = c.completions.create(**kw, extra_body={"return_token_ids": True, "logprobs_mode": "raw"})
    prompt, sizes = served.encode(TEXT), []
    for ch in r.choices:
        out, lp = ch.model_extra["token_ids"], ch.logprobs
        tops = ref.top_logprobs(prompt + out, len(prompt), k, 1.0) if k else [[] for _ in out]
        for row, t, v, want_top in zip(lp.top_logprobs, out, lp.token_logprobs, tops, strict=True):
            want = _with_token(served, t, v, want_top)
            assert list(row) == list(want) and list(row.items())[0] == (served.decode([t]), v)
            assert list(row.values()) == pytest.approx(list(want.values()), abs=1e-4)
            sizes.append(len(row))
    assert set(sizes) <= {k, k + 1} and k + 1 in sizes  # temperature 2: sampled tokens outside the top k


def test_prompt_logprobs_come_from_the_prefill_with_no_second_forward(server, ref, served, model, monkeypatch):
    """/generate's ``prompt_logprobs``, completions' ``prompt_logprobs`` and ``echo`` with
    ``logprobs``, and chat's ``prompt_logprobs`` are the engine's prefill scores: no scoring
    forward runs (the engine's ``top_logprobs`` is never called), and they equal its values."""
    engine = server.controller.runner.backend.engine
    calls, real = [], engine.prepare_top_logprobs
    monkeypatch.setattr(engine, "prepare_top_logprobs", lambda *a, **kw: calls.append(a) or real(*a, **kw))
    prompt = served.encode(TEXT)
    sp = {"n": 2, "max_new_tokens": 3, "seed": 1, "prompt_logprobs": 3}
    for o in _generate(server, input_ids=prompt, sampling_params=sp)["outputs"]:
        _check_vllm_entries(o["prompt_logprobs"], prompt, ref, model, served, 3)
    c = _client(server)
    kw = dict(model="tiny-m3", prompt=TEXT, max_tokens=3, temperature=0.7, echo=True, logprobs=2)
    ch = c.completions.create(**kw, extra_body={"prompt_logprobs": 1}).choices[0]
    _check_vllm_entries(ch.model_extra["prompt_logprobs"], prompt, ref, model, served, 1, 0.7)
    want = ref.score(prompt, temperature=0.7)
    assert ch.logprobs.token_logprobs[1 : len(prompt)] == pytest.approx(want[1:].tolist(), abs=1e-4)
    r = c.chat.completions.create(
        model="tiny-m3", messages=MESSAGES, max_tokens=2, extra_body={"prompt_logprobs": 2, "return_token_ids": True}
    )
    _check_vllm_entries(r.model_extra["prompt_logprobs"], r.model_extra["prompt_token_ids"], ref, model, served, 2)
    assert calls == []


def test_greedy_prompt_logprobs_are_the_models_own_in_either_mode(server, served):
    """temperature 0 samples with top_k 1, and in the "processed" mode a prompt token was either
    that token (logprob 0, rank 1) or impossible (-9999.0). vLLM's greedy filters nothing and its
    prompt logprobs are the model's own: now both modes give those (the "raw" numbers)."""
    prompt = served.encode(TEXT)
    sp = {"max_new_tokens": 2, "temperature": 0, "prompt_logprobs": 1}
    processed = _generate(server, input_ids=prompt, sampling_params=sp)["outputs"][0]["prompt_logprobs"]
    raw = _generate(server, input_ids=prompt, sampling_params={**sp, "logprobs_mode": "raw"})["outputs"][0]
    assert all(PROMPT_LOGPROB_FLOOR < e[str(t)]["logprob"] < 0 for e, t in zip(processed[1:], prompt[1:]))
    assert processed == raw["prompt_logprobs"]


class _RefitAfterGenerating:
    """The controller in front of a real engine, with a weight update (``refit``) landing after a
    request's samples were generated and before the server scores them."""

    def __init__(self, ctl: Controller, refit):
        self.ctl, self.refit = ctl, refit

    @property
    def weight_version(self) -> int:
        return self.ctl.weight_version

    async def stream(self, greq, stream=False):
        items = [item async for item in self.ctl.stream(greq, stream)]
        await self.refit()
        for item in items:
            yield item

    async def top_logprobs(self, *args):
        return await self.ctl.top_logprobs(*args)


def _perturbed(model, seed: int):
    other = copy.deepcopy(model)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return other


@pytest.mark.parametrize("how", ["none", "same_version", "replace"])
def test_a_refit_after_generating_keeps_the_prefill_scores_and_guards_the_scoring_forward(served, model, how):
    """Version 0 stays version 0 in both updates (a fresh receiver's first update may carry the
    version it holds; a later one says replace=True). The engine's prefill scored the prompt with
    the weights that ran it: those scores come back, whatever was written since. A backend whose
    outputs carry none is scored after the update: the version guard let the new weights' scores
    through; the write count does not."""
    backend = native_backend(copy.deepcopy(model), served)
    sync = LocalWeightSync(backend.engine, in_flight="continue")
    backend.weight_sync = sync
    runner = EngineRunner(backend)
    new = _perturbed(model, 7)

    async def refit():
        if how == "same_version":
            await runner.call(backend.update_weights, 0, list(iter_released_tensors(new)))
        elif how == "replace":
            await runner.call(backend.update_weights, 0, list(iter_released_tensors(_perturbed(model, 8))))
            sync.sender.named_tensors = lambda: iter_released_tensors(new)
            await runner.call(sync.sender.update, 0, False, True)  # version 0 again, replace=True

    serving = OpenAIServing(served, _RefitAfterGenerating(Controller(runner), refit))
    req = CompletionRequest.model_validate(
        {"model": "tiny-m3", "prompt": TEXT, "max_tokens": 4, "seed": 5, "logprobs": 2, "echo": True}
    )

    async def ask():
        reqs = serving.prepare_completion(req)
        choice = (await serving.completion(req, reqs))["choices"][0]
        prompt = list(reqs[0].prompt_ids)
        out = [o async for o in runner.stream(reqs[0], stream=False)][0]  # the same sample, now
        scored = await serving.prompt_scores(prompt, 2, reqs[0].params)
        return choice, prompt, scored, out

    try:
        choice, prompt, scored, out = asyncio.run(ask())
        assert (
            backend.weight_version == 0 and backend.weight_writes == {"none": 0, "same_version": 1, "replace": 2}[how]
        )
    finally:
        runner.shutdown()
    lp, p = choice["logprobs"], len(prompt)
    old_scores = native_backend(model, served).engine.score(prompt)[1:].tolist()
    new_scores = native_backend(new, served).engine.score(prompt)[1:].tolist()
    assert max(abs(a - b) for a, b in zip(old_scores, new_scores)) > 1e-2  # the weights differ visibly
    if how == "none":
        assert lp["token_logprobs"][1:p] == pytest.approx(old_scores, abs=1e-4)
        assert all(2 <= len(row) <= 3 for row in lp["top_logprobs"][1:]) and "top_logprobs_note" not in choice
        entries, note = serving.sample_prompt_logprobs(prompt, scored, out, 2)
        assert note is None and entries[1][str(prompt[1])]["logprob"] == pytest.approx(old_scores[0], abs=1e-4)
        return
    # generated and prefilled with the old weights: the prompt's scores and the generated tokens'
    # top lists are those weights' (the prefill's and the sampler's), kept after the update
    assert lp["token_logprobs"][1:p] == pytest.approx(old_scores, abs=1e-4)
    assert all(isinstance(v, float) for v in lp["token_logprobs"][p:])
    assert all(2 <= len(row) <= 3 for row in lp["top_logprobs"][1:]) and "top_logprobs_note" not in choice
    # a backend whose outputs carry no prefill scores: the forward after the update scores the
    # prompt, and a sample generated before it gets empty entries and the note, not the new scores
    # (``out`` ran after the update: its prompt was run with the weights served, so it is scored)
    fresh = dataclasses.replace(out, prompt_logprobs=None)
    stale = dataclasses.replace(fresh, token_weight_writes=[w - 1 for w in out.token_weight_writes])
    entries, note = serving.sample_prompt_logprobs(prompt, scored, stale, 2)
    assert entries == [None] + [{}] * (p - 1) and "prompt_logprobs holds empty entries" in note
    assert "weight version 0" in note and "replace=True" in note
    entries, note = serving.sample_prompt_logprobs(prompt, scored, fresh, 2)
    assert note is None and entries[1][str(prompt[1])]["logprob"] == pytest.approx(new_scores[0], abs=1e-4)
    entries, note = serving.sample_prompt_logprobs(prompt, None, out, 2)  # the prefill's, no forward
    assert note is None and entries[1][str(prompt[1])]["logprob"] == pytest.approx(new_scores[0], abs=1e-4)

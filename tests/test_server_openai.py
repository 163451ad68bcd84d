"""The server's OpenAI-compatible API through the real ``openai`` client: chat with tools (single,
parallel, nested arguments; tool_choice), reasoning in the three thinking modes, streaming deltas
that concatenate to the non-streamed answer, logprobs, completions. Tool-call output is scripted
(a random tiny model does not emit calls); everything else runs on the real engine."""

import json
import re

import httpx
import openai
import pytest
import torch
from server_util import (  # tests/ is on sys.path under pytest
    MESSAGES,
    MODES,
    TOOLS,
    LiveServer,
    ScriptedBackend,
    native_backend,
    served_model,
    tiny_model,
    tiny_tokenizer,
)

from m3_rollout.chat.markers import NS
from m3_rollout.chat.template import ChatFormat
from m3_rollout.server.openai_api import _logprob_entry, chat_prompt
from m3_rollout.server.protocol import ChatCompletionRequest
from m3_trainers.policy import token_logprobs

MAX_LEN = 320


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    return tiny_model(len(tok), seed=0, max_len=MAX_LEN)


@pytest.fixture(scope="module")
def engine_server(tok, model):
    served = served_model(tok, len(tok), MAX_LEN)
    srv = LiveServer(served, native_backend(model, served))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def scripted(tok):
    served = served_model(tok, len(tok), MAX_LEN)
    backend = ScriptedBackend([[1]], served.stop_token_ids[0], detokenize=served.decode)
    srv = LiveServer(served, backend)
    yield srv, backend
    srv.stop()


def _client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _collect(stream):
    """Concatenate a chat stream: per choice reasoning, content, tool calls (by index), finish
    reason, token ids, the response id; and the usage chunk."""
    out, usage = {}, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            d = out.setdefault(c.index, {"reasoning": "", "content": "", "calls": {}, "finish": None, "ids": []})
            d["index"], d["response_id"] = c.index, chunk.id
            delta = c.delta
            d["reasoning"] += (delta.model_extra or {}).get("reasoning_content") or ""
            d["content"] += delta.content or ""
            for tc in delta.tool_calls or []:
                call = d["calls"].setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = tc.id or call["id"]
                if tc.function is not None:
                    call["name"] += tc.function.name or ""
                    call["arguments"] += tc.function.arguments or ""
            d["ids"] += (c.model_extra or {}).get("token_ids") or []
            d["finish"] = c.finish_reason or d["finish"]
            if c.finish_reason is not None:
                d["stop_reason"] = (c.model_extra or {}).get("stop_reason")
    return out, usage


def _message_view(msg):
    calls = [
        {"id": c.id, "name": c.function.name, "arguments": json.loads(c.function.arguments)}
        for c in msg.tool_calls or []
    ]
    return (msg.model_extra or {}).get("reasoning_content") or "", msg.content or "", calls


def _stream_view(d, response_id=None):
    """A collected choice as (reasoning, content, calls). Each call's id is checked to be the
    stream's own (:func:`_call_id`); with ``response_id`` (a non-streamed answer's) it is given as
    that response's id for the same call, so the view compares with :func:`_message_view`'s."""
    calls = [{**c, "arguments": json.loads(c["arguments"])} for _, c in sorted(d["calls"].items())]
    for i, c in enumerate(calls):
        assert c["id"] == _call_id(d["response_id"], d["index"], i), (c["id"], d["response_id"])
        c["id"] = _call_id(response_id or d["response_id"], d["index"], i)
    return d["reasoning"], d["content"], calls


def _call_id(response_id: str, choice: int, index: int) -> str:
    """The id of tool call ``index`` of choice ``choice`` in response ``response_id``."""
    hex_ = re.fullmatch(r"chatcmpl-([0-9a-f]{32})", response_id).group(1)
    return f"call_{hex_}_{choice}_{index}"


# ---- real engine -------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_stream_concatenates_to_the_non_streamed_answer(engine_server, tok, mode):
    c = _client(engine_server)
    kw = dict(
        model="tiny-m3",
        messages=MESSAGES,
        max_tokens=24,
        seed=11,
        n=2,
        temperature=1.0,
        extra_body={"chat_template_kwargs": {"thinking_mode": mode}, "return_token_ids": True},
    )
    full = c.chat.completions.create(**kw)
    streamed, usage = _collect(c.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert sorted(streamed) == [0, 1]
    prompt_ids = full.model_extra["prompt_token_ids"]
    assert tok.decode(prompt_ids).endswith(
        {"enabled": "]~b]ai\n<mm:think>", "disabled": "]~b]ai\n</mm:think>", "adaptive": "]~b]ai\n"}[mode]
    )
    for choice in full.choices:
        s = streamed[choice.index]
        assert s["ids"] == choice.model_extra["token_ids"]
        assert s["finish"] == choice.finish_reason
        reasoning, content, calls = _message_view(choice.message)
        assert (s["reasoning"], s["content"]) == (reasoning, content)
        assert calls == []
        if mode == "enabled":  # the prompt opened the think span: the text is reasoning until a closer
            assert reasoning
    assert full.choices[0].model_extra["token_ids"] != full.choices[1].model_extra["token_ids"]
    total = sum(len(ch.model_extra["token_ids"]) for ch in full.choices)
    assert (full.usage.prompt_tokens, full.usage.completion_tokens) == (len(prompt_ids), total)
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(prompt_ids), total)


def test_logprobs_and_top_logprobs_match_the_model(engine_server, model):
    c = _client(engine_server)
    r = c.chat.completions.create(
        model="tiny-m3",
        messages=MESSAGES,
        max_tokens=8,
        seed=3,
        logprobs=True,
        top_logprobs=3,
        extra_body={"return_token_ids": True},
    )
    ids = r.model_extra["prompt_token_ids"] + r.choices[0].model_extra["token_ids"]
    with torch.no_grad():
        ref = token_logprobs(model, torch.tensor([ids]))[0, len(r.model_extra["prompt_token_ids"]) :]
    entries = r.choices[0].logprobs.content
    assert len(entries) == len(ref) == 8
    for e, want in zip(entries, ref.tolist()):
        assert e.logprob == pytest.approx(want, abs=1e-4)
        tops = [t.logprob for t in e.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True) and tops[0] >= e.logprob - 1e-5


def test_chat_logprobs_without_top_logprobs_give_empty_lists(engine_server):
    """OpenAI's schema types each content item's top_logprobs as a required array: [] when the
    request asks for logprobs without top_logprobs (was null), streamed and not."""
    c = _client(engine_server)
    r = c.chat.completions.create(model="tiny-m3", messages=MESSAGES, max_tokens=4, seed=3, logprobs=True)
    raw = r.model_dump()["choices"][0]["logprobs"]["content"]
    assert len(raw) == 4 and all(e["top_logprobs"] == [] for e in raw)
    for chunk in c.chat.completions.create(
        model="tiny-m3", messages=MESSAGES, max_tokens=4, seed=3, logprobs=True, stream=True
    ):
        for ch in chunk.choices:
            for e in (ch.logprobs.content or []) if ch.logprobs else []:
                assert e.top_logprobs == []


@pytest.mark.parametrize("mode", ["processed", "raw"])
def test_greedy_top_logprobs_come_from_the_same_distribution_as_the_tokens_logprob(engine_server, mode):
    """temperature 0 (top_k 1) in the default "processed" mode gave each token logprob 0.0 (the
    distribution sampled from) but top_logprobs of the unfiltered model (-4.78 for that same token).
    Then it gave 0.0 and a one-entry list; now greedy is vLLM's in either mode: the model's own
    log-softmax, for the token and its top list alike."""
    c = _client(engine_server)
    r = c.chat.completions.create(
        model="tiny-m3",
        messages=MESSAGES,
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"logprobs_mode": mode},
    )
    for e in r.choices[0].logprobs.content:
        assert e.top_logprobs[0].token == e.token
        assert e.top_logprobs[0].logprob == pytest.approx(e.logprob, abs=1e-5)
        assert len(e.top_logprobs) == 3 and e.logprob < 0


def test_greedy_and_top_k_0_agree_on_generate_openai_and_the_engine(engine_server, tok, model):
    """vLLM's temperature 0 (greedy) and top_k 0 (off) on every entry point. /generate took both
    while the engine refused them (an in-process or EP request with temperature 0 failed), and its
    greedy logprobs were 0.0 (the "processed" distribution after a top-1 filter); now /generate,
    the chat route and the in-process engine give the same argmax tokens with the model's own
    log-softmax as their logprobs, and top_k 0 samples as -1."""
    from m3_rollout.engine.interface import GenerationRequest, SamplingParams

    prompt = tok.encode("What is 12 + 30?")
    sp = {"max_new_tokens": 6, "temperature": 0, "top_p": 0.3, "seed": 1}

    def generate(**over):
        resp = httpx.post(
            engine_server.url + "/generate", json={"input_ids": prompt, "sampling_params": {**sp, **over}}, timeout=120
        )
        assert resp.status_code == 200, resp.text
        return resp.json()["outputs"][0]

    http = generate()
    ids = torch.tensor([prompt + http["output_ids"]])
    want = token_logprobs(model, ids, 1.0)[0, len(prompt) :]  # the model's own log-softmax
    with torch.no_grad():
        logits = model(ids)[0, len(prompt) - 1 : -1]
    assert http["output_ids"] == logits.argmax(-1).tolist()
    assert http["logprobs"] == pytest.approx(want.tolist(), abs=1e-5) and max(http["logprobs"]) < -1e-3
    assert generate(logprobs_mode="raw", seed=7)["logprobs"] == http["logprobs"]
    local = native_backend(model, served_model(tok, len(tok), MAX_LEN))
    try:
        params = SamplingParams(max_new_tokens=6, temperature=0, top_p=0.3, seed=1, stop_token_ids=())
        (out,) = local.generate([GenerationRequest("g", prompt, params)])
        assert out.finish_reason != "error", out.error
        assert out.output_ids[: len(http["output_ids"])] == http["output_ids"]
        assert out.logprobs[: len(http["logprobs"])] == pytest.approx(http["logprobs"], abs=1e-6)
    finally:
        local.shutdown()
    c = _client(engine_server)
    r = c.completions.create(
        model="tiny-m3", prompt=prompt, max_tokens=6, temperature=0, logprobs=0, extra_body={"return_token_ids": True}
    )
    assert r.choices[0].model_extra["token_ids"] == http["output_ids"]
    assert r.choices[0].logprobs.token_logprobs == pytest.approx(http["logprobs"], abs=1e-6)
    off = {"temperature": 0.9, "top_p": 1.0, "seed": 3}
    assert generate(**off, top_k=0)["output_ids"] == generate(**off, top_k=-1)["output_ids"]


def test_greedy_and_stop_strings(engine_server):
    c = _client(engine_server)
    a = c.chat.completions.create(model="tiny-m3", messages=MESSAGES, max_tokens=12, temperature=0, seed=1)
    b = c.chat.completions.create(model="tiny-m3", messages=MESSAGES, max_tokens=12, temperature=0, seed=2)
    assert a.choices[0].message.content == b.choices[0].message.content  # greedy ignores the seed
    text = a.choices[0].message.content
    stop = text[4:6]
    cut = c.chat.completions.create(model="tiny-m3", messages=MESSAGES, max_tokens=12, temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].message.content == text[: text.find(stop)]
    # stop_reason names the stop string that cut the text (as vLLM's); null when none did
    assert cut.choices[0].model_extra["stop_reason"] == stop
    assert a.choices[0].model_extra["stop_reason"] is None
    streamed, _ = _collect(
        c.chat.completions.create(
            model="tiny-m3", messages=MESSAGES, max_tokens=12, temperature=0, stop=[stop, "never seen"], stream=True
        )
    )
    assert streamed[0]["content"] == text[: text.find(stop)] and streamed[0]["stop_reason"] == stop
    comp = c.completions.create(model="tiny-m3", prompt="What is 12", max_tokens=12, temperature=0)
    ctext = comp.choices[0].text
    cstop = ctext[3:5]
    cut = c.completions.create(model="tiny-m3", prompt="What is 12", max_tokens=12, temperature=0, stop=[cstop])
    assert cut.choices[0].text == ctext[: ctext.find(cstop)] and cut.choices[0].model_extra["stop_reason"] == cstop
    assert comp.choices[0].model_extra["stop_reason"] is None
    # a stop token id from the request is the stop_reason (an int, as vLLM's), chat and streamed
    full = c.chat.completions.create(
        model="tiny-m3", messages=MESSAGES, max_tokens=12, temperature=0, extra_body={"return_token_ids": True}
    )
    gen = full.choices[0].model_extra["token_ids"]
    sid = gen[3]
    body = {"stop_token_ids": [sid], "return_token_ids": True}
    by_id = c.chat.completions.create(model="tiny-m3", messages=MESSAGES, max_tokens=12, temperature=0, extra_body=body)
    assert by_id.choices[0].finish_reason == "stop"
    assert by_id.choices[0].model_extra["token_ids"] == gen[: gen.index(sid) + 1]
    assert by_id.choices[0].model_extra["stop_reason"] == sid
    streamed, _ = _collect(
        c.chat.completions.create(
            model="tiny-m3", messages=MESSAGES, max_tokens=12, temperature=0, stream=True, extra_body=body
        )
    )
    assert streamed[0]["stop_reason"] == sid


def test_include_stop_str_in_output_keeps_the_stop_string(engine_server):
    """vLLM's ``include_stop_str_in_output``: the choice's text ends with the stop string that
    ended it, chat and completions, streamed and not; ``stop_reason`` still names it."""
    c = _client(engine_server)
    keep = {"include_stop_str_in_output": True}
    kw = dict(model="tiny-m3", messages=MESSAGES, max_tokens=12, temperature=0)
    text = c.chat.completions.create(**kw).choices[0].message.content
    stop = text[4:6]
    want = text[: text.find(stop) + len(stop)]
    kept = c.chat.completions.create(**kw, stop=[stop, "never seen"], extra_body=keep).choices[0]
    assert kept.message.content == want and kept.finish_reason == "stop" and kept.model_extra["stop_reason"] == stop
    streamed, _ = _collect(c.chat.completions.create(**kw, stop=[stop], stream=True, extra_body=keep))
    assert streamed[0]["content"] == want and streamed[0]["stop_reason"] == stop
    ckw = dict(model="tiny-m3", prompt="What is 12", max_tokens=12, temperature=0)
    ctext = c.completions.create(**ckw).choices[0].text
    cstop = ctext[3:5]
    cwant = ctext[: ctext.find(cstop) + len(cstop)]
    kept = c.completions.create(**ckw, stop=[cstop], extra_body=keep).choices[0]
    assert kept.text == cwant and kept.model_extra["stop_reason"] == cstop
    chunks = c.completions.create(**ckw, stop=[cstop], stream=True, extra_body=keep)
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == cwant
    cut = c.completions.create(**ckw, stop=[cstop]).choices[0]  # the default drops it
    assert cut.text == ctext[: ctext.find(cstop)]


def test_completions_with_text_and_token_ids(engine_server, tok):
    c = _client(engine_server)
    ids = tok.encode("What is 12", add_special_tokens=False)
    by_text = c.completions.create(model="tiny-m3", prompt="What is 12", max_tokens=6, seed=5, logprobs=2)
    by_ids = c.completions.create(model="tiny-m3", prompt=ids, max_tokens=6, seed=5)
    assert by_text.choices[0].text == by_ids.choices[0].text
    assert len(by_text.choices[0].logprobs.token_logprobs) == 6
    streamed = "".join(
        ch.choices[0].text
        for ch in c.completions.create(model="tiny-m3", prompt=ids, max_tokens=6, seed=5, stream=True)
    )
    assert streamed == by_ids.choices[0].text
    both = c.completions.create(model="tiny-m3", prompt=[ids, ids[:3]], max_tokens=4, seed=5, n=2)
    assert [ch.index for ch in both.choices] == [0, 1, 2, 3]
    # one id per response, the request's own (it carried the first prompt's internal "-0" suffix)
    assert re.fullmatch(r"cmpl-[0-9a-f]{32}", both.id), both.id
    chunks = list(c.completions.create(model="tiny-m3", prompt=[ids, ids[:3]], max_tokens=4, seed=5, stream=True))
    assert {ch.choices[0].index for ch in chunks} == {0, 1}
    assert len({ch.id for ch in chunks}) == 1 and re.fullmatch(r"cmpl-[0-9a-f]{32}", chunks[0].id), chunks[0].id


def test_null_for_an_openai_nullable_field_is_its_default(engine_server):
    """The OpenAI API types n, stream, logprobs, echo as "X or null" (and vLLM takes null for
    parallel_tool_calls too); clients that send every parameter send null for those left unset.
    They were a 400 ("stream: Input should be a valid boolean (got null)")."""
    url = engine_server.url + "/v1"
    chat = {"model": "tiny-m3", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "seed": 4}
    nulls = {"n": None, "stream": None, "logprobs": None, "parallel_tool_calls": None}
    want = httpx.post(url + "/chat/completions", json=chat, timeout=60).json()
    got = httpx.post(url + "/chat/completions", json={**chat, **nulls}, timeout=60)
    assert got.status_code == 200, got.text
    assert got.json()["choices"] == want["choices"]  # one choice, not streamed, no logprobs
    cmpl = {"model": "tiny-m3", "prompt": "hi", "max_tokens": 3, "seed": 4}
    want = httpx.post(url + "/completions", json=cmpl, timeout=60).json()
    got = httpx.post(url + "/completions", json={**cmpl, "n": None, "stream": None, "echo": None}, timeout=60)
    assert got.status_code == 200, got.text
    assert got.json()["choices"] == want["choices"]


@pytest.mark.parametrize("echo", [False, True])
def test_streamed_completions_return_token_ids_as_the_non_streamed(engine_server, tok, echo):
    """return_token_ids on a streamed completion: each choice's first chunk carries its
    prompt_token_ids (vLLM's way), each chunk its token_ids and their token_weight_versions, so the
    stream gives what the non-streamed choices give (the versions used to be left out silently)."""
    c = _client(engine_server)
    ids = tok.encode("What is 12", add_special_tokens=False)
    kw = dict(model="tiny-m3", prompt=[ids, ids[:3]], max_tokens=5, seed=5, n=2, echo=echo)
    whole = c.completions.create(**kw, extra_body={"return_token_ids": True})
    got: dict = {}
    for chunk in c.completions.create(**kw, stream=True, extra_body={"return_token_ids": True}):
        for ch in chunk.choices:
            extra = ch.model_extra
            g = got.setdefault(ch.index, {"prompt": [], "ids": [], "versions": []})
            g["prompt"].append(extra.get("prompt_token_ids"))
            g["ids"] += extra.get("token_ids") or []
            g["versions"] += extra.get("token_weight_versions") or []
    assert sorted(got) == [0, 1, 2, 3]
    for ch in whole.choices:
        g, want = got[ch.index], ch.model_extra
        assert g["prompt"][0] == want["prompt_token_ids"] == (ids if ch.index < 2 else ids[:3])
        assert g["prompt"][1:] == [None] * (len(g["prompt"]) - 1)  # the first chunk only
        assert g["ids"] == want["token_ids"] and g["versions"] == want["token_weight_versions"] == [0] * 5


def test_tokenize_detokenize_and_models(engine_server, tok):
    base = engine_server.url
    r = httpx.post(
        base + "/tokenize", json={"messages": MESSAGES, "chat_template_kwargs": {"thinking_mode": "disabled"}}
    )
    ids = r.json()["tokens"]
    assert ids == ChatFormat(tok, "disabled").prompt_ids(MESSAGES)
    assert httpx.post(base + "/detokenize", json={"tokens": ids}).json()["prompt"] == tok.decode(ids)
    assert [m.id for m in _client(engine_server).models.list().data] == ["tiny-m3"]


def test_generate_without_a_seed_samples_afresh_and_a_seed_repeats(engine_server, scripted):
    # seed omitted (or null) = a fresh random seed per request, as in vLLM: unseeded calls used to
    # get seed 0 and repeat each other's tokens.
    srv, backend = scripted
    backend.requests.clear()
    for sp in ({"max_new_tokens": 2}, {"max_new_tokens": 2, "seed": None}, {"max_new_tokens": 2, "seed": 7}):
        r = httpx.post(srv.url + "/generate", json={"input_ids": [5, 6, 7], "sampling_params": sp}, timeout=60)
        assert r.status_code == 200, r.text
    unseeded_a, unseeded_b, seeded = (req.params.seed for req in backend.requests)
    assert unseeded_a != unseeded_b and 0 not in (unseeded_a, unseeded_b) and seeded == 7
    # On the engine (random tiny model, temperature 1, near-uniform over the vocabulary): two unseeded
    # calls draw different tokens; two calls with one seed draw the same.
    body = {"input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 24, "temperature": 1.0}}

    def ids(b):
        r = httpx.post(engine_server.url + "/generate", json=b, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["outputs"][0]["output_ids"]

    assert ids(body) != ids(body)
    seeded_body = {**body, "sampling_params": {**body["sampling_params"], "seed": 3}}
    assert ids(seeded_body) == ids(seeded_body)


# ---- scripted output: the parser path -----------------------------------------------------------
def _turn(tok, mode, content="", calls=None, reasoning=None):
    return ChatFormat(tok, mode).assistant_ids(content, calls, reasoning)


CALC = {"name": "calculator", "arguments": {"expression": "12*34"}}
BOOK = {
    "name": "book",
    "arguments": {
        "city": "Paris",
        "nights": 3,
        "guests": [{"name": "Ann", "age": 31}, {"name": "Bo", "age": 7}],
        "options": {"breakfast": True, "tags": ["quiet", "view"]},
    },
}


@pytest.mark.parametrize("calls", [[CALC], [CALC, BOOK], [BOOK]], ids=["single", "parallel", "nested-object-and-array"])
@pytest.mark.parametrize("mode", MODES)
def test_tool_calls_streamed_and_not(scripted, tok, mode, calls):
    srv, backend = scripted
    reasoning = None if mode == "disabled" else "I need the tool."
    backend.scripts = [_turn(tok, mode, "Let me check.", [{"function": c} for c in calls], reasoning)]
    kw = dict(
        model="tiny-m3",
        messages=MESSAGES,
        tools=TOOLS,
        max_tokens=400,
        extra_body={"chat_template_kwargs": {"thinking_mode": mode}},
    )
    full = _client(srv).chat.completions.create(**kw)
    msg = full.choices[0].message
    reasoning_got, content, got = _message_view(msg)
    assert full.choices[0].finish_reason == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in got] == [(c["name"], c["arguments"]) for c in calls]
    assert [c["id"] for c in got] == [_call_id(full.id, 0, i) for i in range(len(calls))]
    assert content == "Let me check."
    assert reasoning_got == (reasoning or "")
    streamed, _ = _collect(_client(srv).chat.completions.create(**kw, stream=True))
    assert _stream_view(streamed[0], full.id) == (reasoning_got, content, got)
    assert streamed[0]["finish"] == "tool_calls"


def test_tool_call_ids_are_unique_across_requests_and_choices(scripted, tok):
    """Ids were `call_<index>`: every response's first call was `call_0`, so an agent keying tool
    results by id over a conversation mixed up two turns' calls. Now each id is unique across
    responses and choices (`call_<response hex>_<choice>_<index>`), the same in a stream's deltas
    as in the message."""
    srv, backend = scripted
    backend.scripts = [_turn(tok, "disabled", "", [{"function": CALC}, {"function": BOOK}])]
    kw = dict(
        model="tiny-m3",
        messages=MESSAGES,
        tools=TOOLS,
        max_tokens=400,
        n=2,
        extra_body={"chat_template_kwargs": {"thinking_mode": "disabled"}},
    )
    c = _client(srv)
    ids = []
    for _ in range(2):
        full = c.chat.completions.create(**kw)
        for choice in full.choices:
            got = [tc.id for tc in choice.message.tool_calls]
            assert got == [_call_id(full.id, choice.index, i) for i in range(2)]
            ids += got
        streamed, _ = _collect(c.chat.completions.create(**kw, stream=True))
        for index, d in sorted(streamed.items()):
            got = [call["id"] for _, call in sorted(d["calls"].items())]
            assert got == [_call_id(d["response_id"], index, i) for i in range(2)]
            ids += got
    assert len(ids) == 16 and len(set(ids)) == 16, ids


def test_tool_choice_none_required_and_named(scripted, tok):
    srv, backend = scripted
    c = _client(srv)
    extra = {"chat_template_kwargs": {"thinking_mode": "disabled"}, "return_token_ids": True}
    base = dict(model="tiny-m3", messages=MESSAGES, tools=TOOLS, max_tokens=200, extra_body=extra)
    backend.scripts = [_turn(tok, "disabled", "", [{"function": CALC}])]
    none = c.chat.completions.create(**base, tool_choice="none")
    assert none.choices[0].message.tool_calls is None and none.choices[0].finish_reason == "stop"
    assert NS + "<invoke" in none.choices[0].message.content  # not parsed: the raw text is the answer
    # Forced call: the opening up to the name is in the prompt; the model writes the rest.
    rest = f'{NS}<expression>1+1{NS}</expression>{NS}</invoke>\n{NS}</tool_call>'
    backend.scripts = [tok.encode(rest, add_special_tokens=False) + [srv.app.state.served.stop_token_ids[0]]]
    named = c.chat.completions.create(**base, tool_choice={"type": "function", "function": {"name": "calculator"}})
    assert tok.decode(named.model_extra["prompt_token_ids"]).endswith(
        f'{NS}<tool_call>\n{NS}<invoke name="calculator">'
    )
    (call,) = named.choices[0].message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("calculator", {"expression": "1+1"})
    assert named.choices[0].finish_reason == "stop"  # a named choice's call: "stop", as OpenAI's and vLLM's
    # "required": the prompt ends where the opening's tokens are the whole call's (here inside
    # "invoke": the tokenizer merges "e name=\"calculator"), the model writes the rest of the tag
    served = srv.app.state.served
    req = ChatCompletionRequest(model="tiny-m3", messages=MESSAGES, tools=TOOLS, tool_choice="required", **extra)
    forced = chat_prompt(served, req).forced
    opening = f'{NS}<tool_call>\n{NS}<invoke name="calculator">'
    assert opening.startswith(forced) and len(forced) < opening.index('name="')
    backend.scripts = [tok.encode(opening[len(forced) :] + rest, add_special_tokens=False) + [backend.stop_id]]
    required = c.chat.completions.create(**base, tool_choice="required")
    (call,) = required.choices[0].message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("calculator", {"expression": "1+1"})
    assert required.choices[0].finish_reason == "tool_calls"
    backend.scripts = [tok.encode(opening[len(forced) :] + rest, add_special_tokens=False) + [backend.stop_id]]
    streamed, _ = _collect(c.chat.completions.create(**base, tool_choice="required", stream=True))
    call_id = _call_id(streamed[0]["response_id"], 0, 0)
    assert _stream_view(streamed[0])[2] == [{"id": call_id, "name": "calculator", "arguments": {"expression": "1+1"}}]
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(**base, tool_choice={"type": "function", "function": {"name": "nope"}})
    assert e.value.body["param"] == "tool_choice"


def test_chat_logprobs_bytes_are_the_tokens_raw_bytes(scripted, tok):
    """Each logprobs item's `bytes` were its decoded text's, the bytes of U+FFFD for a token that
    holds part of a multi-byte character; now the token's own bytes, so the items' bytes join into
    the UTF-8 of the text (markers included), streamed and not, top entries too. `token` stays the
    token decoded alone (U+FFFD there, as vLLM's)."""
    srv, backend = scripted
    served = srv.app.state.served
    text = "héllo 日本語 🙂" + NS + "ß€"
    ids = tok.encode(text, add_special_tokens=False) + [backend.stop_id]
    whole = (text + "[e~[").encode()
    assert "\ufffd" in [served.decode([i]) for i in ids]
    kw = dict(model="tiny-m3", messages=MESSAGES, max_tokens=200, logprobs=True)
    backend.scripts = [ids]
    items = _client(srv).chat.completions.create(**kw).choices[0].logprobs.content
    assert b"".join(bytes(e.bytes) for e in items) == whole
    assert [e.token for e in items] == [served.decode([i]) for i in ids]
    backend.scripts = [ids]
    streamed = [
        e
        for chunk in _client(srv).chat.completions.create(**kw, stream=True)
        for ch in chunk.choices
        for e in (ch.logprobs.content if ch.logprobs else None) or []
    ]
    assert b"".join(bytes(e.bytes) for e in streamed) == whole
    # top_logprobs entries (here every token of the text, as one position's list)
    entry = _logprob_entry(served, ids[0], -0.5, [(i, -1.0) for i in ids])
    assert b"".join(bytes(t["bytes"]) for t in entry["top_logprobs"]) == whole
    assert [t["token"] for t in entry["top_logprobs"]] == [served.decode([i]) for i in ids]


@pytest.mark.parametrize("mode", MODES)
def test_reasoning_split_in_each_thinking_mode(scripted, tok, mode):
    srv, backend = scripted
    reasoning = None if mode == "disabled" else "Twelve times thirty-four."
    backend.scripts = [_turn(tok, mode, "It is 408.", None, reasoning)]
    kw = dict(
        model="tiny-m3", messages=MESSAGES, max_tokens=200, extra_body={"chat_template_kwargs": {"thinking_mode": mode}}
    )
    msg = _client(srv).chat.completions.create(**kw).choices[0].message
    assert msg.content == "It is 408."
    assert (msg.model_extra or {}).get("reasoning_content") == reasoning
    streamed, _ = _collect(_client(srv).chat.completions.create(**kw, stream=True))
    assert (streamed[0]["reasoning"], streamed[0]["content"]) == (reasoning or "", "It is 408.")


@pytest.mark.parametrize("mode", MODES)
def test_forced_tool_call_opening_tokenizes_as_the_whole_call(scripted, mode):
    # tool_choice "required" wrote the opening up to 'name="' into the prompt; the tokenizer merges
    # '="' with the tool name, so the model saw split tokens it never met in training and closed the
    # name at once (an empty answer with the trained models). The prompt's ids must be a token prefix
    # of the prompt followed by the whole call, for every tool (and for a named choice).
    srv, _ = scripted
    served = srv.app.state.served
    kw = {"chat_template_kwargs": {"thinking_mode": mode}}
    names = [t["function"]["name"] for t in TOOLS]
    for choice, called in [("required", names), *[({"type": "function", "function": {"name": n}}, [n]) for n in names]]:
        req = ChatCompletionRequest(model="tiny-m3", messages=MESSAGES, tools=TOOLS, tool_choice=choice, **kw)
        p = chat_prompt(served, req)
        assert p.forced and served.decode(p.ids).endswith(p.forced)
        for n in called:
            text = served.decode(p.ids)[: -len(p.forced)] if p.forced else served.decode(p.ids)
            head = ("</mm:think>" if mode == "enabled" else "") + f'{NS}<tool_call>\n{NS}<invoke name="{n}">{NS}<'
            assert head.startswith(p.forced)
            whole = served.encode(text + head)
            assert whole[: len(p.ids)] == p.ids, (choice, n)


@pytest.mark.parametrize("mode", MODES)
def test_required_with_one_tool_forces_that_tools_name(scripted, mode):
    """With one tool, "required" left the name to the model, and the random-weight model wrote an
    empty one; the only tool's name is forced as a named choice forces it."""
    srv, _ = scripted
    served = srv.app.state.served
    kw = {"chat_template_kwargs": {"thinking_mode": mode}}
    for tool in TOOLS:
        name = tool["function"]["name"]
        named = {"type": "function", "function": {"name": name}}
        req = ChatCompletionRequest(model="tiny-m3", messages=MESSAGES, tools=[tool], tool_choice="required", **kw)
        same = ChatCompletionRequest(model="tiny-m3", messages=MESSAGES, tools=[tool], tool_choice=named, **kw)
        forced = chat_prompt(served, req)
        assert forced.ids == chat_prompt(served, same).ids and f'name="{name}' in forced.forced
        assert not forced.first_call_only  # "required" still allows several calls (parallel_tool_calls)


def _cut_at(served, ids, where):
    """The number of ids of a generation cut by max_tokens at ``where``: inside the first call's
    name, inside the second call's parameter value, after the last </invoke> (before </tool_call>)."""
    texts = [served.decode(ids[:k]) for k in range(len(ids) + 1)]

    def in_name(t):
        tag = t.rfind(f"{NS}<invoke name=")
        return t.count(f"{NS}<invoke") == 1 and tag >= 0 and ">" not in t[tag + len(NS) + 1 :]

    test = {
        "inside the name": in_name,
        "inside a parameter value": lambda t: (
            t.count(f"{NS}<invoke") == 2 and f"{NS}<city>P" in t and "</city>" not in t
        ),
        "after </invoke>": lambda t: t.count(f"{NS}</invoke>") == 2 and "</tool_call>" not in t,
    }[where]
    found = [k for k, t in enumerate(texts) if test(t)]
    assert found, f"no cut {where} in {texts[-1]!r}"
    return found[-1], texts[found[-1]]


def _two_calls_cut(scripted, tok, mode, where, **extra):
    """The scripted backend set to answer with a two-call turn in ``mode`` (reasoning first but in
    "disabled"), cut ``where`` (:func:`_cut_at`): (server, the cut turn's text, the reasoning, the
    chat request kwargs with that max_tokens and ``extra``)."""
    srv, backend = scripted
    reasoning = None if mode == "disabled" else "I need the tool."
    ids = _turn(tok, mode, "Let me check.", [{"function": CALC}, {"function": BOOK}], reasoning)
    k, text = _cut_at(srv.app.state.served, ids, where)
    backend.scripts = [ids]
    kw = dict(
        model="tiny-m3",
        messages=MESSAGES,
        tools=TOOLS,
        max_tokens=k,
        extra_body={"chat_template_kwargs": {"thinking_mode": mode}},
        **extra,
    )
    return srv, text, reasoning, kw


@pytest.mark.parametrize("where", ["inside the name", "inside a parameter value", "after </invoke>"])
@pytest.mark.parametrize("mode", MODES)
def test_generation_cut_inside_a_tool_call_keeps_its_text(scripted, tok, mode, where):
    """max_tokens inside a call: the cut call was a tool call with the arguments before the cut (its
    partial value gone), or nothing at all when cut inside the name; now it is content, verbatim,
    and finish_reason stays length, streamed and not."""
    srv, text, reasoning, kw = _two_calls_cut(scripted, tok, mode, where)
    answer = text[text.index("Let me check.") :]  # after the reasoning
    second = answer.find(f"{NS}<invoke", answer.index(f"{NS}</invoke>") if f"{NS}</invoke>" in answer else 0)
    expected = {
        "inside the name": (answer, []),
        "inside a parameter value": ("Let me check." + answer[second:], [CALC]),
        "after </invoke>": ("Let me check.", [CALC, BOOK]),
    }[where]
    full = _client(srv).chat.completions.create(**kw)
    reasoning_got, content, calls = _message_view(full.choices[0].message)
    assert full.choices[0].finish_reason == "length"
    assert (content, [{"name": c["name"], "arguments": c["arguments"]} for c in calls]) == expected
    assert reasoning_got == (reasoning or "")
    streamed, _ = _collect(_client(srv).chat.completions.create(**kw, stream=True))
    assert _stream_view(streamed[0], full.id) == (reasoning_got, content, calls)
    assert streamed[0]["finish"] == "length"


@pytest.mark.parametrize("mode", MODES)
def test_parallel_tool_calls_false_drops_a_second_call_cut_off_as_a_closed_one(scripted, tok, mode):
    """parallel_tool_calls=false dropped a closed second call but returned one max_tokens cut as
    content (its verbatim text); now it is dropped too, streamed and not: one call at most, and no
    trace of the others."""
    srv, _, _, kw = _two_calls_cut(scripted, tok, mode, "inside a parameter value", parallel_tool_calls=False)
    full = _client(srv).chat.completions.create(**kw)
    reasoning_got, content, calls = _message_view(full.choices[0].message)
    assert full.choices[0].finish_reason == "length"
    assert (content, [(c["name"], c["arguments"]) for c in calls]) == ("Let me check.", [tuple(CALC.values())])
    streamed, _ = _collect(_client(srv).chat.completions.create(**kw, stream=True))
    assert _stream_view(streamed[0], full.id) == (reasoning_got, content, calls)
    assert streamed[0]["finish"] == "length"


def _forced_choices():
    named = {"type": "function", "function": {"name": "calculator"}}
    return [("named", named, TOOLS), ("required", "required", TOOLS), ("required, one tool", "required", TOOLS[:1])]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("label, choice, tools", _forced_choices(), ids=[c[0] for c in _forced_choices()])
def test_forced_call_cut_off_returns_only_what_the_model_wrote(scripted, tok, mode, label, choice, tools):
    """A forced tool_choice writes the call's opening into the prompt. A model that ended its turn
    right after it (or max_tokens there) got that opening back as content, text it never wrote; now
    the content is the model's own text of the cut call (null when it wrote nothing), finish_reason
    the engine's, streamed and not."""
    srv, backend = scripted
    served = srv.app.state.served
    stop = served.stop_token_ids[0]
    extra = {"chat_template_kwargs": {"thinking_mode": mode}}
    req = ChatCompletionRequest(model="tiny-m3", messages=MESSAGES, tools=tools, tool_choice=choice, **extra)
    forced = chat_prompt(served, req).forced
    whole = ("</mm:think>" if mode == "enabled" else "") + f'{NS}<tool_call>\n{NS}<invoke name="calculator">'
    rest = whole[len(forced) :] + f"{NS}<expression>12*"  # the rest of the opening, then a cut value
    kw = dict(model="tiny-m3", messages=MESSAGES, tools=tools, tool_choice=choice, max_tokens=200, extra_body=extra)
    for script, finish, content in [
        ([stop], "stop", None),  # the end of the turn right after the forced opening
        (tok.encode(rest, add_special_tokens=False), "length", rest),  # max_tokens inside the call
    ]:
        backend.scripts = [script]
        full = _client(srv).chat.completions.create(**kw)
        choice_ = full.choices[0]
        assert (choice_.message.content, choice_.message.tool_calls, choice_.finish_reason) == (content, None, finish)
        reasoning = (choice_.message.model_extra or {}).get("reasoning_content")
        assert reasoning == ("" if mode == "enabled" else None)  # enabled: the forced closer ends the span
        backend.scripts = [script]
        streamed, _ = _collect(_client(srv).chat.completions.create(**kw, stream=True))
        assert (streamed[0]["content"], streamed[0]["calls"], streamed[0]["finish"]) == (content or "", {}, finish)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("label, choice, tools", _forced_choices(), ids=[c[0] for c in _forced_choices()])
@pytest.mark.parametrize("parallel", [True, False], ids=["parallel", "first call only"])
def test_forced_call_ends_the_answer_where_it_closes(scripted, tok, mode, label, choice, tools, parallel):
    """A forced call the model closed and then wrote on after, up to max_tokens: the answer was the
    call with finish_reason "length" (the tail, text after the block or a later call with
    parallel_tool_calls=false, is dropped). Now generation ends where the forced call closes (the
    block's NS</tool_call>, or with parallel_tool_calls=false the first NS</invoke>): the answer is
    the call, finish_reason "tool_calls" ("stop" for a named choice, as OpenAI's), and the tokens
    end there, streamed and not."""
    srv, backend = scripted
    served = srv.app.state.served
    extra = {"chat_template_kwargs": {"thinking_mode": mode}, "return_token_ids": True}
    req = ChatCompletionRequest(model="tiny-m3", messages=MESSAGES, tools=tools, tool_choice=choice, **extra)
    forced = chat_prompt(served, req).forced
    whole = ("</mm:think>" if mode == "enabled" else "") + f'{NS}<tool_call>\n{NS}<invoke name="calculator">'
    first = whole[len(forced) :] + f"{NS}<expression>1+1{NS}</expression>{NS}</invoke>"
    second = f'\n{NS}<invoke name="calculator">{NS}<expression>2+2{NS}</expression>{NS}</invoke>'
    block_end = f"\n{NS}</tool_call>"
    tail = " and then some more text" * 4
    ids = tok.encode(first + second + block_end + tail, add_special_tokens=False)
    end = first if not parallel else first + second + block_end
    calls = [("calculator", {"expression": "1+1"})] + ([("calculator", {"expression": "2+2"})] if parallel else [])
    finish = "stop" if label == "named" else "tool_calls"
    kw = dict(model="tiny-m3", messages=MESSAGES, tools=tools, tool_choice=choice, max_tokens=len(ids))
    kw.update(parallel_tool_calls=parallel, extra_body=extra)
    backend.scripts = [ids]
    full = _client(srv).chat.completions.create(**kw)
    ch = full.choices[0]
    got = [(c.function.name, json.loads(c.function.arguments)) for c in ch.message.tool_calls or []]
    assert (ch.message.content, got, ch.finish_reason) == (None, calls, finish)
    assert ch.model_extra["stop_reason"] is None
    out = ch.model_extra["token_ids"]
    assert len(out) < len(ids) and ids[: len(out)] == out
    assert served.decode(out).startswith(end) and not served.decode(out[:-1]).startswith(end)  # its last token closes
    backend.scripts = [ids]
    streamed, _ = _collect(_client(srv).chat.completions.create(**kw, stream=True))
    s = streamed[0]
    assert (s["content"], [(c["name"], json.loads(c["arguments"])) for _, c in sorted(s["calls"].items())]) == (
        "",
        calls,
    )
    assert (s["finish"], s["ids"]) == (finish, out)


def test_forced_call_end_is_a_stop_string_of_the_engine_alone(scripted, tok):
    """The forced call's end joins the engine's stop strings only for a forced choice, and is no
    stop_reason; a request whose own `stop` names it keeps it as a stop of its own (the text is
    cut before it, stop_reason names it)."""
    srv, backend = scripted
    close = f"{NS}</tool_call>"
    call = _turn(tok, "disabled", "", [{"function": CALC}])
    base = dict(model="tiny-m3", messages=MESSAGES, tools=TOOLS, max_tokens=200)
    base["extra_body"] = {"chat_template_kwargs": {"thinking_mode": "disabled"}}
    named = {"type": "function", "function": {"name": "calculator"}}
    for choice, stops in [("auto", ()), ("none", ()), ("required", (close,)), (named, (close,))]:
        backend.scripts = [call]
        _client(srv).chat.completions.create(**base, tool_choice=choice)
        assert backend.requests[-1].params.stop_strings == stops, choice
    served = srv.app.state.served
    req = ChatCompletionRequest(
        model="tiny-m3", messages=MESSAGES, tools=TOOLS, tool_choice=named, **base["extra_body"]
    )
    forced = chat_prompt(served, req).forced
    rest = f'{NS}<expression>1+1{NS}</expression>{NS}</invoke>\n{close}'
    backend.scripts = [tok.encode(rest, add_special_tokens=False) + [backend.stop_id]]
    ch = _client(srv).chat.completions.create(**base, tool_choice=named, stop=[close]).choices[0]
    assert backend.requests[-1].params.stop_strings == (close,) and forced.endswith('name="calculator">')
    assert [c.function.name for c in ch.message.tool_calls] == ["calculator"]
    assert (ch.message.content, ch.finish_reason, ch.model_extra["stop_reason"]) == (None, "stop", close)

"""vLLM's request fields that change what vLLM returns: ``ignore_eos`` is honoured (chat,
completions, ``/generate``); those the server does not serve are a 400 naming the field unless
at vLLM's default, which passes and changes nothing."""

import json

import httpx
import openai
import pytest
from server_util import (  # tests/ on sys.path
    MESSAGES,
    MODES,
    LiveServer,
    ScriptedBackend,
    native_backend,
    served_model,
    tiny_model,
    tiny_tokenizer,
)

from m3_rollout.chat.markers import EOS
from m3_rollout.chat.template import ChatFormat

MAX_LEN = 128


@pytest.fixture(scope="module")
def setup():
    tok = tiny_tokenizer()
    served = served_model(tok, len(tok), MAX_LEN)
    server = LiveServer(served, native_backend(tiny_model(len(tok), max_len=MAX_LEN), served))
    yield server, served.stop_token_ids[0]
    server.stop()


def _post(srv, path: str, body: dict) -> dict:
    resp = httpx.post(srv.url + path, json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()


def _bodies(eos: int, **kw) -> dict[str, dict]:
    """A greedy chat and completion request whose every sample is the end-of-message token
    (``logit_bias`` +100 on it), so without ignore_eos each ends at its first token."""
    common = dict(model="tiny-m3", max_tokens=5, temperature=0, logit_bias={str(eos): 100}, return_token_ids=True, **kw)
    return {
        "/v1/chat/completions": dict(messages=MESSAGES, **common),
        "/v1/completions": dict(prompt="What is 12", **common),
    }


def _text(choice: dict) -> str:
    """A chat choice's content ("" for none) or a completion choice's text."""
    return (choice["message"]["content"] or "") if "message" in choice else choice["text"]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_ignore_eos_runs_to_max_tokens(setup, path):
    # a breaker finding: ignore_eos was dropped silently, so the sample stopped at its end-of-message token
    srv, eos = setup
    stopped = _post(srv, path, _bodies(eos)[path])["choices"][0]
    assert stopped["finish_reason"] == "stop" and stopped["token_ids"] == [eos]
    assert stopped["stop_reason"] is None
    run = _post(srv, path, _bodies(eos, ignore_eos=True)[path])
    choice = run["choices"][0]
    assert choice["finish_reason"] == "length" and choice["token_ids"] == [eos] * 5
    assert run["usage"]["completion_tokens"] == 5
    # the marker was text (EOS * 5); vLLM's default skip_special_tokens leaves it out (chat: no content)
    assert _text(choice) == ""
    kept = _post(srv, path, _bodies(eos, ignore_eos=True, skip_special_tokens=False)[path])["choices"][0]
    assert _text(kept) == EOS * 5
    # explicit stop token ids and stop strings still end it, as in vLLM
    by_id = _post(srv, path, _bodies(eos, ignore_eos=True, stop_token_ids=[eos])[path])["choices"][0]
    assert (by_id["finish_reason"], by_id["stop_reason"], by_id["token_ids"]) == ("stop", eos, [eos])
    by_str = _post(srv, path, _bodies(eos, ignore_eos=True, stop=[EOS])[path])["choices"][0]
    assert (by_str["finish_reason"], by_str["stop_reason"], by_str["token_ids"]) == ("stop", EOS, [eos])
    assert _text(by_str) == ""


def test_ignore_eos_streamed(setup):
    srv, eos = setup
    body = {**_bodies(eos, ignore_eos=True)["/v1/chat/completions"], "stream": True}
    with httpx.stream("POST", srv.url + "/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    finishes = [c["finish_reason"] for chunk in chunks for c in chunk["choices"] if c["finish_reason"]]
    assert finishes == ["length"]
    assert sum(len(c.get("token_ids") or []) for chunk in chunks for c in chunk["choices"]) == 5
    assert "".join(c["delta"].get("content") or "" for chunk in chunks for c in chunk["choices"]) == ""


@pytest.fixture(scope="module")
def scripted():
    tok = tiny_tokenizer()
    served = served_model(tok, len(tok), MAX_LEN)
    backend = ScriptedBackend([[1]], served.stop_token_ids[0], detokenize=served.decode)
    server = LiveServer(served, backend)
    yield server, backend, tok
    server.stop()


@pytest.mark.parametrize("mode", MODES)
def test_ignore_eos_end_of_message_markers_are_not_content(scripted, mode):
    """An ignore_eos sample that writes its end-of-message token mid-answer (and in its reasoning)
    had the marker (``[e~[``) in its content, streamed and not, where vLLM's default
    skip_special_tokens leaves it out. Now it is left out of reasoning, content and completion
    text; token ids and logprobs still hold every token, and skip_special_tokens=false keeps it."""
    srv, backend, tok = scripted
    eos = backend.stop_id

    def ids(text):
        return tok.encode(text, add_special_tokens=False)

    chat = ChatFormat(tok, mode)
    reasoning = None if mode == "disabled" else "Twelve times thirty-four."
    turn = chat.assistant_ids("It is 408.", None, reasoning)  # the turn, its end-of-message token last
    assert turn[-1] == eos
    if reasoning:  # a marker inside the reasoning too
        cut = turn.index(ids("Twelve")[0]) + len(ids("Twelve"))
        turn = turn[:cut] + [eos] + turn[cut:]
    script = turn[:-1] + [eos] + ids(" More.") + [eos, eos] + ids(" End")
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    kw = dict(
        model="tiny-m3",
        messages=MESSAGES,
        max_tokens=200,
        logprobs=True,
        extra_body={"chat_template_kwargs": {"thinking_mode": mode}, "ignore_eos": True, "return_token_ids": True},
    )
    backend.scripts = [script]
    choice = client.chat.completions.create(**kw).choices[0]
    assert choice.message.content == "It is 408. More. End"
    assert (choice.message.model_extra or {}).get("reasoning_content") == reasoning
    assert choice.model_extra["token_ids"] == script  # the ids keep every token
    assert [e.token for e in choice.logprobs.content].count(EOS) == script.count(eos)
    content = reasoning_streamed = ""
    streamed_ids = []
    for chunk in client.chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            content += c.delta.content or ""
            reasoning_streamed += (c.delta.model_extra or {}).get("reasoning_content") or ""
            streamed_ids += (c.model_extra or {}).get("token_ids") or []
    assert (content, reasoning_streamed, streamed_ids) == ("It is 408. More. End", reasoning or "", script)
    kept = dict(kw, extra_body={**kw["extra_body"], "skip_special_tokens": False})
    assert client.chat.completions.create(**kept).choices[0].message.content == f"It is 408.{EOS} More.{EOS}{EOS} End"
    # completions: the text alike, streamed and not
    backend.scripts = [ids("It is") + [eos] + ids(" 408.") + [eos]]
    body = dict(model="tiny-m3", prompt="What is 12", max_tokens=200, extra_body={"ignore_eos": True})
    assert client.completions.create(**body).choices[0].text == "It is 408."
    streamed = "".join(c.text for chunk in client.completions.create(**body, stream=True) for c in chunk.choices)
    assert streamed == "It is 408."


def test_generate_takes_ignore_eos(setup):
    srv, eos = setup
    sp = {"max_new_tokens": 5, "temperature": 0, "logit_bias": {str(eos): 100.0}}
    out = _post(srv, "/generate", {"input_ids": [5, 6, 7], "sampling_params": sp})["outputs"][0]
    assert (out["finish_reason"], out["output_ids"]) == ("stop", [eos])
    sp["ignore_eos"] = True
    out = _post(srv, "/generate", {"input_ids": [5, 6, 7], "sampling_params": sp})["outputs"][0]
    assert (out["finish_reason"], out["output_ids"]) == ("length", [eos] * 5)


REFUSED = [
    ("min_tokens", 3),
    ("min_p", 0.1),
    ("bad_words", ["ok"]),
    ("allowed_token_ids", [5, 6]),
    ("truncate_prompt_tokens", 4),
    ("guided_json", {"type": "object"}),
    ("guided_regex", "[0-9]+"),
    ("guided_choice", ["yes", "no"]),
    ("guided_grammar", "root ::= 'a'"),
    ("structured_outputs", {"regex": "[0-9]+"}),
    ("use_beam_search", True),
    ("best_of", 3),
]
CHAT_REFUSED = [
    ("echo", True),
    ("add_generation_prompt", False),
    ("continue_final_message", True),
    ("chat_template", "{{ messages }}"),
]
CASES = [(p, f, v) for p in ("/v1/chat/completions", "/v1/completions") for f, v in REFUSED] + [
    ("/v1/chat/completions", f, v) for f, v in CHAT_REFUSED
]


@pytest.mark.parametrize("path,field,value", CASES, ids=[f"{c[0]}:{c[1]}" for c in CASES])
def test_unserved_vllm_fields_are_refused(setup, path, field, value):
    # each changes what vLLM returns; the server used to drop it silently and answer as if unsent
    srv, eos = setup
    body = {**_bodies(eos)[path], field: value}
    for stream in (False, True):  # refused before a stream begins
        resp = httpx.post(srv.url + path, json={**body, "stream": stream}, timeout=60)
        assert resp.status_code == 400, resp.text
        err = resp.json()["error"]
        assert err["param"] == field and err["type"] == "invalid_request_error"
        assert err["message"].startswith(f"{field}=") and "not supported" in err["message"]


VLLM_DEFAULTS = {  # what vLLM's protocol defaults these to (min_p 0.0: older vLLM's default)
    "min_tokens": 0,
    "min_p": 0.0,
    "bad_words": [],
    "allowed_token_ids": None,
    "truncate_prompt_tokens": None,
    "guided_json": None,
    "guided_regex": None,
    "guided_choice": None,
    "guided_grammar": None,
    "structured_outputs": None,
    "logits_processors": None,
    "use_beam_search": False,
    "best_of": None,
    "ignore_eos": False,
    "return_tokens_as_token_ids": None,
    "skip_special_tokens": True,
    # no effect on the output here: passed through unread
    "spaces_between_special_tokens": True,
    "length_penalty": 1.0,
    "priority": 0,
    "request_id": "req-1",
}
CHAT_DEFAULTS = {"echo": False, "add_generation_prompt": True, "continue_final_message": False, "chat_template": None}


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_vllm_defaults_pass_and_change_nothing(setup, path):
    srv, _ = setup
    body = dict(model="tiny-m3", max_tokens=6, temperature=1.0, seed=3, n=2, return_token_ids=True)
    chat = path.endswith("chat/completions")
    body.update({"messages": MESSAGES} if chat else {"prompt": "What is 12"})
    plain = _post(srv, path, body)["choices"]
    extras = {**VLLM_DEFAULTS, **(CHAT_DEFAULTS if chat else {})}
    for more in ({}, {"min_p": None, "bad_words": None, "best_of": 2}):  # best_of = n: no selection
        got = _post(srv, path, {**body, **extras, **more})["choices"]
        assert [c["token_ids"] for c in got] == [c["token_ids"] for c in plain]

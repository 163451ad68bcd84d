"""vLLM's request fields that change what vLLM returns: ``ignore_eos`` is honoured (chat,
completions, ``/generate``); those the server does not serve are a 400 naming the field unless
at vLLM's default, which passes and changes nothing."""

import json

import httpx
import pytest
from server_util import MESSAGES, LiveServer, native_backend, served_model, tiny_model, tiny_tokenizer

from m3_rollout.chat.markers import EOS

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
    text = choice["message"]["content"] if "message" in choice else choice["text"]
    assert text == EOS * 5  # the server's text keeps special tokens: the marker is text here, it ended nothing
    # explicit stop token ids and stop strings still end it, as in vLLM
    by_id = _post(srv, path, _bodies(eos, ignore_eos=True, stop_token_ids=[eos])[path])["choices"][0]
    assert (by_id["finish_reason"], by_id["stop_reason"], by_id["token_ids"]) == ("stop", eos, [eos])
    by_str = _post(srv, path, _bodies(eos, ignore_eos=True, stop=[EOS])[path])["choices"][0]
    assert (by_str["finish_reason"], by_str["stop_reason"], by_str["token_ids"]) == ("stop", EOS, [eos])


def test_ignore_eos_streamed(setup):
    srv, eos = setup
    body = {**_bodies(eos, ignore_eos=True)["/v1/chat/completions"], "stream": True}
    with httpx.stream("POST", srv.url + "/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    finishes = [c["finish_reason"] for chunk in chunks for c in chunk["choices"] if c["finish_reason"]]
    assert finishes == ["length"]
    assert sum(len(c.get("token_ids") or []) for chunk in chunks for c in chunk["choices"]) == 5


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
    # no effect on the output here: passed through unread
    "skip_special_tokens": True,
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

"""Bad input gets an OpenAI-shaped 400 (404 unknown model, 401 API key) naming the field, and the
server goes on serving."""

import json
import logging
import threading

import httpx
import openai
import pytest
from server_util import (
    MESSAGES,
    LiveServer,
    ScriptedBackend,
    native_backend,
    served_model,
    tiny_model,
    tiny_tokenizer,
)  # tests/ on sys.path

from m3_rollout.engine.interface import GenerationRequest, SampleOutput, SamplingParams
from m3_rollout.server.client import HTTPBackend, RolloutServerClient

MAX_LEN = 128
KEY = "sk-test-key"


@pytest.fixture(scope="module")
def setup():
    tok = tiny_tokenizer()
    served = served_model(tok, len(tok), MAX_LEN)
    model = tiny_model(len(tok), max_len=MAX_LEN)
    open_srv = LiveServer(served, native_backend(model, served))
    keyed = LiveServer(served, native_backend(model, served), api_key=KEY)
    yield open_srv, keyed, len(tok)
    open_srv.stop()
    keyed.stop()


def _error(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def _chat(**kw) -> dict:
    return {"model": "tiny-m3", "messages": MESSAGES, "max_tokens": 4, **kw}


CASES = [
    ("/v1/chat/completions", _chat(n=0), "n"),
    ("/v1/chat/completions", _chat(n="2"), "n"),
    ("/v1/chat/completions", _chat(max_tokens=-1), "max_tokens"),
    ("/v1/chat/completions", _chat(temperature="hot"), "temperature"),
    ("/v1/chat/completions", _chat(top_p=0), "top_p"),
    ("/v1/chat/completions", _chat(top_k=-5), "top_k"),
    ("/v1/chat/completions", _chat(stream="yes"), "stream"),
    ("/v1/chat/completions", _chat(messages=5), "messages"),
    ("/v1/chat/completions", _chat(messages=[{"role": "robot", "content": "hi"}]), "messages.0.role"),
    ("/v1/chat/completions", _chat(messages=[{"role": "user", "content": "x " * 400}]), "messages"),
    ("/v1/chat/completions", _chat(tool_choice="required"), "tool_choice"),
    ("/v1/chat/completions", _chat(top_logprobs=3), "top_logprobs"),
    (
        "/v1/chat/completions",
        _chat(chat_template_kwargs={"thinking_mode": "sometimes"}),
        "chat_template_kwargs.thinking_mode",
    ),
    ("/v1/chat/completions", _chat(stop=[""]), "stop"),
    ("/v1/chat/completions", _chat(response_format={"type": "json_object"}), "response_format"),
    # penalties and logit_bias: vLLM's ranges; logit_bias keys are token ids in the vocabulary
    ("/v1/chat/completions", _chat(presence_penalty=2.5), "presence_penalty"),
    ("/v1/chat/completions", _chat(frequency_penalty=-3), "frequency_penalty"),
    ("/v1/chat/completions", _chat(repetition_penalty=0), "repetition_penalty"),
    ("/v1/chat/completions", _chat(logit_bias={"five": 10}), "logit_bias"),
    ("/v1/chat/completions", _chat(logit_bias={"5": "lots"}), "logit_bias.5"),
    ("/v1/completions", {"model": "tiny-m3", "prompt": [5], "logit_bias": {"99999": -100}}, "logit_bias"),
    ("/v1/completions", {"model": "tiny-m3", "prompt": [5], "logit_bias": {"-1": 1}}, "logit_bias"),
    ("/generate", {"input_ids": [5], "sampling_params": {"presence_penalty": 2.5}}, "sampling_params.presence_penalty"),
    (
        "/generate",
        {"input_ids": [5], "sampling_params": {"repetition_penalty": -1.0}},
        "sampling_params.repetition_penalty",
    ),
    ("/generate", {"input_ids": [5], "sampling_params": {"logit_bias": {"99999": 1.0}}}, "sampling_params.logit_bias"),
    # breaker findings: accepted before, each changes what the client gets back
    ("/v1/chat/completions", _chat(stream_options={"include_usage": True}), "stream_options"),
    # prompt logprobs: echo + logprobs is answered whole; vLLM's prompt_logprobs is 0-20, not streamed
    ("/v1/completions", {"model": "tiny-m3", "prompt": [5, 6], "echo": True, "logprobs": 2, "stream": True}, "stream"),
    ("/v1/completions", {"model": "tiny-m3", "prompt": [5, 6], "echo": True, "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"model": "tiny-m3", "prompt": [5, 6], "echo": True, "logprobs": -1}, "logprobs"),
    ("/v1/completions", {"model": "tiny-m3", "prompt": [5, 6], "max_tokens": 0}, "max_tokens"),
    (
        "/v1/completions",
        {"model": "tiny-m3", "prompt": [5, 6], "max_tokens": 0, "echo": True, "stream": True},
        "stream",
    ),
    ("/v1/completions", {"model": "tiny-m3", "prompt": [5, 6], "max_tokens": -1, "echo": True}, "max_tokens"),
    ("/v1/completions", {"model": "tiny-m3", "prompt": [5, 6], "prompt_logprobs": -1}, "prompt_logprobs"),
    (
        "/v1/completions",
        {"model": "tiny-m3", "prompt": [5, 6], "prompt_logprobs": 2, "stream": True},
        "prompt_logprobs",
    ),
    ("/v1/chat/completions", _chat(prompt_logprobs=21), "prompt_logprobs"),
    ("/v1/chat/completions", _chat(prompt_logprobs=1, stream=True), "prompt_logprobs"),
    ("/v1/chat/completions", _chat(max_tokens=0), "max_tokens"),
    ("/generate", {"input_ids": [5, 6], "sampling_params": {"prompt_logprobs": 21}}, "sampling_params.prompt_logprobs"),
    ("/generate", {"input_ids": [5, 6], "sampling_params": {"prompt_logprobs": -1}}, "sampling_params.prompt_logprobs"),
    (
        "/generate",
        {"input_ids": [5, 6], "sampling_params": {"prompt_logprobs": 2.5}},
        "sampling_params.prompt_logprobs",
    ),
    ("/v1/chat/completions", _chat(messages=[{"role": "user", "content": [{"text": "hi"}]}]), "messages.0.content"),
    # a text part's null / number text was written into the prompt as "None" / its digits
    (
        "/v1/chat/completions",
        _chat(messages=[{"role": "user", "content": [{"type": "text", "text": None}]}]),
        "messages.0.content",
    ),
    (
        "/v1/chat/completions",
        _chat(messages=[{"role": "user", "content": [{"type": "text", "text": 5}]}]),
        "messages.0.content",
    ),
    ("/tokenize", {"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages.0.content"),
    ("/tokenize", {"messages": []}, "messages"),
    ("/v1/completions", {"model": "tiny-m3", "prompt": list(range(4, 4 + MAX_LEN))}, "prompt"),
    ("/v1/completions", {"model": "tiny-m3", "prompt": [5, 99999]}, "prompt"),
    ("/v1/completions", {"model": "tiny-m3", "prompt": [5, -1]}, "prompt"),
    ("/generate", {"input_ids": [5, 99999]}, "input_ids"),
    ("/generate", {"input_ids": []}, "input_ids"),
    ("/generate", {"input_ids": [5], "sampling_params": {"n": 0}}, "sampling_params.n"),
    ("/generate", {"input_ids": [5], "sampling_params": {"max_new_tokens": -3}}, "sampling_params.max_new_tokens"),
    ("/generate", {"input_ids": [5], "sampling_params": {"max_tokens": 4}}, "sampling_params.max_tokens"),
    ("/generate", {"input_ids": [5], "sampling_params": {"temprature": 0.5}}, "sampling_params.temprature"),
    ("/generate", {"input_ids": [5], "return_routed_experts": True}, "return_routed_experts"),
    ("/generate", {"input_ids": [5], "return_block_selection": True}, "return_block_selection"),
    ("/generate", {"input_ids": [5], "block_selection_from": 2}, "block_selection_from"),
    ("/generate", {"input_ids": [5], "block_selection_from": -1}, "block_selection_from"),
    ("/detokenize", {"tokens": [1, 10**6]}, "tokens"),
    # union-typed fields: param named a member ("stop.str", "tool_choice.literal['none',...]")
    ("/v1/chat/completions", _chat(stop=5), "stop"),
    ("/v1/chat/completions", _chat(tool_choice="always"), "tool_choice"),
    ("/v1/chat/completions", _chat(messages=[{"role": "user", "content": 5}]), "messages.0.content"),
    ("/v1/completions", {"model": "tiny-m3", "prompt": [1.5, 2.5]}, "prompt"),
    ("/pause", {"mode": "sideways"}, "mode"),
    # a timeout past the bound (1e308 overflowed a timedelta: a 500; 1e10 held the control plane)
    (
        "/init_weight_sync",
        {"master_address": "127.0.0.1", "master_port": 1, "world_size": 2, "timeout_s": 1e308},
        "timeout_s",
    ),
    (
        "/init_weight_sync",
        {"master_address": "127.0.0.1", "master_port": 1, "world_size": 2, "timeout_s": 3601},
        "timeout_s",
    ),
    ("/abort", {}, "rid"),
]


@pytest.mark.parametrize("path,body,param", CASES, ids=[f"{c[0]}:{c[2]}" for c in CASES])
def test_bad_field_gets_400_naming_it(setup, path, body, param):
    srv, _, _ = setup
    err = _error(httpx.post(srv.url + path, json=body, timeout=60), 400)
    assert err["param"] == param
    assert err["type"] == "invalid_request_error"
    assert param.split(".")[-1] in err["message"] or param == "messages"


def test_a_union_field_error_lists_every_accepted_type(setup):
    """A value no member of a union field accepts: the message used to give the first member's
    complaint alone, as if that member were the field ("prompt.str: Input should be a valid
    string" for a list of floats); now each member's, under the field's own name."""
    srv, _, _ = setup
    body = {"model": "tiny-m3", "prompt": [1.5, 2.5]}
    err = _error(httpx.post(srv.url + "/v1/completions", json=body, timeout=60), 400)
    assert err["message"].startswith("prompt: matches none of its accepted types (got [1.5, 2.5]): ")
    assert "str: Input should be a valid string" in err["message"]
    assert "list[int] at 0: Input should be a valid integer" in err["message"]
    err = _error(
        httpx.post(srv.url + "/v1/chat/completions", json=_chat(tool_choice={"type": "function"}), timeout=60), 400
    )
    assert err["param"] == "tool_choice" and "NamedToolChoice at function: Field required" in err["message"]
    # not a union: a dict's keys are not members (logit_bias values of the wrong type)
    err = _error(httpx.post(srv.url + "/v1/chat/completions", json=_chat(logit_bias={"str": "a"}), timeout=60), 400)
    assert err["param"] == "logit_bias.str"


def test_malformed_json_unknown_model_and_the_server_goes_on(setup):
    srv, _, _ = setup
    err = _error(
        httpx.post(
            srv.url + "/v1/chat/completions",
            content=b'{"model": ',
            timeout=30,
            headers={"Content-Type": "application/json"},
        ),
        400,
    )
    assert "JSON" in err["message"]
    err = _error(
        httpx.post(
            srv.url + "/v1/chat/completions",
            content=b"[1, 2]",
            timeout=30,
            headers={"Content-Type": "application/json"},
        ),
        400,
    )
    assert "JSON object" in err["message"]
    err = _error(httpx.post(srv.url + "/v1/chat/completions", json=_chat(model="gpt-4"), timeout=30), 404)
    assert (err["param"], err["code"]) == ("model", "model_not_found")
    _error(httpx.post(srv.url + "/no/such/route", json={}, timeout=30), 404)
    ok = httpx.post(srv.url + "/v1/chat/completions", json=_chat(seed=1), timeout=60)
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] in ("stop", "length")
    assert httpx.get(srv.url + "/health").json()["status"] == "ok"


def test_api_key_guards_every_endpoint(setup):
    _, keyed, _ = setup
    for method, path in [
        ("get", "/v1/models"),
        ("get", "/health"),
        ("get", "/metrics"),
        ("post", "/generate"),
        ("post", "/pause"),
        ("post", "/update_weights"),
    ]:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            resp = getattr(httpx, method)(keyed.url + path, headers=headers, timeout=30)
            assert _error(resp, 401)["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=keyed.url + "/v1", api_key="wrong", max_retries=0).models.list()
    good = openai.OpenAI(base_url=keyed.url + "/v1", api_key=KEY, max_retries=0)
    assert good.models.list().data[0].id == "tiny-m3"
    r = good.chat.completions.create(model="tiny-m3", messages=MESSAGES, max_tokens=3, seed=1)
    assert r.usage.completion_tokens >= 1


def test_a_second_pause_in_another_mode_is_refused_and_resume_always_resumes(setup):
    """A keep pause followed by a drain / abort pause used to leave the engine frozen after /resume."""
    srv, _, _ = setup
    assert httpx.post(srv.url + "/pause", json={"mode": "keep"}, timeout=30).json()["mode"] == "keep"
    for other in ("drain", "abort"):
        err = _error(httpx.post(srv.url + "/pause", json={"mode": other}, timeout=30), 409)
        assert err["param"] == "mode" and "already paused with mode='keep'" in err["message"]
    assert httpx.post(srv.url + "/pause", json={"mode": "keep"}, timeout=30).json()["paused"]  # same mode: no-op
    assert httpx.post(srv.url + "/resume", timeout=30).json() == {"paused": False}
    body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 3, "seed": 0}}
    out = httpx.post(srv.url + "/generate", json=body, timeout=30).json()["outputs"][0]
    assert len(out["output_ids"]) == 3 and out["finish_reason"] in ("length", "stop")


def test_health_reports_paused_as_a_boolean_with_the_mode_beside_it(setup, monkeypatch):
    """/health's ``paused`` was the pause mode or null while /pause and /resume answer a boolean
    ``paused`` (and vLLM's /is_paused a boolean): now a boolean, the mode in ``pause_mode``. The
    client reads an older server's answer (the mode in ``paused``) into the same shape."""
    srv, _, _ = setup

    def health() -> dict:
        return httpx.get(srv.url + "/health", timeout=30).json()

    assert (health()["paused"], health()["pause_mode"]) == (False, None)
    assert httpx.post(srv.url + "/pause", json={"mode": "keep"}, timeout=30).json()["paused"] is True
    assert (health()["paused"], health()["pause_mode"]) == (True, "keep")
    client = RolloutServerClient(srv.url)
    try:
        got = client.health()
        assert (got["paused"], got["pause_mode"], got["status"]) == (True, "keep", "ok")
        for old, want in (("drain", (True, "drain")), (None, (False, None))):  # an older server's /health
            monkeypatch.setattr(client, "_get", lambda path, old=old: {"status": "ok", "paused": old})
            assert (client.health()["paused"], client.health()["pause_mode"]) == want
    finally:
        client.close()
        assert httpx.post(srv.url + "/resume", timeout=30).json() == {"paused": False}
    assert (health()["paused"], health()["pause_mode"]) == (False, None)


ENGINE_CASES = [
    # Values the request schema accepts and the engine refuses: the error names the client's field.
    ("/v1/chat/completions", _chat(temperature=1e-45), "temperature"),
    ("/v1/completions", {"model": "tiny-m3", "prompt": [5, 6], "max_tokens": 2, "top_k": 2**63}, "top_k"),
    (
        "/generate",
        {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2**63}},
        "sampling_params.max_new_tokens",
    ),
    ("/generate", {"input_ids": [5, 6], "sampling_params": {"temperature": 1e-45}}, "sampling_params.temperature"),
    ("/generate", {"input_ids": [5, 6], "sample_index": 2**63}, "sample_index"),
    # > 0 (the schema's bound) but logit / it overflows fp32: NaN logprobs were a 500 (not JSON)
    (
        "/generate",
        {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2, "repetition_penalty": 1e-40}},
        "sampling_params.repetition_penalty",
    ),
    ("/v1/chat/completions", _chat(repetition_penalty=1e-20, temperature=1e-20), "repetition_penalty"),
]


@pytest.mark.parametrize("path,body,param", ENGINE_CASES, ids=[f"{c[0]}:{c[2]}" for c in ENGINE_CASES])
def test_engine_errors_name_the_public_field(setup, path, body, param):
    """The engine's own names (SamplingParams.max_new_tokens, GenerationRequest.sample_index) used
    to reach the client, with param null."""
    srv, _, _ = setup
    err = _error(httpx.post(srv.url + path, json=body, timeout=60), 400)
    assert err["param"] == param and err["type"] == "invalid_request_error"
    assert err["message"].startswith(param) and "SamplingParams" not in err["message"]
    assert "GenerationRequest" not in err["message"]


def test_engine_error_in_a_stream_names_the_public_field(setup):
    srv, _, _ = setup
    with httpx.stream("POST", srv.url + "/v1/chat/completions", json=_chat(temperature=1e-45, stream=True)) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    err = next(json.loads(e)["error"] for e in events if e.startswith('{"error"'))
    assert err["param"] == "temperature" and err["message"].startswith("temperature=")
    assert events[-1] == "[DONE]"


def test_response_format_text_is_accepted(setup):
    # The one response_format the server honours (plain text); json_object / json_schema get a 400.
    srv, _, _ = setup
    resp = httpx.post(srv.url + "/v1/chat/completions", json=_chat(response_format={"type": "text"}), timeout=60)
    assert resp.status_code == 200, resp.text


def test_top_logprobs_refused_after_generation_is_a_503_with_a_message(setup):
    # the engine / EP group can refuse the top-logprobs forward after the sample was generated (e.g.
    # a rejected update between the two): a 503 naming why, not a bare 500; the server serves on
    srv, _, _ = setup
    runner = srv.app.state.controller.runner

    async def refuse(*args):
        raise ValueError("the served weights are invalid after a rejected update; call update_weights first")

    runner.top_logprobs = refuse
    # generated tokens' top lists come from the sampler and an echoed prompt's logprobs from the
    # prefill (no forward to refuse); a prompt scored alone (max_tokens 0) still takes one
    echo = {"model": "tiny-m3", "prompt": [5, 6, 7], "max_tokens": 0, "logprobs": 2, "echo": True}
    try:
        resp = httpx.post(srv.url + "/v1/chat/completions", json=_chat(logprobs=True, top_logprobs=2), timeout=60)
        assert resp.status_code == 200
        assert httpx.post(srv.url + "/v1/completions", json={**echo, "max_tokens": 2}, timeout=60).status_code == 200
        err = _error(httpx.post(srv.url + "/v1/completions", json=echo, timeout=60), 503)
        assert err["param"] == "logprobs" and err["type"] == "server_error"
        assert "update_weights" in err["message"]
    finally:
        del runner.top_logprobs
    resp = httpx.post(srv.url + "/v1/chat/completions", json=_chat(logprobs=True, top_logprobs=2), timeout=60)
    assert resp.status_code == 200 and len(resp.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 2


class _LostBackend(ScriptedBackend):
    """Every sample ends in an engine error record about no request field: what a request a failed
    EP group could not finish within its restarts, or refused by weights left invalid by a failed
    update, looks like."""

    LOST = "EP rank 1 exited; the request was lost (resubmit it)"

    def _out(self, req, j: int) -> SampleOutput:
        return SampleOutput(
            req.request_id, req.sample_index + j, list(req.prompt_ids), [], [], "error", 5, error=self.LOST
        )

    async def stream(self, req):
        self.requests.append(req)
        for j in range(req.params.n):
            yield self._out(req, j)


def test_an_engine_error_about_the_server_is_a_503_the_client_retries_not_a_400():
    """A lost request was a 400 invalid_request_error: a client (and openai's retry logic) took it
    for a malformed request and dropped it. It is the server's state: 503 server_error."""
    tok = tiny_tokenizer()
    served = served_model(tok, len(tok), MAX_LEN)
    srv = LiveServer(served, _LostBackend([[5, 6]], served.stop_token_ids[0]))
    try:
        for path, body in (("/v1/chat/completions", _chat()), ("/generate", {"input_ids": [5, 6]})):
            err = _error(httpx.post(srv.url + path, json=body, timeout=60), 503)
            assert err == {
                "message": _LostBackend.LOST,
                "type": "server_error",
                "param": None,
                "code": "generation_failed",
            }
        # a bad request keeps its 400 on the same server
        err = _error(httpx.post(srv.url + "/v1/chat/completions", json=_chat(top_p=0), timeout=60), 400)
        assert err["param"] == "top_p" and err["type"] == "invalid_request_error"
        # the GRPO HTTP backend turns it into the engine's error records, as in-process
        outs = HTTPBackend(srv.url).generate(
            [GenerationRequest("r0", [5, 6], SamplingParams(n=2, max_new_tokens=2), sample_index=4)]
        )
        assert [(o.sample_index, o.finish_reason, o.error, o.weight_version) for o in outs] == [
            (4, "error", _LostBackend.LOST, 5),
            (5, "error", _LostBackend.LOST, 5),
        ]
    finally:
        srv.stop()


def test_text_content_parts_render_as_the_plain_string(setup):
    srv, _, _ = setup
    parts = [{"type": "text", "text": "What is "}, {"type": "text", "text": "12 * 34?"}]
    plain = httpx.post(srv.url + "/tokenize", json={"messages": [{"role": "user", "content": "What is 12 * 34?"}]})
    split = httpx.post(srv.url + "/tokenize", json={"messages": [{"role": "user", "content": parts}]})
    assert split.status_code == plain.status_code == 200, split.text
    assert split.json()["tokens"] == plain.json()["tokens"]
    err = _error(httpx.post(srv.url + "/tokenize", json={"messages": [{"role": "user", "content": [{}]}]}), 400)
    assert 'content part 0 has no "type"' in err["message"] and err["param"] == "messages.0.content"


class _Caught(logging.Handler):
    """Keeps the records of a logger and acknowledges the first one that carries a traceback."""

    def __init__(self):
        super().__init__()
        self.records, self.traceback = [], threading.Event()

    def emit(self, record):
        self.records.append(record)
        if record.exc_info:
            self.traceback.set()


def test_an_unexpected_exception_is_a_500_server_error_in_the_openai_shape_and_logged(setup):
    """Breaker finding: an exception other than WeightSyncError during a weight update (or any
    unexpected one in a route) was a plain-text 500 "Internal Server Error". It is the OpenAI error
    shape, type server_error with the exception's message, and the server logs its traceback."""
    srv, _, _ = setup
    ctl = srv.controller
    message = "CUDA error: an illegal memory access was encountered"

    async def update_weights(body):
        raise RuntimeError(message)

    async def stream(request, stream=True):
        raise KeyError("lost")
        yield  # an async generator, as the runner's

    caught, log = _Caught(), logging.getLogger("uvicorn.error")
    log.addHandler(caught)
    ctl.update_weights, ctl.runner.stream = update_weights, stream
    try:
        err = _error(httpx.post(srv.url + "/update_weights", json={}, timeout=60), 500)
        assert err == {"message": message, "type": "server_error", "param": None, "code": None}
        assert caught.traceback.wait(60)  # the acknowledgement: logged once the answer was sent
        assert caught.records[0].exc_info[1].args == (message,)
        err = _error(httpx.post(srv.url + "/generate", json={"input_ids": [5, 6]}, timeout=60), 500)
        assert err == {"message": "'lost'", "type": "server_error", "param": None, "code": None}
        events = httpx.post(srv.url + "/generate", json={"input_ids": [5, 6], "stream": True}, timeout=60).text
        assert events.split("\n\n")[:2] == [f"data: {json.dumps({'error': err})}", "data: [DONE]"]
    finally:
        log.removeHandler(caught)
        del ctl.update_weights, ctl.runner.stream
    assert httpx.post(srv.url + "/generate", json={"input_ids": [5, 6]}, timeout=60).status_code == 200

"""logit_bias and penalties through the ``openai`` client (chat and completions) and ``/generate``:
they change the tokens as vLLM's do."""

import httpx
import openai
import pytest
from server_util import MESSAGES, LiveServer, native_backend, served_model, tiny_model, tiny_tokenizer

MAX_LEN = 256


@pytest.fixture(scope="module")
def srv():
    tok = tiny_tokenizer()
    served = served_model(tok, len(tok), MAX_LEN)
    server = LiveServer(served, native_backend(tiny_model(len(tok), max_len=MAX_LEN), served))
    yield server
    server.stop()


def _ids(choice):
    return choice.model_extra["token_ids"]


def test_logit_bias_moves_the_greedy_tokens_on_both_routes(srv):
    c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    extra = {"return_token_ids": True}
    chat = dict(model="tiny-m3", messages=MESSAGES, max_tokens=6, temperature=0, extra_body=extra)
    comp = dict(model="tiny-m3", prompt="What is 12", max_tokens=6, temperature=0, extra_body=extra)
    for create, kw in ((c.chat.completions.create, chat), (c.completions.create, comp)):
        greedy = _ids(create(**kw).choices[0])
        first = greedy[0]
        banned = _ids(create(**kw, logit_bias={str(first): -100}).choices[0])
        assert banned[0] != first and first not in banned
        forced = _ids(create(**kw, logit_bias={"17": 100}).choices[0])
        assert forced == [17] * 6
        # out-of-range biases are clamped to [-100, 100], as vLLM does
        assert _ids(create(**kw, logit_bias={"17": 1e6}).choices[0]) == forced
        # a presence penalty of 2 on top of forcing: 17 still wins (100 - 2 beats the rest)
        assert _ids(create(**kw, logit_bias={"17": 100}, presence_penalty=2).choices[0]) == forced
        # repetition penalty (vLLM's extension) over the prompt and output: no token repeats
        rep = _ids(create(**{**kw, "extra_body": {**extra, "repetition_penalty": 1e6}}).choices[0])
        assert len(set(rep)) == len(rep)


def _generate(srv, body) -> list[int]:
    resp = httpx.post(srv.url + "/generate", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()["outputs"][0]["output_ids"]


def test_generate_takes_penalties_and_logit_bias(srv):
    body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 5, "temperature": 0, "seed": 1}}
    greedy = _generate(srv, body)
    sp = {**body["sampling_params"], "logit_bias": {"17": 100.0}, "frequency_penalty": 0.5}
    assert _generate(srv, {**body, "sampling_params": sp}) == [17] * 5 != greedy
    sp = {**body["sampling_params"], "repetition_penalty": 1e6}
    ids = _generate(srv, {**body, "sampling_params": sp})
    assert len(set(ids)) == len(ids) and not set(ids) & {5, 6, 7}

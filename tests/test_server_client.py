"""HTTPBackend: the GenerationBackend contract over /generate. Multi-turn tool-use group rollouts
through a server give the same trajectories as the in-process engine (same seeds, keyed sampler),
bad requests become error records, and update_weights pushes new weights through weight sync."""

import json

import httpx
import numpy as np
import pytest
import torch
from server_util import LiveServer, native_backend, served_model, tiny_model, tiny_tokenizer  # tests/ on sys.path
from test_rollout_multiturn import EchoEnv

from m3_rollout.chat.template import ChatFormat
from m3_rollout.engine.interface import GenerationRequest, SamplingParams
from m3_rollout.model.loading import iter_released_tensors
from m3_rollout.model.selection_record import canonical_rows
from m3_rollout.rollout.group_rollout import RolloutSettings, run_group_rollouts
from m3_rollout.server.client import HTTPBackend, request_body
from m3_rollout.weight_sync import LocalWeightSync

MAX_LEN = 256


@pytest.fixture(scope="module")
def setup():
    tok = tiny_tokenizer()
    served = served_model(tok, len(tok), MAX_LEN)
    model = tiny_model(len(tok), max_len=MAX_LEN)
    # Make the end-of-message token likely so turns end by "stop" and episodes have several turns.
    bias = torch.zeros(len(tok))
    bias[served.stop_token_ids[0]] = 4.0
    model.lm_head.register_forward_hook(lambda mod, inp, out: out + bias.to(out.dtype))
    srv = LiveServer(served, native_backend(model, served, record_routing=True, record_block_selection=True))
    yield tok, served, model, srv
    srv.stop()


def _rollouts(backend, tok):
    chat = ChatFormat(tok, "disabled")
    env = EchoEnv()  # every turn gets a tool observation: episodes run to the turn limit
    records = [{}, {}, {}]
    settings = RolloutSettings(n=4, max_turns=3, max_total_len=MAX_LEN, max_new_tokens=16, seed=7)
    trajs, _ = run_group_rollouts(backend, chat, env, records, settings)
    return trajs


def test_group_rollouts_over_http_equal_the_in_process_engine(setup):
    tok, served, model, srv = setup
    http = HTTPBackend(srv.url, return_routed_experts=True, return_block_selection=True)
    over_http = _rollouts(http, tok)
    local = _rollouts(native_backend(model, served, record_routing=True, record_block_selection=True), tok)
    assert len(over_http) == len(local) == 12
    assert max(len(t.turns) for t in over_http) >= 2  # really multi-turn
    for a, b in zip(over_http, local):
        assert a.token_ids == b.token_ids and a.loss_mask == b.loss_mask
        assert np.allclose(a.rollout_logprobs, b.rollout_logprobs, atol=1e-6)
        assert a.weight_version == b.weight_version
        assert [r.finish_reason for r in a.turns] == [r.finish_reason for r in b.turns]
        assert np.array_equal(np.asarray(a.routed_experts), np.asarray(b.routed_experts))
        # block selections: per turn only the new tokens, coded over the wire (sets: canonical order)
        end = b.block_selection.end
        assert a.block_selection.end == end == len(b.token_ids) - 1
        assert [s.start for s in a.block_selection.segments] == [s.start for s in b.block_selection.segments]
        assert np.array_equal(a.block_selection.dense(end), canonical_rows(b.block_selection.dense(end)))
    for g in range(3):  # a group's samples share the prompt segment (sent once per response)
        assert all(
            t.block_selection.segments[0] is over_http[4 * g].block_selection.segments[0]
            for t in over_http[4 * g : 4 * g + 4]
        )
    http.shutdown()


def test_bad_request_is_an_error_record_and_update_weights_works(setup):
    tok, served, model, srv = setup
    http = HTTPBackend(srv.url)
    good = GenerationRequest("ok", [5, 6, 7], SamplingParams(n=2, max_new_tokens=4, seed=1))
    bad = GenerationRequest("bad", [5, len(tok) + 3], SamplingParams(n=2, max_new_tokens=4))
    outs = http.generate([good, bad])
    assert [(o.request_id, o.sample_index) for o in outs] == [("ok", 0), ("ok", 1), ("bad", 0), ("bad", 1)]
    assert [o.finish_reason for o in outs[2:]] == ["error", "error"] and "outside the vocabulary" in outs[2].error
    assert all(len(o.output_ids) == 4 and o.token_weight_versions == [0] * 4 for o in outs[:2])
    # A weight update through HTTPBackend: the server then serves the new tensors (version 9).
    new = {n: t.detach().clone() for n, t in iter_released_tensors(model)}
    name = next(n for n in new if n.endswith("lm_head.weight"))
    new[name].mul_(0.5)
    http.update_weights(9, new.items())
    assert http.weight_version == 9
    with torch.no_grad():
        assert torch.equal(model.lm_head.weight, new[name])  # in place, in the served model
    (again,) = [o for o in http.generate([good]) if o.sample_index == 0]
    assert again.token_weight_versions == [9] * 4
    http.shutdown()


def test_a_refused_request_gives_the_engines_error_records(setup):
    """The error records of a request the server refuses are the in-process engine's
    (``engine.requests.error_outputs``): one per sample, and a single one for an ``n`` that is no
    valid count (the client's own copy gave none for n=0: the request vanished from the results)."""
    tok, served, model, srv = setup
    http, local = HTTPBackend(srv.url), native_backend(model, served)
    reqs = [
        GenerationRequest("n0", [5, 6], SamplingParams(n=0, max_new_tokens=4)),
        GenerationRequest("oov", [5, len(tok) + 3], SamplingParams(n=2, max_new_tokens=4), sample_index=3),
    ]
    try:
        got = [(o.request_id, o.sample_index, o.prompt_ids, o.output_ids, o.finish_reason) for o in http.generate(reqs)]
    finally:
        http.shutdown()
    want = [(o.request_id, o.sample_index, o.prompt_ids, o.output_ids, o.finish_reason) for o in local.generate(reqs)]
    oov = [5, len(tok) + 3]
    assert got == want
    assert want == [("n0", 0, [5, 6], [], "error"), ("oov", 3, oov, [], "error"), ("oov", 4, oov, [], "error")]


def test_sampler_top_logprobs_over_http_equal_the_in_process_engine(setup):
    """``SamplingParams.top_logprobs`` goes through /generate (``sampling_params.top_logprobs``) and
    comes back as ``SampleOutput.top_logprobs``: the sampler's lists, equal to the in-process
    engine's for the same seed; streamed events carry their tokens' lists; none when not asked."""
    tok, served, model, srv = setup
    http, local = HTTPBackend(srv.url), native_backend(model, served)
    params = SamplingParams(n=2, max_new_tokens=6, seed=4, temperature=0.8, top_p=0.9, top_logprobs=3)
    req = GenerationRequest("tops", [5, 6, 7], params)
    plain = GenerationRequest("plain", [5, 6, 7], SamplingParams(max_new_tokens=3, seed=4))
    try:
        over_http, plain_http = http.generate([req]), http.generate([plain])
    finally:
        http.shutdown()
    in_process = local.generate([req])
    assert len(over_http) == 2 and over_http[0].output_ids != over_http[1].output_ids
    for a, b in zip(over_http, in_process, strict=True):
        assert a.output_ids == b.output_ids and len(a.top_logprobs) == len(a.output_ids)
        assert all(1 <= len(row) <= 3 for row in a.top_logprobs)
        assert a.top_logprobs == b.top_logprobs  # (token id, logprob) tuples, exact through JSON
    assert plain_http[0].top_logprobs is None and "top_logprobs" not in request_body(plain)["sampling_params"]
    # streamed: each event carries its tokens' lists; together, the sample's
    got: dict[int, list] = {0: [], 1: []}
    with httpx.stream("POST", srv.url + "/generate", json={**request_body(req), "stream": True}, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                if "token_ids" in event:
                    got[event["sample_index"]] += [[tuple(p) for p in row] for row in event["top_logprobs"]]
    assert [got[0], got[1]] == [o.top_logprobs for o in over_http]
    refused = httpx.post(srv.url + "/generate", json={"input_ids": [5], "sampling_params": {"top_logprobs": 21}})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "sampling_params.top_logprobs"


def test_prompt_logprobs_over_http_equal_the_in_process_engine(setup):
    """``SamplingParams.prompt_logprobs`` goes through /generate (``sampling_params.prompt_logprobs``)
    and the prefill's entries and weight-write stamps come back (``prefill_prompt_logprobs``,
    ``prompt_weight_writes``) as ``SampleOutput.prompt_logprobs`` / ``prompt_weight_writes``, bit
    for bit the in-process engine's: a token the top-k filter removed (-inf) included, k=0 too; none
    and no field sent when not asked. A server of its own, so its weight-write count is a fresh
    engine's, as the in-process one's (another test of this module writes the weights)."""
    tok, served, model, _ = setup
    srv = LiveServer(served, native_backend(model, served))
    http, local = HTTPBackend(srv.url), native_backend(model, served)
    prompt = [5, 6, 7, 8, 9, 10]
    reqs = [
        GenerationRequest("plp", prompt, SamplingParams(n=2, max_new_tokens=4, seed=3, top_k=2, prompt_logprobs=3)),
        GenerationRequest(
            "raw0", prompt, SamplingParams(max_new_tokens=2, seed=3, logprobs_mode="raw", prompt_logprobs=0)
        ),
    ]
    plain = GenerationRequest("plain", prompt, SamplingParams(max_new_tokens=2, seed=3))
    try:
        # one request at a time on both sides: the same prefill batches, so the same bits
        over_http = [o for r in reqs for o in http.generate([r])]
        plain_http = http.generate([plain])
    finally:
        http.shutdown()
        srv.stop()
    in_process = [o for r in reqs for o in local.generate([r])]
    assert len(over_http) == len(in_process) == 3
    for a, b in zip(over_http, in_process, strict=True):
        assert (a.request_id, a.sample_index, a.output_ids) == (b.request_id, b.sample_index, b.output_ids)
        assert len(b.prompt_logprobs) == len(prompt) and b.prompt_logprobs[0] is None
        assert a.prompt_logprobs == b.prompt_logprobs  # PositionLogprobs (logprob, rank, top), exact through JSON
        assert a.prompt_weight_writes == b.prompt_weight_writes == [local.weight_writes] * (len(prompt) - 1)
    filtered = [e.logprob for e in over_http[0].prompt_logprobs[1:]]
    assert float("-inf") in filtered and all(len(e.top) <= 2 for e in over_http[0].prompt_logprobs[1:])
    assert all(e.top == [] and e.logprob > float("-inf") for e in over_http[2].prompt_logprobs[1:])  # k=0, raw
    assert request_body(reqs[1])["sampling_params"]["prompt_logprobs"] == 0
    assert "prompt_logprobs" not in request_body(plain)["sampling_params"]
    assert plain_http[0].prompt_logprobs is None and plain_http[0].prompt_weight_writes == []


def test_penalties_and_logit_bias_over_http_equal_the_in_process_engine(setup):
    """``presence_penalty`` / ``frequency_penalty`` / ``repetition_penalty`` / ``logit_bias`` of
    ``SamplingParams`` go through /generate (they used to be dropped: HTTPBackend sampled without
    them): same tokens and logprobs as the in-process engine; a logit_bias the engine refuses (an id
    twice, which a JSON object cannot hold) gives the engine's error records, not a merged bias."""
    tok, served, model, srv = setup
    http, local = HTTPBackend(srv.url), native_backend(model, served)
    params = SamplingParams(
        n=2,
        max_new_tokens=8,
        seed=5,
        presence_penalty=1.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.7,
        logit_bias=((9, 6.0), (11, -100.0), (12, 3.5)),
        top_logprobs=2,
    )
    req = GenerationRequest("pen", [9, 10, 11, 12], params)
    twice = GenerationRequest("twice", [5, 6], SamplingParams(max_new_tokens=2, logit_bias=((9, 1.0), (9, 2.0))))
    try:
        over_http = http.generate([req, twice])
    finally:
        http.shutdown()
    in_process = local.generate([req, twice])
    unpenalized = local.generate(
        [GenerationRequest("plain", [9, 10, 11, 12], SamplingParams(n=2, max_new_tokens=8, seed=5))]
    )
    assert [o.logprobs for o in in_process[:2]] != [o.logprobs for o in unpenalized]  # the fields change them
    assert all(11 not in o.output_ids for o in in_process[:2])  # bias -100
    for a, b in zip(over_http, in_process, strict=True):
        assert (a.request_id, a.sample_index, a.output_ids, a.finish_reason) == (
            b.request_id,
            b.sample_index,
            b.output_ids,
            b.finish_reason,
        )
        assert a.logprobs == b.logprobs and a.top_logprobs == b.top_logprobs and a.error == b.error
    assert over_http[2].finish_reason == "error" and "token 9 given twice" in over_http[2].error
    assert request_body(req)["sampling_params"]["logit_bias"] == {"9": 6.0, "11": -100.0, "12": 3.5}


def test_request_body_sends_or_refuses_every_sampling_field():
    """Every ``SamplingParams`` field set to other than its default is either in the /generate body
    (under a key /generate takes) or refused with a ValueError naming it: a field added to
    SamplingParams later cannot be dropped silently. Fields at their defaults that are optional on
    the wire are left out (older servers take the request)."""
    from dataclasses import fields

    from m3_rollout.server.protocol import GenerateRequest, GenerateSamplingParams

    set_values = {
        "n": 3,
        "temperature": 0.7,
        "top_p": 0.8,
        "top_k": 5,
        "max_new_tokens": 9,
        "stop_token_ids": (4, 7),
        "seed": 11,
        "logprobs_mode": "raw",
        "stop_strings": ("ab",),
        "top_logprobs": 4,
        "presence_penalty": 0.5,
        "frequency_penalty": -1.0,
        "repetition_penalty": 1.3,
        "logit_bias": ((3, 2.0),),
        "prompt_logprobs": 0,
        "ignore_eos": True,
    }
    default_body = request_body(GenerationRequest("r", [1, 2], SamplingParams()))["sampling_params"]
    assert set(default_body) == {
        "n",
        "temperature",
        "top_p",
        "top_k",
        "max_new_tokens",
        "stop_token_ids",
        "stop",
        "seed",
        "logprobs_mode",
    }
    for f in fields(SamplingParams):
        value = set_values.get(f.name, object())  # a field unknown here: any non-default value
        req = GenerationRequest("r", [1, 2], SamplingParams(**{f.name: value}))
        try:
            body = request_body(req)
        except ValueError as exc:
            assert f"SamplingParams.{f.name}" in str(exc)
            continue
        sent = {k: v for k, v in body["sampling_params"].items() if default_body.get(k, k) != v}
        assert len(sent) == 1, (f.name, sent)  # the field, under its key
        assert set(sent) <= set(GenerateSamplingParams.model_fields), (f.name, sent)
        parsed = GenerateRequest.model_validate_json(json.dumps(body)).sampling_params
        assert getattr(parsed, next(iter(sent))) is not None


def test_token_weight_writes_over_http_equal_the_in_process_engine(setup):
    """Each generated token's weight-write count (``SampleOutput.token_weight_writes``) comes back
    through /generate (``token_weight_writes``; streamed events ``weight_writes``), the in-process
    engine's (it came back empty). A server of its own, so its count is a fresh engine's, as the
    in-process one's (another test of this module writes the weights); one weight update (the
    served tensors, unchanged) on each side, so the count is not the initial one."""
    tok, served, model, _ = setup
    srv = LiveServer(served, native_backend(model, served))
    http, local = HTTPBackend(srv.url), native_backend(model, served)
    req = GenerationRequest("w", [5, 6, 7], SamplingParams(n=2, max_new_tokens=5, seed=2))
    same = [(n, t.detach().clone()) for n, t in iter_released_tensors(model)]
    try:
        http.update_weights(1, same)
        over_http = http.generate([req])
        streamed: dict[int, list] = {0: [], 1: []}
        with httpx.stream("POST", srv.url + "/generate", json={**request_body(req), "stream": True}, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    event = json.loads(line[6:])
                    if "token_ids" in event:
                        streamed[event["sample_index"]] += event["weight_writes"]
                    else:
                        assert event["token_weight_writes"] == streamed[event["sample_index"]]
    finally:
        http.shutdown()
        srv.stop()
    local.weight_sync = LocalWeightSync(local.engine)  # what the job's stack builder attaches
    local.update_weights(1, same)
    in_process = local.generate([req])
    assert local.weight_writes > 0
    for a, b in zip(over_http, in_process, strict=True):
        assert a.output_ids == b.output_ids and a.token_weight_versions == [1] * len(a.output_ids)
        assert a.token_weight_writes == b.token_weight_writes == [local.weight_writes] * len(a.output_ids)
    assert [streamed[0], streamed[1]] == [o.token_weight_writes for o in over_http]

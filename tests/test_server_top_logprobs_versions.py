"""top_logprobs and prompt logprobs come from a forward with the weights served when the answer is
assembled; a token sampled with other weights must not get another model's scores. The guard
compares weight-write stamps (``token_weight_writes``, which change with every write of the
weights), not version numbers: an update that re-sends the version held (``replace=True``) and a
token sampled on KV computed partly under earlier weights (in_flight "continue" without
recompute) are caught too. Such tokens get an empty top_logprobs list, an echoed prompt whose
first token came from other weights gets null logprobs and empty lists, and the choice a
``top_logprobs_note`` naming them; tokens of the weights served keep theirs."""

import asyncio
import json

import pytest
from server_util import MESSAGES, served_model, tiny_tokenizer  # tests/ on sys.path

from m3_rollout.engine.interface import PositionLogprobs, SampleOutput, SamplingParams, StreamDelta
from m3_rollout.server.openai_api import OpenAIServing
from m3_rollout.server.protocol import ChatCompletionRequest, CompletionRequest

IDS = [40, 41, 42, 43]
SERVED_WRITES = 4  # the weight-write count of the forward that scores


class _UpdatedRunner:
    """A runner whose request ran across a weight write: tokens IDS with ``versions`` / ``writes``;
    the server now holds version 1 at write count SERVED_WRITES. top_logprobs returns rows for the
    asked positions (PositionLogprobs with ``with_tokens``: logprob -0.75, rank 3) and the version
    and count it ran with."""

    weight_version = 1

    def __init__(self, versions, writes, prefill_writes=None):
        self.versions, self.writes = versions, writes
        self.prefill_writes = prefill_writes  # given: the outputs carry prefill prompt logprobs stamped so
        self.tops_calls = []

    async def stream(self, greq, stream=False):
        if stream:
            for t, v, w in zip(IDS, self.versions, self.writes):
                yield StreamDelta(greq.request_id, 0, [t], [-0.25], [v], [w])
        prefill = {}
        if self.prefill_writes is not None:  # the prefill's: logprob -0.5, rank 2, the top 2 tokens 9 and 7
            n = len(greq.prompt_ids) - 1
            rows = [None] + [PositionLogprobs(-0.5, 2, [(9, -0.25), (7, -0.5)])] * n
            prefill = dict(prompt_logprobs=rows, prompt_weight_writes=(self.prefill_writes * n)[:n])
        yield SampleOutput(
            greq.request_id,
            0,
            list(greq.prompt_ids),
            IDS,
            [-0.25] * 4,
            "length",
            self.versions[-1],
            token_weight_versions=list(self.versions),
            token_weight_writes=list(self.writes),
            **prefill,
        )

    async def top_logprobs(self, token_ids, start, k, temperature, top_k=-1, top_p=1.0, with_tokens=False):
        self.tops_calls.append((len(token_ids), start, with_tokens))
        rows = [[(7, -0.5), (8, -1.5)][:k] for _ in range(len(token_ids) - start)]
        if with_tokens:
            rows = [PositionLogprobs(-0.75, 3, r) for r in rows]
        return rows, 1, SERVED_WRITES


def _serving(versions, writes, prefill_writes=None):
    tok = tiny_tokenizer()
    return OpenAIServing(served_model(tok, len(tok), 128), _UpdatedRunner(versions, writes, prefill_writes))


def _chat(serving, **kw):
    req = ChatCompletionRequest.model_validate(
        {"model": "tiny-m3", "messages": MESSAGES, "max_tokens": 4, "logprobs": True, "top_logprobs": 2, **kw}
    )
    prompt, greq = serving.prepare_chat(req)
    return asyncio.run(serving.chat(req, prompt, greq))["choices"][0]


def _completion(serving, **kw):
    req = CompletionRequest.model_validate({"model": "tiny-m3", "prompt": [5, 6, 7], "max_tokens": 4, **kw})
    reqs = serving.prepare_completion(req)
    return asyncio.run(serving.completion(req, reqs))["choices"][0]


def test_chat_tokens_of_an_older_version_get_no_top_logprobs_and_a_note():
    choice = _chat(_serving([0, 0, 1, 1], [3, 3, 4, 4]))
    entries = choice["logprobs"]["content"]
    assert [len(e["top_logprobs"]) for e in entries] == [0, 0, 2, 2]
    assert [e["logprob"] for e in entries] == [-0.25] * 4  # the sampler's, kept for every token
    note = choice["top_logprobs_note"]
    assert "empty for 2 token(s) (indices 0..1)" in note and "weight version(s) 0" in note and "version(s) 1" in note


def test_a_same_version_rewrite_is_caught_by_the_write_count():
    """versions [1, 1, 1, 1] all equal the served 1 (an update re-sent version 1 with replace=True
    after the first two tokens): the version guard gave all four tokens the new model's
    alternatives; their write stamps (3 before the update, 4 after) tell them apart."""
    choice = _chat(_serving([1, 1, 1, 1], [3, 3, 4, 4]))
    assert [len(e["top_logprobs"]) for e in choice["logprobs"]["content"]] == [0, 0, 2, 2]
    note = choice["top_logprobs_note"]
    assert "(indices 0..1)" in note and "weight version(s) 1" in note and "replace=True" in note


def test_tokens_sampled_on_kv_of_earlier_weights_get_no_top_logprobs():
    """The request went on across an update without recomputing its KV: its later tokens were
    sampled with the new weights (stamp -1: KV partly from the old ones), which a forward of the
    new weights does not reproduce."""
    choice = _chat(_serving([0, 0, 1, 1], [4, 4, -1, -1]))
    assert [len(e["top_logprobs"]) for e in choice["logprobs"]["content"]] == [2, 2, 0, 0]
    note = choice["top_logprobs_note"]
    assert "(indices 2..3)" in note and "KV cache computed partly with weights written over since" in note


def test_streamed_chat_notes_each_chunk_whose_tokens_are_older():
    serving = _serving([0, 0, 1, 1], [3, 3, 4, 4])
    req = ChatCompletionRequest.model_validate(
        {"model": "tiny-m3", "messages": MESSAGES, "max_tokens": 4, "logprobs": True, "top_logprobs": 1, "stream": True}
    )
    prompt, greq = serving.prepare_chat(req)

    async def collect():
        return [e async for e in serving.chat_stream(req, prompt, greq)]

    events = [json.loads(e[6:]) for e in asyncio.run(collect()) if e.startswith("data: {")]
    chunks = [c for e in events for c in e["choices"] if c.get("logprobs")]
    assert [len(c["logprobs"]["content"][0]["top_logprobs"]) for c in chunks] == [0, 0, 1, 1]
    assert ["top_logprobs_note" in c for c in chunks] == [True, True, False, False]
    assert "(index 1)" in chunks[1]["top_logprobs_note"]


@pytest.mark.parametrize("writes", [[3, 3, 4, 4], [4, 4, -1, -1]])
def test_streamed_completion_chunks_are_guarded_as_the_whole_answer(writes):
    """Streamed completions carry each chunk's logprobs under the same guard as the non-streamed
    answer: a token of weights written over since (an older count, or -1: KV of earlier weights)
    gets an empty top list, and its chunk the note; the chunks concatenate to the whole answer."""
    serving = _serving([1, 1, 1, 1], writes)
    body = {"model": "tiny-m3", "prompt": [5, 6, 7], "max_tokens": 4, "logprobs": 2}
    req = CompletionRequest.model_validate({**body, "stream": True})

    async def collect():
        return [e async for e in serving.completion_stream(req, serving.prepare_completion(req))]

    events = [json.loads(e[6:]) for e in asyncio.run(collect()) if e.startswith("data: {")]
    chunks = [c for e in events for c in e["choices"] if c["logprobs"] is not None]
    stale = [w != SERVED_WRITES for w in writes]
    # a fresh token's list: the sampled token (vLLM's way; IDS are not among the top 7, 8), then the top 2
    assert [len(c["logprobs"]["top_logprobs"][0]) for c in chunks] == [0 if s else 3 for s in stale]
    assert ["top_logprobs_note" in c for c in chunks] == stale
    whole = _completion(_serving([1, 1, 1, 1], writes), logprobs=2)["logprobs"]
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [v for c in chunks for v in c["logprobs"][key]] == whole[key]


def test_completion_tokens_of_an_older_version_get_empty_top_logprobs():
    serving = _serving([0, 0, 1, 1], [3, 3, 4, 4])
    choice = _completion(serving, logprobs=2)
    assert [len(row) for row in choice["logprobs"]["top_logprobs"]] == [0, 0, 3, 3]
    decode = serving.served.decode
    assert choice["logprobs"]["top_logprobs"][2] == {decode([42]): -0.25, decode([7]): -0.5, decode([8]): -1.5}
    assert "indices 0..1" in choice["top_logprobs_note"]


def test_echoed_prompt_of_other_weights_gets_null_logprobs_and_a_note():
    """The sample's first token (so its prompt) was run at write count 3, the scoring forward at 4:
    the prompt's logprobs would be another model's, so they are null with empty top lists."""
    serving = _serving([1, 1, 1, 1], [3, 3, 4, 4])
    lp = _completion(serving, logprobs=2, echo=True)
    assert lp["logprobs"]["token_logprobs"] == [None, None, None] + [-0.25] * 4
    assert lp["logprobs"]["top_logprobs"][:3] == [None, {}, {}]
    assert [len(row) for row in lp["logprobs"]["top_logprobs"][3:]] == [0, 0, 3, 3]
    note = lp["top_logprobs_note"]
    assert "indices 0..1" in note and "the prompt tokens' logprobs are null" in note and "version 1" in note
    assert serving.runner.tops_calls == [(7, 1, True)]  # one forward: prompt and generated tokens

    fresh = _completion(_serving([1, 1, 1, 1], [4, 4, 4, 4]), logprobs=2, echo=True)
    assert fresh["logprobs"]["token_logprobs"] == [None, -0.75, -0.75] + [-0.25] * 4
    assert "top_logprobs_note" not in fresh


@pytest.mark.parametrize("writes,stale", [([3, 3, 4, 4], True), ([-1, -1, -1, -1], True), ([4, 4, 4, 4], False)])
def test_generate_prompt_logprobs_of_other_weights_are_empty(writes, stale):
    serving = _serving([1, 1, 1, 1], writes)
    prompt = [5, 6, 7]
    out = SampleOutput("g", 0, prompt, IDS, [-0.25] * 4, "length", 1, None, [1] * 4, token_weight_writes=writes)
    scored = asyncio.run(serving.prompt_scores(prompt, 2, SamplingParams()))
    entries, note = serving.sample_prompt_logprobs(prompt, scored, out, 2)
    assert len(entries) == 3 and entries[0] is None
    if stale:
        assert entries[1:] == [{}, {}] and "prompt_logprobs holds empty entries" in note
    else:
        assert note is None and entries[1]["6"] == {
            "logprob": -0.75,
            "rank": 3,
            "decoded_token": entries[1]["6"]["decoded_token"],
        }
        assert [d["rank"] for d in entries[1].values()] == [3, 1, 2]  # the prompt token, then the top 2


def _chat_body(serving, **kw) -> dict:
    req = ChatCompletionRequest.model_validate({"model": "tiny-m3", "messages": MESSAGES, "max_tokens": 4, **kw})
    prompt, greq = serving.prepare_chat(req)
    return asyncio.run(serving.chat(req, prompt, greq))


@pytest.mark.parametrize("writes,stale", [([3, 3, 4, 4], True), ([-1, -1, -1, -1], True), ([4, 4, 4, 4], False)])
def test_openai_prompt_logprobs_of_other_weights_are_empty(writes, stale):
    """vLLM's ``prompt_logprobs`` on /v1/completions (per choice) and /v1/chat/completions (per
    response) under the same guard as /generate's: a sample whose first token (so its prompt) ran
    at write count 3 or on KV of earlier weights (-1), scored at 4, gets empty entries and a
    ``prompt_logprobs_note``, not another model's scores; a fresh one gets the scores."""
    choice = _completion(_serving([1, 1, 1, 1], writes), prompt_logprobs=2)
    body = _chat_body(_serving([1, 1, 1, 1], writes), prompt_logprobs=2)
    n_chat = len(body["prompt_logprobs"])
    assert choice["prompt_logprobs"][0] is None and body["prompt_logprobs"][0] is None and n_chat > 3
    if stale:
        assert choice["prompt_logprobs"][1:] == [{}, {}] and body["prompt_logprobs"][1:] == [{}] * (n_chat - 1)
        for note in (choice["prompt_logprobs_note"], body["prompt_logprobs_note"]):
            assert "prompt_logprobs holds empty entries" in note and "weight version 1" in note
    else:
        assert "prompt_logprobs_note" not in choice and "prompt_logprobs_note" not in body
        # the prompt token (rank 3 from the runner), then the top 2 (tokens 7 and 8)
        assert [(t, d["rank"], d["logprob"]) for t, d in choice["prompt_logprobs"][1].items()] == [
            ("6", 3, -0.75),
            ("7", 1, -0.5),
            ("8", 2, -1.5),
        ]
        assert all(e and list(e.values())[0]["logprob"] == -0.75 for e in body["prompt_logprobs"][1:])
    assert "prompt_logprobs" not in body["choices"][0]  # chat: on the response, as vLLM's


@pytest.mark.parametrize("prefill_writes,kept", [([3], True), ([3, 4], False), ([3, -1], False)])
def test_prefill_prompt_logprobs_are_kept_unless_the_prefill_ran_across_a_write(prefill_writes, kept):
    """Outputs that carry the engine's prefill scores (``SampleOutput.prompt_logprobs``): the sample
    ran at write count 3 and the server now holds 4, yet they are the scores of the weights that
    prefilled the prompt, returned with no scoring forward; unless the prefill itself ran across a
    write (entries stamped 3 then 4, or -1: KV from earlier weights): empty entries and a note."""
    why = "prefilled across a weight update"
    choice = _completion(_serving([1] * 4, [3] * 4, prefill_writes), prompt_logprobs=2, logprobs=2, echo=True)
    body = _chat_body(serving := _serving([1] * 4, [3] * 4, prefill_writes), prompt_logprobs=2)
    assert serving.runner.tops_calls == []  # chat: no top_logprobs asked, the prompt's from the prefill
    entries, echoed = choice["prompt_logprobs"], choice["logprobs"]
    if kept:
        assert [(t, d["rank"], d["logprob"]) for t, d in entries[2].items()] == [("7", 2, -0.5), ("9", 1, -0.25)]
        # the generated tokens (sampled at 3, no sampler lists) lose their top lists; the prompt's stay
        assert echoed["token_logprobs"][:3] == [None, -0.5, -0.5]
        assert list(echoed["top_logprobs"][1].values()) == [-0.5, -0.25, -0.5]  # token 6, then 9 and 7
        assert "prompt tokens" not in choice["top_logprobs_note"]
        assert "prompt_logprobs_note" not in choice and "prompt_logprobs_note" not in body
        assert all(e and e[next(iter(e))]["logprob"] == -0.5 for e in body["prompt_logprobs"][1:])
    else:
        assert entries[1:] == [{}, {}] and echoed["token_logprobs"][:3] == [None, None, None]
        assert why in choice["prompt_logprobs_note"] and why in choice["top_logprobs_note"]
        assert why in body["prompt_logprobs_note"] and body["prompt_logprobs"][1:] == [{}] * (
            len(body["prompt_logprobs"]) - 1
        )

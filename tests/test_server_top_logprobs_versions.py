"""top_logprobs come from a forward with the weights served when the answer is assembled; a token
sampled with other weights (a weight update landed while the request ran, in_flight "continue")
must not get another model's alternatives. Such tokens get an empty top_logprobs list and the
choice a ``top_logprobs_note`` naming them; tokens of the served version keep theirs."""

import asyncio
import json

from server_util import MESSAGES, served_model, tiny_tokenizer  # tests/ on sys.path

from m3_rollout.engine.interface import SampleOutput, StreamDelta
from m3_rollout.server.openai_api import OpenAIServing
from m3_rollout.server.protocol import ChatCompletionRequest, CompletionRequest

IDS = [40, 41, 42, 43]
VERSIONS = [0, 0, 1, 1]  # an update from 0 to 1 landed after the second token


class _UpdatedRunner:
    """A runner whose request ran across an update: tokens IDS with VERSIONS; the server now holds
    version 1. top_logprobs returns rows for the asked positions and the version it ran with."""

    weight_version = 1

    def __init__(self):
        self.tops_calls = []

    async def stream(self, greq, stream=False):
        if stream:
            for t, v in zip(IDS, VERSIONS):
                yield StreamDelta(greq.request_id, 0, [t], [-0.25], [v])
        yield SampleOutput(
            greq.request_id, 0, list(greq.prompt_ids), IDS, [-0.25] * 4, "length", 1, token_weight_versions=VERSIONS
        )

    async def top_logprobs(self, token_ids, start, k, temperature, top_k=-1, top_p=1.0):
        self.tops_calls.append((len(token_ids), start))
        return [[(7, -0.5), (8, -1.5)][:k] for _ in range(len(token_ids) - start)], 1


def _serving():
    tok = tiny_tokenizer()
    return OpenAIServing(served_model(tok, len(tok), 128), _UpdatedRunner())


def test_chat_tokens_of_an_older_version_get_no_top_logprobs_and_a_note():
    serving = _serving()
    req = ChatCompletionRequest.model_validate(
        {"model": "tiny-m3", "messages": MESSAGES, "max_tokens": 4, "logprobs": True, "top_logprobs": 2}
    )
    prompt, greq = serving.prepare_chat(req)
    choice = asyncio.run(serving.chat(req, prompt, greq))["choices"][0]
    entries = choice["logprobs"]["content"]
    assert [len(e["top_logprobs"]) for e in entries] == [0, 0, 2, 2]
    assert [e["logprob"] for e in entries] == [-0.25] * 4  # the sampler's, kept for every token
    note = choice["top_logprobs_note"]
    assert "empty for 2 token(s) (indices 0..1)" in note and "weight version(s) 0" in note and "version(s) 1" in note


def test_streamed_chat_notes_each_chunk_whose_tokens_are_older():
    serving = _serving()
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


def test_completion_tokens_of_an_older_version_get_empty_top_logprobs():
    serving = _serving()
    req = CompletionRequest.model_validate({"model": "tiny-m3", "prompt": [5, 6, 7], "max_tokens": 4, "logprobs": 2})
    reqs = serving.prepare_completion(req)
    choice = asyncio.run(serving.completion(req, reqs))["choices"][0]
    assert [len(row) for row in choice["logprobs"]["top_logprobs"]] == [0, 0, 2, 2]
    assert "indices 0..1" in choice["top_logprobs_note"]

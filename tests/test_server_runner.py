"""The server's hand-over from engine to HTTP handlers: a handler that fell behind gets each sample's
queued deltas as one (one SSE event), order and finals kept; every output of a step reaches the
HTTP loop in one hand-over."""

import asyncio

from server_util import native_backend, served_model, tiny_model, tiny_tokenizer  # tests/ on sys.path

from m3_rollout.engine.interface import GenerationRequest, SampleOutput, SamplingParams, StreamDelta
from m3_rollout.server import runner as runner_module
from m3_rollout.server.runner import EngineRunner, coalesce


def _delta(sample: int, ids: list[int], version: int = 0) -> StreamDelta:
    return StreamDelta("r", sample, ids, [-0.5 * t for t in ids], [version] * len(ids))


def test_coalesce_merges_each_samples_deltas_up_to_its_final_record():
    final0 = SampleOutput("r", 0, [1], [3, 4, 5], [-1.5, -2.0, -2.5], "length", 1)
    items = [_delta(0, [3]), _delta(1, [7]), _delta(0, [4], 1), final0, _delta(0, [5]), _delta(1, [8, 9])]
    out = coalesce(items)
    assert [type(o).__name__ for o in out] == ["StreamDelta", "StreamDelta", "SampleOutput", "StreamDelta"]
    assert (out[0].sample_index, out[0].token_ids, out[0].weight_versions) == (0, [3, 4], [0, 1])
    assert out[0].logprobs == [-1.5, -2.0]
    assert (out[1].sample_index, out[1].token_ids) == (1, [7, 8, 9]) and out[2] is final0
    assert (out[3].sample_index, out[3].token_ids) == (0, [5])  # after the final: not merged into it
    assert coalesce([]) == []


def test_one_hand_over_per_engine_step_and_streams_equal_the_engine(monkeypatch):
    tok = tiny_tokenizer()
    served = served_model(tok, len(tok), 128)
    backend = native_backend(tiny_model(len(tok), max_len=128), served)
    reqs = [GenerationRequest(f"q{i}", [5 + i, 6, 7], SamplingParams(max_new_tokens=6, seed=i)) for i in range(4)]
    expected = {o.request_id: o.output_ids for o in backend.generate(reqs)}
    hand_overs = []
    deliver = runner_module._deliver
    monkeypatch.setattr(runner_module, "_deliver", lambda batch: (hand_overs.append(len(batch)), deliver(batch)))
    runner = EngineRunner(backend)
    steps0 = backend.engine.stats.steps

    async def one(req):
        ids, final = [], None
        async for item in runner.stream(req):
            if isinstance(item, StreamDelta):
                ids += item.token_ids
            else:
                final = item
        return req.request_id, ids, final

    async def main():
        return await asyncio.gather(*(one(r) for r in reqs))

    try:
        got = asyncio.run(main())
    finally:
        runner.shutdown()
    for rid, ids, final in got:
        assert ids == final.output_ids == expected[rid] and final.request_id == rid
    assert len(hand_overs) <= backend.engine.stats.steps - steps0  # at most one per step, not one per token
    assert sum(hand_overs) >= sum(map(len, expected.values()))  # every token went through them

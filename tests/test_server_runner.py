"""The server's hand-over from engine to HTTP handlers: a handler that fell behind gets each sample's
queued deltas as one (one SSE event), order and finals kept; every output of a step reaches the
HTTP loop in one hand-over."""

import asyncio

import torch
from server_util import free_port, native_backend, served_model, tiny_model, tiny_tokenizer  # tests/ on sys.path

from m3_rollout.engine.interface import GenerationRequest, SampleOutput, SamplingParams, StreamDelta
from m3_rollout.model.loading import iter_released_tensors
from m3_rollout.server import runner as runner_module
from m3_rollout.server.runner import EngineRunner, coalesce
from m3_rollout.weight_sync import BroadcastChannel, WeightSender, WeightSyncGroup, WeightUpdateError


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


async def _collect(items) -> list:
    return [item async for item in items]


def test_a_failed_non_atomic_update_ends_running_requests_with_an_error_not_a_hang():
    """Breaker finding: a rejected non-atomic update (atomic=false) that left the weights invalid
    took the running samples out of the engine (``InFlightPolicy.end`` hands them back) and the
    runner dropped them: their handlers waited forever and the driver spun. They now end with an
    error record naming the invalid weights; an accepted update repairs the rank."""
    tok = tiny_tokenizer()
    served = served_model(tok, len(tok), 256)
    trainer = tiny_model(len(tok), seed=1, max_len=256)
    backend = native_backend(tiny_model(len(tok), max_len=256), served)
    runner = EngineRunner(backend)
    port = free_port()
    senders = []

    def join():  # the trainer: rank 0 of the weight-sync group
        group = WeightSyncGroup("127.0.0.1", port, 0, 2, "gloo", 60.0)
        senders.append(
            WeightSender(lambda: iter_released_tensors(trainer), BroadcastChannel(group), bucket_size_mb=0.05)
        )
        senders[0].handshake()

    def nan_with_valid_checksum(k, buf):  # a NaN the sender's own checks do not see (buf: data + checksum)
        if k == 3:
            buf[:8].view(torch.float32).fill_(float("nan"))
            buf[-8:].view(torch.int64).copy_(buf[:-8].view(torch.int64).sum().reshape(1))

    def send(version: int, fault=None) -> str:
        senders[0].fault = fault
        try:
            senders[0].update(version, include_frozen=True)
            return ""
        except WeightUpdateError as exc:
            return str(exc)

    async def main():
        await asyncio.gather(
            runner.init_weight_sync("127.0.0.1", port, 2, 1, "gloo", 60.0, 0.05, False), asyncio.to_thread(join)
        )
        req = GenerationRequest("r", [5, 6, 7, 8], SamplingParams(n=2, max_new_tokens=200, seed=1))
        await runner.pause()  # the request is frozen in the engine: it cannot finish before the update
        collecting = asyncio.ensure_future(_collect(runner.stream(req)))
        while await runner.call(backend.engine.num_unfinished) != 2:  # acknowledged: both samples in the engine
            await asyncio.sleep(0)
        record, sent = await asyncio.gather(
            runner.update_weights(True), asyncio.to_thread(send, 1, nan_with_valid_checksum)
        )
        assert not record.ok and record.version == 0 and "non-finite values" in sent
        # the server's one engine is the group's only rollout rank: its errors name no rank
        assert record.errors[-1] == "update 1 failed after weights were written: engine invalid"
        assert not any("rank" in e for e in record.errors), record.errors

        finals = [o for o in await asyncio.wait_for(collecting, 120) if isinstance(o, SampleOutput)]  # hung before
        await runner.resume()
        repaired, _ = await asyncio.gather(runner.update_weights(False), asyncio.to_thread(send, 1))
        after = [o async for o in runner.stream(GenerationRequest("s", [5, 6], SamplingParams(max_new_tokens=4)))]
        return finals, repaired, after

    try:
        finals, repaired, after = asyncio.run(main())
    finally:
        runner.shutdown()
    assert sorted(o.sample_index for o in finals) == [0, 1]
    assert all(o.finish_reason == "error" and "weights invalid after a failed weight update" in o.error for o in finals)
    assert repaired.ok and repaired.version == 1
    assert after[-1].finish_reason == "length" and after[-1].token_weight_versions == [1] * 4

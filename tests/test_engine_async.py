"""Async scheduling (EngineConfig.async_scheduling) == synchronous stepping, on a tiny fp32 M3.

With async scheduling, step N+1 is launched before step N's sampled ids reach the host (its
decode inputs are gathered on the device) and step N's outputs are processed one ``step()`` call
later. Every test runs the same requests through a synchronous and an asynchronous engine and
compares the results (keyed sampler: same seeds -> same tokens; logprobs within 1e-5 because
batch shapes differ between the two runs).
"""

import dataclasses

import pytest
import torch
from test_engine_core import _model  # tests/ is on sys.path under pytest

from m3_rollout.engine.config import EngineConfig
from m3_rollout.engine.engine import LLMEngine
from m3_rollout.engine.interface import GenerationRequest, SampleOutput, SamplingParams, StreamDelta
from m3_rollout.engine.native_backend import NativeBackend

V = 96
EOS = 3
STOPS = (7, 11, 19, 23, 42)  # frequent enough that some samples stop early


MODEL = _model()  # the engine-core tests' random tiny M3 (same seed, same weights)


def _prompt(n, seed):
    return torch.randint(4, V, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _detok(ids):
    return " ".join(map(str, ids)) + " "


def _grpo_requests():
    """GRPO-like groups with mixed sampling settings, stop tokens, a stop string and lengths."""
    reqs = []
    for i in range(6):
        p = SamplingParams(
            n=4,
            seed=100 + i,
            max_new_tokens=8 + 6 * i,
            temperature=(1.0, 0.7, 1.3)[i % 3],
            top_k=(-1, 5, -1)[i % 3],
            top_p=(1.0, 1.0, 0.9)[i % 3],
            logprobs_mode=("processed", "raw")[i % 2],
            stop_token_ids=STOPS,
            stop_strings=("5 6 ",) if i == 4 else (),
        )
        reqs.append(GenerationRequest(f"g{i}", _prompt(5 + 7 * i, i), p, sample_index=10 * i))
    return reqs


def _engine(async_mode, **kw):
    kw.setdefault("max_model_len", 96)
    kw.setdefault("max_num_seqs", 32)
    return LLMEngine(MODEL, EngineConfig(eos_token_ids=(EOS,), async_scheduling=async_mode, **kw), detokenize=_detok)


def _drive(eng, reqs, on_step=None):
    for r in reqs:
        eng.add_request(r)
    outs, calls = {}, 0
    while eng.has_unfinished():
        for o in eng.step():
            if isinstance(o, SampleOutput):
                assert (o.request_id, o.sample_index) not in outs
                outs[(o.request_id, o.sample_index)] = o
        calls += 1
        if on_step is not None:
            on_step(eng, calls)
        assert calls < 2000
    eng.block_manager.check()
    assert eng.metrics()["kv_pages_in_use"] == 0 and not eng.scheduler.running and not eng.scheduler.waiting
    return outs


def _assert_same(sync, asyn, keys=None):
    assert set(sync) == set(asyn)
    for k in keys or sync:
        x, y = sync[k], asyn[k]
        assert x.output_ids == y.output_ids, k
        assert x.finish_reason == y.finish_reason, k
        # Group leaders (sample_index % 10 == 0 here) run the same steps in both modes; forked
        # samples join one step later with async scheduling, so their version labels (the
        # version that really ran each token) may switch one token earlier.
        if k[1] % 10 == 0:
            assert x.token_weight_versions == y.token_weight_versions, k
        assert y.token_weight_versions == sorted(y.token_weight_versions), k
        if x.routed_experts is not None:  # routing record (int16 [tokens, moe layers, top_k])
            assert torch.equal(torch.as_tensor(x.routed_experts), torch.as_tensor(y.routed_experts)), k
        assert len(x.logprobs) == len(y.logprobs) == len(x.output_ids)
        if x.logprobs:
            assert max(abs(p - q) for p, q in zip(x.logprobs, y.logprobs)) < 1e-5, k


def test_async_equals_sync_on_grpo_batch_with_stops_and_lengths():
    sync_eng, async_eng = _engine(False, record_routing=True), _engine(True, record_routing=True)
    sync, asyn = _drive(sync_eng, _grpo_requests()), _drive(async_eng, _grpo_requests())
    _assert_same(sync, asyn)
    reasons = [o.finish_reason for o in sync.values()]
    assert "stop" in reasons and "length" in reasons
    assert any(o.output_ids and o.output_ids[-1] in STOPS for o in sync.values())
    assert any("5 6 " in _detok(o.output_ids) for o in sync.values())  # the stop string fired
    # Async really ran ahead: decode inputs came from the device and stopped samples had their
    # one extra token dropped; the synchronous engine did neither.
    assert async_eng.stats.device_input_rows > 0 and async_eng.stats.dropped_tokens > 0
    assert sync_eng.stats.device_input_rows == 0 and sync_eng.stats.dropped_tokens == 0
    assert async_eng.stats.generated_tokens == sync_eng.stats.generated_tokens
    assert all(o.routed_experts is not None for o in asyn.values())


def test_async_preemption_under_a_tight_pool_equals_ample_sync():
    reqs = [
        dataclasses.replace(
            r, params=dataclasses.replace(r.params, stop_token_ids=(), stop_strings=(), max_new_tokens=30)
        )
        for r in _grpo_requests()[:4]
    ]
    sync = _drive(_engine(False), reqs)
    tight = _engine(True, num_pages=30, max_num_batched_tokens=24)
    asyn = _drive(tight, reqs)
    assert tight.metrics()["num_preemptions"] > 0
    _assert_same(sync, asyn)


def test_abort_while_a_step_is_in_flight():
    reqs = _grpo_requests()
    sync = _drive(_engine(False), reqs)
    state = {}

    def abort_g2(eng, calls):
        if calls == 6:
            assert eng.step_in_flight  # a launched step holds g2's next token
            state["tokens"] = {s.sample_index: len(s.token_ids) - s.prompt_len for s in eng.unfinished_samples("g2")}
            eng.abort("g2")

    asyn = _drive(_engine(True), reqs, abort_g2)
    others = [k for k in sync if k[0] != "g2"]
    _assert_same({k: sync[k] for k in others}, {k: asyn[k] for k in others})
    aborted = [asyn[k] for k in asyn if k[0] == "g2"]
    assert len(aborted) == 4 and {o.finish_reason for o in aborted} == {"abort"}
    for o in aborted:  # exactly the tokens that had landed, none from the step in flight
        full = sync[("g2", o.sample_index)]
        assert len(o.output_ids) == state["tokens"].get(o.sample_index, 0)
        assert o.output_ids == full.output_ids[: len(o.output_ids)]
        assert all(abs(p - q) < 1e-5 for p, q in zip(o.logprobs, full.logprobs))


def test_pause_drains_weight_versions_and_abort_all():
    def bump(eng, calls):
        if calls == 5:
            eng.set_weight_version(7)  # the step in flight keeps the version it was launched with

    sync, asyn = _drive(_engine(False), _grpo_requests(), bump), _drive(_engine(True), _grpo_requests(), bump)
    _assert_same(sync, asyn)
    assert any(len(set(o.token_weight_versions)) == 2 for o in sync.values())

    eng = _engine(True)
    for r in _grpo_requests():
        eng.add_request(r)
    for _ in range(4):
        eng.step()
    assert eng.step_in_flight
    eng.pause()  # lands the step in flight; nothing runs until resume
    assert not eng.step_in_flight and all(s.num_pending == 0 for s in eng.scheduler.running)
    steps = eng.stats.steps
    eng.step()
    assert eng.stats.steps == steps and eng.step() == []
    eng.step(force_forward=True)  # EP lockstep: exactly one (empty) forward while paused
    assert eng.stats.steps == steps + 1 and not eng.step_in_flight
    eng.resume()
    eng.step()
    assert eng.step_in_flight
    requeue = eng.abort_all()
    assert not eng.step_in_flight and not eng.has_unfinished() and eng.metrics()["kv_pages_in_use"] == 0
    assert sum(r.params.n for r in requeue) == len(requeue) and len(requeue) > 0


def test_force_forward_runs_one_forward_per_call():
    eng = _engine(True)
    eng.add_request(GenerationRequest("f", _prompt(9, 3), SamplingParams(n=2, seed=4, max_new_tokens=5)))
    for _i in range(12):  # work, then idle: every call runs exactly one forward (EP lockstep)
        steps = eng.stats.steps
        eng.step(force_forward=True)
        assert eng.stats.steps == steps + 1
    assert not eng.has_unfinished()


@pytest.mark.parametrize("stream", [False, True])
def test_native_backend_async_streams_equal_sync(stream):
    import asyncio

    reqs = _grpo_requests()[:3]

    async def collect(backend):
        out = []
        if stream:
            for r in reqs:
                async for o in backend.stream(r):
                    out.append(o)
        else:
            async for o in backend.generate_async(reqs):
                out.append(o)
        return out

    kw = dict(max_model_len=96, max_num_seqs=32, detokenize=_detok)
    got = {}
    for mode in (False, True):
        outs = asyncio.run(collect(NativeBackend(MODEL, [EOS], async_scheduling=mode, **kw)))
        finals = {(o.request_id, o.sample_index): o for o in outs if isinstance(o, SampleOutput)}
        if stream:
            for k, f in finals.items():
                deltas = [
                    t
                    for d in outs
                    if isinstance(d, StreamDelta) and (d.request_id, d.sample_index) == k
                    for t in d.token_ids
                ]
                assert deltas == f.output_ids
        got[mode] = finals
    _assert_same(got[False], got[True])


@pytest.mark.parametrize("async_mode", [False, True])
def test_staged_decode_path_equals_plain_path(async_mode):
    """The CUDA-graph decode path (pinned staging, prologue gathering device-side inputs, sampler
    body writing ids + logprobs + last_tokens) run eagerly on the CPU, with padded batch sizes."""
    reqs = _grpo_requests()
    plain = _drive(_engine(False), reqs)
    eng = _engine(async_mode, enable_cuda_graphs="eager", cuda_graph_batch_sizes=(3, 8, 32))
    staged = _drive(eng, reqs)
    _assert_same(plain, staged)
    assert (eng.stats.device_input_rows > 0) == async_mode
    assert eng.stats.graph_steps > eng.stats.steps // 2


def test_staged_decode_path_with_the_fused_triton_sampler():
    """The one-kernel keyed sampler (Triton interpreter on the CPU) picks the same tokens."""
    reqs = [
        dataclasses.replace(r, params=dataclasses.replace(r.params, top_k=-1, top_p=1.0)) for r in _grpo_requests()[:3]
    ]
    plain = _drive(_engine(False), reqs)
    eng = _engine(True, enable_cuda_graphs="eager", cuda_graph_batch_sizes=(4, 16), fused_sampler=True)
    _assert_same(plain, _drive(eng, reqs))
    assert eng.stats.graph_steps > eng.stats.steps // 2


def test_multi_turn_prefix_reuse_matches_sync():
    """Turn 2 (turn 1's prompt + output + new tokens) hits the same cached pages in both modes."""
    got = {}
    for mode in (False, True):
        eng = _engine(mode)
        p = SamplingParams(n=2, seed=5, max_new_tokens=22)
        first = _drive(eng, [GenerationRequest("t1", _prompt(17, 8), p)])
        hits = eng.metrics()["prefix_cache_hit_tokens"]
        o = first[("t1", 1)]
        turn2 = GenerationRequest("t2", o.prompt_ids + o.output_ids + [5, 6, 7], dataclasses.replace(p, n=1))
        second = _drive(eng, [turn2])
        got[mode] = (first, second, eng.metrics()["prefix_cache_hit_tokens"] - hits)
    assert got[True][2] == got[False][2] >= 32  # turn 1's full pages reused
    _assert_same(got[False][0], got[True][0])
    _assert_same(got[False][1], got[True][1])


def test_generate_after_generate_async_and_after_a_caller_left_with_its_last_samples_out():
    """generate() right after an async caller is done is not refused (the driver task that has not
    yet seen its last caller leave steps nothing more); nor after a caller that closed its iterator
    with its remaining samples already out of the engine: nothing is left to abort, so the driver
    waits for nothing (it used to keep an entry for them, refusing generate() and stepping a
    paused engine in a busy loop until every other request was done)."""
    import asyncio

    no_eos = SamplingParams(n=2, seed=3, max_new_tokens=3, logit_bias=((EOS, -100.0),))
    b = NativeBackend(
        MODEL, [EOS], max_model_len=96, max_num_seqs=32, async_scheduling=False, enable_prefix_caching=False
    )
    want = b.generate([GenerationRequest("a", _prompt(9, 1), no_eos)])

    async def main():
        done = [o async for o in b.generate_async([GenerationRequest("a", _prompt(9, 1), no_eos)])]
        after_done = b.generate([GenerationRequest("b", _prompt(9, 1), no_eos)])
        outs = b.generate_async([GenerationRequest("c", _prompt(9, 1), no_eos)])
        first = await outs.__anext__()  # both samples finished at this step: the second is out too
        await outs.aclose()
        assert not b.step_driver.active
        return done, after_done, first, b.generate([GenerationRequest("d", _prompt(9, 1), no_eos)])

    done, after_done, first, after_close = asyncio.run(main())
    key = lambda outs: sorted((o.sample_index, o.output_ids, o.logprobs) for o in outs)  # noqa: E731
    assert key(done) == key(after_done) == key(after_close) == key(want)
    assert (first.sample_index, first.output_ids) in [(o.sample_index, o.output_ids) for o in want]
    assert b.engine.metrics()["kv_pages_in_use"] == 0 and not b.engine.has_unfinished()

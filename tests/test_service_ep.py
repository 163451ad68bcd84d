"""RolloutService over torch.multiprocessing workers: EP=2 generation equals EP=1, failure handling.

A seeded tiny M3 is saved once; the EP=1 reference is the in-process engine (NativeBackend) in
fp32, the EP=2 service loads the same checkpoint as two expert shards in two processes (gloo).
With randomness keyed by (seed, sample index, position), tokens must be identical.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch
from fake_ep import fake_broadcast, fake_ipc_service, fake_service  # tests/ on sys.path

from m3_rollout.config import WeightSyncConfig
from m3_rollout.engine.interface import GenerationRequest, SampleOutput, SamplingParams, StreamDelta
from m3_rollout.engine.native_backend import NativeBackend
from m3_rollout.model import iter_released_tensors, load_checkpoint
from m3_rollout.model.selection_record import canonical_rows
from m3_rollout.parallel import EPGroupSpec
from m3_rollout.service import RolloutFailure, RolloutService, WorkerSpec
from m3_rollout.service.service import LOST

EOS = 3
MAX_LEN = 96


@pytest.fixture(scope="module")
def model_dir(tiny_ep_model_dir):
    return tiny_ep_model_dir


def _requests(tag: str = "") -> list[GenerationRequest]:
    gen = torch.Generator().manual_seed(7)
    reqs = []
    for g in range(5):  # GRPO groups of 3 samples, prompts of 5..40 tokens (some span pages)
        prompt = torch.randint(4, 256, (5 + 9 * g,), generator=gen).tolist()
        params = SamplingParams(n=3, temperature=1.0, max_new_tokens=12 + g, seed=100 + g, stop_token_ids=(EOS,))
        reqs.append(GenerationRequest(f"{tag}g{g}", prompt, params))
    reqs.append(GenerationRequest(f"{tag}bad", [1, 999], SamplingParams(n=2)))  # token outside the vocabulary
    return reqs


def _engine_kwargs() -> dict:
    return {
        "max_model_len": MAX_LEN,
        "max_num_seqs": 16,
        "eos_token_ids": (EOS,),
        "num_pages": 64,
        "record_routing": True,
        "record_block_selection": True,
    }


def _service(model_dir, world: int, **kwargs) -> RolloutService:
    spec = WorkerSpec(
        model_dir=str(model_dir),
        group=EPGroupSpec(world, "127.0.0.1", 0, "gloo", timeout_s=20),
        dtype="float32",
        engine=_engine_kwargs(),
        **kwargs.pop("spec", {}),
    )
    return RolloutService(
        spec,
        launcher=kwargs.pop("launcher", "mp"),
        steps_per_call=kwargs.pop("steps_per_call", 8),
        start_timeout_s=120,
        weight_sync=kwargs.pop("weight_sync", WeightSyncConfig(timeout_s=20)),
        **kwargs,
    )


def _reference(model_dir, reqs):
    backend = NativeBackend(
        load_checkpoint(model_dir, dtype=torch.float32),
        (EOS,),
        max_model_len=MAX_LEN,
        max_num_seqs=16,
        num_pages=64,
        record_routing=True,
        record_block_selection=True,
    )
    return backend.generate(reqs)


def _key(outs):
    return [(o.request_id, o.sample_index, o.output_ids, o.finish_reason) for o in outs]


def test_ep2_tokens_equal_ep1_and_weights_update(model_dir):
    reqs = _requests()
    ref = _reference(model_dir, reqs)
    svc = _service(model_dir, 2)
    try:
        assert [i["expert_range"] for i in svc.rank_info] == [(0, 4), (4, 8)]
        assert all(i["bytes_read"] < i["bytes_in_files"] for i in svc.rank_info)
        outs = svc.generate(reqs)
        assert _key(outs) == _key(ref)
        for a, b in zip(outs, ref):
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
            if a.finish_reason != "error":  # routing records agree too (global expert ids on every rank)
                assert a.routed_experts.shape == (len(a.prompt_ids) + len(a.output_ids), 3, 2)
                assert (a.routed_experts == b.routed_experts).all()
                # the block-selection record crossed the process boundary coded (sets: canonical order)
                end = len(a.prompt_ids) + len(a.output_ids) - 1
                assert a.block_selection.end == end and a.block_selection.dims == (3, 2, 4)
                want = canonical_rows(b.block_selection.dense(end))
                np.testing.assert_array_equal(a.block_selection.dense(end), want)
        for g in range(5):  # a group's samples still share one prompt segment after the transport
            segs = [o.block_selection.segments[0] for o in outs if o.request_id == f"g{g}"]
            assert len(segs) == 3 and all(s is segs[0] for s in segs)
        assert [o.finish_reason for o in outs if o.request_id == "bad"] == ["error", "error"]
        m = svc.metrics()
        assert m["restarts"] == 0 and len(m["tokens_per_expert"][0]) == 8
        # a run with work placed on one rank only: the idle rank steps empty forwards, nothing hangs
        one = svc.generate(reqs[:1])
        assert _key(one) == _key(ref[:3])
        # weights: a changed lm_head reaches both ranks (and the reference agrees)
        model = load_checkpoint(model_dir, dtype=torch.float32)
        with torch.no_grad():
            model.lm_head.weight.mul_(-1.0)
        svc.update_weights(5, iter_released_tensors(model))
        ref2 = NativeBackend(model, (EOS,), max_model_len=MAX_LEN, max_num_seqs=16, num_pages=64).generate(reqs[:2])
        outs2 = svc.generate(reqs[:2])
        assert _key(outs2) == _key(ref2)
        assert svc.weight_version == 5 and all(o.weight_version == 5 for o in outs2)
        with pytest.raises(ValueError, match="missing from update: language_model.lm_head.weight"):
            svc.update_weights(6, [(n, t) for n, t in iter_released_tensors(model) if "lm_head" not in n])
        with pytest.raises(ValueError, match="update version 5 refused: this rank holds version 5"):
            svc.update_weights(5, iter_released_tensors(model))
        assert svc.weight_version == 5
    finally:
        svc.shutdown()


def test_worker_killed_mid_generation_is_restarted_and_requests_complete(model_dir):
    reqs = _requests("k")
    ref = _reference(model_dir, reqs)
    # rank 1 SIGKILLs itself after 3 lockstep steps (first incarnation only)
    svc = _service(model_dir, 2, spec={"fault_after_steps": 3, "fault_rank": 1}, steps_per_call=2)
    try:
        first_pids = svc.worker_pids()
        outs = svc.generate(reqs)
        assert _key(outs) == _key(ref)  # resubmitted samples repeat their tokens exactly
        assert svc.restarts == 1 and len(svc.failures) == 1
        f = svc.failures[0]
        assert 1 in f["ranks"] and f["lost_request_ids"]  # which requests were lost is reported
        assert set(f["lost_request_ids"]) <= {r.request_id for r in reqs}
        assert set(svc.worker_pids()).isdisjoint(first_pids)  # every rank was restarted
    finally:
        svc.shutdown()


def _ignores_sigint(pid: int) -> bool:
    """Whether process ``pid`` ignores SIGINT (the SigIgn mask of /proc/<pid>/status)."""
    with open(f"/proc/{pid}/status") as f:
        mask = next(int(line.split()[1], 16) for line in f if line.startswith("SigIgn:"))
    return bool(mask >> (signal.SIGINT - 1) & 1)


def test_worker_processes_ignore_ctrl_c_which_the_driver_handles(model_dir, capfd):
    # A Ctrl-C in the terminal reaches every process of the foreground group: each worker printed
    # a KeyboardInterrupt traceback (and the forkserver one while it imported torch) under the
    # job's one line. The driver handles it and ends the workers; they ignore SIGINT and serve on.
    reqs = _requests("i")
    svc = _service(model_dir, 2)
    try:
        pids = svc.worker_pids()
        assert all(_ignores_sigint(pid) for pid in pids)
        for pid in pids:
            os.kill(pid, signal.SIGINT)
        assert _key(svc.generate(reqs)) == _key(_reference(model_dir, reqs))
        assert svc.worker_pids() == pids and svc.restarts == 0
    finally:
        svc.shutdown()
    assert "KeyboardInterrupt" not in capfd.readouterr().err


def test_gives_up_after_max_restarts_with_lost_requests(model_dir):
    # max_restarts=0: the first failure is final; the caller gets the lost ids to resubmit
    svc = _service(model_dir, 2, spec={"fault_after_steps": 1, "fault_rank": 0}, max_restarts=0)
    try:
        reqs = _requests("x")[:2]
        with pytest.raises(RolloutFailure) as info:
            svc.generate(reqs)
        assert info.value.lost_request_ids == ["xg0", "xg1"]
        assert "rank 0: worker process died (exit code -9)" in str(info.value)
        events = svc.drain_events()
        assert [(e["recovered"], e["lost_request_ids"]) for e in events] == [(False, ["xg0", "xg1"])]
        assert svc.restarts == 0 and svc.metrics()["failures"] == 1
        # the caller resubmits: a fresh group (second incarnation: no fault) completes them
        assert _key(svc.generate(reqs)) == _key(_reference(model_dir, reqs))
    finally:
        svc.shutdown()


def test_bad_checkpoint_reports_the_workers_traceback(tmp_path):
    # A rank that cannot load its checkpoint sends its traceback, then exits with code 0: the
    # failure used to say only "worker process died (exit code 0)".
    spec = WorkerSpec(
        model_dir=str(tmp_path / "missing"),
        group=EPGroupSpec(2, "127.0.0.1", 0, "gloo", timeout_s=20),
        dtype="float32",
        engine=_engine_kwargs(),
    )
    with pytest.raises(RolloutFailure) as info:
        RolloutService(spec, launcher="mp", max_restarts=0, start_timeout_s=120, weight_sync=WeightSyncConfig())
    text = str(info.value)
    assert "during 'start'" in text and "missing" in text and "Error" in text, text
    assert "exit code 0)" not in text.split(": ", 2)[-1].split(";")[0]  # the cause, not the exit code


def test_failures_during_restart_count_and_end_in_rolloutfailure(capsys):
    svc, log = fake_service(run_failures=1, start_failures=5, max_restarts=2)
    reqs = [GenerationRequest("a", [1, 2], SamplingParams(n=2)), GenerationRequest("b", [3], SamplingParams())]
    with pytest.raises(RolloutFailure) as info:
        svc.generate(reqs)
    assert info.value.lost_request_ids == ["a", "b"]
    assert "OSError: disk gone" in str(info.value) and "cluster.max_restarts" in str(info.value)
    events = svc.drain_events()
    assert [e["recovered"] for e in events] == [True, True, False]  # run, restart 1, restart 2
    assert log["starts"] == 3 and svc.metrics()["failures"] == 3 and svc.metrics()["recovered_failures"] == 2
    svc.shutdown()  # never raises over the original error (it used to: IndexError)
    svc.shutdown()
    assert "[rollout] EP worker group failed during 'run'" in capsys.readouterr().out


def test_recovered_failure_is_an_event_and_the_call_completes():
    svc, log = fake_service(run_failures=1, start_failures=1, max_restarts=2)
    outs = svc.generate([GenerationRequest("a", [1, 2], SamplingParams(n=2))])
    assert [(o.request_id, o.sample_index) for o in outs] == [("a", 0), ("a", 1)]
    events = svc.drain_events()
    assert [(e["recovered"], e["lost_request_ids"]) for e in events] == [(True, ["a"]), (True, ["a"])]
    assert svc.drain_events() == [] and svc.metrics()["recovered_failures"] == 2 and svc.restarts == 2
    assert log["writes"] == [1, 2] and svc.weight_writes == 2  # two groups started: a count each, never repeated
    svc.shutdown()


def test_mis_shaped_and_non_finite_updates_leave_every_rank_on_one_version(model_dir):
    # experts.5.* live on rank 1 only. A wrong shape there is refused by the handshake of every
    # rank's receiver; a NaN there (non-atomic ranks) must not leave rank 0 on the new version
    # beside rank 1 on the old one: no rank moves, and the service repairs the ranks that wrote
    # bytes by re-sending the last good weights.
    reqs = _requests("s")[:2]
    svc = _service(model_dir, 2, weight_sync=WeightSyncConfig(timeout_s=20, atomic=False))
    try:
        model = load_checkpoint(model_dir, dtype=torch.float32)
        bad_name = next(n for n, _ in iter_released_tensors(model) if ".experts.5.w1" in n)
        tensors = [(n, t[:-1] if n == bad_name else t) for n, t in iter_released_tensors(model)]
        with pytest.raises(ValueError, match=f"rank 2: shape of {bad_name.replace('.', '[.]')}"):
            svc.update_weights(3, tensors)
        assert svc.weight_version == 0
        with torch.no_grad():
            model.lm_head.weight.mul_(-1.0)
        svc.update_weights(3, iter_released_tensors(model))
        ref = NativeBackend(model, (EOS,), max_model_len=MAX_LEN, max_num_seqs=16, num_pages=64).generate(reqs)
        worse = [(n, t.clone()) for n, t in iter_released_tensors(model)]
        for n, t in worse:
            if n == bad_name:
                t[0, 0] = float("nan")
            elif n.endswith("lm_head.weight"):
                t.mul_(2.0)
        with pytest.raises(ValueError, match=f"rank 2: non-finite values in {bad_name.replace('.', '[.]')}"):
            svc.update_weights(4, worse)
        assert svc.weight_version == 3
        assert [r["valid"] for r in svc.last_weight_sync["ranks"]] == [True, True]  # repaired (replace)
        assert [r["version"] for r in svc.last_weight_sync["ranks"]] == [3, 3]
        outs = svc.generate(reqs)
        assert _key(outs) == _key(ref)
        assert all(o.token_weight_versions == [3] * len(o.output_ids) for o in outs if o.finish_reason != "error")
    finally:
        svc.shutdown()


@pytest.mark.parametrize("in_flight", ["drain", "abort"])
def test_step_api_samples_a_weight_update_finished_come_out_of_the_next_step(model_dir, in_flight):
    # Requests of the step API (the server's add_request / step) still running in the workers when
    # update_weights comes: with drain the workers finish them inside the update and hand the
    # samples back with their verdict. They were dropped there, so the requests never finished;
    # now the next step() returns them. (abort re-queues them in the engine: they finish later.)
    reqs = _requests()[:2]  # two GRPO groups of 3 samples, 12 and 13 new tokens
    ref = {(o.request_id, o.sample_index): o for o in _reference(model_dir, reqs)}
    svc = _service(model_dir, 2, weight_sync=WeightSyncConfig(timeout_s=20, in_flight=in_flight))
    try:
        for r in reqs:
            svc.add_request(r)
        first = svc.step()  # one lockstep step (requests went out): the samples start, none finishes
        assert not [o for o in first if isinstance(o, SampleOutput)]
        svc.update_weights(1, iter_released_tensors(load_checkpoint(model_dir, dtype=torch.float32)))
        outs = []
        for _ in range(40):
            if not svc.has_unfinished():
                break
            outs += [o for o in svc.step() if isinstance(o, SampleOutput)]
        assert not svc.has_unfinished()
        assert sorted((o.request_id, o.sample_index) for o in outs) == sorted(ref)
        for o in outs:  # the same bytes before and after the update; randomness keyed by position
            want = ref[(o.request_id, o.sample_index)]
            assert (o.output_ids, o.finish_reason) == (want.output_ids, want.finish_reason)
    finally:
        svc.shutdown()


_SLOW_PRELOAD = """
import os, sys, time
open(os.environ["M3_TEST_PRELOAD_MARK"], "w").close()  # the forkserver is inside its preload now
time.sleep(3)
"""

_FORKSERVER_SCRIPT = """
import os, sys, time
import torch.multiprocessing as mp
from multiprocessing import forkserver
from m3_rollout.service.launchers import start_forkserver
ctx = mp.get_context("forkserver")
ctx.set_forkserver_preload(["m3_test_slow_preload"])
start_forkserver(ctx)
mark = os.environ["M3_TEST_PRELOAD_MARK"]
while not os.path.exists(mark):
    time.sleep(0.01)
pid = forkserver._forkserver._forkserver_pid
with open(f"/proc/{pid}/status") as f:
    mask = next(int(line.split()[1], 16) for line in f if line.startswith("SigIgn:"))
print("IGNORED" if mask >> 1 & 1 else "DEFAULT", flush=True)  # SIGINT = 2: bit 1
os.kill(pid, 2)
time.sleep(0.5)
print("ALIVE" if os.waitpid(pid, os.WNOHANG)[0] == 0 else "DEAD", flush=True)
"""


def test_forkserver_ignores_ctrl_c_while_it_imports(tmp_path):
    # the forkserver ignores SIGINT itself only after its preload imports (torch: seconds); started
    # with SIGINT ignored, it ignores a Ctrl-C inside them too instead of printing a traceback
    (tmp_path / "m3_test_slow_preload.py").write_text(_SLOW_PRELOAD)
    env = dict(os.environ, M3_TEST_PRELOAD_MARK=str(tmp_path / "mark"))
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), *filter(None, [env.get("PYTHONPATH")])])
    proc = subprocess.run(
        [sys.executable, "-c", _FORKSERVER_SCRIPT], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["IGNORED", "ALIVE"], proc.stdout + proc.stderr
    assert "KeyboardInterrupt" not in proc.stderr


@pytest.mark.parametrize("gone", ["while it starts", "during a call"])
def test_a_worker_whose_driver_is_gone_ends_quietly(monkeypatch, gone):
    # A driver stopped (SIGTERM, Ctrl-C) while its worker loaded the model left the worker to find
    # the pipe closed at its reply: BrokenPipeError, and again from its report of that error, two
    # tracebacks under the driver's one line. Now a worker whose driver is gone just ends.
    import multiprocessing

    from m3_rollout.service import launchers

    driver, conn = multiprocessing.Pipe()

    class Worker:  # stands in for RolloutWorker: the driver goes away at the chosen point
        def __init__(self, spec, rank):
            if gone == "while it starts":
                driver.close()

        def info(self):
            driver.close()
            return {"rank": 0}

    monkeypatch.setattr(launchers, "RolloutWorker", Worker)
    if gone == "during a call":
        launchers.send_by_value(driver, ("info", ()))
    sigint = signal.getsignal(signal.SIGINT)
    try:
        launchers._process_main(None, 0, conn)  # raised BrokenPipeError
    finally:
        signal.signal(signal.SIGINT, sigint)  # the worker body ignores Ctrl-C
        conn.close()


def _no_eos(rid: str, max_new_tokens: int, seed: int, prompt_seed: int) -> GenerationRequest:
    """A request that runs exactly ``max_new_tokens`` (eos pushed out of reach by logit_bias)."""
    prompt = torch.randint(4, 256, (9,), generator=torch.Generator().manual_seed(prompt_seed)).tolist()
    params = SamplingParams(n=2, max_new_tokens=max_new_tokens, seed=seed, logit_bias=((EOS, -100.0),))
    return GenerationRequest(rid, prompt, params)


async def _until_done(svc: RolloutService) -> None:
    for _ in range(1000):  # the driver steps once per turn of the loop: a bound, not a timing
        if not svc.has_unfinished():
            return
        await asyncio.sleep(0)
    raise AssertionError("the EP service's step API never finished its requests")


def test_generate_async_yields_in_finish_order_and_equals_generate(model_dir):
    # Under EP, generate_async used to run generate() and then yield in request order, so a short
    # request's samples came after a long one's. Now it goes through the step API with the
    # in-process backend's driver: samples come as they finish, with generate()'s bytes.
    long, short = _no_eos("long", 64, 11, 1), _no_eos("short", 2, 12, 2)
    svc = _service(model_dir, 2)
    try:
        svc.reset_prefix_cache()
        want = {(o.request_id, o.sample_index): o for o in svc.generate([long, short, *_requests()])}
        svc.reset_prefix_cache()  # the same prefill chunks again: bitwise-equal logprobs

        async def stream_all():
            got = []  # (request id, sample index, whether the long request was still unfinished)
            async for out in svc.generate_async([long, short, *_requests()]):
                got.append(((out.request_id, out.sample_index), out, svc.has_unfinished()))
            return got

        got = asyncio.run(stream_all())
        order = [k for k, _, _ in got]
        assert sorted(order) == sorted(want)
        assert order.index(("short", 0)) < order.index(("long", 0))
        assert order.index(("short", 1)) < order.index(("long", 1))
        assert all(busy for k, _, busy in got if k[0] == "short")  # yielded while "long" still ran
        for k, out, _ in got:
            w = want[k]
            assert (out.output_ids, out.logprobs, out.finish_reason) == (w.output_ids, w.logprobs, w.finish_reason)
            assert out.token_weight_versions == w.token_weight_versions and out.error == w.error
            if w.finish_reason != "error":
                assert (out.routed_experts == w.routed_experts).all()
        assert [len(want[("long", j)].output_ids) for j in (0, 1)] == [64, 64]
    finally:
        svc.shutdown()


def test_closing_generate_async_aborts_the_samples_not_yet_out(model_dir):
    # Closing the iterator after the first sample aborts the rest: "long" never runs its 64 steps.
    long, short = _no_eos("long", 64, 11, 1), _no_eos("short", 2, 12, 2)
    svc = _service(model_dir, 2)
    try:
        want = svc.generate([short])
        aborted = []
        abort = svc.abort
        svc.abort = lambda rid: (aborted.append(rid), abort(rid))[1]  # what the driver sends

        async def first_then_close():
            outs = svc.generate_async([long, short])
            first = await outs.__anext__()
            await outs.aclose()
            await _until_done(svc)
            return first

        steps = svc.metrics()["lockstep_steps"]
        first = asyncio.run(first_then_close())
        del svc.abort
        assert first.request_id == "short" and first.output_ids == want[first.sample_index].output_ids
        assert "long" in {rid.split(":", 1)[1] for rid in aborted}
        assert not svc.has_unfinished() and svc.metrics()["lockstep_steps"] - steps < 64
        assert svc.engine_metrics()["kv_pages_in_use"] == 0
        assert _key(svc.generate([short])) == _key(want)  # not refused: nothing of the step API is left
    finally:
        svc.shutdown()


def test_generate_refused_while_generate_async_callers_are_active():
    svc, _log = fake_service(run_failures=0, start_failures=0)

    async def main():
        outs = svc.generate_async([GenerationRequest("a", [1, 2], SamplingParams(n=2))])
        first = await outs.__anext__()
        with pytest.raises(RuntimeError, match="generate_async callers are active"):
            svc.generate([GenerationRequest("b", [3], SamplingParams())])
        return [first] + [o async for o in outs]

    outs = asyncio.run(main())
    assert sorted((o.request_id, o.sample_index) for o in outs) == [("a", 0), ("a", 1)]
    svc.shutdown()


def test_generate_after_generate_async_and_after_a_caller_left_with_its_last_samples_out():
    # generate() right after an async caller is done was refused (the driver task had not yet seen
    # its last caller leave); a caller that closed its iterator with its remaining samples already
    # out of the step API left an entry for them, so generate() stayed refused and a pause made the
    # driver send a run call to the group at every turn of the loop while other requests ran.
    svc, log = fake_service(run_failures=0, start_failures=0)
    pair = SamplingParams(n=2, max_new_tokens=3, seed=1)  # both samples end at the third step

    async def main():
        done = [o async for o in svc.generate_async([GenerationRequest("a", [1, 2], pair)])]
        after_done = svc.generate([GenerationRequest("a", [1, 2], pair)])
        outs = svc.generate_async([GenerationRequest("c", [1, 2], pair)])
        first = await outs.__anext__()
        await outs.aclose()
        assert not svc.step_driver.active
        after_close = svc.generate([GenerationRequest("a", [1, 2], pair)])
        long = svc.generate_async([GenerationRequest("L", [1, 2], SamplingParams(max_new_tokens=50, seed=2))])
        step = asyncio.ensure_future(long.__anext__())
        outs = svc.generate_async([GenerationRequest("c", [1, 2], pair)])
        await outs.__anext__()
        await outs.aclose()
        svc.pause()
        runs = log["runs"]
        for _ in range(50):  # turns of the loop, not time: a paused group with nothing to abort runs nothing
            await asyncio.sleep(0)
        assert log["runs"] == runs
        svc.resume()
        await step
        await long.aclose()
        return done, after_done, first, after_close

    done, after_done, first, after_close = asyncio.run(main())
    assert _bits(done) == _bits(after_done) == _bits(after_close)
    assert first.request_id == "c" and first.output_ids == after_done[first.sample_index].output_ids
    svc.shutdown()


def _fake_requests() -> list[GenerationRequest]:
    """GRPO groups whose samples stop at different steps (token 3 stops them)."""
    return [
        GenerationRequest(f"r{i}", [1, 2 + i], SamplingParams(n=3, max_new_tokens=16, seed=seed, stop_token_ids=(3,)))
        for i, seed in enumerate((40, 46, 42, 43))  # sample lengths 6 4 16, 6 16 16, 6 1 3, 16 3 7
    ]


def _collect(svc: RolloutService, reqs) -> list[SampleOutput]:
    async def main():
        return [o async for o in svc.generate_async(reqs)]

    return asyncio.run(main())


def _bits(outs) -> dict:
    return {(o.request_id, o.sample_index): (o.output_ids, o.logprobs, o.finish_reason, o.error) for o in outs}


def test_generate_async_resubmits_what_a_group_failure_lost_and_gives_the_same_outputs():
    # A failed group restarts and the samples not yet out are resubmitted, as generate() does:
    # the whole request when none of its samples came back, else n=1 per missing sample with its
    # sample_index. The step API used to give them error records instead (the previous rule).
    reqs = _fake_requests()
    clean, _ = fake_service(run_failures=0, start_failures=0)
    want = _bits(_collect(clean, reqs))
    clean.shutdown()
    # run 1 places the requests (one step), runs 2.. take 4 steps each: run 3 fails mid-generation
    svc, log = fake_service(run_failures=0, start_failures=0, fail_runs={3})
    outs = _collect(svc, reqs)
    assert len(outs) == len(want) == 12 and _bits(outs) == want  # bitwise: tokens, logprobs, reasons
    assert all(o.finish_reason in ("stop", "length") for o in outs)
    assert [e["recovered"] for e in svc.drain_events()] == [True] and svc.restarts == 1
    # before run 3: 1 + 4 tokens per sample; the samples that stopped by then were out
    out_before = {k for k, (ids, _, _, _) in want.items() if len(ids) <= 5}
    expect = []
    for r in reqs:
        out = [j for j in range(3) if (r.request_id, j) in out_before]
        expect += [(r.request_id, 3, 0)] if not out else [(r.request_id, 1, j) for j in range(3) if j not in out]
    again = [(rid.split(":", 1)[1], n, j) for group, rid, n, j in log["added"] if group == 2]
    assert sorted(again) == sorted(expect)
    assert {n for _, n, _ in again} == {1, 3}  # whole requests and single samples were resubmitted
    assert not svc.has_unfinished()
    svc.shutdown()


def test_a_streamed_request_a_group_failure_lost_gets_error_records_beside_a_resubmitted_one():
    # Tokens of a streamed request have left the service: it ends with error records naming the
    # failure; a request added without stream in the same group is resubmitted and completes.
    reqs = _fake_requests()[:2]
    clean, _ = fake_service(run_failures=0, start_failures=0)
    want = _bits(clean.generate(reqs))
    clean.shutdown()
    svc, log = fake_service(run_failures=0, start_failures=0, fail_runs={2})
    svc.add_request(reqs[0], stream=True)
    svc.add_request(reqs[1])
    outs = []
    for _ in range(20):
        if not svc.has_unfinished():
            break
        outs += svc.step()
    assert not svc.has_unfinished()
    done = [o for o in outs if isinstance(o, SampleOutput)]
    streamed = [o for o in done if o.request_id == "r0"]
    assert sorted(o.sample_index for o in streamed) == [0, 1, 2]
    assert all(o.finish_reason == "error" and "peer died" in o.error and LOST in o.error for o in streamed)
    assert _bits([o for o in done if o.request_id == "r1"]) == {k: v for k, v in want.items() if k[0] == "r1"}
    assert [rid for group, rid, _, _ in log["added"] if group == 2] == ["r1"]  # r0 was not resubmitted
    svc.shutdown()


def test_step_api_resubmission_keeps_aborts_pause_and_the_restart_budget():
    reqs = _fake_requests()[:2]
    # an abort that went out with the failed call: the request comes back aborted, not rerun
    svc, log = fake_service(run_failures=0, start_failures=0, fail_runs={2})
    for r in reqs:
        svc.add_request(r)
    svc.step()
    svc.abort("r0")
    assert svc.step() == []  # the failed call: the group restarts, nothing is lost
    outs = [o for _ in range(20) for o in svc.step() if isinstance(o, SampleOutput)]
    assert sorted((o.request_id, o.finish_reason) for o in outs if o.request_id == "r0") == [("r0", "abort")] * 3
    assert {o.finish_reason for o in outs if o.request_id == "r1"} <= {"stop", "length"}
    assert len(outs) == 6 and not svc.has_unfinished()
    svc.shutdown()

    # a paused service stays paused across the restart: the resubmitted requests wait for resume
    svc, log = fake_service(run_failures=0, start_failures=0, fail_runs={2})
    svc.add_request(reqs[0])
    svc.step()
    svc.pause()
    svc.step()  # fails
    assert svc.paused and svc.launcher.paused  # the new workers were paused too
    assert svc.step() == [] and svc.metrics()["lockstep_steps"] == 1
    svc.resume()
    outs = [o for _ in range(20) for o in svc.step() if isinstance(o, SampleOutput)]
    assert sorted(o.sample_index for o in outs) == [0, 1, 2] and all(o.finish_reason != "error" for o in outs)
    svc.shutdown()

    # a request that lives through more than max_restarts failures gets error records naming it
    svc, log = fake_service(run_failures=0, start_failures=0, max_restarts=1, fail_runs={2, 3})
    svc.add_request(reqs[0])
    outs = [o for _ in range(4) for o in svc.step() if isinstance(o, SampleOutput)]
    assert len(outs) == 3 and all(o.finish_reason == "error" for o in outs), outs
    assert all("more than cluster.max_restarts=1 times" in o.error and LOST in o.error for o in outs)
    assert svc.restarts == 2 and not svc.has_unfinished()
    svc.shutdown()

    # a restart that fails: error records with its cause; the next request starts a fresh group
    svc, log = fake_service(run_failures=0, start_failures=5, max_restarts=2, fail_runs={2})
    svc.add_request(reqs[0])
    outs = [o for _ in range(3) for o in svc.step() if isinstance(o, SampleOutput)]
    assert len(outs) == 3 and all("OSError: disk gone" in o.error and "gave up restarting" in o.error for o in outs)
    assert svc.launcher is None and not svc.has_unfinished()
    svc.shutdown()


def _join(svc: RolloutService) -> None:
    """The fake group joins a trainer's weight-sync group (ranks 1..2 of 3)."""
    svc.join_weight_sync("127.0.0.1", 1, 3, 1, "gloo", 5.0, 1.0, True)


def _steps_until_done(svc: RolloutService, limit: int = 30) -> list:
    outs = []
    for _ in range(limit):
        if not svc.has_unfinished():
            break
        outs += svc.step()
    assert not svc.has_unfinished(), "requests left unfinished"
    return outs


def test_weights_received_from_the_trainer_are_not_served_by_a_restarted_group_until_sent_again():
    # join_weight_sync / receive_weight_update: the trainer's broadcast reaches the workers only
    # and the service keeps no copy, so a restarted group holds the checkpoint's weights (the
    # fake's version 0). The resubmitted request used to run on them while the service reported
    # version 1. Now (the "weights not served after the restart" branch of _restart_live) it ends
    # with error records naming the cause and the remedy, no forward runs, and new requests get
    # error records too, until the trainer joins again and an update is accepted.
    reqs = _fake_requests()[:2]
    svc, log = fake_service(run_failures=0, start_failures=0)
    _join(svc)
    assert svc.receive_weight_update()["version"] == 1 and svc.weight_version == 1
    svc.add_request(reqs[0])
    svc.step()  # the first token, on version 1
    log["fail_runs"].add(log["runs"] + 1)
    outs = svc.step()  # fails: the group restarts on the checkpoint's weights
    assert svc.restarts == 1 and svc.launcher.version == 0 and svc.weight_version == 1
    got = sorted((o.request_id, o.sample_index, o.finish_reason) for o in outs)
    assert got == [("r0", j, "error") for j in range(3)]
    for o in outs:
        assert "peer died" in o.error and "hold the checkpoint's weights, not the served version 1" in o.error
        assert "join_weight_sync" in o.error and "send the weights again" in o.error and LOST in o.error
        assert o.weight_version == 1 and o.output_ids == []
    assert not svc.has_unfinished() and [a for a in log["added"] if a[0] == 2] == []  # nothing resubmitted
    runs = log["runs"]
    svc.add_request(reqs[1])  # a new request: error records at once
    outs = svc.step()
    assert [(o.request_id, o.finish_reason) for o in outs] == [("r1", "error")] * 3
    assert all("not the served version 1" in o.error and "then resubmit" in o.error for o in outs)
    with pytest.raises(RolloutFailure, match="not the served version 1") as info:
        svc.generate(reqs)
    assert info.value.lost_request_ids == ["r0", "r1"]
    with pytest.raises(RolloutFailure, match="not the served version 1"):
        svc.score([1, 2, 3])
    assert log["runs"] == runs  # no forward on the checkpoint's weights
    # the restarted workers left the trainer's group: refused at once (it used to fail on the
    # workers and restart the group once more)
    with pytest.raises(RuntimeError, match="call join_weight_sync first"):
        svc.receive_weight_update()
    assert svc.restarts == 1 and not svc.weight_sync_joined
    _join(svc)
    log["trainer_version"] = 2
    assert svc.receive_weight_update()["version"] == 2
    outs = svc.generate(reqs)
    assert len(outs) == 6 and all(o.finish_reason in ("stop", "length") and o.weight_version == 2 for o in outs)
    # generate() across a restart on received weights: RolloutFailure naming them, as the step API
    log["fail_runs"].add(log["runs"] + 1)
    with pytest.raises(RolloutFailure, match="not the served version 2") as info:
        svc.generate(reqs)
    assert info.value.lost_request_ids == ["r0", "r1"] and svc.launcher.version == 0
    svc.shutdown()


def test_a_received_update_that_left_a_rank_invalid_stops_serving_until_the_trainers_next_update():
    # receive_weight_update (the trainer's group: nothing to re-send from here) rejected after
    # rank 1 wrote part of it: the requests it gave up end at once, the others at the next step,
    # new ones are refused, until the trainer's next update is accepted. The same path as a
    # rejected update_weights (_after_rejected_update), so the cause names the remedy as theirs do.
    reqs = _fake_requests()[:2]
    svc, log = fake_service(run_failures=0, start_failures=0)
    _join(svc)
    assert svc.receive_weight_update()["version"] == 1
    svc.add_request(reqs[0])
    svc.add_request(reqs[1], stream=True)
    outs = svc.step()
    log["trainer_version"], log["trainer_outcomes"] = 2, ["partial"]
    got = svc.receive_weight_update()
    assert not got["ok"] and got["version"] == 1 and svc.weight_version == 1
    assert got["errors"] == ["rank 1: rank 1: update 2 failed after weights were written: rank invalid"]
    runs = log["runs"]
    why = (
        "rollout rank(s) 1 invalid: wrote bytes of a rejected weight update (weight_sync.atomic=false), and this "
        "process cannot re-send the served version 1 to repair them (the update came over the trainer's "
        "weight-sync group); the trainer's next accepted update repairs them (receive_weight_update; the "
        "server's /update_weights)"
    )
    done = [o for o in outs + _steps_until_done(svc) if isinstance(o, SampleOutput)]
    assert sorted((o.request_id, o.sample_index) for o in done) == [(r, j) for r in ("r0", "r1") for j in range(3)]
    assert all(o.finish_reason == "error" and o.error == f"{why}; {LOST}" for o in done)
    with pytest.raises(RolloutFailure) as info:
        svc.generate(reqs)
    assert str(info.value) == f"{why}, then resubmit" and log["runs"] == runs  # no forward on rank 1
    log["trainer_version"] = 3
    assert svc.receive_weight_update()["ok"] and svc.weight_version == 3
    outs = svc.generate(reqs)
    assert len(outs) == 6 and all(o.finish_reason in ("stop", "length") and o.weight_version == 3 for o in outs)
    svc.shutdown()


def test_sleep_with_requests_unfinished_is_refused_without_a_restart():
    # The ranks' engines refuse to sleep with samples unfinished; their refusal reached the service
    # as a failure of the group, which restarted it (the requests' KV pages dropped, the requests
    # resubmitted) and then slept. Now the service refuses first, as LLMEngine.sleep does, naming
    # the samples and the remedy: no restart, and the requests (sent or not) go on as without it.
    # A bad level is the caller's ValueError too, no longer a failure of the group.
    reqs = _fake_requests()[:3]
    clean, _ = fake_service(run_failures=0, start_failures=0)
    want = _bits(clean.generate(reqs))
    clean.shutdown()
    svc, log = fake_service(run_failures=0, start_failures=0)
    svc.add_request(reqs[0])
    svc.add_request(reqs[1], stream=True)
    outs = svc.step()  # each sample has its first token
    svc.add_request(reqs[2])  # not sent yet: counted too (the engine's waiting requests are)
    with pytest.raises(RuntimeError) as info:
        svc.sleep(1)
    assert str(info.value) == (
        "sleep: 9 samples of 3 requests are unfinished; finish them, or abort them (abort(request_id): the next "
        "step() sends the abort and returns the abort records), then step() until has_unfinished() is false "
        "before sleeping"
    )
    outs += _steps_until_done(svc)
    with pytest.raises(ValueError, match=r"sleep\(level=3\): level must be 1"):
        svc.sleep(3)
    assert svc.restarts == 0 and log["starts"] == 1 and svc.drain_events() == [] and not svc.launcher.sleeping
    done = [o for o in outs if isinstance(o, SampleOutput)]
    assert len(done) == 9 and _bits(done) == want  # bitwise as without the refusals
    assert svc.sleep(1)["level"] == 1 and svc.launcher.sleeping  # nothing unfinished: it sleeps
    svc.shutdown()


def test_sleep_after_abort_needs_the_steps_that_send_the_aborts():
    # RolloutService.abort only queues an abort (LLMEngine.abort acts at once): the refusal said
    # "abort them (abort(request_id); ...) before sleeping", but a sleep right after the aborts was
    # still refused. The message now names the queued aborts and the exact remedy, which works:
    # abort, then step() until has_unfinished() is false, then sleep.
    reqs = _fake_requests()[:2]
    svc, log = fake_service(run_failures=0, start_failures=0)
    for req in reqs:
        svc.add_request(req)
    svc.step()  # sent: each sample has its first token
    for req in reqs:
        svc.abort(req.request_id)
    with pytest.raises(RuntimeError) as info:
        svc.sleep(1)
    assert str(info.value) == (
        "sleep: 6 samples of 2 requests are unfinished (2 of them with an abort queued, not sent yet); finish "
        "them, or abort them (abort(request_id): the next step() sends the abort and returns the abort "
        "records), then step() until has_unfinished() is false before sleeping"
    )
    done = [o for o in _steps_until_done(svc) if isinstance(o, SampleOutput)]
    assert sorted((o.request_id, o.sample_index, o.finish_reason) for o in done) == [
        (r.request_id, j, "abort") for r in reqs for j in range(3)
    ]
    assert not svc.has_unfinished() and svc.sleep(1)["level"] == 1 and svc.launcher.sleeping
    assert svc.restarts == 0 and log["starts"] == 1
    svc.shutdown()


def test_add_request_while_the_workers_sleep_is_refused_without_a_restart():
    # add_request placed a request while the workers slept; the next step sent it to the sleeping
    # ranks, whose engines refused it, and that refusal reached the service as a failure of the
    # group: a restart, which woke the group up behind the trainer's back. Now the service
    # refuses first, as LLMEngine.add_request does, naming the remedy: nothing is placed, the
    # group keeps sleeping, and after wake_up the requests complete as without the refusal.
    reqs = _fake_requests()[:2]
    clean, _ = fake_service(run_failures=0, start_failures=0)
    want = _bits(clean.generate(reqs))
    clean.shutdown()
    svc, log = fake_service(run_failures=0, start_failures=0)
    assert svc.sleep(2)["level"] == 2
    for stream in (False, True):
        with pytest.raises(RuntimeError) as info:
            svc.add_request(reqs[0], stream=stream)
        assert str(info.value) == "the rollout workers sleep (level 2): call wake_up() before you add a request"
    assert not svc.has_unfinished() and svc.step() == []
    assert svc.restarts == 0 and log["starts"] == 1 and log["added"] == [] and svc.launcher.sleeping
    assert svc.drain_events() == []
    svc.wake_up()
    for req in reqs:
        svc.add_request(req)
    done = [o for o in _steps_until_done(svc) if isinstance(o, SampleOutput)]
    assert len(done) == 6 and _bits(done) == want and svc.restarts == 0
    svc.shutdown()


def test_a_restart_in_sleep_or_wake_up_leaves_the_group_as_asked_and_requests_complete():
    # A rank lost in sleep restarts the group, which then sleeps (add_request is refused there);
    # one lost in wake_up restarts it awake. (sleep refuses while any request is unfinished and
    # add_request while the workers sleep, so neither restart has requests to put back.)
    reqs = _fake_requests()[:3]
    clean, _ = fake_service(run_failures=0, start_failures=0)
    want = _bits(clean.generate(reqs))
    clean.shutdown()
    svc, log = fake_service(run_failures=0, start_failures=0)
    log["fail_calls"]["sleep"] = 1
    assert svc.sleep(1)["level"] == 1  # a rank died in sleep: the group restarts, then sleeps
    assert svc.restarts == 1 and svc.launcher.sleeping
    with pytest.raises(RuntimeError, match=r"call wake_up\(\) before you add a request"):
        svc.add_request(reqs[0])
    log["fail_calls"]["wake_up"] = 1
    svc.wake_up()
    assert svc.restarts == 2 and not svc.launcher.sleeping
    svc.add_request(reqs[0])
    svc.add_request(reqs[1], stream=True)
    svc.add_request(reqs[2])
    outs = _steps_until_done(svc)
    done = [o for o in outs if isinstance(o, SampleOutput)]
    assert len(done) == 9 and _bits(done) == want  # bitwise as without the failures
    streamed = [o for o in outs if isinstance(o, StreamDelta)]
    assert {o.request_id for o in streamed} == {"r1"}
    for o in done:
        if o.request_id == "r1":
            assert [t for d in streamed if d.sample_index == o.sample_index for t in d.token_ids] == o.output_ids
    assert sorted((group, rid) for group, rid, _, _ in log["added"]) == [(3, "r0"), (3, "r1"), (3, "r2")]  # once each
    svc.shutdown()


def test_pause_resume_and_reset_prefix_cache_while_a_failed_restart_left_no_group():
    # They used to raise AttributeError (launcher None). Now the state is recorded and the next
    # group started (by add_request) gets it.
    r = _fake_requests()[0]
    svc, log = fake_service(run_failures=0, start_failures=5, max_restarts=1, fail_runs={2})
    svc.add_request(r)
    _steps_until_done(svc)  # run 2 fails, the restart fails: error records, no group left
    assert svc.launcher is None
    svc.pause()
    svc.reset_prefix_cache()
    assert svc.paused
    log["start_failures"] = 0
    svc.add_request(r)  # starts a group: paused
    assert svc.launcher.paused and svc.step() == [] and svc.has_unfinished()
    svc.resume()
    outs = [o for o in _steps_until_done(svc) if isinstance(o, SampleOutput)]
    assert len(outs) == 3 and all(o.finish_reason in ("stop", "length") for o in outs)

    svc.pause()
    log["start_failures"] = 5
    log["fail_runs"].add(log["runs"] + 1)
    svc.add_request(r)
    _steps_until_done(svc)  # a paused step's run call fails, the restart fails
    assert svc.launcher is None
    svc.resume()
    log["start_failures"] = 0
    svc.add_request(r)  # the new group starts unpaused
    assert not svc.paused and not svc.launcher.paused
    outs = [o for o in _steps_until_done(svc) if isinstance(o, SampleOutput)]
    assert len(outs) == 3 and all(o.finish_reason in ("stop", "length") for o in outs)
    svc.shutdown()


def test_a_rejected_first_broadcast_update_that_half_wrote_a_rank_stops_the_group_until_a_full_update(monkeypatch):
    # The first update_weights (no earlier one kept to re-send) rejected after rank 1 wrote part of
    # it (atomic=false): the ranks used to stay half-written and the next step / generate ran on
    # them. Now no forward runs: the request rank 1 gave up and new ones get error records naming
    # the cause and the remedy, generate / score raise, until a full update is accepted (which
    # carries the frozen tensors again: the rejected one may have written part of them).
    reqs = _fake_requests()[:2]
    svc, log = fake_service(run_failures=0, start_failures=0)
    fake_broadcast(monkeypatch, log)
    weights = [("w", torch.zeros(2))]
    svc.add_request(reqs[0])
    assert svc.step() == []  # running on the checkpoint's weights
    log["send_outcomes"].append("partial")
    with pytest.raises(ValueError, match="rank invalid"):
        svc.update_weights(1, weights)
    assert log["received"] == [(1, True, False, "partial")] and svc.weight_version == 0  # no re-send
    runs = log["runs"]
    outs = svc.step()
    assert sorted((o.request_id, o.sample_index, o.finish_reason) for o in outs) == [
        ("r0", j, "error") for j in range(3)
    ]
    for o in outs:
        assert "rank(s) 1 invalid: wrote bytes of the rejected update 1" in o.error and LOST in o.error
        assert "no copy of the served version 0" in o.error and "send a full update" in o.error
    svc.add_request(reqs[1])
    outs = svc.step()
    assert [(o.request_id, o.finish_reason) for o in outs] == [("r1", "error")] * 3
    assert all("send a full update" in o.error and "then resubmit" in o.error for o in outs)
    with pytest.raises(RolloutFailure, match="rank.s. 1 invalid.*send a full update") as info:
        svc.generate(reqs)
    assert info.value.lost_request_ids == ["r0", "r1"]
    with pytest.raises(RolloutFailure, match="send a full update"):
        svc.score([1, 2, 3])
    assert log["runs"] == runs and not svc.has_unfinished()  # no forward on the half-written ranks
    svc.update_weights(2, weights)
    assert log["received"][1:] == [(2, True, False, "ok")]  # the frozen tensors go again
    outs = svc.generate(reqs)
    assert len(outs) == 6 and all(o.finish_reason in ("stop", "length") and o.weight_version == 2 for o in outs)
    svc.shutdown()


def test_a_rejected_broadcast_update_over_received_weights_has_nothing_to_re_send(monkeypatch):
    # The served weights came from a trainer's group (receive_weight_update, version 2): the copy
    # kept here is update_weights' version 1, older; re-sending it (replace) was refused by the
    # ranks and left them half-written. Now nothing is re-sent and no forward runs.
    svc, log = fake_service(run_failures=0, start_failures=0)
    fake_broadcast(monkeypatch, log)
    weights = [("w", torch.zeros(2))]
    svc.update_weights(1, weights)
    _join(svc)
    log["trainer_version"] = 2
    assert svc.receive_weight_update()["version"] == 2
    svc.launcher.broadcast = True  # the fake group takes update_weights' broadcast again
    log["send_outcomes"].append("partial")
    with pytest.raises(ValueError, match="rank invalid"):
        svc.update_weights(3, weights)
    assert [r[0] for r in log["received"]] == [1, 3] and svc.weight_version == 2  # version 1 not re-sent
    with pytest.raises(RolloutFailure, match="no copy of the served version 2 .*send a full update"):
        svc.generate(_fake_requests()[:1])
    svc.shutdown()


def test_requests_a_rank_gave_up_in_a_repaired_broadcast_update_are_placed_again(monkeypatch):
    # A rejected non-atomic update repaired by re-sending the last good weights (replace): the
    # requests the invalid rank gave up were dropped by its engine and never finished. Now they are
    # resubmitted (same tokens as without the update); a streamed one ends with error records.
    reqs = _fake_requests()[:2]
    ref_svc, _ = fake_service(run_failures=0, start_failures=0)
    ref = sorted((o.sample_index, o.output_ids, o.logprobs) for o in ref_svc.generate(reqs[:1]))
    ref_svc.shutdown()
    svc, log = fake_service(run_failures=0, start_failures=0)
    fake_broadcast(monkeypatch, log)
    weights = [("w", torch.zeros(2))]
    svc.update_weights(1, weights)
    svc.add_request(reqs[0])
    svc.add_request(reqs[1], stream=True)
    outs = svc.step()
    log["send_outcomes"].append("partial")
    with pytest.raises(ValueError, match="rank invalid"):
        svc.update_weights(2, weights)
    assert log["received"][1:] == [(2, False, False, "partial"), (1, False, True, "ok")]  # repaired
    outs += _steps_until_done(svc)
    done = [o for o in outs if isinstance(o, SampleOutput)]
    assert sorted((o.sample_index, o.output_ids, o.logprobs) for o in done if o.request_id == "r0") == ref
    assert all(o.weight_version == 1 and o.finish_reason in ("stop", "length") for o in done if o.request_id == "r0")
    streamed = [o for o in done if o.request_id == "r1"]
    assert sorted(o.sample_index for o in streamed) == [0, 1, 2]
    assert all(o.finish_reason == "error" and "gave up the streamed request" in o.error for o in streamed)
    svc.shutdown()


def test_an_abort_not_sent_yet_follows_a_request_a_repaired_update_placed_on_another_rank(monkeypatch):
    # r0 (streamed) on rank 0, r1 on rank 1; the caller aborts r1 before the next step, the prefix
    # map is reset, and a rejected non-atomic update (repaired by the re-send) makes rank 1 give r1
    # up. _put_back re-placed r1 on rank 0 (r0, streamed, ended) but left its abort queued for
    # rank 1, which no longer had it: r1 ran to its end. Now the re-placement is the one helper a
    # restart uses too (_requeue), which moves the unsent abort with the request.
    reqs = _fake_requests()[:2]
    svc, log = fake_service(run_failures=0, start_failures=0)
    fake_broadcast(monkeypatch, log)
    weights = [("w", torch.zeros(2))]
    svc.update_weights(1, weights)
    svc.add_request(reqs[0], stream=True)
    svc.add_request(reqs[1])
    outs = svc.step()
    assert {s["req"].request_id: s["rank"] for s in svc.launcher.samples} == {"r0": 0, "r1": 1}
    svc.abort("r1")
    svc.reset_prefix_cache()
    log["send_outcomes"].append("partial")
    with pytest.raises(ValueError, match="rank invalid"):
        svc.update_weights(2, weights)
    assert log["received"][1:] == [(2, False, False, "partial"), (1, False, True, "ok")]  # repaired
    done = [o for o in outs + _steps_until_done(svc) if isinstance(o, SampleOutput)]
    assert sorted((o.request_id, o.sample_index, o.finish_reason) for o in done if o.request_id == "r1") == [
        ("r1", j, "abort") for j in range(3)
    ]
    assert all(o.finish_reason == "error" for o in done if o.request_id == "r0")  # streamed: given up
    svc.shutdown()


REJECTED = "rank 1: update 2 failed after weights were written: rank invalid"  # the fake's rejection of update 2


def _reject_update_over_live_requests(svc, log, outcomes: list[str]) -> tuple[list, list, str]:
    """Version 1 accepted; r0 and a streamed r1 get their first token; update 2 goes out with the
    fake group's ``outcomes`` ("partial" first: rank 1 half-written, its samples handed back) and
    raises ValueError. Returns (the outputs so far, the reference tokens of r0 run undisturbed,
    the ValueError's message)."""
    reqs = _fake_requests()[:2]
    ref_svc, _ = fake_service(run_failures=0, start_failures=0)
    ref = sorted((o.sample_index, o.output_ids, o.logprobs) for o in ref_svc.generate(reqs[:1]))
    ref_svc.shutdown()
    weights = [("w", torch.zeros(2))]
    svc.update_weights(1, weights)
    svc.add_request(reqs[0])
    svc.add_request(reqs[1], stream=True)
    outs = svc.step()
    log["send_outcomes"] += outcomes
    with pytest.raises(ValueError, match="rank invalid") as info:
        svc.update_weights(2, weights)
    return outs, ref, str(info.value)


def _assert_weights_lost(svc, log, outs, why: str, streamed_why: str | None = None) -> None:
    """Every sample of r0 / r1 ended with an error record naming ``why`` (r1's: ``streamed_why``
    when given); no forward runs (generate refuses naming ``why``) until update 3 is accepted,
    which serves again."""
    runs = log["runs"]
    outs = outs + _steps_until_done(svc)  # the requests the invalid rank gave up used to hang here
    done = [o for o in outs if isinstance(o, SampleOutput)]
    assert sorted((o.request_id, o.sample_index) for o in done) == [(r, j) for r in ("r0", "r1") for j in range(3)]
    for o in done:
        cause = streamed_why if streamed_why and o.request_id == "r1" else why
        assert o.finish_reason == "error" and re.search(cause, o.error) and LOST in o.error, o.error
    reqs = _fake_requests()[:2]
    with pytest.raises(RolloutFailure, match=why) as info:
        svc.generate(reqs)
    assert info.value.lost_request_ids == ["r0", "r1"]
    with pytest.raises(RolloutFailure, match=why):
        svc.score([1, 2, 3])
    assert log["runs"] == runs and not svc.has_unfinished()  # no forward on the half-written ranks
    svc.update_weights(3, [("w", torch.zeros(2))])
    outs = svc.generate(reqs)
    assert len(outs) == 6 and all(o.finish_reason in ("stop", "length") and o.weight_version == 3 for o in outs)
    svc.shutdown()


def test_requests_a_rank_gave_up_in_a_rejected_ipc_update_end_with_error_records(monkeypatch):
    # refit="ipc": the source holds the rejected fill, not the served weights, so nothing re-sends
    # them to repair rank 1. The requests rank 1 gave up (its engine dropped them) used to stay
    # unfinished forever (the next steps aborted them on a rank that no longer had them). Now they
    # end with error records naming the cause and the remedy, as the broadcast refit's (one path).
    svc, log = fake_ipc_service(monkeypatch, run_failures=0, start_failures=0)
    outs, _, raised = _reject_update_over_live_requests(svc, log, ["partial"])
    assert log["received"] == [(1, True, False, "ok"), (2, False, False, "partial")]  # nothing re-sent
    why = r"rank\(s\) 1 invalid: wrote bytes of the rejected update 2 .*IPC source no longer holds the served "
    assert raised.startswith(f"{REJECTED}; rollout ") and re.search(why, raised)  # it says both
    _assert_weights_lost(svc, log, outs, why + r"version 1 .*call update_weights first")


def test_a_rejected_repair_re_send_leaves_the_weights_lost_and_ends_the_given_up_requests(monkeypatch):
    # broadcast: the re-send of version 1 (replace) that repairs rank 1 is rejected too. It used to
    # escape with nothing marked: the next steps ran on the half-written ranks and the requests
    # rank 1 gave up never ended. Now the weights are lost until an update is accepted.
    svc, log = fake_service(run_failures=0, start_failures=0)
    fake_broadcast(monkeypatch, log)
    outs, _, raised = _reject_update_over_live_requests(svc, log, ["partial", "partial"])
    assert log["received"][1:] == [(2, False, False, "partial"), (1, False, True, "partial")]
    why = r"rank\(s\) 1 invalid: wrote bytes of the rejected update 2 .*re-send of the served version 1 "
    why += r"that repairs them was rejected too .*send a full update"
    # update_weights raised the rejection of update 2 alone, as if the re-send had repaired rank 1;
    # now it says both, as the refusals from then on do
    assert raised.startswith(f"{REJECTED}; rollout ") and re.search(why, raised)
    _assert_weights_lost(svc, log, outs, why)


def test_a_rank_lost_in_the_repair_re_send_restarts_the_group_on_the_last_good_weights(monkeypatch):
    # broadcast: rank 1 dies during the repair re-send. The GroupFailure used to escape
    # update_weights with no restart and the given-up requests left unfinished. Now the group
    # restarts on the host copy of version 1 and update_weights raises the rejection; the given-up
    # request is resubmitted (tokens as undisturbed), the streamed one gets error records.
    svc, log = fake_service(run_failures=0, start_failures=0)
    fake_broadcast(monkeypatch, log)
    outs, ref, raised = _reject_update_over_live_requests(svc, log, ["partial", "dies"])
    assert raised == REJECTED  # repaired by the restart: the rejection alone
    assert log["received"][1:] == [(2, False, False, "partial"), (1, False, True, "dies"), (1, True, False, "ok")]
    assert svc.restarts == 1 and svc.weight_version == 1 and svc.launcher.version == 1
    done = [o for o in outs + _steps_until_done(svc) if isinstance(o, SampleOutput)]
    assert sorted((o.sample_index, o.output_ids, o.logprobs) for o in done if o.request_id == "r0") == ref
    assert all(o.weight_version == 1 and o.finish_reason in ("stop", "length") for o in done if o.request_id == "r0")
    streamed = [o for o in done if o.request_id == "r1"]
    assert sorted(o.sample_index for o in streamed) == [0, 1, 2]
    assert all(o.finish_reason == "error" and "peer died" in o.error for o in streamed)
    svc.shutdown()


def test_a_rejected_update_whose_repair_restart_fails_says_both_causes(monkeypatch):
    # ... and when that restart fails too (max_restarts spent), the group is left stopped and the
    # live requests end with error records naming it: the ValueError used to name the rejection
    # alone; now it says the repair failed and why.
    svc, log = fake_service(run_failures=0, start_failures=5, max_restarts=1)
    fake_broadcast(monkeypatch, log)
    outs, _, raised = _reject_update_over_live_requests(svc, log, ["partial", "dies"])
    assert svc.launcher is None and svc.restarts == 1
    assert raised.startswith(f"{REJECTED}; the re-send of the served version 1 that repairs rollout rank(s) 1 failed")
    assert "could not be restarted" in raised and "OSError: disk gone" in raised
    done = [o for o in outs + _steps_until_done(svc) if isinstance(o, SampleOutput)]
    assert sorted((o.request_id, o.sample_index) for o in done) == [(r, j) for r in ("r0", "r1") for j in range(3)]
    assert all(o.finish_reason == "error" for o in done)
    svc.shutdown()


def test_a_restart_whose_re_sent_weights_are_refused_serves_nothing_until_an_update(monkeypatch):
    # ... and when the restarted group refuses the re-sent version 1 (rank 1 half-written again),
    # the ValueError used to escape the restart: the group was shut down and the requests never
    # ended. Now the restarted group serves nothing until an update is accepted.
    svc, log = fake_service(run_failures=0, start_failures=0)
    fake_broadcast(monkeypatch, log)
    outs, _, raised = _reject_update_over_live_requests(svc, log, ["partial", "dies", "partial"])
    assert log["received"][3:] == [(1, True, False, "partial")] and svc.restarts == 1
    why = r"the restarted rollout workers refused the served version 1 re-sent to them .*call update_weights first"
    assert raised.startswith(f"{REJECTED}; the restarted ") and re.search(why, raised)
    _assert_weights_lost(svc, log, outs, why, streamed_why="peer died")

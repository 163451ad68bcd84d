"""RolloutService over torch.multiprocessing workers: EP=2 generation equals EP=1, failure handling.

A seeded tiny M3 is saved once; the EP=1 reference is the in-process engine (NativeBackend) in
fp32, the EP=2 service loads the same checkpoint as two expert shards in two processes (gloo).
With randomness keyed by (seed, sample index, position), tokens must be identical.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch

from m3_rollout.config import WeightSyncConfig
from m3_rollout.engine.interface import GenerationRequest, SampleOutput, SamplingParams
from m3_rollout.engine.native_backend import NativeBackend
from m3_rollout.model import iter_released_tensors, load_checkpoint
from m3_rollout.model.selection_record import canonical_rows
from m3_rollout.parallel import EPGroupSpec
from m3_rollout.service import RolloutFailure, RolloutService, WorkerSpec
from m3_rollout.service.launchers import GroupFailure, Launcher
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


class _FakeLauncher(Launcher):
    """In-process stand-in for the worker group: ``run`` fails ``run_failures`` times, every start
    after the first fails while ``start_failures`` lasts (no processes; failure paths only)."""

    def __init__(self, log: dict):
        self.log = log
        self.world_size = 2

    def start(self, spec, timeout_s):
        self.log["starts"] += 1
        if self.log["starts"] > 1 and self.log["start_failures"] > 0:
            self.log["start_failures"] -= 1
            raise GroupFailure("start", [1], {1: "Traceback (most recent call last):\nOSError: disk gone"})

    def call(self, method, per_rank_args=(), timeout_s=None):
        if method == "info":
            return [{"pid": r, "rank": r} for r in range(2)]
        if method == "count_weight_write":  # every start gives the new workers the group's write count
            self.log.setdefault("writes", []).append(per_rank_args[0])
            return [None, None]
        if method == "run":
            if self.log["run_failures"] > 0:
                self.log["run_failures"] -= 1
                raise GroupFailure("run", [0], {0: "RuntimeError: peer died"})
            reqs = per_rank_args[0][0] + per_rank_args[1][0]
            outs = [
                SampleOutput(q.request_id, q.sample_index + j, list(q.prompt_ids), [5], [-0.1], "length", 0)
                for q in reqs
                for j in range(q.params.n)
            ]
            ep = {"tokens_per_expert": [], "dispatch_s": 0.0, "expert_s": 0.0, "combine_s": 0.0}
            engine = {}
            return [
                {"outputs": outs, "steps": 1, "ep": ep, "engine": engine},
                {"outputs": [], "steps": 1, "ep": ep, "engine": engine},
            ]
        if method == "shutdown":
            raise GroupFailure("shutdown", [0], {0: "group broken"})
        raise AssertionError(method)

    def pids(self):
        return [0, 1]

    def shutdown(self, graceful=True):
        self.log["shutdowns"] += 1


def _fake_service(run_failures: int, start_failures: int, max_restarts: int = 2):
    log = {"starts": 0, "shutdowns": 0, "run_failures": run_failures, "start_failures": start_failures}
    spec = WorkerSpec(model_dir="unused", group=EPGroupSpec(2, "127.0.0.1", 0, "gloo", timeout_s=5))
    svc = RolloutService(
        spec, launcher=lambda: _FakeLauncher(log), max_restarts=max_restarts, weight_sync=WeightSyncConfig()
    )
    return svc, log


def test_failures_during_restart_count_and_end_in_rolloutfailure(capsys):
    svc, log = _fake_service(run_failures=1, start_failures=5, max_restarts=2)
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
    svc, log = _fake_service(run_failures=1, start_failures=1, max_restarts=2)
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
    svc, _log = _fake_service(run_failures=0, start_failures=0)

    async def main():
        outs = svc.generate_async([GenerationRequest("a", [1, 2], SamplingParams(n=2))])
        first = await outs.__anext__()
        with pytest.raises(RuntimeError, match="generate_async callers are active"):
            svc.generate([GenerationRequest("b", [3], SamplingParams())])
        return [first] + [o async for o in outs]

    outs = asyncio.run(main())
    assert sorted((o.request_id, o.sample_index) for o in outs) == [("a", 0), ("a", 1)]
    svc.shutdown()


def test_generate_async_samples_a_group_failure_lost_come_back_as_error_records():
    # The step API's rule: a failed group restarts and every unfinished sample gets an error record
    # naming the failure (none is left waiting); the next call runs on the restarted group.
    svc, log = _fake_service(run_failures=1, start_failures=0)
    reqs = [GenerationRequest("a", [1, 2], SamplingParams(n=2)), GenerationRequest("b", [3], SamplingParams())]

    async def collect(rs):
        return [o async for o in svc.generate_async(rs)]

    outs = asyncio.run(collect(reqs))
    assert sorted((o.request_id, o.sample_index) for o in outs) == [("a", 0), ("a", 1), ("b", 0)]
    assert all(o.finish_reason == "error" and "peer died" in o.error and LOST in o.error for o in outs)
    assert log["starts"] == 2 and [e["recovered"] for e in svc.drain_events()] == [True]
    again = asyncio.run(collect(reqs[:1]))
    assert [(o.sample_index, o.finish_reason) for o in again] == [(0, "length"), (1, "length")]
    svc.shutdown()

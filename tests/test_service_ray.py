"""RolloutService through the Ray launcher (actors with fractional CPUs): EP=2 equals EP=1, and a
rank that dies mid-generation is restarted with its requests completed.

Skipped where Ray is not installed (the GPU test machines); the collectives themselves are
covered with plain processes in test_ep_moe.py / test_service_ep.py.
"""

from __future__ import annotations

import os

import pytest

ray = pytest.importorskip("ray")

from test_service_ep import _key, _reference, _requests, model_dir  # noqa: E402, F401 (fixture reuse)

from m3_rollout.config import WeightSyncConfig  # noqa: E402
from m3_rollout.parallel import EPGroupSpec  # noqa: E402
from m3_rollout.service import RolloutFailure, RolloutService, WorkerSpec, init_ray  # noqa: E402


def test_ray_ep2_generation_and_restart(model_dir, ray_local):
    reqs = _requests("r")
    ref = _reference(model_dir, reqs)
    spec = WorkerSpec(
        model_dir=str(model_dir),
        group=EPGroupSpec(2, "127.0.0.1", 0, "gloo", timeout_s=60),  # generous: a loaded machine
        dtype="float32",
        engine={"max_model_len": 96, "max_num_seqs": 16, "eos_token_ids": (3,), "num_pages": 64},
        fault_after_steps=4,
        fault_rank=0,
    )
    svc = RolloutService(
        spec,
        launcher="ray",
        worker_cpus=0.5,
        steps_per_call=2,
        start_timeout_s=300,  # Ray actors start slowly on 2 loaded cores (a 120 s limit ran out there)
        weight_sync=WeightSyncConfig(timeout_s=60),
    )
    try:
        assert [i["expert_range"] for i in svc.rank_info] == [(0, 4), (4, 8)]
        # the ranks run at the driver's niceness, not 15 above it (Ray's worker_niceness; init_ray)
        nice = os.getpriority(os.PRIO_PROCESS, 0)
        assert [os.getpriority(os.PRIO_PROCESS, i["pid"]) for i in svc.rank_info] == [nice, nice]
        outs = svc.generate(reqs)  # rank 0 SIGKILLs itself after 4 steps; the actor group restarts
        assert _key(outs) == _key(ref)
        assert svc.restarts == 1 and 0 in svc.failures[0]["ranks"] and svc.failures[0]["lost_request_ids"]
    finally:
        svc.shutdown()


def test_ray_bad_checkpoint_reports_the_workers_error(tmp_path, ray_local):
    spec = WorkerSpec(
        model_dir=str(tmp_path / "missing"),
        group=EPGroupSpec(2, "127.0.0.1", 0, "gloo", timeout_s=20),
        dtype="float32",
        engine={"max_model_len": 96, "max_num_seqs": 16, "eos_token_ids": (3,), "num_pages": 64},
    )
    with pytest.raises(RolloutFailure) as info:
        RolloutService(spec, launcher="ray", max_restarts=0, start_timeout_s=120, weight_sync=WeightSyncConfig())
    cause = str(info.value).split(": rank ", 1)[1].split(";")[0]  # the first failed rank's cause line
    assert "missing" in cause and "Error" in cause, str(info.value)


def test_init_ray_sets_the_niceness_only_where_it_starts_an_instance(monkeypatch, capsys):
    """Ray refuses ``_system_config`` from a driver that joins a running cluster (``RAY_ADDRESS``
    or ``ray start`` found by an address-less ``ray.init``): init_ray then joins without it; an
    explicit address never sends it; other errors propagate."""
    calls = []

    def fake_init(address=None, _system_config=None, **kwargs):
        calls.append((address, _system_config, kwargs))
        if _system_config and joining:
            raise ValueError("When connecting to an existing cluster, _system_config must not be provided.")

    monkeypatch.setattr(ray, "init", fake_init)
    joining = False
    init_ray(None, num_cpus=2)
    kwargs = {"include_dashboard": False, "num_cpus": 2, "ignore_reinit_error": True}
    assert calls == [(None, {"worker_niceness": 0}, kwargs)]
    calls.clear()
    init_ray("local")
    assert [c[:2] for c in calls] == [("local", {"worker_niceness": 0})]
    assert capsys.readouterr().out == ""
    calls.clear()
    joining = True
    init_ray(None)
    assert [c[:2] for c in calls] == [(None, {"worker_niceness": 0}), (None, None)]
    assert "worker_niceness" in capsys.readouterr().out  # says the joined cluster's workers may be reniced
    calls.clear()
    init_ray("10.0.0.1:6379", log_to_driver=True)  # as before: no dashboard key for a cluster (Ray Client)
    assert calls == [("10.0.0.1:6379", None, {"log_to_driver": True, "ignore_reinit_error": True})]

    def broken(address=None, _system_config=None, **kwargs):
        raise ValueError("some other problem")

    monkeypatch.setattr(ray, "init", broken)
    with pytest.raises(ValueError, match="some other problem"):
        init_ray(None)

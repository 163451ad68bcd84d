"""The two colocated placements of the GRPO job behind one interface, on CPU (shared-memory stage).

``policy.generation.colocated_placement=in_process``: the trainer's process owns the engine, refit
by a direct in-place copy. ``worker_process``: one rollout worker process on the trainer's device
(``cluster.launcher=mp``), refit through the stage the trainer shares (weight_sync/ipc.py; CPU
shared memory here, CUDA IPC on a GPU), its sleep / wake-up forwarded to it. Sampling is keyed by
(seed, sample, position) and the worker runs the in-process engine's code on the same weights and
thread count, so the two runs log the same rewards, logprob mismatch and every other non-timing
metric exactly. After every refit the worker's weights are the trainer's cast, bitwise; a worker
killed between steps (found by the next generate, or by the wake-up after training) is
restarted on the stage's weights and the run goes on with the same figures.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import signal

import pytest
import torch

from m3_rollout.config import ConfigError, load_config
from m3_rollout.jobs.grpo import main, run
from m3_rollout.service import RolloutService

RUN = [
    "policy.generation.expert_parallel_size=1",
    "grpo.num_prompts_per_step=1",
    "grpo.num_generations_per_prompt=4",
    "policy.train_global_batch_size=4",
    "policy.train_micro_batch_size=4",
    "policy.generation.max_new_tokens=8",
    "policy.generation.dtype=float32",  # bf16 matmuls are slow on CPU; test_weight_sync_ipc.py casts to bf16
    "policy.generation.sleep_level=2",  # weights to host while the trainer trains: the refit follows a wake-up
    "grpo.max_num_steps=2",
    "grpo.val_at_start=false",
    "grpo.val_at_end=false",
    "checkpointing.enabled=false",
]
IN_PROCESS = ["cluster.launcher=auto"]
WORKER = ["cluster.launcher=mp", "policy.generation.colocated_placement=worker_process"]
# Wall-clock and throughput figures differ between any two runs; worker failures are what the
# restart test causes on purpose. Everything else must be equal.
VARIES = re.compile(r"^timing/|^performance/|^train/worker_failures")


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    path = tmp_path_factory.mktemp("placement")
    old = os.environ.get("M3_ROLLOUT_CACHE")
    os.environ["M3_ROLLOUT_CACHE"] = str(path / "cache")
    yield path
    if old is None:
        del os.environ["M3_ROLLOUT_CACHE"]
    else:
        os.environ["M3_ROLLOUT_CACHE"] = old


def _run(out, extra) -> list[dict]:
    run(load_config("configs/grpo_smoke.yaml", [*RUN, f"logger.log_dir={out}", *extra]))
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def in_process(cache) -> list[dict]:
    return _run(cache / "in_process", IN_PROCESS)


def _assert_same_figures(a: list[dict], b: list[dict], varies: re.Pattern = VARIES) -> None:
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2]
    for ra, rb in zip(a, b):
        na = {k: v for k, v in ra.items() if not varies.search(k)}
        nb = {k: v for k, v in rb.items() if not varies.search(k)}
        assert na.keys() == nb.keys()
        diff = {
            k: (na[k], nb[k])
            for k in na
            if not (na[k] == nb[k] or (isinstance(na[k], float) and math.isnan(na[k]) and math.isnan(nb[k])))
        }
        assert not diff, f"step {ra['step']}: in_process vs worker_process differ in {diff}"
        assert rb["train/num_tokens"] > 0 and rb["train/memory/sleep_gb_freed"] > 0  # the worker's engine slept


def _trainer_digests(named_tensors, dtypes: dict[str, str]) -> dict[str, tuple[str, str]]:
    """The trainer's tensors a worker holds (the names in ``dtypes``: an EP rank has its own experts
    only) cast to the worker's dtypes, as ``RolloutWorker.weight_digests``."""
    out = {}
    for name, t in named_tensors:
        if name not in dtypes:
            continue
        dtype = dtypes[name]
        data = t.detach().to(getattr(torch, dtype.removeprefix("torch.")), copy=True).reshape(-1)
        out[name] = (dtype, hashlib.sha256(data.view(torch.uint8).numpy().tobytes()).hexdigest())
    return out


class RefitRecorder:
    """Wraps ``RolloutService.update_weights``: after every refit each worker's weight digests are
    compared with the trainer's cast, and together the workers must hold every tensor (``checked``
    lists the versions); ``after`` runs a test action (e.g. killing the worker) after the refit of
    a given version."""

    def __init__(self, monkeypatch, after: dict | None = None):
        self.checked: list[int] = []
        self.pids: list[int] = []
        self.after = after or {}
        original = RolloutService.update_weights

        def update_weights(service, version, named_tensors):
            original(service, version, named_tensors)
            ranks = service.weight_digests()
            for rank, digests in enumerate(ranks):
                expected = _trainer_digests(named_tensors, {n: d for n, (d, _) in digests.items()})
                assert digests == expected, f"refit {version}: rank {rank}'s weights differ from the trainer's cast"
            assert set().union(*ranks) == {n for n, _ in named_tensors}
            self.checked.append(version)
            self.pids += service.worker_pids()
            if version in self.after:
                self.after[version](service)

        monkeypatch.setattr(RolloutService, "update_weights", update_weights)


def test_worker_process_placement_matches_in_process_with_bitwise_refits(cache, in_process, monkeypatch):
    refits = RefitRecorder(monkeypatch)
    worker = _run(cache / "worker", WORKER)
    _assert_same_figures(in_process, worker)
    assert refits.checked == [0, 1, 2]  # start, after step 1, after step 2: each bitwise
    assert len(set(refits.pids)) == 1 and os.getpid() not in refits.pids  # one worker, another process
    assert all(r["train/worker_failures"] == 0 for r in worker)


def test_killed_worker_is_restarted_on_the_stage_and_the_next_refit_works(cache, in_process, monkeypatch):
    original_sleep = RolloutService.sleep
    sleeps = []

    def sleep_then_kill_at_step_2(service, level=1):
        record = original_sleep(service, level)
        sleeps.append(record)
        if len(sleeps) == 2:  # the trainer now trains step 2; the wake-up finds the worker gone
            os.kill(service.worker_pids()[0], signal.SIGKILL)
        return record

    monkeypatch.setattr(RolloutService, "sleep", sleep_then_kill_at_step_2)
    # killed after refit 1, between steps: step 2's first generate finds it gone
    refits = RefitRecorder(monkeypatch, after={1: lambda s: os.kill(s.worker_pids()[0], signal.SIGKILL)})
    worker = _run(cache / "worker_killed", WORKER)
    # the restarted workers were given the stage's weights (version 1, while the trainer had already
    # trained step 2 for the second one), so the rollouts and the refit of step 2 are unchanged; the
    # wake-up of step 2 found a fresh worker, awake, with nothing to restore
    _assert_same_figures(in_process, worker, re.compile(VARIES.pattern + "|^train/memory/wake_"))
    assert refits.checked == [0, 1, 2]
    assert len(set(refits.pids)) == 2  # the refit of step 2 went to a restarted worker
    step1, step2 = worker
    assert step1["train/worker_failures"] == 0
    assert step2["train/worker_failures"] == 2 and step2["train/worker_failures_recovered"] == 2
    assert step2["train/memory/wake_gb_restored"] == 0.0 < step1["train/memory/wake_gb_restored"]


def test_ep2_workers_beside_the_trainer_refit_through_the_stage(cache, in_process, monkeypatch):
    """``colocated_placement=worker_process`` with ``expert_parallel_size=2``: two EP workers (gloo
    here; rank r on cuda:r beside a trainer on one of them on a GPU node), every refit through the
    trainer's stage, each rank holding only its experts, bitwise; both ranks sleep and wake. The
    EP forward equals EP=1 in fp32, so the rollouts (tokens, rewards) are the in-process run's and
    the logprob figures agree to fp32 rounding."""
    refits = RefitRecorder(monkeypatch)
    worker = _run(cache / "worker_ep2", [*WORKER, "policy.generation.expert_parallel_size=2"])
    assert refits.checked == [0, 1, 2]
    assert len(set(refits.pids)) == 2 and os.getpid() not in refits.pids  # two workers, no restart
    assert [r["step"] for r in worker] == [1, 2]
    for a, b in zip(in_process, worker):
        assert a.keys() == b.keys()
        for k in a:  # same tokens and rewards; logprob figures up to the EP combine's fp32 rounding
            if VARIES.search(k) or k.startswith("train/memory/"):
                continue
            if isinstance(a[k], float) and math.isnan(a[k]):
                assert math.isnan(b[k]), k
            elif isinstance(a[k], float):
                # max |train - rollout logprob| is itself a few fp32 ulps of logprobs near -6 (4.8e-7 each)
                # in both runs: the EP combine's rounding moves it by ulps, not by a relative amount
                # (4.77e-07 in process vs 9.54e-07 with EP 2 on an AMD EPYC machine, 2026-12-07)
                tol = 4e-6 if k.endswith("max_logprob_abs_diff") else 1e-9
                assert b[k] == pytest.approx(a[k], rel=1e-5, abs=tol), k
            else:
                assert b[k] == a[k], k
        assert b["train/worker_failures"] == 0 and b["train/num_tokens"] > 0
        assert b["train/memory/sleep_gb_freed"] > a["train/memory/sleep_gb_freed"] > 0  # both ranks' pools


def test_worker_process_as_a_ray_actor_matches_in_process(cache, in_process, ray_local):
    # the start limit is max(120 s, collective_timeout_s): Ray actors took longer on 2 loaded cores
    ray_run = ["cluster.launcher=ray", "policy.generation.colocated_placement=worker_process"]
    worker = _run(cache / "ray", [*ray_run, "cluster.collective_timeout_s=300"])
    # the actor is no child of the trainer: it fetches the CPU stage's file descriptor all the same
    _assert_same_figures(in_process, worker)


@pytest.mark.parametrize(
    "overrides, key",
    [
        # EP workers beside a CUDA trainer: rank r on cuda:r, the trainer on one of them
        (["policy.generation.expert_parallel_size=2", "cluster.device=cuda:2"], "cluster.device"),
        (["policy.generation.expert_parallel_size=2", "cluster.device=cuda"], "cluster.gpus_per_node"),
        (["policy.generation.backend=http"], "policy.generation.colocated_placement"),
        (["weight_sync.method=broadcast"], "weight_sync.method"),
        (["weight_sync.bucket_size_mb=64"], "weight_sync.bucket_size_mb"),
        (["cluster.gpus_per_node=1"], "cluster.gpus_per_node"),  # a GPU worker beside a CPU trainer
        (["policy.generation.colocated_placement=elsewhere"], "policy.generation.colocated_placement"),
        # Ray joining a cluster could place the workers on another node than the trainer's memory
        (["cluster.launcher=ray", "cluster.ray_address=10.0.0.1:6379"], "cluster.ray_address"),
        (["cluster.ray_address=auto"], "cluster.ray_address"),  # launcher auto: Ray when installed
    ],
)
def test_worker_process_rejects(overrides, key):
    base = ["policy.generation.expert_parallel_size=1", "policy.generation.colocated_placement=worker_process"]
    with pytest.raises(ConfigError, match=re.escape(key) + "="):
        load_config(None, [*base, *overrides])


def test_worker_process_keys_accepted_and_bad_ones_exit_2(capsys):
    ok = ["policy.generation.expert_parallel_size=1", "weight_sync.timeout_s=30", "policy.generation.sleep_level=1"]
    cfg = load_config(None, [*WORKER, *ok])
    assert cfg.policy.generation.colocated_placement == "worker_process" and cfg.weight_sync.timeout_s == 30
    load_config("configs/grpo_smoke.yaml", WORKER)  # the smoke config's EP=2: two workers beside the trainer
    # plain processes ignore a Ray address: still on this node
    load_config(None, [*WORKER, *ok, "cluster.ray_address=10.0.0.1:6379"])
    for local in ("local", "''"):  # a Ray instance started on this node
        load_config(
            None,
            [
                "cluster.launcher=ray",
                "policy.generation.colocated_placement=worker_process",
                *ok,
                f"cluster.ray_address={local}",
            ],
        )
    with pytest.raises(SystemExit) as exc:  # ... but not with the trainer on a GPU no rank uses
        main(["--config", "configs/grpo_smoke.yaml", *WORKER, "cluster.device=cuda:3", "cluster.gpus_per_node=2"])
    assert exc.value.code == 2
    assert "cluster.device='cuda:3': must be one of cuda:0 .. cuda:1" in capsys.readouterr().err


@pytest.mark.parametrize(
    "overrides, want",
    [
        # beside the trainer: a new local Ray instance, never a cluster Ray would find by itself
        (["cluster.launcher=ray", "policy.generation.colocated_placement=worker_process"], "local"),
        (["cluster.launcher=ray"], None),  # the EP service: Ray's own lookup (RAY_ADDRESS, `ray start`)
        (["cluster.launcher=ray", "cluster.ray_address=auto"], "auto"),
    ],
)
def test_rollout_service_gets_the_ray_address(monkeypatch, tiny_ep_model_dir, overrides, want):
    import m3_rollout.service.factory as factory

    seen = {}
    monkeypatch.setattr(factory, "RolloutService", lambda spec, **kw: seen.update(kw))
    cfg = load_config(None, ["policy.generation.expert_parallel_size=2", *overrides])
    factory.build_rollout_service(cfg, tiny_ep_model_dir, [3], 64)
    assert seen["launcher"] == "ray" and seen["ray_address"] == want

"""Async GRPO collector: generation overlaps training, groups carry their weight version, stale
groups are dropped and counted, a slow group never blocks a step past the timeout; and the
smoke job runs end to end with async on."""

import json
import threading
import time

import pytest
import torch

from m3_rollout.rollout.trajectory import Trajectory
from m3_trainers.rollout_collector import AsyncCollector, RefitRejected, SyncCollector, split_groups


class FakeBackend:
    """Just the weight-version part of a GenerationBackend."""

    def __init__(self):
        self.weight_version = 0
        self.updates = []

    def update_weights(self, version, named_tensors):
        dict(named_tensors)
        self.weight_version = version
        self.updates.append(version)

    def reset_prefix_cache(self):
        pass


def make_generate(backend, groups=2, delay=0.0, slow=None, fail_at=None):
    """generate(b): `groups` groups of 2 trajectories, tagged with the version in use; sleeps
    `delay` s (or slow[b] s)."""
    seen = []

    def generate(b):
        if fail_at == b:
            raise RuntimeError("boom")
        seen.append((b, backend.weight_version, threading.current_thread().name))
        time.sleep((slow or {}).get(b, delay))
        trajs = []
        for gi in range(groups):
            for j in range(2):
                t = Trajectory(gi, j, [], [], [], [], prompt_len=0)
                t.reward = float(j)
                t.info["batch"] = b
                trajs.append(t)
        return split_groups(trajs), {"generated_tokens": 10, "rollout_seconds": 0.01}

    generate.seen = seen
    return generate


def _loop(collector, steps, train_s):
    """Run `steps` steps: get groups, 'train' for train_s, push weights. Returns the per-step
    (versions, stale, batches) and the wall time."""
    out = []
    t0 = time.perf_counter()
    for step in range(1, steps + 1):
        got = collector.get_groups(step, policy_version=step - 1)
        time.sleep(train_s)
        collector.push_weights(step, [("w", torch.zeros(2))])
        out.append((got.versions, got.stale_dropped, sorted({g[0].info["batch"] for g in got.groups})))
    return out, time.perf_counter() - t0


def test_async_overlaps_generation_with_training_and_ages_are_one():
    backend = FakeBackend()
    sync = SyncCollector(backend, make_generate(backend, delay=0.2))
    sync_steps, sync_wall = _loop(sync, 4, 0.2)
    assert [v for v, _, _ in sync_steps] == [[0, 0], [1, 1], [2, 2], [3, 3]]  # age 0

    backend = FakeBackend()
    gen = make_generate(backend, delay=0.2)
    coll = AsyncCollector(backend, gen, groups_per_step=2, max_age=1, timeout_s=10.0)
    try:
        steps, wall = _loop(coll, 4, 0.2)
    finally:
        coll.close()
    # step s trains batch s; batch s >= 2 was generated with version s-2 (age 1) while step s-1 trained
    assert [b for _, _, b in steps] == [[1], [2], [3], [4]]
    assert [v for v, _, _ in steps] == [[0, 0], [0, 0], [1, 1], [2, 2]]
    assert all(stale == 0 for _, stale, _ in steps)
    assert all(name == "grpo-rollout-producer" for _, _, name in gen.seen)
    # 4 x (0.2 gen + 0.2 train) sync vs ~0.2 + 4 x 0.2 overlapped
    assert wall < 0.8 * sync_wall, (wall, sync_wall)
    # Producer never ran more than max_age batches ahead of the trainer.
    assert max(b for b, _, _ in gen.seen) <= 4 + 1


def test_stale_groups_are_dropped_and_counted():
    backend = FakeBackend()
    coll = AsyncCollector(backend, make_generate(backend), groups_per_step=2, max_age=1, timeout_s=10.0)
    try:
        first = coll.get_groups(1, policy_version=0)
        assert first.versions == [0, 0]
        time.sleep(0.2)  # batch 2 (version 0) is now queued
        coll.push_weights(5, [("w", torch.zeros(2))])
        got = coll.get_groups(3, policy_version=5)  # batch 2 has age 5 > 1
    finally:
        coll.close()
    assert got.stale_dropped == 2 and coll.stale_total == 2
    assert got.versions == [5, 5] and not got.timed_out


def test_slow_group_never_blocks_past_the_timeout():
    backend = FakeBackend()
    coll = AsyncCollector(backend, make_generate(backend, slow={2: 1.5}), groups_per_step=2, max_age=1, timeout_s=0.4)
    try:
        coll.get_groups(1, policy_version=0)
        t0 = time.perf_counter()
        got = coll.get_groups(2, policy_version=1)
        waited = time.perf_counter() - t0
    finally:
        coll.close(timeout=5)
    assert got.timed_out and got.groups == []
    assert 0.35 < waited < 1.5


def test_producer_failure_surfaces_in_the_trainer():
    backend = FakeBackend()
    coll = AsyncCollector(backend, make_generate(backend, fail_at=1), groups_per_step=2, max_age=1, timeout_s=5.0)
    with pytest.raises(RuntimeError, match="producer failed"):
        coll.get_groups(1, policy_version=0)
    coll.close()


def test_a_refit_the_generator_rejects_stops_the_trainer_naming_the_version():
    # Async GRPO stages the weights; the producer applies them before its next batch. A rejection
    # there (the backend's ValueError) used to reach the job as "async rollout producer failed"
    # with a traceback; now get_groups raises RefitRejected with the version, and the job's refit
    # turns it into its one-line TrainingError.
    from m3_rollout.jobs.grpo import TrainingError, refit

    backend = FakeBackend()
    accept = backend.update_weights

    def update(version, named_tensors):
        if version == 1:
            raise ValueError("weight update 1 rejected:\n  rank 1: probe drift 0.5 nats/token > 0.1")
        accept(version, named_tensors)

    backend.update_weights = update
    coll = AsyncCollector(backend, make_generate(backend), groups_per_step=2, max_age=1, timeout_s=5.0)
    try:
        coll.get_groups(1, policy_version=0)
        coll.push_weights(1, [("w", torch.zeros(2))])
        with pytest.raises(TrainingError) as e:
            for step in (2, 3):  # batch 2 may already have been generated on version 0
                refit(lambda step=step: coll.get_groups(step, policy_version=step - 1), step - 1)
        msg = str(e.value)
        assert msg.startswith("weight update 1 rejected:\n  rank 1: probe drift 0.5")
        assert "the rollout refused weight version 1, so it cannot serve the trainer's weights" in msg
        with pytest.raises(RefitRejected) as again:  # the trainer asking again gets the same verdict
            coll.get_groups(4, policy_version=3)
        assert again.value.version == 1 and backend.updates == []
    finally:
        coll.close()


def test_smoke_job_runs_async(tmp_path, monkeypatch):
    monkeypatch.setenv("M3_ROLLOUT_CACHE", str(tmp_path / "cache"))
    from m3_rollout.config import load_config
    from m3_rollout.jobs.grpo import run

    cfg = load_config(
        "configs/grpo_smoke.yaml",
        [
            f"logger.log_dir={tmp_path}/logs",
            "checkpointing.enabled=false",
            "grpo.async_grpo.enabled=true",
            "logger.print_sample_every=0",
        ],
    )
    summary = run(cfg)
    assert summary["async"] is True and summary["final_checkpoint"] is None
    rows = [json.loads(l) for l in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "train/loss" in r]
    assert [r["step"] for r in train] == [1, 2, 3]
    assert train[0]["train/mean_group_age"] == 0
    assert all(r["train/max_group_age"] <= 1 and r["train/num_groups"] == 4 for r in train)
    for key in (
        "token_mult_prob_error",
        "gen_kl_error",
        "probs_ratio",
        "probs_ratio_max",
        "clip_fraction",
        "entropy",
        "grad_norm",
        "reward_std",
        "truncation_rate",
        "stale_groups_dropped",
    ):
        assert f"train/{key}" in train[-1], key
    for key in (
        "timing/train/generation",
        "timing/train/exposed_generation",
        "timing/train/policy_and_reference_logprobs",
        "timing/train/policy_training",
        "timing/train/prepare_for_generation/transfer_and_update_weights",
        "performance/step_tokens_per_s",
    ):
        assert key in train[-1], key

"""GRPO with the engine in a rollout worker process on the trainer's GPU
(``policy.generation.colocated_placement=worker_process``): refit through the trainer's CUDA IPC
stage, sleep / wake-up forwarded to the worker, a killed worker restarted. Skipped without CUDA
(and without omegaconf: the job layer).

Model: ``builtin:tiny-random`` (the smoke config's random-weight tiny M3, built in seconds).
Checks: the job's stack builds a ``RolloutService`` whose one worker is another process on the
same GPU with a CUDA stage; one GRPO step (rollout -> sleep level 2 -> train -> wake -> refit)
leaves the worker's weights bitwise equal to the trainer's bf16 cast (router gate and bias: the
fp32 masters); a worker killed after the refit is restarted by the next generate on the stage's
weights (bitwise again) and the refit after the next training step reaches the new worker through
the re-opened stage; the job's command line runs one step in this placement. About a minute on an
H200.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("omegaconf")

from m3_rollout.config import load_config  # noqa: E402
from m3_rollout.jobs.grpo import main  # noqa: E402
from m3_rollout.jobs.stack import build_generation_backend, build_rollout_stack  # noqa: E402
from m3_rollout.rollout.group_rollout import run_group_rollouts  # noqa: E402
from m3_rollout.service import RolloutService  # noqa: E402
from m3_trainers.step import build_loss_fn, build_policy, load_trainer_model, train_step_on_groups  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def _overrides(out) -> list[str]:
    return [
        "cluster.device=cuda",
        "cluster.launcher=mp",
        "policy.generation.colocated_placement=worker_process",
        "policy.generation.expert_parallel_size=1",
        "policy.precision=bfloat16",
        "policy.generation.enable_cuda_graphs=true",
        "policy.generation.kv_cache_memory_gb=1.0",
        "policy.generation.sleep_level=2",
        "grpo.max_num_steps=1",
        "grpo.val_at_start=false",
        "grpo.val_at_end=false",
        "checkpointing.enabled=false",
        f"logger.log_dir={out}/logs",
        f"checkpointing.checkpoint_dir={out}/ckpt",
    ]


@pytest.fixture()
def out(tmp_path, monkeypatch):
    monkeypatch.setenv("M3_ROLLOUT_CACHE", str(tmp_path / "cache"))
    return tmp_path / "run"


def _assert_worker_is_trainer_cast(backend: RolloutService, policy) -> None:
    """The worker's weights (digests by value) equal the trainer's masters cast to the worker's
    dtypes (bf16; the router's fp32), bitwise."""
    (digests,) = backend.weight_digests()
    master = dict(policy.named_released_tensors())
    assert digests.keys() == master.keys()
    for name, (dtype, digest) in digests.items():
        cast = master[name].detach().to(getattr(torch, dtype.removeprefix("torch.")), copy=True).reshape(-1)
        assert hashlib.sha256(cast.view(torch.uint8).cpu().numpy().tobytes()).hexdigest() == digest, name


def _train_step(policy, cfg, trajs) -> None:
    adv = torch.tensor([1.0, -1.0] * (len(trajs) // 2))  # random weights earn no reward: move them anyway
    temperature = cfg.policy.generation.temperature
    res = train_step_on_groups(policy, build_loss_fn(cfg.loss_fn), trajs, cfg, temperature, advantages=adv)
    assert not res.metrics["skipped_step"] and res.metrics["grad_norm"] > 0
    assert 1.0 <= res.metrics["token_mult_prob_error"] < 1.5  # bf16 engine vs bf16-compute trainer


def test_worker_on_the_trainers_gpu_refit_bitwise_through_ipc_and_restarted(out):
    cfg = load_config(str(ROOT / "configs/grpo_smoke.yaml"), _overrides(out))
    stack = build_rollout_stack(cfg, with_backend=False)
    backend = None
    try:
        policy = build_policy(cfg, load_trainer_model(cfg, stack.model_dir), 2)
        backend = build_generation_backend(cfg, stack.model_dir, stack.chat, stack.max_len)
        assert isinstance(backend, RolloutService) and backend.refit == "ipc"
        (pid,) = backend.worker_pids()
        assert pid != os.getpid()
        backend.update_weights(0, policy.named_released_tensors())
        assert backend.last_weight_sync["stage_device"] == "cuda:0"  # the CUDA IPC stage on the trainer's GPU
        _assert_worker_is_trainer_cast(backend, policy)

        records = stack.source.train_batch(1, cfg.grpo.num_prompts_per_step)
        trajs, rm = run_group_rollouts(backend, stack.chat, stack.env, records, stack.settings_for(cfg, 1))
        assert rm["generated_tokens"] > 0
        slept = backend.sleep(2)
        assert slept["level"] == 2 and slept["gb_freed"] > 0
        _train_step(policy, cfg, trajs)
        with pytest.raises(RuntimeError, match="wake_up"):
            backend.update_weights(1, policy.named_released_tensors())
        woke = backend.wake_up()
        assert woke["level"] == 2 and woke["gb_restored"] == slept["gb_freed"]
        backend.update_weights(1, policy.named_released_tensors())
        _assert_worker_is_trainer_cast(backend, policy)

        os.kill(pid, signal.SIGKILL)  # between steps: the next generate restarts it on the stage's weights
        again, _ = run_group_rollouts(backend, stack.chat, stack.env, records, stack.settings_for(cfg, 2))
        assert all(t.num_generated > 0 for t in again)
        (event,) = backend.drain_events()
        assert event["recovered"] and backend.worker_pids() != [pid]
        assert backend.weight_version == 1
        _assert_worker_is_trainer_cast(backend, policy)  # version 1 from the stage, bitwise

        _train_step(policy, cfg, again)
        backend.update_weights(2, policy.named_released_tensors())  # through the re-opened stage
        _assert_worker_is_trainer_cast(backend, policy)
        assert backend.last_weight_sync["ranks"] == [{"ok": True, "version": 2, "valid": True, "probe_drift": None}]
    finally:
        stack.env.close()
        if backend is not None:
            backend.shutdown()


def test_job_command_one_step_in_a_worker_process(out):
    summary = main(["--config", str(ROOT / "configs/grpo_smoke.yaml"), *_overrides(out)])
    assert summary["trained_steps"] == 1
    rows = [json.loads(line) for line in (out / "logs" / "metrics.jsonl").read_text().splitlines()]
    (train,) = [r for r in rows if "train/loss" in r]
    assert 1.0 <= train["train/token_mult_prob_error"] < 1.5 and train["train/worker_failures"] == 0
    assert train["train/memory/sleep_gb_freed"] > 0 and train["performance/generation_tokens_per_s"] > 0

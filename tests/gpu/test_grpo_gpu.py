"""GRPO colocated on one CUDA GPU: trainer (fp32 masters, bf16 compute) and the in-process engine
(bf16, CUDA graphs, async scheduling, fused kernels) on the same device, taking turns. Skipped
without CUDA.

Model: ``builtin:tiny-random`` (the smoke config's random-weight tiny M3, built in seconds).
Checks: one GRPO step in-process (rollout -> train -> refit) with the engine's weights after the
refit bitwise equal to the trainer's bf16 cast of its masters (router gate and bias: the fp32
masters themselves); the mismatch metrics (token_mult_prob_error, gen_kl_error) with and without
routing replay; counted TFLOP/s; activation checkpointing on CUDA; the job's command line for one
step; a device index past the device count stops at start (exit 2). About a minute on an H200.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from m3_rollout.config import load_config  # noqa: E402
from m3_rollout.jobs.grpo import main  # noqa: E402
from m3_rollout.jobs.stack import build_generation_backend, build_rollout_stack  # noqa: E402
from m3_rollout.model import M3ForCausalLM, iter_released_tensors, tiny_config  # noqa: E402
from m3_rollout.rollout.group_rollout import run_group_rollouts  # noqa: E402
from m3_trainers.batch import TrainBatch  # noqa: E402
from m3_trainers.loss import ClippedPGLossFn  # noqa: E402
from m3_trainers.policy import Policy  # noqa: E402
from m3_trainers.step import build_loss_fn, build_policy, load_trainer_model, train_step_on_groups  # noqa: E402


def _overrides(out) -> list[str]:
    return [
        "cluster.device=cuda",
        "cluster.launcher=auto",
        "policy.generation.expert_parallel_size=1",
        "policy.precision=bfloat16",
        "policy.generation.enable_cuda_graphs=true",
        "policy.generation.kv_cache_memory_gb=1.0",
        "grpo.max_num_steps=1",
        "grpo.val_at_start=false",
        "grpo.val_at_end=false",
        "checkpointing.enabled=false",
        "logger.wandb_enabled=false",
        f"logger.log_dir={out}/logs",
        f"checkpointing.checkpoint_dir={out}/ckpt",
    ]


@pytest.fixture()
def out(tmp_path, monkeypatch):
    monkeypatch.setenv("M3_ROLLOUT_CACHE", str(tmp_path / "cache"))
    return tmp_path / "run"


@pytest.mark.parametrize("replay", [False, True])
def test_one_colocated_step_and_refit_is_the_trainers_bf16_cast(out, replay):
    cfg = load_config("configs/grpo_smoke.yaml", [*_overrides(out), f"policy.routing_replay={str(replay).lower()}"])
    stack = build_rollout_stack(cfg, with_backend=False)
    backend = None
    try:
        policy = build_policy(cfg, load_trainer_model(cfg, stack.model_dir), 1)
        backend = build_generation_backend(cfg, stack.model_dir, stack.chat, stack.max_len)
        engine = backend.engine
        assert policy.model.lm_head.weight.is_cuda and policy.model.lm_head.weight.dtype == torch.float32
        assert policy.compute.lm_head.weight.dtype == torch.bfloat16
        assert engine.device.type == "cuda" and engine.kv_dtype == torch.bfloat16 and engine.async_scheduling
        backend.update_weights(0, policy.named_released_tensors())

        records = stack.source.train_batch(1, cfg.grpo.num_prompts_per_step)
        trajs, rm = run_group_rollouts(backend, stack.chat, stack.env, records, stack.settings_for(cfg, 1))
        assert rm["generated_tokens"] > 0
        if replay:
            assert all(t.routed_experts is not None for t in trajs)
        # random weights earn no reward: train on fixed non-zero advantages so the step moves the weights
        adv = torch.tensor([1.0, -1.0] * (len(trajs) // 2))
        temperature = cfg.policy.generation.temperature
        initial_head = engine.model.lm_head.weight.detach().clone()
        res = train_step_on_groups(policy, build_loss_fn(cfg.loss_fn), trajs, cfg, temperature, advantages=adv)
        m = res.metrics
        assert not m["skipped_step"] and m["grad_norm"] > 0
        # bf16 engine vs bf16-compute trainer on the same GPU: close, not identical
        assert 1.0 <= m["token_mult_prob_error"] < 1.5 and 0.0 <= m["gen_kl_error"] < 0.1
        assert m["train_tflops_per_s"] > 0 and m["train_flops"] > 0 and m["train_step_seconds"] > 0
        if replay:
            assert m["routing_replay_coverage"] > 0.9
            assert 1.0 <= m["token_mult_prob_error_without_replay"] < 1.5
            assert m["gen_kl_error_without_replay"] >= 0.0

        backend.update_weights(1, policy.named_released_tensors())
        master = dict(policy.named_released_tensors())
        for name, t in iter_released_tensors(engine.model):
            assert t.is_cuda and torch.equal(t, master[name].to(t.dtype)), name
        # the update carried trained weights, not the initial ones
        assert not torch.equal(engine.model.lm_head.weight, initial_head)
        # the engine keeps generating (captured graphs read the updated storage)
        again, _ = run_group_rollouts(backend, stack.chat, stack.env, records[:1], stack.settings_for(cfg, 2))
        assert all(t.num_generated > 0 for t in again)
    finally:
        stack.env.close()
        if backend is not None:
            backend.shutdown()


def test_activation_checkpointing_on_cuda_matches_plain_backward():
    ids = torch.randint(0, 50, (4, 24), generator=torch.Generator().manual_seed(0))
    mask = torch.zeros(4, 24)
    mask[:, 8:] = 1
    batch = TrainBatch(ids, mask, torch.zeros(4, 24), torch.tensor([1.0, -1.0, 0.5, -0.5]), torch.full((4,), 24))
    grads = {}
    for ckpt in (False, True):
        torch.manual_seed(0)
        model = M3ForCausalLM(tiny_config(vocab_size=50, max_position_embeddings=128))
        kw = dict(device="cuda", compute_dtype=torch.bfloat16, activation_checkpointing=ckpt, max_grad_norm=1e9)
        policy = Policy(model, lr=1e-3, **kw)
        m = policy.train_step(batch, ClippedPGLossFn(), 1.0, 2)
        assert math.isfinite(m["loss"]) and m["train_tflops_per_s"] > 0
        grads[ckpt] = torch.cat([p.grad.flatten() for p in policy.model.parameters() if p.grad is not None])
    # bf16 recompute of the same inputs: the same gradient up to atomics' summation order
    rel = (grads[True] - grads[False]).norm() / grads[False].norm()
    assert grads[False].norm() > 0 and rel < 1e-2


def test_job_command_one_step_on_cuda_logs_mismatch_and_throughput(out):
    summary = main(["--config", "configs/grpo_smoke.yaml", *_overrides(out)])
    assert summary["trained_steps"] == 1
    rows = [json.loads(line) for line in (out / "logs" / "metrics.jsonl").read_text().splitlines()]
    (train,) = [r for r in rows if "train/loss" in r]
    assert 1.0 <= train["train/token_mult_prob_error"] < 1.5 and train["train/gen_kl_error"] >= 0.0
    assert train["performance/train_flops_per_gpu"] > 0 and train["performance/generation_tokens_per_s"] > 0


def test_device_index_past_the_count_exits_2_naming_the_key(out, capsys):
    bad = f"cluster.device=cuda:{torch.cuda.device_count()}"
    with pytest.raises(SystemExit) as exc:
        main(["--config", "configs/grpo_smoke.yaml", *_overrides(out), bad])
    assert exc.value.code == 2
    assert f"cluster.device='cuda:{torch.cuda.device_count()}'" in capsys.readouterr().err

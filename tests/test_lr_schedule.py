"""The LR schedule follows GRPO steps, not the optimizer steps that happened to run.

A GRPO step whose batch is short (failed samples left out, dynamic sampling or async GRPO short
of groups) runs fewer optimizer steps than nominal; the schedule (built over nominal optimizer
steps, ``total_optimizer_steps``) used to fall behind, ending above ``min_lr_ratio`` with a
stretched warmup. Now GRPO step k starts at position k x nominal (``schedule_position``), with
nominal row counts the LRs are the plain LambdaLR's bit for bit, and a resumed run continues them
(CPU, fp32, the training step driven directly on a small model).
"""

import pytest
import torch

from m3_rollout.config import load_config
from m3_rollout.model import M3ForCausalLM, tiny_config
from m3_rollout.rollout.trajectory import Trajectory
from m3_trainers.checkpoint import CheckpointManager
from m3_trainers.policy import lr_factor
from m3_trainers.step import (
    build_loss_fn,
    build_policy,
    optimizer_steps_per_grpo_step,
    schedule_position,
    total_optimizer_steps,
    train_step_on_groups,
)

LR, WARMUP, MIN_RATIO = 3e-4, 3, 0.1
PER_STEP = 4  # 2 prompts x 4 samples / global batch 2
SHORT = [8, 5, 8, 3]  # rows that generated in each of 4 GRPO steps (the rest failed)


def _cfg(schedule: str):
    return load_config(
        None,
        [
            "grpo.num_prompts_per_step=2",
            "grpo.num_generations_per_prompt=4",
            "policy.train_global_batch_size=2",
            "policy.train_micro_batch_size=2",
            f"policy.optimizer.lr={LR}",
            f"policy.scheduler.name={schedule}",
            f"policy.scheduler.warmup_steps={WARMUP}",
            f"policy.scheduler.min_lr_ratio={MIN_RATIO}",
        ],
    )


def _policy(cfg, steps: int, seed: int = 0):
    torch.manual_seed(seed)
    model = M3ForCausalLM(
        tiny_config(
            vocab_size=64,
            max_position_embeddings=64,
            num_hidden_layers=2,
            moe_layer_freq=[0, 1],
            sparse_attention_freq=[0, 1],
            sparse_disable_index_value=[0, 1],
        )
    )
    policy = build_policy(cfg, model, total_optimizer_steps(cfg, steps))
    seen = []  # the LR of every optimizer step, as train_step reads it
    train_step = policy.train_step

    def recording(*args, **kw):
        seen.append(policy.lr)
        return train_step(*args, **kw)

    policy.train_step = recording
    return policy, seen


def _trajs(step: int, rows: int) -> list[Trajectory]:
    """2 groups x 4 samples of 10 tokens (6 sampled); all but the first ``rows`` failed to generate."""
    g = torch.Generator().manual_seed(step)
    out = []
    for i in range(8):
        t = Trajectory(i // 4, i % 4, [], [], [], [], prompt_len=4)
        t.append(torch.randint(4, 64, (4,), generator=g).tolist(), generated=False)
        t.append(torch.randint(4, 64, (6,), generator=g).tolist(), generated=True, logprobs=[-3.0] * 6, version=0)
        t.reward = float(torch.rand((), generator=g) > 0.5)
        t.finish_reason = "stop" if i < rows else "error"
        out.append(t)
    return out


def _run(policy, cfg, rows, first: int = 0, index: bool = True) -> list[float]:
    """GRPO steps ``first``.. with ``rows`` rows each; returns each step's train/lr."""
    loss_fn = build_loss_fn(cfg.loss_fn)
    lrs = []
    for k, n in enumerate(rows, start=first):
        res = train_step_on_groups(policy, loss_fn, _trajs(k, n), cfg, 1.0, grpo_step_index=k if index else None)
        lrs.append(res.metrics["lr"])
    return lrs


@pytest.mark.parametrize("schedule", ["linear", "cosine"])
def test_short_steps_keep_the_schedule_on_grpo_steps(schedule):
    """Steps of 8, 5, 8, 3 rows run 4, 3, 4, 2 optimizer steps: each GRPO step still starts at
    lr_factor(k x 4) and the schedule ends at min_lr_ratio x lr after the last one (it used to
    end 3 positions short: 13 of 16)."""
    cfg = _cfg(schedule)
    assert optimizer_steps_per_grpo_step(cfg) == PER_STEP

    def lr_at(pos):
        return LR * lr_factor(pos, WARMUP, schedule, PER_STEP * len(SHORT), MIN_RATIO)

    policy, seen = _policy(cfg, len(SHORT))
    first = _run(policy, cfg, SHORT)
    assert first == [lr_at(k * PER_STEP) for k in range(len(SHORT))]  # train/lr of each GRPO step
    want = [[0, 1, 2, 3], [4, 5, 6], [8, 9, 10, 11], [12, 13]]
    assert [schedule_position(k, i, PER_STEP) for k, ps in enumerate(want) for i in range(len(ps))] == sum(want, [])
    assert seen == [lr_at(p) for p in sum(want, [])]
    assert policy.schedule_position == 16
    assert policy.lr == lr_at(16) == pytest.approx(MIN_RATIO * LR, rel=1e-12)
    assert seen[:3] == [lr_at(0), lr_at(1), lr_at(2)] and seen[3] == LR  # warmup: 3 nominal optimizer steps


@pytest.mark.parametrize("schedule", ["constant", "linear", "cosine"])
def test_nominal_steps_give_the_plain_lambda_lr_sequence_bit_for_bit(schedule):
    """Every step has its 8 rows: the LRs are exactly those of a LambdaLR stepped once per
    optimizer step (the schedule before it was tied to GRPO steps), and the weights equal those of
    the free-running path (``grpo_step_index=None``)."""
    cfg, steps = _cfg(schedule), 3
    total = total_optimizer_steps(cfg, steps)
    opt = torch.optim.AdamW([torch.zeros(1, requires_grad=True)], lr=LR)
    ref = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, WARMUP, schedule, total, MIN_RATIO))
    want = []
    for _ in range(total):
        want.append(opt.param_groups[0]["lr"])
        opt.step()
        ref.step()
    tied, seen = _policy(cfg, steps)
    free, seen_free = _policy(cfg, steps)
    _run(tied, cfg, [8] * steps)
    _run(free, cfg, [8] * steps, index=False)
    assert seen == want and seen_free == want and tied.lr == free.lr == opt.param_groups[0]["lr"]
    assert tied.schedule_position == free.schedule_position == ref.last_epoch == total
    assert all(torch.equal(a, b) for a, b in zip(tied.model.parameters(), free.model.parameters()))


def test_resume_mid_run_continues_the_lr_sequence(tmp_path):
    """Save after GRPO step 2 (a short step), load into a fresh policy, train steps 3 and 4: the
    same LRs (and weights) as the unbroken run."""
    cfg = _cfg("linear")
    whole, seen = _policy(cfg, len(SHORT))
    _run(whole, cfg, SHORT)
    split, seen_split = _policy(cfg, len(SHORT))
    _run(split, cfg, SHORT[:2])
    path = CheckpointManager(tmp_path).save(2, split, None, {}, {})
    resumed, seen_resumed = _policy(cfg, len(SHORT), seed=5)
    CheckpointManager.load(path, resumed)
    assert resumed.schedule_position == 2 * PER_STEP and resumed.lr == split.lr
    _run(resumed, cfg, SHORT[2:], first=2)
    assert seen_split + seen_resumed == seen
    assert all(torch.equal(a, b) for a, b in zip(whole.model.parameters(), resumed.model.parameters()))

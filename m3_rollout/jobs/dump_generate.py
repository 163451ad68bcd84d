"""Produce dumps without training: the GRPO loop's rollout phase only, one shard per step.

Governing idea: the same pieces the GRPO loop uses (``resolve_model``, the chat format, the
native backend, the environment, ``run_group_rollouts``, ``trajectory_advantages``) with the weights
fixed at the checkpoint (weight version 0), so a dump made here has the same schema and meaning
as one written during training.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from m3_rollout.config import MasterConfig, ignored_setting_warnings, to_dict
from m3_rollout.dump.records import checkpoint_hash, config_hash
from m3_rollout.dump.writer import RetentionPolicy, RolloutDumpWriter, sampling_params_of
from m3_rollout.jobs.outputs import empty_dump_dir
from m3_rollout.jobs.stack import RolloutStack, batch_seed, build_rollout_stack
from m3_rollout.jobs.step_metrics import rollout_metrics
from m3_rollout.rollout.group_rollout import run_group_rollouts
from m3_trainers.step import trajectory_advantages


def generate_dumps(
    cfg: MasterConfig, out_dir: str | None = None, num_steps: int | None = None, log=print
) -> list[Path]:
    """Roll out ``num_steps`` (default ``grpo.max_num_steps``) steps and write a shard for each.

    Args:
        cfg: ``MasterConfig``; its ``policy``, ``grpo`` sampling knobs, ``data`` and ``env`` are used.
        out_dir: dump directory (default ``rollout_dump.dir``); must be new or empty.

    Returns:
        the shard paths written.

    Raises:
        ConfigError: the dump directory is not empty or not writable (before anything is
            generated), or a bad setting found while building the rollout stack.
        KeyboardInterrupt: a Ctrl-C, re-raised with what is left in the dump directory
            (``interrupted_generate``).
    """
    g = cfg.grpo
    rd = cfg.rollout_dump
    dump_dir = empty_dump_dir(out_dir or rd.dir, "--dir" if out_dir else "rollout_dump.dir")
    steps = g.max_num_steps if num_steps is None else num_steps
    paths: list[Path] = []
    for warning in ignored_setting_warnings(cfg):  # the GRPO job logs the same lines
        log(warning)
    try:
        torch.manual_seed(g.seed)
        stack = build_rollout_stack(cfg)  # the GRPO loop's backend (EP service or in-process), env, prompts
        writer = RolloutDumpWriter(
            dump_dir,
            run_id=f"generate-{time.strftime('%Y%m%d-%H%M%S')}",
            retention=RetentionPolicy(rd.keep_last_n_steps, rd.max_bytes),
            decode=stack.chat.decode,
            checkpoint_hash=checkpoint_hash(stack.model_dir),
            config_hash=config_hash(to_dict(cfg)),
        )
        try:
            _roll_out(cfg, stack, writer, steps, log, paths)
        finally:
            stack.backend.shutdown()
            stack.env.close()
    except KeyboardInterrupt:  # m3_rollout.cli.load_entry prints the line and exits 130
        raise KeyboardInterrupt(interrupted_generate(dump_dir, paths, steps)) from None
    if writer.last_absent:
        log(
            f"columns left null (not recorded in this run): {', '.join(writer.last_absent)}; routed_experts "
            "is recorded with policy.routing_replay=true, block_selection with "
            "policy.generation.record_block_selection=true"
        )
    return paths


def interrupted_generate(dump_dir: Path, paths: list[Path], num_steps: int) -> str:
    """What a generate stopped by Ctrl-C left in ``dump_dir`` (``paths``: the shards it wrote), as
    the end of the ``interrupted:`` line. A shard is written whole or not at all (tmp + rename; the
    step in progress leaves nothing), so the shards there are a valid dump, of fewer steps."""
    kept = [p for p in paths if p.exists()]  # retention may have deleted older ones
    if not kept:
        return f"no step was dumped ({dump_dir} holds no shard)"
    return (
        f"{len(paths)} of the {num_steps} steps were dumped to {dump_dir} ({', '.join(p.name for p in kept)}): each "
        "shard is whole and readable, the step in progress was not written; a new generate needs an empty --dir"
    )


def _roll_out(
    cfg: MasterConfig, stack: RolloutStack, writer: RolloutDumpWriter, num_steps: int, log, paths: list[Path]
) -> list[Path]:
    """Steps 1..num_steps: roll out the step's prompt batch, write its shard (appended to ``paths``
    as it is written, so a Ctrl-C knows what is kept)."""
    g = cfg.grpo
    chat, backend, env, source, settings = stack.chat, stack.backend, stack.env, stack.source, stack.settings
    for step in range(1, num_steps + 1):
        seed = batch_seed(cfg, step)  # the GRPO loop's per-step seed
        trajs, rm = run_group_rollouts(
            backend, chat, env, source.train_batch(step, g.num_prompts_per_step), stack.settings_for(cfg, step)
        )
        rewards = torch.tensor([t.reward for t in trajs])
        adv = trajectory_advantages(trajs, g)
        metrics = {
            "reward": rollout_metrics(trajs, rewards)["reward"],  # the GRPO loop's names and figures (docs/metrics.md)
            "timing/train/generation": rm["rollout_seconds"],
            "performance/generation_tokens_per_s": rm["generation_tokens_per_s"],
        }
        paths.append(writer.write_step(step, trajs, adv, sampling_params_of(settings, seed), metrics))
        log(f"step {step}: {len(trajs)} trajectories, reward {metrics['reward']:.3f} -> {paths[-1]}")
    return paths

"""Produce dumps without training: the GRPO loop's rollout phase only, one shard per step.

Governing idea: the same pieces the GRPO loop uses (``resolve_model``, the chat format, the
native backend, the environment, ``run_group_rollouts``, ``group_advantages``) with the weights
fixed at the checkpoint (weight version 0), so a dump made here has the same schema and meaning
as one written during training.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from m3_rollout.dump.writer import RetentionPolicy, RolloutDumpWriter, sampling_params_of


def generate_dumps(cfg, out_dir: str | None = None, num_steps: int | None = None, log=print) -> list[Path]:
    """Roll out ``num_steps`` (default ``grpo.max_num_steps``) steps and write a shard for each.

    Args:
        cfg: ``MasterConfig``; its ``policy``, ``grpo`` sampling knobs, ``data`` and ``env`` are used.
        out_dir: dump directory (default ``rollout_dump.dir``).

    Returns:
        the shard paths written.
    """
    from transformers import AutoTokenizer

    from m3_rollout.builtin import resolve_model
    from m3_rollout.chat.template import ChatFormat
    from m3_rollout.config import to_dict
    from m3_rollout.dump.records import checkpoint_hash, config_hash
    from m3_rollout.engine.native_backend import NativeBackend
    from m3_rollout.model import load_checkpoint
    from m3_rollout.rollout.data import PromptSource, load_jsonl
    from m3_rollout.rollout.environments import build_environment
    from m3_rollout.rollout.environments.calculator import ArithmeticTask
    from m3_rollout.rollout.group_rollout import RolloutSettings, run_group_rollouts
    from trainers.advantages import group_advantages

    g, p, gen, d = cfg.grpo, cfg.policy, cfg.policy.generation, cfg.data
    torch.manual_seed(g.seed)
    model_dir, _ = resolve_model(p.model_name, progress=cfg.logger.progress_bar)
    chat = ChatFormat(AutoTokenizer.from_pretrained(str(model_dir)), thinking_mode=p.thinking_mode)
    model = load_checkpoint(model_dir, dtype=torch.float32).cast_for_inference(getattr(torch, gen.dtype))
    max_len = min(p.max_total_sequence_length, model.config.max_position_embeddings)
    backend = NativeBackend(model, chat.stop_token_ids, max_model_len=max_len, max_num_seqs=gen.max_num_seqs,
                            detokenize=chat.decode, **gen.engine_kwargs())
    env = build_environment(cfg.env)
    source = PromptSource(ArithmeticTask(d.min_digits, d.max_digits, d.operations) if d.source == "calculator" else None,
                          g.seed, g.num_val_prompts, records=load_jsonl(d.path) if d.source == "jsonl" else None)
    rd = cfg.rollout_dump
    writer = RolloutDumpWriter(out_dir or rd.dir, run_id=f"generate-{time.strftime('%Y%m%d-%H%M%S')}",
                               retention=RetentionPolicy(rd.keep_last_n_steps, rd.max_bytes), decode=chat.decode,
                               checkpoint_hash=checkpoint_hash(model_dir), config_hash=config_hash(to_dict(cfg)))
    settings = RolloutSettings(n=g.num_generations_per_prompt, max_turns=g.max_rollout_turns, max_total_len=max_len,
                               max_new_tokens=gen.max_new_tokens, temperature=gen.temperature, top_p=gen.top_p,
                               top_k=gen.top_k, logprobs_mode=gen.logprobs_mode,
                               mask_truncated_turns=cfg.env.mask_truncated_turns)
    paths = []
    for step in range(1, (g.max_num_steps if num_steps is None else num_steps) + 1):
        seed = g.seed * 100_003 + step  # the GRPO loop's per-step seed
        trajs, rm = run_group_rollouts(backend, chat, env, source.train_batch(step, g.num_prompts_per_step),
                                       RolloutSettings(**{**vars(settings), "seed": seed}))
        rewards = torch.tensor([t.reward for t in trajs])
        adv = group_advantages(rewards, torch.tensor([t.group_index for t in trajs]), g.normalize_rewards,
                               g.use_leave_one_out_baseline)
        metrics = {"reward_mean": float(rewards.mean()), "rollout_seconds": rm["rollout_seconds"],
                   "generation_tokens_per_s": rm["generation_tokens_per_s"]}
        paths.append(writer.write_step(step, trajs, adv, sampling_params_of(settings, seed), metrics))
        log(f"step {step}: {len(trajs)} trajectories, reward {metrics['reward_mean']:.3f} -> {paths[-1]}")
    if writer.last_absent:
        log(f"columns left null (the Trajectory does not carry them yet): {', '.join(writer.last_absent)}")
    return paths

"""``python -m m3_rollout.grpo --config configs/grpo_bf16_ep.yaml [key=value ...]``

The GRPO loop (design.md §2, synchronous form): sample prompts -> group rollouts with tool use
(bf16 generator) -> rewards -> group-normalised advantages -> clipped policy-gradient step on
fp32 master weights -> in-place weight update of the generator -> log; held-out accuracy at step
0, every ``grpo.val_period`` steps and at the end; final checkpoint saved.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from m3_rollout.builtin import resolve_model
from m3_rollout.chat.template import ChatFormat
from m3_rollout.config import ConfigError, MasterConfig, load_config, to_dict
from m3_rollout.engine.simple_backend import SimpleGenerationBackend
from m3_rollout.metrics_logger import MetricsLogger
from m3_rollout.model import load_checkpoint, save_checkpoint
from m3_rollout.rollout.data import PromptSource, load_jsonl
from m3_rollout.rollout.environments.calculator import ArithmeticTask, CalculatorEnvironment
from m3_rollout.rollout.group_rollout import RolloutSettings, run_group_rollouts
from m3_rollout.rollout.trajectory import Trajectory
from trainers.advantages import group_advantages
from trainers.batch import batch_from_trajectories
from trainers.loss import ClippedPGLossFn
from trainers.policy import Policy

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


def set_seed(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def format_sample(t: Trajectory, chat: ChatFormat) -> str:
    """One trajectory as readable text: the generated turns and tool turns after the prompt."""
    return chat.decode(t.token_ids[t.prompt_len:]).replace("\n", "\\n")


def evaluate(backend, chat, env, records, cfg: MasterConfig, seed: int) -> dict:
    """Held-out accuracy: one sample per prompt at ``grpo.val_temperature``."""
    gen = cfg.policy.generation
    settings = RolloutSettings(n=1, max_turns=cfg.grpo.max_rollout_turns,
                               max_total_len=cfg.policy.max_total_sequence_length,
                               max_new_tokens=gen.max_new_tokens, temperature=cfg.grpo.val_temperature,
                               seed=seed, logprobs_mode=gen.logprobs_mode)
    trajs, m = run_group_rollouts(backend, chat, env, records, settings)
    return {"accuracy": sum(t.reward for t in trajs) / len(trajs),
            "tool_call_rate": sum(1 for t in trajs if t.tool_calls) / len(trajs),
            "seconds": m["rollout_seconds"]}


def save_final(policy: Policy, src_dir: Path, out_dir: Path, step: int) -> Path:
    """Write the trained weights + tokenizer files as a checkpoint directory (tmp + rename)."""
    final = out_dir / f"step_{step}"
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=final.name + ".tmp-", dir=out_dir))
    save_checkpoint(policy.model, policy.model.config, tmp)
    for name in TOKENIZER_FILES:
        if (src_dir / name).is_file():
            shutil.copy(src_dir / name, tmp / name)
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    return final


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/grpo_bf16_ep.yaml", help="YAML config")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. grpo.max_num_steps=5")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
    except (ConfigError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2)
    return run(cfg)


def run(cfg: MasterConfig) -> dict:
    """Run the GRPO job described by ``cfg``; returns the run summary (also written to
    ``<logger.log_dir>/summary.json``)."""
    t_start = time.perf_counter()
    set_seed(cfg.grpo.seed)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    g, p, gen = cfg.grpo, cfg.policy, cfg.policy.generation

    model_dir, info = resolve_model(p.model_name, progress=cfg.logger.progress_bar)
    if info.get("built"):
        print(f"built checkpoint {model_dir} in {info['build_seconds']:.1f} s "
              f"(held-out accuracy {info.get('heldout_accuracy', float('nan')):.3f})")
    else:
        print(f"using checkpoint {model_dir}" + (f" (cached build of {info['build_seconds']:.1f} s)"
                                                 if "build_seconds" in info else ""))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    chat = ChatFormat(tokenizer, thinking_mode=p.thinking_mode)
    train_model = load_checkpoint(model_dir, dtype=getattr(torch, p.precision))
    gen_model = load_checkpoint(model_dir, dtype=torch.float32).cast_for_inference(getattr(torch, gen.dtype))
    max_len = min(p.max_total_sequence_length, train_model.config.max_position_embeddings)
    backend = SimpleGenerationBackend(gen_model, chat.stop_token_ids, max_model_len=max_len,
                                      max_num_seqs=gen.max_num_seqs)
    policy = Policy(train_model, lr=p.optimizer.lr, weight_decay=p.optimizer.weight_decay,
                    betas=(p.optimizer.beta1, p.optimizer.beta2), eps=p.optimizer.eps,
                    max_grad_norm=p.max_grad_norm, freeze_indexer=p.freeze.indexer,
                    freeze_router_bias=p.freeze.router_bias)
    backend.update_weights(0, policy.named_released_tensors())  # generator == trainer weights at step 0
    loss_fn = ClippedPGLossFn(cfg.loss_fn.ratio_clip_min, cfg.loss_fn.ratio_clip_max, cfg.loss_fn.token_level_loss)
    env = CalculatorEnvironment(cfg.env.calculator.max_expression_chars)
    d = cfg.data
    task = ArithmeticTask(d.min_digits, d.max_digits, d.operations)
    source = PromptSource(task if d.source == "calculator" else None, g.seed, g.num_val_prompts,
                          records=load_jsonl(d.path) if d.source == "jsonl" else None)
    logger = MetricsLogger(cfg.logger, to_dict(cfg), write=tqdm.write)
    settings = RolloutSettings(n=g.num_generations_per_prompt, max_turns=g.max_rollout_turns,
                               max_total_len=max_len, max_new_tokens=gen.max_new_tokens,
                               temperature=gen.temperature, top_p=gen.top_p, top_k=gen.top_k,
                               logprobs_mode=gen.logprobs_mode)
    val_seed = g.seed + 17
    history: list[tuple[int, float]] = []

    def validate(step: int) -> None:
        v = evaluate(backend, chat, env, source.val, cfg, val_seed)
        history.append((step, v["accuracy"]))
        logger.log(v, step, prefix="val/")
        logger.text(f"[val] step {step}: held-out accuracy {v['accuracy']:.3f} "
                    f"(tool-call rate {v['tool_call_rate']:.2f}, {len(source.val)} prompts, {v['seconds']:.1f} s)")

    if g.val_at_start:
        validate(0)
    t_loop = time.perf_counter()
    bar = tqdm(range(1, g.max_num_steps + 1), desc="GRPO", unit="step", disable=not cfg.logger.progress_bar)
    for step in bar:
        t0 = time.perf_counter()
        records = source.train_batch(step, g.num_prompts_per_step)
        trajs, rm = run_group_rollouts(backend, chat, env, records,
                                       RolloutSettings(**{**settings.__dict__, "seed": g.seed * 100_003 + step}))
        rewards = torch.tensor([t.reward for t in trajs])
        groups = torch.tensor([t.group_index for t in trajs])
        adv = group_advantages(rewards, groups, g.normalize_rewards, g.use_leave_one_out_baseline)
        batch = batch_from_trajectories(trajs, adv, pad_id=tokenizer.pad_token_id or 0)
        t_train = time.perf_counter()
        tm = {}
        gbs = p.train_global_batch_size
        prev = policy.get_logprobs(batch, gen.temperature, p.train_micro_batch_size) if gbs < len(trajs) else None
        for s in range(0, len(trajs), gbs):
            mb = batch.slice(slice(s, s + gbs))
            tm = policy.train_step(mb, loss_fn, gen.temperature, p.train_micro_batch_size,
                                   None if prev is None else prev[s:s + gbs, :mb.token_ids.shape[1]])
        t_sync = time.perf_counter()
        backend.update_weights(step, policy.named_released_tensors())
        backend.reset_prefix_cache()
        t_end = time.perf_counter()
        metrics = {"reward_mean": float(rewards.mean()), "accuracy": float((rewards > 0.5).float().mean()),
                   "tool_call_rate": sum(1 for t in trajs if t.tool_calls) / len(trajs),
                   "mean_generated_tokens": sum(t.num_generated for t in trajs) / len(trajs),
                   "truncated_fraction": sum(1 for t in trajs if t.finish_reason == "length") / len(trajs),
                   "generation_tokens_per_s": rm["generation_tokens_per_s"],
                   "rollout_seconds": rm["rollout_seconds"], "train_seconds": t_sync - t_train,
                   "weight_sync_seconds": t_end - t_sync, "step_seconds": t_end - t0, **tm}
        logger.log(metrics, step, prefix="train/")
        bar.set_postfix(reward=f"{metrics['reward_mean']:.3f}", mult_err=f"{tm['token_mult_prob_error']:.4f}")
        logger.text(f"[train] step {step}: reward {metrics['reward_mean']:.3f}  loss {tm['loss']:+.4f}  "
                    f"token_mult_prob_error {tm['token_mult_prob_error']:.4f}  "
                    f"gen {metrics['generation_tokens_per_s']:.0f} tok/s  step {metrics['step_seconds']:.1f} s")
        if cfg.logger.print_sample_every and step % cfg.logger.print_sample_every == 0:
            t = trajs[0]
            logger.text(f"[sample] step {step} reward {t.reward:.0f}: {format_sample(t, chat)}")
        if step % g.val_period == 0 and step != g.max_num_steps:
            validate(step)
    bar.close()
    if g.val_at_end and g.max_num_steps > 0:
        validate(g.max_num_steps)
    loop_seconds = time.perf_counter() - t_loop
    final_dir = None
    if cfg.checkpointing.enabled and cfg.checkpointing.save_final:
        final_dir = save_final(policy, model_dir, Path(cfg.checkpointing.checkpoint_dir), g.max_num_steps)
        logger.text(f"saved final checkpoint to {final_dir}")
    summary = {"model_dir": str(model_dir), "build_seconds": info.get("build_seconds"), "built_now": info.get("built"),
               "grpo_seconds": round(loop_seconds, 1), "total_seconds": round(time.perf_counter() - t_start, 1),
               "val_history": history, "final_checkpoint": str(final_dir) if final_dir else None,
               "accuracy_start": history[0][1] if history else None,
               "accuracy_end": history[-1][1] if history else None}
    if len(history) >= 2:
        summary["accuracy_gain"] = history[-1][1] - history[0][1]
        logger.text(f"held-out accuracy {history[0][1]:.3f} -> {history[-1][1]:.3f} "
                    f"(gain {summary['accuracy_gain']:+.3f}) in {loop_seconds:.0f} s of GRPO")
    (Path(cfg.logger.log_dir) / "summary.json").write_text(json.dumps(summary, indent=1))
    logger.close()
    return summary


if __name__ == "__main__":
    main()

"""What the GRPO loop logs per step and per validation, under NeMo RL's names (docs/metrics.md).

Governing idea: one name per quantity, and it is NeMo RL's where NeMo RL logs the same quantity,
so a dashboard built for NeMo RL reads this project's runs. The groups are NeMo RL's: ``train/``
(rollout, advantage and loss figures), ``timing/train/`` (seconds of the step's phases),
``performance/`` (throughput), ``validation/`` and ``timing/validation/``. Quantities NeMo RL does
not log keep this project's names inside those groups. ``logged_metric_names`` lists every name a
configuration logs, so a ``checkpointing.metric_name`` that names none of them stops the run at
start; ``RENAMED`` maps the names of earlier runs' logs to the current ones.
"""

from __future__ import annotations

import torch

from m3_rollout.config import ConfigError, MasterConfig
from m3_rollout.rollout.trajectory import Trajectory
from m3_trainers.advantages import generated_mask

#: Policy.train_step / train_step_on_groups timing keys -> their ``timing/train/`` names.
TRAINER_TIMINGS = {
    "logprob_seconds": "policy_and_reference_logprobs",
    "train_seconds": "policy_training",
    "train_step_seconds": "train_step",
}
#: Trainer keys logged under ``performance/`` (train_tflops_per_s is TFLOP/s of the one trainer device).
TRAINER_PERFORMANCE = {"train_tflops_per_s": "train_flops_per_gpu"}

#: Logged names of earlier versions of this loop -> the current names.
RENAMED = {
    "train/reward_mean": "train/reward",
    "train/truncated_fraction": "train/truncation_rate",
    "train/mean_generated_tokens": "train/mean_gen_tokens_per_sample",
    "train/mean_sequence_length": "train/mean_total_tokens_per_sample",
    "train/ratio_mean": "train/probs_ratio",
    "train/ratio_max": "train/probs_ratio_max",
    "train/reference_kl": "train/kl_penalty",
    "train/is_weight_mean": "train/sampling_importance_ratio",
    "train/is_dropped_fraction": "train/is_oob_ratio",
    "train/step_seconds": "timing/train/total_step_time",
    "train/generation_seconds": "timing/train/generation",
    "train/rollout_seconds": "timing/train/generation",
    "train/wait_for_groups_seconds": "timing/train/exposed_generation",
    "train/logprob_seconds": "timing/train/policy_and_reference_logprobs",
    "train/train_seconds": "timing/train/policy_training",
    "train/train_step_seconds": "timing/train/train_step",
    "train/weight_sync_seconds": "timing/train/prepare_for_generation/transfer_and_update_weights",
    "train/timing/sleep_seconds": "timing/train/finish_generation",
    "train/timing/wake_seconds": "timing/train/prepare_for_generation/wake_up",
    "train/timing/wake_graph_capture_seconds": "timing/train/prepare_for_generation/graph_capture",
    "train/train_tflops_per_s": "performance/train_flops_per_gpu",
    "train/generation_tokens_per_s": "performance/generation_tokens_per_s",
    "train/train_tokens_per_s": "performance/train_tokens_per_s",
    "train/step_tokens_per_s": "performance/step_tokens_per_s",
    "val/accuracy": "validation/accuracy",
    "val/tool_call_rate": "validation/tool_call_rate",
    "val/reward_errors": "validation/reward_errors",
    "val/seconds": "timing/validation/total_validation_time",
}


def reward_errors(trajs: list[Trajectory]) -> list[str]:
    """The reward-function errors of ``trajs`` (``info["reward_error"]``, set by the environment
    when its reward function raised or returned a non-finite value; those rewards are 0)."""
    return [t.info["reward_error"] for t in trajs if t.info.get("reward_error")]


def generation_errors(trajs: list[Trajectory]) -> list[str]:
    """The generation errors of ``trajs`` (``Trajectory.failed``, finish_reason "error": the backend
    refused or lost a request, e.g. a prompt with no room under max_model_len; ``info["error"]``
    says why). Such a trajectory's reward 0 is a placeholder: it trains nothing, gets advantage 0
    and is left out of its group's advantage statistics (``m3_trainers.advantages``) and of the
    ``train/`` reward figures (``rollout_metrics``); validation counts it as wrong."""
    return [t.info.get("error") or "generation failed" for t in trajs if t.failed]


def rollout_metrics(trajs: list[Trajectory], rewards: torch.Tensor) -> dict:
    """Reward and response statistics of one step's trajectories (``train/``): reward (mean),
    reward_std, accuracy (fraction > 0.5), tool_call_rate, mean_gen_tokens_per_sample,
    mean_total_tokens_per_sample (prompt, generated and tool tokens), truncation_rate (fraction
    cut by a token limit), reward_errors and generation_errors (counts).

    The three reward figures are over the samples that generated (``generated_mask``), the ones
    whose rewards the advantages use: a failed sample's reward 0 is a placeholder, counted in
    generation_errors instead (0.0 when every sample failed). The other figures are over all samples.

    Args:
        trajs: the step's N trajectories. rewards: float [N], ``trajs``' rewards.
    """
    n = len(trajs)
    r = rewards[generated_mask(trajs)]
    return {
        "reward": float(r.mean()) if r.numel() else 0.0,
        "reward_std": float(r.std()) if r.numel() > 1 else 0.0,
        "accuracy": float((r > 0.5).float().mean()) if r.numel() else 0.0,
        "tool_call_rate": sum(1 for t in trajs if t.tool_calls) / n,
        "mean_gen_tokens_per_sample": sum(t.num_generated for t in trajs) / n,
        "mean_total_tokens_per_sample": sum(len(t.token_ids) for t in trajs) / n,
        "truncation_rate": sum(1 for t in trajs if t.finish_reason == "length") / n,
        "reward_errors": len(reward_errors(trajs)),
        "generation_errors": len(generation_errors(trajs)),
    }


def advantage_metrics(advantages: torch.Tensor, loss_mask: torch.Tensor) -> dict:
    """advantages/mean, /std, /min, /max over the trained tokens (NeMo RL's definition: each
    sample's advantage once per token with loss mask 1; std is the population std). All 0 when no
    token is trained. A failed sample (``Trajectory.failed``) has no trained token, so its
    advantage 0 is not in these figures.

    Args:
        advantages: float [N] per sample. loss_mask: [N, L] of the trained batch.
    """
    per_token = advantages.double().repeat_interleave(loss_mask.bool().sum(-1).cpu())
    if per_token.numel() == 0:
        return {f"advantages/{k}": 0.0 for k in ("mean", "std", "min", "max")}
    return {
        "advantages/mean": float(per_token.mean()),
        "advantages/std": float(per_token.std(correction=0)),
        "advantages/min": float(per_token.min()),
        "advantages/max": float(per_token.max()),
    }


def bitwise_on_policy(train_metrics: dict) -> float:
    """``train/bitwise_on_policy`` (batch-invariant mode, issue 24: equal, not close): 1.0 when the
    trainer's prev logprobs equal the rollout's at every sampled token, else 0.0.

    Read from ``max_logprob_abs_diff`` (an exact max of |prev - rollout|, NaN when either is NaN),
    not from ``token_mult_prob_error`` == 1 / ``gen_kl_error`` == 0: those are fp64 means whose
    sums absorb a one-ulp difference of a near-certain token (|d| ~ 1e-13 at logprob -1e-6 vanishes
    against a few thousand tokens' 1.0 terms, and exp(d) - 1 - d rounds to 0 for |d| < ~1e-8).
    """
    return float(train_metrics["max_logprob_abs_diff"] == 0.0 and train_metrics["token_mult_prob_error"] == 1.0)


def handoff_metrics(phase: str, record: dict) -> tuple[dict, dict]:
    """(``timing/train/`` seconds, ``train/`` memory figures) of one memory-handoff transition
    (``LLMEngine.sleep`` / ``wake_up`` records). Sleep is NeMo RL's ``finish_generation``; wake-up
    is part of its ``prepare_for_generation`` (``.../wake_up``, ``.../graph_capture``)."""
    if phase == "sleep":
        timing = {"finish_generation": record["seconds"]}
    else:
        timing = {"prepare_for_generation/wake_up": record["seconds"]}
        if "graph_capture_seconds" in record:
            timing["prepare_for_generation/graph_capture"] = record["graph_capture_seconds"]
    memory = {f"memory/{phase}_{k}": v for k, v in record.items() if k.startswith("gb_")}
    return timing, memory


def validation_metrics(trajs: list[Trajectory], seconds: float) -> dict:
    """``validation/`` and ``timing/validation/`` figures of a held-out evaluation (one sample per
    prompt): accuracy (mean reward, NeMo RL's), avg_length (mean generated tokens), tool_call_rate,
    reward_errors, generation_errors; total_validation_time (seconds). Unlike ``train/reward``,
    accuracy and avg_length are over every prompt: a sample that failed to generate counts as
    wrong (reward 0) and as 0 tokens."""
    n = len(trajs)
    return {
        "validation/accuracy": sum(t.reward for t in trajs) / n,
        "validation/avg_length": sum(t.num_generated for t in trajs) / n,
        "validation/tool_call_rate": sum(1 for t in trajs if t.tool_calls) / n,
        "validation/reward_errors": len(reward_errors(trajs)),
        "validation/generation_errors": len(generation_errors(trajs)),
        "timing/validation/total_validation_time": seconds,
    }


_TRAINER = (
    "loss pg_loss kl_loss grad_norm lr token_mult_prob_error gen_kl_error policy_kl_error js_divergence_error "
    "max_logprob_abs_diff probs_ratio probs_ratio_clamped probs_ratio_min probs_ratio_max clip_fraction "
    "dual_clip_fraction kl_penalty sampling_importance_ratio is_oob_ratio approx_entropy entropy num_tokens "
    "skipped_step train_flops logprob_flops"
).split()
_LOOP = (
    "reward reward_std accuracy tool_call_rate mean_gen_tokens_per_sample mean_total_tokens_per_sample "
    "truncation_rate reward_errors generation_errors advantages/mean advantages/std advantages/min advantages/max "
    "worker_failures worker_failures_recovered num_groups mean_group_age max_group_age stale_groups_dropped "
    "stale_groups_dropped_total group_wait_timed_out skipped_steps_total"
).split()
_TIMING = (
    "total_step_time generation exposed_generation policy_and_reference_logprobs policy_training train_step "
    "prepare_for_generation/transfer_and_update_weights"
).split()
_PERFORMANCE = "train_flops_per_gpu generation_tokens_per_s train_tokens_per_s step_tokens_per_s".split()
_VALIDATION = (
    "validation/accuracy",
    "validation/avg_length",
    "validation/tool_call_rate",
    "validation/reward_errors",
    "validation/generation_errors",
    "timing/validation/total_validation_time",
)
_MISMATCH = ("token_mult_prob_error", "gen_kl_error", "policy_kl_error", "js_divergence_error", "max_logprob_abs_diff")


def logged_metric_names(cfg: MasterConfig) -> set[str]:
    """Every metric name a GRPO run with ``cfg`` logs at a training step or a validation (both
    are what a checkpoint records for ``checkpointing.metric_name``)."""
    g, gen = cfg.grpo, cfg.policy.generation
    train = set(_TRAINER) | set(_LOOP)
    if g.overlong_filtering:
        train.add("overlong_filtered")
    if cfg.policy.routing_replay:
        train |= {"routing_replay_coverage", *(f"{k}_without_replay" for k in _MISMATCH)}
    if cfg.policy.index_replay:
        train |= {f"{k}_without_replay" for k in _MISMATCH}
    if gen.record_block_selection:
        # also msa_selection_agreement/layer_{i} and msa_selection_overlap/layer_{i} per sparse
        # layer i of the model (not listed: they depend on the checkpoint, not on cfg)
        train |= {"msa_selection_coverage", "msa_selection_agreement", "msa_selection_overlap"}
    if gen.batch_invariant:
        train.add("bitwise_on_policy")
    if g.use_dynamic_sampling:
        train |= {"dynamic_sampling_gen_batches", "dynamic_sampling_dropped_groups"}
    if g.async_grpo.enabled:
        train.add("skipped_no_groups")  # a step whose groups did not arrive in time
    timing = set(_TIMING)
    if gen.sleep_level:
        timing |= {"finish_generation", "prepare_for_generation/wake_up", "prepare_for_generation/graph_capture"}
        train |= {"memory/sleep_gb_freed", "memory/wake_gb_restored"}
    names = {f"train/{k}" for k in train} | {f"timing/train/{k}" for k in timing}
    names |= {f"performance/{k}" for k in _PERFORMANCE}
    if g.val_at_start or (g.val_at_end and g.max_num_steps > 0) or g.val_period < g.max_num_steps:
        names |= set(_VALIDATION)
    return names


def resolve_metric_name(cfg: MasterConfig) -> str | None:
    """``checkpointing.metric_name`` as a logged name: NeMo RL's ``val:NAME`` / ``train:NAME``
    become ``validation/NAME`` / ``train/NAME``; None stays None (``keep_top_k`` keeps the newest
    checkpoints, as NeMo RL does).

    A validation metric of a run that never validates is accepted while nothing ranks by it
    (``keep_top_k`` null); NeMo RL warns at the first save in that case.

    Raises:
        ConfigError: the name is not one this configuration logs (``logged_metric_names``); the
            message says what an old name is called now, or lists the close names.
    """
    name = cfg.checkpointing.metric_name
    if name is None:
        return None
    prefix, sep, rest = name.partition(":")
    if sep and prefix in ("val", "train"):
        name = ("validation/" if prefix == "val" else "train/") + rest
    names = logged_metric_names(cfg)
    if name in names:
        return name
    key = f"checkpointing.metric_name={cfg.checkpointing.metric_name!r}"
    if name in _VALIDATION:  # a validation metric of a run that never validates
        if cfg.checkpointing.keep_top_k is None:
            return name  # recorded in no checkpoint, and nothing ranks by it
        raise ConfigError(
            f"{key}: this run never validates (grpo.val_at_start, val_at_end false and grpo.val_period > "
            f"max_num_steps), so checkpointing.keep_top_k={cfg.checkpointing.keep_top_k} could not rank by it; "
            f"validate, or rank by a train/ metric"
        )
    if name in RENAMED:
        raise ConfigError(f"{key}: that metric is now logged as {RENAMED[name]!r} (docs/metrics.md)")
    import difflib

    close = difflib.get_close_matches(name, sorted(names), n=3, cutoff=0.5)
    hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    raise ConfigError(f"{key} names no metric this run logs{hint} (the names are listed in docs/metrics.md)")

"""One GRPO training step on a step's trajectories, and the trainer pieces it runs with, from config.

Governing idea: the live GRPO loop (``m3_rollout.jobs.grpo``) and the offline replay
(``python -m m3_rollout.dump replay --train``) train through this one function, so a step means the
same thing in both: advantages (design.md §2 step 4; failed samples left out of their groups'
statistics) -> failed samples and (optionally) overlong ones out of the loss -> padded
``TrainBatch`` -> logprobs before the first update (and the reference's) when the batch spans
several optimizer steps -> one ``Policy.train_step`` per ``policy.train_global_batch_size`` slice
-> the slices' metrics combined by :func:`combine_optimizer_steps`.

LR schedule: its position (``m3_trainers.policy.lr_factor``'s ``step``) counts nominal optimizer
steps, ``optimizer_steps_per_grpo_step`` per GRPO step, and is tied to the GRPO step index
(:func:`schedule_position`): a step that trains fewer rows than nominal (failed samples left out,
dynamic sampling or async GRPO short of groups) runs fewer optimizer steps but the next step still
starts at its own position, so warmup ends and the decay reaches its end value after the GRPO
steps the schedule was built for, whatever the row counts.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from m3_rollout.config import GRPOConfig, LossConfig, MasterConfig, check_devices
from m3_rollout.rollout.trajectory import Trajectory
from m3_trainers.advantages import apply_overlong_filter, generated_mask, group_advantages, mask_failed
from m3_trainers.batch import TrainBatch, batch_from_trajectories
from m3_trainers.loss import ClippedPGLossFn
from m3_trainers.policy import Policy, mismatch_metrics
from m3_trainers.selection_replay import SelectionAgreement


def optimizer_steps_per_grpo_step(cfg: MasterConfig) -> int:
    """Optimizer steps of one GRPO step: samples per step / ``policy.train_global_batch_size`` (>= 1)."""
    g = cfg.grpo
    return max(1, (g.num_prompts_per_step * g.num_generations_per_prompt) // cfg.policy.train_global_batch_size)


def total_optimizer_steps(cfg: MasterConfig, num_grpo_steps: int) -> int:
    """Nominal optimizer steps of ``num_grpo_steps`` GRPO steps: the LR schedule's ``total_steps``,
    the position it reaches after the last GRPO step (:func:`schedule_position`)."""
    return num_grpo_steps * optimizer_steps_per_grpo_step(cfg)


def schedule_position(grpo_step_index: int, opt_step: int, per_grpo_step: int) -> int:
    """LR-schedule position (``lr_factor``'s ``step``) of optimizer step ``opt_step`` (0-based) of
    GRPO step ``grpo_step_index`` (0-based), with ``per_grpo_step`` nominal optimizer steps per GRPO
    step (``optimizer_steps_per_grpo_step``).

    GRPO step k owns positions k x per_grpo_step .. (k+1) x per_grpo_step - 1: its i-th optimizer
    step is at k x per_grpo_step + i, held at the last of them should a step run more optimizer
    steps than nominal. A step with fewer rows uses the first positions of its share and leaves the
    rest unused; after it the schedule is at (k+1) x per_grpo_step (``train_step_on_groups``).
    With nominal row counts this is the optimizer-step count itself.
    """
    return grpo_step_index * per_grpo_step + min(opt_step, per_grpo_step - 1)


def trainer_device(cfg: MasterConfig) -> torch.device:
    """``cluster.device`` after checking it against this machine (``m3_rollout.config.check_devices``).

    Raises:
        ConfigError: CUDA asked for where there is none, or a device index / GPU count past what exists.
    """
    check_devices(cfg, torch.cuda.is_available(), torch.cuda.device_count())
    return torch.device(cfg.cluster.device)


def master_dtype(cfg: MasterConfig) -> torch.dtype:
    """dtype of the trainer's master weights and AdamW states: float64 for ``policy.precision=float64``,
    else float32 (``bfloat16`` computes in a bf16 copy of fp32 masters)."""
    return torch.float64 if cfg.policy.precision == "float64" else torch.float32


def load_trainer_model(cfg: MasterConfig, model_dir):
    """The checkpoint in ``model_dir`` as the trainer's master model: ``master_dtype`` on
    ``trainer_device`` (raises what those and ``m3_rollout.model.load_checkpoint`` raise)."""
    from m3_rollout.model import load_checkpoint

    return load_checkpoint(model_dir, dtype=master_dtype(cfg), device=trainer_device(cfg))


def build_policy(cfg: MasterConfig, model, total_opt_steps: int) -> Policy:
    """The trainer's ``Policy`` for ``model`` (optimizer, LR schedule over ``total_opt_steps``
    nominal optimizer steps (``total_optimizer_steps``, :func:`schedule_position`), freeze policy,
    reference copy when the KL penalty is on) on ``cluster.device`` (checked, ``trainer_device``),
    computing in bf16 for ``policy.precision=bfloat16``, with ``policy.activation_checkpointing``."""
    p = cfg.policy
    return Policy(
        model,
        lr=p.optimizer.lr,
        weight_decay=p.optimizer.weight_decay,
        betas=(p.optimizer.beta1, p.optimizer.beta2),
        eps=p.optimizer.eps,
        max_grad_norm=p.max_grad_norm,
        freeze_indexer=p.freeze.indexer,
        freeze_router_bias=p.freeze.router_bias,
        freeze_patterns=p.freeze.patterns,
        warmup_steps=p.scheduler.warmup_steps,
        lr_schedule=p.scheduler.name,
        total_steps=total_opt_steps,
        min_lr_ratio=p.scheduler.min_lr_ratio,
        reference_model=cfg.loss_fn.reference_policy_kl_penalty > 0,
        routing_replay=p.routing_replay,
        index_replay=p.index_replay,
        device=trainer_device(cfg),
        compute_dtype=torch.bfloat16 if p.precision == "bfloat16" else None,
        activation_checkpointing=p.activation_checkpointing,
    )


def build_loss_fn(lf: LossConfig) -> ClippedPGLossFn:
    """The loss function described by the ``loss_fn`` config section."""
    return ClippedPGLossFn(
        lf.ratio_clip_min,
        lf.ratio_clip_max,
        lf.token_level_loss,
        ratio_clip_c=lf.ratio_clip_c,
        reference_policy_kl_penalty=lf.reference_policy_kl_penalty,
        reference_policy_kl_type=lf.reference_policy_kl_type,
        importance_sampling=lf.importance_sampling_type if lf.use_importance_sampling_correction else "none",
        tis_max=lf.truncated_importance_sampling_ratio,
        mis_min=lf.mis_ratio_min,
        mis_max=lf.mis_ratio_max,
    )


def truncated_sampling_warning(cfg: MasterConfig) -> str | None:
    """A warning when rollouts sample with top-p < 1 or top-k > 0, else None.

    The trainer scores the temperature-only distribution (``m3_trainers.policy.token_logprobs``),
    while the rollout logprobs the step uses (the mismatch metrics, and the importance weights
    of ``loss_fn.use_importance_sampling_correction``, which ``m3_rollout.config`` refuses with
    truncated sampling) come from the truncated one, so the two compare different distributions.
    """
    gen = cfg.policy.generation
    keys = [f"policy.generation.top_p={gen.top_p}"] if gen.top_p < 1.0 else []
    keys += [f"policy.generation.top_k={gen.top_k}"] if gen.top_k > 0 else []
    if not keys:
        return None
    lf = cfg.loss_fn
    return (
        f"[warn] {' and '.join(keys)}: the rollout logprobs used in training come from the truncated "
        f"sampling distribution, the trainer's from the full temperature-scaled one, so "
        f"token_mult_prob_error / gen_kl_error (and importance weights, "
        f"loss_fn.use_importance_sampling_correction={lf.use_importance_sampling_correction}) compare "
        f"different distributions; set top_p=1.0 and top_k=-1 for training rollouts"
    )


def trajectory_advantages(trajs: Sequence[Trajectory], g: GRPOConfig) -> torch.Tensor:
    """float32 [N] advantages of ``trajs`` grouped by ``group_index``, as ``grpo`` configures them
    (``normalize_rewards``, ``use_leave_one_out_baseline``). A trajectory whose generation failed
    (``Trajectory.failed``) gets exactly 0 and is left out of its group's statistics
    (``group_advantages`` with ``valid=generated_mask(trajs)``)."""
    return group_advantages(
        torch.tensor([t.reward for t in trajs]),
        torch.tensor([t.group_index for t in trajs]),
        g.normalize_rewards,
        g.use_leave_one_out_baseline,
        valid=generated_mask(trajs),
    )


_TOKEN_AVERAGED = (
    "probs_ratio",
    "probs_ratio_clamped",
    "clip_fraction",
    "dual_clip_fraction",
    "kl_penalty",
    "sampling_importance_ratio",
    "is_oob_ratio",
    "approx_entropy",
    "entropy",
    "token_mult_prob_error",
    "gen_kl_error",
    "policy_kl_error",
    "js_divergence_error",
)


def combine_optimizer_steps(steps: list[dict]) -> dict:
    """Metrics of one GRPO step from its optimizer steps' (``Policy.train_step``) metrics:
    token-weighted means of per-token figures, sums of tokens, seconds and FLOPs (TFLOP/s = summed
    train FLOPs / summed train seconds), max of maxima, min of minima (over optimizer steps with
    sampled tokens), mean of loss and grad norm; lr of the first optimizer step; skipped if any
    optimizer step was."""
    if len(steps) == 1:
        return dict(steps[0])
    out = dict(steps[-1])
    w = [m["num_tokens"] for m in steps]
    total = sum(w)
    for k in _TOKEN_AVERAGED:
        out[k] = sum(m[k] * n for m, n in zip(steps, w)) / total if total else steps[-1][k]
    for k in ("num_tokens", "logprob_seconds", "train_seconds", "train_flops", "logprob_flops"):
        out[k] = sum(m[k] for m in steps)
    out["train_tflops_per_s"] = out["train_flops"] / max(out["train_seconds"], 1e-9) / 1e12
    for k in ("probs_ratio_max", "max_logprob_abs_diff"):
        out[k] = max(m[k] for m in steps)
    with_tokens = [m for m in steps if m["num_tokens"]]  # probs_ratio_min is 0 for a step without tokens
    out["probs_ratio_min"] = min(m["probs_ratio_min"] for m in with_tokens) if with_tokens else 0.0
    for k in ("loss", "pg_loss", "kl_loss", "grad_norm"):
        out[k] = sum(m[k] for m in steps) / len(steps)
    out["lr"] = steps[0]["lr"]
    out["skipped_step"] = any(m["skipped_step"] for m in steps)
    return out


@dataclass
class StepResult:
    """What :func:`train_step_on_groups` did.

    Attributes:
        batch: the padded batch trained on: one row per trajectory that generated, in ``trajs``
            order (failed ones are left out: they have no loss token); overlong-filtered rows have
            mask 0.
        advantages: float32 [N] advantages of every trajectory (0 for the failed ones; the
            batch carries the rows' own).
        metrics: :func:`combine_optimizer_steps` of the optimizer steps, with ``logprob_seconds``
            including the logprobs computed once before the first update, the mismatch
            (``token_mult_prob_error``, ``gen_kl_error``, ``policy_kl_error``,
            ``js_divergence_error``, ``max_logprob_abs_diff``) over the whole
            batch when the batch spans several optimizer steps, ``overlong_filtered`` (trajectories
            filtered) with overlong filtering, ``routing_replay_coverage``
            (fraction of token positions with a recorded route) when routing replay is on and,
            when the batch carries routes (or, with index replay, block selections), the mismatch
            of the trainer with its own router and indexer before the update (the mismatch names +
            ``_without_replay``; one more scoring forward), besides the replayed figures;
            with block-selection records (``policy.generation.record_block_selection``)
            ``msa_selection_coverage`` (fraction of token positions with a record) and the
            selection agreement of the trainer's own top-k with the rollout's before the update
            (``SelectionAgreement.metrics``: ``msa_selection_agreement``, ``msa_selection_overlap``
            and per layer), measured in a scoring forward the step runs anyway;
            ``train_step_seconds`` (= ``seconds``), FLOPs and TFLOP/s (``Policy.train_step``).
        seconds: wall time of the training phase (logprobs and optimizer steps), seconds.
    """

    batch: TrainBatch
    advantages: torch.Tensor
    metrics: dict
    seconds: float


def train_step_on_groups(
    policy: Policy,
    loss_fn: ClippedPGLossFn,
    trajs: Sequence[Trajectory],
    cfg: MasterConfig,
    temperature: float,
    pad_id: int = 0,
    advantages: torch.Tensor | None = None,
    grpo_step_index: int | None = None,
) -> StepResult:
    """Train one GRPO step on ``trajs`` (all groups of the step, ``group_index`` naming each group).

    Args:
        policy, loss_fn: the trainer (``build_policy``, ``build_loss_fn``).
        trajs: the step's N trajectories in (group, sample) order; the failed ones
            (``Trajectory.failed``) get loss_mask 0 in place (``mask_failed``) and are left out of
            the batch; the truncated ones get loss_mask 0 with ``grpo.overlong_filtering``
            (``apply_overlong_filter``).
        cfg: the job config; ``grpo`` (advantages, ``overlong_filtering``) and ``policy``
            (``train_global_batch_size``, ``train_micro_batch_size``, ``routing_replay``) are used.
        temperature: sampling temperature the rollouts used (the trainer scores that distribution).
        pad_id: token id of padding.
        advantages: float [N] to train with (e.g. the values stored in a dump); None = computed
            from the rewards by :func:`trajectory_advantages`.
        grpo_step_index: which GRPO step of the run this is, 0-based (the loop's step - 1, the
            offline replay's dumped step - 1 by default, ``m3_rollout.jobs.replay.schedule_indices``):
            the optimizer steps train at
            :func:`schedule_position` and the schedule is left at (index + 1) x
            ``optimizer_steps_per_grpo_step``, whatever the number of rows trained. None = the
            schedule simply advances one position per optimizer step (a step outside a run).

    Returns:
        :class:`StepResult`.

    Raises:
        ValueError: non-finite rewards (from ``group_advantages``), every trajectory failed, or
            an inconsistent batch.
    """
    g, p = cfg.grpo, cfg.policy
    adv = trajectory_advantages(trajs, g) if advantages is None else advantages.float()
    mask_failed(trajs)
    filtered = apply_overlong_filter(trajs) if g.overlong_filtering else 0
    # NOTE: failed trajectories train nothing: they stay out of the batch, whose width (and cost)
    # a refused over-long prompt would otherwise set for every row
    kept = generated_mask(trajs)
    trained = [t for t, k in zip(trajs, kept.tolist()) if k]
    if not trained:
        raise ValueError(f"all {len(trajs)} trajectories failed to generate (Trajectory.failed): nothing to train")
    batch = batch_from_trajectories(
        trained,
        adv[kept],
        pad_id=pad_id,
        with_routing=p.routing_replay,
        with_block_selection=p.generation.record_block_selection,
    )
    t0 = time.perf_counter()
    # NOTE: a micro batch above the global batch is the global batch (config allows it): the scoring
    # passes below then split the rows as the optimizer steps do, so the first step's training
    # forward runs the very shapes the prev logprobs came from (same bits; the ratio is exactly 1)
    gbs = p.train_global_batch_size
    mbs = min(p.train_micro_batch_size, gbs)
    prev = ref = own = None
    scored = 0  # tokens of the forwards run here, before the optimizer steps
    selections = batch.block_selection is not None
    replayed = (p.routing_replay and batch.routed_experts is not None) or (p.index_replay and selections)
    agreement = SelectionAgreement(policy.compute, policy.device) if selections else None
    # NOTE: the agreement is measured in a no-replay scoring forward the step runs anyway: the
    # "own" forward when replaying, else the pre-update logprobs (otherwise computed inside
    # train_step, on the same weights).
    if gbs < len(trained) or (selections and not replayed):  # ratios against the rollout-time policy
        prev = policy.get_logprobs(batch, temperature, mbs, agreement=None if replayed else agreement)
        scored += batch.token_ids.numel()
    if gbs < len(trained) and loss_fn.needs_reference:
        ref = policy.get_logprobs(batch, temperature, mbs, reference=True)
        scored += batch.token_ids.numel()
    if replayed:  # the trainer's own routing and blocks, before the update: the mismatch replay removes
        own = policy.get_logprobs(
            batch, temperature, mbs, routing_replay=False, index_replay=False, agreement=agreement
        )
        scored += batch.token_ids.numel()
    lp_seconds = policy.elapsed(t0)
    per_opt_step = []
    nominal = optimizer_steps_per_grpo_step(cfg)
    for i, s in enumerate(range(0, len(trained), gbs)):
        if grpo_step_index is not None:
            policy.set_schedule_position(schedule_position(grpo_step_index, i, nominal))
        mb = batch.slice(slice(s, s + gbs))
        l = mb.token_ids.shape[1]
        per_opt_step.append(
            policy.train_step(
                mb,
                loss_fn,
                temperature,
                mbs,
                None if prev is None else prev[s : s + gbs, :l],
                None if ref is None else ref[s : s + gbs, :l],
                prev_on_current_weights=s == 0,
            )
        )
    if grpo_step_index is not None:  # the next GRPO step's first position, however many rows trained
        policy.set_schedule_position((grpo_step_index + 1) * nominal)
    metrics = combine_optimizer_steps(per_opt_step)
    metrics["logprob_seconds"] = lp_seconds + metrics["logprob_seconds"]
    metrics["logprob_flops"] += float(policy.flops_per_token // 3 * scored)
    rollout_lp, mask = batch.rollout_logprobs.to(policy.device), batch.loss_mask.to(policy.device)
    if prev is not None:  # mismatch over the whole batch, not the last optimizer step's slice
        metrics.update(mismatch_metrics(rollout_lp, prev, mask))
    if replayed:
        m = mismatch_metrics(rollout_lp, own, mask)
        metrics.update({f"{k}_without_replay": v for k, v in m.items()})
    if g.overlong_filtering:
        metrics["overlong_filtered"] = filtered
    if p.routing_replay:
        r = batch.routed_experts
        metrics["routing_replay_coverage"] = 0.0 if r is None else float((r[..., 0, 0] >= 0).float().mean())
    if p.generation.record_block_selection:
        sel = batch.block_selection
        real = torch.arange(batch.token_ids.shape[1])[None, :] < batch.lengths[:, None]  # [B, L] not padding
        hit = torch.zeros_like(real) if sel is None else (sel >= 0).flatten(2).any(dim=-1)
        metrics["msa_selection_coverage"] = float((hit & real).sum()) / max(int(real.sum()), 1)
        if agreement is not None:
            metrics.update(agreement.metrics())
    seconds = time.perf_counter() - t0
    metrics["train_step_seconds"] = seconds
    return StepResult(batch, adv, metrics, seconds)

"""The trainer's policy: fp32 master weights, logprob scoring and one GRPO optimizer step.

NeMo RL's split: ``get_logprobs`` recomputes token logprobs with the same model code path the
generator runs (here the same ``M3ForCausalLM`` module, in fp32), ``train_step`` runs the loss
over micro-batches with one global normaliser (gradient accumulation) and steps AdamW once per
global batch, after clipping the global gradient norm; the learning rate follows
``lr_factor`` (linear warmup, then constant / linear / cosine decay).
"""

from __future__ import annotations

import copy
import math
import re
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

from m3_rollout.model import M3ForCausalLM
from m3_rollout.model.loading import iter_released_tensors
from m3_rollout.model.numerics import compute_dtype
from m3_trainers.batch import TrainBatch
from m3_trainers.loss import ClippedPGLossFn, masked_fill_zero

_INDEXER_KEYS = ("index_q_proj", "index_k_proj", "index_q_norm", "index_k_norm")
LR_SCHEDULES = ("constant", "linear", "cosine")


@contextmanager
def replay_routing(model: M3ForCausalLM, routed_experts: torch.Tensor | None):
    """Within the block, every MoE layer of ``model`` uses the given expert ids (routing replay).

    Args:
        routed_experts: int64 [B, L, n_moe_layers, K] for the next forward over [B, L] tokens
            (-1 rows = own router); None = no replay (the block is a no-op).

    Raises:
        ValueError: the layer count or K does not match the model.
    """
    layers = model.moe_layers()
    if routed_experts is None:
        yield
        return
    b, l, n, k = routed_experts.shape
    if n != len(layers) or (layers and k != layers[0].top_k):
        raise ValueError(
            f"routed_experts has {n} MoE layers x top_k {k}; the model has {len(layers)} x "
            f"{layers[0].top_k if layers else '-'}"
        )
    try:
        for j, moe in enumerate(layers):
            moe.replay_topk_ids = routed_experts[:, :, j].reshape(b * l, k)  # [T, K], row-major like x
        yield
    finally:
        for moe in layers:
            moe.replay_topk_ids = None


def token_logprobs(
    model: M3ForCausalLM,
    token_ids: torch.Tensor,
    temperature: float = 1.0,
    routed_experts: torch.Tensor | None = None,
    return_entropy: bool = False,
):
    """Logprob of every token given its prefix.

    Args:
        model: the policy.
        token_ids: int64 [B, L] (right padding is harmless: attention is causal).
        temperature: logits are divided by it, so the trainer scores the distribution the sampler
            drew from (temperature only; top-k/top-p are off for training rollouts).
        routed_experts: optional int64 [B, L, n_moe_layers, K] for routing replay.
        return_entropy: also return the entropy (nats) of the predictive distribution at every
            position (no grad), column 0 = 0.

    Returns:
        float32 [B, L] (float64 for a float64 model); column 0 is 0 (no prefix), column t =
        log p(token_t | tokens_<t). With ``return_entropy``: (logprobs, entropy [B, L]).
    """
    with replay_routing(model, routed_experts):
        logits = model(token_ids)
    logits = logits.to(compute_dtype(logits.dtype)) / temperature  # [B, L, V], fp32 (fp64 for fp64 models)
    logp_all = torch.log_softmax(logits[:, :-1], dim=-1)  # [B, L-1, V]
    lp = logp_all.gather(-1, token_ids[:, 1:, None]).squeeze(-1)
    lp = torch.cat([torch.zeros_like(lp[:, :1]), lp], dim=1)
    if not return_entropy:
        return lp
    with torch.no_grad():
        ent = -(logp_all.exp() * logp_all).sum(-1)  # [B, L-1]
        ent = torch.cat([torch.zeros_like(ent[:, :1]), ent], dim=1)
    return lp, ent


def frozen_parameter_names(
    model: torch.nn.Module, freeze_indexer: bool, freeze_router_bias: bool, patterns: Sequence[str] = ()
) -> set[str]:
    """Names of parameters the freeze policy keeps fixed.

    Args:
        freeze_indexer: the MSA indexer projections and norms (``index_*``).
        freeze_router_bias: ``e_score_correction_bias`` (a load-balancing statistic).
        patterns: extra regular expressions (``re.search`` on the parameter name).

    Raises:
        ValueError: a pattern is not a valid regular expression or matches no parameter.
    """
    names = [n for n, _ in model.named_parameters()]
    frozen = set()
    for n in names:
        if (freeze_indexer and any(k in n for k in _INDEXER_KEYS)) or (
            freeze_router_bias and n.endswith("e_score_correction_bias")
        ):
            frozen.add(n)
    for pat in patterns:
        try:
            rx = re.compile(pat)
        except re.error as exc:
            raise ValueError(f"policy.freeze.patterns: {pat!r} is not a regular expression ({exc})") from None
        hits = {n for n in names if rx.search(n)}
        if not hits:
            raise ValueError(f"policy.freeze.patterns: {pat!r} matches no parameter (names look like {names[1]!r})")
        frozen |= hits
    return frozen


def is_no_decay(name: str, p: torch.Tensor) -> bool:
    """Norm weights, other 1-D tensors and the router bias get no weight decay."""
    return p.ndim < 2 or "norm" in name or name.endswith("e_score_correction_bias")


def split_param_groups(
    model: M3ForCausalLM,
    freeze_indexer: bool,
    freeze_router_bias: bool,
    weight_decay: float,
    patterns: Sequence[str] = (),
) -> list[dict]:
    """AdamW parameter groups: no weight decay on norms (1-D weights) and the router bias;
    frozen tensors (``frozen_parameter_names``) get ``requires_grad=False`` and stay out of the
    optimizer (so weight decay never touches them either)."""
    frozen = frozen_parameter_names(model, freeze_indexer, freeze_router_bias, patterns)
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        p.requires_grad_(name not in frozen)
        if name in frozen:
            continue
        (no_decay if is_no_decay(name, p) else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def lr_factor(step: int, warmup_steps: int, schedule: str, total_steps: int, min_lr_ratio: float) -> float:
    """Multiplier of the base learning rate for optimizer step ``step`` (0-based).

    Linear warmup over ``warmup_steps`` (factor (step+1)/warmup_steps), then "constant" (1),
    "linear" (1 -> min_lr_ratio at ``total_steps``) or "cosine" (half cosine 1 -> min_lr_ratio).
    """
    if schedule not in LR_SCHEDULES:
        raise ValueError(f"lr schedule {schedule!r}: one of {list(LR_SCHEDULES)}")
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    span = max(1, total_steps - warmup_steps)
    frac = min(1.0, (step - warmup_steps) / span)
    if schedule == "linear":
        return 1.0 - (1.0 - min_lr_ratio) * frac
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * frac))


class Policy:
    """Owns the fp32 master model, its optimizer and LR scheduler, and the optional reference model.

    Args:
        model: ``M3ForCausalLM`` in fp32 (or fp64 for tests).
        lr, weight_decay, betas, eps: AdamW.
        max_grad_norm: global gradient-norm clip.
        freeze_indexer, freeze_router_bias, freeze_patterns: see ``frozen_parameter_names``.
        warmup_steps, lr_schedule, total_steps, min_lr_ratio: see ``lr_factor`` (in optimizer steps).
        reference_model: keep a frozen copy of the initial weights for the KL penalty.
        routing_replay: use ``TrainBatch.routed_experts`` in every trainer forward.
    """

    def __init__(
        self,
        model: M3ForCausalLM,
        lr: float,
        weight_decay: float = 0.01,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        max_grad_norm: float = 1.0,
        freeze_indexer: bool = True,
        freeze_router_bias: bool = True,
        freeze_patterns: Sequence[str] = (),
        warmup_steps: int = 0,
        lr_schedule: str = "constant",
        total_steps: int = 1,
        min_lr_ratio: float = 0.0,
        reference_model: bool = False,
        routing_replay: bool = False,
    ):
        self.model = model.train()
        self.max_grad_norm = max_grad_norm
        self.routing_replay = routing_replay
        groups = split_param_groups(model, freeze_indexer, freeze_router_bias, weight_decay, freeze_patterns)
        self.optimizer = torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_factor(s, warmup_steps, lr_schedule, total_steps, min_lr_ratio)
        )
        self.reference = None
        if reference_model:
            self.reference = copy.deepcopy(model).eval()
            self.reference.requires_grad_(False)

    def named_released_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Weights in released checkpoint naming (what weight sync sends)."""
        return iter_released_tensors(self.model)

    def _routes(self, mb: TrainBatch) -> torch.Tensor | None:
        return mb.routed_experts if self.routing_replay else None

    @torch.no_grad()
    def get_logprobs(
        self, batch: TrainBatch, temperature: float, micro_batch_size: int, reference: bool = False
    ) -> torch.Tensor:
        """float32 [B, L] logprobs of ``batch.token_ids`` under the current (or reference) weights."""
        model = self.reference if reference else self.model
        if model is None:
            raise ValueError("no reference model: construct Policy(reference_model=True) for a KL penalty")
        out = torch.zeros(batch.rollout_logprobs.shape, dtype=torch.float64 if self._fp64() else torch.float32)
        for s in range(0, batch.token_ids.shape[0], micro_batch_size):
            mb = batch.slice(slice(s, s + micro_batch_size))
            out[s : s + micro_batch_size, : mb.token_ids.shape[1]] = token_logprobs(
                model, mb.token_ids, temperature, self._routes(mb)
            )
        return out

    def _fp64(self) -> bool:
        return self.model.lm_head.weight.dtype == torch.float64

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def train_step(
        self,
        batch: TrainBatch,
        loss_fn: ClippedPGLossFn,
        temperature: float,
        micro_batch_size: int,
        prev_logprobs: torch.Tensor | None = None,
        reference_logprobs: torch.Tensor | None = None,
    ) -> dict:
        """One optimizer step on a global batch (gradients accumulated over micro-batches).

        The ratio is taken against ``prev_logprobs``, the current policy's own logprobs before
        the step (recomputed here unless given: when one rollout batch is split into several
        optimizer steps, pass the logprobs computed once before the first step, as NeMo RL does,
        so the later steps are clipped against the rollout-time policy). Reference logprobs are
        computed only when ``loss_fn.needs_reference``.

        Train/inference mismatch over sampled tokens (rollout lp = ``batch.rollout_logprobs``):
          token_mult_prob_error = mean exp(|rollout_lp - prev_lp|)      (1.0 = identical)
          gen_kl_error          = mean (r - 1 - log r), r = exp(prev_lp - rollout_lp)
                                  (k3 estimate of KL(generator || trainer) per token, >= 0)

        Returns:
            metrics: loss, pg_loss, kl_loss, grad_norm, lr, token_mult_prob_error, gen_kl_error,
            max_logprob_abs_diff, ratio_mean, ratio_max, clip_fraction, dual_clip_fraction,
            reference_kl, is_weight_mean, is_dropped_fraction, entropy, num_tokens,
            logprob_seconds, train_seconds, skipped_step (the loss or gradient norm was not finite:
            no update was applied; the LR schedule still advances).
        """
        batch.validate()
        self.model.train()
        t0 = time.perf_counter()
        prev = self.get_logprobs(batch, temperature, micro_batch_size) if prev_logprobs is None else prev_logprobs
        ref = None
        if loss_fn.needs_reference:
            ref = (
                self.get_logprobs(batch, temperature, micro_batch_size, reference=True)
                if reference_logprobs is None
                else reference_logprobs
            )
        t1 = time.perf_counter()
        metrics = mismatch_metrics(batch.rollout_logprobs, prev, batch.loss_mask)
        mask = batch.loss_mask
        num_tokens = float(mask.sum())
        normalizer = max(num_tokens, 1.0) if loss_fn.token_level_loss else float(batch.token_ids.shape[0])
        self.optimizer.zero_grad(set_to_none=True)
        sums = {
            "loss": 0.0,
            "pg_loss": 0.0,
            "kl_loss": 0.0,
            "clip_fraction_sum": 0.0,
            "dual_clip_fraction_sum": 0.0,
            "ratio_sum": 0.0,
            "kl_sum": 0.0,
            "is_weight_sum": 0.0,
            "is_dropped_sum": 0.0,
            "entropy_sum": 0.0,
        }
        ratio_max = 0.0
        for s in range(0, batch.token_ids.shape[0], micro_batch_size):
            mb = batch.slice(slice(s, s + micro_batch_size))
            l = mb.token_ids.shape[1]
            lp, ent = token_logprobs(self.model, mb.token_ids, temperature, self._routes(mb), return_entropy=True)
            loss, m = loss_fn(
                lp,
                prev[s : s + micro_batch_size, :l],
                mb.advantages,
                mb.loss_mask,
                normalizer,
                generation_logprobs=mb.rollout_logprobs,
                reference_logprobs=None if ref is None else ref[s : s + micro_batch_size, :l],
            )
            loss.backward()
            sums["loss"] += float(loss.detach())
            for k in (
                "pg_loss",
                "kl_loss",
                "clip_fraction_sum",
                "dual_clip_fraction_sum",
                "ratio_sum",
                "kl_sum",
                "is_weight_sum",
                "is_dropped_sum",
            ):
                sums[k] += m[k]
            sums["entropy_sum"] += float(masked_fill_zero(ent, mb.loss_mask).sum())
            ratio_max = max(ratio_max, m["ratio_max"])
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm))
        lr = self.lr
        skipped = not (math.isfinite(grad_norm) and math.isfinite(sums["loss"]))
        if not skipped:
            self.optimizer.step()
        self.scheduler.step()
        n = max(num_tokens, 1.0)
        metrics.update(
            loss=sums["loss"],
            pg_loss=sums["pg_loss"],
            kl_loss=sums["kl_loss"],
            grad_norm=grad_norm,
            lr=lr,
            ratio_mean=sums["ratio_sum"] / n,
            ratio_max=ratio_max,
            clip_fraction=sums["clip_fraction_sum"] / n,
            dual_clip_fraction=sums["dual_clip_fraction_sum"] / n,
            reference_kl=sums["kl_sum"] / n,
            is_weight_mean=sums["is_weight_sum"] / n,
            is_dropped_fraction=sums["is_dropped_sum"] / n,
            entropy=sums["entropy_sum"] / n,
            num_tokens=num_tokens,
            skipped_step=skipped,
            logprob_seconds=t1 - t0,
            train_seconds=time.perf_counter() - t1,
        )
        return metrics


def mismatch_metrics(rollout_logprobs: torch.Tensor, trainer_logprobs: torch.Tensor, mask: torch.Tensor) -> dict:
    """Train/inference mismatch over sampled tokens (see ``Policy.train_step``).

    Args:
        rollout_logprobs, trainer_logprobs: float [B, L]; mask: [B, L] sampled tokens.

    Returns:
        {"token_mult_prob_error", "gen_kl_error", "max_logprob_abs_diff"} (1.0 / 0.0 / 0.0 when
        no token is sampled). Computed in fp64.
    """
    m = mask.bool()
    n = max(float(m.sum()), 1.0)
    d = masked_fill_zero(trainer_logprobs.double() - rollout_logprobs.double(), m)  # log r
    return {
        "token_mult_prob_error": float(masked_fill_zero(torch.exp(d.abs()), m).sum() / n) if m.any() else 1.0,
        "gen_kl_error": float(masked_fill_zero(torch.exp(d) - 1 - d, m).sum() / n),
        "max_logprob_abs_diff": float(d.abs().max()) if m.any() else 0.0,
    }

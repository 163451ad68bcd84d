"""The trainer's policy: fp32 master weights, logprob scoring and one GRPO optimizer step.

NeMo RL's split: ``get_logprobs`` recomputes token logprobs with the same model code path the
generator runs (here the same ``M3ForCausalLM`` module, in fp32), ``train_step`` runs the loss
over micro-batches with one global normaliser and steps AdamW once per global batch.
"""

from __future__ import annotations

import math
from typing import Iterator

import torch

from m3_rollout.model import M3ForCausalLM
from m3_rollout.model.loading import iter_released_tensors
from m3_rollout.model.numerics import compute_dtype
from trainers.batch import TrainBatch
from trainers.loss import ClippedPGLossFn

_INDEXER_KEYS = ("index_q_proj", "index_k_proj", "index_q_norm", "index_k_norm")


def token_logprobs(model: M3ForCausalLM, token_ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Logprob of every token given its prefix.

    Args:
        model: the policy.
        token_ids: int64 [B, L] (right padding is harmless: attention is causal).
        temperature: logits are divided by it, so the trainer scores the distribution the sampler
            drew from (temperature only; top-k/top-p are off for training rollouts).

    Returns:
        float32 [B, L] (float64 for a float64 model); column 0 is 0 (no prefix), column t = log p(token_t | tokens_<t).
    """
    logits = model(token_ids)
    logits = logits.to(compute_dtype(logits.dtype)) / temperature  # [B, L, V], fp32 (fp64 for fp64 models)
    lp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, token_ids[:, 1:, None]).squeeze(-1)
    return torch.cat([torch.zeros_like(lp[:, :1]), lp], dim=1)


def split_param_groups(model: M3ForCausalLM, freeze_indexer: bool, freeze_router_bias: bool,
                       weight_decay: float) -> list[dict]:
    """AdamW parameter groups: no weight decay on norms (1-D weights) and the router bias;
    frozen tensors get ``requires_grad=False`` and stay out of the optimizer."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        frozen = (freeze_indexer and any(k in name for k in _INDEXER_KEYS)) or \
                 (freeze_router_bias and name.endswith("e_score_correction_bias"))
        p.requires_grad_(not frozen)
        if frozen:
            continue
        (no_decay if p.ndim < 2 or "norm" in name or name.endswith("e_score_correction_bias") else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


class Policy:
    """Owns the fp32 master model and its optimizer.

    Args:
        model: ``M3ForCausalLM`` in fp32 (or fp64 for tests).
        lr, weight_decay, betas, eps: AdamW.
        max_grad_norm: global gradient-norm clip.
        freeze_indexer, freeze_router_bias: see ``split_param_groups``.
    """

    def __init__(self, model: M3ForCausalLM, lr: float, weight_decay: float = 0.01,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, max_grad_norm: float = 1.0,
                 freeze_indexer: bool = True, freeze_router_bias: bool = True):
        self.model = model.train()
        self.max_grad_norm = max_grad_norm
        groups = split_param_groups(model, freeze_indexer, freeze_router_bias, weight_decay)
        self.optimizer = torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps)

    def named_released_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Weights in released checkpoint naming (what weight sync sends)."""
        return iter_released_tensors(self.model)

    @torch.no_grad()
    def get_logprobs(self, batch: TrainBatch, temperature: float, micro_batch_size: int) -> torch.Tensor:
        """float32 [B, L] logprobs of ``batch.token_ids`` under the current weights."""
        out = torch.zeros(batch.rollout_logprobs.shape)
        for s in range(0, batch.token_ids.shape[0], micro_batch_size):
            mb = batch.slice(slice(s, s + micro_batch_size))
            out[s:s + micro_batch_size, :mb.token_ids.shape[1]] = token_logprobs(self.model, mb.token_ids, temperature)
        return out

    def train_step(self, batch: TrainBatch, loss_fn: ClippedPGLossFn, temperature: float,
                   micro_batch_size: int, prev_logprobs: torch.Tensor | None = None) -> dict:
        """One optimizer step on a global batch.

        The ratio is taken against ``prev_logprobs``, the current policy's own logprobs before
        the step (recomputed here unless given: when one rollout batch is split into several
        optimizer steps, pass the logprobs computed once before the first step, as NeMo RL does,
        so the later steps are clipped against the rollout-time policy); the train/inference
        mismatch is logged as
        ``token_mult_prob_error`` = mean over sampled tokens of exp(|rollout_lp - prev_lp|)
        (1.0 = identical).

        Returns:
            metrics: loss, grad_norm, token_mult_prob_error, max_logprob_abs_diff, clip_fraction,
            num_tokens.
        """
        batch.validate()
        self.model.train()
        prev = self.get_logprobs(batch, temperature, micro_batch_size) if prev_logprobs is None else prev_logprobs
        mask = batch.loss_mask
        num_tokens = float(mask.sum())
        normalizer = num_tokens if loss_fn.token_level_loss else float(batch.token_ids.shape[0])
        diff = (batch.rollout_logprobs - prev).abs() * mask
        metrics = {"token_mult_prob_error": float((torch.exp(diff) * mask).sum() / max(num_tokens, 1.0)),
                   "max_logprob_abs_diff": float(diff.max()), "num_tokens": num_tokens}
        self.optimizer.zero_grad(set_to_none=True)
        total_loss, clip_sum = 0.0, 0.0
        for s in range(0, batch.token_ids.shape[0], micro_batch_size):
            mb = batch.slice(slice(s, s + micro_batch_size))
            l = mb.token_ids.shape[1]
            lp = token_logprobs(self.model, mb.token_ids, temperature)
            loss, m = loss_fn(lp, prev[s:s + micro_batch_size, :l], mb.advantages, mb.loss_mask, normalizer)
            loss.backward()
            total_loss += float(loss.detach())
            clip_sum += m["clip_fraction_sum"]
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm))
        if math.isfinite(grad_norm):
            self.optimizer.step()
        metrics.update(loss=total_loss, grad_norm=grad_norm, clip_fraction=clip_sum / max(num_tokens, 1.0),
                       skipped_step=not math.isfinite(grad_norm))
        return metrics

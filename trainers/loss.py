"""Clipped policy-gradient loss for GRPO, NeMo RL style: configuration in the constructor, a pure
``__call__`` of tensors with an explicit global normaliser.

Governing idea: every per-token term is computed on *sanitised* inputs (masked positions replaced
by 0 before any arithmetic), so a NaN or inf in a position the mask excludes can reach neither the
loss nor its gradient (``x * 0`` would keep a NaN, and ``where`` after ``exp`` would still send
``0 * inf = NaN`` back through the unselected branch).

Per sampled token t of a sample with advantage A (Schulman et al. 2017, PPO; Shao et al. 2024, GRPO):

    ratio_t   = exp(logp_t - prev_t)                                   prev = the trainer's own
                                                                       logprobs before the step
    pg_t      = -min(ratio_t * A, clip(ratio_t, 1 - eps_min, 1 + eps_max) * A)
    dual clip (Ye et al. 2020, "Mastering complex control in MOBA games", eq. 5), for A < 0 only:
              pg_t = min(pg_t, -c * A)                                 (c > 1)
    KL to the reference policy (Schulman 2020, "Approximating KL divergence"), with
    log_r = ref_t - logp_t:
              k1 = -log_r      k2 = log_r**2 / 2      k3 = exp(log_r) - 1 - log_r
    importance weight against the rollout engine's logprobs (train/inference mismatch, as in
    NeMo RL's ``use_importance_sampling_correction``; Yao et al. 2025, "Your efficient RL
    framework secretly brings you off-policy RL training", TIS/MIS):
              w_t = exp(prev_t - gen_t)   (no gradient)
              TIS: w_t = min(w_t, tis_max)
              MIS: w_t = w_t if mis_min <= w_t <= mis_max else 0   (token dropped)
    loss_t    = w_t * pg_t + beta * kl_t

Diagnostics (NeMo RL's names and definitions, ``docs/metrics.md``), per sampled token, with
w_raw_t = exp(prev_t - gen_t) (gen = prev when no generation logprobs are given):
    sampling_importance_ratio = mean of w_t as truncated by the configured TIS / MIS (w_raw_t
                                when importance sampling is off: it is reported, not applied)
    is_oob_ratio              = fraction of tokens whose w_raw_t lies outside the truncation
                                bounds (TIS: > tis_max; MIS: outside [mis_min, mis_max]; off: 0)
    approx_entropy            = mean of -exp(logp_t - gen_t) * logp_t (entropy of the current
                                policy estimated from the generator's samples)

Token-level mean: sum over the global batch's sampled tokens / their count. Sequence-level mean:
per-sample mean over its sampled tokens, summed, / global sample count. Micro-batches therefore
add up to the loss of the whole global batch.
"""

from __future__ import annotations

import torch

KL_TYPES = ("k1", "k2", "k3")
IS_TYPES = ("none", "tis", "mis")


def masked_fill_zero(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``x`` where ``mask`` is set, exactly 0 elsewhere (also where x is NaN/inf); the gradient
    to x at masked-out positions is 0."""
    return torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))


def masked_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum of ``x`` over positions where ``mask`` is set (NaN/inf elsewhere ignored); scalar."""
    return masked_fill_zero(x, mask).sum()


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token estimator of KL(pi || pi_ref) from tokens sampled from pi (Schulman 2020).

    Args:
        logprobs, ref_logprobs: float [...] logprobs of the sampled tokens under pi and pi_ref.
        kind: "k1" (= logp - ref, unbiased, high variance, can be negative), "k2" (= (logp-ref)^2/2,
            biased, >= 0), "k3" (= r - 1 - log r with r = exp(ref - logp), unbiased, >= 0).

    Returns:
        float [...] same shape. Raises ValueError for an unknown ``kind``.
    """
    log_r = ref_logprobs - logprobs
    if kind == "k1":
        return -log_r
    if kind == "k2":
        return 0.5 * log_r**2
    if kind == "k3":
        return torch.exp(log_r) - 1 - log_r
    raise ValueError(f"kl type {kind!r}: must be one of {list(KL_TYPES)}")


def importance_weights(
    prev_logprobs: torch.Tensor,
    generation_logprobs: torch.Tensor,
    mask: torch.Tensor,
    kind: str,
    tis_max: float = 2.0,
    mis_min: float = 0.5,
    mis_max: float = 2.0,
) -> torch.Tensor:
    """Per-token importance weights trainer/generator, exp(prev - gen), detached.

    Args:
        prev_logprobs, generation_logprobs: float [B, L].
        mask: [B, L] sampled tokens; weights are 0 outside it.
        kind: "none" (all 1), "raw" (exp(prev - gen) as is), "tis" (truncated at ``tis_max``),
            "mis" (0 outside [mis_min, mis_max]).

    Returns:
        float [B, L], no grad.
    """
    if kind not in (*IS_TYPES, "raw"):
        raise ValueError(f"importance sampling type {kind!r}: must be one of {[*IS_TYPES, 'raw']}")
    with torch.no_grad():
        diff = masked_fill_zero(prev_logprobs - generation_logprobs, mask)
        w = torch.exp(diff)
        if kind == "none":
            w = torch.ones_like(w)
        elif kind == "tis":
            w = w.clamp(max=tis_max)
        elif kind == "mis":
            w = torch.where((w >= mis_min) & (w <= mis_max), w, torch.zeros_like(w))
        return masked_fill_zero(w, mask)


class ClippedPGLossFn:
    """Clipped PG loss with dual clip, reference KL and importance-sampling correction.

    Args:
        ratio_clip_min, ratio_clip_max: eps_min, eps_max of the clip range [1-eps_min, 1+eps_max].
        token_level_loss: True = normalise by the global count of sampled tokens; False = mean
            over tokens per sequence, then over sequences (normaliser = the global count of
            sequences with loss tokens, NeMo RL's valid sequences; ``Policy.train_step``).
        ratio_clip_c: dual-clip constant c > 1 (None = off).
        reference_policy_kl_penalty: beta; 0 = no KL term and reference logprobs are not needed.
        reference_policy_kl_type: "k1" | "k2" | "k3".
        importance_sampling: "none" | "tis" | "mis".
        tis_max: TIS truncation threshold. mis_min, mis_max: MIS acceptance band.

    Raises:
        ValueError: bad option (named).
    """

    def __init__(
        self,
        ratio_clip_min: float = 0.2,
        ratio_clip_max: float = 0.2,
        token_level_loss: bool = True,
        ratio_clip_c: float | None = None,
        reference_policy_kl_penalty: float = 0.0,
        reference_policy_kl_type: str = "k3",
        importance_sampling: str = "none",
        tis_max: float = 2.0,
        mis_min: float = 0.5,
        mis_max: float = 2.0,
    ):
        if ratio_clip_c is not None and not ratio_clip_c > 1:
            raise ValueError(f"ratio_clip_c={ratio_clip_c}: must be > 1 (or None = off)")
        if reference_policy_kl_type not in KL_TYPES:
            raise ValueError(f"reference_policy_kl_type={reference_policy_kl_type!r}: one of {list(KL_TYPES)}")
        if importance_sampling not in IS_TYPES:
            raise ValueError(f"importance_sampling={importance_sampling!r}: one of {list(IS_TYPES)}")
        self.eps_min, self.eps_max = ratio_clip_min, ratio_clip_max
        self.token_level_loss = token_level_loss
        self.ratio_clip_c = ratio_clip_c
        self.kl_penalty = reference_policy_kl_penalty
        self.kl_type = reference_policy_kl_type
        self.importance_sampling = importance_sampling
        self.tis_max, self.mis_min, self.mis_max = tis_max, mis_min, mis_max

    @property
    def needs_reference(self) -> bool:
        """Whether callers must compute reference-policy logprobs (skipped when beta == 0)."""
        return self.kl_penalty != 0.0

    def __call__(
        self,
        logprobs: torch.Tensor,
        prev_logprobs: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        global_normalizer: float,
        generation_logprobs: torch.Tensor | None = None,
        reference_logprobs: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict]:
        """:meth:`loss_and_stats` with the metrics read back as Python floats (one device sync).

        Returns:
            (scalar loss to backpropagate, {name: float}) with the names of :meth:`loss_and_stats`.
        """
        loss, stats = self.loss_and_stats(
            logprobs, prev_logprobs, advantages, mask, global_normalizer, generation_logprobs, reference_logprobs
        )
        values = torch.stack([v.double() for v in stats.values()]).tolist()
        return loss, dict(zip(stats, values))

    def loss_and_stats(
        self,
        logprobs: torch.Tensor,
        prev_logprobs: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        global_normalizer: float,
        generation_logprobs: torch.Tensor | None = None,
        reference_logprobs: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict]:
        """Loss of one micro-batch (see module docstring for the maths).

        Args:
            logprobs: float [B, L] current-policy logprobs (with grad).
            prev_logprobs: float [B, L] ratio denominator.
            advantages: float [B].
            mask: float [B, L], 1 on sampled tokens.
            global_normalizer: sampled-token count (token level) or the count of sequences with
                loss tokens (sequence level) of the whole global batch (> 0).
            generation_logprobs: float [B, L]; required unless importance_sampling == "none".
            reference_logprobs: float [B, L]; required when the KL penalty != 0, ignored otherwise.

        Returns:
            (scalar loss to backpropagate, metrics) where metrics are detached 0-d tensors on the
            inputs' device (no host sync; ``__call__`` reads them back): sums over this
            micro-batch's sampled tokens ("*_sum", divide by the token count) and maxima
            ("ratio_max", 0 without sampled tokens) and minima ("ratio_min", +inf without sampled
            tokens): clip_fraction_sum, dual_clip_fraction_sum, ratio_sum, clamped_ratio_sum,
            ratio_max, ratio_min, kl_sum, is_ratio_sum (sampling_importance_ratio), is_oob_sum,
            approx_entropy_sum, pg_loss (scalar contribution), kl_loss.

        Raises:
            ValueError: a required input is missing or shapes disagree.
        """
        if logprobs.shape != prev_logprobs.shape or logprobs.shape != mask.shape:
            raise ValueError(
                f"logprobs {tuple(logprobs.shape)}, prev_logprobs {tuple(prev_logprobs.shape)} and "
                f"mask {tuple(mask.shape)} must have one shape [B, L]"
            )
        if advantages.shape != logprobs.shape[:1]:
            raise ValueError(f"advantages shape {tuple(advantages.shape)} != [B] = {tuple(logprobs.shape[:1])}")
        m = mask.bool()
        lp = masked_fill_zero(logprobs, m)
        prev = masked_fill_zero(prev_logprobs, m)
        adv = advantages[:, None].to(lp.dtype)  # [B, 1]
        ratio = torch.exp(lp - prev)  # [B, L], 1 at masked positions
        clipped_ratio = torch.clamp(ratio, 1 - self.eps_min, 1 + self.eps_max)
        pg = -torch.minimum(ratio * adv, clipped_ratio * adv)  # [B, L]
        dual = torch.zeros_like(m)
        if self.ratio_clip_c is not None:
            cap = -self.ratio_clip_c * adv  # positive where A < 0
            dual = (adv < 0) & (pg > cap)
            pg = torch.where(dual, cap.expand_as(pg), pg)
        if self.importance_sampling != "none" and generation_logprobs is None:
            raise ValueError(f"importance_sampling={self.importance_sampling!r} needs generation_logprobs")
        gen = prev if generation_logprobs is None else masked_fill_zero(generation_logprobs, m)
        kind = self.importance_sampling
        w_report = importance_weights(
            prev, gen, m, kind if kind != "none" else "raw", self.tis_max, self.mis_min, self.mis_max
        )
        w = w_report if kind != "none" else m.to(lp.dtype)
        per_token = w * pg
        kl = torch.zeros_like(lp)
        if self.needs_reference:
            if reference_logprobs is None:
                raise ValueError("reference_policy_kl_penalty != 0 needs reference_logprobs")
            kl = kl_estimate(lp, masked_fill_zero(reference_logprobs, m), self.kl_type)
            per_token = per_token + self.kl_penalty * kl
        per_token = masked_fill_zero(per_token, m)
        if self.token_level_loss:
            loss = per_token.sum() / global_normalizer
            pg_part = masked_sum(w * pg, m) / global_normalizer
        else:
            count = m.sum(-1).clamp(min=1)
            loss = (per_token.sum(-1) / count).sum() / global_normalizer
            pg_part = (masked_fill_zero(w * pg, m).sum(-1) / count).sum() / global_normalizer
        with torch.no_grad():
            outside = (ratio < 1 - self.eps_min) | (ratio > 1 + self.eps_max)
            w_raw = torch.exp(prev - gen)  # 1 at masked positions (both 0 there)
            if kind == "tis":
                oob = w_raw > self.tis_max
            elif kind == "mis":
                oob = (w_raw < self.mis_min) | (w_raw > self.mis_max)
            else:
                oob = torch.zeros_like(m)
            metrics = {
                "clip_fraction_sum": masked_sum(outside.to(lp.dtype), m),
                "dual_clip_fraction_sum": masked_sum(dual.to(lp.dtype), m),
                "ratio_sum": masked_sum(ratio, m),
                "clamped_ratio_sum": masked_sum(clipped_ratio, m),
                "ratio_max": masked_fill_zero(ratio, m).amax(),  # ratio > 0: 0 only without sampled tokens
                "ratio_min": torch.where(m, ratio, torch.full_like(ratio, float("inf"))).amin(),
                "kl_sum": masked_sum(kl, m),
                "is_ratio_sum": masked_sum(w_report, m),
                "is_oob_sum": masked_sum(oob.to(lp.dtype), m),
                "approx_entropy_sum": -masked_sum(torch.exp(lp - gen) * lp, m),
                "pg_loss": pg_part.detach(),
                "kl_loss": (loss - pg_part).detach(),
            }
        return loss, metrics

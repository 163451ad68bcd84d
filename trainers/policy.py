"""The trainer's policy: master weights on a device, logprob scoring and one GRPO optimizer step.

NeMo RL's split: ``get_logprobs`` recomputes token logprobs with the same model code path the
generator runs (here the same ``M3ForCausalLM`` module), ``train_step`` runs the loss over
micro-batches with one global normaliser (gradient accumulation) and steps AdamW once per global
batch, after clipping the global gradient norm; the learning rate follows ``lr_factor`` (linear
warmup, then constant / linear / cosine decay).

Device and precision: the master model, its gradients and the AdamW states live on
``Policy.device`` in the master dtype (fp32; fp64 in tests). With ``compute_dtype`` below it
(bf16), forward and backward run in a copy cast exactly as the generator casts
(``M3ForCausalLM.cast_for_inference``: router and norms stay fp32, spec §6) rather than under
``torch.autocast`` (which would run the fp32 router GEMM in bf16 and so route differently from the
engine); its gradients are added into fp32 master gradients after every micro-batch. The copy is
refreshed from the masters right after every optimizer step, and again before a scoring / training
call if the masters changed meanwhile (a loaded checkpoint), by one fused cast that also leaves
finite flags on the device (``weight_sync.cast_copy.CastCopy``): a refit in the compute dtype sends
this copy and validates from those flags instead of re-reading the bytes. Logprobs, the loss and
every metric stay on the device; a step reads its metrics back once (``train_step``).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import re
import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager

import torch
from torch.utils.checkpoint import checkpoint

from m3_rollout.model import M3ForCausalLM
from m3_rollout.model.numerics import compute_dtype
from m3_rollout.weight_sync.cast_copy import CastCopy
from m3_rollout.weight_sync.released import ReleasedTensors
from m3_trainers.batch import TrainBatch
from m3_trainers.loss import ClippedPGLossFn, masked_fill_zero
from m3_trainers.selection_replay import SelectionAgreement, replay_block_selection

_INDEXER_KEYS = ("index_q_proj", "index_k_proj", "index_q_norm", "index_k_norm")
LR_SCHEDULES = ("constant", "linear", "cosine")

# scorer(model, rows: token ids [L_i] as ints per row, temperature) -> per row logprobs [L_i] on the
# model's device (entry 0 = 0, entry i = log p(token_i | tokens_<i)), no autograd: the engine's paged
# forward with the rows packed into its forwards, built by the job layer
# (``m3_rollout.engine.score.PagedScorer``; the trainers may not import the engine).
SequenceScorer = Callable[[M3ForCausalLM, list[list[int]], float], list[torch.Tensor]]


class _InvariantValue(torch.autograd.Function):
    """Forward: the batch-invariant logprobs (``value``, no autograd); backward: the gradient goes to
    the training forward's logprobs (``differentiable``) unchanged, as a straight-through estimator.

    The loss then sees the bits the engine's invariant kernels give (the ratio's numerator equals the
    prev logprobs and the rollout's exactly on the step's first update) while the gradient is that of
    the training forward, the same function rounded differently (issue 24: the backward need not be
    invariant). Shapes: both float [B, L], same dtype.
    """

    @staticmethod
    def forward(ctx, differentiable: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        return value.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


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
    block_selection: torch.Tensor | None = None,
    index_replay: bool = False,
    agreement: SelectionAgreement | None = None,
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
        block_selection: optional int [B, L, S, G, K] block-selection record
            (``m3_trainers.selection_replay``): replayed when ``index_replay``, and measured into
            ``agreement`` when given.

    Returns:
        float32 [B, L] (float64 for a float64 model); column 0 is 0 (no prefix), column t =
        log p(token_t | tokens_<t). With ``return_entropy``: (logprobs, entropy [B, L]).
    """
    with replay_routing(model, routed_experts), replay_block_selection(model, block_selection, index_replay, agreement):
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
    """Multiplier of the base learning rate at schedule position ``step`` (0-based).

    Linear warmup over ``warmup_steps`` (factor (step+1)/warmup_steps), then "constant" (1),
    "linear" (1 -> min_lr_ratio at ``total_steps``) or "cosine" (half cosine 1 -> min_lr_ratio).
    Positions, ``warmup_steps`` and ``total_steps`` count nominal optimizer steps: the GRPO loop
    puts optimizer step i of GRPO step k at k x (optimizer steps per GRPO step) + i
    (``m3_trainers.step.schedule_position``), so a step that trains fewer rows than nominal does
    not stretch the schedule.
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


def active_parameter_count(model: M3ForCausalLM) -> int:
    """Parameters one token's forward multiplies with: every weight except the embedding table
    (a lookup), the routed experts counted at ``num_experts_per_tok / num_local_experts`` of their
    size (the experts a token is routed to), the shared expert and lm_head in full."""
    cfg = model.config
    routed_share = cfg.num_experts_per_tok / cfg.num_local_experts
    total = 0.0
    for name, p in model.named_parameters():
        if name.startswith("model.embed_tokens."):
            continue
        total += p.numel() * (routed_share if ".experts.w" in name else 1.0)
    return int(total)


def checkpointed_layer_forward(layer: torch.nn.Module, forward, h: torch.Tensor, inputs) -> torch.Tensor:
    """``forward(h, inputs)`` of one decoder layer under activation checkpointing.

    With autograd recording, the layer keeps only its input ``h`` [B, S, H] and recomputes its
    activations in the backward pass (``torch.utils.checkpoint``, ``use_reentrant=False``). The
    routing-replay ids set on the layer's MoE for this forward (``replay_routing``) and the
    block-selection replay of its attention (``replay_block_selection``) are captured now and set
    again for the recomputation, which runs after those blocks have cleared them (the
    recomputation adds no agreement counts a second time).
    Without autograd it is plain ``forward``.
    """
    if not torch.is_grad_enabled():
        return forward(h, inputs)
    moe = layer.block_sparse_moe if layer.is_moe else None
    attn = layer.self_attn
    routes = None if moe is None else moe.replay_topk_ids
    blocks = attn.block_replay
    calls = []

    def run(x: torch.Tensor) -> torch.Tensor:
        outer_r = None if moe is None else moe.replay_topk_ids
        outer_b = attn.block_replay
        if moe is not None:
            moe.replay_topk_ids = routes
        if blocks is not None:  # counted on the first call only
            attn.block_replay = blocks if not calls else dataclasses.replace(blocks, stats=None)
        calls.append(1)
        try:
            return forward(x, inputs)
        finally:
            if moe is not None:
                moe.replay_topk_ids = outer_r
            attn.block_replay = outer_b

    return checkpoint(run, h, use_reentrant=False)


def enable_activation_checkpointing(model: M3ForCausalLM) -> None:
    """Make every decoder layer of ``model`` run through :func:`checkpointed_layer_forward`
    (an instance-level ``forward``; parameter names and state_dict are unchanged)."""
    for layer in model.model.layers:
        layer.forward = functools.partial(checkpointed_layer_forward, layer, type(layer).forward.__get__(layer))


def batch_to_device(batch: TrainBatch, device: torch.device) -> TrainBatch:
    """``batch`` with its tensors on ``device`` (no copy where already there), except ``lengths``,
    which stays on the host so micro-batch slicing (``TrainBatch.slice``) never waits for the device."""
    routed, sel = batch.routed_experts, batch.block_selection

    def move(t: torch.Tensor) -> torch.Tensor:
        return t.to(device, non_blocking=True)

    return TrainBatch(
        move(batch.token_ids),
        move(batch.loss_mask),
        move(batch.rollout_logprobs),
        move(batch.advantages),
        batch.lengths.cpu(),
        None if routed is None else move(routed),
        None if sel is None else move(sel),
    )


class Policy:
    """Owns the master model, its optimizer and LR scheduler, the compute copy and the optional
    reference model, all on one device.

    Args:
        model: ``M3ForCausalLM`` in the master dtype, fp32 (fp64 for tests); moved to ``device``.
        lr, weight_decay, betas, eps: AdamW (states in the master dtype, on the device).
        max_grad_norm: global gradient-norm clip.
        freeze_indexer, freeze_router_bias, freeze_patterns: see ``frozen_parameter_names``.
        warmup_steps, lr_schedule, total_steps, min_lr_ratio: see ``lr_factor`` (in schedule
            positions: nominal optimizer steps). Each optimizer step advances the position by one;
            ``set_schedule_position`` moves it (the GRPO step does, ``m3_trainers.step``).
        reference_model: keep a frozen copy of the initial weights (in the compute dtype) for the
            KL penalty.
        routing_replay: use ``TrainBatch.routed_experts`` in every trainer forward.
        index_replay: use ``TrainBatch.block_selection`` in every trainer forward (block-selection
            replay, ``m3_trainers.selection_replay``).
        device: where the model, optimizer, logprobs and loss live; None = the model's device.
        compute_dtype: dtype forward and backward run in; None or the master dtype = the master
            model itself; lower (torch.bfloat16) = a cast copy (module docstring).
        activation_checkpointing: recompute each decoder layer's activations in the backward pass
            (``enable_activation_checkpointing``).
        scorer: batch-invariant mode (design.md §4.6): ``get_logprobs`` (the prev logprobs compared
            with the rollout's, and the reference's) scores each sequence with it on the compute copy
            instead of the training forward (``SequenceScorer``), and ``train_step``'s ratio numerator
            takes its value from it too (the gradient still flows through the training forward).
            None = the training forward.

    Attributes:
        model: the master model (what checkpoints save and weight sync sends).
        compute: the model forward and backward run in (``model`` itself at full precision).
        device: ``torch.device``.
        flops_per_token: 6 x ``active_parameter_count`` (forward + backward FLOPs of one token).
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
        device: torch.device | str | None = None,
        index_replay: bool = False,
        compute_dtype: torch.dtype | None = None,
        activation_checkpointing: bool = False,
        scorer: SequenceScorer | None = None,
    ):
        self.scorer = scorer
        self.device = torch.device(device) if device is not None else model.lm_head.weight.device
        self.model = model.to(self.device).train()
        self.max_grad_norm = max_grad_norm
        self.routing_replay = routing_replay
        self.index_replay = index_replay
        groups = split_param_groups(model, freeze_indexer, freeze_router_bias, weight_decay, freeze_patterns)
        self.optimizer = torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_factor(s, warmup_steps, lr_schedule, total_steps, min_lr_ratio)
        )
        master_dtype = model.lm_head.weight.dtype
        self.compute = model
        self._cast: CastCopy | None = None
        if compute_dtype is not None and compute_dtype != master_dtype:
            self.compute = copy.deepcopy(model).cast_for_inference(compute_dtype).train()
            for pc, pm in zip(self.compute.parameters(), model.parameters()):
                pc.requires_grad_(pm.requires_grad)
            # NOTE: casting a loaded model rounds the router gate and bias through the low dtype
            # on their way back to fp32; the masters' exact values go in before the reference copy.
            self._cast = CastCopy(model, self.compute)
            self._refresh_compute()
        self._released = ReleasedTensors(model, cast=self._cast)
        self._pairs = [  # (master, compute) of every trainable parameter (used when they differ)
            (pm, pc) for pm, pc in zip(model.parameters(), self.compute.parameters()) if pm.requires_grad
        ]
        self.reference = None
        if reference_model:
            self.reference = copy.deepcopy(self.compute).eval()
            self.reference.requires_grad_(False)
        if activation_checkpointing:
            enable_activation_checkpointing(self.compute)
        self.flops_per_token = 6 * active_parameter_count(model)

    def named_released_tensors(self) -> ReleasedTensors:
        """Master weights in released checkpoint naming, on the device (what weight sync sends):
        a re-iterable of (name, tensor) whose fingerprint lets the sender resolve the 4,195 views
        of an M3-shaped model once instead of every refit (``weight_sync.ReleasedTensors``), with
        the compute copy's attested cast (``cast``) that a direct refit in the compute dtype sends
        instead. The same object every call."""
        return self._released

    def _routes(self, mb: TrainBatch, replay: bool) -> torch.Tensor | None:
        return mb.routed_experts if replay else None

    def _refresh_compute(self) -> None:
        """Cast the master weights into the compute copy when they changed since the last cast (a
        no-op at full precision or when nothing changed). Run after every optimizer step and
        before every scoring / training call, so weights loaded into ``model`` (a resumed
        checkpoint) always reach the copy."""
        if self._cast is not None:
            self._cast.refresh()

    def elapsed(self, t0: float) -> float:
        """Seconds since ``t0`` once the device's queued work is done (one sync on CUDA)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - t0

    def _logprob_dtype(self) -> torch.dtype:
        return torch.float64 if self.model.lm_head.weight.dtype == torch.float64 else torch.float32

    @torch.no_grad()
    def get_logprobs(
        self,
        batch: TrainBatch,
        temperature: float,
        micro_batch_size: int,
        reference: bool = False,
        routing_replay: bool | None = None,
        index_replay: bool | None = None,
        agreement: SelectionAgreement | None = None,
    ) -> torch.Tensor:
        """Logprobs of ``batch.token_ids`` under the current (or reference) weights, without autograd
        (the plain forward takes the same PyTorch ops with or without it: the engine's fused
        kernels are only handed to its paged forward).

        Args:
            batch: on the host or the device (``batch_to_device``).
            reference: score with the frozen reference model.
            routing_replay: use the batch's routes (None = ``Policy.routing_replay``).
            index_replay: use the batch's block selections (None = ``Policy.index_replay``).
            agreement: add the sparse layers' selection-agreement counts against the batch's
                block selections here (``SelectionAgreement``; None = not measured).

        With ``Policy.scorer`` the rows' first ``lengths[b]`` tokens go through the scorer in one
        call (it packs them into its forwards; ``micro_batch_size`` unused); routing / index replay
        and the agreement do not apply there (the invariant forward routes and selects as the engine
        did, bit for bit).

        Returns:
            float32 (float64 for an fp64 master) [B, L] on ``Policy.device``, 0 past each row's length.

        Raises:
            ValueError: ``reference=True`` without a reference model.
        """
        model = self.reference if reference else self.compute
        if model is None:
            raise ValueError("no reference model: construct Policy(reference_model=True) for a KL penalty")
        self._refresh_compute()
        replay = self.routing_replay if routing_replay is None else routing_replay
        blocks = self.index_replay if index_replay is None else index_replay
        batch = batch_to_device(batch, self.device)
        out = torch.zeros(batch.rollout_logprobs.shape, dtype=self._logprob_dtype(), device=self.device)
        if self.scorer is not None:
            lengths = batch.lengths.tolist()
            rows = [row[:n] for row, n in zip(batch.token_ids.cpu().tolist(), lengths)]  # one host copy
            for b, lp in enumerate(self.scorer(model, rows, temperature)):
                out[b, : lengths[b]] = lp
            return out
        for s in range(0, batch.token_ids.shape[0], micro_batch_size):
            mb = batch.slice(slice(s, s + micro_batch_size))
            lp = token_logprobs(
                model,
                mb.token_ids,
                temperature,
                self._routes(mb, replay),
                block_selection=mb.block_selection,
                index_replay=blocks,
                agreement=agreement,
            )
            out[s : s + micro_batch_size, : mb.token_ids.shape[1]] = lp
        return out

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    @property
    def schedule_position(self) -> int:
        """The LR schedule's position: ``lr_factor``'s ``step`` for the next optimizer step (the
        LambdaLR's ``last_epoch``, which checkpoints save with the scheduler)."""
        return self.scheduler.last_epoch

    def set_schedule_position(self, position: int) -> None:
        """Move the LR schedule to ``position`` (>= 0): the optimizer's learning rates become
        base_lr x factor(position), the expression LambdaLR evaluates, so moving to the position
        the schedule is already at changes no bit. The next optimizer step trains at it and
        advances from it.

        Raises:
            ValueError: ``position`` < 0.
        """
        if position < 0:
            raise ValueError(f"LR schedule position {position}: must be >= 0")
        s = self.scheduler
        s.last_epoch = position
        for group, base, fn in zip(self.optimizer.param_groups, s.base_lrs, s.lr_lambdas, strict=True):
            group["lr"] = base * fn(position)
        s._last_lr = [group["lr"] for group in self.optimizer.param_groups]  # what get_last_lr() reads

    def train_step(
        self,
        batch: TrainBatch,
        loss_fn: ClippedPGLossFn,
        temperature: float,
        micro_batch_size: int,
        prev_logprobs: torch.Tensor | None = None,
        reference_logprobs: torch.Tensor | None = None,
        prev_on_current_weights: bool = False,
    ) -> dict:
        """One optimizer step on a global batch (gradients accumulated over micro-batches).

        The ratio is taken against ``prev_logprobs``, the current policy's own logprobs before
        the step (recomputed here unless given: when one rollout batch is split into several
        optimizer steps, pass the logprobs computed once before the first step, as NeMo RL does,
        so the later steps are clipped against the rollout-time policy). Reference logprobs are
        computed only when ``loss_fn.needs_reference``.

        Train/inference mismatch over sampled tokens (rollout lp = ``batch.rollout_logprobs``;
        NeMo RL's names and definitions, docs/metrics.md), with d = prev_lp - rollout_lp:
          token_mult_prob_error = mean exp(|d|)                       (1.0 = identical)
          gen_kl_error          = mean (e^d - 1 - d)   (k3 estimate of KL(generator || trainer), >= 0)
          policy_kl_error       = mean (e^-d - 1 + d)  (k3 estimate of KL(trainer || generator), >= 0)
          js_divergence_error   = mean of 1/2 f(prev_lp - m) + 1/2 f(rollout_lp - m), f(x) = e^x - 1 - x,
                                  m = log((e^prev_lp + e^rollout_lp) / 2) (Jensen-Shannon, per token)

        Every per-micro-batch figure is accumulated on the device; the metrics are read back
        once, after the gradient clip (the skip decision needs them), before the optimizer step.

        Throughput: FLOPs are counted, not measured: ``flops_per_token`` (6 x active parameters,
        the routed experts at top_k / E) x the tokens the forward computes (padded micro-batch
        B x L, prompt tokens included); attention-score FLOPs (quadratic in L) and the recompute
        of activation checkpointing are not counted. Scoring forwards count 2 x active parameters.

        Batch-invariant mode (``Policy.scorer``): the loss's logprobs (the ratio's numerator) take
        their value from the scorer, the engine's invariant paged forward, and their gradient from
        the training forward (``_InvariantValue``). On the current weights the scorer's output is the
        prev logprobs themselves (same kernels, same weights: the same bits), so it is reused when
        they were computed here or ``prev_on_current_weights`` says so; otherwise (a later optimizer
        step of a split rollout batch) the batch is scored again first.

        Args:
            batch: a host (or device) batch; validated here.
            prev_logprobs, reference_logprobs: optional float [B, L] (any device).
            prev_on_current_weights: ``prev_logprobs`` were computed on the weights this step
                starts from (the first optimizer step of a GRPO step).

        Returns:
            metrics (Python numbers): loss, pg_loss, kl_loss, grad_norm, lr, token_mult_prob_error,
            gen_kl_error, policy_kl_error, js_divergence_error, max_logprob_abs_diff, probs_ratio,
            probs_ratio_clamped, probs_ratio_min / _max (0 without sampled tokens), clip_fraction,
            dual_clip_fraction, kl_penalty (mean KL estimate to the reference, before the penalty
            weight), sampling_importance_ratio, is_oob_ratio, approx_entropy (``m3_trainers.loss``),
            entropy (exact entropy of the trainer's distribution, mean over sampled tokens),
            num_tokens, logprob_seconds, train_seconds (device work included), train_flops and
            logprob_flops (counted as above), train_tflops_per_s (forward + backward TFLOP/s of the
            optimizer step), skipped_step (the loss or gradient norm was not finite: no update
            was applied; the LR schedule still advances).
        """
        batch.validate()
        self.model.train()
        self.compute.train()
        t0 = time.perf_counter()
        dev = batch_to_device(batch, self.device)
        flop2 = self.flops_per_token // 3  # forward only
        scored = 0
        if prev_logprobs is None:
            prev = self.get_logprobs(dev, temperature, micro_batch_size)
            scored += dev.token_ids.numel()
        else:
            prev = prev_logprobs.to(self.device)
        ref = None
        if loss_fn.needs_reference:
            if reference_logprobs is None:
                ref = self.get_logprobs(dev, temperature, micro_batch_size, reference=True)
                scored += dev.token_ids.numel()
            else:
                ref = reference_logprobs.to(self.device)
        numerator = None  # batch-invariant mode: the loss logprobs' value
        if self.scorer is not None:
            if prev_logprobs is None or prev_on_current_weights:
                numerator = prev
            else:
                numerator = self.get_logprobs(dev, temperature, micro_batch_size)
                scored += dev.token_ids.numel()
        self._refresh_compute()
        logprob_seconds = self.elapsed(t0)
        t1 = time.perf_counter()
        stats = mismatch_stats(dev.rollout_logprobs, prev, dev.loss_mask)
        num_tokens = float(batch.loss_mask.sum())  # host batch: no device sync
        # sequence-level loss: the mean over the sequences that have loss tokens (NeMo RL's valid
        # sequences); an overlong-filtered or errored row (all-zero mask) adds nothing and counts nothing
        valid_seqs = float((batch.loss_mask.sum(dim=1) > 0).sum())
        normalizer = max(num_tokens, 1.0) if loss_fn.token_level_loss else max(valid_seqs, 1.0)
        self.optimizer.zero_grad(set_to_none=True)
        self.compute.zero_grad(set_to_none=True)
        zero = torch.zeros((), dtype=torch.float64, device=self.device)  # sums in fp64, as Python floats were
        keys = ("pg_loss", "kl_loss", "clip_fraction_sum", "dual_clip_fraction_sum", "ratio_sum", "kl_sum")
        keys += ("clamped_ratio_sum", "is_ratio_sum", "is_oob_sum", "approx_entropy_sum")
        sums = {k: zero.clone() for k in ("loss", "entropy_sum", "ratio_max", *keys)}
        sums["ratio_min"] = torch.full((), float("inf"), dtype=torch.float64, device=self.device)
        computed = 0
        for s in range(0, dev.token_ids.shape[0], micro_batch_size):
            mb = dev.slice(slice(s, s + micro_batch_size))
            l = mb.token_ids.shape[1]
            computed += mb.token_ids.numel()
            lp, ent = token_logprobs(
                self.compute,
                mb.token_ids,
                temperature,
                self._routes(mb, self.routing_replay),
                return_entropy=True,
                block_selection=mb.block_selection,
                index_replay=self.index_replay,
            )
            if numerator is not None:
                lp = _InvariantValue.apply(lp, numerator[s : s + micro_batch_size, :l].to(lp.dtype))
            loss, m = loss_fn.loss_and_stats(
                lp,
                prev[s : s + micro_batch_size, :l],
                mb.advantages,
                mb.loss_mask,
                normalizer,
                generation_logprobs=mb.rollout_logprobs,
                reference_logprobs=None if ref is None else ref[s : s + micro_batch_size, :l],
            )
            loss.backward()
            self._accumulate_master_grads()
            sums["loss"] += loss.detach()
            for k in keys:
                sums[k] += m[k]
            sums["entropy_sum"] += masked_fill_zero(ent, mb.loss_mask).sum()
            sums["ratio_max"] = torch.maximum(sums["ratio_max"], m["ratio_max"])
            sums["ratio_min"] = torch.minimum(sums["ratio_min"], m["ratio_min"].double())
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        sums["grad_norm"] = torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm).to(zero.dtype)
        both = {**stats, **sums}
        # the one readback of the step
        host = dict(zip(both, torch.stack([v.double() for v in both.values()]).tolist()))
        lr = self.lr
        skipped = not (math.isfinite(host["grad_norm"]) and math.isfinite(host["loss"]))
        if not skipped:
            self.optimizer.step()
            self._refresh_compute()  # now, while the masters are hot: the refit reads an attested copy
        self.scheduler.step()
        train_seconds = self.elapsed(t1)
        n = max(num_tokens, 1.0)
        train_flops = float(self.flops_per_token * computed)
        return {
            **{k: host[k] for k in stats},  # token_mult_prob_error, gen_kl_error, policy_kl_error, ...
            "loss": host["loss"],
            "pg_loss": host["pg_loss"],
            "kl_loss": host["kl_loss"],
            "grad_norm": host["grad_norm"],
            "lr": lr,
            "probs_ratio": host["ratio_sum"] / n,
            "probs_ratio_clamped": host["clamped_ratio_sum"] / n,
            "probs_ratio_max": host["ratio_max"],
            "probs_ratio_min": host["ratio_min"] if math.isfinite(host["ratio_min"]) else 0.0,
            "clip_fraction": host["clip_fraction_sum"] / n,
            "dual_clip_fraction": host["dual_clip_fraction_sum"] / n,
            "kl_penalty": host["kl_sum"] / n,
            "sampling_importance_ratio": host["is_ratio_sum"] / n,
            "is_oob_ratio": host["is_oob_sum"] / n,
            "approx_entropy": host["approx_entropy_sum"] / n,
            "entropy": host["entropy_sum"] / n,
            "num_tokens": num_tokens,
            "skipped_step": skipped,
            "logprob_seconds": logprob_seconds,
            "train_seconds": train_seconds,
            "train_flops": train_flops,
            "logprob_flops": float(flop2 * scored),
            "train_tflops_per_s": train_flops / max(train_seconds, 1e-9) / 1e12,
        }

    def _accumulate_master_grads(self) -> None:
        """Add the compute copy's gradients into the fp32 master gradients and free them (after
        every micro-batch, so accumulation over micro-batches happens in the master dtype)."""
        if self.compute is self.model:
            return
        with torch.no_grad():
            for pm, pc in self._pairs:
                if pc.grad is None:
                    continue
                if pm.grad is None:
                    pm.grad = pc.grad.to(pm.dtype)
                else:
                    pm.grad.add_(pc.grad)
                pc.grad = None


def mismatch_stats(rollout_logprobs: torch.Tensor, trainer_logprobs: torch.Tensor, mask: torch.Tensor) -> dict:
    """:func:`mismatch_metrics` as 0-d fp64 tensors on the inputs' device (no host sync)."""
    m = mask.bool()
    count = m.sum()
    n = count.clamp(min=1).double()
    d = masked_fill_zero(trainer_logprobs.double() - rollout_logprobs.double(), m)  # log r
    one = torch.ones((), dtype=torch.float64, device=d.device)
    prev = masked_fill_zero(trainer_logprobs.double(), m)
    gen = masked_fill_zero(rollout_logprobs.double(), m)
    mix = torch.logaddexp(prev, gen) - math.log(2.0)  # log of the mixture (p + q) / 2
    a, b = prev - mix, gen - mix
    jsd = 0.5 * (torch.exp(a) - 1 - a) + 0.5 * (torch.exp(b) - 1 - b)
    return {
        "token_mult_prob_error": torch.where(count > 0, masked_fill_zero(torch.exp(d.abs()), m).sum() / n, one),
        "gen_kl_error": masked_fill_zero(torch.exp(d) - 1 - d, m).sum() / n,
        "policy_kl_error": masked_fill_zero(torch.exp(-d) - 1 + d, m).sum() / n,
        "js_divergence_error": masked_fill_zero(jsd, m).sum() / n,
        "max_logprob_abs_diff": d.abs().amax(),  # masked positions are 0
    }


def mismatch_metrics(rollout_logprobs: torch.Tensor, trainer_logprobs: torch.Tensor, mask: torch.Tensor) -> dict:
    """Train/inference mismatch over sampled tokens (see ``Policy.train_step``).

    Args:
        rollout_logprobs, trainer_logprobs: float [B, L] on one device; mask: [B, L] sampled tokens.

    Returns:
        {"token_mult_prob_error", "gen_kl_error", "policy_kl_error", "js_divergence_error",
        "max_logprob_abs_diff"} as floats (1.0 / 0.0 / 0.0 / 0.0 / 0.0 when no token is sampled),
        computed in fp64 on the inputs' device, read back once.
    """
    stats = mismatch_stats(rollout_logprobs, trainer_logprobs, mask)
    return dict(zip(stats, torch.stack(list(stats.values())).tolist()))

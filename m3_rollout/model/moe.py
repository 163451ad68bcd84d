"""SwiGLU-OAI MLPs and the sigmoid-routed MoE block (spec §3.6-§3.8).

Governing idea: the router runs in (at least) fp32 — sigmoid scores, bias used only to *choose*
experts, unbiased scores renormalised and scaled to weight them — and the routed experts run
grouped by expert (one GEMM pair per expert that received tokens), plus one always-on shared
expert.

Shape legend:
  T  tokens (flattened batch)   H  hidden size   E  routed experts   K  experts per token
  I  expert FFN width           N  tokens routed to one expert
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .configuration import M3Config
from .fused import fused_linear, pack_linear_weights, packed_linear, packed_ok
from .numerics import compute_dtype
from .paged_ops import PagedOps, needs_autograd


def swiglu_oai(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float, beta: float = 1.0) -> torch.Tensor:
    """act = g' * sigmoid(alpha * g') * (u' + beta), g' = min(gate, limit), u' = clamp(up, ±limit).

    gate/up: same shape, any float dtype. The gate has NO lower clamp (spec §3.7). Computed in
    fp32 (fp64 for fp64 input; vLLM's AMD path notes bf16 intermediates cost accuracy) and returned
    in gate.dtype.
    """
    cdt = compute_dtype(gate.dtype)
    g = gate.to(cdt).clamp(max=limit)
    u = up.to(cdt).clamp(min=-limit, max=limit)
    return (g * torch.sigmoid(alpha * g) * (u + beta)).to(gate.dtype)


class DenseMLP(nn.Module):
    """down(SwiGLU-OAI(gate(x), up(x))): the dense-layer MLP and the MoE shared expert.

    x: [..., H] -> [..., H], same dtype.
    """

    def __init__(self, config: M3Config, intermediate_size: int):
        super().__init__()
        h = config.hidden_size
        self.gate_proj = nn.Linear(h, intermediate_size, bias=False)
        self.up_proj = nn.Linear(h, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, h, bias=False)
        self.alpha, self.limit, self.beta = config.swiglu_alpha, config.swiglu_limit, config.swiglu_beta
        self.packed_gate_up: torch.Tensor | None = None  # [2I, H] gate|up buffer (pack_projections)

    def forward(self, x: torch.Tensor, ops: PagedOps | None = None) -> torch.Tensor:
        """x [..., H] -> [..., H]; ``ops`` (paged path only): the three GEMMs through ``ops.project``
        (the table's ``linear`` when it has one)."""
        if ops is not None and ops.linear is not None:
            gate, up = ops.project(self.gate_proj, x), ops.project(self.up_proj, x)
            return ops.project(self.down_proj, swiglu_oai(gate, up, self.alpha, self.limit, self.beta))
        return self.down_proj(swiglu_oai(self.gate_proj(x), self.up_proj(x), self.alpha, self.limit, self.beta))

    def pack_projections(self) -> None:
        """Put gate/up weights into ``packed_gate_up`` [2I, H] (parameters become views; model/fused.py)."""
        self.packed_gate_up = pack_linear_weights([self.gate_proj, self.up_proj])

    def forward_fused(self, x: torch.Tensor, ops: PagedOps) -> torch.Tensor:
        """Fused paged path (``ops.fused_layers``): x [T, H] -> [T, H]. Decode-sized (``ops.skinny_ok``
        on the packed gate|up buffer): one skinny GEMM computing gate|up with SwiGLU-OAI in its
        epilogue (same roundings), then the skinny down GEMM. A table with ``linear_swiglu``
        (batch-invariant) does the same where ``ops.linear_swiglu_takes(T)``: gate|up + SwiGLU in one
        launch with the bits of the two, then the down GEMM through ``ops.linear``. Otherwise one
        gate|up GEMM, ``ops.swiglu`` and the down GEMM, through ``ops.linear`` when the table has one."""
        gate_up = [self.gate_proj, self.up_proj]
        if packed_ok(self.packed_gate_up, gate_up) and ops.skinny_ok(x, self.packed_gate_up):
            act = ops.skinny_linear(x, self.packed_gate_up, (self.alpha, self.limit, self.beta))  # [T, I]
            return fused_linear(act, self.down_proj.weight, ops)
        if packed_ok(self.packed_gate_up, gate_up) and ops.linear_swiglu_takes(x.shape[0]):
            act = ops.linear_swiglu(x, self.packed_gate_up, self.alpha, self.limit, self.beta)  # [T, I]
            return ops.project(self.down_proj, act)
        gu = packed_linear(x, self.packed_gate_up, gate_up, ops)  # [T, 2I]
        return ops.project(self.down_proj, ops.swiglu(gu, self.alpha, self.limit, self.beta))


def route(
    logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sigmoid top-k routing with selection-only bias (spec §3.6 steps 2-4).

    logits: [T, E] router logits (fp32 or fp64); bias: [E] or None.
    Returns (weights [T, K] in logits.dtype, ids [T, K] int64): ids = the K experts with the
    largest sigmoid(logits) + bias (ties to the lower expert id, via a stable sort); weights =
    the UNBIASED sigmoid scores of those experts, renormalised to sum 1, times `scaling`.
    """
    scores = torch.sigmoid(logits)  # [T, E]
    choice = scores if bias is None else scores + bias.to(scores.dtype)
    ids = torch.sort(choice, dim=-1, descending=True, stable=True).indices[:, :top_k]  # [T, K]
    w = scores.gather(1, ids)  # [T, K]
    return w / w.sum(dim=-1, keepdim=True) * scaling, ids


def route_given(logits: torch.Tensor, ids: torch.Tensor, scaling: float) -> torch.Tensor:
    """Routing replay (design.md §2.3): weights for externally given expert ids.

    logits: [T, E] router logits of THIS model; ids: [T, K] int64 (e.g. recorded by the rollout
    engine). Returns weights [T, K] in logits.dtype = this model's unbiased sigmoid scores at
    those ids, renormalised and scaled exactly as in `route`, so the router still gets gradients.
    """
    w = torch.sigmoid(logits).gather(1, ids)  # [T, K]
    return w / w.sum(dim=-1, keepdim=True) * scaling


def grouped_experts(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    act,
) -> torch.Tensor:
    """sum_k weights[t,k] * W2[e] act(W13[e] x[t]) with e = ids[t,k], computed per expert.

    x: [T, H]; ids: [T, K] int64; weights: [T, K]; w13: [E, 2I, H] (gate rows then up rows);
    w2: [E, H, I]; act(gate [N, I], up [N, I]) -> [N, I]. Returns [T, H] in x.dtype.
    Tokens are sorted by expert so each expert that received any runs one GEMM pair (no per-token
    loop); results are combined with index_add in x.dtype (spec §6).
    """
    t, k = ids.shape
    inter = w2.shape[-1]
    flat = ids.reshape(-1)  # [T*K]
    order = torch.argsort(flat, stable=True)  # [T*K]
    token = order // k  # [T*K] token of each sorted (token, slot) pair
    w_sorted = weights.reshape(-1)[order]  # [T*K]
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()  # NOTE: host sync, one per layer
    out = torch.zeros_like(x)  # [T, H]
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        tok = token[start : start + n]  # [N]
        h = x[tok] @ w13[e].t()  # [N, 2I]
        y = act(h[:, :inter], h[:, inter:]) @ w2[e].t()  # [N, H]
        y = (y.to(w_sorted.dtype) * w_sorted[start : start + n, None]).to(x.dtype)
        out.index_add_(0, tok, y)
        start += n
    return out


def grouped_experts_gemm(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    act,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The maths of :func:`grouped_experts` as two grouped GEMMs (``torch._grouped_mm``) over the
    (token, slot) pairs sorted by expert: no host sync, no loop over experts, a fixed number of
    launches whatever E (the per-expert loop runs ~20 ops per expert, and the training step of a
    small MoE is bound by their launch cost; measured op counts in docs/benchmarks.md).

    x: [T, H]; ids: [T, K] int64 (no -1); weights: [T, K]; w13: [E, 2I, H]; w2: [E, H, I]; act as
    in :func:`grouped_experts`; dtype: the GEMMs' input dtype (None = x.dtype; bf16 under CUDA
    autocast, which does not cover ``_grouped_mm``). Returns [T, H] in x.dtype; differentiable in
    x, weights, w13 and w2 (``_grouped_mm`` has a backward). The loop's roundings: each
    expert's GEMMs in ``dtype`` with fp32 accumulation, the routing weight applied in
    weights.dtype, the K slots summed in x.dtype (in slot order; the loop adds them in expert order).
    Deterministic run to run (no atomics in the gathers' backward or in the combine).
    """
    t, k = ids.shape
    inter = w2.shape[-1]
    dt = dtype or x.dtype
    flat = ids.reshape(-1)  # [T*K]
    order = torch.argsort(flat, stable=True)  # [T*K]
    unsort = torch.empty_like(order)
    unsort[order] = torch.arange(order.numel(), device=order.device)  # [T*K] inverse permutation
    # [E] group ends = pairs with id <= e; searchsorted, not bincount (whose CUDA kernel reads the max id on the host)
    experts = torch.arange(w13.shape[0], device=flat.device, dtype=flat.dtype)
    offs = torch.searchsorted(flat[order], experts, right=True).to(torch.int32)
    # Run-to-run deterministic, forward and backward: every gather below reads each source row once
    # (its backward writes each row once), and the K slots of a token add up in a fixed order (sum
    # over a dim) - an index_add over the token ids would add them with atomics in arrival order.
    # [T*K, H] gathered from the [T, K, H] view (no [T*K, H] copy first); grad: the K slots summed
    xs = x.unsqueeze(1).expand(t, k, x.shape[-1])[order // k, order % k]
    h = torch._grouped_mm(xs.to(dt), w13.to(dt).transpose(1, 2), offs=offs)  # [T*K, 2I]
    y = torch._grouped_mm(act(h[:, :inter], h[:, inter:]), w2.to(dt).transpose(1, 2), offs=offs)  # [T*K, H]
    y = (y.to(weights.dtype) * weights.reshape(-1)[order, None]).to(x.dtype)
    return y[unsort].view(t, k, y.shape[-1]).sum(dim=1)


def use_grouped_gemm(x: torch.Tensor) -> torch.dtype | None:
    """The GEMM dtype :class:`StackedExperts` runs :func:`grouped_experts_gemm` in for ``x``, or
    None for the per-expert loop: bf16 on a CUDA device of compute capability >= 9.0 (where
    ``torch._grouped_mm`` has its kernel) when x is bf16 or CUDA autocast asks for bf16; the loop
    everywhere else (the CPU jobs keep their exact results), and with the environment variable
    ``M3_ROLLOUT_GROUPED_GEMM=0`` (exactly "0", read once when this module is imported: a
    diagnostic switch for the per-expert loop on the GPU too, to compare training runs; give such a
    run its own ``M3_ROLLOUT_CACHE`` so it builds its own checkpoint)."""
    if not x.is_cuda or not hasattr(torch, "_grouped_mm") or not _GROUPED_GEMM_OK or not _GROUPED_GEMM_ENV:
        return None
    if torch.cuda.get_device_capability(x.device) < (9, 0):
        return None
    if x.dtype == torch.bfloat16:
        return torch.bfloat16
    if torch.is_autocast_enabled("cuda") and torch.get_autocast_dtype("cuda") == torch.bfloat16:
        return torch.bfloat16
    return None


_GROUPED_GEMM_OK = True  # cleared (with a warning) if torch._grouped_mm ever refuses a call
_GROUPED_GEMM_ENV = os.environ.get("M3_ROLLOUT_GROUPED_GEMM", "1") != "0"


class StackedExperts(nn.Module):
    """Routed expert weights stacked per layer: w13 [E, 2I, H] (gate rows, then up rows), w2 [E, H, I].

    The released checkpoint stores them per expert (w1 = w13[e, :I], w3 = w13[e, I:], w2 = w2[e]);
    see loading.py. Gate-then-up, NOT gpt-oss interleaving (spec §2.2).
    """

    def __init__(self, config: M3Config):
        super().__init__()
        e, h, i = config.num_local_experts, config.hidden_size, config.intermediate_size
        self.w13 = nn.Parameter(torch.empty(e, 2 * i, h))
        self.w2 = nn.Parameter(torch.empty(e, h, i))
        nn.init.normal_(self.w13, std=0.02)
        nn.init.normal_(self.w2, std=0.02)
        self.alpha, self.limit, self.beta = config.swiglu_alpha, config.swiglu_limit, config.swiglu_beta

    def act(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return swiglu_oai(gate, up, self.alpha, self.limit, self.beta)

    def forward(
        self,
        x: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
        fused_experts: Callable[..., torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """x [T, H], ids/weights [T, K] -> [T, H].

        With ``fused_experts`` (``PagedOps.fused_experts``: the engine's Triton MoE on CUDA, same
        maths) and no autograd needed, that op runs on the experts in `expert_range` (EP,
        design.md §3.5; default all); otherwise the PyTorch reference `grouped_experts`.
        """
        if fused_experts is not None and not needs_autograd(x, self.w13, self.w2):
            return fused_experts(
                x,
                ids,
                weights,
                self.w13,
                self.w2,
                alpha=self.alpha,
                limit=self.limit,
                beta=self.beta,
                expert_range=getattr(self, "expert_range", None),
            )
        dt = use_grouped_gemm(x)
        if dt is not None:
            try:
                return grouped_experts_gemm(x, ids, weights, self.w13, self.w2, self.act, dt)
            except RuntimeError as e:  # a torch build whose kernel refuses these shapes: keep training
                if isinstance(e, torch.OutOfMemoryError):  # memory, not the kernel: do not disable it for good
                    raise
                global _GROUPED_GEMM_OK
                _GROUPED_GEMM_OK = False
                warnings.warn(
                    f"torch._grouped_mm failed ({e}); routed experts fall back to the per-expert loop", stacklevel=2
                )
        return grouped_experts(x, ids, weights, self.w13, self.w2, self.act)


class M3MoE(nn.Module):
    """Sigmoid-routed MoE + shared expert (spec §3.6). Released name: `block_sparse_moe`.

    Parameters: `gate` (Linear H->E, fp32 weight), `e_score_correction_bias` [E] fp32
    (requires_grad False: the bias is a load-balancing statistic, frozen by default), `experts`
    (StackedExperts), `shared_experts` (DenseMLP of width shared_intermediate_size).

    forward(x [..., H]) -> [..., H] in x.dtype. After each call `last_topk_ids` holds the chosen
    expert ids [T, K] int64 (T = x.numel() // H, row-major over the leading dims), for routing
    records / replay.

    Routing replay (trainer side): `forward(x, topk_ids=ids)` or, when the caller cannot reach
    this module's call (the decoder layer calls it), `replay_topk_ids = ids` before the model
    forward (cleared by the caller). ids: [T, K] int64 given expert ids per token; a row holding
    -1 keeps this router's own choice for that token. Weights come from `route_given`.
    """

    def __init__(self, config: M3Config):
        super().__init__()
        e = config.num_local_experts
        self.top_k = config.num_experts_per_tok
        self.routed_scaling_factor = config.routed_scaling_factor
        self.use_routing_bias = config.use_routing_bias
        # NOTE: the router weight is created fp32 whatever the default dtype is (released in fp32,
        # spec §2.2); M3ForCausalLM.cast_for_inference keeps it there.
        self.gate = nn.Linear(config.hidden_size, e, bias=False, dtype=torch.float32)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(e, dtype=torch.float32), requires_grad=False)
        self.experts = StackedExperts(config)
        self.shared_experts = DenseMLP(config, config.shared_intermediate_size)
        self.last_topk_ids: torch.Tensor | None = None
        self.replay_topk_ids: torch.Tensor | None = None

    def router_logits(self, x: torch.Tensor, ops: PagedOps | None = None) -> torch.Tensor:
        """x [T, H] -> router logits [T, E] in max(fp32, weight dtype); the GEMM through
        ``ops.matmul`` when a table is given (paged path)."""
        w = self.gate.weight
        rdt = torch.promote_types(compute_dtype(x.dtype), compute_dtype(w.dtype))
        if ops is not None:
            return ops.matmul(x.to(rdt), w.to(rdt))
        return F.linear(x.to(rdt), w.to(rdt))  # [T, E]

    def router(self, x: torch.Tensor, ops: PagedOps | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (weights [T, K], ids [T, K]); logits in max(fp32, weight dtype)."""
        logits = self.router_logits(x, ops)  # [T, E]
        bias = self.e_score_correction_bias if self.use_routing_bias else None
        return route(logits, bias, self.top_k, self.routed_scaling_factor)

    def _replay_router(
        self, x: torch.Tensor, given: torch.Tensor, ops: PagedOps | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H], given [T, K] int64 (-1 rows = own choice) -> (weights [T, K], ids [T, K])."""
        if tuple(given.shape) != (x.shape[0], self.top_k):
            raise ValueError(
                f"replayed expert ids have shape {tuple(given.shape)}, expected [T={x.shape[0]}, K={self.top_k}]"
            )
        logits = self.router_logits(x, ops)  # [T, E]
        bias = self.e_score_correction_bias if self.use_routing_bias else None
        _, own = route(logits, bias, self.top_k, self.routed_scaling_factor)
        given = given.to(device=x.device, dtype=torch.long)
        ids = torch.where((given < 0).any(-1, keepdim=True), own, given)  # [T, K]
        return route_given(logits, ids, self.routed_scaling_factor), ids

    def router_wants_fp32_input(self, num_tokens: int, ops: PagedOps) -> bool:
        """Whether ``forward_fused`` would use an fp32 copy of its input (a separate fp32 router GEMM:
        cuBLAS, or the table's ``linear``): true unless ``ops.router_gemm_topk_ok`` takes the
        one-launch route (decode-sized steps)."""
        return not ops.router_gemm_topk_ok(num_tokens, self.gate.weight)

    def forward_fused(
        self, x: torch.Tensor, x32: torch.Tensor | None, ops: PagedOps
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Fused paged path of ``forward`` for x [T, H] (x32: the same values in fp32, for the router,
        or None; ops: a table with ``fused_layers``).

        Returns (routed [T, H], shared [T, H]); the caller adds them (``ops.add_rms_norm`` with
        ``x2``, rounding routed + shared to x.dtype first, as ``forward`` does). Router (same maths
        as ``route``): without x32 and for few tokens one ``ops.router_gemm_topk`` launch, else an
        fp32 GEMM and ``ops.router_topk``. With replayed ids pending, or a router weight above
        fp32, this is ``forward`` (returned as (out, None)). GEMMs through ``ops.linear`` when given.
        """
        w = self.gate.weight
        if self.replay_topk_ids is not None or w.dtype != torch.float32:
            return self.forward(x, fused_experts=ops.fused_experts, ops=ops), None
        bias = self.e_score_correction_bias if self.use_routing_bias else None
        if x32 is None and ops.router_gemm_topk_ok(x.shape[0], w):  # decode-sized: GEMM + top-k in one launch
            weights, ids = ops.router_gemm_topk(x, w, bias, self.top_k, self.routed_scaling_factor)
        else:
            logits = ops.matmul(x.float() if x32 is None else x32, w)  # [T, E] fp32
            weights, ids = ops.router_topk(logits, bias, self.top_k, self.routed_scaling_factor)
        self.last_topk_ids = ids
        return self.experts(x, ids, weights, ops.fused_experts), self.shared_experts.forward_fused(x, ops)

    def forward(
        self,
        x: torch.Tensor,
        topk_ids: torch.Tensor | None = None,
        fused_experts: Callable[..., torch.Tensor] | None = None,
        ops: PagedOps | None = None,
    ) -> torch.Tensor:
        """x [..., H] -> [..., H]; ``fused_experts``: the routed experts' fast op (paged path only,
        ``PagedOps.fused_experts``; None = ``grouped_experts``); ``ops`` (paged path only): the
        router and shared-expert GEMMs through the table's ``linear`` when it has one."""
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])  # [T, H]
        given = topk_ids if topk_ids is not None else self.replay_topk_ids
        if given is None:
            weights, ids = self.router(x2, ops)  # [T, K] each
        else:
            weights, ids = self._replay_router(x2, given, ops)
        self.last_topk_ids = ids.detach()
        out = self.experts(x2, ids, weights, fused_experts) + self.shared_experts(x2, ops)  # [T, H]
        return out.view(shape)

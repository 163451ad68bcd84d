"""The table of fast ops the paged forward calls (``M3ForCausalLM.forward_paged``); built by the engine.

Governing idea: the model is plain single-device PyTorch and imports no kernels. Its paged path
(the engine's forward over flat varlen tokens and paged KV caches) needs ops the model does not
own: attention over the page pool, and on the GPU the Triton versions of its small per-layer
ops. The engine hands them in as one frozen ``PagedOps`` (``m3_rollout/engine/ops.py``:
``paged_ops_for`` picks Triton kernels on CUDA, PyTorch references elsewhere); the model only
calls its fields. The training forward (``M3ForCausalLM.forward``) never sees a table.

Fields fall in four groups:
- attention (always given; the model has no paged attention of its own):
  ``paged_attention(q [T, nh, d], k_cache_l, v_cache_l [P, G, ps, d], meta, scale, topk_ids [T, G, K] | None)
  -> [T, nh, d]`` (dense causal when topk_ids is None) and
  ``msa_attention(q, iq [T, G, di], k_cache_l, v_cache_l, index_cache_l [P, ps, di], meta, scale, topk,
  init_blocks, local_blocks, sel_out=None) -> [T, nh, d]`` (indexer + top-k + sparse attention of a
  sparse layer; ``sel_out``, an optional [T, G, K] integer view, receives the block choice: the
  engine's block-selection record);
  ``takes_prefill_scratch``: both accept a ``scratch=`` keyword, the buffer of their sparse prefill's
  KV-major path (the Triton kernels: layout and size in kernels/paged_layout.py). The engine then
  allocates that buffer once, inside its memory budget, and binds it into the two fields
  (``engine/ops.py bind_prefill_scratch``); the model never passes it;
- routed experts: ``fused_experts(x [T, H], ids [T, K], weights [T, K], w13, w2, *, alpha, limit, beta,
  expert_range) -> [T, H]``; None = ``moe.grouped_experts``;
- the fused layer path (all six given, or none = the layer-by-layer PyTorch path):
  ``add_rms_norm``, ``qkv_norm_rope_write``, ``swiglu``, ``router_topk``, ``router_gemm_topk`` and its
  predicate ``router_gemm_topk_ok``, with the signatures of kernels/fused_layers.py; plus, optional
  within it, the decode-sized GEMM ``skinny_linear`` with its predicate ``skinny_linear_ok``;
- the projection GEMM ``linear(x [T, K], weight [N, K], bias=None) -> [T, N]`` in x.dtype: when given
  (the batch-invariant table, design.md §4.6), every GEMM of the paged forward calls it instead of
  ``F.linear`` / an ``nn.Linear`` / the skinny GEMM: q/k/v(/index q/k) (packed or not), o_proj, the
  dense MLP and shared expert, the router logits (fp32) and lm_head; None = today's GEMMs.
  Exclusive with ``skinny_linear``. Optional with it (given together, on the fused layer path):
  ``linear_swiglu(x [T, K], gate_up [2I, K], alpha, limit, beta) -> [T, I]``, the packed gate|up
  GEMM with SwiGLU-OAI in its epilogue, the bits of ``swiglu(linear(x, gate_up), ...)``, which
  ``DenseMLP.forward_fused`` takes where its predicate ``linear_swiglu_ok(T) -> bool`` says so
  (the batch-invariant table: decode-sized steps).

The ops have no backward: the model takes the ``fused_experts`` and fused-layer fields only for
calls that autograd does not differentiate (``needs_autograd``); ``linear`` is only handed to the
paged forward (the training forward never sees a table).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields

import torch

FUSED_LAYER_FIELDS = (
    "add_rms_norm",
    "qkv_norm_rope_write",
    "swiglu",
    "router_topk",
    "router_gemm_topk",
    "router_gemm_topk_ok",
)


@dataclass(frozen=True)
class PagedOps:
    """Fast ops of the paged forward (see the module docstring for each field's contract).

    Raises ValueError at construction when the fused-layer fields are only partly given, when
    ``skinny_linear`` and ``skinny_linear_ok`` are not given together, when the skinny GEMM is
    given without the fused layer path (it only runs there), or with ``linear`` (which replaces it),
    and when ``linear_swiglu`` and ``linear_swiglu_ok`` are not given together or come without
    ``linear`` and the fused layer path.
    """

    paged_attention: Callable[..., torch.Tensor]
    msa_attention: Callable[..., torch.Tensor]
    fused_experts: Callable[..., torch.Tensor] | None = None
    add_rms_norm: Callable | None = None
    qkv_norm_rope_write: Callable | None = None
    swiglu: Callable[..., torch.Tensor] | None = None
    router_topk: Callable | None = None
    router_gemm_topk: Callable | None = None
    router_gemm_topk_ok: Callable[[int, torch.Tensor], bool] | None = None
    skinny_linear: Callable[..., torch.Tensor] | None = None
    skinny_linear_ok: Callable[[torch.Tensor, torch.Tensor], bool] | None = None
    # The attention ops accept scratch= (see the module docstring); False once the engine bound it.
    takes_prefill_scratch: bool = False
    linear: Callable[..., torch.Tensor] | None = None
    linear_swiglu: Callable[..., torch.Tensor] | None = None
    linear_swiglu_ok: Callable[[int], bool] | None = None

    def __post_init__(self) -> None:
        given = {f.name: getattr(self, f.name) is not None for f in fields(self)}
        fused = [given[n] for n in FUSED_LAYER_FIELDS]
        if any(fused) and not all(fused):
            missing = [n for n in FUSED_LAYER_FIELDS if not given[n]]
            raise ValueError(f"PagedOps: the fused layer path needs all of {FUSED_LAYER_FIELDS}; missing {missing}")
        if given["skinny_linear"] != given["skinny_linear_ok"]:
            raise ValueError("PagedOps: give skinny_linear and skinny_linear_ok together (or neither)")
        if given["skinny_linear"] and not all(fused):
            raise ValueError("PagedOps: skinny_linear runs on the fused layer path only; give its fields too")
        if given["skinny_linear"] and given["linear"]:
            raise ValueError("PagedOps: linear replaces every GEMM of the paged forward; give no skinny_linear with it")
        if given["linear_swiglu"] != given["linear_swiglu_ok"]:
            raise ValueError("PagedOps: give linear_swiglu and linear_swiglu_ok together (or neither)")
        if given["linear_swiglu"] and not (given["linear"] and all(fused)):
            raise ValueError(
                "PagedOps: linear_swiglu fuses linear + swiglu on the fused layer path; give linear and its fields too"
            )

    @property
    def fused_layers(self) -> bool:
        """Whether the table carries the fused layer path (``add_rms_norm`` and the others)."""
        return self.add_rms_norm is not None

    def matmul(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x [T, K] @ weight [N, K]^T -> [T, N]: ``linear`` when given, else ``F.linear``."""
        if self.linear is not None:
            return self.linear(x, weight)
        return torch.nn.functional.linear(x, weight)

    def project(self, module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
        """``module(x)`` (an ``nn.Linear``, e.g. o_proj, lm_head), through ``linear`` when given."""
        if self.linear is not None:
            return self.linear(x, module.weight, module.bias)
        return module(x)

    def linear_swiglu_takes(self, num_tokens: int) -> bool:
        """Whether a step of ``num_tokens`` rows runs gate|up + SwiGLU as ``linear_swiglu`` (given,
        and its predicate says so)."""
        return self.linear_swiglu is not None and self.linear_swiglu_ok(num_tokens)

    def skinny_ok(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether x [T, K] @ weight [N, K]^T takes ``skinny_linear`` (given, and it suits the call)."""
        return self.skinny_linear is not None and self.skinny_linear_ok(x, weight)


def needs_autograd(*tensors: torch.Tensor) -> bool:
    """True when autograd records this call: grad mode on and any of ``tensors`` requires grad.
    The paged ops have no backward, so such calls stay on the PyTorch path."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)

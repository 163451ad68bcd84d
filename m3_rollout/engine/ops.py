"""The engine's choice of fast ops for the model's paged forward: one ``PagedOps`` table per device and dtype.

Governing idea: the model (m3_rollout/model) is plain PyTorch and imports no kernels; its paged
forward calls the ops of a ``PagedOps`` table (model/paged_ops.py) that the engine builds here
and hands to ``M3ForCausalLM.forward_paged`` (``ModelRunner``, the decode graphs). On CUDA with
triton importable the table holds the Triton kernels of kernels/ (MSA attention, the fused
layer ops, the fused MoE, the skinny decode GEMM); elsewhere the PyTorch references of
``engine/reference_ops.py`` and no fused fields (the model's own PyTorch path runs).
``interpreted_paged_ops`` is the test-only table with the fused layer kernels run by the Triton
interpreter on CPU.

Selection rules (same as before the table existed):
- MSA attention: Triton (``msa_fused_decode.msa_attention``, ``msa_paged_attention.paged_attention``)
  on CUDA, else ``msa_attention_ref`` / ``paged_attention_ref``.
- fused layers (``kernels/fused_layers.py``) and fused MoE (``kernels/fused_moe.py``): CUDA and an
  activation dtype of bf16 / fp16 / fp32; the model still keeps calls that autograd differentiates
  on its PyTorch path (the kernels have no backward).
- skinny decode GEMM: with the fused layers, unless turned off (A/B profiling: ``skinny_gemm=False``).
- KV-major prefill scratch: the Triton attention table says ``takes_prefill_scratch``; the engine sizes
  the buffer (``paged_cache.prefill_scratch_bytes``), allocates it and binds it with
  :func:`bind_prefill_scratch`, so the kernels never allocate their own. The batch-invariant table
  takes one when built with ``invariant_sparse_attention="page_partials"`` (the default,
  ``DEFAULT_INVARIANT_SPARSE_ATTENTION``; the choice is bound into the table's ops).
- batch-invariant mode (``batch_invariant=True``, ``EngineConfig.batch_invariant``; design.md §4.6):
  on CUDA the fused layer path with the fixed-config ops of ``kernels/invariant_ops.py`` (``linear``
  for every projection, the router logits and lm_head; ``fused_experts`` with fixed tile configs by
  row band (``invariant_ops.moe_config``);
  decode-sized steps fuse the router GEMM + top-k and the gate|up GEMM + SwiGLU into one launch each,
  with the bits of the two launches), no skinny GEMM; attention from
  ``invariant_attention_fields`` (``m3_kernels.invariant_attention``: one kernel and tile shape for decode and
  prefill, pages in ascending order, no split over the KV). Elsewhere the reference table
  (with a warning: the PyTorch ops are not batch-invariant).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import warnings

import torch

from m3_rollout.engine.config import DEFAULT_INVARIANT_SPARSE_ATTENTION, INVARIANT_SPARSE_ATTENTIONS
from m3_rollout.engine.reference_ops import msa_attention_ref, paged_attention_ref
from m3_rollout.model.paged_ops import PagedOps

KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # activation dtypes the Triton ops take


@functools.lru_cache(maxsize=1)
def triton_importable() -> bool:
    """Whether the triton package can be imported (without importing it)."""
    return importlib.util.find_spec("triton") is not None


def reference_paged_ops() -> PagedOps:
    """The all-PyTorch table: reference MSA attention over the pages, no fused fields."""
    return PagedOps(paged_attention=paged_attention_ref, msa_attention=msa_attention_ref)


def _fused_layer_fields(fl, skinny_gemm: bool) -> dict:
    """The fused-layer fields of ``PagedOps`` from a ``m3_kernels.fused_layers`` module object."""
    out = dict(
        add_rms_norm=fl.add_rms_norm,
        qkv_norm_rope_write=fl.qkv_norm_rope_write,
        swiglu=fl.swiglu,
        router_topk=fl.router_topk,
        router_gemm_topk=fl.router_gemm_topk,
        router_gemm_topk_ok=fl.router_gemm_topk_ok,
    )
    if skinny_gemm:
        out.update(skinny_linear=fl.skinny_linear, skinny_linear_ok=fl.skinny_linear_ok)
    return out


def _check_invariant_sparse_attention(choice: str) -> None:
    """Raises ValueError naming ``invariant_sparse_attention`` unless ``choice`` is one of
    ``INVARIANT_SPARSE_ATTENTIONS``."""
    if choice not in INVARIANT_SPARSE_ATTENTIONS:
        raise ValueError(f"invariant_sparse_attention={choice!r}: one of {INVARIANT_SPARSE_ATTENTIONS}")


def invariant_attention_fields(
    device: torch.device | str = "cuda",
    interpret: bool = False,
    invariant_sparse_attention: str = DEFAULT_INVARIANT_SPARSE_ATTENTION,
) -> dict:
    """The ``paged_attention`` / ``msa_attention`` fields of the batch-invariant table (issue 24):
    ``m3_kernels.invariant_attention`` (one reduction order per token whatever the batch, chunking,
    prefix hits or graph padding; decode and prefill give the same bits; design.md §4.6).

    device: the model's device: compiled kernels on CUDA with triton; elsewhere the PyTorch
    references, which are NOT batch-invariant (``paged_ops_for`` warns). interpret: the kernels
    under the Triton interpreter on CPU tensors (tests; sets TRITON_INTERPRET=1 for the rest of the
    process). invariant_sparse_attention: the sparse layers' attention (``EngineConfig.
    invariant_sparse_attention``: "page_partials", the default, or "union"), bound into both ops
    (``functools.partial(..., sparse_impl=...)``). ``takes_prefill_scratch``: whether the kernels
    take the KV-major scratch, i.e. whether that choice is "page_partials" (their sparse attention
    then writes per-page partials at every prefill length and at decode; the engine and
    ``PagedScorer`` bind a scratch). Raises ValueError for an unknown invariant_sparse_attention
    (on any device).
    """
    _check_invariant_sparse_attention(invariant_sparse_attention)
    if interpret:
        from m3_kernels.msa_interpret import interpreted_invariant_attention

        ia = interpreted_invariant_attention()
    elif torch.device(device).type == "cuda" and triton_importable():
        import m3_kernels.invariant_attention as ia
    else:
        return dict(paged_attention=paged_attention_ref, msa_attention=msa_attention_ref, takes_prefill_scratch=False)
    impl = ia.check_sparse_impl(invariant_sparse_attention)
    return {
        "paged_attention": functools.partial(ia.invariant_paged_attention, sparse_impl=impl),
        "msa_attention": functools.partial(ia.invariant_msa_attention, sparse_impl=impl),
        "takes_prefill_scratch": impl == "page_partials",
    }


def invariant_fields(fl, inv) -> dict:
    """The non-attention fields of the batch-invariant table from the ``m3_kernels.fused_layers``
    and ``m3_kernels.invariant_ops`` module objects: the fused layer path (its per-row kernels are
    invariant as they are, see invariant_ops' docstring), the fixed-config GEMM and MoE, no skinny
    GEMM; for decode-sized steps the router's GEMM + top-k in one launch (``inv.router_gemm_topk``,
    taken where ``inv.router_gemm_topk_ok``) and the gate|up GEMM with SwiGLU in its epilogue
    (``inv.linear_swiglu`` where ``inv.linear_swiglu_ok``), each with the bits of its two-launch
    route. ``inv.ROUTER_GEMM_TOPK_FUSE`` / ``inv.LINEAR_SWIGLU_FUSE`` False (read here, when the
    table is built: the A/B switches of scripts/profile_engine.py) keep the two launches at every T."""
    fields = _fused_layer_fields(fl, skinny_gemm=False)
    fields.update(
        router_gemm_topk=inv.router_gemm_topk,
        router_gemm_topk_ok=inv.router_gemm_topk_ok if inv.ROUTER_GEMM_TOPK_FUSE else inv.router_gemm_topk_never,
        linear=inv.linear,
        fused_experts=inv.fused_experts,
    )
    if inv.LINEAR_SWIGLU_FUSE:
        fields.update(linear_swiglu=inv.linear_swiglu, linear_swiglu_ok=inv.linear_swiglu_ok)
    return fields


def paged_ops_for(
    device: torch.device | str,
    dtype: torch.dtype,
    fused_layers: bool = True,
    skinny_gemm: bool = True,
    batch_invariant: bool = False,
    invariant_sparse_attention: str = DEFAULT_INVARIANT_SPARSE_ATTENTION,
) -> PagedOps:
    """The ops table for a model whose activations are ``dtype`` on ``device``.

    fused_layers: take the fused layer path where it applies (False: the layer-by-layer PyTorch
    ops, for A/B profiling; attention and MoE kernels stay). skinny_gemm: decode-sized bf16/fp16
    projections (up to ``m3_kernels.fused_layers.SKINNY_MAX_TOKENS`` tokens) on the fused path use
    the Triton skinny GEMM instead of cuBLAS. batch_invariant: the batch-invariant table
    (``invariant_fields`` + ``invariant_attention_fields``; overrides fused_layers / skinny_gemm);
    needs CUDA, triton and a bf16 / fp16 / fp32 model, else warns and returns the fast-mode table.
    invariant_sparse_attention: the invariant table's sparse attention (``invariant_attention_fields``;
    ``EngineConfig.invariant_sparse_attention``); checked whatever the other arguments (ValueError
    naming it), used only with batch_invariant. Imports triton (and the kernels) only on CUDA.
    """
    _check_invariant_sparse_attention(invariant_sparse_attention)  # on any device
    cuda = torch.device(device).type == "cuda" and triton_importable()
    if batch_invariant:
        if cuda and dtype in KERNEL_DTYPES:
            import m3_kernels.fused_layers as fl
            import m3_kernels.invariant_ops as inv

            attention = invariant_attention_fields(device, invariant_sparse_attention=invariant_sparse_attention)
            return PagedOps(**attention, **invariant_fields(fl, inv))
        if not cuda:
            why = f"needs a CUDA device with triton (got device {torch.device(device).type})"
        else:
            why = f"needs a bf16 / fp16 / fp32 model (got {dtype})"
        # the device's type (not "cuda:0" or a device object): the same text from every caller, so
        # the default warnings filter shows it once per calling line
        warnings.warn(
            f"batch_invariant (policy.generation.batch_invariant / serve --batch-invariant): {why}; the PyTorch / "
            "fast-mode ops used instead are not batch-invariant (and "
            f"invariant_sparse_attention={invariant_sparse_attention!r} has no effect)",
            stacklevel=2,
        )
    if not cuda:
        return reference_paged_ops()
    import m3_kernels.fused_layers as fl
    from m3_kernels.fused_moe import fused_experts
    from m3_kernels.msa_fused_decode import msa_attention
    from m3_kernels.msa_paged_attention import paged_attention

    kernels = dtype in KERNEL_DTYPES
    return PagedOps(
        paged_attention=paged_attention,
        msa_attention=msa_attention,
        fused_experts=fused_experts if kernels else None,
        **(_fused_layer_fields(fl, skinny_gemm) if kernels and fused_layers else {}),
        takes_prefill_scratch=True,
    )


def bind_prefill_scratch(ops: PagedOps, scratch: torch.Tensor) -> PagedOps:
    """``ops`` with ``scratch`` (uint8 [bytes] on the engine's device; kernels/paged_layout.py) bound
    as the ``scratch=`` of both attention ops; the result says ``takes_prefill_scratch=False``.

    An empty scratch turns the KV-major prefill path off (union-list tiles at every length).
    Raises ValueError when ``ops`` does not take a scratch.
    """
    if not ops.takes_prefill_scratch:
        raise ValueError("bind_prefill_scratch: this PagedOps table's attention ops take no scratch")
    return dataclasses.replace(
        ops,
        paged_attention=functools.partial(ops.paged_attention, scratch=scratch),
        msa_attention=functools.partial(ops.msa_attention, scratch=scratch),
        takes_prefill_scratch=False,
    )


def invariant_token_logprobs(device: torch.device | str):
    """The sampler's batch-invariant logprob op (``m3_kernels.invariant_ops.token_logprobs``:
    logits [N, V], tokens [N] -> fp32 [N]) on CUDA with triton; None elsewhere (the sampler's
    ``torch.log_softmax``)."""
    if torch.device(device).type == "cuda" and triton_importable():
        from m3_kernels.invariant_ops import token_logprobs

        return token_logprobs
    return None


def interpreted_paged_ops(skinny_gemm: bool = True, batch_invariant: bool = False) -> PagedOps:
    """Tests only: the fused layer path with ``m3_kernels.fused_layers`` run by the Triton interpreter
    on CPU tensors (fp32 / fp16; sets TRITON_INTERPRET=1 for the rest of the process, see
    kernels/fused_interpret.py), reference MSA attention, PyTorch routed experts. batch_invariant:
    the invariant table's non-attention fields (``invariant_fields``) interpreted, reference attention."""
    from m3_kernels.fused_interpret import interpreted_fused_layers, interpreted_invariant_ops

    fl = interpreted_fused_layers()
    attention = dict(paged_attention=paged_attention_ref, msa_attention=msa_attention_ref)
    if batch_invariant:
        return PagedOps(**attention, **invariant_fields(fl, interpreted_invariant_ops()))
    return PagedOps(**attention, **_fused_layer_fields(fl, skinny_gemm))

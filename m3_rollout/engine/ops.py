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
- batch-invariant mode (issue 24): ``invariant_attention_fields`` gives the attention fields
  (``m3_kernels.invariant_attention``: one kernel and tile shape for decode and prefill, no
  split-K) for the batch-invariant table.
"""

from __future__ import annotations

import functools
import importlib.util

import torch

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


def paged_ops_for(
    device: torch.device | str, dtype: torch.dtype, fused_layers: bool = True, skinny_gemm: bool = True
) -> PagedOps:
    """The ops table for a model whose activations are ``dtype`` on ``device``.

    fused_layers: take the fused layer path where it applies (False: the layer-by-layer PyTorch
    ops, for A/B profiling; attention and MoE kernels stay). skinny_gemm: decode-sized bf16/fp16
    projections (up to ``m3_kernels.fused_layers.SKINNY_MAX_TOKENS`` tokens) on the fused path use
    the Triton skinny GEMM instead of cuBLAS. Imports triton (and the kernels) only on CUDA.
    """
    if torch.device(device).type != "cuda" or not triton_importable():
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
    )


def interpreted_paged_ops(skinny_gemm: bool = True) -> PagedOps:
    """Tests only: the fused layer path with ``m3_kernels.fused_layers`` run by the Triton interpreter
    on CPU tensors (fp32 / fp16; sets TRITON_INTERPRET=1 for the rest of the process, see
    kernels/fused_interpret.py), reference MSA attention, PyTorch routed experts."""
    from m3_kernels.fused_interpret import interpreted_fused_layers

    fl = interpreted_fused_layers()
    return PagedOps(
        paged_attention=paged_attention_ref, msa_attention=msa_attention_ref, **_fused_layer_fields(fl, skinny_gemm)
    )


def invariant_attention_fields(interpret: bool = False) -> dict:
    """The attention fields of a batch-invariant ``PagedOps`` (issue 24): ``{"paged_attention": ...,
    "msa_attention": ...}`` from ``m3_kernels.invariant_attention`` (one reduction order per token
    whatever the batch, chunking, prefix hits or graph padding; decode and prefill give the same bits).

    interpret: run the kernels in the Triton interpreter on CPU tensors (tests; sets
    TRITON_INTERPRET=1 for the rest of the process). Otherwise the compiled kernels (CUDA tensors).
    """
    if interpret:
        from m3_kernels.msa_interpret import interpreted_invariant_attention

        ia = interpreted_invariant_attention()
    else:
        import m3_kernels.invariant_attention as ia
    return {"paged_attention": ia.invariant_paged_attention, "msa_attention": ia.invariant_msa_attention}

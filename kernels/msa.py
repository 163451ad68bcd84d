"""MSA op dispatch: Triton kernels on CUDA, PyTorch references elsewhere (layout: kernels/paged_layout.py).

The engine's model runner calls only these functions: ``msa_attention`` on sparse layers (indexer +
top-k + sparse attention; fused decode path of ``kernels/msa_decode.py`` on CUDA) and
``paged_attention`` (dense causal) on dense layers; ``index_topk`` / ``paged_attention`` keep the
signatures of ``kernels/msa_reference.py``.
"""

from __future__ import annotations

import torch

from m3_kernels.msa_reference import index_topk_ref, paged_attention_ref

# NOTE: the Triton modules are imported on first CUDA use only, so CPU runs never import triton
# here and the CPU interpreter tests can (re)load them with TRITON_INTERPRET=1.


def index_topk(iq, index_cache_l, meta, topk: int, init_blocks: int = 0, local_blocks: int = 1) -> torch.Tensor:
    """[T, G, K] int32 selected block ids; see ``msa_reference.index_topk_ref``."""
    if iq.is_cuda:
        from m3_kernels.msa_index_topk import index_topk as index_topk_triton

        return index_topk_triton(iq, index_cache_l, meta, topk, init_blocks, local_blocks)
    return index_topk_ref(iq, index_cache_l, meta, topk, init_blocks, local_blocks)


def paged_attention(q, k_cache_l, v_cache_l, meta, scale: float, topk_ids=None) -> torch.Tensor:
    """[T, nh, d] attention output; see ``msa_reference.paged_attention_ref``."""
    if q.is_cuda:
        from m3_kernels.msa_sparse_attention import paged_attention as paged_attention_triton

        return paged_attention_triton(q, k_cache_l, v_cache_l, meta, scale, topk_ids)
    return paged_attention_ref(q, k_cache_l, v_cache_l, meta, scale, topk_ids)


def msa_attention(
    q,
    iq,
    k_cache_l,
    v_cache_l,
    index_cache_l,
    meta,
    scale: float,
    topk: int,
    init_blocks: int = 0,
    local_blocks: int = 1,
) -> torch.Tensor:
    """Sparse-layer MSA attention: indexer + top-k + sparse GQA attention in one call (spec §3.4-3.5).

    q: [T, nh, d]; iq: [T, G, di]; k_cache_l, v_cache_l: [P, G, ps, d]; index_cache_l: [P, ps, di]
    (already holding this step's keys); meta: ``PagedMetadata`` (decode rows first). Returns
    [T, nh, d] in q.dtype, equal to ``paged_attention(q, ..., index_topk(iq, ...))``.
    On CUDA the decode rows run the fused decode path of ``kernels/msa_decode.py`` (2 launches
    at block-table width <= 256) and the prefill rows the prefill kernels; elsewhere the
    PyTorch references. Raises ValueError for unsupported sizes or dtypes (naming the field).
    """
    if not q.is_cuda:
        return paged_attention_ref(
            q,
            k_cache_l,
            v_cache_l,
            meta,
            scale,
            index_topk_ref(iq, index_cache_l, meta, topk, init_blocks, local_blocks),
        )
    from m3_kernels.msa_decode import msa_attention as msa_attention_triton

    return msa_attention_triton(
        q, iq, k_cache_l, v_cache_l, index_cache_l, meta, scale, topk, init_blocks, local_blocks
    )

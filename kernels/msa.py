"""MSA op dispatch: Triton kernels on CUDA, PyTorch references elsewhere (layout: engine/paged_cache.py).

The engine's model runner calls only these two functions; signatures are those of
``kernels/msa_reference.py``.
"""

from __future__ import annotations

import torch

from kernels.msa_reference import index_topk_ref, paged_attention_ref

# NOTE: the Triton modules are imported on first CUDA use only, so CPU runs never import triton
# here and the CPU interpreter tests can (re)load them with TRITON_INTERPRET=1.


def index_topk(iq, index_cache_l, meta, topk: int, init_blocks: int = 0, local_blocks: int = 1) -> torch.Tensor:
    """[T, G, K] int32 selected block ids; see ``msa_reference.index_topk_ref``."""
    if iq.is_cuda:
        from kernels.msa_index_topk import index_topk as index_topk_triton

        return index_topk_triton(iq, index_cache_l, meta, topk, init_blocks, local_blocks)
    return index_topk_ref(iq, index_cache_l, meta, topk, init_blocks, local_blocks)


def paged_attention(q, k_cache_l, v_cache_l, meta, scale: float, topk_ids=None) -> torch.Tensor:
    """[T, nh, d] attention output; see ``msa_reference.paged_attention_ref``."""
    if q.is_cuda:
        from kernels.msa_sparse_attention import paged_attention as paged_attention_triton

        return paged_attention_triton(q, k_cache_l, v_cache_l, meta, scale, topk_ids)
    return paged_attention_ref(q, k_cache_l, v_cache_l, meta, scale, topk_ids)

"""Paged KV cache and index-key cache: the engine's page pool (docs/design.md, "Paged KV cache").

One physical page holds ``page_size`` consecutive positions of one sequence, and ``page_size``
equals the MSA block size, so a block id chosen by the lightning indexer is a logical page number.
The tensor layout and the per-step metadata every attention path reads are defined in
``m3_kernels.paged_layout`` (kernels/paged_layout.py), the bottom of the import graph; this module
allocates those tensors and sizes the pool.
"""

from __future__ import annotations

import torch

from m3_rollout.model.configuration import M3Config


def page_bytes(config: M3Config, dtype: torch.dtype) -> int:
    """Bytes one page costs over all layers (main K/V + index keys of the sparse layers)."""
    elt = torch.empty((), dtype=dtype).element_size()
    ps = config.sparse_block_size
    n_sparse = sum(config.is_sparse_layer(i) for i in range(config.num_hidden_layers))
    main = config.num_hidden_layers * 2 * config.num_key_value_heads * ps * config.head_dim
    index = n_sparse * ps * config.sparse_index_dim
    return (main + index) * elt


class PagedKVCache:
    """The engine's page pool (tensors only; which page belongs to whom is the block manager's job).

    Args:
        config: model config (page size = ``sparse_block_size``).
        num_pages: P, pages allocated.
        dtype, device: KV dtype and device.
    Raises ValueError for num_pages < 1.
    """

    def __init__(self, config: M3Config, num_pages: int, dtype: torch.dtype, device: torch.device | str = "cpu"):
        if num_pages < 1:
            raise ValueError(
                f"num_pages={num_pages}: the KV cache needs at least one page; raise "
                "policy.generation.kv_cache_memory_gb"
            )
        self.config = config
        self.num_pages, self.page_size = num_pages, config.sparse_block_size
        self.dtype, self.device = dtype, torch.device(device)
        g, d, ps = config.num_key_value_heads, config.head_dim, self.page_size
        nl = config.num_hidden_layers
        self.sparse_slot = {}  # layer index -> index-cache slice
        for i in range(nl):
            if config.is_sparse_layer(i):
                self.sparse_slot[i] = len(self.sparse_slot)
        self.null_page = num_pages  # scratch page for padding (see the module docstring)
        self.k_cache = torch.zeros(nl, num_pages + 1, g, ps, d, dtype=dtype, device=self.device)
        self.v_cache = torch.zeros(nl, num_pages + 1, g, ps, d, dtype=dtype, device=self.device)
        self.index_cache = torch.zeros(
            max(len(self.sparse_slot), 1), num_pages + 1, ps, config.sparse_index_dim, dtype=dtype, device=self.device
        )

    @staticmethod
    def pages_for_budget(config: M3Config, dtype: torch.dtype, memory_bytes: int) -> int:
        """How many usable pages fit in ``memory_bytes`` (floor; the null page counted)."""
        return int(memory_bytes // page_bytes(config, dtype)) - 1

    def layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(k [P, G, ps, d], v [P, G, ps, d], index_k [P, ps, di] or None) views of one layer."""
        s = self.sparse_slot.get(layer_idx)
        return self.k_cache[layer_idx], self.v_cache[layer_idx], None if s is None else self.index_cache[s]

    def copy_page(self, src: int, dst: int) -> None:
        """Copy every layer's content of page ``src`` into page ``dst`` (partial-page copy on fork)."""
        self.k_cache[:, dst].copy_(self.k_cache[:, src])
        self.v_cache[:, dst].copy_(self.v_cache[:, src])
        self.index_cache[:, dst].copy_(self.index_cache[:, src])

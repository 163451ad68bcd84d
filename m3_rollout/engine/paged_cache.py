"""Paged KV cache and index-key cache: the engine's page pool (docs/design.md, "Paged KV cache").

One physical page holds ``page_size`` consecutive positions of one sequence, and ``page_size``
equals the MSA block size, so a block id chosen by the lightning indexer is a logical page number.
The tensor layout and the per-step metadata every attention path reads are defined in
``m3_kernels.paged_layout`` (kernels/paged_layout.py), the bottom of the import graph; this module
allocates those tensors and sizes the pool.
"""

from __future__ import annotations

import torch

from m3_kernels.paged_layout import (
    KV_CHUNK_MIN_TOKENS,
    KV_CHUNK_TOKENS,
    KV_MAJOR_MIN_TOKENS,
    FP8IndexCache,
    kv_major_token_bytes,
)
from m3_rollout.model.configuration import M3Config

INDEX_CACHE_DTYPES = ("bfloat16", "fp8_e4m3")  # policy.generation.index_cache_dtype / EngineConfig
MIB = 2**20


def page_bytes(config: M3Config, dtype: torch.dtype, index_cache_dtype: str = "bfloat16") -> int:
    """Bytes one page costs over all layers (main K/V + index keys of the sparse layers; with
    ``fp8_e4m3`` index keys 1 byte per element plus one fp32 scale per token)."""
    elt = torch.empty((), dtype=dtype).element_size()
    ps = config.sparse_block_size
    n_sparse = sum(config.is_sparse_layer(i) for i in range(config.num_hidden_layers))
    main = config.num_hidden_layers * 2 * config.num_key_value_heads * ps * config.head_dim * elt
    if index_cache_dtype == "fp8_e4m3":
        return main + n_sparse * ps * (config.sparse_index_dim + 4)
    return main + n_sparse * ps * config.sparse_index_dim * elt


def prefill_scratch_bytes(
    config: M3Config,
    dtype: torch.dtype,
    scratch_mb: float | None,
    max_num_batched_tokens: int,
    min_tokens: int = KV_MAJOR_MIN_TOKENS,
    granule: int = KV_CHUNK_MIN_TOKENS,
) -> int:
    """Bytes of the KV-major sparse prefill scratch the engine allocates (layout: kernels/paged_layout.py;
    ``EngineConfig.msa_prefill_scratch_mb`` / ``policy.generation.msa_prefill_scratch_mb``).

    One pass of c prefill tokens needs c * ``kv_major_token_bytes`` (the sparse layers' shapes in
    ``dtype``, the attention inputs' dtype). c = min(KV_CHUNK_TOKENS, max_num_batched_tokens) when
    ``scratch_mb`` is None (the kernels' default pass); for scratch_mb > 0 the largest multiple of
    ``granule`` tokens whose bytes fit in scratch_mb MiB, at most max_num_batched_tokens. 0 bytes
    when ``scratch_mb`` is 0 (the path off), the model has no sparse layer, or a step's prefill
    (at most max_num_batched_tokens tokens) stays below ``min_tokens`` (the path never runs).
    Raises ValueError, naming the key, the minimum in MiB and 0 (off), when 0 < scratch_mb <
    one ``granule``-token pass (checked whenever the model has sparse layers).
    """
    if scratch_mb == 0 or not any(config.is_sparse_layer(i) for i in range(config.num_hidden_layers)):
        return 0
    per_token = kv_major_token_bytes(config.num_attention_heads, config.head_dim, config.sparse_topk_blocks, dtype)
    if scratch_mb is None:
        tokens = KV_CHUNK_TOKENS
    else:
        # capped at 2**80 bytes: a finite scratch_mb near the float maximum times MIB is inf (inf // n = nan)
        tokens = int(min(scratch_mb * MIB, 2.0**80) // per_token) // granule * granule
        if tokens < granule:
            raise ValueError(
                f"policy.generation.msa_prefill_scratch_mb={scratch_mb} (EngineConfig.msa_prefill_scratch_mb) "
                f"holds no KV-major prefill pass: the minimum is {granule * per_token / MIB:.2f} MiB ({granule} "
                f"tokens x {per_token} bytes at this model's shapes in {dtype}); use 0 to turn the KV-major "
                "path off (union-list tiles at every prefill length) or null (None) for the default pass"
            )
    if max_num_batched_tokens < min_tokens:
        return 0
    return min(tokens, max_num_batched_tokens) * per_token


class PagedKVCache:
    """The engine's page pool (tensors only; which page belongs to whom is the block manager's job).

    Args:
        config: model config (page size = ``sparse_block_size``).
        num_pages: P, pages allocated.
        dtype, device: KV dtype and device.
        index_cache_dtype: "bfloat16" = index keys in the KV dtype (``index_cache`` [Ls, P+1, ps, di]);
            "fp8_e4m3" = e4m3 codes in ``index_cache`` plus ``index_scale`` [Ls, P+1, ps] fp32 (one
            scale per token; kernels/paged_layout.py), a layer's view being an ``FP8IndexCache``.
        quantize_index_queries: (fp8_e4m3 only) the score kernels quantize the index queries too.
    Raises ValueError for num_pages < 1 or an unknown index_cache_dtype.
    """

    def __init__(
        self,
        config: M3Config,
        num_pages: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        index_cache_dtype: str = "bfloat16",
        quantize_index_queries: bool = False,
    ):
        if num_pages < 1:
            raise ValueError(
                f"num_pages={num_pages}: the KV cache needs at least one page; raise "
                "policy.generation.kv_cache_memory_gb"
            )
        if index_cache_dtype not in INDEX_CACHE_DTYPES:
            raise ValueError(f"index_cache_dtype={index_cache_dtype!r}: use one of {INDEX_CACHE_DTYPES}")
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
        fp8 = index_cache_dtype == "fp8_e4m3"
        n_idx = max(len(self.sparse_slot), 1)
        self.index_cache = torch.zeros(
            n_idx,
            num_pages + 1,
            ps,
            config.sparse_index_dim,
            dtype=torch.float8_e4m3fn if fp8 else dtype,
            device=self.device,
        )
        self.index_scale = (
            torch.zeros(n_idx, num_pages + 1, ps, dtype=torch.float32, device=self.device) if fp8 else None
        )
        self.quantize_index_queries = fp8 and quantize_index_queries

    @staticmethod
    def pages_for_budget(
        config: M3Config, dtype: torch.dtype, memory_bytes: int, index_cache_dtype: str = "bfloat16"
    ) -> int:
        """How many usable pages fit in ``memory_bytes`` (floor; the null page counted)."""
        return int(memory_bytes // page_bytes(config, dtype, index_cache_dtype)) - 1

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor of the pool (K, V, index keys, and the FP8 index scales when present)."""
        return [self.k_cache, self.v_cache, self.index_cache] + (
            [self.index_scale] if self.index_scale is not None else []
        )

    def layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | FP8IndexCache | None]:
        """(k [P, G, ps, d], v [P, G, ps, d], index keys or None) views of one layer; the index keys are
        [P, ps, di] or, with FP8 index keys, an ``FP8IndexCache`` (codes [P, ps, di], scales [P, ps])."""
        s = self.sparse_slot.get(layer_idx)
        if s is None:
            return self.k_cache[layer_idx], self.v_cache[layer_idx], None
        if self.index_scale is None:
            return self.k_cache[layer_idx], self.v_cache[layer_idx], self.index_cache[s]
        index = FP8IndexCache(self.index_cache[s], self.index_scale[s], self.quantize_index_queries)
        return self.k_cache[layer_idx], self.v_cache[layer_idx], index

    def copy_page(self, src: int, dst: int) -> None:
        """Copy every layer's content of page ``src`` into page ``dst`` (partial-page copy on fork)."""
        for t in self.tensors():
            t[:, dst].copy_(t[:, src])

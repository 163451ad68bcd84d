"""Contiguous per-row KV cache for the reference model (spec §4.1, simplified: no pages).

Governing idea: slot == absolute position. Every layer WRITES the new tokens' K, V (and, on sparse
layers, index K) to slot positions[b, s] BEFORE scoring and attention, then query (b, s) reads
slots u <= positions[b, s] among slots [0, positions.max() + 1). So a prefill in one call, in
chunks, or token by token all see the same keys, and rows of one batch may sit at different
positions.

Contract for callers:
- Before a query at position p of row b runs, slots 0..p-1 of row b must hold that row's tokens
  (written by earlier calls or earlier in the same call). The cache never tracks lengths.
- Right padding is allowed: pad tokens take positions continuing past the row's real tokens.
  They write garbage K/V into those *future* slots; no real query can read a slot beyond its own
  position, and the row's next real tokens overwrite those slots before any query reads them.
  Pad positions must still be < max_len.
- Positions within one row of one call must be distinct (duplicate writes race).
- Slots start zeroed, so unwritten slots hold finite values (masked-out values are multiplied by
  an exact 0 probability, which must not meet NaN/inf garbage).
"""

from __future__ import annotations

import torch

from .configuration import M3Config


class KVCache:
    """Per-layer cache tensors, all [B, max_len, ...] with slot == absolute position.

    k[l], v[l]: [B, max_len, nkv, head_dim] (k post-norm post-RoPE, v raw).
    index_k[l]: [B, max_len, sparse_index_dim] (post-norm post-RoPE) on sparse layers, None on
    dense layers.
    """

    def __init__(
        self,
        config: M3Config,
        batch_size: int,
        max_len: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        nkv, d, di = config.num_key_value_heads, config.head_dim, config.sparse_index_dim
        n = config.num_hidden_layers
        self.k = [torch.zeros(batch_size, max_len, nkv, d, dtype=dtype, device=device) for _ in range(n)]
        self.v = [torch.zeros(batch_size, max_len, nkv, d, dtype=dtype, device=device) for _ in range(n)]
        self.index_k: list[torch.Tensor | None] = [
            torch.zeros(batch_size, max_len, di, dtype=dtype, device=device) if config.is_sparse_layer(i) else None
            for i in range(n)
        ]

    # Sizes are read off the tensors so that callers may re-select rows (e.g. drop finished
    # samples with index_select on every tensor) without updating any bookkeeping.
    @property
    def batch_size(self) -> int:
        return self.k[0].shape[0]

    @property
    def max_len(self) -> int:
        return self.k[0].shape[1]

    @property
    def dtype(self) -> torch.dtype:
        return self.k[0].dtype

    def check_positions(self, positions: torch.Tensor, max_pos: int) -> None:
        """Raise ValueError unless positions [B, S] fits this cache (batch size, 0 <= pos < max_len)."""
        if positions.shape[0] != self.batch_size:
            raise ValueError(f"batch of {positions.shape[0]} rows for a KVCache of batch_size {self.batch_size}")
        if max_pos >= self.max_len:
            raise ValueError(
                f"position {max_pos} does not fit the KV cache (max_len {self.max_len}); "
                f"positions, including right-padding positions, must be < max_len"
            )
        if int(positions.min()) < 0:
            raise ValueError(f"negative position {int(positions.min())}")

    def write(
        self,
        layer: int,
        positions: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        index_k: torch.Tensor | None = None,
    ) -> None:
        """Store token (b, s)'s k/v [B, S, nkv, d] (and index_k [B, S, di]) at slot positions[b, s]."""
        rows = torch.arange(positions.shape[0], device=positions.device)[:, None].expand_as(positions)  # [B, S]
        self.k[layer].index_put_((rows, positions), k.to(self.k[layer].dtype))
        self.v[layer].index_put_((rows, positions), v.to(self.v[layer].dtype))
        if index_k is not None:
            cache = self.index_k[layer]
            assert cache is not None, f"layer {layer} is dense: it has no index-key cache"
            cache.index_put_((rows, positions), index_k.to(cache.dtype))

    def select_rows(self, keep: torch.Tensor) -> None:
        """Keep only rows ``keep`` (int64 [B']) in that order, e.g. to drop finished samples."""
        for tensors in (self.k, self.v, self.index_k):
            for layer, t in enumerate(tensors):
                if t is not None:
                    tensors[layer] = t.index_select(0, keep)

    def reset(self) -> None:
        """Zero every slot (a fresh cache without reallocating)."""
        for t in [*self.k, *self.v, *(x for x in self.index_k if x is not None)]:
            t.zero_()

"""Paged KV / index-key cache layout and per-step metadata: the contract between the engine and
every attention kernel (docs/design.md, "Paged KV cache").

This module sits at the bottom of the import graph (torch only): the Triton kernels of this
package, the engine (which allocates the pages, ``m3_rollout/engine/paged_cache.py``) and the
paged-op references all read the layout described here.


Governing idea: one physical page holds ``page_size`` consecutive token positions of one
sequence, and ``page_size`` equals the MSA block size (spec §4.1), so a block id chosen by the
lightning indexer *is* a logical page number: block b of request r lives in physical page
``block_tables[r, b]``. Dense layers use the same pages (and the same block table).

Layout (fixed; the Triton MSA kernels of ``kernels/`` index exactly these tensors)
------------------------------------------------------------------------------
``P`` = num_pages, ``ps`` = page_size (= ``config.sparse_block_size``), ``L`` = num_hidden_layers,
``Ls`` = number of sparse layers, ``G`` = num_key_value_heads, ``d`` = head_dim,
``di`` = sparse_index_dim. Every cache tensor has ``P + 1`` pages along its page axis: page ``P``
(``PagedKVCache.null_page``) is never handed out; padding tokens (slot ``-1``) write into it and
padding rows of a CUDA-graph batch read it, so neither needs a data-dependent branch (no host
sync). All tensors are contiguous, dtype = the engine's KV dtype (bf16 on GPU, fp32 or fp64 on
CPU), allocated once; per-layer views never move (CUDA-graph safe).

- ``k_cache``: ``[L, P, G, ps, d]``; entry ``[l, p, g, o, :]`` is the post-QK-norm, post-RoPE key of
  KV head g for the token at offset o of page p. Strides (elements): ``(P*G*ps*d, G*ps*d, ps*d, d, 1)``.
  One (page, KV head) is a contiguous ``ps x d`` tile.
- ``v_cache``: ``[L, P, G, ps, d]``, raw V, same strides.
- ``index_cache``: ``[Ls, P, ps, di]``; the post-norm, post-RoPE index key (one head) of the
  i-th sparse layer in layer order (``PagedKVCache.sparse_slot`` maps layer -> i).
  Strides: ``(P*ps*di, ps*di, di, 1)``.

Per-step metadata (:class:`PagedMetadata`), flat "varlen" token layout
--------------------------------------------------------------------
A step processes ``T`` query tokens belonging to ``R`` sequences ("rows"). Rows are ordered
decode-first: rows ``0..num_decodes-1`` each have exactly ``decode_query_len`` query tokens (1
for plain decode, 1 + k for speculative verification); the rest are prefill chunks of any length.
Tokens of row r are ``query_start_loc[r] : query_start_loc[r+1]``.

- ``positions [T] int64``: absolute position of each query token; for row r, token i of its
  chunk sits at ``context_lens[r] + i``.
- ``slot_mapping [T] int64``: where the token's K/V/index-K are written:
  ``slot = page * ps + (position % ps)``; ``-1`` = padding token, never written.
- ``block_tables [R, max_pages] int32``: logical page b of row r -> physical page; ``-1`` past the
  row's last page. Every page a row's keys touch (``ceil(seq_lens[r] / ps)`` of them) is present.
- ``context_lens [R] int32``: tokens already in the cache before this step (computed earlier or a
  prefix-cache hit). ``seq_lens [R] int32`` = context_lens + query length: key count after writing.
- ``query_start_loc [R+1] int32``: cumulative query lengths, starting at 0.
- host ints: ``num_decodes``, ``decode_query_len``, ``max_query_len``, ``max_seq_len``.

Order inside a layer (spec §4.2): K, V and index-K of the step's tokens are written through
``slot_mapping`` *before* any scoring or attention, so every read (own token, same chunk, cached
prefix) goes through the pages, and chunked prefill / prefix hits equal one pass.

Ops over this layout (same signatures for the PyTorch references and the Triton kernels):
- ``index_topk(iq [T, G, di], index_cache_l [P, ps, di], meta, topk, init_blocks, local_blocks)
  -> [T, G, K] int32``: spec §3.4 selection per query token, valid ids first, -1 padding.
- ``paged_attention(q [T, nh, d], k_cache_l [P, G, ps, d], v_cache_l, meta, scale, topk_ids=None)
  -> [T, nh, d]``: exact softmax over the keys of the selected blocks (``topk_ids`` [T, G, K]) or,
  with ``topk_ids=None``, all causal keys (dense layers); causal cut at each query's position.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PagedMetadata:
    """Per-step attention metadata; see the module docstring for every field's convention."""

    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64
    block_tables: torch.Tensor  # [R, max_pages] int32
    context_lens: torch.Tensor  # [R] int32
    seq_lens: torch.Tensor  # [R] int32
    query_start_loc: torch.Tensor  # [R+1] int32
    num_decodes: int
    decode_query_len: int
    max_query_len: int
    max_seq_len: int

    @property
    def num_rows(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

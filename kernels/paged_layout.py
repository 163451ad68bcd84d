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
- FP8 index keys (``policy.generation.index_cache_dtype: fp8_e4m3``): ``index_cache`` is
  ``float8_e4m3fn`` and ``index_scale`` ``[Ls, P, ps]`` fp32 holds one scale per token; a sparse
  layer's view is an :class:`FP8IndexCache` (keys ``[P, ps, di]``, scales ``[P, ps]``) in place of
  the ``[P, ps, di]`` tensor, accepted by every op that reads or writes index keys. Format below.

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

FP8 index-key format (e4m3, one power-of-two scale per token)
-------------------------------------------------------------
Key u (its ``di`` values already rounded to the activation dtype) is stored as codes
``c_u = RNE_e4m3(k_u / s_u)`` with ``s_u = 2**(E_u - 8)``, ``E_u = ceil(log2(max_i |k_u[i]|))``
(clamped to fp32's normal range; an all-zero key gets ``2**-126``), so the largest code lies in
(128, 256] (e4m3's largest finite value is 448); ``k_u ~= c_u * s_u``.
- Per token, not per block: a decode step writes one token of a page at a time, and a block scale
  fixed by the page's first token would clip later, larger keys (or the page would have to be
  re-quantized on every write). One fp32 per 128-byte key is 3% more bytes read.
- Power-of-two scales: ``k / s`` and ``c * s`` are exact, so the Triton write kernel, the PyTorch
  reference and every reader agree bit for bit (the rounding is the only inexact step, and the
  kernels round in integer arithmetic, independent of the backend's fp8 conversion), and a score
  ``s_u * <q, c_u>`` equals ``<q, c_u * s_u>`` up to fp32 summation order. e4m3 is a float format,
  so a power-of-two scale costs no relative precision: error <= 2**-4 |k| per element (>= 2**-6 s
  in magnitude; smaller elements <= 2**-10 s absolute).
- Queries (``FP8IndexCache.quantize_queries``): each (token, index head) query row is quantized
  the same way, inside the score kernels or, for the prefill score launch on CUDA, by
  ``msa_fp8.quantize_rows`` just before it (fp8 x fp8 tensor-core dots); otherwise queries stay in the
  activation dtype and the keys are converted to it in registers.
- Non-finite keys: NaN stays NaN (the block's score becomes -1e30, as with bf16 keys).

KV-major sparse prefill scratch (``kernels/msa_paged_attention.py``)
-------------------------------------------------------------------
From ``KV_MAJOR_MIN_TOKENS`` prefill tokens on, the sparse prefill attends page by page and writes
one block-normalised partial output per (token, KV head, slot j) before a per-token merge; it runs
in passes of at most ``chunk`` prefill tokens over one scratch buffer reused by every pass. Per
token of a pass the scratch holds (``kv_major_token_bytes``):
- partial outputs ``[G, K, nh/G, d]`` in the partial dtype (``kv_major_partial_dtype``: fp32 for
  fp32 inputs, else the input dtype), then
- their base-2 log-sum-exps ``[G, K, nh/G]`` fp32,
so ``nh * K * (d * elt + 4)`` bytes: 266,240 at M3 shapes in bf16 (nh 64, K 16, d 128), i.e.
4160 MiB for a ``KV_CHUNK_TOKENS`` = 16,384-token pass. The scratch is one uint8 buffer; a pass
of ``c`` tokens uses its first ``c * nh * K * d * elt`` bytes for the partials and the next
``c * nh * K * 4`` for the log-sum-exps. The engine allocates it once, inside its memory budget
(``policy.generation.msa_prefill_scratch_mb``; ``m3_rollout/engine/paged_cache.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# KV-major sparse prefill (see the module docstring): the path is taken from this many prefill tokens
# on (below it: union-list tiles, no scratch); prefill tokens per pass by default (the kernel's own
# buffer, or the engine's automatic scratch size); engine-sized passes are whole multiples of
# KV_CHUNK_MIN_TOKENS (H200, 128K prefill: 16K-token passes 42.2 ms, 8K 44.7 ms, 4K 48.3 ms of
# attention; shorter passes pay the per-pass bucketing more often; docs/benchmarks.md).
KV_MAJOR_MIN_TOKENS = 16384
KV_CHUNK_TOKENS = 16384
KV_CHUNK_MIN_TOKENS = 1024


def kv_major_partial_dtype(dtype: torch.dtype) -> torch.dtype:
    """dtype of the KV-major partial outputs for inputs of ``dtype``: fp32 stays fp32, else the input dtype."""
    return torch.float32 if dtype == torch.float32 else dtype


def kv_major_token_bytes(num_heads: int, head_dim: int, topk: int, dtype: torch.dtype) -> int:
    """Scratch bytes one prefill token of a KV-major pass needs: nh * K * (d * elt + 4) (module docstring).

    num_heads: nh query heads (all KV heads' groups); topk: K selected blocks per (token, KV head);
    dtype: the attention inputs' dtype.
    """
    elt = torch.empty((), dtype=kv_major_partial_dtype(dtype)).element_size()
    return num_heads * topk * (head_dim * elt + 4)


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
    # index tensors derived from the fields above that every layer of the step would otherwise
    # rebuild (e.g. the KV-major prefill's bucket -> page map); filled on first use by the kernel
    # that needs them, keyed by that kernel's name and every size they are built from. The meta's
    # tensors must not change after that first use (a new step gets a new meta). Never read by the
    # engine.
    memo: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def num_rows(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])


E4M3_SCALE_SHIFT = 8  # s = 2**(ceil(log2(amax)) - 8): the largest code of a key lies in (128, 256]


@dataclass(frozen=True)
class FP8IndexCache:
    """One sparse layer's FP8 index-key pages (format: module docstring).

    keys: [P, ps, di] float8_e4m3fn codes; scales: [P, ps] fp32 (one power of two per token);
    quantize_queries: the score kernels quantize the index queries the same way (fp8 x fp8 dots).
    """

    keys: torch.Tensor
    scales: torch.Tensor
    quantize_queries: bool = False

    @property
    def page_size(self) -> int:
        return int(self.keys.shape[1])

    def write(self, page: torch.Tensor, off: torch.Tensor, ik: torch.Tensor) -> None:
        """Quantize ik [T, di] and store it at (page [T], offset [T]) (the PyTorch write path)."""
        codes, scales = quantize_index_keys(ik)
        self.keys[page, off] = codes
        self.scales[page, off] = scales


def e4m3_pow2_scales(amax: torch.Tensor) -> torch.Tensor:
    """fp32 power-of-two scales 2**(ceil(log2 amax) - 8) of amax [...] >= 0 (clamped to [2**-126, 2**126]).

    Exact integer arithmetic on the fp32 bits (ceil(log2) of the exponent and mantissa fields); NaN
    amax gives a finite scale (the codes stay NaN).
    """
    bits = amax.float().contiguous().view(torch.int32)
    e_ceil = (bits >> 23) + ((bits & 0x7FFFFF) != 0).to(torch.int32)  # biased exponent of 2**ceil(log2 amax)
    e_ceil = torch.where(amax.isnan(), 255, e_ceil)
    se = (e_ceil - E4M3_SCALE_SHIFT).clamp(1, 253)
    return (se << 23).view(torch.float32)


def quantize_index_keys(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference FP8 quantization of index keys (or index query rows), module docstring format.

    x: [..., di] any float dtype (values taken as they are). Returns (codes [..., di]
    float8_e4m3fn, scales [...] fp32); ``codes.float() * scales[..., None]`` ~= x.
    """
    xf = x.float()
    amax = xf.abs().amax(dim=-1)  # NaN propagates (its row's codes stay NaN)
    scales = e4m3_pow2_scales(amax)
    return (xf / scales[..., None]).to(torch.float8_e4m3fn), scales


def dequantize_index_keys(
    codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """codes [..., di] float8_e4m3fn, scales [...] fp32 -> [..., di] values in ``dtype`` (exact for fp32)."""
    return (codes.float() * scales[..., None]).to(dtype)

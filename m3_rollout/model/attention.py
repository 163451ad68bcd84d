"""M3 attention: QK Gemma-norm, partial NeoX RoPE, GQA; dense-causal or block-sparse (spec §3.3-§3.5).

Governing idea: both layer kinds are one masked softmax attention. Dense layers mask by
causality; sparse layers additionally keep only the keys in the blocks the lightning indexer
selected for the query's KV group. The mask is materialised densely ([B, G, Sq, Sk] bool), which
is exact and cheap at reference sizes; kernels replace it later.

Shape legend:
  B   batch rows     S   query tokens per row   Sk  key slots per row    H  hidden size
  nh  query heads    G   KV heads (= index heads)  R  query heads per KV head (nh = G * R)
  d   head dim       di  index head dim          r  rotary dim
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .configuration import M3Config
from .fused import fused_linear, pack_linear_weights, packed_linear
from .indexer import block_scores, replayed_blocks, select_blocks, selected_key_mask, selection_agreement
from .kv_cache import KVCache
from .norm import GemmaRMSNorm
from .numerics import compute_dtype
from .paged_ops import PagedOps
from .rope import apply_rope


@dataclass
class AttentionInputs:
    """Per-forward metadata shared by every layer; built once by `M3Model.forward`.

    NOTE: one context object instead of five arguments threaded through each layer.
    positions: [B, S] int64 absolute query positions.
    cos, sin: [B, S, r/2] fp32 RoPE tables for those positions.
    cache: KVCache or None.
    num_slots: with a cache, key slots read per row (= positions.max() + 1); unused without.
    key_positions: without a cache, [B, S] positions of the keys (the same tokens) when they are
        not simply 0..S-1; None means key slot index == key position.
    """

    positions: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    cache: KVCache | None = None
    num_slots: int = 0
    key_positions: torch.Tensor | None = None


@dataclass
class BlockReplay:
    """A recorded block selection handed to one sparse layer for the next training forward.

    NOTE: set on the module (``M3Attention.block_replay``) by the trainer around a forward, as
    routing replay sets ``M3MoE.replay_topk_ids``; the forward's signature stays the model's.
    recorded: int [B, S, G, K] block ids per (row, token, KV head), -1 = empty slot; an all -1
        row has no record (the layer's own choice stands).
    replay: attend the recorded blocks (``indexer.replayed_blocks``); False = only measure.
    stats: optional float64 [3] accumulator on the layer's device; the forward adds
        ``indexer.selection_agreement(own choice, recorded)`` to it in place.
    """

    recorded: torch.Tensor
    replay: bool = True
    stats: torch.Tensor | None = None


def masked_gqa_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """softmax(q k^T * scale, masked) v with GQA: query head h uses KV head h // R.

    q: [B, S, nh, d]; k, v: [B, Sk, G, d]; mask: bool [B, G or 1, S, Sk] (True = attend; every
    query must attend to at least one key). Logits, softmax and PV in fp32 (fp64 for fp64 q).
    Returns [B, S, nh, d] in q.dtype.
    """
    b, s, nh, d = q.shape
    sk, g = k.shape[1], k.shape[2]
    r = nh // g
    cdt = compute_dtype(q.dtype)
    # NOTE: explicit [B*G, R*S, .] layouts so the two big tensors (logits, probabilities) are made
    # once each and never permuted; only q, k, v (small) are re-laid out.
    qg = q.to(cdt).view(b, s, g, r, d).permute(0, 2, 3, 1, 4).reshape(b * g, r * s, d)  # [B*G, R*S, d]
    kt = k.to(cdt).permute(0, 2, 3, 1).reshape(b * g, d, sk)  # [B*G, d, Sk]
    logits = torch.bmm(qg, kt).mul_(scale).view(b, g, r, s, sk)  # [B, G, R, S, Sk]
    logits.masked_fill_(~mask[:, :, None], float("-inf"))
    p = torch.softmax(logits, dim=-1).view(b * g, r * s, sk)  # [B*G, R*S, Sk]
    vg = v.to(cdt).permute(0, 2, 1, 3).reshape(b * g, sk, d)  # [B*G, Sk, d]
    out = torch.bmm(p, vg).view(b, g, r, s, d).permute(0, 3, 1, 2, 4)  # [B, S, G, R, d]
    return out.reshape(b, s, nh, d).to(q.dtype)


class M3Attention(nn.Module):
    """One attention layer; sparse layers also own the score-only lightning indexer projections.

    Submodule names are the released ones: q_proj, k_proj, v_proj, o_proj, q_norm, k_norm and, on
    sparse layers, index_q_proj, index_k_proj, index_q_norm, index_k_norm (all bias-free).
    forward(x [B, S, H], inputs) -> [B, S, H] in x.dtype.
    """

    def __init__(self, config: M3Config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        h, d = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, d
        self.scale = d**-0.5
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=False)
        # per_head QK norm: one [d] weight shared by all heads (spec §3.3)
        self.q_norm = GemmaRMSNorm(d, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(d, config.rms_norm_eps)
        self.is_sparse = config.is_sparse_layer(layer_idx)
        # Position among the sparse layers (the S axis of a block-selection record).
        self.sparse_index = sum(config.is_sparse_layer(i) for i in range(layer_idx)) if self.is_sparse else -1
        self.block_replay: BlockReplay | None = None  # trainer-side replay / agreement (BlockReplay)
        # The last training forward's own block choice [B, G, S, K] (before replay; tests and the
        # engine-record checks read it, as M3MoE.last_topk_ids).
        self.last_selected_blocks: torch.Tensor | None = None
        self.packed_proj: torch.Tensor | None = None  # q|k|v(|index q|index k) buffer (pack_projections)
        if self.is_sparse:
            di = config.sparse_index_dim
            self.num_index_heads, self.index_dim = config.sparse_num_index_heads, di
            self.block_size, self.topk = config.sparse_block_size, config.sparse_topk_blocks
            self.init_blocks, self.local_blocks = config.sparse_init_block, config.sparse_local_block
            self.index_q_proj = nn.Linear(h, self.num_index_heads * di, bias=False)
            self.index_k_proj = nn.Linear(h, di, bias=False)  # one key head shared by all index heads
            self.index_q_norm = GemmaRMSNorm(di, config.rms_norm_eps)
            self.index_k_norm = GemmaRMSNorm(di, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, inputs: AttentionInputs) -> torch.Tensor:
        b, s, _ = x.shape
        pos = inputs.positions  # [B, S]
        cos, sin = inputs.cos[:, :, None, :], inputs.sin[:, :, None, :]  # [B, S, 1, r/2]
        q = apply_rope(self.q_norm(self.q_proj(x).view(b, s, self.num_heads, self.head_dim)), cos, sin)  # [B,S,nh,d]
        k = apply_rope(self.k_norm(self.k_proj(x).view(b, s, self.num_kv_heads, self.head_dim)), cos, sin)  # [B,S,G,d]
        v = self.v_proj(x).view(b, s, self.num_kv_heads, self.head_dim)  # [B, S, G, d]
        iq = ik = None
        if self.is_sparse:
            iq = self.index_q_proj(x).view(b, s, self.num_index_heads, self.index_dim)  # [B, S, G, di]
            iq = apply_rope(self.index_q_norm(iq), cos, sin)
            ik = apply_rope(self.index_k_norm(self.index_k_proj(x)), inputs.cos, inputs.sin)  # [B, S, di]

        cache, k_pos = inputs.cache, inputs.key_positions
        if cache is not None:
            # Write first, then read: chunked prefill / decode see exactly the keys of one pass.
            cache.write(self.layer_idx, pos, k, v, ik)
            n = inputs.num_slots
            k, v = cache.k[self.layer_idx][:, :n], cache.v[self.layer_idx][:, :n]  # [B, Sk, G, d]
            if ik is not None:
                ik = cache.index_k[self.layer_idx][:, :n]  # [B, Sk, di]
            k_pos = None  # cache slot == position
        sk = k.shape[1]

        if self.is_sparse:
            scores = block_scores(iq, ik, pos, self.block_size, k_pos)  # [B, G, S, nb]
            sel = select_blocks(scores, pos, self.topk, self.block_size, self.init_blocks, self.local_blocks)
            self.last_selected_blocks = sel
            if self.block_replay is not None:
                sel = self._replay(sel, pos)  # [B, G, S, K'] the recorded blocks where recorded
            mask = selected_key_mask(sel, pos, sk, self.block_size, k_pos)  # [B, G, S, Sk]
        else:
            kp = torch.arange(sk, device=x.device)[None, :] if k_pos is None else k_pos  # [1|B, Sk]
            mask = kp[:, None, None, :] <= pos[:, None, :, None]  # [B, 1, S, Sk]
        out = masked_gqa_attention(q, k, v, mask, self.scale)  # [B, S, nh, d]
        return self.o_proj(out.reshape(b, s, self.num_heads * self.head_dim))

    def _replay(self, own: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Apply ``block_replay`` to the layer's own choice own [B, G, S, K] (positions pos [B, S])."""
        br = self.block_replay
        rec = br.recorded.permute(0, 2, 1, 3)  # [B, G, S, K]
        if tuple(rec.shape) != tuple(own.shape):
            raise ValueError(
                f"layer {self.layer_idx}: recorded blocks {tuple(br.recorded.shape)} do not match {own.shape}"
            )
        if br.stats is not None:
            with torch.no_grad():
                br.stats += selection_agreement(own, rec)
        if not br.replay:
            return own
        return replayed_blocks(own, rec, pos, self.block_size, self.init_blocks, self.local_blocks)

    def forward_paged(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta,
        kv,
        ops: PagedOps,
        fused: bool = False,
        selection_out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Paged path over flat query tokens (kernels/paged_layout.py layout; spec §4.2 order).

        x: [T, H] (T may be 0); cos, sin: [T, r/2] RoPE rows of ``meta.positions``, or with
        ``fused`` [max_pos, r/2] tables indexed by ``meta.positions``; meta: ``PagedMetadata``;
        selection_out: optional int16 [>= T, S, G, K] block-selection record buffer (engine-owned);
        a sparse layer writes its choice of the step's tokens into ``selection_out[:T, sparse_index]``;
        kv: ``PagedKVCache``; ops: the engine's ``PagedOps``. K, V (and index K on sparse layers) of
        the step's tokens are written through ``meta.slot_mapping`` first; then the indexer selects
        blocks from the index-key pages and attention reads the K/V pages, both through
        ``ops.msa_attention`` (sparse layers) / ``ops.paged_attention`` (dense layers). ``fused``
        (``ops.fused_layers`` only): one packed projection GEMM + ``ops.qkv_norm_rope_write`` for
        norms, RoPE and the cache writes, the output projection through ``fused_linear``. Every
        projection goes through ``ops.linear`` when the table has one (``PagedOps.project``).
        Returns [T, H] in x.dtype.
        """
        t = x.shape[0]
        k_cache, v_cache, index_cache = kv.layer(self.layer_idx)
        if fused:
            q, iq = self.fused_qkv_write(
                x, cos, sin, meta.slot_mapping, k_cache, v_cache, index_cache, meta.positions, ops
            )
        else:
            c, s_ = cos[:, None, :], sin[:, None, :]  # [T, 1, r/2]
            proj = ops.project  # lin(x), or the table's linear
            nh, g, d = self.num_heads, self.num_kv_heads, self.head_dim
            q = apply_rope(self.q_norm(proj(self.q_proj, x).view(t, nh, d)), c, s_)  # [T, nh, d]
            k = apply_rope(self.k_norm(proj(self.k_proj, x).view(t, g, d)), c, s_)  # [T, G, d]
            v = proj(self.v_proj, x).view(t, g, d)  # [T, G, d]
            ik = iq = None
            if self.is_sparse:
                iq = apply_rope(
                    self.index_q_norm(proj(self.index_q_proj, x).view(t, self.num_index_heads, self.index_dim)), c, s_
                )  # [T, G, di]
                ik = apply_rope(self.index_k_norm(proj(self.index_k_proj, x)), cos, sin)  # [T, di]
            if t > 0:
                write_paged_kv(meta.slot_mapping, k, v, ik, k_cache, v_cache, index_cache)
        if t == 0:
            # Empty step (EP lockstep): no attention work; o_proj keeps the [0, H] shape and dtype.
            return self.o_proj(q.reshape(0, self.num_heads * self.head_dim))
        if self.is_sparse:  # indexer + top-k + sparse attention (fused decode path on CUDA)
            sel_out = None if selection_out is None else selection_out[:t, self.sparse_index]  # [T, G, K]
            out = ops.msa_attention(
                q,
                iq,
                k_cache,
                v_cache,
                index_cache,
                meta,
                self.scale,
                self.topk,
                self.init_blocks,
                self.local_blocks,
                sel_out=sel_out,
            )  # [T, nh, d]
        else:
            out = ops.paged_attention(q, k_cache, v_cache, meta, self.scale, None)  # [T, nh, d]
        out = out.reshape(t, self.num_heads * self.head_dim)
        return fused_linear(out, self.o_proj.weight, ops) if fused else ops.project(self.o_proj, out)

    def projection_linears(self) -> list[nn.Linear]:
        """The Linears that read the layer input, in packed-column order: q, k, v (+ index q, index k)."""
        linears = [self.q_proj, self.k_proj, self.v_proj]
        if self.is_sparse:
            linears += [self.index_q_proj, self.index_k_proj]
        return linears

    def pack_projections(self) -> None:
        """Put q/k/v (+ index q/k) weights into ``packed_proj`` (parameters become views; model/fused.py)."""
        self.packed_proj = pack_linear_weights(self.projection_linears())

    def fused_qkv_write(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        slot_mapping: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        index_cache: torch.Tensor | None,
        positions: torch.Tensor,
        ops: PagedOps,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Fused path of forward_paged's pre-attention work: x [T, H] -> (q [T, nh, d], index q
        [T, G, di] or None), K/V/index K written through slot_mapping [T] (``ops.qkv_norm_rope_write``,
        the signature of kernels/fused_layers.py; cos/sin are [max_pos, r/2] tables indexed by
        ``positions`` [T])."""
        qkv = packed_linear(x, self.packed_proj, self.projection_linears(), ops)
        index = {}
        if self.is_sparse:
            index = dict(
                index_q_norm_w=self.index_q_norm.weight,
                index_k_norm_w=self.index_k_norm.weight,
                num_index_heads=self.num_index_heads,
                index_dim=self.index_dim,
                index_cache=index_cache,
            )
        return ops.qkv_norm_rope_write(
            qkv,
            cos,
            sin,
            slot_mapping,
            self.q_norm.weight,
            self.k_norm.weight,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            k_cache,
            v_cache,
            self.q_norm.eps,
            positions=positions,
            **index,
        )


def write_paged_kv(
    slot_mapping: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ik: torch.Tensor | None,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    index_cache,
) -> None:
    """Scatter the step's keys into their pages (slot = page * ps + offset; -1 = padding).

    slot_mapping: [T] int64; k, v: [T, G, d]; ik: [T, di] or None; k_cache, v_cache:
    [P + 1, G, ps, d]; index_cache: [P + 1, ps, di], None, or an engine-owned quantized index
    cache whose ``write(page [T], offset [T], ik)`` quantizes and stores (the FP8 index keys of
    kernels/paged_layout.py). Padding tokens go to the last (null) page, so there is no
    data-dependent branch and no host sync (CUDA-graph safe).
    """
    ps = k_cache.shape[2]
    slot = slot_mapping.long()
    slot = torch.where(slot >= 0, slot, (k_cache.shape[0] - 1) * ps)  # -1 -> null page, offset 0
    page, off = slot // ps, slot % ps  # [T], [T]
    k_cache[page, :, off] = k.to(k_cache.dtype)  # advanced dims first: [T', G, d]
    v_cache[page, :, off] = v.to(v_cache.dtype)
    if ik is not None:
        assert index_cache is not None, "sparse layer without an index-key cache"
        if isinstance(index_cache, torch.Tensor):
            index_cache[page, off] = ik.to(index_cache.dtype)
        else:
            index_cache.write(page, off, ik)

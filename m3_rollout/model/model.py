"""MiniMax-M3 text model: pre-norm decoder, single-device maths (spec §3.2).

Governing idea: h = embed(ids); per layer h += attn(norm(h)); h += ffn(norm(h)); logits =
lm_head(norm(h)). No embedding scale, no logit soft-cap, untied lm_head. Module and parameter
names equal the released text-only checkpoint names (`model.layers.{i}.self_attn.q_proj.weight`,
`model.layers.{i}.block_sparse_moe.gate.weight`, `lm_head.weight`, ...) except the routed experts,
stacked as `...block_sparse_moe.experts.w13` / `.w2` (loading.py maps them).
"""

from __future__ import annotations

import torch
from torch import nn

from .attention import AttentionInputs, M3Attention
from .configuration import M3Config
from .kv_cache import KVCache
from .moe import DenseMLP, M3MoE
from .norm import GemmaRMSNorm
from .numerics import compute_dtype
from .paged_ops import PagedOps, needs_autograd
from .rope import rope_cos_sin


class M3DecoderLayer(nn.Module):
    """input_layernorm -> self_attn -> residual; post_attention_layernorm -> mlp | block_sparse_moe -> residual."""

    def __init__(self, config: M3Config, layer_idx: int):
        super().__init__()
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = M3Attention(config, layer_idx)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.is_moe = config.is_moe_layer(layer_idx)
        if self.is_moe:
            self.block_sparse_moe = M3MoE(config)
        else:
            self.mlp = DenseMLP(config, config.dense_intermediate_size)

    def forward(self, h: torch.Tensor, inputs: AttentionInputs) -> torch.Tensor:
        """h: [B, S, H] -> [B, S, H]."""
        h = h + self.self_attn(self.input_layernorm(h), inputs)
        ffn = self.block_sparse_moe if self.is_moe else self.mlp
        return h + ffn(self.post_attention_layernorm(h))

    def forward_paged(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta,
        kv,
        ops: PagedOps,
        selection_out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Layer-by-layer paged path: h [T, H] -> [T, H] (see M3Attention.forward_paged); the routed
        experts take ``ops.fused_experts`` when given, the GEMMs ``ops.linear`` when given."""
        h = h + self.self_attn.forward_paged(
            self.input_layernorm(h), cos, sin, meta, kv, ops, selection_out=selection_out
        )
        x = self.post_attention_layernorm(h)
        if self.is_moe:
            return h + self.block_sparse_moe(x, fused_experts=ops.fused_experts, ops=ops)
        return h + self.mlp(x, ops)


class M3Model(nn.Module):
    """embed_tokens, layers, norm. forward -> final-normed hidden states [B, S, H]."""

    def __init__(self, config: M3Config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(M3DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self._rope_tables: tuple[torch.Tensor, torch.Tensor] | None = None  # see rope_tables
        self._old_rope_tables: list[tuple[torch.Tensor, torch.Tensor]] = []

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor | None = None,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        """See M3ForCausalLM.forward; returns hidden states [B, S, H] in the embedding dtype."""
        b, s = input_ids.shape
        arange = torch.arange(s, device=input_ids.device)
        key_positions = None
        if positions is None:
            positions = arange.expand(b, s)
        elif positions.shape != input_ids.shape:
            raise ValueError(f"positions shape {tuple(positions.shape)} != input_ids shape {tuple(input_ids.shape)}")
        elif cache is None and not torch.equal(positions, arange.expand(b, s)):
            key_positions = positions  # keys are the same tokens, at their own positions
        # NOTE: one host sync per forward: the key span is a Python int (slice length).
        max_pos = int(positions.max())
        if cache is not None:
            cache.check_positions(positions, max_pos)
        cos, sin = rope_cos_sin(positions, self.config.rotary_dim, self.config.rope_theta)  # [B, S, r/2]
        inputs = AttentionInputs(positions, cos, sin, cache, max_pos + 1, key_positions)
        h = self.embed_tokens(input_ids)  # [B, S, H]
        for layer in self.layers:
            h = layer(h, inputs)
        return self.norm(h)

    def forward_paged(
        self, input_ids: torch.Tensor, meta, kv, ops: PagedOps, selection_out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """See M3ForCausalLM.forward_paged; returns final-normed hidden states [T, H]."""
        h = self.embed_tokens(input_ids)  # [T, H]
        if ops.fused_layers and not needs_autograd(h):
            return self._forward_paged_fused(h, meta, kv, ops, selection_out)
        cos, sin = rope_cos_sin(meta.positions, self.config.rotary_dim, self.config.rope_theta)  # [T, r/2]
        for layer in self.layers:
            h = layer.forward_paged(h, cos, sin, meta, kv, ops, selection_out)
        return self.norm(h)

    def rope_tables(self, num_positions: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [N, r/2] fp32 for positions 0..N-1, N >= max(num_positions,
        max_position_embeddings); built once per device (the same values ``rope_cos_sin`` gives
        per position) and kept, so a step reads rows instead of recomputing them."""
        tab = self._rope_tables
        if tab is None or tab[0].device != device or tab[0].shape[0] < num_positions:
            n = max(num_positions, self.config.max_position_embeddings)
            tab = rope_cos_sin(torch.arange(n, device=device), self.config.rotary_dim, self.config.rope_theta)
            # NOTE: earlier tables stay alive: a captured CUDA graph may still read them.
            if self._rope_tables is not None:
                self._old_rope_tables.append(self._rope_tables)
            self._rope_tables = tab
        return tab

    def _forward_paged_fused(
        self, h: torch.Tensor, meta, kv, ops: PagedOps, selection_out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Fused paged path (``ops.fused_layers``): the residual stream is carried separately and
        every "add the sublayer output, then norm" is one ``ops.add_rms_norm`` launch (spec §3.1,
        §3.2), with the same roundings as the layer-by-layer path; RoPE rows come from cached
        tables (``rope_tables``; ``meta.max_seq_len`` bounds the positions). h [T, H] (embedding
        output, updated in place as the residual) -> final-normed [T, H]."""
        cos, sin = self.rope_tables(meta.max_seq_len, h.device)
        residual = h
        f = f2 = None  # previous sublayer output(s), added into the residual by the next norm
        for i, layer in enumerate(self.layers):
            norm = layer.input_layernorm
            if i == 0:
                x, _ = ops.add_rms_norm(residual, norm.weight, norm.eps)
            else:
                x, _ = ops.add_rms_norm(f, norm.weight, norm.eps, residual=residual, x2=f2)
            a = layer.self_attn.forward_paged(x, cos, sin, meta, kv, ops, fused=True, selection_out=selection_out)
            norm = layer.post_attention_layernorm
            want32 = layer.is_moe and layer.block_sparse_moe.router_wants_fp32_input(x.shape[0], ops)
            x, x32 = ops.add_rms_norm(a, norm.weight, norm.eps, residual=residual, want_fp32=want32)
            if layer.is_moe:
                f, f2 = layer.block_sparse_moe.forward_fused(x, x32, ops)
            else:
                f, f2 = layer.mlp.forward_fused(x, ops), None
        if f is None:
            return self.norm(residual)
        y, _ = ops.add_rms_norm(f, self.norm.weight, self.norm.eps, residual=residual, x2=f2)
        return y


class M3ForCausalLM(nn.Module):
    """The M3 text model with its untied lm_head; `state_dict()` uses released text-only names."""

    def __init__(self, config: M3Config):
        super().__init__()
        self.config = config
        self.model = M3Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor | None = None,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        """Logits [B, S, V] in the model dtype (callers upcast).

        input_ids: [B, S] int64. positions: [B, S] int64 absolute positions, default 0..S-1 per row.
        Without a cache the keys are the S tokens themselves (at their positions): right padding
        with continuing positions is fine, a row's tokens must have increasing positions.
        With a cache, see kv_cache.py for the write-then-read contract; raises ValueError when a
        position is outside [0, cache.max_len) or the batch size differs from the cache's.
        """
        return self.lm_head(self.model(input_ids, positions, cache))

    def forward_paged(
        self,
        input_ids: torch.Tensor,
        meta,
        kv,
        ops: PagedOps,
        logits_indices: torch.Tensor | None = None,
        selection_out: torch.Tensor | None = None,
        hidden_indices: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The engine's forward over flat varlen tokens and paged caches (kernels/paged_layout.py).

        input_ids: [T] int64 (T may be 0: an empty EP-lockstep step still runs every layer once);
        meta: ``PagedMetadata`` for those tokens; kv: ``PagedKVCache`` (written in place: each
        token's K/V/index-K land at ``meta.slot_mapping``); ops: the fast ops the engine picked
        for this device and dtype (``PagedOps``, model/paged_ops.py; built by
        ``m3_rollout.engine.ops.paged_ops_for``): attention over the pages always, the fused layer
        path and the fused MoE when given. logits_indices: optional [N] int64 token indices whose
        logits are wanted (default all T). selection_out: optional int16 [>= T, S, G, K] buffer
        (``selection_dims``) that receives every sparse layer's block choice of the T tokens (the
        engine's block-selection record; rows past T untouched). Returns logits [N or T, V] in the
        model dtype (lm_head through ``ops.linear`` when the table has one). Equals ``forward`` on
        the same tokens with their cached prefix (tests). hidden_indices: optional [M] int64 token
        indices whose final hidden states [M, H] are returned too, ``(logits, hidden)`` (the
        engine's prompt logprobs project them apart, so the logits rows keep their bits).
        """
        h = self.model.forward_paged(input_ids, meta, kv, ops, selection_out)  # [T, H]
        kept = None if hidden_indices is None else h.index_select(0, hidden_indices)  # [M, H]
        if logits_indices is not None:
            h = h.index_select(0, logits_indices)  # [N, H]
        logits = ops.project(self.lm_head, h)
        return logits if kept is None else (logits, kept)

    def sparse_attention_layers(self) -> list[M3Attention]:
        """The sparse (MSA) attention modules in layer order: the S axis of a block-selection record."""
        return [layer.self_attn for layer in self.model.layers if layer.self_attn.is_sparse]

    def selection_dims(self) -> tuple[int, int, int]:
        """(S sparse layers, G KV heads, K top-k blocks) of a block-selection record row."""
        c = self.config
        return len(self.sparse_attention_layers()), c.num_key_value_heads, c.sparse_topk_blocks

    def moe_layers(self) -> list[M3MoE]:
        """The MoE blocks in layer order (their `last_topk_ids` form the routing record)."""
        return [layer.block_sparse_moe for layer in self.model.layers if layer.is_moe]

    def cast_for_inference(self, dtype: torch.dtype) -> M3ForCausalLM:
        """Cast every parameter to `dtype` but keep router gate weights and e_score_correction_bias
        in at least fp32 (spec §6: released and computed in fp32). On CUDA also packs the projection
        weights for the fused paged path (``pack_fused_weights``). Returns self."""
        self.to(dtype)
        router_dtype = compute_dtype(dtype)
        for moe in self.moe_layers():
            moe.gate.to(router_dtype)
            moe.e_score_correction_bias.data = moe.e_score_correction_bias.data.to(router_dtype)
        if self.lm_head.weight.is_cuda:
            self.pack_fused_weights()
        return self

    def pack_fused_weights(self) -> M3ForCausalLM:
        """Pack each layer's q/k/v(/index q/k) and dense/shared gate/up weights into one buffer per
        group (the parameters become views of it; see model/fused.py) for the fused paged path's
        GEMMs. Called by ``cast_for_inference`` on CUDA; weight sync keeps writing the parameters
        in place. Returns self."""
        for layer in self.model.layers:
            layer.self_attn.pack_projections()
            mlp = layer.block_sparse_moe.shared_experts if layer.is_moe else layer.mlp
            mlp.pack_projections()
        return self

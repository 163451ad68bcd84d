"""The small random M3 the paged-forward tests share (tests/test_model_fused_paged.py,
tests/test_model_batch_invariant.py, tests/test_trainer_invariant_scoring.py): 4 query / 2 KV heads,
hidden 32, 4 experts, sparse layers with top-2 blocks, weights drawn large enough (std 0.3) that
rounding differences show in the logits."""

from __future__ import annotations

import torch

from m3_rollout.model import M3ForCausalLM, tiny_config


def small_paged_model(
    seed: int = 0, vocab_size: int = 96, head_dim: int = 8, page_size: int = 4, layers: int = 4
) -> M3ForCausalLM:
    """fp32 eval model: ``head_dim`` per head (RoPE on half of it, index dim = head dim), block /
    page ``page_size`` tokens, top-2 blocks; parameters N(0, 0.3) (vectors N(0, 0.1)) from ``seed``.
    ``layers``: layer 0 dense (full attention, dense MLP), the others sparse attention + MoE (the
    interpreter-bound tests take 2: every layer kind at half the time); 1 has no sparse layer."""
    torch.manual_seed(seed)
    kinds = [0] + [1] * (layers - 1)
    cfg = tiny_config(
        num_hidden_layers=layers,
        moe_layer_freq=kinds,
        sparse_attention_freq=kinds,
        sparse_disable_index_value=kinds,
        vocab_size=vocab_size,
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        rotary_dim=head_dim // 2,
        sparse_index_dim=head_dim,
        dense_intermediate_size=48,
        intermediate_size=16,
        shared_intermediate_size=16,
        num_local_experts=4,
        max_position_embeddings=128,
        sparse_block_size=page_size,
        sparse_topk_blocks=2,
    )
    m = M3ForCausalLM(cfg).float()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.3 if p.ndim >= 2 else 0.1)
    return m.eval()

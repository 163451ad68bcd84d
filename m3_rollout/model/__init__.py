"""MiniMax-M3 text model in plain PyTorch (spec: docs/m3_spec.md §1-3, §6-7).

configuration  M3Config (both config.json shapes), tiny_config (spec §7 preset A)
norm / rope    Gemma RMSNorm, partial NeoX RoPE
indexer        lightning-indexer block scores + top-k block selection (pure functions)
attention      QK-norm + RoPE + GQA, dense causal or block-sparse
moe            SwiGLU-OAI, dense MLP, sigmoid-routed MoE with shared expert
kv_cache       contiguous per-row cache, slot == position
model          decoder layer, M3Model, M3ForCausalLM
paged_ops      PagedOps: the table of fast ops the paged forward calls (built by the engine, engine/ops.py)
fused          packed projection weights and GEMM helpers of the fused paged path
loading        released / transformers tensor names, safetensors save + load
atomic_file    write_atomic (temporary file, fsync, rename) and fsync_dir: the durable file writes
"""

from .configuration import M3Config, tiny_config
from .kv_cache import KVCache
from .loading import (
    iter_released_tensors,
    load_checkpoint,
    load_hf_state_dict,
    load_released_tensor,
    save_checkpoint,
)
from .model import M3ForCausalLM

__all__ = [
    "M3Config",
    "tiny_config",
    "M3ForCausalLM",
    "KVCache",
    "load_checkpoint",
    "save_checkpoint",
    "iter_released_tensors",
    "load_released_tensor",
    "load_hf_state_dict",
]

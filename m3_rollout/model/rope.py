"""Partial NeoX rotary position embedding (spec §3.3).

Governing idea: only the first `rotary_dim` channels of each head rotate, paired as
(i, i + rotary_dim/2) ("rotate_half" on that slice, not GPT-J interleaving); the remaining
channels pass through. The same cos/sin serve q, k, index q and index k.
"""

from __future__ import annotations

import torch

from .numerics import compute_dtype


def rope_cos_sin(positions: torch.Tensor, rotary_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of angle_i = pos * theta^(-2i/rotary_dim), i = 0..rotary_dim/2-1.

    positions: int tensor of any shape P (absolute 0-based positions).
    Returns (cos, sin), each [*P, rotary_dim // 2] fp32.
    NOTE: tables stay fp32 here; vLLM and transformers store them in the model dtype (bf16) before
    use, a source of tiny (~1 bf16 ulp) mismatches against them in bf16 runs (spec §6).
    """
    assert rotary_dim % 2 == 0, f"rotary_dim must be even, got {rotary_dim}"
    exponent = torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=positions.device) / rotary_dim
    inv_freq = 1.0 / (theta**exponent)  # [r/2]
    angles = positions.to(torch.float32)[..., None] * inv_freq  # [*P, r/2]
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first 2 * cos.shape[-1] channels of x's last dim (NeoX pairing).

    x: [..., d]; cos/sin: [..., r/2], broadcastable against x[..., :r/2] (e.g. [B, S, 1, r/2]
    for x [B, S, heads, d]). Computed in fp32 (fp64 for fp64 x), returned in x.dtype.
    """
    half = cos.shape[-1]
    r = 2 * half
    assert r <= x.shape[-1], f"rotary_dim {r} > head dim {x.shape[-1]}"
    cdt = compute_dtype(x.dtype)
    xf = x.to(cdt)
    cos, sin = cos.to(cdt), sin.to(cdt)
    x1, x2, rest = xf[..., :half], xf[..., half:r], xf[..., r:]
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)
    return out.to(x.dtype)

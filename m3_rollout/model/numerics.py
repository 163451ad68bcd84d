"""Numerics policy shared by every layer: which dtype a reduction or nonlinearity runs in.

Governing idea (spec §6): norms, RoPE, softmax, router and SwiGLU-OAI run in fp32 even when
the weights and activations are bf16. A float64 model (parity tests) must stay float64 end to end,
so "compute in fp32" means "at least fp32": bf16/fp16/fp32 -> fp32, fp64 -> fp64.
"""

from __future__ import annotations

import torch


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype to compute in for activations of `dtype`: float64 stays, everything else fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32

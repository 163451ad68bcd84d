"""Gemma RMSNorm, the only norm in M3 (spec §3.1).

Governing idea: normalise in (at least) fp32, scale by (1 + w) with w stored raw and
zero-initialised (so w = 0 is a plain RMSNorm), cast back to the input dtype. The +1 is added at
use time, never at load time (spec §2.2 layout notes).
"""

from __future__ import annotations

import torch
from torch import nn

from .numerics import compute_dtype


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """y = x * rsqrt(mean(x^2, -1) + eps) * (1 + weight), over the last dim.

    x: [..., n] any float dtype; weight: [n]. Computed in fp32 (fp64 for fp64 input) and
    returned in x.dtype.
    """
    cdt = compute_dtype(x.dtype)
    xf = x.to(cdt)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * (1.0 + weight.to(cdt))).to(x.dtype)


class GemmaRMSNorm(nn.Module):
    """Gemma RMSNorm over the last dim of size `dim`; `weight` [dim] starts at zero (scale 1)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gemma_rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"

"""When the model's paged forward takes the fused GPU path, and the packed projection weights it uses.

Governing idea: on CUDA, inference (no autograd) runs the small per-layer ops through the Triton
kernels of ``kernels/fused_layers.py`` and one GEMM per group of projections that read the same
input (q|k|v|index q|index k; gate|up), over a weight buffer that the individual ``nn.Linear``
parameters are views of. Weight sync and checkpoint loading keep writing the individual
parameters in place (contracts.md), which writes the packed buffer too. Everywhere else (CPU, fp64,
autograd) the plain PyTorch path runs, unchanged.

Packing happens once, in ``M3ForCausalLM.cast_for_inference`` on CUDA (or ``pack_fused_weights()``),
after the dtype cast: anything that later re-points a parameter's storage (``.to()``, assigning
``.data``) breaks the aliasing, which ``packed_ok`` detects per call (host-side pointer checks),
and that layer then falls back to separate GEMMs (concatenated) - slower, never wrong.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Sequence

import torch
from torch import nn

_STATE = {"enabled": True, "allow_cpu": False, "skinny_gemm": True}


def set_fused_layers(enabled: bool, allow_cpu: bool = False, skinny_gemm: bool | None = None) -> None:
    """Turn the fused path on/off (A/B profiling). ``allow_cpu`` lets it run on CPU tensors too: only
    for tests that run the kernels under the Triton interpreter (TRITON_INTERPRET=1, fp32/fp16).
    ``skinny_gemm`` (None = unchanged; default on): decode-sized bf16/fp16 projections (up to
    ``m3_kernels.fused_layers.SKINNY_MAX_TOKENS`` tokens) use the Triton skinny GEMM
    (``m3_kernels.fused_layers.skinny_linear``) instead of cuBLAS."""
    _STATE["enabled"], _STATE["allow_cpu"] = bool(enabled), bool(allow_cpu)
    if skinny_gemm is not None:
        _STATE["skinny_gemm"] = bool(skinny_gemm)


def skinny_ok(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the fused path's GEMM of x [T, K] with weight [N, K] takes the Triton skinny GEMM."""
    return _STATE["skinny_gemm"] and use_fused_layers(x) and fused_ops().skinny_linear_ok(x, weight)


class DecodeLinear(nn.Linear):
    """``nn.Linear`` (same parameter, same name) whose forward takes the Triton skinny GEMM for
    decode-sized inputs on the fused GPU path (``skinny_ok``); ``F.linear`` otherwise."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is None and x.dim() == 2 and skinny_ok(x, self.weight):
            return fused_ops().skinny_linear(x, self.weight)
        return torch.nn.functional.linear(x, self.weight, self.bias)


@functools.lru_cache(maxsize=1)
def _triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


def use_fused_layers(x: torch.Tensor) -> bool:
    """Whether a paged forward on activations ``x`` takes the fused path: enabled, CUDA (or the
    interpreter test switch), bf16/fp16/fp32, and nothing for autograd to differentiate."""
    if not _STATE["enabled"] or not (x.is_cuda or _STATE["allow_cpu"]):
        return False
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return False
    if torch.is_grad_enabled() and x.requires_grad:
        return False
    return _triton_importable()


def fused_ops():
    """The ``m3_kernels.fused_layers`` module (imported lazily: CPU-only runs never import triton)."""
    import m3_kernels.fused_layers as fl

    return fl


def pack_linear_weights(linears: Sequence[nn.Linear]) -> torch.Tensor:
    """Concatenate the weights of bias-free Linears with one input size into one buffer
    [sum(out_i), in] and re-point each ``weight`` (same Parameter object) to its row slice.

    Raises ValueError when the Linears disagree on input size, dtype or device, or have a bias.
    """
    ws = [lin.weight for lin in linears]
    if any(lin.bias is not None for lin in linears):
        raise ValueError("pack_linear_weights: Linears with a bias are not packed")
    if len({(w.shape[1], w.dtype, w.device) for w in ws}) != 1:
        raise ValueError(
            "pack_linear_weights: weights differ in input size, dtype or device: "
            f"{[(tuple(w.shape), w.dtype, str(w.device)) for w in ws]}"
        )
    buf = torch.empty(sum(w.shape[0] for w in ws), ws[0].shape[1], dtype=ws[0].dtype, device=ws[0].device)
    off = 0
    with torch.no_grad():
        for w in ws:
            n = w.shape[0]
            buf[off : off + n].copy_(w)
            w.data = buf[off : off + n]
            off += n
    return buf


def packed_ok(buf: torch.Tensor | None, linears: Sequence[nn.Linear]) -> bool:
    """True when every Linear's weight is still the row slice of ``buf`` that packing made."""
    if buf is None:
        return False
    row_bytes = buf.shape[1] * buf.element_size()
    ptr = buf.data_ptr()
    for lin in linears:
        w = lin.weight
        if w.data_ptr() != ptr or w.dtype != buf.dtype or w.shape[1] != buf.shape[1] or not w.is_contiguous():
            return False
        ptr += w.shape[0] * row_bytes
    return ptr == buf.data_ptr() + buf.shape[0] * row_bytes


def packed_linear(x: torch.Tensor, buf: torch.Tensor | None, linears: Sequence[nn.Linear]) -> torch.Tensor:
    """x [T, in] @ concat(weights).T -> [T, sum(out_i)]: one GEMM on the packed buffer when the
    aliasing holds, else one GEMM per Linear, concatenated."""
    if packed_ok(buf, linears):
        if skinny_ok(x, buf):
            return fused_ops().skinny_linear(x, buf)
        return torch.nn.functional.linear(x, buf)
    return torch.cat([torch.nn.functional.linear(x, lin.weight) for lin in linears], dim=-1)

"""Packed projection weights for the fused paged path, and its GEMM helpers.

Governing idea: on the fused paged path (``PagedOps.fused_layers``, the engine's table on CUDA)
one GEMM runs per group of projections that read the same input (q|k|v|index q|index k;
gate|up), over a weight buffer that the individual ``nn.Linear`` parameters are views of. Weight
sync and checkpoint loading keep writing the individual parameters in place (design.md §3.6),
which writes the packed buffer too. Decode-sized GEMMs take the table's skinny GEMM when it has
one (``PagedOps.skinny_ok``); a table with ``linear`` (batch-invariant mode) runs every GEMM
through it (its decode-sized gate|up GEMM with SwiGLU in one launch, ``PagedOps.linear_swiglu``).
Everywhere else (the training forward, the layer-by-layer paged path) the plain ``nn.Linear`` runs,
unchanged.

Packing happens once, in ``M3ForCausalLM.cast_for_inference`` on CUDA (or ``pack_fused_weights()``),
after the dtype cast: anything that later re-points a parameter's storage (``.to()``, assigning
``.data``) breaks the aliasing, which ``packed_ok`` detects per call (host-side pointer checks),
and that layer then falls back to separate GEMMs (concatenated) - slower, never wrong.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from .paged_ops import PagedOps


def fused_linear(x: torch.Tensor, weight: torch.Tensor, ops: PagedOps) -> torch.Tensor:
    """x [T, K] @ weight [N, K]^T -> [T, N] on the fused path: the table's ``linear`` when it has one,
    else its skinny GEMM for decode-sized inputs (``ops.skinny_ok``), else ``F.linear``."""
    if ops.linear is not None:
        return ops.linear(x, weight)
    if ops.skinny_ok(x, weight):
        return ops.skinny_linear(x, weight)
    return torch.nn.functional.linear(x, weight)


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


def packed_linear(
    x: torch.Tensor, buf: torch.Tensor | None, linears: Sequence[nn.Linear], ops: PagedOps | None = None
) -> torch.Tensor:
    """x [T, in] @ concat(weights).T -> [T, sum(out_i)]: one GEMM on the packed buffer when the
    aliasing holds (through ``fused_linear`` when ``ops`` is given), else one GEMM per Linear
    (``ops.matmul``: the table's ``linear`` when it has one), concatenated."""
    if packed_ok(buf, linears):
        return torch.nn.functional.linear(x, buf) if ops is None else fused_linear(x, buf, ops)
    if ops is not None:
        return torch.cat([ops.matmul(x, lin.weight) for lin in linears], dim=-1)
    return torch.cat([torch.nn.functional.linear(x, lin.weight) for lin in linears], dim=-1)

"""Test helper: the Triton interpreter's ``tl.dot`` computed one tile row at a time (batch-invariance tests).

Why: the interpreter runs ``tl.dot`` of a [M, K] x [K, N] tile as one numpy matmul, and numpy's
BLAS (OpenBLAS sgemm here) gives a row different fp32 bits depending on its POSITION in the
matrix (the micro-kernel handles edge rows on another code path). That is a CPU artifact with no
GPU counterpart: on the GPU every row of an MMA tile runs the same instructions. A kernel whose
rows are independent would look batch-dependent under it (a token's row position inside its tile
moves with the other tokens). ``row_wise_dot`` replaces the matmul by one vector-matrix product
per tile row (the same numpy call for every row, on a contiguous copy of the right operand: numpy
gives a transposed view, e.g. a weight tile loaded [N, K] and used as ``w.T``, other fp32 bits than
the same values laid out [K, N], where the GPU's MMA does not care), which models the GPU's per-row arithmetic and
keeps everything else of the interpreter: masks, tile layouts, K loops, configs chosen by T,
cross-row reductions. The GPU tests (tests/gpu/test_invariant_ops_gpu.py) check the compiled bits.
(tests/conftest.py picks OpenBLAS's Sandy Bridge kernel on x86-64, under which rows were found
position-independent too, 2026-12-07; this helper keeps the tests independent of the BLAS.)
"""

from __future__ import annotations

import contextlib

import numpy as np
from triton.runtime import interpreter


def _row_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
    if a.data.ndim != 2 or a.dtype.primitive_bitwidth == 8:  # not used by the invariant kernels
        return _ORIGINAL(self, a, b, d, input_precision, max_num_imprecise_acc)
    b_data = np.ascontiguousarray(b.data)  # a transposed view takes another BLAS path (other bits)
    # [M, 1, K] x [K, N]: numpy's stacked matmul makes one vector-matrix BLAS call per row (the same
    # bits as a loop of ``np.matmul(a[i], b)``, without a Python call per row)
    rows = np.matmul(a.data[:, None, :], b_data, dtype=d.data.dtype)[:, 0, :]
    return interpreter.TensorHandle(rows + d.data, d.dtype.scalar)


_ORIGINAL = interpreter.InterpreterBuilder.create_dot


@contextlib.contextmanager
def row_wise_dot():
    """Within the block, interpreted ``tl.dot`` computes each tile row on its own (module docstring)."""
    interpreter.InterpreterBuilder.create_dot = _row_dot
    try:
        yield
    finally:
        interpreter.InterpreterBuilder.create_dot = _ORIGINAL

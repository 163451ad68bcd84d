"""Load kernels/fused_layers.py with its kernels running in the Triton interpreter (CPU tests only).

Same mechanism as kernels/msa_interpret.py (whose numpy shim it reuses): ``triton.jit`` decides at
decoration time whether a kernel is interpreted, so the module is reloaded after setting
``TRITON_INTERPRET=1`` when an earlier import compiled it for the GPU.
"""

from __future__ import annotations

import importlib
import os
import sys
from types import ModuleType


def interpreted_fused_layers() -> ModuleType:
    """The ``m3_kernels.fused_layers`` module with interpreted kernels; sets TRITON_INTERPRET=1 for the
    rest of the process (the interpreter reads it at launch time too)."""
    os.environ["TRITON_INTERPRET"] = "1"
    from triton.runtime.interpreter import InterpretedFunction

    from m3_kernels.msa_interpret import _patch_numpy_index

    _patch_numpy_index()
    mod = sys.modules.get("m3_kernels.fused_layers")
    mod = importlib.import_module("m3_kernels.fused_layers") if mod is None else mod
    if not isinstance(mod._add_rms_norm_kernel, InterpretedFunction):
        mod = importlib.reload(mod)
    return mod

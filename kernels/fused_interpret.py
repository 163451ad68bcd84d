"""Load kernels/fused_layers.py (and kernels/invariant_ops.py) with their kernels running in the Triton
interpreter (CPU tests only).

Same mechanism as kernels/msa_interpret.py (``interpreted_module``, with its numpy shim):
``triton.jit`` decides at decoration time whether a kernel is interpreted, so the module is
reloaded after setting ``TRITON_INTERPRET=1`` when an earlier import compiled it for the GPU.
The engine builds its CPU ops table from this module in ``m3_rollout.engine.ops.interpreted_paged_ops``.
"""

from __future__ import annotations

import os
from types import ModuleType

from m3_kernels.msa_interpret import FP8_HELPERS, interpreted_module


def interpreted_fused_layers() -> ModuleType:
    """The ``m3_kernels.fused_layers`` module with interpreted kernels; sets TRITON_INTERPRET=1 for the
    rest of the process (the interpreter reads it at launch time too)."""
    os.environ["TRITON_INTERPRET"] = "1"
    interpreted_module(FP8_HELPERS)  # the write kernel quantizes FP8 index keys with them
    return interpreted_module("m3_kernels.fused_layers")


# invariant_ops calls the fused MoE, whose kernels call the jit helpers of moe_tiles and split_k:
# a module after the modules it imports.
_INVARIANT_DEPS = (
    "m3_kernels.moe_tiles",
    "m3_kernels.moe_align",
    "m3_kernels.split_k",
    "m3_kernels.moe_chunked",
    "m3_kernels.moe_ragged",
    "m3_kernels.fused_moe",
)


def interpreted_invariant_ops() -> ModuleType:
    """The ``m3_kernels.invariant_ops`` module with interpreted kernels, over interpreted
    ``fused_layers`` and fused-MoE modules; sets TRITON_INTERPRET=1 for the rest of the process."""
    interpreted_fused_layers()
    for name in _INVARIANT_DEPS:
        interpreted_module(name)
    return interpreted_module("m3_kernels.invariant_ops")

"""Run the MSA Triton kernels on CPU under the Triton interpreter (tests only).

Governing idea: ``triton.jit`` decides at decoration time whether a kernel is interpreted, so the
kernel modules must be (re)imported after ``TRITON_INTERPRET=1`` is set — also when another test
module already imported triton or these modules. Returns fresh interpreted module objects.

NOTE: triton 3.6's interpreter converts loop bounds with ``int(ndarray)``, which numpy >= 2.3
rejects for the 1-element arrays that program ids and scalar loads are; ``_patch_numpy_index``
makes that conversion take the single element (test-only shim, applied once).
"""

from __future__ import annotations

import importlib
import os
import sys
from types import ModuleType

_KERNEL_MODULES = ("m3_kernels.msa_index_topk", "m3_kernels.msa_sparse_attention")


def _patch_numpy_index() -> None:
    from triton.runtime import interpreter

    if getattr(interpreter, "_msa_index_patched", False):
        return
    original = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched
    interpreter._msa_index_patched = True


def interpreted_kernels() -> tuple[ModuleType, ModuleType]:
    """(msa_index_topk, msa_sparse_attention) modules whose kernels run in the Triton interpreter.

    Sets TRITON_INTERPRET=1 for the rest of the process: the interpreter also reads it at launch
    time, so it cannot be restored afterwards (kernels decorated later are interpreted too).
    """
    os.environ["TRITON_INTERPRET"] = "1"
    return _load_interpreted()


def _load_interpreted() -> tuple[ModuleType, ModuleType]:
    _patch_numpy_index()
    mods = []
    for name in _KERNEL_MODULES:
        mod = sys.modules.get(name)
        mod = importlib.import_module(name) if mod is None else mod
        from triton.runtime.interpreter import InterpretedFunction

        kern = next(v for k, v in vars(mod).items() if k.endswith("_kernel"))
        if not isinstance(kern, InterpretedFunction):
            mod = importlib.reload(mod)
        mods.append(mod)
    return mods[0], mods[1]

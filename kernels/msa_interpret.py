"""Run the MSA Triton kernels on CPU under the Triton interpreter (tests only).

Governing idea: ``triton.jit`` decides at decoration time whether a kernel is interpreted, so the
kernel modules must be (re)imported after ``TRITON_INTERPRET=1`` is set — also when another test
module already imported triton or these modules. Returns fresh interpreted module objects.

NOTE: triton 3.6's interpreter converts loop bounds with ``int(ndarray)``, which numpy >= 2.3
rejects for the 1-element arrays that program ids and scalar loads are; ``patch_numpy_index``
makes that conversion take the single element (test-only shim, applied once; it wraps a private
hook of ``triton.runtime.interpreter``, the only place the conversion can be changed).
NOTE: triton 3.6's interpreter patches triton.language (every builtin of ``tl``, ``tl.tensor``,
``tl.math``, found with ``inspect.getmembers``) at each kernel launch, and again at each call of a
``@triton.jit`` helper inside the launch, where nothing is left to patch; in the batch-invariant
scoring tests that repetition was about a quarter of the run (one test: 9,389 patches and 22-23 s;
825 and 16-18 s without the repeats; AMD EPYC, 2026-12-07).
``patch_nested_jit_calls`` skips the repeat when the launch, or an earlier helper call in it,
already patched every language module the helper's globals hold (``tl`` or ``tl.core``: the
helpers of ``triton.language.standard``, ``tl.sum`` and the like, see ``tl.core`` where a kernel
module sees ``tl``). The interpreter never undoes a helper call's patch, so within a launch it holds
once made. Same programs, same results.
NOTE: every op the interpreter runs makes a ``tl.tensor`` and its ``block_type``, each with a
``tl.tuple`` shape whose ``tuple_type`` formats a name, and maps the type to numpy through a dict
it rebuilds per call; in the interpreted MoE tests that bookkeeping was over half of the run
(cProfile: ~20 of ~45 s in triton/language/core.py). ``patch_type_bookkeeping`` builds a shape
tuple's type on first read and remembers block types, tensor shapes and numpy dtypes by value.
With tests/interpreter_dot.py's row-wise dot as one stacked matmul: one split-k test 21-24 s ->
10-13 s, the whole suite 14 min 42 s -> 11 min 28 s-12 min 1 s on 2 idle cores (AMD EPYC,
2026-12-07). Same values, same errors (tests/test_interpret_type_bookkeeping.py).
NOTE: the interpreter's ``tl.dot`` is ``numpy.matmul`` (BLAS), whose result for one row of the left
operand depends on the row's place in the tile (BLAS micro-kernels); a GPU tensor-core dot of a
fixed shape does not. ``fixed_order_dot`` swaps in a dot that sums over k in order, element by
element (row-invariant like the hardware), for the batch-invariance tests.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
import threading
from collections.abc import Iterator
from types import ModuleType
from typing import NamedTuple

# Reload order matters: the FP8 helpers are imported by the score kernels' modules at import time,
# msa_score_topk (its jit merge helper) by msa_fused_decode at import time; msa_fused_decode imports
# the index_topk and paged_attention modules at call time.
_KERNEL_MODULES = ("m3_kernels.msa_index_topk", "m3_kernels.msa_paged_attention", "m3_kernels.msa_fused_decode")
FP8_HELPERS = "m3_kernels.msa_fp8"
SCORE_TOPK = "m3_kernels.msa_score_topk"


class InterpretedMSA(NamedTuple):
    """The three MSA kernel modules with interpreted kernels."""

    index_topk: ModuleType  # m3_kernels.msa_index_topk
    paged_attention: ModuleType  # m3_kernels.msa_paged_attention
    fused_decode: ModuleType  # m3_kernels.msa_fused_decode


def patch_numpy_index() -> None:
    """Make the interpreter's tensors convert to int through their single element (see module NOTE)."""
    from triton.runtime import interpreter

    if getattr(interpreter, "_msa_index_patched", False):
        return
    original = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched
    interpreter._msa_index_patched = True


def patch_nested_jit_calls() -> None:
    """Let ``@triton.jit`` helpers called inside an interpreted launch reuse the launch's patch of
    triton.language instead of redoing it per call (module NOTE). Applied once per process; does
    nothing outside triton 3.6 (the release it was read against) or where the interpreter lacks what
    it wraps or calls (``GridExecutor``, ``InterpretedFunction.rewrite``, ``InterpreterError``): then
    every helper call patches as before. A launch's pre-run hooks are not expected to call jit helpers."""
    from triton.runtime import interpreter as ti

    if getattr(ti, "_m3_nested_jit_patched", False):
        return
    import triton
    import triton.language as tl

    needed = ("GridExecutor", "InterpretedFunction", "InterpreterError")
    if not all(hasattr(ti, name) for name in needed) or not hasattr(ti.InterpretedFunction, "rewrite"):
        return
    if not triton.__version__.startswith("3.6."):  # read for 3.6 only: a helper's patch is never undone
        return

    launch_call, helper_call = ti.GridExecutor.__call__, ti.InterpretedFunction.__call__
    local = threading.local()  # the language modules patched by this thread's running launch
    seen: dict = {}  # (python function, size of its globals) -> ids of the language modules they hold

    def langs(fn) -> frozenset:  # keyed by size too: the interpreter adds names to a module's globals
        key = (fn, len(fn.__globals__))
        if key not in seen:
            seen[key] = frozenset(id(v) for v in fn.__globals__.values() if v is tl or v is tl.core)
        return seen[key]

    def launch(self, *args, **kwargs):
        outer = getattr(local, "patched", None)
        local.patched = langs(self.fn)
        try:
            return launch_call(self, *args, **kwargs)
        finally:
            local.patched = outer

    def helper(self, *args, **kwargs):
        patched = getattr(local, "patched", None)
        if patched is None:  # not inside a launch: as the interpreter does it
            return helper_call(self, *args, **kwargs)
        need = langs(self.fn)
        if not need or not need <= patched:  # none: the interpreter's own assert
            # the interpreter's own call patches the helper's language modules and never restores
            # that patch, so it holds for the rest of the launch: later helpers need not redo it
            local.patched = patched | need
            return helper_call(self, *args, **kwargs)
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # as the interpreter's own helper call reports it
            raise ti.InterpreterError(repr(e)) from e

    ti.GridExecutor.__call__ = launch
    ti.InterpretedFunction.__call__ = helper
    ti._m3_nested_jit_patched = True


# What ``patch_type_bookkeeping`` replaced: (owner, attribute) -> the original (tests compare with it).
TYPE_BOOKKEEPING_ORIGINALS: dict = {}


def patch_type_bookkeeping() -> None:
    """Make the interpreter's per-op type bookkeeping cheaper (module NOTE); same values, same errors.

    - ``tl.block_type``: the shape's checks and the name are done once per (element type, shape);
    - ``tl.tensor``: the constexpr shape and numel are made once per shape;
    - the shape tuples these two make (``tl.tuple`` of ints / constexprs) build their ``type`` (a
      ``tuple_type`` with a formatted name) on first read, not when made; other tuples as before;
    - the interpreter's ``_get_np_dtype``: one lookup per (type class, type name).
    Memo keys take exact ints only (``2.0`` and ``True`` equal ints as dict keys: they go through
    the originals, which judge them). Applied once per process; does nothing outside triton 3.6 (the
    release it was read against)."""
    import builtins
    import math

    import triton
    from triton.language import core
    from triton.runtime import interpreter as ti

    if getattr(ti, "_m3_types_patched", False) or not triton.__version__.startswith("3.6."):
        return
    originals = {
        (core.block_type, "__init__"): core.block_type.__init__,
        (core.tensor, "__init__"): core.tensor.__init__,
        (ti, "_get_np_dtype"): ti._get_np_dtype,
    }
    type_for_values, constexpr, Tuple = core._type_for_tuple_values, core.constexpr, core.tuple

    class LazyTupleType:  # non-data descriptor: only read where __init__ set no type (shape_tuple)
        def __get__(self, obj, owner=None):
            if obj is None:
                return self
            obj.__dict__["type"] = t = type_for_values(obj.values)  # ints / constexprs: cannot fail
            return t

    def shape_tuple(values) -> core.tuple:
        t = Tuple.__new__(Tuple)
        t.values = list(values)
        return t

    blocks: dict = {}  # (element type's class and name, shape ints) -> (shape ints, numel, name)
    block_init = originals[(core.block_type, "__init__")]

    def block_type_init(self, element_ty, shape):
        key = None
        if isinstance(shape, (list, Tuple)):  # what the original asserts; others go through it
            dims = builtins.tuple(s.value if isinstance(s, constexpr) else s for s in shape)
            if all(type(d) is int for d in dims):
                key = (element_ty.__class__, str(element_ty), dims)  # what the stored name is made of
                hit = blocks.get(key)
                if hit is not None:
                    self.element_ty, self.numel, self.name = element_ty, hit[1], hit[2]
                    self.shape = shape_tuple(hit[0])
                    return
        block_init(self, element_ty, shape)  # raises for a bad shape: nothing is stored then
        if key is not None:
            blocks[key] = (list(self.shape.values), self.numel, self.name)

    shapes: dict = {}  # shape ints -> ([constexpr dims], constexpr numel)
    tensor_init_original = originals[(core.tensor, "__init__")]

    def tensor_init(self, handle, type):
        dims = builtins.tuple(type.shape) if type.is_block() else ()
        if not all(builtins.type(d) is int for d in dims):
            return tensor_init_original(self, handle, type)
        self.handle, self.type, self.dtype = handle, type, type.scalar
        hit = shapes.get(dims)
        if hit is None:
            hit = shapes[dims] = ([constexpr(d) for d in dims], constexpr(math.prod(dims)))
        self.shape, self.numel = shape_tuple(hit[0]), hit[1]

    np_dtypes: dict = {}
    get_np_dtype = originals[(ti, "_get_np_dtype")]

    def np_dtype(tt_dtype):
        name = getattr(tt_dtype, "name", None)
        if not isinstance(name, str):
            return get_np_dtype(tt_dtype)  # not a triton type: the original's error
        key = (tt_dtype.__class__, name)
        found = np_dtypes.get(key)
        if found is None:
            found = np_dtypes[key] = get_np_dtype(tt_dtype)
        return found

    Tuple.type = LazyTupleType()
    core.block_type.__init__ = block_type_init
    core.tensor.__init__ = tensor_init
    ti._get_np_dtype = np_dtype
    TYPE_BOOKKEEPING_ORIGINALS.update(originals)
    ti._m3_types_patched = True


def interpreted_module(name: str) -> ModuleType:
    """Module ``name`` (e.g. ``"m3_kernels.fused_layers"``) with its Triton kernels interpreted.

    Imports it, or reloads it when an earlier import compiled its kernels for the GPU (judged by
    the first Triton function defined in the module). Needs TRITON_INTERPRET=1 set.
    NOTE: a module's jit helpers imported from another module must be interpreted too (an
    interpreted kernel cannot call a compiled helper): load the helpers' module first.
    """
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    patch_numpy_index()
    patch_nested_jit_calls()
    patch_type_bookkeeping()
    mod = sys.modules.get(name)
    mod = importlib.import_module(name) if mod is None else mod
    kern = next(
        v
        for v in vars(mod).values()
        if isinstance(v, (InterpretedFunction, JITFunction)) and v.fn.__module__ == mod.__name__
    )
    if not isinstance(kern, InterpretedFunction):
        mod = importlib.reload(mod)
    return mod


def interpreted_kernels() -> InterpretedMSA:
    """(msa_index_topk, msa_paged_attention, msa_fused_decode) modules whose kernels run in the
    Triton interpreter.

    Sets TRITON_INTERPRET=1 for the rest of the process: the interpreter also reads it at launch
    time, so it cannot be restored afterwards (kernels decorated later are interpreted too).
    """
    os.environ["TRITON_INTERPRET"] = "1"
    interpreted_module(FP8_HELPERS)
    interpreted_module(SCORE_TOPK)  # msa_fused_decode's K2 calls its merge helper
    return InterpretedMSA(*(interpreted_module(name) for name in _KERNEL_MODULES))


INVARIANT_ATTENTION = "m3_kernels.invariant_attention"


def interpreted_invariant_attention() -> ModuleType:
    """The ``m3_kernels.invariant_attention`` module (batch-invariant MSA attention) with interpreted
    kernels; sets TRITON_INTERPRET=1 for the rest of the process (see ``interpreted_kernels``)."""
    os.environ["TRITON_INTERPRET"] = "1"
    interpreted_module(FP8_HELPERS)  # its score kernel calls the FP8 helpers
    interpreted_module("m3_kernels.msa_index_topk")  # its top-k kernel calls block_selection_keys
    interpreted_module("m3_kernels.split_k")  # its decode score launch counts arrivals (last_to_arrive)
    interpreted_module("m3_kernels.msa_paged_attention")  # its attention kernel calls attend_block
    interpreted_module("m3_kernels.invariant_page_partials")  # sparse_impl "page_partials" (calls the above)
    return interpreted_module(INVARIANT_ATTENTION)


@contextlib.contextmanager
def fixed_order_dot() -> Iterator[None]:
    """Within the block, the interpreter's 2-D ``tl.dot`` sums a[m, k] * b[k, n] over k = 0, 1, ... in the
    accumulator's dtype, one rounding per product and per add: row m's result depends on row m of a
    alone, as on the GPU (module NOTE). fp8 operands go through fp16 as in the interpreter's own dot.
    Tests only; restores the interpreter's dot on exit."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    original = builder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.data.ndim != 2:
            return original(self, a, b, d, input_precision, max_num_imprecise_acc)
        a_data, b_data = a.data, b.data
        if a.dtype.primitive_bitwidth == 8 and a.dtype.is_floating():
            a_data = interpreter._convert_float(a_data, a.dtype, tl.float16, None).view(np.float16)
        if b.dtype.primitive_bitwidth == 8 and b.dtype.is_floating():
            b_data = interpreter._convert_float(b_data, b.dtype, tl.float16, None).view(np.float16)
        dt = d.data.dtype
        a_data, b_data = a_data.astype(dt), b_data.astype(dt)
        prod = a_data[:, :, None] * b_data[None, :, :]  # [M, K, N], one rounding per product
        out = np.cumsum(prod, axis=1, dtype=dt)[:, -1, :]  # running sum: k = 0, 1, ... in order
        return interpreter.TensorHandle(out + d.data, d.dtype.scalar)

    builder.create_dot = create_dot
    try:
        yield
    finally:
        builder.create_dot = original

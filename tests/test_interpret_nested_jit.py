"""``msa_interpret.patch_nested_jit_calls``: inside an interpreted launch, ``@triton.jit`` helpers
reuse the launch's patch of triton.language (one patch per launch and language module, not one per
helper call), with the same results and the same error reporting (CPU, Triton interpreter)."""

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":  # tests/conftest.py sets it on a machine without CUDA
    pytest.skip("needs the Triton interpreter (TRITON_INTERPRET=1)", allow_module_level=True)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime import interpreter as ti  # noqa: E402

from m3_kernels.msa_interpret import patch_nested_jit_calls  # noqa: E402


@triton.jit
def _row_softmax_max(v):
    """A helper that sees ``tl`` (as the kernel does) and calls the standard library's helpers
    (``tl.max``, ``tl.sum``: module triton.language.standard, which sees ``tl.core``)."""
    e = tl.exp(v - tl.max(v, axis=0))
    return tl.max(e / tl.sum(e, axis=0), axis=0)


@triton.jit
def _kernel(x_ptr, out_ptr, N: tl.constexpr):
    row = tl.program_id(0)
    v = tl.load(x_ptr + row * N + tl.arange(0, N))
    a = _row_softmax_max(v)
    b = _row_softmax_max(v * 2.0)
    tl.store(out_ptr + row, a + b)


@triton.jit
def _raising_helper(v):
    return tl.sum(tl.reshape(v, (4, 4)), axis=0)  # 8 elements cannot become 4 x 4: the interpreter raises


@triton.jit
def _raising_kernel(x_ptr, N: tl.constexpr):
    v = tl.load(x_ptr + tl.arange(0, N))
    tl.store(x_ptr + tl.arange(0, 4), _raising_helper(v))


def _expected(x: torch.Tensor) -> torch.Tensor:
    return torch.softmax(x, dim=1).amax(dim=1) + torch.softmax(2 * x, dim=1).amax(dim=1)


def _patched() -> None:
    patch_nested_jit_calls()
    patch_nested_jit_calls()  # applied once: a second call changes nothing
    if not getattr(ti, "_m3_nested_jit_patched", False):
        pytest.skip(f"patch_nested_jit_calls applies to triton 3.6 only (this is {triton.__version__})")


def test_one_patch_per_launch_and_language_module_and_the_same_results(monkeypatch):
    _patched()
    calls = []
    original = ti._patch_lang
    monkeypatch.setattr(ti, "_patch_lang", lambda fn: calls.append(fn.__module__) or original(fn))
    x = torch.randn(5, 16, generator=torch.Generator().manual_seed(0))
    for launch in range(1, 3):
        out = torch.empty(5)
        _kernel[(5,)](x, out, N=16)
        torch.testing.assert_close(out, _expected(x))
        # per launch: the kernel's module (tl), then the first standard-library helper's (tl.core);
        # every other helper call of the 5 programs (2 own helpers, 6 library ones each) reuses them
        assert calls == [__name__, "triton.language.standard"] * launch
    # outside a launch a helper patches as the interpreter does (the launch's record was cleared)
    with pytest.raises(Exception):  # noqa: B017 - a helper called from Python, not from a kernel
        _row_softmax_max(torch.zeros(4))
    assert calls[4] == __name__


def test_a_helpers_error_is_reported_as_the_interpreter_reports_it():
    _patched()
    x = torch.zeros(8)
    with pytest.raises(ti.InterpreterError, match="cannot change total number of elements") as err:
        _raising_kernel[(1,)](x, N=8)
    # the launch's InterpreterError wraps the helper call's, which wraps the ValueError (as unpatched)
    inner = err.value.__cause__
    assert isinstance(inner, ti.InterpreterError) and isinstance(inner.__cause__, ValueError)

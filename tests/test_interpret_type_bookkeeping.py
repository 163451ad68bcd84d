"""``msa_interpret.patch_type_bookkeeping``: the interpreter's tuples, block types, tensors and numpy
dtypes come out as the unpatched constructors make them, bad shapes raise the same errors, and a
kernel gives the same results (CPU, Triton interpreter; tests/conftest.py applies the patch)."""

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":  # tests/conftest.py sets it on a machine without CUDA
    pytest.skip("needs the Triton interpreter (TRITON_INTERPRET=1)", allow_module_level=True)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.language import core  # noqa: E402
from triton.runtime import interpreter as ti  # noqa: E402

from m3_kernels.msa_interpret import TYPE_BOOKKEEPING_ORIGINALS, patch_type_bookkeeping  # noqa: E402


@pytest.fixture(autouse=True)
def patched():
    patch_type_bookkeeping()
    patch_type_bookkeeping()  # applied once: a second call changes nothing
    if not getattr(ti, "_m3_types_patched", False):
        pytest.skip(f"patch_type_bookkeeping applies to triton 3.6 only (this is {triton.__version__})")
    assert core.block_type.__init__ is not TYPE_BOOKKEEPING_ORIGINALS[(core.block_type, "__init__")]


def _unpatched(cls, *args):
    """An instance of ``cls`` made by its original constructor (``tl.tuple``'s is not patched)."""
    obj = cls.__new__(cls)
    TYPE_BOOKKEEPING_ORIGINALS.get((cls, "__init__"), cls.__init__)(obj, *args)
    return obj


def _same_type(a, b) -> bool:
    return type(a) is type(b) and a == b and str(a) == str(b)


def test_shape_tuples_build_their_type_when_read_and_other_tuples_as_before():
    bt = core.block_type(tl.float32, [16, 4])
    core.block_type(tl.float32, [16, 4])  # remembered
    for t in (core.block_type(tl.float32, [16, 4]).shape, core.tensor(None, bt).shape):
        assert "type" not in t.__dict__  # not built yet
        want = _unpatched(core.tuple, list(t.values)).type
        assert _same_type(t.type, want) and "type" in t.__dict__
    t = core.tensor(None, bt).shape
    t._setitem(1, core.constexpr(8))  # the in-place update recomputes the type from the new values
    assert [v.value for v in t.values] == [16, 8] and _same_type(t.type, _unpatched(core.tuple, t.values).type)
    values = [core.constexpr(4), tl.float32, 3]
    assert "type" in core.tuple(values).__dict__  # any other tuple: made as the original makes it
    with pytest.raises(AttributeError, match="has no attribute 'type'"):
        core.tuple([4, print])  # an element without a type fails when made, as unpatched


@pytest.mark.parametrize(
    "shape",
    [[16, 4], [4, 16], [core.constexpr(16), core.constexpr(4)], core.tuple([16, 4]), [8], [1, 8], [8, 1], [1, 1, 32]],
    ids=["ints", "transposed", "constexprs", "tl_tuple", "1d", "unit_first", "unit_last", "3d"],
)
@pytest.mark.parametrize("elt", [tl.float32, tl.bfloat16, tl.pointer_type(tl.float16)], ids=str)
def test_block_type_equals_the_unpatched_twice(shape, elt):
    want = _unpatched(core.block_type, elt, shape)
    for _ in range(2):  # the first call fills the memo, the second reads it
        got = core.block_type(elt, shape)
        assert got.element_ty is elt and got.numel == want.numel and got.name == want.name
        assert list(got.shape) == list(want.shape) and _same_type(got.shape.type, want.shape.type)
        assert got == want and not got != want
        assert got.shape is not want.shape  # each type has its own shape tuple


@pytest.mark.parametrize(
    ("shape", "err", "match"),
    [([3, 4], ValueError, "power of 2"), ([], TypeError, "0d block_type"), ([2.0], TypeError, "Shape element 0")],
)
def test_block_type_errors_are_the_unpatched_ones_each_time(shape, err, match):
    core.block_type(tl.float32, [2])  # remembered: a float 2.0 (== 2 as a dict key) must still fail
    for _ in range(2):  # nothing is remembered for a bad shape
        with pytest.raises(err, match=match):
            core.block_type(tl.float32, shape)
    with pytest.raises(AssertionError):
        core.block_type(tl.float32, (4,))  # a Python tuple: the original's assert


def test_tensor_shape_and_numel_equal_the_unpatched():
    shapes = ([4, 8], [8, 4], [1, 8], [8, 1], [32])
    types = [core.block_type(tl.float16, s) for s in shapes] + [tl.int32, tl.pointer_type(tl.float32)]
    for ty in types * 2:  # the second round reads the memo
        want = _unpatched(core.tensor, None, ty)
        got, other = core.tensor(None, ty), core.tensor(None, ty)
        assert got.type is ty and got.dtype == want.dtype and str(got) == str(want)
        assert [s.value for s in got.shape] == [s.value for s in want.shape] and got.numel.value == want.numel.value
        assert all(type(s.value) is int for s in got.shape) and got.shape is not other.shape


def test_a_bool_dimension_goes_through_the_originals():
    for _ in range(2):
        bt = core.block_type(tl.float32, [True])  # triton 3.6 takes it; True == 1 as a dict key
        assert bt.shape.values == [True] and str(core.tensor(None, bt)) == "fp32[constexpr[True]]"
        one = core.tensor(None, core.block_type(tl.float32, [1]))
        assert type(one.shape[0].value) is int and str(one) == "fp32[constexpr[1]]"


def test_numpy_dtypes_equal_the_unpatched():
    original = TYPE_BOOKKEEPING_ORIGINALS[(ti, "_get_np_dtype")]
    types = [tl.int1, tl.float16, tl.float32, tl.int64, tl.bfloat16, tl.float8e4nv, tl.pointer_type(tl.bfloat16)]
    types += [core.block_type(t, [2, 4]) for t in types]
    for t in types * 2:
        assert ti._get_np_dtype(t) == original(t), t
    with pytest.raises(KeyError):
        ti._get_np_dtype(tl.void)  # what the interpreter does not store stays an error


@triton.jit
def _kernel(x_ptr, y_ptr, out_ptr, N: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, N)
    x = tl.load(x_ptr + row * N + offs)
    y = tl.load(y_ptr + offs[:, None] * N + offs[None, :])
    z = tl.sum(tl.reshape(x[:, None] * y, (y.shape[0], y.shape[1] // 2, 2)), axis=2)
    tl.store(out_ptr + row * (N // 2) + tl.arange(0, N // 2), tl.max(z, axis=0).to(tl.float16))


def test_a_kernel_gives_the_reference_values():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(3, 8, generator=g), torch.randn(8, 8, generator=g)
    out = torch.empty(3, 4, dtype=torch.float16)
    _kernel[(3,)](x, y, out, N=8)
    want = (x[:, :, None] * y[None]).reshape(3, 8, 4, 2).sum(-1).amax(1)
    torch.testing.assert_close(out.float(), want, rtol=1e-3, atol=1e-3)

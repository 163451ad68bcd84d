"""Session-wide test setup.

Triton decides at ``@triton.jit`` decoration time whether a kernel runs in the interpreter, so on a
machine without a CUDA GPU the variable must be set before any test module imports triton;
otherwise the order in which test files import kernels decides whether the MSA kernels can run.
GPU tests (tests/gpu) skip themselves under the interpreter; run them in their own process on a GPU.

The interpreter computes ``tl.dot`` with numpy's matmul (OpenBLAS). Tests that compare two launch
shapes bit for bit (key sub-tiles of 64 vs 128 columns, store tiles) need each output column's sum
to be formed in the same order whatever the other operand's width; OpenBLAS's Haswell and Zen GEMM
kernels do not (on an AMD EPYC machine, 2026-12-07: an [M, 128] x [128, 64] product differs from
the first 64 columns of [M, 128] x [128, 128] from M of about 12 rows on), its Sandy Bridge kernel
does. So on x86-64 the kernel is chosen here, before torch loads numpy (OPENBLAS_CORETYPE is read
when the library loads; workers the tests start inherit it). Elsewhere, or where numpy uses another
BLAS, the variable does nothing.
"""

import os
import platform
import sys
import warnings

if platform.machine().lower() in ("x86_64", "amd64"):
    if "numpy" not in sys.modules:
        os.environ.setdefault("OPENBLAS_CORETYPE", "Sandybridge")
    elif "OPENBLAS_CORETYPE" not in os.environ:
        warnings.warn(
            "numpy was imported before tests/conftest.py, so OpenBLAS keeps the GEMM kernel it detected; the "
            "interpreter tests that compare launch shapes bit for bit may then fail on some CPUs. Run "
            "`python -m pytest` directly, or set OPENBLAS_CORETYPE=Sandybridge in the environment.",
            stacklevel=1,
        )

import pytest  # noqa: E402
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def tiny_ep_model_dir(tmp_path_factory):
    """A saved tiny fp32 M3 (vocab 256) whose router weights are scaled up so tokens route to
    different experts; shared by the EP-service and weight-sync-service tests."""
    from m3_rollout.model import M3ForCausalLM, save_checkpoint, tiny_config

    torch.manual_seed(0)
    model = M3ForCausalLM(tiny_config(vocab_size=256)).float()
    with torch.no_grad():
        for moe in model.moe_layers():
            moe.gate.weight.mul_(8.0)
    path = tmp_path_factory.mktemp("tiny_ep")
    save_checkpoint(model, model.config, path)
    return path

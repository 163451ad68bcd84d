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

`scripts/test.sh` (the README's test command) runs the suite in two pytest-xdist workers with one
torch / OpenBLAS thread each (OMP_NUM_THREADS=1); `pytest_xdist_make_scheduler` below keeps each
file on one worker.
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
if os.environ.get("TRITON_INTERPRET") == "1":
    from m3_kernels.msa_interpret import patch_nested_jit_calls, patch_type_bookkeeping

    patch_nested_jit_calls()  # jit helpers reuse their launch's patch of triton.language (its NOTE)
    patch_type_bookkeeping()  # cheaper per-op type bookkeeping, same values (its NOTE)


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


@pytest.fixture(scope="module")
def ray_local():
    """A local Ray instance for the module's tests (``init_ray``: its workers at this process's
    niceness), shut down after them if this fixture started it; skips where Ray is not installed."""
    ray = pytest.importorskip("ray")
    from m3_rollout.service import init_ray

    started = not ray.is_initialized()
    if started:
        init_ray(num_cpus=2, log_to_driver=False)
    yield
    if started:
        ray.shutdown()


# Files whose tests start a local Ray cluster: one worker runs them, one after another.
RAY_FILES = {"test_grpo_worker_process.py", "test_service_ray.py"}


def file_group(nodeid: str) -> str:
    """The xdist scope of a test id: its file, or "ray" for the files of RAY_FILES."""
    path = nodeid.split("::", 1)[0]
    return "ray" if path.rsplit("/", 1)[-1] in RAY_FILES else path


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Under pytest-xdist (scripts/test.sh: ``-n 2``), each file's tests run on one worker in file
    order (module-scoped state and fixtures are built once), and the Ray files share one worker.
    A scheduler, not ``xdist_group`` markers: with pytest 9 the marker's rewritten test ids are not
    used, and xdist reads the markers before this conftest's collection hook could add them."""
    from xdist.scheduler import LoadScopeScheduling

    class FileScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return file_group(nodeid)

    return FileScheduling(config, log)

"""Session-wide test setup.

Triton decides at ``@triton.jit`` decoration time whether a kernel runs in the interpreter, so on a
machine without a CUDA GPU the variable must be set before any test module imports triton;
otherwise the order in which test files import kernels decides whether the MSA kernels can run.
GPU tests (tests/gpu) skip themselves under the interpreter; run them in their own process on a GPU.
"""

import os

import pytest
import torch

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

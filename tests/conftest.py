"""Session-wide test setup.

Triton decides at ``@triton.jit`` decoration time whether a kernel runs in the interpreter, so on a
machine without a CUDA GPU the variable must be set before any test module imports triton;
otherwise the order in which test files import kernels decides whether the MSA kernels can run.
GPU tests (tests/gpu) skip themselves under the interpreter; run them in their own process on a GPU.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

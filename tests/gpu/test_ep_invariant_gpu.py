"""Batch-invariant mode under expert parallelism on two CUDA GPUs (issue 24; design.md §4.6).

The CPU test (tests/test_ep_invariant.py: gloo, Triton interpreter, fp32 / fp16) checks the
combine's structure; here NCCL and the compiled invariant kernels (``paged_ops_for(...,
batch_invariant=True)``) in bf16 at M3-bench MoE shapes (H 1024, I 512, 16 experts top-4; EP=2,
8 experts per GPU): a token's routed and shared outputs and expert ids from the EP layer equal the
EP=1 layer's on the same token bitwise, computed in its rank's batch of 300 / 37 tokens, alone,
among shuffled subsets, or beside a peer with no tokens (tests/ep_invariant_util.py).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")
if torch.cuda.device_count() < 2:
    pytest.skip("needs two CUDA GPUs", allow_module_level=True)
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("TRITON_INTERPRET=1 in this process; run tests/gpu alone", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: ep_invariant_util, mp_results

from ep_invariant_util import EPCase, check_ep_invariant, run_ep_invariant  # noqa: E402


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_ep2_invariant_moe_equals_ep1_bitwise_on_gpus(dtype):
    case = EPCase(dtype, tokens=(300, 37), hidden=1024, inter=512, experts=16, top_k=4, device="cuda")
    check_ep_invariant(run_ep_invariant(case, timeout_s=300))

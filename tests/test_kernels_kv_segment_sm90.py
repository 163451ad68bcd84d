"""The Hopper KV-major segment kernel (kernels/msa_kv_segment_sm90.py, Gluon) without a GPU.

Gluon kernels do not run under the CPU interpreter, so this file checks what the compiler gives for
sm_90 (``python -m m3_kernels.mma_check`` / ``smem_check`` in a subprocess, as
tests/test_invariant_page_partials.py and tests/test_kernels_smem.py do) and the launch's input
checks. Its values against the Triton segment loop (bitwise) are checked on the GPU:
tests/gpu/test_msa_gpu.py::test_kv_segment_sm90_equals_the_triton_segment_loop.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[1]


def _compiled(module: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    run = subprocess.run([sys.executable, "-m", module], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_sm90_segment_kernel_runs_the_triton_loops_mmas_with_the_softmax_under_the_next_dot():
    # the same tensor-core code (layouts, operand types, wgmma opcodes and immediates) as the Triton
    # segment loop, the condition for equal bits; and the one difference the kernel exists for: the
    # first exponential of the softmax is issued while a wgmma group (the next tile's QK dot) is in
    # flight, where the Triton loop waits for every dot before its softmax
    code = _compiled("m3_kernels.mma_check")
    tri, glu = code["kv_seg_attn_kernel/bf16"], code["kv_seg_attn_sm90_kernel/bf16"]
    for key in ("layouts", "dots", "instructions"):
        assert glu[key] == tri[key], key
    assert len(glu["dots"]) == 2 and all(i.startswith("wgmma.mma_async") for i in glu["instructions"])
    assert glu["softmax_under_mma"] is True
    assert tri["softmax_under_mma"] is False


def test_two_sm90_segment_programs_share_an_sm():
    # K and V pages (2 x [128, 128] bf16) + KV_SEG_SM90_STAGES query tiles of [64, 128] bf16, all of them
    # (a lost stage would come out smaller), within half of an SM's shared memory (two programs per SM)
    from m3_kernels.msa_kv_segment_sm90 import KV_SEG_SM90_STAGES, SM90_TWO_PROGRAM_SMEM

    smem = _compiled("m3_kernels.smem_check")
    got = smem["kv_major_segment_sm90/bf16"]
    assert got >= 2 * 128 * 128 * 2 + KV_SEG_SM90_STAGES * 64 * 128 * 2, got
    assert got <= SM90_TWO_PROGRAM_SMEM, got


class _Cuda:
    """What ``sm90_unsupported`` reads of a CUDA tensor (a CPU test cannot make one)."""

    def __init__(self, shape, dtype=torch.bfloat16, strides=None, ptr=1 << 20):
        self.shape, self.dtype, self.is_cuda, self.device, self._ptr = shape, dtype, True, "cuda:0", ptr
        self._strides = strides or torch.empty(0).new_empty(shape, device="meta").stride()

    def stride(self):
        return self._strides

    def data_ptr(self):
        return self._ptr

    def element_size(self):
        return torch.empty(0, dtype=self.dtype).element_size()


def test_sm90_launch_is_refused_with_what_is_missing(monkeypatch):
    from m3_kernels.msa_kv_segment_sm90 import check_kv_seg_sm90
    from m3_kernels.msa_paged_attention import check_prefill_config

    assert check_prefill_config({"prefetch": "sm90"}) == {"prefetch": "sm90"}
    with pytest.raises(ValueError, match="'sm90'"):
        check_prefill_config({"prefetch": "sm91"})
    k = torch.zeros(8, 4, 128, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="compute capability 9.x"):  # a CPU tensor
        check_kv_seg_sm90(torch.zeros(4, 64, 128, dtype=torch.bfloat16), k, 16, 4, 3)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    q, kc = _Cuda((4, 64, 128)), _Cuda((8, 4, 128, 128))
    check_kv_seg_sm90(q, kc, 16, 4, 3)  # M3's shapes: accepted
    cases = [
        ((_Cuda((4, 64, 128), torch.float32), kc, 16, 4, 3), "bf16 / fp16 queries"),
        ((q, kc, 16, 8, 3), "got tok 8, heads 16"),
        ((q, kc, 8, 8, 3), "got tok 8, heads 8"),  # 64 rows too, but not checked on a GPU
        ((q, _Cuda((8, 4, 128, 64)), 16, 4, 3), "head dim 64"),
        ((q, _Cuda((8, 4, 64, 128)), 16, 4, 3), "page 64"),
        ((q, kc, 16, 4, 1), "num_stages >= 2"),
        ((q, kc, 16, 4, 4), "got num_stages 4"),  # 128 KB: one program per SM
        ((_Cuda((4, 64, 128), strides=(8200, 128, 1)), kc, 16, 4, 3), "queries with strides"),
        ((_Cuda((4, 64, 128), ptr=(1 << 20) + 2), kc, 16, 4, 3), "16-byte aligned queries"),
        ((q, _Cuda((8, 4, 128, 128), strides=(65544, 16384, 128, 1)), 16, 4, 3), "K cache"),
    ]
    for args, want in cases:
        with pytest.raises(ValueError, match=want):
            check_kv_seg_sm90(*args)

"""Shared-memory budget of the large-tile Triton kernels, checked without a GPU.

``python -m m3_kernels.smem_check`` (a subprocess: it must compile, not interpret, the kernels) builds
each kernel for an sm_90 target with the launch configuration the code picks by default, in bf16 and
fp32; each must fit the 232,448 bytes of shared memory an H200 SM offers a block. Regression: fp32
doubles tile bytes, and the ragged MoE tiles at their bf16 pipelining depth (4 stages) needed
376,888 B in fp32, which the H200 refused at launch (engine GPU test in fp32) before
``fused_moe.config_for_dtype`` capped fp32 at 2 stages; likewise the batch-invariant attention's
pipelined decode walk asked for 262,144 B in fp32 at 2 stages (GPU test, 2026-12-03) before
``invariant_attention.decode_walk_stages`` gave fp32 one stage.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[1]


def _compile_env() -> dict[str, str]:
    """This process's environment without TRITON_INTERPRET (the checks compile, not interpret, the
    kernels), the repository first on PYTHONPATH."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


@pytest.fixture(scope="module")
def smem() -> dict[str, int]:
    run = subprocess.run(
        [sys.executable, "-m", "m3_kernels.smem_check"],
        cwd=ROOT,
        env=_compile_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_default_tiles_fit_h200_shared_memory(smem):
    from m3_kernels.msa_checks import SM90_SMEM_BYTES

    kernels = ("moe_w13_ragged", "moe_w2_ragged", "kv_major_segment")
    kernels += ("invariant_decode_dense", "invariant_decode_sparse")
    kernels += ("invariant_moe_w13_flat", "invariant_moe_w13_ragged", "invariant_moe_w2_ragged")
    want = {f"{k}/{d}" for k in kernels for d in ("bf16", "fp32")} | {"invariant_decode_dense_d256_ps64/bf16"}
    want |= {"kv_major_segment_sm90/bf16"}  # the Gluon segment kernel: 16-bit inputs only
    assert set(smem) == want
    for name, nbytes in smem.items():
        assert 0 < nbytes <= SM90_SMEM_BYTES, (name, nbytes)


def test_fp32_moe_tiles_are_capped_and_bf16_keeps_its_pipeline(smem):
    from m3_kernels import fused_moe

    # bf16 keeps 4 stages (>100 KB of shared memory); fp32 runs 2 (the 4-stage fp32 tile needs 376,888 B)
    assert smem["moe_w13_ragged/bf16"] > 100_000 and smem["moe_w2_ragged/bf16"] > 150_000
    cfg = fused_moe.config_for_dtype(fused_moe.default_config(4096 * 4, 128, 6144, 3072), fused_moe.torch.float32)
    assert cfg.w13.num_stages == cfg.w2.num_stages == fused_moe.FP32_MAX_STAGES == 2


def test_invariant_decode_walk_is_pipelined_in_bf16_only(smem):
    from m3_kernels import invariant_attention as ia

    assert ia.decode_walk_stages(ieee=False) == ia.DECODE_STAGES >= 2
    assert ia.decode_walk_stages(ieee=True) == 1
    # head dim 256 with 64-key pages (the input check accepts it): 3 stages would ask 262,144 B
    # (breaker pass, 2026-12-03), so the walk takes 2 there; the compile above checks that it fits
    assert ia.decode_walk_stages(False, 128, 256, 64, 2) == 2 < ia.DECODE_STAGES
    # the pipeliner stages K and V (one [128, 128] bf16 tile each, 32 KB) DECODE_STAGES deep beside the
    # query tile (dense: 128 rows x d 128; sparse: 64 rows): fails if the walk stops being pipelined,
    # e.g. a page-id load feeding the K / V addresses inside the loop, or a compile without the
    # launch's alignment hints (smem_check.launch_attrs: 98,304 B instead of 163,840 B, 2026-12-03)
    tile = 128 * 128 * 2
    assert smem["invariant_decode_dense/bf16"] >= tile * (1 + 2 * ia.DECODE_STAGES)
    assert smem["invariant_decode_sparse/bf16"] >= tile // 2 + tile * 2 * ia.DECODE_STAGES


def test_invariant_moe_loops_compile_and_are_pipelined(smem):
    # the invariant routed experts' chunk-folding K loops (the aligned unsplit launch; the prefill
    # band's ragged GEMMs) compile for sm_90 and stage their A / weight tiles num_stages deep (a
    # loop the pipeliner gave up on, e.g. because of the fold's branch, would come out smaller)
    from m3_kernels import invariant_ops as inv

    cfg = inv.INVARIANT_MOE_CONFIG
    staged = cfg.w13.num_stages * (cfg.block_m + 2 * cfg.w13.block_n) * cfg.w13.block_k * 2  # bf16 tiles
    assert smem["invariant_moe_w13_flat/bf16"] >= staged
    pf = inv.INVARIANT_MOE_PREFILL_CONFIG
    assert pf.ragged and pf.k_chunk == cfg.k_chunk
    # w13: a 128-row A tile (+ the fat tail's) and gate / up weight tiles per stage; w2: A + weight
    a_rows, t13, t2 = 128 + pf.fat_tail, pf.w13, pf.w2
    assert smem["invariant_moe_w13_ragged/bf16"] >= t13.num_stages * (a_rows + 2 * t13.block_n) * t13.block_k * 2
    assert smem["invariant_moe_w2_ragged/bf16"] >= t2.num_stages * (a_rows + t2.block_n) * t2.block_k * 2


def test_fp8_query_prefill_scores_read_the_query_tile_from_shared_memory():
    """The prefill score launch with FP8 queries (``PREFILL_SCORE_FORMAT["fp8q"]``, qpre: the rows
    quantized before the launch) compiled for sm_90 at M3's shapes: its warpgroup dot takes the query
    tile from shared memory and it stays within the 128-register cap (two programs per SM), with fewer
    spilled bytes than quantizing inside the kernel, whose query tile is a register operand (ptxas
    reloads it before every k-step). H100 2026-12-07: scores 10.4-10.9 -> 9.8-10.3 ms at 128K."""
    code = (
        "import json; from m3_kernels import ptxas_check as p; "
        "print(json.dumps([p.prefill_score_report('fp8q'), p.prefill_score_report('fp8q', qpre=False)]))"
    )
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=_compile_env(), capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr[-3000:]
    pre, inside = json.loads(run.stdout.strip().splitlines()[-1])
    assert pre["query_operand"] == "shared" and inside["query_operand"] == "registers", (pre, inside)
    assert pre["registers"] <= 128 and pre["spill_bytes"] < inside["spill_bytes"], (pre, inside)

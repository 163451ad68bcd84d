"""scripts/profile_engine.py's ``--variants`` names: the ``invariant+<option>`` A/B switches parse to
the constants they set, and malformed names are refused before any run (CPU; no model is built)."""

from __future__ import annotations

import pytest
import torch
from script_loader import script_module  # tests/ on sys.path

with script_module("profile_engine") as pe:
    pass


def test_options_parse_to_their_values():
    assert pe._invariant_options("invariant") == {}
    assert pe._invariant_options("invariant+stages2+nopdl") == {"stages2": 1, "nopdl": 1}
    assert pe._invariant_options("invariant+moe_aligned") == {"moe_aligned": 1}
    got = pe._invariant_options("invariant+dp512+ss4+lbn32+lbk128+lw2+ls3+lsk0+union_walk")
    assert got == {"dp": 512, "ss": 4, "lbn": 32, "lbk": 128, "lw": 2, "ls": 3, "lsk": 0, "union_walk": 1}
    for name in ("pytorch", "fused", "fused+cublas", "invariant+topk_launch"):
        pe.check_variant(name)


def test_the_union_flag_picks_the_union_walk_and_every_other_variant_the_engine_default():
    from m3_rollout.engine.config import DEFAULT_INVARIANT_SPARSE_ATTENTION

    assert DEFAULT_INVARIANT_SPARSE_ATTENTION == "page_partials"
    assert pe.variant_sparse_attention("invariant+union") == "union"
    assert pe.variant_sparse_attention("invariant+nopdl+union+dp512") == "union"
    assert pe.variant_sparse_attention("invariant+union_walk") == "page_partials"  # union_walk: the decode walk
    assert pe.variant_sparse_attention("invariant") == "page_partials"
    assert pe.variant_sparse_attention("fused") == "page_partials"
    with pytest.raises(ValueError, match="given twice"):
        pe.variant_sparse_attention("invariant+union+union")


@pytest.mark.parametrize(
    "name, match",
    [
        ("invariant+", "not a flag"),
        ("invariant+dp", "not a flag"),
        ("invariant+DP4", "not a flag"),
        ("invariant+stages3", "not a flag"),
        ("invariant+dp4+dp8", "given twice"),
        ("invariant+ss0", "out of range"),
        ("invariant+lbn48", "out of range"),
        ("invariant+lw3", "out of range"),
        ("invariant+lbk256", "out of range"),
        ("invariant+lbk48", "out of range"),
        ("fused+dp4", "is not one of"),
        ("invariantx", "is not one of"),
    ],
)
def test_malformed_names_are_refused(name, match):
    with pytest.raises(ValueError, match=match):
        pe.check_variant(name)


def test_main_refuses_a_bad_name_before_running(capsys, monkeypatch):
    monkeypatch.setattr("sys.argv", ["profile_engine.py", "--variants", "fused", "invariant+ss0"])
    with pytest.raises(SystemExit) as exc:
        pe.main()
    assert exc.value.code == 2 and "'ss0' out of range" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv", [["--prefill-kernel-table"], ["--device", "cuda", "--kernel-table"], ["--cuda-graphs", "--kernel-table"]]
)
def test_kernel_tables_without_the_model_level_gpu_run_are_refused(argv, capsys, monkeypatch):
    # they used to print nothing: the tables are taken in the model-level run (CUDA, graphs)
    monkeypatch.setattr("sys.argv", ["profile_engine.py", *argv])
    with pytest.raises(SystemExit) as exc:
        pe.main()
    assert exc.value.code == 2 and "needs --device cuda and --cuda-graphs" in capsys.readouterr().err


def test_fuse_flags_build_the_invariant_table_without_its_fused_decode_routes(monkeypatch):
    """noswiglu_fuse / norouter_fuse (invariant_ops.LINEAR_SWIGLU_FUSE / ROUTER_GEMM_TOPK_FUSE off):
    the table of that variant has no ``linear_swiglu`` / answers ``router_gemm_topk_never``; plain
    ``invariant`` (and the next variant after a flagged one) has both fused decode routes; chunked_k
    turns ``invariant_ops.WHOLE_K`` off for its variant only. The CUDA
    table is built on the CPU (nothing launches); the module constants the variants set are restored."""
    for n in pe._IA_DEFAULTS:
        monkeypatch.setattr(pe.ia, n, getattr(pe.ia, n))
    set_by_variants = ("LINEAR_DECODE_CONFIGS", "INVARIANT_MOE_CONFIG", "MOE_PREFILL_ROWS")
    for n in (*set_by_variants, "LINEAR_SWIGLU_FUSE", "ROUTER_GEMM_TOPK_FUSE", "WHOLE_K"):
        monkeypatch.setattr(pe.inv, n, getattr(pe.inv, n))
    assert pe._invariant_options("invariant+noswiglu_fuse+norouter_fuse") == {"noswiglu_fuse": 1, "norouter_fuse": 1}
    gate = torch.empty(16, 1024)
    cuda = torch.device("cuda")

    def table(name):
        ops = pe.variant_ops(name, cuda, torch.bfloat16)
        return ops.linear_swiglu is not None, ops.router_gemm_topk_ok(1, gate)

    assert table("invariant+noswiglu_fuse") == (False, True)
    assert table("invariant+norouter_fuse") == (True, False)
    assert table("invariant+noswiglu_fuse+norouter_fuse") == (False, False)
    assert table("invariant") == (True, True)
    assert pe.inv.WHOLE_K and pe.inv.whole_k(torch.bfloat16, 6144) and not pe.inv.whole_k(torch.bfloat16, 1024)
    table("invariant+chunked_k")  # the whole-K weights switch off (other bits), on again in the next variant
    assert not pe.inv.WHOLE_K and not pe.inv.whole_k(torch.bfloat16, 6144)
    table("invariant")
    assert pe.inv.WHOLE_K

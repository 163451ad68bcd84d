"""scripts/bench_ep.py on the CPU (gloo, tiny shapes): the reported figures and the EP-vs-EP=1 checks.

The issue-25 figures come from GPUs (``--real-shapes`` / ``--logits builtin:m3-gpu-small``, NCCL,
one GPU per rank: scripts/run_multigpu.sh); here the same code runs at the tiny MoE, EP=2 and
EP=4 in gloo processes, and the GPU-only options refuse clearly. The EP maths itself is
tests/test_ep_moe.py's; these tests check what the benchmark measures and reports.
"""

import datetime
import math
import sys

import pytest
import torch
from script_loader import script_module  # tests/ on sys.path


@pytest.fixture(scope="module")
def bench():
    # registered under its name, so its rank functions pickle by reference into spawned ranks
    # (which import it from scripts/, on the sys.path the spawn hands them)
    with script_module("bench_ep") as module:
        sys.modules["bench_ep"] = module
        try:
            yield module
        finally:
            del sys.modules["bench_ep"]


def _check_rows(res, tokens, world):
    base = {r["T"]: r for r in res["base"]["rows"]}
    assert sorted(res["ep"]) == list(range(world))
    assert [r["T"] for r in res["ep"][0]["rows"]] == list(tokens)
    for r in res["ep"][0]["rows"]:
        b = base[r["T"]]
        for v in (b["moe_ms"], b["expert_ms"], r["moe_ms"], r["dispatch_ms"], r["expert_ms"], r["combine_ms"]):
            assert math.isfinite(v) and v > 0, r
        # the parts are timed inside the step loop: they cannot add up to more than the step
        assert b["expert_ms"] <= b["moe_ms"] and b["dispatch_ms"] == b["combine_ms"] == 0.0, b
        assert r["dispatch_ms"] + r["expert_ms"] + r["combine_ms"] <= r["moe_ms"], r
    # every (token, slot) pair of every rank is processed once per layer and step, on some rank
    k, layers, steps = 2, 3, 2
    for i, t in enumerate(tokens):
        pairs = sum(res["ep"][rank]["rows"][i]["pairs"] for rank in range(world))
        assert pairs == world * t * k * layers * steps
        assert res["base"]["rows"][i]["pairs"] == t * k * layers * steps


@pytest.mark.parametrize("world, dtype", [(2, "float32"), (4, "bfloat16")])
def test_bench_ep_tiny_world_reports_sane_split_and_matches_ep1(bench, tmp_path, world, dtype):
    out = tmp_path / "ep.md"
    tokens = (1, 24)
    res = bench.main(
        ["--world", str(world), "--tokens", *map(str, tokens), "--steps", "2", "--dtype", dtype, "--write", str(out)]
    )
    _check_rows(res, tokens, world)
    assert res["ok"]
    assert set(res["rel"]) == set(tokens)
    assert all(v <= bench.TOLERANCE[dtype] for v in res["rel"].values()), res["rel"]
    if dtype == "float32":
        assert all(v < 1e-6 for v in res["rel"].values()), res["rel"]
    # every EP rank's rows were compared with EP=1's answers for the same rows
    for t in tokens:
        assert sorted(res["base"]["check"][t]) == list(range(world))
        for rank in range(world):
            shape = res["ep"][rank]["check"][t][rank].shape
            assert shape == (3, min(t, bench.CHECK_ROWS), 128) == res["base"]["check"][t][rank].shape
    text = out.read_text()
    assert f"EP={world} vs EP=1, {datetime.date.today().isoformat()}, " in text
    assert "within tolerance" in text and "NOT within" not in text
    assert text.count(f"\n| {world} | ") == len(tokens) and text.count("\n| 1 | ") == len(tokens)


def test_bench_ep_logits_mode_matches_ep1_on_a_checkpoint(bench, tmp_path):
    from m3_rollout.model import M3ForCausalLM, save_checkpoint, tiny_config

    torch.manual_seed(0)
    cfg = tiny_config()
    model = M3ForCausalLM(cfg).float()
    with torch.no_grad():  # sharper routing, so the top-k choice matters
        for moe in model.moe_layers():
            moe.gate.weight.mul_(8.0)
    save_checkpoint(model, cfg, tmp_path / "ckpt")
    out = tmp_path / "logits.md"
    res = bench.main(
        ["--logits", str(tmp_path / "ckpt"), "--world", "2", "--device", "cpu", "--dtype", "float32"]
        + ["--write", str(out)]
    )
    assert res["ok"]
    assert [res["ranks"][r]["range"] for r in (0, 1)] == [(0, 4), (4, 8)]
    for r in res["ranks"].values():
        assert r["max_diff"] < 1e-5 and r["argmax_agree"] == 1.0 and r["max_logit"] > 0, r
        assert r["tokens"] == 2 * (48 + 16 * r["rank"])
    assert "EP=2 logits vs EP=1" in out.read_text()


def test_bench_ep_gpu_options_refuse_clearly_on_cpu(bench, tmp_path):
    with pytest.raises(SystemExit, match="CUDA GPUs only"):
        bench.main(["--real-shapes", "--device", "cpu", "--no-write"])
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="needs 2 GPUs"):
            bench.main(["--real-shapes", "--no-write"])
        with pytest.raises(SystemExit, match="needs 4 GPUs"):
            bench.main(["--logits", str(tmp_path), "--world", "4", "--no-write"])


def test_bench_ep_real_shapes_memory_estimate_and_refusal(bench):
    cfg = bench.moe_config(True)
    assert (cfg.hidden_size, cfg.num_local_experts, cfg.num_experts_per_tok, cfg.intermediate_size) == (
        6144,
        128,
        4,
        3072,
    )
    need = bench.real_shapes_bytes(cfg, layers=1, world=2, max_tokens=4096)
    experts = 128 * 3 * 6144 * 3072 * 2  # 14.5 GB of bf16 expert weights per layer
    assert experts < need["ep1"] < experts + 8 * 2**30
    assert experts / 2 < need["ep"] < need["ep1"]
    gib = 2**30
    bench.check_fits(need, [139 * gib, 139 * gib], 2)  # two H200s: fits
    with pytest.raises(SystemExit, match=r"GPU 1: 8\.0 GiB free"):
        bench.check_fits(need, [139 * gib, 8 * gib], 2)
    with pytest.raises(SystemExit, match="GPU 0"):  # EP=1 holds all 128 experts on GPU 0
        bench.check_fits(need, [need["ep"] + 4 * gib, 139 * gib], 2)

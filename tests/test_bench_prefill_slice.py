"""scripts/bench_prefill_slice.py on the CPU at tiny sizes: the FLOP count and that the script measures.

The figures that answer issue 23 come from the H200 run at real layer shapes; here the FLOP
counter is checked against a hand count and the whole script runs on tiny_config().
"""

import pytest
import torch
from script_loader import script_module  # tests/ on sys.path


@pytest.fixture(scope="module")
def bench():
    with script_module("bench_prefill_slice") as module:
        yield module


def test_attention_pairs_counts_causal_and_capped_keys(bench):
    assert bench.attention_pairs(5, None) == 1 + 2 + 3 + 4 + 5
    assert bench.attention_pairs(5, 3) == 1 + 2 + 3 + 3 + 3
    assert bench.attention_pairs(3, 8) == 6  # cap above the length: plain causal


def test_sparse_attention_pairs_count_the_own_block_causally(bench):
    """Spec §3.4 / §3.5: K blocks include the own (local) block, whose keys stop at the query, so a
    query at p >= K x B attends (K - 1) x B + p % B + 1 keys, not K x B; below K x B plain causal."""
    for length, k, block in ((5, 2, 2), (37, 3, 4), (64, 4, 16), (100, 4, 16), (4, 4, 16)):
        want = sum(min(p + 1, (k - 1) * block + p % block + 1) for p in range(length))
        assert bench.sparse_attention_pairs(length, k, block) == want, (length, k, block)
    assert bench.sparse_attention_pairs(5, 2, 2) == 1 + 2 + 3 + 3 + 4


def test_prefill_flops_by_hand_on_the_real_slice_shapes(bench):
    """The real slice's config on the meta device: weights per token by hand from the layer shapes,
    and the total of 4 x 32K tokens at 600 TFLOP/s ~0.64 s (the issue's ~0.65 s)."""
    from m3_rollout.model import M3ForCausalLM

    cfg = bench.load_config(str(bench.REAL_SLICE))
    with torch.device("meta"):
        model = M3ForCausalLM(cfg)
    h, nh, g, d = 6144, 64, 4, 128
    attn = h * nh * d * 2 + 2 * h * g * d  # q, o; k, v
    index = h * 4 * 128 + h * 128  # index q (4 heads x 128), index k (one head)
    dense_mlp = 3 * h * 12288
    moe = h * 128 + 3 * h * 3072 + 4 * 3 * h * 3072  # router, shared expert, top-4 of 128 experts
    want = 2 * (3 * attn + 2 * index + dense_mlp + 2 * moe)
    assert bench.weight_flops_per_token(model, cfg) == pytest.approx(want, rel=1e-9)
    flops = bench.prefill_flops(model, cfg, [32768] * 4)
    pairs_dense = 32768 * 32769 // 2
    # from 2048 on: 15 past blocks + the own block's causal keys (240 whole blocks of positions)
    pairs_sparse = 2048 * 2049 // 2 + (32768 - 2048) * 15 * 128 + 240 * (128 * 129 // 2)
    assert flops["attention"] == pytest.approx(4 * 4 * d * nh * (pairs_dense + 2 * pairs_sparse), rel=1e-12)
    assert flops["index scores"] == pytest.approx(4 * 2 * 2 * 128 * 4 * pairs_dense, rel=1e-12)
    assert flops["total"] / 600e12 == pytest.approx(0.644, abs=0.005)


def test_script_runs_on_cpu_and_reports_both_rows(bench, tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "ROOT", tmp_path)  # no docs/ there: a write despite --no-write would fail
    argv = ["--device", "cpu", "--model-json", "", "--prompts", "2", "--prompt-len", "40", "--chunk", "32"]
    lines = bench.main(argv + ["--reps", "1", "--decode-prompt", "8", "--decode-new", "3", "--no-write"])
    rows = [line for line in lines if line.startswith("| prefill") or line.startswith("| decode")]
    assert len(rows) == 2 and "80 tokens" in rows[0] and "tok/s" in rows[0] and "% |" in rows[0]
    assert "x the floor" in rows[1]

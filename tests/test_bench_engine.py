"""scripts/bench_engine.py --batch-invariant on the CPU at tiny sizes: the whole mode runs and prints its table.

On the CPU ``paged_ops_for`` warns and the "invariant" engine runs the fast (PyTorch) ops, so the
figures only show that the script measures and compares; the GPU run is what answers issue 24.
"""

import json
import math

import pytest
from script_loader import script_module  # tests/ on sys.path


@pytest.fixture(scope="module")
def bench():
    with script_module("bench_engine") as module:
        yield module


def cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def number(cell: str) -> float:
    """The first number of a table cell ("1,234 tok/s", "+3.1 %", "0.042 s (6,028 tok/s)")."""
    return float(cell.split()[0].replace(",", ""))


def test_batch_invariant_mode_runs_on_cpu_and_reports_ratios_and_token_checks(bench, tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "ROOT", tmp_path)  # no docs/ there: a write despite --no-write would fail
    out = tmp_path / "inv.json"
    argv = ["--batch-invariant", "--device", "cpu", "--no-write", "--out", str(out)]
    sizes = ["--record-batch", "6", "--invariant-new", "6", "--long-len", "192", "--record-reps", "2"]
    sizes += ["--prefill-reps", "2", "--kv-cache-gb", "2.5"]
    lines = bench.main(argv + sizes)
    assert bench._kv_cache_gb == 2.5  # the run's value (CUDA engines; the CPU ones size their pool themselves)
    assert lines[0].startswith("\n## Batch-invariant mode vs fast mode (bench_engine.py --batch-invariant), ")
    assert "tiny_config()" in lines[1] and "medians of 2 alternated runs" in lines[1]
    assert "(invariant sparse attention: page_partials;" in lines[1]  # the engine's default, no --invariant-sparse
    assert "whole-K GEMMs (K >= 3072) on)" in lines[1]  # invariant_ops.WHOLE_K, named in the section
    rows = {cells(line)[0]: cells(line) for line in lines if line.startswith("| ") and not line.startswith("| case")}
    assert set(rows) == {
        "decode, batch 1, 128 + 6 tokens (eager)",
        "decode, batch 6, 128 + 6 tokens (eager)",
        "prefill 192 tokens in 48-token chunks",
    }
    figures = json.loads(out.read_text())
    assert figures["lines"] == lines and figures["reps"] == 2
    for name, row in rows.items():
        fast, inv, ratio, slowdown, verdict = number(row[1]), number(row[2]), number(row[3]), number(row[4]), row[7]
        assert all(math.isfinite(x) and x > 0 for x in (fast, inv, ratio)), row
        assert math.isfinite(slowdown), row
        if name.startswith("decode"):  # throughputs: ratio invariant / fast, slowdown in time
            fig = figures["b1" if "batch 1," in name else "bN"]
            f, i = fig["tok_s"]
            assert ratio == pytest.approx(i / f, abs=6e-4) and slowdown == pytest.approx(100 * (f / i - 1), abs=0.06)
            steps = [float(s) for s in row[5].removesuffix(" ms").split(" -> ")]
            assert all(s > 0 for s in steps) and steps == pytest.approx(fig["decode_step_ms"], abs=6e-4), row
            step_slow = number(row[6])  # the decode rows are judged on the decode step, not the throughput
            assert step_slow == pytest.approx(100 * (steps[1] / steps[0] - 1), abs=0.2), row
            assert verdict == "- (not invariant here)", row  # the CPU runs the fast ops in both modes
        else:  # seconds
            f, i = figures["prefill"]["seconds"]
            assert ratio == pytest.approx(f / i, abs=6e-4) and slowdown == pytest.approx(100 * (i / f - 1), abs=0.06)
            assert row[5] == row[6] == "-" and verdict == "- (not invariant here)", row
    notes = [line for line in lines if line.startswith("- ")]
    outside = next(n for n in notes if n.startswith("- a decode row's generate call outside its decode steps"))
    for case, label in (("b1", "batch 1 "), ("bN", "batch 6 ")):
        f, i = figures[case]["outside_decode_ms"]
        assert all(math.isfinite(x) and x > 0 for x in (f, i)), figures[case]
        assert f"{label}{f:.1f} / {i:.1f} ms" in outside, outside
    differ = next(n for n in notes if n.startswith("- batch-6 tokens, fast vs invariant"))
    # the CPU runs the same ops in both engines: same seeds give the same tokens
    assert "0 of 36 differ, 6 of 6 sequences identical" in differ
    for mode in ("fast", "invariant"):
        alone = next(n for n in notes if n.startswith(f"- {mode} mode, batch 6 vs each sequence alone"))
        assert "first 4 sequences: " in alone and " of 4 bitwise-equal" in alone
        equal = int(alone.split("first 4 sequences: ")[1].split()[0])
        assert 0 <= equal <= 4
    assert any(
        n.startswith(
            "- NOT batch-invariant here: the engine warned: batch_invariant (policy.generation.batch_invariant"
        )
        for n in notes
    )
    assert figures["batch_tokens_differ"] == 0
    assert all(x > 0 for case in ("b1", "bN") for x in figures[case]["tok_s"])
    assert all(x > 0 for x in figures["prefill"]["seconds"]) and figures["fallback"]
    # the prefill's median is over rounds x --prefill-reps runs per mode, inside its min-max spread
    assert figures["prefill"]["samples"] == 4
    for (lo, hi), med in zip(figures["prefill"]["min_max_s"], figures["prefill"]["seconds"], strict=True):
        assert 0 < lo <= med <= hi
    spread = next(n for n in notes if n.startswith("- prefill: medians of 4 runs per mode (2 rounds x 2)"))
    assert f"{figures['prefill']['min_max_s'][0][0]:.3f}" in spread
    assert set(figures["alone"]) == {"fast", "invariant"} and figures["alone"]["fast"]["compared"] == 4


def test_batch_invariant_mode_refuses_sizes_that_time_no_decode_step(bench, tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "ROOT", tmp_path)
    base = ["--batch-invariant", "--device", "cpu", "--no-write", "--record-batch", "2", "--long-len", "64"]
    for extra in (["--invariant-new", "1"], ["--invariant-prompt", "0"]):
        with pytest.raises(SystemExit, match="needs --invariant-new >= 2 and --invariant-prompt >= 1"):
            bench.main(base + extra)
    with pytest.raises(SystemExit, match=r"needs --prefill-reps >= 1 \(got 0\)"):
        bench.main(base + ["--prefill-reps", "0"])
    for choice in ("union", "page_partials"):  # either named choice needs --batch-invariant
        with pytest.raises(SystemExit, match="--invariant-sparse applies to --batch-invariant runs only"):
            bench.main(["--device", "cpu", "--no-write", "--invariant-sparse", choice])


def test_kv_cache_gb_sizes_cuda_engines_only(bench, monkeypatch):
    made = []
    monkeypatch.setattr(bench, "LLMEngine", lambda model, config: made.append(config))
    monkeypatch.setattr(bench, "_kv_cache_gb", 8.0)
    bench.make_engine(None, [[5, 6, 7]], 1, "cuda", 16)
    bench.make_engine(None, [[5, 6, 7]], 1, "cpu", 16)
    bench.make_engine(None, [[5, 6, 7]], 1, "cuda", 16, kv_cache_memory_gb=1.5)  # a caller's own size wins
    assert [c.kv_cache_memory_gb for c in made] == [8.0, 0.0, 1.5]

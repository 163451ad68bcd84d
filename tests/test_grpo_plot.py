"""scripts/plot_metrics.py: reads the run's metrics.jsonl and writes a PNG of the curves."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import plot_metrics  # noqa: E402


def test_plot_from_log(tmp_path):
    pytest.importorskip("matplotlib")
    log = tmp_path / "logs"
    log.mkdir()
    rows = [
        {"step": 0, "validation/accuracy": 0.25},
        {
            "step": 1,
            "train/reward": 0.3,
            "train/token_mult_prob_error": 1.01,
            "train/gen_kl_error": 1e-3,
            "train/skipped_step": False,
        },
        {"step": 2, "train/reward": 0.4, "train/token_mult_prob_error": 1.02, "train/gen_kl_error": 2e-3},
        {"step": 2, "validation/accuracy": 0.5},
    ]
    (log / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    series = plot_metrics.read_metrics(log)
    assert series["train/reward"] == [(1, 0.3), (2, 0.4)]
    assert series["validation/accuracy"] == [(0, 0.25), (2, 0.5)]
    assert "train/skipped_step" not in series  # booleans are not curves
    old = {"train/reward_mean": [(1, 0.2)], "val/accuracy": [(0, 0.1)]}  # a log written before the renaming
    assert plot_metrics.panel_points(old, plot_metrics.PANELS[0][0]) == [(1, 0.2)]
    assert plot_metrics.panel_points({**old, **series}, plot_metrics.PANELS[1][0]) == [(0, 0.25), (2, 0.5)]
    out = plot_metrics.main([f"run={log}", "-o", str(tmp_path / "c.png")])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        plot_metrics.read_metrics(tmp_path / "nope")


def test_a_missing_run_is_one_error_line_exit_2(tmp_path, capsys):
    # a bad argument exits 2 with one line, as the other commands do (it exited 1)
    with pytest.raises(SystemExit) as exc:
        plot_metrics.main([str(tmp_path / "nope"), "-o", str(tmp_path / "c.png")])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "metrics.jsonl" in err and err.count("\n") == 1
    assert not (tmp_path / "c.png").exists()

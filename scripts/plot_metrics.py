"""Plot reward and train/inference-mismatch curves of GRPO runs from their metrics log to a PNG.

    python scripts/plot_metrics.py outputs/logs [more log dirs or metrics.jsonl ...] [-o curves.png]
    python scripts/plot_metrics.py sync=/tmp/a/logs async=/tmp/b/logs -o compare.png

Each argument is a run: a ``logger.log_dir`` (its ``metrics.jsonl`` is read) or the JSONL file
itself, optionally prefixed with ``label=``. Panels: train reward mean, held-out accuracy,
``token_mult_prob_error`` and ``gen_kl_error`` per step (NeMo RL's names, docs/metrics.md; logs of
runs before the renaming are read under their old names). Needs matplotlib (``pip install
m3-rollout[plot]``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

#: (metric names, the first present is drawn: current, then the name of older logs; panel title)
PANELS = (
    (("train/reward", "train/reward_mean"), "train reward (mean)"),
    (("validation/accuracy", "val/accuracy"), "held-out accuracy"),
    (("train/token_mult_prob_error",), "token_mult_prob_error"),
    (("train/gen_kl_error",), "gen_kl_error"),
)


def read_metrics(path: str | Path) -> dict[str, list[tuple[int, float]]]:
    """{metric: [(step, value), ...]} from a metrics.jsonl (or the log dir holding it).

    Raises:
        FileNotFoundError: no metrics.jsonl there.
    """
    path = Path(path)
    if path.is_dir():
        path = path / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"no metrics log at {path} (expected <logger.log_dir>/metrics.jsonl)")
    series: dict[str, list[tuple[int, float]]] = {}
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        step = int(row.pop("step"))
        for k, v in row.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                series.setdefault(k, []).append((step, float(v)))
    return series


def panel_points(series: dict[str, list[tuple[int, float]]], keys: tuple[str, ...]) -> list[tuple[int, float]]:
    """The points of the first of ``keys`` (a PANELS entry) that ``series`` has, else []."""
    return next((series[k] for k in keys if k in series), [])


def parse_run(arg: str) -> tuple[str, Path]:
    label, sep, path = arg.partition("=")
    return (label, Path(path)) if sep else (Path(arg).name or arg, Path(arg))


def plot_runs(runs: dict[str, dict[str, list[tuple[int, float]]]], out: str | Path, title: str = "") -> Path:
    """Draw the PANELS of every run into one PNG; returns its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(2, 2, figsize=(11, 7), sharex=True)
    for ax, (keys, name) in zip(axes.flat, PANELS):
        for label, series in runs.items():
            pts = panel_points(series, keys)
            if pts:
                ax.plot([s for s, _ in pts], [v for _, v in pts], marker="." if len(pts) < 40 else None, label=label)
        ax.set_title(name)
        ax.grid(alpha=0.3)
        ax.set_xlabel("GRPO step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers, also in short runs
    axes.flat[0].legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="[label=]log_dir or metrics.jsonl")
    ap.add_argument("-o", "--out", default="grpo_curves.png")
    ap.add_argument("--title", default="")
    args = ap.parse_args(argv)
    try:
        runs = {label: read_metrics(path) for label, path in map(parse_run, args.runs)}
    except FileNotFoundError as exc:  # a bad argument: one line, exit 2 (as the other commands)
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    out = plot_runs(runs, args.out, args.title)
    print(f"wrote {out}")
    return out


if __name__ == "__main__":
    main()

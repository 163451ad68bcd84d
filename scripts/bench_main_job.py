"""Time the main job (checkpoint build + GRPO) and report the held-out accuracy gain.

    python scripts/bench_main_job.py [--fresh] [--seeds 42 43 44] [key=value ...]

Runs ``python -m m3_rollout.grpo --config configs/grpo_bf16_ep.yaml`` once per seed in a
subprocess (so the timing includes start-up) and appends a table row per run to
``docs/benchmarks.md`` with machine and date. ``--fresh`` builds the checkpoint in a new cache
directory first, so the build time is measured too. The main job's budgets on 2 CPU cores: build
<= 300 s, GRPO <= 600 s, accuracy gain >= 0.2.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchlib import machine  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fresh", action="store_true", help="build the checkpoint in an empty cache first")
    ap.add_argument("--seeds", type=int, nargs="+", default=[42])
    ap.add_argument("--no-write", action="store_true", help="do not append to docs/benchmarks.md")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    env = dict(os.environ)
    if args.fresh:
        env["M3_ROLLOUT_CACHE"] = tempfile.mkdtemp(prefix="m3cache-")
    rows = []
    for seed in args.seeds:
        log_dir = Path(tempfile.mkdtemp(prefix="m3bench-"))
        cmd = [
            sys.executable,
            "-m",
            "m3_rollout.grpo",
            "--config",
            "configs/grpo_bf16_ep.yaml",
            f"grpo.seed={seed}",
            f"logger.log_dir={log_dir}",
            "logger.wandb.mode=disabled",
            "logger.progress_bar=false",
            f"checkpointing.checkpoint_dir={log_dir / 'ckpt'}",
            *args.overrides,
        ]
        t0 = time.perf_counter()
        subprocess.run(cmd, cwd=ROOT, env=env, check=True)
        wall = time.perf_counter() - t0
        s = json.loads((log_dir / "summary.json").read_text())
        built = bool(s.get("built_now"))
        row = {
            "seed": seed,
            "build_s": s["build_seconds"] if built else None,
            "grpo_s": s["grpo_seconds"],
            "wall_s": round(wall, 1),
            "acc_start": s["accuracy_start"],
            "acc_end": s["accuracy_end"],
            "gain": s.get("accuracy_gain"),
        }
        rows.append(row)
        print(json.dumps(row))
    gains = [r["gain"] for r in rows if r["gain"] is not None]
    print(
        f"accuracy gain: mean {sum(gains) / len(gains):+.3f}, min {min(gains):+.3f}, max {max(gains):+.3f} "
        f"over seeds {args.seeds}"
    )
    if args.no_write:
        return
    doc = ROOT / "docs" / "benchmarks.md"
    if not doc.exists():
        doc.write_text("# Benchmarks\n")
    lines = [
        f"\n## Main job (bench_main_job.py), {datetime.date.today()}, {machine()}\n",
        f"Overrides: {' '.join(args.overrides) or 'none'}. Budget: build <= 300 s, GRPO <= 600 s, gain >= 0.2.\n",
        "| seed | checkpoint build (s) | GRPO loop (s) | wall incl. start-up (s) | held-out acc start | end | gain |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        build = f"{r['build_s']:.0f}" if r["build_s"] is not None else "cached"
        lines.append(
            f"| {r['seed']} | {build} | {r['grpo_s']:.0f} | {r['wall_s']:.0f} | {r['acc_start']:.3f} | "
            f"{r['acc_end']:.3f} | {r['gain']:+.3f} |"
        )
    with doc.open("a") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

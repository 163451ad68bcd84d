"""Metrics to stdout (one line per step) and to Weights & Biases (offline without an API key)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from m3_rollout.config import ConfigError, LoggerConfig


def _kept(line: str, resume_step: int) -> bool:
    """A metrics.jsonl row a run resumed at ``resume_step`` keeps: a step up to it, or no step."""
    try:
        step = json.loads(line).get("step")
    except (ValueError, AttributeError):
        return True  # not ours to judge: kept as it was
    return not isinstance(step, int) or step <= resume_step


class MetricsLogger:
    """Args:
    cfg: ``logger`` section. ``wandb.mode`` "auto" = online iff ``WANDB_API_KEY`` is set;
        ``wandb.entity`` / ``group`` / ``tags`` go to ``wandb.init``.
    run_config: the whole job config (stored with the wandb run).
    write: where step lines go (default: tqdm-safe print).
    resume_run_id: the wandb run id a resumed run's checkpoint recorded (None: a fresh run, or a
        checkpoint without one). With ``wandb.resume`` "allow" / "must" the run continues that
        wandb run (``wandb.init(id=..., resume=...)``); "never" starts a new one.
    resume_step: the step of the checkpoint a resumed run continues from: ``metrics.jsonl`` keeps
        the rows up to it (the interrupted run logged later steps that this run logs again), then
        gets this run's rows appended. None: a fresh run (a fresh log), or no checkpoint found.

    Attributes:
        run_id: the wandb run's id (stored in every checkpoint), None without wandb.

    Raises:
        ConfigError: ``wandb.resume=must`` for a resumed run whose checkpoint names no wandb run.
    """

    def __init__(
        self,
        cfg: LoggerConfig,
        run_config: dict,
        write=print,
        resume_run_id: str | None = None,
        resume_step: int | None = None,
    ):
        self.cfg, self.write = cfg, write
        self.log_dir = Path(cfg.log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        # A fresh run starts a fresh log (a rerun into the same log_dir would otherwise mix two
        # runs' steps); a resumed run appends to the log it continues, cut back to its checkpoint.
        resume = bool(run_config.get("checkpointing", {}).get("resume", False))
        path = self.log_dir / "metrics.jsonl"
        if resume and resume_step is not None and path.is_file():
            path.write_text(
                "".join(line for line in path.read_text().splitlines(keepends=True) if _kept(line, resume_step))
            )
        self._jsonl = open(path, "a" if resume else "w")
        self.run = None
        self.run_id: str | None = None
        w = cfg.wandb
        mode = w.mode
        if cfg.wandb_enabled and mode != "disabled":
            if mode == "auto":
                mode = "online" if os.environ.get("WANDB_API_KEY") else "offline"
            continuing = {}
            if resume and w.resume != "never":
                if resume_run_id is not None:
                    continuing = {"id": resume_run_id, "resume": w.resume}
                elif w.resume == "must":
                    self._jsonl.close()
                    raise ConfigError(
                        "logger.wandb.resume=must: the checkpoint this run resumes from records no wandb run id "
                        "(it was written without wandb); use logger.wandb.resume=allow to start a new wandb run"
                    )
            import wandb

            os.environ.setdefault("WANDB_SILENT", "true")
            self.run = wandb.init(
                project=w.project,
                name=w.name,
                entity=w.entity,
                group=w.group,
                tags=list(w.tags),
                config=run_config,
                mode=mode,
                dir=str(self.log_dir),
                **continuing,
            )
            self.wandb_mode = mode
            self.run_id = self.run.id

    def log(self, metrics: dict, step: int, prefix: str = "") -> None:
        """Record ``metrics`` (numbers) for ``step`` under ``prefix`` (e.g. "train/")."""
        flat = {f"{prefix}{k}": v for k, v in metrics.items() if isinstance(v, (int, float, bool))}
        self._jsonl.write(json.dumps({"step": step, **flat}) + "\n")
        self._jsonl.flush()
        if self.run is not None:
            self.run.log(flat, step=step)

    def text(self, line: str) -> None:
        self.write(line)

    def close(self) -> None:
        self._jsonl.close()
        if self.run is not None:
            self.run.finish()

"""Output directories of a job, checked when it starts.

Governing idea: a run that cannot write its logs, checkpoints or dumps should fail in its first
second, naming the config key, not after its first step (or its last, for the final checkpoint).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from m3_rollout.config import ConfigError, MasterConfig


def writable_dir(path: str | Path, key: str) -> Path:
    """Create ``path`` (and its parents) if needed and check a file can be written in it.

    Raises:
        ConfigError: naming ``key`` and the path, when it cannot be created or written.
    """
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{key}={str(path)!r}: a file, not a directory; give a new or existing directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        raise ConfigError(
            f"{key}={str(path)!r}: cannot write there ({type(exc).__name__}: {exc.strerror or exc}); "
            f"give a writable directory"
        ) from None
    return path


def check_output_dirs(cfg: MasterConfig) -> None:
    """``logger.log_dir``, and ``checkpointing.checkpoint_dir`` / ``rollout_dump.dir`` when
    checkpoints / dumps are on, exist and are writable, and a fresh run's dump directory holds no
    step shards of another run. Raises ConfigError naming the key."""
    writable_dir(cfg.logger.log_dir, "logger.log_dir")
    if cfg.checkpointing.enabled:
        writable_dir(cfg.checkpointing.checkpoint_dir, "checkpointing.checkpoint_dir")
    if cfg.rollout_dump.enabled:
        dump_dir = writable_dir(cfg.rollout_dump.dir, "rollout_dump.dir")
        shards = sorted(dump_dir.glob("step_*.parquet"))
        if shards and not cfg.checkpointing.resume:  # a fresh run would collide with step 1's shard
            raise ConfigError(
                f"rollout_dump.dir={str(dump_dir)!r} already holds {len(shards)} step shards of an earlier run "
                f"({shards[0].name} ...); give a new rollout_dump.dir, delete the old shards, or resume that "
                "run with checkpointing.resume=true"
            )


def empty_dump_dir(path: str | Path, key: str) -> Path:
    """A writable dump directory that is new or empty (``dump generate`` never mixes two runs' shards).

    Raises:
        ConfigError: the directory holds files already, or cannot be written.
    """
    path = Path(path)
    if path.is_dir() and any(path.iterdir()):
        raise ConfigError(
            f"{key}={str(path)!r}: the directory is not empty ({sum(1 for _ in path.iterdir())} entries); "
            f"give a new directory or delete this one"
        )
    return writable_dir(path, key)

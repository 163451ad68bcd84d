"""Write one Parquet shard per dumped GRPO step: atomic, never overwriting, with retention.

Governing idea (design.md §6): a reader must never take a partial file as whole. A shard is
written and fsynced under a hidden temporary name, then renamed to ``step_<step>.parquet``
(``os.replace`` is atomic on one filesystem) and the directory is fsynced. A killed writer can
leave only a hidden ``.tmp-<pid>`` file, which readers skip and the next writer on the directory
removes. A shard that exists is never rewritten: writing the same step again is an error.
Retention deletes whole shards, oldest first.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq

from m3_rollout.dump import schema as S
from m3_rollout.dump.records import StepContext, dumps, table_from_trajectories
from m3_rollout.model.atomic_file import fsync_dir
from m3_rollout.rollout.trajectory import Trajectory

#: Parquet writer settings. Routed experts are already zstd-compressed per row.
ZSTD_LEVEL = 3
# routed_experts and block_selection are compressed per row already (zstd)
_COMPRESSION = {name: ("none" if name in ("routed_experts", "block_selection") else "zstd") for name in S.COLUMN_NAMES}


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass
class RetentionPolicy:
    """Attributes:
    keep_last_n_steps: keep only the newest N shards (0 = keep all).
    max_bytes: delete the oldest shards while the shards' total size exceeds this (0 = no
        limit). The newest shard is always kept, even if it alone is larger.
    """

    keep_last_n_steps: int = 0
    max_bytes: int = 0


class RolloutDumpWriter:
    """Writes step shards into one dump directory.

    Args:
        directory: dump directory (created if missing).
        run_id: id stored in every row and in the file metadata (default: time + random suffix).
        every_n_steps: ``write_step`` writes only steps divisible by this.
        retention: see :class:`RetentionPolicy`.
        decode: token ids -> text, for the prompt/response/turn text columns (None: text left null).
        checkpoint_hash, config_hash: provenance strings stored in every row.
        keep_existing: a step whose shard already exists is skipped (``write_step`` returns
            None) instead of raising; for a resumed run, which repeats the steps after its
            checkpoint that the interrupted run may have dumped already.

    Raises:
        NotADirectoryError: ``directory`` exists and is not a directory.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        run_id: str | None = None,
        every_n_steps: int = 1,
        retention: RetentionPolicy | None = None,
        decode: Callable[[list[int]], str] | None = None,
        checkpoint_hash: str | None = None,
        config_hash: str | None = None,
        keep_existing: bool = False,
    ):
        self.dir = Path(directory)
        if self.dir.exists() and not self.dir.is_dir():
            raise NotADirectoryError(f"rollout_dump.dir={str(self.dir)!r} exists and is not a directory")
        self.dir.mkdir(parents=True, exist_ok=True)
        self.run_id = run_id or time.strftime("%Y%m%d-%H%M%S") + "-" + uuid.uuid4().hex[:6]
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps={every_n_steps}: must be >= 1")
        self.every_n_steps = every_n_steps
        self.retention = retention or RetentionPolicy()
        self.decode = decode
        self.checkpoint_hash = checkpoint_hash
        self.config_hash = config_hash
        self.keep_existing = keep_existing
        self.last_absent: list[str] = []
        self._remove_stale_tmp()

    def _remove_stale_tmp(self) -> None:
        """Delete temporary files left by writers that no longer run (killed mid-write)."""
        for f in self.dir.iterdir():
            if f.name.startswith(".step_") and S.TMP_MARKER in f.name:
                pid = f.name.rsplit(S.TMP_MARKER, 1)[1]
                if pid.isdigit() and not _pid_alive(int(pid)):
                    f.unlink(missing_ok=True)

    def should_write(self, step: int) -> bool:
        return step % self.every_n_steps == 0

    def write_step(
        self,
        step: int,
        trajs: Sequence[Trajectory],
        advantages=None,
        sampling_params: dict | None = None,
        step_metrics: dict | None = None,
    ) -> Path | None:
        """Write step ``step``'s shard if ``should_write(step)``, then apply retention.

        Args:
            step: GRPO step (>= 0).
            trajs: the step's trajectories.
            advantages: [B] (torch / numpy / list) or None.
            sampling_params: JSON-able dict stored in every row.
            step_metrics: the step's logged metrics, stored as JSON in the file metadata.

        Returns:
            The shard path, or None when the step is not dumped (or its shard exists and
            ``keep_existing`` is set).

        Raises:
            FileExistsError: a shard for this step already exists (shards are never rewritten)
                and ``keep_existing`` is not set.
            ValueError: inconsistent trajectories (see ``table_from_trajectories``).
        """
        if not self.should_write(step):
            return None
        final = self.dir / S.shard_name(step)
        if final.exists():
            if self.keep_existing:
                return None
            raise FileExistsError(
                f"{final}: a shard for step {step} already exists and shards are never "
                f"rewritten; use a new rollout_dump.dir for a new run"
            )
        ctx = StepContext(self.run_id, step, sampling_params or {}, self.checkpoint_hash, self.config_hash)
        table, absent = table_from_trajectories(trajs, advantages, ctx, self.decode)
        self.last_absent = absent
        meta = {
            S.META_VERSION: str(S.SCHEMA_VERSION),
            S.META_RUN_ID: self.run_id,
            S.META_STEP: str(step),
            S.META_NUM_ROWS: str(table.num_rows),
            S.META_CREATED: f"{time.time():.3f}",
            S.META_STEP_METRICS: dumps(step_metrics or {}),
            S.META_ABSENT: json.dumps(absent),
        }
        table = table.replace_schema_metadata({k.encode(): v.encode() for k, v in meta.items()})
        # NOTE: not atomic_file.write_atomic: the temporary name must be S.tmp_name's (with the pid
        # last), which _remove_stale_tmp recognises as a killed writer's file.
        tmp = self.dir / S.tmp_name(step, os.getpid())
        try:
            self._write_parquet(table, tmp)
            with open(tmp, "rb") as fh:
                os.fsync(fh.fileno())
            os.replace(tmp, final)
        finally:
            if tmp.exists():
                tmp.unlink()
        fsync_dir(self.dir)
        self.apply_retention()
        return final

    @staticmethod
    def _write_parquet(table, path: Path) -> None:
        pq.write_table(
            table,
            path,
            compression=_COMPRESSION,
            compression_level={k: ZSTD_LEVEL for k, v in _COMPRESSION.items() if v == "zstd"},
        )

    def apply_retention(self) -> list[Path]:
        """Delete the oldest shards beyond ``keep_last_n_steps`` / ``max_bytes``; returns them."""
        shards = sorted((int(m.group(1)), f) for f in self.dir.iterdir() if (m := S.SHARD_PATTERN.match(f.name)))
        files = [f for _, f in shards]
        doomed: list[Path] = []
        n = self.retention.keep_last_n_steps
        if n > 0 and len(files) > n:
            doomed, files = files[:-n], files[-n:]
        if self.retention.max_bytes > 0:
            sizes = [f.stat().st_size for f in files]
            total = sum(sizes)
            while len(files) > 1 and total > self.retention.max_bytes:
                total -= sizes.pop(0)
                doomed.append(files.pop(0))
        for f in doomed:
            f.unlink(missing_ok=True)
        if doomed:
            fsync_dir(self.dir)
        return doomed


def writer_from_config(
    cfg, model_dir=None, decode: Callable[[list[int]], str] | None = None, run_id: str | None = None
) -> RolloutDumpWriter | None:
    """The GRPO loop's dump writer from ``cfg.rollout_dump`` (None when disabled).

    Args:
        cfg: a ``MasterConfig``.
        model_dir: checkpoint directory the run starts from (hashed for ``checkpoint_hash``).
        decode: the chat format's ``decode``.
    """
    d = cfg.rollout_dump
    if not d.enabled:
        return None
    from m3_rollout.config import to_dict
    from m3_rollout.dump.records import checkpoint_hash, config_hash

    return RolloutDumpWriter(
        d.dir,
        run_id=run_id or f"{cfg.logger.wandb.name}-" + time.strftime("%Y%m%d-%H%M%S") + "-" + uuid.uuid4().hex[:6],
        every_n_steps=d.every_n_steps,
        retention=RetentionPolicy(d.keep_last_n_steps, d.max_bytes),
        decode=decode,
        checkpoint_hash=checkpoint_hash(model_dir) if model_dir else None,
        config_hash=config_hash(to_dict(cfg)),
        keep_existing=cfg.checkpointing.resume,
    )


def sampling_params_of(settings, step_seed: int | None = None) -> dict:
    """JSON-able sampling params of a ``RolloutSettings`` (the ``sampling_params`` column)."""
    params = dict(vars(settings))
    if step_seed is not None:
        params["seed"] = step_seed
    return params

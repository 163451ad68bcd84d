"""Read a dump directory: list complete shards, load them, report bad files without stopping.

Governing idea: one bad shard (truncated, foreign, another schema version) costs only that
shard. :func:`read_dump` returns the rows of every good shard plus a :class:`DumpFileError` per
bad one, each naming the file and what to do; callers print the errors and go on.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from m3_rollout.dump import schema as S
from m3_rollout.dump.row_checks import row_problems, summary


class DumpError(Exception):
    """Base class of dump reading errors."""


class DumpDirError(DumpError):
    """The dump directory is missing or holds no rollout dump shards."""


class DumpFileError(DumpError):
    """One shard cannot be used; ``path`` names it."""

    def __init__(self, path: Path, reason: str):
        self.path = Path(path)
        self.reason = reason
        super().__init__(f"{self.path}: {reason}")


class SchemaVersionError(DumpFileError):
    """A shard of another schema version."""


@dataclass
class ShardInfo:
    """A complete shard's file and its metadata (``m3_rollout.dump.*`` keys, decoded)."""

    path: Path
    step: int
    run_id: str
    num_rows: int
    size_bytes: int
    step_metrics: dict = field(default_factory=dict)
    absent_fields: list[str] = field(default_factory=list)


def shard_paths(directory: str | Path) -> list[Path]:
    """Complete shards of a dump directory in step order (temporary files are skipped).

    Raises:
        DumpDirError: the directory does not exist, is not a directory, or holds no
            ``step_<8 digits>.parquet`` file (a foreign directory).
    """
    d = Path(directory)
    if not d.exists():
        raise DumpDirError(
            f"{d}: dump directory does not exist. Dumps are written by the GRPO job run with "
            "rollout_dump.enabled=true (into rollout_dump.dir, default <logger.log_dir>/rollout_dumps), or without "
            "training by `python -m m3_rollout.dump generate --config CONFIG --dir DIR --steps N`"
        )
    if not d.is_dir():
        raise DumpDirError(f"{d}: not a directory; give the dump directory holding step_*.parquet shards")
    shards = sorted((f for f in d.iterdir() if S.SHARD_PATTERN.match(f.name)), key=lambda f: f.name)
    if not shards:
        hint = (
            " (only temporary files of an interrupted write)"
            if any(S.TMP_MARKER in f.name for f in d.iterdir())
            else ""
        )
        raise DumpDirError(f"{d}: no rollout dump shards (step_XXXXXXXX.parquet){hint}; is this a rollout_dump.dir?")
    return shards


def _metadata(path: Path) -> dict[str, str]:
    try:
        meta = pq.read_schema(path).metadata or {}
    except (pa.ArrowInvalid, pa.ArrowIOError, OSError) as exc:
        raise DumpFileError(
            path,
            f"not a readable Parquet file, probably truncated or corrupt ({exc}); "
            f"delete it or restore it, the other shards still load",
        ) from None
    meta = {k.decode(errors="replace"): v.decode(errors="replace") for k, v in meta.items()}
    if S.META_VERSION not in meta:
        raise DumpFileError(path, f"Parquet file without {S.META_VERSION!r} metadata: not a rollout dump shard")
    if meta[S.META_VERSION] not in {str(v) for v in S.READABLE_VERSIONS}:
        raise SchemaVersionError(
            path,
            f"schema version {meta[S.META_VERSION]}, this reader reads versions "
            f"{', '.join(map(str, S.READABLE_VERSIONS))}; read it with the m3_rollout release that wrote it",
        )
    return meta


def _added_since(version: int) -> list[str]:
    """Columns a shard of ``version`` lacks (added by later versions)."""
    return [c for v, cols in S.ADDED_COLUMNS.items() if v > version for c in cols]


def shard_info(path: str | Path) -> ShardInfo:
    """Metadata of one shard (reads only the footer).

    Raises:
        DumpFileError: unreadable / truncated file or not a dump shard.
        SchemaVersionError: another schema version.
    """
    path = Path(path)
    meta = _metadata(path)
    try:
        return ShardInfo(
            path=path,
            step=int(meta[S.META_STEP]),
            run_id=meta[S.META_RUN_ID],
            num_rows=int(meta[S.META_NUM_ROWS]),
            size_bytes=path.stat().st_size,
            step_metrics=json.loads(meta.get(S.META_STEP_METRICS, "{}")),
            absent_fields=json.loads(meta.get(S.META_ABSENT, "[]")),
        )
    except KeyError as exc:
        raise DumpFileError(path, f"metadata lacks {exc.args[0]!r}: not a complete rollout dump shard") from None
    except ValueError as exc:
        raise DumpFileError(path, f"metadata is malformed ({exc}): not a valid rollout dump shard") from None


def read_shard(path: str | Path, columns: Iterable[str] | None = None) -> pa.Table:
    """Load one shard, checking its version and columns.

    Raises:
        DumpFileError, SchemaVersionError: as :func:`shard_info`; also a missing column, a row
            count or step that disagrees with the metadata, or rows that do not hold together
            (``row_checks``: lengths, indices, JSON cells).
    """
    path = Path(path)
    meta = _metadata(path)
    version = int(meta[S.META_VERSION])
    want = list(columns) if columns is not None else S.COLUMN_NAMES
    later = set(_added_since(version))
    try:
        table = pq.read_table(path, columns=None if columns is None else [c for c in want if c not in later])
    except (pa.ArrowInvalid, pa.ArrowIOError, OSError, KeyError) as exc:
        raise DumpFileError(path, f"cannot read its data ({exc}); the file is corrupt or truncated") from None
    for c in _added_since(version):  # an older shard: the columns it predates are null
        if c in want and c not in table.column_names:
            table = table.append_column(S.SCHEMA.field(c), pa.nulls(table.num_rows, S.SCHEMA.field(c).type))
    missing = [c for c in want if c not in table.column_names]
    if missing:
        raise DumpFileError(path, f"missing columns {missing} for schema version {version}")
    if table.num_rows != int(meta.get(S.META_NUM_ROWS, -1)):
        raise DumpFileError(path, f"{table.num_rows} rows but the metadata says {meta[S.META_NUM_ROWS]}")
    step = int(meta[S.META_STEP])
    named = S.SHARD_PATTERN.match(path.name)
    if named is not None and int(named.group(1)) != step:
        raise DumpFileError(path, f"its metadata says step {step}, its name another step: a renamed or copied shard")
    try:
        problems = row_problems(table, step)
    except (TypeError, ValueError, pa.ArrowException) as exc:  # a cell of another type than the schema's
        raise DumpFileError(path, f"rows cannot be checked ({exc}); the shard was edited or damaged") from None
    if problems:
        raise DumpFileError(path, f"rows do not hold together ({summary(problems)}); the shard was edited or damaged")
    return table


@dataclass
class DumpRead:
    """Result of :func:`read_dump`.

    Attributes:
        table: rows of every good shard (schema :data:`SCHEMA`), in step order.
        shards: metadata of the good shards.
        errors: one per bad shard; the rows of those shards are not in ``table``.
    """

    table: pa.Table
    shards: list[ShardInfo]
    errors: list[DumpFileError]


def _steps_text(steps: list[int], limit: int = 20) -> str:
    """``[2, 4, 6]``, or the first and last ``limit // 2`` steps around "..." for a long list."""
    steps = sorted(steps)
    if len(steps) <= limit:
        return str(steps)
    half = limit // 2
    head, tail = ", ".join(map(str, steps[:half])), ", ".join(map(str, steps[-half:]))
    return f"[{head}, ..., {tail}] ({len(steps)} shards)"


def read_dump(
    directory: str | Path, steps: Iterable[int] | None = None, columns: Iterable[str] | None = None
) -> DumpRead:
    """Load the shards of ``directory`` (optionally only ``steps``), skipping bad ones.

    Raises:
        DumpDirError: see :func:`shard_paths`; also when every shard is bad or no shard has a
            requested step.
    """
    wanted = None if steps is None else set(int(s) for s in steps)
    tables, infos, errors, present = [], [], [], []
    for path in shard_paths(directory):
        step = int(S.SHARD_PATTERN.match(path.name).group(1))
        present.append(step)
        if wanted is not None and step not in wanted:
            continue
        try:
            info = shard_info(path)
            tables.append(read_shard(path, columns))
            infos.append(info)
        except DumpFileError as exc:
            errors.append(exc)
    if not tables:
        if errors:
            raise DumpDirError(f"{directory}: no usable shard:\n  " + "\n  ".join(str(e) for e in errors))
        raise DumpDirError(
            f"{directory}: no shard for steps {sorted(wanted or [])}; its shards are of steps {_steps_text(present)}"
        )
    schema = S.SCHEMA if columns is None else pa.schema([S.SCHEMA.field(c) for c in columns])
    table = pa.concat_tables([t.select(schema.names).cast(schema).replace_schema_metadata(None) for t in tables])
    return DumpRead(table, infos, errors)

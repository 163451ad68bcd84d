"""Offline rollout dumps (design.md §2 step 7, §6): Parquet shards of GRPO trajectories.

schema    the versioned Arrow schema (one row per trajectory) and file naming
records   Trajectory <-> row conversion, routed-experts codec, block-selection placement, provenance hashes
writer    atomic, never-overwriting shard writer with retention; the GRPO loop's hook
reader    shard listing and loading; bad shards reported by file, the rest still load
report    ``inspect`` (per-step table) and ``show`` (one group by turn)
replay    re-scoring statistics: stored rollout logprobs against a scorer's

The jobs on a dump (generate without training, scorers, offline GRPO) and the CLI
``python -m m3_rollout.dump {generate,inspect,show,replay} ...`` are in ``m3_rollout.jobs``.
"""

from m3_rollout.dump.reader import (
    DumpDirError,
    DumpError,
    DumpFileError,
    DumpRead,
    SchemaVersionError,
    ShardInfo,
    read_dump,
    read_shard,
    shard_info,
    shard_paths,
)
from m3_rollout.dump.records import (
    StepContext,
    decode_routed_experts,
    encode_routed_experts,
    table_from_trajectories,
    trajectories_from_rows,
    trajectory_from_row,
)
from m3_rollout.dump.schema import SCHEMA, SCHEMA_VERSION
from m3_rollout.dump.writer import RetentionPolicy, RolloutDumpWriter, writer_from_config

__all__ = [
    "SCHEMA",
    "SCHEMA_VERSION",
    "StepContext",
    "RolloutDumpWriter",
    "RetentionPolicy",
    "writer_from_config",
    "read_dump",
    "read_shard",
    "shard_info",
    "shard_paths",
    "DumpRead",
    "ShardInfo",
    "DumpError",
    "DumpDirError",
    "DumpFileError",
    "SchemaVersionError",
    "table_from_trajectories",
    "trajectory_from_row",
    "trajectories_from_rows",
    "encode_routed_experts",
    "decode_routed_experts",
]

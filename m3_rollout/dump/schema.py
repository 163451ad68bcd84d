"""The rollout dump's on-disk schema (version 2): one Parquet row per trajectory.

Governing idea: this module is the single source of the schema. The Arrow schema below fixes
every column's type; ``docs/rollout_dump_schema.md`` explains each column for readers that do not
import this package (pandas, pyarrow, ``datasets``). A change to a column's name, type or meaning
bumps :data:`SCHEMA_VERSION`; readers refuse shards of another version with an error naming the
file, except the older versions in :data:`READABLE_VERSIONS`, whose missing columns
(:data:`ADDED_COLUMNS`) read as nulls.

Shard layout: ``<dump dir>/step_<step:08d>.parquet``, written under a hidden temporary name
(``.step_<step:08d>.parquet.tmp-<pid>``) and renamed, so a name matching :data:`SHARD_PATTERN`
is always a complete file. File-level key/value metadata (``m3_rollout.dump.*``) carries the
schema version, the run id, the step and the step's metrics as JSON.
"""

from __future__ import annotations

import re

import pyarrow as pa

SCHEMA_VERSION = 2

#: File-metadata keys (bytes in Parquet; values are UTF-8 strings, JSON where noted).
META_VERSION = "m3_rollout.dump.schema_version"
META_RUN_ID = "m3_rollout.dump.run_id"
META_STEP = "m3_rollout.dump.step"
META_NUM_ROWS = "m3_rollout.dump.num_rows"
META_CREATED = "m3_rollout.dump.created_unix_s"
META_STEP_METRICS = "m3_rollout.dump.step_metrics"  # JSON object (the GRPO step's logged metrics)
META_ABSENT = "m3_rollout.dump.absent_fields"  # JSON list of columns left null: the producer lacked them

SHARD_PATTERN = re.compile(r"^step_(\d{8})\.parquet$")
TMP_MARKER = ".tmp-"


def shard_name(step: int) -> str:
    """File name of step ``step``'s shard."""
    return f"step_{step:08d}.parquet"


def tmp_name(step: int, pid: int) -> str:
    """Hidden temporary name a shard is written under before the rename (never matches
    :data:`SHARD_PATTERN`)."""
    return f".{shard_name(step)}{TMP_MARKER}{pid}"


#: (column, Arrow type, nullable, meaning). ``L`` = the trajectory's total tokens, ``T`` = its
#: number of model turns.
COLUMNS: list[tuple[str, pa.DataType, bool, str]] = [
    ("run_id", pa.string(), False, "id of the run that produced the row"),
    ("step", pa.int64(), False, "GRPO step (1-based)"),
    ("group_id", pa.int32(), False, "prompt index within the step (GRPO group)"),
    ("sample_index", pa.int32(), False, "sample index within the group"),
    ("prompt_len", pa.int32(), False, "number of prompt tokens at the start of token_ids"),
    ("prompt_text", pa.string(), True, "decoded prompt tokens"),
    ("response_text", pa.string(), True, "decoded tokens after the prompt (model and tool turns)"),
    ("reasoning_text", pa.string(), True, "reasoning of the model turns joined by a blank line; null: none"),
    ("token_ids", pa.list_(pa.int32()), False, "[L] prompt, model-turn and tool-turn tokens"),
    ("loss_mask", pa.list_(pa.int8()), False, "[L] 1 on sampled tokens, 0 elsewhere"),
    (
        "rollout_logprobs",
        pa.list_(pa.float64()),
        False,
        "[L] sampling-distribution logprob of each sampled token, 0 elsewhere",
    ),
    ("weight_versions", pa.list_(pa.int64()), False, "[L] weight version per token, -1 if not sampled"),
    ("turn_token_start", pa.list_(pa.int32()), False, "[T] first token index of each model turn"),
    ("turn_token_end", pa.list_(pa.int32()), False, "[T] one past the last token of each model turn"),
    ("turn_texts", pa.list_(pa.string()), False, "[T] decoded text of each model turn (stop token excluded)"),
    (
        "tool_turn_texts",
        pa.list_(pa.string()),
        True,
        "[T] decoded tokens after each model turn up to the next one (the tool turn as the model saw it)",
    ),
    # Per-turn records (Trajectory.turns); null when the producer has none.
    ("turn_finish_reasons", pa.list_(pa.string()), True, "[T] the engine's finish reason of each turn"),
    ("turn_stop_sampled", pa.list_(pa.bool_()), True, "[T] the turn's stop token was sampled (in the span)"),
    ("turn_truncated", pa.list_(pa.bool_()), True, "[T] the turn ended by a length limit"),
    ("turn_masked", pa.list_(pa.bool_()), True, "[T] the turn's tokens were taken out of the loss"),
    ("turn_reasoning", pa.list_(pa.string()), True, "[T] reasoning (think span) of each turn; null item: none"),
    ("turn_content", pa.list_(pa.string()), True, "[T] answer text outside the tool-call block; null item: none"),
    (
        "turn_tool_calls",
        pa.list_(pa.string()),
        True,
        "[T] JSON list of each turn's parsed calls: {id, name, arguments, type, truncated, error}",
    ),
    ("turn_parse_truncated", pa.list_(pa.bool_()), True, "[T] the turn's text ended inside a tool call"),
    ("turn_parse_errors", pa.list_(pa.string()), True, "[T] first malformed-XML fault of the turn; null item: none"),
    ("turn_tool_results", pa.list_(pa.list_(pa.string())), True, "[T][*] tool observations shown after each turn"),
    (
        "turn_bridge_len",
        pa.list_(pa.int32()),
        True,
        "[T] tokens appended after each turn (tool turn + next generation prompt), mask 0",
    ),
    ("tool_calls", pa.string(), False, "JSON list of parsed tool calls in order"),
    ("finish_reason", pa.string(), False, "stop | length | max_turns | error | ..."),
    ("reward", pa.float64(), False, "environment reward"),
    ("advantage", pa.float64(), True, "GRPO advantage used for training"),
    ("env_info", pa.string(), False, "JSON object of the environment's info"),
    ("timings", pa.string(), True, "JSON object of per-trajectory timings (seconds)"),
    ("sampling_params", pa.string(), False, "JSON object: temperature, top_p, top_k, seed, ..."),
    ("checkpoint_hash", pa.string(), True, "hash of the checkpoint the run started from"),
    ("config_hash", pa.string(), True, "sha256 of the run's config as sorted JSON"),
    (
        "routed_experts",
        pa.binary(),
        True,
        "zstd-compressed little-endian int16 array [L, n_moe_layers, top_k] of routed expert ids",
    ),
    ("routed_experts_shape", pa.list_(pa.int32()), True, "shape of routed_experts: [L, n_moe_layers, top_k]"),
    (
        "block_selection",
        pa.list_(pa.binary()),
        True,
        "coded block-selection segments this row stores (KV blocks per token, sparse layer and KV head)",
    ),
    (
        "block_selection_index",
        pa.list_(pa.list_(pa.int32())),
        True,
        "the row's block-selection record in position order: [sample_index, k] = item k of block_selection "
        "of this step's row of the same group with that sample_index",
    ),
    ("extra_fields", pa.string(), True, "JSON object of Trajectory fields this schema has no column for"),
]

#: Versions this reader reads, and the (nullable) columns each version added: an older shard gets them as nulls.
READABLE_VERSIONS = (1, 2)
ADDED_COLUMNS = {2: ("block_selection", "block_selection_index")}

SCHEMA = pa.schema([pa.field(name, typ, nullable=nullable) for name, typ, nullable, _ in COLUMNS])
COLUMN_NAMES = [c[0] for c in COLUMNS]

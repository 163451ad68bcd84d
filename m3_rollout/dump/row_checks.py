"""Row consistency of a loaded shard: lengths, indices and JSON cells that must agree.

Governing idea: a shard that Parquet reads can still be wrong (edited by hand, written by another
tool, a file copied under another step's name). Readers then miscount silently ("gen tok" from a
cut ``loss_mask``) or crash on one cell (a truncated JSON string). :func:`row_problems` lists what
does not hold together, so :func:`m3_rollout.dump.reader.read_shard` can refuse the shard by name,
as it refuses a truncated file, and the other shards are still used.

Checked on the columns the table has (``L`` = ``len(token_ids)``, ``T`` = model turns):
- no null in a column the schema says is never null (then nothing else is checked);
- ``step`` equals the shard's metadata step;
- ``loss_mask``, ``rollout_logprobs``, ``weight_versions`` have ``L`` entries;
- ``0 <= prompt_len <= L``; ``turn_token_start`` / ``turn_token_end`` have one entry per turn,
  with ``prompt_len <= start <= end <= L``;
- ``routed_experts_shape`` (when set) is ``[L, layers, top_k]``;
- the JSON cells parse to their kind: ``tool_calls`` a list; ``env_info``, ``sampling_params``
  objects; ``timings`` / ``extra_fields`` objects or null; ``turn_tool_calls`` items lists.
"""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.compute as pc

from m3_rollout.dump import schema as S

_PER_TOKEN = ("loss_mask", "rollout_logprobs", "weight_versions")
_JSON_KINDS = {  # column -> (type, nullable)
    "tool_calls": (list, False),
    "env_info": (dict, False),
    "sampling_params": (dict, False),
    "timings": (dict, True),
    "extra_fields": (dict, True),
}
_REQUIRED = [f.name for f in S.SCHEMA if not f.nullable]  # columns the schema says are never null
MAX_LISTED = 3  # problems named in one error; the count says how many more


def _lengths(table: pa.Table, column: str) -> list[int | None]:
    return pc.list_value_length(table.column(column)).to_pylist()


def _json_problem(text: str | None, kind: type, nullable: bool) -> str | None:
    if text is None:
        return None if nullable else "is null"
    try:
        value = json.loads(text)
    except ValueError as exc:
        return f"is not valid JSON ({exc})"
    if value is None and nullable:
        return None
    if not isinstance(value, kind):
        return f"is JSON {type(value).__name__}, not {'a list' if kind is list else 'an object'}"
    return None


def row_problems(table: pa.Table, step: int) -> list[str]:
    """What does not hold together in ``table`` (a shard's rows, any subset of the schema's
    columns) for a shard of metadata step ``step``; [] when consistent. Each problem names the
    row (index, group, sample) and the columns."""
    names = set(table.column_names)
    n = table.num_rows
    nulls = [
        f"{c} is null in {table.column(c).null_count} row(s)"
        for c in _REQUIRED
        if c in names and table.column(c).null_count
    ]
    if nulls:  # the checks below read these cells
        return nulls
    col = {c: table.column(c).to_pylist() for c in ("group_id", "sample_index", "step", "prompt_len") if c in names}

    def where(i: int) -> str:
        who = [f"group {col['group_id'][i]}" if "group_id" in col else None]
        who.append(f"sample {col['sample_index'][i]}" if "sample_index" in col else None)
        return f"row {i} (" + ", ".join(w for w in who if w) + ")" if any(who) else f"row {i}"

    out: list[str] = []
    for i, s in enumerate(col.get("step", [])):
        if s != step:
            out.append(f"{where(i)}: step {s}, but the shard's metadata says step {step}")
    total = _lengths(table, "token_ids") if "token_ids" in names else None
    if total is not None:
        for c in _PER_TOKEN:
            for i, m in enumerate(_lengths(table, c) if c in names else []):
                if m != total[i]:
                    out.append(f"{where(i)}: {c} has {m} entries, token_ids {total[i]}")
        for i, p in enumerate(col.get("prompt_len", [])):
            if not 0 <= p <= total[i]:
                out.append(f"{where(i)}: prompt_len {p} outside [0, {total[i]}] (token_ids)")
        if {"turn_token_start", "turn_token_end"} <= names:
            starts = table.column("turn_token_start").to_pylist()
            ends = table.column("turn_token_end").to_pylist()
            for i in range(n):
                lo = col["prompt_len"][i] if "prompt_len" in col else 0
                if len(starts[i]) != len(ends[i]):
                    out.append(f"{where(i)}: {len(starts[i])} turn_token_start but {len(ends[i])} turn_token_end")
                elif any(not lo <= a <= b <= total[i] for a, b in zip(starts[i], ends[i])):
                    out.append(f"{where(i)}: a turn span outside [prompt_len {lo}, token_ids {total[i]}]")
        if "routed_experts_shape" in names:
            for i, shape in enumerate(table.column("routed_experts_shape").to_pylist()):
                if shape is not None and (len(shape) != 3 or shape[0] != total[i] or min(shape) < 0):
                    out.append(
                        f"{where(i)}: routed_experts_shape {shape} is not [{total[i]} (token_ids), layers, top_k]"
                    )
    for c, (kind, nullable) in _JSON_KINDS.items():
        if c in names:
            for i, text in enumerate(table.column(c).to_pylist()):
                if (why := _json_problem(text, kind, nullable)) is not None:
                    out.append(f"{where(i)}: {c} {why}")
    if "turn_tool_calls" in names:
        for i, items in enumerate(table.column("turn_tool_calls").to_pylist()):
            for k, text in enumerate(items or []):
                if text is not None and (why := _json_problem(text, list, False)) is not None:
                    out.append(f"{where(i)}: turn_tool_calls[{k}] {why}")
    return out


def summary(problems: list[str]) -> str:
    """The first :data:`MAX_LISTED` problems and how many more, for one error line."""
    more = len(problems) - MAX_LISTED
    return "; ".join(problems[:MAX_LISTED]) + (f"; and {more} more" if more > 0 else "")

"""Trajectory <-> dump row conversion, the routed-experts codec, block-selection placement.

Governing idea: the dump stores a ``Trajectory`` losslessly. Fields with a column are written
there (typed lists for the per-token arrays, per-turn lists, JSON text for free-form dicts); a
dataclass field this schema has no column for goes into ``extra_fields`` (JSON) so it still
round-trips. Optional fields the producer's ``Trajectory`` does not have yet are written as null
and reported by :func:`table_from_trajectories` as absent.

Block-selection records (``Trajectory.block_selection``) are stored as their coded segments
(``m3_rollout.model.selection_record``), each ONCE per step and group: a segment the group's
samples share (their prompt's) sits in the first row that holds it and the others point at it
(``block_selection_index``), so rebuilding a row's record needs its group's rows:
:func:`trajectories_from_rows`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from m3_rollout.dump.schema import SCHEMA
from m3_rollout.model.selection_record import SelectionRecord, SelectionSegment
from m3_rollout.rollout.trajectory import Trajectory

#: Trajectory attributes stored in typed columns.
CORE_FIELDS = (
    "group_index",
    "sample_index",
    "token_ids",
    "loss_mask",
    "rollout_logprobs",
    "weight_version",
    "prompt_len",
    "finish_reason",
    "tool_calls",
    "reward",
    "texts",
    "info",
    "turns",
)

#: Optional column -> Trajectory attribute it is read from; a Trajectory without the attribute
#: gets a null and the column is listed as absent.
OPTIONAL_FIELDS = {"timings": "timings", "routed_experts": "routed_experts", "block_selection": "block_selection"}

INT16_MAX = np.iinfo(np.int16).max


@dataclass
class StepContext:
    """Values shared by every row of one step's shard.

    Attributes:
        run_id: id of the producing run.
        step: GRPO step.
        sampling_params: JSON-able dict (temperature, top_p, top_k, seed, max_new_tokens, ...).
        checkpoint_hash, config_hash: provenance (see :func:`config_hash`, :func:`checkpoint_hash`).
    """

    run_id: str
    step: int
    sampling_params: dict
    checkpoint_hash: str | None = None
    config_hash: str | None = None


def to_jsonable(value: Any) -> Any:
    """``json.dumps`` default hook: numpy / torch scalars and arrays, dataclasses, sets; any
    other object becomes its ``repr`` (a plug-in's odd info value must not stop a run's dump;
    that value then reads back as a string)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if isinstance(value, np.generic):
        return value.item()
    if hasattr(value, "tolist"):  # numpy arrays, torch tensors
        return value.tolist()
    if isinstance(value, (set, frozenset)):
        return sorted(value, key=repr)
    return repr(value)


def dumps(value: Any, sort_keys: bool = False) -> str:
    """JSON text of ``value`` (dict key order kept unless ``sort_keys``)."""
    return json.dumps(value, default=to_jsonable, sort_keys=sort_keys)


def config_hash(config: dict) -> str:
    """sha256 of a config dict as sorted JSON (``sha256:<hex16>``)."""
    return "sha256:" + hashlib.sha256(dumps(config, sort_keys=True).encode()).hexdigest()[:16]


def checkpoint_hash(path, full_bytes_limit: int = 1 << 30) -> str:
    """Hash of a checkpoint directory: config.json and every ``*.safetensors`` file.

    Files are hashed in full while the total is under ``full_bytes_limit`` (``sha256:``); larger
    checkpoints hash only names, sizes and safetensors headers (``sha256-headers:``), which still
    changes with any shape or dtype change but not with a value change.
    """
    from pathlib import Path

    root = Path(path)
    files = sorted([root / "config.json"] + sorted(root.glob("*.safetensors")))
    files = [f for f in files if f.is_file()]
    full = sum(f.stat().st_size for f in files) <= full_bytes_limit
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode())
        with open(f, "rb") as fh:
            if full:
                for chunk in iter(lambda: fh.read(1 << 20), b""):
                    h.update(chunk)
            else:
                h.update(str(f.stat().st_size).encode())
                head = fh.read(8)
                h.update(head)
                if f.suffix == ".safetensors" and len(head) == 8:
                    h.update(fh.read(int.from_bytes(head, "little")))
    return ("sha256:" if full else "sha256-headers:") + h.hexdigest()[:16]


# ---------------------------------------------------------------------------- routed experts
def encode_routed_experts(experts: Any, num_tokens: int) -> tuple[bytes, list[int]]:
    """Compress a routing record.

    Args:
        experts: int array-like [L, n_moe_layers, top_k] of global expert ids (numpy, torch or
            nested lists); -1 allowed as padding.
        num_tokens: L of the trajectory (the record must cover every token, design.md §2).

    Returns:
        (zstd-compressed little-endian int16 bytes, [L, n_moe_layers, top_k]).

    Raises:
        ValueError: wrong rank, wrong length, or ids outside [-1, 32767].
    """
    arr = np.asarray(experts.cpu() if hasattr(experts, "cpu") else experts)
    if arr.ndim != 3 or arr.shape[0] != num_tokens:
        raise ValueError(f"routed_experts has shape {arr.shape}; expected [L={num_tokens}, n_moe_layers, top_k]")
    if arr.size and (arr.min() < -1 or arr.max() > INT16_MAX):
        raise ValueError(f"routed_experts ids must lie in [-1, {INT16_MAX}], got [{arr.min()}, {arr.max()}]")
    raw = np.ascontiguousarray(arr, dtype="<i2").tobytes()
    return pa.compress(raw, codec="zstd", asbytes=True), [int(s) for s in arr.shape]


def decode_routed_experts(blob: bytes, shape: Sequence[int]) -> np.ndarray:
    """Inverse of :func:`encode_routed_experts`: int16 array of ``shape``."""
    size = int(np.prod(shape)) * 2
    raw = pa.decompress(blob, decompressed_size=size, codec="zstd", asbytes=True)
    return np.frombuffer(raw, dtype="<i2").reshape(tuple(shape)).astype(np.int16)


# ---------------------------------------------------------------------------- rows
def _tool_turn_texts(t: Trajectory, decode: Callable[[list[int]], str] | None) -> list[str] | None:
    """Decoded non-generated span after each model turn (empty string when none)."""
    if decode is None:
        return None
    ends = [e for _, e in t.turn_spans]
    nexts = [s for s, _ in t.turn_spans[1:]] + [len(t.token_ids)]
    return [decode(list(t.token_ids[e:n])) if n > e else "" for e, n in zip(ends, nexts)]


def _turn_columns(t: Trajectory) -> dict:
    """The ``turn_*`` record columns of ``t.turns``.

    Raises:
        ValueError: a turn whose bridge is not the tokens right after it (a producer bug: the row
            could not be restored).
    """
    turns = t.turns
    for r in turns:
        if list(t.token_ids[r.end : r.end + len(r.bridge)]) != list(r.bridge):
            raise ValueError(
                f"trajectory (group {t.group_index}, sample {t.sample_index}): the bridge of the "
                f"turn at {r.start}..{r.end} is not the tokens that follow it"
            )
    return {
        "turn_finish_reasons": [r.finish_reason for r in turns],
        "turn_stop_sampled": [bool(r.stop_sampled) for r in turns],
        "turn_truncated": [bool(r.truncated) for r in turns],
        "turn_masked": [bool(r.masked) for r in turns],
        "turn_reasoning": [r.parsed.reasoning for r in turns],
        "turn_content": [r.parsed.content for r in turns],
        "turn_tool_calls": [dumps(list(r.parsed.tool_calls)) for r in turns],
        "turn_parse_truncated": [bool(r.parsed.truncated) for r in turns],
        "turn_parse_errors": [r.parsed.error for r in turns],
        "turn_tool_results": [[str(o) for o in r.observations] for r in turns],
        "turn_bridge_len": [len(r.bridge) for r in turns],
    }


def selection_columns(trajs: Sequence[Trajectory]) -> list[tuple[list[bytes], list[list[int]]] | None]:
    """Per trajectory, its ``(block_selection, block_selection_index)`` column values (None without
    a record): each distinct segment object of a group is stored by the first row holding it."""
    home: dict[tuple[int, int], tuple[int, int]] = {}  # (group, id(segment)) -> (sample_index, item)
    out = []
    for t in trajs:
        rec = getattr(t, "block_selection", None)
        if rec is None:
            out.append(None)
            continue
        blobs, index = [], []
        for seg in rec.segments:
            key = (int(t.group_index), id(seg))
            if key not in home:
                home[key] = (int(t.sample_index), len(blobs))
                blobs.append(seg.to_bytes())
            index.append(list(home[key]))
        out.append((blobs, index))
    return out


def trajectory_row(
    traj: Trajectory,
    advantage: float | None,
    ctx: StepContext,
    decode: Callable[[list[int]], str] | None,
    absent: set[str],
    selection: tuple[list[bytes], list[list[int]]] | None = None,
) -> dict:
    """One row dict of the schema; adds names of columns the Trajectory cannot fill to ``absent``.
    ``selection``: the row's block-selection columns from :func:`selection_columns` (None: the
    row stores its whole record itself)."""
    t = traj
    t.check()
    row = {
        "run_id": ctx.run_id,
        "step": int(ctx.step),
        "group_id": int(t.group_index),
        "sample_index": int(t.sample_index),
        "prompt_len": int(t.prompt_len),
        "prompt_text": decode(list(t.token_ids[: t.prompt_len])) if decode else None,
        "response_text": decode(list(t.token_ids[t.prompt_len :])) if decode else None,
        "token_ids": [int(x) for x in t.token_ids],
        "loss_mask": [int(x) for x in t.loss_mask],
        "rollout_logprobs": [float(x) for x in t.rollout_logprobs],
        "weight_versions": [int(x) for x in t.weight_version],
        "turn_token_start": [int(s) for s, _ in t.turn_spans],
        "turn_token_end": [int(e) for _, e in t.turn_spans],
        "turn_texts": list(t.texts),
        "tool_turn_texts": _tool_turn_texts(t, decode),
        "tool_calls": dumps(t.tool_calls),
        "finish_reason": t.finish_reason,
        "reward": float(t.reward),
        "advantage": None if advantage is None else float(advantage),
        "env_info": dumps(t.info),
        "sampling_params": dumps(ctx.sampling_params),
        "checkpoint_hash": ctx.checkpoint_hash,
        "config_hash": ctx.config_hash,
        "timings": None,
        "routed_experts": None,
        "routed_experts_shape": None,
        "block_selection": None,
        "block_selection_index": None,
    }
    if not decode:
        absent.update(("prompt_text", "response_text", "tool_turn_texts"))
    row.update(_turn_columns(t))
    parts = [r for r in (row["turn_reasoning"] or []) if r]
    row["reasoning_text"] = "\n\n".join(parts) if parts else None
    for column, attr in OPTIONAL_FIELDS.items():
        if not hasattr(t, attr):
            absent.add(column)
            continue
        value = getattr(t, attr)
        if value is None:
            continue
        if column == "routed_experts":
            row["routed_experts"], row["routed_experts_shape"] = encode_routed_experts(value, len(t.token_ids))
        elif column == "block_selection":
            row["block_selection"], row["block_selection_index"] = selection or selection_columns([t])[0]
        else:
            row[column] = dumps(value)
    fields = {f.name for f in dataclasses.fields(t)} - set(CORE_FIELDS) - set(OPTIONAL_FIELDS.values())
    row["extra_fields"] = dumps({name: getattr(t, name) for name in sorted(fields)}) if fields else None
    return row


def table_from_trajectories(
    trajs: Sequence[Trajectory],
    advantages: Sequence[float] | None,
    ctx: StepContext,
    decode: Callable[[list[int]], str] | None = None,
) -> tuple[pa.Table, list[str]]:
    """Build one step's Arrow table.

    Args:
        trajs: the step's trajectories (any order; rows keep it).
        advantages: one per trajectory (a torch/numpy [B] array or list), or None.
        ctx: step-level values.
        decode: token ids -> text (the chat format's ``decode``); None leaves the text columns null.

    Returns:
        (table with :data:`SCHEMA`, sorted names of columns left null because the producer lacks them).
    """
    adv = (
        None
        if advantages is None
        else [float(a) for a in (advantages.tolist() if hasattr(advantages, "tolist") else advantages)]
    )
    if adv is not None and len(adv) != len(trajs):
        raise ValueError(f"advantages has {len(adv)} entries for {len(trajs)} trajectories")
    seen: set[tuple[int, int]] = set()
    for t in trajs:
        key = (int(t.group_index), int(t.sample_index))
        if key in seen:
            raise ValueError(
                f"two trajectories of step {ctx.step} are (group {key[0]}, sample {key[1]}); "
                f"(group_index, sample_index) must be unique within a step (renumber the "
                f"groups of a step that come from several prompt batches)"
            )
        seen.add(key)
    absent: set[str] = set()
    sel = selection_columns(trajs)
    rows = [
        trajectory_row(t, None if adv is None else adv[i], ctx, decode, absent, sel[i]) for i, t in enumerate(trajs)
    ]
    if adv is None:
        absent.add("advantage")
    if all(r["routed_experts"] is None for r in rows):
        absent.add("routed_experts")
    if all(r["block_selection"] is None for r in rows):
        absent.update(("block_selection", "block_selection_index"))
    table = pa.Table.from_pylist(rows, schema=SCHEMA)
    return table, sorted(absent)


def _turn_records(row: dict, token_ids: list[int]) -> list:
    """``TurnRecord``s of a row; a row written without turn records (null ``turn_*`` columns) gets
    records of its turn spans only."""
    from m3_rollout.chat.output_parser import ParsedTurn
    from m3_rollout.chat.tool_parser import ToolCall
    from m3_rollout.rollout.trajectory import TurnRecord

    spans = list(zip(row["turn_token_start"], row["turn_token_end"]))
    if row.get("turn_finish_reasons") is None:
        return [TurnRecord(start, end) for start, end in spans]
    out = []
    for k, (start, end) in enumerate(spans):
        parsed = ParsedTurn(
            reasoning=row["turn_reasoning"][k],
            content=row["turn_content"][k],
            tool_calls=[ToolCall(**c) for c in json.loads(row["turn_tool_calls"][k])],
            truncated=row["turn_parse_truncated"][k],
            error=row["turn_parse_errors"][k],
        )
        out.append(
            TurnRecord(
                start=start,
                end=end,
                finish_reason=row["turn_finish_reasons"][k],
                stop_sampled=row["turn_stop_sampled"][k],
                parsed=parsed,
                observations=list(row["turn_tool_results"][k]),
                bridge=list(token_ids[end : end + row["turn_bridge_len"][k]]),
                truncated=row["turn_truncated"][k],
                masked=row["turn_masked"][k],
            )
        )
    return out


def trajectories_from_rows(rows: Sequence[dict]) -> list[Trajectory]:
    """:func:`trajectory_from_row` of every row, block-selection records resolved across the rows of
    each (step, group): a segment the group's samples share comes back as ONE object they all hold.

    Raises:
        ValueError: a row points at a segment of a row that is not among ``rows``.
    """
    stored: dict[tuple[int, int, int], list[SelectionSegment]] = {}
    for r in rows:
        if r.get("block_selection") is not None:
            key = (int(r["step"]), int(r["group_id"]), int(r["sample_index"]))
            stored[key] = [SelectionSegment.from_bytes(b) for b in r["block_selection"]]
    return [trajectory_from_row(r, stored) for r in rows]


def _row_segments(row: dict, stored: dict) -> list[SelectionSegment]:
    """The segments of a row's block-selection record, in position order."""
    step, group, sample = int(row["step"]), int(row["group_id"]), int(row["sample_index"])
    own = stored.get((step, group, sample)) or [SelectionSegment.from_bytes(b) for b in row["block_selection"] or []]
    out = []
    for s_idx, item in row["block_selection_index"]:
        segs = own if s_idx == sample else stored.get((step, group, s_idx))
        if segs is None:
            raise ValueError(
                f"step {step} group {group} sample {sample}: its block-selection record uses a segment of "
                f"sample {s_idx}; read the group's rows together (trajectories_from_rows)"
            )
        out.append(segs[item])
    return out


def trajectory_from_row(row: dict, stored: dict | None = None) -> Trajectory:
    """Rebuild the ``Trajectory`` a row was written from (row = one ``Table.to_pylist()`` item).

    Optional fields come back when the ``Trajectory`` class has them; routed experts as an int16
    numpy array [L, n_moe_layers, top_k]; the block-selection record as a ``SelectionRecord``;
    ``extra_fields`` entries as their JSON values.

    stored: (step, group_id, sample_index) -> that row's decoded ``block_selection`` segments
    (:func:`trajectories_from_rows` builds it); needed when the row's record points into another
    row (its group's shared prompt segment), else a ValueError says so.
    """
    known = {f.name for f in dataclasses.fields(Trajectory)}
    ids = list(row["token_ids"])
    t = Trajectory(
        group_index=row["group_id"],
        sample_index=row["sample_index"],
        token_ids=ids,
        loss_mask=list(row["loss_mask"]),
        rollout_logprobs=list(row["rollout_logprobs"]),
        weight_version=list(row["weight_versions"]),
        prompt_len=row["prompt_len"],
        finish_reason=row["finish_reason"],
        tool_calls=json.loads(row["tool_calls"]),
        reward=row["reward"],
        texts=list(row["turn_texts"]),
        info=json.loads(row["env_info"]),
        turns=_turn_records(row, ids),
    )
    if "timings" in known and row.get("timings") is not None:
        t.timings = json.loads(row["timings"])
    if row.get("routed_experts") is not None:
        t.routed_experts = decode_routed_experts(row["routed_experts"], row["routed_experts_shape"])
    if row.get("block_selection_index") is not None:
        t.block_selection = SelectionRecord(_row_segments(row, stored or {}))
    if row.get("extra_fields"):
        for name, value in json.loads(row["extra_fields"]).items():
            if name in known:
                setattr(t, name, value)
    return t

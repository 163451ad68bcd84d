"""Rollout dumps: exact round trip, crash safety, retention, bad input (m3_rollout/dump)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from m3_rollout.chat.output_parser import ParsedTurn
from m3_rollout.chat.tool_parser import ToolCall
from m3_rollout.dump import (
    SCHEMA,
    DumpDirError,
    DumpFileError,
    RetentionPolicy,
    RolloutDumpWriter,
    SchemaVersionError,
    decode_routed_experts,
    read_dump,
    read_shard,
    trajectory_from_row,
)
from m3_rollout.dump import schema as S
from m3_rollout.dump.report import _STAT_COLUMNS, inspect_lines, show_lines
from m3_rollout.rollout.trajectory import Trajectory, TurnRecord

SMOKE = "configs/grpo_smoke.yaml"


def _decode(ids):
    return " ".join(f"t{i}" for i in ids)


def _traj(group: int, sample: int, seed: int, routed: bool = False) -> Trajectory:
    """Two model turns with a tool call, reasoning, tool results and a bridge; random logprobs
    (float64, not fp32-representable) and per-token weight versions."""
    rng = np.random.default_rng(seed)
    t = Trajectory(
        group_index=group,
        sample_index=sample,
        token_ids=[],
        loss_mask=[],
        rollout_logprobs=[],
        weight_version=[],
        prompt_len=5,
    )
    t.append([int(x) for x in rng.integers(0, 1000, 5)], generated=False)
    n1 = int(rng.integers(2, 6))
    t.append(
        [int(x) for x in rng.integers(0, 1000, n1)],
        generated=True,
        logprobs=[float(x) for x in -rng.random(n1) * 3],
        version=[3] * (n1 - 1) + [4],
    )
    call = ToolCall(id=f"call_{sample}", name="calculator", arguments='{"expression": "12*34"}')
    r1 = TurnRecord(
        5,
        5 + n1,
        "stop",
        True,
        ParsedTurn("think ü", None, [call]),
        observations=["408"],
        bridge=[int(x) for x in rng.integers(0, 1000, 3)],
    )
    t.append(r1.bridge, generated=False)
    t.turns[-1] = r1  # the record append() made for the turn, filled in
    s2 = len(t.token_ids)
    t.append([7, 8], generated=True, logprobs=[-0.1 - seed * 1e-9, -1e-300], version=4)
    bad = ToolCall(id="call_x", name="calc", arguments="{", truncated=True, error="unterminated <invoke>")
    r2 = TurnRecord(
        s2,
        s2 + 2,
        "length",
        False,
        ParsedTurn(None, "The answer is 408", [bad], True, "cut"),
        truncated=True,
        masked=True,
    )
    t.turns[-1] = r2
    t.mask_span(s2, s2 + 2)
    t.texts += ["<invoke name=calculator>", "The answer is 408"]
    t.tool_calls += [
        {**call.to_openai(), "name": call.name, "arguments": call.arguments, "truncated": False, "error": None}
    ]
    t.finish_reason, t.reward, t.info = "length", 0.25 * sample, {"tool_calls": 1, "nested": {"a": [1, 2]}}
    if routed:
        t.routed_experts = rng.integers(-1, 300, (len(t.token_ids), 3, 2)).astype(np.int16)
    return t


def _write(d, step, trajs=None, adv=None, **kw):
    w = RolloutDumpWriter(d, run_id="run-a", decode=_decode, checkpoint_hash="sha256:ck", config_hash="sha256:cf", **kw)
    trajs = trajs if trajs is not None else [_traj(0, j, step * 10 + j) for j in range(3)]
    return w.write_step(
        step,
        trajs,
        [0.5, -0.25, 1e-7][: len(trajs)] if adv is None else adv,
        {"temperature": 0.7, "seed": step},
        {"token_mult_prob_error": 1.01},
    ), trajs


def _sha(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_round_trip_every_field(tmp_path):
    trajs = [_traj(g, j, 100 + 3 * g + j, routed=(j == 1)) for g in range(2) for j in range(2)]
    adv = np.array([0.5, -0.5, 1.25, -1.25], dtype=np.float32)
    routed_ref = trajs[1].routed_experts.copy()
    path, _ = _write(tmp_path, 7, trajs, adv)
    read = read_dump(tmp_path)
    assert not read.errors and [s.step for s in read.shards] == [7]
    rows = read.table.to_pylist()
    assert len(rows) == 4
    for t, a, row in zip(trajs, adv, rows):
        back = trajectory_from_row(row)
        routed = getattr(t, "routed_experts", None)
        if routed is not None:
            np.testing.assert_array_equal(
                decode_routed_experts(row["routed_experts"], row["routed_experts_shape"]), routed
            )
            if getattr(back, "routed_experts", None) is not None:  # once Trajectory has the field
                np.testing.assert_array_equal(back.routed_experts, routed)
                back.routed_experts = None
            t.routed_experts = None
        else:
            assert row["routed_experts"] is None and row["routed_experts_shape"] is None
        assert back == t  # every dataclass field, turn records, parse results, tool calls, floats bit-exact
        assert row["rollout_logprobs"] == t.rollout_logprobs
        assert row["advantage"] == float(a)
        assert (row["run_id"], row["step"], row["group_id"], row["sample_index"]) == (
            "run-a",
            7,
            t.group_index,
            t.sample_index,
        )
        assert row["prompt_text"] == _decode(t.token_ids[:5])
        assert row["response_text"] == _decode(t.token_ids[5:])
        assert row["reasoning_text"] == "think ü"
        end1, start2 = t.turn_spans[0][1], t.turn_spans[1][0]
        assert row["tool_turn_texts"] == [_decode(t.token_ids[end1:start2]), ""]
        assert row["turn_tool_results"] == [["408"], []]
        assert row["sampling_params"] == '{"temperature": 0.7, "seed": 7}'
        assert (row["checkpoint_hash"], row["config_hash"]) == ("sha256:ck", "sha256:cf")
    # Readable without this package: pandas, and pyarrow alone for the routed experts.
    df = pd.read_parquet(path)
    assert list(df.columns) == SCHEMA.names and len(df) == 4
    assert list(df["token_ids"][2]) == trajs[2].token_ids
    raw = pa.decompress(
        df["routed_experts"][1],
        decompressed_size=int(np.prod(df["routed_experts_shape"][1])) * 2,
        codec="zstd",
        asbytes=True,
    )
    np.testing.assert_array_equal(np.frombuffer(raw, "<i2").reshape(routed_ref.shape), routed_ref)
    meta = pq.read_schema(path).metadata
    assert meta[S.META_VERSION.encode()] == str(S.SCHEMA_VERSION).encode()
    assert b"timings" in meta[S.META_ABSENT.encode()]


def test_routed_experts_codec_and_compression():
    rng = np.random.default_rng(0)
    # Realistic routing: few distinct experts per layer across nearby tokens compress well.
    arr = np.sort(rng.integers(0, 16, (512, 8, 4)), axis=-1).astype(np.int16) * 17
    from m3_rollout.dump import encode_routed_experts

    blob, shape = encode_routed_experts(arr, 512)
    assert shape == [512, 8, 4] and len(blob) < arr.nbytes
    np.testing.assert_array_equal(decode_routed_experts(blob, shape), arr)
    with pytest.raises(ValueError, match="L=511"):
        encode_routed_experts(arr, 511)
    with pytest.raises(ValueError, match="32767"):
        encode_routed_experts(np.full((2, 1, 1), 40000), 2)


def test_writer_failure_before_rename_leaves_no_shard(tmp_path, monkeypatch):
    first, _ = _write(tmp_path, 1)
    before = _sha(first)

    def broken(table, path):
        path.write_bytes(b"PAR1 partial")  # part of a file, then the process fails
        raise OSError("disk full")

    monkeypatch.setattr(RolloutDumpWriter, "_write_parquet", staticmethod(broken))
    with pytest.raises(OSError, match="disk full"):
        _write(tmp_path, 2)
    assert sorted(f.name for f in tmp_path.iterdir()) == ["step_00000001.parquet"]
    assert _sha(first) == before
    assert [s.step for s in read_dump(tmp_path).shards] == [1]


def test_killed_writer_never_leaves_a_complete_looking_shard(tmp_path):
    first, _ = _write(tmp_path, 1)
    before = _sha(first)
    # A child process is killed (SIGKILL) after writing most of step 2's file, before the rename.
    script = textwrap.dedent(f"""
        import os, signal, sys
        sys.path.insert(0, {os.getcwd()!r})
        from tests.test_dump import _write
        from m3_rollout.dump.writer import RolloutDumpWriter
        real = RolloutDumpWriter._write_parquet
        def dying(table, path):
            real(table, path)
            with open(path, "r+b") as f:
                f.truncate(os.path.getsize(path) // 2)
            os.kill(os.getpid(), signal.SIGKILL)
        RolloutDumpWriter._write_parquet = staticmethod(dying)
        _write({str(tmp_path)!r}, 2)
    """)
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert proc.returncode == -9, proc.stderr.decode()[-2000:]
    names = sorted(f.name for f in tmp_path.iterdir())
    assert names[1] == "step_00000001.parquet" and names[0].startswith(".step_00000002.parquet.tmp-")
    read = read_dump(tmp_path)
    assert [s.step for s in read.shards] == [1] and not read.errors and _sha(first) == before
    # The next writer on the directory removes the dead writer's temporary file.
    _write(tmp_path, 2)
    assert sorted(f.name for f in tmp_path.iterdir()) == ["step_00000001.parquet", "step_00000002.parquet"]
    assert _sha(first) == before


def test_shards_are_never_rewritten(tmp_path):
    first, _ = _write(tmp_path, 1)
    before = _sha(first)
    with pytest.raises(FileExistsError, match="step_00000001.parquet"):
        _write(tmp_path, 1)
    assert _sha(first) == before


def test_every_n_steps_and_retention(tmp_path):
    for step in range(1, 9):
        _write(tmp_path / "n", step, every_n_steps=3)
    assert [s.step for s in read_dump(tmp_path / "n").shards] == [3, 6]
    for step in range(1, 6):
        _write(tmp_path / "k", step, retention=RetentionPolicy(keep_last_n_steps=2))
    assert [s.step for s in read_dump(tmp_path / "k").shards] == [4, 5]
    size = (tmp_path / "k" / S.shard_name(5)).stat().st_size
    for step in range(1, 6):  # room for about 2.5 shards: the 2 newest stay
        _write(tmp_path / "b", step, retention=RetentionPolicy(max_bytes=int(size * 2.5)))
    assert [s.step for s in read_dump(tmp_path / "b").shards] == [4, 5]
    _write(tmp_path / "one", 1, retention=RetentionPolicy(max_bytes=10))  # the newest is always kept
    assert [s.step for s in read_dump(tmp_path / "one").shards] == [1]


def _selection_group(seed: int):
    """3 trajectories of group 0 whose block-selection records share one prompt segment object."""
    from m3_rollout.model.selection_record import SelectionRecord, SelectionSegment

    rng = np.random.default_rng(seed)
    trajs = [_traj(0, j, seed + j) for j in range(3)]
    n = len(trajs[0].token_ids)
    prompt = SelectionSegment.from_rows(0, rng.integers(-1, 40, (5, 3, 2, 4)).astype(np.int16))
    for t in trajs:
        own = SelectionSegment.from_rows(5, rng.integers(-1, 40, (n - 6, 3, 2, 4)).astype(np.int16))
        t.block_selection = SelectionRecord([prompt, own])
    return trajs


def test_block_selection_stored_once_per_group_and_read_back_shared(tmp_path):
    from m3_rollout.dump import trajectories_from_rows
    from m3_rollout.model.selection_record import canonical_rows

    trajs = _selection_group(3)
    prompt_rows = trajs[0].block_selection.segments[0].rows
    path, _ = _write(tmp_path, 2, trajs)
    rows = read_dump(tmp_path).table.to_pylist()
    assert [len(r["block_selection"]) for r in rows] == [2, 1, 1]  # the prompt segment is in row 0 only
    assert rows[2]["block_selection_index"] == [[0, 0], [2, 0]]
    back = trajectories_from_rows(rows)
    assert back[1].block_selection.segments[0] is back[2].block_selection.segments[0]
    for a, b in zip(trajs, back):
        end = a.block_selection.end
        np.testing.assert_array_equal(b.block_selection.dense(end), canonical_rows(a.block_selection.dense(end)))
        b.block_selection = a.block_selection = None
        assert a == b
    with pytest.raises(ValueError, match="trajectories_from_rows"):
        trajectory_from_row(rows[1])  # its prompt segment lives in row 0
    assert trajectory_from_row(rows[0]).block_selection.end == len(trajs[0].token_ids) - 1
    assert "block selection: 2 segments (1 stored with another sample)" in "\n".join(show_lines(tmp_path, 2, 0)[0])
    # Without this package: the coded segment format of docs/rollout_dump_schema.md.
    blob = pd.read_parquet(path)["block_selection"][0][0]
    start, n, s, g, k = np.frombuffer(blob[4:18], "<u4", 2).tolist() + np.frombuffer(blob[12:18], "<u2").tolist()
    raw = pa.decompress(blob[18:], decompressed_size=2 * n * s * g * k, codec="zstd", asbytes=True)
    d = np.frombuffer(raw, "<u2").reshape(n, s, g, k)
    rows0 = np.cumsum(d, axis=0, dtype=np.uint16).view(np.int16)
    assert (blob[:4], start, n) == (b"MSB1", 0, 5)
    np.testing.assert_array_equal(rows0, canonical_rows(prompt_rows))


def test_version_1_shards_read_with_null_block_selection(tmp_path):
    path, _ = _write(tmp_path, 1)
    t = pq.read_table(path).drop_columns(list(S.ADDED_COLUMNS[2]))
    meta = {**t.schema.metadata, S.META_VERSION.encode(): b"1"}
    pq.write_table(t.replace_schema_metadata(meta), path)
    read = read_dump(tmp_path)
    assert not read.errors and read.table.column("block_selection").null_count == 3
    assert read_dump(tmp_path, columns=["token_ids", "block_selection_index"]).table.num_rows == 3


def test_inspect_of_a_missing_directory_says_so_and_how_dumps_are_made(tmp_path, capsys):
    from m3_rollout.jobs.dump_cli import main as dump_main

    missing = tmp_path / "rollout_dumps"
    assert dump_main(["inspect", str(missing)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (
        f"error: {missing}: dump directory does not exist. Dumps are written by the GRPO job run with "
        "rollout_dump.enabled=true (into rollout_dump.dir, default <logger.log_dir>/rollout_dumps), or without "
        "training by `python -m m3_rollout.dump generate --config CONFIG --dir DIR --steps N`\n"
    )


def test_replay_with_a_model_that_is_no_checkpoint_says_so_without_a_traceback(tmp_path, capsys):
    from m3_rollout.jobs.dump_cli import main as dump_main

    _write(tmp_path / "dump", 1)
    missing = tmp_path / "no_such_checkpoint"
    assert dump_main(["replay", str(tmp_path / "dump"), "--checkpoint", str(missing)]) == 2
    assert capsys.readouterr().err == (
        f"error: --checkpoint: {missing} does not exist; give a checkpoint directory (one holding config.json) "
        "or one of builtin:tiny-calculator, builtin:tiny-random, builtin:m3-gpu-small\n"
    )
    assert dump_main(["replay", str(tmp_path / "dump"), "policy.model_name=builtin:nope"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: policy.model_name='builtin:nope': unknown built-in checkpoint 'nope'")
    assert err.count("\n") == 1


def test_show_of_a_missing_step_lists_the_steps_there(tmp_path, capsys):
    from m3_rollout.jobs.dump_cli import main as dump_main

    for step in (2, 4):
        _write(tmp_path, step)
    assert dump_main(["show", str(tmp_path), "--step", "9", "--group", "0"]) == 2
    assert capsys.readouterr().err == f"error: {tmp_path}: no shard for steps [9]; its shards are of steps [2, 4]\n"
    for step in range(5, 30):
        _write(tmp_path, step)
    with pytest.raises(DumpDirError, match=r"steps \[2, 4, 5, .*, 28, 29\] \(27 shards\)"):
        read_dump(tmp_path, steps=[1])


def test_bad_input_names_the_file_and_other_shards_load(tmp_path):
    with pytest.raises(DumpDirError, match="does not exist"):
        read_dump(tmp_path / "missing")
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    pq.write_table(pa.table({"x": [1]}), foreign / "data.parquet")
    with pytest.raises(DumpDirError, match="no rollout dump shards"):
        read_dump(foreign)
    d = tmp_path / "dump"
    _write(d, 1)
    good, _ = _write(d, 2)
    # Another schema version.
    t = pq.read_table(good)
    meta = {**t.schema.metadata, S.META_VERSION.encode(): b"999"}
    pq.write_table(t.replace_schema_metadata(meta), d / S.shard_name(3))
    # A truncated copy and a foreign Parquet file under shard names.
    (d / S.shard_name(4)).write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    pq.write_table(pa.table({"x": [1]}), d / S.shard_name(5))
    read = read_dump(d)
    assert [s.step for s in read.shards] == [1, 2] and read.table.num_rows == 6
    errors = {e.path.name: e for e in read.errors}
    assert set(errors) == {S.shard_name(3), S.shard_name(4), S.shard_name(5)}
    assert isinstance(errors[S.shard_name(3)], SchemaVersionError)
    assert "schema version 999" in str(errors[S.shard_name(3)]) and str(d / S.shard_name(3)) in str(
        errors[S.shard_name(3)]
    )
    assert "truncated" in str(errors[S.shard_name(4)])
    assert "not a rollout dump shard" in str(errors[S.shard_name(5)])
    with pytest.raises(SchemaVersionError, match="step_00000003.parquet"):
        read_shard(d / S.shard_name(3))
    with pytest.raises(DumpFileError, match="step_00000004.parquet"):
        read_shard(d / S.shard_name(4))
    lines, errs = inspect_lines(d)
    assert len(lines) == 5 and len(errs) == 3 and all("skipped" in e for e in errs)


def test_inspect_and_show_values(tmp_path):
    trajs = [_traj(0, j, 50 + j) for j in range(3)] + [_traj(1, 0, 60)]
    trajs[0].finish_reason = "stop"
    trajs[3].reward = 1.0
    trajs[2].finish_reason = "error"  # a failed sample: its reward 0 is a placeholder, left out
    _write(tmp_path, 4, trajs, adv=[0.1, 0.2, 0.0, 0.4])
    lines, errs = inspect_lines(tmp_path)
    cells = lines[3].split()
    rewards = [t.reward for t in trajs if t.finish_reason != "error"]
    assert len(rewards) == 3 and sum(rewards) > 0
    assert cells[:6] == ["4", "4", "2", "1", f"{sum(rewards) / 3:.3f}", f"{sum(r > 0.5 for r in rewards) / 3:.3f}"]
    assert cells[6] == f"{sum(t.num_generated for t in trajs) / 4:.1f}"
    assert cells[9] == f"{2 / 4:.3f}" and cells[11] == "1.0100" and not errs  # "length": samples 1 and 3
    out, _ = show_lines(tmp_path, 4, 0)
    text = "\n".join(out)
    assert text.count("── sample") == 3 and "reasoning:" in text and "think ü" in text
    assert 'tool call: calculator({"expression": "12*34"})' in text and "408" in text
    assert "[truncated, error: unterminated <invoke>]" in text and "turn 2 [length]" in text
    # turn 2's text ended inside a tool call (turn_parse_truncated): flagged with the turn's other flags
    t = trajs[0]
    (s1, e1), (s2, e2) = t.turn_spans
    assert f"  turn 1 [stop] tokens {s1}..{e1}" in out
    assert f"  turn 2 [length] tokens {s2}..{e2} (truncated, masked, ended inside a tool call)" in out
    with pytest.raises(ValueError, match="no group 5"):
        show_lines(tmp_path, 4, 5)


def test_schema_doc_lists_every_column_and_the_version():
    from pathlib import Path

    doc = (Path(__file__).parent.parent / "docs" / "rollout_dump_schema.md").read_text()
    assert f"# Rollout dump schema (version {S.SCHEMA_VERSION})" in doc
    missing = [name for name in SCHEMA.names if f"| `{name}` |" not in doc]
    assert not missing, f"docs/rollout_dump_schema.md lacks columns {missing}"


def test_pandas_reads_a_dump_directory_skipping_temp_files(tmp_path):
    _write(tmp_path, 1)
    _write(tmp_path, 2)
    (tmp_path / ".step_00000003.parquet.tmp-1").write_bytes(b"PAR1 partial")
    df = pd.read_parquet(tmp_path)
    assert sorted(df["step"].unique()) == [1, 2] and len(df) == 6


# --- adversarial review ------------------------------------------------------------------------


def test_shard_with_broken_metadata_is_a_named_error_and_others_load(tmp_path):
    good, _ = _write(tmp_path, 1)
    # The version key but nothing else (a half-written foreign tool), and non-UTF-8 metadata.
    pq.write_table(
        pa.table({"x": [1]}).replace_schema_metadata({S.META_VERSION.encode(): b"1"}), tmp_path / S.shard_name(2)
    )
    t = pq.read_table(good)
    pq.write_table(
        t.replace_schema_metadata({**t.schema.metadata, S.META_STEP.encode(): b"\xff\xfe"}), tmp_path / S.shard_name(3)
    )
    t = pq.read_table(good)
    pq.write_table(
        t.replace_schema_metadata({**t.schema.metadata, S.META_STEP_METRICS.encode(): b"{oops"}),
        tmp_path / S.shard_name(4),
    )
    read = read_dump(tmp_path)
    assert [s.step for s in read.shards] == [1] and read.table.num_rows == 3
    assert sorted(e.path.name for e in read.errors) == [S.shard_name(k) for k in (2, 3, 4)]
    assert all(isinstance(e, DumpFileError) and "metadata" in e.reason for e in read.errors)


def test_unserialisable_env_info_does_not_stop_the_dump(tmp_path):
    # An environment plug-in may put any object into its info; the dump keeps its repr instead
    # of raising in the middle of a training run.
    class Opaque:
        def __repr__(self):
            return "<Opaque 7>"

    trajs = [_traj(0, j, 300 + j) for j in range(2)]
    trajs[0].info = {"obj": Opaque(), "ok": 1}
    path, _ = _write(tmp_path, 1, trajs, [0.5, -0.5])
    rows = read_shard(path).to_pylist()
    assert json.loads(rows[0]["env_info"]) == {"obj": "<Opaque 7>", "ok": 1}


def test_duplicate_group_and_sample_ids_are_refused(tmp_path):
    # (step, group_id, sample_index) identifies a row: replay keys re-scored logprobs by it and
    # offline training groups advantages by group_id, so two rows must never share it.
    trajs = [_traj(0, 0, 1), _traj(0, 0, 2)]
    with pytest.raises(ValueError, match=r"group 0, sample 0"):
        _write(tmp_path, 1, trajs, [0.0, 0.0])
    assert not list(tmp_path.iterdir())


def test_resumed_run_keeps_existing_shards_instead_of_failing(tmp_path):
    # checkpointing.resume re-runs the steps after the checkpoint; shards the interrupted run
    # already wrote for them stay untouched and the resumed run goes on (no FileExistsError).
    from m3_rollout.config import load_config
    from m3_rollout.dump.writer import writer_from_config

    first, trajs = _write(tmp_path, 3)
    before = _sha(first)
    over = ["rollout_dump.enabled=true", f"rollout_dump.dir={tmp_path}"]
    resumed = writer_from_config(load_config(None, over + ["checkpointing.resume=true"]), decode=_decode)
    assert resumed.write_step(3, trajs, [0.0] * 3) is None and _sha(first) == before
    assert resumed.write_step(4, trajs, [0.0] * 3) == tmp_path / S.shard_name(4)
    fresh = writer_from_config(load_config(None, over), decode=_decode)
    with pytest.raises(FileExistsError):
        fresh.write_step(3, trajs, [0.0] * 3)


def _edited(good, d, step: int, **columns) -> None:
    """``good``'s rows with ``columns`` replaced (column -> function of the old Python list),
    written as the shard of ``step`` (metadata kept: the step it says stays ``good``'s)."""
    t = pq.read_table(good)
    for name, edit in columns.items():
        i = t.schema.get_field_index(name)
        field = t.schema.field(i).with_nullable(True)  # a hand edit may write nulls anywhere
        t = t.set_column(i, field, pa.array(edit(t.column(name).to_pylist()), field.type))
    pq.write_table(t, d / S.shard_name(step))


@pytest.mark.parametrize(
    "edit, needle",
    [
        ({"tool_calls": lambda v: [v[0][:-3]] + v[1:]}, "row 0 (group 0, sample 0): tool_calls is not valid JSON"),
        ({"rollout_logprobs": lambda v: [v[0][:-2]] + v[1:]}, "rollout_logprobs has"),
        ({"loss_mask": lambda v: v[:1] + [v[1][:3]] + v[2:]}, "row 1 (group 0, sample 1): loss_mask has 3 entries"),
        ({"prompt_len": lambda v: [-3] + v[1:]}, "prompt_len -3 outside"),
        ({"prompt_len": lambda v: [10**6] + v[1:]}, "prompt_len 1000000 outside"),
        (
            {"routed_experts_shape": lambda v: [[s[0] + 1, *s[1:]] if s else [5, 3, 2] for s in v]},
            "routed_experts_shape",
        ),
        ({"env_info": lambda v: ["[1, 2]"] + v[1:]}, "env_info is JSON list, not an object"),
        ({"turn_token_end": lambda v: [[10**6] * len(v[0])] + v[1:]}, "a turn span outside"),
        # null cells in never-null columns made the checker itself raise TypeError (review finding)
        ({"prompt_len": lambda v: [None] + v[1:]}, "prompt_len is null in 1 row(s)"),
        ({"turn_token_start": lambda v: [None] + v[1:]}, "turn_token_start is null in 1 row(s)"),
    ],
)
def test_rows_that_do_not_hold_together_refuse_their_shard_by_name_and_the_others_load(tmp_path, capsys, edit, needle):
    """A truncated JSON cell crashed `dump inspect` (JSONDecodeError, exit 1); cut lengths and
    out-of-range indices were read silently ("gen tok" quietly lower)."""
    d = tmp_path / "dump"
    good, _ = _write(d, 1, trajs=[_traj(0, j, 10 + j, routed=True) for j in range(3)])
    _write(d, 2)
    moved = tmp_path / "moved.parquet"
    good.rename(moved)
    _edited(moved, d, 1, **edit)
    read = read_dump(d)
    assert [s.step for s in read.shards] == [2] and read.table.num_rows == 3
    (err,) = read.errors
    assert err.path.name == S.shard_name(1) and needle in str(err) and "edited or damaged" in str(err)
    if set(edit) <= set(_STAT_COLUMNS):  # inspect reads these columns only (the row named by group)
        lines, errs = inspect_lines(d)
        assert len(errs) == 1 and needle.split("): ")[-1] in errs[0] and "1 shard(s)" in lines[0]


def test_a_shard_copied_under_another_steps_name_is_refused_not_merged(tmp_path):
    d = tmp_path / "dump"
    good, _ = _write(d, 1)
    _write(d, 2)
    (d / S.shard_name(3)).write_bytes(good.read_bytes())  # says step 1 inside
    read = read_dump(d)
    assert [s.step for s in read.shards] == [1, 2] and read.table.num_rows == 6
    (err,) = read.errors
    assert err.path.name == S.shard_name(3) and "its metadata says step 1, its name another step" in str(err)


def test_package_names_and_submodules_load_on_first_use():
    # Issue: the package's names became lazy (PEP 562 __getattr__) and its submodules reader,
    # records, row_checks, schema and writer, which `import m3_rollout.dump` used to bind, raised
    # AttributeError until something imported them; dir() listed none of __all__. Now both load on
    # first use, and importing the package still loads neither pyarrow nor torch.
    script = textwrap.dedent("""
        import sys
        import m3_rollout.dump as d
        heavy = sorted({"pyarrow", "torch"} & set(sys.modules))
        missing = sorted(set(d.__all__) - set(dir(d)))
        subs = [type(getattr(d, m)).__name__ for m in ("reader", "records", "row_checks", "schema", "writer")]
        same = d.writer.RolloutDumpWriter is d.RolloutDumpWriter and d.schema.SCHEMA_VERSION == d.SCHEMA_VERSION
        print(heavy, missing, subs, same)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split("\n")[0] == "[] [] ['module', 'module', 'module', 'module', 'module'] True"
    with pytest.raises(AttributeError, match="has no attribute 'report_lines'"):
        import m3_rollout.dump

        m3_rollout.dump.report_lines  # noqa: B018


def test_dump_generate_takes_one_sample_per_prompt(tmp_path, monkeypatch, capsys):
    """`dump generate` refused grpo.num_generations_per_prompt=1 with the GRPO job's rule (a group
    of one sample learns nothing), though it trains nothing; now it dumps one sample per prompt
    (advantage 0, as the GRPO loop would give it), while the GRPO job still refuses it. It also
    prints the GRPO job's [warn] for a setting it reads nowhere (a sparse-attention choice without
    batch-invariant mode), which it used to drop."""
    from m3_rollout.config import ConfigError, load_config
    from m3_rollout.jobs.dump_cli import main as dump_main

    monkeypatch.setenv("M3_ROLLOUT_CACHE", str(tmp_path / "cache"))
    over = [
        "grpo.num_generations_per_prompt=1",
        "grpo.num_prompts_per_step=3",
        "policy.generation.expert_parallel_size=1",
        "cluster.launcher=auto",
        "policy.generation.max_new_tokens=4",
    ]
    d = tmp_path / "dump"
    unread = "policy.generation.invariant_sparse_attention=union"
    assert dump_main(["generate", "--config", SMOKE, "--dir", str(d), "--steps", "1", *over, unread]) == 0
    assert "[warn] policy.generation.invariant_sparse_attention=union has no effect" in capsys.readouterr().out
    rows = read_dump(d).table.to_pydict()
    assert sorted(rows["group_id"]) == [0, 1, 2] and rows["sample_index"] == [0, 0, 0]
    assert rows["advantage"] == [0.0, 0.0, 0.0]
    with pytest.raises(ConfigError, match="grpo.num_generations_per_prompt=1: must be >= 2"):
        load_config(SMOKE, over)
    assert load_config(SMOKE, over, training=False).grpo.num_generations_per_prompt == 1
    with pytest.raises(ConfigError, match="grpo.num_generations_per_prompt=0: must be >= 1"):
        load_config(SMOKE, [*over, "grpo.num_generations_per_prompt=0"], training=False)

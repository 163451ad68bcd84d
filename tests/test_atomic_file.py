"""The one durable file write (``m3_rollout.model.atomic_file``) and the writers that use it."""

import os

import pytest
import torch
from durability import record_fsyncs  # tests/ on sys.path

from m3_rollout.model import M3ForCausalLM, atomic_file, save_checkpoint, tiny_config
from m3_rollout.model.atomic_file import fsync_dir, fsync_tree, write_atomic


def _fsyncs(monkeypatch) -> list[int]:
    """Records the descriptors ``atomic_file`` fsyncs (and still fsyncs them)."""
    real, calls = os.fsync, []

    def fsync(fd):
        calls.append(fd)
        real(fd)

    monkeypatch.setattr(atomic_file.os, "fsync", fsync)
    return calls


def test_write_atomic_replaces_the_file_whole_fsynced_and_with_the_mode_asked(tmp_path, monkeypatch):
    calls = _fsyncs(monkeypatch)
    path = tmp_path / "a.bin"
    path.write_bytes(b"old")
    write_atomic(path, lambda p: open(p, "wb").write(b"new"), mode=0o640)
    assert path.read_bytes() == b"new" and path.stat().st_mode & 0o777 == 0o640
    assert len(calls) == 1 and os.listdir(tmp_path) == ["a.bin"]
    write_atomic(path, lambda p: open(p, "wb").write(b"newer"), fsync=False)
    assert path.read_bytes() == b"newer" and len(calls) == 1


def test_a_write_that_fails_leaves_the_old_file_and_no_temporary_one(tmp_path):
    path = tmp_path / "a.bin"
    path.write_bytes(b"old")

    def half_then_fail(p):
        with open(p, "wb") as f:
            f.write(b"ha")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        write_atomic(path, half_then_fail)
    assert path.read_bytes() == b"old" and os.listdir(tmp_path) == ["a.bin"]
    with pytest.raises(OSError):  # the first write of a path: nothing is left at all
        write_atomic(tmp_path / "b.bin", half_then_fail)
    assert os.listdir(tmp_path) == ["a.bin"]


def test_fsync_dir_syncs_a_directory_and_passes_over_what_cannot_be_opened(tmp_path, monkeypatch):
    calls = _fsyncs(monkeypatch)
    fsync_dir(tmp_path)
    fsync_dir(tmp_path / "missing")  # os.open fails: nothing to sync, no error
    assert len(calls) == 1


def test_fsync_tree_syncs_every_file_and_then_each_directory_after_its_contents(tmp_path, monkeypatch):
    synced = record_fsyncs(monkeypatch)
    (tmp_path / "sub").mkdir()
    for name in ("a.json", "sub/b.bin"):
        (tmp_path / name).write_bytes(b"x")
    (tmp_path / "link").symlink_to(tmp_path / "a.json")  # not followed: a.json is synced once
    fsync_tree(tmp_path)
    stats = {p: os.stat(tmp_path / p) for p in ("a.json", "sub/b.bin", "sub", ".")}
    name = {(st.st_dev, st.st_ino): p for p, st in stats.items()}
    order = [name.get(i, "?") for i in synced]
    assert sorted(order) == sorted(stats)
    assert order.index("sub/b.bin") < order.index("sub") < order.index(".") == len(order) - 1


def test_the_checkpoint_and_the_warm_start_progress_write_through_it(tmp_path, monkeypatch):
    # save_checkpoint keeps what it did (mode 0644, no fsync); the progress store fsyncs every file
    # and then its directory.
    from m3_trainers import warm_start_progress

    calls = _fsyncs(monkeypatch)
    model = M3ForCausalLM(tiny_config(bos_token_id=None, eos_token_id=None))
    files = save_checkpoint(model, model.config, tmp_path / "ckpt")
    assert calls == [] and all((tmp_path / "ckpt" / f).stat().st_mode & 0o777 == 0o644 for f in files)

    wrote = []
    real = warm_start_progress.write_atomic
    monkeypatch.setattr(
        warm_start_progress, "write_atomic", lambda p, w, **kw: (wrote.append(p.name), real(p, w, **kw))
    )
    monkeypatch.setattr(warm_start_progress, "fsync_dir", lambda d: wrote.append("dir"))
    warm_start_progress.ProgressStore(tmp_path / "progress", {"key": "test"}).save(_state())
    assert wrote == ["snapshot-0.pt", "state-0.pt", warm_start_progress.MANIFEST, "dir"]
    assert len(calls) == 3 and sorted(os.listdir(tmp_path / "progress")) == sorted(wrote[:-1])


def _state():
    """A small warm-start state: one snapshot (best and below), the live state after a step more."""
    from m3_trainers.warm_start import Snapshot, WarmStartState

    snap = Snapshot(0, 0, 0.0, {"w": torch.zeros(3)}, {"state": {}, "param_groups": []}, {"last_epoch": 0})
    return WarmStartState(
        step=1, eval_every=8, interval_end=8, accuracy=0.0, loss=1.0, history=[(0, 0.0)], best=snap,
        best_distance=0.25, below=snap, seconds=1.0, train_steps=1, train_seconds=1.0,
        eval_seconds=0.5, model={"w": torch.ones(3)}, optimizer={"state": {}, "param_groups": []},
        scheduler={"last_epoch": 1}, data_rng=(3, (1, 2), None), torch_rng=torch.get_rng_state(),
    )  # fmt: skip


def test_the_dump_writer_syncs_its_directory_through_it(tmp_path, monkeypatch):
    # After each shard's rename and after retention deletes shards: fsync_dir of the dump directory
    # (the writer's own copy of it is gone; its shard writes keep their own temporary names, which
    # the next writer's clean-up of killed writers' files recognises).
    from test_dump import _write

    from m3_rollout.dump import RetentionPolicy, writer

    real_replace, events = os.replace, []
    monkeypatch.setattr(writer, "fsync_dir", lambda d: events.append(("fsync_dir", d)))
    monkeypatch.setattr(
        writer.os, "replace", lambda a, b: (real_replace(a, b), events.append(("replace", os.path.basename(b))))
    )
    _write(tmp_path, 1)
    _write(tmp_path, 2, retention=RetentionPolicy(keep_last_n_steps=1))
    shard = "step_{:08d}.parquet".format
    assert events == [
        ("replace", shard(1)), ("fsync_dir", tmp_path),
        ("replace", shard(2)), ("fsync_dir", tmp_path), ("fsync_dir", tmp_path),  # step 1 deleted
    ]  # fmt: skip
    assert os.listdir(tmp_path) == [shard(2)]

"""Recording the fsyncs and renames of a save, to check that a directory written under a
temporary name and renamed into place is on the disk (``m3_rollout.model.atomic_file``: every file
and directory of it fsynced before the rename, its parent directory after it)."""

from __future__ import annotations

import os
from pathlib import Path


def inode(path: Path) -> tuple[int, int]:
    """(device, inode) of ``path``: what an fsync of it records (a renamed file keeps it)."""
    st = os.stat(path)
    return st.st_dev, st.st_ino


def record_fsyncs(monkeypatch) -> list[tuple[int, int]]:
    """Patch ``os.fsync`` to record the (device, inode) of each descriptor it syncs, in order (the
    sync still runs). Returns the list they are appended to."""
    synced: list[tuple[int, int]] = []
    real = os.fsync

    def fsync(fd):
        st = os.fstat(fd)
        synced.append((st.st_dev, st.st_ino))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return synced


def record_fsyncs_and_renames(monkeypatch) -> list[tuple[str, object]]:
    """Patch ``os.fsync`` and ``os.rename`` (``Path.rename`` calls it) to record, in order,
    ("fsync", (device, inode) of the descriptor) and ("rename", Path(destination)); both still
    run. Returns the list the events are appended to (a test may append events of its own)."""
    events: list[tuple[str, object]] = []
    real_fsync, real_rename = os.fsync, os.rename

    def fsync(fd):
        st = os.fstat(fd)
        events.append(("fsync", (st.st_dev, st.st_ino)))
        real_fsync(fd)

    def rename(src, dst, *args, **kw):
        real_rename(src, dst, *args, **kw)
        events.append(("rename", Path(dst)))

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    return events


def assert_durably_renamed(events: list[tuple[str, object]], out: Path) -> None:
    """``out`` (a directory) was renamed into place once, after every file and directory under
    it (itself included) was fsynced, and its parent directory was fsynced after that rename."""
    renames = [i for i, e in enumerate(events) if e == ("rename", out)]
    assert len(renames) == 1, renames
    before = {what for e, what in events[: renames[0]] if e == "fsync"}
    tree = [out, *sorted(out.rglob("*"))]
    unsynced = [str(p.relative_to(out.parent)) for p in tree if inode(p) not in before]
    assert unsynced == [], f"not fsynced before the rename: {unsynced}"
    assert ("fsync", inode(out.parent)) in events[renames[0] + 1 :], "the parent not fsynced after the rename"

"""A warm start's saved progress on disk, so that an interrupted build goes on where it stopped.

Governing idea: the directory always holds one complete save. Every file is written under a
temporary name, fsynced and renamed into place; the manifest is renamed last and names the files
of its save, so a save cut short (Ctrl-C, a killed process, a full disk) leaves the previous one
in force. The next save removes the files no manifest names.

Layout::

    <dir>/progress.json      {"format", "meta", "seq", "step", "history", "state": "state-<seq>.pt",
                              "best": "snapshot-<id>.pt", "below": "snapshot-<id>.pt"}
    <dir>/state-<seq>.pt     the WarmStartState fields other than its two snapshots (torch.save;
                             seq counts the saves)
    <dir>/snapshot-<id>.pt   one Snapshot, written once (snapshot ids never repeat in a warm start)

``meta`` says what the progress belongs to (the builder passes its cache key and the tokenizer's
hash); a directory saved with another ``meta`` or another ``PROGRESS_FORMAT`` is not resumed from.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from m3_rollout.model.atomic_file import fsync_dir, write_atomic
from m3_trainers.warm_start import Snapshot, WarmStartState

#: Version of the layout above; a directory of another version is discarded, not read.
#: 2: the state file no longer holds ``next_snapshot_id`` (derived from the snapshots).
PROGRESS_FORMAT = 2
MANIFEST = "progress.json"
_SNAPSHOT_FIELDS = ("best", "below")


def read_manifest(directory: Path) -> dict | None:
    """The manifest of a progress directory, None where there is none or it is unreadable."""
    try:
        data = json.loads((Path(directory) / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def saved_step(directory: Path, meta: dict) -> int | None:
    """The SFT step a build would resume at from ``directory``: None where it holds no progress of
    this format whose meta has ``meta``'s items (a subset: the caller may not know all of it yet)."""
    m = read_manifest(directory)
    if m is None or m.get("format") != PROGRESS_FORMAT or not isinstance(m.get("meta"), dict):
        return None
    if any(m["meta"].get(k) != v for k, v in meta.items()):
        return None
    step = m.get("step")
    return step if isinstance(step, int) else None


class ProgressStore:
    """Save and load one warm start's progress in ``directory``.

    Args:
        directory: created on the first save; :meth:`remove` deletes it (a finished build).
        meta: JSON-able identity of what is built (e.g. ``{"key": ..., "tokenizer": ...}``).

    Attributes:
        discarded: after :meth:`load`, why a directory that held progress was not resumed from
            (another meta or format, unreadable files) and was removed; None otherwise.
    """

    def __init__(self, directory: Path, meta: dict):
        self.dir = Path(directory)
        self.meta = dict(meta)
        self.discarded: str | None = None
        self._seq = 0
        self._written: set[str] = set()  # snapshot files of this warm start already on disk

    def load(self) -> WarmStartState | None:
        """The saved progress (tensors on the CPU), or None: nothing saved, or progress of another
        meta / format, or files that cannot be read (such a directory is removed, see ``discarded``)."""
        self.discarded = None
        if not self.dir.exists():
            return None
        m = read_manifest(self.dir)
        if m is None:  # a first save cut short: nothing complete
            self.remove()
            return None
        if m.get("format") != PROGRESS_FORMAT:
            why = f"it was saved in progress format {m.get('format')!r}, this builder reads {PROGRESS_FORMAT}"
        elif m.get("meta") != self.meta:
            why = f"it was saved for {m.get('meta')}, not {self.meta}"
        else:
            try:
                state = self._read(m)
            except Exception as exc:  # noqa: BLE001 - any unreadable save is discarded alike
                why = f"its files cannot be read ({type(exc).__name__}: {exc})"
            else:
                self._seq = int(m["seq"]) + 1
                self._written = {m[f] for f in _SNAPSHOT_FIELDS}
                return state
        self.discarded = f"the saved progress in {self.dir} was not used and is removed: {why}"
        self.remove()
        return None

    def _read(self, m: dict) -> WarmStartState:
        def load(name: str) -> dict:
            return torch.load(self.dir / name, map_location="cpu", weights_only=True)

        snaps: dict[str, Snapshot] = {}
        for field in _SNAPSHOT_FIELDS:
            if m[field] not in snaps:
                snaps[m[field]] = Snapshot(**load(m[field]))
        fields = load(m["state"])
        return WarmStartState(**fields, **{f: snaps[m[f]] for f in _SNAPSHOT_FIELDS})

    def save(self, state: WarmStartState) -> None:
        """Write ``state`` as the directory's one save (see the module's layout), then remove the
        files of the save before it. Each snapshot is written once: a later save names its file."""
        self.dir.mkdir(parents=True, exist_ok=True)
        names = {}
        for field in _SNAPSHOT_FIELDS:
            snap: Snapshot = getattr(state, field)
            path = self.dir / f"snapshot-{snap.id}.pt"
            if path.name not in self._written:
                write_atomic(path, lambda p, s=snap: torch.save(vars(s), p))
                self._written.add(path.name)
            names[field] = path.name
        fields = {k: v for k, v in vars(state).items() if k not in _SNAPSHOT_FIELDS}  # vars: no copies
        state_path = self.dir / f"state-{self._seq}.pt"
        write_atomic(state_path, lambda p: torch.save(fields, p))
        manifest = {
            "format": PROGRESS_FORMAT,
            "meta": self.meta,
            "seq": self._seq,
            "step": state.step,
            "history": state.history,
            "state": state_path.name,
            **names,
        }
        write_atomic(self.dir / MANIFEST, lambda p: Path(p).write_bytes(json.dumps(manifest, indent=1).encode()))
        fsync_dir(self.dir)
        self._seq += 1
        keep = {MANIFEST, state_path.name, *names.values()}
        self._written &= keep
        for p in self.dir.iterdir():
            if p.name not in keep:
                p.unlink(missing_ok=True)

    def remove(self) -> None:
        """Delete the directory (a finished build, or progress not to be resumed from)."""
        shutil.rmtree(self.dir, ignore_errors=True)

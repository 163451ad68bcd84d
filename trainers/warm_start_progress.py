"""A warm start's saved progress on disk, so that an interrupted build goes on where it stopped.

Governing idea: the directory always holds one complete save. Every file is written under a
temporary name, fsynced and renamed into place; the manifest is renamed last and names the files
of its save, so a save cut short (Ctrl-C, a killed process, a full disk) leaves the previous one
in force. The next save removes the files no manifest names.

Layout::

    <dir>/progress.json      {"format", "meta", "seq", "step", "history", "state": "state-<seq>.pt",
                              "best": "snapshot-<id>.pt", "below": "snapshot-<id>.pt",
                              "live": "snapshot-<id>.pt" or null}
    <dir>/state-<seq>.pt     the WarmStartState fields other than its two snapshots (torch.save;
                             seq counts the saves); without model / optimizer / scheduler where
                             "live" names a snapshot: these are then that snapshot's
    <dir>/snapshot-<id>.pt   one Snapshot, written once (snapshot ids never repeat in a warm start)

"live" names the snapshot (best or below) whose model, optimizer and scheduler state dicts are
bitwise those of the state at the save (a save right after the evaluation that took the snapshot,
or right after going back to it), so the weights and moments are written once, not twice.

``meta`` says what the progress belongs to (the builder passes its cache key and the tokenizer's
hash); a directory saved with another ``meta`` or another ``PROGRESS_FORMAT`` is not resumed from.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import torch

from m3_rollout.model.atomic_file import fsync_dir, write_atomic
from m3_trainers.warm_start import Snapshot, WarmStartState

#: Version of the layout above; a directory of another version is discarded, not read.
#: 2: the state file no longer holds ``next_snapshot_id`` (derived from the snapshots).
#: 3: "live": the state file may leave its model / optimizer / scheduler to a snapshot.
PROGRESS_FORMAT = 3
MANIFEST = "progress.json"
_SNAPSHOT_FIELDS = ("best", "below")
_LIVE_FIELDS = ("model", "optimizer", "scheduler")  # what a state and a snapshot both hold


def _identical(a, b) -> bool:
    """``a`` and ``b`` (state dicts: nested dicts, lists, tuples, tensors, numbers) are the same to the
    bit: same types and keys, tensors of one dtype, shape and device with the same bytes, floats of
    the same bits (``float.hex``: -0.0 is not 0.0)."""
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and (a.dtype, a.shape, a.device) == (b.dtype, b.shape, b.device)
            and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
        )
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_identical(v, b[k]) for k, v in a.items())
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(map(_identical, a, b))
    if isinstance(a, float):
        return a.hex() == b.hex()
    return a == b


def live_snapshot(state: WarmStartState) -> Snapshot | None:
    """The snapshot of ``state`` (best or below) whose model, optimizer and scheduler state dicts are
    bitwise ``state``'s own right now, or None. Only one taken at ``state.step`` can be: the others are
    not compared (a save between evaluations costs no comparison)."""
    for snap in (state.best, state.below):
        if snap.step == state.step and all(_identical(getattr(state, f), getattr(snap, f)) for f in _LIVE_FIELDS):
            return snap
    return None


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
        if m["live"] is not None:
            # NOTE: copies, not the snapshot's dicts: the resumed warm start loads these into its
            # optimizer, which keeps the tensors it is given, and would train the snapshot's moments.
            live = snaps[m["live"]]
            fields.update({f: copy.deepcopy(getattr(live, f)) for f in _LIVE_FIELDS})
        return WarmStartState(**fields, **{f: snaps[m[f]] for f in _SNAPSHOT_FIELDS})

    def save(self, state: WarmStartState) -> None:
        """Write ``state`` as the directory's one save (see the module's layout), then remove the
        files of the save before it. Each snapshot is written once: a later save names its file;
        a state whose model, optimizer and scheduler are a snapshot's (``live_snapshot``) names it too."""
        self.dir.mkdir(parents=True, exist_ok=True)
        names = {}
        for field in _SNAPSHOT_FIELDS:
            snap: Snapshot = getattr(state, field)
            path = self.dir / f"snapshot-{snap.id}.pt"
            if path.name not in self._written:
                write_atomic(path, lambda p, s=snap: torch.save(vars(s), p))
                self._written.add(path.name)
            names[field] = path.name
        live = live_snapshot(state)
        skip = _SNAPSHOT_FIELDS + (_LIVE_FIELDS if live is not None else ())
        fields = {k: v for k, v in vars(state).items() if k not in skip}  # vars: no copies
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
            "live": None if live is None else f"snapshot-{live.id}.pt",
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

"""Refit of worker processes from the trainer's memory on one node: shared once, opened by each worker.

Governing idea: rollout workers beside the trainer (one worker on its GPU, or the P ranks of an
EP group on the node's GPUs, rank r on cuda:r, the trainer sharing one of them) cannot join an
NCCL group with it (NCCL puts one rank of a group on a GPU), and a host round trip would cost two
PCIe transfers of the whole model. Instead each worker opens trainer memory by handle ONCE
(``torch.multiprocessing``'s reductions: a CUDA IPC handle for a CUDA buffer, a shared-memory
file descriptor for a CPU buffer in shared memory, which is how CI runs the same protocol
without a GPU) and copies from it at every update: on the trainer's GPU by the fused copy plan,
from another GPU of the node by peer copies that read the source's current bytes every time
(``copy_plan.PeerCopy``; the receiver's ``_plan_for``). An EP worker keeps only its own experts
(the others have no destination view). What the workers open, the *source*:

- the trainer's compute copy (``source = copy``): a trainer computing in the generation dtype
  keeps a low-precision copy of its masters, re-cast after every optimizer step by an attested
  cast (``cast_copy.CastCopy``) that leaves finite flags. The worker opens the copy's storages
  and reads the update straight from them: ONE device copy per update (copy -> worker
  parameters), validated from the cast's flags, sent by value. Used when the sender hands over
  the copy with its ``CastCopy`` and the copy is current (``share_copy``: on CUDA by default);
- a *stage* (``source = stage``, the fallback: an fp32 trainer, a generation dtype the trainer
  does not compute in, a copy written since its cast, CPU by default): one flat uint8 buffer on
  the trainer's device holding every manifest tensor in its wire dtype at a 16-byte aligned
  offset, filled per update by one fused pass that casts and flags (two device copies per
  update: fill, then the worker's).

Per update:

    trainer (IpcChannel.send_direct)                 worker (IpcRolloutSync.update)
      copy: the cast's flags (one 4-byte read per
        cast), the cast complete on the device,
        the copy lent (no cast until the acks)
      stage: one fused pass casts the trainer's
        tensors into the stage and flags the
        non-finite runs (copy_plan), one host sync
      "update": version, flags, entries and where
        they lie (the first time / when they
        change), the non-finite header positions,
        probe                                    ->   WeightReceiver.receive_direct(header, source
                                                        views, checked=positions): header vs
                                                        handshake, version rule, finite verdict
                                                 <-   status
      all_ok (every worker's status)             ->   apply: atomic commit = one fused copy
                                                        source -> parameters (peer copies from
                                                        another GPU); device syncs (the source
                                                        may be rewritten after the ack)
                                                 <-   probe verdict   } only when the update
      probe_ok                                   ->                      } carries a probe
                                                      finish: version, validity, in-flight end
                                                 <-   ack {version, ok}
      copy: reclaimed (the cast may run again)

With one worker and no probe the worker's own status decides (every worker's verdict is its
own): it applies without the all_ok round trip and its ack carries the status. An update the
trainer refuses itself before filling anything (a non-float tensor, one outside the handshake, a
probe without a reference) is announced as "withdrawn" instead: each worker's update call returns
at once, refused, with its weights and version kept, rather than waiting out ``timeout_s``.

Ordering rule: the source is written only while no worker reads it. The stage is refilled only
by the next update, after every worker acknowledged the last (each syncs its device, and the
source's, before the ack); the copy is written only by the trainer's cast, which refuses to run while the copy is lent
to an update some worker has not acknowledged (``CastCopy.lend``: an interrupted update keeps it
lent until the channel is rebuilt or its workers dropped: a worker reconnects only once its own
update call has returned, its reads done).

Everything but the weights crosses by value over a ``multiprocessing.connection`` pair (pickled
messages, bounded waits: a dead or silent peer is a ``WeightSyncTimeout`` after ``timeout_s``).
The trainer listens on an AF_UNIX address with an auth key (``IpcChannel.endpoint``); workers
connect to it. A worker that dies or restarts is answered like a broken group: the update fails
on the trainer (``WeightUpdateError``, the channel needs a rebuild), the next update accepts the
worker's new connection, repeats the handshake and sends the handles again (the restarted worker
re-opens them), then updates as usual.
"""

from __future__ import annotations

import os
import pickle
import queue
import secrets
import shutil
import tempfile
import threading
import time
import weakref
from multiprocessing.connection import Client, Connection, Listener
from multiprocessing.reduction import ForkingPickler

import torch
import torch.multiprocessing  # noqa: F401  (registers the tensor reductions with ForkingPickler)

from .cast_copy import CastCopy
from .copy_plan import CopyPlan
from .direct import nonfinite
from .group import WeightSyncTimeout
from .in_flight import InFlightOutcome
from .manifest import HandshakeError, TensorSpec, UpdateHeader, manifest_from_bytes, manifest_to_bytes
from .receiver import UpdateResult, WeightReceiver

_ALIGN = 16  # bytes: every stage entry starts on a 16-byte boundary (vector loads / stores)
_STAGE = ("stage",)  # the source of an update read from the stage


def stage_layout(manifest: list[TensorSpec], order: list[int]) -> tuple[list[int], int]:
    """Byte offset of every manifest entry in the stage, laid out in ``order`` (manifest indices;
    the ones it leaves out follow in manifest order), each aligned to 16 bytes. Returns
    (offsets indexed by manifest position, total bytes)."""
    seen = set(order)
    offsets, pos = [0] * len(manifest), 0
    for i in list(order) + [i for i in range(len(manifest)) if i not in seen]:
        offsets[i] = pos
        pos += (manifest[i].nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
    return offsets, max(pos, _ALIGN)


def stage_views(
    buffer: torch.Tensor, offsets: list[int], entries: tuple[tuple[int, tuple[int, ...], torch.dtype], ...]
) -> list[torch.Tensor]:
    """The tensors of header ``entries`` inside the stage ``buffer`` (uint8), in their shapes and
    wire dtypes (views: no copy)."""
    out = []
    for idx, shape, dtype in entries:
        n = dtype.itemsize
        for s in shape:
            n *= s
        out.append(buffer[offsets[idx] : offsets[idx] + n].view(dtype).view(shape))
    return out


def copy_places(
    sources: list[torch.Tensor], storages: list[torch.UntypedStorage]
) -> list[tuple[int, int, tuple[int, ...]]] | None:
    """Where each of ``sources`` lies in ``storages``: (storage index, storage offset in elements,
    stride), or None when some source lies in none of them."""
    index = {st.data_ptr(): i for i, st in enumerate(storages)}
    places = []
    for t in sources:
        i = index.get(t.untyped_storage().data_ptr())
        if i is None:
            return None
        places.append((i, t.storage_offset(), tuple(t.stride())))
    return places


def copy_views(
    flats: list[torch.Tensor],
    places: list[tuple[int, int, tuple[int, ...]]],
    entries: tuple[tuple[int, tuple[int, ...], torch.dtype], ...],
) -> list[torch.Tensor]:
    """The tensors of header ``entries`` inside the shared storages ``flats`` (uint8 tensors over
    whole storages) at ``places`` (``copy_places``), in their shapes and wire dtypes (views).
    Raises RuntimeError (torch) when a place runs past its storage."""
    return [
        flats[i].view(dtype).as_strided(shape, stride, offset)
        for (i, offset, stride), (_, shape, dtype) in zip(places, entries)
    ]


def _flat(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over the whole ``storage`` (what crosses to the workers, by handle)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def synchronize(*devices: torch.device | None) -> None:
    """Wait for the work issued on every CUDA device among ``devices`` (None and CPU skipped): a
    worker's own device, and the source's when that is another GPU (the peer copies of an EP worker
    on cuda:r reading the trainer's stage on its GPU run on the source's stream)."""
    for d in dict.fromkeys(d for d in devices if d is not None and d.type == "cuda"):
        torch.cuda.synchronize(d)


def _drop_socket(listener: Listener, folder: str) -> None:
    """Close ``listener`` (which unlinks its socket file) and remove the folder made for it."""
    listener.close()
    shutil.rmtree(folder, ignore_errors=True)


def _send(conn: Connection, msg, who: str) -> None:
    try:
        conn.send_bytes(ForkingPickler.dumps(msg))
    except (OSError, EOFError, ValueError) as exc:
        raise WeightSyncTimeout(f"weight-sync IPC: {who} went away ({exc})") from exc


def _recv(conn: Connection, timeout_s: float, who: str):
    try:
        if not conn.poll(None if timeout_s == float("inf") else timeout_s):
            raise WeightSyncTimeout(f"weight-sync IPC: no message from {who} within {timeout_s:g} s")
        return pickle.loads(conn.recv_bytes())
    except (OSError, EOFError, ValueError) as exc:
        raise WeightSyncTimeout(f"weight-sync IPC: {who} went away ({exc})") from exc


class IpcChannel:
    """Trainer end of the IPC refit (``weight_sync.backend=ipc``).

    Args:
        n_workers: rollout worker processes that connect (the EP group's P ranks, on the trainer's
            device or on the GPUs of its node).
        device: where the workers' source lives: the trainer's GPU (CUDA IPC), or cpu (shared memory).
        timeout_s: bound on every wait (connections, verdicts).
        address: AF_UNIX socket path to listen on (default: a fresh one in the temp dir).
        share_copy: read the trainer's attested compute copy itself (module docstring) when the
            sender hands it over: None = on CUDA (a CPU copy would have to move into shared
            memory), True = also on CPU (the copy's storages move into shared memory once, in
            place), False = always fill the stage.
    ``endpoint`` = (address, authkey) is what a worker needs (``IpcRolloutSync``). Use with
    ``WeightSender`` (``direct_only``: no bucket path). ``close()`` stops listening and tells the
    workers to stop serving. ``resend_stage``: set it before an update to send the source as it
    stands, without filling it (a restarted worker gets the bytes the others were last given; the
    caller knows they are an update every worker accepted, so nothing in them is flagged; check
    ``can_resend()`` first: a copy cast again since holds other bytes).
    """

    direct = direct_only = True

    def __init__(
        self,
        n_workers: int = 1,
        device: torch.device | str = "cpu",
        timeout_s: float = 60.0,
        address=None,
        share_copy: bool | None = None,
    ):
        if n_workers < 1:
            raise ValueError(f"IpcChannel: n_workers={n_workers} must be >= 1")
        self.n_workers, self.device, self.timeout_s = int(n_workers), torch.device(device), float(timeout_s)
        if self.device.type == "cuda" and self.device.index is None:
            # "cuda" names the current device; tensors say "cuda:N", and the copy's device must match
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.share_copy = share_copy
        folder = None
        if address is None:
            folder = tempfile.mkdtemp(prefix="m3_ipc_")
            address = os.path.join(folder, "refit.sock")
        self.authkey = secrets.token_bytes(16)
        self._listener = Listener(address, family="AF_UNIX", authkey=self.authkey)
        # NOTE: a folder made here goes with close() or, if close is never called, at exit
        self._cleanup = None if folder is None else weakref.finalize(self, _drop_socket, self._listener, folder)
        self.address = self._listener.address
        self._pending: queue.Queue = queue.Queue()
        self._accepting = True
        threading.Thread(target=self._accept, daemon=True, name="m3-ipc-accept").start()
        self.conns: list[Connection] = []
        self.needs_rebuild = False
        self.stage: torch.Tensor | None = None
        self.offsets: list[int] | None = None
        self._shared: set[int] = set()  # ids of connections that hold the stage handle
        self._sent_entries: dict[int, object] = {}  # id(conn) -> the entries tuple it holds
        self._sent_copy: dict[int, tuple] = {}  # id(conn) -> the copy layout whose handles it holds
        self._sent_source: dict[int, object] = {}  # id(conn) -> the source (places) it reads from
        self._fill: tuple | None = None  # (entries, sources, CopyPlan) of the last fill
        # the compute copy shared: (layout key, flat uint8 tensors over its storages, storages)
        self._copy_layout: tuple | None = None
        self._places: tuple | None = None  # (entries, sources, layout key, places or None)
        self._last: tuple | None = None  # what the last update sent: _STAGE / ("copy", cast, its cast count)
        self.resend_stage = False
        self.stats: dict = {}

    @property
    def endpoint(self) -> tuple[str, bytes]:
        """(address, authkey) for the workers (picklable)."""
        return self.address, self.authkey

    @property
    def source_device(self) -> torch.device | None:
        """The device the workers read the last update from (None before any)."""
        if self._last is None:
            return None
        return self._last[1].plan.device if self._last[0] == "copy" else self.stage.device

    def _accept(self) -> None:
        while self._accepting:
            try:
                self._pending.put(self._listener.accept())
            except (OSError, EOFError):  # closed listener, or a client that failed authentication
                if not self._accepting:
                    return

    def connect(self) -> None:
        """Wait (up to ``timeout_s``) until ``n_workers`` workers are connected."""
        deadline = time.monotonic() + self.timeout_s
        while len(self.conns) < self.n_workers:
            try:
                self.conns.append(self._pending.get(timeout=max(deadline - time.monotonic(), 0.01)))
            except queue.Empty:
                raise WeightSyncTimeout(
                    f"weight-sync IPC: {len(self.conns)} of {self.n_workers} rollout workers connected to "
                    f"{self.address} within {self.timeout_s:g} s"
                ) from None

    def _forget_connections(self) -> None:
        self.conns, self._shared, self._sent_entries, self._sent_copy, self._sent_source = [], set(), {}, {}, {}

    def _reclaim(self) -> None:
        """No worker reads the copy any more: the trainer's cast may run again."""
        if self._last is not None and self._last[0] == "copy":
            self._last[1].reclaim()

    def rebuild(self) -> None:
        """Drop every connection (one broke) and wait for the workers to connect again; the
        sender repeats the handshake, and the handles go out again with the next update. A
        worker connects only once its last update call returned (its reads done), so the copy
        is reclaimed once every worker is back."""
        for c in self.conns:
            c.close()
        self._forget_connections()
        self.connect()
        self._reclaim()

    def discard_connections(self) -> None:
        """Close every connection, the accepted ones and those still queued (their workers were
        lost: a restart ends every worker of the group), and mark the channel for a rebuild: the
        next update waits for the new workers' connections. The stage is kept; the copy is
        reclaimed (no worker of the group is left to read it)."""
        for c in self.conns:
            c.close()
        while True:
            try:
                self._pending.get_nowait().close()
            except queue.Empty:
                break
        self._forget_connections()
        self.needs_rebuild = True
        self._reclaim()

    def handshake(self, manifest: list[TensorSpec]) -> list[str]:
        """Send the manifest to every worker; returns their differences (named by worker)."""
        self.connect()
        data = manifest_to_bytes(manifest)
        for c in self.conns:
            _send(c, ("handshake", data), "a rollout worker")
        diffs = []
        for w, c in enumerate(self.conns):
            diffs += [f"worker {w}: {d}" for d in _recv(c, self.timeout_s, f"rollout worker {w}")]
        if self.stage is not None and (self.offsets is None or len(self.offsets) != len(manifest)):
            self.stage = None  # another model: a new stage
            if self._last is _STAGE:
                self._last = None
        self._manifest = manifest
        return diffs

    # ---------------------------------------------------------------- the source
    def _shared_copy(self, header: UpdateHeader, sources: list[torch.Tensor], cast) -> tuple | None:
        """(cast, layout key, places) when this update can be read from the trainer's compute copy
        itself: a ``CastCopy`` handed over with the sources, copy sharing on for this device, the
        copy not written since its cast, every source inside it. None: fill the stage."""
        if not isinstance(cast, CastCopy) or self.share_copy is False:
            return None
        if (self.share_copy is None and self.device.type != "cuda") or cast.plan is None:
            return None
        if cast.plan.device != self.device or not cast.current():
            return None
        c = self._copy_layout
        if c is None or c[0][0] is not cast or c[0][1] != cast.layouts:
            # the copy's storages never move (the trainer's cast writes them in place), but a new
            # cast layout re-reads them anyway (cheap, and a moved copy would be caught here)
            if self.device.type == "cpu":
                cast.share_memory()  # in place, once: the workers open the storages by file descriptor
            storages = cast.storages()
            self._copy_layout = c = ((cast, cast.layouts), [_flat(st) for st in storages], storages)
        f = self._places
        if f is None or f[0] is not header.entries or f[1] is not sources or f[2] is not c[0]:
            places = copy_places(sources, c[2])
            if places is not None and not cast.covers(sources):
                places = None
            self._places = f = (header.entries, sources, c[0], places)
        return None if f[3] is None else (cast, c[0], f[3])

    def can_resend(self) -> bool:
        """Whether the source still holds what the last update sent (``resend_stage``): the stage
        does until the next fill; the copy until its next cast (or a write into it)."""
        if self._last is None:
            return False
        if self._last is _STAGE:
            return self.stage is not None
        cast, casts = self._last[1], self._last[2]
        return cast.casts == casts and cast.current() and not cast.pending()

    def _ensure_stage(self, header: UpdateHeader, sources: list[torch.Tensor]) -> None:
        if self.stage is not None:
            return
        # lay the stage out in the sources' memory order, so the fill pass merges into long runs
        order = [header.entries[k][0] for k in sorted(range(len(sources)), key=lambda k: sources[k].data_ptr())]
        self.offsets, total = stage_layout(self._manifest, order)
        self.stage = torch.empty(total, dtype=torch.uint8, device=self.device)
        if self.device.type == "cpu":
            self.stage.share_memory_()
        self._fill = None

    def _fill_stage(self, header: UpdateHeader, sources: list[torch.Tensor]) -> list[int]:
        """Cast ``sources`` into the stage with the fused copy + finite pass; returns the header
        positions holding non-finite values (one host sync, after which the stage is complete)."""
        f = self._fill
        if f is None or f[0] is not header.entries or f[1] is not sources:
            # NOTE: the plan is cached and reused while the sender passes the same tensors, so a copy
            # of a source made here (``s.to(device)``) would be a snapshot filled again at every later
            # update: a source elsewhere than the stage is refused instead
            away = [k for k, s in enumerate(sources) if s.device != self.device]
            if away:
                k = away[0]
                raise ValueError(
                    f"weight-sync IPC: {self._manifest[header.entries[k][0]].name} is on {sources[k].device}, the "
                    f"stage on {self.device} ({len(away)} tensors elsewhere): the trainer's tensors must be on the "
                    "stage's device (cluster.device)"
                )
            views = stage_views(self.stage, self.offsets, header.entries)
            srcs = list(sources)
            self._fill = f = (header.entries, sources, CopyPlan(views, srcs), views, srcs)
        plan = f[2]
        plan.copy_check()
        members = plan.bad_members()
        if not members:
            return []
        views, srcs = f[3], f[4]
        return [members[j] for j in nonfinite([srcs[i] for i in members], [views[i].dtype for i in members])]

    @staticmethod
    def _copy_verdict(header: UpdateHeader, sources: list[torch.Tensor], cast: CastCopy) -> list[int]:
        """The header positions holding non-finite values, from the cast's flags (one 4-byte read
        per cast; the per-tensor check only when a flag is set); then the host waits for the cast
        to be complete on the device (the workers' streams are not ordered after this process's)."""
        bad = nonfinite(sources, [dt for _, _, dt in header.entries]) if cast.any_bad() else []
        cast.wait_written()
        return bad

    # ---------------------------------------------------------------- one update
    def send_direct(
        self, header: UpdateHeader, sources: list[torch.Tensor], probe=None, attestation=None
    ) -> list[dict]:
        """One update to every worker (module docstring); returns the workers' verdicts (status,
        then the probe's when the update carries one). ``attestation``: the ``CastCopy`` whose
        cast wrote ``sources`` (the copy is then the source, when ``_shared_copy`` allows; else the
        stage's fill flags what it writes in the same pass). Raises WeightSyncTimeout when a worker
        dies or does not answer in time (``needs_rebuild`` is then set by the sender; the copy
        stays lent until the rebuild), RuntimeError for ``resend_stage`` when ``can_resend`` is
        False."""
        t0 = time.perf_counter()
        resend, self.resend_stage = self.resend_stage, False
        if resend:
            copy = self._last is not None and self._last is not _STAGE
            shared = self._shared_copy(header, sources, attestation) if copy else None
            if not self.can_resend() or (copy and (shared is None or shared[0] is not self._last[1])):
                raise RuntimeError(
                    "weight-sync IPC: resend_stage, but the source does not hold the last update any more "
                    "(none sent yet, or the compute copy was cast again since)"
                )
            bad = []
        else:
            shared = self._shared_copy(header, sources, attestation)
            if shared is not None:
                bad = self._copy_verdict(header, sources, shared[0])
                self._last = ("copy", shared[0], shared[0].casts)
            else:
                self._ensure_stage(header, sources)
                bad = self._fill_stage(header, sources)
                self._last = _STAGE
        t_fill = time.perf_counter() - t0
        if shared is not None:
            shared[0].lend(f"the IPC refit to version {header.version}")
            source = ("copy", shared[2])
        else:
            source = _STAGE
        solo = len(self.conns) == 1 and not header.probe
        for w, c in enumerate(self.conns):
            who = f"rollout worker {w}"
            if shared is not None and self._sent_copy.get(id(c)) is not shared[1]:
                _send(c, ("copy", self._copy_layout[1]), who)
                self._sent_copy[id(c)] = shared[1]
            if shared is None and id(c) not in self._shared:
                _send(c, ("stage", self.stage, self.offsets), who)
                self._shared.add(id(c))
            entries = None if self._sent_entries.get(id(c)) is header.entries else header.entries
            key = source[1] if shared is not None else _STAGE  # the places list, or the stage
            src = None if entries is None and self._sent_source.get(id(c)) is key else source
            msg = ("update", header.version, header.include_frozen, header.replace, entries, bad, probe, src, solo)
            _send(c, msg, who)
            self._sent_entries[id(c)], self._sent_source[id(c)] = header.entries, key
        verdicts = []
        if solo:  # one worker, no probe: its own status is the update's verdict, its ack carries it
            acks = self._gather("ack")
            statuses = [a.pop("status", None) for a in acks]
            if None in statuses:
                raise WeightSyncTimeout("weight-sync IPC: the rollout worker's ack carries no status")
        else:
            statuses = self._gather("status")
            all_ok = all(v["ok"] for v in statuses)
            self._broadcast(("all_ok", all_ok))
            if header.probe:  # without a probe the second exchange carries nothing: skip its round trip
                verdicts = self._gather("apply")
                self._broadcast(("probe_ok", all(v["ok"] for v in verdicts)))
            acks = self._gather("ack")
        if shared is not None:
            shared[0].reclaim()
        self.stats = {
            "fill_seconds": t_fill,
            "seconds": time.perf_counter() - t0,
            "acks": acks,
            "source": source[0],
        }
        return statuses + verdicts

    def withdraw(self, header: UpdateHeader, bucket_bytes: int = 0) -> None:
        """Tell every worker that update ``header.version`` is withdrawn (the trainer refused it
        before filling anything): each ends its update call at once, weights and version kept.
        Raises WeightSyncTimeout when a worker's connection is broken."""
        self._broadcast(("withdrawn", int(header.version)))

    def _broadcast(self, msg) -> None:
        for w, c in enumerate(self.conns):
            _send(c, msg, f"rollout worker {w}")

    def _gather(self, kind: str) -> list:
        out = []
        for w, c in enumerate(self.conns):
            got = _recv(c, self.timeout_s, f"rollout worker {w}")
            if not (isinstance(got, tuple) and len(got) == 2 and got[0] == kind):
                raise WeightSyncTimeout(f"weight-sync IPC: rollout worker {w} sent {got!r:.80} instead of {kind}")
            out.append(got[1])
        return out

    def close(self) -> None:
        """Tell the workers to stop serving, close the connections and the listener."""
        self._accepting = False
        for c in self.conns:
            try:
                _send(c, ("close",), "a rollout worker")
            except WeightSyncTimeout:
                pass
            c.close()
        self.conns = []
        self._listener.close()
        self._reclaim()
        if self._cleanup is not None:
            self._cleanup()


class IpcRolloutSync:
    """Worker end of the IPC refit: a ``WeightReceiver`` fed from the trainer's shared source
    (its compute copy, or the stage; module docstring).

    Args:
        receiver: this worker's receiver (``engine_receiver(engine, ...)`` for an engine, or a
            bare ``WeightReceiver`` over a model); its model lives on the source's device or on
            another GPU of the node (peer copies from the source at every update).
        endpoint: ``IpcChannel.endpoint`` of the trainer.
        timeout_s: bound on every wait.
    ``update()`` serves messages until one update finished (the driver calls it while the trainer
    calls ``WeightSender.update``); ``serve()`` loops until the trainer closes the channel.
    """

    def __init__(self, receiver: WeightReceiver, endpoint: tuple[str, bytes], timeout_s: float = 60.0):
        self.receiver, self.endpoint, self.timeout_s = receiver, endpoint, float(timeout_s)
        self.conn: Connection | None = None
        self.stage: torch.Tensor | None = None
        self.offsets: list[int] | None = None
        self.copy: list[torch.Tensor] | None = None  # the trainer's compute copy: uint8 tensors over its storages
        self._entries = None
        self._source = None  # what the updates read: _STAGE, or ("copy", places)
        self._views: dict = {}  # source kind ("copy" / "stage") -> (entries, source, views)
        self.closed = False
        self.last: InFlightOutcome | None = None

    def connect(self) -> None:
        """Connect to the trainer (retrying until ``timeout_s``: it may still be starting)."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                self.conn = Client(self.endpoint[0], family="AF_UNIX", authkey=self.endpoint[1])
                return
            except (OSError, EOFError) as exc:
                if time.monotonic() > deadline:
                    raise WeightSyncTimeout(
                        f"weight-sync IPC: trainer at {self.endpoint[0]} unreachable: {exc}"
                    ) from exc
                time.sleep(0.05)

    def _handshake(self, data: bytes) -> None:
        diffs = self.receiver.check_handshake(manifest_from_bytes(data))
        _send(self.conn, diffs, "the trainer")
        self.stage, self.copy, self._source, self._views = None, None, None, {}
        if diffs:
            raise HandshakeError("weight-sync handshake failed:\n  " + "\n  ".join(diffs))

    def update(self, wait_s: float | None = None) -> InFlightOutcome | None:
        """Serve messages until one update finished; returns its in-flight outcome (None when the
        trainer closed the channel). ``wait_s``: how long to wait for the trainer's first message
        (default ``timeout_s``; None in ``serve``: as long as the trainer trains). A broken
        connection mid-update ends the update with ``needs_rebuild`` (the rank keeps its old
        weights, or turns invalid if bytes landed) and the next call reconnects.
        Raises WeightSyncTimeout when the trainer is gone or silent, HandshakeError when the
        trainer's manifest differs from this rank's."""
        if self.conn is None:
            self.connect()
        wait = self.timeout_s if wait_s is None else wait_s
        while True:
            try:
                msg = _recv(self.conn, wait, "the trainer")
            except WeightSyncTimeout:
                self.conn = None
                raise
            wait = self.timeout_s
            kind = msg[0]
            if kind == "close":
                self.closed = True
                self.conn.close()
                self.conn = None
                return None
            if kind == "handshake":
                self._handshake(msg[1])
            elif kind == "stage":
                self.stage, self.offsets = msg[1], msg[2]
                self._views.pop("stage", None)
            elif kind == "copy":
                self.copy = msg[1]
                self._views.pop("copy", None)
            elif kind == "withdrawn":  # the trainer refused this update itself; nothing follows
                self.last = InFlightOutcome(self.receiver.withdrawn(msg[1]))
                return self.last
            elif kind == "update":
                result = self._receive(*msg[1:])
                policy = self.receiver.in_flight
                last = policy.last if policy is not None else None
                self.last = last if last is not None and last.result is result else InFlightOutcome(result)
                return self.last
            else:
                raise WeightSyncTimeout(f"weight-sync IPC: unexpected message {kind!r} from the trainer")

    def _source_views(self) -> list[torch.Tensor]:
        """The header entries' tensors in the source the trainer named (built once per entries and
        source; one set per source kind, so a trainer alternating between its compute copy and the
        stage hands the receiver the same view lists, whose copy plans it keeps)."""
        kind = self._source[0]
        v = self._views.get(kind)
        if v is not None and v[0] is self._entries:
            if v[1] is not self._source and v[1] == self._source:  # the same places, sent again
                self._source = v[1]
            if v[1] is self._source:
                return v[2]
        if self._source[0] == "copy":
            if self.copy is None:
                raise WeightSyncTimeout("weight-sync IPC: an update from the compute copy arrived before its handles")
            views = copy_views(self.copy, self._source[1], self._entries)
        else:
            if self.stage is None:
                raise WeightSyncTimeout("weight-sync IPC: an update from the stage arrived before its handle")
            views = stage_views(self.stage, self.offsets, self._entries)
        self._views[kind] = (self._entries, self._source, views)
        return views

    def _receive(self, version, include_frozen, replace, entries, bad, probe, source, solo) -> UpdateResult:
        rx = self.receiver
        t0 = time.perf_counter()
        if entries is not None:
            self._entries = entries
        if source is not None:
            self._source = source
        if self._entries is None or self._source is None:
            raise WeightSyncTimeout("weight-sync IPC: an update arrived before its entries and source")
        header = UpdateHeader(int(version), bool(include_frozen), self._entries, bool(replace), probe is not None)
        views = self._source_views()
        try:
            try:
                rx.receive_direct(header, views, probe, checked=list(bad))
                status = rx.status()
                if solo:  # the only worker: every worker's verdict is this one (it travels with the ack)
                    all_ok = status["ok"]
                else:
                    _send(self.conn, ("status", status), "the trainer")
                    all_ok = _recv(self.conn, self.timeout_s, "the trainer")[1]
                verdict = rx.apply(all_ok)
                # the trainer may rewrite the source after the ack: every copy out of it done first
                synchronize(views[0].device if views else None, rx.device)
                if probe is not None:
                    _send(self.conn, ("apply", verdict), "the trainer")
                    probe_ok = _recv(self.conn, self.timeout_s, "the trainer")[1]
                else:
                    probe_ok = verdict["ok"]
            except WeightSyncTimeout as exc:
                self.conn = None
                return rx.interrupted(f"update interrupted: {exc}")
        except BaseException:
            rx.abandon()
            raise
        result = rx.finish(all_ok, probe_ok, time.perf_counter() - t0)
        try:
            ack = {"version": result.version, "ok": result.ok}
            if solo:
                ack["status"] = status
            _send(self.conn, ("ack", ack), "the trainer")
        except WeightSyncTimeout:
            self.conn = None
        return result

    def serve(self, on_update=None) -> None:
        """Serve updates until the trainer closes the channel; ``on_update(outcome)`` after each.
        A broken connection is re-established (the trainer rebuilds the channel)."""
        while not self.closed:
            try:
                outcome = self.update(wait_s=float("inf"))
            except WeightSyncTimeout:
                if self.closed:
                    return
                self.connect()
                continue
            if outcome is not None and on_update is not None:
                on_update(outcome)

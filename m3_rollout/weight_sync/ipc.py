"""Refit across processes on ONE device: the trainer's stage shared once, opened by each worker.

Governing idea: a rollout worker beside the trainer on the same GPU (one worker actor per GPU in
a Ray deployment) cannot join an NCCL group with it (NCCL puts one rank on a GPU), and a host
round trip would cost two PCIe transfers of the whole model. Instead the trainer keeps a *stage*
— one flat uint8 buffer on its device holding every manifest tensor in its wire dtype at a
16-byte aligned offset — and hands each worker a handle to it ONCE (``torch.multiprocessing``'s
reductions: a CUDA IPC handle for a CUDA buffer, a shared-memory file descriptor for a CPU buffer
made with ``share_memory_()``, which is how CI runs the same protocol without a GPU). Per update:

    trainer (IpcChannel.send_direct)                 worker (IpcRolloutSync.update)
      fill: one fused pass casts the trainer's
        tensors (its attested bf16 copy when it
        keeps one) into the stage and flags the
        non-finite runs (copy_plan), one host sync
      "update": version, flags, entries (the
        first time / when they change), the
        non-finite header positions, probe       ->   WeightReceiver.receive_direct(header, stage
                                                        views, checked=positions): header vs
                                                        handshake, version rule, finite verdict
                                                 <-   status
      all_ok (every worker's status)             ->   apply: atomic commit = one fused copy
                                                        stage -> parameters; device sync (the
                                                        stage may be overwritten after the ack)
                                                 <-   probe verdict   } only when the update
      probe_ok                                   ->                      } carries a probe
                                                      finish: version, validity, in-flight end
                                                 <-   ack {version, ok}

Everything but the weights crosses by value over a ``multiprocessing.connection`` pair (pickled
messages, bounded waits: a dead or silent peer is a ``WeightSyncTimeout`` after ``timeout_s``).
The trainer listens on an AF_UNIX address with an auth key (``IpcChannel.endpoint``); workers
connect to it. A worker that dies or restarts is answered like a broken group: the update fails
on the trainer (``WeightUpdateError``, the channel needs a rebuild), the next update accepts the
worker's new connection, repeats the handshake and sends the stage handle again (the restarted
worker re-opens it), then updates as usual. The stage is written only between a worker's ack
and the next update, so a worker never reads a half-filled stage.
"""

from __future__ import annotations

import os
import pickle
import queue
import secrets
import tempfile
import threading
import time
from multiprocessing.connection import Client, Connection, Listener
from multiprocessing.reduction import ForkingPickler

import torch
import torch.multiprocessing  # noqa: F401  (registers the tensor reductions with ForkingPickler)

from .copy_plan import CopyPlan
from .direct import nonfinite
from .group import WeightSyncTimeout
from .in_flight import InFlightOutcome
from .manifest import HandshakeError, TensorSpec, UpdateHeader, manifest_from_bytes, manifest_to_bytes
from .receiver import UpdateResult, WeightReceiver

_ALIGN = 16  # bytes: every stage entry starts on a 16-byte boundary (vector loads / stores)


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
        n_workers: rollout worker processes that connect (one per device beside the trainer).
        device: where the stage lives: the trainer's GPU (CUDA IPC), or cpu (shared memory).
        timeout_s: bound on every wait (connections, verdicts).
        address: AF_UNIX socket path to listen on (default: a fresh one in the temp dir).
    ``endpoint`` = (address, authkey) is what a worker needs (``IpcRolloutSync``). Use with
    ``WeightSender`` (``direct_only``: no bucket path). ``close()`` stops listening and tells the
    workers to stop serving. ``resend_stage``: set it before an update to send the stage as it
    stands, without filling it (a restarted worker gets the bytes the others were last given; the
    caller knows they are an update every worker accepted, so nothing in them is flagged).
    """

    direct = direct_only = True

    def __init__(self, n_workers: int = 1, device: torch.device | str = "cpu", timeout_s: float = 60.0, address=None):
        if n_workers < 1:
            raise ValueError(f"IpcChannel: n_workers={n_workers} must be >= 1")
        self.n_workers, self.device, self.timeout_s = int(n_workers), torch.device(device), float(timeout_s)
        if address is None:
            address = os.path.join(tempfile.mkdtemp(prefix="m3_ipc_"), "refit.sock")
        self.authkey = secrets.token_bytes(16)
        self._listener = Listener(address, family="AF_UNIX", authkey=self.authkey)
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
        self._fill: tuple | None = None  # (entries, sources, CopyPlan) of the last fill
        self.resend_stage = False
        self.stats: dict = {}

    @property
    def endpoint(self) -> tuple[str, bytes]:
        """(address, authkey) for the workers (picklable)."""
        return self.address, self.authkey

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

    def rebuild(self) -> None:
        """Drop every connection (one broke) and wait for the workers to connect again; the
        sender repeats the handshake, and the stage handle goes out again with the next update."""
        for c in self.conns:
            c.close()
        self.conns, self._shared, self._sent_entries = [], set(), {}
        self.connect()

    def discard_connections(self) -> None:
        """Close every connection, the accepted ones and those still queued (their workers were
        lost: a restart ends every worker of the group), and mark the channel for a rebuild: the
        next update waits for the new workers' connections. The stage is kept."""
        for c in self.conns:
            c.close()
        while True:
            try:
                self._pending.get_nowait().close()
            except queue.Empty:
                break
        self.conns, self._shared, self._sent_entries = [], set(), {}
        self.needs_rebuild = True

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
        self._manifest = manifest
        return diffs

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
            views = stage_views(self.stage, self.offsets, header.entries)
            srcs = [s if s.device == self.device else s.to(self.device) for s in sources]
            self._fill = f = (header.entries, sources, CopyPlan(views, srcs), views, srcs)
        plan = f[2]
        plan.copy_check()
        members = plan.bad_members()
        if not members:
            return []
        views, srcs = f[3], f[4]
        return [members[j] for j in nonfinite([srcs[i] for i in members], [views[i].dtype for i in members])]

    def send_direct(
        self, header: UpdateHeader, sources: list[torch.Tensor], probe=None, attestation=None
    ) -> list[dict]:
        """One update to every worker (module docstring); returns the workers' verdicts (status,
        then the probe's when the update carries one). ``attestation`` is not needed: the fill
        flags what it writes in the same pass. Raises WeightSyncTimeout when a worker dies or
        does not answer in time (``needs_rebuild`` is then set by the sender)."""
        t0 = time.perf_counter()
        resend, self.resend_stage = self.resend_stage, False
        if resend and self.stage is None:
            raise RuntimeError("weight-sync IPC: resend_stage with no stage filled yet")
        if not resend:
            self._ensure_stage(header, sources)
        bad = [] if resend else self._fill_stage(header, sources)
        t_fill = time.perf_counter() - t0
        for w, c in enumerate(self.conns):
            if id(c) not in self._shared:
                _send(c, ("stage", self.stage, self.offsets), f"rollout worker {w}")
                self._shared.add(id(c))
            entries = None if self._sent_entries.get(id(c)) is header.entries else header.entries
            msg = ("update", header.version, header.include_frozen, header.replace, entries, bad, probe)
            _send(c, msg, f"rollout worker {w}")
            self._sent_entries[id(c)] = header.entries
        statuses = self._gather("status")
        all_ok = all(v["ok"] for v in statuses)
        self._broadcast(("all_ok", all_ok))
        verdicts = []
        if header.probe:  # without a probe the second exchange carries nothing: skip its round trip
            verdicts = self._gather("apply")
            self._broadcast(("probe_ok", all(v["ok"] for v in verdicts)))
        acks = self._gather("ack")
        self.stats = {"fill_seconds": t_fill, "seconds": time.perf_counter() - t0, "acks": acks}
        return statuses + verdicts

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


class IpcRolloutSync:
    """Worker end of the IPC refit: a ``WeightReceiver`` fed from the trainer's shared stage.

    Args:
        receiver: this worker's receiver (``engine_receiver(engine, ...)`` for an engine, or a
            bare ``WeightReceiver`` over a model); its model lives on the stage's device.
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
        self._entries = None
        self._views: tuple | None = None  # (entries, views) of the stage
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
        self.stage, self._views = None, None
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
                self.stage, self.offsets, self._views = msg[1], msg[2], None
            elif kind == "update":
                result = self._receive(*msg[1:])
                policy = self.receiver.in_flight
                last = policy.last if policy is not None else None
                self.last = last if last is not None and last.result is result else InFlightOutcome(result)
                return self.last
            else:
                raise WeightSyncTimeout(f"weight-sync IPC: unexpected message {kind!r} from the trainer")

    def _receive(self, version, include_frozen, replace, entries, bad, probe) -> UpdateResult:
        rx = self.receiver
        t0 = time.perf_counter()
        if entries is not None:
            self._entries = entries
        if self._entries is None or self.stage is None:
            raise WeightSyncTimeout("weight-sync IPC: an update arrived before the stage and its entries")
        header = UpdateHeader(int(version), bool(include_frozen), self._entries, bool(replace), probe is not None)
        if self._views is None or self._views[0] is not self._entries:
            self._views = (self._entries, stage_views(self.stage, self.offsets, self._entries))
        try:
            try:
                rx.receive_direct(header, self._views[1], probe, checked=list(bad))
                _send(self.conn, ("status", rx.status()), "the trainer")
                all_ok = _recv(self.conn, self.timeout_s, "the trainer")[1]
                verdict = rx.apply(all_ok)
                if self.stage.is_cuda:
                    torch.cuda.synchronize(self.stage.device)  # the trainer may refill the stage after the ack
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
            _send(self.conn, ("ack", {"version": result.version, "ok": result.ok}), "the trainer")
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

"""Trainer side of weight sync: handshake once, then versioned bucketed updates (design.md §3).

Governing idea: the sender reads the trainer's live tensors (released names, iter_released_tensors
order) each update, casts them to the wire dtype while packing per-dtype buckets, and pushes the
buckets through a channel: ``BroadcastChannel`` (one ``WeightSyncGroup`` broadcast per bucket
from trainer rank 0, packed on a side stream into a ring of three wire buffers, so bucket k+1 is
packed while k is on the wire; ring.py; a data-parallel trainer's other ranks take part without
packing) or ``ColocatedChannel`` (receivers in the same process: the direct copy plan,
or the same bucket pipeline in loopback with a device copy standing in for the broadcast; the
path for a trainer and rollout sharing one device, where NCCL cannot put two ranks). Either way
the other end is a ``WeightReceiver``, which runs every check (receiver.py). Both end with the
verdict exchanges (status; the probe's when the update carries one); any rank's failure raises
``WeightUpdateError`` on the trainer naming the rank and tensors.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterable

import torch

from .buckets import Bucket, BucketPacker, plan_buckets
from .group import WeightSyncGroup, WeightSyncTimeout
from .manifest import (
    HandshakeError,
    TensorSpec,
    UpdateHeader,
    decode_header,
    default_frozen,
    encode_header,
    manifest_from_bytes,
    manifest_to_bytes,
    sender_manifest,
)
from .probe import ProbeData, ProbeSettings, Scorer, build_probe
from .receiver import WeightReceiver
from .released import ReleasedTensors
from .ring import BucketRing, SlotEvents, StreamSwitch, pipelined

NamedTensors = Callable[[], Iterable[tuple[str, torch.Tensor]]]
# Test hook: called as fault(k, wire_buffer) after bucket k is packed and checksummed, before it is
# sent (on the packing stream).
FaultHook = Callable[[int, torch.Tensor], None]


class WeightUpdateError(RuntimeError):
    """An update was rejected or interrupted; the message names the rank and tensor(s)."""


class BroadcastChannel:
    """Sender end over a ``WeightSyncGroup``, on any of the trainer's ranks (``group.rank`` below
    ``group.train_world_size``).

    Trainer rank 0 is the source of every tensor: it packs the buckets and broadcasts them. A
    data-parallel trainer's other ranks (NeMo RL's policy workers all join the refit group) run the
    same ``WeightSender.update`` with their own copy of the weights, so collective gathers inside
    ``named_tensors()`` (a sharded trainer's full tensors) happen on every trainer rank in step, and
    take part in each collective: the manifest, header and buckets broadcast from rank 0 land in
    their buffers (they pack nothing). Each checks that rank 0's manifest and header equal its own
    and reports a difference in its verdict, which fails the update on every rank.

    ``double_buffer``: a ring of three wire buffers (pack k+1 while k is on the wire and k-1 is
    still being received); False: one buffer, one bucket at a time."""

    def __init__(self, group: WeightSyncGroup, double_buffer: bool = True):
        if not 0 <= group.rank < group.train_world_size:
            raise ValueError(
                f"the weight sender must be one of the trainer's ranks [0, {group.train_world_size}) of the "
                f"weight-sync group, not rank {group.rank}"
            )
        self.group, self.double_buffer = group, double_buffer
        self.direct = self.direct_only = False  # buckets over the group
        self.device = group.device
        self.needs_rebuild = False
        self._ring = BucketRing(self.device, 3 if double_buffer else 1)

    @property
    def source(self) -> bool:
        """Whether this rank's tensors go on the wire (trainer rank 0)."""
        return self.group.rank == 0

    def rebuild(self) -> None:
        """Rebuild the broken group (a new rendezvous token); the sender re-runs the handshake."""
        self.group.rebuild()

    def _from_source(self, mine: torch.Tensor) -> torch.Tensor:
        """Broadcast the 1-D tensor ``mine`` from trainer rank 0; returns rank 0's tensor on every
        rank. The length goes first, so a rank whose own tensor differs in size still receives it."""
        n = torch.tensor([mine.numel()], dtype=torch.int64, device=self.device)
        self.group.broadcast(n)
        out = mine.to(self.device) if self.source else torch.empty(int(n), dtype=mine.dtype, device=self.device)
        self.group.broadcast(out)
        return out

    def handshake(self, manifest: list[TensorSpec]) -> list[str]:
        data = manifest_to_bytes(manifest)
        sent = self._from_source(torch.frombuffer(bytearray(data), dtype=torch.uint8)).cpu().numpy().tobytes()
        mine = []
        if sent != data:
            theirs = manifest_from_bytes(sent)
            i = next((i for i, (a, b) in enumerate(zip(theirs, manifest)) if a != b), min(len(theirs), len(manifest)))
            at = [m[i] if i < len(m) else "(end of list)" for m in (theirs, manifest)]
            mine = [
                f"trainer rank {self.group.rank}: its tensor list differs from trainer rank 0's at entry {i}: "
                f"rank 0 {at[0]}, this rank {at[1]}"
            ]
        verdicts = self.group.exchange_objects(mine)
        return [d for v in verdicts for d in v]

    def withdraw(self, header: UpdateHeader, bucket_bytes: int = 0) -> None:
        """Broadcast ``header`` (its withdrawn flag set): the receivers end that update at once.
        Raises WeightSyncTimeout when the group does not take it."""
        self.send(header, [], lambda k, buf: None, bucket_bytes)

    def send(
        self,
        header: UpdateHeader,
        plan: list[Bucket],
        pack: Callable[[int, torch.Tensor], None],
        bucket_bytes: int = 0,
        probe=None,
    ) -> list[dict]:
        """Header, probe, buckets, then the verdict exchanges; returns the verdicts of every rank
        but trainer rank 0 (status, and the probe's when there is one). ``bucket_bytes`` (the
        sender's) re-plans the buckets on a trainer rank whose header differs from rank 0's."""
        errors: list[str] = []
        got = self._from_source(encode_header(header))
        sent = header if self.source else decode_header(got.cpu())
        if sent.withdrawn:  # rank 0 refused its own update: nothing follows on any rank
            if not header.withdrawn:
                raise WeightUpdateError(
                    f"weight update {sent.version}: trainer rank 0 withdrew it before sending (its error says why)"
                )
            return []
        if sent != header:
            errors.append(
                f"trainer rank {self.group.rank}: its update (version {header.version}, {len(header.entries)} "
                f"tensors) differs from trainer rank 0's (version {sent.version}, {len(sent.entries)} tensors)"
            )
            plan = plan_buckets([(shape, dt) for _, shape, dt in sent.entries], bucket_bytes)
        if sent.probe:
            self.group.exchange_objects(probe if self.source else None)
        ring = self._ring
        ring.reserve(max((b.wire_bytes for b in plan), default=8))  # kept between updates
        ring.start()  # the pack reads the trainer's tensors after its last writes
        pending: deque = deque()
        try:
            for k, b in enumerate(plan):
                with ring.side():
                    if len(pending) == ring.slots:  # the slot's last broadcast (bucket k - slots) is done
                        self.group.wait(pending.popleft())  # NCCL: a stream wait; gloo: the host waits
                    buf = ring.buffer(k, b.wire_bytes)
                    if self.source:  # the other trainer ranks receive (and drop) rank 0's bucket
                        pack(k, buf)
                    # issued from the side stream: NCCL's stream waits for the pack, the host does not
                    pending.append(self.group.broadcast(buf, async_op=True))
            with ring.side():
                while pending:
                    self.group.wait(pending.popleft())
        finally:
            ring.finish()  # the trainer's next writes wait for the packs and the sends
        verdicts = self.group.exchange_objects({"ok": not errors, "errors": errors})[1:]
        if sent.probe:
            verdicts += self.group.exchange_objects({"ok": True, "errors": [], "drift": None})[1:]
        return verdicts


class ColocatedChannel:
    """Sender end for receivers living in this process (weight_sync.method=colocated).

    ``direct=True`` (``build_weight_sender`` sets it; the class default keeps the bucket path the
    wire-format tests exercise): no buckets; each trainer tensor is copied straight into every
    receiver's destination view (``WeightReceiver.receive_direct``, ``direct.py``): no packing,
    no checksum (nothing crosses a transport), a fused finite check before committing when
    atomic. ``direct=False`` (and whenever the sender has a ``fault`` hook, which works on wire
    buffers): the broadcast pipeline in loopback (design.md §3 format in memory): each bucket
    is packed into this channel's ring on its side stream, copied into every receiver's
    ``bucket_buffer`` on a transfer stream (the stand-in for the broadcast), and validated and
    unpacked on each receiver's side stream, ordered by events only.
    """

    def __init__(self, receivers: list[WeightReceiver], device: torch.device | str = "cpu", direct: bool = False):
        self.receivers, self.device = list(receivers), torch.device(device)
        self.direct, self.direct_only = bool(direct), False
        self.needs_rebuild = False
        self._ring = BucketRing(self.device, 3)
        self._transfer = torch.cuda.Stream(self._ring.device) if pipelined(self.device) else None
        self._on_transfer = StreamSwitch(self._transfer)
        # bucket k packed (side stream) / copied into every receiver (transfer stream): one event per slot
        self._packed = SlotEvents(self.device, 3)
        self._arrived = SlotEvents(self.device, 3)

    def send_direct(
        self, header: UpdateHeader, sources: list[torch.Tensor], probe: ProbeData | None = None, attestation=None
    ) -> list[dict]:
        """Direct update: every receiver validates / copies ``sources`` (header order), then all
        commit or all discard. ``attestation``: the ``CastCopy`` that wrote ``sources`` (the
        receivers validate from its flags when it is current). Returns each receiver's verdicts."""

        def receive_all() -> None:
            for r in self.receivers:
                r.receive_direct(header, sources, probe, attested=attestation)

        return self._run(receive_all)

    def rebuild(self) -> None:
        """Nothing to rebuild in process (``needs_rebuild`` is never set here)."""

    def handshake(self, manifest: list[TensorSpec]) -> list[str]:
        return [f"receiver {i}: {d}" for i, r in enumerate(self.receivers) for d in r.check_handshake(manifest)]

    def withdraw(self, header: UpdateHeader, bucket_bytes: int = 0) -> None:
        """Nothing to tell: receivers in this process wait for no update."""

    def send(
        self,
        header: UpdateHeader,
        plan: list[Bucket],
        pack: Callable[[int, torch.Tensor], None],
        bucket_bytes: int = 0,
        probe: ProbeData | None = None,
    ) -> list[dict]:
        """Bucketed update in memory (design.md §3 format); returns each receiver's verdicts."""

        def receive_all() -> None:
            for r in self.receivers:
                r.begin(header, bucket_bytes, probe)
            ring, transfer = self._ring, self._transfer
            ring.reserve(max((b.wire_bytes for b in plan), default=8))
            ring.start()
            side = ring.stream
            try:
                for k, b in enumerate(plan):
                    src = ring.buffer(k, b.wire_bytes)
                    ring.acquire(k, side)  # the copy out of this slot (bucket k - slots) is done
                    with ring.side():
                        pack(k, src)
                    self._packed.record(k, side)
                    self._packed.wait(k, transfer)
                    dsts = []
                    with self._on_transfer:
                        for r in self.receivers:
                            dst = r.bucket_buffer(k)
                            r.wait_buffer_free(k, transfer)  # its unpack of bucket k - slots is done
                            dst.copy_(src)
                            dsts.append(dst)
                    ring.release(k, transfer)
                    self._arrived.record(k, transfer)
                    arrived = self._arrived.event(k)
                    for r, dst in zip(self.receivers, dsts):
                        r.on_bucket(k, dst, ready=arrived)
            finally:
                ring.finish()
                if transfer is not None:
                    torch.cuda.current_stream(self.device).wait_stream(transfer)

        return self._run(receive_all)

    def _run(self, receive_all: Callable[[], None]) -> list[dict]:
        """``receive_all()``, then the two verdict phases over every receiver."""
        t0 = time.perf_counter()
        try:
            for i, r in enumerate(self.receivers):  # a lone receiver (the in-process engine) names none
                r.rank_label = f"receiver {i}" if len(self.receivers) > 1 else None
            receive_all()
            verdicts = [r.status() for r in self.receivers]
            all_ok = all(v["ok"] for v in verdicts)
            probes = [r.apply(all_ok) for r in self.receivers]
        except BaseException:
            for r in self.receivers:
                r.abandon()
            raise
        probe_ok = all(v["ok"] for v in probes)
        self.results = [r.finish(all_ok, probe_ok, time.perf_counter() - t0) for r in self.receivers]
        return verdicts + probes


class WeightSender:
    """Pushes the trainer's weights to every rollout rank.

    Args:
        named_tensors: callable returning (released name, tensor) pairs of the trainer model in
            ``iter_released_tensors`` order (e.g. ``Policy.named_released_tensors``).
        channel: ``BroadcastChannel``, ``ColocatedChannel`` or ``ipc.IpcChannel`` (``direct``: the
            update goes through ``channel.send_direct`` as (header, source tensors); ``direct_only``:
            the channel has no bucket path).
        bucket_size_mb: max data bytes per bucket (weight_sync.bucket_size_mb).
        generation_dtype: rollout dtype; tensors are cast to it on the wire (router >= fp32).
            None = send in the trainer's dtypes.
        frozen: names left out of updates unless ``include_frozen``.
        fault: test hook (``FaultHook``).
        probe: ``weight_sync.probe`` settings (None: no probe); needs ``reference`` by the first update.
        reference: the trainer's scorer for the probe ids (``probe.model_scorer(trainer model)``),
            called with the weights being sent.
    Raises ValueError for bucket_size_mb <= 0, or a fault hook on a channel without buckets.

    ``withdrawn``: the version of the last ``update`` when this sender refused it itself and
    withdrew it before packing or filling anything, else None. It sent nothing: over an IPC or
    colocated channel (and from trainer rank 0 of a broadcast group) the channel's source and the
    ranks' weights are as they were; a broadcast group's other trainer ranks take part in rank 0's
    update instead when rank 0 did not withdraw it.
    """

    def __init__(
        self,
        named_tensors: NamedTensors,
        channel,
        bucket_size_mb: float = 512,
        generation_dtype: torch.dtype | None = None,
        frozen: Callable[[str], bool] = default_frozen,
        fault: FaultHook | None = None,
        probe: ProbeSettings | None = None,
        reference: Scorer | None = None,
    ):
        if not bucket_size_mb > 0:
            raise ValueError(f"weight_sync.bucket_size_mb={bucket_size_mb}: must be > 0")
        if fault is not None and channel.direct_only:
            raise ValueError(f"{type(channel).__name__} moves no buckets; the fault hook works on bucket wire buffers")
        self.named_tensors, self.channel = named_tensors, channel
        self.bucket_bytes = int(bucket_size_mb * 2**20)
        self.generation_dtype, self.frozen, self.fault = generation_dtype, frozen, fault
        self.probe, self.reference = probe, reference
        self.manifest: list[TensorSpec] | None = None
        self.stats: dict = {}
        self.withdrawn: int | None = None
        self._source_cache: dict[tuple, tuple] = {}  # (include_frozen, manifest id, fingerprint) -> _resolve()
        self._packer: tuple | None = None  # (entries, bucket bytes, source addresses, BucketPacker)

    def handshake(self) -> None:
        """Send the manifest; raises HandshakeError listing every rank's differences."""
        manifest = sender_manifest(self.named_tensors(), self.generation_dtype, self.frozen)
        problems = self.channel.handshake(manifest)
        if problems:
            raise HandshakeError("weight-sync handshake failed:\n  " + "\n  ".join(problems))
        self.manifest = manifest

    def _probe_data(self) -> ProbeData | None:
        if self.probe is None:
            return None
        if self.reference is None:
            raise WeightUpdateError(
                "weight_sync.probe.enabled=true needs the trainer's reference scorer: set it with "
                "set_probe_reference(m3_rollout.weight_sync.probe.model_scorer(trainer_model)) (the job does)"
            )
        vocab = next((s.shape[0] for s in self.manifest if s.name.endswith("embed_tokens.weight")), None)
        if vocab is None:
            raise WeightUpdateError("weight_sync.probe: no embed_tokens.weight in the manifest to size the probe ids")
        return build_probe(vocab, self.probe, self.reference)

    def update(self, version: int, include_frozen: bool = False, replace: bool = False) -> dict:
        """Send the current weights as ``version``. Returns stats (bytes, seconds, GB/s,
        ``probe_drift``: the largest rank's probe figure or None).

        ``version`` must exceed the ranks' version; ``replace=True`` re-sends the version they
        hold (receiver.py). Raises:
            WeightUpdateError: some rank rejected the update (bad version, tensors, probe; atomic
                ranks keep their old weights and version, non-atomic ones that wrote bytes turn
                invalid) or the transport failed (the channel then needs a rebuild, done at the
                start of the next update).
        """
        if isinstance(version, bool) or not isinstance(version, int) or version >= 2**62:
            # 2.5 was truncated to 2, True read as 1, and 2**70 locked every later version out
            # (negative versions reach the receivers, which refuse them with their own rule)
            raise WeightUpdateError(f"weight version {version!r}: must be an integer below 2**62")
        self.withdrawn = None
        if self.channel.needs_rebuild:
            try:
                self.channel.rebuild()
            except WeightSyncTimeout as exc:
                raise WeightUpdateError(f"weight update {version}: the channel could not be rebuilt: {exc}") from exc
            self.channel.needs_rebuild = False
            self.manifest = None
        if self.manifest is None:
            try:
                self.handshake()
            except WeightSyncTimeout as exc:  # a peer missing or gone: rebuild at the next update
                self.channel.needs_rebuild = True
                raise WeightUpdateError(f"weight update {version}: handshake failed: {exc}") from exc
        t0 = time.perf_counter()
        direct = self.channel.direct and (self.fault is None or self.channel.direct_only)
        try:
            sources, entries, nbytes, cast = self._sources(include_frozen, direct)
            probe = self._probe_data()
        except WeightUpdateError:
            self._withdraw(version, include_frozen, replace)
            raise
        header = UpdateHeader(int(version), include_frozen, entries, bool(replace), probe is not None)
        if direct:
            try:
                verdicts = self.channel.send_direct(header, sources, probe, cast)
            except WeightSyncTimeout as exc:
                self.channel.needs_rebuild = True
                raise WeightUpdateError(f"weight update {version} interrupted: {exc}") from exc
            return self._finish(version, verdicts, t0, nbytes, 0)
        packer = self._packer_for(entries, sources)
        plan = packer.plan
        pack = packer.pack
        if self.fault is not None:

            def pack(k: int, buf: torch.Tensor) -> None:
                packer.pack(k, buf)
                self.fault(k, buf)

        try:
            with torch.no_grad():
                verdicts = self.channel.send(header, plan, pack, self.bucket_bytes, probe)
        except WeightSyncTimeout as exc:
            self.channel.needs_rebuild = True
            raise WeightUpdateError(f"weight update {version} interrupted: {exc}") from exc
        return self._finish(version, verdicts, t0, sum(b.data_bytes for b in plan), len(plan))

    def _withdraw(self, version: int, include_frozen: bool, replace: bool) -> None:
        """After refusing an update before packing it: tell the receivers that wait for it (the
        channel's ``withdraw``: a withdrawn header over a broadcast group, manifest.py; a
        "withdrawn" message to IPC workers, ipc.py), so they end the update now with their weights
        and version unchanged and stay in step. (In-process receivers wait for nothing.) A trainer
        rank other than 0 takes part in rank 0's update instead when rank 0 did not withdraw it,
        and fails it with a verdict error."""
        self.withdrawn = int(version)
        header = UpdateHeader(int(version), include_frozen, (), bool(replace), False, True)
        try:
            self.channel.withdraw(header, self.bucket_bytes)
        except WeightSyncTimeout:  # nobody took the message: both ends rebuild at the next update
            self.channel.needs_rebuild = True

    def _packer_for(self, entries: tuple, sources: list[torch.Tensor]) -> BucketPacker:
        """The bucket plan and packer of ``entries`` / ``sources``, reused (with its fused passes)
        while the header entries and the sources' devices, addresses, dtypes and strides stay the
        same (the cached views then alias the same live storages)."""
        c = self._packer
        if c is not None and c[1] == self.bucket_bytes and c[0] is entries and c[3].sources is sources:
            return c[3]  # the source cache handed back the same objects (ReleasedTensors)
        addresses = tuple((t.device, t.data_ptr(), t.dtype, t.stride()) for t in sources)
        if c is not None and c[1] == self.bucket_bytes and c[2] == addresses and c[0] == entries:
            c[3].sources = sources  # read by the per-segment fallback (non-contiguous sources)
            return c[3]
        self._packer = None
        plan = plan_buckets([(shape, dt) for _, shape, dt in entries], self.bucket_bytes)
        packer = BucketPacker(plan, sources)
        self._packer = (entries, self.bucket_bytes, addresses, packer)
        return packer

    def _sources(self, include_frozen: bool, direct: bool = False) -> tuple[list[torch.Tensor], tuple, int, object]:
        """(source tensors, header entries, wire bytes, attestation) of an update, in manifest order.

        ``direct`` and a ``ReleasedTensors`` with a cast copy that holds every tensor in its wire
        dtype (the trainer computes in the generation dtype): the copy, refreshed if the masters
        moved on, and the ``CastCopy`` as the attestation the receivers validate from
        (``cast_copy.py``). Otherwise the tensors themselves and None."""
        named = self.named_tensors()
        cast = named.cast if direct and isinstance(named, ReleasedTensors) else None
        if cast is not None:
            cast.refresh()  # reads the layout too: the copy's fingerprint is the cast (held) and its count
            key = (cast, cast.layouts)
            sources, entries, nbytes, in_wire_dtypes = self._resolve(cast.released, include_frozen, key)
            if in_wire_dtypes:
                return sources, entries, nbytes, cast
        fingerprint = named.fingerprint() if isinstance(named, ReleasedTensors) else None
        sources, entries, nbytes, _ = self._resolve(named, include_frozen, fingerprint)
        return sources, entries, nbytes, None

    def _resolve(self, named, include_frozen: bool, fingerprint) -> tuple[list[torch.Tensor], tuple, int, bool]:
        """(source tensors, header entries, wire bytes, every tensor already in its wire dtype).

        Resolved once per (``include_frozen``, ``fingerprint``: (the model's identity, its layout),
        None = resolve every update) and reused while it repeats (the same list and tuple objects
        each update, so receivers reuse their copy plans). Raises WeightUpdateError for a tensor
        outside the handshake or of a non-float dtype."""
        key = None if fingerprint is None else (include_frozen, id(self.manifest), fingerprint)
        if key is not None and key in self._source_cache:
            return self._source_cache[key]
        index = {s.name: i for i, s in enumerate(self.manifest)}
        sources, entries = [], []
        for name, t in named:
            i = index.get(name)
            if i is None:
                raise WeightUpdateError(f"trainer tensor {name} is not in the handshake list; re-handshake")
            if self.manifest[i].frozen and not include_frozen:
                continue
            if not (t.is_floating_point() and not t.is_complex()):
                # an int tensor was cast into the float parameter (truncating it) without a word
                raise WeightUpdateError(f"trainer tensor {name}: dtype {t.dtype} is not a real floating-point dtype")
            sources.append(t.detach())
            entries.append((i, tuple(t.shape), self.manifest[i].dtype))
        in_wire = all(s.dtype == dt for s, (_, _, dt) in zip(sources, entries))
        out = (sources, tuple(entries), sum(math.prod(shape) * dt.itemsize for _, shape, dt in entries), in_wire)
        if key is not None:  # one entry per (include_frozen, model): a moved layout replaces its entry
            self._source_cache = {
                k: v for k, v in self._source_cache.items() if not (k[0] == include_frozen and k[2][0] == key[2][0])
            }
            self._source_cache[key] = out
        return out

    def _finish(self, version: int, verdicts: list[dict], t0: float, nbytes: int, buckets: int) -> dict:
        """Record stats (``buckets`` = 0 on the colocated direct path); raise on any rank's error."""
        seconds = time.perf_counter() - t0
        drifts = [v["drift"] for v in verdicts if v.get("drift") is not None]
        self.stats = {
            "version": int(version),
            "bytes": nbytes,
            "buckets": buckets,
            "seconds": seconds,
            "gb_per_s": nbytes / max(seconds, 1e-9) / 1e9,
            "probe_drift": max(drifts) if drifts else None,
        }
        errors = [e for v in verdicts for e in v["errors"]]
        if errors or not all(v["ok"] for v in verdicts):
            raise WeightUpdateError(f"weight update {version} rejected:\n  " + "\n  ".join(errors))
        return self.stats

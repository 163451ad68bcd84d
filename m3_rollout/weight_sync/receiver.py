"""Rollout-rank side of weight sync: the ONE receiver every backend refits through.

Governing idea: a small state machine (``check_handshake`` -> ``begin`` -> ``on_bucket`` * n ->
``status`` -> ``apply`` -> ``finish``) that knows nothing about the transport; ``handshake(group)``
/ ``receive_update(group)`` drive it over a ``WeightSyncGroup`` broadcast (EP workers), and
``ColocatedChannel`` drives the same methods in-process (the in-process engine), with buckets or
with the direct per-tensor copy (``receive_direct``). So the checks below exist once, for one
rank and for N: the header against the handshake (names, shapes, dtypes, missing tensors), the
version rule, finite values, the two-phase verdict, the in-flight policy and the probe. Nothing
here allocates new parameter storage: every write goes through a view of an existing parameter
(``data_ptr`` fixed).

Versions only increase: an update whose version is negative, older than the rank's, or equal to
it is refused (both versions in the message) unless its header says ``replace`` (re-send the
version held, e.g. to repair ranks a failed non-atomic update left invalid). A fresh receiver's
first update may carry the version it was built with (the checkpoint it loaded is no update).

Finite values and checksums are checked on the device on every path and read on the host once per
update, whether it succeeds or fails (a failure is named from that same read): the bucket path's
fused unpack pass (one flag per owned segment) and checksum table (unpack.py); on the direct path the
flags of the pass that wrote the sources, before any byte reaches the parameters (the trainer's
attested cast, ``cast_copy.py``, or the IPC fill; else a fused check pass). ``atomic`` decides
staging, not validation.
``atomic=True``: every owned byte is staged in host memory (on CPU a fully owned bucket is
received straight into its stage slot; on GPU through the ring of device wire buffers, ring.py),
each bucket is validated on the device as it arrives; only when EVERY rank reports success are the
staged bytes copied into the parameters (two-phase: status exchange, then commit). Any failure
leaves weights and version untouched. The direct path validates every tensor first and copies at
commit, the trainer tensors serving as the stage.
``atomic=False``: on the bucket path each bucket is copied into the parameters by the same pass
that validates it (no stage; the verdict is read once, after the last bucket, so the bytes of a
bad bucket land too); on the direct path each tensor is validated before any byte is copied.
A bad bucket is reported from that one read, as on an atomic rank: "bucket k (dtype, bytes)
checksum mismatch; holds <tensors>" for torn bytes, "non-finite values in <tensor>" for each
tensor (up to four, then a count) whose stored values hold a NaN / inf (an overflowing cast
included); the result adds "update v failed after weights were written: rank invalid" ("engine
invalid" for a lone engine, whose messages name no rank).
When any rank fails, no rank moves to the new version: a rank that already overwrote bytes is
marked ``valid=False`` (it refuses requests) until a later full update succeeds, so every rank
ends on one version or the update failed everywhere.

Probe (``probe.py``): when the update carries one, every rank re-scores the probe ids with the new
weights after the commit and reports its drift in a second verdict exchange; atomic ranks keep a
copy of the weights they overwrote and roll back when any rank's drift is beyond the threshold.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from m3_rollout.model.loading import RELEASED_PREFIX

from . import copy_plan
from .buckets import Bucket, plan_buckets
from .cast_copy import CastCopy
from .copy_plan import CopyPlan, PeerCopy
from .direct import nonfinite
from .group import WeightSyncGroup, WeightSyncTimeout
from .in_flight import InFlightPolicy
from .manifest import (
    HandshakeError,
    TensorSpec,
    UpdateHeader,
    check_header,
    decode_header,
    diff_manifests,
    manifest_from_bytes,
    receiver_layout,
)
from .probe import ProbeData, Scorer, probe_drift
from .ring import BucketRing
from .unpack import BucketUnpack

_MAX_NAMES = 4  # tensors named per failing bucket


def _group_label(group: WeightSyncGroup) -> str | None:
    """The rank label ("rank r") when the group holds several rollout ranks, None when this rank is its only one
    (an in-process engine, a one-engine server or worker): a lone engine's messages name no rank."""
    return f"rank {group.rank}" if group.world_size - group.train_world_size > 1 else None


@dataclass
class UpdateResult:
    """Outcome of one update on one rollout rank.

    Attributes:
        ok: this rank's weights now equal the trainer's update ``version``.
        version: weight version served after the call (unchanged on failure).
        errors: what went wrong, naming tensors (prefixed "rank r: " / "receiver i: " where several
            ranks receive the update; bare for a lone engine).
        valid: False when the rank holds a partial update and must refuse requests.
        needs_rebuild: the group broke (peer died / timeout); rebuild before the next update.
        changed: this rank's parameters were overwritten (the prefix cache must go).
        seconds: wall time of the receive + commit.
        probe_drift: this rank's probe figure (nats per token), None without a probe.
    """

    ok: bool
    version: int
    errors: list[str] = field(default_factory=list)
    valid: bool = True
    needs_rebuild: bool = False
    seconds: float = 0.0
    changed: bool = False
    probe_drift: float | None = None

    @property
    def wrote(self) -> bool:
        """Weight bytes were (or may have been) written: the parameters changed, or the rank was
        left invalid by a partial write. Each such update counts a weight write
        (``LLMEngine.count_weight_write``; the EP service's group-wide count)."""
        return self.changed or not self.valid


@dataclass
class _DirectPlan:
    """The direct path's cached plan: built for these (identical) header entries and sources.

    ``pairs`` / ``names``: the owned tensors, those on the destinations' device first (``plan``'s
    pairs, same indices), then those whose source lies on another device (``peer``'s, from index
    ``plan.n_pairs``): the fused plan for the first, a peer copy of the CURRENT source bytes at
    every update for the others (``copy_plan.PeerCopy``; never a cached snapshot)."""

    entries: tuple
    sources: list
    pairs: list  # [(dst view, src)] of the owned tensors
    names: list[str]
    plan: CopyPlan
    generation: int  # the engine's weight_storage_generation the tables were built at
    covered: tuple = (None, False)  # ((cast, its layouts), the cast covers every source)
    peer: PeerCopy | None = None  # the pairs whose source lies on another device

    def copy(self) -> None:
        """Write every owned tensor: the fused pass, then the peer copies (no host sync)."""
        self.plan.copy()
        if self.peer is not None:
            self.peer.copy()


class WeightReceiver:
    """Receives weight updates into ``model`` in place.

    Args:
        model: the rollout ``M3ForCausalLM`` (its StackedExperts may hold experts [a, b) with
            ``expert_range``; design.md §3.5).
        atomic: see module docstring.
        double_buffer: pipeline the buckets through a ring of three wire buffers (bucket k+1 on
            the wire while k is validated and unpacked on the ring's side stream); False: one
            buffer, one bucket at a time.
        version: weight version the model holds now.
        prefix: released-name prefix; must match the trainer's.
        in_flight: the engine's ``InFlightPolicy``; it brackets every update (pause / abort /
            drain before, prefix-cache reset + version + resume after). None: a bare model.
        scorer: re-scores probe ids with this rank's weights (``probe.Scorer``; e.g. the engine's
            ``score``); needed when updates carry a probe.
    Raises ValueError when a destination view is not contiguous (cannot be written flat).
    """

    def __init__(
        self,
        model: nn.Module,
        atomic: bool = True,
        double_buffer: bool = True,
        version: int = 0,
        prefix: str = RELEASED_PREFIX,
        in_flight: InFlightPolicy | None = None,
        scorer: Scorer | None = None,
    ):
        layout = list(receiver_layout(model, prefix=prefix))
        self.local_manifest: list[TensorSpec] = [s for s, _ in layout]
        self.views: dict[str, torch.Tensor | None] = {s.name: v for s, v in layout}
        for name, v in self.views.items():
            if v is not None and not v.is_contiguous():
                raise ValueError(f"{name}: destination view is not contiguous; cannot receive it in place")
        self.device = next(model.parameters()).device
        self.atomic, self.double_buffer = atomic, double_buffer
        self.version = int(version)
        self.received = False  # no update applied yet: the first may carry ``version`` itself
        self.valid = True
        self.in_flight, self.scorer = in_flight, scorer
        # "rank r" / "receiver i" where several ranks receive the update (set by the driver:
        # ``receive_update``, ``ColocatedChannel``); None for the one engine of its update: its
        # messages then name no rank (``_named``)
        self.rank_label: str | None = None
        self.manifest: list[TensorSpec] | None = None
        self._stage_cache: torch.Tensor | None = None
        self._ring = BucketRing(self.device, 3 if double_buffer else 1)
        self._unpack_cache: tuple | None = None  # (entries, bucket bytes, manifest, BucketUnpack)
        self._backup_cache: torch.Tensor | None = None
        # Test hook: called as fault(k, wire_buffer) when bucket k has arrived, before it is validated.
        self.fault: Callable[[int, torch.Tensor], None] | None = None
        # direct path: the plan of the last update; a sender that resends the same objects
        # (WeightSender's source cache) reuses it
        self._plan_cache: _DirectPlan | None = None
        self._plan_spare: _DirectPlan | None = None  # the plan before, for the same entries (another source)
        # direct path: how the last verdict was reached: "sent" (positions the producer flagged,
        # IPC), "attested" (the cast's flags) or "checked" (this receiver's own check pass)
        self.last_verdict = ""
        self._header_cache: tuple | None = None  # (entries, manifest, problems)
        self._reset()

    def _reset(self) -> None:
        self._header: UpdateHeader | None = None
        self._buckets: BucketUnpack | None = None  # this update's bucket path (None: direct / no buckets to apply)
        self._bucket_plan: list[Bucket] = []
        self._verdict_read = False
        self._errors: list[str] = []
        self._touched = False  # non-atomic: some parameter bytes were overwritten this update
        self._direct: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # colocated: (dst view, src)
        self._direct_plan: _DirectPlan | None = None  # atomic direct path: what the commit copies
        self._probe: ProbeData | None = None
        self._backup: list[tuple[torch.Tensor, torch.Tensor]] = []  # (dst view, copy of its old bytes)
        self._committed = False
        self._drift: float | None = None

    # ---------------------------------------------------------------- protocol steps
    def check_handshake(self, manifest: list[TensorSpec]) -> list[str]:
        """Compare the trainer's manifest with this rank's; remember it when equal."""
        diffs = diff_manifests(manifest, self.local_manifest)
        self.manifest = None if diffs else list(manifest)
        return diffs

    def _start(self, header: UpdateHeader, probe: ProbeData | None, expect_version: int | None = None) -> None:
        """Checks shared by both paths (header vs handshake, version rule, the version the caller
        expects when given, probe), then the in-flight policy's ``begin``."""
        if self.manifest is None:
            raise RuntimeError("weight update before a successful handshake")
        self._reset()
        self._header = header
        self._errors = [self._named(p) for p in self._header_problems(header)]
        v, cur = int(header.version), self.version
        if v < 0:
            self._fail(f"update version {v} refused: versions are >= 0 ({self._this} holds version {cur})")
        elif v < cur or (v == cur and self.received and not header.replace):
            self._fail(
                f"update version {v} refused: {self._this} holds version {cur}; versions only increase "
                "(an update that re-sends the version held must say replace=True)"
            )
        if expect_version is not None and v != expect_version:
            self._fail(f"update version {v} refused: the receiving side expected version {expect_version}")
        if header.probe != (probe is not None):
            self._fail("update header and probe data disagree (sender and receiver out of step?)")
        elif probe is not None and self.scorer is None:
            self._fail(f"update carries a probe (weight_sync.probe) but {self._this} has no scorer")
        self._probe = probe
        if self.in_flight is not None and self.in_flight.engine.weights_offloaded:
            # sleep(2) freed the parameters' device memory: a write would land in freed memory
            self._fail("the engine is asleep with its weights offloaded (sleep level 2): call wake_up() first")
        if self.in_flight is not None:
            refusal = self.in_flight.refusal()
            if refusal is not None:
                self._fail(refusal)
            self.in_flight.begin()

    def begin(
        self, header: UpdateHeader, bucket_bytes: int, probe: ProbeData | None = None, expect_version: int | None = None
    ) -> list[Bucket]:
        """Start a bucketed update; returns the bucket plan (the same the sender computes).

        Header problems (shape, dtype, missing / repeated tensor, version) are recorded as errors;
        the buckets must still be consumed to stay in step with the group, but nothing is applied.
        The plan, the owned segments, the stage layout and the fused passes are built once per
        (header entries, bucket size, handshake) and reused by later updates."""
        self._start(header, probe, expect_version)
        c = self._unpack_cache
        hit = (
            c is not None
            and c[1] == bucket_bytes
            and c[2] is self.manifest
            and (c[0] is header.entries or c[0] == header.entries)
        )
        plan = c[3].plan if hit else plan_buckets([(shape, dt) for _, shape, dt in header.entries], bucket_bytes)
        self._bucket_plan = plan
        self._ring.reserve(max((b.wire_bytes for b in plan), default=8))  # before the layout: it cuts the slots
        if hit:
            unpack = c[3]
        elif not self._errors:  # a header that passed the checks: every destination fits its entry
            self._unpack_cache = None
            dests, names = [], []
            for idx, _, _ in header.entries:
                view = self.views.get(self.manifest[idx].name)
                dests.append(view.reshape(-1) if view is not None else None)
                names.append(self.manifest[idx].name)
            unpack = BucketUnpack(plan, dests, names, self._ring)
            self._unpack_cache = (header.entries, bucket_bytes, self.manifest, unpack)
        else:
            unpack = None
        self._ring.start()
        if unpack is not None and not self._errors:  # otherwise consume the buckets, apply nothing
            unpack.start(self.atomic, self._stage_for)
            self._buckets = unpack
        return self._bucket_plan

    def _stage_for(self, nbytes: int) -> torch.Tensor:
        """The host stage (pinned on CUDA), kept between updates: fresh host allocations
        page-fault on first touch, which costs more than the copies themselves."""
        if self._stage_cache is None or self._stage_cache.numel() < nbytes:
            self._stage_cache = None
            self._stage_cache = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.device.type == "cuda")
        return self._stage_cache[:nbytes]

    def release_buffers(self) -> None:
        """Free the cached host stage, wire ring and probe-backup buffers (reallocated when needed)."""
        self._unpack_cache, self._buckets = None, None
        self._ring.free()
        self._stage_cache, self._backup_cache = None, None

    def bucket_buffer(self, k: int) -> torch.Tensor:
        """The uint8 buffer bucket k should be received into (a stage slot or a ring slot)."""
        if self._buckets is not None:
            return self._buckets.buffer(k)
        return self._ring.buffer(k, self._bucket_plan[k].wire_bytes)

    def wait_buffer_free(self, k: int, stream=None) -> None:
        """``stream`` (default: the current one) waits until ``bucket_buffer(k)`` is no longer
        read by the unpack of bucket k - slots (for a transfer on another stream; a no-op on CPU)."""
        self._ring.acquire(k, stream)

    def on_bucket(self, k: int, buf: torch.Tensor, ready=None) -> None:
        """Validate (checksum, finite values) and stage or apply bucket k, which has arrived in
        ``buf`` (normally ``bucket_buffer(k)``). The work is issued on the ring's side stream after
        ``ready.wait()`` (a CUDA event recorded after the transfer, None: the bytes are there) and
        is not read on the host here: ``status`` reads every bucket's verdict at once."""
        ring = self._ring
        if ready is not None:
            ring.stream.wait_event(ready)
        with ring.side():
            u = self._buckets
            if u is not None:
                slot = u.buffer(k)
                if slot.data_ptr() != buf.data_ptr():  # arrived elsewhere: bring it where the layout reads it
                    slot.copy_(buf[: slot.numel()])
                if self.fault is not None:
                    self.fault(k, slot)
                self._touched |= u.receive(k, slot)
        ring.release(k, ring.stream)

    def _read_bucket_verdict(self) -> None:
        """After the last bucket: the update's one host read of the bucket checks (``status`` and
        ``apply`` both ask; the first reads), whatever the outcome and the atomic setting; records
        errors naming the buckets / tensors from that read alone."""
        u = self._buckets
        if u is None or self._verdict_read:
            return
        self._verdict_read = True
        with self._ring.side():
            bad_sums, nonfinite_names = u.verdict()
        self._ring.finish()
        for k in bad_sums[:_MAX_NAMES]:
            b = u.plan[k]
            self._fail(f"bucket {k} ({b.dtype}, {b.data_bytes} bytes) checksum mismatch; holds " + self._names(b))
        if len(bad_sums) > _MAX_NAMES:
            self._fail(f"checksum mismatch in {len(bad_sums) - _MAX_NAMES} more buckets")
        for name in nonfinite_names[:_MAX_NAMES]:
            self._fail(f"non-finite values in {name}")
        if len(nonfinite_names) > _MAX_NAMES:
            self._fail(f"non-finite values in {len(nonfinite_names) - _MAX_NAMES} more tensors")

    # ---------------------------------------------------------------- colocated direct path
    def receive_direct(
        self,
        header: UpdateHeader,
        sources: list[torch.Tensor],
        probe: ProbeData | None = None,
        checked: list[int] | None = None,
        attested: CastCopy | None = None,
    ) -> None:
        """Update without buckets (``copy_plan.py``): ``sources[k]`` is the tensor of
        ``header.entries[k]`` (the trainer's own tensor or its cast copy in process; a view of the
        shared source under IPC, already in the wire dtype), on this rank's device or on another
        (an EP worker on cuda:r reading the trainer's stage on its GPU): those pairs are copied
        from the source's current bytes at every update by torch peer copies (``PeerCopy``), the
        others by the fused plan.

        The shared checks (``_start``), then the finite verdict on the values as they will be
        stored, on the device, before any write, with at most ONE host sync; then ``atomic=True``
        keeps the plan for ``apply`` to copy once every receiver succeeded (the sources must not
        change before ``apply``; the channel calls both in one go), ``atomic=False`` copies now
        (either way a non-finite tensor is refused before any byte moves, so such a failure
        leaves the rank valid on its old weights). The verdict comes from, in this order:
        - ``checked``: the sources were validated where they were produced (the IPC stage's fill
          pass flags non-finite values in the pass that writes them); the header positions that
          hold non-finite values. No pass, no sync here.
        - ``attested``: the ``CastCopy`` whose cast wrote the sources, trusted when it is current,
          covers every source and no pair's cast can overflow (``cast_copy.py``): its flags, one
          4-byte read. No pass.
        - otherwise a fused check-only pass over the sources, then its flags (one read); sources
          on another device by the per-tensor check where they lie (one read per device).
        The (dst, src) pairs, the runs, the kernel tables and the attestation's coverage are
        built once and reused while the sender passes the same ``header.entries`` and ``sources``
        objects (``WeightSender`` does while the trainer's parameters stay where they are); the
        tables are re-derived when the engine re-allocated its weights (sleep level 2, wake-up).
        Follow with ``status`` / ``apply`` / ``finish`` as for buckets.
        """
        self._start(header, probe)
        if len(sources) != len(header.entries):
            self._fail(f"update carries {len(sources)} tensors for {len(header.entries)} header entries")
        if self._errors:
            return
        c = self._plan_for(header, sources)
        pairs, names, plan = c.pairs, c.names, c.plan
        if checked is not None:
            self.last_verdict = "sent"
            pos = {n: i for i, n in enumerate(names)} if checked else {}
            flagged = (self.manifest[header.entries[p][0]].name for p in checked if 0 <= p < len(header.entries))
            bad = [pos[n] for n in flagged if n in pos]
        elif attested is not None and c.peer is None and self._trusts(attested, plan):
            self.last_verdict = "attested"
            bad = self._refine_all(pairs) if attested.any_bad() else []
        else:
            self.last_verdict = "checked"
            plan.check()
            bad = self._refine(plan, pairs)
            if c.peer is not None:  # sources on another device: checked where they are, tensor by tensor
                bad += [plan.n_pairs + j for j in c.peer.nonfinite()]
        for i in sorted(bad)[:_MAX_NAMES]:
            self._fail(f"non-finite values in {names[i]}")
        if bad:
            return
        self._direct = pairs
        if self.atomic:
            self._direct_plan = c
        else:
            c.copy()
            self._touched = True

    def _storage_generation(self) -> int:
        """The engine's count of weight re-allocations (0 for a bare model, which never moves)."""
        return self.in_flight.engine.weight_storage_generation if self.in_flight is not None else 0

    def _plan_for(self, header: UpdateHeader, sources: list[torch.Tensor]) -> _DirectPlan:
        """The plan of this update's owned tensors, cached by object identity; the kernel tables
        follow storages the engine re-allocated since the last update. The plan before is kept too
        while the entries are the same: an IPC worker whose source alternates (the trainer's
        compute copy / the stage) reuses both plans instead of rebuilding one per switch
        (O(tensors) Python and table uploads). A source on another device than its destination
        (``copy_plan.reads_across``: an EP worker on cuda:1 reading the trainer's stage on cuda:0)
        goes to the plan's ``PeerCopy``, which reads it anew at every update: the cached plan holds
        the source itself, never a copy of its bytes."""
        c, spare = self._plan_cache, self._plan_spare
        if spare is not None and spare.entries is header.entries and spare.sources is sources:
            c, self._plan_spare = spare, c
            self._plan_cache = c
        if c is not None and c.entries is header.entries and c.sources is sources:
            generation = self._storage_generation()
            if generation != c.generation:
                c.plan.relocate()  # the peer copies' views follow the storages by themselves
                c.generation = generation
            return c
        keep = c is not None and c.entries is header.entries
        self._plan_cache, self._plan_spare = None, c if keep else None
        local, across = [], []  # (dst view, src, name)
        for (idx, _, _), src in zip(header.entries, sources):
            name = self.manifest[idx].name
            view = self.views.get(name)
            if view is not None:
                (across if copy_plan.reads_across(src, view) else local).append((view, src, name))
        plan = CopyPlan([d for d, _, _ in local], [s for _, s, _ in local])
        peer = PeerCopy([d for d, _, _ in across], [s for _, s, _ in across]) if across else None
        pairs, names = [(d, s) for d, s, _ in local + across], [n for _, _, n in local + across]
        c = _DirectPlan(header.entries, sources, pairs, names, plan, self._storage_generation(), peer=peer)
        self._plan_cache = c
        return c

    def _trusts(self, cast: CastCopy, plan: CopyPlan) -> bool:
        """The attestation vouches for this plan's sources (``cast_copy.py``, guarantees 1-3):
        current (O(parameters) reads), and, checked once per (plan, cast layout), covering. (A plan
        with peer copies is never trusted: the caller checks that first.)"""
        c = self._plan_cache
        key = (cast, cast.layouts)  # holds the cast: its identity cannot be reused meanwhile
        if c.covered[0] != key:
            c.covered = (key, plan.keeps_finite and cast.covers([r.src for r in plan.runs]))
        return c.covered[1] and cast.current()

    @staticmethod
    def _refine(plan: CopyPlan, pairs: list) -> list[int]:
        """Pair indices holding non-finite values: the plan's flags (the one host sync), then the
        exact tensors of the flagged runs (the slow per-tensor check runs only on failure)."""
        members = plan.bad_members()
        if not members:
            return []
        hits = nonfinite([pairs[i][1] for i in members], [pairs[i][0].dtype for i in members])
        return [members[j] for j in hits]

    def _refine_all(self, pairs: list) -> list[int]:
        """Pair indices holding non-finite values, by the per-tensor check (failure path only)."""
        return nonfinite([s for _, s in pairs], [d.dtype for d, _ in pairs])

    def _header_problems(self, header: UpdateHeader) -> list[str]:
        """``check_header`` against the handshake, cached for a header whose entries object repeats."""
        c = self._header_cache
        if c is not None and c[0] is header.entries and c[1] is self.manifest:
            return list(c[2])
        problems = check_header(header, self.manifest)
        self._header_cache = (header.entries, self.manifest, problems)
        return list(problems)

    # ---------------------------------------------------------------- verdicts and commit
    def status(self) -> dict:
        """This rank's verdict for the first exchange (received and validated)."""
        self._read_bucket_verdict()
        return {"ok": not self._errors, "errors": list(self._errors)}

    def apply(self, all_ok: bool) -> dict:
        """Second phase: commit the staged update when every rank validated it (atomic), then run
        the probe when the update carries one. Returns this rank's probe verdict
        ``{"ok", "errors", "drift"}`` for the second exchange (ok without a probe)."""
        assert self._header is not None, "apply() without begin() / receive_direct()"
        self._read_bucket_verdict()
        mine_ok = not self._errors
        if self.atomic and all_ok and mine_ok:
            if self._probe is not None:
                self._take_backup()
            self._commit()
            self._committed = True
        elif not self.atomic and all_ok and mine_ok:
            self._committed = True
        if not (self._committed and self._probe is not None):
            return {"ok": True, "errors": [], "drift": None}
        try:
            self._drift = probe_drift(self._probe, self.scorer)
        except (RuntimeError, ValueError) as exc:  # scoring failed on this rank: the probe fails
            self._drift = float("inf")
            return {"ok": False, "errors": [self._named(f"probe could not score: {exc}")], "drift": None}
        if self._drift <= self._probe.threshold:
            return {"ok": True, "errors": [], "drift": self._drift}
        msg = self._named(
            f"probe drift {self._drift:.4g} nats/token > weight_sync.probe.threshold="
            f"{self._probe.threshold:g} after update {self._header.version} (wrong expert layout, stale or "
            "corrupted weights?)"
        )
        return {"ok": False, "errors": [msg], "drift": self._drift}

    def finish(self, all_ok: bool, probe_ok: bool = True, seconds: float = 0.0) -> UpdateResult:
        """Last step: ``all_ok`` = every rank's ``status`` was ok, ``probe_ok`` = every rank's
        ``apply`` verdict was ok. Sets version / validity, rolls an atomic rank back on a failed
        probe, ends the in-flight policy."""
        h = self._header
        assert h is not None, "finish() without begin() / receive_direct()"
        errors = list(self._errors)
        changed = False
        if self._committed and probe_ok:
            self.version, self.valid, self.received = int(h.version), True, True
            changed = True
        elif self._committed and self.atomic:  # the probe failed somewhere: back to the old weights
            self._restore_backup()
            errors.append(self._named(f"update {h.version} rolled back: the probe failed"))
        elif self._committed or self._touched:  # non-atomic: bytes written, update not accepted everywhere
            self.valid, changed = False, True
            unit = "rank" if self.rank_label is not None else "engine"
            errors.append(self._named(f"update {h.version} failed after weights were written: {unit} invalid"))
        if not all_ok and not self._errors:
            errors.append(self._named(f"update {h.version} not applied: another rank failed"))
        ok = changed and self.valid
        drift = self._drift
        self._reset()
        result = UpdateResult(
            ok=ok,
            version=self.version,
            errors=errors,
            valid=self.valid,
            seconds=seconds,
            changed=changed,
            probe_drift=drift,
        )
        if self.in_flight is not None:
            self.in_flight.end(result)
        return result

    def complete(self, all_ok: bool, seconds: float = 0.0) -> UpdateResult:
        """``apply`` + ``finish`` for a receiver alone (no other rank to exchange verdicts with)."""
        verdict = self.apply(all_ok)
        return self.finish(all_ok, verdict["ok"], seconds)

    def refused(self, reason: str) -> UpdateResult:
        """An update that ended before any bucket was received, with the group in step (no
        rebuild): weights, version and validity stay."""
        return UpdateResult(ok=False, version=self.version, errors=[self._named(reason)], valid=self.valid)

    def withdrawn(self, version: int) -> UpdateResult:
        """The trainer withdrew update ``version`` before sending anything (it refused it itself:
        its own error says why): ``refused``, weights and version kept, the group in step."""
        why = f"update {version} withdrawn by the trainer before sending (its error says why)"
        return self.refused(f"{why}; version {self.version} kept")

    def interrupted(self, reason: str) -> UpdateResult:
        """The transport failed mid-update: drop staged bytes (an atomic rank that committed
        before a failed probe exchange rolls back); non-atomic ranks that wrote bytes become invalid."""
        if self._committed and self.atomic and self._backup:
            self._restore_backup()
        elif self._touched or self._committed:
            self.valid = False
        self._reset()
        result = UpdateResult(
            ok=False,
            version=self.version,
            errors=[self._named(reason)],
            valid=self.valid,
            needs_rebuild=True,
        )
        if self.in_flight is not None and self.in_flight.active:
            self.in_flight.end(result)
        return result

    def abandon(self) -> None:
        """The update raised (a bug, not a bad update): drop it, keep serving as before."""
        self._reset()
        if self.in_flight is not None:
            self.in_flight.cancel()

    # ---------------------------------------------------------------- drivers over a group
    def handshake(self, group: WeightSyncGroup) -> None:
        """Receive the trainer's manifest, compare, exchange verdicts. Raises HandshakeError
        listing every rank's differences."""
        self.rank_label = _group_label(group)
        n = torch.zeros(1, dtype=torch.int64, device=group.device)
        group.broadcast(n)
        data = torch.empty(int(n), dtype=torch.uint8, device=group.device)
        group.broadcast(data)
        diffs = self.check_handshake(manifest_from_bytes(data.cpu().numpy().tobytes()))
        verdicts = group.exchange_objects([self._named(d) for d in diffs])
        problems = [d for v in verdicts for d in v]
        if problems:
            self.manifest = None
            raise HandshakeError("weight-sync handshake failed:\n  " + "\n  ".join(problems))

    def receive_update(
        self, group: WeightSyncGroup, bucket_bytes: int, expect_version: int | None = None
    ) -> UpdateResult:
        """Receive one update (header, probe, buckets, verdict exchanges) and commit or discard.
        ``expect_version``: refuse (on every rank, before anything is written) an update whose
        header carries another version (the server's ``/update_weights`` ``version``).

        Never raises for a bad update: the result says what happened. On a transport failure
        (sender killed, timeout) the result has ``needs_rebuild=True``."""
        import time

        t0 = time.perf_counter()
        self.rank_label = _group_label(group)
        try:
            try:
                n = torch.zeros(1, dtype=torch.int64, device=group.device)
                group.broadcast(n)
                hdr = torch.empty(int(n), dtype=torch.int64, device=group.device)
                group.broadcast(hdr)
                header = decode_header(hdr.cpu())
                if header.withdrawn:  # the trainer refused it before sending (manifest.py)
                    return self.withdrawn(header.version)
                probe = group.exchange_objects(None)[0] if header.probe else None
                plan = self.begin(header, bucket_bytes, probe, expect_version)
                # NOTE: a ring of slots; the receive of bucket k is posted after the unpack of
                # bucket k - slots was issued on the side stream, and posted FROM that stream, so
                # NCCL writes the slot only once that unpack is done (gloo: the host did it)
                pending: deque = deque()
                for k in range(len(plan)):
                    if len(pending) == self._ring.slots:
                        self._arrived(group, *pending.popleft())
                    buf = self.bucket_buffer(k)
                    with self._ring.side():
                        pending.append((k, group.broadcast(buf, async_op=True), buf))
                while pending:
                    self._arrived(group, *pending.popleft())
                all_ok = all(v["ok"] for v in group.exchange_objects(self.status()))
                verdict = self.apply(all_ok)
                probe_ok = all(v["ok"] for v in group.exchange_objects(verdict)) if header.probe else verdict["ok"]
            except (WeightSyncTimeout, ValueError) as exc:
                return self.interrupted(f"update interrupted: {exc}")
        except BaseException:
            self.abandon()
            raise
        return self.finish(all_ok, probe_ok, time.perf_counter() - t0)

    def _arrived(self, group: WeightSyncGroup, k: int, work, buf: torch.Tensor) -> None:
        """Bucket k's broadcast ``work`` was posted: order its unpack after it (NCCL: the side
        stream waits, the host does not; gloo: the host waits), then unpack."""
        with self._ring.side():
            group.wait(work)
        self.on_bucket(k, buf)

    # ---------------------------------------------------------------- helpers
    def _fail(self, msg: str) -> None:
        self._errors.append(self._named(msg))

    def _named(self, msg: str) -> str:
        """``msg`` prefixed with this receiver's rank label ("rank 2: ..."), bare without one."""
        return msg if self.rank_label is None else f"{self.rank_label}: {msg}"

    @property
    def _this(self) -> str:
        """What holds the weights, for messages: "this rank" among several, else "this engine"."""
        return "this rank" if self.rank_label is not None else "this engine"

    def _seg_name(self, seg) -> str:
        idx = self._header.entries[seg.entry][0]
        return self.manifest[idx].name

    def _names(self, b: Bucket) -> str:
        names = [self._seg_name(s) for s in b.segments[:_MAX_NAMES]]
        more = len(b.segments) - len(names)
        return ", ".join(names) + (f" and {more} more" if more > 0 else "")

    def _targets(self) -> list[torch.Tensor]:
        """Every destination region the pending commit overwrites (1-D views)."""
        if self._direct is not None:
            return [d.reshape(-1) for d, _ in self._direct]
        return self._buckets.targets() if self._buckets is not None else []

    @torch.no_grad()
    def _take_backup(self) -> None:
        """Copy the bytes the commit will overwrite into a cached buffer (probe rollback)."""
        targets = self._targets()
        need = sum(t.numel() * t.element_size() for t in targets)
        if self._backup_cache is None or self._backup_cache.numel() < need:
            self._backup_cache = None
            self._backup_cache = torch.empty(need, dtype=torch.uint8, device=self.device)
        off, self._backup = 0, []
        for t in targets:
            n = t.numel() * t.element_size()
            slot = self._backup_cache[off : off + n].view(t.dtype)
            slot.copy_(t)
            self._backup.append((t, slot))
            off += n

    @torch.no_grad()
    def _restore_backup(self) -> None:
        for t, slot in self._backup:
            t.copy_(slot)
        self._backup = []

    @torch.no_grad()
    def _commit(self) -> None:
        if self._direct_plan is not None:
            self._direct_plan.copy()  # same stream as the engine's next step: no host sync needed
            return
        if self._buckets is not None:
            # on the caller's stream too: the engine's next step is ordered after it, and the next
            # update's staging waits for it (its ring.start()), so no host sync
            self._buckets.commit()

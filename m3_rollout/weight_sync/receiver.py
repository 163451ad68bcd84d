"""Rollout-rank side of weight sync: handshake, receive buckets, validate, commit in place.

Governing idea: a small state machine (``check_handshake`` -> ``begin`` -> ``on_bucket`` * n ->
``status`` -> ``complete``) that knows nothing about the transport; ``handshake(group)`` /
``receive_update(group)`` drive it over a ``WeightSyncGroup`` broadcast, and the colocated path
(``transport.ColocatedSender``) calls the same methods in-process. Nothing here allocates new
parameter storage: every write goes through a view of an existing parameter (``data_ptr`` fixed).

``atomic=True``: every owned byte is staged in host memory (on CPU a fully owned bucket is
received straight into its stage slot; on GPU through at most one or two device wire buffers),
each bucket is validated as it arrives (checksum, then finite values of the owned tensors), the
header was validated against the handshake (sizes, shapes, dtypes, missing tensors) before any
bucket; only when EVERY rank reports success are the staged bytes copied into the parameters
(two-phase: status exchange, then commit). Any failure leaves weights and version untouched.
``atomic=False``: each bucket is checksummed (finite values too with ``check_finite``) and
copied into the parameters as it arrives (no host stage); a failure after the first copy marks the rank
``valid=False`` (it must refuse
requests) until a later full update succeeds.
Colocated direct path (``receive_direct``, ``direct.py``): no buckets; the trainer's tensors are
copied straight into the destination views; atomic validates them all first (fused finite check,
one host sync) and copies at ``complete``, the trainer tensors serving as the stage.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from m3_rollout.model.loading import RELEASED_PREFIX

from .buckets import Bucket, all_finite, checksum_ok, plan_buckets, segment_view
from .direct import copy_into, nonfinite
from .group import WeightSyncGroup, WeightSyncTimeout
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

_MAX_NAMES = 4  # tensors named per failing bucket


@dataclass
class UpdateResult:
    """Outcome of one update on one rollout rank.

    Attributes:
        ok: this rank's weights now equal the trainer's update ``version``.
        version: weight version served after the call (unchanged on failure for atomic ranks).
        errors: what went wrong, naming tensors ("rank r: ...").
        valid: False when the rank holds a partial update and must refuse requests.
        needs_rebuild: the group broke (peer died / timeout); rebuild before the next update.
        changed: this rank's parameters were overwritten with the update (prefix cache must go).
        seconds: wall time of the receive + commit.
    """

    ok: bool
    version: int
    errors: list[str] = field(default_factory=list)
    valid: bool = True
    needs_rebuild: bool = False
    seconds: float = 0.0
    changed: bool = False


@dataclass
class _BucketState:
    bucket: Bucket
    owned: list  # [(Segment, dst view)] of segments this rank keeps
    fully_owned: bool
    stage_offset: int = 0  # byte offset of this bucket's owned bytes in the host stage
    stage_offsets: tuple = ()  # per owned segment (partial buckets)


class WeightReceiver:
    """Receives weight updates into ``model`` in place.

    Args:
        model: the rollout ``M3ForCausalLM`` (its StackedExperts may hold experts [a, b) with
            ``expert_range``; contracts.md).
        atomic: see module docstring.
        double_buffer: post the receive of bucket k+1 before processing bucket k.
        version: weight version the model holds now.
        on_commit: called with the new version after the weights changed (engine hooks:
            reset the prefix cache, set the weight version).
        prefix: released-name prefix; must match the trainer's.
        check_finite: reject buckets with NaN / inf in owned tensors; default: on when atomic,
            off otherwise (``atomic=False`` is the fast path: checksum only).
    Raises ValueError when a destination view is not contiguous (cannot be written flat).
    """

    def __init__(
        self,
        model: nn.Module,
        atomic: bool = True,
        double_buffer: bool = True,
        version: int = 0,
        on_commit: Callable[[int], None] | None = None,
        prefix: str = RELEASED_PREFIX,
        check_finite: bool | None = None,
    ):
        layout = list(receiver_layout(model, prefix=prefix))
        self.local_manifest: list[TensorSpec] = [s for s, _ in layout]
        self.views: dict[str, torch.Tensor | None] = {s.name: v for s, v in layout}
        for name, v in self.views.items():
            if v is not None and not v.is_contiguous():
                raise ValueError(f"{name}: destination view is not contiguous; cannot receive it in place")
        self.device = next(model.parameters()).device
        self.atomic, self.double_buffer = atomic, double_buffer
        self._check_finite = check_finite
        self.version = int(version)
        self.valid = True
        self.on_commit = on_commit
        self.rank_label = "rollout"
        self.manifest: list[TensorSpec] | None = None
        self._stage_cache: torch.Tensor | None = None
        self._scratch_cache: list[torch.Tensor] = []
        self._reset()

    @property
    def check_finite(self) -> bool:
        return self.atomic if self._check_finite is None else bool(self._check_finite)

    def _reset(self) -> None:
        self._header: UpdateHeader | None = None
        self._states: list[_BucketState] = []
        self._errors: list[str] = []
        self._touched = False  # non-atomic: some parameter bytes were overwritten this update
        self._stage: torch.Tensor | None = None
        self._scratch: list[torch.Tensor] = []
        self._direct: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # colocated: (dst view, src)

    # ---------------------------------------------------------------- protocol steps
    def check_handshake(self, manifest: list[TensorSpec]) -> list[str]:
        """Compare the trainer's manifest with this rank's; remember it when equal."""
        diffs = diff_manifests(manifest, self.local_manifest)
        self.manifest = None if diffs else list(manifest)
        return diffs

    def begin(self, header: UpdateHeader, bucket_bytes: int) -> list[Bucket]:
        """Start an update; returns the bucket plan (the same the sender computes).

        Header problems (shape, dtype, missing / repeated tensor) are recorded as errors; the
        buckets must still be consumed to stay in step with the group, but nothing is applied."""
        if self.manifest is None:
            raise RuntimeError("weight update before a successful handshake")
        self._reset()
        self._header = header
        self._errors = [f"{self.rank_label}: {p}" for p in check_header(header, self.manifest)]
        plan = plan_buckets([(shape, dt) for _, shape, dt in header.entries], bucket_bytes)
        stage_bytes = 0
        for b in plan:
            owned = []
            for seg in b.segments:
                idx = header.entries[seg.entry][0]
                view = self.views.get(self.manifest[idx].name) if 0 <= idx < len(self.manifest) else None
                if view is not None and not self._errors:
                    owned.append((seg, view.reshape(-1)))
            full = len(owned) == len(b.segments) and self.device.type == "cpu"
            st = _BucketState(b, owned, full)
            if self.atomic and owned:
                st.stage_offset = stage_bytes
                if full:
                    stage_bytes += b.wire_bytes
                else:
                    offs, n = [], 0
                    for seg, _ in owned:
                        offs.append(stage_bytes + n)
                        n += seg.numel * b.dtype.itemsize
                    st.stage_offsets = tuple(offs)
                    stage_bytes += (n + 7) // 8 * 8
            self._states.append(st)
        # NOTE: stage and wire buffers are kept between updates (same plan each time): fresh host
        # allocations page-fault on first touch, which cost more than the copies themselves.
        if self.atomic:
            if self._stage_cache is None or self._stage_cache.numel() < stage_bytes:
                self._stage_cache = None
                self._stage_cache = torch.empty(stage_bytes, dtype=torch.uint8, pin_memory=self.device.type == "cuda")
            self._stage = self._stage_cache[:stage_bytes]
        wire = max((b.wire_bytes for b in plan), default=8)
        n = 2 if self.double_buffer else 1
        if len(self._scratch_cache) != n or self._scratch_cache[0].numel() < wire:
            self._scratch_cache = []
            self._scratch_cache = [torch.empty(wire, dtype=torch.uint8, device=self.device) for _ in range(n)]
        self._scratch = self._scratch_cache
        return plan

    def release_buffers(self) -> None:
        """Free the cached host stage and wire buffers (they are reallocated by the next update)."""
        self._stage_cache, self._scratch_cache = None, []

    def bucket_buffer(self, k: int) -> torch.Tensor:
        """The uint8 buffer bucket k should be received into (a stage slot or a scratch buffer)."""
        st = self._states[k]
        if self.atomic and st.fully_owned:
            return self._stage[st.stage_offset : st.stage_offset + st.bucket.wire_bytes]
        return self._scratch[k % len(self._scratch)][: st.bucket.wire_bytes]

    def on_bucket(self, k: int, buf: torch.Tensor) -> None:
        """Validate (and stage or apply) bucket k, which has arrived in ``bucket_buffer(k)``."""
        st = self._states[k]
        b = st.bucket
        if self._errors or not st.owned:
            return  # update already failed here, or nothing of ours in this bucket (skip the read)
        if self.atomic and st.fully_owned:
            slot = self.bucket_buffer(k)
            if slot.data_ptr() != buf.data_ptr():  # colocated path: bytes arrive in the sender's buffer
                slot.copy_(buf[: b.wire_bytes])
            buf = slot
        if not checksum_ok(buf, b):
            self._fail(f"bucket {k} ({b.dtype}, {b.data_bytes} bytes) checksum mismatch; holds " + self._names(b))
            return
        if not self.atomic:
            if self.check_finite:
                whole = len(st.owned) == len(b.segments)
                if whole and all_finite(buf[: b.data_bytes].view(b.dtype)):
                    bad = []
                else:
                    bad = [seg for seg, _ in st.owned if not all_finite(segment_view(buf, b, seg))]
                if bad:
                    self._fail(f"non-finite values in {self._seg_name(bad[0])}")
                    return
            with torch.no_grad():
                for seg, dst in st.owned:
                    dst[seg.elem_start : seg.elem_start + seg.numel].copy_(segment_view(buf, b, seg))
            self._touched = True
            return
        if not st.fully_owned:
            for (seg, _), off in zip(st.owned, st.stage_offsets):
                n = seg.numel * b.dtype.itemsize
                self._stage[off : off + n].copy_(buf[seg.byte_offset : seg.byte_offset + n])
        if not self.check_finite or all_finite(self._staged_all(st)):
            return
        bad = [seg for seg, _ in st.owned if not all_finite(self._staged(st, seg))]
        for seg in bad[:_MAX_NAMES]:
            self._fail(f"non-finite values in {self._seg_name(seg)}")

    # ---------------------------------------------------------------- colocated direct path
    def receive_direct(self, header: UpdateHeader, sources: list[torch.Tensor]) -> None:
        """In-process update without buckets (``direct.py``): ``sources[k]`` is the trainer tensor
        of ``header.entries[k]`` (trainer dtype, any device; cast on copy).

        Checks the header against the handshake, then: ``atomic=False`` copies every owned tensor
        into its destination view now (after the fused finite check when ``check_finite``);
        ``atomic=True`` only validates (fused finite check of the cast values, one host sync) and
        keeps the pairs for ``complete`` to copy when every receiver succeeded; the trainer tensors
        are the stage, so they must not change before ``complete`` (the channel calls both in one
        go). Follow with ``status`` / ``complete`` as for buckets.
        """
        if self.manifest is None:
            raise RuntimeError("weight update before a successful handshake")
        self._reset()
        self._header = header
        self._errors = [f"{self.rank_label}: {p}" for p in check_header(header, self.manifest)]
        if len(sources) != len(header.entries):
            self._fail(f"update carries {len(sources)} tensors for {len(header.entries)} header entries")
        if self._errors:
            return
        pairs, names = [], []
        for (idx, _, _), src in zip(header.entries, sources):
            view = self.views.get(self.manifest[idx].name)
            if view is not None:
                pairs.append((view, src))
                names.append(self.manifest[idx].name)
        if self.check_finite:
            bad = nonfinite([s for _, s in pairs], [d.dtype for d, _ in pairs])
            for i in bad[:_MAX_NAMES]:
                self._fail(f"non-finite values in {names[i]}")
            if bad:
                return
        if self.atomic:
            self._direct = pairs
            return
        copy_into([d for d, _ in pairs], [s for _, s in pairs])
        self._touched = True

    def status(self) -> dict:
        """This rank's verdict for the status exchange."""
        return {"ok": not self._errors, "errors": list(self._errors)}

    def complete(self, all_ok: bool, seconds: float = 0.0) -> UpdateResult:
        """Commit (atomic, when every rank succeeded) or discard; set version / validity."""
        h = self._header
        assert h is not None, "complete() without begin()"
        mine_ok = not self._errors
        changed = False
        if self.atomic:
            if all_ok and mine_ok:
                self._commit()
                changed = True
        else:
            if mine_ok:
                changed = True
            elif self._touched:
                self.valid = False
        if changed:
            self.version, self.valid = int(h.version), True
        ok = changed and (all_ok or not self.atomic)
        errors = list(self._errors)
        if not all_ok and mine_ok and self.atomic:
            errors.append(f"{self.rank_label}: update {h.version} not applied: another rank failed")
        self._reset()
        if changed and self.on_commit is not None:
            self.on_commit(self.version)
        return UpdateResult(
            ok=ok, version=self.version, errors=errors, valid=self.valid, seconds=seconds, changed=changed
        )

    def interrupted(self, reason: str) -> UpdateResult:
        """The transport failed mid-update: drop staged bytes; non-atomic ranks that already wrote
        bytes become invalid."""
        if not self.atomic and self._touched:
            self.valid = False
        self._reset()
        return UpdateResult(
            ok=False,
            version=self.version,
            errors=[f"{self.rank_label}: {reason}"],
            valid=self.valid,
            needs_rebuild=True,
        )

    # ---------------------------------------------------------------- drivers over a group
    def handshake(self, group: WeightSyncGroup) -> None:
        """Receive the trainer's manifest, compare, exchange verdicts. Raises HandshakeError
        listing every rank's differences."""
        self.rank_label = f"rank {group.rank}"
        n = torch.zeros(1, dtype=torch.int64, device=group.device)
        group.broadcast(n)
        data = torch.empty(int(n), dtype=torch.uint8, device=group.device)
        group.broadcast(data)
        diffs = self.check_handshake(manifest_from_bytes(data.cpu().numpy().tobytes()))
        verdicts = group.exchange_objects([f"rank {group.rank}: {d}" for d in diffs])
        problems = [d for v in verdicts for d in v]
        if problems:
            self.manifest = None
            raise HandshakeError("weight-sync handshake failed:\n  " + "\n  ".join(problems))

    def receive_update(self, group: WeightSyncGroup, bucket_bytes: int) -> UpdateResult:
        """Receive one update (header, buckets, status exchange) and commit or discard.

        Never raises for a bad update: the result says what happened. On a transport failure
        (sender killed, timeout) the result has ``needs_rebuild=True``."""
        import time

        t0 = time.perf_counter()
        self.rank_label = f"rank {group.rank}"
        try:
            n = torch.zeros(1, dtype=torch.int64, device=group.device)
            group.broadcast(n)
            hdr = torch.empty(int(n), dtype=torch.int64, device=group.device)
            group.broadcast(hdr)
            plan = self.begin(decode_header(hdr.cpu()), bucket_bytes)
            pending = None
            for k in range(len(plan)):
                buf = self.bucket_buffer(k)
                work = group.broadcast(buf, async_op=True)
                if pending is not None:
                    group.wait(pending[1])
                    self.on_bucket(pending[0], pending[2])
                if not self.double_buffer:
                    group.wait(work)
                    self.on_bucket(k, buf)
                    work = None
                pending = (k, work, buf) if work is not None else None
            if pending is not None:
                group.wait(pending[1])
                self.on_bucket(pending[0], pending[2])
            verdicts = group.exchange_objects(self.status())
        except (WeightSyncTimeout, ValueError) as exc:
            return self.interrupted(f"update interrupted: {exc}")
        all_ok = all(v["ok"] for v in verdicts)
        return self.complete(all_ok, time.perf_counter() - t0)

    # ---------------------------------------------------------------- helpers
    def _fail(self, msg: str) -> None:
        self._errors.append(f"{self.rank_label}: {msg}")

    def _seg_name(self, seg) -> str:
        idx = self._header.entries[seg.entry][0]
        return self.manifest[idx].name

    def _names(self, b: Bucket) -> str:
        names = [self._seg_name(s) for s in b.segments[:_MAX_NAMES]]
        more = len(b.segments) - len(names)
        return ", ".join(names) + (f" and {more} more" if more > 0 else "")

    def _staged(self, st: _BucketState, seg) -> torch.Tensor:
        if st.fully_owned:
            return segment_view(self._stage[st.stage_offset :], st.bucket, seg)
        off = st.stage_offsets[[s for s, _ in st.owned].index(seg)]
        return self._stage[off : off + seg.numel * st.bucket.dtype.itemsize].view(st.bucket.dtype)

    def _staged_all(self, st: _BucketState) -> torch.Tensor:
        b = st.bucket
        if st.fully_owned:
            return self._stage[st.stage_offset : st.stage_offset + b.data_bytes].view(b.dtype)
        end = st.stage_offsets[-1] + st.owned[-1][0].numel * b.dtype.itemsize
        return self._stage[st.stage_offsets[0] : end].view(b.dtype)

    @torch.no_grad()
    def _commit(self) -> None:
        if self._direct is not None:
            copy_into([d for d, _ in self._direct], [s for _, s in self._direct])
        for st in self._states:
            for seg, dst in st.owned:
                dst[seg.elem_start : seg.elem_start + seg.numel].copy_(self._staged(st, seg), non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

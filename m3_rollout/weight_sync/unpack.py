"""Receiver half of the bucketed pipeline: validate and stage / apply each bucket on the device,
read the verdict once per update.

Governing idea: nothing a bucket's checks produce is read on the host while buckets arrive. Per
bucket, on the receiver's side stream (ring.py), a handful of launches: the checksum of the
bytes as received and the sender's trailer go into two slots of a device table; one fused
pass (``copy_plan.CopyPlan`` over the bucket's owned segments) flags non-finite values of the
values as stored, and writes them into the parameters (``atomic=False``) or only checks them
(``atomic=True``, which then copies the owned bytes into the host stage). The table and every
bucket's flags are slices of ONE device buffer (``verdict``), zeroed once per update; after the
last bucket ``verdict()`` reads that buffer on the host: the update's ONE host sync, whatever the
number of buckets and whatever the outcome, and the comparisons happen on the host. A failure is
named from that same read: each bucket's pass has one run, so one flag, per owned segment
(``CopyPlan(merge=False)``), so a set flag names its tensor; nothing looks at the device again
(before, a flagged run of several tensors was re-checked tensor by tensor, ``direct.nonfinite``:
on a non-atomic rank, whose values sit in the parameters, three more syncs per failed update).

``read_verdict`` is that one read (the one device -> host transfer of an update); tests count its
calls, and ``tests/fake_cuda.HostSyncs`` counts every other host sync an update would make.

Layout (built once per (header entries, bucket size, handshake) and reused): for every bucket
its owned segments and their destinations (flat slices of the receiver's parameter views), and
where the owned bytes sit in the host stage: the owned segments merged into byte runs, each run
at a 16-byte aligned stage offset. Per (bucket, buffer) the work is cut once (``_Work``: the
checksum views, the fused pass, the stage copies), so a bucket costs its launches and no Python
objects. On a host device a bucket this rank owns entirely is received straight into its stage
slot (``in_stage``: the stage slot is the wire buffer, trailer included), which saves a host copy
per bucket.

Verdict buffer (uint8 on the device): ``[checks: int64 [n, 2] | flags: int32 [F]]``; row k of
``checks`` = (checksum of bucket k as received, the sender's trailer), (0, 0) for a bucket this
rank owns nothing of; ``flags`` holds each owned bucket's pass flags (one per owned segment, in
the pass's run order, then its ``any``): 16 bytes per bucket + 4 per owned segment (tens of KB
for thousands of tensors), read in one transfer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .buckets import Bucket, Segment, segment_view, trailer
from .copy_plan import CopyPlan, build_runs
from .ring import BucketRing, pipelined


def read_verdict(verdict: torch.Tensor) -> torch.Tensor:
    """The update's one host read: ``verdict`` (uint8 [nbytes], on the device) copied to the host."""
    return verdict.to("cpu")


@dataclass
class OwnedBucket:
    """What this rank keeps of one bucket.

    Attributes:
        bucket: the bucket (plan entry).
        pairs: [(segment, destination)] for the owned segments; destination = a flat slice of the
            parameter view (the bucket's wire dtype or the parameter's, cast on copy).
        runs: ((wire start, wire end, stage offset), ...): owned byte ranges and where they sit
            in the host stage (atomic).
        in_stage: received straight into the stage slot at ``runs[0][2]`` (host device, fully owned).
    """

    bucket: Bucket
    pairs: list[tuple[Segment, torch.Tensor]]
    runs: tuple[tuple[int, int, int], ...]
    in_stage: bool


@dataclass
class _Work:
    """Bucket k's work for one wire buffer, cut once: int64 views of the buffer's data region and
    trailer, the fused pass over the owned segments (flags bound to the
    bucket's slice of the verdict buffer), and, for the atomic device path, the (stage slice, wire
    slice) copies of the owned runs for the stage at ``stage_address``."""

    data: torch.Tensor
    trailer: torch.Tensor
    fused: CopyPlan
    check: torch.Tensor  # int64 0-d views of the bucket's row of the checks table:
    sent: torch.Tensor  # (checksum as received, the trailer as received)
    stage_address: int = -1
    stage_copies: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)


def _align16(n: int) -> int:
    return (n + 15) // 16 * 16


class BucketUnpack:
    """The receiver's per-layout state of the bucket path (see module docstring).

    Args:
        plan: the update's buckets (``plan_buckets`` of the header).
        destinations: per header entry, the flat destination view on this rank or None (not owned).
        names: per header entry, the released name (for errors).
        ring: the receiver's ``BucketRing``, reserved for the plan's largest bucket (each owned
            bucket's pass over its ring slot is built here: it fixes the bucket's flag slots).
    Raises ValueError (from ``CopyPlan``) when a destination and its segments differ in size.
    """

    def __init__(
        self,
        plan: list[Bucket],
        destinations: list[torch.Tensor | None],
        names: list[str],
        ring: BucketRing,
    ):
        self.plan, self.names, self.ring = plan, names, ring
        self.device = ring.device
        host = not pipelined(self.device)
        self.owned: list[OwnedBucket] = []
        stage = 0
        for b in plan:
            pairs = []
            for seg in b.segments:
                dst = destinations[seg.entry]
                if dst is not None:
                    pairs.append((seg, dst[seg.elem_start : seg.elem_start + seg.numel]))
            full = bool(pairs) and len(pairs) == len(b.segments) and host
            runs: list[tuple[int, int, int]] = []
            if full:
                runs.append((0, b.wire_bytes, stage))
                stage = _align16(stage + b.wire_bytes)
            else:
                for seg, _ in pairs:
                    lo, hi = seg.byte_offset, seg.byte_offset + seg.numel * b.dtype.itemsize
                    if runs and runs[-1][1] == lo:
                        runs[-1] = (runs[-1][0], hi, runs[-1][2])
                    else:
                        runs.append((lo, hi, stage))
                    stage = _align16(runs[-1][2] + runs[-1][1] - runs[-1][0])
            self.owned.append(OwnedBucket(b, pairs, tuple(runs), full))
        self.stage_bytes = stage
        n = len(plan)
        self._works: dict[tuple[int, int], _Work] = {}  # (k, buffer address) -> work
        # the pass over each owned bucket's ring slot: its runs fix the bucket's flag slots (the
        # same for every buffer: the segments are adjacent in any wire buffer)
        self._canon: dict[int, CopyPlan] = {}
        for k, o in enumerate(self.owned):
            if o.pairs:
                self._canon[k] = self._pass(k, ring.buffer(k, o.bucket.wire_bytes))
        self._flag_at: dict[int, int] = {}  # k -> first flag slot
        self._flag_owner: list[tuple[int, int]] = []  # flag slot -> (k, run index; -1 = the bucket's any)
        for k, p in self._canon.items():
            self._flag_at[k] = len(self._flag_owner)
            self._flag_owner += [(k, r) for r in range(len(p.runs))] + [(k, -1)]
        self._check_bytes = 16 * n
        nbytes = self._check_bytes + 4 * len(self._flag_owner)
        self.verdict_bytes = torch.zeros(nbytes, dtype=torch.uint8, device=self.device)
        self.checks = self.verdict_bytes[: self._check_bytes].view(torch.int64).view(n, 2)
        self._flags = self.verdict_bytes[self._check_bytes :].view(torch.int32)
        for k, p in self._canon.items():
            p.bind_flags(self._flag_slice(k, p))
            buf = ring.buffer(k, self.owned[k].bucket.wire_bytes)
            self._works[(k, buf.data_ptr())] = self._work(k, buf, p)
        self._commit_runs: tuple[int, list] | None = None  # (stage address, copy_plan runs)
        self.stage: torch.Tensor | None = None
        self.atomic = True

    def _flag_slice(self, k: int, p: CopyPlan) -> torch.Tensor:
        at = self._flag_at[k]
        return self._flags[at : at + len(p.runs) + 1]

    def _pass(self, k: int, buf: torch.Tensor) -> CopyPlan:
        """Bucket k's fused check (+ copy) pass reading wire buffer ``buf``: one run per owned
        segment (unmerged), so each flag names one segment's tensor."""
        o = self.owned[k]
        return CopyPlan([d for _, d in o.pairs], [segment_view(buf, o.bucket, s) for s, _ in o.pairs], merge=False)

    def _work(self, k: int, buf: torch.Tensor, fused: CopyPlan | None = None) -> _Work:
        """Bucket k's work for wire buffer ``buf`` (the pass built unless given), flags bound to
        the bucket's slots."""
        b = self.owned[k].bucket
        if fused is None:
            fused = self._pass(k, buf)
            if len(fused.runs) != len(self._canon[k].runs):
                raise AssertionError(f"bucket {k}: {len(fused.runs)} runs in this buffer, {len(self._canon[k].runs)}")
            fused.bind_flags(self._flag_slice(k, fused))
        row = self.checks[k]
        return _Work(buf[: b.padded_bytes].view(torch.int64), trailer(buf, b), fused, row[0], row[1])

    # ------------------------------------------------------------------ one update
    def start(self, atomic: bool, stage: Callable[[int], torch.Tensor] | None) -> None:
        """Begin an update (on the side stream): zero the verdict buffer (checks and flags);
        ``stage(nbytes)`` gives the host stage when atomic."""
        self.atomic = atomic
        self.stage = stage(self.stage_bytes) if atomic else None
        with self.ring.side():
            self.verdict_bytes.zero_()

    def buffer(self, k: int) -> torch.Tensor:
        """Where bucket k must arrive: its stage slot (``in_stage``, atomic) or its ring slot."""
        o = self.owned[k]
        if self.atomic and o.in_stage:
            at = o.runs[0][2]
            return self.stage[at : at + o.bucket.wire_bytes]
        return self.ring.buffer(k, o.bucket.wire_bytes)

    def receive(self, k: int, buf: torch.Tensor) -> bool:
        """Validate bucket k (in ``buf`` = ``buffer(k)``) and stage (atomic) or apply it, issued
        on the current stream (the ring's side stream), nothing read on the host. Returns True
        when parameter bytes were written (non-atomic with owned segments)."""
        o = self.owned[k]
        if not o.pairs:
            return False  # nothing of ours: skip the read (the checks row stays equal)
        key = (k, buf.data_ptr())
        w = self._works.get(key)
        if w is None:
            w = self._works[key] = self._work(k, buf)
        torch.sum(w.data, 0, out=w.check)
        w.sent.copy_(w.trailer)
        if not self.atomic:
            w.fused.launch(store=True, check=True)
            return True
        w.fused.launch(store=False, check=True)
        if not o.in_stage:
            if w.stage_address != self.stage.data_ptr():
                w.stage_address = self.stage.data_ptr()
                w.stage_copies = [(self.stage[at : at + hi - lo], buf[lo:hi]) for lo, hi, at in o.runs]
            for dst, src in w.stage_copies:
                dst.copy_(src, non_blocking=True)
        return False

    def verdict(self) -> tuple[list[int], list[str]]:
        """(buckets whose checksum differs, names of tensors holding non-finite values, in bucket
        order, each once), after the last ``receive``; call on the side stream. The update's one
        host read (``read_verdict``) of the verdict buffer, success or failure; the comparisons
        and the naming run on that host copy (a set flag is one segment's: its tensor's name). A
        bucket whose checksum failed is not searched for non-finite values (its bytes are torn)."""
        host = read_verdict(self.verdict_bytes)
        sums = host[: self._check_bytes].view(torch.int64).view(-1, 2)
        bad_sums = (sums[:, 0] != sums[:, 1]).nonzero().flatten().tolist()
        skip = set(bad_sums)
        names: dict[str, None] = {}
        for at in host[self._check_bytes :].view(torch.int32).nonzero().flatten().tolist():
            k, r = self._flag_owner[at]
            if r >= 0 and k not in skip:
                for i in self._canon[k].runs[r].members:  # one member: the runs are unmerged
                    names[self.names[self.owned[k].pairs[i][0].entry]] = None
        return bad_sums, list(names)

    # ------------------------------------------------------------------ atomic commit
    def staged(self, k: int, i: int) -> torch.Tensor:
        """Pair i of bucket k in the host stage (1-D, the bucket's wire dtype)."""
        o = self.owned[k]
        seg = o.pairs[i][0]
        lo = seg.byte_offset
        for r_lo, r_hi, at in o.runs:
            if r_lo <= lo < r_hi:
                start = at + lo - r_lo
                return self.stage[start : start + seg.numel * o.bucket.dtype.itemsize].view(o.bucket.dtype)
        raise AssertionError(f"bucket {k}: segment at byte {lo} is in no staged run")

    def targets(self) -> list[torch.Tensor]:
        """Every destination slice an update writes (1-D views)."""
        return [dst for o in self.owned for _, dst in o.pairs]

    @torch.no_grad()
    def commit(self) -> None:
        """Copy the staged bytes into the parameters on the current stream (host -> device copies
        from the pinned stage on CUDA, merged into runs; no host sync)."""
        c = self._commit_runs
        if c is None or c[0] != self.stage.data_ptr():
            dsts, srcs = [], []
            for k, o in enumerate(self.owned):
                for i, (_, dst) in enumerate(o.pairs):
                    dsts.append(dst)
                    srcs.append(self.staged(k, i))
            c = self._commit_runs = (self.stage.data_ptr(), build_runs(dsts, srcs))
        for r in c[1]:
            r.dst.copy_(r.src, non_blocking=True)

"""Receiver half of the bucketed pipeline: validate and stage / apply each bucket on the device,
read the verdict once per update.

Governing idea: nothing a bucket's checks produce is read on the host while buckets arrive. Per
bucket, on the receiver's side stream (ring.py), a handful of launches: the checksum of the
bytes as received and the sender's trailer go into two columns of a device table; one fused
pass (``copy_plan.CopyPlan`` over the bucket's owned segments) flags non-finite values of the
values as stored, and writes them into the parameters (``atomic=False``) or only checks them
(``atomic=True``, which then copies the owned bytes into the host stage). After the last
bucket, ``verdict`` compares the table, gathers the flags and reads them on the host: the
update's ONE host sync, whatever the number of buckets. Only on failure does it look closer
(per-tensor finite check, ``direct.nonfinite``) to name the tensors.

``read_verdict`` is that one read; tests count its calls.

Layout (built once per (header entries, bucket size, handshake) and reused): for every bucket
its owned segments and their destinations (flat slices of the receiver's parameter views), and
where the owned bytes sit in the host stage: the owned segments merged into byte runs, each run
at a 16-byte aligned stage offset. On CPU a bucket this rank owns entirely is received straight
into its stage slot (``in_stage``: the stage slot is the wire buffer, trailer included), which
saves a host copy per bucket.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .buckets import Bucket, Segment, checksum_into, segment_view, trailer
from .copy_plan import CopyPlan, build_runs
from .direct import nonfinite
from .ring import BucketRing


def read_verdict(flags: torch.Tensor) -> torch.Tensor:
    """The update's one host read: ``flags`` (int32 [n], on the device) copied to the host."""
    return flags.to("cpu")


@dataclass
class OwnedBucket:
    """What this rank keeps of one bucket.

    Attributes:
        bucket: the bucket (plan entry).
        pairs: [(segment, destination)] for the owned segments; destination = a flat slice of the
            parameter view (the bucket's wire dtype or the parameter's, cast on copy).
        runs: ((wire start, wire end, stage offset), ...): owned byte ranges and where they sit
            in the host stage (atomic).
        in_stage: received straight into the stage slot at ``runs[0][2]`` (CPU, fully owned).
    """

    bucket: Bucket
    pairs: list[tuple[Segment, torch.Tensor]]
    runs: tuple[tuple[int, int, int], ...]
    in_stage: bool


def _align16(n: int) -> int:
    return (n + 15) // 16 * 16


class BucketUnpack:
    """The receiver's per-layout state of the bucket path (see module docstring).

    Args:
        plan: the update's buckets (``plan_buckets`` of the header).
        destinations: per header entry, the flat destination view on this rank or None (not owned).
        names: per header entry, the released name (for errors).
        ring: the receiver's ``BucketRing`` (slots reserved for the plan's largest bucket).
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
        self.owned: list[OwnedBucket] = []
        stage = 0
        for b in plan:
            pairs = []
            for seg in b.segments:
                dst = destinations[seg.entry]
                if dst is not None:
                    pairs.append((seg, dst[seg.elem_start : seg.elem_start + seg.numel]))
            full = bool(pairs) and len(pairs) == len(b.segments) and self.device.type == "cpu"
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
        # int64 [n, 2]: (checksum of the bytes as received, the sender's trailer); a bucket this
        # rank skips (owns nothing of) keeps (0, 0)
        self.checks = torch.zeros(len(plan), 2, dtype=torch.int64, device=self.device)
        self._passes: dict[int, tuple[int, CopyPlan]] = {}  # k -> (buffer address, fused pass)
        self._commit_runs: tuple[int, list] | None = None  # (stage address, copy_plan runs)
        self.stage: torch.Tensor | None = None
        self.atomic = True
        self._used: list[tuple[int, CopyPlan]] = []

    # ------------------------------------------------------------------ one update
    def start(self, atomic: bool, stage: Callable[[int], torch.Tensor] | None) -> None:
        """Begin an update (on the side stream): reset the checks table; ``stage(nbytes)`` gives
        the host stage when atomic."""
        self.atomic = atomic
        self.stage = stage(self.stage_bytes) if atomic else None
        self._used = []
        with self.ring.side():
            self.checks.zero_()

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
        b = o.bucket
        checksum_into(buf, b, self.checks[k, 0])
        self.checks[k, 1].copy_(trailer(buf, b))
        fused = self._pass(k, buf)
        self._used.append((k, fused))
        if not self.atomic:
            fused.copy_check()
            return True
        fused.check()
        if not o.in_stage:
            for lo, hi, at in o.runs:
                self.stage[at : at + hi - lo].copy_(buf[lo:hi], non_blocking=True)
        return False

    def _pass(self, k: int, buf: torch.Tensor) -> CopyPlan:
        """Bucket k's fused check (+ copy) pass for ``buf``, built once per buffer address."""
        cached = self._passes.get(k)
        if cached is None or cached[0] != buf.data_ptr():
            b = self.owned[k].bucket
            pairs = self.owned[k].pairs
            cached = self._passes[k] = (
                buf.data_ptr(),
                CopyPlan([d for _, d in pairs], [segment_view(buf, b, s) for s, _ in pairs]),
            )
        return cached[1]

    def verdict(self) -> tuple[list[int], list[str]]:
        """(buckets whose checksum differs, names of tensors holding non-finite values), after the
        last ``receive``; call on the side stream. One host read (``read_verdict``); the
        per-tensor check that names the tensors runs only when a flag is set."""
        parts = [(self.checks[:, 0] != self.checks[:, 1]).to(torch.int32)]
        parts += [p.flags for _, p in self._used]
        host = read_verdict(torch.cat(parts))
        n = len(self.plan)
        bad_sums = host[:n].nonzero().flatten().tolist()
        skip = set(bad_sums)  # a torn bucket's values are not worth naming: its checksum already failed
        flagged: list[tuple[int, int]] = []
        at = n
        for k, p in self._used:
            runs = host[at : at + p.flags.numel()].nonzero().flatten().tolist()
            at += p.flags.numel()
            if k not in skip:
                flagged += [(k, i) for r in runs if r < len(p.runs) for i in p.runs[r].members]
        return bad_sums, self._name_nonfinite(flagged)

    def _name_nonfinite(self, flagged: list[tuple[int, int]]) -> list[str]:
        """Names of the flagged (bucket, pair) segments that hold a non-finite value, in order,
        each once. Reads the staged bytes (atomic) or the parameters (non-atomic)."""
        if not flagged:
            return []
        data, dtypes, names = [], [], []
        for k, i in flagged:
            seg, dst = self.owned[k].pairs[i]
            data.append(self.staged(k, i) if self.atomic else dst)
            dtypes.append(dst.dtype)
            names.append(self.names[seg.entry])
        hits = nonfinite(data, dtypes)
        # the fused flags and the exact check should agree; if not, name every flagged tensor
        chosen = [names[j] for j in hits] if hits else names
        return list(dict.fromkeys(chosen))

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

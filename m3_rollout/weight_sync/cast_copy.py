"""The trainer's low-precision copy of its master weights, refreshed by ONE fused cast that also
attests the copy's finiteness: the flags a refit validates from without reading the bytes again.

Governing idea: validating an update before any byte reaches the engine used to cost a separate
pass over the source (check, then copy: three trips over the bytes where a flat copy makes two,
ceiling ~0.67x). But a trainer computing in bf16 casts its fp32 masters into a bf16 copy after
every optimizer step anyway (``Policy.compute``), and that cast reads and writes exactly the
bytes a refit sends. ``CastCopy.refresh`` runs it as a ``CopyPlan`` copy + check pass (same
traffic as the plain cast) that leaves per-run non-finite flags on the device. The refit then
sends the copy (already in the wire dtype: the same bits the receiver's own cast of the master
would produce) together with this object, and the receiver validates from the flags (one 4-byte
read) and runs a single copy pass.

The guarantee (what ``current()`` and ``covers()`` establish before the flags are trusted):
  1. the flags were produced by the pass that wrote the copy's values: a cast from the masters
     whose version counters are those recorded (``refresh`` re-casts when they moved on: an
     optimizer step, a checkpoint load, any in-place write through torch);
  2. nothing wrote the copy since (its parameters' version counters are those recorded right
     after the cast);
  3. every tensor the receiver reads lies inside the bytes the cast wrote (adjacent written ranges
     count as one; checked once per source list), and its copy into the destination cannot
     overflow (same dtype or widening; ``CopyPlan.keeps_finite``).
If any of these fails the receiver falls back to the check pass over what it reads, so a stale
or missing attestation costs time, never safety. Version counters see every in-place write made
through torch; writes through ``.data`` or raw pointers (a kernel of one's own) are not seen:
the copy is the trainer's, written only by this cast.

Lending (the IPC refit, ipc.py): a rollout worker in another process may read the copy itself
(shared once by handle), which no version counter of this process sees. Ordering rule: the copy
is written only by ``refresh``'s cast, and the cast never runs while the copy is lent to a refit
that has not been acknowledged: ``lend(reader)`` before the readers are told to read, ``reclaim()``
once every reader acknowledged (its reads are complete on the device) or was dropped; a
``refresh`` that would cast meanwhile raises RuntimeError instead of writing under a reader. The
readers wait for the cast itself through ``wait_written`` (the cast is asynchronous on a GPU).
"""

from __future__ import annotations

import bisect

import torch
from torch import nn

from m3_rollout.model.loading import RELEASED_PREFIX

from .copy_plan import CopyPlan
from .released import ParamWatch, ReleasedTensors


class CastCopy:
    """``copy``'s parameters = ``master``'s cast to ``copy``'s dtypes, with the finite flags of the
    cast that wrote them.

    Args:
        master: the trainer's model (fp32 masters; the optimizer steps it).
        copy: its low-precision twin (``copy.deepcopy(master).cast_for_inference(dtype)``: same
            parameters in the same order and shapes, any float dtypes, possibly packed views).
        prefix: released-name prefix of ``released``.
    Attributes:
        released: ``ReleasedTensors`` of ``copy`` (what a direct refit sends).
        casts: number of casts run (the flags belong to the last one).
        layouts: number of times the parameters' addresses were (re)read (a moved parameter).
    Raises ValueError when the two models' parameters do not pair up (count, shape, device).
    Call ``refresh()`` after the masters changed (the policy does after every optimizer step);
    it is a no-op (two O(parameters) C-level reads) when they did not.
    """

    def __init__(self, master: nn.Module, copy: nn.Module, prefix: str = RELEASED_PREFIX):
        self.master, self.copy = master, copy
        self._master, self._copy = ParamWatch(master), ParamWatch(copy)
        self.released = ReleasedTensors(copy, prefix)
        self.casts = self.layouts = 0
        self.plan: CopyPlan | None = None
        self._layout: tuple | None = None
        self._master_version = self._copy_version = -1
        self._verdict = (-1, False)  # (casts, any flag set) read back once per cast
        self._ranges: list[tuple[int, int]] = []  # sorted (start, end) byte ranges the cast writes
        self.lent_to: str | None = None  # the unacknowledged reader of the copy (``lend``)
        self._written = None  # CUDA event recorded after the last cast

    def _build(self) -> None:
        masters, copies = self._master.params(), self._copy.params()
        if len(masters) != len(copies):
            raise ValueError(f"CastCopy: {len(masters)} master parameters but {len(copies)} in the copy")
        for i, (m, c) in enumerate(zip(masters, copies)):
            if m.shape != c.shape or m.device != c.device:
                raise ValueError(f"CastCopy: parameter {i}: master {list(m.shape)} on {m.device}, copy {list(c.shape)}")
        self.plan = CopyPlan([c.detach() for c in copies], [m.detach() for m in masters])
        self._read_ranges()
        self._layout = self._master.addresses()
        self.layouts += 1

    def _read_ranges(self) -> None:
        """The byte ranges the cast writes, sorted, with touching or overlapping ranges merged: a
        reader's run may span several cast runs (packed views, e.g. q/k/v of one buffer, are
        adjacent in the copy but cast from separate master storages, so they are separate cast
        runs while a rollout model packed the same way merges them into one run)."""
        merged: list[list[int]] = []
        for start, end in sorted(
            (r.dst.data_ptr(), r.dst.data_ptr() + r.dst.numel() * r.dst.element_size()) for r in self.plan.runs
        ):
            if merged and start <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], end)
            else:
                merged.append([start, end])
        self._ranges = [(a, b) for a, b in merged]

    def refresh(self) -> bool:
        """Cast the masters into the copy (fused copy + finite flags, no host sync) unless they are
        unchanged since the last cast and no master parameter moved. Returns whether it cast.

        NOTE: the copy's own addresses are not re-read per call (the copy is the trainer's and is
        never re-pointed; were it, a refit would still be safe: sources outside the ranges the
        cast writes fail ``covers`` and are checked instead)."""
        moved = self._master.addresses() != self._layout
        version = self._master.version()
        if not moved and version == self._master_version:
            return False
        if self.lent_to is not None:
            raise RuntimeError(
                f"CastCopy: the compute copy is lent to {self.lent_to}, which has not acknowledged its reads; "
                "the cast may not overwrite it before (rebuild the channel, or drop its workers, first)"
            )
        if moved:
            self._build()
        self.plan.copy_check()
        self.casts += 1
        self._master_version = version  # the cast reads the masters, never writes them
        self._copy_version = self._copy.version()  # after the cast (the torch path counts its own writes)
        if self.plan.device.type == "cuda":
            if self._written is None:
                self._written = torch.cuda.Event()
            self._written.record(torch.cuda.current_stream(self.plan.device))
        return True

    def pending(self) -> bool:
        """Whether ``refresh`` would cast: a master moved or was written since the last cast (or
        none ran). Two O(parameters) C-level reads."""
        return self._master.addresses() != self._layout or self._master.version() != self._master_version

    # ------------------------------------------------------------------ sharing with a reader process
    def lend(self, reader: str) -> None:
        """The copy is about to be read by ``reader`` (another process): no cast until ``reclaim``."""
        self.lent_to = reader

    def reclaim(self) -> None:
        """Every reader acknowledged (or was dropped): the cast may run again."""
        self.lent_to = None

    def wait_written(self) -> None:
        """Block the host until the last cast is complete on the device (a reader in another process
        is not ordered after this process's streams). A no-op on CPU or when it is done."""
        if self._written is not None:
            self._written.synchronize()

    def storages(self) -> list[torch.UntypedStorage]:
        """The distinct storages of the copy's parameters, in parameter order (what a reader
        process opens: every released tensor of the copy is a view of one of them)."""
        seen: dict[int, torch.UntypedStorage] = {}
        for p in self._copy.params():
            st = p.untyped_storage()
            seen.setdefault(st.data_ptr(), st)
        return list(seen.values())

    def share_memory(self) -> None:
        """Move the copy's storages into shared memory (CPU; CUDA storages are shared by handle as
        they are). In place: every view follows, the addresses change (the ranges are re-read)."""
        for st in self.storages():
            if st.device.type == "cpu" and not st.is_shared():
                st.share_memory_()
        if self.plan is not None:
            self._read_ranges()

    # ------------------------------------------------------------------ the attestation
    def current(self) -> bool:
        """The flags describe the copy as it is: a cast ran and no in-place write touched the copy
        since (guarantee 2 of the module docstring). O(parameters) C-level reads, no sync."""
        return self.plan is not None and self._copy.version() == self._copy_version

    def covers(self, tensors: list[torch.Tensor]) -> bool:
        """Every tensor lies inside a range the cast wrote (guarantee 3). O(tensors log runs):
        call once per source list and keep the answer."""
        for t in tensors:
            if t.numel() == 0:
                continue
            start = t.data_ptr()
            end = start + t.numel() * t.element_size()
            if not t.is_contiguous():
                return False
            k = bisect.bisect_right(self._ranges, (start, float("inf"))) - 1
            if k < 0 or end > self._ranges[k][1]:
                return False
        return True

    def any_bad(self) -> bool:
        """Whether the last cast wrote a non-finite value anywhere (one host sync per cast, 4 bytes)."""
        if self._verdict[0] != self.casts:
            self._verdict = (self.casts, self.plan.any_bad())
        return self._verdict[1]

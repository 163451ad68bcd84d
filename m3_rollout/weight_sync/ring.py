"""A ring of wire buffers and a side stream: the skeleton of the bucketed weight-sync pipeline.

Governing idea: bucket k goes through slot ``k % slots`` of a small ring, so with three slots
bucket k+1 is packed while k is on the wire and k-1 is unpacked. Each end issues its per-bucket
work (sender: pack + checksum; receiver: checksum, finite flags, stage or apply) on the ring's
side stream, never on the caller's, and orders the stages with CUDA events and stream waits
only: nothing here makes the host wait for the device. On CPU (gloo) the same calls run inline:
there is no stream, and a slot is free once the host has finished with it.

Per-bucket host cost: everything a bucket needs is made once and reused (the events are one per
slot and re-recorded, the wire views are cut once per (slot, size), the stream switch reads and
sets raw stream ids), so the pipeline's host time per bucket is a few tens of microseconds of
launches, not object churn.

Ordering rules the users follow (sender.py, receiver.py):
- ``start()`` before the first bucket: the side stream waits for the caller's stream (the
  trainer's parameters, the rollout's parameters, the host stage were last touched there);
- a slot is written only after ``acquire(k)`` (the stage that last read it for bucket k - slots
  recorded ``release``), or after a wait that implies it (same stream, issued later);
- ``finish()`` once the update's work is issued: the caller's stream waits for the side stream.
"""

from __future__ import annotations

import contextlib

import torch


def pipelined(device: torch.device) -> bool:
    """Whether ``device`` runs the bucket pipeline on side streams ordered by events (CUDA); else
    every step runs inline on the host (CPU, gloo)."""
    return device.type == "cuda"


class SlotEvents:
    """One reusable CUDA event per ring slot (none on a host device).

    ``record(k, stream)`` marks the point bucket k's step reached on ``stream``; ``wait(k, stream)``
    makes ``stream`` wait for bucket k's last record (a no-op before the slot's first record). An
    event is re-recorded by bucket k + slots only after every wait on bucket k's record was issued
    (each user waits before it records again), so one event per slot suffices.
    """

    def __init__(self, device: torch.device, slots: int):
        self.slots = slots
        self.events = [torch.cuda.Event() for _ in range(slots)] if pipelined(device) else None
        self.recorded = [False] * slots

    def record(self, k: int, stream) -> None:
        if self.events is not None:
            self.events[k % self.slots].record(stream)
            self.recorded[k % self.slots] = True

    def wait(self, k: int, stream) -> None:
        if self.events is not None and self.recorded[k % self.slots]:
            stream.wait_event(self.events[k % self.slots])

    def event(self, k: int):
        """Bucket k's event (None on a host device): hand it to a waiter on another object."""
        return self.events[k % self.slots] if self.events is not None else None

    def reset(self) -> None:
        self.recorded = [False] * self.slots


class StreamSwitch:
    """Context manager making ``stream`` current on its device and restoring the stream that was
    current before (a no-op for None). Reuse one per stream: it reads and sets raw stream ids
    (what ``torch.cuda.stream`` does, without building ``Stream`` objects on every entry)."""

    def __init__(self, stream):
        self.stream = stream
        self._saved: list[tuple[int, int, int]] = []
        if stream is not None:
            self._ids = (stream.stream_id, stream.device_index, stream.device_type)

    def __enter__(self):
        if self.stream is None:
            return self
        if torch._C._cuda_getDevice() != self._ids[1]:  # another current device: the full context
            ctx = torch.cuda.stream(self.stream)
            ctx.__enter__()
            self._saved.append(ctx)
            return self
        self._saved.append(torch._C._cuda_getCurrentStream(self._ids[1]))
        torch._C._cuda_setStream(stream_id=self._ids[0], device_index=self._ids[1], device_type=self._ids[2])
        return self

    def __exit__(self, *exc) -> None:
        if self.stream is None:
            return
        saved = self._saved.pop()
        if isinstance(saved, tuple):
            torch._C._cuda_setStream(stream_id=saved[0], device_index=saved[1], device_type=saved[2])
        else:
            saved.__exit__(*exc)


class BucketRing:
    """``slots`` uint8 wire buffers on ``device``, kept between updates, and one side stream.

    Args:
        device: where the buffers live (the group's device; cpu for gloo).
        slots: ring length (3: pack / transfer / unpack overlap; 1: one bucket at a time).
    """

    def __init__(self, device: torch.device | str, slots: int):
        if slots < 1:
            raise ValueError(f"bucket ring needs at least one slot, not {slots}")
        self.device, self.slots = torch.device(device), int(slots)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.buffers: list[torch.Tensor] = []
        self.stream = torch.cuda.Stream(self.device) if pipelined(self.device) else None
        self._side = StreamSwitch(self.stream)
        self.released = SlotEvents(self.device, self.slots)
        self._views: dict[tuple[int, int], torch.Tensor] = {}

    def reserve(self, nbytes: int) -> None:
        """Make every slot hold at least ``nbytes`` (reallocated only when too small: fresh host
        allocations page-fault on first touch, and device ones may sync the allocator)."""
        if len(self.buffers) == self.slots and self.buffers[0].numel() >= nbytes:
            return
        self.free()
        self.buffers = [torch.empty(max(nbytes, 8), dtype=torch.uint8, device=self.device) for _ in range(self.slots)]

    def free(self) -> None:
        """Drop the buffers. No host sync: the caller's stream first waits for the side stream, so
        the allocator (which reuses a block on the stream it was allocated on, the caller's)
        cannot hand the memory out while queued work still reads or writes it."""
        if self.stream is not None and self.buffers:
            self.finish()
        self.buffers = []
        self._views = {}
        self.released.reset()

    def buffer(self, k: int, nbytes: int) -> torch.Tensor:
        """The first ``nbytes`` of bucket k's slot (``reserve`` first); the view is cut once."""
        key = (k % self.slots, nbytes)
        view = self._views.get(key)
        if view is None:
            view = self._views[key] = self.buffers[key[0]][:nbytes]
        return view

    def side(self):
        """Context that makes the side stream current (a no-op on CPU)."""
        return self._side if self.stream is not None else contextlib.nullcontext()

    def start(self) -> None:
        """The side stream waits for the caller's current stream."""
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def finish(self) -> None:
        """The caller's current stream waits for everything issued on the side stream."""
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def release(self, k: int, stream=None) -> None:
        """Bucket k's last use of its slot has been issued on ``stream`` (default: the current one)."""
        if self.stream is not None:
            self.released.record(k, stream if stream is not None else torch.cuda.current_stream(self.device))

    def acquire(self, k: int, stream=None) -> None:
        """``stream`` (default: the current one) waits until bucket k's slot was released by
        bucket k - slots."""
        if self.stream is not None:
            self.released.wait(k, stream if stream is not None else torch.cuda.current_stream(self.device))

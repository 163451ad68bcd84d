"""A ring of wire buffers and a side stream: the skeleton of the bucketed weight-sync pipeline.

Governing idea: bucket k goes through slot ``k % slots`` of a small ring, so with three slots
bucket k+1 is packed while k is on the wire and k-1 is unpacked. Each end issues its per-bucket
work (sender: pack + checksum; receiver: checksum, finite flags, stage or apply) on the ring's
side stream, never on the caller's, and orders the stages with CUDA events and stream waits
only: nothing here makes the host wait for the device. On CPU (gloo) the same calls run inline:
there is no stream, and a slot is free once the host has finished with it.

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


def recorded_event(device: torch.device) -> torch.cuda.Event | None:
    """A CUDA event recorded on the current stream of ``device`` (None on CPU: nothing to wait for)."""
    if device.type != "cuda":
        return None
    ev = torch.cuda.Event()
    ev.record(torch.cuda.current_stream(device))
    return ev


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
        self.buffers: list[torch.Tensor] = []
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._released: list[torch.cuda.Event | None] = [None] * self.slots

    def reserve(self, nbytes: int) -> None:
        """Make every slot hold at least ``nbytes`` (reallocated only when too small: fresh host
        allocations page-fault on first touch, and device ones may sync the allocator)."""
        if len(self.buffers) == self.slots and self.buffers[0].numel() >= nbytes:
            return
        self.free()
        self.buffers = [torch.empty(max(nbytes, 8), dtype=torch.uint8, device=self.device) for _ in range(self.slots)]

    def free(self) -> None:
        """Drop the buffers (after the side stream's pending work on them)."""
        if self.stream is not None and self.buffers:
            self.stream.synchronize()
        self.buffers = []
        self._released = [None] * self.slots

    def buffer(self, k: int, nbytes: int) -> torch.Tensor:
        """The first ``nbytes`` of bucket k's slot (``reserve`` first)."""
        return self.buffers[k % self.slots][:nbytes]

    def side(self):
        """Context that makes the side stream current (a no-op on CPU)."""
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()

    def start(self) -> None:
        """The side stream waits for the caller's current stream."""
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def finish(self) -> None:
        """The caller's current stream waits for everything issued on the side stream."""
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def release(self, k: int) -> None:
        """Bucket k's last use of its slot has been issued on the current stream."""
        self._released[k % self.slots] = recorded_event(self.device)

    def acquire(self, k: int) -> None:
        """The current stream waits until bucket k's slot was released by bucket k - slots."""
        ev = self._released[k % self.slots]
        if ev is not None:
            torch.cuda.current_stream(self.device).wait_event(ev)

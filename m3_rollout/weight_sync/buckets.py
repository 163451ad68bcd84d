"""Bucket plan, packing and checksums for one weight update (design.md §3 wire format).

Governing idea: both ends derive the SAME plan from the update header alone, so only raw bytes
travel. Tensors are grouped by wire dtype (first-appearance order), each group's elements are
concatenated in header order and cut into buckets of at most ``bucket_bytes`` data bytes, so a
tensor larger than a bucket spans several and fp32 router tensors never share a bucket with bf16
ones. A bucket on the wire is a flat uint8 buffer: data (zero-padded to a multiple of 8 bytes)
followed by an 8-byte int64 checksum.

Checksum: the int64 sum, wrapping, of the data region read as int64 words (the data is padded
to 8 bytes): one fused reduction per bucket on either end, on the device. Wrapping addition is
associative, so every summation order (CPU, GPU, either end) gives the same value. It catches any
corrupted word and truncation; it is not a cryptographic hash and does not catch two swapped
words (NOTE: the transport already guarantees order; the checksum guards against torn transfers
and packing/staging bugs). The sender's value travels in the bucket's own trailer; the receiver
writes its value and the trailer into a device table and compares them once per update
(unpack.py), so no per-bucket result reaches the host. Finite values are checked by the
receiver's unpack pass (copy_plan.py flags), not here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .copy_plan import CopyPlan

CHECKSUM_BYTES = 8


@dataclass(frozen=True)
class Segment:
    """Elements ``[elem_start, elem_start + numel)`` of header entry ``entry`` (flattened), stored
    at byte ``byte_offset`` of the bucket."""

    entry: int
    elem_start: int
    numel: int
    byte_offset: int


@dataclass(frozen=True)
class Bucket:
    """One wire buffer: ``dtype`` of every segment, ``data_bytes`` used (padded to 8),
    ``wire_bytes`` = padded data + checksum trailer."""

    dtype: torch.dtype
    segments: tuple[Segment, ...]
    data_bytes: int

    @property
    def padded_bytes(self) -> int:
        return (self.data_bytes + 7) // 8 * 8

    @property
    def wire_bytes(self) -> int:
        return self.padded_bytes + CHECKSUM_BYTES


def plan_buckets(entries: list[tuple[tuple[int, ...], torch.dtype]], bucket_bytes: int) -> list[Bucket]:
    """Cut the tensors ``entries[k] = (shape, dtype)`` into per-dtype buckets of <= bucket_bytes.

    Returns buckets in send order. Raises ValueError if ``bucket_bytes`` is smaller than one
    element of some dtype.
    """
    order: list[torch.dtype] = []
    for _, dt in entries:
        if dt not in order:
            order.append(dt)
    buckets: list[Bucket] = []
    for dt in order:
        item = torch.empty((), dtype=dt).element_size()
        cap = bucket_bytes // item  # elements per bucket
        if cap < 1:
            raise ValueError(f"weight_sync.bucket_size_mb gives {bucket_bytes} bytes, less than one {dt} element")
        segs: list[Segment] = []
        used = 0  # elements in the current bucket
        for k, (shape, edt) in enumerate(entries):
            if edt != dt:
                continue
            numel = 1
            for s in shape:
                numel *= s
            start = 0
            while start < numel:
                take = min(numel - start, cap - used)
                segs.append(Segment(k, start, take, used * item))
                used += take
                start += take
                if used == cap:
                    buckets.append(Bucket(dt, tuple(segs), used * item))
                    segs, used = [], 0
        if segs:
            buckets.append(Bucket(dt, tuple(segs), used * item))
    return buckets


def checksum(data: torch.Tensor) -> torch.Tensor:
    """int64 scalar tensor: wrapping sum of ``data`` (uint8, length a multiple of 8) read as int64
    words. Stays on data's device (no host sync until the caller reads it)."""
    return data.view(torch.int64).sum()


def checksum_into(buf: torch.Tensor, bucket: Bucket, out: torch.Tensor) -> None:
    """Write the checksum of wire buffer ``buf``'s data region into ``out`` (an int64 0-d tensor
    view, e.g. the buffer's own trailer or a slot of the receiver's verdict table): one
    reduction, no allocation, no host sync."""
    torch.sum(buf[: bucket.padded_bytes].view(torch.int64), 0, out=out)


def trailer(buf: torch.Tensor, bucket: Bucket) -> torch.Tensor:
    """The checksum trailer of wire buffer ``buf`` as an int64 0-d view."""
    return buf[bucket.padded_bytes : bucket.wire_bytes].view(torch.int64)[0]


def finish_wire(buf: torch.Tensor, bucket: Bucket) -> None:
    """Zero the padding of a packed wire buffer and write its checksum trailer (on the device)."""
    if bucket.padded_bytes > bucket.data_bytes:
        buf[bucket.data_bytes : bucket.padded_bytes].zero_()
    checksum_into(buf, bucket, trailer(buf, bucket))


def checksum_ok(buf: torch.Tensor, bucket: Bucket) -> bool:
    """True if the trailer of ``buf`` matches its data. Reads the result on the host (one sync):
    for tests and tools; the receiver compares on the device (unpack.py)."""
    return bool(checksum(buf[: bucket.padded_bytes]) == trailer(buf, bucket))


def segment_view(buf: torch.Tensor, bucket: Bucket, seg: Segment) -> torch.Tensor:
    """The elements of ``seg`` inside wire buffer ``buf``, as a 1-D tensor of ``bucket.dtype``."""
    return buf[seg.byte_offset : seg.byte_offset + seg.numel * bucket.dtype.itemsize].view(bucket.dtype)


def source_slice(sources: list[torch.Tensor], seg: Segment) -> torch.Tensor:
    """The elements of ``seg`` in its source tensor, flattened (a view when the source is contiguous)."""
    return sources[seg.entry].reshape(-1)[seg.elem_start : seg.elem_start + seg.numel]


def pack_bucket(buf: torch.Tensor, bucket: Bucket, sources: list[torch.Tensor]) -> None:
    """Reference packing, one copy per segment: copy the segments of ``bucket`` from
    ``sources[entry]`` (any shape/dtype/device; cast to the wire dtype) into ``buf`` (uint8,
    >= wire_bytes), zero the padding, write the checksum. ``BucketPacker`` is the fast path."""
    for seg in bucket.segments:
        segment_view(buf, bucket, seg).copy_(source_slice(sources, seg))
    finish_wire(buf, bucket)


@dataclass
class _Packing:
    """Bucket k's packing into one wire buffer, cut once: the fused pass (None: per-segment
    fallback), int64 views of the data region (checksum in) and the trailer (checksum out), the
    padding bytes to zero (None: the data fills whole words)."""

    address: int
    fused: CopyPlan | None
    data: torch.Tensor
    trailer: torch.Tensor
    pad: torch.Tensor | None


class BucketPacker:
    """Packs the buckets of ``plan`` from ``sources`` (header order) into wire buffers.

    Per bucket one fused cast + copy pass (``copy_plan.CopyPlan``: one Triton launch per dtype
    pair on CUDA, a few merged runs on CPU), then the padding and the checksum trailer: a handful
    of launches per bucket, no host sync, no Python objects made. The packing of bucket k (pass
    and views) is cut for the buffer it was first packed into and reused while bucket k keeps
    landing in that buffer (a ring slot), so the sources must be updated in place between updates
    (the trainer's parameters are); a bucket with a non-contiguous source or a source on another
    device is packed segment by segment (``pack_bucket``'s copies) every time.
    """

    def __init__(self, plan: list[Bucket], sources: list[torch.Tensor]):
        self.plan, self.sources = plan, sources
        self._packings: dict[int, _Packing] = {}

    def _packing(self, k: int, buf: torch.Tensor) -> _Packing:
        b = self.plan[k]
        fused = all(
            self.sources[s.entry].is_contiguous() and self.sources[s.entry].device == buf.device for s in b.segments
        )
        p = None
        if fused:
            dsts = [segment_view(buf, b, s) for s in b.segments]
            p = CopyPlan(dsts, [source_slice(self.sources, s) for s in b.segments])
        pad = buf[b.data_bytes : b.padded_bytes] if b.padded_bytes > b.data_bytes else None
        return _Packing(buf.data_ptr(), p, buf[: b.padded_bytes].view(torch.int64), trailer(buf, b), pad)

    def pack(self, k: int, buf: torch.Tensor) -> None:
        """Pack bucket k into ``buf`` (uint8, >= wire_bytes) on the current stream."""
        p = self._packings.get(k)
        if p is None or p.address != buf.data_ptr():
            p = self._packings[k] = self._packing(k, buf)
        if p.fused is None:
            for seg in self.plan[k].segments:
                segment_view(buf, self.plan[k], seg).copy_(source_slice(self.sources, seg))
        else:
            p.fused.launch(store=True, check=False)
        if p.pad is not None:
            p.pad.zero_()
        torch.sum(p.data, 0, out=p.trailer)

"""MSA block-selection record: the KV blocks every sparse layer selected, per token and KV head.

Governing idea (design.md §2.3, "Block-selection replay"): the rollout engine records, for every
token it runs, the block ids each sparse layer's lightning indexer selected (``rows``, int16
``[n, S, G, K]``: n tokens, S sparse layers in layer order, G KV heads, K = top-k; -1 padding, as
``indexer.select_blocks`` pads), and the trainer replays them. A record is an ordered tuple of
immutable :class:`SelectionSegment` s (positions ``[start, start + n)``), so the part every sample
of a GRPO group shares (its prompt) is one object held by all of them, and a multi-turn
trajectory appends only the new tokens of each turn.

What a record keeps is the *set* of blocks per (token, layer, head): attention over the selected
blocks does not depend on their order, and neither do replay or the agreement metric. Rows come
out of the engine in the reference order (forced blocks first, then score descending); a coded
segment (:meth:`SelectionSegment.to_bytes`, what crosses a process boundary or lands in a dump)
stores each row sorted ascending with -1 last (:func:`canonical_rows`), because the order of
similar-scoring blocks changes from token to token and would cost more than the sets themselves.

Coded segment (version 1, little endian; ``docs/rollout_dump_schema.md`` has a reader)::

    magic b"MSB1" | start u32 | n u32 | S u16 | G u16 | K u16 | zstd(D)

    Y = canonical_rows(rows) viewed as uint16 (so -1 = 65535 sorts last)   [n, S, G, K]
    D[0] = Y[0];  D[t] = Y[t] - Y[t-1] (mod 2**16)                          delta over tokens

Consecutive tokens mostly share blocks, so D is mostly zeros and zstd (pyarrow's, a project
dependency; level 1) shrinks it; decoding is a running sum over tokens. Encoding and decoding
are vectorized numpy (no loop over tokens or layers) and run lazily: a segment made in the
engine keeps its raw rows and codes them only when it is pickled (EP workers, ``__reduce__``) or
written; one read from bytes decodes on first use. The engine may also hand out a segment whose
rows are still being copied off its host table by a worker thread (:meth:`SelectionSegment.from_future`):
the first use of ``rows`` waits for that copy.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import numpy as np

MAGIC = b"MSB1"
_HEADER = struct.Struct("<4sIIHHH")
# NOTE: zstd level 1 measured 5x faster than zlib level 1 on M3-shaped records, and smaller (it
# also finds repeats across layers); higher levels gain little (scripts/bench_engine.py --block-record).
ZSTD_LEVEL = 1


def canonical_rows(rows: np.ndarray) -> np.ndarray:
    """Each [K] row of ``rows`` (int16 [..., K]) sorted ascending with -1 padding last (int16, same shape):
    the form a coded record decodes to; equal for two rows iff they select the same blocks."""
    return np.sort(np.asarray(rows, dtype=np.int16).view(np.uint16), axis=-1).view(np.int16)


class SelectionSegment:
    """Selected blocks of the positions ``[start, start + length)`` of one sequence.

    Make one with :meth:`from_rows` (raw int16 ``[n, S, G, K]``, any order within a row),
    :meth:`from_future` (rows still being copied) or :meth:`from_bytes` (a coded segment). ``rows``
    and ``to_bytes()`` convert on first use and keep the result. Immutable by convention: never
    write into ``rows``. Pickles as its coded bytes.
    """

    __slots__ = ("start", "length", "dims", "_rows", "_coded", "_future")

    def __init__(
        self,
        start: int,
        length: int,
        dims: tuple[int, int, int],
        rows: np.ndarray | None = None,
        coded: bytes | None = None,
    ):
        self.start, self.length, self.dims = int(start), int(length), tuple(int(d) for d in dims)
        self._rows, self._coded = rows, coded
        self._future = None  # .result() -> the rows (from_future)

    @classmethod
    def from_rows(cls, start: int, rows: np.ndarray) -> SelectionSegment:
        """A segment holding ``rows`` (int16 [n, S, G, K]; kept, not copied). Raises ValueError
        on another rank or dtype."""
        if rows.ndim != 4 or rows.dtype != np.int16:
            raise ValueError(f"selection rows must be int16 [n, S, G, K], got {rows.dtype} {rows.shape}")
        return cls(start, rows.shape[0], rows.shape[1:], rows=rows)

    @classmethod
    def from_future(cls, start: int, length: int, dims: tuple[int, int, int], future) -> SelectionSegment:
        """A segment whose int16 [length, *dims] rows ``future.result()`` returns (a
        ``concurrent.futures.Future``: waited for on first use of ``rows``, its error raised there)."""
        seg = cls(start, length, dims)
        seg._future = future
        return seg

    @classmethod
    def from_bytes(cls, buf: bytes) -> SelectionSegment:
        """A segment from its coded form (decoded on first use of ``rows``). Raises ValueError for
        bytes that are not a version-1 coded segment."""
        buf = bytes(buf)
        if len(buf) < _HEADER.size or buf[:4] != MAGIC:
            raise ValueError("not a coded block-selection segment (magic 'MSB1' missing)")
        _, start, n, s, g, k = _HEADER.unpack_from(buf)
        return cls(start, n, (s, g, k), coded=buf)

    @property
    def end(self) -> int:
        return self.start + self.length

    @property
    def rows(self) -> np.ndarray:
        """int16 [length, S, G, K] (-1 = empty slot)."""
        if self._rows is None:  # the future is kept: another thread may be reading it right now
            fut = self._future
            self._rows = fut.result() if fut is not None else _decode(self._coded, self.length, self.dims)
        return self._rows

    def to_bytes(self) -> bytes:
        """The coded segment (module docstring; rows canonicalised)."""
        if self._coded is None:
            self._coded = _encode(self.rows, self.start)
        return self._coded

    def __reduce__(self):
        return (SelectionSegment.from_bytes, (self.to_bytes(),))

    def __repr__(self) -> str:
        return f"SelectionSegment(start={self.start}, length={self.length}, dims={self.dims})"


def _encode(rows: np.ndarray, start: int) -> bytes:
    y = canonical_rows(rows).view(np.uint16)  # [n, S, G, K]
    d = np.empty_like(y)
    if len(y):
        d[0] = y[0]
        np.subtract(y[1:], y[:-1], out=d[1:])  # wraps mod 2**16
    n, s, g, k = rows.shape
    head = _HEADER.pack(MAGIC, start, n, s, g, k)
    return head + _zstd().compress(d.astype("<u2", copy=False), asbytes=True)  # the array's buffer, no copy


def _decode(buf: bytes, n: int, dims: tuple[int, int, int]) -> np.ndarray:
    size = 2 * n * int(np.prod(dims))
    raw = _zstd().decompress(buf[_HEADER.size :], decompressed_size=size, asbytes=True)
    y = np.frombuffer(raw, dtype="<u2").reshape(n, -1).copy()  # [n, S*G*K] deltas, summed in place
    # NOTE: one vectorized add per token (S*G*K lanes, wrapping mod 2**16): numpy's cumsum along
    # the token axis measured ~50x slower (~70 vs 1.4 us per M3-shaped token).
    for t in range(1, n):
        np.add(y[t], y[t - 1], out=y[t])
    return y.view(np.int16).reshape(n, *dims)


def _zstd():
    import pyarrow as pa  # NOTE: imported on first coding only: the model itself never needs it

    return pa.Codec("zstd", compression_level=ZSTD_LEVEL)


class SelectionRecord:
    """A sequence's block-selection record: segments in position order, not overlapping.

    Args:
        segments: :class:`SelectionSegment` s, each starting at or after the previous one's end
            (gaps are positions without a record). Raises ValueError otherwise, or when their
            (S, G, K) differ.
    """

    __slots__ = ("segments",)

    def __init__(self, segments: Sequence[SelectionSegment] = ()):
        segs = tuple(s for s in segments if s.length > 0)
        for a, b in zip(segs, segs[1:]):
            if b.start < a.end or b.dims != a.dims:
                raise ValueError(f"selection segments overlap or differ in shape: {a} then {b}")
        self.segments = segs

    @property
    def end(self) -> int:
        """One past the last recorded position (0 when empty): where the next turn's record starts."""
        return self.segments[-1].end if self.segments else 0

    @property
    def dims(self) -> tuple[int, int, int] | None:
        """(S sparse layers, G KV heads, K top-k), or None when empty."""
        return self.segments[0].dims if self.segments else None

    def then(self, other: SelectionRecord | None) -> SelectionRecord:
        """This record followed by ``other``'s segments (a later turn); ``other`` None = self."""
        return self if other is None else SelectionRecord(self.segments + other.segments)

    def dense(self, length: int) -> np.ndarray | None:
        """int16 [length, S, G, K]: recorded rows, -1 at positions without a record (segments past
        ``length`` are cut). None when the record is empty."""
        if not self.segments:
            return None
        out = np.full((length, *self.dims), -1, dtype=np.int16)
        for s in self.segments:
            if s.start < length:
                out[s.start : min(s.end, length)] = s.rows[: length - s.start]
        return out

    def coded_bytes(self) -> int:
        """Bytes of the coded segments (what a dump or a worker stores / sends; shared segments counted once)."""
        return sum(len(s.to_bytes()) for s in {id(s): s for s in self.segments}.values())

    def __repr__(self) -> str:
        return f"SelectionRecord({list(self.segments)})"


def share_segments(records: Sequence[SelectionRecord | None]) -> list[SelectionRecord | None]:
    """The records with equal segments (same start and coded bytes) made one object: what a GRPO
    group's samples hold after crossing a process boundary in separate messages (their prompt
    segment, equal but unpickled twice). None entries stay None."""
    seen: dict[tuple[int, bytes], SelectionSegment] = {}
    out = []
    for rec in records:
        if rec is None:
            out.append(None)
            continue
        out.append(SelectionRecord([seen.setdefault((s.start, s.to_bytes()), s) for s in rec.segments]))
    return out

"""Block-selection record, engine side: the kernels write it on the device, one copy per step takes it home.

Governing idea (design.md §2.3, "Block-selection replay"): every sparse layer's block choice
already exists on the device in every path, so recording is a store, not a computation. Each
sparse layer's MSA op writes its [T, G, K] choice into ``step_buffer[:T, j]`` (int16, one fixed
buffer: the decode graphs capture the stores; the fused decode kernel stores from registers, no
extra launch). After the step is launched, ONE non-blocking copy moves ``step_buffer[:T]`` into a
pinned host buffer behind the step's other outputs. When that copy has landed, the rows are
scattered into a host table laid out like the KV pages (``table[slot]``, slot = page *
page_size + offset), so a prefix-cache hit reads the record of the earlier computation with its
K/V, a fork's partial-page copy copies it, and preemption by recompute rewrites it — exactly what
the K/V in the pages came from.

Nothing here blocks the step loop: :meth:`SelectionCache.land` scatters the copies that have
completed (polled) and waits only for steps whose sampled ids the host has already waited for
(their copy was queued right behind), which is what forks and finishing samples read. Host-side
operations run in step order (a page copy is also queued behind the copies launched before it), so a
step still in flight can never overwrite rows a later fork copied. On the CPU the copy is
synchronous and everything lands at once.

A finishing sample's rows leave the table on a worker thread (:meth:`SelectionCache.gather_later`:
numpy copies release the GIL, and the copy into fresh memory is mostly page faults, ~10x the
memcpy), so the step loop only hands the copy off; the sample's segment waits for it on first use.
Until such a copy is done, a write into one of the pages it reads (a later step's rows landing,
a fork's page copy) waits for it.

Shapes: T tokens of a step, S sparse layers, G KV heads, K top-k blocks; ps page size.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_all
from dataclasses import dataclass

import numpy as np
import torch

MAX_PENDING_COPIES = 3  # pinned staging buffers; a fourth step in flight waits for the oldest copy
# NOTE: a gather smaller than this is copied inline; handing it to the worker costs more than the copy.
INLINE_GATHER_BYTES = 64 * 1024


@dataclass
class _StepCopy:
    """A launched step's rows on their way to the host (``event`` follows the copy)."""

    serial: int
    slots: np.ndarray  # int64 [T], -1 = padding
    host: torch.Tensor  # int16 [T, S, G, K] view of ``buf``
    buf: torch.Tensor  # the pinned buffer, returned to the pool once landed
    event: torch.cuda.Event


@dataclass
class _PageCopy:
    """A fork's partial-page copy (``src`` -> ``dst``), applied in step order."""

    serial: int
    src: int
    dst: int


class SelectionCache:
    """Paged host store of the block-selection record plus the device step buffer the kernels write.

    Args:
        dims: (S, G, K) (``M3ForCausalLM.selection_dims``).
        num_pages, page_size: the KV page pool's geometry.
        capacity: most tokens of one step (rows of ``step_buffer``).
        device: the model's device.

    Attributes:
        step_buffer: int16 [capacity, S, G, K] on ``device`` (-1 filled at start).
        table: int16 [num_pages * page_size, S, G, K] host array, filled with -1 at construction
            (committed up front: first-touch page faults inside the step loop made the scatter of
            112 MiB of rows 11x slower on a Xeon; -1 = never recorded).
    """

    def __init__(
        self, dims: tuple[int, int, int], num_pages: int, page_size: int, capacity: int, device: torch.device | str
    ):
        self.dims, self.page_size, self.capacity = tuple(dims), int(page_size), int(capacity)
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.step_buffer = torch.full((self.capacity, *self.dims), -1, dtype=torch.int16, device=self.device)
        self.table = np.full((num_pages * self.page_size, *self.dims), -1, dtype=np.int16)
        self._pages = self.table.reshape(num_pages, self.page_size, -1)  # [P, ps, S*G*K] view
        self._queue: deque[_StepCopy | _PageCopy] = deque()
        self._free: list[tuple[torch.Tensor, torch.cuda.Event]] = []
        self._num_buffers = 0
        self._serial = 0  # serial of the last launched step
        self._dev_rows: dict[int, torch.Tensor] = {}  # T -> step_buffer[:T] (one view per step size)
        self._worker: ThreadPoolExecutor | None = None  # gather_later's thread, made on first use
        self._gathers: list[tuple[Future, np.ndarray]] = []  # copies not seen done, with the pages they read
        self._busy = np.zeros(num_pages, dtype=np.int32)  # per page: copies of _gathers reading it

    @classmethod
    def for_model(cls, model, num_pages: int, page_size: int, capacity: int) -> SelectionCache:
        """A cache for ``model`` (``M3ForCausalLM``) on its device and the engine's page pool."""
        return cls(model.selection_dims(), num_pages, page_size, capacity, next(model.parameters()).device)

    @property
    def row_bytes(self) -> int:
        """Bytes of one token's record (S * G * K int16)."""
        return int(np.prod(self.dims)) * 2

    # ---- per step ----------------------------------------------------------------------------
    def launch(self, serial: int, slots: np.ndarray) -> None:
        """Take step ``serial``'s rows home; call right after the step's forward was enqueued.

        slots: int64 [T] the step's slot mapping on the host (-1 = padding row, not stored); the
        forward wrote ``step_buffer[:T]``. CUDA: one non-blocking copy into a pinned buffer
        (landed later); elsewhere the rows are stored now.
        """
        self._serial = serial
        t = len(slots)
        if t == 0:
            return
        if t > self.capacity:
            raise ValueError(f"block-selection record: a step of {t} tokens exceeds the buffer of {self.capacity}")
        if not self.cuda:
            # a copy: a numpy view would make the buffer's storage non-resizable for good, and
            # sleep() releases it in place (sleep.check_resizable)
            self._scatter(slots, self.step_buffer[:t].clone().numpy())
            return
        buf, event = self._take_buffer()
        rows = self._dev_rows.get(t)
        if rows is None:
            rows = self._dev_rows[t] = self.step_buffer[:t]
        host = buf[:t]
        host.copy_(rows, non_blocking=True)
        event.record()
        # a copy: the caller's slots may be a view of its reused decode staging (stage_rows), which
        # a later step overwrites before this one lands
        self._queue.append(_StepCopy(serial, np.array(slots, dtype=np.int64), host, buf, event))

    def land(self, upto: int | None = None) -> None:
        """Apply queued work in step order: ``upto`` given, everything of steps ``<= upto`` (waiting
        for their copies; ``last_serial``: everything launched); None, whatever is done (polled,
        no waiting). A step after ``upto`` is left for a later call: with async scheduling it is
        the step in flight, and polling it would cost a query on every step."""
        while self._queue:
            op = self._queue[0]
            if upto is not None and op.serial > upto:
                return
            if isinstance(op, _StepCopy):
                if upto is None and not op.event.query():
                    return
                op.event.synchronize()
                self._scatter(op.slots, op.host.numpy())
                self._free.append((op.buf, op.event))
            else:
                self._copy_rows(op.src, op.dst)
            self._queue.popleft()

    @property
    def last_serial(self) -> int:
        return self._serial

    def copy_page(self, src: int, dst: int) -> None:
        """Copy page ``src``'s rows to page ``dst`` (a fork's partial page): now, and while steps are
        still queued, once more after every step launched so far has landed (queued, never blocking).

        The copy now carries the rows landed so far: the leader's prompt, which a child finishing
        in the step that forked it reads at once (a group with max_new_tokens=1, or a first token
        that stops), while the step in flight is still queued. The queued copy keeps host-side
        operations in step order, so a step in flight can never overwrite rows the fork copied."""
        self._copy_rows(src, dst)
        if self._queue:
            self._queue.append(_PageCopy(self._serial, src, dst))

    def gather(self, block_table: list[int], start: int, end: int) -> np.ndarray:
        """int16 [end - start, S, G, K]: the rows of positions [start, end) of a sequence whose
        logical page b is physical page ``block_table[b]`` (a copy). Call :meth:`land` first for
        the steps that computed those positions. Raises ValueError when the pages do not cover ``end``."""
        return self._copy_out(self._pieces(block_table, start, end), end - start)

    def gather_later(self, block_table: list[int], start: int, end: int) -> Future:
        """:meth:`gather` on the worker thread: a Future of the rows (done at once for fewer than
        ``INLINE_GATHER_BYTES``). Until it is done, writes into the pages it reads wait for it
        (:meth:`_before_write`), so the rows are the table's as of this call. Same errors as gather."""
        pieces, n = self._pieces(block_table, start, end), end - start
        if n * self.row_bytes < INLINE_GATHER_BYTES:
            fut = Future()
            fut.set_result(self._copy_out(pieces, n))
            return fut
        if self._worker is None:
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="selection-gather")
        pages = np.array([lo // self.page_size for lo, _ in pieces], dtype=np.int64)  # distinct pages
        fut = self._worker.submit(self._copy_out, pieces, n)  # first: a refused submit marks no page busy
        self._busy[pages] += 1
        self._gathers.append((fut, pages))
        return fut

    def equals(self, block_table: list[int], start: int, end: int, rows: np.ndarray) -> bool:
        """``rows`` (int16 [n, S, G, K]) equals ``gather(block_table, start, end)``, compared in place
        (no copy). Raises ValueError as gather."""
        pieces = self._pieces(block_table, start, end)
        if rows.shape != (end - start, *self.dims):
            return False
        i = 0
        for lo, hi in pieces:
            if not np.array_equal(rows[i : i + hi - lo], self.table[lo:hi]):
                return False
            i += hi - lo
        return True

    # ---- internals ---------------------------------------------------------------------------
    def _pieces(self, block_table: list[int], start: int, end: int) -> list[tuple[int, int]]:
        """Table row ranges [lo, hi) holding positions [start, end) in order, one per page."""
        ps = self.page_size
        if end > len(block_table) * ps:
            raise ValueError(f"block-selection record: {len(block_table)} pages cannot hold position {end - 1}")
        pieces = []
        for b in range(start // ps, (end - 1) // ps + 1) if end > start else ():
            base = block_table[b] * ps
            pieces.append((base + max(start - b * ps, 0), base + min(end - b * ps, ps)))
        return pieces

    def _copy_out(self, pieces: list[tuple[int, int]], n: int) -> np.ndarray:
        # page by page: contiguous slices (a per-position fancy index took 2x as long for 32
        # sequences of 384 tokens on the Xeon)
        out = np.empty((n, *self.dims), dtype=np.int16)
        i = 0
        for lo, hi in pieces:
            out[i : i + hi - lo] = self.table[lo:hi]
            i += hi - lo
        return out

    def _before_write(self, pages) -> None:
        """Wait for the worker's copies that read any of ``pages`` (page ids: int or int array;
        -1 may stand for a padding row: a needless wait at most) before the table is written there."""
        if not self._gathers:
            return
        if self._busy[pages].any():
            wait_all([fut for fut, _ in self._gathers])  # in order on one thread: as long as the last
        still = []
        for fut, pages_read in self._gathers:
            if fut.done():
                self._busy[pages_read] -= 1
            else:
                still.append((fut, pages_read))
        self._gathers = still

    def _scatter(self, slots: np.ndarray, rows: np.ndarray) -> None:
        ps = self.page_size
        t = len(slots)
        if self._gathers:
            self._before_write(slots // ps)
        if t >= ps and t % ps == 0:  # a prefill of whole pages: copy page by page (memcpy speed)
            heads = slots[::ps]  # >= 0: with ps = 1 a -1 padding row would pass as page -1 (the last)
            aligned = (heads >= 0).all() and (heads % ps == 0).all()
            if aligned and np.array_equal(slots, (heads[:, None] + np.arange(ps)).reshape(-1)):
                self._pages[heads // ps] = rows.reshape(t // ps, ps, -1)
                return
        if slots.min() >= 0:  # decode steps, partial pages: one row per slot
            self.table[slots] = rows
        else:
            keep = slots >= 0
            self.table[slots[keep]] = rows[keep]

    def _copy_rows(self, src: int, dst: int) -> None:
        ps = self.page_size
        self._before_write(dst)
        self.table[dst * ps : (dst + 1) * ps] = self.table[src * ps : (src + 1) * ps]

    def _take_buffer(self) -> tuple[torch.Tensor, torch.cuda.Event]:
        """A free pinned staging buffer and the event that follows its copies (made once per buffer)."""
        if not self._free and self._num_buffers >= MAX_PENDING_COPIES:
            oldest = next(op for op in self._queue if isinstance(op, _StepCopy))
            self.land(oldest.serial)
        if self._free:
            return self._free.pop()
        self._num_buffers += 1
        return torch.empty((self.capacity, *self.dims), dtype=torch.int16).pin_memory(), torch.cuda.Event()

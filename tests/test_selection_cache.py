"""SelectionCache's host table on the CPU: every step's rows land at their slots whatever the shape
of the step (whole aligned pages take the page-copy path, partial pages, padding rows and
decode-sized steps the row path), unrecorded slots read -1, and a fork's page copy follows."""

from __future__ import annotations

import numpy as np
import torch

from m3_rollout.engine.selection_cache import SelectionCache


def _step(cache: SelectionCache, serial: int, slots: list[int], rng: np.random.Generator) -> np.ndarray:
    rows = rng.integers(0, 500, size=(len(slots), *cache.dims)).astype(np.int16)
    cache.step_buffer[: len(slots)] = torch.from_numpy(rows)
    cache.launch(serial, np.asarray(slots, dtype=np.int64))
    return rows


def test_rows_land_at_their_slots_through_page_and_row_paths():
    ps, pages = 4, 8
    cache = SelectionCache((2, 3, 5), pages, ps, capacity=64, device="cpu")
    assert (cache.table == -1).all()
    want = np.full_like(cache.table, -1)
    rng = np.random.default_rng(0)
    steps = [
        [12, 13, 14, 15, 4, 5, 6, 7],  # pages 3 and 1, whole and aligned: page copies
        [20, 21, 22, 23, 24, 25, 26, 27, 0, 1, 2, 3],  # three whole pages
        [8, 9, 10, 11, 17, 18, 19, 16],  # page 2 whole, page 4 rotated: not a page copy
        [28, 29, -1, -1],  # padding rows: skipped
        [30],  # a decode step
        [31, 30, 29, 28],  # four slots of one page, reversed
    ]
    for serial, slots in enumerate(steps, 1):
        rows = _step(cache, serial, slots, rng)
        for s, r in zip(slots, rows):
            if s >= 0:
                want[s] = r
        assert np.array_equal(cache.table, want), serial
    cache.copy_page(3, 5)  # a fork's partial page
    want[20:24] = want[12:16]
    assert np.array_equal(cache.table, want)
    assert np.array_equal(cache.gather([3, 1, 5], 2, 10), want[[14, 15, 4, 5, 6, 7, 20, 21]])


def test_page_path_is_not_fooled_by_padding_duplicates_or_misalignment():
    """Slot patterns of T a multiple of the page size that must not take (or must survive) the page
    copy: -1 padding inside whole pages, a page size of 1 (every slot, -1 included, is a "page
    head"; regression: padding rows were written to the last page), pages out of order, a page
    twice, whole-length runs that start mid-page. The table must equal a plain per-row scatter
    (padding skipped, a later row winning a repeated slot)."""
    rng = np.random.default_rng(1)
    for ps in (1, 2, 4):
        pages = 6
        cache = SelectionCache((1, 2, 3), pages, ps, capacity=32, device="cpu")
        want = np.full_like(cache.table, -1)
        n = pages * ps

        def page(p):
            return list(range(p * ps, (p + 1) * ps))

        steps = [
            [-1] * ps,  # one padded page
            page(2) + [-1] * ps,  # a whole page then a padded one
            page(5) + page(0),  # out of order
            page(3) + page(3),  # the same page twice
            [(s + 1) % n for s in range(2 * ps)],  # a 2-page run starting mid-page (ps > 1)
            page(4)[:-1] + [-1] + page(1),  # padding inside a page
            [n - 1] + [-1] * (ps - 1) + page(2),
        ]
        for serial, slots in enumerate(steps, 1):
            rows = _step(cache, serial, slots, rng)
            for s, r in zip(slots, rows):
                if s >= 0:
                    want[s] = r
            assert np.array_equal(cache.table, want), (ps, serial, slots)


def test_gather_over_page_boundaries_equals_the_per_position_rows():
    """``gather`` copies page by page; every (start, end) window, across page boundaries and within
    one page, equals the rows read position by position through the block table."""
    import numpy as np

    from m3_rollout.engine.selection_cache import SelectionCache

    ps = 4
    cache = SelectionCache((2, 1, 3), num_pages=6, page_size=ps, capacity=8, device="cpu")
    cache.table[:] = np.arange(cache.table.size, dtype=np.int16).reshape(cache.table.shape)
    table = [5, 0, 3]
    for start, end in [(0, 12), (1, 3), (3, 5), (4, 8), (2, 11), (7, 7), (11, 12)]:
        want = [cache.table[table[p // ps] * ps + p % ps] for p in range(start, end)]
        got = cache.gather(table, start, end)
        assert got.shape == (end - start, 2, 1, 3)
        assert all(np.array_equal(g, w) for g, w in zip(got, want))
        assert not np.shares_memory(got, cache.table)

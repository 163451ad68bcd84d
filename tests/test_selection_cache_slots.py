"""SelectionCache on its CUDA path (faked on the CPU): a queued step's slot mapping must not alias
the caller's array. The engine hands ``launch`` a view of its double-buffered decode staging
(``CudaGraphDecode.stage_rows``), which a later step overwrites; ``np.asarray`` kept that view, so
rows landed after the overwrite went to the later step's slots."""

from __future__ import annotations

import numpy as np
import torch

from m3_rollout.engine.selection_cache import SelectionCache


class _Event:
    def record(self):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True


def test_queued_step_keeps_its_own_slots(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self)
    cache = SelectionCache((1, 1, 2), num_pages=4, page_size=4, capacity=8, device="cpu")
    cache.cuda = True  # the pinned-buffer / event path, run in program order on the host
    staging = np.array([5, 9], dtype=np.int64)  # the caller's reusable host slot mapping
    rows = torch.tensor([[[[1, 2]]], [[[3, 4]]]], dtype=torch.int16)
    cache.step_buffer[:2] = rows
    cache.launch(1, staging)
    staging[:] = [6, 10]  # the caller stages the next step before this one landed
    cache.land()
    assert np.array_equal(cache.table[[5, 9]], rows.numpy())
    assert (cache.table[[6, 10]] == -1).all()

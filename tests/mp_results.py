"""Results of spawned test processes, sent BY VALUE.

A ``torch.multiprocessing`` queue sends a tensor as a handle to shared memory that the sending
process serves; when that process exits before the parent unpickles the message (a busy
machine), the parent fails to open it. ``put_result`` serialises the whole result with
``torch.save`` into plain bytes first, so nothing in it refers back to the child; ``get_results``
collects one result per process with a deadline and fails the test with the child's traceback.

A test that kills a child hands the child it starts next a NEW queue: writers share the queue's
write lock, and a child killed between writing a message and releasing that lock (a busy
machine widens the window) leaves every later ``put`` on that queue blocked for good.
"""

from __future__ import annotations

import io
import queue

import pytest
import torch


def put_result(results, obj) -> None:
    """Send ``obj`` (dicts / lists / tensors / numbers) through ``results`` by value."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    results.put(buf.getvalue())


def get_results(results, n: int, timeout_s: float, key: str) -> dict:
    """``n`` results keyed by ``obj[key]``; fails the test on a timeout or a result holding
    ``"error"`` (the child's traceback)."""
    got: dict = {}
    for _ in range(n):
        try:
            data = results.get(timeout=timeout_s)
        except queue.Empty:
            pytest.fail(f"timed out after {timeout_s} s waiting for results; got {sorted(got)}")
        r = torch.load(io.BytesIO(data), weights_only=False)
        assert "error" not in r, f"{r[key]} failed:\n{r['error']}"
        got[r[key]] = r
    return got

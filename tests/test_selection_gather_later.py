"""SelectionCache off the step loop (CPU; the CUDA staging path faked as in test_selection_cache_slots):

- a finishing sample's rows are copied by the worker thread (``gather_later``), never by the step
  loop's thread, and equal the plain forward's record once read;
- a table write waits for a worker copy only when it writes a page that copy reads, and the copy
  then holds the rows from before the write;
- a decode step of an async-scheduled engine costs the record exactly one event wait (its own copy)
  and no event poll: a per-step poll of the step in flight, or a per-sample copy in the loop, fails here.
"""

from __future__ import annotations

import threading
from collections import Counter

import numpy as np
import pytest
import torch
from test_block_selection_record import _check, _model, _prompt

from m3_rollout.engine import selection_cache
from m3_rollout.engine.interface import GenerationRequest, SamplingParams
from m3_rollout.engine.native_backend import NativeBackend
from m3_rollout.engine.selection_cache import SelectionCache


class _Events:
    """Fake CUDA events (the host runs everything in order: every copy is done) that count calls."""

    def __init__(self):
        self.calls = Counter()

    def __call__(self, *args, **kwargs):
        calls = self.calls

        class _Event:
            def record(self, stream=None):
                calls["record"] += 1

            def synchronize(self):
                calls["synchronize"] += 1

            def query(self):
                calls["query"] += 1
                return True

        return _Event()


def _fake_cuda(monkeypatch) -> _Events:
    events = _Events()
    monkeypatch.setattr(torch.cuda, "Event", events)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self)
    return events


def test_worker_copy_blocks_only_writes_into_its_pages(monkeypatch):
    monkeypatch.setattr(selection_cache, "INLINE_GATHER_BYTES", 0)  # every gather goes to the worker
    ps = 4
    cache = SelectionCache((1, 2, 3), num_pages=8, page_size=ps, capacity=8, device="cpu")
    cache.table[:] = np.arange(cache.table.size, dtype=np.int16).reshape(cache.table.shape)
    before = cache.table.copy()
    gate, waits = threading.Event(), []
    real_copy, real_wait = SelectionCache._copy_out, selection_cache.wait_all

    def gated_copy(self, pieces, n):
        gate.wait()
        return real_copy(self, pieces, n)

    def opening_wait(futures):  # the write path waits: let the worker go, then really wait
        waits.append(len(futures))
        gate.set()
        return real_wait(futures)

    monkeypatch.setattr(SelectionCache, "_copy_out", gated_copy)
    monkeypatch.setattr(selection_cache, "wait_all", opening_wait)
    fut = cache.gather_later([5, 2], 1, 7)  # pages 5 and 2
    rows = torch.full((ps, 1, 2, 3), 7, dtype=torch.int16)
    cache.step_buffer[:ps] = rows
    cache.launch(1, np.arange(3 * ps, 4 * ps))  # page 3: no wait, the copy is still held
    cache.copy_page(3, 6)  # a fork's page copy into page 6: no wait either
    assert not waits and not fut.done()
    cache.launch(2, np.array([2 * ps + 1], dtype=np.int64))  # a decode row into page 2: waits
    assert waits == [1] and fut.done()
    want = np.concatenate([before[5 * ps + 1 : 6 * ps], before[2 * ps : 2 * ps + 3]])
    np.testing.assert_array_equal(fut.result(), want)  # the rows from before the write
    np.testing.assert_array_equal(cache.table[2 * ps + 1], rows[0].numpy())
    np.testing.assert_array_equal(cache.table[6 * ps : 7 * ps], rows.numpy())
    assert not cache._gathers and not cache._busy.any()


def test_finishing_samples_are_copied_off_the_step_loop(monkeypatch):
    monkeypatch.setattr(selection_cache, "INLINE_GATHER_BYTES", 0)
    threads = []
    real_copy = SelectionCache._copy_out

    def copy_out(self, pieces, n):
        threads.append(threading.current_thread())
        return real_copy(self, pieces, n)

    monkeypatch.setattr(SelectionCache, "_copy_out", copy_out)
    m = _model(2)
    be = NativeBackend(
        m, (95,), max_model_len=256, max_num_seqs=8, num_pages=64, max_num_batched_tokens=16,
        record_block_selection=True, async_scheduling=True,
    )  # fmt: skip
    outs = be.generate([GenerationRequest("g", _prompt(23, 7), SamplingParams(n=3, max_new_tokens=10, seed=4))])
    assert threads and threading.main_thread() not in threads
    for o in outs:
        _check(m, o)
    assert outs[1].block_selection.segments[0] is outs[0].block_selection.segments[0]  # compared in place


def test_a_decode_step_costs_one_event_wait_and_no_poll(monkeypatch):
    events = _fake_cuda(monkeypatch)
    be = NativeBackend(
        _model(4), (95,), max_model_len=256, max_num_seqs=8, num_pages=64, max_num_batched_tokens=64,
        record_block_selection=True, async_scheduling=True, enable_cuda_graphs="eager",
        cuda_graph_batch_sizes=(4,),
    )  # fmt: skip
    eng = be.engine
    eng.selection.cuda = True  # the pinned-copy / event path, in program order on the host
    for i in range(4):
        eng.add_request(GenerationRequest(f"r{i}", _prompt(20, i), SamplingParams(max_new_tokens=12, seed=i)))
    eng.step()  # the prompts' prefill
    eng.step()  # the first decode step launched, the prefill processed
    before, graph_steps = Counter(events.calls), eng.stats.graph_steps
    n = 6
    for _ in range(n):
        eng.step()
    assert eng.stats.graph_steps - graph_steps == n  # plain decode steps on the staged path
    per = {k: events.calls[k] - before[k] for k in ("record", "synchronize", "query")}
    assert per == {"record": n, "synchronize": n, "query": 0}
    while eng.has_unfinished():
        eng.step()


def test_a_child_finishing_in_its_fork_step_reads_its_copied_page(monkeypatch):
    # async scheduling on the staged (CUDA) path: the fork's partial-page copy used to be only
    # queued behind the step in flight, so a child that finished in the step that forked it
    # (max_new_tokens=1) was gathered from its still-uncopied page: a wrong record
    _fake_cuda(monkeypatch)
    m = _model(3)
    be = NativeBackend(
        m, (95,), max_model_len=96, max_num_seqs=8, num_pages=64, max_num_batched_tokens=64,
        record_block_selection=True, async_scheduling=True,
    )  # fmt: skip
    eng = be.engine
    eng.selection.cuda = True
    eng.add_request(GenerationRequest("g", _prompt(23, 1), SamplingParams(n=3, max_new_tokens=1, seed=2)))
    # another request keeps a step in flight past the fork
    eng.add_request(GenerationRequest("x", _prompt(23, 5), SamplingParams(max_new_tokens=6, seed=2)))
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    assert eng.stats.forks == 2 and len(outs) == 4
    for o in outs:
        _check(m, o)
    group = [o.block_selection.segments[0] for o in outs if o.request_id == "g"]
    assert all(s is group[0] for s in group)  # the children's prompt rows equal the leader's: shared


def test_a_refused_worker_copy_marks_no_page_busy(monkeypatch):
    # a submit the executor refuses (interpreter shutting down) raises to the caller and leaves no
    # page marked as read by a copy that will never run
    monkeypatch.setattr(selection_cache, "INLINE_GATHER_BYTES", 0)
    cache = SelectionCache((1, 2, 3), num_pages=8, page_size=4, capacity=8, device="cpu")

    class _Refusing:
        def submit(self, *args):
            raise RuntimeError("cannot schedule new futures after interpreter shutdown")

    cache._worker = _Refusing()
    with pytest.raises(RuntimeError, match="cannot schedule"):
        cache.gather_later([5, 2], 1, 7)
    assert not cache._busy.any() and not cache._gathers

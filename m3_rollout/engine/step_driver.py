"""StepDriver: many asyncio callers over one step API (``add_request`` / ``abort`` / ``step``).

Governing idea: callers never see steps. Each caller's requests go into the stepper under
internal unique ids (two callers may reuse a request id) and their records are routed to that
caller's queue; ONE driver task steps while anyone waits, so concurrent callers batch together.
A caller that leaves early (its iterator closed or its task cancelled) aborts the samples it
still waited for, and the driver steps on until their final records are out of the stepper.
The stepper is the in-process ``LLMEngine`` (``NativeBackend``) or the EP ``RolloutService``'s
own step API: the engine may not import the service, so it is a protocol here.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from collections.abc import AsyncIterator, Iterable, Sequence
from typing import Protocol

from m3_rollout.engine.interface import GenerationRequest, SampleOutput, StreamDelta

PAUSED_POLL_S = 0.001  # driver sleep while the stepper is paused (no step runs then)


class Stepper(Protocol):
    """What the driver steps: ``LLMEngine`` (design.md §3.2) or ``RolloutService``'s step API."""

    def add_request(self, req: GenerationRequest, stream: bool = False) -> None:
        """Queue ``req`` (unique ``request_id`` among the unfinished); a bad request's error records
        come out of a later ``step``."""

    def abort(self, request_id: str) -> None:
        """Every unfinished sample of ``request_id`` comes out of a later ``step`` as "abort"."""

    def step(self) -> list[SampleOutput | StreamDelta]:
        """Run some generation; return finished samples, error records and stream deltas."""

    def has_unfinished(self) -> bool:
        """Whether any request's records are still to come."""

    @property
    def paused(self) -> bool:
        """No generation runs (``pause``) until ``resume``."""


class StepDriver:
    """The asyncio front end of a :class:`Stepper`: per-request queues and one shared driver task.

    Args:
        stepper: what is stepped (its ``step`` blocks the event loop while it runs).

    Records carry internal ids inside the stepper (``"<k>:<caller id>"``) and the caller's id
    again when yielded. Not thread-safe: every call comes from one event loop's thread (``add`` /
    ``release`` / ``abort`` / ``deliver`` may come from synchronous code of that thread).
    """

    def __init__(self, stepper: Stepper):
        self.stepper = stepper
        self._ids = itertools.count()
        self._queues: dict[str, asyncio.Queue] = {}  # internal id -> its waiting caller's queue
        self._internal: dict[str, list[str]] = {}  # caller id -> internal ids (abort by caller id)
        self._orphans: dict[str, int] = {}  # internal id -> final records still to come, caller gone
        self._task: asyncio.Task | None = None

    @property
    def active(self) -> bool:
        """Whether the driver task has work: an async caller waits, or an abandoned request's final
        records are still to come. A task whose last caller has just left is not active (it ends
        at its next turn without stepping)."""
        return self._task is not None and bool(self._queues or self._orphans)

    def check_idle(self) -> None:
        """Raises RuntimeError while the driver is :attr:`active`: a synchronous ``generate`` would
        step the stepper beside it."""
        if self.active:
            raise RuntimeError("generate() while generate_async callers are active; await them or use generate_async")

    # ---- ids -----------------------------------------------------------------------------
    def add(self, req: GenerationRequest, stream: bool = False) -> str:
        """Add ``req`` to the stepper under a new internal id and return it (the synchronous
        ``generate`` of a backend uses it too). Raises what ``stepper.add_request`` raises (then
        nothing was added)."""
        iid = f"{next(self._ids)}:{req.request_id}"
        self.stepper.add_request(dataclasses.replace(req, request_id=iid), stream=stream)
        self._internal.setdefault(req.request_id, []).append(iid)
        return iid

    def release(self, request_id: str, iid: str) -> None:
        """Forget internal id ``iid`` of caller id ``request_id`` (its records are all out)."""
        ids = self._internal.get(request_id)
        if ids is not None and iid in ids:
            ids.remove(iid)
            if not ids:
                del self._internal[request_id]

    def internal_ids(self, request_id: str) -> list[str]:
        """The internal ids of the unfinished requests added under caller id ``request_id``."""
        return list(self._internal.get(request_id, ()))

    def abort(self, request_id: str) -> None:
        """Abort every unfinished request added under caller id ``request_id`` (its samples come
        out with finish_reason "abort"); unknown ids are ignored."""
        for iid in self.internal_ids(request_id):
            self.stepper.abort(iid)

    def deliver(self, outputs: Iterable[SampleOutput | StreamDelta]) -> None:
        """Route records with internal ids that came from elsewhere than ``step`` (a weight
        update that drained running samples) to their callers."""
        for out in outputs:
            self._route(out)

    def _route(self, out: SampleOutput | StreamDelta) -> None:
        q = self._queues.get(out.request_id)
        if q is not None:
            q.put_nowait(out)
            return
        left = self._orphans.get(out.request_id)
        if left is not None and isinstance(out, SampleOutput):
            if left > 1:
                self._orphans[out.request_id] = left - 1
            else:
                del self._orphans[out.request_id]

    # ---- the driver task -----------------------------------------------------------------
    async def _drive(self) -> None:
        """Step while any caller waits or an abandoned request's records are still to come; route
        each step's records to their queues."""
        st = self.stepper
        try:
            while self._queues or (self._orphans and st.has_unfinished()):
                if st.paused and not self._orphans:
                    await asyncio.sleep(PAUSED_POLL_S)
                    continue
                for out in st.step():  # paused: no generation, only ready records (aborts)
                    self._route(out)
                await asyncio.sleep(0)  # let callers consume and add requests
        except Exception as exc:  # noqa: BLE001 - handed to every waiting caller, none may hang
            for q in {id(q): q for q in self._queues.values()}.values():
                q.put_nowait(exc)
        finally:
            self._orphans.clear()  # the stepper has nothing unfinished (or failed): none will come
            self._task = None

    def _ensure_task(self) -> None:
        if self._task is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # a caller finalised with no loop running: the next driver drains
                return
            self._task = loop.create_task(self._drive())

    async def run(
        self, requests: Sequence[GenerationRequest], stream: bool = False
    ) -> AsyncIterator[SampleOutput | StreamDelta]:
        """Add ``requests`` and yield their records as they come, with the callers' request ids:
        each sample's :class:`SampleOutput` as it finishes (bad requests: error records), and with
        ``stream`` its :class:`StreamDelta` records before it. Leaving early (``aclose``, the
        consuming task cancelled) aborts the samples not yet out.

        Raises what ``stepper.add_request`` raises (requests added before it are aborted), and an
        exception raised by a ``step`` in every waiting caller (none is left hanging).
        """
        q: asyncio.Queue = asyncio.Queue()
        left: dict[str, int] = {}  # internal id -> SampleOutputs still to come
        caller: dict[str, str] = {}  # internal id -> caller's request id
        remaining = 0
        try:
            for req in requests:
                iid = self.add(req, stream)
                self._queues[iid] = q
                left[iid] = len(req.output_indices())
                caller[iid] = req.request_id
                remaining += left[iid]
            if remaining:
                self._ensure_task()
            while remaining:
                out = await q.get()
                if isinstance(out, Exception):  # a step failed (see _drive)
                    raise out
                if isinstance(out, SampleOutput):
                    left[out.request_id] -= 1
                    remaining -= 1
                yield dataclasses.replace(out, request_id=caller[out.request_id])
        finally:
            while not q.empty():  # records routed here but not yielded: out of the stepper already
                out = q.get_nowait()
                if isinstance(out, SampleOutput) and left.get(out.request_id):
                    left[out.request_id] -= 1
            for iid, n in left.items():
                self._queues.pop(iid, None)
                if n:  # the caller went away: abort, and drop its final records when they come
                    self.stepper.abort(iid)
                    self._orphans[iid] = n
                self.release(caller[iid], iid)
            if self._orphans:
                self._ensure_task()

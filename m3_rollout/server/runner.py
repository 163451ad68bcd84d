"""EngineRunner: a GenerationBackend on a thread of its own, driven from the HTTP event loop.

Governing idea: the HTTP loop must stay responsive (SSE flushes, /health, /metrics, control calls)
while the engine steps, and a weight update must land *between* two engine steps. So the backend
lives on a dedicated thread with its own asyncio loop (the "engine loop"). Everything that touches
the engine runs there: one driver task steps it, and a weight update is one coroutine that blocks
the engine loop while it receives, which is exactly "between steps".

Per-token cost is what limits a server in front of a fast engine, so the hand-over is batched:
the driver steps the engine itself (the in-process ``LLMEngine`` behind ``NativeBackend``, or the
expert-parallel ``RolloutService``, which offers the same add_request / abort / step calls) and
hands ALL outputs of one step to the HTTP loop in one ``call_soon_threadsafe``; there each
request's inbox collects them and wakes its handler once; a handler that fell behind takes
everything queued at once, with a sample's consecutive deltas merged into one (so it writes one
SSE event for them). No task per request runs on the engine loop.

Backends:
- ``NativeBackend`` and ``RolloutService``: stepped by the driver as above (streaming, abort,
  pause, weight sync over a trainer's group, top logprobs between two steps);
- any other :class:`StreamingBackend` (``stream`` + ``abort``; e.g. a scripted test backend):
  one task per request iterates its ``stream`` on the engine loop.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import itertools
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from m3_rollout.engine.interface import GenerationBackend, GenerationRequest, SampleOutput, StreamDelta
from m3_rollout.engine.native_backend import NativeBackend
from m3_rollout.service import GroupFailure, RolloutFailure, RolloutService
from m3_rollout.weight_sync import HandshakeError, WeightSyncGroup, WeightSyncTimeout
from m3_rollout.weight_sync.rollout_sync import RolloutWeightSync

TOKENS_PER_S_WINDOW = 10.0  # seconds over which /metrics' tokens/s is measured
PAUSED_POLL_S = 0.002  # driver sleep while the engine is paused (abort records still come out)


@runtime_checkable
class StreamingBackend(Protocol):
    """A backend that streams token deltas and aborts by request id."""

    def stream(self, request: GenerationRequest) -> AsyncIterator[SampleOutput | StreamDelta]: ...

    def abort(self, request_id: str) -> None: ...


class WeightSyncError(RuntimeError):
    """A weight-sync call failed (bad group parameters, rendezvous timeout, handshake mismatch,
    rejected update); the message says which and what to do."""


class WeightSyncNotJoined(WeightSyncError):
    """The server is not in the trainer's weight-sync group: none was joined, or its EP group was
    restarted since (the new workers are not in it): join again (/init_weight_sync), then resend."""


@dataclass
class RefitRecord:
    """The last weight update: version served afterwards, whether it applied, seconds (receive +
    commit), seconds the engine did not step, errors by rank."""

    version: int
    ok: bool
    seconds: float
    paused_seconds: float
    errors: list[str]


class Inbox:
    """One request's outputs on the HTTP loop: filled by :meth:`EngineRunner._deliver` (HTTP
    loop), emptied by the request's handler, which sleeps on ``waiter`` while it is empty."""

    __slots__ = ("loop", "items", "waiter")

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.items: list = []
        self.waiter: asyncio.Future | None = None

    async def take(self) -> list:
        """Everything queued (waits for at least one item)."""
        if not self.items:
            self.waiter = self.loop.create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        items, self.items = self.items, []
        return items


@dataclass
class _Sink:
    """Engine-loop record of one request in the engine: its inbox, the output records still to
    come (finished samples), and whether its handler went away (outputs are then dropped)."""

    inbox: Inbox
    remaining: int
    dropped: bool = False


def coalesce(items: list) -> list:
    """Merge each sample's consecutive :class:`StreamDelta` records (up to its final record) into
    one; the order of records within a sample is kept."""
    out: list = []
    open_delta: dict[int, int] = {}  # sample index -> position of its open merged delta in out
    for item in items:
        if isinstance(item, StreamDelta):
            j = open_delta.get(item.sample_index)
            if j is None:
                open_delta[item.sample_index] = len(out)
                out.append(item)
            else:
                d = out[j]
                out[j] = StreamDelta(
                    d.request_id,
                    d.sample_index,
                    d.token_ids + item.token_ids,
                    d.logprobs + item.logprobs,
                    d.weight_versions + item.weight_versions,
                    d.weight_writes + item.weight_writes,
                    None if d.top_logprobs is None else d.top_logprobs + (item.top_logprobs or []),
                )
        else:
            if isinstance(item, SampleOutput):
                open_delta.pop(item.sample_index, None)
            out.append(item)
    return out


def _deliver(batch: list[tuple[Inbox, object]]) -> None:
    """HTTP loop: append each item to its inbox and wake each inbox's handler once."""
    touched = []
    for inbox, item in batch:
        if not inbox.items:
            touched.append(inbox)
        inbox.items.append(item)
    for inbox in touched:
        w = inbox.waiter
        if w is not None and not w.done():
            w.set_result(None)


class EngineRunner:
    """Hosts ``backend`` on an engine thread; every public coroutine is awaited from the HTTP loop.

    Args:
        backend: ``NativeBackend`` or ``RolloutService`` (expert-parallel; both: streaming,
            abort, weight sync, top logprobs) or any :class:`StreamingBackend`.
        num_threads: torch intra-op threads of the engine thread; default the creating thread's
            ``torch.get_num_threads()`` (a new thread would otherwise run its CPU ops on one
            OpenMP thread).

    Raises:
        TypeError: a backend of none of these kinds.
    """

    def __init__(self, backend: GenerationBackend, num_threads: int | None = None):
        self.backend = backend
        self.native: NativeBackend | None = backend if isinstance(backend, NativeBackend) else None
        self.ep: RolloutService | None = backend if isinstance(backend, RolloutService) else None
        # What the driver steps: add_request / abort / step / has_unfinished / paused.
        self._stepper = self.native.engine if self.native is not None else self.ep
        if self._stepper is None and not isinstance(backend, StreamingBackend):
            raise TypeError(
                f"EngineRunner: {type(backend).__name__} is neither NativeBackend, RolloutService nor a "
                "streaming backend (stream + abort)"
            )
        self.num_threads = int(num_threads or torch.get_num_threads())
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run_loop, name="m3-engine-loop", daemon=True)
        self._thread.start()
        # Engine loop state: requests in the engine by internal id, internal ids by caller id.
        self._ids = itertools.count()
        self._sinks: dict[str, _Sink] = {}
        self._by_rid: dict[str, list[str]] = {}
        self._tasks: dict[str, asyncio.Task] = {}  # generic streaming backends: one task per request
        self._driver: asyncio.Task | None = None
        self._weight_sync: RolloutWeightSync | None = None
        self.last_refit: RefitRecord | None = None
        self.refit_seconds_total = 0.0
        self.refits = 0
        self._token_times: collections.deque[tuple[float, int]] = collections.deque()
        self.generated_tokens = 0
        self.prompt_tokens = 0
        self.requests_finished: collections.Counter[str] = collections.Counter()

    def _run_loop(self) -> None:
        torch.set_num_threads(self.num_threads)
        self._loop.run_forever()

    # ---- running coroutines on the engine loop -----------------------------------------------
    def _submit(self, coro) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    async def call(self, fn: Callable, *args):
        """Run ``fn(*args)`` on the engine loop (between two engine steps) and return its result."""

        async def run():
            return fn(*args)

        return await asyncio.wrap_future(self._submit(run()))

    # ---- generation --------------------------------------------------------------------------
    async def stream(
        self, request: GenerationRequest, stream: bool = True
    ) -> AsyncIterator[SampleOutput | StreamDelta]:
        """Yield the request's :class:`StreamDelta` records (``stream=True``; a handler that fell
        behind gets a sample's queued deltas merged into one) and then one :class:`SampleOutput`
        per sample. Leaving the iteration early (a client that disconnected) aborts the request
        on the engine, which frees its KV pages.

        Raises:
            Exception: whatever the backend raised for this request (e.g. an engine step failure).
        """
        inbox = Inbox(asyncio.get_running_loop())
        iid = f"{next(self._ids)}:{request.request_id}"
        remaining = len(request.output_indices())
        self.prompt_tokens += len(request.prompt_ids) * request.params.n
        self._loop.call_soon_threadsafe(self._add, iid, request, stream, inbox)
        try:
            while remaining:
                for item in coalesce(await inbox.take()):
                    if isinstance(item, BaseException):
                        remaining = 0
                        raise item
                    if isinstance(item, StreamDelta):
                        if not stream:
                            continue
                        self._count_tokens(len(item.token_ids))
                    elif isinstance(item, SampleOutput):
                        remaining -= 1
                        self.requests_finished[item.finish_reason] += 1
                        if not stream:
                            self._count_tokens(len(item.output_ids))
                        item = dataclasses.replace(item, request_id=request.request_id)
                    yield item
        finally:
            if remaining:  # the handler left early (a client that disconnected): its samples are aborted
                self.requests_finished["abort"] += remaining
                self._loop.call_soon_threadsafe(self._cancel, iid)

    def _count_tokens(self, n: int) -> None:
        now = time.monotonic()
        self.generated_tokens += n
        self._token_times.append((now, n))
        while self._token_times and self._token_times[0][0] < now - TOKENS_PER_S_WINDOW:
            self._token_times.popleft()

    def tokens_per_second(self) -> float:
        """Generated tokens per second over the last ``TOKENS_PER_S_WINDOW`` seconds."""
        now = time.monotonic()
        return sum(n for t, n in self._token_times if t >= now - TOKENS_PER_S_WINDOW) / TOKENS_PER_S_WINDOW

    # engine loop ------------------------------------------------------------------------------
    def _add(self, iid: str, request: GenerationRequest, stream: bool, inbox: Inbox) -> None:
        self._sinks[iid] = _Sink(inbox, len(request.output_indices()))
        self._by_rid.setdefault(request.request_id, []).append(iid)
        req = dataclasses.replace(request, request_id=iid)
        if self._stepper is None:
            self._tasks[iid] = self._loop.create_task(self._pump(iid, req, stream))
            return
        try:
            self._stepper.add_request(req, stream=stream)
        except Exception as exc:  # noqa: BLE001 - e.g. the EP group does not start: the caller's error
            self._post([(iid, exc)])
            return
        if self._driver is None:
            self._driver = self._loop.create_task(self._drive())

    def _forget(self, iid: str) -> None:
        del self._sinks[iid]
        rid = iid.split(":", 1)[1]
        ids = self._by_rid[rid]
        ids.remove(iid)
        if not ids:
            del self._by_rid[rid]

    def _cancel(self, iid: str) -> None:
        """The handler of ``iid`` went away: abort it (its final records are awaited, then dropped)."""
        sink = self._sinks.get(iid)
        if sink is None:
            return
        sink.dropped = True
        if self._stepper is not None:
            self._stepper.abort(iid)
        else:
            self._tasks.pop(iid).cancel()
            self._forget(iid)

    def _post(self, outputs: Sequence) -> None:
        """Hand one step's outputs to their inboxes: one ``call_soon_threadsafe`` per HTTP loop.
        ``outputs``: records with an internal ``request_id``, or (internal id, exception) pairs."""
        batches: dict[asyncio.AbstractEventLoop, list] = {}
        for out in outputs:
            iid, item = out if isinstance(out, tuple) else (out.request_id, out)
            sink = self._sinks.get(iid)
            if sink is None:
                continue
            if isinstance(item, BaseException):
                sink.remaining = 0
            elif isinstance(item, SampleOutput):
                sink.remaining -= 1
            if sink.remaining <= 0:
                self._forget(iid)
            if not sink.dropped:
                batches.setdefault(sink.inbox.loop, []).append((sink.inbox, item))
        for loop, batch in batches.items():
            loop.call_soon_threadsafe(_deliver, batch)

    async def _drive(self) -> None:
        """Step the engine while any request is in it; hand each step's outputs over at once."""
        st = self._stepper
        try:
            while self._sinks or st.has_unfinished():
                outs = st.step()
                if outs:
                    self._post(outs)
                await asyncio.sleep(PAUSED_POLL_S if st.paused else 0)
        except Exception as exc:  # noqa: BLE001 - handed to every waiting request, none may hang
            self._post([(iid, exc) for iid in list(self._sinks)])
        finally:
            self._driver = None

    async def _pump(self, iid: str, req: GenerationRequest, stream: bool) -> None:
        """Generic streaming backends: iterate the backend's stream for one request."""
        try:
            source = self.backend.stream(req) if stream else self.backend.generate_async([req])
            async for item in source:
                self._post([item])
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - handed to the waiting HTTP handler
            self._post([(iid, exc)])
        finally:
            self._tasks.pop(iid, None)

    async def abort(self, request_id: str) -> None:
        """Abort every sample of ``request_id`` (they finish with reason "abort" and the output so
        far)."""
        await self.call(self._abort_rid, request_id)

    def _abort_rid(self, request_id: str) -> None:
        for iid in self._by_rid.get(request_id, []):
            if self._stepper is not None:
                self._stepper.abort(iid)
            else:
                self.backend.abort(iid)

    # ---- control -----------------------------------------------------------------------------
    async def pause(self) -> None:
        """Stop stepping (running requests keep their KV pages) until :meth:`resume`."""
        await self.call(self.backend.pause)

    async def resume(self) -> None:
        await self.call(self.backend.resume)

    async def reset_prefix_cache(self) -> None:
        await self.call(self.backend.reset_prefix_cache)

    @property
    def weight_version(self) -> int:
        return self.backend.weight_version

    @property
    def records_routing(self) -> bool:
        """Outputs carry the routing record (the engine was built with ``record_routing``)."""
        if self.native is not None:
            return self.native.engine.config.record_routing
        return self.ep is not None and bool(self.ep.spec.engine.get("record_routing"))

    @property
    def records_block_selection(self) -> bool:
        """Outputs carry the block-selection record (engine built with ``record_block_selection``)."""
        if self.native is not None:
            return self.native.engine.config.record_block_selection
        return self.ep is not None and bool(self.ep.spec.engine.get("record_block_selection"))

    def engine_metrics(self) -> dict:
        """The engine's counters (the EP ranks' summed; empty for other backends). Read from the
        HTTP thread: plain integer and length reads, consistent enough for monitoring."""
        if self.native is not None:
            return self.native.metrics()
        return self.ep.engine_metrics() if self.ep is not None else {}

    # ---- top logprobs --------------------------------------------------------------------------
    async def top_logprobs(
        self,
        token_ids: Sequence[int],
        start: int,
        k: int,
        temperature: float,
        top_k: int = -1,
        top_p: float = 1.0,
        with_tokens: bool = False,
    ) -> tuple[list, int, int]:
        """The ``k`` most likely tokens and their logprobs at positions ``start .. len - 1`` of
        ``token_ids`` under the served weights, on the engine loop between two steps: one plain
        forward, fp32 log-softmax of the logits processed by ``temperature`` / ``top_k`` /
        ``top_p`` (tokens they remove left out), by ``LLMEngine.top_logprobs`` in process, or
        ``RolloutService.top_logprobs`` on every EP rank. ``with_tokens``: each position's own
        token's logprob and rank too (``PositionLogprobs``; the prompt logprobs of outputs that carry none).

        Returns ([len(token_ids) - start] lists of (token id, logprob), most likely first, or
        ``PositionLogprobs`` with ``with_tokens``; the weight version and the weight-write count
        (``weight_writes``) they were computed with, read in the same engine-loop call, so a
        caller can tell which tokens were sampled with these very weights: those whose
        ``token_weight_writes`` equal the count).
        Raises ValueError naming a bad argument (``top_logprobs token_ids`` / ``start`` / ``k`` /
        ``temperature`` / ``top_k`` / ``top_p``) or refused weights; NotImplementedError for backends without an engine
        (a :class:`StreamingBackend`).
        """
        if self.native is not None:
            fn = self.native.engine.top_logprobs
        elif self.ep is not None:
            fn = self.ep.top_logprobs
        else:
            raise NotImplementedError(
                f"top_logprobs needs an engine (in-process or EP workers); {type(self.backend).__name__} has none"
            )

        def run() -> tuple[list, int, int]:
            rows = fn(list(token_ids), start, k, temperature, top_k, top_p, with_tokens)
            return rows, self.backend.weight_version, self.backend.weight_writes

        return await self.call(run)

    # ---- weight sync ---------------------------------------------------------------------------
    @property
    def weight_sync_ready(self) -> bool:
        """A weight-sync group was joined; under EP the running worker group's (a group restart
        leaves the trainer's group: /init_weight_sync again)."""
        if self.ep is not None:
            return self.ep.weight_sync_joined
        return self._weight_sync is not None

    @property
    def weight_sync_ranks(self) -> int:
        """Ranks this server takes in a trainer's weight-sync group (one per EP worker)."""
        return self.ep.world_size if self.ep is not None else 1

    async def init_weight_sync(
        self,
        host: str,
        port: int,
        world_size: int,
        rank_offset: int,
        backend: str,
        timeout_s: float,
        bucket_size_mb: float,
        atomic: bool,
    ) -> None:
        """Join the trainer's weight-sync group as ranks ``rank_offset .. rank_offset +
        weight_sync_ranks - 1`` and run the handshake (the trainer builds the group as rank 0 and
        calls ``WeightSender.handshake`` meanwhile). The in-process engine joins on a side thread
        and keeps stepping; the EP workers join between two steps (the group waits meanwhile).

        Raises:
            WeightSyncError: a backend without an engine, rendezvous timeout, or manifest mismatch.
        """
        if self.ep is not None:
            args = (host, port, world_size, rank_offset, backend, timeout_s, bucket_size_mb, atomic)
            try:
                await self.call(self.ep.join_weight_sync, *args)
            except (ValueError, GroupFailure, RolloutFailure) as exc:  # RolloutFailure: no group could start
                raise WeightSyncError(str(exc)) from exc
            return
        if self.native is None:
            raise WeightSyncError(f"weight sync over HTTP needs an engine; {type(self.backend).__name__} has none")
        engine = self.native.engine

        def join() -> RolloutWeightSync:
            device = engine.model.lm_head.weight.device
            group = WeightSyncGroup(host, port, rank_offset, world_size, backend, timeout_s, device)
            sync = RolloutWeightSync(engine, group, bucket_size_mb, atomic=atomic, in_flight="continue")
            try:
                sync.handshake()
            except BaseException:
                group.close()
                raise
            return sync

        if self._weight_sync is not None:
            self._weight_sync.group.close()
            self._weight_sync = None
        try:
            self._weight_sync = await asyncio.to_thread(join)
        except (WeightSyncTimeout, HandshakeError, ValueError) as exc:
            raise WeightSyncError(str(exc)) from exc

    async def update_weights(self, keep_paused: bool, expect_version: int | None = None) -> RefitRecord:
        """Receive one update from the trainer (who calls ``WeightSender.update`` meanwhile) between
        two engine steps; running requests continue afterwards, their later tokens stamped with the
        new version. ``keep_paused``: the engine stays paused afterwards (a ``/pause`` in force).
        ``expect_version``: the update is refused (weights and version kept) when the trainer
        sends another version. A rejected non-atomic update that left the weights invalid ends
        every running request with an error record (the engine refuses requests until an update
        is accepted).

        Raises:
            WeightSyncNotJoined: no group yet (call init_weight_sync first; under EP also after a
                group restart, e.g. an EP rank failed during this update).
        """
        if not self.weight_sync_ready:
            raise WeightSyncNotJoined("no weight-sync group: call /init_weight_sync first")
        if self.ep is not None:
            ep = self.ep

            def receive() -> RefitRecord:
                if not ep.weight_sync_joined:  # a restart between the caller's check and this step
                    raise WeightSyncNotJoined("the EP group was restarted: call /init_weight_sync again")
                r = ep.receive_weight_update(expect_version)
                if keep_paused:
                    ep.pause()  # the ranks' engines stayed paused (InFlightPolicy); the service's flag too
                return RefitRecord(r["version"], r["ok"], r["seconds"], r["paused_seconds"], r["errors"])

        else:
            sync = self._weight_sync

            def receive() -> RefitRecord:
                outcome = sync.update(expect_version)
                # A rejected non-atomic update that left the weights invalid took the running
                # samples out of the engine (``InFlightPolicy.end``): re-added, the refusal turns
                # them into error records, so no handler waits for outputs that never come.
                for req in outcome.handed_back:
                    self._stepper.add_request(req)
                if keep_paused:
                    self.backend.pause()
                r = outcome.result
                return RefitRecord(r.version, r.ok, r.seconds, outcome.paused_seconds, list(r.errors))

        try:
            record = await self.call(receive)
        except GroupFailure as exc:
            raise WeightSyncNotJoined(f"{exc}; the EP group was restarted: call /init_weight_sync again") from exc
        self.last_refit = record
        self.refits += 1
        self.refit_seconds_total += record.seconds
        return record

    def shutdown(self) -> None:
        """Close the weight-sync group, shut the backend down and stop the engine thread."""
        if self._weight_sync is not None:
            self._weight_sync.group.close()
        try:
            self._submit(self._stop()).result(timeout=60)
        except (concurrent.futures.TimeoutError, RuntimeError):
            pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)

    async def _stop(self) -> None:
        for task in asyncio.all_tasks():
            if task is not asyncio.current_task():
                task.cancel()
        self.backend.shutdown()

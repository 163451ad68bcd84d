"""EngineRunner: a GenerationBackend on a thread of its own, driven from the HTTP event loop.

Governing idea: the HTTP loop must stay responsive (SSE flushes, /health, /metrics, control calls)
while the engine steps, and a weight update must land *between* two engine steps. So the backend
lives on a dedicated thread with its own asyncio loop (the "engine loop"). Everything that touches
the engine runs there as a coroutine: a request is one task iterating the backend's stream, and a
weight update is one coroutine that blocks the engine loop while it receives, which is exactly
"between steps" (the backend's driver only runs when the engine loop is free). Results cross back
with ``call_soon_threadsafe`` into a per-request queue of the HTTP loop.

Backends:
- streaming backends (:class:`StreamingBackend`: ``stream`` + ``abort``, e.g. ``NativeBackend``):
  token deltas as they are sampled, abort by request id, cancellation frees the request's KV pages;
- any other ``GenerationBackend`` (e.g. the expert-parallel ``RolloutService``): requests that
  arrive together are batched into one blocking ``generate`` call; streams then carry one delta
  per sample at its end.
Weight sync over a trainer's group (``init_weight_sync`` / ``update_weights``) needs the
in-process engine (``NativeBackend``).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from m3_rollout.engine.interface import GenerationBackend, GenerationRequest, SampleOutput, StreamDelta
from m3_rollout.engine.native_backend import NativeBackend
from m3_rollout.model.numerics import compute_dtype
from m3_rollout.weight_sync import HandshakeError, WeightSyncGroup, WeightSyncTimeout
from m3_rollout.weight_sync.rollout_sync import RolloutWeightSync

_END = object()
TOKENS_PER_S_WINDOW = 10.0  # seconds over which /metrics' tokens/s is measured


@runtime_checkable
class StreamingBackend(Protocol):
    """A backend that streams token deltas and aborts by request id (``NativeBackend`` is one)."""

    def stream(self, request: GenerationRequest) -> AsyncIterator[SampleOutput | StreamDelta]: ...

    def abort(self, request_id: str) -> None: ...


class WeightSyncError(RuntimeError):
    """A weight-sync call failed (bad group parameters, rendezvous timeout, handshake mismatch,
    rejected update); the message says which and what to do."""


@dataclass
class RefitRecord:
    """The last weight update: version served afterwards, whether it applied, seconds (receive +
    commit), seconds the engine did not step, errors by rank."""

    version: int
    ok: bool
    seconds: float
    paused_seconds: float
    errors: list[str]


class EngineRunner:
    """Hosts ``backend`` on an engine thread; every public coroutine is awaited from the HTTP loop.

    Args:
        backend: the generation backend (``NativeBackend`` for streaming, abort, weight sync and
            top logprobs; any ``GenerationBackend`` otherwise).
        num_threads: torch intra-op threads of the engine thread; default the creating thread's
            ``torch.get_num_threads()`` (a new thread would otherwise run its CPU ops on one
            OpenMP thread).
    """

    def __init__(self, backend: GenerationBackend, num_threads: int | None = None):
        self.backend = backend
        self.native: NativeBackend | None = backend if isinstance(backend, NativeBackend) else None
        self.streaming = isinstance(backend, StreamingBackend)
        self.num_threads = int(num_threads or torch.get_num_threads())
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run_loop, name="m3-engine-loop", daemon=True)
        self._thread.start()
        self._batch_queue: asyncio.Queue | None = None  # engine loop: (request, put) for non-streaming backends
        self._batch_task: asyncio.Task | None = None
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
        """Yield the request's :class:`StreamDelta` records (``stream=True``, streaming backends)
        and then one :class:`SampleOutput` per sample. Leaving the iteration early (a client that
        disconnected) cancels the request on the engine, which frees its KV pages.

        Raises:
            Exception: whatever the backend raised for this request (e.g. an engine step failure).
        """
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def put(item) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, item)

        self.prompt_tokens += len(request.prompt_ids) * request.params.n
        fut = self._submit(self._forward(request, put, stream))
        done = False
        try:
            while True:
                item = await queue.get()
                if item is _END:
                    done = True
                    return
                if isinstance(item, BaseException):
                    done = True
                    raise item
                if isinstance(item, StreamDelta):
                    self._count_tokens(len(item.token_ids))
                elif isinstance(item, SampleOutput):
                    self.requests_finished[item.finish_reason] += 1
                    if not (stream and self.streaming):
                        self._count_tokens(len(item.output_ids))
                yield item
        finally:
            if not done:
                fut.cancel()  # cancels the forwarding task on the engine loop (frees the request)

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

    async def _forward(self, request: GenerationRequest, put, stream: bool) -> None:
        """Engine loop: iterate the backend for ``request`` and hand every item to ``put``."""
        try:
            if self.streaming:
                source = self.backend.stream(request) if stream else self.backend.generate_async([request])
                async for item in source:
                    put(item)
            else:
                outs: asyncio.Queue = asyncio.Queue()
                if self._batch_queue is None:
                    self._batch_queue = asyncio.Queue()
                    self._batch_task = asyncio.ensure_future(self._batch_loop())
                self._batch_queue.put_nowait((request, outs.put_nowait))
                for _ in range(request.params.n):
                    item = await outs.get()
                    if isinstance(item, BaseException):
                        raise item
                    put(item)
            put(_END)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - handed to the waiting HTTP handler
            put(exc)

    async def _batch_loop(self) -> None:
        """Engine loop, non-streaming backends: every request that is waiting goes into one blocking
        ``generate`` call; outputs are routed back by request id."""
        while True:
            batch = [await self._batch_queue.get()]
            while not self._batch_queue.empty():
                batch.append(self._batch_queue.get_nowait())
            sinks = {req.request_id: put for req, put in batch}
            try:
                outs = self.backend.generate([req for req, _ in batch])
            except Exception as exc:  # noqa: BLE001 - every request of the batch gets the error
                for put in sinks.values():
                    put(exc)
                continue
            for out in outs:
                sinks[out.request_id](out)
            await asyncio.sleep(0)

    async def abort(self, request_id: str) -> bool:
        """Abort every sample of ``request_id`` (they finish with reason "abort" and the output so
        far). Returns False when the backend cannot abort (non-streaming backends)."""
        if not self.streaming:
            return False
        await self.call(self.backend.abort, request_id)
        return True

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
        return self.native is not None and self.native.engine.config.record_routing

    def engine_metrics(self) -> dict:
        """The engine's counters (empty for backends without one). Read from the HTTP thread: plain
        integer and length reads, consistent enough for monitoring."""
        return self.native.metrics() if self.native is not None else {}

    # ---- top logprobs --------------------------------------------------------------------------
    async def top_logprobs(
        self, token_ids: Sequence[int], start: int, k: int, temperature: float
    ) -> list[list[tuple[int, float]]]:
        """The ``k`` most likely tokens and their logprobs at positions ``start .. len - 1`` of
        ``token_ids`` under the served weights: one plain forward on the engine loop, fp32
        log-softmax of logits / ``temperature`` (top-k / top-p are not applied).

        Returns [len(token_ids) - start] lists of (token id, logprob), most likely first.
        Raises NotImplementedError for backends without an in-process model.
        """
        if self.native is None:
            raise NotImplementedError("top_logprobs needs the in-process engine (expert-parallel serving has none)")
        return await self.call(self._top_logprobs, list(token_ids), start, k, temperature)

    @torch.no_grad()
    def _top_logprobs(self, ids: list[int], start: int, k: int, temperature: float):
        model = self.native.model
        device = model.lm_head.weight.device
        logits = model(torch.tensor([ids[:-1]], device=device))[0, start - 1 :]  # [G, V]
        lp = torch.log_softmax(logits.to(compute_dtype(logits.dtype)) / temperature, dim=-1)
        vals, idx = lp.topk(min(k, lp.shape[-1]), dim=-1)
        return [list(zip(i.tolist(), v.tolist())) for i, v in zip(idx.cpu(), vals.cpu())]

    # ---- weight sync ---------------------------------------------------------------------------
    @property
    def weight_sync_ready(self) -> bool:
        return self._weight_sync is not None

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
        """Join the trainer's weight-sync group as rank ``rank_offset`` and run the handshake
        (the trainer builds the group as rank 0 and calls ``WeightSender.handshake`` meanwhile).
        Runs on a side thread: the engine keeps stepping.

        Raises:
            WeightSyncError: no in-process engine, rendezvous timeout, or manifest mismatch.
        """
        if self.native is None:
            raise WeightSyncError(
                "weight sync over HTTP needs the in-process engine; with --expert-parallel-size > 1 the "
                "rollout workers join the trainer's group through RolloutService(weight_sync=...)"
            )
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

    async def update_weights(self, keep_paused: bool) -> RefitRecord:
        """Receive one update from the trainer (who calls ``WeightSender.update`` meanwhile) between
        two engine steps; running requests continue afterwards, their later tokens stamped with the
        new version. ``keep_paused``: the engine stays paused afterwards (a ``/pause`` in force).

        Raises:
            WeightSyncError: no group yet (call init_weight_sync first).
        """
        if self._weight_sync is None:
            raise WeightSyncError("no weight-sync group: call /init_weight_sync first")
        sync = self._weight_sync

        def receive() -> RefitRecord:
            outcome = sync.update()
            if keep_paused:
                self.backend.pause()
            r = outcome.result
            return RefitRecord(r.version, r.ok, r.seconds, outcome.paused_seconds, list(r.errors))

        record = await self.call(receive)
        self.last_refit = record
        self.refits += 1
        self.refit_seconds_total += record.seconds
        return record

    def shutdown(self) -> None:
        """Close the weight-sync group, shut the backend down and stop the engine thread."""
        if self._weight_sync is not None:
            self._weight_sync.group.close()
        try:
            self._submit(self._stop()).result(timeout=30)
        except (concurrent.futures.TimeoutError, RuntimeError):
            pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)

    async def _stop(self) -> None:
        for task in asyncio.all_tasks():
            if task is not asyncio.current_task():
                task.cancel()
        self.backend.shutdown()

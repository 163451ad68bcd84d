"""The RL control plane: admission, pause / resume, abort, weight updates, and their conflicts.

Governing idea: one object on the HTTP loop owns the serving state (admitting or paused, an
update running or not, which requests are live) so that every control call sees a consistent
picture and the rules are in one place: requests wait at the admission gate while the server is
paused or draining for an update (``/abort`` ends them there, as it ends running ones); a control
call that would interfere with a running weight update is refused with 409; the engine itself is
only touched through the :class:`EngineRunner`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import AsyncIterator

from m3_rollout.engine.interface import GenerationRequest, SampleOutput, StreamDelta
from m3_rollout.engine.requests import aborted_outputs

from .protocol import (
    WEIGHT_SYNC_NOT_JOINED,
    WEIGHT_UPDATE_REJECTED,
    APIError,
    InitWeightSyncRequest,
    UpdateWeightsRequest,
)
from .runner import EngineRunner, RefitRecord, WeightSyncError, WeightSyncNotJoined

DRAIN_POLL_S = 0.005


class Controller:
    """Serving state in front of an :class:`EngineRunner` (use from the HTTP event loop only)."""

    def __init__(self, runner: EngineRunner):
        self.runner = runner
        self.pause_mode: str | None = None  # "abort" | "drain" | "keep" while paused
        self.updating = False  # a weight update (or group join) is running
        self._gate = asyncio.Event()  # set = new requests are admitted
        self._gate.set()
        self.live: collections.Counter[str] = collections.Counter()  # request id -> open streams
        self.waiting = 0  # requests held at the admission gate
        # request id -> one future per request held at the gate under it, resolved by /abort
        self._held: dict[str, list[asyncio.Future]] = {}
        self._resumes = 0  # /resume calls so far: a drain pause a /resume lifted stops waiting
        self.stopping = False  # the server is shutting down (:meth:`stop`)

    @property
    def weight_version(self) -> int:
        return self.runner.weight_version

    async def top_logprobs(self, *args):
        return await self.runner.top_logprobs(*args)

    async def _pass_gate(self, request_id: str) -> bool:
        """Wait at the admission gate while it is closed: True once it is open, False when
        :meth:`abort` ended the request there (it must not run)."""
        if self._gate.is_set():
            return True
        if self.stopping:  # held now, it would never be let through: the shutdown waits on it
            return False
        aborted = asyncio.get_running_loop().create_future()
        self._held.setdefault(request_id, []).append(aborted)
        self.waiting += 1
        try:
            # the gate may close again before this waiter runs (a /resume, then a /pause in the
            # same loop iteration): wait again, never start while paused
            while not self._gate.is_set() and not aborted.done():
                opened = asyncio.ensure_future(self._gate.wait())
                try:
                    await asyncio.wait({opened, aborted}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    opened.cancel()
            return not aborted.done()  # an abort that counted this request wins over the gate
        finally:
            self.waiting -= 1
            held = self._held[request_id]
            held.remove(aborted)
            if not held:
                del self._held[request_id]

    @contextlib.asynccontextmanager
    async def admitted(self, request_id: str) -> AsyncIterator[bool]:
        """Wait until the admission gate is open (it is closed while paused or draining for an
        update; ``waiting`` counts those held), then count ``request_id`` as live (abortable,
        drained: a pause in mode drain and an update with in_flight=drain wait for it) until the
        block ends, and give True. Gives False, never live, when ``/abort`` (its id or abort_all)
        ended the request at the gate: the block must then not run the engine for it. Every
        request that runs the engine for a client passes here: generation (:meth:`stream`) and
        prompt scoring (completions ``max_tokens=0``)."""
        if not await self._pass_gate(request_id):
            yield False
            return
        self.live[request_id] += 1  # no await since the gate: never in neither _held nor live
        try:
            yield True
        finally:
            self.live[request_id] -= 1
            if self.live[request_id] <= 0:
                del self.live[request_id]

    async def stream(
        self, request: GenerationRequest, stream: bool = True
    ) -> AsyncIterator[SampleOutput | StreamDelta]:
        """The runner's stream of ``request`` once admitted (:meth:`admitted`); the request counts
        as live (abortable, drained) until its iteration ends. A request ``/abort`` ended at the
        gate yields one record per sample with finish reason "abort" and no tokens (as a running
        request aborted before its first token), counted in the finished requests."""
        async with self.admitted(request.request_id) as admitted:
            if not admitted:
                outs = aborted_outputs(request, self.weight_version)
                self.runner.requests_finished["abort"] += len(outs)
                for out in outs:
                    yield out
                return
            async for item in self.runner.stream(request, stream):
                yield item

    def _refuse_during_update(self, what: str) -> None:
        if self.updating:
            raise APIError(
                409,
                f"{what} refused: a weight update is running; retry after it returns (see /health)",
                None,
                code="update_in_progress",
            )

    async def _abort_live(self) -> int:
        rids = list(self.live)
        for rid in rids:
            await self.runner.abort(rid)
        return len(rids)

    async def _wait_idle(self, resumes: int | None = None) -> None:
        """Wait until no request is live; with ``resumes`` (``_resumes`` when the wait began), stop
        early once a /resume came."""
        while self.live and (resumes is None or resumes == self._resumes):
            await asyncio.sleep(DRAIN_POLL_S)

    async def pause(self, mode: str) -> dict:
        """Stop admitting requests. ``abort``: running requests end now with reason "abort";
        ``drain``: returns once they finished; ``keep``: they stay frozen in the engine (KV kept)
        and continue at :meth:`resume`. A second ``/pause`` with the mode in force is a no-op; with
        another mode it is refused (the frozen or draining requests would be stranded). The
        answer's ``paused`` is the state at return: False when a ``/resume`` lifted this pause
        while it aborted, drained (it then returns at once) or froze the engine. Raises APIError
        409 during a weight update or a pause in another mode, 503 while the server shuts down."""
        if self.stopping:
            raise APIError(503, "/pause refused: the server is shutting down", None, type="server_error")
        self._refuse_during_update("/pause")
        if self.pause_mode is not None:
            if mode != self.pause_mode:
                raise APIError(
                    409,
                    f"already paused with mode={self.pause_mode!r}; call /resume before pausing with mode={mode!r}",
                    "mode",
                    type="invalid_request_error",
                    code="already_paused",
                )
            return {"paused": True, "mode": mode, "aborted": 0, "running": sum(self.live.values())}
        self._gate.clear()
        self.pause_mode = mode
        resumes = self._resumes
        aborted = 0
        if mode == "abort":
            aborted = await self._abort_live()
        elif mode == "drain":
            await self._wait_idle(resumes)
        elif mode == "keep":
            await self.runner.pause()  # a /resume meanwhile resumes the engine after it (one engine loop, in order)
        lifted = resumes != self._resumes  # a /resume came while this pause awaited
        return {"paused": not lifted, "mode": mode, "aborted": aborted, "running": sum(self.live.values())}

    async def resume(self) -> dict:
        """Admit requests again and let frozen ones continue. Raises APIError 409 during an update."""
        self._refuse_during_update("/resume")
        if self.pause_mode == "keep":
            await self.runner.resume()
        self.pause_mode = None
        self._resumes += 1
        self._gate.set()
        return {"paused": False}

    def _abort_held(self, rid: str) -> bool:
        """End every request held at the gate under ``rid`` (:meth:`admitted` gives False);
        whether there was one."""
        held = self._held.get(rid, [])
        for aborted in held:
            if not aborted.done():
                aborted.set_result(None)
        return bool(held)

    async def abort(self, rid: str | None, abort_all: bool) -> dict:
        """Abort one request id (every sample of it) or every request, running or held at the
        admission gate (a held one never runs: its samples end with reason "abort" and no
        tokens). Unknown ids are not an error (the request may just have finished): ``aborted``
        says how many request ids were found."""
        if abort_all:
            held = {rid for rid in list(self._held) if self._abort_held(rid)}
            only_held = len(held - set(self.live))  # an id both held and running counts once
            return {"aborted": only_held + await self._abort_live()}
        if rid is None:
            raise APIError(400, "rid: give the request id to abort, or abort_all=true", "rid")
        found = self._abort_held(rid)
        if rid in self.live:
            found = True
            await self.runner.abort(rid)
        return {"aborted": int(found)}

    async def stop(self) -> int:
        """The server is shutting down (SIGTERM / SIGINT, ``cli.GracefulServer``), which waits for
        the requests in flight: end those that cannot finish on their own, which it would wait for
        forever. Requests held at the admission gate (paused, or an update draining) never run, and
        with ``/pause`` mode keep the running ones stay frozen: each ends as ``/abort`` ends it
        (finish reason "abort"). Requests running unpaused go on and finish. From now on a request
        that would wait at the gate ends there at once, and ``/pause`` is refused (503). Returns
        how many request ids were ended."""
        self.stopping = True
        held = {rid for rid in list(self._held) if self._abort_held(rid)}
        frozen = set(self.live) if self.pause_mode == "keep" else set()
        for rid in frozen:
            await self.runner.abort(rid)
        return len(held | frozen)

    async def reset_prefix_cache(self) -> dict:
        self._refuse_during_update("/reset_prefix_cache")
        await self.runner.reset_prefix_cache()
        return {"success": True}

    async def init_weight_sync(self, req: InitWeightSyncRequest) -> dict:
        """Join the trainer's weight-sync group (see :meth:`EngineRunner.init_weight_sync`).
        Raises APIError 409 during an update, 400 when the join or handshake fails."""
        self._refuse_during_update("/init_weight_sync")
        ranks = self.runner.weight_sync_ranks
        if req.rank_offset + ranks > req.world_size:
            raise APIError(
                400,
                f"rank_offset={req.rank_offset}: this server takes {ranks} rank(s) from rank_offset on, which must "
                f"be below world_size={req.world_size}",
                "rank_offset",
            )
        self.updating = True
        try:
            await self.runner.init_weight_sync(
                req.master_address,
                req.master_port,
                req.world_size,
                req.rank_offset,
                req.backend,
                req.timeout_s,
                req.bucket_size_mb,
                req.atomic,
            )
        except WeightSyncError as exc:
            raise APIError(400, str(exc), None, code="weight_sync_failed") from exc
        finally:
            self.updating = False
        return {"success": True, "rank": req.rank_offset, "weight_version": self.weight_version}

    async def update_weights(self, req: UpdateWeightsRequest) -> RefitRecord:
        """Receive one update from the trainer under the ``in_flight`` policy. Raises APIError 409
        while another update runs, or for ``in_flight="drain"`` while ``/pause`` mode keep holds
        running requests frozen (the drain would wait for them forever); 400 when no group exists
        or the update was rejected (the weights and version are then unchanged for an atomic
        update, and for any update of another ``version`` than the request announced); its code is
        ``weight_sync_not_joined`` when the server is not in the trainer's group (none joined, or
        the EP group restarted since: /init_weight_sync, then resend)."""
        self._refuse_during_update("/update_weights")
        if not self.runner.weight_sync_ready:
            raise APIError(400, "no weight-sync group: call /init_weight_sync first", None, code=WEIGHT_SYNC_NOT_JOINED)
        if req.in_flight == "drain" and self.pause_mode == "keep" and self.live:
            raise APIError(
                409,
                f"in_flight='drain' refused: /pause mode=keep holds {len(self.live)} running request(s) frozen, so "
                "they cannot finish; call /resume first, or update with in_flight='continue' (they go on with the "
                "new weights after /resume) or 'abort'",
                "in_flight",
                code="paused_keep",
            )
        self.updating = True
        gate_was_open = self._gate.is_set()
        try:
            if req.in_flight == "abort":
                await self._abort_live()
            elif req.in_flight == "drain":
                self._gate.clear()
                await self._wait_idle()
            record = await self.runner.update_weights(self.pause_mode == "keep", req.version)
        except WeightSyncNotJoined as exc:
            raise APIError(400, str(exc), None, code=WEIGHT_SYNC_NOT_JOINED) from exc
        except WeightSyncError as exc:
            raise APIError(400, str(exc), None, code="weight_sync_failed") from exc
        finally:
            self.updating = False
            if gate_was_open and self.pause_mode is None:
                self._gate.set()
        if not record.ok:
            raise APIError(
                400,
                f"weight update rejected; serving version {record.version}:\n  " + "\n  ".join(record.errors),
                None,
                code=WEIGHT_UPDATE_REJECTED,
            )
        return record

"""RolloutService: P expert-parallel RolloutWorkers behind one GenerationBackend (design.md §3-6).

Governing idea: the driver (the GRPO loop) sees one backend. The service places each request
(a GRPO group: all n samples together, so they share the prompt's KV pages) on the least-loaded
rank, or on the rank that already holds its prompt's prefix (a multi-turn continuation of a
sample goes back to its group's rank). It then calls ``run(new requests, steps_per_call)`` on
every rank at once; the ranks step in lockstep among themselves (see worker.py) and return
finished samples, until every sample of the call is done.

Failure (design.md §6): a dead or failing rank breaks the group's collectives. The launcher
reports it within the collective timeout; the service records which requests were lost, tears
the whole group down, starts it again (fresh rendezvous port, last weights re-applied) and
resubmits the lost samples, whose tokens repeat exactly (randomness is keyed by seed, sample
index and position). Every failure counts against ``max_restarts`` within one call, a failure
while restarting too; past it the service raises :class:`RolloutFailure` with the lost request
ids (the caller may resubmit them) and the last cause. The step API (``add_request`` / ``step``:
``generate_async``, the rollout server) resubmits the same way the requests added without
``stream`` (and streamed ones not sent yet); streamed ones, whose tokens have left the service,
end with error records. Weights a restart cannot re-apply (received from a trainer's group by
``receive_weight_update``, which keeps no copy here; an IPC source that moved on) are never
served by the new workers' checkpoint weights: requests get error records naming the remedy
until an update is accepted. Each failure is kept as an event (``drain_events()``) and counted
in ``metrics()`` for the job to log.

Weights (design.md §3): the driver is rank 0 of a weight-sync group with the workers
(m3_rollout/weight_sync); every update goes through the workers' ``WeightReceiver``, the same
receiver the in-process engine uses, so names, shapes, finite values, versions, atomicity, the
in-flight policy and the probe are checked in one place. With ``refit="ipc"``
(``policy.generation.colocated_placement=worker_process``) the workers sit on the driver's node,
one on the trainer's own device or P EP ranks on cuda:0..P-1 with the trainer on one of those
GPUs (NCCL could not put the trainer and a worker of one group on one GPU), and the transport is
trainer memory every worker opens by handle instead of a group (``ipc_refit.py``: the trainer's
compute copy, or a stage it fills): no host copy, each rank keeps its own experts, restarted
workers are given the source's weights while it still holds them, a worker lost during a refit
restarts the group and the refit is repeated; ``sleep`` / ``wake_up`` reach every worker's engine
(generation and training take turns on the shared GPU).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import itertools
import threading
import time
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass

import torch

from m3_rollout.engine.interface import FINISH_ERROR, GenerationBackend, GenerationRequest, SampleOutput, StreamDelta
from m3_rollout.engine.requests import error_outputs
from m3_rollout.engine.sleep import check_sleep_level
from m3_rollout.engine.step_driver import StepDriver
from m3_rollout.model.selection_record import share_segments
from m3_rollout.parallel.process_group import free_port

from .ipc_refit import IpcRefit
from .launchers import GroupFailure, Launcher, make_launcher
from .worker import WorkerSpec


def _share_prompt_records(outs: list[SampleOutput]) -> None:
    """Make the block-selection segments a request's samples share (their prompt's) one object
    again: samples finished in different ``run`` calls were unpickled separately."""
    if any(o.block_selection is not None for o in outs):
        for i, rec in enumerate(share_segments([o.block_selection for o in outs])):
            outs[i] = dataclasses.replace(outs[i], block_selection=rec)


def _locked(method):
    """Run the method under the service's lock (one launcher call at a time)."""

    def wrapper(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)

    wrapper.__name__, wrapper.__doc__ = method.__name__, method.__doc__
    return wrapper


LOST = "the request was lost (resubmit it)"  # the end of an error record of a request the group lost


class RolloutFailure(RuntimeError):
    """The EP group failed more than ``max_restarts`` times in one call; ``lost_request_ids``
    are the caller's requests that did not complete (resubmit them after fixing the cause)."""

    def __init__(self, message: str, lost_request_ids: list[str]):
        super().__init__(message)
        self.lost_request_ids = lost_request_ids


def refit_rules(ws, freeze) -> tuple:
    """(frozen-name predicate, probe settings or None) of the ``weight_sync`` section ``ws`` and
    ``policy.freeze`` (None: nothing frozen): frozen tensors go with a worker's first update only,
    unless ``weight_sync.send_frozen``."""
    from m3_rollout.weight_sync import ProbeSettings, default_frozen

    pr = ws.probe
    probe = ProbeSettings(pr.num_prompts, pr.num_tokens, pr.threshold) if pr.enabled else None

    def frozen(name: str) -> bool:
        return not ws.send_frozen and freeze is not None and default_frozen(name, freeze.indexer, freeze.router_bias)

    return frozen, probe


def trainer_group_device(backend: str, trainer_device: str | None) -> str:
    """Where the trainer's end of the broadcast weight-sync group keeps its wire buffers: "cpu" for
    gloo; for NCCL the trainer's GPU (``cluster.device``), always with an index (the group binds the
    rank to it: ``torch.cuda.set_device``). A CUDA device without an index, a CPU trainer or None:
    the current CUDA device. The workers of rank r sit on cuda:r, so the trainer's GPU must be
    another one (NCCL refuses two ranks of one group on one GPU)."""
    if backend != "nccl":
        return "cpu"
    dev = torch.device(trainer_device) if trainer_device else torch.device("cuda")
    if dev.type != "cuda":
        dev = torch.device("cuda")
    if dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return str(dev)


def _rank_error(errors: dict[int, tuple[str, str]], world_size: int) -> Exception:
    """One exception for the refusals of the ranks in ``errors`` ({rank: (exception type name,
    message)}): the lowest rank's type (ValueError, TypeError, else RuntimeError); its message
    alone when every rank refused with the same message (bad arguments: the caller's error, worded
    as the in-process engine words it), else each refusing rank's message, named."""
    kinds = {"ValueError": ValueError, "TypeError": TypeError}
    first = min(errors)
    if len(errors) == world_size and len({m for _, m in errors.values()}) == 1:
        text = errors[first][1]
    else:
        text = "; ".join(f"rank {r}: {m}" for r, (_, m) in sorted(errors.items()))
    return kinds.get(errors[first][0], RuntimeError)(text)


def _by_value(seq):
    """A sequence argument of a worker call as a list (tensors too), so it pickles; anything that
    is not iterable as is, for the ranks' checks to refuse by name."""
    if isinstance(seq, torch.Tensor):
        return seq.tolist()
    try:
        return list(seq)
    except TypeError:
        return seq


def _merge_records(records: list[dict]) -> dict:
    """One sleep / wake-up record from the ranks': GiB figures summed, the rest (level, seconds)
    the largest."""
    return {k: (sum if k.startswith("gb_") else max)(r[k] for r in records) for k in records[0]}


@dataclass
class _Pending:
    """One caller request in flight: where its outputs go and which samples are still missing.
    The step API's also: whether it streams, and the group failures it lived through."""

    index: int
    request: GenerationRequest
    missing: set[int]
    rank: int
    stream: bool = False
    failures: int = 0


class RolloutService(GenerationBackend):
    """Expert-parallel generation over P worker processes.

    Args:
        spec: the workers' :class:`WorkerSpec` (its ``group.port`` is replaced at every start).
        launcher: "auto" | "ray" | "mp", or a :class:`Launcher` factory (callable -> Launcher).
        ray_address: ``cluster.ray_address`` for the Ray launcher.
        worker_cpus / worker_gpus: resources each Ray actor asks for.
        steps_per_call: lockstep steps per ``run`` call before the driver places new work
            (larger = fewer round trips; new requests wait at most that long).
        max_restarts: group restarts allowed within one ``generate`` call.
        start_timeout_s: limit for bringing the group up (imports, rendezvous, shard loading).
        call_timeout_s: limit for one ``run`` call (None: the collective timeout bounds it).
        stream_steps_per_call: lockstep steps per :meth:`step` (the streaming API; deltas carry
            up to that many tokens) when no new request goes out with it.
        weight_sync: the ``weight_sync`` config section (a ``WeightSyncConfig``).
        freeze: ``policy.freeze`` (frozen tensors are sent with a group's first update only,
            unless ``weight_sync.send_frozen``); None: nothing frozen.
        probe_reference: the trainer's probe scorer (``weight_sync.probe``; the job sets it).
        refit: "broadcast" (a weight-sync group with the workers; tensors kept on the host for a
            restarted group) or "ipc" (the workers are on this process's node: refit through the
            source this process shares with them on ``trainer_device``, ``ipc_refit.py``).
        trainer_device: the trainer's device (``cluster.device``): where this process's end of an
            NCCL weight-sync group lives (:func:`trainer_group_device`; it must not be a worker's
            GPU), or with ``refit="ipc"`` where the shared source lives (None: ``spec.device``).
    Raises RolloutFailure when the group does not start within ``max_restarts`` attempts;
    ValueError for another ``refit``.
    """

    def __init__(
        self,
        spec: WorkerSpec,
        launcher="auto",
        ray_address: str | None = None,
        worker_cpus: float = 0.5,
        worker_gpus: float = 0.0,
        steps_per_call: int = 64,
        max_restarts: int = 2,
        start_timeout_s: float = 300.0,
        call_timeout_s: float | None = None,
        stream_steps_per_call: int = 4,
        *,
        weight_sync,
        freeze=None,
        probe_reference=None,
        refit: str = "broadcast",
        trainer_device: str | None = None,
    ):
        if refit not in ("broadcast", "ipc"):
            raise ValueError(f"RolloutService: refit={refit!r} must be 'broadcast' or 'ipc'")
        self.spec, self.refit = spec, refit
        self.trainer_device = trainer_device
        self.world_size = spec.group.world_size
        self._launcher_kind = launcher
        self._launcher_args = (ray_address, worker_cpus, worker_gpus)
        self.steps_per_call = int(steps_per_call)
        self.max_restarts = int(max_restarts)
        self.start_timeout_s, self.call_timeout_s = start_timeout_s, call_timeout_s
        self.launcher: Launcher | None = None
        self._version = 0
        self._weight_writes = 0  # weight_writes: the group-wide count every rank's engine stamps
        self._last_weights: tuple[int, dict[str, torch.Tensor]] | None = None
        self._ids = itertools.count()
        self._prefix_owner: dict[tuple[int, int], int] = {}  # (prompt length, hash) -> rank
        self._prefix_lengths: set[int] = set()
        self.restarts = 0
        self._starts = 0  # group starts so far (the workers' incarnation)
        self.failures: list[dict] = []  # {"time", "ranks", "error", "lost_request_ids", "recovered"}
        self._events: list[dict] = []  # failures not yet handed to the job (drain_events)
        self.last_ep_stats: list[dict] = []
        self._metrics = {"run_calls": 0, "lockstep_steps": 0, "run_seconds": 0.0}
        self._lock = threading.RLock()  # one launcher call at a time (async GRPO's producer thread)
        self.weight_sync, self._freeze, self.probe_reference = weight_sync, freeze, probe_reference
        self._ws_sender = None
        self._ipc: IpcRefit | None = None  # refit="ipc": channel + sender, kept across restarts (the stage)
        self._sleep_level = 0  # the workers' engines sleep at this level (sleep / wake_up)
        # why the workers do not hold the served weights and what makes them served again (None: they
        # do); no forward runs meanwhile (generate / score refuse, the step API gives error records)
        self._weights_lost: str | None = None
        # the served weights came from a trainer's group (receive_weight_update): no copy is kept here,
        # so a restarted group cannot be given them
        self._served_received = False
        self._joined = False  # this group's workers joined a trainer's weight-sync group (join_weight_sync)
        self._handed_back: list[str] = []  # step-API requests an invalid rank gave up in the last refit
        self._frozen_sent = False  # the broadcast group's ranks accepted an update with the frozen tensors
        self.last_weight_sync: dict = {}
        # The step API (add_request / abort / step): requests by id, and what the next step sends.
        self.stream_steps_per_call = int(stream_steps_per_call)
        self._live: dict[str, _Pending] = {}
        self._to_add: list[list[tuple[GenerationRequest, bool]]] = []  # per rank: (request, stream)
        self._to_abort: list[list[str]] = []
        self._paused = False
        self._rank_engine: list[dict] = []  # each rank's engine metrics after its last reply
        self._ready: list[SampleOutput] = []  # error records of requests a group failure lost
        # generate_async: NativeBackend's driver (queues, one driver task) over this step API
        self.step_driver = StepDriver(self)
        self._start_with_retries(None, [])
        atexit.register(self.shutdown)

    # ---- group lifecycle ---------------------------------------------------------------------
    def _start(self) -> None:
        """Start a fresh group (new rendezvous port) and re-apply the served weights where this
        process can: the last :meth:`update_weights` (the host copy, or the IPC source while it
        holds them) or the checkpoint's. Weights received from a trainer's group
        (:meth:`receive_weight_update`) cannot be: the new workers keep the checkpoint's and
        ``_weights_lost`` says so (no forward until the next accepted update), as it does when the
        new workers refuse the re-applied weights (ValueError: the checkpoint's, or a non-atomic
        rank half-written, stay on them). A paused service pauses the new workers too (requests
        resubmitted after a failure wait for ``resume``).
        Raises GroupFailure (the launcher is shut down and dropped first)."""
        group = dataclasses.replace(self.spec.group, port=free_port(self.spec.group.addr))
        spec = dataclasses.replace(self.spec, group=group, incarnation=self._starts)
        self._starts += 1
        kind = self._launcher_kind
        self.launcher = kind() if callable(kind) else make_launcher(kind, *self._launcher_args)
        try:
            self.launcher.start(spec, self.start_timeout_s)
            infos = self.launcher.call("info", (), self.start_timeout_s)
            self.rank_info = infos
            self._rank_engine = []
            self._to_add = [[] for _ in range(self.world_size)]
            self._to_abort = [[] for _ in range(self.world_size)]
            self._sleep_level = 0  # fresh workers are awake
            self._joined = False  # a trainer's weight-sync group had the old workers only
            if self.refit == "ipc":
                self.launcher.call("init_ipc_sync", self._ipc_refit().worker_args, self.start_timeout_s)
            if self._served_received:  # only the old workers got them: no copy to re-apply
                self._weights_lost = self._received_weights_lost()
            else:
                try:
                    if self.refit == "ipc" and self._last_weights is not None:
                        self._reapply_ipc()  # sets _weights_lost when the source no longer holds them
                    else:
                        if self._last_weights is not None:
                            self._push_weights(*self._last_weights)
                        self._weights_lost = None  # fresh valid ranks on the served weights
                except ValueError as exc:  # refused: the checkpoint's weights, or part of the re-sent ones
                    self._weights_lost = (
                        f"the restarted rollout workers refused the served version {self._version} re-sent to "
                        f"them ({exc}); call update_weights first"
                    )
            self._count_writes()  # fresh workers: no count of an earlier group may be taken for theirs
            if self._paused:
                self.launcher.call("pause", (), self.start_timeout_s)
        except BaseException:
            self._close_weight_sync()
            self.launcher.shutdown(graceful=False)
            self.launcher = None
            raise

    def _received_weights_lost(self) -> str:
        """``_weights_lost`` after a restart while the served weights were received from a
        trainer's group: the cause and what makes the weights served again."""
        return (
            f"the restarted rollout workers hold the checkpoint's weights, not the served version {self._version}, "
            "which came from the trainer's weight-sync group (join_weight_sync / receive_weight_update) and is not "
            "kept for a restart: have the trainer join again (join_weight_sync; the server's /init_weight_sync) "
            "and send the weights again (its next update: receive_weight_update; /update_weights), or call "
            "update_weights first"
        )

    def _record(self, failure: GroupFailure, lost: list[str], recovered: bool) -> None:
        event = {
            "time": time.time(),
            "ranks": failure.ranks,
            "error": str(failure),
            "lost_request_ids": lost,
            "recovered": recovered,
        }
        self.failures.append(event)
        self._events.append(event)
        then = "restarting the group" if recovered else f"giving up (cluster.max_restarts={self.max_restarts})"
        print(f"[rollout] {failure}; {len(lost)} requests to resubmit; {then}", flush=True)

    def _start_with_retries(self, failure: GroupFailure | None, lost: list[str], used: int = 0) -> int:
        """(Re)start the group after ``failure`` (None: the first start). A failure while starting
        counts like any other; ``used`` restarts were already spent in this call. Returns the
        restarts used in all. Raises RolloutFailure (with ``lost`` and the last cause) past
        ``max_restarts``."""
        while True:
            if failure is not None:
                self._close_weight_sync()  # the new workers join a new weight-sync group
                if self.launcher is not None:
                    self.launcher.shutdown(graceful=False)
                    self.launcher = None
                if used >= self.max_restarts:
                    self._record(failure, lost, recovered=False)
                    raise RolloutFailure(
                        f"{failure}; gave up after {self.max_restarts} restarts (cluster.max_restarts); "
                        f"lost requests (resubmit them): {lost}",
                        lost,
                    ) from failure
                self._record(failure, lost, recovered=True)
                used += 1
                self.restarts += 1
                self._prefix_owner.clear()
                self._prefix_lengths.clear()
            try:
                self._start()
                return used
            except GroupFailure as again:
                failure = again

    @_locked
    def shutdown(self) -> None:
        """End the workers. Never raises: it runs after failures (and at exit) and must not
        hide them."""
        launcher, self.launcher = self.launcher, None
        if launcher is None:
            return
        try:
            launcher.call("shutdown", (), 10.0)
        except GroupFailure:
            pass
        finally:
            self._close_weight_sync(final=True)
            launcher.shutdown()

    @_locked
    def drain_events(self) -> list[dict]:
        """Worker failures since the last call (recovered or not), oldest first: {"time",
        "ranks", "error", "lost_request_ids", "recovered"}; the job logs them."""
        out, self._events = self._events, []
        return out

    @_locked
    def worker_pids(self) -> list[int]:
        return self.launcher.pids()

    # ---- placement ---------------------------------------------------------------------------
    def _owner_of(self, prompt: Sequence[int]) -> int | None:
        for n in sorted(self._prefix_lengths, reverse=True):
            if n <= len(prompt):
                rank = self._prefix_owner.get((n, hash(tuple(prompt[:n]))))
                if rank is not None:
                    return rank
        return None

    def _place(self, req: GenerationRequest, load: list[int]) -> int:
        """A continuation goes where its prefix is cached; a new group to the least-loaded rank."""
        rank = self._owner_of(req.prompt_ids)
        if rank is None:
            rank = min(range(self.world_size), key=lambda r: (load[r], r))
            n = len(req.prompt_ids)
            self._prefix_owner[(n, hash(tuple(req.prompt_ids)))] = rank
            self._prefix_lengths.add(n)
        load[rank] += len(req.output_indices())
        return rank

    # ---- generation --------------------------------------------------------------------------
    @_locked
    def generate(self, requests: Sequence[GenerationRequest]) -> list[SampleOutput]:
        """Run all requests to completion on the EP group; outputs ordered by request, then sample.

        Bad requests give error records. Raises RolloutFailure when the group fails more than
        ``max_restarts`` times during this call (failures while restarting included); the next
        call starts a fresh group. RuntimeError while generate_async callers are active or
        requests of the step API are unfinished.
        """
        self.step_driver.check_idle()
        if self._live:
            raise RuntimeError(
                f"generate() while {len(self._live)} requests of the step API (add_request / step) are unfinished"
            )
        self._check_ready("generate", [r.request_id for r in requests])
        results: list[list[SampleOutput]] = [[] for _ in requests]
        pending: dict[str, _Pending] = {}
        load = [0] * self.world_size
        new: list[list[GenerationRequest]] = [[] for _ in range(self.world_size)]
        for i, req in enumerate(requests):
            iid = f"{next(self._ids)}:{req.request_id}"
            rank = self._place(req, load)
            pending[iid] = _Pending(i, req, set(req.output_indices()), rank)
            new[rank].append(dataclasses.replace(req, request_id=iid))
        restarts_here = 0
        while pending:
            t0 = time.perf_counter()
            try:
                replies = self.launcher.call(
                    "run", [(new[r], self.steps_per_call) for r in range(self.world_size)], self.call_timeout_s
                )
            except GroupFailure as failure:
                lost = sorted({p.request.request_id for p in pending.values()})
                restarts_here = self._start_with_retries(failure, lost, restarts_here)
                self._check_weights_served(lost)
                new = self._resubmit(pending)
                continue
            self._metrics["run_calls"] += 1
            self._metrics["run_seconds"] += time.perf_counter() - t0
            new = [[] for _ in range(self.world_size)]
            self.last_ep_stats = [r["ep"] for r in replies]
            self._metrics["lockstep_steps"] += replies[0]["steps"]
            for reply in replies:
                for out in reply["outputs"]:
                    p = pending.get(out.request_id)
                    if p is None or out.sample_index not in p.missing:
                        continue  # a duplicate of an already delivered sample (after a resubmission)
                    p.missing.discard(out.sample_index)
                    results[p.index].append(dataclasses.replace(out, request_id=p.request.request_id))
                    if not p.missing:
                        del pending[out.request_id]
                        _share_prompt_records(results[p.index])
            if pending and all(r["steps"] == 0 for r in replies):
                raise RuntimeError(
                    f"EP group idle with {len(pending)} requests unfinished "
                    f"(paused? call resume()): {[p.request.request_id for p in pending.values()]}"
                )
        return [o for outs in results for o in sorted(outs, key=lambda o: o.sample_index)]

    async def generate_async(self, requests: Sequence[GenerationRequest]) -> AsyncIterator[SampleOutput]:
        """Yield each sample's :class:`SampleOutput` as it finishes (finish order), through the
        step API below: the requests are placed at once, and ONE driver task (the
        :class:`StepDriver` ``NativeBackend`` uses) steps the group while any caller waits, so
        concurrent callers batch together. Tokens equal :meth:`generate`'s for the same seeds.

        Bad requests yield error records. A group failure restarts the group and resubmits the
        samples not yet out, as :meth:`generate` does (same tokens for the same seeds; the step
        API's :meth:`_restart_live`); past ``max_restarts`` failures while a request runs, or when
        the restart fails, its samples yield error records naming the cause. Closing the
        iterator early aborts the samples not yet out.
        Raises RuntimeError while the workers sleep; RolloutFailure when the group cannot be
        started; an exception raised by a step in every waiting caller.
        """
        self._check_awake("generate")
        async with contextlib.aclosing(self.step_driver.run(requests)) as outs:
            async for out in outs:
                yield out

    def _resubmit(self, pending: dict[str, _Pending], load: list[int] | None = None) -> list[list[GenerationRequest]]:
        """New per-rank request lists for the missing samples of `pending` (after a restart; of
        :meth:`generate` and of the step API): the whole request when none of its samples came
        back, else one n=1 request per missing sample with its ``sample_index`` (the keyed sampler
        repeats its tokens); each keeps its id. Places them afresh (``p.rank`` follows) over
        ``load`` (samples per rank already running there; None: none)."""
        load = [0] * self.world_size if load is None else list(load)
        new: list[list[GenerationRequest]] = [[] for _ in range(self.world_size)]
        for iid, p in pending.items():
            req = p.request
            full = len(p.missing) == len(req.output_indices())
            if full:
                reqs = [req]
            else:  # n=1 per missing sample: its own random stream (sample_index) repeats its tokens
                reqs = [
                    dataclasses.replace(req, params=dataclasses.replace(req.params, n=1), sample_index=j)
                    for j in sorted(p.missing)
                ]
            rank = p.rank = self._place(reqs[0], load)
            for _r in reqs[1:]:
                load[rank] += 1
            new[rank].extend(dataclasses.replace(r, request_id=iid) for r in reqs)
        return new

    # ---- the step API (the rollout server) ---------------------------------------------------
    # The engine's own contract (design.md §3.2) over the EP group, for a caller that interleaves
    # arrivals, aborts and control calls with generation (the HTTP server's engine loop): requests
    # are placed at once and reach their rank with the next ``step``, which runs one ``run`` call
    # of ``stream_steps_per_call`` lockstep steps on every rank.
    @_locked
    def add_request(self, req: GenerationRequest, stream: bool = False) -> None:
        """Place ``req`` (its ``request_id`` must be unique among the unfinished ones) on a rank;
        it starts with the next :meth:`step`. ``stream``: its :class:`StreamDelta` records come out
        of ``step`` too (a group failure then ends it with error records; a request without
        ``stream`` is resubmitted instead, see :meth:`step`). A bad request yields error records,
        as the engine's; so does every request while the workers do not hold the served weights
        (:meth:`_check_weights_served`: after a rejected non-atomic update, or a restart that could not
        re-apply the served weights: the IPC source no longer held them, or they were received from
        a trainer's group), since an EP forward would read an invalid rank's experts or run old
        weights under the served version.
        Raises RuntimeError while the workers sleep (:meth:`_check_awake`; wake_up first), as
        ``LLMEngine.add_request`` does: placed anyway, the next step would fail on the sleeping
        ranks and restart the group awake; ValueError for an id still unfinished."""
        self._check_awake("add a request")
        if req.request_id in self._live:
            raise ValueError(f"request_id={req.request_id!r}: a request with this id is still unfinished")
        if self.launcher is None:
            self._start_with_retries(None, [])
        try:
            self._check_weights_served([req.request_id])
        except RolloutFailure as refused:
            self._ready += error_outputs(req, str(refused), self._version)
            return
        load = [0] * self.world_size
        for p in self._live.values():
            load[p.rank] += len(p.missing)
        rank = self._place(req, load)
        self._live[req.request_id] = _Pending(0, req, set(req.output_indices()), rank, stream)  # index: unused
        self._to_add[rank].append((req, stream))

    @_locked
    def abort(self, request_id: str) -> None:
        """Stop every sample of ``request_id`` (the step API's request of that id, and the
        requests of :meth:`generate_async` callers that gave that id): each comes out of the next
        :meth:`step` with finish_reason "abort" (its KV pages are freed there). Unknown ids are
        ignored."""
        for rid in (request_id, *self.step_driver.internal_ids(request_id)):
            p = self._live.get(rid)
            if p is not None and rid not in self._to_abort[p.rank]:
                self._to_abort[p.rank].append(rid)

    def has_unfinished(self) -> bool:
        return bool(self._live or self._ready)

    @property
    def paused(self) -> bool:
        return self._paused

    @_locked
    def step(self) -> list[SampleOutput | StreamDelta]:
        """Send the new requests and aborts to their ranks and run ``stream_steps_per_call``
        lockstep steps (one when new requests go out; none while paused: only abort records come
        back); return the finished samples, error records and stream deltas.

        A group failure does not raise: the group restarts and the unfinished requests added
        without ``stream`` are resubmitted as :meth:`generate` resubmits (their missing samples,
        same ids, same tokens for the same seeds; :meth:`_restart_live`), while streamed ones get
        error records naming the failure (streamed tokens cannot be taken back).
        """
        outputs: list[SampleOutput | StreamDelta] = self._ready
        self._ready = []
        if not self._live:
            return outputs
        aborting = {rid for rids in self._to_abort for rid in rids}  # the callers' aborts
        # One step while requests arrive (their first tokens come back at once and the next
        # arrivals join sooner), stream_steps_per_call once the batch is settled.
        steps = 0 if self._paused else 1 if any(self._to_add) else self.stream_steps_per_call
        lost = None
        if self._weights_lost:  # no forward may read an invalid rank's experts: end what runs
            lost = f"{self._weights_lost}; {LOST}"
            steps = 0
            for rid, p in self._live.items():
                if rid not in self._to_abort[p.rank]:
                    self._to_abort[p.rank].append(rid)
        args = [
            ([req for req, _ in new], steps, aborts, {req.request_id for req, stream in new if stream})
            for new, aborts in zip(self._to_add, self._to_abort)
        ]
        self._to_add = [[] for _ in range(self.world_size)]
        self._to_abort = [[] for _ in range(self.world_size)]
        t0 = time.perf_counter()
        try:
            replies = self.launcher.call("run", args, self.call_timeout_s)
        except GroupFailure as failure:
            self._fail_live(failure, aborting)
            outputs, self._ready = outputs + self._ready, []
            return outputs
        self._metrics["run_calls"] += 1
        self._metrics["run_seconds"] += time.perf_counter() - t0
        self._metrics["lockstep_steps"] += replies[0]["steps"]
        self.last_ep_stats = [r["ep"] for r in replies]
        self._rank_engine = [r["engine"] for r in replies]
        for reply in replies:
            got = reply["outputs"]
            if lost is not None:  # their abort records, as the error records they are
                got = [
                    dataclasses.replace(o, finish_reason=FINISH_ERROR, error=lost)
                    if isinstance(o, SampleOutput) and o.finish_reason == "abort"
                    else o
                    for o in got
                ]
            outputs += self._deliver(got)
        return outputs

    def _deliver(self, outs: Iterable[SampleOutput | StreamDelta]) -> list[SampleOutput | StreamDelta]:
        """The records of ``outs`` that belong to unfinished requests of the step API; a request
        whose every sample came back is finished (no longer ``_live``)."""
        kept = []
        for out in outs:
            p = self._live.get(out.request_id)
            if p is None:
                continue
            if isinstance(out, SampleOutput):
                if out.sample_index not in p.missing:
                    continue  # a duplicate of an already delivered sample (as in generate)
                p.missing.discard(out.sample_index)
                if not p.missing:
                    del self._live[out.request_id]
            kept.append(out)
        return kept

    def _fail_live(self, failure: GroupFailure, aborting: Iterable[str] = ()) -> None:
        """:meth:`_restart_live` for a step or a weight-sync call; a failed restart leaves the
        group stopped (the next ``add_request`` starts it)."""
        with contextlib.suppress(RolloutFailure):  # recorded, and the requests have error records
            self._restart_live(failure, aborting)

    def _restart_live(self, failure: GroupFailure, aborting: Iterable[str] = (), used: int = 0) -> int:
        """After ``failure``: restart the group (``used`` restarts already spent by the caller's
        call) and put the step API's unfinished requests back. Without ``stream`` (nothing of
        them has left the service) their missing samples are resubmitted (:meth:`_resubmit`, the
        one :meth:`generate` uses) and go out with the next :meth:`step`; those in ``aborting`` (or
        with an abort not sent yet) are aborted again there (their abort records come out of it).
        A streamed request not sent yet (its ``add_request`` came after the last :meth:`step`, e.g.
        a restart in a weight update) is resubmitted too, still streamed: none of its tokens left.
        Error records, out of the next :meth:`step`, naming the cause, for: streamed requests
        that were sent (their streamed tokens cannot be taken back); a request that lived through more than
        ``max_restarts`` group failures (as :meth:`generate` gives up); every one when the restart
        fails or the restarted workers do not hold the served weights
        (:meth:`_check_weights_served`). Returns the restarts used in all; raises RolloutFailure
        (recorded, the group left stopped) when the restart fails."""
        aborting = set(aborting).union(*self._to_abort)  # the restart drops the unsent aborts
        unsent = {req.request_id for reqs in self._to_add for req, _ in reqs}  # ... and the unsent requests
        lost = sorted(self._live)
        self._lose([rid for rid, p in self._live.items() if p.stream and rid not in unsent], str(failure))
        try:
            total = self._start_with_retries(failure, lost, used)
        except RolloutFailure as gave_up:
            cause = gave_up.__cause__  # the last failure (_start_with_retries raises from it)
            why = f"{cause}; gave up restarting after {self.max_restarts} restarts (cluster.max_restarts)"
            self._lose(list(self._live), why)
            raise
        for p in self._live.values():
            p.failures += total - used  # the failures while restarting count too
        self._lose(
            [rid for rid, p in self._live.items() if p.failures > self.max_restarts],
            f"{failure}; the group failed more than cluster.max_restarts={self.max_restarts} times while "
            "the request ran",
        )
        if self._weights_lost:
            self._lose(list(self._live), f"{failure}; {self._weights_lost}")
        self._requeue(list(self._live), aborting)
        return total

    def _put_back(self, request_ids: Iterable[str]) -> None:
        """Re-place the step API's requests among ``request_ids`` that an invalid rank gave up
        (its engine dropped them) once every rank is valid again: their missing samples go out
        with the next :meth:`step` (:meth:`_resubmit`: same tokens for the same seeds); streamed
        ones get error records (their streamed tokens cannot be taken back)."""
        ids = [rid for rid in dict.fromkeys(request_ids) if rid in self._live]
        self._lose(
            [rid for rid in ids if self._live[rid].stream],
            "a rollout rank gave up the streamed request when a rejected weight update left it invalid",
        )
        self._requeue(ids)

    def _requeue(self, request_ids: Iterable[str], aborting: Iterable[str] = ()) -> None:
        """Queue the missing samples of the step API's requests among ``request_ids`` that no rank
        holds any more (a restart; an invalid rank gave them up) for the next :meth:`step`, each
        with its stream flag: placed afresh (:meth:`_resubmit`: same ids, same tokens for the same
        seeds) beside the load of the live requests that stay where they are. Their aborts not sent
        yet, and those named in ``aborting``, follow them to their new ranks (an abort sent to the
        old rank would find nothing there, and the request would run on)."""
        moved = {rid: self._live[rid] for rid in dict.fromkeys(request_ids) if rid in self._live}
        aborting = set(aborting)
        for rank, rids in enumerate(self._to_abort):
            aborting.update(rid for rid in rids if rid in moved)
            self._to_abort[rank] = [rid for rid in rids if rid not in moved]
        load = [0] * self.world_size
        for rid, p in self._live.items():
            if rid not in moved:
                load[p.rank] += len(p.missing)
        for rank, reqs in enumerate(self._resubmit(moved, load)):
            self._to_add[rank] += [(req, moved[req.request_id].stream) for req in reqs]
        for rid in sorted(aborting):
            p = moved.get(rid)
            if p is not None:
                self._to_abort[p.rank].append(rid)

    def _lose(self, request_ids: Iterable[str], why: str) -> list[str]:
        """End the unfinished step-API requests among ``request_ids``: error records for their
        samples not yet out (``why``; :data:`LOST` added), queued for the next :meth:`step`;
        returns their ids, sorted."""
        message = f"{why}; {LOST}"
        lost = sorted(rid for rid in set(request_ids) if rid in self._live)
        for rid in lost:
            p = self._live.pop(rid)
            self._ready += [o for o in error_outputs(p.request, message, self._version) if o.sample_index in p.missing]
        return lost

    def engine_metrics(self) -> dict:
        """The ranks' engine counters after their last reply, summed (pages, running / waiting
        samples, preemptions; usage = pages in use / pages; hit rate = mean over ranks)."""
        ranks = self._rank_engine
        if not ranks:
            return {}
        out = {k: sum(m[k] for m in ranks) for k in ("kv_pages_in_use", "kv_pages_total", "num_running", "num_waiting")}
        out["num_preemptions"] = sum(m["num_preemptions"] for m in ranks)
        out["kv_usage"] = out["kv_pages_in_use"] / max(1, out["kv_pages_total"])
        out["prefix_cache_hit_rate"] = sum(m["prefix_cache_hit_rate"] for m in ranks) / len(ranks)
        return out

    # ---- weight sync hosted by another process (the rollout server's trainer) ------------------
    @_locked
    def join_weight_sync(
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
        """Every rank joins a weight-sync group hosted elsewhere (a trainer at rank 0) as rank
        ``rank_offset + rank`` and runs the handshake; updates then arrive with
        :meth:`receive_weight_update` (in-flight policy "continue": running requests go on, their
        later tokens stamped with the new version). Starts the group first when a failed restart
        left none.

        Weights received this way go from the trainer to the workers only: this process keeps no
        copy, so a group restart cannot re-apply them, and the restarted workers are no longer in
        the trainer's group. After such a restart no forward runs on the checkpoint's weights they
        load: requests get error records naming the cause and the remedy (:meth:`_start`,
        :meth:`_check_weights_served`) until the trainer joins again and an update is accepted
        (or :meth:`update_weights`).

        Raises:
            ValueError: the ranks do not fit in ``world_size`` or the handshake found differences.
            GroupFailure: a rank failed to join (e.g. the rendezvous timed out); the group is
                restarted and the unfinished requests of the step API resubmitted or given error
                records (streamed ones; :meth:`_restart_live`).
        """
        if rank_offset < 1 or rank_offset + self.world_size > world_size:
            raise ValueError(
                f"rank_offset={rank_offset}, world_size={world_size}: the {self.world_size} EP ranks need ranks "
                f"{rank_offset}..{rank_offset + self.world_size - 1} below world_size (rank 0 is the trainer)"
            )
        options = dict(bucket_size_mb=bucket_size_mb, atomic=atomic, in_flight="continue")
        args = (host, port, world_size, backend, timeout_s, options, rank_offset)
        if self.launcher is None:
            self._start_with_retries(None, [])
        self._joined = False  # the workers leave the last group first
        try:
            problems = self.launcher.call("init_weight_sync", args, timeout_s + self.start_timeout_s)
        except GroupFailure as failure:
            self._fail_live(failure)
            raise
        bad = [self._rank_named(r, p) for r, ps in enumerate(problems) for p in ps]
        if bad:
            raise ValueError("weight-sync handshake failed:\n  " + "\n  ".join(bad))
        self._joined = True

    def _rank_named(self, rank: int, msg: str) -> str:
        """``msg`` of EP rank ``rank``, prefixed "rank r: " unless the group is one worker."""
        return msg if self.world_size == 1 else f"rank {rank}: {msg}"

    @property
    def weight_sync_joined(self) -> bool:
        """Whether the running group's workers are in a trainer's weight-sync group
        (:meth:`join_weight_sync`; a restart leaves it)."""
        return self._joined

    @_locked
    def receive_weight_update(self, expect_version: int | None = None) -> dict:
        """Receive one update on every rank of the group joined with :meth:`join_weight_sync`
        (the trainer sends meanwhile). Returns {"ok", "version", "seconds", "paused_seconds",
        "errors"} over the ranks; the served version changes only when every rank applied it.
        ``expect_version``: every rank refuses an update of another version. When any rank wrote
        weight bytes the group's :attr:`weight_writes` goes up on every rank.

        A rejected non-atomic update that left a rank invalid (it wrote part of it) stops the
        group serving until an update is accepted: that rank's experts are read by every rank's
        forward, so the step API's unfinished requests end with error records (the ones the
        invalid rank gave up at once, the others at the next :meth:`step`) and new ones are
        refused (:meth:`add_request`), as after a rejected IPC update (one path,
        :meth:`_after_rejected_update`; nothing is re-sent from here). An accepted update cannot be
        re-applied after a group restart (see :meth:`join_weight_sync`).
        Raises RuntimeError when the running group has not joined a trainer's group (a restart
        since :meth:`join_weight_sync`: join again); GroupFailure when a rank failed (the group is
        restarted)."""
        if not self._joined:
            raise RuntimeError(
                "receive_weight_update: the rollout workers are not in a trainer's weight-sync group (none was "
                "joined, or the EP group was restarted since): call join_weight_sync first"
            )
        try:
            outs = self.launcher.call("receive_weights", (expect_version,), self.start_timeout_s)
        except GroupFailure as failure:
            self._fail_live(failure)
            raise
        self._ready += self._deliver(out for o in outs for out in o["outputs"])  # drained around the update
        if any(o["wrote"] for o in outs):
            try:
                self._count_writes()
            except GroupFailure as failure:
                self._fail_live(failure)
                raise
        ok = all(o["ok"] for o in outs)
        if ok:
            self._serve(max(o["version"] for o in outs), received=True)  # no copy here for a restart
        else:
            self._handed_back = [req.request_id for o in outs for req in o["handed_back"]]
            self._after_rejected_update(
                None,
                outs,
                None,
                f"this process cannot re-send the served version {self._version} to repair them (the update came "
                "over the trainer's weight-sync group)",
                "the trainer's next accepted update repairs them (receive_weight_update; the server's /update_weights)",
            )
        return {
            "ok": ok,
            "version": self._version,
            "seconds": max(o["seconds"] for o in outs),
            "paused_seconds": max(o["paused_seconds"] for o in outs),
            "errors": [self._rank_named(r, e) for r, o in enumerate(outs) for e in o["errors"]],
        }

    # ---- weights and control -----------------------------------------------------------------
    @property
    def weight_version(self) -> int:
        return self._version

    @property
    def weight_writes(self) -> int:
        """The group's weight-write count (``LLMEngine.weight_writes`` of every rank, set by the
        service): it changes with every write of any rank's weights (also one that keeps the
        version, ``replace``) and with every group (re)start, so it never repeats across
        restarts; tokens are stamped with it (``SampleOutput.token_weight_writes``)."""
        return self._weight_writes

    def _count_writes(self) -> None:
        """The workers' weights were written (on any rank: every rank's forward reads every rank's
        experts) or the group was (re)started: the count goes up and every rank's engine takes it
        (``RolloutWorker.count_weight_write``), so all ranks stamp their tokens alike. Between two
        ``run`` calls (the caller holds the lock). Raises GroupFailure."""
        self._weight_writes += 1
        self.launcher.call("count_weight_write", (self._weight_writes,), self.start_timeout_s)

    @_locked
    def update_weights(self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Send every rank the update over the weight-sync group (each rank keeps the tensors it
        holds: replicated ones + its experts; released names), in place.

        The tensors are copied to host once and kept, so a restarted group gets the same weights
        (``refit="ipc"``: no copy; the trainer's shared source, :meth:`_update_ipc`).
        Every check is the ranks' receiver's (receiver.py): a rejected update leaves atomic ranks
        on their weights and version; ranks a non-atomic failure left invalid are repaired by
        re-sending the last good weights (``replace``; the requests the invalid ranks gave up are
        re-placed, :meth:`_put_back`; :meth:`_after_rejected_update`). When no copy of the served
        weights is kept (the checkpoint's: no update accepted yet, or weights received from a
        trainer's group) or the re-send is rejected too, they cannot be: no forward runs (the step
        API's requests get error records, ``generate`` / ``score`` raise RolloutFailure naming the
        cause and the remedy, a full update) until an update is accepted. A rank dying mid-update
        (or during the re-send) restarts the group on the last good weights (the step API's
        requests: :meth:`_restart_live`). An accepted update makes the weights served again after
        a restart that could not re-apply them.
        Raises ValueError naming the rank and tensors / versions of a rejected update, and, when
        ranks it left invalid could not be repaired, why and the remedy (the message ``generate``
        refuses with from then on); GroupFailure when a rank failed during the update (after the
        restart).
        """
        if self.refit == "ipc":
            return self._update_ipc(int(version), named_tensors)
        incoming = {n: t.detach().to("cpu", copy=True) for n, t in named_tensors}
        if self.launcher is None:
            self._start_with_retries(None, [])
        try:
            self._push_weights(int(version), incoming)
        except GroupFailure as failure:
            self._restart_live(failure)  # back on the last good weights
            raise
        except ValueError as rejected:
            # a copy of the served weights to re-send, unless they are the checkpoint's or came from a trainer's group
            kept = self._last_weights is not None and not self._served_received
            unrepaired = self._after_rejected_update(
                int(version),
                self.last_weight_sync.get("ranks", []),
                (lambda: self._push_weights(*self._last_weights, replace=True)) if kept else None,
                f"no copy of the served version {self._version} is kept to re-send",
                "send a full update (update_weights with every tensor) first",
            )
            if unrepaired is None:
                raise
            raise ValueError(f"{rejected}; {unrepaired}") from rejected
        self._last_weights = (int(version), incoming)
        self._serve(int(version), received=False)

    def _serve(self, version: int, received: bool) -> None:
        """An update was accepted: the workers serve ``version`` (no weights lost any more);
        ``received``: it came from the trainer's weight-sync group, held by these workers only
        (a restart cannot re-apply it), else from ``update_weights`` (``_last_weights``)."""
        self._version, self._weights_lost, self._served_received = version, None, received

    def _after_rejected_update(
        self, version: int | None, verdicts: list[dict], resend, no_copy: str, remedy: str
    ) -> str | None:
        """After update ``version`` was rejected (None: its version is the trainer's, not known
        here), for every refit (``update_weights``' broadcast or IPC, ``receive_weight_update``):
        the ranks whose verdict (``verdicts[rank]["valid"]``) says they wrote part of it
        (atomic=false) are invalid, and every rank's forward reads their experts;
        ``_handed_back`` names the requests they gave up.
        ``resend()`` re-sends the served weights (``replace``) to repair them; the given-up
        requests are then re-placed (:meth:`_put_back`). A rank failing during the re-send
        restarts the group on the last good weights (:meth:`_restart_live`: the live requests
        resubmitted or given error records). With no ``resend`` (``no_copy`` says why) or a
        rejected re-send, no forward runs until an update is accepted: ``_weights_lost`` names the
        invalid ranks, the cause and ``remedy`` (``generate`` / ``score`` raise RolloutFailure with
        it), the given-up requests get error records now, the step API's others at the next
        :meth:`step`. Never raises; returns why the ranks do not hold the served weights after it
        (``_weights_lost``, or the restart after a failed re-send that could not be done), None
        when they do (nothing invalid, or repaired), for the caller's error to say."""
        invalid = [str(r) for r, v in enumerate(verdicts) if not v["valid"]]
        handed_back, self._handed_back = self._handed_back, []
        if not invalid:
            return None
        if resend is not None:
            try:
                resend()
            except GroupFailure as failure:  # the restart's workers get the last good weights
                try:
                    self._restart_live(failure)
                except RolloutFailure as gave_up:  # recorded; the live requests have error records
                    return (
                        f"the re-send of the served version {self._version} that repairs rollout rank(s) "
                        f"{', '.join(invalid)} failed, and the EP group could not be restarted: {gave_up}"
                    )
                return self._weights_lost  # set when the restarted workers refused the re-sent weights
            except ValueError as exc:
                no_copy = f"the re-send of the served version {self._version} that repairs them was rejected too "
                no_copy += f"({exc})"
            else:
                self._put_back(handed_back + self._handed_back)
                return None
        update = "a rejected weight update" if version is None else f"the rejected update {version}"
        self._weights_lost = (
            f"rollout rank(s) {', '.join(invalid)} invalid: wrote bytes of {update} (weight_sync.atomic=false), "
            f"and {no_copy}; {remedy}"
        )
        self._lose(handed_back + self._handed_back, self._weights_lost)
        return self._weights_lost

    def _call_beside(self, method: str, args: tuple, fn):
        """Run ``launcher.call(method, args)`` in a thread while ``fn()`` runs here (both ends of a
        weight-sync collective must be inside it at once). Returns (fn's result, the call's)."""
        box: dict = {}

        def call():
            try:
                box["out"] = self.launcher.call(method, args, self.start_timeout_s)
            except BaseException as exc:  # noqa: BLE001 - re-raised below in the caller's thread
                box["exc"] = exc

        t = threading.Thread(target=call, daemon=True)
        t.start()
        try:
            res = fn()
        except BaseException:
            t.join(self.start_timeout_s + 60.0)
            if "exc" in box:  # a rank failed: that is the cause, the trainer side only timed out
                raise box["exc"] from None
            raise
        t.join(self.start_timeout_s + 60.0)
        if "exc" in box:
            raise box["exc"]
        return res, box.get("out")

    def _push_weights(self, version: int, incoming: dict[str, torch.Tensor], replace: bool = False) -> None:
        """One update over the trainer -> workers weight-sync group (this process is rank 0).

        The group is created (and the handshake run) on first use and after a restart; its updates
        also send the frozen tensors until one is accepted. Raises ValueError naming the rank and
        tensor when a rank rejects the update, GroupFailure when a rank fails."""
        from m3_rollout.weight_sync import (
            BroadcastChannel,
            HandshakeError,
            WeightSender,
            WeightSyncGroup,
            WeightUpdateError,
        )

        ws = self.weight_sync
        self.last_weight_sync = {}
        first = self._ws_sender is None
        if first:
            addr = self.spec.group.addr
            port = ws.master_port or free_port(addr)
            backend = ws.backend if ws.backend != "auto" else ("nccl" if self.spec.device == "cuda" else "gloo")
            world = 1 + self.world_size
            options = dict(
                bucket_size_mb=ws.bucket_size_mb,
                atomic=ws.atomic,
                double_buffer=ws.double_buffer,
                in_flight=ws.in_flight,
                recompute_kv_after_update=ws.recompute_kv_after_update,
            )
            frozen, probe = refit_rules(ws, self._freeze)

            def trainer_side():
                device = trainer_group_device(backend, self.trainer_device)
                group = WeightSyncGroup(addr, port, 0, world, backend, ws.timeout_s, device)
                sender = WeightSender(
                    lambda: incoming.items(),
                    BroadcastChannel(group, ws.double_buffer),
                    ws.bucket_size_mb,
                    getattr(torch, self.spec.dtype),
                    frozen,
                    probe=probe,
                    reference=self.probe_reference,
                )
                try:
                    sender.handshake()
                except HandshakeError:
                    group.close()
                    raise
                return sender

            try:
                self._ws_sender, _ = self._call_beside(
                    "init_weight_sync", (addr, port, world, backend, ws.timeout_s, options), trainer_side
                )
            except HandshakeError as exc:
                raise ValueError(f"weight update rejected, weights unchanged (version {self._version}): {exc}") from exc
        sender = self._ws_sender
        sender.named_tensors = lambda: incoming.items()
        # the frozen tensors go until an update with them is accepted: a rejected first update may
        # have left none of them (atomic) or part of them (a non-atomic rank) on the ranks
        frozen_too = not self._frozen_sent
        self._refit_beside(
            lambda: sender.update(version, include_frozen=frozen_too, replace=replace), (WeightUpdateError,), sender
        )
        self._frozen_sent = True

    def _refit_beside(self, send, errors: tuple, sender, extra=None) -> None:
        """Run ``send()`` (the trainer side of one update) while every worker runs
        ``receive_weights``; record ``last_weight_sync`` (the sender's stats, wall and pause
        seconds, each rank's verdict, plus ``extra()``). Raises ValueError when ``send`` raised one
        of ``errors`` (a rank rejected the update), GroupFailure when a worker failed."""
        t0 = time.perf_counter()
        box: dict = {}

        def trainer_side():
            try:
                box["stats"] = send()
            except errors as exc:
                box["error"] = exc

        _, outs = self._call_beside("receive_weights", (), trainer_side)
        # requests an invalid rank gave up (its engine dropped them): the caller ends or re-places them
        self._handed_back = [req.request_id for o in outs for req in o["handed_back"]]
        # samples the ranks finished (in_flight=drain) or stopped (abort) around the update: the
        # step API's requests get them from the next step (generate() holds the lock: none of its own)
        self._ready += self._deliver(out for o in outs for out in o["outputs"])
        if any(o["wrote"] for o in outs):
            self._count_writes()
        self.last_weight_sync = {
            **box.get("stats", sender.stats),
            "wall_seconds": time.perf_counter() - t0,
            "paused_seconds": max((o["paused_seconds"] for o in outs), default=0.0),
            "ranks": [{k: o[k] for k in ("ok", "version", "valid", "probe_drift")} for o in outs],
            **(extra() if extra is not None else {}),
        }
        if "error" in box:
            raise ValueError(str(box["error"])) from box["error"]

    def set_probe_reference(self, reference) -> None:
        """The trainer's probe scorer (``weight_sync.probe``; ``weight_sync.probe.model_scorer``)."""
        self.probe_reference = reference
        if self._ws_sender is not None:
            self._ws_sender.reference = reference
        if self._ipc is not None:
            self._ipc.sender.reference = reference

    def _close_weight_sync(self, final: bool = False) -> None:
        """Drop the broadcast group (a restarted group builds a new one). The IPC refit keeps its
        channel and stage across restarts (the new workers connect to it), unless ``final``."""
        if self._ws_sender is not None:
            self._ws_sender.channel.group.close()
            self._ws_sender = None
        self._frozen_sent = False  # a new group's workers get them with their first accepted update
        if self._ipc is not None:
            if final:
                self._ipc.close()
                self._ipc = None
            else:
                self._ipc.lost_workers()

    # ---- refit through the shared stage (refit="ipc": workers on this process's device) --------
    def _ipc_refit(self) -> IpcRefit:
        """The IPC refit of every rank, built on the first start (the channel must listen before the
        workers connect); its source lives on the trainer's device (EP ranks on other GPUs of the
        node peer-copy from it)."""
        if self._ipc is None:
            frozen, probe = refit_rules(self.weight_sync, self._freeze)
            dtype = getattr(torch, self.spec.dtype)
            device = self.trainer_device or self.spec.device
            self._ipc = IpcRefit(self.weight_sync, self.world_size, device, dtype, frozen, probe, self.probe_reference)
        return self._ipc

    def _update_ipc(self, version: int, named_tensors) -> None:
        """``update_weights`` with ``refit="ipc"``: the stage is filled from the trainer's tensors
        where they are (no host copy). A worker lost during the update restarts the group
        (``max_restarts`` within this call) and the update is repeated; a rejected update raises
        ValueError (atomic workers keep their weights; the stage then holds no accepted version,
        unless the trainer withdrew the update before filling it (``IpcRefit.send``), so workers
        restarted before the next accepted update cannot be given the served weights;
        non-atomic ranks that wrote part of it cannot be repaired: ``generate`` refuses, naming
        this, until an update is accepted, the requests they gave up get error records,
        :meth:`_after_rejected_update`, and the ValueError says so too). The step API's
        unfinished requests come through a restart as through any (:meth:`_restart_live`).
        RuntimeError at sleep level 2 (wake up first)."""
        if self._sleep_level >= 2:
            raise RuntimeError(
                "update_weights: the rollout workers sleep at level 2 (weights offloaded to host memory); "
                "call wake_up() first, then update the weights"
            )
        from m3_rollout.weight_sync import ReleasedTensors

        named = named_tensors if isinstance(named_tensors, ReleasedTensors) else list(named_tensors)
        used = 0
        if self.launcher is None:
            used = self._start_with_retries(None, [])
        while True:
            try:
                self._push_ipc(version, named)
                break
            except GroupFailure as failure:
                used = self._restart_live(failure, used=used)
            except ValueError as rejected:
                # the source holds the refused update, not the served weights: no re-send repairs
                # ranks that wrote part of it (weight_sync.atomic=false), as the broadcast refit does
                unrepaired = self._after_rejected_update(
                    version,
                    self.last_weight_sync.get("ranks", []),
                    None,
                    f"the trainer's IPC source no longer holds the served version {self._version} to repair them",
                    "call update_weights first",
                )
                if unrepaired is None:
                    raise
                raise ValueError(f"{rejected}; {unrepaired}") from rejected
        self._last_weights = (version, None)
        self._serve(version, received=False)

    def _check_weights_served(self, request_ids: list[str]) -> None:
        """Raises RolloutFailure (with ``request_ids``) when the workers do not hold the served
        weights: restarted ones could not be given them (they would generate with the checkpoint's:
        ``_reapply_ipc``, or weights received from a trainer's group, :meth:`_start`), or a
        rejected non-atomic update left ranks invalid (``_update_ipc``,
        :meth:`receive_weight_update`). The message names the cause and the remedy."""
        if self._weights_lost:
            raise RolloutFailure(f"{self._weights_lost}, then resubmit", sorted(request_ids))

    def _check_ready(self, what: str, request_ids: list[str]) -> None:
        """Before a forward on the workers (``what``: "generate", "score", ...): RuntimeError while
        they sleep; else start the group if a failure left it stopped, then
        :meth:`_check_weights_served` (the start re-applies the served weights and can find that the
        IPC source no longer holds them, so the check comes after it)."""
        self._check_awake(what)
        if self.launcher is None:
            self._start_with_retries(None, [])
        self._check_weights_served(request_ids)

    def _check_awake(self, what: str) -> None:
        """RuntimeError while the workers sleep (``what``: "generate", "score", ...)."""
        if self._sleep_level:
            raise RuntimeError(
                f"the rollout workers sleep (level {self._sleep_level}): call wake_up() before you {what}"
            )

    def _reapply_ipc(self) -> None:
        """At a restart: give the new workers the served weights, which the IPC source holds. When
        it does not (a rejected or interrupted update overwrote the stage; the trainer cast its
        compute copy again since) the workers hold the checkpoint's weights and ``generate``
        refuses until the next accepted update."""
        if not self._ipc.holds(self._version):
            self._weights_lost = (
                f"the restarted rollout workers hold the checkpoint's weights, not the served version {self._version}: "
                "the trainer's IPC source no longer holds it (a rejected update overwrote the stage, or the trainer "
                "cast its compute copy again since); call update_weights first"
            )
            return
        self._weights_lost = None
        self._push_ipc(self._version, None)

    def _push_ipc(self, version: int, named) -> None:
        """One update through the IPC source while every worker receives it (``named`` None: resend
        the source as it stands). Raises ValueError when a worker rejects it, GroupFailure when a
        worker fails."""
        from m3_rollout.weight_sync import HandshakeError, WeightUpdateError

        ipc = self._ipc
        self.last_weight_sync = {}
        self._refit_beside(
            lambda: ipc.resend() if named is None else ipc.send(version, named),
            (WeightUpdateError, HandshakeError),
            ipc.sender,
            lambda: {
                "stage_device": str(ipc.channel.source_device) if ipc.channel.source_device is not None else None,
                "ipc_source": ipc.channel.stats.get("source"),
            },
        )

    # ---- memory handoff (policy.generation.sleep_level: workers on the trainer's device) -------
    def _call_restarting(self, method: str, args: tuple) -> list:
        """``launcher.call(method, args)`` on every rank; a failed group is restarted (on the last
        weights, ``max_restarts`` within this call) and the call repeated. The step API's
        unfinished requests (sent or not yet) are resubmitted or given error records, as after a
        failed :meth:`step` (:meth:`_restart_live`)."""
        used = 0
        if self.launcher is None:
            used = self._start_with_retries(None, [])
        while True:
            try:
                return self.launcher.call(method, args, self.start_timeout_s)
            except GroupFailure as failure:
                used = self._restart_live(failure, used=used)

    @_locked
    def sleep(self, level: int = 1) -> dict:
        """Every worker's ``LLMEngine.sleep(level)`` (the trainer trains on their device meanwhile).
        Returns {"level", "gb_freed" (GiB, summed over ranks), "seconds" (the slowest rank)}.
        A lost worker restarts the group, which then sleeps (:meth:`_call_restarting`).

        NOTE: refused, as ``LLMEngine.sleep`` refuses, while requests of the step API (and so of
        ``generate_async`` callers) are unfinished, sent to a rank or not: the ranks' engines would
        refuse, and a rank's refusal reaches this process as a failure of the group, whose restart
        would drop the requests' KV pages. Unlike ``LLMEngine.abort``, :meth:`abort` only queues
        the abort, which the next :meth:`step` sends to the rank: an aborted request is unfinished
        until its abort records come out of a step. Records already out (error, abort records)
        wait for the next :meth:`step`.
        Raises:
            RuntimeError: samples are unfinished (finish them, or abort them; either way step()
                until has_unfinished() is false, then sleep).
            ValueError: ``level`` not 1 or 2.
            RolloutFailure: the group failed more than ``max_restarts`` times in this call.
        """
        if self._live:
            samples = sum(len(p.missing) for p in self._live.values())
            queued = {rid for rids in self._to_abort for rid in rids}.intersection(self._live)
            aborting = f" ({len(queued)} of them with an abort queued, not sent yet)" if queued else ""
            raise RuntimeError(
                f"sleep: {samples} samples of {len(self._live)} requests are unfinished{aborting}; finish them, or "
                "abort them (abort(request_id): the next step() sends the abort and returns the abort records), "
                "then step() until has_unfinished() is false before sleeping"
            )
        check_sleep_level(level)
        records = self._call_restarting("sleep", (int(level),))
        self._sleep_level = max(r["level"] for r in records)
        return _merge_records(records)

    @_locked
    def wake_up(self) -> dict:
        """Every worker's ``LLMEngine.wake_up()``; returns {"level", "gb_restored" (summed),
        "seconds", "graph_capture_seconds" (the slowest rank)}. A worker lost meanwhile restarts
        the group (awake, on the stage's / last weights). Raises RolloutFailure past
        ``max_restarts``."""
        records = self._call_restarting("wake_up", ())
        self._sleep_level = 0
        return _merge_records(records)

    @_locked
    def weight_digests(self) -> list[dict[str, tuple[str, str]]]:
        """Each rank's {released name: (dtype, sha256 of the bytes)} (``RolloutWorker.weight_digests``):
        a bitwise check of a refit without moving the weights."""
        return self.launcher.call("weight_digests", (), self.start_timeout_s)

    @_locked
    def reset_prefix_cache(self) -> None:
        """Drop every rank's reusable KV pages (no group running: a fresh one starts empty)."""
        if self.launcher is not None:
            self.launcher.call("reset_prefix_cache", (), self.start_timeout_s)
        self._prefix_owner.clear()
        self._prefix_lengths.clear()

    @_locked
    def pause(self) -> None:
        """Pause every worker's engine (no forward; requests keep their pages). With no group
        running (a failed restart left none) the state is recorded: the next group starts
        paused (:meth:`_start`)."""
        if self.launcher is not None:
            self.launcher.call("pause", (), self.start_timeout_s)
        self._paused = True

    @_locked
    def resume(self) -> None:
        """Resume every worker's engine; with no group running the next one starts unpaused."""
        if self.launcher is not None:
            self.launcher.call("resume", (), self.start_timeout_s)
        self._paused = False

    # ---- scoring over the EP group ------------------------------------------------------------
    @_locked
    def score(
        self, token_ids: Sequence[int], positions: Sequence[int] | None = None, temperature: float = 1.0
    ) -> torch.Tensor:
        """``LLMEngine.score`` over the EP group: logprobs of a stored token sequence under the
        served weights. Every rank scores the same ids (its MoE layers take part in the
        all-to-alls) on KV pages it borrows for the call; rank 0's result comes back by value.
        Runs between two ``run`` calls (the service's lock), so requests of the step API keep
        their pages and continue afterwards.

        Args:
            token_ids: [L] ints. positions: optional indices i (0 <= i < L) to return; default all.
            temperature: logits are divided by it.
        Returns:
            fp32 (fp64 for fp64 workers) [L] on the CPU: entry 0 = 0, entry i = log p(token_i |
            tokens_<i); with ``positions``, [len(positions)] of those entries.
        Raises:
            ValueError: bad arguments (as ``LLMEngine.score``: the message names them), or a rank's
                weights are refused (a failed non-atomic update that could not be repaired);
            RuntimeError: the workers sleep, a rank has too few free KV pages now;
            RolloutFailure: the workers do not hold the served weights (as :meth:`generate`), or
                the group failed more than ``max_restarts`` times in this call. A rank that fails
                during the call restarts the group and the call is repeated (as :meth:`generate`);
                the step API's unfinished requests get error records (as after a failed :meth:`step`).
        """
        pos = None if positions is None else _by_value(positions)
        return self._forward_on_every_rank("score", (_by_value(token_ids), pos, temperature), "score")

    @_locked
    def top_logprobs(
        self,
        token_ids: Sequence[int],
        start: int,
        k: int,
        temperature: float = 1.0,
        top_k: int = -1,
        top_p: float = 1.0,
        with_tokens: bool = False,
    ) -> list:
        """``LLMEngine.top_logprobs`` over the EP group (the server's ``top_logprobs`` and prompt
        logprobs): the ``k`` most likely tokens and their logprobs at positions ``start .. L - 1``
        of ``token_ids`` under the served weights, one plain forward on every rank with the same
        ids (the all-to-alls pair up), rank 0's result by value. Runs between two ``run`` calls,
        as :meth:`score`.

        Returns:
            [L - start] lists of (token id, logprob), most likely first (fp32 log-softmax of
            the logits processed by ``temperature``, ``top_k``, ``top_p``; removed tokens left out);
            ``with_tokens``: [L - start] ``PositionLogprobs`` (the position's own token's logprob
            and rank too).
        Raises:
            ValueError naming ``top_logprobs token_ids`` / ``start`` / ``k`` / ``temperature``, or
            refused weights; RuntimeError, RolloutFailure as :meth:`score`.
        """
        args = (_by_value(token_ids), start, k, temperature, top_k, top_p, bool(with_tokens))
        return self._forward_on_every_rank("top_logprobs", args, "compute top logprobs")

    def _forward_on_every_rank(self, method: str, args: tuple, what: str):
        """Call the worker's ``method`` (``RolloutWorker.score`` / ``top_logprobs``) on every rank
        with the same ``args`` and return rank 0's value. The ranks agree among themselves that
        all can run before any forward (``RolloutWorker._forward_together``); a rank that refused
        comes back as its exception here. Refuses, as :meth:`generate` does, while the workers
        sleep or do not hold the served weights; a failed group is restarted and the call repeated
        (``max_restarts`` within the call; the forwards have no side effects). Caller holds the lock."""
        used = 0
        while True:
            self._check_ready(what, [])
            try:
                replies = self.launcher.call(method, args, self.call_timeout_s)
                break
            except GroupFailure as failure:
                used = self._restart_live(failure, used=used)
        errors = {r: reply["error"] for r, reply in enumerate(replies) if "error" in reply}
        if errors:
            raise _rank_error(errors, len(replies))
        return replies[0]["value"]

    def metrics(self) -> dict:
        """Driver-side counters, restarts / failures (recovered ones too) / lost requests, and the
        last ``run`` call's EP stats: tokens per expert [n_moe_layers][E] (ranks' local rows concatenated), dispatch /
        expert / combine seconds summed over ranks."""
        out = dict(
            self._metrics,
            restarts=self.restarts,
            failures=len(self.failures),
            recovered_failures=sum(f["recovered"] for f in self.failures),
            lost_requests=sum(len(f["lost_request_ids"]) for f in self.failures),
        )
        if self.last_ep_stats:
            per_layer = [
                sum((s["tokens_per_expert"][layer] for s in self.last_ep_stats), [])
                for layer in range(len(self.last_ep_stats[0]["tokens_per_expert"]))
            ]
            out["tokens_per_expert"] = per_layer
            for key in ("dispatch_s", "expert_s", "combine_s"):
                out[f"ep_{key}"] = sum(s[key] for s in self.last_ep_stats)
        return out

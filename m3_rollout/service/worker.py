"""RolloutWorker: one EP rank = one process with its own engine, KV cache and expert shard.

Governing idea (design.md §4-5): attention is data-parallel (each rank serves its own requests
with its own paged KV cache); the MoE layers are expert-parallel, so every forward of every rank
runs the same all-to-all collectives. The ranks therefore step in lockstep: before each step
they agree (one ``all_reduce(MAX)`` of a has-work flag) whether anyone has work; if so EVERY rank
runs exactly one forward, ranks without work an empty one (``step(force_forward=True)``), so no
collective waits for a rank that skipped it. When nobody has work, all ranks leave the loop at
the same step.

The worker is a plain class; a launcher (``launchers.py``) hosts it in a Ray actor or a
``torch.multiprocessing`` process and forwards method calls to it.
"""

from __future__ import annotations

import hashlib
import os
import signal
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from m3_rollout.engine.config import EngineConfig
from m3_rollout.engine.engine import LLMEngine
from m3_rollout.engine.interface import GenerationRequest, SampleOutput, StreamDelta
from m3_rollout.model.loading import iter_released_tensors
from m3_rollout.parallel.expert_sharding import expert_range, load_checkpoint_ep
from m3_rollout.parallel.process_group import EPGroupSpec, destroy_ep_group, init_ep_group

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


@dataclass
class WorkerSpec:
    """Everything a rank needs to start (picklable; the same for every rank but ``rank``).

    Attributes:
        model_dir: checkpoint directory (config.json + safetensors); each rank reads its shard.
        group: where the EP group meets (world_size = EP size).
        dtype: generation dtype name ("bfloat16", "float32", ...); the router stays >= fp32.
        engine: ``EngineConfig`` fields (max_model_len, max_num_seqs, eos_token_ids, ...).
        device: "cpu", "cuda" (rank r uses cuda:r % device_count) or "cuda:N" (every rank on
            cuda:N: the one worker beside the trainer, ``colocated_placement=worker_process``).
        device_uuid: the UUID the worker's CUDA device must have, as the trainer's process sees
            it (a refit through the trainer's CUDA IPC stage opens it by the trainer's device
            index): one UUID for every rank, or a tuple, rank r's at [r] (EP workers on cuda:r
            beside the trainer); checked at start, since a launcher that remaps
            ``CUDA_VISIBLE_DEVICES`` (Ray) could give "cuda:N" another meaning. None: unchecked.
        num_threads: torch intra-op threads per worker (1: two workers on two cores must not
            oversubscribe them).
        fault_after_steps: TESTS ONLY: the first incarnation (``incarnation == 0``) of this rank
            SIGKILLs itself after that many lockstep steps; ``fault_rank`` picks the rank.
        tokenizer_dir: optional directory with the tokenizer; gives the engine a detokenize
            callback (``SamplingParams.stop_strings``), markers kept, as ``ChatFormat.decode``.
        incarnation: how many times the group was started before this start.
    """

    model_dir: str
    group: EPGroupSpec
    dtype: str = "bfloat16"
    engine: dict = field(default_factory=dict)
    device: str = "cpu"
    device_uuid: str | tuple[str, ...] | None = None
    num_threads: int = 1
    tokenizer_dir: str | None = None
    fault_after_steps: int | None = None
    fault_rank: int = 0
    incarnation: int = 0


def _detokenizer(tokenizer_dir: str | None):
    if tokenizer_dir is None:
        return None
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    return lambda ids: tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


class RolloutWorker:
    """One EP rank: joins the group, loads its expert shard, owns an ``LLMEngine``.

    Raises (at construction) ValueError for a bad spec (e.g. E % P != 0) and RuntimeError when
    the group does not form within ``group.timeout_s``.
    """

    def __init__(self, spec: WorkerSpec, rank: int):
        torch.set_num_threads(max(1, int(spec.num_threads)))
        self.spec, self.rank = spec, rank
        self.world_size = spec.group.world_size
        device = torch.device(spec.device)
        if device.type == "cuda":
            if device.index is None:
                device = torch.device("cuda", rank % torch.cuda.device_count())
            torch.cuda.set_device(device)
            uuid = str(torch.cuda.get_device_properties(device).uuid)
            want = spec.device_uuid[rank] if isinstance(spec.device_uuid, tuple) else spec.device_uuid
            if want is not None and uuid != want:
                raise RuntimeError(
                    f"rollout worker rank {rank}: {device} is GPU {uuid} here, not GPU {want} as the trainer "
                    "sees it (the launcher changed CUDA_VISIBLE_DEVICES); a worker refit through the trainer's "
                    "CUDA IPC stage must run on the GPU the trainer names (cluster.device for one worker, "
                    "cuda:<rank> under EP)"
                )
        self.device = device
        self.group = init_ep_group(spec.group, rank, device)
        dtype = _DTYPES[spec.dtype]
        model, self.ep_stats, self.load_report = load_checkpoint_ep(
            spec.model_dir, rank, self.world_size, self.group, dtype=torch.float32, device=device
        )
        model.cast_for_inference(dtype)
        self.model = model
        self.engine = LLMEngine(model, EngineConfig(**spec.engine), _detokenizer(spec.tokenizer_dir))
        self.expert_range = expert_range(model.config.num_local_experts, self.world_size, rank)
        self._steps = 0
        self._flag = torch.zeros(1, dtype=torch.int64, device=device)
        self.weight_sync = None  # set by init_weight_sync

    # ---- lockstep generation ---------------------------------------------------------------
    def run(
        self,
        requests: list[GenerationRequest],
        max_steps: int,
        aborts: Sequence[str] = (),
        stream: Collection[str] = (),
    ) -> dict:
        """Add `requests` (those whose id is in `stream` streamed: their :class:`StreamDelta`
        records come back too), abort the requests named in `aborts` (their samples come back
        with finish_reason "abort"), then step in lockstep with the peers for at most `max_steps`
        steps or until no rank has work. Every rank must call this with the same `max_steps`.
        While the engine is paused (every rank is: the service pauses them together) no forward
        runs: only records that are ready (abort records) come back.

        Returns {"outputs": [SampleOutput | StreamDelta], "unfinished": samples still running here,
        "steps": lockstep steps run, "ep": EPStats snapshot, "engine": engine metrics,
        "seconds": wall time}.
        Raises RuntimeError when a peer died or the group timeout passed (the group is then
        broken; the service restarts it).
        """
        t0 = time.perf_counter()
        for req in requests:
            self.engine.add_request(req, stream=req.request_id in stream)
        for rid in aborts:
            self.engine.abort(rid)
        outputs: list[SampleOutput | StreamDelta] = []
        if self.engine.paused:
            outputs.extend(self.engine.step())  # paused: no forward, only the ready records
            max_steps = 0
        steps = 0
        while steps < max_steps:
            mine = self.engine.has_unfinished()
            if self.group is not None:
                self._flag.fill_(int(mine))
                dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, group=self.group)
                anyone = bool(self._flag.item())
            else:
                anyone = mine
            if not anyone:
                break
            # Exactly one forward per rank per lockstep step (an empty one when this rank is idle).
            outputs.extend(self.engine.step(force_forward=self.group is not None))
            steps += 1
            self._steps += 1
            self._maybe_fault()
        return {
            "outputs": outputs,
            "unfinished": self.engine.num_unfinished(),
            "steps": steps,
            "ep": self.ep_stats.snapshot(reset=True),
            "engine": self.engine.metrics(),
            "seconds": time.perf_counter() - t0,
        }

    def _maybe_fault(self) -> None:
        s = self.spec
        if (
            s.fault_after_steps is not None
            and s.incarnation == 0
            and self.rank == s.fault_rank
            and self._steps >= s.fault_after_steps
        ):
            os.kill(os.getpid(), signal.SIGKILL)  # test hook: die like a crashed / OOM-killed rank

    # ---- scoring: one forward on every rank (RolloutService.score / top_logprobs) ---------------
    def score(self, token_ids: list[int], positions: list[int] | None, temperature: float) -> dict:
        """``LLMEngine.score`` of ``token_ids`` on this rank, in step with the peers (every rank
        gets the same ids: the MoE layers' all-to-alls pair up). See :meth:`_forward_together`."""
        return self._forward_together(lambda: self.engine.prepare_score(token_ids, positions, temperature))

    def top_logprobs(
        self,
        token_ids: list[int],
        start: int,
        k: int,
        temperature: float,
        top_k: int = -1,
        top_p: float = 1.0,
        with_tokens: bool = False,
    ) -> dict:
        """``LLMEngine.top_logprobs`` on this rank, in step with the peers (as :meth:`score`)."""
        return self._forward_together(
            lambda: self.engine.prepare_top_logprobs(token_ids, start, k, temperature, top_k, top_p, with_tokens)
        )

    def _forward_together(self, prepare) -> dict:
        """Run ``prepare()`` (the engine's checks, no forward; returns the call that runs the
        forwards) and agree with the peers, in one ``all_reduce(MAX)`` of a refused flag, that
        every rank can run: then every rank runs the same forwards, else none does (a rank that
        ran alone would wait in its first all-to-all until the group timeout). Called between two
        ``run`` calls (the service's lock), so no generation step interleaves.

        Returns {"value": the result (rank 0 only; None elsewhere)}, {"error": (exception type
        name, message)} when this rank's checks refused (bad arguments, asleep, refused weights,
        too few free KV pages), or {"peer_refused": True} when only a peer's did. Never raises for
        a refusal (a raise breaks the group); raises what the forwards raise (a peer gone)."""
        try:
            run, error = prepare(), None
        except Exception as exc:  # noqa: BLE001 - returned by value; every rank must reach the all_reduce
            run, error = None, exc
        refused = error is not None
        if self.group is not None:
            self._flag.fill_(int(refused))
            dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, group=self.group)
            refused = bool(self._flag.item())
        if error is not None:
            return {"error": (type(error).__name__, str(error))}
        if refused:
            return {"peer_refused": True}
        value = run()
        self.ep_stats.reset()  # not generation: ``run``'s EP stats (expert load) leave these forwards out
        return {"value": value if self.rank == 0 else None}

    # ---- weights and control -----------------------------------------------------------------
    def reset_prefix_cache(self) -> None:
        self.engine.reset_prefix_cache()

    def pause(self) -> None:
        self.engine.pause()

    def resume(self) -> None:
        self.engine.resume()

    def abort_all(self) -> list[GenerationRequest]:
        return self.engine.abort_all()

    # ---- weight sync over the trainer's broadcast group (m3_rollout/weight_sync) -------------
    def init_weight_sync(
        self,
        host: str,
        port: int,
        world_size: int,
        backend: str,
        timeout_s: float,
        options: dict,
        rank_offset: int = 1,
    ) -> list[str]:
        """Join the trainer's weight-sync group as rank ``rank_offset + self.rank`` (its own
        TCPStore, not the EP group) and run the handshake. Returns the handshake's problems ([] = joined; the
        trainer side raises with the same list). ``options``: RolloutWeightSync keyword arguments.
        Drains under ``in_flight=drain`` step in lockstep with the peers (``run`` until no rank
        has work)."""
        from m3_rollout.weight_sync import HandshakeError, RolloutWeightSync, WeightSyncGroup

        if self.weight_sync is not None:  # a new group replaces the last one
            self.weight_sync.group.close()
            self.weight_sync = None
        group = WeightSyncGroup(host, port, rank_offset + self.rank, world_size, backend, timeout_s, self.device)
        self.weight_sync = RolloutWeightSync(
            self.engine, group, drain=lambda: self.run([], 2**62)["outputs"], **options
        )
        try:
            self.weight_sync.handshake()
        except HandshakeError as exc:
            group.close()
            return str(exc).splitlines()[1:]
        return []

    # ---- weight sync through the trainer's shared stage (workers on the trainer's node) ---------
    def init_ipc_sync(self, endpoint: tuple[str, bytes], options: dict) -> list[str]:
        """Connect to the trainer's ``IpcChannel`` at ``endpoint`` (``weight_sync/ipc.py``): updates
        then arrive with :meth:`receive_weights`, copied from the source the trainer shares (its
        handle comes with the first update of each connection) into this rank's weights, its own
        experts only: on the device when the source lies on this rank's device, by peer copies
        from the trainer's GPU otherwise (EP rank r on cuda:r). ``options``: atomic,
        in_flight, recompute_kv_after_update, timeout_s (the ``weight_sync`` section) and
        process_authkey (the trainer's: this process takes it, as a child of the trainer would,
        so the file descriptor of a CPU stage can be fetched from the trainer under any launcher).
        Returns [] (the handshake runs with the first update). Raises WeightSyncTimeout when the
        trainer does not answer within ``timeout_s``."""
        import multiprocessing

        from m3_rollout.weight_sync import IpcRolloutSync, engine_receiver

        multiprocessing.current_process().authkey = options["process_authkey"]
        receiver = engine_receiver(
            self.engine,
            options["atomic"],
            True,
            options["in_flight"],
            options["recompute_kv_after_update"],
            drain=lambda: self.run([], 2**62)["outputs"],
        )
        receiver.rank_label = f"rank {self.rank}" if self.world_size > 1 else None  # one worker names no rank
        self.weight_sync = IpcRolloutSync(receiver, endpoint, options["timeout_s"])
        self.weight_sync.connect()
        return []

    def receive_weights(self, expect_version: int | None = None) -> dict:
        """Receive one update (broadcast group or IPC stage) under the in-flight policy; returns
        this rank's result. ``expect_version`` (broadcast group only): refuse an update of another
        version. Raises RuntimeError while the weights are offloaded (sleep level 2) or when the
        trainer closed the IPC channel."""
        if self.engine.weights_offloaded:
            raise RuntimeError("receive_weights: the engine sleeps at level 2 (weights offloaded); wake_up() first")
        if expect_version is None:
            out = self.weight_sync.update()
        elif hasattr(self.weight_sync, "group"):  # a RolloutWeightSync (broadcast group), not the IPC stage's
            out = self.weight_sync.update(expect_version=expect_version)
        else:
            raise ValueError("receive_weights: expect_version needs a broadcast weight-sync group, not the IPC stage")
        if out is None:
            raise RuntimeError("receive_weights: the trainer closed the weight-sync channel")
        r = out.result
        return {
            "ok": r.ok,
            "version": r.version,
            "wrote": r.wrote,
            "valid": r.valid,
            "errors": r.errors,
            "seconds": r.seconds,
            "probe_drift": r.probe_drift,
            "paused_seconds": out.paused_seconds,
            "handed_back": out.handed_back,
            "outputs": [o for o in out.outputs if isinstance(o, SampleOutput)],
        }

    def count_weight_write(self, writes: int) -> None:
        """``LLMEngine.count_weight_write(writes)``: the service's group-wide weight-write count,
        set on every rank after a write on any (the EP forward reads every rank's experts)."""
        self.engine.count_weight_write(writes)

    # ---- memory handoff (policy.generation.sleep_level) ------------------------------------
    def sleep(self, level: int) -> dict:
        """``LLMEngine.sleep``: free the KV cache (and at level 2 move the weights to host memory)
        while the trainer trains on this device; returns its record."""
        return self.engine.sleep(level)

    def wake_up(self) -> dict:
        """``LLMEngine.wake_up``; returns its record."""
        return self.engine.wake_up()

    def weight_digests(self) -> dict[str, tuple[str, str]]:
        """{released name: (dtype, sha256 of the bytes)} of this rank's weights: a bitwise check
        of a refit against the trainer's cast without moving the weights (diagnostics, tests)."""
        self.engine.check_awake("read the weights")
        out = {}
        for name, t in iter_released_tensors(self.model):
            # a copy: .numpy() of the parameter's own storage would mark it not resizable (sleep frees it in place)
            data = t.detach().reshape(-1).view(torch.uint8).to("cpu", copy=True).numpy().tobytes()
            out[name] = (str(t.dtype), hashlib.sha256(data).hexdigest())
        return out

    def info(self) -> dict:
        """pid, rank, expert range, bytes the sharded loader read, engine metrics."""
        r = self.load_report
        return {
            "pid": os.getpid(),
            "rank": self.rank,
            "expert_range": self.expert_range,
            "bytes_read": r.bytes_read,
            "bytes_in_files": r.bytes_in_files,
            "weight_version": self.engine.weight_version,
            "engine": self.engine.metrics(),
        }

    def shutdown(self) -> None:
        conn = getattr(self.weight_sync, "conn", None)  # the IPC connection (IpcRolloutSync)
        if conn is not None:
            conn.close()
        destroy_ep_group()

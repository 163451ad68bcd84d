"""Build the rollout service from the job config (the GRPO loop's one call into this package).

Governing idea: the loop asks for a backend; with ``policy.generation.expert_parallel_size``
P > 1 or an explicit ``cluster.launcher`` ("ray" / "mp") it gets a :class:`RolloutService` of P
worker processes refit over a broadcast group; with ``policy.generation.colocated_placement=
worker_process`` the P workers sit beside the trainer (P = 1: on ``cluster.device``; P > 1: rank r
on cuda:r, the trainer on one of those GPUs, or all on the CPU) and are refit through the
trainer's shared source (CUDA IPC / shared memory); otherwise None and it builds the in-process
engine itself, then gives it its weight receiver with ``attach_local_weight_sync`` (the same
receiver the workers use).
"""

from __future__ import annotations

import torch

from m3_rollout.parallel.process_group import EPGroupSpec
from m3_rollout.weight_sync import LocalWeightSync, ProbeSettings, default_frozen

from .service import RolloutService
from .worker import WorkerSpec


def attach_local_weight_sync(backend, ws, freeze=None) -> LocalWeightSync:
    """Give an in-process ``NativeBackend`` its weight receiver from the ``weight_sync`` config
    section ``ws`` (atomic, in_flight, recompute_kv_after_update, probe) and ``policy.freeze``
    (frozen tensors go with the first update only, unless ``weight_sync.send_frozen``). The probe's
    reference scorer is the trainer's: ``backend.set_probe_reference(...)``. Returns it."""
    pr = ws.probe
    probe = ProbeSettings(pr.num_prompts, pr.num_tokens, pr.threshold) if pr.enabled else None

    def frozen(name: str) -> bool:
        return not ws.send_frozen and freeze is not None and default_frozen(name, freeze.indexer, freeze.router_bias)

    backend.weight_sync = LocalWeightSync(
        backend.engine, ws.atomic, ws.in_flight, ws.recompute_kv_after_update, probe=probe, frozen=frozen
    )
    return backend.weight_sync


def worker_placement(trainer_device: str, world_size: int) -> tuple[str, str | tuple[str, ...] | None]:
    """(``WorkerSpec.device``, ``WorkerSpec.device_uuid``) of ``world_size`` workers refit through
    the IPC source of a trainer on ``trainer_device`` (``colocated_placement=worker_process``,
    validated by ``m3_rollout.config``): one worker on the trainer's device itself, its GPU's UUID;
    EP ranks on the CPU beside a CPU trainer, or rank r on cuda:r ("cuda"), each rank's UUID as
    this process sees cuda:r (the trainer shares one of those GPUs). Raises RuntimeError (torch)
    when a CUDA device asked for is not there."""
    dev = torch.device(trainer_device)
    if dev.type != "cuda":
        return "cpu", None
    if world_size == 1:
        return trainer_device, str(torch.cuda.get_device_properties(dev).uuid)
    uuids = tuple(str(torch.cuda.get_device_properties(torch.device("cuda", r)).uuid) for r in range(world_size))
    return "cuda", uuids


def build_rollout_service(cfg, model_dir, eos_token_ids, max_model_len: int) -> RolloutService | None:
    """A RolloutService for ``cfg`` (a MasterConfig), or None when the in-process engine serves.

    Workers load `model_dir` (each rank its expert shard), run ``policy.generation.dtype``, one
    torch thread each, gloo on CPU (``cluster.gpus_per_node == 0``) or NCCL with one GPU per rank.
    ``colocated_placement=worker_process``: the workers beside the trainer, refit through its
    shared source (``RolloutService(refit="ipc")``), with the trainer's torch threads split among
    them (they generate while it waits): P = 1 on ``cluster.device`` itself; P > 1 on the CPU, or
    rank r on cuda:r with the trainer on one of those GPUs (:func:`worker_placement`). On CUDA each
    rank's GPU UUID, as this process sees it, is checked in the worker at start; a Ray actor asks
    for no GPU, so Ray leaves the devices visible.
    Raises ValueError when the model's experts do not split over the EP size (names the key),
    RolloutFailure when the workers do not start.
    """
    gen, c = cfg.policy.generation, cfg.cluster
    beside = gen.colocated_placement == "worker_process"
    if gen.expert_parallel_size == 1 and c.launcher == "auto" and not beside:
        return None
    from m3_rollout.model.configuration import M3Config
    from m3_rollout.parallel.expert_sharding import expert_range

    # E % P != 0 fails here, in the driver, with the key name (not inside every worker).
    expert_range(M3Config.from_pretrained(str(model_dir)).num_local_experts, gen.expert_parallel_size, 0)
    on_gpu = c.gpus_per_node > 0
    device, uuid, threads, gpus = ("cuda" if on_gpu else "cpu"), None, 1, 1.0 if on_gpu else 0.0
    if beside:
        device, uuid = worker_placement(c.device, gen.expert_parallel_size)
        threads, gpus = max(1, torch.get_num_threads() // gen.expert_parallel_size), 0.0
    engine = dict(
        max_model_len=int(max_model_len),
        max_num_seqs=gen.max_num_seqs,
        eos_token_ids=tuple(int(t) for t in eos_token_ids),
        record_routing=cfg.policy.routing_replay,
        **gen.engine_kwargs(),
    )
    spec = WorkerSpec(
        model_dir=str(model_dir),
        group=EPGroupSpec(gen.expert_parallel_size, "127.0.0.1", 0, None, c.collective_timeout_s),
        dtype=gen.dtype,
        engine=engine,
        device=device,
        device_uuid=uuid,
        num_threads=threads,
        tokenizer_dir=str(model_dir),
    )
    return RolloutService(
        spec,
        launcher=c.launcher,
        # worker_process: the workers must share the trainer's node (its memory by CUDA IPC), so an
        # unset address starts a local instance rather than joining a cluster Ray finds
        ray_address=c.ray_address or ("local" if beside else None),
        worker_cpus=c.worker_cpus,
        worker_gpus=gpus,
        steps_per_call=c.steps_per_call,
        max_restarts=c.max_restarts,
        start_timeout_s=max(120.0, c.collective_timeout_s),
        weight_sync=cfg.weight_sync,
        freeze=cfg.policy.freeze,
        refit="ipc" if beside else "broadcast",
        trainer_device=c.device,
    )

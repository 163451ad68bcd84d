"""Build the rollout service from the job config (the GRPO loop's one call into this package).

Governing idea: the loop asks for a backend; with ``policy.generation.expert_parallel_size``
P > 1 or an explicit ``cluster.launcher`` ("ray" / "mp") it gets a :class:`RolloutService` of P
worker processes refit over a broadcast group; with ``policy.generation.colocated_placement=
worker_process`` one worker on the trainer's device (``cluster.device``) refit through the
trainer's shared stage (CUDA IPC); otherwise None and it builds the in-process engine itself,
then gives it its weight receiver with ``attach_local_weight_sync`` (the same receiver the
workers use).
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


def build_rollout_service(cfg, model_dir, eos_token_ids, max_model_len: int) -> RolloutService | None:
    """A RolloutService for ``cfg`` (a MasterConfig), or None when the in-process engine serves.

    Workers load `model_dir` (each rank its expert shard), run ``policy.generation.dtype``, one
    torch thread each, gloo on CPU (``cluster.gpus_per_node == 0``) or NCCL with one GPU per rank.
    ``colocated_placement=worker_process``: one worker on ``cluster.device`` itself (on CUDA its
    GPU's UUID is checked at start; a Ray actor asks for no GPU, so Ray leaves the device visible),
    with the trainer's torch thread count (the two take turns), refit through the stage
    (``RolloutService(refit="ipc")``).
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
        device, threads, gpus = c.device, torch.get_num_threads(), 0.0
        if device.startswith("cuda"):
            uuid = str(torch.cuda.get_device_properties(torch.device(device)).uuid)
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
        ray_address=c.ray_address,
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

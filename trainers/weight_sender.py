"""Trainer end of weight sync: a ``WeightSender`` over the policy's weights, built from config.

The trainer is rank 0 of the weight-sync group (it hosts the group's TCPStore); rollout workers
join as ranks 1..N. With ``weight_sync.method=colocated`` the rollout receivers live in this
process and get an in-process copy instead of a broadcast (same sender, same receiver, same
version / validity semantics; ``ColocatedChannel(direct=True)``: the fused copy plan into the
rollout's views, no buckets). Rollout worker processes on the trainer's own device get the
IPC channel: the trainer's stage shared once, refit on the device (``weight_sync/ipc.py``).
With ``weight_sync.probe.enabled`` the sender scores the probe ids with the policy's model
(``probe.model_scorer``) as the reference every rank is compared with.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from m3_rollout.config import FreezeConfig, WeightSyncConfig
from m3_rollout.weight_sync import (
    BroadcastChannel,
    ColocatedChannel,
    IpcChannel,
    WeightReceiver,
    WeightSender,
    WeightSyncGroup,
    default_frozen,
)
from m3_rollout.weight_sync.probe import ProbeSettings, model_scorer


def resolve_backend(cfg: WeightSyncConfig, device: torch.device | str) -> str:
    """``weight_sync.backend``: auto -> nccl for a CUDA device, gloo otherwise."""
    if cfg.backend != "auto":
        return cfg.backend
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def build_weight_sender(
    policy,
    cfg: WeightSyncConfig,
    generation_dtype: torch.dtype | None,
    freeze: FreezeConfig | None = None,
    group: WeightSyncGroup | None = None,
    receivers: Sequence[WeightReceiver] = (),
    ipc: IpcChannel | None = None,
) -> WeightSender:
    """A sender for ``policy`` (anything with ``named_released_tensors()`` and ``model``).

    ``group`` given: broadcast to the rollout workers (this process as rank 0); ``ipc`` given:
    rollout worker processes on this process's device, refit from the stage it shares with them
    (``weight_sync/ipc.py``; ``weight_sync.method`` must be auto then); else the in-process
    ``receivers`` (colocated; ``weight_sync.method`` auto resolves by which is given).
    Frozen tensors (``policy.freeze``) are left out of updates unless ``weight_sync.send_frozen``.
    Raises ValueError when the method's group / receivers are missing (naming the key).
    """
    freeze = freeze or FreezeConfig()
    if ipc is not None and cfg.method != "auto":
        raise ValueError(
            f"weight_sync.method={cfg.method}: rollout workers beside the trainer on one device are refit through "
            "the shared stage (IPC); leave weight_sync.method=auto"
        )
    method = cfg.method if cfg.method != "auto" else ("broadcast" if group is not None else "colocated")
    if ipc is not None:
        channel = ipc
    elif method == "broadcast":
        if group is None:
            raise ValueError("weight_sync.method=broadcast needs a WeightSyncGroup (the trainer as rank 0)")
        channel = BroadcastChannel(group, cfg.double_buffer)
    else:
        if not receivers:
            raise ValueError("weight_sync.method=colocated needs the in-process rollout receivers")
        device = next(policy.model.parameters()).device
        channel = ColocatedChannel(list(receivers), device, direct=True)  # per-tensor copies, no buckets

    def frozen(name: str) -> bool:
        return not cfg.send_frozen and default_frozen(name, freeze.indexer, freeze.router_bias)

    pr = cfg.probe
    probe = ProbeSettings(pr.num_prompts, pr.num_tokens, pr.threshold) if pr.enabled else None
    return WeightSender(
        policy.named_released_tensors,
        channel,
        cfg.bucket_size_mb,
        generation_dtype,
        frozen,
        probe=probe,
        reference=model_scorer(policy.model) if probe is not None else None,
    )

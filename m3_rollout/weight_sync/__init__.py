"""Trainer -> rollout weight sync (refit): handshake, bucketed versioned updates, in place.

manifest   ordered (released name, shape, dtype) lists, EP-aware destination views, update header
buckets    per-dtype bucket plan, packing (fused, cached per bucket), checksums
ring       the bucket pipeline's ring of wire buffers and side stream (pack / transfer / unpack overlap)
unpack     receiver half of the bucket path: device-side checksums and finite flags, one host read
group      the private trainer + rollout-ranks process group (TCPStore, gloo / NCCL, rebuild)
receiver   the ONE rollout-side receiver: checks, version rule, stage (atomic) or apply, commit
sender     trainer side: broadcast or colocated (in-process) channel
copy_plan  the direct refit's hot path: contiguous runs, one fused check / copy pass per dtype pair
released   the trainer's tensors as the sender reads them (cached, fingerprinted by address)
cast_copy  the trainer's low-precision copy, refreshed by a fused cast whose flags attest it
direct     per-tensor finite check naming the tensors of a failed direct update
ipc        separate processes on one device: the trainer's compute copy (or a stage) shared once (CUDA IPC / shm)
in_flight  what happens to running requests at an update (abort / drain / continue)
probe      post-update probe: re-score fixed ids, compare with the trainer's logprobs
rollout_sync  an engine's endpoint: receiver + in-flight policy + scorer (EP worker / in-process)
Trainer glue: trainers/weight_sender.py. Service wiring: RolloutService(weight_sync=...).
"""

from .buckets import Bucket, plan_buckets
from .cast_copy import CastCopy
from .group import WeightSyncGroup, WeightSyncTimeout
from .in_flight import InFlightOutcome, InFlightPolicy
from .ipc import IpcChannel, IpcRolloutSync
from .manifest import HandshakeError, TensorSpec, default_frozen, receiver_layout, sender_manifest
from .probe import ProbeSettings, model_scorer
from .receiver import UpdateResult, WeightReceiver
from .released import ReleasedTensors
from .rollout_sync import LocalWeightSync, RolloutWeightSync, engine_receiver
from .sender import BroadcastChannel, ColocatedChannel, WeightSender, WeightUpdateError

__all__ = [
    "Bucket",
    "plan_buckets",
    "CastCopy",
    "WeightSyncGroup",
    "WeightSyncTimeout",
    "InFlightOutcome",
    "InFlightPolicy",
    "IpcChannel",
    "IpcRolloutSync",
    "HandshakeError",
    "TensorSpec",
    "default_frozen",
    "receiver_layout",
    "sender_manifest",
    "ProbeSettings",
    "model_scorer",
    "UpdateResult",
    "WeightReceiver",
    "LocalWeightSync",
    "RolloutWeightSync",
    "engine_receiver",
    "BroadcastChannel",
    "ColocatedChannel",
    "ReleasedTensors",
    "WeightSender",
    "WeightUpdateError",
]

"""Trainer -> rollout weight sync (refit): handshake, bucketed versioned updates, in place.

manifest   ordered (released name, shape, dtype) lists, EP-aware destination views, update header
buckets    per-dtype bucket plan, packing, checksums
group      the private trainer + rollout-ranks process group (TCPStore, gloo / NCCL, rebuild)
receiver   rollout side: validate, stage (atomic) or apply per bucket, commit in place
sender     trainer side: broadcast or colocated (in-process) channel
direct     colocated direct path: fused finite check + per-tensor copies, no buckets
in_flight  what happens to running requests at an update (abort / drain / continue)
rollout_sync  a rollout rank's endpoint: group + receiver + engine + in-flight policy
Trainer glue: trainers/weight_sender.py. Service wiring: RolloutService(weight_sync=...).
"""

from .buckets import Bucket, plan_buckets
from .group import WeightSyncGroup, WeightSyncTimeout
from .manifest import HandshakeError, TensorSpec, default_frozen, receiver_layout, sender_manifest
from .receiver import UpdateResult, WeightReceiver
from .sender import BroadcastChannel, ColocatedChannel, WeightSender, WeightUpdateError

__all__ = [
    "Bucket",
    "plan_buckets",
    "WeightSyncGroup",
    "WeightSyncTimeout",
    "HandshakeError",
    "TensorSpec",
    "default_frozen",
    "receiver_layout",
    "sender_manifest",
    "UpdateResult",
    "WeightReceiver",
    "BroadcastChannel",
    "ColocatedChannel",
    "WeightSender",
    "WeightUpdateError",
]

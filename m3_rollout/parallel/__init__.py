"""Expert parallelism for the rollout engine (design.md §3.5, §4-5).

process_group     EP process groups (gloo on CPU, NCCL on GPU), free ports, short timeouts
ep_moe            EPExperts: all-to-all dispatch -> local grouped experts -> all-to-all combine; EPStats
expert_sharding   expert ranges per rank, sharding a model in place, the sharded safetensors loader
routing_record    per-token routed expert ids [L, n_moe_layers, top_k] int16, kept per KV page
"""

from .ep_moe import EPExperts, EPStats
from .expert_sharding import ShardLoadReport, expert_range, load_checkpoint_ep, shard_experts
from .process_group import EPGroupSpec, destroy_ep_group, free_port, init_ep_group

__all__ = [
    "EPExperts",
    "EPStats",
    "EPGroupSpec",
    "ShardLoadReport",
    "destroy_ep_group",
    "expert_range",
    "free_port",
    "init_ep_group",
    "load_checkpoint_ep",
    "shard_experts",
]

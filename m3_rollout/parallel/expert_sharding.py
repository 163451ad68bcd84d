"""Sharded experts: rank r of an EP group of size P holds experts [r·E/P, (r+1)·E/P) of every MoE layer.

Governing idea (design.md §3.5, "Expert-parallel model representation"): attention, router, shared
expert, embeddings and lm_head are replicated; each MoE layer's ``experts`` module becomes an
:class:`~m3_rollout.parallel.ep_moe.EPExperts` holding only the local rows, with
``expert_range = (a, b)``. Released tensor names stay per GLOBAL expert
(``...experts.{e}.w1.weight``), so loading and weight sync address experts the same way at every
EP size; a rank simply has no tensor for e outside [a, b).

The sharded loader reads from the safetensors files only the tensors this rank keeps (per-expert
tensors of other ranks are never read; a fused transformers tensor ``mlp.experts.gate_up_proj``
[E, 2I, H] is read as the row slice [a, b) only) and counts the bytes it read.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from m3_rollout.model.configuration import M3Config
from m3_rollout.model.loading import checkpoint_files, load_named_tensors, text_tensor_name
from m3_rollout.model.model import M3ForCausalLM

from .ep_moe import EPExperts, EPStats

_EXPERT_NAME = re.compile(r"^model\.layers\.\d+\.block_sparse_moe\.experts\.(\d+)\.(w1|w2|w3)\.weight$")
_HF_FUSED = re.compile(r"^(model\.layers\.\d+\.)mlp\.experts\.(gate_up_proj|down_proj)$")


def expert_range(num_experts: int, ep_size: int, rank: int) -> tuple[int, int]:
    """Global expert ids [a, b) of `rank`: a = rank·E/P, b = a + E/P.

    Raises:
        ValueError: ep_size < 1, rank outside [0, ep_size), or E % P != 0 (naming
            ``policy.generation.expert_parallel_size`` and the sizes that divide E).
    """
    if ep_size < 1:
        raise ValueError(f"policy.generation.expert_parallel_size={ep_size}: must be >= 1")
    if num_experts % ep_size != 0:
        divisors = [d for d in range(1, num_experts + 1) if num_experts % d == 0]
        raise ValueError(
            f"policy.generation.expert_parallel_size={ep_size}: the model has {num_experts} routed "
            f"experts per layer, which must split evenly over the EP ranks; use one of {divisors}"
        )
    if not 0 <= rank < ep_size:
        raise ValueError(f"EP rank {rank}: must be in [0, {ep_size})")
    n = num_experts // ep_size
    return rank * n, (rank + 1) * n


def shard_experts(
    model: M3ForCausalLM, rank: int, ep_size: int, group: dist.ProcessGroup | None, timing: bool = True
) -> EPStats:
    """Replace every MoE layer's experts by the local slice, in place; returns the model's EPStats.

    If the model's experts hold real weights (not ``meta``), the local rows are copied over, so
    sharding a full model gives the same maths; on ``meta`` the new parameters stay on ``meta``
    (for the loader to materialise). Raises ValueError as :func:`expert_range`.
    """
    config = model.config
    a, b = expert_range(config.num_local_experts, ep_size, rank)
    moes = model.moe_layers()
    stats = EPStats(len(moes), b - a, ep_size, timing=timing)
    for slot, moe in enumerate(moes):
        old = moe.experts
        with torch.device(old.w13.device):
            new = EPExperts(config, (a, b), group, stats, slot).to(old.w13.dtype)
        if tuple(getattr(old, "expert_range", (0, config.num_local_experts))) != (0, config.num_local_experts):
            raise ValueError(f"MoE layer {slot} is already sharded (experts {old.expert_range}); shard a full model")
        if old.w13.device.type != "meta":
            with torch.no_grad():
                new.w13.copy_(old.w13[a:b])
                new.w2.copy_(old.w2[a:b])
        moe.experts = new
    return stats


@dataclass
class ShardLoadReport:
    """What the sharded loader read: ``bytes_read`` of ``bytes_in_files`` (all tensors of all files)."""

    bytes_read: int
    bytes_in_files: int
    tensors_read: int
    expert_range: tuple[int, int]


def _local_tensors(files: list[str], a: int, b: int, report: dict) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of `files` this rank keeps, reading nothing else."""
    from safetensors import safe_open

    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            for key in sorted(f.keys()):
                sl = f.get_slice(key)
                shape = sl.get_shape()
                itemsize = _DTYPE_BYTES[sl.get_dtype()]
                report["bytes_in_files"] += itemsize * _numel(shape)
                name = text_tensor_name(key)
                if name is None:
                    continue  # vision / MTP: never read
                m = _EXPERT_NAME.match(name)
                if m and not a <= int(m.group(1)) < b:
                    continue  # another rank's expert: never read
                fused = _HF_FUSED.match(name)
                if fused:
                    t = sl[a:b]  # only the local rows are read
                    report["bytes_read"] += t.numel() * t.element_size()
                    report["tensors_read"] += 1
                    yield from _split_fused(fused.group(1), fused.group(2), t, a)
                    continue
                t = f.get_tensor(key)
                report["bytes_read"] += t.numel() * t.element_size()
                report["tensors_read"] += 1
                yield key, t


_DTYPE_BYTES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
}


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _split_fused(layer: str, which: str, t: torch.Tensor, a: int) -> Iterator[tuple[str, torch.Tensor]]:
    """A transformers fused expert tensor's local rows [E_local, ...] -> per-expert released names."""
    base = f"{layer}block_sparse_moe.experts."
    for i in range(t.shape[0]):
        e = a + i
        if which == "down_proj":
            yield f"{base}{e}.w2.weight", t[i]
        else:
            inter = t.shape[1] // 2
            yield f"{base}{e}.w1.weight", t[i, :inter]
            yield f"{base}{e}.w3.weight", t[i, inter:]


def load_checkpoint_ep(
    path: str | os.PathLike,
    rank: int,
    ep_size: int,
    group: dist.ProcessGroup | None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    timing: bool = True,
) -> tuple[M3ForCausalLM, EPStats, ShardLoadReport]:
    """Build rank `rank`'s EP shard of the checkpoint at `path`, reading only its tensors.

    Like ``m3_rollout.model.load_checkpoint`` (same namings accepted, router kept >= fp32, eval
    mode), but each MoE layer holds experts ``expert_range(E, ep_size, rank)`` only.
    Returns (model, its EPStats, ShardLoadReport with the bytes read).

    Raises:
        ValueError: E % ep_size != 0 (see :func:`expert_range`), or a missing / mis-shaped tensor
            of this rank's part (listed, as in ``load_named_tensors``).
        FileNotFoundError: no safetensors in `path`.
    """
    p = os.fspath(path)
    config = M3Config.from_pretrained(p)
    a, b = expert_range(config.num_local_experts, ep_size, rank)
    files = checkpoint_files(p)
    with torch.device("meta"):
        model = M3ForCausalLM(config)
    stats = shard_experts(model, rank, ep_size, group, timing=timing)
    model.cast_for_inference(dtype)
    model.to_empty(device=device)
    counters = {"bytes_read": 0, "bytes_in_files": 0, "tensors_read": 0}
    load_named_tensors(model, _local_tensors(files, a, b, counters))
    report = ShardLoadReport(counters["bytes_read"], counters["bytes_in_files"], counters["tensors_read"], (a, b))
    return model.eval(), stats, report

"""Process groups for expert parallelism: gloo on CPU, NCCL on GPU, short timeouts (design.md §5).

Governing idea: one EP rank per process; the EP group is the process's default
``torch.distributed`` group, created over TCP from an address and a port the launcher picked.
Every collective carries a short timeout, so a dead peer turns into an exception on the
survivors instead of a hang (design.md §6).
"""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on `host` a moment ago (bind to port 0, read it back, release it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def default_backend(device: torch.device | str) -> str:
    """ "nccl" for a CUDA device, "gloo" otherwise."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


@dataclass(frozen=True)
class EPGroupSpec:
    """Where and how an EP group meets.

    Attributes:
        world_size: P, the EP size (number of ranks).
        addr, port: TCP rendezvous of rank 0 (``tcp://addr:port``).
        backend: "gloo" (CPU) or "nccl" (one GPU per rank); None = from the device.
        timeout_s: seconds a collective may wait for its peers before raising.
    """

    world_size: int
    addr: str
    port: int
    backend: str | None = None
    timeout_s: float = 30.0


# NVLink multicast (NVLS) stays off on shared GPU hosts: a program using it can take the host's
# GPUs out of service (the GPU machines' notes). Set in this process before NCCL starts, and
# inherited by every worker process it spawns.
MULTICAST_OFF_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def disable_nvlink_multicast() -> None:
    """Set MULTICAST_OFF_ENV in os.environ unless the caller chose values already."""
    for key, value in MULTICAST_OFF_ENV.items():
        os.environ.setdefault(key, value)


def init_ep_group(spec: EPGroupSpec, rank: int, device: torch.device | str = "cpu") -> dist.ProcessGroup | None:
    """Join the EP group as `rank` (the process's default group). Returns the group, or None for P = 1.

    Raises:
        ValueError: rank outside [0, world_size) or an unknown backend.
        RuntimeError / DistNetworkError: the rendezvous did not complete within ``timeout_s``.
    """
    if not 0 <= rank < spec.world_size:
        raise ValueError(f"rank={rank}: must be in [0, expert_parallel_size={spec.world_size})")
    if spec.world_size == 1:
        return None
    backend = spec.backend or default_backend(device)
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend={backend!r}: must be 'gloo' (CPU) or 'nccl' (GPU)")
    kwargs = {}
    if backend == "nccl":
        disable_nvlink_multicast()
        kwargs["device_id"] = torch.device(device)
    dist.init_process_group(
        backend,
        init_method=f"tcp://{spec.addr}:{spec.port}",
        rank=rank,
        world_size=spec.world_size,
        timeout=datetime.timedelta(seconds=spec.timeout_s),
        **kwargs,
    )
    return dist.group.WORLD


def destroy_ep_group() -> None:
    """Leave the EP group if this process joined one (safe to call twice or after a failure)."""
    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - a broken group may refuse a clean shutdown; the process is ending
            pass

"""Ordered split-K with an in-kernel combine: the last program of an output tile to finish sums the
tile's K-chunk partials in chunk order (the batch-invariant GEMMs: ``invariant_ops.linear`` and
the chunked fused-MoE GEMMs of ``moe_chunked``).

Governing idea: a split-K GEMM stores one fp32 partial per fixed K chunk; which program finishes
last depends on scheduling, but the sum it makes does not: it reads every chunk's partial back
from memory and adds them left to right, chunk 0 first, exactly as one program walking all the
chunks would. So the combine needs no second launch and no ordering of the programs, and the
bits are those of the unsplit launch.

Protocol, per output tile (one int32 counter each, zero between launches):
1. every chunk program stores its partial, then ``last_to_arrive`` (all threads' stores issued:
   ``tl.debug_barrier``; then one acq_rel atomic increment at GPU scope, the release that
   publishes them, as CUTLASS's split-K semaphore does) tells it whether it was the last;
2. the last one reads the partials (L2 loads, ``.cg``), combines them, writes the tile and sets
   the counter back to zero (``reset_counter``), so the buffer is all zeros again when the
   launch ends: the next launch, and every CUDA-graph replay, starts from zeros.

Constraint: one counter buffer per device (``tile_counters``), so two split launches on one
device must not run at the same time on different streams (the engine runs its forward on one
stream; graph replays are ordered on theirs). A launch aborted half-way would leave counters
set; the CUDA context is unusable after that anyway.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

TILE_COUNTERS = 4096  # counters per device: a split launch covers at most this many output tiles

_COUNTERS: dict[torch.device, torch.Tensor] = {}


def tile_counters(device: torch.device, tiles: int) -> torch.Tensor | None:
    """The device's zeroed int32 counter buffer [TILE_COUNTERS] for a split launch of ``tiles``
    output tiles, or None (the caller then combines in a separate pass) when tiles exceeds
    TILE_COUNTERS or when the buffer does not exist yet and the current stream is capturing a CUDA
    graph (a buffer allocated during capture would not be zeroed before the replay: the engine's
    eager warm-up creates it first)."""
    if tiles > TILE_COUNTERS:
        return None
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    buf = _COUNTERS.get(device)
    if buf is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        buf = _COUNTERS[device] = torch.zeros(TILE_COUNTERS, dtype=torch.int32, device=device)
    return buf


@triton.jit
def last_to_arrive(count_ptr, n_chunks):
    # True in the program that is the n_chunks-th to reach this point for the counter count_ptr,
    # after this program's partial stores are issued and published (module docstring, step 1).
    tl.debug_barrier()
    ticket = tl.atomic_add(count_ptr, 1, sem="acq_rel", scope="gpu")
    return ticket == n_chunks - 1


@triton.jit
def reset_counter(count_ptr):
    # The last program hands the counter back at zero for the next launch (module docstring, step 2).
    tl.atomic_xchg(count_ptr, 0, sem="relaxed", scope="gpu")

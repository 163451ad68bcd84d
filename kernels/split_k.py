"""Ordered split-K with an in-kernel combine: the last program of an output tile to finish sums the
tile's K-chunk partials in chunk order (the batch-invariant GEMMs: ``invariant_ops.linear`` and
the chunked fused-MoE GEMMs of ``moe_chunked``); and ``fold_chunk``, the same chunk order for
their unsplit launches' single K loop.

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


@triton.jit
def combine_chunks(p_ptrs, chunk_stride, n_chunks, mask, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # The last program's sum (module docstring, step 2): ((0 + part[0]) + part[1]) + ... +
    # part[n_chunks - 1] in fp32, part[c] = [BLOCK_M, BLOCK_N] at p_ptrs + c * chunk_stride, read from
    # L2 (.cg). Four chunks' loads are issued before their four adds, so the tail waits one memory
    # round trip per four chunks instead of one per chunk (a K of 6144 in 256-wide chunks: 6 instead
    # of 24). A chunk past the end reads as +0.0 and leaves the sum's bits as they are: the running
    # sum is never -0.0 (it starts at +0.0, and a round-to-nearest sum is -0.0 only when both terms
    # are), and s + 0.0 == s for every other s, inf and NaN included.
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for c0 in range(0, n_chunks, 4):
        p0 = tl.load(p_ptrs + c0 * chunk_stride, mask=mask, other=0.0, cache_modifier=".cg")
        p1 = tl.load(p_ptrs + (c0 + 1) * chunk_stride, mask=mask & (c0 + 1 < n_chunks), other=0.0, cache_modifier=".cg")
        p2 = tl.load(p_ptrs + (c0 + 2) * chunk_stride, mask=mask & (c0 + 2 < n_chunks), other=0.0, cache_modifier=".cg")
        p3 = tl.load(p_ptrs + (c0 + 3) * chunk_stride, mask=mask & (c0 + 3 < n_chunks), other=0.0, cache_modifier=".cg")
        acc += p0
        acc += p1
        acc += p2
        acc += p3
    return acc


# A k_chunk past any K (2^30 columns): one chunk, the whole K summed as one chain from zero (a
# "whole-K" weight: ``invariant_ops.WHOLE_K``). Launchers hand it to the kernels as K_CHUNK = 0
# (``launch_chunk``): a plain accumulation with no chunk partial beside the total, the bits of
# folding that single chunk (0 + x == x for every sum the chain can give: never -0.0, as above).
WHOLE_K_CHUNK = 1 << 30


def launch_chunk(k_chunk: int) -> int:
    """The K_CHUNK constexpr a chunked kernel takes for ``k_chunk``: 0 (one chain) for
    ``WHOLE_K_CHUNK``, else ``k_chunk``."""
    return 0 if k_chunk == WHOLE_K_CHUNK else k_chunk


@triton.jit
def k_step(acc, part, a, b, k0, K, BLOCK_K: tl.constexpr, K_CHUNK: tl.constexpr, PRECISION: tl.constexpr):
    # One K step of an unsplit loop: K_CHUNK == 0 (a whole-K weight) adds the dot into acc; else
    # into the chunk's partial, folded into acc at the chunk's end (fold_chunk).
    if K_CHUNK == 0:
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    else:
        part = tl.dot(a, b, part, input_precision=PRECISION)
        acc, part = fold_chunk(acc, part, k0, K, BLOCK_K, K_CHUNK)
    return acc, part


@triton.jit
def k_step_pair(acc_g, part_g, acc_u, part_u, a, b_g, b_u, k0, K, BLOCK_K: tl.constexpr, K_CHUNK: tl.constexpr,
                PRECISION: tl.constexpr):  # fmt: skip
    # k_step for a gate tile and an up tile that share the x tile a, in the order both dots, then
    # both folds (the gate|up GEMMs' loops: the fold branches of the two tiles merge).
    if K_CHUNK == 0:
        acc_g = tl.dot(a, b_g, acc_g, input_precision=PRECISION)
        acc_u = tl.dot(a, b_u, acc_u, input_precision=PRECISION)
    else:
        part_g = tl.dot(a, b_g, part_g, input_precision=PRECISION)
        part_u = tl.dot(a, b_u, part_u, input_precision=PRECISION)
        acc_g, part_g = fold_chunk(acc_g, part_g, k0, K, BLOCK_K, K_CHUNK)
        acc_u, part_u = fold_chunk(acc_u, part_u, k0, K, BLOCK_K, K_CHUNK)
    return acc_g, part_g, acc_u, part_u


@triton.jit
def fold_chunk(acc, part, k0, K, BLOCK_K: tl.constexpr, K_CHUNK: tl.constexpr):
    # The flat K loop's chunk rule (unsplit launches), after the K step at k0: at a chunk end (or
    # K's end) the chunk's partial, summed from zero, is added to acc and restarts from zero: the
    # additions of one loop per chunk, in their order, in one software-pipelined loop (no pipeline
    # drain at every chunk).
    if ((k0 + BLOCK_K) % K_CHUNK == 0) | (k0 + BLOCK_K >= K):
        acc += part
        part = tl.zeros(part.shape, dtype=tl.float32)
    return acc, part

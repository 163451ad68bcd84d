"""Tile helpers shared by the two fused-MoE GEMM layouts (kernels/fused_moe.py: aligned tiles,
kernels/moe_ragged.py: ragged tiles); both import this module, neither imports the other back.

- ``GemmTile``: one grouped GEMM's tile and launch knobs; ``launch_group``: its row-tile group size.
- ``tile_coords`` (Triton): program id -> (row tile, column tile) in groups of row tiles.
- ``swiglu_oai_tile`` (Triton): SwiGLU-OAI on fp32 gate/up accumulators (spec §3.7).
- ``dot_precision``: the ``tl.dot`` input precision for an activation dtype.
- ``FAT_TAIL``: rows a full ragged tile may absorb on the default path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

FAT_TAIL = 64  # rows a full tile may absorb (align_ragged fat_tail): one 64-row wgmma more per weight tile


@dataclass(frozen=True)
class GemmTile:
    """Tile of one grouped GEMM: output columns BLOCK_N, reduction step BLOCK_K, launch knobs.

    group_m: row tiles per program group (`tile_coords`); 0 = all row tiles in one group.
    """

    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    group_m: int = 0


def launch_group(tile: GemmTile, num_tiles_m: int) -> int:
    """group_m argument of `tile_coords` for `tile` over num_tiles_m row tiles (0 = one group)."""
    return tile.group_m if 0 < tile.group_m < num_tiles_m else num_tiles_m


def dot_precision(dtype: torch.dtype) -> str:
    """``input_precision`` of the GEMMs' ``tl.dot`` for activations of ``dtype``: "ieee" (exact fp32
    products) for fp32, the CPU-test and reference dtype; "tf32" otherwise (ignored by 16-bit dots)."""
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def tile_coords(pid, num_tiles_m, num_tiles_n: tl.constexpr, group_m):
    # Program id -> (row tile, column tile), row tiles in groups of group_m: a group's programs
    # sweep every column tile before the next group starts, so the group's A rows stay in L2 and
    # each weight tile is read once by all row tiles of its expert at nearly the same time.
    # group_m = num_tiles_m gives plain row-tile-fastest order over the whole grid.
    per_group = group_m * num_tiles_n
    first = (pid // per_group) * group_m
    size = tl.minimum(num_tiles_m - first, group_m)
    local = pid % per_group
    return first + local % size, local // size


@triton.jit
def swiglu_oai_tile(acc_g, acc_u, alpha, limit, beta):
    """SwiGLU-OAI on fp32 gate/up accumulators (spec §3.7): gate clamped above only, up both sides."""
    g_c = tl.minimum(acc_g, limit)
    u_c = tl.minimum(tl.maximum(acc_u, -limit), limit)
    return g_c * tl.sigmoid(alpha * g_c) * (u_c + beta)

"""Sort/align top-k expert assignments by expert for the grouped MoE GEMMs (spec §3.6).

Governing idea: every (token, slot) assignment whose expert lies in the local slice [a, b) gets a
row in one flat buffer where each local expert owns a contiguous run of rows padded up to a
multiple of the GEMM tile height BLOCK_M, so every BLOCK_M-row tile of that buffer belongs to
exactly one expert. All sizes are upper bounds known from the *shapes* alone (T, K, E_local,
BLOCK_M), never from the routing values, so the whole thing runs on the device with no host sync
and the buffers keep fixed shapes under CUDA-graph replay.

Shape legend:
  T  tokens   K  experts per token   E  local experts (b - a)   M  BLOCK_M (tile height)
  P  padded rows (upper bound)       B  row tiles = P // M

Worked example (T=3, K=2, M=4, local slice [0, 3), expert 1 gets no tokens):
  ids = [[0, 2], [2, 0], [0, 5]]    flat assignments 0..5, expert 5 is outside the slice
  expert 0 <- assignments 0, 3, 4   expert 2 <- assignments 1, 2   (stable: ascending flat index)
  sorted_ids   = [0, 3, 4, S,  1, 2, S, S,  S, ...]   S = T*K = 6, the padding sentinel
  tile_expert  = [0, 2, -1, ...]                      -1: tile past the last used row
  num_rows     = [8]                                  rows in use (a multiple of M)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

try:  # the torch path below needs no triton; the one-launch decode path does
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU installs without the kernels extra
    triton = None

# NOTE: at decode sizes the ~20 small launches of the torch path cost more than the expert GEMMs'
# weight streaming saves (measured ~70 us of a 200 us layer on H200), so up to this many
# assignments one single-program Triton kernel does the whole alignment.
SMALL_ALIGN_MAX_ASSIGNMENTS = 256
# The batch-invariant mode's aligned chunked kernels (kernels/moe_chunked.py) serve every step below
# invariant_ops.MOE_PREFILL_ROWS (512) tokens, short prompts' eager prefill included, where the
# torch path's ~40 launches per MoE layer cost more host time than the one program's quadratic rank
# loop costs GPU time (300M bench model, 128-token prompt: ~300 launches of a ~900-launch prefill
# step); they pass this bound (512 tokens x top-4).
CHUNKED_SMALL_ALIGN_MAX_ASSIGNMENTS = 2048


@dataclass
class AlignedAssignments:
    """Assignments grouped by local expert, padded to the tile height (all int32, on ids.device).

    sorted_ids:  [P] flat assignment index t*K + k per row; ``T*K`` marks a padding row.
    tile_expert: [B] local expert (0..E-1) owning each BLOCK_M-row tile; -1 for unused tiles.
    num_rows:    [1] rows in use (sum over experts of counts rounded up to BLOCK_M).
    block_m:     the tile height M the padding was made for.
    """

    sorted_ids: torch.Tensor
    tile_expert: torch.Tensor
    num_rows: torch.Tensor
    block_m: int


def max_padded_rows(num_assignments: int, num_local_experts: int, block_m: int) -> int:
    """Upper bound P on padded rows: each non-empty expert wastes at most M-1 rows of padding.

    At most min(T*K, E) experts are non-empty, so P = M * (ceil(T*K / M) + min(T*K, E)), which
    for decode (T*K small) stays a few tiles instead of E tiles.
    """
    tiles = -(-num_assignments // block_m) + min(num_assignments, num_local_experts)
    return tiles * block_m


def align_by_expert(
    ids: torch.Tensor, expert_range: tuple[int, int], block_m: int, small_max: int = SMALL_ALIGN_MAX_ASSIGNMENTS
) -> AlignedAssignments:
    """Group the assignments ``ids`` [T, K] (global expert ids, any int dtype) by local expert.

    Assignments whose expert is outside ``expert_range = (a, b)`` are dropped (another EP rank
    owns them). Within an expert, rows keep ascending flat index t*K + k. Shape-derived sizes
    only: no host sync, CUDA-graph capturable. On CUDA with at most ``small_max`` (default
    SMALL_ALIGN_MAX_ASSIGNMENTS) assignments one Triton launch (`align_by_expert_small`), else
    tensor ops (`align_by_expert_torch`); both give identical results.

    Raises ValueError for a non-2-D ids, an empty or inverted expert_range, or block_m < 1.
    """
    if ids.is_cuda and triton is not None and 0 < ids.numel() <= small_max:
        return align_by_expert_small(ids, expert_range, block_m)
    return align_by_expert_torch(ids, expert_range, block_m)


def _check(ids: torch.Tensor, expert_range: tuple[int, int], block_m: int) -> tuple[int, int]:
    if ids.dim() != 2:
        raise ValueError(f"ids must be [T, K], got shape {tuple(ids.shape)}")
    a, b = int(expert_range[0]), int(expert_range[1])
    if not 0 <= a < b:
        raise ValueError(f"expert_range must satisfy 0 <= a < b, got {expert_range}")
    if block_m < 1:
        raise ValueError(f"block_m must be >= 1, got {block_m}")
    return a, b


def align_by_expert_torch(ids: torch.Tensor, expert_range: tuple[int, int], block_m: int) -> AlignedAssignments:
    """`align_by_expert` as plain tensor ops on ids.device (any size, any device)."""
    a, b = _check(ids, expert_range, block_m)
    dev = ids.device
    n_local = b - a
    n = ids.numel()  # T*K
    p = max_padded_rows(n, n_local, block_m)

    local = ids.reshape(-1).to(torch.int64) - a  # [T*K]
    inside = (local >= 0) & (local < n_local)
    key = torch.where(inside, local, torch.full_like(local, n_local))  # [T*K]; n_local = dropped
    # NOTE: scatter_add instead of bincount: CUDA bincount reads max() back to the host.
    counts = torch.zeros(n_local + 1, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, key, torch.ones_like(key))
    counts = counts[:n_local]  # [E]
    padded = (counts + block_m - 1) // block_m * block_m  # [E]
    padded_end = torch.cumsum(padded, 0)  # [E]
    padded_start = padded_end - padded  # [E]
    count_start = torch.cumsum(counts, 0) - counts  # [E]

    order = torch.sort(key, stable=True).indices  # [T*K] flat assignment indices grouped by key
    key_sorted = key[order]  # [T*K]
    kept = key_sorted < n_local
    ks = key_sorted.clamp(max=n_local - 1)
    rank = torch.arange(n, device=dev) - count_start[ks]  # [T*K] position within its expert
    dest = torch.where(kept, padded_start[ks] + rank, torch.full_like(rank, p))  # [T*K]; p = dump
    sorted_ids = torch.full((p + 1,), n, dtype=torch.int64, device=dev)
    sorted_ids.scatter_(0, dest, order)
    sorted_ids = sorted_ids[:p]  # [P]

    tile_start = torch.arange(0, p, block_m, device=dev)  # [B]
    owner = torch.searchsorted(padded_end, tile_start, right=True)  # [B] in 0..E (E: past the end)
    tile_expert = torch.where(owner < n_local, owner, torch.full_like(owner, -1))
    num_rows = padded_end[-1:].clone()  # [1]
    return AlignedAssignments(
        sorted_ids=sorted_ids.to(torch.int32),
        tile_expert=tile_expert.to(torch.int32),
        num_rows=num_rows.to(torch.int32),
        block_m=block_m,
    )


def align_by_expert_small(ids: torch.Tensor, expert_range: tuple[int, int], block_m: int) -> AlignedAssignments:
    """`align_by_expert` in one single-program Triton launch (decode sizes; any T*K but meant for small).

    Same outputs as `align_by_expert_torch`. Runs under TRITON_INTERPRET=1 on CPU tensors too.
    """
    a, b = _check(ids, expert_range, block_m)
    n_local, n = b - a, ids.numel()
    p = max_padded_rows(n, n_local, block_m)
    dev = ids.device
    sorted_ids = torch.empty(p, dtype=torch.int32, device=dev)
    tile_expert = torch.empty(p // block_m, dtype=torch.int32, device=dev)
    num_rows = torch.empty(1, dtype=torch.int32, device=dev)
    block_a = triton.next_power_of_2(n)  # a compiled variant per power of two (P is a runtime bound)
    if n == 0:
        num_rows.zero_()
        return AlignedAssignments(sorted_ids, tile_expert, num_rows, block_m)
    _align_small_kernel[(1,)](
        ids.reshape(-1).contiguous(),
        sorted_ids,
        tile_expert,
        num_rows,
        n,
        a,
        p,
        p // block_m,
        P_BOUND=max_padded_rows(block_a, n_local, block_m),
        N_LOCAL=n_local,
        BLOCK_M=block_m,
        BLOCK_A=block_a,
        BLOCK_E=triton.next_power_of_2(n_local + 1),
        BLOCK_J=16,
        BLOCK_T=16,
        BLOCK_P=256,
        num_warps=4 if block_a <= SMALL_ALIGN_MAX_ASSIGNMENTS else 8,
    )
    return AlignedAssignments(sorted_ids, tile_expert, num_rows, block_m)


if triton is not None:

    @triton.jit
    def _align_small_kernel(
        ids_ptr,
        sorted_ids_ptr,
        tile_expert_ptr,
        num_rows_ptr,
        n_assign,
        expert_lo,
        P,  # padded rows (max_padded_rows): runtime bounds, so a prefill's T does not recompile;
        n_tiles,  # P // BLOCK_M    the loops run to P_BOUND (P at n = BLOCK_A), masked
        P_BOUND: tl.constexpr,
        N_LOCAL: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_A: tl.constexpr,
        BLOCK_E: tl.constexpr,
        BLOCK_J: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_P: tl.constexpr,
    ):
        # key = local expert of each flat assignment, N_LOCAL for other ranks' experts and lanes past n.
        offs = tl.arange(0, BLOCK_A)
        ok = offs < n_assign
        e = tl.load(ids_ptr + offs, mask=ok, other=-1).to(tl.int32) - expert_lo
        inside = ok & (e >= 0) & (e < N_LOCAL)
        key = tl.where(inside, e, N_LOCAL)
        offs_e = tl.arange(0, BLOCK_E)
        counts = tl.histogram(key, BLOCK_E)  # [BLOCK_E]; bin N_LOCAL collects the dropped lanes
        padded = tl.where(offs_e < N_LOCAL, (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M, 0)
        padded_end = tl.cumsum(padded, 0)
        padded_start = padded_end - padded
        # stable rank inside an expert: earlier assignments with the same key, in chunks of BLOCK_J
        rank = tl.zeros((BLOCK_A,), dtype=tl.int32)
        for j0 in range(0, BLOCK_A, BLOCK_J):
            offs_j = j0 + tl.arange(0, BLOCK_J)
            ej = tl.load(ids_ptr + offs_j, mask=offs_j < n_assign, other=-1).to(tl.int32) - expert_lo
            kj = tl.where((offs_j < n_assign) & (ej >= 0) & (ej < N_LOCAL), ej, N_LOCAL)
            same = (kj[None, :] == key[:, None]) & (offs_j[None, :] < offs[:, None])
            rank += tl.sum(same.to(tl.int32), axis=1)
        dest = tl.gather(padded_start, key, 0) + rank
        tl.store(num_rows_ptr, tl.sum(padded, 0))
        # tile owner = number of experts whose padded run ends at or before the tile start
        for t0 in range(0, P_BOUND // BLOCK_M, BLOCK_T):
            offs_t = t0 + tl.arange(0, BLOCK_T)
            done = (padded_end[None, :] <= offs_t[:, None] * BLOCK_M) & (offs_e[None, :] < N_LOCAL)
            owner = tl.sum(done.to(tl.int32), axis=1)
            tl.store(tile_expert_ptr + offs_t, tl.where(owner < N_LOCAL, owner, -1), mask=offs_t < n_tiles)
        for r0 in range(0, P_BOUND, BLOCK_P):
            offs_r = r0 + tl.arange(0, BLOCK_P)
            tl.store(sorted_ids_ptr + offs_r, tl.zeros((BLOCK_P,), dtype=tl.int32) + n_assign, mask=offs_r < P)
        tl.debug_barrier()  # padding sentinels land before the real rows overwrite their slots
        tl.store(sorted_ids_ptr + dest, offs, mask=inside)

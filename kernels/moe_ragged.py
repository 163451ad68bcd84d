"""Grouped MoE GEMMs over ragged row tiles: 128-row tiles plus short tails, chosen per tile (spec §3.6).

Governing idea: at large T every local expert gets about T*K/E rows (128 on the real shape at
T=4096, +-11). Padding each expert to a multiple of one tile height M wastes about M/2 rows per
expert (47% more MMA work at M=128, 23% at M=64). Here each expert's rows are padded only to
MIN_M (16) and cut into full MAX_M-row tiles plus a tail whose MMA height is the smallest power
of two >= the remaining rows (16/32/64/128), chosen per tile at run time inside one launch. With
`fat_tail` (default path) a tail of <= 32/64 rows rides along with the expert's last full tile:
one program loads each weight tile once and feeds a 128-row and a 32/64-row MMA with it, so
every weight tile is read once per expert (weights are most of the traffic at T=4096: 14.5 GB).
Weight tiles come through TMA descriptors; A rows either through TMA from an expert-sorted copy
of x (`fused_moe.moe_permute`) or gathered by token inside the GEMM (no copy). Programs run in
groups of row tiles (`moe_tiles.tile_coords`) so a group's weights and rows stay in L2.
With K_CHUNK > 0 (the batch-invariant prefill band, kernels/invariant_ops.py) both GEMMs sum K in
chunks of K_CHUNK columns, each chunk's partial from zero and folded into the total at the chunk's
end (`split_k.fold_chunk`): kernels/moe_chunked.py's additions in its order, so a row's bits are
those of the aligned chunked kernels whatever its tile's MMA height.

Tiles are described by three int32 arrays (shape-derived sizes, no host sync, graph-safe):
  tile_row [S]   first row of the tile in the [P, .] expert-sorted buffers
  tile_expert [S] local expert of the tile
  tile_rows [S]  rows of the tile that belong to its expert (a multiple of MIN_M, at most MAX_M,
                 or MAX_M + fat_tail for a fat tile); rows past it belong to the next expert:
                 computed (TMA reads them) but never stored
and num_tiles [1]. Slots S are an upper bound; programs of slots >= num_tiles exit at once.
On CUDA the alignment is three Triton launches (`align_ragged_triton`); `align_ragged_torch` is
the same in tensor ops (reference and CPU path).

Worked example (MIN_M 16, MAX_M 128, fat_tail 64; one expert with 150 rows, one with 20):
  expert 0: 150 rows -> padded 160 -> one fat tile (row 0, 160 rows: a 128-row + 64-row MMA)
  expert 1: 20 rows  -> padded 32  -> one tile (row 160, 32 rows: a 32-row MMA)
  without fat_tail expert 0 gets tiles (0, 128) and (128, 32).

Shape legend: T tokens, K slots per token, E local experts, H hidden, I expert width,
P padded rows (`moe_align.max_padded_rows(T*K, E, MIN_M)`), S tile slots.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from m3_kernels.moe_align import align_by_expert_torch, max_padded_rows
from m3_kernels.moe_chunked import check_k_chunk
from m3_kernels.moe_tiles import dot_precision, launch_group, swiglu_oai_tile, tile_coords
from m3_kernels.split_k import fold_chunk, launch_chunk

MAX_M, MIN_M = 128, 16


@dataclass
class RaggedTiles:
    """Expert-sorted rows (padded to MIN_M per expert) and their ragged tiles; all int32.

    sorted_ids [P]: flat assignment t*K + k per row, T*K on padding rows (as AlignedAssignments).
    tile_row / tile_expert / tile_rows [S], num_tiles [1]: see the module docstring.
    num_rows [1]: rows in use (a multiple of MIN_M).
    """

    sorted_ids: torch.Tensor
    tile_row: torch.Tensor
    tile_expert: torch.Tensor
    tile_rows: torch.Tensor
    num_tiles: torch.Tensor
    num_rows: torch.Tensor
    fat_tail: int = 0


def _check_fat(fat_tail: int) -> None:
    if fat_tail not in (0, 32, 64):
        raise ValueError(f"fat_tail must be 0, 32 or 64 (tail MMA heights the kernels have), got {fat_tail}")


def max_tile_slots(num_assignments: int, num_local_experts: int) -> int:
    """S: each expert has ceil(n_e / MAX_M) tiles <= n_e / MAX_M + 1, and at most min(T*K, E) are non-empty."""
    return -(-num_assignments // MAX_M) + min(num_assignments, num_local_experts)


def align_ragged(ids: torch.Tensor, expert_range: tuple[int, int], fat_tail: int = 0) -> RaggedTiles:
    """Group ids [T, K] by local expert into MIN_M-padded runs and cut ragged tiles (see align_ragged_torch).

    On CUDA three Triton launches (`align_ragged_triton`, ~25 tensor ops fewer), else tensor ops;
    both give identical results.
    """
    if ids.is_cuda and ids.numel() > 0:
        return align_ragged_triton(ids, expert_range, fat_tail)
    return align_ragged_torch(ids, expert_range, fat_tail)


def align_ragged_torch(ids: torch.Tensor, expert_range: tuple[int, int], fat_tail: int = 0) -> RaggedTiles:
    """Group ids [T, K] (global expert ids) by local expert into MIN_M-padded runs and cut ragged tiles.

    fat_tail (0, 32 or 64): an expert's last full tile absorbs a remainder of at most fat_tail
    rows (tile_rows up to MAX_M + fat_tail; the kernels run it as one program sharing each weight
    tile between a MAX_M-row and a fat_tail-row MMA) instead of giving it a tail tile of its own.
    Tensor ops on ids.device, sizes from shapes only (no host sync). Raises ValueError like
    `moe_align.align_by_expert` for bad ids / expert_range.
    """
    _check_fat(fat_tail)
    al = align_by_expert_torch(ids, expert_range, MIN_M)
    a, b = int(expert_range[0]), int(expert_range[1])
    n_local, dev = b - a, ids.device
    s = max_tile_slots(ids.numel(), n_local)
    # rows per local expert from the MIN_M tile owners (each MIN_M tile belongs to one expert)
    owner = al.tile_expert.to(torch.int64)  # [P // MIN_M], -1 past the end
    padded = torch.zeros(n_local + 1, dtype=torch.int64, device=dev)
    padded.scatter_add_(0, torch.where(owner >= 0, owner, n_local), torch.full_like(owner, MIN_M))
    padded = padded[:n_local]  # [E] rows per expert, multiple of MIN_M
    start = torch.cumsum(padded, 0) - padded  # [E]
    rem = padded % MAX_M  # [E]
    absorb = (padded > MAX_M) & (rem > 0) & (rem <= fat_tail)  # [E] last full tile takes the remainder
    n_tiles = (padded + MAX_M - 1) // MAX_M - absorb.to(torch.int64)  # [E]
    tile_end = torch.cumsum(n_tiles, 0)  # [E]
    slot = torch.arange(s, device=dev)
    e = torch.searchsorted(tile_end, slot, right=True).clamp(max=n_local - 1)  # [S]
    j = slot - (tile_end[e] - n_tiles[e])  # tile index inside its expert
    row0 = start[e] + MAX_M * j
    left = padded[e] - MAX_M * j  # [S] rows of the expert from this tile on
    last_fat = absorb[e] & (j == n_tiles[e] - 1)
    rows = torch.where(last_fat, left, left.clamp(max=MAX_M)).clamp(min=0)
    return RaggedTiles(
        sorted_ids=al.sorted_ids,
        tile_row=row0.to(torch.int32),
        tile_expert=e.to(torch.int32),
        tile_rows=rows.to(torch.int32),
        num_tiles=tile_end[-1:].to(torch.int32),
        num_rows=al.num_rows,
        fat_tail=fat_tail,
    )


ALIGN_CHUNK = 512  # assignments per program of the Triton alignment


def align_ragged_triton(ids: torch.Tensor, expert_range: tuple[int, int], fat_tail: int = 0) -> RaggedTiles:
    """`align_ragged_torch` in three Triton launches: per-chunk expert counts, one planning
    program (prefix sums, tile table), per-chunk stable scatter. Same outputs; runs under
    TRITON_INTERPRET=1 on CPU tensors too. Needs T*K >= 1.
    """
    _check_fat(fat_tail)
    if ids.dim() != 2:
        raise ValueError(f"ids must be [T, K], got shape {tuple(ids.shape)}")
    a, b = int(expert_range[0]), int(expert_range[1])
    if not 0 <= a < b:
        raise ValueError(f"expert_range must satisfy 0 <= a < b, got {expert_range}")
    n_local, n = b - a, ids.numel()
    p = max_padded_rows(n, n_local, MIN_M)
    s = max_tile_slots(n, n_local)
    dev = ids.device
    n_chunks = triton.cdiv(n, ALIGN_CHUNK)
    block_e = triton.next_power_of_2(n_local + 1)
    flat = ids.reshape(-1).contiguous()
    counts = torch.empty((n_chunks, block_e), dtype=torch.int32, device=dev)  # per-chunk histograms
    base = torch.empty((n_chunks, block_e), dtype=torch.int32, device=dev)  # rows of earlier chunks
    start = torch.empty(block_e, dtype=torch.int32, device=dev)  # first row per expert
    sorted_ids = torch.full((p,), n, dtype=torch.int32, device=dev)  # padding sentinel; scatter fills real rows
    tile_row = torch.empty(s, dtype=torch.int32, device=dev)
    tile_expert = torch.empty(s, dtype=torch.int32, device=dev)
    tile_rows = torch.empty(s, dtype=torch.int32, device=dev)
    num_tiles = torch.empty(1, dtype=torch.int32, device=dev)
    num_rows = torch.empty(1, dtype=torch.int32, device=dev)
    _align_count_kernel[(n_chunks,)](
        flat,
        counts,
        n,
        a,
        N_LOCAL=n_local,
        BLOCK_A=ALIGN_CHUNK,
        BLOCK_E=block_e,
        num_warps=4,
    )
    _align_plan_kernel[(1,)](
        counts,
        base,
        start,
        tile_row,
        tile_expert,
        tile_rows,
        num_tiles,
        num_rows,
        n_chunks,
        s,
        fat_tail,
        N_LOCAL=n_local,
        BLOCK_E=block_e,
        MAX_ROWS=MAX_M,
        MIN_ROWS=MIN_M,
        BLOCK_T=64,
        CHUNKS_P2=triton.next_power_of_2(n_chunks),
        SLOTS_P2=max(64, triton.next_power_of_2(s)),
        num_warps=4,
    )
    _align_scatter_kernel[(n_chunks,)](
        flat,
        base,
        start,
        sorted_ids,
        n,
        a,
        N_LOCAL=n_local,
        BLOCK_A=ALIGN_CHUNK,
        BLOCK_E=block_e,
        BLOCK_J=32,
        num_warps=8,
    )
    return RaggedTiles(sorted_ids, tile_row, tile_expert, tile_rows, num_tiles, num_rows, fat_tail)


@triton.jit
def _local_key(ids_ptr, offs, n_assign, expert_lo, N_LOCAL: tl.constexpr):
    # local expert of each flat assignment; N_LOCAL for other ranks' experts and lanes past n
    ok = offs < n_assign
    e = tl.load(ids_ptr + offs, mask=ok, other=-1).to(tl.int32) - expert_lo
    return tl.where(ok & (e >= 0) & (e < N_LOCAL), e, N_LOCAL)


@triton.jit
def _align_count_kernel(
    ids_ptr, counts_ptr, n_assign, expert_lo, N_LOCAL: tl.constexpr, BLOCK_A: tl.constexpr, BLOCK_E: tl.constexpr
):
    c = tl.program_id(0)
    key = _local_key(ids_ptr, c * BLOCK_A + tl.arange(0, BLOCK_A), n_assign, expert_lo, N_LOCAL)
    tl.store(counts_ptr + c * BLOCK_E + tl.arange(0, BLOCK_E), tl.histogram(key, BLOCK_E))


@triton.jit
def _align_plan_kernel(
    counts_ptr,
    base_ptr,
    start_ptr,
    tile_row_ptr,
    tile_expert_ptr,
    tile_rows_ptr,
    num_tiles_ptr,
    num_rows_ptr,
    n_chunks,
    num_slots,
    fat_tail,
    N_LOCAL: tl.constexpr,
    BLOCK_E: tl.constexpr,
    MAX_ROWS: tl.constexpr,
    MIN_ROWS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    CHUNKS_P2: tl.constexpr,
    SLOTS_P2: tl.constexpr,
):
    # NOTE: loop bounds are powers of two >= the run-time counts (masked), so one compiled kernel
    # serves every T between two powers of two instead of one compile per T.
    offs_e = tl.arange(0, BLOCK_E)
    total = tl.zeros((BLOCK_E,), dtype=tl.int32)
    for c in range(0, CHUNKS_P2):  # exclusive prefix over chunks: rows of an expert in earlier chunks
        ok = (tl.zeros((BLOCK_E,), dtype=tl.int32) + c) < n_chunks
        tl.store(base_ptr + c * BLOCK_E + offs_e, total, mask=ok)
        total += tl.load(counts_ptr + c * BLOCK_E + offs_e, mask=ok, other=0)
    is_e = offs_e < N_LOCAL
    padded = tl.where(is_e, (total + MIN_ROWS - 1) // MIN_ROWS * MIN_ROWS, 0)
    start = tl.cumsum(padded, 0) - padded
    tl.store(start_ptr + offs_e, start)
    rem = padded % MAX_ROWS
    absorb = (padded > MAX_ROWS) & (rem > 0) & (rem <= fat_tail)
    n_tiles = (padded + MAX_ROWS - 1) // MAX_ROWS - absorb.to(tl.int32)
    tile_end = tl.cumsum(n_tiles, 0)
    tl.store(num_tiles_ptr, tl.sum(n_tiles, 0))
    tl.store(num_rows_ptr, tl.sum(padded, 0))
    for t0 in range(0, SLOTS_P2, BLOCK_T):
        slot = t0 + tl.arange(0, BLOCK_T)
        done = (tile_end[None, :] <= slot[:, None]) & is_e[None, :]
        e = tl.minimum(tl.sum(done.to(tl.int32), axis=1), N_LOCAL - 1)  # [T] owner expert
        j = slot - (tl.gather(tile_end, e, 0) - tl.gather(n_tiles, e, 0))
        left = tl.gather(padded, e, 0) - MAX_ROWS * j
        last_fat = (tl.gather(absorb.to(tl.int32), e, 0) != 0) & (j == tl.gather(n_tiles, e, 0) - 1)
        rows = tl.maximum(tl.where(last_fat, left, tl.minimum(left, MAX_ROWS)), 0)
        ok = slot < num_slots
        tl.store(tile_row_ptr + slot, tl.gather(start, e, 0) + MAX_ROWS * j, mask=ok)
        tl.store(tile_expert_ptr + slot, e, mask=ok)
        tl.store(tile_rows_ptr + slot, rows, mask=ok)


@triton.jit
def _align_scatter_kernel(
    ids_ptr,
    base_ptr,
    start_ptr,
    sorted_ids_ptr,
    n_assign,
    expert_lo,
    N_LOCAL: tl.constexpr,
    BLOCK_A: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_J: tl.constexpr,
):
    c = tl.program_id(0)
    offs = c * BLOCK_A + tl.arange(0, BLOCK_A)
    key = _local_key(ids_ptr, offs, n_assign, expert_lo, N_LOCAL)
    # stable rank inside the chunk: earlier assignments of the chunk with the same expert
    rank = tl.zeros((BLOCK_A,), dtype=tl.int32)
    for j0 in range(0, BLOCK_A, BLOCK_J):
        offs_j = c * BLOCK_A + j0 + tl.arange(0, BLOCK_J)
        kj = _local_key(ids_ptr, offs_j, n_assign, expert_lo, N_LOCAL)
        same = (kj[None, :] == key[:, None]) & (offs_j[None, :] < offs[:, None])
        rank += tl.sum(same.to(tl.int32), axis=1)
    row0 = tl.load(start_ptr + key) + tl.load(base_ptr + c * BLOCK_E + key)
    tl.store(sorted_ids_ptr + row0 + rank, offs, mask=key < N_LOCAL)


@triton.jit
def _gather_rows(sorted_ids_ptr, first, n_valid, n_assign, TOP_K: tl.constexpr, BM: tl.constexpr):
    # token of each of the BM rows from `first` (-1: padding, or past the tile's rows)
    offs_r = tl.arange(0, BM)
    rid = tl.load(sorted_ids_ptr + first + offs_r, mask=offs_r < n_valid, other=n_assign)
    return tl.where(rid < n_assign, rid // TOP_K, -1).to(tl.int64)


@triton.jit
def _load_a(a_desc, x_ptr, tok, row0, k0, stride_xt, HIDDEN: tl.constexpr, BLOCK_K: tl.constexpr, GATHER: tl.constexpr):
    # [BM, K_] A tile: TMA from the expert-sorted xs, or gathered from x [T, H] by token
    if GATHER:
        offs_k = k0 + tl.arange(0, BLOCK_K)
        ptrs = x_ptr + tok[:, None] * stride_xt + offs_k[None, :]
        if HIDDEN % BLOCK_K == 0:
            return tl.load(ptrs, mask=tok[:, None] >= 0, other=0.0)
        else:
            return tl.load(ptrs, mask=(tok[:, None] >= 0) & (offs_k[None, :] < HIDDEN), other=0.0)
    else:
        return a_desc.load([row0, k0])


@triton.jit
def _w13_tile(
    a_desc,
    x_ptr,
    sorted_ids_ptr,
    n_assign,
    stride_xt,
    w_desc,
    act_ptr,
    row0,
    n_rows,
    g_row,
    n0,
    stride_am,
    alpha,
    limit,
    beta,
    INTER: tl.constexpr,
    HIDDEN: tl.constexpr,
    BM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
    TOP_K: tl.constexpr,
    GATHER: tl.constexpr,
    K_CHUNK: tl.constexpr,
):
    acc_g = tl.zeros((BM, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BM, BLOCK_N), dtype=tl.float32)
    tot_g = tl.zeros((BM, BLOCK_N), dtype=tl.float32)  # K_CHUNK > 0: the folded chunk partials
    tot_u = tl.zeros((BM, BLOCK_N), dtype=tl.float32)
    if GATHER:
        tok = _gather_rows(sorted_ids_ptr, row0, n_rows, n_assign, TOP_K, BM)
    else:
        tok = row0  # unused
    for k0 in range(0, HIDDEN, BLOCK_K):
        a = _load_a(a_desc, x_ptr, tok, row0, k0, stride_xt, HIDDEN, BLOCK_K, GATHER)  # [BM, K_]
        g = w_desc.load([g_row, k0])  # [N, K_]
        u = w_desc.load([g_row + INTER, k0])
        acc_g = tl.dot(a, g.T, acc_g, input_precision=PRECISION)
        acc_u = tl.dot(a, u.T, acc_u, input_precision=PRECISION)
        if K_CHUNK > 0:  # chunked sums (ragged_gate_up, moe_chunked): acc_* hold the chunk's partials
            tot_g, acc_g = fold_chunk(tot_g, acc_g, k0, HIDDEN, BLOCK_K, K_CHUNK)
            tot_u, acc_u = fold_chunk(tot_u, acc_u, k0, HIDDEN, BLOCK_K, K_CHUNK)
    if K_CHUNK > 0:
        acc_g, acc_u = tot_g, tot_u
    act = swiglu_oai_tile(acc_g, acc_u, alpha, limit, beta)  # SwiGLU-OAI on the fp32 accumulators
    offs_r = tl.arange(0, BM)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    ptrs = act_ptr + (row0 + offs_r)[:, None].to(tl.int64) * stride_am + offs_n[None, :]
    tl.store(ptrs, act.to(act_ptr.dtype.element_ty), mask=(offs_r[:, None] < n_rows) & (offs_n[None, :] < INTER))


@triton.jit
def _w13_fat_tile(
    a_main,
    a_tail,
    x_ptr,
    sorted_ids_ptr,
    n_assign,
    stride_xt,
    w_desc,
    act_ptr,
    row0,
    n_rows,
    g_row,
    n0,
    stride_am,
    alpha,
    limit,
    beta,
    INTER: tl.constexpr,
    HIDDEN: tl.constexpr,
    BM: tl.constexpr,
    TAIL: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
    TOP_K: tl.constexpr,
    GATHER: tl.constexpr,
    K_CHUNK: tl.constexpr,
):
    # BM + TAIL rows in one program: each weight tile feeds a BM-row and a TAIL-row MMA.
    acc_g = tl.zeros((BM, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BM, BLOCK_N), dtype=tl.float32)
    acc_gt = tl.zeros((TAIL, BLOCK_N), dtype=tl.float32)
    acc_ut = tl.zeros((TAIL, BLOCK_N), dtype=tl.float32)
    tot_g = tl.zeros((BM, BLOCK_N), dtype=tl.float32)  # K_CHUNK > 0: the folded chunk partials
    tot_u = tl.zeros((BM, BLOCK_N), dtype=tl.float32)
    tot_gt = tl.zeros((TAIL, BLOCK_N), dtype=tl.float32)
    tot_ut = tl.zeros((TAIL, BLOCK_N), dtype=tl.float32)
    if GATHER:
        tok = _gather_rows(sorted_ids_ptr, row0, BM, n_assign, TOP_K, BM)
        tok_t = _gather_rows(sorted_ids_ptr, row0 + BM, n_rows - BM, n_assign, TOP_K, TAIL)
    else:
        tok = row0  # unused
        tok_t = row0
    for k0 in range(0, HIDDEN, BLOCK_K):
        a = _load_a(a_main, x_ptr, tok, row0, k0, stride_xt, HIDDEN, BLOCK_K, GATHER)  # [BM, K_]
        at = _load_a(a_tail, x_ptr, tok_t, row0 + BM, k0, stride_xt, HIDDEN, BLOCK_K, GATHER)  # [TAIL, K_]
        g = w_desc.load([g_row, k0]).T  # [K_, N]
        u = w_desc.load([g_row + INTER, k0]).T
        acc_g = tl.dot(a, g, acc_g, input_precision=PRECISION)
        acc_u = tl.dot(a, u, acc_u, input_precision=PRECISION)
        acc_gt = tl.dot(at, g, acc_gt, input_precision=PRECISION)
        acc_ut = tl.dot(at, u, acc_ut, input_precision=PRECISION)
        if K_CHUNK > 0:  # chunked sums, as _w13_tile
            tot_g, acc_g = fold_chunk(tot_g, acc_g, k0, HIDDEN, BLOCK_K, K_CHUNK)
            tot_u, acc_u = fold_chunk(tot_u, acc_u, k0, HIDDEN, BLOCK_K, K_CHUNK)
            tot_gt, acc_gt = fold_chunk(tot_gt, acc_gt, k0, HIDDEN, BLOCK_K, K_CHUNK)
            tot_ut, acc_ut = fold_chunk(tot_ut, acc_ut, k0, HIDDEN, BLOCK_K, K_CHUNK)
    if K_CHUNK > 0:
        acc_g, acc_u, acc_gt, acc_ut = tot_g, tot_u, tot_gt, tot_ut
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_ok = offs_n[None, :] < INTER
    act = swiglu_oai_tile(acc_g, acc_u, alpha, limit, beta)
    offs_r = tl.arange(0, BM)
    ptrs = act_ptr + (row0 + offs_r)[:, None].to(tl.int64) * stride_am + offs_n[None, :]
    tl.store(ptrs, act.to(act_ptr.dtype.element_ty), mask=n_ok)
    act = swiglu_oai_tile(acc_gt, acc_ut, alpha, limit, beta)
    offs_t = tl.arange(0, TAIL)
    ptrs = act_ptr + (row0 + BM + offs_t)[:, None].to(tl.int64) * stride_am + offs_n[None, :]
    tl.store(ptrs, act.to(act_ptr.dtype.element_ty), mask=(offs_t[:, None] < n_rows - BM) & n_ok)


@triton.jit
def moe_w13_ragged_kernel(
    a128,
    a64,
    a32,
    a16,
    x_ptr,
    sorted_ids_ptr,
    w_desc,
    act_ptr,
    tile_row_ptr,
    tile_expert_ptr,
    tile_rows_ptr,
    num_tiles_ptr,
    n_assign,
    num_slots,
    group_m,
    stride_xt,
    stride_am,
    alpha,
    limit,
    beta,
    INTER: tl.constexpr,
    HIDDEN: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
    TOP_K: tl.constexpr,
    GATHER: tl.constexpr,
    FAT: tl.constexpr,
    K_CHUNK: tl.constexpr = 0,
):
    # GATHER: A rows gathered from x [T, H] by token (a* descriptors unused), else TMA from xs [P, H].
    # FAT: tail rows (32 or 64) a 128-row tile may carry (align_ragged fat_tail); 0 = none.
    # act[row, n] = SwiGLU-OAI(xs[row] . w13[e, n], xs[row] . w13[e, I + n]) for one ragged tile.
    pid = tl.program_id(0)
    slot, pid_n = tile_coords(pid, num_slots, tl.cdiv(INTER, BLOCK_N), group_m)
    if slot >= tl.load(num_tiles_ptr):
        return
    row0 = tl.load(tile_row_ptr + slot)
    n_rows = tl.load(tile_rows_ptr + slot)
    e = tl.load(tile_expert_ptr + slot)
    n0 = pid_n * BLOCK_N
    g_row = e * (2 * INTER) + n0
    if FAT == 32 and n_rows > 128:
        _w13_fat_tile(
            a128,
            a32,
            x_ptr,
            sorted_ids_ptr,
            n_assign,
            stride_xt,
            w_desc,
            act_ptr,
            row0,
            n_rows,
            g_row,
            n0,
            stride_am,
            alpha,
            limit,
            beta,
            INTER,
            HIDDEN,
            128,
            32,
            BLOCK_N,
            BLOCK_K,
            PRECISION,
            TOP_K,
            GATHER,
            K_CHUNK,
        )
    elif FAT == 64 and n_rows > 128:
        _w13_fat_tile(
            a128,
            a64,
            x_ptr,
            sorted_ids_ptr,
            n_assign,
            stride_xt,
            w_desc,
            act_ptr,
            row0,
            n_rows,
            g_row,
            n0,
            stride_am,
            alpha,
            limit,
            beta,
            INTER,
            HIDDEN,
            128,
            64,
            BLOCK_N,
            BLOCK_K,
            PRECISION,
            TOP_K,
            GATHER,
            K_CHUNK,
        )
    elif n_rows > 64:
        _w13_tile(
            a128,
            x_ptr,
            sorted_ids_ptr,
            n_assign,
            stride_xt,
            w_desc,
            act_ptr,
            row0,
            n_rows,
            g_row,
            n0,
            stride_am,
            alpha,
            limit,
            beta,
            INTER,
            HIDDEN,
            128,
            BLOCK_N,
            BLOCK_K,
            PRECISION,
            TOP_K,
            GATHER,
            K_CHUNK,
        )
    elif n_rows > 32:
        _w13_tile(
            a64,
            x_ptr,
            sorted_ids_ptr,
            n_assign,
            stride_xt,
            w_desc,
            act_ptr,
            row0,
            n_rows,
            g_row,
            n0,
            stride_am,
            alpha,
            limit,
            beta,
            INTER,
            HIDDEN,
            64,
            BLOCK_N,
            BLOCK_K,
            PRECISION,
            TOP_K,
            GATHER,
            K_CHUNK,
        )
    elif n_rows > 16:
        _w13_tile(
            a32,
            x_ptr,
            sorted_ids_ptr,
            n_assign,
            stride_xt,
            w_desc,
            act_ptr,
            row0,
            n_rows,
            g_row,
            n0,
            stride_am,
            alpha,
            limit,
            beta,
            INTER,
            HIDDEN,
            32,
            BLOCK_N,
            BLOCK_K,
            PRECISION,
            TOP_K,
            GATHER,
            K_CHUNK,
        )
    else:
        _w13_tile(
            a16,
            x_ptr,
            sorted_ids_ptr,
            n_assign,
            stride_xt,
            w_desc,
            act_ptr,
            row0,
            n_rows,
            g_row,
            n0,
            stride_am,
            alpha,
            limit,
            beta,
            INTER,
            HIDDEN,
            16,
            BLOCK_N,
            BLOCK_K,
            PRECISION,
            TOP_K,
            GATHER,
            K_CHUNK,
        )


@triton.jit
def _w2_tile(
    a_desc,
    w_desc,
    out_ptr,
    weights_ptr,
    sorted_ids_ptr,
    n_assign,
    row0,
    n_rows,
    w_row,
    n0,
    stride_or,
    HIDDEN: tl.constexpr,
    INTER: tl.constexpr,
    BM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
    K_CHUNK: tl.constexpr,
):
    acc = tl.zeros((BM, BLOCK_N), dtype=tl.float32)
    tot = tl.zeros((BM, BLOCK_N), dtype=tl.float32)  # K_CHUNK > 0: the folded chunk partials
    for k0 in range(0, INTER, BLOCK_K):
        a = a_desc.load([row0, k0])  # [BM, K_] of act
        b = w_desc.load([w_row, k0])  # [N, K_] of w2[e]
        acc = tl.dot(a, b.T, acc, input_precision=PRECISION)
        if K_CHUNK > 0:  # chunked sums, as _w13_tile
            tot, acc = fold_chunk(tot, acc, k0, INTER, BLOCK_K, K_CHUNK)
    if K_CHUNK > 0:
        acc = tot
    offs_r = tl.arange(0, BM)
    r_in = offs_r < n_rows
    rid = tl.load(sorted_ids_ptr + row0 + offs_r, mask=r_in, other=n_assign)
    row_ok = rid < n_assign
    w = tl.load(weights_ptr + rid, mask=row_ok, other=0.0).to(tl.float32)  # routing weights
    acc = acc * w[:, None]
    offs_n = n0 + tl.arange(0, BLOCK_N)
    ptrs = out_ptr + rid[:, None].to(tl.int64) * stride_or + offs_n[None, :]
    tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (offs_n[None, :] < HIDDEN))


@triton.jit
def _w2_rows_out(
    acc,
    out_ptr,
    weights_ptr,
    sorted_ids_ptr,
    n_assign,
    first,
    n_valid,
    n0,
    stride_or,
    HIDDEN: tl.constexpr,
    BM: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # scale rows [first, first + BM) (the first n_valid of them are real) by their routing weight
    # and write them to their (token, slot) row of out
    offs_r = tl.arange(0, BM)
    rid = tl.load(sorted_ids_ptr + first + offs_r, mask=offs_r < n_valid, other=n_assign)
    row_ok = rid < n_assign
    w = tl.load(weights_ptr + rid, mask=row_ok, other=0.0).to(tl.float32)
    acc = acc * w[:, None]
    offs_n = n0 + tl.arange(0, BLOCK_N)
    ptrs = out_ptr + rid[:, None].to(tl.int64) * stride_or + offs_n[None, :]
    tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (offs_n[None, :] < HIDDEN))


@triton.jit
def _w2_fat_tile(
    a_main,
    a_tail,
    w_desc,
    out_ptr,
    weights_ptr,
    sorted_ids_ptr,
    n_assign,
    row0,
    n_rows,
    w_row,
    n0,
    stride_or,
    HIDDEN: tl.constexpr,
    INTER: tl.constexpr,
    BM: tl.constexpr,
    TAIL: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
    K_CHUNK: tl.constexpr,
):
    acc = tl.zeros((BM, BLOCK_N), dtype=tl.float32)
    acc_t = tl.zeros((TAIL, BLOCK_N), dtype=tl.float32)
    tot = tl.zeros((BM, BLOCK_N), dtype=tl.float32)  # K_CHUNK > 0: the folded chunk partials
    tot_t = tl.zeros((TAIL, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, INTER, BLOCK_K):
        a = a_main.load([row0, k0])
        at = a_tail.load([row0 + BM, k0])
        b = w_desc.load([w_row, k0]).T
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        acc_t = tl.dot(at, b, acc_t, input_precision=PRECISION)
        if K_CHUNK > 0:  # chunked sums, as _w13_tile
            tot, acc = fold_chunk(tot, acc, k0, INTER, BLOCK_K, K_CHUNK)
            tot_t, acc_t = fold_chunk(tot_t, acc_t, k0, INTER, BLOCK_K, K_CHUNK)
    if K_CHUNK > 0:
        acc, acc_t = tot, tot_t
    _w2_rows_out(acc, out_ptr, weights_ptr, sorted_ids_ptr, n_assign, row0, BM, n0, stride_or, HIDDEN, BM, BLOCK_N)
    _w2_rows_out(
        acc_t,
        out_ptr,
        weights_ptr,
        sorted_ids_ptr,
        n_assign,
        row0 + BM,
        n_rows - BM,
        n0,
        stride_or,
        HIDDEN,
        TAIL,
        BLOCK_N,
    )


@triton.jit
def moe_w2_ragged_kernel(
    a128,
    a64,
    a32,
    a16,
    w_desc,
    out_ptr,
    weights_ptr,
    sorted_ids_ptr,
    tile_row_ptr,
    tile_expert_ptr,
    tile_rows_ptr,
    num_tiles_ptr,
    n_assign,
    num_slots,
    group_m,
    stride_or,
    HIDDEN: tl.constexpr,
    INTER: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
    FAT: tl.constexpr,
    K_CHUNK: tl.constexpr = 0,
):
    # out[rid, n] = weight[rid] * (act[row] . w2[e, n]) for the rows of one ragged tile, row -> rid.
    pid = tl.program_id(0)
    slot, pid_n = tile_coords(pid, num_slots, tl.cdiv(HIDDEN, BLOCK_N), group_m)
    if slot >= tl.load(num_tiles_ptr):
        return
    row0 = tl.load(tile_row_ptr + slot)
    n_rows = tl.load(tile_rows_ptr + slot)
    e = tl.load(tile_expert_ptr + slot)
    n0 = pid_n * BLOCK_N
    w_row = e * HIDDEN + n0
    if FAT == 32 and n_rows > 128:
        _w2_fat_tile(
            a128,
            a32,
            w_desc,
            out_ptr,
            weights_ptr,
            sorted_ids_ptr,
            n_assign,
            row0,
            n_rows,
            w_row,
            n0,
            stride_or,
            HIDDEN,
            INTER,
            128,
            32,
            BLOCK_N,
            BLOCK_K,
            PRECISION,
            K_CHUNK,
        )
    elif FAT == 64 and n_rows > 128:
        _w2_fat_tile(
            a128,
            a64,
            w_desc,
            out_ptr,
            weights_ptr,
            sorted_ids_ptr,
            n_assign,
            row0,
            n_rows,
            w_row,
            n0,
            stride_or,
            HIDDEN,
            INTER,
            128,
            64,
            BLOCK_N,
            BLOCK_K,
            PRECISION,
            K_CHUNK,
        )
    elif n_rows > 64:
        _w2_tile(
            a128,
            w_desc,
            out_ptr,
            weights_ptr,
            sorted_ids_ptr,
            n_assign,
            row0,
            n_rows,
            w_row,
            n0,
            stride_or,
            HIDDEN,
            INTER,
            128,
            BLOCK_N,
            BLOCK_K,
            PRECISION,
            K_CHUNK,
        )
    elif n_rows > 32:
        _w2_tile(
            a64,
            w_desc,
            out_ptr,
            weights_ptr,
            sorted_ids_ptr,
            n_assign,
            row0,
            n_rows,
            w_row,
            n0,
            stride_or,
            HIDDEN,
            INTER,
            64,
            BLOCK_N,
            BLOCK_K,
            PRECISION,
            K_CHUNK,
        )
    elif n_rows > 16:
        _w2_tile(
            a32,
            w_desc,
            out_ptr,
            weights_ptr,
            sorted_ids_ptr,
            n_assign,
            row0,
            n_rows,
            w_row,
            n0,
            stride_or,
            HIDDEN,
            INTER,
            32,
            BLOCK_N,
            BLOCK_K,
            PRECISION,
            K_CHUNK,
        )
    else:
        _w2_tile(
            a16,
            w_desc,
            out_ptr,
            weights_ptr,
            sorted_ids_ptr,
            n_assign,
            row0,
            n_rows,
            w_row,
            n0,
            stride_or,
            HIDDEN,
            INTER,
            16,
            BLOCK_N,
            BLOCK_K,
            PRECISION,
            K_CHUNK,
        )


def _a_descs(buf: torch.Tensor, block_k: int):
    from triton.tools.tensor_descriptor import TensorDescriptor

    return [TensorDescriptor.from_tensor(buf, [m, block_k]) for m in (128, 64, 32, 16)]


def ragged_gate_up(
    x: torch.Tensor,
    w13: torch.Tensor,
    tiles: RaggedTiles,
    tile,
    alpha: float,
    limit: float,
    beta: float,
    *,
    top_k: int = 0,
    k_chunk: int = 0,
) -> torch.Tensor:
    """Grouped GEMM 1 + SwiGLU-OAI over ragged tiles: act [P, I] in x.dtype.

    x: the expert-sorted rows xs [P, H] (`fused_moe.moe_permute` of `tiles`; A tiles through TMA),
    or with top_k > 0 the tokens x [T, H] themselves (A rows gathered per tile by sorted_ids // K).
    w13 [E, 2I, H]; tile: `fused_moe.GemmTile` (block_n SwiGLU columns, block_k, warps, stages,
    group_m). Weight tiles through TMA: H, I multiples of 8, contiguous last dimensions.
    k_chunk > 0: K summed in chunks of k_chunk columns, each chunk's fp32 partial from zero and
    folded into the total at the chunk's end (`split_k.fold_chunk`): the additions of
    `moe_chunked` (the batch-invariant MoE), so a row gets the chunked kernels' bits; it costs a
    second set of accumulators (registers); ``split_k.WHOLE_K_CHUNK``: one chunk, the kernels'
    plain chain (k_chunk 0's loop, the chunked kernels' bits for one chunk). Raises ValueError for
    a k_chunk that is not a multiple of 2 x block_k.
    """
    from triton.tools.tensor_descriptor import TensorDescriptor

    if k_chunk:
        check_k_chunk(k_chunk, tile)

    h = x.shape[1]
    p = tiles.sorted_ids.numel()
    inter = w13.shape[1] // 2
    act = torch.empty((p, inter), dtype=x.dtype, device=x.device)  # [P, I]
    slots = tiles.tile_row.numel()
    w_desc = TensorDescriptor.from_tensor(w13.reshape(-1, h), [tile.block_n, tile.block_k])  # [E*2I, H]
    gather = top_k > 0
    if x.stride(1) != 1:
        raise ValueError("ragged_gate_up: x must have a contiguous last dimension")
    n_assign = x.shape[0] * top_k if gather else p
    a_descs = _a_descs(act if gather else x, tile.block_k)  # unused (any valid descriptor) when gathering
    grid = (slots * triton.cdiv(inter, tile.block_n),)
    moe_w13_ragged_kernel[grid](
        *a_descs,
        x,
        tiles.sorted_ids,
        w_desc,
        act,
        tiles.tile_row,
        tiles.tile_expert,
        tiles.tile_rows,
        tiles.num_tiles,
        n_assign,
        slots,
        launch_group(tile, slots),
        x.stride(0),
        act.stride(0),
        float(alpha),
        float(limit),
        float(beta),
        INTER=inter,
        HIDDEN=h,
        BLOCK_N=tile.block_n,
        BLOCK_K=tile.block_k,
        PRECISION=dot_precision(x.dtype),
        TOP_K=max(top_k, 1),
        GATHER=gather,
        FAT=tiles.fat_tail,
        K_CHUNK=launch_chunk(k_chunk),
        num_warps=tile.num_warps,
        num_stages=tile.num_stages,
    )
    return act


def ragged_down(
    act: torch.Tensor, w2: torch.Tensor, tiles: RaggedTiles, weights: torch.Tensor, tile, k_chunk: int = 0
) -> torch.Tensor:
    """Grouped GEMM 2 + routing weight over ragged tiles: rows [T*K, H], rows[s] = weights[s] * W2[e] act[r].

    act [P, I] from `ragged_gate_up`; w2 [E, H, I]; weights [T, K] (fp32 use). Rows of slots not
    routed to a local expert are left unwritten (`fused_moe.moe_combine` masks them). k_chunk as
    `ragged_gate_up` (over I).
    """
    from triton.tools.tensor_descriptor import TensorDescriptor

    if k_chunk:
        check_k_chunk(k_chunk, tile)

    n_assign = weights.numel()
    h, inter = w2.shape[1], w2.shape[2]
    w_flat = weights.reshape(-1).to(torch.float32).contiguous()  # [T*K]
    rows = torch.empty((n_assign, h), dtype=act.dtype, device=act.device)  # [T*K, H]
    slots = tiles.tile_row.numel()
    w_desc = TensorDescriptor.from_tensor(w2.reshape(-1, inter), [tile.block_n, tile.block_k])  # [E*H, I]
    grid = (slots * triton.cdiv(h, tile.block_n),)
    moe_w2_ragged_kernel[grid](
        *_a_descs(act, tile.block_k),
        w_desc,
        rows,
        w_flat,
        tiles.sorted_ids,
        tiles.tile_row,
        tiles.tile_expert,
        tiles.tile_rows,
        tiles.num_tiles,
        n_assign,
        slots,
        launch_group(tile, slots),
        rows.stride(0),
        HIDDEN=h,
        INTER=inter,
        BLOCK_N=tile.block_n,
        BLOCK_K=tile.block_k,
        PRECISION=dot_precision(act.dtype),
        FAT=tiles.fat_tail,
        K_CHUNK=launch_chunk(k_chunk),
        num_warps=tile.num_warps,
        num_stages=tile.num_stages,
    )
    return rows


def mma_rows(tiles: RaggedTiles) -> torch.Tensor:
    """[1] int64: rows the MMAs compute over the used tiles (each tile's rows rounded up to its height).

    Diagnostic for the padding waste (compare with the real assignment count); tensor ops only.
    """
    r = tiles.tile_rows.to(torch.int64)
    height = torch.full_like(r, MAX_M + tiles.fat_tail)  # fat tiles: a MAX_M-row and a fat_tail-row MMA
    for h in (MAX_M, 64, 32, 16):  # smallest power of two >= rows, as the kernels branch
        height = torch.where(r <= h, torch.full_like(r, h), height)
    used = torch.arange(r.numel(), device=r.device) < tiles.num_tiles.to(torch.int64)
    return torch.where(used, height, torch.zeros_like(height)).sum().reshape(1)

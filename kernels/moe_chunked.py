"""Chunked-K grouped GEMMs of the aligned fused MoE (``MoEKernelConfig.k_chunk > 0``: the
batch-invariant config of kernels/invariant_ops.py), optionally split over programs.

Governing idea: the reduction of each output element is DEFINED as an fp32 partial per fixed K
chunk of ``k_chunk`` columns (each from zero, in BLOCK_K steps), then a left-to-right sum of the
chunk partials in fp32. One program may walk all the chunks in one software-pipelined K loop that
folds each chunk's partial into the total at the chunk's end (prefill-sized launches), or the
chunks may run as separate programs (``split``: decode-sized launches, where a 64-row tile per
active expert leaves most SMs idle) whose partials the last program of the tile to finish adds
in chunk order (kernels/split_k.py): the same additions in the same order, so the same bits
whichever way a launch runs, and whatever T is. The epilogue (SwiGLU-OAI for the gate/up GEMM;
the routing weight and the scatter to the (token, slot) row for the down GEMM) runs on the summed
fp32 accumulators, as in kernels/fused_moe.py's aligned kernels. k_chunk must be a multiple of
2 x BLOCK_K (a one-step chunk's ``acc + dot(a, b, 0)`` may be folded by the compiler into
``dot(a, b, acc)``, another order).

Layout and arguments as ``fused_moe.moe_gate_up`` / ``moe_down`` (aligned rows, x gathered per
tile). Partials: fp32 [chunks, P, 2I] (gate columns then up columns) and [chunks, P, H]; only
rows of real assignments are written and read (padding rows sum to zero, as unsplit).

Shape legend: T tokens, H hidden, I expert width, E local experts, K experts per token,
P padded rows (moe_align).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from m3_kernels.moe_align import AlignedAssignments
from m3_kernels.moe_tiles import GemmTile, dot_precision, launch_group, swiglu_oai_tile, tile_coords
from m3_kernels.split_k import (
    combine_chunks,
    k_step,
    k_step_pair,
    last_to_arrive,
    launch_chunk,
    reset_counter,
    tile_counters,
)


def check_k_chunk(k_chunk: int, *tiles: GemmTile) -> None:
    """Raises ValueError unless k_chunk is a positive multiple of 2 x block_k of every tile."""
    for tile in tiles:
        if k_chunk <= 0 or k_chunk % (2 * tile.block_k):
            raise ValueError(f"k_chunk {k_chunk} must be a positive multiple of 2 x block_k ({tile.block_k})")


@triton.jit
def _w13_step_tiles(a_ptrs, g_ptrs, u_ptrs, row_ok, n_ok, offs_k, k0, HIDDEN, BLOCK_K: tl.constexpr):
    # the x [M, BK] and gate / up [BK, N] tiles of the K step at k0 (pointers already at k0)
    if HIDDEN % BLOCK_K == 0:  # no K mask (masks zero what lies past H: the same sums)
        a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
        g = tl.load(g_ptrs, mask=n_ok[None, :], other=0.0)
        u = tl.load(u_ptrs, mask=n_ok[None, :], other=0.0)
    else:
        k_ok = offs_k < HIDDEN - k0
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        g = tl.load(g_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        u = tl.load(u_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
    return a, g, u


@triton.jit
def _w13_chunk(a_ptrs, g_ptrs, u_ptrs, row_ok, n_ok, offs_k, k_lo, HIDDEN, BLOCK_M, BLOCK_N, BLOCK_K, K_CHUNK,
               PRECISION):  # fmt: skip
    # (gate, up) partials over k in [k_lo, min(k_lo + K_CHUNK, H)), from zero, in BLOCK_K steps
    part_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    part_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    a_ptrs += k_lo
    g_ptrs += k_lo
    u_ptrs += k_lo
    for k0 in range(k_lo, tl.minimum(k_lo + K_CHUNK, HIDDEN), BLOCK_K):
        a, g, u = _w13_step_tiles(a_ptrs, g_ptrs, u_ptrs, row_ok, n_ok, offs_k, k0, HIDDEN, BLOCK_K)
        part_g = tl.dot(a, g, part_g, input_precision=PRECISION)
        part_u = tl.dot(a, u, part_u, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    return part_g, part_u


@triton.jit(do_not_specialize=["num_rows_p"])
def moe_w13_chunked_kernel(
    x_ptr,
    w13_ptr,
    act_ptr,
    part_ptr,
    count_ptr,
    sorted_ids_ptr,
    tile_expert_ptr,
    num_rows_ptr,
    n_assign,
    num_tiles_m,
    group_m,
    num_rows_p,
    stride_xt,
    stride_we,
    stride_wn,
    stride_am,
    alpha,
    limit,
    beta,
    TOP_K: tl.constexpr,
    INTER: tl.constexpr,
    HIDDEN: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    K_CHUNK: tl.constexpr,
    SPLIT: tl.constexpr,
    PRECISION: tl.constexpr,
):
    # act[row, n] = SwiGLU-OAI(x[tok] . w13[e, n], x[tok] . w13[e, I + n]), each dot summed by K
    # chunks (module docstring). Program (tile [, chunk]); the tile's chunks in chunk order.
    pid = tl.program_id(0)
    pid_m, pid_n = tile_coords(pid, num_tiles_m, tl.cdiv(INTER, BLOCK_N), group_m)
    if pid_m * BLOCK_M >= tl.load(num_rows_ptr):
        return
    e = tl.load(tile_expert_ptr + pid_m).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < INTER
    offs_k = tl.arange(0, BLOCK_K)
    rid = tl.load(sorted_ids_ptr + offs_m)  # [M] flat (token, slot) ids; n_assign = padding
    row_ok = rid < n_assign
    tok = (rid // TOP_K).to(tl.int64)
    a_ptrs = x_ptr + tok[:, None] * stride_xt + offs_k[None, :]  # [M, K_]
    g_ptrs = w13_ptr + e * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]  # [K_, N]
    u_ptrs = g_ptrs + INTER * stride_wn  # up rows follow the gate rows (spec §2.2)
    out_ptrs = act_ptr + offs_m[:, None].to(tl.int64) * stride_am + offs_n[None, :]
    if SPLIT:
        c = tl.program_id(1)
        part_g, part_u = _w13_chunk(a_ptrs, g_ptrs, u_ptrs, row_ok, n_ok, offs_k, c * K_CHUNK, HIDDEN, BLOCK_M,
                                    BLOCK_N, BLOCK_K, K_CHUNK, PRECISION)  # fmt: skip
        pg_ptrs = part_ptr + offs_m[:, None].to(tl.int64) * (2 * INTER) + offs_n[None, :]  # chunk 0, gate
        ok = row_ok[:, None] & n_ok[None, :]
        chunk_stride = num_rows_p.to(tl.int64) * (2 * INTER)
        tl.store(pg_ptrs + c * chunk_stride, part_g, mask=ok)
        tl.store(pg_ptrs + c * chunk_stride + INTER, part_u, mask=ok)
        n_chunks = tl.cdiv(HIDDEN, K_CHUNK)
        if last_to_arrive(count_ptr + pid, n_chunks):
            # chunk order, whichever program came last
            acc_g = combine_chunks(pg_ptrs, chunk_stride, n_chunks, ok, BLOCK_M, BLOCK_N)
            acc_u = combine_chunks(pg_ptrs + INTER, chunk_stride, n_chunks, ok, BLOCK_M, BLOCK_N)
            act = swiglu_oai_tile(acc_g, acc_u, alpha, limit, beta)
            tl.store(out_ptrs, act.to(act_ptr.dtype.element_ty), mask=n_ok[None, :])
            reset_counter(count_ptr + pid)
    else:
        # one pipelined K loop, each chunk's partials folded at its end (split_k.k_step / fold_chunk):
        # the additions of the split launch's combine, in its order (K_CHUNK 0: one chain)
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        part_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        part_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, HIDDEN, BLOCK_K):
            a, g, u = _w13_step_tiles(a_ptrs + k0, g_ptrs + k0, u_ptrs + k0, row_ok, n_ok, offs_k, k0, HIDDEN, BLOCK_K)
            acc_g, part_g, acc_u, part_u = k_step_pair(
                acc_g, part_g, acc_u, part_u, a, g, u, k0, HIDDEN, BLOCK_K, K_CHUNK, PRECISION
            )
        act = swiglu_oai_tile(acc_g, acc_u, alpha, limit, beta)  # padding rows: SwiGLU(0), never stored later
        tl.store(out_ptrs, act.to(act_ptr.dtype.element_ty), mask=n_ok[None, :])


@triton.jit
def _w2_step_tiles(a_ptrs, b_ptrs, n_ok, offs_k, k0, INTER, BLOCK_K: tl.constexpr):
    # the act [M, BK] and w2 [BK, N] tiles of the K step at k0 (pointers already at k0)
    if INTER % BLOCK_K == 0:  # no K mask
        a = tl.load(a_ptrs)  # padding rows: finite SwiGLU(0) values
        b = tl.load(b_ptrs, mask=n_ok[None, :], other=0.0)
    else:
        k_ok = offs_k < INTER - k0
        a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
    return a, b


@triton.jit
def _w2_chunk(a_ptrs, b_ptrs, n_ok, offs_k, k_lo, INTER, BLOCK_M, BLOCK_N, BLOCK_K, K_CHUNK, PRECISION):
    # partial over k in [k_lo, min(k_lo + K_CHUNK, I)), from zero, in BLOCK_K steps
    part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    a_ptrs += k_lo
    b_ptrs += k_lo
    for k0 in range(k_lo, tl.minimum(k_lo + K_CHUNK, INTER), BLOCK_K):
        a, b = _w2_step_tiles(a_ptrs, b_ptrs, n_ok, offs_k, k0, INTER, BLOCK_K)
        part = tl.dot(a, b, part, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    return part


@triton.jit(do_not_specialize=["num_rows_p"])
def moe_w2_chunked_kernel(
    act_ptr,
    w2_ptr,
    out_ptr,
    part_ptr,
    count_ptr,
    weights_ptr,
    sorted_ids_ptr,
    tile_expert_ptr,
    num_rows_ptr,
    n_assign,
    num_tiles_m,
    group_m,
    num_rows_p,
    stride_am,
    stride_we,
    stride_wh,
    stride_or,
    HIDDEN: tl.constexpr,
    INTER: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    K_CHUNK: tl.constexpr,
    SPLIT: tl.constexpr,
    PRECISION: tl.constexpr,
):
    # out[rid, n] = weight[rid] * (act[row] . w2[e, n]), the dot summed by K chunks (module
    # docstring), for the rows of one tile, row -> rid. Program (tile [, chunk]).
    pid = tl.program_id(0)
    pid_m, pid_n = tile_coords(pid, num_tiles_m, tl.cdiv(HIDDEN, BLOCK_N), group_m)
    if pid_m * BLOCK_M >= tl.load(num_rows_ptr):
        return
    e = tl.load(tile_expert_ptr + pid_m).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rid = tl.load(sorted_ids_ptr + offs_m)
    row_ok = rid < n_assign
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < HIDDEN
    offs_k = tl.arange(0, BLOCK_K)
    ok = row_ok[:, None] & n_ok[None, :]
    a_ptrs = act_ptr + offs_m[:, None].to(tl.int64) * stride_am + offs_k[None, :]  # [M, K_]
    b_ptrs = w2_ptr + e * stride_we + offs_n[None, :].to(tl.int64) * stride_wh + offs_k[:, None]  # [K_, N]
    out_ptrs = out_ptr + rid[:, None].to(tl.int64) * stride_or + offs_n[None, :]
    if SPLIT:
        c = tl.program_id(1)
        part = _w2_chunk(
            a_ptrs, b_ptrs, n_ok, offs_k, c * K_CHUNK, INTER, BLOCK_M, BLOCK_N, BLOCK_K, K_CHUNK, PRECISION
        )
        p_ptrs = part_ptr + offs_m[:, None].to(tl.int64) * HIDDEN + offs_n[None, :]  # chunk 0
        chunk_stride = num_rows_p.to(tl.int64) * HIDDEN
        tl.store(p_ptrs + c * chunk_stride, part, mask=ok)
        n_chunks = tl.cdiv(INTER, K_CHUNK)
        if last_to_arrive(count_ptr + pid, n_chunks):
            acc = combine_chunks(p_ptrs, chunk_stride, n_chunks, ok, BLOCK_M, BLOCK_N)  # chunk order
            w = tl.load(weights_ptr + rid, mask=row_ok, other=0.0).to(tl.float32)  # [M] routing weights
            tl.store(out_ptrs, (acc * w[:, None]).to(out_ptr.dtype.element_ty), mask=ok)
            reset_counter(count_ptr + pid)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, INTER, BLOCK_K):  # one pipelined K loop, chunks folded as above
            a, b = _w2_step_tiles(a_ptrs + k0, b_ptrs + k0, n_ok, offs_k, k0, INTER, BLOCK_K)
            acc, part = k_step(acc, part, a, b, k0, INTER, BLOCK_K, K_CHUNK, PRECISION)
        w = tl.load(weights_ptr + rid, mask=row_ok, other=0.0).to(tl.float32)
        tl.store(out_ptrs, (acc * w[:, None]).to(out_ptr.dtype.element_ty), mask=ok)


def _split_counters(device: torch.device, tiles: int, chunks: int, split_below: int) -> torch.Tensor | None:
    # The counter buffer when this launch runs its chunks as separate programs, else None.
    if chunks < 2 or tiles >= split_below:
        return None
    return tile_counters(device, tiles)


def chunked_gate_up(
    x: torch.Tensor,
    w13: torch.Tensor,
    aligned: AlignedAssignments,
    top_k: int,
    tile: GemmTile,
    k_chunk: int,
    split_below: int,
    alpha: float,
    limit: float,
    beta: float,
) -> torch.Tensor:
    """``fused_moe.moe_gate_up`` (x gathered per tile) with the chunked-K reduction: act [P, I] in
    x.dtype (x [T, H] and w13 [E, 2I, H] copied first if their last dim is strided). The K chunks run as separate
    programs when the grid has fewer than ``split_below`` tiles and H spans >= 2 chunks (same bits;
    module docstring); an unsplit launch walks K in one software-pipelined loop that folds each
    chunk's partial at the chunk's end (``split_k.fold_chunk``): the same additions. Raises
    ValueError for a bad k_chunk."""
    check_k_chunk(k_chunk, tile)
    x, w13 = x if x.stride(1) == 1 else x.contiguous(), w13 if w13.stride(2) == 1 else w13.contiguous()
    h = x.shape[1]
    inter = w13.shape[1] // 2
    bm = aligned.block_m
    p = aligned.sorted_ids.numel()
    num_tiles_m = p // bm
    tiles = num_tiles_m * triton.cdiv(inter, tile.block_n)
    chunks = triton.cdiv(h, k_chunk)
    act = torch.empty((p, inter), dtype=x.dtype, device=x.device)  # [P, I]
    counters = _split_counters(x.device, tiles, chunks, split_below)
    split = counters is not None
    part = torch.empty((chunks, p, 2 * inter), dtype=torch.float32, device=x.device) if split else act
    moe_w13_chunked_kernel[(tiles, chunks) if split else (tiles,)](
        x, w13, act, part, counters if split else act, aligned.sorted_ids, aligned.tile_expert, aligned.num_rows,
        x.shape[0] * top_k, num_tiles_m, launch_group(tile, num_tiles_m), p,
        x.stride(0), w13.stride(0), w13.stride(1), act.stride(0), float(alpha), float(limit), float(beta),
        TOP_K=top_k, INTER=inter, HIDDEN=h, BLOCK_M=bm, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
        K_CHUNK=launch_chunk(k_chunk), SPLIT=split, PRECISION=dot_precision(x.dtype),
        num_warps=tile.num_warps, num_stages=tile.num_stages,
    )  # fmt: skip
    return act


def chunked_down(
    act: torch.Tensor,
    w2: torch.Tensor,
    aligned: AlignedAssignments,
    weights: torch.Tensor,
    tile: GemmTile,
    k_chunk: int,
    split_below: int,
) -> torch.Tensor:
    """``fused_moe.moe_down`` with the chunked-K reduction: rows [T*K, H] in act.dtype, rows[s] =
    weights[s] * W2[e] act[r] for the slots of local experts; act [P, I] from ``chunked_gate_up``, w2
    [E, H, I]. Split or one loop as ``chunked_gate_up`` (same bits either way). Raises ValueError for a
    bad k_chunk."""
    check_k_chunk(k_chunk, tile)
    w2 = w2 if w2.stride(2) == 1 else w2.contiguous()
    n_assign = weights.numel()
    h, inter = w2.shape[1], w2.shape[2]
    bm = aligned.block_m
    p = aligned.sorted_ids.numel()
    num_tiles_m = p // bm
    tiles = num_tiles_m * triton.cdiv(h, tile.block_n)
    chunks = triton.cdiv(inter, k_chunk)
    w_flat = weights.reshape(-1).to(torch.float32).contiguous()  # [T*K]
    rows = torch.empty((n_assign, h), dtype=act.dtype, device=act.device)  # [T*K, H]
    counters = _split_counters(act.device, tiles, chunks, split_below)
    split = counters is not None
    part = torch.empty((chunks, p, h), dtype=torch.float32, device=act.device) if split else rows
    moe_w2_chunked_kernel[(tiles, chunks) if split else (tiles,)](
        act, w2, rows, part, counters if split else rows, w_flat, aligned.sorted_ids, aligned.tile_expert,
        aligned.num_rows, n_assign, num_tiles_m, launch_group(tile, num_tiles_m), p,
        act.stride(0), w2.stride(0), w2.stride(1), rows.stride(0),
        HIDDEN=h, INTER=inter, BLOCK_M=bm, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
        K_CHUNK=launch_chunk(k_chunk), SPLIT=split, PRECISION=dot_precision(act.dtype),
        num_warps=tile.num_warps, num_stages=tile.num_stages,
    )  # fmt: skip
    return rows

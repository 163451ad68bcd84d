"""Fused routed-expert MoE for the GPU: two Triton grouped GEMMs and a weighted combine (spec §3.6-3.7).

Governing idea: after `moe_align.align_by_expert` lays the (token, slot) assignments out in
expert-contiguous, tile-padded rows, one grouped GEMM over the stacked gate/up weights computes
both halves for the same output columns in one program and applies SwiGLU-OAI to its fp32
accumulators (spec §3.7) before anything is rounded; a second grouped GEMM over the down
weights scales each row by its routing weight (which already carries routed_scaling_factor,
spec §3.6 step 4) and writes it to the row of its (token, slot); a combine kernel sums the K
slots of each token. Every buffer size and launch grid depends only on shapes, so the op has no
host sync and replays under CUDA graphs at fixed decode batch sizes.

Two layouts of the rows (`default_config` picks by rows per expert): decode sizes pad every
expert to one tile height BLOCK_M (16/32) and gather A rows x[token] per tile; from 32 rows per
expert on (T=4096 on the real shape: ~128, where padding to 128 would compute 1.47x the real
rows) ragged tiles (`kernels/moe_ragged.py`: rows padded to 16, 128-row tiles plus a 16..64-row
tail, weight tiles through TMA). Programs run in groups of row tiles (`tile_coords`) so that all
row tiles of an expert read each weight tile at nearly the same time (once from HBM) and a
group's A rows stay in L2.

PyTorch reference: `m3_rollout.model.moe.grouped_experts` (with `swiglu_oai`). Numerics (spec §6):
bf16/fp16 weights and activations, fp32 accumulation and activation math, the SwiGLU output
rounded to the activation dtype once (as the reference does), routed rows weighted in fp32 and
rounded once, the K-slot sum in fp32.

Expert parallelism (design.md §3.5): the weights may hold only the local experts [a, b) of E;
`expert_range=(a, b)` maps global id e to local row e - a, and assignments outside [a, b)
contribute nothing (the EP combine adds other ranks' parts).

Shape legend:
  T  tokens   H  hidden size   I  expert FFN width   E  local experts   K  experts per token
  P  padded rows (see moe_align)   M/N/K_  tile sizes BLOCK_M / BLOCK_N / BLOCK_K
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from m3_kernels.moe_align import CHUNKED_SMALL_ALIGN_MAX_ASSIGNMENTS, AlignedAssignments, align_by_expert
from m3_kernels.moe_chunked import chunked_down, chunked_gate_up
from m3_kernels.moe_ragged import align_ragged, ragged_down, ragged_gate_up
from m3_kernels.moe_tiles import FAT_TAIL, GemmTile, dot_precision, launch_group, swiglu_oai_tile, tile_coords

try:  # host-side TMA descriptors (triton >= 3.4); without them the pointer-load kernels run
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover
    TensorDescriptor = None

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class MoEKernelConfig:
    """Tiles for one fused-MoE call. block_m (rows per tile, the alignment padding) is shared.

    w13: tile of the gate/up GEMM; its block_n counts SwiGLU output columns, so each program
    reads 2 * block_n weight rows (block_n gate rows and the matching up rows).
    w2: tile of the down GEMM (block_n = hidden columns, block_k over I).
    permute: first gather x into an expert-sorted [P, H] buffer (`moe_permute`) so the gate/up
      GEMM reads its A rows contiguously (TMA on the ragged path) instead of gathering x[token]
      per tile.
    tma: both GEMMs load their A and weight tiles through TMA tensor descriptors (implies
      permute; needs H and I multiples of 8 and `triton.tools.tensor_descriptor`).
    ragged: rows padded per expert to 16 only and cut into 128-row tiles plus one 16/32/64/128
      tail per expert (`moe_ragged`, weights through TMA; A gathered in the GEMM, or from the
      permuted copy with permute=True). block_m and the tiles also serve the aligned fallback
      when x/w13/w2 are not TMA-aligned. Large T.
    fat_tail: with ragged, 0, 32 or 64 (`moe_tiles.FAT_TAIL` = 64 on the default path): a
      remainder that small rides along with the expert's last full tile (one program, each
      weight tile loaded once for both MMAs).
    k_chunk: 0, or both GEMMs sum K in fixed chunks of this many columns (a multiple of 2 x
      block_k) whose fp32 partials are added in chunk order: the batch-invariant config
      (kernels/invariant_ops.py). On the aligned layout (no permute / TMA) `moe_chunked`'s
      kernels; with ragged, the ragged kernels fold each chunk at its end (the same additions,
      so the same bits as the aligned chunked kernels, whatever the tile heights).
      ``split_k.WHOLE_K_CHUNK``: one chunk, the whole K as one chain in either family (never
      split; the ragged kernels' k_chunk-0 loop).
    split_k_below: with k_chunk on the aligned layout, a GEMM whose grid has fewer tiles than
      this runs its K chunks as separate programs (decode sizes; the bits do not change,
      `moe_chunked`).
    """

    block_m: int
    w13: GemmTile
    w2: GemmTile
    permute: bool = False
    tma: bool = False
    ragged: bool = False
    fat_tail: int = 0
    k_chunk: int = 0
    split_k_below: int = 0


# fp32 tiles take twice the shared memory of bf16 ones: the ragged tiles at 4 stages need 377 KB (w13) /
# 410 KB (w2) in fp32 against 227 KB per SM on H100/H200, so fp32 (a test / reference dtype) pipelines
# at most 2 deep (164 / 180 KB; tests/test_kernels_smem.py compiles them for sm_90 and checks).
FP32_MAX_STAGES = 2


def config_for_dtype(cfg: MoEKernelConfig, dtype: torch.dtype) -> MoEKernelConfig:
    """``cfg`` with the pipelining depth of both GEMM tiles capped at FP32_MAX_STAGES for fp32 inputs."""
    if dtype != torch.float32:
        return cfg
    return replace(
        cfg,
        w13=replace(cfg.w13, num_stages=min(cfg.w13.num_stages, FP32_MAX_STAGES)),
        w2=replace(cfg.w2, num_stages=min(cfg.w2.num_stages, FP32_MAX_STAGES)),
    )


def default_config(num_assignments: int, num_local_experts: int, hidden: int, inter: int) -> MoEKernelConfig:
    """Heuristic tiles from the mean rows per local expert (no autotuning: fixed, graph-safe choice).

    NOTE: few rows per expert (decode, < 32) is weight-bandwidth bound: smallest legal tile
    height (16, the tensor-core minimum) and narrow N tiles so there are several programs per SM
    streaming weights (`bench_moe.py --sweep`, H200, 2026-11-29). From 32 rows per expert on, the
    ragged-tile path (`moe_ragged`, fat tail 64, A rows gathered in the GEMM): padding every
    expert to one tile height computes up to 1.47x the real rows (T=4096 on the real shape:
    128 +- 11 rows per expert); ragged tiles compute ~1.2x, read each weight tile once per expert,
    and run in groups of 4 row tiles (`tile_coords`). Measured on the real shape, H200, CUDA-graph
    replay (two device rounds, 2026-11-29): T=1024 3.75 ms vs 4.05 (block_m 64) / 4.95 (block_m
    32); T=2048 3.95 vs 4.70; T=4096 per GEMM: w13 2.89 ms at 4 stages vs 3.01 at 3, w2 with
    block_n 256 1.34 ms vs 1.63 with 128. Figures: docs/benchmarks.md.
    """
    rows = num_assignments / max(num_local_experts, 1)
    if rows <= 16:
        return MoEKernelConfig(16, GemmTile(32, 128, 4, 4), GemmTile(64, 128, 4, 4))
    if rows < 32:
        return MoEKernelConfig(32, GemmTile(64, 64, 4, 4), GemmTile(64, 64, 4, 4))
    # block_m / tiles also serve the aligned fallback when H or I is not TMA-aligned
    return MoEKernelConfig(128, GemmTile(128, 64, 8, 4, 4), GemmTile(256, 64, 8, 4, 4), ragged=True, fat_tail=FAT_TAIL)


@triton.jit
def _moe_w13_swiglu_kernel(
    x_ptr,
    w13_ptr,
    act_ptr,
    sorted_ids_ptr,
    tile_expert_ptr,
    num_rows_ptr,
    n_assign,
    num_tiles_m,
    group_m,
    stride_xt,
    stride_xh,
    stride_we,
    stride_wn,
    stride_wh,
    stride_am,
    stride_ai,
    alpha,
    limit,
    beta,
    TOP_K: tl.constexpr,
    INTER: tl.constexpr,
    HIDDEN: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    PRECISION: tl.constexpr,
    A_SORTED: tl.constexpr,
):
    # act[row, n] = SwiGLU-OAI(x[tok] . w13[e, n], x[tok] . w13[e, I + n]) for the rows of one tile.
    # A_SORTED: x is already the expert-sorted [P, H] buffer of moe_permute (row = tile row, padding 0).
    pid = tl.program_id(0)
    pid_m, pid_n = tile_coords(pid, num_tiles_m, tl.cdiv(INTER, BLOCK_N), group_m)
    if pid_m * BLOCK_M >= tl.load(num_rows_ptr):
        return
    e = tl.load(tile_expert_ptr + pid_m).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < INTER
    offs_k = tl.arange(0, BLOCK_K)
    if A_SORTED:
        row_ok = offs_m >= 0  # all rows readable; padding rows are zeros
        a_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xt + offs_k[None, :] * stride_xh  # [M, K_]
    else:
        rid = tl.load(sorted_ids_ptr + offs_m)  # [M] flat (token, slot) ids; n_assign = padding
        row_ok = rid < n_assign
        tok = (rid // TOP_K).to(tl.int64)
        a_ptrs = x_ptr + tok[:, None] * stride_xt + offs_k[None, :] * stride_xh  # [M, K_]
    g_ptrs = w13_ptr + e * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None] * stride_wh
    u_ptrs = g_ptrs + INTER * stride_wn  # up rows follow the gate rows (spec §2.2, not interleaved)
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, HIDDEN, BLOCK_K):
        if EVEN_K:
            if A_SORTED:
                a = tl.load(a_ptrs)
            else:
                a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
            g = tl.load(g_ptrs, mask=n_ok[None, :], other=0.0)
            u = tl.load(u_ptrs, mask=n_ok[None, :], other=0.0)
        else:
            k_ok = offs_k < HIDDEN - k0
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            g = tl.load(g_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            u = tl.load(u_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc_g = tl.dot(a, g, acc_g, input_precision=PRECISION)
        acc_u = tl.dot(a, u, acc_u, input_precision=PRECISION)
        a_ptrs += BLOCK_K * stride_xh
        g_ptrs += BLOCK_K * stride_wh
        u_ptrs += BLOCK_K * stride_wh
    act = swiglu_oai_tile(acc_g, acc_u, alpha, limit, beta)  # on the fp32 accumulators
    out_ptrs = act_ptr + offs_m[:, None].to(tl.int64) * stride_am + offs_n[None, :] * stride_ai
    tl.store(out_ptrs, act.to(act_ptr.dtype.element_ty), mask=n_ok[None, :])


@triton.jit
def _moe_w2_weighted_kernel(
    act_ptr,
    w2_ptr,
    out_ptr,
    weights_ptr,
    sorted_ids_ptr,
    tile_expert_ptr,
    num_rows_ptr,
    n_assign,
    num_tiles_m,
    group_m,
    stride_am,
    stride_ai,
    stride_we,
    stride_wh,
    stride_wi,
    stride_or,
    stride_oh,
    HIDDEN: tl.constexpr,
    INTER: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    # out[rid, n] = weight[rid] * (act[row] . w2[e, n]) for the rows of one tile, row -> rid.
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
    a_ptrs = act_ptr + offs_m[:, None].to(tl.int64) * stride_am + offs_k[None, :] * stride_ai  # [M, K_]
    b_ptrs = w2_ptr + e * stride_we + offs_n[None, :].to(tl.int64) * stride_wh + offs_k[:, None] * stride_wi
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, INTER, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs)  # padding rows hold finite SwiGLU(0) values, dropped at the store
            b = tl.load(b_ptrs, mask=n_ok[None, :], other=0.0)
        else:
            k_ok = offs_k < INTER - k0
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K * stride_ai
        b_ptrs += BLOCK_K * stride_wi
    w = tl.load(weights_ptr + rid, mask=row_ok, other=0.0).to(tl.float32)  # [M] routing weights
    acc = acc * w[:, None]
    out_ptrs = out_ptr + rid[:, None].to(tl.int64) * stride_or + offs_n[None, :] * stride_oh
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _moe_permute_kernel(
    x_ptr,
    xs_ptr,
    sorted_ids_ptr,
    num_rows_ptr,
    n_assign,
    stride_xt,
    stride_xh,
    stride_st,
    stride_sh,
    TOP_K: tl.constexpr,
    HIDDEN: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    # xs[row] = x[sorted_ids[row] // K] for the rows in use; padding rows get zeros.
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    if tl.program_id(0) * BLOCK_R >= tl.load(num_rows_ptr):
        return
    rid = tl.load(sorted_ids_ptr + offs_r)
    row_ok = rid < n_assign
    tok = (rid // TOP_K).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = offs_h < HIDDEN
    v = tl.load(
        x_ptr + tok[:, None] * stride_xt + offs_h[None, :] * stride_xh, mask=row_ok[:, None] & h_ok[None, :], other=0.0
    )
    tl.store(xs_ptr + offs_r[:, None].to(tl.int64) * stride_st + offs_h[None, :] * stride_sh, v, mask=h_ok[None, :])


@triton.jit
def _moe_w13_swiglu_tma_kernel(
    a_desc,
    w_desc,
    act_ptr,
    tile_expert_ptr,
    num_rows_ptr,
    num_tiles_m,
    group_m,
    stride_am,
    stride_ai,
    alpha,
    limit,
    beta,
    INTER: tl.constexpr,
    HIDDEN: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    # As _moe_w13_swiglu_kernel with A_SORTED, tiles through TMA: a_desc over xs [P, H] (block
    # [M, K_]), w_desc over w13 viewed [E*2I, H] (block [N, K_]). Weight rows past I (ragged N)
    # belong to the up half or the next expert: their columns are computed and never stored.
    pid = tl.program_id(0)
    pid_m, pid_n = tile_coords(pid, num_tiles_m, tl.cdiv(INTER, BLOCK_N), group_m)
    if pid_m * BLOCK_M >= tl.load(num_rows_ptr):
        return
    e = tl.load(tile_expert_ptr + pid_m)
    row0 = pid_m * BLOCK_M
    n0 = pid_n * BLOCK_N
    g_row = e * (2 * INTER) + n0
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, HIDDEN, BLOCK_K):
        a = a_desc.load([row0, k0])  # [M, K_]; columns past H arrive as zeros
        g = w_desc.load([g_row, k0])  # [N, K_]
        u = w_desc.load([g_row + INTER, k0])
        acc_g = tl.dot(a, g.T, acc_g, input_precision=PRECISION)
        acc_u = tl.dot(a, u.T, acc_u, input_precision=PRECISION)
    act = swiglu_oai_tile(acc_g, acc_u, alpha, limit, beta)
    offs_m = row0 + tl.arange(0, BLOCK_M)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    out_ptrs = act_ptr + offs_m[:, None].to(tl.int64) * stride_am + offs_n[None, :] * stride_ai
    tl.store(out_ptrs, act.to(act_ptr.dtype.element_ty), mask=offs_n[None, :] < INTER)


@triton.jit
def _moe_w2_weighted_tma_kernel(
    a_desc,
    w_desc,
    out_ptr,
    weights_ptr,
    sorted_ids_ptr,
    tile_expert_ptr,
    num_rows_ptr,
    n_assign,
    num_tiles_m,
    group_m,
    stride_or,
    stride_oh,
    HIDDEN: tl.constexpr,
    INTER: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    # As _moe_w2_weighted_kernel, tiles through TMA: a_desc over act [P, I] (block [M, K_]),
    # w_desc over w2 viewed [E*H, I] (block [N, K_]); rows past H are computed and never stored.
    pid = tl.program_id(0)
    pid_m, pid_n = tile_coords(pid, num_tiles_m, tl.cdiv(HIDDEN, BLOCK_N), group_m)
    if pid_m * BLOCK_M >= tl.load(num_rows_ptr):
        return
    e = tl.load(tile_expert_ptr + pid_m)
    row0 = pid_m * BLOCK_M
    n0 = pid_n * BLOCK_N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, INTER, BLOCK_K):
        a = a_desc.load([row0, k0])
        b = w_desc.load([e * HIDDEN + n0, k0])
        acc = tl.dot(a, b.T, acc, input_precision=PRECISION)
    offs_m = row0 + tl.arange(0, BLOCK_M)
    rid = tl.load(sorted_ids_ptr + offs_m)
    row_ok = rid < n_assign
    offs_n = n0 + tl.arange(0, BLOCK_N)
    w = tl.load(weights_ptr + rid, mask=row_ok, other=0.0).to(tl.float32)
    acc = acc * w[:, None]
    out_ptrs = out_ptr + rid[:, None].to(tl.int64) * stride_or + offs_n[None, :] * stride_oh
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (offs_n[None, :] < HIDDEN))


@triton.jit
def _moe_combine_kernel(
    rows_ptr,
    ids_ptr,
    out_ptr,
    expert_lo,
    expert_hi,
    stride_rr,
    stride_rh,
    stride_ot,
    stride_oh,
    TOP_K: tl.constexpr,
    HIDDEN: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    # out[t, h] = sum over slots k whose expert is local of rows[t*K + k, h], summed in fp32.
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = offs_h < HIDDEN
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for k in range(0, TOP_K):
        e = tl.load(ids_ptr + t * TOP_K + k)
        local = (e >= expert_lo) & (e < expert_hi)  # rows of other ranks' experts were never written
        r = tl.load(rows_ptr + (t * TOP_K + k) * stride_rr + offs_h * stride_rh, mask=h_ok & local, other=0.0)
        acc += r.to(tl.float32)
    tl.store(out_ptr + t * stride_ot + offs_h * stride_oh, acc.to(out_ptr.dtype.element_ty), mask=h_ok)


def _check_inputs(x, ids, weights, w13, w2, expert_range) -> tuple[int, int]:
    if x.dim() != 2:
        raise ValueError(f"x must be [T, H], got shape {tuple(x.shape)}")
    if ids.dim() != 2 or ids.shape[0] != x.shape[0]:
        raise ValueError(f"ids must be [T, K] with T = x.shape[0] = {x.shape[0]}, got {tuple(ids.shape)}")
    if weights.shape != ids.shape:
        raise ValueError(f"weights must have the shape of ids {tuple(ids.shape)}, got {tuple(weights.shape)}")
    if ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise ValueError(f"ids must be an integer tensor of expert ids, got {ids.dtype}")
    if w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"w13 must be [E, 2I, H] and w2 [E, H, I], got {tuple(w13.shape)} / {tuple(w2.shape)}")
    e, two_i, h = w13.shape
    if h != x.shape[1] or two_i % 2 or tuple(w2.shape) != (e, h, two_i // 2):
        raise ValueError(
            f"weight shapes do not match x [T, {x.shape[1]}]: w13 {tuple(w13.shape)} must be [E, 2I, H], "
            f"w2 {tuple(w2.shape)} must be [E, H, I]"
        )
    if x.dtype not in _DTYPES or w13.dtype != x.dtype or w2.dtype != x.dtype:
        raise ValueError(
            f"x, w13, w2 must share one dtype of {_DTYPES}, got {x.dtype}, {w13.dtype}, {w2.dtype}; "
            "cast the experts with the model (cast_for_inference)"
        )
    if not (x.device == ids.device == weights.device == w13.device == w2.device):
        raise ValueError("x, ids, weights, w13, w2 must be on one device")
    a, b = (0, e) if expert_range is None else (int(expert_range[0]), int(expert_range[1]))
    if b - a != e or a < 0:
        raise ValueError(f"expert_range {expert_range} must span the {e} local experts held in w13/w2 (b - a == E)")
    return a, b


def moe_permute(x: torch.Tensor, aligned, top_k: int) -> torch.Tensor:
    """Expert-sorted copy of the routed rows: xs [P, H] in x.dtype, xs[r] = x[sorted_ids[r] // K].

    aligned: an AlignedAssignments or moe_ragged.RaggedTiles (uses sorted_ids [P], num_rows [1]).
    Padding rows inside used tiles are zeros; rows past num_rows are left unwritten (no GEMM
    tile reads them). One gather pass (T*K rows of H), so the gate/up GEMM reads A contiguously.
    """
    t, h = x.shape
    p = aligned.sorted_ids.numel()
    xs = torch.empty((p, h), dtype=x.dtype, device=x.device)  # [P, H]
    block_r = 4
    block_h = min(1024, triton.next_power_of_2(h))
    _moe_permute_kernel[(p // block_r, triton.cdiv(h, block_h))](
        x,
        xs,
        aligned.sorted_ids,
        aligned.num_rows,
        t * top_k,
        x.stride(0),
        x.stride(1),
        xs.stride(0),
        xs.stride(1),
        TOP_K=top_k,
        HIDDEN=h,
        BLOCK_R=block_r,
        BLOCK_H=block_h,
        num_warps=4,
    )
    return xs


def _tma_ok(*tensors: torch.Tensor) -> bool:
    # NOTE: TMA needs 16-byte aligned bases and row strides and a contiguous last dimension.
    return TensorDescriptor is not None and all(
        t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and all((s * t.element_size()) % 16 == 0 for s in t.stride()[:-1])
        for t in tensors
    )


def moe_gate_up(
    x: torch.Tensor,
    w13: torch.Tensor,
    aligned: AlignedAssignments,
    top_k: int,
    tile: GemmTile,
    alpha: float,
    limit: float,
    beta: float,
    *,
    a_sorted: bool = False,
    tma: bool = False,
) -> torch.Tensor:
    """Grouped GEMM 1 + SwiGLU-OAI: act [P, I] in x.dtype, row r = SwiGLU(W13[e] x[sorted_ids[r] // K]).

    x [T, H] (gathered per tile), or with a_sorted=True the [P, H] output of `moe_permute`;
    w13 [E, 2I, H]. tma=True (needs a_sorted and TMA-aligned x/w13) loads tiles through TMA
    descriptors. Rows of unused tiles are left unwritten; padding rows hold SwiGLU(0) values.
    """
    h = x.shape[1]
    inter = w13.shape[1] // 2
    bm = aligned.block_m
    p = aligned.sorted_ids.numel()
    num_tiles_m = p // bm
    n_assign = x.shape[0] * top_k  # padding sentinel of sorted_ids (unused when a_sorted)
    act = torch.empty((p, inter), dtype=x.dtype, device=x.device)  # [P, I]
    grid = (num_tiles_m * triton.cdiv(inter, tile.block_n),)
    if tma:
        if not a_sorted:
            raise ValueError("moe_gate_up: tma=True needs the expert-sorted x of moe_permute (a_sorted=True)")
        w_flat = w13.reshape(-1, h)  # [E*2I, H]
        a_desc = TensorDescriptor.from_tensor(x, [bm, tile.block_k])
        w_desc = TensorDescriptor.from_tensor(w_flat, [tile.block_n, tile.block_k])
        _moe_w13_swiglu_tma_kernel[grid](
            a_desc,
            w_desc,
            act,
            aligned.tile_expert,
            aligned.num_rows,
            num_tiles_m,
            launch_group(tile, num_tiles_m),
            act.stride(0),
            act.stride(1),
            float(alpha),
            float(limit),
            float(beta),
            INTER=inter,
            HIDDEN=h,
            BLOCK_M=bm,
            BLOCK_N=tile.block_n,
            BLOCK_K=tile.block_k,
            PRECISION=dot_precision(x.dtype),
            num_warps=tile.num_warps,
            num_stages=tile.num_stages,
        )
        return act
    _moe_w13_swiglu_kernel[grid](
        x,
        w13,
        act,
        aligned.sorted_ids,
        aligned.tile_expert,
        aligned.num_rows,
        n_assign,
        num_tiles_m,
        launch_group(tile, num_tiles_m),
        x.stride(0),
        x.stride(1),
        w13.stride(0),
        w13.stride(1),
        w13.stride(2),
        act.stride(0),
        act.stride(1),
        float(alpha),
        float(limit),
        float(beta),
        TOP_K=top_k,
        INTER=inter,
        HIDDEN=h,
        BLOCK_M=bm,
        BLOCK_N=tile.block_n,
        BLOCK_K=tile.block_k,
        EVEN_K=h % tile.block_k == 0,
        PRECISION=dot_precision(x.dtype),
        A_SORTED=a_sorted,
        num_warps=tile.num_warps,
        num_stages=tile.num_stages,
    )
    return act


def moe_down(
    act: torch.Tensor,
    w2: torch.Tensor,
    aligned: AlignedAssignments,
    weights: torch.Tensor,
    tile: GemmTile,
    *,
    tma: bool = False,
) -> torch.Tensor:
    """Grouped GEMM 2 + routing weight: rows [T*K, H] in act.dtype, rows[s] = weights[s] * W2[e] act[r].

    act [P, I] from `moe_gate_up`; w2 [E, H, I]; weights [T, K] (used in fp32). Row s = t*K + k
    of the output is written only when slot s went to a local expert (moe_combine masks the rest).
    tma=True loads the act and weight tiles through TMA descriptors (act/w2 must be TMA-aligned).
    """
    n_assign = weights.numel()
    h, inter = w2.shape[1], w2.shape[2]
    bm = aligned.block_m
    num_tiles_m = aligned.sorted_ids.numel() // bm
    w_flat = weights.reshape(-1).to(torch.float32).contiguous()  # [T*K]
    rows = torch.empty((n_assign, h), dtype=act.dtype, device=act.device)  # [T*K, H]
    grid = (num_tiles_m * triton.cdiv(h, tile.block_n),)
    if tma:
        a_desc = TensorDescriptor.from_tensor(act, [bm, tile.block_k])
        w_desc = TensorDescriptor.from_tensor(w2.reshape(-1, inter), [tile.block_n, tile.block_k])  # [E*H, I]
        _moe_w2_weighted_tma_kernel[grid](
            a_desc,
            w_desc,
            rows,
            w_flat,
            aligned.sorted_ids,
            aligned.tile_expert,
            aligned.num_rows,
            n_assign,
            num_tiles_m,
            launch_group(tile, num_tiles_m),
            rows.stride(0),
            rows.stride(1),
            HIDDEN=h,
            INTER=inter,
            BLOCK_M=bm,
            BLOCK_N=tile.block_n,
            BLOCK_K=tile.block_k,
            PRECISION=dot_precision(act.dtype),
            num_warps=tile.num_warps,
            num_stages=tile.num_stages,
        )
        return rows
    _moe_w2_weighted_kernel[grid](
        act,
        w2,
        rows,
        w_flat,
        aligned.sorted_ids,
        aligned.tile_expert,
        aligned.num_rows,
        n_assign,
        num_tiles_m,
        launch_group(tile, num_tiles_m),
        act.stride(0),
        act.stride(1),
        w2.stride(0),
        w2.stride(1),
        w2.stride(2),
        rows.stride(0),
        rows.stride(1),
        HIDDEN=h,
        INTER=inter,
        BLOCK_M=bm,
        BLOCK_N=tile.block_n,
        BLOCK_K=tile.block_k,
        EVEN_K=inter % tile.block_k == 0,
        PRECISION=dot_precision(act.dtype),
        num_warps=tile.num_warps,
        num_stages=tile.num_stages,
    )
    return rows


def moe_combine(rows: torch.Tensor, ids: torch.Tensor, expert_range: tuple[int, int]) -> torch.Tensor:
    """out [T, H] in rows.dtype: sum over slots k with ids[t, k] in [a, b) of rows[t*K + k] (fp32 sum)."""
    t, k = ids.shape
    h = rows.shape[1]
    out = torch.empty((t, h), dtype=rows.dtype, device=rows.device)
    block_h = min(1024, triton.next_power_of_2(h))
    _moe_combine_kernel[(t, triton.cdiv(h, block_h))](
        rows,
        ids.contiguous(),
        out,
        int(expert_range[0]),
        int(expert_range[1]),
        rows.stride(0),
        rows.stride(1),
        out.stride(0),
        out.stride(1),
        TOP_K=k,
        HIDDEN=h,
        BLOCK_H=block_h,
        num_warps=4,
    )
    return out


def fused_experts(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    *,
    alpha: float,
    limit: float,
    beta: float = 1.0,
    expert_range: tuple[int, int] | None = None,
    config: MoEKernelConfig | None = None,
) -> torch.Tensor:
    """sum_k weights[t,k] * W2[e] SwiGLU_OAI(W13[e] x[t]) over local experts e = ids[t,k] - a.

    x: [T, H] bf16/fp16/fp32; ids: [T, K] global expert ids (any int dtype); weights: [T, K]
    routing weights (any float dtype, used in fp32; already renormalised and scaled by
    routed_scaling_factor, as `moe.route` returns them); w13: [E, 2I, H] (gate rows then up rows),
    w2: [E, H, I], both in x.dtype, holding experts [a, b) = expert_range (default (0, E)).
    alpha/limit/beta: SwiGLU-OAI constants (spec §3.7). Returns [T, H] in x.dtype; slots routed
    outside [a, b) add nothing. Same maths as `moe.grouped_experts` (see module docstring for
    rounding). Raises ValueError on mismatched shapes, dtypes, devices or expert_range.
    """
    a, b = _check_inputs(x, ids, weights, w13, w2, expert_range)
    t, k = ids.shape
    e, two_i, h = w13.shape
    if t == 0:
        return torch.empty((0, h), dtype=x.dtype, device=x.device)
    cfg = config or config_for_dtype(default_config(t * k, e, h, two_i // 2), x.dtype)
    if cfg.k_chunk and (cfg.tma or cfg.permute):
        raise ValueError(
            f"k_chunk takes the aligned or the ragged layout with gathered rows (no tma / permute), got {cfg}"
        )
    if cfg.ragged and _tma_ok(x, w13, w2):
        tiles = align_ragged(ids, (a, b), cfg.fat_tail)
        kc = cfg.k_chunk
        if cfg.permute:
            xs = moe_permute(x, tiles, k)  # [P, H] expert-sorted rows
            act = ragged_gate_up(xs, w13, tiles, cfg.w13, alpha, limit, beta)  # [P, I]
        else:  # A rows gathered from x inside the GEMM
            act = ragged_gate_up(x, w13, tiles, cfg.w13, alpha, limit, beta, top_k=k, k_chunk=kc)  # [P, I]
        rows = ragged_down(act, w2, tiles, weights, cfg.w2, k_chunk=kc)  # [T*K, H]
        return moe_combine(rows, ids, (a, b))
    if cfg.k_chunk:  # aligned chunked kernels (also the ragged config's fallback: same bits)
        aligned = align_by_expert(ids, (a, b), cfg.block_m, small_max=CHUNKED_SMALL_ALIGN_MAX_ASSIGNMENTS)
        act = chunked_gate_up(x, w13, aligned, k, cfg.w13, cfg.k_chunk, cfg.split_k_below, alpha, limit, beta)
        rows = chunked_down(act, w2, aligned, weights, cfg.w2, cfg.k_chunk, cfg.split_k_below)
        return moe_combine(rows, ids, (a, b))
    aligned = align_by_expert(ids, (a, b), cfg.block_m)
    tma = cfg.tma and _tma_ok(x, w13, w2)
    if cfg.permute or tma:
        xs = moe_permute(x, aligned, k)  # [P, H] expert-sorted rows
        act = moe_gate_up(xs, w13, aligned, k, cfg.w13, alpha, limit, beta, a_sorted=True, tma=tma)  # [P, I]
    else:
        act = moe_gate_up(x, w13, aligned, k, cfg.w13, alpha, limit, beta)  # [P, I]
    rows = moe_down(act, w2, aligned, weights, cfg.w2, tma=tma)  # [T*K, H]
    return moe_combine(rows, ids, (a, b))  # [T, H]

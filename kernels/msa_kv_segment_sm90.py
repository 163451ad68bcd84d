"""The KV-major segment kernel of the sparse prefill, written for Hopper (sm_90) in Gluon.

Which path is this: the same work as ``msa_paged_attention.kv_seg_attn_kernel`` (one program per
segment of up to SEG (token, slot j) entries of one (KV head, row, block) bucket; the page's K / V
loaded once, the entries' query rows streamed through it TOK tokens x RH heads per tensor-core
tile, each entry's block-normalised partial output and base-2 LSE written for
``kv_major_merge_kernel``), for CUDA devices of compute capability 9.x with 16-bit inputs and the
tile of M3's shapes (TOK 4 x RH 16 = 64 rows, page and head dim 128). The default where it can run
(``msa_paged_attention.KV_SEG_SM90_DEFAULT``; ``sm90_unsupported`` says where it cannot);
``prefill_config={"prefetch": "sm90"}`` asks for it (a launch it cannot run: ValueError),
``"deferred"`` keeps the Triton loop.

Why a second kernel: the Triton loop is serial inside each program. Compiled for sm_90 it issues
the next tile's QK dot after this tile's softmax and waits for it at once, then issues the PV dot
and waits again (docs/benchmarks.md, 2026-12-06), so a program's tensor-core work never runs under
its own softmax; only the SM's second program fills the gaps. Gluon exposes the asynchronous
warpgroup MMA, so here each step issues tile i+1's QK dot, runs tile i's softmax while it
computes, then issues tile i's PV dot (the intra-warpgroup overlap of FlashAttention-3: Shah et al.
2024, §3.2). Query rows are copied asynchronously STAGES - 1 tiles ahead; the entry ids and
positions a step needs are loaded one step earlier; each tile's partial goes out through its own
query stage in shared memory (free by then) as 16-byte rows.

Values: the Triton loop's ops on the same register layouts (scores q @ k^T in fp32 from m64n{PS}k16
wgmma, scale, causal cut, base-2 softmax, probabilities rounded to the input dtype for the
m64n{D}k16 PV wgmma, the row-sum division, the LSE): the partials are bitwise equal to it
(tests/gpu/test_msa_gpu.py; the compiled MMA code is compared on the CPU by
tests/test_kernels_kv_segment_sm90.py). Speed: docs/benchmarks.md (H100, 2026-12-06).

Shape legend: as msa_paged_attention (G KV heads, RH = nh/G query heads per group, d head dim,
ps page size, K top-k entries); M = TOK x RH rows per tile.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

# Query-row tiles in flight per program (the current tile's, the next tile's QK operand, and
# STAGES - 2 more being copied). Shared memory per program: K and V pages + STAGES x [M, d] tiles
# (bf16, M3 shapes: 64 + 48 KB at 3 stages, two programs per SM).
KV_SEG_SM90_STAGES = 3


@gluon.jit
def _tile_rows(ptr, e_lo, n, c, rows, other, RH: gl.constexpr):
    """[M] values of a per-entry vector (entry ids ``perm``, query positions ``epos``) for the tile at
    segment-local entry c, one per row (row m: entry c + m // RH; ``other`` past the segment's n
    entries), in the layout of ``rows``."""
    li = c + rows // RH
    return gl.load(ptr + e_lo + li, mask=li < n, other=other)


@gluon.jit
def _tile_ids(perm_ptr, e_lo, n, c, rows, RH: gl.constexpr):
    """Entry ids [M] int32 of the tile at segment-local entry c (``_tile_rows`` of perm; 0 past n)."""
    return _tile_rows(perm_ptr, e_lo, n, c, rows, 0, RH).to(gl.int32)


@gluon.jit
def _copy_q_tile(
    q_smem, q_ptr, e, n, c, rows, cols, t_base, topk, g, stride_qt, stride_qh, G: gl.constexpr, RH: gl.constexpr
):
    """Start the asynchronous copy of the tile at segment-local entry c (entry ids e [M], rows in the
    copy layout) into q_smem [M, D]: row m = query row of head g * RH + m % RH of entry e[m]'s token;
    rows past the segment's n entries zero-filled. One copy group."""
    ok = (c + rows // RH) < n
    t = e // (G * topk)
    off = (t_base + t).to(gl.int64) * stride_qt + (g * RH + rows % RH) * stride_qh
    async_copy.async_copy_global_to_shared(q_smem, q_ptr + off[:, None] + cols[None, :], mask=ok[:, None])
    async_copy.commit_group()


@gluon.jit
def kv_seg_attn_sm90_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    epos_ptr,
    seg_bkt_ptr,
    bkt_start_ptr,
    bkt_seg0_ptr,
    bkt_end_ptr,
    bkt_page_ptr,
    perm_ptr,
    opart_ptr,
    lse_ptr,
    qk_scale,
    t_base,
    topk,
    nbp,
    bkt_per_head,
    stride_qt,
    stride_qh,
    stride_kp,
    stride_kg,
    stride_ko,
    G: gl.constexpr,
    RH: gl.constexpr,
    D: gl.constexpr,
    PS: gl.constexpr,
    TOK: gl.constexpr,
    SEG: gl.constexpr,
    STAGES: gl.constexpr,
):
    """One segment (up to SEG entries) of one KV-major bucket; arguments and outputs as
    ``msa_paged_attention.kv_seg_attn_kernel`` (perm: int64 entry ids in bucket order, epos: int32
    query positions in the same order; opart [E, RH, D] in the input dtype, lse [E, RH] fp32).
    4 warps (one warpgroup); TOK * RH == 64."""
    M: gl.constexpr = TOK * RH
    dt: gl.constexpr = q_ptr.dtype.element_ty
    S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, PS, 16])
    O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
    P_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_L, k_width=2)
    LD: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])  # 16-byte copies, a warp spans 2 rows
    SH: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)

    seg = gl.program_id(0)
    bkt = gl.load(seg_bkt_ptr + seg)
    if bkt >= 0:
        e_lo = (gl.load(bkt_start_ptr + bkt) + (seg - gl.load(bkt_seg0_ptr + bkt)) * SEG).to(gl.int32)
        e_hi = gl.minimum(gl.load(bkt_end_ptr + bkt), e_lo + SEG).to(gl.int32)
        n = e_hi - e_lo
        page = gl.load(bkt_page_ptr + bkt)
        g = bkt // bkt_per_head
        b = bkt % nbp

        # the page's K and V: one copy group, waited for with the first query tile
        k_smem = gl.allocate_shared_memory(dt, [PS, D], SH)
        v_smem = gl.allocate_shared_memory(dt, [PS, D], SH)
        q_smem = gl.allocate_shared_memory(dt, [STAGES, M, D], SH)
        ko = gl.arange(0, PS, layout=gl.SliceLayout(1, LD))
        kd = gl.arange(0, D, layout=gl.SliceLayout(0, LD))
        koff = page.to(gl.int64) * stride_kp + g * stride_kg + ko[:, None] * stride_ko + kd[None, :]
        async_copy.async_copy_global_to_shared(k_smem, k_ptr + koff)
        async_copy.async_copy_global_to_shared(v_smem, v_ptr + koff)
        async_copy.commit_group()
        mq = gl.arange(0, M, layout=gl.SliceLayout(1, LD))  # copy-layout rows
        dq = gl.arange(0, D, layout=gl.SliceLayout(0, LD))
        for st in gl.static_range(STAGES - 1):
            e_q = _tile_ids(perm_ptr, e_lo, n, st * TOK, mq, RH)
            _copy_q_tile(
                q_smem.index(st), q_ptr, e_q, n, st * TOK, mq, dq, t_base, topk, g, stride_qt, stride_qh, G, RH
            )
        async_copy.wait_group(STAGES - 2)  # K, V and tile 0 landed
        gl.thread_barrier()
        fence_async_shared()
        kt = k_smem.permute((1, 0))  # [D, PS]: the QK dot's B operand
        zs = gl.zeros([M, PS], gl.float32, S_L)
        zo = gl.zeros([M, D], gl.float32, O_L)
        s_cur = warpgroup_mma(q_smem.index(0), kt, zs, use_acc=False, is_async=True)
        s_cur = warpgroup_mma_wait(0, deps=(s_cur,))

        ms = gl.arange(0, M, layout=gl.SliceLayout(1, S_L))  # score-layout rows
        offs_o = gl.arange(0, PS, layout=gl.SliceLayout(0, S_L))
        # ids and positions of tile 0, the copy rows of tile STAGES - 1 (each loop step loads the next ones
        # one tile ahead, so no load in the loop waits for its result in the same step)
        e_s = _tile_ids(perm_ptr, e_lo, n, 0, ms, RH)
        e_b = _tile_ids(perm_ptr, e_lo, n, 0, mq, RH)
        qpos = _tile_rows(epos_ptr, e_lo, n, 0, ms, -1, RH)
        e_q = _tile_ids(perm_ptr, e_lo, n, (STAGES - 1) * TOK, mq, RH)
        n_tiles = (n + TOK - 1) // TOK
        for i in range(n_tiles):
            # stage (i + STAGES - 1) % STAGES was last read by tile i - 1's QK dot, waited for last step
            nxt = i + STAGES - 1
            _copy_q_tile(
                q_smem.index(nxt % STAGES), q_ptr, e_q, n, nxt * TOK, mq, dq, t_base, topk, g, stride_qt, stride_qh,
                G, RH,
            )  # fmt: skip
            e_q = _tile_ids(perm_ptr, e_lo, n, (nxt + 1) * TOK, mq, RH)
            async_copy.wait_group(STAGES - 2)  # tile i + 1 landed
            gl.thread_barrier()
            fence_async_shared()
            s_next = warpgroup_mma(q_smem.index((i + 1) % STAGES), kt, zs, use_acc=False, is_async=True)
            c1 = (i + 1) * TOK
            e_s_n = _tile_ids(perm_ptr, e_lo, n, c1, ms, RH)
            e_b_n = _tile_ids(perm_ptr, e_lo, n, c1, mq, RH)
            qpos_n = _tile_rows(epos_ptr, e_lo, n, c1, ms, -1, RH)

            # tile i: causal cut, base-2 softmax, PV dot (while the tensor cores run tile i + 1's QK)
            c = i * TOK
            ok = (c + ms // RH) < n
            s = s_cur * qk_scale
            keep = ok[:, None] & ((b * PS + offs_o)[None, :] <= qpos[:, None])
            s = gl.where(keep, s, float("-inf"))
            m = gl.max(s, axis=1)
            m = gl.where(m == float("-inf"), 0.0, m)
            p = gl.exp2(s - m[:, None])
            l_i = gl.sum(p, axis=1)
            p16 = gl.convert_layout(p.to(dt), P_L)
            o = warpgroup_mma(p16, v_smem, zo, use_acc=False, is_async=True)
            o, s_next = warpgroup_mma_wait(0, deps=(o, s_next))

            l_safe = gl.where(l_i > 0, l_i, 1.0)
            lse = gl.where(l_i > 0, m + gl.log2(l_safe), float("-inf"))
            gl.store(lse_ptr + e_s * RH + ms % RH, lse, mask=ok)
            o = o / gl.convert_layout(l_safe, gl.SliceLayout(1, O_L))[:, None]
            # the partial goes out through tile i's query stage (free until tile i + STAGES's copy is
            # issued next step): registers -> shared -> 16-byte rows of the copy layout -> global
            ob_smem = q_smem.index(i % STAGES)
            ob_smem.store(o.to(dt))
            gl.thread_barrier()
            ob = ob_smem.load(LD)
            gl.thread_barrier()
            ok_b = (c + mq // RH) < n
            gl.store(opart_ptr + (e_b * RH + mq % RH)[:, None].to(gl.int64) * D + dq[None, :], ob, mask=ok_b[:, None])
            s_cur = s_next
            e_s = e_s_n
            e_b = e_b_n
            qpos = qpos_n
        async_copy.wait_group(0)


# The one tile the kernel is taken at (compiled and compared with the Triton loop on a GPU only here):
# M3's attention, TOK 4 tokens x RH 16 query heads per KV head, head dim D 128, page PS 128.
SM90_TILE = {"TOK": 4, "RH": 16, "D": 128, "PS": 128}
# Shared memory two programs may each use on one sm_90 SM (228 KB, less 1 KB reserved per block).
SM90_TWO_PROGRAM_SMEM = 228 * 1024 // 2 - 1024


def sm90_unsupported(q, k_cache_l, rh: int, tok: int, stages: int) -> str | None:
    """None when ``kv_seg_attn_sm90_kernel`` can run this launch, else what is missing: a CUDA device
    of compute capability 9.x; bf16 / fp16 queries; M3's tile (TOK 4 x RH 16 rows, head dim and page
    size 128: the kernel is written for any TOK x RH == 64 and d / ps of 64 or 128, but compiled and
    compared with the Triton loop on a GPU only at these); 2 <= stages with the K / V page and the
    stages' query tiles in ``SM90_TWO_PROGRAM_SMEM`` bytes (two programs per SM); q and the K / V
    cache 16-byte aligned with every stride but the last a multiple of 16 elements (the asynchronous
    16-byte copies).
    q: [T, nh, d]; k_cache_l: [P, G, ps, d] (one layer's K cache; V has its layout)."""
    import torch

    _, _, ps, d = k_cache_l.shape
    if not q.is_cuda or torch.cuda.get_device_capability(q.device)[0] != 9:
        return "a CUDA device of compute capability 9.x"
    if q.dtype not in (torch.bfloat16, torch.float16):
        return f"bf16 / fp16 queries, got {q.dtype}"
    if {"TOK": tok, "RH": rh, "D": d, "PS": ps} != SM90_TILE:
        return (
            f"M3's attention tile (tok {SM90_TILE['TOK']} x {SM90_TILE['RH']} heads per KV head, head dim "
            f"{SM90_TILE['D']}, page {SM90_TILE['PS']}); got tok {tok}, heads {rh}, head dim {d}, page {ps}"
        )
    smem = (2 * ps + stages * tok * rh) * d * q.element_size()
    if stages < 2 or smem > SM90_TWO_PROGRAM_SMEM:
        return (
            f"num_stages >= 2 with {smem} <= {SM90_TWO_PROGRAM_SMEM} bytes of shared memory per program (two "
            f"programs per SM); got num_stages {stages}"
        )
    for name, t in (("queries", q), ("K cache", k_cache_l)):
        if t.data_ptr() % 16 or any(st % 16 for st in t.stride()[:-1]):
            return f"16-byte aligned {name} with strides (but the last) multiples of 16 elements, got {t.stride()}"
    return None


def check_kv_seg_sm90(q, k_cache_l, rh: int, tok: int, stages: int) -> None:
    """Raise ValueError naming what is missing (``sm90_unsupported``) when ``kv_seg_attn_sm90_kernel``
    cannot run this launch."""
    why = sm90_unsupported(q, k_cache_l, rh, tok, stages)
    if why is not None:
        raise ValueError(f"paged_attention: prefill_config prefetch='sm90' needs {why}")

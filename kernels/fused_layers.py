"""Fused Triton kernels for the model's small per-layer ops on the GPU (decode / prefill speed; design.md §4.4).

Governing idea: a decode step of a small model is dominated by launches of tiny element-wise
kernels (norm, RoPE, casts, cache scatters). Each op here does, in ONE launch, what the PyTorch
path (m3_rollout/model: norm.py, rope.py, attention.write_paged_kv, moe.swiglu_oai, moe.route)
does in several, with the same maths and the same intermediate roundings:

- ``qkv_norm_rope_write``: per attention layer, from the fused projection output
  ``[T, nh*d + 2*G*d (+ Gi*di + di)]`` (q | k | v | index q | index k columns): per-head Gemma
  RMSNorm of q, k (and index q, index k), partial NeoX RoPE on the first ``rotary_dim`` channels,
  K / V / index K written into their pages through ``slot_mapping`` (-1 -> null page), q and
  index q returned; FP8 index keys quantized on the way (e4m3 codes + a per-token scale, bit for
  bit ``paged_layout.quantize_index_keys``). Spec §3.3, §3.4, §4.2; cache layout kernels/paged_layout.py.
- ``add_rms_norm``: residual add (+ an optional second addend) and Gemma RMSNorm (spec §3.1,
  "fused add+norm"), residual updated in place; optional fp32 copy of the output (router input).
- ``swiglu``: SwiGLU-OAI over a ``[T, 2I]`` gate|up GEMM output (spec §3.7).
- ``router_topk``: sigmoid, selection-only bias, top-k (ties to the lower expert id),
  renormalisation and routed scaling of fp32 router logits (spec §3.6 steps 2-4);
  ``router_gemm_topk``: the same with the fp32 router GEMM in the kernel (decode-sized steps).
- ``skinny_linear``: x [T <= 32, K] @ W^T for decode-sized steps (bf16/fp16, fp32 accumulation),
  optionally the gate|up GEMM with SwiGLU-OAI in its epilogue ([T, H] -> [T, I] activation).

Numerics (spec §6): all maths in fp32; every value the PyTorch path rounds to the activation
dtype is rounded here at the same point (the normed q/k before RoPE, the residual sum, the
sum of two addends), so outputs differ from the PyTorch path only by fp32 reduction order and
FMA contraction (<= 1 ulp of the activation dtype on a few elements).

Shape legend: T tokens, H hidden, nh query heads, G KV heads (= index heads Gi), d head dim,
di index head dim, r rotary dim (= 2 * half), P pages (+1 null page), ps page size, E experts,
K experts per token, I MLP width.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from m3_kernels.msa_fp8 import e4m3_round, e4m3_scale, split_index_cache
from m3_kernels.paged_layout import FP8IndexCache

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# ----------------------------------------------------------------------------- jit helpers
@triton.jit
def _norm_rope_vec(
    src_ptr, w_ptr, cos_ptr, sin_ptr, eps, act_ptr, N: tl.constexpr, HALF: tl.constexpr, BLOCK: tl.constexpr
):
    """Gemma RMSNorm of one head vector [N] then NeoX RoPE on its first 2*HALF channels.

    The normed vector is rounded to the activation dtype (``act_ptr``'s element type) before RoPE
    (the PyTorch path's norm returns it). Returns fp32 [BLOCK] (lanes >= N are 0)."""
    ACT = act_ptr.dtype.element_ty
    offs = tl.arange(0, BLOCK)
    m = offs < N
    R: tl.constexpr = 2 * HALF
    partner = tl.where(offs < HALF, offs + HALF, tl.where(offs < R, offs - HALF, offs))
    x = tl.load(src_ptr + offs, mask=m, other=0.0).to(tl.float32)
    xp = tl.load(src_ptr + partner, mask=m, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
    wp = tl.load(w_ptr + partner, mask=m, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / N + eps)
    y = (x * rstd * (1.0 + w)).to(ACT).to(tl.float32)
    yp = (xp * rstd * (1.0 + wp)).to(ACT).to(tl.float32)
    rm = offs < R
    ci = tl.where(offs < HALF, offs, offs - HALF)
    c = tl.load(cos_ptr + ci, mask=rm, other=1.0)
    s = tl.load(sin_ptr + ci, mask=rm, other=0.0)
    rot = tl.where(offs < HALF, y * c - yp * s, y * c + yp * s)
    return tl.where(rm, rot, y)


@triton.jit
def _qkv_norm_rope_write_kernel(
    qkv_ptr,
    stride_t,
    cos_ptr,
    sin_ptr,
    pos_ptr,
    slot_ptr,
    qw_ptr,
    kw_ptr,
    iqw_ptr,
    ikw_ptr,
    q_out_ptr,
    iq_out_ptr,
    k_cache_ptr,
    v_cache_ptr,
    idx_cache_ptr,
    idx_scale_ptr,
    null_slot,
    eps,
    NH: tl.constexpr,
    G: tl.constexpr,
    NI: tl.constexpr,
    HAS_INDEX: tl.constexpr,
    INDEX_FP8: tl.constexpr,
    D: tl.constexpr,
    DI: tl.constexpr,
    HALF: tl.constexpr,
    PS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DI: tl.constexpr,
    ROPE_TABLE: tl.constexpr,
):
    # grid (T, NH + 2G [+ NI + 1]): program (t, j) handles one head vector of token t.
    t = tl.program_id(0)
    j = tl.program_id(1)
    ACT = q_out_ptr.dtype.element_ty
    row = qkv_ptr + t.to(tl.int64) * stride_t
    if ROPE_TABLE:  # cos/sin rows indexed by the token's position
        rr = tl.load(pos_ptr + t).to(tl.int64)
    else:  # one cos/sin row per token
        rr = t.to(tl.int64)
    cs = cos_ptr + rr * HALF
    sn = sin_ptr + rr * HALF
    slot = tl.load(slot_ptr + t).to(tl.int64)
    slot = tl.where(slot >= 0, slot, null_slot)
    page = slot // PS
    off = slot % PS
    od = tl.arange(0, BLOCK_D)
    md = od < D
    if j < NH:
        y = _norm_rope_vec(row + j * D, qw_ptr, cs, sn, eps, q_out_ptr, D, HALF, BLOCK_D)
        tl.store(q_out_ptr + (t.to(tl.int64) * NH + j) * D + od, y.to(ACT), mask=md)
    elif j < NH + G:
        g = j - NH
        y = _norm_rope_vec(row + (NH + g) * D, kw_ptr, cs, sn, eps, q_out_ptr, D, HALF, BLOCK_D)
        dst = k_cache_ptr + ((page * G + g) * PS + off) * D
        tl.store(dst + od, y.to(ACT).to(k_cache_ptr.dtype.element_ty), mask=md)
    elif j < NH + 2 * G:
        g = j - NH - G
        v = tl.load(row + (NH + G + g) * D + od, mask=md, other=0.0)
        dst = v_cache_ptr + ((page * G + g) * PS + off) * D
        tl.store(dst + od, v.to(v_cache_ptr.dtype.element_ty), mask=md)
    elif HAS_INDEX:
        oi = tl.arange(0, BLOCK_DI)
        mi = oi < DI
        base = row + (NH + 2 * G) * D
        h = j - NH - 2 * G
        if h < NI:
            y = _norm_rope_vec(base + h * DI, iqw_ptr, cs, sn, eps, q_out_ptr, DI, HALF, BLOCK_DI)
            tl.store(iq_out_ptr + (t.to(tl.int64) * NI + h) * DI + oi, y.to(ACT), mask=mi)
        else:
            y = _norm_rope_vec(base + NI * DI, ikw_ptr, cs, sn, eps, q_out_ptr, DI, HALF, BLOCK_DI)
            dst = idx_cache_ptr + (page * PS + off) * DI
            if INDEX_FP8:  # e4m3 codes + one power-of-two scale per token (kernels/paged_layout.py)
                y = y.to(ACT).to(tl.float32)
                amax = tl.max(tl.where(mi, tl.abs(y), 0.0), axis=0)
                amax = tl.where(tl.sum(tl.where(mi & (y != y), 1, 0), axis=0) > 0, float("nan"), amax)
                scale, inv = e4m3_scale(amax)
                tl.store(dst + oi, e4m3_round(y * inv).to(tl.float8e4nv), mask=mi)
                tl.store(idx_scale_ptr + page * PS + off, scale)
            else:
                tl.store(dst + oi, y.to(ACT).to(idx_cache_ptr.dtype.element_ty), mask=mi)


@triton.jit
def _add_rms_norm_kernel(
    x_ptr,
    x2_ptr,
    res_ptr,
    w_ptr,
    y_ptr,
    y32_ptr,
    stride_x,
    stride_x2,
    stride_res,
    stride_y,
    eps,
    N: tl.constexpr,
    HAS_X2: tl.constexpr,
    HAS_RES: tl.constexpr,
    WRITE_Y32: tl.constexpr,
    BLOCK: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    ACT = y_ptr.dtype.element_ty
    offs = tl.arange(0, BLOCK)
    m = offs < N
    s = tl.load(x_ptr + t * stride_x + offs, mask=m, other=0.0).to(tl.float32)
    if HAS_X2:
        s = (s + tl.load(x2_ptr + t * stride_x2 + offs, mask=m, other=0.0).to(tl.float32)).to(ACT).to(tl.float32)
    if HAS_RES:
        r = tl.load(res_ptr + t * stride_res + offs, mask=m, other=0.0).to(tl.float32)
        s = (r + s).to(ACT).to(tl.float32)
        tl.store(res_ptr + t * stride_res + offs, s.to(res_ptr.dtype.element_ty), mask=m)
    w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(s * s, axis=0) / N + eps)
    y = (s * rstd * (1.0 + w)).to(ACT)
    tl.store(y_ptr + t * stride_y + offs, y, mask=m)
    if WRITE_Y32:
        tl.store(y32_ptr + t * N + offs, y.to(tl.float32), mask=m)


@triton.jit
def swiglu_oai_act(g, u, alpha, limit, beta):
    """SwiGLU-OAI (spec §3.7) of fp32 gate / up values g, u (any one shape; the rounded gate|up
    GEMM output): min(g, limit) * sigmoid(alpha * min(g, limit)) * (clamp(u, ±limit) + beta) in
    fp32, not rounded. The one expression of ``swiglu``'s kernel, shared with the batch-invariant
    GEMM whose epilogue must give its bits (``invariant_ops.linear_swiglu``)."""
    g = tl.minimum(g, limit)
    u = tl.minimum(tl.maximum(u, -limit), limit)
    return g * tl.sigmoid(alpha * g) * (u + beta)


@triton.jit
def _swiglu_kernel(gu_ptr, out_ptr, stride_gu, stride_out, alpha, limit, beta, I: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = offs < I
    g = tl.load(gu_ptr + t * stride_gu + offs, mask=m, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + t * stride_gu + I + offs, mask=m, other=0.0).to(tl.float32)
    act = swiglu_oai_act(g, u, alpha, limit, beta)
    tl.store(out_ptr + t * stride_out + offs, act.to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _router_topk_kernel(
    logits_ptr,
    bias_ptr,
    w_ptr,
    ids_ptr,
    stride_l,
    scaling,
    E: tl.constexpr,
    K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    m = offs < E
    z = tl.load(logits_ptr + t * stride_l + offs, mask=m, other=0.0).to(tl.float32)
    topk_store(z, bias_ptr, w_ptr, ids_ptr, t, scaling, E, K, HAS_BIAS, BLOCK_E, BLOCK_K)


@triton.jit
def _router_gemm_topk_kernel(
    x_ptr,
    gate_w_ptr,
    bias_ptr,
    w_ptr,
    ids_ptr,
    stride_x,
    scaling,
    H: tl.constexpr,
    E: tl.constexpr,
    K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # one token per program: fp32 logits = x . W_gate^T over H in BLOCK_H chunks, then top-k
    t = tl.program_id(0).to(tl.int64)
    oe = tl.arange(0, BLOCK_E)
    oh = tl.arange(0, BLOCK_H)
    me = oe < E
    acc = tl.zeros([BLOCK_E], dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        mh = h0 + oh < H
        xv = tl.load(x_ptr + t * stride_x + h0 + oh, mask=mh, other=0.0).to(tl.float32)
        wt = tl.load(gate_w_ptr + oe[:, None] * H + h0 + oh[None, :], mask=me[:, None] & mh[None, :], other=0.0)
        acc += tl.sum(wt.to(tl.float32) * xv[None, :], axis=1)
    topk_store(acc, bias_ptr, w_ptr, ids_ptr, t, scaling, E, K, HAS_BIAS, BLOCK_E, BLOCK_K)


@triton.jit
def topk_store(
    z,
    bias_ptr,
    w_ptr,
    ids_ptr,
    t,
    scaling,
    E: tl.constexpr,
    K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Sigmoid, biased top-K choice (ties -> lower id), renormalised scaled weights of one token:
    z [BLOCK_E] fp32 logits (lanes >= E ignored), bias_ptr [E] fp32 (HAS_BIAS), token index t;
    stores weights [K] fp32 at w_ptr + t * K and ids [K] int64 at ids_ptr + t * K. Shared by
    ``router_topk``'s and ``router_gemm_topk``'s kernels and the batch-invariant router
    (``invariant_ops.router_gemm_topk``), so every route gives the same bits from the same logits."""
    offs = tl.arange(0, BLOCK_E)
    m = offs < E
    s = tl.sigmoid(z)
    choice = s
    if HAS_BIAS:
        choice = s + tl.load(bias_ptr + offs, mask=m, other=0.0).to(tl.float32)
    choice = tl.where(m, choice, float("-inf"))
    ko = tl.arange(0, BLOCK_K)
    wv = tl.zeros([BLOCK_K], dtype=tl.float32)
    iv = tl.zeros([BLOCK_K], dtype=tl.int64)
    for k in tl.static_range(K):
        best = tl.max(choice, axis=0)
        idx = tl.min(tl.where(choice == best, offs, BLOCK_E), axis=0)  # ties -> lower expert id
        wk = tl.sum(tl.where(offs == idx, s, 0.0), axis=0)
        wv = tl.where(ko == k, wk, wv)
        iv = tl.where(ko == k, idx.to(tl.int64), iv)
        choice = tl.where(offs == idx, float("-inf"), choice)
    total = tl.sum(wv, axis=0)
    mk = ko < K
    tl.store(w_ptr + t * K + ko, wv / total * scaling, mask=mk)
    tl.store(ids_ptr + t * K + ko, iv, mask=mk)


# ----------------------------------------------------------------------------- host wrappers
def _check_act(name: str, x: torch.Tensor) -> None:
    if x.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{name}: dtype {x.dtype} not supported by the fused kernels (bf16/fp16/fp32)")


def qkv_norm_rope_write(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    slot_mapping: torch.Tensor,
    q_norm_w: torch.Tensor,
    k_norm_w: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    eps: float,
    index_q_norm_w: torch.Tensor | None = None,
    index_k_norm_w: torch.Tensor | None = None,
    num_index_heads: int = 0,
    index_dim: int = 0,
    index_cache: torch.Tensor | FP8IndexCache | None = None,
    positions: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Post-projection work of one attention layer in one launch (spec §3.3, §3.4, §4.2).

    Args:
        qkv: [T, nh*d + 2*G*d (+ Gi*di + di)] projection output, columns q | k | v | index q |
            index k; row stride free, last dim contiguous. Activation dtype (bf16/fp16/fp32).
        cos, sin: [T, r/2] fp32 RoPE tables of the tokens' positions (model/rope.rope_cos_sin), or,
            with ``positions`` [T] int64 given, tables [max_pos, r/2] indexed by position (every
            position must be < max_pos; not checked on the device).
        slot_mapping: [T] int64, slot = page * ps + offset, -1 = padding (written to the null page,
            the last page of the caches, offset 0).
        q_norm_w, k_norm_w ([d]), index_q_norm_w, index_k_norm_w ([di]): raw Gemma weights (scale 1 + w).
        k_cache, v_cache: [P + 1, G, ps, d] contiguous (one layer's pages); index_cache [P + 1, ps, di]
            (or an ``FP8IndexCache``: keys quantized as ``paged_layout.quantize_index_keys``, scales
            stored) for a sparse layer (index weights given), else None.
    Returns:
        (q [T, nh, d], index q [T, Gi, di] or None) in qkv.dtype, normed and rotated. K (normed,
        rotated), raw V and the index K are written into the caches (cast to the cache dtype).
    Raises ValueError on shape / dtype mismatches.
    """
    _check_act("qkv", qkv)
    t = qkv.shape[0]
    has_index = index_cache is not None
    width = num_heads * head_dim + 2 * num_kv_heads * head_dim + ((num_index_heads + 1) * index_dim if has_index else 0)
    if qkv.dim() != 2 or qkv.shape[1] != width or qkv.stride(1) != 1:
        raise ValueError(
            f"qkv: shape {tuple(qkv.shape)} stride {qkv.stride()}, expected [T, {width}] with a contiguous last dim"
        )
    half = cos.shape[-1]
    if 2 * half > head_dim or (has_index and 2 * half > index_dim):
        raise ValueError(f"rotary_dim {2 * half} exceeds head_dim {head_dim} / index_dim {index_dim}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache / v_cache must be contiguous [P + 1, G, ps, d] page views")
    index_keys, index_scales, _ = split_index_cache(index_cache)
    if index_scales is not None and not (index_keys.is_contiguous() and index_scales.is_contiguous()):
        raise ValueError("FP8 index cache: keys [P + 1, ps, di] and scales [P + 1, ps] must be contiguous page views")
    q = torch.empty(t, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    iq = torch.empty(t, num_index_heads, index_dim, dtype=qkv.dtype, device=qkv.device) if has_index else None
    if t == 0:
        return q, iq
    if cos.dtype != torch.float32 or sin.dtype != torch.float32 or not (cos.is_contiguous() and sin.is_contiguous()):
        raise ValueError("cos / sin: expected contiguous fp32 tables")
    if positions is None and cos.shape[0] != t:
        raise ValueError(f"cos: {cos.shape[0]} rows for {t} tokens (pass positions to index a table)")
    ps = k_cache.shape[2]
    null_slot = (k_cache.shape[0] - 1) * ps
    jobs = num_heads + 2 * num_kv_heads + (num_index_heads + 1 if has_index else 0)
    dummy = q_norm_w
    _qkv_norm_rope_write_kernel[(t, jobs)](
        qkv,
        qkv.stride(0),
        cos,
        sin,
        positions if positions is not None else slot_mapping,
        slot_mapping,
        q_norm_w,
        k_norm_w,
        index_q_norm_w if has_index else dummy,
        index_k_norm_w if has_index else dummy,
        q,
        iq if has_index else q,
        k_cache,
        v_cache,
        index_keys if has_index else k_cache,
        index_scales if index_scales is not None else k_cache,
        null_slot,
        eps,
        NH=num_heads,
        G=num_kv_heads,
        NI=num_index_heads if has_index else 0,
        HAS_INDEX=has_index,
        INDEX_FP8=index_scales is not None,
        D=head_dim,
        DI=index_dim if has_index else head_dim,
        HALF=half,
        PS=ps,
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_DI=triton.next_power_of_2(index_dim if has_index else head_dim),
        ROPE_TABLE=positions is not None,
        num_warps=1,
    )
    return q, iq


def add_rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    x2: torch.Tensor | None = None,
    want_fp32: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gemma RMSNorm of ``residual + (x [+ x2])`` with the residual updated IN PLACE (spec §3.1).

    x, x2, residual: [T, N], same activation dtype (residual's last dim contiguous; x, x2 are made
    so if needed); weight [N] raw (scale 1 + w).
    With ``residual`` None: plain norm of x (+ x2). Roundings as the PyTorch path: x + x2 rounded to
    the dtype, then residual + that rounded (stored back into ``residual``), the norm computed
    from the rounded sum. Returns (y [T, N] in x.dtype, y as fp32 [T, N] if ``want_fp32`` else None).
    """
    _check_act("x", x)
    if x.dim() != 2:
        raise ValueError(f"x: expected [T, N], got {tuple(x.shape)}")
    x = x if x.stride(1) == 1 else x.contiguous()
    x2 = x2 if x2 is None or x2.stride(1) == 1 else x2.contiguous()
    t, n = x.shape
    for name, o in (("residual", residual), ("x2", x2)):
        if o is not None and (tuple(o.shape) != (t, n) or o.stride(1) != 1 or o.dtype != x.dtype):
            raise ValueError(f"{name}: shape {tuple(o.shape)} dtype {o.dtype}, expected [{t}, {n}] {x.dtype}")
    y = torch.empty(t, n, dtype=x.dtype, device=x.device)
    y32 = torch.empty(t, n, dtype=torch.float32, device=x.device) if want_fp32 else None
    if t == 0:
        return y, y32
    block = triton.next_power_of_2(n)
    _add_rms_norm_kernel[(t,)](
        x,
        x2 if x2 is not None else x,
        residual if residual is not None else x,
        weight,
        y,
        y32 if want_fp32 else y,
        x.stride(0),
        x2.stride(0) if x2 is not None else 0,
        residual.stride(0) if residual is not None else 0,
        y.stride(0),
        eps,
        N=n,
        HAS_X2=x2 is not None,
        HAS_RES=residual is not None,
        WRITE_Y32=want_fp32,
        BLOCK=block,
        num_warps=min(16, max(1, block // 256)),
    )
    return y, y32


def swiglu(gate_up: torch.Tensor, alpha: float, limit: float, beta: float = 1.0) -> torch.Tensor:
    """SwiGLU-OAI (spec §3.7) of a [T, 2I] gate|up GEMM output -> [T, I] in its dtype (fp32 maths)."""
    _check_act("gate_up", gate_up)
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or gate_up.stride(1) != 1:
        raise ValueError(f"gate_up: expected [T, 2I] with a contiguous last dim, got {tuple(gate_up.shape)}")
    t, i = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(t, i, dtype=gate_up.dtype, device=gate_up.device)
    if t == 0:
        return out
    block = min(1024, triton.next_power_of_2(i))
    _swiglu_kernel[(t, triton.cdiv(i, block))](
        gate_up, out, gate_up.stride(0), out.stride(0), alpha, limit, beta, I=i, BLOCK=block, num_warps=4
    )
    return out


def router_topk(
    logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sigmoid top-k routing of ``moe.route`` in one launch (spec §3.6 steps 2-4).

    logits: [T, E] fp32; bias: [E] fp32 or None (selection only). Returns (weights [T, K] fp32 =
    unbiased scores of the chosen experts renormalised to 1 times ``scaling``, ids [T, K] int64,
    by descending biased score, ties to the lower expert id).
    """
    if logits.dtype != torch.float32 or logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(
            f"logits: expected fp32 [T, E] with a contiguous last dim, got {logits.dtype} {tuple(logits.shape)}"
        )
    t, e = logits.shape
    if not 1 <= top_k <= e:
        raise ValueError(f"top_k={top_k} must be in [1, E={e}]")
    w = torch.empty(t, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(t, top_k, dtype=torch.int64, device=logits.device)
    if t == 0:
        return w, ids
    _router_topk_kernel[(t,)](
        logits,
        bias if bias is not None else logits,
        w,
        ids,
        logits.stride(0),
        scaling,
        E=e,
        K=top_k,
        HAS_BIAS=bias is not None,
        BLOCK_E=triton.next_power_of_2(e),
        BLOCK_K=triton.next_power_of_2(top_k),
        num_warps=1,
    )
    return w, ids


# Per-token router GEMM only while every program re-reading W_gate stays cheap: T * E * H elements,
# and W_gate fits one register tile of a program (E * H, e.g. 16 x 1024; the real M3's 128 x 6144
# takes the cuBLAS GEMM + router_topk route).
ROUTER_GEMM_MAX_ELEMS = 1 << 22
ROUTER_GEMM_MAX_TILE = 1 << 14


def router_gemm_topk_ok(num_tokens: int, gate_weight: torch.Tensor) -> bool:
    """Whether ``router_gemm_topk`` suits this call (few tokens: decode-sized steps; small router)."""
    return (
        num_tokens * gate_weight.numel() <= ROUTER_GEMM_MAX_ELEMS
        and triton.next_power_of_2(gate_weight.shape[0]) * triton.next_power_of_2(gate_weight.shape[1])
        <= ROUTER_GEMM_MAX_TILE
    )


def router_gemm_topk(
    x: torch.Tensor, gate_weight: torch.Tensor, bias: torch.Tensor | None, top_k: int, scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits (fp32 GEMM of x upcast with the fp32 gate weight) + ``router_topk``, one launch.

    x: [T, H] activations (bf16/fp16/fp32, last dim contiguous); gate_weight: [E, H] fp32 contiguous;
    bias: [E] fp32 or None. Each program reads all of W_gate: meant for decode-sized T
    (``router_gemm_topk_ok``). Returns (weights [T, K] fp32, ids [T, K] int64) as ``router_topk``.
    """
    _check_act("x", x)
    if gate_weight.dtype != torch.float32 or not gate_weight.is_contiguous() or x.stride(-1) != 1:
        raise ValueError("router_gemm_topk: gate_weight must be contiguous fp32 [E, H], x [T, H] row-major")
    t, h = x.shape
    e = gate_weight.shape[0]
    if gate_weight.shape[1] != h or not 1 <= top_k <= e:
        raise ValueError(
            f"router_gemm_topk: gate_weight {tuple(gate_weight.shape)} vs x {tuple(x.shape)}, top_k={top_k}"
        )
    w = torch.empty(t, top_k, dtype=torch.float32, device=x.device)
    ids = torch.empty(t, top_k, dtype=torch.int64, device=x.device)
    if t == 0:
        return w, ids
    block_e = triton.next_power_of_2(e)
    block_h = max(16, min(triton.next_power_of_2(h), ROUTER_GEMM_MAX_TILE // block_e))
    _router_gemm_topk_kernel[(t,)](
        x,
        gate_weight,
        bias if bias is not None else gate_weight,
        w,
        ids,
        x.stride(0),
        scaling,
        H=h,
        E=e,
        K=top_k,
        HAS_BIAS=bias is not None,
        BLOCK_H=block_h,
        BLOCK_E=block_e,
        BLOCK_K=triton.next_power_of_2(top_k),
        num_warps=8,
    )
    return w, ids


# ----------------------------------------------------------------------------- skinny GEMM (decode)
@triton.jit(do_not_specialize=["T"])  # one compile for every decode batch size
def _skinny_gemm_kernel(
    x_ptr,
    w_ptr,
    wu_ptr,
    out_ptr,
    T,
    N,
    K,
    stride_x,
    stride_w,
    stride_o,
    alpha,
    limit,
    beta,
    SWIGLU: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # out[T, N] = x[T, K] @ w[N, K]^T; SWIGLU: w / wu are the gate / up rows [N, K] (same strides) and
    # out = swiglu_oai(x @ w^T, x @ wu^T), each product rounded to x's dtype first.
    # One program per BLOCK_N output columns (and their up rows), all T (<= BLOCK_T) rows: W is streamed once.
    pid = tl.program_id(0)
    ot = tl.arange(0, BLOCK_T)
    on = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = tl.arange(0, BLOCK_K)
    mt = ot < T
    mn = on < N
    acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + ok
        mk = kk < K
        a = tl.load(
            x_ptr + ot[:, None].to(tl.int64) * stride_x + kk[None, :], mask=mt[:, None] & mk[None, :], other=0.0
        )
        w_off = on[None, :].to(tl.int64) * stride_w + kk[:, None]
        wm = mk[:, None] & mn[None, :]
        acc += tl.dot(a, tl.load(w_ptr + w_off, mask=wm, other=0.0))
        if SWIGLU:
            acc_u += tl.dot(a, tl.load(wu_ptr + w_off, mask=wm, other=0.0))
    if SWIGLU:  # spec §3.7 on the rounded gate|up products, in fp32
        g = tl.minimum(acc.to(out_ptr.dtype.element_ty).to(tl.float32), limit)
        u = acc_u.to(out_ptr.dtype.element_ty).to(tl.float32)
        u = tl.minimum(tl.maximum(u, -limit), limit)
        acc = g * tl.sigmoid(alpha * g) * (u + beta)
    tl.store(
        out_ptr + ot[:, None].to(tl.int64) * stride_o + on[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=mt[:, None] & mn[None, :],
    )


# Measured on the H200 (300M bench model, docs/benchmarks.md): the skinny GEMM beats cuBLAS at 1 token
# (decode step 0.498 -> 0.423 ms GPU) and loses at 32 (0.599 -> 0.634 ms): used up to one 16-row tile.
SKINNY_MAX_TOKENS = 16


def skinny_config(n: int, swiglu: bool) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) of ``skinny_linear`` for n output columns (by output
    width and SwiGLU alone; the swept K sizes did not call for more).

    Plain GEMMs: from a sweep of 3 x 2 x 2 x 3 configurations at the M3 layer shapes and the 300M
    bench model's, 1 and 16 tokens (H200, docs/benchmarks.md 2026-12-03): wide outputs take 64
    columns per program (fewer, longer weight streams: o_proj 27.4 -> 26.6 us), narrow ones 16.
    SwiGLU (the gate|up GEMM with the activation in its epilogue, 2n weight rows): the plain launch of
    2n rows with half the columns per program (each program streams BLOCK_N gate and BLOCK_N up
    rows: the same bytes per program and program count as the plain gate|up GEMM), except that
    BLOCK_N stays >= 16 (n <= 1024: twice the bytes per program, half the programs).
    """
    if swiglu:
        bn, bk, warps, stages = skinny_config(2 * n, False)
        return max(16, bn // 2), bk, warps, stages
    if n <= 2048:
        return 16, 256, 4, 4
    return 64, (128 if n > 8192 else 256), 4, 4


def skinny_linear_ok(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``skinny_linear`` suits x [T, K] @ weight [N, K]^T: T <= SKINNY_MAX_TOKENS (decode),
    bf16/fp16, contiguous rows."""
    return (
        x.dim() == 2
        and 0 < x.shape[0] <= SKINNY_MAX_TOKENS
        and x.dtype in (torch.bfloat16, torch.float16)
        and weight.dtype == x.dtype
        and x.stride(1) == 1
        and weight.stride(1) == 1
    )


def skinny_linear(
    x: torch.Tensor, weight: torch.Tensor, swiglu_params: tuple[float, float, float] | None = None
) -> torch.Tensor:
    """x [T, K] @ weight [N, K]^T -> [T, N] in x.dtype for few tokens (T <= 32 allowed; the model uses
    it up to ``SKINNY_MAX_TOKENS``), fp32 accumulation, one rounding.

    With ``swiglu_params`` = (alpha, limit, beta), weight is a packed gate|up weight [2I, K] (gate
    rows first) and the result is SwiGLU-OAI(x @ gate^T, x @ up^T) -> [T, I] (spec §3.7): each
    product rounded to x.dtype, the activation in fp32, rounded to x.dtype, as the gate|up GEMM
    followed by ``moe.swiglu_oai`` (the [T, 2I] product never goes to memory). Raises ValueError
    on bad shapes or dtypes (or an odd row count with ``swiglu_params``).
    """
    swiglu = swiglu_params is not None
    if swiglu and len(swiglu_params) != 3:
        raise ValueError(f"skinny_linear: swiglu_params={swiglu_params!r}; give (alpha, limit, beta) or None")
    ok = (
        x.dim() == 2
        and weight.dim() == 2
        and 0 < x.shape[0] <= 32
        and x.dtype in (torch.bfloat16, torch.float16)
        and weight.dtype == x.dtype
        and x.stride(1) == 1
        and weight.stride(1) == 1
    )
    if not ok or x.shape[1] != weight.shape[1]:
        raise ValueError(
            f"skinny_linear: x {tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)} {weight.dtype}; needs "
            "x [T <= 32, K] and weight [N, K] in one of bf16 / fp16 with contiguous rows"
        )
    t = x.shape[0]
    n, k = weight.shape
    if swiglu and n % 2:
        raise ValueError(
            f"skinny_linear: weight {tuple(weight.shape)}; with swiglu_params it is a gate|up [2I, K] buffer"
        )
    if swiglu:
        n //= 2
    out = torch.empty(t, n, dtype=x.dtype, device=x.device)
    block_t = 16 if t <= 16 else 32
    block_n, block_k, warps, stages = skinny_config(n, swiglu)
    alpha, limit, beta = swiglu_params or (1.0, 1.0, 1.0)
    _skinny_gemm_kernel[(triton.cdiv(n, block_n),)](
        x,
        weight,
        weight[n:] if swiglu else weight,
        out,
        t,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        alpha,
        limit,
        beta,
        SWIGLU=swiglu,
        BLOCK_T=block_t,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=warps,
        num_stages=stages,
    )
    return out

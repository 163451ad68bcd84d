"""Static shared memory of the large-tile Triton kernels at their default launch configs, compiled for
sm_90 (H100/H200) on any machine: ``triton.compile`` with the ptxas shipped in the Triton wheel, no GPU.

``python -m m3_kernels.smem_check`` prints one JSON object {"<kernel>/<dtype>": bytes}; every value must
be <= msa_checks.SM90_SMEM_BYTES or the launch fails on the GPU with OutOfResources (tests/test_kernels_smem.py).
Must run without TRITON_INTERPRET (interpreted kernels cannot be compiled): the test starts it as a
subprocess. Real M3 shapes: MoE 128 experts, H 6144, I 3072, top-4 at T=4096 (the ragged path);
attention 4 KV heads x 16 q heads, d 128, page 128 (the batch-invariant decode launch: its
one-token walk, tests/gpu found fp32 at 2 stages over the limit on 2026-12-03); the batch-invariant
routed experts' unsplit gate/up launch (one pipelined K loop folding each chunk at its end) and
its prefill band's ragged GEMMs (the same folds in the fast mode's ragged kernels).
"""

from __future__ import annotations

import json

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.experimental.gluon._runtime import GluonASTSource

from m3_kernels import fused_moe, moe_chunked, moe_ragged
from m3_kernels import invariant_attention as ia
from m3_kernels import invariant_ops as inv
from m3_kernels import msa_kv_segment_sm90 as sm90
from m3_kernels import msa_paged_attention as ma

SM90 = GPUTarget("cuda", 90, 32)
_TT = {torch.bfloat16: "bf16", torch.float32: "fp32"}


def launch_attrs(fn, sig: dict) -> dict:
    """The specialization a real launch gives ``fn``: pointers 16-byte aligned and ``stride*`` ints
    divisible by 16 (``tt.divisibility``, what the JIT infers from torch tensors at these shapes).
    Without it the compiler cannot vectorize the loads into async copies, so the software pipeliner
    stages nothing and the shared memory comes out far below the launch's (2026-12-03: the
    invariant decode walk compiled to 98,304 B unspecialized, 163,840 B as launched)."""
    return {
        (i,): [["tt.divisibility", 16]]
        for i, name in enumerate(fn.arg_names)
        if str(sig.get(name, "")).startswith("*") or (name.startswith("stride") and sig.get(name) == "i32")
    }


def compile_sm90(fn, sig: dict, consts: dict, num_warps: int, num_stages: int, maxnreg: int | None = None):
    """JIT kernel ``fn`` (Triton or Gluon) compiled for sm_90 (sig: Triton type strings of the
    arguments, consts: the constexpr values), specialized as a launch would be (``launch_attrs``);
    maxnreg: the launch's register cap per thread, if any."""
    attrs = launch_attrs(fn, sig)
    sig = dict(sig, **{c: "constexpr" for c in consts})
    source = (GluonASTSource if fn.is_gluon() else ASTSource)(fn, sig, consts, attrs)
    options = {"num_warps": num_warps, "num_stages": num_stages, **({"maxnreg": maxnreg} if maxnreg else {})}
    return triton.compile(source, target=SM90, options=options)


def shared_bytes(fn, sig: dict, consts: dict, num_warps: int, num_stages: int) -> int:
    """Bytes of static shared memory of JIT kernel ``fn`` compiled for sm_90 (``compile_sm90``)."""
    return int(compile_sm90(fn, sig, consts, num_warps, num_stages).metadata.shared)


def kv_segment_sm90_consts() -> dict:
    """The constexprs of ``msa_kv_segment_sm90.kv_seg_attn_sm90_kernel`` as the KV-major prefill
    launches it at M3's shapes (4 KV heads, ``SM90_TILE``, default segment and stages)."""
    return dict(G=4, **sm90.SM90_TILE, SEG=ma.KV_SEGMENT, STAGES=sm90.KV_SEG_SM90_STAGES)


def _ragged_sig(fn, dt: str, block_n: int, block_k: int) -> dict:
    sig = {n: "i32" for n in fn.arg_names}
    for m, n in zip((128, 64, 32, 16), ("a128", "a64", "a32", "a16")):
        sig[n] = f"tensordesc<{dt}[{m}, {block_k}]>"
    sig["w_desc"] = f"tensordesc<{dt}[{block_n}, {block_k}]>"
    for n in ("sorted_ids_ptr", "tile_row_ptr", "tile_expert_ptr", "tile_rows_ptr", "num_tiles_ptr"):
        sig[n] = "*i32"
    return sig


def ragged_moe(dtype: torch.dtype, cfg: fused_moe.MoEKernelConfig | None = None) -> dict[str, int]:
    """Shared bytes of the ragged w13 / w2 GEMMs for ``dtype`` with ``cfg`` (default: the fast mode's
    large-batch default tiles; its k_chunk is compiled in as the kernels' K_CHUNK)."""
    if cfg is None:
        cfg = fused_moe.config_for_dtype(fused_moe.default_config(4096 * 4, 128, 6144, 3072), dtype)
    dt, prec = _TT[dtype], ("ieee" if dtype == torch.float32 else "tf32")
    t13, t2 = cfg.w13, cfg.w2
    sig = _ragged_sig(moe_ragged.moe_w13_ragged_kernel, dt, t13.block_n, t13.block_k)
    sig.update(x_ptr="*" + dt, act_ptr="*" + dt, alpha="fp32", limit="fp32", beta="fp32")
    w13 = shared_bytes(
        moe_ragged.moe_w13_ragged_kernel,
        sig,
        dict(
            INTER=3072,
            HIDDEN=6144,
            BLOCK_N=t13.block_n,
            BLOCK_K=t13.block_k,
            PRECISION=prec,
            TOP_K=4,
            GATHER=not cfg.permute,
            FAT=cfg.fat_tail,
            K_CHUNK=cfg.k_chunk,
        ),
        t13.num_warps,
        t13.num_stages,
    )
    sig = _ragged_sig(moe_ragged.moe_w2_ragged_kernel, dt, t2.block_n, t2.block_k)
    sig.update(out_ptr="*" + dt, weights_ptr="*fp32")
    w2 = shared_bytes(
        moe_ragged.moe_w2_ragged_kernel,
        sig,
        dict(
            HIDDEN=6144,
            INTER=3072,
            BLOCK_N=t2.block_n,
            BLOCK_K=t2.block_k,
            PRECISION=prec,
            FAT=cfg.fat_tail,
            K_CHUNK=cfg.k_chunk,
        ),  # fmt: skip
        t2.num_warps,
        t2.num_stages,
    )
    return {f"moe_w13_ragged/{dt}": w13, f"moe_w2_ragged/{dt}": w2}


def kv_major_prefill(dtype: torch.dtype) -> dict[str, int]:
    """Shared bytes of the KV-major sparse-prefill segment kernel (default tile and loop: ``KV_SEG_LOOP``,
    ``KV_SEG_PIPELINE_STAGES`` deep, for 16-bit dtypes, the one-ahead prefetch for fp32) for ``dtype``."""
    dt, ieee = _TT[dtype], dtype == torch.float32
    sig = {n: "i32" for n in ma.kv_seg_attn_kernel.arg_names}
    sig.update(
        q_ptr="*" + dt,
        k_ptr="*" + dt,
        v_ptr="*" + dt,
        opart_ptr="*" + dt,
        perm_ptr="*i64",
        lse_ptr="*fp32",
        epos_ptr="*i32",
        seg_bkt_ptr="*i32",
        bkt_start_ptr="*i64",
        bkt_seg0_ptr="*i64",
        bkt_end_ptr="*i64",
        bkt_page_ptr="*i32",
        qk_scale="fp32",
    )
    consts = dict(
        G=4,
        RH=16,
        RHP=16,
        D=128,
        PS=128,
        TOK=4,
        SEG=ma.KV_SEGMENT,
        SEGP=ma.KV_SEGMENT,
        IEEE=ieee,
        PREFETCH=ieee,
        PIPELINE=not ieee,
        DEFERRED=not ieee and ma.KV_SEG_LOOP == "deferred",
    )
    stages = 1 if ieee else ma.KV_SEG_PIPELINE_STAGES
    out = {f"kv_major_segment/{dt}": shared_bytes(ma.kv_seg_attn_kernel, sig, consts, num_warps=4, num_stages=stages)}
    if not ieee:  # the Hopper (Gluon) segment kernel, 16-bit inputs only
        fn = sm90.kv_seg_attn_sm90_kernel
        sig90 = {n: sig[n] for n in fn.arg_names if n in sig}
        out[f"kv_major_segment_sm90/{dt}"] = shared_bytes(fn, sig90, kv_segment_sm90_consts(), 4, 1)
    return out


def invariant_decode_attention(dtype: torch.dtype) -> dict[str, int]:
    """Shared bytes of the batch-invariant attention's one-token decode launch (the one-token walk at
    ``decode_walk_stages``), dense and sparse layer tiles, for ``dtype``."""
    fn, dt, ieee = ia.inv_attn_kernel, _TT[dtype], dtype == torch.float32
    sig = {n: "i32" for n in fn.arg_names}
    sig.update({n: "*" + dt for n in ("q_ptr", "k_ptr", "v_ptr", "o_ptr")})
    sig.update({n: "*i32" for n in ("bt_ptr", "qsl_ptr", "pos_ptr", "sel_ptr")})
    sig.update({n: "*fp32" for n in ("pm_ptr", "pl_ptr", "pacc_ptr")}, qk_scale="fp32")
    out = {}
    shapes = [(True, 128, 128, ""), (False, 128, 128, "")]
    if not ieee:  # the widest head with a smaller page the input check accepts: fewer stages fit
        shapes.append((True, 256, 64, "_d256_ps64"))
    for dense, d, ps, tag in shapes:
        rows, warps = (ia.DENSE_TILE_ROWS, ia.DENSE_WARPS) if dense else (ia.SPARSE_TILE_ROWS, ia.SPARSE_WARPS)
        consts = dict(
            NH=64, RH=16, RHP=16, D=d, PS=ps, BLOCK_M=ia.attn_block_m(16, rows), KP=16,
            SPLIT_B=ia.ATTN_SPLIT_BLOCKS, DENSE=dense, IEEE=ieee, PDL=True, PARTIAL=True, ONE=True,
            STAGES=ia.decode_walk_stages(ieee, rows, d, ps, dtype.itemsize),
        )  # fmt: skip
        name = f"invariant_decode_{'dense' if dense else 'sparse'}{tag}/{dt}"
        out[name] = shared_bytes(fn, sig, consts, num_warps=warps, num_stages=1 if ieee else 2)
    return out


def invariant_chunked_moe_gate_up(dtype: torch.dtype) -> dict[str, int]:
    """Shared bytes of the batch-invariant routed experts' unsplit gate/up launch (``moe_chunked``,
    ``invariant_ops.INVARIANT_MOE_CONFIG`` tiles, M3's H 6144 / I 3072: one pipelined K loop
    folding each chunk at its end), for ``dtype``."""
    cfg = fused_moe.config_for_dtype(inv.INVARIANT_MOE_CONFIG, dtype)
    fn, dt, tile = moe_chunked.moe_w13_chunked_kernel, _TT[dtype], cfg.w13
    sig = {n: "i32" for n in fn.arg_names}
    sig.update(x_ptr="*" + dt, w13_ptr="*" + dt, act_ptr="*" + dt, part_ptr="*fp32", count_ptr="*i32")
    sig.update(sorted_ids_ptr="*i32", tile_expert_ptr="*i32", num_rows_ptr="*i32", alpha="fp32", limit="fp32")
    sig.update(beta="fp32")
    consts = dict(
        TOP_K=4, INTER=3072, HIDDEN=6144, BLOCK_M=cfg.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
        K_CHUNK=cfg.k_chunk, SPLIT=False, PRECISION="ieee" if dtype == torch.float32 else "tf32",
    )  # fmt: skip
    return {f"invariant_moe_w13_flat/{dt}": shared_bytes(fn, sig, consts, tile.num_warps, tile.num_stages)}


def invariant_ragged_moe(dtype: torch.dtype) -> dict[str, int]:
    """Shared bytes of the batch-invariant prefill band's ragged w13 / w2 GEMMs (``moe_ragged`` with
    K chunks folded in, ``invariant_ops.INVARIANT_MOE_PREFILL_CONFIG`` tiles, M3's H 6144 / I 3072)
    for ``dtype``."""
    cfg = fused_moe.config_for_dtype(inv.INVARIANT_MOE_PREFILL_CONFIG, dtype)
    return {f"invariant_{name}": size for name, size in ragged_moe(dtype, cfg).items()}


def main() -> None:
    out: dict[str, int] = {}
    for dtype in (torch.bfloat16, torch.float32):
        out.update(ragged_moe(dtype))
        out.update(kv_major_prefill(dtype))
        out.update(invariant_decode_attention(dtype))
        out.update(invariant_chunked_moe_gate_up(dtype))
        out.update(invariant_ragged_moe(dtype))
    print(json.dumps(out))


if __name__ == "__main__":
    main()

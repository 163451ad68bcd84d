"""The tensor-core code of the page-partials decode kernel and of the prefill kernel whose bits it must
equal, compiled for sm_90 (H100/H200) on any machine (``triton.compile``, no GPU).

``python -m m3_kernels.mma_check`` prints one JSON object {"<kernel>/bf16": {"layouts": [...],
"dots": [...], "instructions": [...]}}: the ``#ttg.nvidia_mma`` layouts of the TTGIR (MMA version,
warps per CTA, instruction shape), its dots' operand and result types, and the MMA instructions of
the PTX (opcode and immediates), for ``msa_paged_attention.kv_seg_attn_kernel``
and ``invariant_page_partials.pp_decode_kernel`` at M3 shapes (4 KV heads x 16 q heads, d 128,
page 128, top-16) with ``PAGE_PARTIALS_LAUNCH``. A decode row's partial equals the prefill row's
only if both kernels run the same instruction on the same tile (tests/test_invariant_page_partials.py
compares them); whether equal instructions give equal rows on the hardware is for tests/gpu. bf16
only: fp32 (IEEE) dots lower to FMA loops, and that compile takes over a minute on the CPU.
Must run without TRITON_INTERPRET (a subprocess in the test).
"""

from __future__ import annotations

import json
import re

import torch

from m3_kernels import invariant_page_partials as pp
from m3_kernels import msa_kv_segment_sm90 as sm90
from m3_kernels import msa_paged_attention as ma
from m3_kernels.smem_check import compile_sm90, kv_segment_sm90_consts


def softmax_under_mma(ptx: str) -> bool:
    """Whether the first base-2 exponential of ``ptx`` is issued while a committed wgmma group is in
    flight (a ``wgmma.commit_group`` after the last ``wgmma.wait_group`` before it in the PTX text):
    the softmax of one tile issued under a tensor-core dot, as kernels/msa_kv_segment_sm90.py does.
    A proxy read from issue order, not a measurement of execution (that is docs/benchmarks.md's)."""
    ex2 = ptx.find("ex2.approx")
    if ex2 < 0:
        return False
    return ptx.rfind("wgmma.commit_group", 0, ex2) > ptx.rfind("wgmma.wait_group", 0, ex2)


def dot_code(fn, sig: dict, consts: dict, num_warps: int, num_stages: int) -> dict:
    """{"layouts": distinct MMA layouts of the TTGIR, "dots": distinct dot signatures, "instructions":
    distinct MMA instructions of the PTX (each sorted), "softmax_under_mma": ``softmax_under_mma``}
    of JIT (Triton or Gluon) kernel ``fn`` compiled for sm_90 as a launch specializes it
    (``launch_attrs``)."""
    kernel = compile_sm90(fn, sig, consts, num_warps, num_stages)
    ttgir, ptx = kernel.asm["ttgir"], kernel.asm["ptx"]
    dots = re.findall(r"(?:ttng\.warp_group_dot|tt\.dot) [^{]*\{[^}]*\} : ([^\n]*?)(?: loc\(|$)", ttgir, re.M)
    mma = re.findall(r"^\s*((?:wgmma\.mma_async|mma\.sync)[\w.]*)\s+([^;]*);", ptx, re.M)
    return {
        "layouts": sorted(set(re.findall(r"#ttg\.nvidia_mma<\{[^}]*\}>", ttgir))),
        # operand types (shared memory or registers) and result; "mutable" (a pipeline buffer) and the
        # attributes (isAsync: when the warps wait for it) dropped
        "dots": sorted({d.replace(", mutable", "") for d in dots}),
        # opcode and the immediate operands (scale-d, negation, transposition), registers blanked
        "instructions": sorted({f"{op} " + re.sub(r"%\w+|\{[^}]*\}", "R", args) for op, args in mma}),
        "softmax_under_mma": softmax_under_mma(ptx),
    }


def page_partials_kernels(dtype: torch.dtype = torch.bfloat16) -> dict[str, dict[str, list[str]]]:
    """``dot_code`` of kv_seg_attn_kernel (as ``prefill_kv_major`` launches it with the page-partials
    constants) and of pp_decode_kernel, for ``dtype``."""
    dt, ieee = {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype], False
    cfg = pp.page_partials_config(16, ieee)
    tile = dict(G=4, RH=16, RHP=16, D=128, PS=128, TOK=cfg["tok"], SEG=cfg["seg"], SEGP=cfg["seg"], IEEE=ieee)
    deferred = cfg["prefetch"] == "deferred"
    io = dict(q_ptr="*" + dt, k_ptr="*" + dt, v_ptr="*" + dt, opart_ptr="*" + dt, lse_ptr="*fp32")
    seg_sig = {n: "i32" for n in ma.kv_seg_attn_kernel.arg_names}
    seg_sig.update(io, epos_ptr="*i32", perm_ptr="*i64", seg_bkt_ptr="*i32", bkt_page_ptr="*i32", qk_scale="fp32")
    seg_sig.update({n: "*i64" for n in ("bkt_start_ptr", "bkt_seg0_ptr", "bkt_end_ptr")})
    dec_sig = {n: "i32" for n in pp.pp_decode_kernel.arg_names}
    dec_sig.update(io, bt_ptr="*i32", pos_ptr="*i64", sel_ptr="*i32", qk_scale="fp32")
    seg_consts = dict(tile, PREFETCH=False, PIPELINE=True, DEFERRED=deferred)
    run = dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    sm90_sig = {n: seg_sig[n] for n in sm90.kv_seg_attn_sm90_kernel.arg_names if n in seg_sig}
    sm90_consts = kv_segment_sm90_consts()
    return {
        f"kv_seg_attn_kernel/{dt}": dot_code(ma.kv_seg_attn_kernel, seg_sig, seg_consts, **run),
        f"kv_seg_attn_sm90_kernel/{dt}": dot_code(sm90.kv_seg_attn_sm90_kernel, sm90_sig, sm90_consts, 4, 1),
        f"pp_decode_kernel/{dt}": dot_code(pp.pp_decode_kernel, dec_sig, dict(tile, KP=16, DEFERRED=deferred), **run),
    }


if __name__ == "__main__":
    print(json.dumps(page_partials_kernels()))

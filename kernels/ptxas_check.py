"""The prefill index-score launch as compiled for sm_90 on any machine (no GPU): where its dot reads
the query operand, and what ptxas reports.

``python -m m3_kernels.ptxas_check`` prints one JSON object {"<format>": {"query_operand",
"registers", "spill_bytes", "wgmma_serialized"}} for ``msa_index_topk.index_scores_kernel`` as
``prefill_score_config`` launches it at M3's shapes (4 index heads, index dim 128, page 128, bf16
query rows) for each index-key format: "bf16" (bf16 keys), "fp8" (e4m3 keys, bf16 queries: the
keys converted in registers), "fp8q" (e4m3 keys, the queries quantized to e4m3 too).
"registers": per thread (the launch caps them at 128: two 8-warp programs per SM); "spill_bytes":
spill stores per thread. "query_operand": "shared" when the TTGIR's warpgroup dot takes
the query tile from shared memory, "registers" when it is a register operand (then ptxas reloads
it from a shared copy before every k-step). "wgmma_serialized": ptxas's C7511 note (the k-steps of
a dot wait for one another for want of registers).

Found 2026-12-07 (docs/benchmarks.md): with FP8 queries quantized inside the kernel the query tile
is a register operand and the launch spills 404 bytes under its 128-register cap; quantized before
the launch (``PREFILL_SCORE_FORMAT`` "qpre") the dot reads the loaded codes from shared memory and
the spills drop to 96 bytes: the 128K scores 10.4-10.9 -> 9.8-10.3 ms on an H100 (alternating
A/B). The C7511 note stays (a [256, 128] fp32 accumulator is 128 registers a thread); the variants
without it (two or four key sub-tiles, no cap) measured slower. The "fp8" launch spills 268 bytes
(two key sub-tiles, measured as its fastest tile on 2026-12-06); it is not what the 10x target is
stated for and was not changed. tests/test_kernels_smem.py keeps the FP8-query launch on the
shared-memory operand. Must run without TRITON_INTERPRET (the test starts it as a subprocess).
"""

from __future__ import annotations

import json
import re
import subprocess
import tempfile
from pathlib import Path

import torch
from triton.backends.nvidia.compiler import get_ptxas

from m3_kernels import msa_index_topk as mi
from m3_kernels.paged_layout import FP8IndexCache
from m3_kernels.smem_check import compile_sm90


def ptxas_report(ptx: str) -> dict:
    """{"registers", "spill_bytes" (spill stores), "wgmma_serialized"} from ``ptxas -v`` on ``ptx``
    for sm_90a (the ptxas shipped in the Triton wheel). Raises RuntimeError with ptxas's output if
    it fails or its report lacks the register line."""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        run = subprocess.run(
            [get_ptxas(90).path, "-v", "--gpu-name=sm_90a", str(src), "-o", str(src.with_suffix(".o"))],
            capture_output=True,
            text=True,
        )
    log = run.stderr + run.stdout
    regs = re.search(r"Used (\d+) registers", log)
    spill = re.search(r"(\d+) bytes spill stores", log)
    if run.returncode or regs is None or spill is None:
        raise RuntimeError(f"ptxas failed or gave no register report:\n{log}")
    return {
        "registers": int(regs.group(1)),
        "spill_bytes": int(spill.group(1)),
        "wgmma_serialized": "C7511" in log,
    }


def prefill_score_report(fmt: str, **knobs) -> dict:
    """``ptxas_report`` plus "query_operand" ("shared" | "registers", from the TTGIR's warpgroup
    dot) of the prefill score kernel as ``prefill_score_config`` launches it for index-key format
    ``fmt`` ("bf16", "fp8", "fp8q") with bf16 queries at M3's shapes; knobs override that config
    (``index_block_scores``' prefill_config keys, e.g. qpre=False). Raises ValueError for another
    ``fmt``, RuntimeError when the TTGIR has no warpgroup dot or ptxas fails. The launch's
    constexprs are rebuilt here from ``prefill_score_config`` (the rules of
    ``msa_index_topk._score_launch`` for a prefill launch of one split)."""
    if fmt not in ("bf16", "fp8", "fp8q"):
        raise ValueError(f"prefill_score_report: index-key format {fmt!r}; use 'bf16', 'fp8' or 'fp8q'")
    keys = torch.zeros(1, 128, 128)
    codes = keys.to(torch.float8_e4m3fn)
    cache = keys.bfloat16() if fmt == "bf16" else FP8IndexCache(codes, keys[:, :, 0], fmt == "fp8q")
    iq = torch.zeros(1, 4, 128, dtype=torch.bfloat16)
    cfg = dict(mi.prefill_score_config(iq, cache), **knobs)
    fp8 = fmt != "bf16"
    qpre = fmt == "fp8q" and cfg["qpre"]
    box = f"[{128 // cfg['nsub']}, 128]"
    fn = mi.index_scores_kernel
    sig = {n: "i32" for n in fn.arg_names}
    sig.update(
        iq_ptr="*fp8e4nv" if qpre else "*bf16",
        iqs_ptr="*fp32" if qpre else "*bf16",
        ik_ptr=f"tensordesc<fp8e4nv{box}>" if cfg["tma"] else ("*fp8e4nv" if fp8 else "*bf16"),
        iks_ptr="*fp32" if fp8 else "*bf16",
        bt_ptr="*i32",
        qsl_ptr="*i32",
        pos_ptr="*i64",
        score_ptr="*fp32",
    )
    consts = dict(
        G=4,
        GP=4,
        DI=128,
        PS=128,
        BLOCK_M=cfg["block_m"],
        STORE_B=cfg["store_b"],
        KSCALE=fp8,
        QFP8=fmt == "fp8q",
        SPLIT_CAUSAL=cfg["split_causal"],
        NSUB=cfg["nsub"],
        TMA=cfg["tma"],
        PV=0,
        PDL=False,
        PVC=cfg["pvc"],
        QPRE=qpre,
    )
    warps, stages = mi.score_warps(cfg, cfg["block_m"], 4), cfg.get("num_stages", 3)
    kernel = compile_sm90(fn, sig, consts, warps, stages, maxnreg=cfg.get("maxnreg"))
    # "ttng.warp_group_dot %a, %b, %c {attributes} : <A's type> * <B's type> -> <result>"
    dots = re.findall(r"ttng\.warp_group_dot [^{\n]*\{[^}]*\} : (\S+)", kernel.asm["ttgir"])
    if not dots:
        raise RuntimeError(f"no warpgroup dot in the sm_90 TTGIR of the {fmt} prefill score launch")
    kinds = {"shared" if ty.startswith("!ttg.memdesc") else "registers" for ty in dots}
    return {"query_operand": "/".join(sorted(kinds)), **ptxas_report(kernel.asm["ptx"])}


if __name__ == "__main__":
    print(json.dumps({fmt: prefill_score_report(fmt) for fmt in ("bf16", "fp8", "fp8q")}))

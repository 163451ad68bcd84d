"""Profile the engine's decode steps (GPU or CPU): where a step's time goes.

    python scripts/profile_engine.py --device cuda --model-json configs/bench/m3_bench_300m.json --batch 1
    python scripts/profile_engine.py --device cuda --model-json configs/bench/m3_bench_300m.json \\
        --batches 1 32 --cuda-graphs --graph-replay 200 --variants pytorch fused --kernel-table --out-json prof.json

Prints the wall time per engine decode step (public step() API) and, with ``--profile-ops``,
torch.profiler's top ops. With ``--cuda-graphs`` on the GPU it first measures the model alone:
``--batch`` rows of ``--context`` cached tokens, the decode forward (``forward_paged``) captured in
a CUDA graph and replayed ``--graph-replay`` times between CUDA events = the GPU time of one
decode step with no host work; ``--kernel-table`` lists the kernels of that forward (count and
device time per step, eager). ``--variants`` runs everything once per model path in the same
process (``pytorch``: PyTorch ops; ``fused``: the engine's default table, engine/ops.py; ``fused+cublas``,
``fused+router_cublas``, ``invariant``, and ``invariant+<option>+...``: the invariant table with
its kernels' scheduling constants switched, see ``--help`` and ``variant_ops``); ``--compare-fused``
= ``--variants pytorch fused``.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import re
import time
from pathlib import Path

import torch
from benchlib import bench_config, run_date

from m3_kernels import invariant_attention as ia
from m3_kernels import invariant_ops as inv
from m3_kernels.paged_layout import PagedMetadata
from m3_rollout.engine.config import DEFAULT_INVARIANT_SPARSE_ATTENTION, EngineConfig
from m3_rollout.engine.engine import LLMEngine
from m3_rollout.engine.interface import GenerationRequest, SamplingParams
from m3_rollout.engine.ops import paged_ops_for
from m3_rollout.engine.paged_cache import PagedKVCache
from m3_rollout.model import M3ForCausalLM, tiny_config
from m3_rollout.model.paged_ops import PagedOps


def _kernel_table(fn, steps: int) -> tuple[list[tuple[str, float, float]], float]:
    """Run ``fn`` ``steps`` times under torch.profiler; return ([(kernel, count/step, us/step)], us/step)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            t = getattr(e, "self_device_time_total", None)
            t = e.self_cuda_time_total if t is None else t
            rows.append((e.key, e.count / steps, t / steps))
    rows.sort(key=lambda r: -r[2])
    return rows, sum(r[2] for r in rows)


def _engine(
    model,
    cfg,
    batch: int,
    prompt: int,
    steps: int,
    graphs: bool,
    ops: PagedOps,
    batch_invariant: bool = False,
    invariant_sparse_attention: str = DEFAULT_INVARIANT_SPARSE_ATTENTION,
) -> LLMEngine:
    max_len = prompt + steps * 4 + 64
    ec = EngineConfig(
        max_model_len=max_len,
        max_num_seqs=batch,
        enable_cuda_graphs=graphs,
        cuda_graph_batch_sizes=(batch,),
        kv_cache_memory_gb=1.0 if graphs else 0.0,
        batch_invariant=batch_invariant,
        invariant_sparse_attention=invariant_sparse_attention,
    )
    eng = LLMEngine(model, ec, ops=ops)
    g = torch.Generator().manual_seed(0)
    for i in range(batch):
        ids = torch.randint(3, cfg.vocab_size, (prompt,), generator=g).tolist()
        eng.add_request(GenerationRequest(f"r{i}", ids, SamplingParams(max_new_tokens=steps * 4, seed=i)))
    return eng


VARIANTS = ("pytorch", "fused", "fused+cublas", "fused+router_cublas", "invariant")
# "invariant+<option>+...": A/B switches of the batch-invariant kernels' module constants (read at
# launch; none changes a bit of the results, only how the work is scheduled). Flags: union_walk
# (invariant_attention.DECODE_PIPELINE off), stages2 (DECODE_STAGES 2), topk_launch (DECODE_FUSED_TOPK
# off), topk_long (TOPK_SHORT_PATH off: the index top-k walks 128-block chunks for short rows too),
# nopdl (PDL off: the decode merge launches after the attention), union (the sparse layers'
# union walk instead of the default per-page partials: EngineConfig.invariant_sparse_attention, other
# bits; union_walk, stages2 and dp then apply to the sparse layers too), moe_aligned (the routed experts'
# prefill band off: every size on the aligned chunked kernels, invariant_ops.MOE_PREFILL_ROWS),
# noswiglu_fuse (decode steps' gate|up GEMM and SwiGLU in two launches: invariant_ops.LINEAR_SWIGLU_FUSE
# off), norouter_fuse (decode steps' router GEMM and top-k in two launches: invariant_ops.
# ROUTER_GEMM_TOPK_FUSE off), chunked_k (invariant_ops.WHOLE_K off: GEMMs with K >= WHOLE_K_MIN_K sum K
# in fixed chunks like the narrower ones, other bits than the whole-K chain, the same in every band). Numbers: dp<N>
# (DECODE_PROGRAMS), ss<N> (SCORE_SPLIT_BLOCKS_DECODE); the linear's decode band (invariant_ops.
# LINEAR_DECODE_CONFIGS): lbn<N> (block_n), lbk<N> (block_k, the K step), lw<N> (warps), ls<N> (stages),
# lsk<N> (split_k_below: split-K below N output tiles; 0 = no split-K).
INVARIANT_FLAGS = (
    "union_walk",
    "stages2",
    "topk_launch",
    "topk_long",
    "nopdl",
    "union",
    "moe_aligned",
    "noswiglu_fuse",
    "norouter_fuse",
    "chunked_k",
)
INVARIANT_NUMBERS = ("dp", "ss", "lbn", "lbk", "lw", "ls", "lsk")


# the scheduling constants an invariant+... variant sets, at their import-time defaults (every
# ``invariant`` variant starts from these)
_IA_DEFAULTS = {
    n: getattr(ia, n)
    for n in (
        "DECODE_PIPELINE",
        "DECODE_STAGES",
        "DECODE_FUSED_TOPK",
        "TOPK_SHORT_PATH",
        "PDL",
        "DECODE_PROGRAMS",
        "SCORE_SPLIT_BLOCKS_DECODE",
    )
}
_DEFAULT_LINEAR_DECODE = dict(inv.LINEAR_DECODE_CONFIGS)
_DEFAULT_MOE_PREFILL_ROWS = inv.MOE_PREFILL_ROWS
_DEFAULT_LINEAR_SWIGLU_FUSE = inv.LINEAR_SWIGLU_FUSE
_DEFAULT_ROUTER_GEMM_TOPK_FUSE = inv.ROUTER_GEMM_TOPK_FUSE
_DEFAULT_WHOLE_K = inv.WHOLE_K


def _invariant_options(name: str) -> dict[str, int]:
    """The options of an ``invariant+...`` variant name as {option: value (1 for flags)}. Raises
    ValueError naming an unknown or repeated option or a number out of range (dp, ss, ls >= 1; lsk
    >= 0; lbn a power of two >= 16; lbk 16, 32, 64 or 128; lw 1, 2, 4 or 8)."""
    opts = {}
    for tok in name.split("+")[1:]:
        m = re.fullmatch(r"([a-z_]+?)([0-9]+)", tok)
        key, num = (tok, None) if tok in INVARIANT_FLAGS else (m.group(1), int(m.group(2))) if m else (tok, None)
        if not (tok in INVARIANT_FLAGS or (key in INVARIANT_NUMBERS and num is not None)):
            raise ValueError(
                f"--variants: {name!r}: option {tok!r} is not a flag of {INVARIANT_FLAGS} or a number option "
                f"of {INVARIANT_NUMBERS} (e.g. dp512)"
            )
        if key in opts:
            raise ValueError(f"--variants: {name!r}: option {key!r} given twice")
        ranges = {"lsk": num is not None and num >= 0, "lw": num in (1, 2, 4, 8)}
        ranges["lbn"] = num is not None and num >= 16 and num & (num - 1) == 0
        ranges["lbk"] = num in (16, 32, 64, 128)
        if not ranges.get(key, num is None or num >= 1):
            raise ValueError(
                f"--variants: {name!r}: {tok!r} out of range (dp, ss, ls >= 1; lsk >= 0; lbn a power of two "
                ">= 16; lbk 16, 32, 64 or 128; lw 1, 2, 4 or 8)"
            )
        opts[key] = 1 if num is None else num
    return opts


def variant_sparse_attention(name: str) -> str:
    """The batch-invariant sparse attention (``EngineConfig.invariant_sparse_attention``) of an
    ``invariant`` variant: "union" with the ``union`` flag, else the engine's default; the default
    for other variants too (they do not read it). Raises ValueError as ``check_variant``."""
    check_variant(name)
    union = name.startswith("invariant") and "union" in _invariant_options(name)
    return "union" if union else DEFAULT_INVARIANT_SPARSE_ATTENTION


def check_variant(name: str) -> None:
    """Raises ValueError for a ``--variants`` name that ``variant_ops`` would refuse (main checks every
    name before the first run)."""
    base = name.split("+")[0] if name.startswith("invariant") else name
    if base not in VARIANTS:
        raise ValueError(f"--variants: {name!r} is not one of {VARIANTS} (or invariant+<option>...)")
    if base == "invariant":
        _invariant_options(name)


def variant_ops(name: str, device: torch.device, dtype: torch.dtype) -> PagedOps:
    """The paged forward's ops table of a model path: ``pytorch`` (PyTorch layer ops; MSA and MoE
    kernels stay), ``fused`` (the engine's default table), ``fused+cublas`` (every projection GEMM
    on cuBLAS, no Triton skinny GEMM), ``fused+router_cublas`` (router GEMM on cuBLAS + top-k
    kernel: sets ``fused_layers.ROUTER_GEMM_MAX_ELEMS``, read at call time), ``invariant`` (the
    batch-invariant table of ``EngineConfig.batch_invariant``, design.md §4.6), and
    ``invariant+<option>+...`` (``INVARIANT_FLAGS`` / ``INVARIANT_NUMBERS``: the same table with the
    invariant kernels' scheduling constants switched for an A/B; every ``invariant`` variant starts
    from the import-time defaults). Raises ValueError for an unknown name or option."""
    check_variant(name)
    if name.startswith("invariant"):
        opts = _invariant_options(name)
        if device.type == "cuda":
            for n, v in _IA_DEFAULTS.items():
                setattr(ia, n, v)
            ia.DECODE_PIPELINE = "union_walk" not in opts and _IA_DEFAULTS["DECODE_PIPELINE"]
            ia.DECODE_STAGES = 2 if "stages2" in opts else _IA_DEFAULTS["DECODE_STAGES"]
            ia.DECODE_FUSED_TOPK = "topk_launch" not in opts and _IA_DEFAULTS["DECODE_FUSED_TOPK"]
            ia.TOPK_SHORT_PATH = "topk_long" not in opts and _IA_DEFAULTS["TOPK_SHORT_PATH"]
            ia.PDL = "nopdl" not in opts and _IA_DEFAULTS["PDL"]
            ia.DECODE_PROGRAMS = opts.get("dp", _IA_DEFAULTS["DECODE_PROGRAMS"])
            ia.SCORE_SPLIT_BLOCKS_DECODE = opts.get("ss", _IA_DEFAULTS["SCORE_SPLIT_BLOCKS_DECODE"])
            dec = _DEFAULT_LINEAR_DECODE[torch.bfloat16]
            inv.LINEAR_DECODE_CONFIGS = dict(_DEFAULT_LINEAR_DECODE)
            inv.MOE_PREFILL_ROWS = 1 << 62 if "moe_aligned" in opts else _DEFAULT_MOE_PREFILL_ROWS
            inv.LINEAR_SWIGLU_FUSE = "noswiglu_fuse" not in opts and _DEFAULT_LINEAR_SWIGLU_FUSE
            inv.ROUTER_GEMM_TOPK_FUSE = "norouter_fuse" not in opts and _DEFAULT_ROUTER_GEMM_TOPK_FUSE
            inv.WHOLE_K = "chunked_k" not in opts and _DEFAULT_WHOLE_K
            inv.LINEAR_DECODE_CONFIGS[torch.bfloat16] = dataclasses.replace(
                dec,
                block_n=opts.get("lbn", dec.block_n),
                block_k=opts.get("lbk", dec.block_k),
                split_k_below=opts.get("lsk", dec.split_k_below),
                num_warps=opts.get("lw", dec.num_warps),
                num_stages=opts.get("ls", dec.num_stages),
            )
        return paged_ops_for(
            device, dtype, batch_invariant=True, invariant_sparse_attention=variant_sparse_attention(name)
        )
    if device.type == "cuda":
        import m3_kernels.fused_layers as fl

        fl.ROUTER_GEMM_MAX_ELEMS = 0 if "router_cublas" in name else 1 << 22
    return paged_ops_for(device, dtype, fused_layers=name != "pytorch", skinny_gemm=name != "fused+cublas")


def engine_wall(model, cfg, args, batch: int, variant: str) -> dict:
    """Wall time per engine decode step through the public step() API (host + GPU)."""
    dev = torch.device(args.device)
    ops = variant_ops(variant, dev, model.model.embed_tokens.weight.dtype)
    inv_mode = variant.startswith("invariant")
    eng = _engine(
        model, cfg, batch, args.prompt, args.steps, args.cuda_graphs, ops, inv_mode, variant_sparse_attention(variant)
    )
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    for _ in range(4):  # prefill + warm-up decodes
        eng.step()
    sync()
    t0 = time.perf_counter()
    n = args.steps // 2
    for _ in range(n):
        eng.step()
    sync()
    ms = 1000 * (time.perf_counter() - t0) / n
    print(f"[batch {batch}, {variant}] engine decode step (wall): {ms:.3f} ms", flush=True)
    if args.profile_ops:
        acts = [torch.profiler.ProfilerActivity.CPU] + (
            [torch.profiler.ProfilerActivity.CUDA] if dev.type == "cuda" else []
        )
        with torch.profiler.profile(activities=acts) as prof:
            for _ in range(4):
                eng.step()
            sync()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    del eng
    gc.collect()
    return {"wall_ms_per_step": ms}


def meta_to(meta: PagedMetadata, dev) -> PagedMetadata:
    """``meta`` with its tensors on ``dev``."""
    return PagedMetadata(
        **{
            f.name: (v.to(dev) if torch.is_tensor(v) else v)
            for f in dataclasses.fields(meta)
            if f.init
            for v in [getattr(meta, f.name)]
        }
    )


def _decode_batch(cfg, kv: PagedKVCache, batch: int, context: int, max_seq_len: int, dev):
    """Decode-step inputs of ``batch`` rows that each hold ``context`` tokens in their own pages
    (row r: pages r*n .. r*n+n-1), plus the prefill inputs that put them there."""
    ps = kv.page_size
    n = -(-max_seq_len // ps)
    bt = torch.arange(batch * n, dtype=torch.int32).view(batch, n)
    g = torch.Generator().manual_seed(0)
    pos = torch.arange(context).repeat(batch)
    row = torch.arange(batch).repeat_interleave(context)
    pre = PagedMetadata(
        pos,
        bt.long()[row, pos // ps] * ps + pos % ps,
        bt,
        torch.zeros(batch, dtype=torch.int32),
        torch.full((batch,), context, dtype=torch.int32),
        (torch.arange(batch + 1) * context).to(torch.int32),
        0,
        1,
        context,
        context,
    )
    pre_ids = torch.randint(3, cfg.vocab_size, (batch * context,), generator=g)
    dpos = torch.full((batch,), context)
    dec = PagedMetadata(
        dpos,
        bt.long()[:, context // ps] * ps + context % ps,
        bt,
        torch.full((batch,), context, dtype=torch.int32),
        torch.full((batch,), context + 1, dtype=torch.int32),
        torch.arange(batch + 1, dtype=torch.int32),
        batch,
        1,
        1,
        max_seq_len,
    )
    dec_ids = torch.randint(3, cfg.vocab_size, (batch,), generator=g)
    return pre_ids.to(dev), meta_to(pre, dev), dec_ids.to(dev), meta_to(dec, dev)


@torch.no_grad()
def model_step_gpu_time(model, cfg, args, batch: int, variant: str) -> dict:
    """GPU time of one decode forward (``forward_paged``, no sampler, no host work): prefill
    ``batch`` rows of ``--context`` tokens, capture the decode forward in a CUDA graph and time
    ``--graph-replay`` replays with CUDA events; optionally the kernel table of the same forward."""
    dev = torch.device(args.device)
    ops = variant_ops(variant, dev, model.model.embed_tokens.weight.dtype)
    tag = f"batch {batch}, {variant}"
    max_seq_len = args.max_model_len or args.context + 64
    n_pages = batch * -(-max_seq_len // cfg.sparse_block_size)
    kv = PagedKVCache(cfg, n_pages, next(model.lm_head.parameters()).dtype, dev)
    pre_ids, pre, ids, meta = _decode_batch(cfg, kv, batch, args.context, max_seq_len, dev)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    model.forward_paged(pre_ids, pre, kv, ops)
    torch.cuda.synchronize()
    res = {
        "batch": batch,
        "variant": variant,
        "context": args.context,
        "max_seq_len": max_seq_len,
        "prefill_ms_first_call": 1000 * (time.perf_counter() - t0),
    }
    model.forward_paged(pre_ids, pre, kv, ops)  # warm (compiled) prefill
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    model.forward_paged(pre_ids, pre, kv, ops)
    torch.cuda.synchronize()
    res["prefill_ms"] = 1000 * (time.perf_counter() - t0)
    if args.prefill_kernel_table:
        rows, total = _kernel_table(lambda: model.forward_paged(pre_ids, pre, kv, ops), 1)
        res["prefill_kernel_table"] = rows[:40]
        print(f"[{tag}] eager prefill forward ({batch}x{args.context} tokens): {total:.1f} us summed kernel time")
        for name, c, t in rows[: args.table_rows]:
            print(f"    {t:10.1f} us  {c:6.1f}x  {name[:110]}")
    model.forward_paged(ids, meta, kv, ops)  # warm-up (compile)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        model.forward_paged(ids, meta, kv, ops)
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(args.graph_replay):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    res["gpu_ms_per_step_graph"] = start.elapsed_time(end) / args.graph_replay
    print(
        f"[{tag}] prefill {batch}x{args.context} tokens: {res['prefill_ms']:.2f} ms wall (eager); "
        f"decode forward GPU time (graph replay x{args.graph_replay}): {res['gpu_ms_per_step_graph']:.4f} ms",
        flush=True,
    )
    if args.kernel_table:
        rows, total = _kernel_table(lambda: model.forward_paged(ids, meta, kv, ops), 3)
        res["kernels_per_step"] = sum(r[1] for r in rows)
        res["kernel_us_per_step_eager"] = total
        res["kernel_table"] = rows[:40]
        print(
            f"[{tag}] eager decode forward: {res['kernels_per_step']:.0f} kernels, "
            f"{total:.1f} us summed kernel time per step",
            flush=True,
        )
        for name, c, t in rows[: args.table_rows]:
            print(f"    {t:8.1f} us  {c:6.1f}x  {name[:110]}")
    del graph
    gc.collect()
    torch.cuda.empty_cache()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda: the GPU timings need cuda")
    ap.add_argument("--model-json", help="a model config JSON (e.g. configs/bench/m3_bench_300m.json); default tiny")
    ap.add_argument("--batch", type=int, default=1, help="sequences decoded together")
    ap.add_argument("--batches", type=int, nargs="*", help="several batch sizes (overrides --batch)")
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens per sequence (engine wall times)")
    ap.add_argument("--steps", type=int, default=24, help="decode steps timed (engine wall times)")
    ap.add_argument("--cuda-graphs", action="store_true")
    ap.add_argument("--graph-replay", type=int, default=100, help="replays timed per engine (GPU, graphs)")
    ap.add_argument("--kernel-table", action="store_true", help="kernels of one decode forward (GPU, graphs)")
    ap.add_argument("--table-rows", type=int, default=25, help="rows of the kernel tables printed")
    ap.add_argument(
        "--prefill-kernel-table", action="store_true", help="kernels of the prefill forward (--context tokens per row)"
    )
    ap.add_argument("--compare-fused", action="store_true", help="= --variants pytorch fused")
    ap.add_argument(
        "--variants",
        nargs="*",
        default=None,
        help=f"model paths to run, of {VARIANTS} (default fused), or invariant+<option>+... with the flags "
        f"{INVARIANT_FLAGS} and the numbers dp<N> (invariant_attention.DECODE_PROGRAMS), ss<N> "
        "(SCORE_SPLIT_BLOCKS_DECODE), lbn<N> / lbk<N> / lw<N> / ls<N> / lsk<N> (the invariant linear's "
        "decode-band block_n / K step / warps / stages / split-K below N tiles), e.g. invariant+dp512+nopdl; "
        "the scheduling only, never the bits",
    )
    ap.add_argument("--profile-ops", action="store_true", help="torch.profiler op table (no graphs)")
    ap.add_argument("--context", type=int, default=192, help="tokens per row before the timed decode step")
    ap.add_argument(
        "--max-model-len",
        type=int,
        default=0,
        help="max_seq_len the decode graph is captured with (default context + 64)",
    )
    ap.add_argument("--skip-engine", action="store_true", help="only the model-level GPU timings")
    ap.add_argument("--skip-model", action="store_true", help="only the engine wall times")
    ap.add_argument("--out-json")
    ap.add_argument("--markdown", help="write the GPU-time table (docs/benchmarks.md rows) here")
    args = ap.parse_args()
    variants = args.variants or (["pytorch", "fused"] if args.compare_fused else ["fused"])
    for v in variants:  # every name before anything is built
        try:
            check_variant(v)
        except ValueError as exc:
            ap.error(str(exc))
    dev = torch.device(args.device)
    tables = [
        f
        for f, on in (("--kernel-table", args.kernel_table), ("--prefill-kernel-table", args.prefill_kernel_table))
        if on
    ]
    if tables and (dev.type != "cuda" or not args.cuda_graphs or args.skip_model):
        ap.error(
            f"{' / '.join(tables)}: the kernel tables come from the model-level GPU run, which needs --device cuda "
            "and --cuda-graphs, without --skip-model"
        )
    if dev.type == "cuda" and not torch.cuda.is_available():
        ap.error(
            f"--device {args.device}: this torch sees no CUDA device (the GPU timings need one; --device cpu runs)"
        )
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    if args.model_json:
        cfg = bench_config(args.model_json)
    else:
        cfg = tiny_config()
    torch.manual_seed(0)
    with torch.device(dev):
        model = M3ForCausalLM(cfg)
    model = model.cast_for_inference(dtype).eval()
    results = []
    batches = args.batches or [args.batch]
    if dev.type == "cuda" and args.cuda_graphs and not args.skip_model:  # the model's GPU time per step first
        for batch in batches:
            for v in variants:
                try:
                    results.append(model_step_gpu_time(model, cfg, args, batch, v))
                except Exception as exc:  # NOTE: keep the other variants' figures
                    import traceback

                    traceback.print_exc()
                    results.append({"batch": batch, "variant": v, "error": repr(exc)})
                if args.out_json:
                    Path(args.out_json).write_text(json.dumps(results, indent=1))
                if args.markdown:  # NOTE: after every run, so a time-limited job keeps partial tables
                    Path(args.markdown).write_text(markdown(results, args))
            done = {
                r["variant"]: r["gpu_ms_per_step_graph"]
                for r in results
                if r["batch"] == batch and "gpu_ms_per_step_graph" in r
            }
            print(
                f"batch {batch}: GPU ms per decode step: " + ", ".join(f"{v} {ms:.4f}" for v, ms in done.items()),
                flush=True,
            )
    if not args.skip_engine:
        for batch in batches:
            for v in variants:
                try:
                    r = engine_wall(model, cfg, args, batch, v)
                except Exception as exc:  # NOTE: the engine is another helper's; keep the GPU figures
                    print(f"engine run failed (batch {batch}, {v}): {exc!r}", flush=True)
                    r = {"error": repr(exc)}
                results.append({"batch": batch, "variant": v, "engine": r})
                if args.out_json:
                    Path(args.out_json).write_text(json.dumps(results, indent=1))
    variant_ops("fused", torch.device(args.device), torch.float32)  # router threshold back to the default
    if args.markdown:
        Path(args.markdown).write_text(markdown(results, args))


def markdown(results: list[dict], args) -> str:
    """docs/benchmarks.md rows: GPU time of one graphed decode forward, PyTorch ops vs fused path."""
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    lines = [
        f"### Decode step GPU time: fused layer kernels ({gpu}, torch {torch.__version__}, {run_date()})",
        "",
        f"`scripts/profile_engine.py --cuda-graphs --variants ...`: model {args.model_json or 'tiny'}, bf16 "
        f"random weights; each row holds {args.context} cached tokens; the decode forward "
        "(`forward_paged`, no sampler, no host work) captured in a CUDA graph and replayed "
        f"{args.graph_replay} times between CUDA events. Kernels: eager forward, torch.profiler.",
        "",
        "| batch | path | GPU ms / decode step | kernels / step | forward-only tok/s | speed-up | "
        f"prefill forward ms (batch x {args.context} tokens, eager, wall) |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    by = {(r["batch"], r["variant"]): r for r in results if "gpu_ms_per_step_graph" in r}
    names = {
        "pytorch": "PyTorch ops (before)",
        "fused": "fused kernels (default)",
        "fused+cublas": "fused kernels, all GEMMs cuBLAS",
    }
    for (b, v), r in sorted(
        by.items(),
        key=lambda kv: (
            kv[0][0],
            VARIANTS.index(kv[0][1].split("+")[0]) if kv[0][1].split("+")[0] in VARIANTS else 0,
            kv[0][1],
        ),
    ):
        ms = r["gpu_ms_per_step_graph"]
        base = by.get((b, "pytorch"))
        up = f"{base['gpu_ms_per_step_graph'] / ms:.2f}x" if base else "-"
        k = f"{r['kernels_per_step']:.0f}" if "kernels_per_step" in r else "-"
        pre = f"{r['prefill_ms']:.2f}" if "prefill_ms" in r else "-"
        lines.append(f"| {b} | {names.get(v, v)} | {ms:.3f} | {k} | {1000 * b / ms:,.0f} | {up} | {pre} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()

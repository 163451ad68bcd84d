"""Expert-parallel MoE step cost (dispatch / expert / combine vs EP=1), and EP logits vs EP=1.

    python scripts/bench_ep.py [--world 2|4] [--tokens 16 128 1024] [--steps 20] [--dtype bfloat16]
    python scripts/bench_ep.py --real-shapes [--world 2|4] [--layers 1]         # P GPUs, one per rank
    python scripts/bench_ep.py --logits builtin:m3-gpu-small [--world 2|4]      # P GPUs, one per rank
    ... [--write PATH | --no-write]

Each EP rank is a process: gloo on the CPU (one torch thread each), NCCL with one GPU per rank
(``--device cuda``, the default with --real-shapes and --logits; needs --world GPUs).

Timing (default). Every rank holds ``--layers`` MoE layers (``M3MoE``: fp32 router, shared expert,
routed experts) with its expert shard [r E/P, (r+1) E/P) and pushes T tokens per rank (its own
N(0, 1) rows) through each of them once per "step" (a decode step of T rows), ``--steps`` times
after 3 warm-up steps. Weights: normal, seeded per layer and per expert (std 0.02; router std
H^-1/2, bias 0), so every EP size holds the same experts. Shapes:
  tiny (default): the main job's tiny M3 MoE (H 128, E 8, K 2, I 32), 3 layers, T = 16 128 1024;
  --real-shapes: the released M3 MoE layer (configs/bench/m3_slice_real.json: H 6144, E 128 experts
      of width 3072, top-4, one shared expert of 3072; spec §2), 1 layer, random bf16 weights,
      CUDA only, T = 1 32 256 4096. The routed experts run the engine's fused MoE kernel
      (``PagedOps.fused_experts`` on CUDA) as the rollout does, at EP=1 and on each EP rank's
      received rows. Refused before any rank starts when a GPU's free memory is below the estimate
      (``real_shapes_bytes``).
Reported per step (rank 0, summed over the layers): the MoE time (router + shared + routed), and at
EP=P its parts from ``EPStats``: dispatch (counts exchange + token all-to-all), expert (the local
experts), combine (reverse all-to-all + combine); on CUDA each part ends with a device sync (EPStats
timing), so they include it. The baseline, in the same run, is EP=1: one process (on one GPU) with
all experts local and the same T, expert time = the routed-experts call (synchronised the same way).
Check, after the timing: every EP rank's outputs of every layer for its own rows (the first 64 of
each T) against EP=1's outputs for the same rows: max |EP - EP=1| / max |EP=1| over ranks and
layers, within ``TOLERANCE`` of the dtype (fp32 1e-5, bf16 / fp16 2^-6).

--logits MODEL (a checkpoint directory, or a builtin: name, e.g. builtin:m3-gpu-small, the GPU
preset of configs/grpo_h200.yaml, built and cached on first use): every rank loads the model twice,
whole (the EP=1 reference) and as its EP shard (``load_checkpoint_ep``), in --dtype, and feeds its
own 2 random sequences of 48 + 16 r tokens through both (the model forward, ``M3ForCausalLM.forward``).
Per rank: max and mean |EP - EP=1| of the logits, max |EP=1 logit|, argmax agreement; within
``LOGIT_TOLERANCE`` when max |diff| <= tolerance x max |logit| (fp32 1e-5, bf16 / fp16 2^-5).

Output: a markdown section ("## title, date of the run, machine"; benchlib.emit_section) printed
and appended to --write PATH (default docs/benchmarks.md) unless --no-write. Exit status 1 when a
check is outside its tolerance (the figures are written first). Absolute CPU times compare only
within a run (shared cores).
"""

from __future__ import annotations

import argparse
import io
import queue
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))  # benchlib, also when imported from a test

from benchlib import GPU_RESERVE, REAL_SLICE, bench_config, emit_section, gpu_shortfalls  # noqa: E402

from m3_rollout.model.configuration import M3Config, tiny_config  # noqa: E402
from m3_rollout.model.moe import M3MoE  # noqa: E402
from m3_rollout.parallel import EPGroupSpec, destroy_ep_group, free_port, init_ep_group  # noqa: E402
from m3_rollout.parallel.ep_moe import EPExperts, EPStats  # noqa: E402
from m3_rollout.parallel.expert_sharding import expert_range  # noqa: E402

TINY_TOKENS = (16, 128, 1024)
REAL_TOKENS = (1, 32, 256, 4096)
CHECK_ROWS = 64  # rows per (layer, T) compared with EP=1
TOLERANCE = {"float32": 1e-5, "bfloat16": 2.0**-6, "float16": 2.0**-6}
LOGIT_TOLERANCE = {"float32": 1e-5, "bfloat16": 2.0**-5, "float16": 2.0**-5}


def moe_config(real_shapes: bool) -> M3Config:
    """The MoE layer's config: the released M3 shapes (configs/bench/m3_slice_real.json) or the
    main job's tiny M3."""
    return bench_config(REAL_SLICE) if real_shapes else tiny_config(sparse_local_block=2)


def real_shapes_bytes(cfg: M3Config, layers: int, world: int, max_tokens: int, dtype_bytes: int = 2) -> dict:
    """Bytes one GPU needs for the timing run: {"ep1": the EP=1 process, "ep": one EP rank}.

    Weights: the rank's experts (w13 + w2), the shared expert, the fp32 router, per layer. Activations
    (an upper bound): every (token, slot) pair of all P ranks landing on one rank, as rows of
    H + 2I fp32 values, three times over (dispatch buffers, the fused kernel's intermediates, the
    combine), plus the EP=1 process's check inputs for every rank's T rows."""
    h, i, e, k = cfg.hidden_size, cfg.intermediate_size, cfg.num_local_experts, cfg.num_experts_per_tok
    expert = 3 * h * i * dtype_bytes
    fixed = 3 * h * cfg.shared_intermediate_size * dtype_bytes + 4 * h * e + 4 * e

    def need(p: int, n_experts: int) -> int:
        act = 3 * p * max_tokens * k * (h + 2 * i) * 4
        return layers * (n_experts * expert + fixed) + act

    return {"ep1": need(1, e) + world * max_tokens * h * 4, "ep": need(world, e // world)}


def check_fits(need: dict, free: list[int], world: int) -> None:
    """Raise SystemExit naming the GPU, its free memory and the estimate, when the EP=1 process
    (GPU 0) or an EP rank (GPUs 0..world-1) would not fit. ``free``: free bytes per GPU."""
    want = [max(need["ep"], need["ep1"] if gpu == 0 else 0) + GPU_RESERVE for gpu in range(world)]
    bad = gpu_shortfalls(want, free[:world])
    if bad:
        raise SystemExit(
            "--real-shapes: the MoE layers would not fit (" + "; ".join(bad) + "); use fewer --layers, "
            "smaller --tokens or more ranks (--world)"
        )


def init_layer(moe: M3MoE, slot: int) -> None:
    """Seeded normal weights for MoE layer ``slot`` (the router std H^-1/2, the rest 0.02, bias 0);
    expert e gets the same values whichever rank holds it (one seed per expert)."""
    dev = moe.gate.weight.device

    def fill(t: torch.Tensor, seed: int, std: float) -> None:
        t.normal_(0.0, std, generator=torch.Generator(device=dev).manual_seed(seed))

    base = 1_000_003 * (slot + 1)
    with torch.no_grad():
        fill(moe.gate.weight, base, moe.gate.weight.shape[1] ** -0.5)
        moe.e_score_correction_bias.zero_()
        sh = moe.shared_experts
        for j, lin in enumerate((sh.gate_proj, sh.up_proj, sh.down_proj)):
            fill(lin.weight, base + 1 + j, 0.02)
        a, b = moe.experts.expert_range
        for local, e in enumerate(range(a, b)):
            fill(moe.experts.w13[local], base + 10 + 2 * e, 0.02)
            fill(moe.experts.w2[local], base + 11 + 2 * e, 0.02)


def build_layers(cfg: M3Config, n_layers: int, world: int, rank: int, group, dtype, dev) -> tuple[list, EPStats]:
    """Rank ``rank``'s ``n_layers`` MoE layers (experts ``expert_range``; EP=1 holds all), built on
    ``meta``, cast (router and bias fp32), materialised on ``dev`` and filled by ``init_layer``."""
    a, b = expert_range(cfg.num_local_experts, world, rank)
    stats = EPStats(n_layers, b - a, world)
    layers = []
    for slot in range(n_layers):
        with torch.device("meta"):
            moe = M3MoE(cfg)
            moe.experts = EPExperts(cfg, (a, b), group, stats, slot)
        moe.experts.to(dtype)
        moe.shared_experts.to(dtype)
        moe.to_empty(device=dev)
        init_layer(moe, slot)
        layers.append(moe.eval())
    return layers, stats


def rank_inputs(rank: int, t: int, hidden: int) -> torch.Tensor:
    """Rank ``rank``'s T input rows (fp32, CPU): N(0, 1), seeded by rank and T."""
    return torch.randn(t, hidden, generator=torch.Generator().manual_seed(7919 * (rank + 1) + t))


def _put(out, obj) -> None:
    """Send ``obj`` by value (torch.save bytes: no shared-memory handle back into this process)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    out.put(buf.getvalue())


def _device(device: str, rank: int) -> torch.device:
    if device == "cuda":
        torch.cuda.set_device(rank)  # Triton launches on the current device
        return torch.device("cuda", rank)
    return torch.device("cpu")


def _timing_rank(rank: int, spec: EPGroupSpec, job: dict, out) -> None:
    try:
        torch.set_num_threads(1)
        dev = _device(job["device"], rank)
        group = init_ep_group(spec, rank, dev)
        dtype = getattr(torch, job["dtype"])
        cfg = moe_config(job["real_shapes"])
        world = spec.world_size
        layers, stats = build_layers(cfg, job["layers"], world, rank, group, dtype, dev)
        fused = None
        if dev.type == "cuda":
            from m3_rollout.engine.ops import paged_ops_for

            fused = paged_ops_for(dev, dtype).fused_experts
        sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
        expert_time = [0.0]
        if world == 1:  # time the routed-experts call (the baseline's breakdown)
            for moe in layers:
                inner = moe.experts.forward

                def timed(xx, ids, w, fe=None, inner=inner):
                    sync()
                    t0 = time.perf_counter()
                    y = inner(xx, ids, w, fe)
                    sync()
                    expert_time[0] += time.perf_counter() - t0
                    return y

                moe.experts.forward = timed

        def forward(x: torch.Tensor) -> list[torch.Tensor]:
            return [moe(x, fused_experts=fused) for moe in layers]

        rows, check = [], {}
        with torch.no_grad():
            for t in job["tokens"]:
                x = rank_inputs(rank, t, cfg.hidden_size).to(dev, dtype)
                for _ in range(3):
                    ys = forward(x)
                stats.reset()
                expert_time[0] = 0.0
                sync()
                t0 = time.perf_counter()
                for _ in range(job["steps"]):
                    ys = forward(x)
                sync()
                total = time.perf_counter() - t0
                s = stats.snapshot()
                expert_s = expert_time[0] if world == 1 else s["expert_s"]
                n = min(t, CHECK_ROWS)
                check[t] = {rank: torch.stack([y[:n].float().cpu() for y in ys])}  # [layers, n, H]
                if world == 1:  # EP=1 also answers for every EP rank's rows (untimed)
                    for r in range(1, job["check_world"]):
                        xr = rank_inputs(r, t, cfg.hidden_size).to(dev, dtype)
                        check[t][r] = torch.stack([y[:n].float().cpu() for y in forward(xr)])
                rows.append(
                    {
                        "T": t,
                        "moe_ms": 1e3 * total / job["steps"],
                        "dispatch_ms": 1e3 * s["dispatch_s"] / job["steps"],
                        "expert_ms": 1e3 * expert_s / job["steps"],
                        "combine_ms": 1e3 * s["combine_s"] / job["steps"],
                        "pairs": int(sum(map(sum, s["tokens_per_expert"]))),
                    }
                )
        _put(out, {"rank": rank, "rows": rows, "check": check})
    except Exception:  # noqa: BLE001 - reported to the parent
        _put(out, {"rank": rank, "error": traceback.format_exc()})
    finally:
        destroy_ep_group()


def _logits_rank(rank: int, spec: EPGroupSpec, job: dict, out) -> None:
    try:
        from m3_rollout.model import load_checkpoint
        from m3_rollout.parallel import load_checkpoint_ep

        torch.set_num_threads(1)
        dev = _device(job["device"], rank)
        group = init_ep_group(spec, rank, dev)
        dtype = getattr(torch, job["dtype"])
        ref = load_checkpoint(job["model_dir"], dtype=dtype, device=dev).eval()
        ep, _, _ = load_checkpoint_ep(job["model_dir"], rank, spec.world_size, group, dtype=dtype, device=dev)
        ep.eval()
        gen = torch.Generator().manual_seed(100 + rank)
        ids = torch.randint(3, ref.config.vocab_size, (2, 48 + 16 * rank), generator=gen).to(dev)
        with torch.no_grad():
            a = ref(ids).float()
            b = ep(ids).float()
        diff = (a - b).abs()
        _put(
            out,
            {
                "rank": rank,
                "tokens": int(ids.numel()),
                "max_diff": float(diff.max()),
                "mean_diff": float(diff.mean()),
                "max_logit": float(a.abs().max()),
                "argmax_agree": float((a.argmax(-1) == b.argmax(-1)).float().mean()),
                "range": ep.moe_layers()[0].experts.expert_range,
            },
        )
    except Exception:  # noqa: BLE001 - reported to the parent
        _put(out, {"rank": rank, "error": traceback.format_exc()})
    finally:
        destroy_ep_group()


def run(fn, world: int, job: dict, timeout_s: float = 900.0) -> dict[int, dict]:
    """Spawn ``world`` ranks of ``fn(rank, spec, job, out)``; their results by rank. Raises
    RuntimeError with a rank's traceback, or when the ranks do not answer within ``timeout_s``."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    backend = "nccl" if job["device"] == "cuda" else "gloo"
    spec = EPGroupSpec(world, "127.0.0.1", free_port(), backend, timeout_s=120)
    procs = [ctx.Process(target=fn, args=(r, spec, job, out), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    got = {}
    deadline = time.monotonic() + timeout_s
    try:
        for _ in range(world):
            try:
                r = torch.load(io.BytesIO(out.get(timeout=max(1.0, deadline - time.monotonic()))), weights_only=False)
            except queue.Empty:
                raise RuntimeError(f"benchmark ranks did not answer within {timeout_s:.0f} s") from None
            if "error" in r:
                raise RuntimeError(f"rank {r['rank']} failed:\n{r['error']}")
            got[r["rank"]] = r
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return got


def check_against_ep1(base: dict, ep: dict[int, dict], tokens) -> dict[int, float]:
    """max |EP - EP=1| / max |EP=1| per T over every rank's checked rows and layers."""
    rel = {}
    for t in tokens:
        worst = 0.0
        for r, res in ep.items():
            a, b = base["check"][t][r], res["check"][t][r]
            scale = max(float(a.abs().max()), 1e-30)
            worst = max(worst, float((a - b).abs().max()) / scale)
        rel[t] = worst
    return rel


def timing(args) -> dict:
    """The timing run (EP=1, then EP=P); returns {"base", "ep", "rel", "ok", "lines"}."""
    cfg = moe_config(args.real_shapes)
    job = dict(
        device=args.device,
        dtype=args.dtype,
        real_shapes=args.real_shapes,
        layers=args.layers,
        tokens=list(args.tokens),
        steps=args.steps,
        check_world=args.world,
    )
    base = run(_timing_rank, 1, job)[0]
    ep = run(_timing_rank, args.world, job)
    rel = check_against_ep1(base, ep, args.tokens)
    tol = TOLERANCE[args.dtype]
    ok = all(v <= tol for v in rel.values())
    p = args.world
    lines = [
        "| EP | T / rank | MoE ms/step | dispatch ms | expert ms | combine ms | (dispatch+combine) / expert "
        "| MoE time vs EP=1 | max abs(EP - EP=1) / max abs(EP=1) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    brow = {r["T"]: r for r in base["rows"]}
    for r in ep[0]["rows"]:
        b = brow[r["T"]]
        lines.append(f"| 1 | {r['T']} | {b['moe_ms']:.3f} | - | {b['expert_ms']:.3f} | - | - | 1.00x | - |")
        comm = r["dispatch_ms"] + r["combine_ms"]
        lines.append(
            f"| {p} | {r['T']} | {r['moe_ms']:.3f} | {r['dispatch_ms']:.3f} | {r['expert_ms']:.3f} | "
            f"{r['combine_ms']:.3f} | {comm / max(r['expert_ms'], 1e-9):.1f}x | "
            f"{r['moe_ms'] / max(b['moe_ms'], 1e-9):.2f}x | {rel[r['T']]:.2e} |"
        )
    if args.real_shapes:
        shapes = (
            f"{args.layers} MoE layer(s) at the released M3 shapes (H {cfg.hidden_size}, E {cfg.num_local_experts} "
            f"experts of width {cfg.intermediate_size}, top-{cfg.num_experts_per_tok}, shared expert "
            f"{cfg.shared_intermediate_size}; configs/bench/m3_slice_real.json), random weights, routed experts "
            "through the engine's fused MoE kernel"
        )
    else:
        shapes = (
            f"{args.layers} MoE layer(s) of the main job's tiny M3 (H {cfg.hidden_size}, E {cfg.num_local_experts}, "
            f"K {cfg.num_experts_per_tok}, I {cfg.intermediate_size})"
        )
    where = "gloo, one torch thread per rank" if args.device == "cpu" else "NCCL, one GPU per rank"
    notes = (
        f"{args.dtype}, {args.steps} steps after 3 warm-up steps, {shapes}; T tokens per rank per step, rank 0's "
        f"times per step summed over the layers; {where}. EP=1 (one process, same run, same T) is the baseline. "
        f"Check: each EP rank's outputs for its first {CHECK_ROWS} rows vs EP=1's for the same rows, tolerance "
        f"{tol:.1e}: {'within' if ok else 'NOT within'} tolerance."
    )
    title = f"Expert parallelism (bench_ep.py{' --real-shapes' if args.real_shapes else ''}), EP={p} vs EP=1"
    return {"base": base, "ep": ep, "rel": rel, "ok": ok, "title": title, "notes": notes, "lines": lines}


def logits(args) -> dict:
    """The logits check at EP=P; returns {"ranks", "ok", "lines", ...}."""
    model_dir = args.logits
    if args.logits.startswith("builtin:"):
        from m3_rollout.jobs.builtin import resolve_model

        model_dir = str(resolve_model(args.logits)[0])
    job = dict(device=args.device, dtype=args.dtype, model_dir=model_dir)
    ranks = run(_logits_rank, args.world, job)
    tol = LOGIT_TOLERANCE[args.dtype]
    ok = all(r["max_diff"] <= tol * max(r["max_logit"], 1e-30) for r in ranks.values())
    lines = [
        "| rank | experts | tokens | max abs diff | mean abs diff | max abs logit (EP=1) | max diff / max logit "
        "| argmax agreement |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for rank in sorted(ranks):
        r = ranks[rank]
        lines.append(
            f"| {rank} | {r['range'][0]}-{r['range'][1] - 1} | {r['tokens']} | {r['max_diff']:.3e} | "
            f"{r['mean_diff']:.3e} | {r['max_logit']:.3f} | {r['max_diff'] / max(r['max_logit'], 1e-30):.2e} | "
            f"{r['argmax_agree']:.4f} |"
        )
    where = "gloo" if args.device == "cpu" else "NCCL, one GPU per rank"
    notes = (
        f"Model {args.logits}, {args.dtype}; every rank: the whole model (EP=1) and its EP={args.world} shard on "
        f"its device ({where}), the model forward on its own 2 random sequences; tolerance max diff <= {tol:.1e} x "
        f"max logit: {'within' if ok else 'NOT within'} tolerance."
    )
    title = f"EP={args.world} logits vs EP=1 (bench_ep.py --logits)"
    return {"ranks": ranks, "ok": ok, "title": title, "notes": notes, "lines": lines}


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark; returns its results (tests). Exits 1 after writing when a check fails."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=2, choices=(2, 4), help="EP ranks (one GPU each on CUDA)")
    ap.add_argument("--real-shapes", action="store_true", help="the released M3 MoE layer shapes (CUDA only)")
    ap.add_argument("--logits", default=None, metavar="MODEL", help="EP logits vs EP=1 of a checkpoint / builtin:")
    ap.add_argument("--layers", type=int, default=None, help="MoE layers (default: 3 tiny, 1 real shapes)")
    ap.add_argument("--tokens", type=int, nargs="+", default=None, help="tokens per rank per step")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    ap.add_argument(
        "--device", default=None, choices=["cpu", "cuda"], help="default: cuda with --real-shapes / --logits"
    )
    ap.add_argument("--write", default=str(ROOT / "docs" / "benchmarks.md"), metavar="PATH", help="markdown file")
    ap.add_argument("--no-write", action="store_true", help="print only")
    args = ap.parse_args(argv)
    if args.real_shapes and args.logits:
        ap.error("--real-shapes (timing) and --logits (the logits check) are separate runs")
    args.device = args.device or ("cuda" if args.real_shapes or args.logits else "cpu")
    args.layers = args.layers or (1 if args.real_shapes else 3)
    args.tokens = args.tokens or list(REAL_TOKENS if args.real_shapes else TINY_TOKENS)
    if args.real_shapes and args.device != "cuda":
        raise SystemExit(
            "--real-shapes runs on CUDA GPUs only (one real M3 MoE layer holds 14.5 GB of bf16 experts); "
            "the tiny default runs on the CPU"
        )
    if args.device == "cuda":
        if not torch.cuda.is_available() or torch.cuda.device_count() < args.world:
            n = torch.cuda.device_count() if torch.cuda.is_available() else 0
            raise SystemExit(f"--device cuda --world {args.world} needs {args.world} GPUs (one per EP rank); found {n}")
        if args.real_shapes:
            need = real_shapes_bytes(moe_config(True), args.layers, args.world, max(args.tokens))
            check_fits(need, [torch.cuda.mem_get_info(i)[0] for i in range(args.world)], args.world)
    res = logits(args) if args.logits else timing(args)
    emit_section(res["title"], res["notes"], res["lines"], not args.no_write, args.device, args.write)
    if not res["ok"]:
        print("bench_ep: a check is outside its tolerance (see the notes above)", file=sys.stderr)
        raise SystemExit(1)
    return res


if __name__ == "__main__":
    main()

"""Host vs GPU time of the engine's decode steps (host side), per step phase.

    python scripts/profile_engine_host.py --device cuda --model-json configs/bench/m3_bench_300m.json \
        --batches 1 32 --out /tmp/host_profile.json

Builds the model alone (random weights, no transformers copy), runs one GRPO-shaped generation
per batch size (``batch`` requests of ``--prompt`` tokens, ``--new`` new tokens each, decode CUDA
graphs of exactly that batch size) and reports, for the decode-only steps:
- wall ms per step (median) and tokens/s of the whole run;
- host ms per step of each engine phase (``EngineStats.phase_seconds``: schedule, prepare, forward
  launch, sample launch, sync wait, output processing);
- GPU ms per step: the device time of the kernels of a few profiled decode steps
  (``torch.profiler``), and the replay time of the captured decode graph alone (CUDA events).
With ``--async-modes`` the engine runs once per value of ``EngineConfig.async_scheduling``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import time
from pathlib import Path

import torch
from benchlib import bench_config, random_model

from m3_rollout.engine.config import EngineConfig
from m3_rollout.engine.engine import LLMEngine
from m3_rollout.engine.interface import GenerationRequest, SamplingParams
from m3_rollout.engine.stats import PHASES
from m3_rollout.model import tiny_config


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def make_engine(model, batch: int, max_len: int, graphs: bool, async_mode: bool | None) -> LLMEngine:
    kw = {} if async_mode is None else {"async_scheduling": async_mode}
    pages = 2 * batch * -(-max_len // model.config.sparse_block_size) + 8  # room for the profiled extra run
    return LLMEngine(
        model,
        EngineConfig(
            max_model_len=max_len,
            max_num_seqs=batch,
            max_num_batched_tokens=8192,
            num_pages=pages,
            enable_cuda_graphs=graphs,
            cuda_graph_batch_sizes=(batch,),
            **kw,
        ),
    )


def run(eng: LLMEngine, prompts: list[list[int]], new: int, device: str, seed: int = 1) -> dict:
    """Generate; per decode-only step: wall seconds and the host phase seconds."""
    params = SamplingParams(n=1, max_new_tokens=new, seed=seed)
    for i, p in enumerate(prompts):
        eng.add_request(GenerationRequest(f"r{i}", p, params))
    ph = eng.stats.phase_seconds
    walls, phases, outs = [], {k: [] for k in PHASES}, []
    sync(device)
    t0 = time.perf_counter()
    while eng.has_unfinished():
        decode = not eng.scheduler.waiting and all(s.num_computed >= s.num_tokens - 1 for s in eng.scheduler.running)
        before = dict(ph)
        ts = time.perf_counter()
        outs += [o for o in eng.step() if hasattr(o, "finish_reason")]
        te = time.perf_counter()
        if decode and eng.scheduler.running:
            walls.append(te - ts)
            for k in PHASES:
                phases[k].append(ph[k] - before[k])
    sync(device)
    secs = time.perf_counter() - t0
    toks = sum(len(o.output_ids) for o in outs)
    return {
        "tokens": toks,
        "seconds": secs,
        "tok_s": toks / secs,
        "decode_steps": len(walls),
        "step_ms_median": 1000 * statistics.median(walls) if walls else float("nan"),
        "host_ms": {k: 1000 * statistics.mean(v) if v else 0.0 for k, v in phases.items()},
        "outputs": sorted((o.request_id, o.output_ids, o.logprobs) for o in outs),
    }


def gpu_ms_per_decode_step(eng: LLMEngine, prompts: list[list[int]], new: int, steps: int = 6) -> dict:
    """Kernel time per decode step from torch.profiler (after the prefill) + the top ops."""
    from torch.profiler import ProfilerActivity, profile

    params = SamplingParams(n=1, max_new_tokens=new, seed=3)
    for i, p in enumerate(prompts):
        eng.add_request(GenerationRequest(f"p{i}", p, params))
    for _ in range(3):  # prefill + first decodes
        eng.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            eng.step()
        torch.cuda.synchronize()
    while eng.has_unfinished():
        eng.step()
    events = prof.key_averages()
    dev_us = sum(getattr(e, "self_device_time_total", 0.0) for e in events)
    table = events.table(sort_by="self_cpu_time_total", row_limit=25)
    return {"gpu_ms_per_step": dev_us / 1000 / steps, "profile_table": table}


def graph_replay_ms(eng: LLMEngine, batch: int, reps: int = 50, which: int = 0) -> float:
    """Device ms per replay of the decode graph of ``batch`` rows (``which``: 0 = forward,
    2 = sampler where the engine captures one)."""
    graphs = eng.runner.graphs
    if graphs is None or batch not in graphs.graphs or len(graphs.graphs[batch]) <= which:
        return float("nan")
    graph = graphs.graphs[batch][which]
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--model-json", default=None)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--no-graphs", action="store_true")
    ap.add_argument(
        "--async-modes",
        nargs="*",
        default=None,
        choices=["on", "off"],
        help="run once per EngineConfig.async_scheduling value (default: the engine default)",
    )
    ap.add_argument("--profile", action="store_true", help="also torch.profiler a few decode steps (CUDA)")
    ap.add_argument("--out", default=None, help="JSON figures (rewritten after every case)")
    args = ap.parse_args()
    dev = args.device
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    if args.model_json:
        cfg = bench_config(args.model_json)
    else:
        cfg = tiny_config()
    t = time.perf_counter()
    model = random_model(cfg, dev, dtype)
    print(f"model built in {time.perf_counter() - t:.1f} s", flush=True)
    g = torch.Generator().manual_seed(0)
    graphs = dev == "cuda" and not args.no_graphs
    modes = [None] if args.async_modes is None else [m == "on" for m in args.async_modes]
    results = []
    for batch in args.batches:
        prompts = [torch.randint(3, cfg.vocab_size, (args.prompt,), generator=g).tolist() for _ in range(batch)]
        max_len = args.prompt + args.new
        for mode in modes:
            t = time.perf_counter()
            eng = make_engine(model, batch, max_len, graphs, mode)
            setup = time.perf_counter() - t
            run(eng, [p[::-1] for p in prompts], 4, dev)  # warm-up: same shapes, no prefix-cache hit
            r = run(eng, prompts, args.new, dev)
            outputs = r.pop("outputs")
            row = {"batch": batch, "async": mode, "setup_s": setup, **r}
            if dev == "cuda":
                row["graph_replay_ms"] = graph_replay_ms(eng, batch)
                row["sampler_replay_ms"] = graph_replay_ms(eng, batch, which=2)
                if args.profile:
                    p = gpu_ms_per_decode_step(eng, prompts, 16)
                    row["gpu_ms_per_step_profiled"] = p["gpu_ms_per_step"]
                    row["profile_table"] = p["profile_table"]
            row["first_output"] = outputs[0][1][:8]
            # Same seeds in every mode: these must agree across engines / async modes.
            row["tokens_digest"] = hashlib.sha1(repr([o[1] for o in outputs]).encode()).hexdigest()[:12]
            row["logprob_sum"] = sum(sum(o[2]) for o in outputs)
            results.append(row)
            host = " ".join(f"{k} {v:.3f}" for k, v in r["host_ms"].items())
            print(
                f"batch {batch} async={mode}: {r['tok_s']:.0f} tok/s, step {r['step_ms_median']:.3f} ms median; "
                f"host ms/step: {host} (sum {sum(r['host_ms'].values()):.3f}); graph replay "
                f"{row.get('graph_replay_ms', float('nan')):.3f} ms (sampler graph "
                f"{row.get('sampler_replay_ms', float('nan')):.3f}); profiled GPU "
                f"{row.get('gpu_ms_per_step_profiled', float('nan')):.3f} ms/step; setup {setup:.1f} s; tokens "
                f"{row['tokens_digest']}, logprob sum {row['logprob_sum']:.4f}",
                flush=True,
            )
            if args.out:
                Path(args.out).write_text(json.dumps({"device": dev, "rows": results}, indent=1))
            del eng
            if dev == "cuda":
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

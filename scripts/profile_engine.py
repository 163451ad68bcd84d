"""Profile the engine's decode steps (GPU or CPU): where a step's time goes.

    python scripts/profile_engine.py --device cuda --model-json configs/bench/m3_bench_300m.json --batch 1

Prints the wall time per decode step, the model forward alone, and torch.profiler's top ops by
self CPU and device time for a few decode steps.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from m3_rollout.engine.engine import EngineConfig, LLMEngine
from m3_rollout.engine.interface import GenerationRequest, SamplingParams
from m3_rollout.model import M3Config, M3ForCausalLM, tiny_config


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model-json")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--cuda-graphs", action="store_true")
    args = ap.parse_args()
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    if args.model_json:
        raw = {k: v for k, v in json.loads(Path(args.model_json).read_text()).items() if not k.startswith("_")}
        cfg = M3Config.from_dict(raw)
    else:
        cfg = tiny_config()
    torch.manual_seed(0)
    with torch.device(dev):
        model = M3ForCausalLM(cfg)
    model = model.cast_for_inference(dtype).eval()
    max_len = args.prompt + args.steps * 2 + 8
    eng = LLMEngine(model, EngineConfig(max_model_len=max_len, max_num_seqs=args.batch, enable_cuda_graphs=args.cuda_graphs))
    g = torch.Generator().manual_seed(0)
    for i in range(args.batch):
        ids = torch.randint(3, cfg.vocab_size, (args.prompt,), generator=g).tolist()
        eng.add_request(GenerationRequest(f"r{i}", ids, SamplingParams(max_new_tokens=args.steps * 2, seed=i)))
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    for _ in range(4):  # prefill + warm-up decodes
        eng.step()
    sync()
    t0 = time.perf_counter()
    n = args.steps // 2
    for _ in range(n):
        eng.step()
    sync()
    print(f"decode step: {1000 * (time.perf_counter() - t0) / n:.2f} ms (batch {args.batch})", flush=True)
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(4):
            eng.step()
        sync()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    if dev.type == "cuda":
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=15))


if __name__ == "__main__":
    main()

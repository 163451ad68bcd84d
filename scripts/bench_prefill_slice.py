"""Engine prefill at real M3 layer shapes: tokens/s and TFLOP/s against the FLOP floor (issue 23).

Model: a slice of M3 at the released layer shapes (configs/bench/m3_slice_real.json: layer 0 dense
attention + dense MLP, layers 1-2 MSA sparse attention + 128-expert MoE; hidden 6144, 64 q / 4 KV
heads of 128), random bf16 weights, in the engine as the rollout runs it (paged KV cache, chunked
prefill of ``--chunk`` tokens per step, the fused kernels): ``--prompts`` prompts of
``--prompt-len`` tokens (default 4 x 32768) each generate one token; wall seconds of that call,
median of ``--reps`` after one warm-up.

FLOPs (``prefill_flops``, multiply-adds counted as 2):
- weights: 2 x every matrix a token multiplies (attention and index projections, dense MLP, router,
  shared expert) + 2 x top-k / E of the routed experts' matrices; the lm_head for each prompt's
  last token only (the rest need no logits);
- attention: 4 x head_dim x q heads per (query, key) pair attended: dense layers the causal keys
  (pos + 1), sparse layers the top-k blocks' causal keys: pos + 1 below top-k x block, else
  (top-k - 1) x block + pos % block + 1, the own block being one of the top-k (spec §3.4 / §3.5;
  ``sparse_attention_pairs``);
- index scores (sparse layers): 2 x index dim x index heads per (query, causal key) (spec §3.4).
Floor = FLOPs / ``--peak`` (600 TFLOP/s: the issue's figure for a dense bf16 GEMM on the H200,
whose spec peak is 989). ``rate vs floor`` = floor seconds / measured seconds (target >= 50 %).

Decode on the same slice: batch 1, ``--decode-prompt`` + ``--decode-new`` tokens (CUDA graphs and
async scheduling on CUDA, as the engine runs), median decode step against the bandwidth floor
(``bench_engine.decode_floor_ms``; target within 1.3x).

Usage: python scripts/bench_prefill_slice.py [--device cuda] [--model-json configs/bench/m3_slice_real.json]
       [--prompts 4 --prompt-len 32768 --chunk 32768] [--no-write]
CPU (CI): --device cpu --model-json '' (tiny_config) runs the same code at tiny sizes.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch
from bench_engine import decode_floor_ms, make_engine, timed_generate
from benchlib import REAL_SLICE, bench_config, machine, random_model, run_date

from m3_rollout.model import M3Config, tiny_config

ROOT = Path(__file__).resolve().parents[1]


def load_config(path: str) -> M3Config:
    """M3Config from a config JSON (keys starting with "_" ignored), or tiny_config() for ""."""
    if not path:
        return tiny_config(max_position_embeddings=4096)
    return bench_config(path)


def weight_flops_per_token(model, cfg: M3Config) -> float:
    """2 x the weights one token multiplies in the decoder layers (the routed experts at top-k / E;
    norms, biases and the embedding lookup excluded), FLOPs."""
    total = 0.0
    share = cfg.num_experts_per_tok / cfg.num_local_experts
    for name, p in model.named_parameters():
        if ".layers." not in name or p.dim() < 2:
            continue
        total += 2.0 * p.numel() * (share if ".experts." in name else 1.0)
    return total


def attention_pairs(length: int, cap: int | None) -> int:
    """Sum over positions p = 0..length-1 of min(p + 1, cap) (cap None: p + 1)."""
    if cap is None or cap >= length:
        return length * (length + 1) // 2
    return cap * (cap + 1) // 2 + (length - cap) * cap


def sparse_attention_pairs(length: int, topk: int, block: int) -> int:
    """Keys attended over positions p = 0..length-1 of an MSA layer (spec §3.4 / §3.5): every causal key
    below ``topk`` x ``block`` (all candidates selected), from there ``topk`` - 1 whole past blocks plus
    the own (local) block's p % block + 1 causal keys (the local block is one of the top-k)."""
    dense = min(length, topk * block)
    pairs = dense * (dense + 1) // 2
    rest = length - dense  # positions from topk x block on, which is block-aligned
    full, tail = divmod(rest, block)
    pairs += rest * (topk - 1) * block + full * (block * (block + 1) // 2) + tail * (tail + 1) // 2
    return pairs


def prefill_flops(model, cfg: M3Config, lengths: list[int]) -> dict[str, float]:
    """FLOPs of prefilling prompts of ``lengths`` tokens, by part (module docstring)."""
    d, nh = cfg.head_dim, cfg.num_attention_heads
    parts = {"weights": 0.0, "attention": 0.0, "index scores": 0.0, "lm_head": 0.0}
    per_tok = weight_flops_per_token(model, cfg)
    for n in lengths:
        parts["weights"] += per_tok * n
        parts["lm_head"] += 2.0 * cfg.vocab_size * cfg.hidden_size
        for i in range(cfg.num_hidden_layers):
            sparse = cfg.is_sparse_layer(i)
            pairs = (
                sparse_attention_pairs(n, cfg.sparse_topk_blocks, cfg.sparse_block_size)
                if sparse
                else attention_pairs(n, None)
            )
            parts["attention"] += 4.0 * d * nh * pairs
            if sparse:
                parts["index scores"] += (
                    2.0 * cfg.sparse_index_dim * cfg.sparse_num_index_heads * attention_pairs(n, None)
                )
    parts["total"] = sum(parts.values())
    return parts


def main(argv: list[str] | None = None) -> list[str]:
    """Run the benchmark; returns (and, unless --no-write, appends to docs/benchmarks.md) its lines."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    ap.add_argument("--model-json", default=str(REAL_SLICE), help="config JSON; '' = tiny_config() (CPU tests)")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=32768)
    ap.add_argument("--chunk", type=int, default=32768, help="EngineConfig.max_num_batched_tokens (prefill chunk)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--peak", type=float, default=600.0, help="TFLOP/s of the floor")
    ap.add_argument("--decode-prompt", type=int, default=128)
    ap.add_argument("--decode-new", type=int, default=64)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    dev = args.device
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    cfg = load_config(args.model_json)
    cfg.max_position_embeddings = max(cfg.max_position_embeddings, args.prompt_len + 2)
    model = random_model(cfg, dev, dtype)
    params = sum(p.numel() for p in model.parameters())
    gen = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(3, cfg.vocab_size, (args.prompt_len,), generator=gen).tolist() for _ in range(args.prompts)
    ]
    flops = prefill_flops(model, cfg, [len(p) for p in prompts])

    kv_gb = 12.0 if dev == "cuda" else 0.0  # the KV pages plus the MSA prefill scratch (4160 MiB by default)
    eng = make_engine(
        model, prompts, 1, dev, args.prompt_len + 2, max_num_batched_tokens=args.chunk, kv_cache_memory_gb=kv_gb
    )
    timed_generate(eng, prompts, 1, dev, "warm")
    secs = statistics.median(timed_generate(eng, prompts, 1, dev, f"r{r}-")["seconds"] for r in range(args.reps))
    del eng
    tokens = args.prompts * args.prompt_len
    floor_s = flops["total"] / (args.peak * 1e12)
    achieved = flops["total"] / secs / 1e12

    dprompt = [torch.randint(3, cfg.vocab_size, (args.decode_prompt,), generator=gen).tolist()]
    cuda = dev == "cuda"
    dec = make_engine(
        model, dprompt, 1, dev, args.decode_prompt + args.decode_new + 1, cuda_graphs=cuda,
        async_scheduling=None, graph_sizes=(1,) if cuda else None,
    )  # fmt: skip
    timed_generate(dec, dprompt, args.decode_new, dev, "dwarm")
    step_ms = statistics.median(
        timed_generate(dec, dprompt, args.decode_new, dev, f"d{r}-")["decode_step_ms"] for r in range(args.reps)
    )
    dfloor = decode_floor_ms(cfg, model, 1, args.decode_prompt + args.decode_new, dtype)

    src = "tiny_config()"
    if args.model_json:
        path = Path(args.model_json).resolve()
        src = str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else args.model_json
    lines = [
        f"\n## Engine prefill at real M3 layer shapes (bench_prefill_slice.py), {run_date()}, {machine(dev)}\n",
        f"Model: {src} ({cfg.num_hidden_layers} layers, {params / 1e9:.2f} B parameters, random {dtype}); "
        f"{args.prompts} prompts x {args.prompt_len} tokens, prefill chunk {args.chunk} tokens, median of {args.reps} "
        f"runs after a warm-up. FLOPs: weights {flops['weights'] / 1e12:.1f} T, attention "
        f"{flops['attention'] / 1e12:.1f} T, index scores {flops['index scores'] / 1e12:.2f} T, final-token lm_head "
        f"{flops['lm_head'] / 1e9:.2f} G (module docstring). Floor at {args.peak:.0f} TFLOP/s.\n",
        "| case | measured | floor | rate vs floor | target |",
        "|---|---|---|---|---|",
        f"| prefill {tokens:,} tokens | {secs:.3f} s ({tokens / secs:,.0f} tok/s, {achieved:.0f} TFLOP/s) | "
        f"{floor_s:.3f} s ({tokens / floor_s:,.0f} tok/s) | {100 * floor_s / secs:.0f} % | >= 50 % |",
        f"| decode batch 1, {args.decode_prompt} + {args.decode_new} tokens (median step) | {step_ms:.3f} ms | "
        f"{dfloor:.3f} ms (bandwidth) | {step_ms / dfloor:.2f}x the floor | <= 1.3x |",
    ]
    print("\n".join(lines), flush=True)
    if not args.no_write:
        with open(ROOT / "docs" / "benchmarks.md", "a") as f:
            f.write("\n".join(lines) + "\n")
    return lines


if __name__ == "__main__":
    main()

"""Native engine vs transformers ``generate`` on the same weights, tokens/s and their ratio.

    python scripts/bench_engine.py                      # CPU, tiny M3 (spec §7 preset A), fp32
    python scripts/bench_engine.py --device cuda --model-json configs/bench/m3_bench_300m.json

Loads (one run measures both sides):
- ``grpo``: 16 prompts x n=8 samples, 128 prompt tokens, 128 new tokens (no early stop). The
  engine gets 16 requests with n=8 (prompt prefilled once per group); transformers gets the 128
  rows. On CUDA instead: batch 1 and batch 32 (one request per row), 128 + 128 tokens, the
  setting of the transformers 5.17 anchor figures (46 / 1,531 tok/s on one H200).
- ``long``: prompts long enough that sparse block selection is active (8K on CUDA; on CPU scaled
  down to ``--long-len``, default 2048 = 32 x top_k x block of the tiny config, because
  transformers' eager sparse path builds dense [B, G, S, S] masks).
CUDA also prints the decode step time beside the memory-bandwidth floor: bytes read per decode
step (weights touched + KV pages read) / 4.4 TB/s (H200 HBM3e).
Appends a table to docs/benchmarks.md with machine and date (``--no-write`` to skip).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from benchlib import machine as _machine
from m3_rollout.engine.engine import EngineConfig, LLMEngine
from m3_rollout.engine.interface import GenerationRequest, SamplingParams
from m3_rollout.model import M3Config, M3ForCausalLM, load_hf_state_dict, tiny_config

ROOT = Path(__file__).resolve().parent.parent


def machine(device: str) -> str:
    return _machine(device) + ("" if device == "cuda" else f", {torch.get_num_threads()} threads")
HBM_BYTES_PER_S = 4.4e12
DATE = "2026-11-29"



def build_pair(cfg: M3Config, device: str, dtype: torch.dtype):
    """(ours, transformers MiniMaxM3VLForCausalLM) with the same random weights on ``device``."""
    from transformers.models.minimax_m3_vl.configuration_minimax_m3_vl import MiniMaxM3VLTextConfig
    from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import MiniMaxM3VLForCausalLM

    tc = cfg.to_dict()["text_config"]
    tc.update(bos_token_id=None, eos_token_id=None)
    hc = MiniMaxM3VLTextConfig(**tc)
    if device == "cpu":
        hc._attn_implementation = "eager"
    torch.manual_seed(0)
    with torch.device(device):
        hf = MiniMaxM3VLForCausalLM(hc).to(dtype).eval()
        with torch.no_grad():
            for name, p in hf.named_parameters():
                p.normal_(0, 0.02) if p.ndim >= 2 else p.normal_(0, 0.05)
        ours = M3ForCausalLM(cfg)
    load_hf_state_dict(ours, hf.state_dict())
    ours = ours.to(device).cast_for_inference(dtype).eval()
    return ours, hf


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def run_engine(model, prompts: list[list[int]], n: int, new: int, device: str, max_len: int,
               cuda_graphs: bool = False) -> dict:
    eng = LLMEngine(model, EngineConfig(max_model_len=max_len, max_num_seqs=max(len(prompts) * n, 1),
                                        max_num_batched_tokens=max(8192, max(map(len, prompts))),
                                        enable_cuda_graphs=cuda_graphs))
    params = SamplingParams(n=n, max_new_tokens=new, seed=1)
    step_times: list[tuple[int, float]] = []  # (decode rows, seconds) of decode-only steps
    sync(device)
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        eng.add_request(GenerationRequest(f"r{i}", p, params))
    done = 0
    while eng.has_unfinished():
        ts = time.perf_counter()
        running = [s for s in eng.scheduler.running if s.num_computed == s.num_tokens - 1]
        is_decode = not eng.scheduler.waiting and len(running) == len(eng.scheduler.running) > 0
        done += len(eng.step())
        sync(device)
        if is_decode:
            step_times.append((len(running), time.perf_counter() - ts))
    sync(device)
    secs = time.perf_counter() - t0
    toks = eng.stats.generated_tokens
    dec = [t for _, t in step_times]
    return {"tokens": toks, "seconds": secs, "tok_s": toks / secs,
            "decode_step_ms": 1000 * sorted(dec)[len(dec) // 2] if dec else float("nan")}


@torch.no_grad()
def run_hf(hf, prompts: list[list[int]], n: int, new: int, device: str) -> dict:
    ids = torch.tensor([p for p in prompts for _ in range(n)], device=device)
    sync(device)
    t0 = time.perf_counter()
    out = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_p=1.0,
                      top_k=0, max_new_tokens=new, min_new_tokens=new, eos_token_id=None, pad_token_id=0)
    sync(device)
    secs = time.perf_counter() - t0
    toks = (out.shape[1] - ids.shape[1]) * out.shape[0]
    return {"tokens": toks, "seconds": secs, "tok_s": toks / secs}


@torch.no_grad()
def check_logprobs(ours, hf, cfg: M3Config, length: int, device: str) -> dict:
    """Engine ``score`` vs transformers' forward on one random prompt of ``length`` tokens.

    Returns the max / mean |logprob difference| over positions and the fraction of positions
    whose argmax token agrees (bf16 on the GPU: both sides round differently, so this is a
    tolerance check, not bitwise).
    """
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, cfg.vocab_size, (length,), generator=g).tolist()
    eng = LLMEngine(ours, EngineConfig(max_model_len=length, max_num_seqs=1, max_num_batched_tokens=max(8192, length)))
    got = eng.score(ids).float().cpu()[1:]
    logits = hf(input_ids=torch.tensor([ids], device=device)).logits[0, :-1].float()
    lp = torch.log_softmax(logits, -1)
    want = lp.gather(-1, torch.tensor(ids[1:], device=device)[:, None])[:, 0].cpu()
    diff = (got - want).abs()
    return {"length": length, "max_abs_diff": float(diff.max()), "mean_abs_diff": float(diff.mean())}


def decode_floor_ms(cfg: M3Config, model, batch: int, ctx: int, dtype: torch.dtype) -> float:
    """Bytes one decode step must read / HBM bandwidth, in ms.

    Weights: every non-expert tensor once (embedding: only the batch's rows) plus, per MoE layer,
    the expected number of distinct experts hit by batch x top-k random picks. KV: per row, the
    keys read by each layer (dense: ctx tokens; sparse: min(ctx, top_k x block) tokens, plus the
    index keys of all ctx tokens scored by the indexer).
    """
    elt = torch.empty((), dtype=dtype).element_size()
    e, k = cfg.num_local_experts, cfg.num_experts_per_tok
    expert_params, other = 0, 0
    for name, p in model.named_parameters():
        if ".experts." in name:
            expert_params += p.numel()
        elif "embed_tokens" in name:
            other += batch * p.shape[1]
        else:
            other += p.numel() * p.element_size() // elt
    hit = 1 - (1 - k / e) ** batch
    weight_bytes = (other + expert_params * hit) * elt
    kv_tok = 2 * cfg.num_key_value_heads * cfg.head_dim * elt
    kv = 0
    for i in range(cfg.num_hidden_layers):
        if cfg.is_sparse_layer(i):
            kv += min(ctx, cfg.sparse_topk_blocks * cfg.sparse_block_size) * kv_tok + ctx * cfg.sparse_index_dim * elt
        else:
            kv += ctx * kv_tok
    return 1000 * (weight_bytes + batch * kv) / HBM_BYTES_PER_S


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--model-json", help="config.json (either shape); default: tiny_config() on CPU")
    ap.add_argument("--loads", nargs="*", default=["grpo", "long"], choices=["grpo", "long"],
                    help="pass no value to run only --check-len")
    ap.add_argument("--long-len", type=int, default=None, help="long-context prompt tokens (CPU default 2048, CUDA 8192)")
    ap.add_argument("--long-batch", type=int, default=2)
    ap.add_argument("--long-new", type=int, default=32)
    ap.add_argument("--out", default=None, help="also write the figures as JSON here")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--dtype", default=None, choices=["bfloat16", "float32"], help="default: bf16 on CUDA, fp32 on CPU")
    ap.add_argument("--cuda-graphs", action="store_true", help="CUDA: also time the engine with decode CUDA graphs")
    ap.add_argument("--check-len", type=int, default=0,
                    help="first compare engine.score with transformers' forward on a prompt of this length")
    args = ap.parse_args()
    dev = args.device
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if dev == "cuda" else torch.float32)
    if args.model_json:
        raw = json.loads(Path(args.model_json).read_text())
        raw = {k: v for k, v in raw.items() if not k.startswith("_")}
        cfg = M3Config.from_dict(raw)
    else:
        cfg = tiny_config(max_position_embeddings=16384)
    long_len = args.long_len or (8192 if dev == "cuda" else 2048)
    cfg.max_position_embeddings = max(cfg.max_position_embeddings, long_len + args.long_new + 1)
    ours, hf = build_pair(cfg, dev, dtype)
    g = torch.Generator().manual_seed(0)
    prompt = lambda n: torch.randint(3, cfg.vocab_size, (n,), generator=g).tolist()  # noqa: E731
    if args.check_len:
        chk = check_logprobs(ours, hf, cfg, args.check_len, dev)
        print(f"logprob check vs transformers, {chk['length']} tokens ({dtype}): max |diff| {chk['max_abs_diff']:.4f}, "
              f"mean {chk['mean_abs_diff']:.5f}", flush=True)
    cases = []
    if "grpo" in args.loads:
        if dev == "cuda":
            cases += [("batch 1, 128+128", [prompt(128)], 1, 128, 1), ("batch 32, 128+128", [prompt(128) for _ in range(32)], 1, 128, 32)]
        else:
            cases.append(("GRPO 16x8, 128+128", [prompt(128) for _ in range(16)], 8, 128, 128))
    if "long" in args.loads:
        b = args.long_batch
        cases.append((f"long {long_len}+{args.long_new}, batch {b}", [prompt(long_len) for _ in range(b)], 1,
                      args.long_new, b))
    rows = []
    for name, prompts, n, new, batch in cases:
        max_len = max(map(len, prompts)) + new
        run_engine(ours, [p[:16] for p in prompts[:2]], 1, 4, dev, max_len)  # warm-up
        e = run_engine(ours, prompts, n, new, dev, max_len)
        h = run_hf(hf, prompts, n, new, dev)
        row = {"case": name, "engine_tok_s": e["tok_s"], "hf_tok_s": h["tok_s"], "ratio": e["tok_s"] / h["tok_s"],
               "engine_s": e["seconds"], "hf_s": h["seconds"], "decode_step_ms": e["decode_step_ms"]}
        if args.cuda_graphs and dev == "cuda":
            run_engine(ours, [p[:16] for p in prompts[:2]], 1, 4, dev, max_len, cuda_graphs=True)  # warm-up
            eg = run_engine(ours, prompts, n, new, dev, max_len, cuda_graphs=True)
            row.update(graph_tok_s=eg["tok_s"], graph_ratio=eg["tok_s"] / h["tok_s"], graph_decode_step_ms=eg["decode_step_ms"])
            print(f"{name}: engine with CUDA graphs {eg['tok_s']:.0f} tok/s, ratio {row['graph_ratio']:.2f}x, "
                  f"median decode step {eg['decode_step_ms']:.2f} ms", flush=True)
        if dev == "cuda":
            row["floor_ms"] = decode_floor_ms(cfg, ours, batch, max_len, dtype)
        rows.append(row)
        print(f"{name}: engine {e['tok_s']:.0f} tok/s ({e['seconds']:.1f} s), transformers {h['tok_s']:.0f} tok/s "
              f"({h['seconds']:.1f} s), ratio {row['ratio']:.2f}x, median decode step {e['decode_step_ms']:.2f} ms"
              + (f", bandwidth floor {row['floor_ms']:.3f} ms" if "floor_ms" in row else ""), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"machine": machine(dev), "rows": rows}, indent=1))
    if not args.no_write:
        import transformers

        lines = [f"\n## Engine vs transformers generate (bench_engine.py), {DATE}, {machine(dev)}\n",
                 f"Model: {args.model_json or 'tiny_config() (spec §7 preset A)'}, {dtype}, random weights; "
                 f"torch {torch.__version__}, transformers {transformers.__version__}; sampling at temperature 1.\n",
                 "| case | engine tok/s | transformers tok/s | ratio | median decode step (ms) |"
                 + (" bandwidth floor (ms) |" if dev == "cuda" else ""),
                 "|---|---|---|---|---|" + ("---|" if dev == "cuda" else "")]
        if args.check_len:
            lines.insert(2, f"engine.score vs transformers forward on {chk['length']} random tokens: max |logprob diff| "
                            f"{chk['max_abs_diff']:.4f}, mean {chk['mean_abs_diff']:.5f}.\n")
        for r in rows:
            lines.append(f"| {r['case']} | {r['engine_tok_s']:.0f} | {r['hf_tok_s']:.0f} | {r['ratio']:.2f}x | "
                         f"{r['decode_step_ms']:.2f} |" + (f" {r['floor_ms']:.3f} |" if dev == "cuda" else ""))
        if any("graph_tok_s" in r for r in rows):
            lines.append("\nWith decode CUDA graphs: " + "; ".join(
                f"{r['case']}: {r['graph_tok_s']:.0f} tok/s ({r['graph_ratio']:.2f}x transformers, median decode step "
                f"{r['graph_decode_step_ms']:.2f} ms)" for r in rows if "graph_tok_s" in r) + "\n")
        with open(ROOT / "docs" / "benchmarks.md", "a") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

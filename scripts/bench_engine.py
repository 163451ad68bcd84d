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
With ``--cuda-graphs`` the engine also runs with decode graphs, once per ``--async-modes`` value
(``EngineConfig.async_scheduling``), same seeds: the async / sync ratio and whether the tokens
are identical are printed. ``--skip-hf`` drops the transformers run (ratios then against the
transformers 5.17 anchor figures ``ANCHOR``, measured on CUDA), ``--skip-eager`` the engine run without graphs.
Appends a table to docs/benchmarks.md with machine and date (``--no-write`` to skip).

``--block-record``: only the cost of the MSA block-selection record (EngineConfig.record_block_selection,
design.md §2.3.1), each engine built once per setting and the runs alternated (record off / on,
``--record-reps`` times, medians): decode tokens/s and median decode step at batch 32 (128 + 256
tokens; on CUDA with decode graphs and async scheduling, as the engine runs), and one long prefill
(``--long-len``, default 131072 on CUDA, in chunks of ``--record-chunk`` tokens, the step budget).
Then the payload per token at M3 shapes (57 sparse layers x 4 KV heads x top-16 blocks of 128
tokens) on ``--record-payload-len`` tokens of the MSA benchmark's smooth and random index data
(``scripts/bench_msa.py``; block choice by the index top-k kernel on CUDA, its reference on CPU):
raw int16, the coded segment (sets: sorted rows, token delta, zstd), and what keeping the engine's
order within a row would cost; host encode / decode time per token.

    python scripts/bench_engine.py --device cuda --model-json configs/bench/m3_bench_300m.json --block-record

``--batch-invariant``: batch-invariant mode (``EngineConfig.batch_invariant``, design.md §4.6) against
the fast mode in the same run, on the same weights: per mode one decode engine (CUDA: decode graphs
for batch 1 and ``--record-batch``, async scheduling, as the engine runs) and one prefill engine, built
once and the runs alternated (fast / invariant, ``--record-reps`` times, medians): decode tokens/s and
median decode step at batch 1 and batch ``--record-batch`` (default 32; ``--invariant-prompt`` prompt
tokens, default 128, + ``--invariant-new`` tokens, default 128 on CUDA, 16 on CPU, no early stop,
seed 1 at temperature 1) and one prefill of ``--long-len`` tokens (default 32768 on CUDA, 1024 on
CPU) in chunks of ``--record-chunk`` (the step budget; default 16384 on CUDA, a quarter of the prompt
on CPU), ``--prefill-reps`` times per round (default 3: its time spreads between runs; the min-max is
printed): seconds and tokens/s; the invariant / fast slowdown per case (issue 24's target: <= 15 %),
judged on the median decode step for the decode cases (their tokens/s include the prompts' prefill,
most of the time at long prompts and batch 32) and on the time for the prefill. Then two token checks: how many of
the large-batch run's tokens differ between the two modes (they may: the invariant kernels round
differently), and for each mode whether the first 4 sequences of that run give bitwise the same
logprobs (and tokens) run alone at batch 1 with the same seed (the invariant mode's promise; the fast
mode's figure is the contrast). On the CPU ``paged_ops_for`` warns and the "invariant" engine runs
the same PyTorch ops as the fast one: the run only exercises the script (the output says so).

    python scripts/bench_engine.py --device cuda --model-json configs/bench/m3_bench_300m.json --batch-invariant
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from benchlib import bench_config, random_model, run_date
from benchlib import machine as _machine

from m3_rollout.engine.config import DEFAULT_INVARIANT_SPARSE_ATTENTION, INVARIANT_SPARSE_ATTENTIONS, EngineConfig
from m3_rollout.engine.engine import LLMEngine
from m3_rollout.engine.interface import GenerationRequest, SamplingParams
from m3_rollout.model import M3Config, M3ForCausalLM, load_hf_state_dict, tiny_config

ROOT = Path(__file__).resolve().parent.parent


def machine(device: str) -> str:
    return _machine(device) + ("" if device == "cuda" else f", {torch.get_num_threads()} threads")


HBM_BYTES_PER_S = 4.4e12
# transformers 5.17 generate() on one H200, configs/bench/m3_bench_300m.json, tok/s by
# (device, batch, n): the baseline of --skip-hf runs.
ANCHOR = {("cuda", 1, 1): 46.4, ("cuda", 32, 1): 1530.7}
# Each engine's kv_cache_memory_gb on CUDA (--kv-cache-gb; main() sets the run's value): KV pages
# plus the MSA prefill scratch, which a 16K-token chunk at real M3 layer shapes sizes at ~4.2 GB alone.
DEFAULT_KV_CACHE_GB = 4.0
_kv_cache_gb = DEFAULT_KV_CACHE_GB


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
            for _name, p in hf.named_parameters():
                p.normal_(0, 0.02) if p.ndim >= 2 else p.normal_(0, 0.05)
        ours = M3ForCausalLM(cfg)
    load_hf_state_dict(ours, hf.state_dict())
    ours = ours.to(device).cast_for_inference(dtype).eval()
    return ours, hf


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def make_engine(
    model,
    prompts: list[list[int]],
    n: int,
    device: str,
    max_len: int,
    cuda_graphs: bool = False,
    async_scheduling: bool | None = False,
    graph_sizes: tuple[int, ...] | None = None,
    **config,
) -> LLMEngine:
    """A fresh engine sized for ``prompts`` x n (``config``: further EngineConfig fields)."""
    # explicit: the auto size counts the previous engine's cached pool; a caller may pass its own
    kv_gb = config.pop("kv_cache_memory_gb", _kv_cache_gb if device == "cuda" else 0.0)
    config.setdefault("max_num_batched_tokens", max(8192, max(map(len, prompts))))
    return LLMEngine(
        model,
        EngineConfig(
            max_model_len=max_len,
            max_num_seqs=max(len(prompts) * n, 1),
            kv_cache_memory_gb=kv_gb,
            enable_cuda_graphs=cuda_graphs,
            cuda_graph_batch_sizes=graph_sizes,
            async_scheduling=async_scheduling,
            **config,
        ),
    )


def decode_and_prefill_engines(
    model, decode_prompts, long_prompt, dev: str, new: int, graph_sizes: tuple[int, ...], chunk, **config
) -> tuple[LLMEngine, LLMEngine]:
    """One A/B setting's two engines: a decode engine sized for ``decode_prompts`` + ``new`` tokens
    (CUDA graphs of ``graph_sizes`` and async scheduling on CUDA, as the engine runs) and a
    prefill engine for ``long_prompt`` in chunks of ``chunk`` tokens (no graphs); ``config``:
    the EngineConfig field under test."""
    plen, cuda = len(decode_prompts[0]), dev == "cuda"
    decode = make_engine(
        model, decode_prompts, 1, dev, plen + new + 1, cuda_graphs=cuda, async_scheduling=None,
        graph_sizes=graph_sizes, **config,
    )  # fmt: skip
    prefill = make_engine(
        model, long_prompt, 1, dev, len(long_prompt[0]) + 2, async_scheduling=None,
        max_num_batched_tokens=chunk, **config,
    )  # fmt: skip
    return decode, prefill


def run_engine(
    model,
    prompts: list[list[int]],
    n: int,
    new: int,
    device: str,
    max_len: int,
    cuda_graphs: bool = False,
    async_scheduling: bool | None = False,
    graph_sizes: tuple[int, ...] | None = None,
) -> dict:
    """Generate ``new`` tokens for every prompt x n on a fresh engine (after a warm-up generation
    of 4 tokens on it, same prompt lengths); tokens/s and the median decode step.

    A decode step's time is the interval between successive ``step()`` returns (no device sync
    in between, so async scheduling can overlap host work with the GPU as in real use)."""
    eng = make_engine(model, prompts, n, device, max_len, cuda_graphs, async_scheduling, graph_sizes)
    warm = SamplingParams(n=n, max_new_tokens=4, seed=2)
    for i, p in enumerate(prompts):  # same shapes (kernels compile here), reversed: no prefix-cache hit later
        eng.add_request(GenerationRequest(f"w{i}", p[::-1], warm))
    while eng.has_unfinished():
        eng.step()
    eng.stats = type(eng.stats)()
    params = SamplingParams(n=n, max_new_tokens=new, seed=1)
    step_times: list[float] = []  # seconds of decode-only steps
    sync(device)
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        eng.add_request(GenerationRequest(f"r{i}", p, params))
    outs = []
    ts = time.perf_counter()
    while eng.has_unfinished():
        running = eng.scheduler.running
        is_decode = not eng.scheduler.waiting and running and all(s.num_computed == s.num_tokens - 1 for s in running)
        outs += [o for o in eng.step() if hasattr(o, "finish_reason")]
        te = time.perf_counter()
        if is_decode:
            step_times.append(te - ts)
        ts = te
    sync(device)
    secs = time.perf_counter() - t0
    toks = eng.stats.generated_tokens
    m = eng.metrics()
    return {
        "tokens": toks,
        "seconds": secs,
        "tok_s": toks / secs,
        "decode_step_ms": 1000 * sorted(step_times)[len(step_times) // 2] if step_times else float("nan"),
        "host_ms": {k[len("host_ms_per_step_") :]: v for k, v in m.items() if k.startswith("host_ms_per_step_")},
        "outputs": {(o.request_id, o.sample_index): (o.output_ids, o.logprobs) for o in outs},
    }


def same_outputs(a: dict, b: dict) -> tuple[bool, float]:
    """(identical token ids, max |logprob difference|) of two runs' outputs."""
    same = a.keys() == b.keys() and all(a[k][0] == b[k][0] for k in a)
    diff = max((abs(p - q) for k in a if k in b for p, q in zip(a[k][1], b[k][1])), default=0.0)
    return same, diff


@torch.no_grad()
def run_hf(hf, prompts: list[list[int]], n: int, new: int, device: str) -> dict:
    ids = torch.tensor([p for p in prompts for _ in range(n)], device=device)
    sync(device)
    t0 = time.perf_counter()
    out = hf.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        do_sample=True,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        max_new_tokens=new,
        min_new_tokens=new,
        eos_token_id=None,
        pad_token_id=0,
    )
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


# ---- --block-record ------------------------------------------------------------------------
M3_SELECTION_DIMS = (57, 4, 16)  # sparse layers, KV heads, top-k blocks (spec: layers 3..59, 128-token blocks)


def timed_generate(eng: LLMEngine, prompts: list[list[int]], new: int, device: str, tag: str) -> dict:
    """Run ``prompts`` (n=1 each) to ``new`` tokens on ``eng`` (prefix cache emptied first): wall
    seconds, generated tokens/s, median decode step (ms), the call's time outside its decode steps
    (ms: request setup, the prompts' prefill, steps that still prefill) and the outputs."""
    eng.reset_prefix_cache()
    params = SamplingParams(n=1, max_new_tokens=new, seed=1)
    sync(device)
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        eng.add_request(GenerationRequest(f"{tag}{i}", p, params))
    outs, steps, ts = [], [], time.perf_counter()
    while eng.has_unfinished():
        running = eng.scheduler.running
        decode = not eng.scheduler.waiting and running and all(q.num_computed == q.num_tokens - 1 for q in running)
        outs += [o for o in eng.step() if hasattr(o, "finish_reason")]
        te = time.perf_counter()
        if decode:
            steps.append(te - ts)
        ts = te
    sync(device)
    secs = time.perf_counter() - t0
    toks = sum(len(o.output_ids) for o in outs)
    step_ms = 1000 * sorted(steps)[len(steps) // 2] if steps else float("nan")
    outside_ms = 1000 * (secs - sum(steps))
    return {
        "seconds": secs,
        "tok_s": toks / secs,
        "decode_step_ms": step_ms,
        "outside_decode_ms": outside_ms,
        "outputs": outs,
    }


def selection_data(n_tokens: int, smooth: bool, device: str, dims=M3_SELECTION_DIMS, seed: int = 0) -> torch.Tensor:
    """int16 [n_tokens, S, G, K]: each of S layers' block choice on its own synthetic index data
    (``m3_kernels.msa_synthetic`` pages, 128-token blocks, index dim 128; bench_msa.py's "smooth"
    queries: one direction per 64-token span + 0.5x noise, else i.i.d.), one prefill of n_tokens."""
    from m3_kernels.msa_synthetic import make_paged_batch
    from m3_rollout.engine.reference_ops import index_topk_ref

    s, g, k = dims
    if device == "cuda":
        from m3_kernels.msa_index_topk import index_topk
    else:
        index_topk = index_topk_ref
    dt = torch.bfloat16 if device == "cuda" else torch.float32
    out = torch.empty(n_tokens, s, g, k, dtype=torch.int16, device=device)
    for j in range(s):
        b = make_paged_batch(
            [(0, n_tokens)],
            0,
            page_size=128,
            kv_heads=g,
            q_heads=g,
            head_dim=16,
            index_dim=128,
            dtype=dt,
            device=device,
            seed=seed + j,
            spare_pages=0,
        )
        if smooth:
            gen = torch.Generator(device=device).manual_seed(seed + 1000 + j)
            base = torch.randn((n_tokens + 63) // 64, g, 128, generator=gen, device=device)
            b.iq.copy_((base.repeat_interleave(64, 0)[:n_tokens] + 0.5 * b.iq.float()).to(dt))
        out[:, j] = index_topk(b.iq, b.ik, b.meta, k, 0, 1)
    return out.cpu()


def payload_figures(rows: torch.Tensor) -> dict:
    """Bytes per token of a record (int16 [n, S, G, K] in the engine's order): raw, coded segment,
    and coded keeping the order within rows (same delta + zstd without the sort); encode / decode
    microseconds per token on this host (one thread of numpy + zstd)."""
    import numpy as np
    import pyarrow as pa

    from m3_rollout.model.selection_record import ZSTD_LEVEL, SelectionSegment, canonical_rows

    arr = rows.numpy()
    n = arr.shape[0]
    t0 = time.perf_counter()
    coded = SelectionSegment.from_rows(0, arr).to_bytes()
    t1 = time.perf_counter()
    back = SelectionSegment.from_bytes(coded).rows
    t2 = time.perf_counter()
    assert np.array_equal(back, canonical_rows(arr)), "coded segment does not round-trip"
    y = arr.view(np.uint16)
    d = np.concatenate([y[:1], y[1:] - y[:-1]])
    ordered = len(pa.Codec("zstd", compression_level=ZSTD_LEVEL).compress(d.tobytes(), asbytes=True))
    return {
        "raw_b_per_token": arr.nbytes / n,
        "coded_b_per_token": len(coded) / n,
        "ordered_b_per_token": ordered / n,
        "encode_us_per_token": 1e6 * (t1 - t0) / n,
        "decode_us_per_token": 1e6 * (t2 - t1) / n,
        "set_equal_next_token": float((canonical_rows(arr)[1:] == canonical_rows(arr)[:-1]).all(-1).mean()),
    }


def payload_line(p: dict, pattern: str, n_tokens: int) -> str:
    s, g, k = M3_SELECTION_DIMS
    return (
        f"payload, M3 shapes ({s} layers x {g} KV heads x top-{k}), {pattern} index data, {n_tokens} tokens: "
        f"raw {p['raw_b_per_token']:.0f} B/token, coded {p['coded_b_per_token']:.0f} B/token "
        f"({p['raw_b_per_token'] / p['coded_b_per_token']:.1f}x), keeping the row order "
        f"{p['ordered_b_per_token']:.0f} B/token; encode {p['encode_us_per_token']:.1f} us/token, decode "
        f"{p['decode_us_per_token']:.1f} us/token (host); next token selects the same set in "
        f"{100 * p['set_equal_next_token']:.1f} % of (layer, head) rows"
    )


def block_record_bench(args, cfg: M3Config, model, dev: str, dtype: torch.dtype) -> list[str]:
    """The ``--block-record`` mode (module docstring). Returns the docs/benchmarks.md lines."""
    import statistics

    g = torch.Generator().manual_seed(0)
    prompt = lambda n: torch.randint(3, cfg.vocab_size, (n,), generator=g).tolist()  # noqa: E731
    batch, plen, new = args.record_batch, 128, args.record_new
    long_len = args.long_len or (131072 if dev == "cuda" else 2048)
    decode_prompts, long_prompt = [prompt(plen) for _ in range(batch)], [prompt(long_len)]
    cuda = dev == "cuda"
    # Decode engines sized for the decode load (block tables <= MAX_FUSED_BLOCKS wide: the fused decode
    # kernel stores the record from registers), prefill engines for the long prompt (no graphs).
    engines = {}
    for rec in (False, True):
        eng, pre = decode_and_prefill_engines(
            model, decode_prompts, long_prompt, dev, new, (batch,), args.record_chunk, record_block_selection=rec
        )
        engines[rec, "decode"], engines[rec, "prefill"] = eng, pre
        timed_generate(eng, [p[::-1] for p in decode_prompts], 8, dev, "w")  # compile / warm up
        timed_generate(pre, [long_prompt[0][: 2 * args.record_chunk]], 1, dev, "w")
    runs = {(rec, part): [] for rec in (False, True) for part in ("decode", "prefill")}
    for rep in range(args.record_reps):
        for rec in (False, True) if rep % 2 == 0 else (True, False):
            runs[rec, "decode"].append(timed_generate(engines[rec, "decode"], decode_prompts, new, dev, f"d{rep}"))
            runs[rec, "prefill"].append(timed_generate(engines[rec, "prefill"], long_prompt, 1, dev, f"p{rep}"))
    outs = runs[True, "prefill"][-1]["outputs"][0]
    assert outs.block_selection.end == long_len, "the prefill's record does not cover the prompt"
    med = lambda rec, part, key: statistics.median(r[key] for r in runs[rec, part])  # noqa: E731
    dec_off, dec_on = med(False, "decode", "tok_s"), med(True, "decode", "tok_s")
    step_off, step_on = med(False, "decode", "decode_step_ms"), med(True, "decode", "decode_step_ms")
    pre_off, pre_on = med(False, "prefill", "seconds"), med(True, "prefill", "seconds")
    mode = "CUDA graphs + async scheduling" if cuda else "eager"
    row_bytes = engines[True, "prefill"].selection.row_bytes
    res = [
        f"decode, batch {batch}, {plen}+{new} tokens ({mode}): {dec_off:.0f} -> {dec_on:.0f} tok/s with the record "
        f"({100 * (dec_off / dec_on - 1):+.1f} % time); median decode step {step_off:.3f} -> {step_on:.3f} ms "
        f"({100 * (step_on / step_off - 1):+.1f} %)",
        f"prefill {long_len} tokens in {args.record_chunk}-token chunks: {pre_off:.3f} -> {pre_on:.3f} s "
        f"({100 * (pre_on / pre_off - 1):+.1f} %); record {long_len * row_bytes / 2**20:.0f} MiB",
    ]
    for line in res:
        print(line, flush=True)
    payload = {}
    try:
        import pyarrow  # noqa: F401 - the coded segments' zstd
    except ImportError:
        args.record_payload_len = []
        res.append("payload: skipped, pyarrow (zstd) is not installed here")
        print(res[-1], flush=True)
    for n_tok in args.record_payload_len:
        for pat in ("smooth", "random"):
            payload[f"{pat}_{n_tok}"] = p = payload_figures(selection_data(n_tok, pat == "smooth", dev))
            res.append(payload_line(p, pat, n_tok))
            print(res[-1], flush=True)
    if args.out:
        Path(args.out).write_text(
            json.dumps(
                {
                    "machine": machine(dev),
                    "decode_tok_s": [dec_off, dec_on],
                    "decode_step_ms": [step_off, step_on],
                    "prefill_s": [pre_off, pre_on],
                    "payload": payload,
                },
                indent=1,
            )
        )
    return [
        f"\n## MSA block-selection record cost (bench_engine.py --block-record), {run_date()}, {machine(dev)}\n",
        f"Model: {args.model_json or 'tiny_config()'}, {dtype}, random weights; record off vs on, medians of "
        f"{args.record_reps} alternated runs per setting; torch {torch.__version__}.\n",
        *[f"- {line}" for line in res],
    ]


# ---- --batch-invariant ---------------------------------------------------------------------
def bitwise_equal(a: list[float], b: list[float]) -> bool:
    """Whether two logprob lists (fp32 values as Python floats) hold the same bits, position by position."""
    as_bits = lambda x: torch.tensor(x, dtype=torch.float64).view(torch.int64)  # noqa: E731
    return len(a) == len(b) and bool(torch.equal(as_bits(a), as_bits(b)))


def token_diff(a: list, b: list) -> tuple[int, int, int]:
    """Two runs' outputs (``timed_generate``'s, same prompts in the same order): (differing token
    positions, counting a length difference as differing; sequences with identical tokens; the
    earliest differing position, -1 if none)."""
    by_id = lambda outs: {o.request_id.split("-", 1)[1]: o.output_ids for o in outs}  # noqa: E731
    ta, tb = by_id(a), by_id(b)
    differ, same, first = 0, 0, -1
    for k, x in ta.items():
        y = tb[k]
        bad = [i for i, (p, q) in enumerate(zip(x, y)) if p != q] + list(
            range(min(len(x), len(y)), max(len(x), len(y)))
        )
        differ += len(bad)
        same += not bad
        if bad and (first < 0 or bad[0] < first):
            first = bad[0]
    return differ, same, first


def invariant_bench(args, cfg: M3Config, model, dev: str, dtype: torch.dtype) -> list[str]:
    """The ``--batch-invariant`` mode (module docstring) on ``model`` (weights on ``dev`` in ``dtype``).

    Reads args.record_batch / record_reps / record_chunk / long_len / invariant_prompt / invariant_new /
    invariant_sparse (the invariant engines' EngineConfig.invariant_sparse_attention) /
    model_json / out.
    Prints the table (throughputs in tok/s, prefill in s, slowdown = invariant time / fast time - 1 in
    %) and the token checks; writes the figures as JSON to args.out when given. Returns the
    docs/benchmarks.md lines (the caller appends them unless --no-write). Off CUDA the engine's
    fallback warning is caught and reported as a "NOT batch-invariant here" line.
    """
    import statistics
    import warnings

    g = torch.Generator().manual_seed(0)
    prompt = lambda n: torch.randint(3, cfg.vocab_size, (n,), generator=g).tolist()  # noqa: E731
    cuda = dev == "cuda"
    batch, plen, reps = args.record_batch, args.invariant_prompt, args.record_reps
    new = args.invariant_new or (128 if cuda else 16)
    if new < 2 or plen < 1:  # a decode step is the interval between two steps' returns
        raise SystemExit(
            f"--batch-invariant: needs --invariant-new >= 2 and --invariant-prompt >= 1 (got {new}, {plen})"
        )
    if args.prefill_reps < 1:
        raise SystemExit(f"--batch-invariant: needs --prefill-reps >= 1 (got {args.prefill_reps})")
    long_len = args.long_len or (32768 if cuda else 1024)
    chunk = args.record_chunk or (16384 if cuda else max(long_len // 4, 1))
    decode_prompts, long_prompt = [prompt(plen) for _ in range(batch)], [prompt(long_len)]
    engines, fallback = {}, set()
    for inv in (False, True):
        with warnings.catch_warnings(record=True) as caught:  # paged_ops_for's fallback off CUDA
            warnings.simplefilter("always")
            eng, pre = decode_and_prefill_engines(
                model, decode_prompts, long_prompt, dev, new, tuple(sorted({1, batch})), chunk,
                batch_invariant=inv, invariant_sparse_attention=args.invariant_sparse,
            )  # fmt: skip
            engines[inv, "decode"], engines[inv, "prefill"] = eng, pre
        fallback |= {str(w.message) for w in caught if "batch_invariant" in str(w.message)}
        # compile / warm up every shape the timed runs meet (reversed prompts: no prefix-cache hit)
        timed_generate(eng, [p[::-1] for p in decode_prompts], 4, dev, "wb-")
        timed_generate(eng, [decode_prompts[0][::-1]], 4, dev, "w1-")
        timed_generate(pre, [long_prompt[0][::-1][: 2 * chunk]], 1, dev, "wp-")
    runs = {(inv, case): [] for inv in (False, True) for case in ("b1", "bN", "prefill")}
    for rep in range(reps):
        for inv in (False, True) if rep % 2 == 0 else (True, False):
            dec, pre = engines[inv, "decode"], engines[inv, "prefill"]
            runs[inv, "b1"].append(timed_generate(dec, decode_prompts[:1], new, dev, f"a{rep}-"))
            runs[inv, "bN"].append(timed_generate(dec, decode_prompts, new, dev, f"b{rep}-"))
            for k in range(args.prefill_reps):  # the prefill is short: more samples against the spread
                runs[inv, "prefill"].append(timed_generate(pre, long_prompt, 1, dev, f"p{rep}.{k}-"))
    med = lambda inv, case, key: statistics.median(r[key] for r in runs[inv, case])  # noqa: E731
    mode = "CUDA graphs + async scheduling" if cuda else "eager"
    figures, table = {}, []
    # issue 24: <= 15 % slower; no verdict where the engine fell back to the fast ops (off CUDA)
    verdict = lambda slow: "- (not invariant here)" if fallback else ("met" if slow <= 15 else "not met")  # noqa: E731
    for case, label in (
        ("b1", f"decode, batch 1, {plen} + {new} tokens ({mode})"),
        ("bN", f"decode, batch {batch}, {plen} + {new} tokens ({mode})"),
    ):
        fast, inv = med(False, case, "tok_s"), med(True, case, "tok_s")
        step_f, step_i = med(False, case, "decode_step_ms"), med(True, case, "decode_step_ms")
        outside = [med(False, case, "outside_decode_ms"), med(True, case, "outside_decode_ms")]
        figures[case] = {"tok_s": [fast, inv], "decode_step_ms": [step_f, step_i], "outside_decode_ms": outside}
        slow, step_slow = 100 * (fast / inv - 1), 100 * (step_i / step_f - 1)
        table.append(
            f"| {label} | {fast:,.0f} tok/s | {inv:,.0f} tok/s | {inv / fast:.3f} | {slow:+.1f} % | "
            f"{step_f:.3f} -> {step_i:.3f} ms | {step_slow:+.1f} % | {verdict(step_slow)} |"
        )
    fast, inv = med(False, "prefill", "seconds"), med(True, "prefill", "seconds")
    spread = {
        m: [min(r["seconds"] for r in runs[m, "prefill"]), max(r["seconds"] for r in runs[m, "prefill"])]
        for m in (False, True)
    }
    figures["prefill"] = {
        "seconds": [fast, inv],
        "tok_s": [long_len / fast, long_len / inv],
        "min_max_s": [spread[False], spread[True]],
        "samples": len(runs[False, "prefill"]),
    }
    slow = 100 * (inv / fast - 1)
    table.append(
        f"| prefill {long_len} tokens in {chunk}-token chunks | {fast:.3f} s ({long_len / fast:,.0f} tok/s) | "
        f"{inv:.3f} s ({long_len / inv:,.0f} tok/s) | {fast / inv:.3f} | {slow:+.1f} % | - | - | {verdict(slow)} |"
    )
    # decode rows are judged on the median decode step: their tokens/s (new tokens over the whole
    # generate call) include the prompts' prefill, which dominates at long prompts and batch 32
    header = [
        "| case | fast | invariant | invariant / fast (throughput, with the prompts' prefill) | slowdown (time) | "
        "median decode step fast -> invariant | decode step slowdown | target <= 15 % (decode step; prefill time) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for line in header + table:
        print(line, flush=True)
    differ, same, first = token_diff(runs[False, "bN"][-1]["outputs"], runs[True, "bN"][-1]["outputs"])
    notes = [
        f"batch-{batch} tokens, fast vs invariant (same seeds): {differ} of {batch * new} differ, {same} of "
        f"{batch} sequences identical" + (f", first difference at generated token {first}" if first >= 0 else "")
    ]
    print(notes[-1], flush=True)
    outside = {case: figures[case]["outside_decode_ms"] for case in ("b1", "bN")}
    notes.append(
        "a decode row's generate call outside its decode steps (request setup, the prompts' prefill, steps "
        f"that still prefill; medians), fast / invariant: batch 1 {outside['b1'][0]:.1f} / {outside['b1'][1]:.1f} "
        f"ms, batch {batch} {outside['bN'][0]:.1f} / {outside['bN'][1]:.1f} ms"
    )
    print(notes[-1], flush=True)
    n_pre = figures["prefill"]["samples"]
    notes.append(
        f"prefill: medians of {n_pre} runs per mode ({reps} rounds x {args.prefill_reps}); min-max fast "
        f"{spread[False][0]:.3f}-{spread[False][1]:.3f} s, invariant {spread[True][0]:.3f}-{spread[True][1]:.3f} s"
    )
    print(notes[-1], flush=True)
    alone = {}
    n_cmp = min(4, batch)
    for inv in (False, True):
        dec = engines[inv, "decode"]
        big = {o.request_id: o for o in runs[inv, "bN"][-1]["outputs"]}
        equal, same_ids, max_diff = 0, 0, 0.0
        for i in range(n_cmp):
            solo = timed_generate(dec, [decode_prompts[i]], new, dev, f"s{i}-")["outputs"][0]
            ref = big[f"b{reps - 1}-{i}"]
            same, diff = same_outputs({0: (solo.output_ids, solo.logprobs)}, {0: (ref.output_ids, ref.logprobs)})
            equal += same and bitwise_equal(solo.logprobs, ref.logprobs)
            same_ids, max_diff = same_ids + same, max(max_diff, diff)
        name = "invariant" if inv else "fast"
        alone[name] = {"bitwise_equal": equal, "same_tokens": same_ids, "compared": n_cmp, "max_abs_diff": max_diff}
        notes.append(
            f"{name} mode, batch {batch} vs each sequence alone at batch 1 (same seed), first {n_cmp} sequences: "
            f"{equal} of {n_cmp} bitwise-equal (tokens and logprobs); same tokens {same_ids} of {n_cmp}, "
            f"max |logprob diff| {max_diff:.2e} (over the positions both ran)"
        )
        print(notes[-1], flush=True)
    for msg in sorted(fallback):
        notes.append(f"NOT batch-invariant here: the engine warned: {msg}")
        print(notes[-1], flush=True)
    try:
        import triton

        import m3_kernels.invariant_ops as inv

        versions = f"torch {torch.__version__}, triton {triton.__version__}"
        whole_k = f"whole-K GEMMs (K >= {inv.WHOLE_K_MIN_K}) {'on' if inv.WHOLE_K else 'off'}"
    except ImportError:
        versions, whole_k = f"torch {torch.__version__}", "no triton"
    lines = [
        f"\n## Batch-invariant mode vs fast mode (bench_engine.py --batch-invariant), {run_date()}, {machine(dev)}\n",
        f"Model: {args.model_json or 'tiny_config()'}, {dtype}, random weights; `EngineConfig.batch_invariant` off vs "
        f"on on the same weights (invariant sparse attention: {args.invariant_sparse}; {whole_k}), medians of {reps} "
        f"alternated runs per mode; target <= 15 % slower; {versions}.\n",
        *header,
        *table,
        "",
        *[f"- {line}" for line in notes],
    ]
    if args.out:
        out = {"machine": machine(dev), "reps": reps, **figures, "batch_tokens_differ": differ, "alone": alone}
        Path(args.out).write_text(json.dumps({**out, "fallback": sorted(fallback), "lines": lines}, indent=1))
    return lines


def main(argv: list[str] | None = None) -> list[str] | None:
    """Parse ``argv`` (default: sys.argv), run the chosen mode; the --block-record and --batch-invariant
    modes return their docs/benchmarks.md lines (also when not written)."""
    global _kv_cache_gb
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--model-json", help="config.json (either shape); default: tiny_config() on CPU")
    ap.add_argument(
        "--loads",
        nargs="*",
        default=["grpo", "long"],
        choices=["grpo", "long"],
        help="pass no value to run only --check-len",
    )
    ap.add_argument(
        "--long-len",
        type=int,
        default=None,
        help="long-context prompt tokens (default CPU 2048, CUDA 8192; --block-record: CUDA 131072; "
        "--batch-invariant: CUDA 32768, CPU 1024)",
    )
    ap.add_argument(
        "--kv-cache-gb",
        type=float,
        default=DEFAULT_KV_CACHE_GB,
        help="CUDA: kv_cache_memory_gb per engine (pages + scratch)",
    )
    ap.add_argument("--long-batch", type=int, default=2)
    ap.add_argument("--long-new", type=int, default=32)
    ap.add_argument("--out", default=None, help="also write the figures as JSON here")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--dtype", default=None, choices=["bfloat16", "float32"], help="default: bf16 on CUDA, fp32 on CPU")
    ap.add_argument("--cuda-graphs", action="store_true", help="CUDA: also time the engine with decode CUDA graphs")
    ap.add_argument(
        "--async-modes",
        nargs="+",
        default=["off", "on"],
        choices=["off", "on"],
        help="with --cuda-graphs: EngineConfig.async_scheduling values to time (same seeds; tokens compared)",
    )
    ap.add_argument("--graph-sizes", type=int, nargs="+", default=None, help="padded decode sizes to capture")
    ap.add_argument(
        "--skip-hf",
        action="store_true",
        help="no transformers run (ratios against the anchor figures on CUDA; none on CPU)",
    )
    ap.add_argument("--skip-eager", action="store_true", help="no engine run without CUDA graphs")
    ap.add_argument(
        "--block-record",
        action="store_true",
        help="only the block-selection record's cost and payload (module docstring)",
    )
    ap.add_argument(
        "--batch-invariant",
        action="store_true",
        help="only batch-invariant vs fast mode: decode, prefill, token checks (module docstring)",
    )
    ap.add_argument(
        "--invariant-sparse",
        default=None,
        choices=INVARIANT_SPARSE_ATTENTIONS,
        help="--batch-invariant: the invariant sparse attention (EngineConfig.invariant_sparse_attention; default "
        f"{DEFAULT_INVARIANT_SPARSE_ATTENTION}: the KV-major per-page partials, faster prefill, slower decode than "
        "union)",
    )
    ap.add_argument("--record-batch", type=int, default=32, help="--block-record / --batch-invariant: decode batch")
    ap.add_argument("--record-new", type=int, default=256, help="--block-record: decode tokens per row")
    ap.add_argument(
        "--invariant-new", type=int, default=None, help="--batch-invariant: decode tokens per row (CUDA 128, CPU 16)"
    )
    ap.add_argument(
        "--invariant-prompt",
        type=int,
        default=128,
        help="--batch-invariant: prompt tokens per decode row (above top-k x block, e.g. 4096: sparse layers select)",
    )
    ap.add_argument(
        "--record-chunk",
        type=int,
        default=None,
        help="--block-record / --batch-invariant: prefill chunk (step budget; default 16384, --batch-invariant "
        "on CPU a quarter of --long-len)",
    )
    ap.add_argument("--record-reps", type=int, default=3, help="--block-record / --batch-invariant: runs per setting")
    ap.add_argument(
        "--prefill-reps",
        type=int,
        default=3,
        help="--batch-invariant: prefill runs per setting within each of the --record-reps rounds (the prefill "
        "is short and its time spreads between runs: more samples for its median)",
    )
    ap.add_argument(
        "--record-payload-len", type=int, nargs="+", default=[8192, 32768], help="--block-record: payload data tokens"
    )
    ap.add_argument(
        "--check-len",
        type=int,
        default=0,
        help="first compare engine.score with transformers' forward on a prompt of this length",
    )
    args = ap.parse_args(argv)
    _kv_cache_gb = args.kv_cache_gb
    dev = args.device
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if dev == "cuda" else torch.float32)
    if args.model_json:
        cfg = bench_config(args.model_json)
    else:
        cfg = tiny_config(max_position_embeddings=16384)
    long_len = args.long_len or (8192 if dev == "cuda" else 2048)
    if args.block_record and args.batch_invariant:
        raise SystemExit("--block-record and --batch-invariant are separate runs: pass one")
    if args.block_record:
        long_len = args.long_len or (131072 if dev == "cuda" else 2048)
        args.record_chunk = args.record_chunk or 16384
        args.skip_hf = True
    if args.invariant_sparse is not None and not args.batch_invariant:
        raise SystemExit("--invariant-sparse applies to --batch-invariant runs only")
    args.invariant_sparse = args.invariant_sparse or DEFAULT_INVARIANT_SPARSE_ATTENTION
    if args.batch_invariant:
        long_len = args.long_len or (32768 if dev == "cuda" else 1024)
        args.skip_hf = True
    cfg.max_position_embeddings = max(cfg.max_position_embeddings, long_len + args.long_new + 1)
    if args.skip_hf:
        ours, hf = random_model(cfg, dev, dtype), None
        if args.check_len:
            raise SystemExit("--check-len needs the transformers model: drop --skip-hf")
    else:
        ours, hf = build_pair(cfg, dev, dtype)
    if args.block_record or args.batch_invariant:
        bench = block_record_bench if args.block_record else invariant_bench
        lines = bench(args, cfg, ours, dev, dtype)
        if not args.no_write:
            with open(ROOT / "docs" / "benchmarks.md", "a") as f:
                f.write("\n".join(lines) + "\n")
        return lines
    if args.graph_sizes:
        args.graph_sizes = tuple(args.graph_sizes)
    g = torch.Generator().manual_seed(0)
    prompt = lambda n: torch.randint(3, cfg.vocab_size, (n,), generator=g).tolist()  # noqa: E731
    if args.check_len:
        chk = check_logprobs(ours, hf, cfg, args.check_len, dev)
        print(
            f"logprob check vs transformers, {chk['length']} tokens ({dtype}): max |diff| {chk['max_abs_diff']:.4f}, "
            f"mean {chk['mean_abs_diff']:.5f}",
            flush=True,
        )
    cases = []
    if "grpo" in args.loads:
        if dev == "cuda":
            cases += [
                ("batch 1, 128+128", [prompt(128)], 1, 128, 1),
                ("batch 32, 128+128", [prompt(128) for _ in range(32)], 1, 128, 32),
            ]
        else:
            cases.append(("GRPO 16x8, 128+128", [prompt(128) for _ in range(16)], 8, 128, 128))
    if "long" in args.loads:
        b = args.long_batch
        cases.append(
            (f"long {long_len}+{args.long_new}, batch {b}", [prompt(long_len) for _ in range(b)], 1, args.long_new, b)
        )
    rows = []
    for name, prompts, n, new, batch in cases:
        max_len = max(map(len, prompts)) + new
        row = {"case": name}
        e = h = None
        if not args.skip_eager:
            e = run_engine(ours, prompts, n, new, dev, max_len)
            row.update(engine_tok_s=e["tok_s"], engine_s=e["seconds"], decode_step_ms=e["decode_step_ms"])
        if hf is not None:
            h = run_hf(hf, prompts, n, new, dev)
            row.update(hf_tok_s=h["tok_s"], hf_s=h["seconds"])
            if e is not None:
                row["ratio"] = e["tok_s"] / h["tok_s"]
        base_tok_s, base_name = (
            (h["tok_s"], "transformers in this run") if h else (ANCHOR.get((dev, batch, n)), "transformers anchor")
        )
        row["baseline"] = base_name
        if args.cuda_graphs and dev == "cuda":
            graph_runs = {}
            for mode in args.async_modes:
                on = mode == "on"
                graph_runs[mode] = g = run_engine(ours, prompts, n, new, dev, max_len, True, on, args.graph_sizes)
                key = "graph" if mode == "off" else "graph_async"
                row.update(
                    {
                        f"{key}_tok_s": g["tok_s"],
                        f"{key}_decode_step_ms": g["decode_step_ms"],
                        f"{key}_host_ms": g["host_ms"],
                    }
                )
                if base_tok_s:
                    row[f"{key}_ratio"] = g["tok_s"] / base_tok_s
                print(
                    f"{name}: engine with CUDA graphs, async scheduling {mode}: {g['tok_s']:.0f} tok/s"
                    + (f" ({g['tok_s'] / base_tok_s:.2f}x {base_name})" if base_tok_s else "")
                    + f", median decode step {g['decode_step_ms']:.3f} ms; host ms/step (mean over all "
                    "steps, prefill included) " + " ".join(f"{k} {v:.3f}" for k, v in g["host_ms"].items()),
                    flush=True,
                )
            if len(graph_runs) == 2:
                same, diff = same_outputs(graph_runs["off"]["outputs"], graph_runs["on"]["outputs"])
                row.update(
                    async_speedup=graph_runs["on"]["tok_s"] / graph_runs["off"]["tok_s"],
                    async_same_tokens=same,
                    async_max_logprob_diff=diff,
                )
                print(
                    f"{name}: async / sync {row['async_speedup']:.2f}x; identical tokens {same}, "
                    f"max |logprob diff| {diff:.2e}",
                    flush=True,
                )
        if dev == "cuda":
            row["floor_ms"] = decode_floor_ms(cfg, ours, batch, max_len, dtype)
        rows.append(row)
        if e is not None:
            print(
                f"{name}: engine (eager) {e['tok_s']:.0f} tok/s ({e['seconds']:.1f} s)"
                + (
                    f", transformers {h['tok_s']:.0f} tok/s ({h['seconds']:.1f} s), ratio {row['ratio']:.2f}x"
                    if h
                    else ""
                )
                + f", median decode step {e['decode_step_ms']:.2f} ms"
                + (f", bandwidth floor {row['floor_ms']:.3f} ms" if "floor_ms" in row else ""),
                flush=True,
            )
        if args.out:
            Path(args.out).write_text(json.dumps({"machine": machine(dev), "rows": rows}, indent=1))
    if not args.no_write:
        import transformers

        lines = [
            f"\n## Engine vs transformers generate (bench_engine.py), {run_date()}, {machine(dev)}\n",
            f"Model: {args.model_json or 'tiny_config() (spec §7 preset A)'}, {dtype}, random weights; "
            f"torch {torch.__version__}, transformers {transformers.__version__}; sampling at temperature 1.\n",
        ]
        if args.check_len:
            lines.append(
                f"engine.score vs transformers forward on {chk['length']} random tokens: max |logprob diff| "
                f"{chk['max_abs_diff']:.4f}, mean {chk['mean_abs_diff']:.5f}.\n"
            )
        if any("engine_tok_s" in r for r in rows):
            lines += [
                "| case | engine tok/s | transformers tok/s | ratio | median decode step (ms) |"
                + (" bandwidth floor (ms) |" if dev == "cuda" else ""),
                "|---|---|---|---|---|" + ("---|" if dev == "cuda" else ""),
            ]
            for r in rows:
                if "engine_tok_s" in r:
                    lines.append(
                        f"| {r['case']} | {r['engine_tok_s']:.0f} | {r.get('hf_tok_s', float('nan')):.0f} | "
                        f"{r.get('ratio', float('nan')):.2f}x | {r['decode_step_ms']:.2f} |"
                        + (f" {r['floor_ms']:.3f} |" if dev == "cuda" else "")
                    )
        graph_rows = [r for r in rows if "graph_tok_s" in r or "graph_async_tok_s" in r]
        if graph_rows:
            nan = float("nan")
            lines += [
                "\nWith decode CUDA graphs (forward + sampler captured), async scheduling off / on "
                "(ratios against the baseline named in the row):\n",
                "| case | sync tok/s | async tok/s | async / sync | median decode step sync / async (ms) | "
                "vs baseline (async) | baseline | identical tokens | bandwidth floor (ms) |",
                "|---|---|---|---|---|---|---|---|---|",
            ]
            for r in graph_rows:
                lines.append(
                    f"| {r['case']} | {r.get('graph_tok_s', nan):.0f} | {r.get('graph_async_tok_s', nan):.0f} | "
                    f"{r.get('async_speedup', nan):.2f}x | {r.get('graph_decode_step_ms', nan):.3f} / "
                    f"{r.get('graph_async_decode_step_ms', nan):.3f} | {r.get('graph_async_ratio', nan):.2f}x | "
                    f"{r['baseline']} | {r.get('async_same_tokens', '-')} | {r.get('floor_ms', nan):.3f} |"
                )
        with open(ROOT / "docs" / "benchmarks.md", "a") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

"""Tokens/s through the rollout server (streaming /generate over HTTP) vs the in-process engine on
the same load, with p50 / p99 time to first token and inter-token latency.

    python scripts/bench_server.py                          # CPU, tiny M3, fp32, 32 and 256 concurrent
    python scripts/bench_server.py --device cuda --model-json configs/bench/m3_bench_300m.json \
        --prompt-len 128 --new-tokens 128                   # one GPU, the 300M benchmark model, bf16

Load: C concurrent requests (``--concurrency``, default 32 and 256), each a distinct random prompt
of ``--prompt-len`` tokens and up to ``--new-tokens`` generated tokens (the end-of-message id stops
a sample on both sides alike), seed i; every measured run follows a warm-up of C 4-token requests.
In-process: ``NativeBackend.stream`` for every request in one asyncio loop on a thread of its own
(as the server's engine thread, same torch thread count; 1 on the CPU). Server: the same checkpoint
served by ``python -m m3_rollout.serve`` in its own process, started after the in-process runs (the
two never share the machine), once per ``--server-modes`` entry: "thread" (the engine on a thread of
the server process) and "process" (``--engine-process``: the engine in a worker process of its
own). Requests are streaming ``/generate`` calls from a plain asyncio client in this process (an
httpx client's per-line parsing costs more CPU than the server's work per token). tokens/s = all
generated tokens / wall time from the first submission to the last token; TTFT = submission to
first token of a request; ITL = gaps between a request's consecutive token deliveries (a delivery
of k tokens counts as k gaps of equal size).
Appends a table to docs/benchmarks.md with machine and UTC time (``--no-write`` to skip).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import torch
from benchlib import bench_config, machine, random_model

from m3_rollout.chat.template import load_template, render
from m3_rollout.chat.tokenizer import save_tokenizer, train_tokenizer
from m3_rollout.engine.interface import GenerationRequest, SamplingParams, StreamDelta
from m3_rollout.engine.native_backend import NativeBackend
from m3_rollout.model import save_checkpoint, tiny_config
from m3_rollout.parallel.process_group import free_port

ROOT = Path(__file__).resolve().parent.parent


def tokenizer(vocab_size: int):
    """A small tokenizer with M3's markers (the server needs one; the load is token ids)."""
    template = load_template("m3_short")
    texts = [
        render(template, [{"role": "user", "content": f"question {i} about {i * 7}"}], None, True) for i in range(50)
    ]
    return train_tokenizer(texts, vocab_size=min(vocab_size, 600)), template


def requests(c: int, prompt_len: int, new: int, vocab: int) -> list[GenerationRequest]:
    rng = np.random.default_rng(0)
    return [
        GenerationRequest(
            f"r{i}", rng.integers(4, vocab, prompt_len).tolist(), SamplingParams(max_new_tokens=new, seed=i)
        )
        for i in range(c)
    ]


def summary(t0: float, t_end: float, starts: list[float], arrivals: list[list[tuple[float, int]]]) -> dict:
    """tokens/s, TTFT and ITL percentiles (ms) from per-request (time, tokens) arrivals."""
    tokens = sum(n for a in arrivals for _, n in a)
    ttft = [a[0][0] - s for s, a in zip(starts, arrivals)]
    itl = []
    for a in arrivals:
        for (t_prev, _), (t, n) in zip(a, a[1:]):
            itl += [(t - t_prev) / n] * n
    pct = lambda xs, q: 1000 * float(np.percentile(xs, q)) if xs else float("nan")
    return dict(
        tok_s=tokens / (t_end - t0),
        tokens=tokens,
        seconds=t_end - t0,
        ttft_p50=pct(ttft, 50),
        ttft_p99=pct(ttft, 99),
        itl_p50=pct(itl, 50),
        itl_p99=pct(itl, 99),
    )


async def run_engine(backend: NativeBackend, reqs: list[GenerationRequest]) -> dict:
    arrivals: list[list[tuple[float, int]]] = [[] for _ in reqs]
    starts = [0.0] * len(reqs)

    async def one(i: int, req: GenerationRequest) -> None:
        starts[i] = time.perf_counter()
        async for item in backend.stream(req):
            if isinstance(item, StreamDelta) and item.token_ids:
                arrivals[i].append((time.perf_counter(), len(item.token_ids)))

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i, r) for i, r in enumerate(reqs)))
    return summary(t0, time.perf_counter(), starts, arrivals)


def count_tokens(events: bytes) -> int:
    """Tokens in a block of /generate SSE events: the entries of every ``"token_ids": [...]`` list
    (delta events; the final record lists ``output_ids``)."""
    n, at = 0, events.find(TOKEN_IDS)
    while at >= 0:
        start = at + len(TOKEN_IDS)
        stop = events.index(b"]", start)
        if stop > start:
            n += events.count(b",", start, stop) + 1
        at = events.find(TOKEN_IDS, stop)
    return n


TOKEN_IDS = b'"token_ids": ['


async def stream_generate(port: int, body: dict, arrivals: list[tuple[float, int]]) -> None:
    """One streaming /generate call over a plain asyncio connection (HTTP/1.1, ``Connection:
    close``); appends (arrival time, tokens) per socket read that completed token events. A
    light client on purpose: on a small CPU machine an httpx client's per-line parsing takes the
    cores the server needs, and the load generator, not the server, is then measured."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    payload = json.dumps(body).encode()
    writer.write(
        b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(payload), payload)
    )
    head = await reader.readuntil(b"\r\n\r\n")
    if head.split(b" ", 2)[1] != b"200":
        raise RuntimeError(f"/generate answered {head!r}: {await reader.read()}")
    buf = b""
    while True:
        data = await reader.read(1 << 16)
        if not data:
            break
        buf += data
        cut = buf.rfind(b"\n\n")  # events end with a blank line; chunk framing never holds one
        if cut < 0:
            continue
        events, buf = buf[:cut], buf[cut + 2 :]
        n = count_tokens(events)
        if n:
            arrivals.append((time.perf_counter(), n))
        if b"data: [DONE]" in events:
            break
    writer.close()


async def run_server(port: int, reqs: list[GenerationRequest]) -> dict:
    arrivals: list[list[tuple[float, int]]] = [[] for _ in reqs]
    starts = [0.0] * len(reqs)

    async def one(i: int, req: GenerationRequest) -> None:
        p = req.params
        body = {
            "input_ids": list(req.prompt_ids),
            "stream": True,
            "sampling_params": {"max_new_tokens": p.max_new_tokens, "seed": p.seed},
        }
        starts[i] = time.perf_counter()
        await stream_generate(port, body, arrivals[i])

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i, r) for i, r in enumerate(reqs)))
    return summary(t0, time.perf_counter(), starts, arrivals)


def in_thread(coro):
    """Run ``coro`` on a fresh thread with this thread's torch thread count, as the server's engine
    thread runs (on the CPU a thread's OpenMP team size matters a lot; the two sides must match)."""
    box, n = {}, torch.get_num_threads()

    def run():
        torch.set_num_threads(n)
        box["out"] = asyncio.run(coro)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    return box["out"]


def start_server(model_dir: str, port: int, args, mode: str) -> subprocess.Popen:
    """``python -m m3_rollout.serve`` for ``model_dir``; ``mode`` "thread" (the engine on a thread of
    the server process) or "process" (``--engine-process``). Returns once /health answers."""
    cmd = [
        sys.executable,
        "-m",
        "m3_rollout.serve",
        "--model",
        model_dir,
        "--port",
        str(port),
        "--device",
        args.device,
        "--dtype",
        args.dtype,
        "--max-num-seqs",
        str(max(args.concurrency)),
        "--max-num-batched-tokens",
        str(args.max_num_batched_tokens),
    ] + (["--engine-process"] if mode == "process" else [])
    env = {**os.environ, "OMP_NUM_THREADS": "1"} if args.device == "cpu" else None
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 600
    while True:
        try:
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).raise_for_status()
            return proc
        except httpx.HTTPError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"the server did not start: {proc.stderr.read()}") from None
            time.sleep(0.5)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--model-json", default=None, help="M3 config.json (default: tiny_config, spec §7 preset A)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[32, 256])
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument(
        "--server-modes",
        nargs="+",
        choices=("thread", "process"),
        default=["thread", "process"],
        help="engine on a thread of the server process, and/or in a process of its own (--engine-process)",
    )
    ap.add_argument("--port", type=int, default=0, help="server port (0: a free one)")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    if args.device == "cpu":
        torch.set_num_threads(1)  # as every server-side engine here (OMP_NUM_THREADS=1; an EP worker's one)
    if args.model_json:
        cfg = bench_config(args.model_json)
    else:
        cfg = tiny_config()
    tok, template = tokenizer(cfg.vocab_size)
    cfg.vocab_size = max(cfg.vocab_size, len(tok))
    cfg.max_position_embeddings = max(cfg.max_position_embeddings, args.prompt_len + args.new_tokens + 16)
    model = random_model(cfg, args.device, getattr(torch, args.dtype))
    max_len = cfg.max_position_embeddings
    engine: dict[int, dict] = {}
    rows = []
    t_start, load = time.perf_counter(), os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        save_checkpoint(model.float(), cfg, tmp)
        model.cast_for_inference(getattr(torch, args.dtype))
        save_tokenizer(tok, tmp, template)
        for c in args.concurrency:
            # The server stops at the tokenizer's end-of-message id: so does the in-process engine (same
            # model, seeds and keyed sampler, so both sides generate the same tokens).
            eos = [tok.convert_tokens_to_ids(tok.eos_token)]
            backend = NativeBackend(
                model,
                eos,
                max_model_len=max_len,
                max_num_seqs=max(args.concurrency),
                max_num_batched_tokens=args.max_num_batched_tokens,
            )
            in_thread(run_engine(backend, requests(c, args.prompt_len, 4, cfg.vocab_size)))  # warm-up
            engine[c] = in_thread(run_engine(backend, requests(c, args.prompt_len, args.new_tokens, cfg.vocab_size)))
            backend.shutdown()
            print(f"engine  C={c}: {engine[c]['tok_s']:.0f} tok/s", flush=True)
        del model, backend
        if args.device == "cuda":
            torch.cuda.empty_cache()
        for mode in args.server_modes:
            port = args.port or free_port()
            proc = start_server(tmp, port, args, mode)
            try:
                for c in args.concurrency:
                    asyncio.run(run_server(port, requests(c, args.prompt_len, 4, cfg.vocab_size)))  # warm-up
                    srv = asyncio.run(run_server(port, requests(c, args.prompt_len, args.new_tokens, cfg.vocab_size)))
                    rows.append({"concurrency": c, "mode": mode, "engine": engine[c], "server": srv})
                    ratio = srv["tok_s"] / engine[c]["tok_s"]
                    print(f"server ({mode}) C={c}: {srv['tok_s']:.0f} tok/s, ratio {ratio:.2f}x", flush=True)
            finally:
                proc.terminate()
                proc.wait(timeout=60)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        f"\n## Rollout server vs in-process engine (bench_server.py), {stamp}, {machine(args.device)}\n",
        f"Model: {args.model_json or 'tiny_config() (spec §7 preset A)'}, {args.dtype}, random weights; "
        f"{args.prompt_len} prompt + up to {args.new_tokens} generated tokens per request, C concurrent "
        "requests; server = `python -m m3_rollout.serve` in its own process (engine on a thread of it, or in a "
        "process of its own with `--engine-process`), streaming `/generate` from a plain asyncio client; "
        "engine = `NativeBackend.stream` in-process. TTFT / ITL in ms (p50 / p99). "
        f"Whole run {time.perf_counter() - t_start:.0f} s; load average {load:.1f} at its start.\n",
        "| C | server engine | engine tok/s | server tok/s | server / engine | TTFT engine | TTFT server "
        "| ITL engine | ITL server |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        e, s = r["engine"], r["server"]
        ratio = s["tok_s"] / e["tok_s"]
        lines.append(
            f"| {r['concurrency']} | {r['mode']} | {e['tok_s']:.0f} | {s['tok_s']:.0f} | {ratio:.2f}x "
            f"| {e['ttft_p50']:.0f} / {e['ttft_p99']:.0f} | {s['ttft_p50']:.0f} / {s['ttft_p99']:.0f} | "
            f"{e['itl_p50']:.1f} / {e['itl_p99']:.1f} | {s['itl_p50']:.1f} / {s['itl_p99']:.1f} |"
        )
    print("\n".join(lines))
    if not args.no_write:
        with open(ROOT / "docs" / "benchmarks.md", "a") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()

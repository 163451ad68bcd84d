"""Shared pieces of the server tests: a tiny tokenizer + M3 checkpoint, a scripted backend, and a
server on 127.0.0.1 (a free port) in a background thread of the test process."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import torch
import uvicorn

from m3_rollout.chat.template import load_template, render
from m3_rollout.chat.tokenizer import save_tokenizer, train_tokenizer
from m3_rollout.engine.interface import GenerationBackend, SampleOutput, StreamDelta
from m3_rollout.engine.native_backend import NativeBackend
from m3_rollout.engine.stop_strings import complete_text
from m3_rollout.model import M3ForCausalLM, save_checkpoint, tiny_config
from m3_rollout.parallel.process_group import free_port
from m3_rollout.server.app import build_app
from m3_rollout.server.client import RolloutServerClient
from m3_rollout.server.openai_api import ServedModel
from m3_rollout.server.runner import EngineRunner

MODES = ("enabled", "disabled", "adaptive")
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "book",
            "description": "Book a trip.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "nights": {"type": "integer"},
                    "guests": {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                        },
                    },
                    "options": {
                        "type": "object",
                        "properties": {
                            "breakfast": {"type": "boolean"},
                            "tags": {"type": "array", "items": {"type": "string"}},
                        },
                    },
                },
            },
        },
    },
]
MESSAGES = [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "What is 12 * 34?"}]


def tiny_tokenizer():
    """A byte-level BPE that knows M3's markers, with the short chat template (~1 s to train)."""
    template = load_template("m3_short")
    call = {"function": {"name": "calculator", "arguments": {"expression": "12*34"}}}
    texts = []
    for i in range(10):
        convo = MESSAGES + [
            {"role": "assistant", "content": f"ok {i}", "reasoning_content": "hm", "tool_calls": [call]},
            {"role": "tool", "content": str(408 * i)},
            {"role": "assistant", "content": f"It is {408 * i}."},
        ]
        texts += [render(template, convo, TOOLS, True, m) for m in MODES]
    tok = train_tokenizer(texts, vocab_size=600)
    tok.chat_template = template
    return tok


def tiny_model(vocab_size: int, seed: int = 0, max_len: int = 512) -> M3ForCausalLM:
    """A random fp32 tiny M3 (page = MSA block = 16 tokens)."""
    torch.manual_seed(seed)
    model = M3ForCausalLM(tiny_config(vocab_size=vocab_size, max_position_embeddings=max_len)).float()
    return model.eval()


def save_tiny_checkpoint(path: Path, tok, model: M3ForCausalLM) -> Path:
    save_checkpoint(model, model.config, path)
    save_tokenizer(tok, path, tok.chat_template)
    return path


def served_model(tok, vocab_size: int, max_model_len: int, name: str = "tiny-m3") -> ServedModel:
    return ServedModel(
        name=name,
        tokenizer=tok,
        chat_template=tok.chat_template,
        stop_token_ids=[tok.convert_tokens_to_ids(tok.eos_token)],
        max_model_len=max_model_len,
        vocab_size=vocab_size,
    )


def native_backend(model, served: ServedModel, **kw) -> NativeBackend:
    kw.setdefault("max_num_seqs", 64)
    return NativeBackend(
        model, served.stop_token_ids, max_model_len=served.max_model_len, detokenize=served.decode, **kw
    )


class LiveServer:
    """The app on 127.0.0.1:<free port> in a thread; ``stop()`` shuts it (and its runner) down."""

    def __init__(self, served: ServedModel, backend: GenerationBackend, api_key: str | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.app = build_app(served, EngineRunner(backend), api_key)
        config = uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start within 60 s")
            time.sleep(0.02)

    @property
    def controller(self):
        return self.app.state.controller

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)


class ScriptedBackend(GenerationBackend):
    """Streams scripted token ids, one token per delta: sample s gets ``scripts[s % len(scripts)]``
    (cut at max_new_tokens). Logprobs are -0.01 * (i + 1); every token carries version 5.
    Implements the streaming protocol (``stream`` + ``abort``). With ``detokenize`` it honours
    ``SamplingParams.stop_strings`` as the engine does: the script ends ("stop") at the first token
    after which its decoded text (of complete characters: ``stop_strings.complete_text``) contains
    one, that token kept."""

    def __init__(self, scripts: list[list[int]], stop_id: int, detokenize=None):
        self.scripts, self.stop_id, self.detokenize = scripts, stop_id, detokenize
        self.requests = []
        self.aborted: set[str] = set()

    def _ids(self, req, j: int) -> list[int]:
        ids = list(self.scripts[(req.sample_index + j) % len(self.scripts)])[: req.params.max_new_tokens]
        stops = req.params.stop_strings if self.detokenize else ()
        for k in range(1, len(ids) + 1) if stops else ():
            if any(s in complete_text(self.detokenize(ids[:k])) for s in stops):
                return ids[:k]
        return ids

    def _finish(self, req, ids: list[int]) -> str:
        stops = req.params.stop_strings if self.detokenize else ()
        if ids and (ids[-1] == self.stop_id or any(s in complete_text(self.detokenize(ids)) for s in stops)):
            return "stop"
        return "length"

    def _out(self, req, j: int) -> SampleOutput:
        ids = self._ids(req, j)
        finish = self._finish(req, ids)
        return SampleOutput(
            req.request_id,
            req.sample_index + j,
            list(req.prompt_ids),
            ids,
            [-0.01 * (i + 1) for i in range(len(ids))],
            finish,
            5,
            token_weight_versions=[5] * len(ids),
        )

    def generate(self, requests):
        self.requests += list(requests)
        return [self._out(r, j) for r in requests for j in range(r.params.n)]

    async def stream(self, req):
        self.requests.append(req)
        for j in range(req.params.n):
            for i, t in enumerate(self._ids(req, j)):
                await asyncio.sleep(0)
                yield StreamDelta(req.request_id, req.sample_index + j, [t], [-0.01 * (i + 1)], [5])
            yield self._out(req, j)

    def abort(self, request_id: str) -> None:
        self.aborted.add(request_id)

    @property
    def weight_version(self) -> int:
        return 5

    def update_weights(self, version, named_tensors):
        raise NotImplementedError("scripted backend")


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def start_server_process(
    model_dir: Path, args: list[str], startup_timeout_s: float, prelude: str | None = None, **popen_kw
):
    """``python -m m3_rollout.serve --model model_dir --port <free> *args`` in its own process
    (OMP_NUM_THREADS=1, stdout and stderr in one text pipe), waited for on /health; ``prelude``:
    Python code run in that process before the server starts (e.g. a patch that prints what a test
    looks for); ``popen_kw`` go to ``subprocess.Popen``. Returns (process, url, client).

    Raises: RuntimeError with the server's output when it exits or is not healthy within
    ``startup_timeout_s`` seconds."""
    port = free_port()
    serve = ["-m", "m3_rollout.serve"]
    if prelude is not None:
        serve = ["-c", f"{prelude}\nimport sys\nfrom m3_rollout.serve import main\nsys.exit(main(sys.argv[1:]))\n"]
    cmd = [sys.executable, *serve, "--model", str(model_dir), "--port", str(port), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **popen_kw
    )
    url = f"http://127.0.0.1:{port}"
    client = RolloutServerClient(url, timeout_s=120)
    deadline = time.monotonic() + startup_timeout_s
    while True:
        try:
            client.health()
            return proc, url, client
        except httpx.HTTPError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                client.close()
                raise RuntimeError(f"server did not start:\n{proc.stdout.read()}") from None
            time.sleep(0.2)


@contextlib.contextmanager
def serve_subprocess(model_dir: Path, args: list[str], startup_timeout_s: float, stop_timeout_s: float):
    """The server of :func:`start_server_process`; yields (url, client); on exit the client closes
    and the server gets SIGTERM, then SIGKILL after ``stop_timeout_s``."""
    proc, url, client = start_server_process(model_dir, args, startup_timeout_s)
    try:
        yield url, client
    finally:
        client.close()
        proc.terminate()
        try:
            proc.wait(timeout=stop_timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()

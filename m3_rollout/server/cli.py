"""Start the server: ``python -m m3_rollout.serve --model DIR|builtin:NAME [...]`` (console script
``m3-rollout-serve``).

Governing idea: build the pieces once (tokenizer + chat template, the generation backend, the
engine runner, the FastAPI app) and hand the app to uvicorn. ``--expert-parallel-size`` P > 1 (or
``--engine-process``: P = 1 in a process of its own) serves through the expert-parallel
``RolloutService`` (P worker processes: streaming, abort, weight sync over HTTP, top logprobs);
otherwise the in-process ``NativeBackend`` serves the same on a thread of this process.
Binds to 127.0.0.1 unless ``--host`` says otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import errno
import json
import logging
import signal
import socket
import sys
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import torch
import uvicorn

from m3_rollout.chat.template import BUILTIN_CHAT_DEFAULTS, read_chat_defaults
from m3_rollout.config import device_problem
from m3_rollout.engine.config import DEFAULT_INVARIANT_SPARSE_ATTENTION, INVARIANT_SPARSE_ATTENTIONS
from m3_rollout.engine.interface import GenerationBackend

from .openai_api import ServedModel, thinking_mode_of
from .protocol import APIError
from .runner import EngineRunner

DTYPES = ("auto", "float32", "bfloat16", "float16", "float64")


def parse_args(argv: Sequence[str] | None = None, prog: str = "m3-rollout serve") -> argparse.Namespace:
    """The server's command line. prog: the command ``--help`` and errors name (the one the user typed).

    Raises:
        SystemExit(2): a bad flag (argparse's ``error:`` line); SystemExit(0) after ``--help``.
    """
    p = argparse.ArgumentParser(prog=prog, description="OpenAI-compatible M3 rollout server")
    p.add_argument("--model", required=True, help="checkpoint directory or builtin:NAME")
    p.add_argument("--served-model-name", default=None, help="model id clients send (default: --model)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="TCP port to serve on (default 8000)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every endpoint")
    p.add_argument("--expert-parallel-size", type=int, default=1, help="EP worker processes (1: in-process engine)")
    p.add_argument(
        "--engine-process",
        action="store_true",
        help="with --expert-parallel-size 1: run the engine in a worker process of its own (the EP service with "
        "one rank), so HTTP work never holds the engine's GIL (EP > 1 always runs in worker processes)",
    )
    p.add_argument(
        "--worker-steps-per-call",
        type=int,
        default=4,
        help="EP / --engine-process: engine steps per call to the workers (a stream gets up to this many tokens "
        "at once; a new request waits up to this many steps)",
    )
    p.add_argument("--dtype", choices=DTYPES, default="auto", help="generation dtype (auto: bf16 on GPU, fp32 on CPU)")
    p.add_argument("--device", default="auto", help="cpu | cuda | cuda:N | auto (default: cuda if present, else cpu)")
    p.add_argument("--max-model-len", type=int, default=None, help="longest context (default: the model's)")
    p.add_argument("--max-num-seqs", type=int, default=256, help="most sequences the engine runs at once (default 256)")
    p.add_argument("--max-num-batched-tokens", type=int, default=4096)
    p.add_argument(
        "--kv-cache-memory-gb", type=float, default=0.0, help="KV page pool + MSA prefill scratch (0: automatic)"
    )
    p.add_argument(
        "--msa-prefill-scratch-mb",
        type=float,
        default=None,
        help="KV-major sparse prefill scratch in MiB, inside the cache memory (default: one 16384-token pass; "
        "0: the KV-major path off)",
    )
    p.add_argument(
        "--kv-cache-memory-fraction",
        type=float,
        default=0.8,
        help="automatic KV pool on CUDA: this fraction of the free device memory (default 0.8)",
    )
    p.add_argument(
        "--index-cache-dtype",
        choices=("bfloat16", "fp8_e4m3"),
        default="bfloat16",
        help="sparse layers' index-key cache (fp8_e4m3: e4m3 codes + a scale per token)",
    )
    p.add_argument(
        "--quantize-index-queries",
        action="store_true",
        help="with --index-cache-dtype fp8_e4m3: quantize the index queries too (fp8 x fp8 scores, the fastest)",
    )
    p.add_argument(
        "--no-prefix-caching", action="store_true", help="do not reuse full KV pages across requests (on by default)"
    )
    p.add_argument(
        "--async-scheduling",
        choices=("auto", "on", "off"),
        default="auto",
        help="launch step N+1 before step N's ids reach the host (auto: on for CUDA, off on CPU)",
    )
    p.add_argument(
        "--record-routing", action="store_true", help="keep routed experts (/generate return_routed_experts)"
    )
    p.add_argument(
        "--record-block-selection",
        action="store_true",
        help="record each sparse layer's KV blocks per token (/generate return_block_selection)",
    )
    p.add_argument(
        "--batch-invariant",
        action="store_true",
        help="fixed-order kernels: logits / logprobs independent of the batch (CUDA only; slower)",
    )
    p.add_argument(
        "--invariant-sparse-attention",
        choices=INVARIANT_SPARSE_ATTENTIONS,
        default=DEFAULT_INVARIANT_SPARSE_ATTENTION,
        help="--batch-invariant: the sparse layers' attention (default %(default)s: per-page partials, fast long "
        "prefill; union: the union walk, other bits; a trainer scoring these rollouts must use the same)",
    )
    p.add_argument(
        "--default-chat-template-kwargs",
        default=None,
        help='JSON object applied under every chat request\'s chat_template_kwargs, e.g. \'{"thinking_mode": '
        '"disabled"}\' (default: that for builtin: checkpoints, which are trained in that mode; else none)',
    )
    p.add_argument(
        "--graceful-shutdown-timeout",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="after SIGTERM / Ctrl-C, wait at most this long for requests in flight and open connections, then "
        "cut them off; the engine stops either way (default 30; 0: no wait)",
    )
    p.add_argument("--enable-cuda-graphs", action="store_true")
    p.add_argument("--log-level", default="warning")
    args = p.parse_args(argv)
    if args.expert_parallel_size < 1:
        p.error(f"--expert-parallel-size={args.expert_parallel_size}: must be >= 1")
    if args.worker_steps_per_call < 1:
        p.error(f"--worker-steps-per-call={args.worker_steps_per_call}: must be >= 1")
    if args.msa_prefill_scratch_mb is not None and not 0 <= args.msa_prefill_scratch_mb < float("inf"):
        p.error(f"--msa-prefill-scratch-mb={args.msa_prefill_scratch_mb}: must be a finite MiB >= 0")
    if not 0 < args.kv_cache_memory_fraction <= 1:
        p.error(f"--kv-cache-memory-fraction={args.kv_cache_memory_fraction}: must be in (0, 1]")
    if not 0 <= args.graceful_shutdown_timeout < float("inf"):
        timeout = args.graceful_shutdown_timeout
        p.error(f"--graceful-shutdown-timeout={timeout}: must be a finite number of seconds >= 0")
    if not 0 < args.port < 65536:
        p.error(f"--port={args.port}: must be in 1..65535")
    if not args.batch_invariant and args.invariant_sparse_attention != DEFAULT_INVARIANT_SPARSE_ATTENTION:
        print(
            f"warning: --invariant-sparse-attention {args.invariant_sparse_attention} has no effect without "
            "--batch-invariant (it chooses that mode's sparse attention)",
            file=sys.stderr,
        )
    # the GRPO job's cluster.device rule (one line here instead of a traceback from the checkpoint
    # load), plus auto (CUDA when there is one, else cpu), the flag's own and always usable
    problem = device_problem(args.device, "--device", torch.cuda.is_available(), torch.cuda.device_count(), auto=True)
    if problem:
        p.error(f"--device={args.device}: {problem}")
    return args


def _device(name: str) -> str:
    return ("cuda" if torch.cuda.is_available() else "cpu") if name == "auto" else name


def _dtype(name: str, device: str) -> str:
    return ("bfloat16" if device == "cuda" else "float32") if name == "auto" else name


def build_backend(args: argparse.Namespace, model_dir: Path, stop_ids: list[int], max_len: int, detokenize: Callable):
    """The generation backend the arguments ask for (NativeBackend or the EP RolloutService)."""
    device = _device(args.device)
    dtype = _dtype(args.dtype, device)
    engine = dict(
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory_gb=args.kv_cache_memory_gb,
        kv_cache_memory_fraction=args.kv_cache_memory_fraction,
        msa_prefill_scratch_mb=args.msa_prefill_scratch_mb,
        enable_prefix_caching=not args.no_prefix_caching,
        enable_cuda_graphs=args.enable_cuda_graphs,
        async_scheduling={"auto": None, "on": True, "off": False}[args.async_scheduling],
        index_cache_dtype=args.index_cache_dtype,
        quantize_index_queries=args.quantize_index_queries,
        record_block_selection=args.record_block_selection,
        batch_invariant=args.batch_invariant,
        invariant_sparse_attention=args.invariant_sparse_attention,
    )
    if args.expert_parallel_size > 1 or args.engine_process:
        from m3_rollout.config import MasterConfig
        from m3_rollout.service.factory import build_rollout_service

        cfg = MasterConfig()
        gen = dataclasses.replace(
            cfg.policy.generation,
            dtype=dtype,
            expert_parallel_size=args.expert_parallel_size,
            max_num_seqs=args.max_num_seqs,
            **engine,
        )
        cfg.policy = dataclasses.replace(cfg.policy, generation=gen, routing_replay=args.record_routing)
        cfg.cluster = dataclasses.replace(cfg.cluster, gpus_per_node=int(device == "cuda"), launcher="mp")
        try:
            service = build_rollout_service(cfg, model_dir, stop_ids, max_len)
        except ValueError as exc:  # the EP checks name the GRPO config key; here it is the flag
            raise ValueError(
                str(exc).replace("policy.generation.expert_parallel_size", "--expert-parallel-size")
            ) from exc
        service.stream_steps_per_call = args.worker_steps_per_call
        return service
    from m3_rollout.engine.native_backend import NativeBackend
    from m3_rollout.model import load_checkpoint

    model = load_checkpoint(model_dir, dtype=torch.float32, device=device).cast_for_inference(getattr(torch, dtype))
    return NativeBackend(
        model,
        stop_ids,
        max_model_len=max_len,
        max_num_seqs=args.max_num_seqs,
        detokenize=detokenize,
        record_routing=args.record_routing,
        **engine,
    )


def default_template_kwargs(text: str | None, builtin: bool = False, model_dir: Path | None = None) -> dict:
    """``--default-chat-template-kwargs`` parsed (a JSON object; its thinking mode checked). When not
    given: the checkpoint's own ``chat_template_kwargs.json`` (``model_dir``; written by the builtin
    builds and the GRPO job's checkpoints: the rendering their prompts were trained in, as a
    released checkpoint's template default is its own), else ``{"thinking_mode": "disabled"}`` for
    a ``builtin:`` checkpoint built before that file existed, else ``{}``. Raises ValueError naming
    the flag or the file."""
    if text is None:
        found = read_chat_defaults(model_dir) if model_dir is not None else {}
        if found:
            return found
        return dict(BUILTIN_CHAT_DEFAULTS) if builtin else {}
    try:
        kwargs = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--default-chat-template-kwargs: not JSON ({exc})") from None
    if not isinstance(kwargs, dict):
        raise ValueError(f"--default-chat-template-kwargs: must be a JSON object, got {text!r}")
    try:
        thinking_mode_of(kwargs)
    except APIError as exc:
        raise ValueError(f"--default-chat-template-kwargs: {exc.message}") from None
    return kwargs


def build_served(
    model_dir: Path, name: str, max_model_len: int | None, default_chat_template_kwargs: dict | None = None
) -> ServedModel:
    """Tokenizer, chat template and limits of the checkpoint in ``model_dir``."""
    from transformers import AutoTokenizer

    from m3_rollout.model.configuration import M3Config

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    if not tok.chat_template:
        raise ValueError(f"{model_dir}: the tokenizer has no chat template (chat_template.jinja)")
    cfg = M3Config.from_pretrained(str(model_dir))
    limit = cfg.max_position_embeddings
    if max_model_len is not None and not 1 < max_model_len <= limit:
        raise ValueError(f"--max-model-len={max_model_len}: must be in 2..{limit} (the model's positions)")
    return ServedModel(
        name=name,
        tokenizer=tok,
        chat_template=tok.chat_template,
        stop_token_ids=[tok.convert_tokens_to_ids(tok.eos_token)],
        max_model_len=max_model_len or limit,
        vocab_size=cfg.vocab_size,
        default_chat_template_kwargs=dict(default_chat_template_kwargs or {}),
    )


class BindError(RuntimeError):
    """The server's address cannot be bound; the message names the flag (``--port`` / ``--host``)."""


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (not listening yet: uvicorn listens on it once the app
    is built), as uvicorn binds one (SO_REUSEADDR, IPv6 for a host with ':').

    Binding before the checkpoint is loaded means a port in use stops the command in its first
    second, and the "serving" line is printed only for an address that is ours.

    Raises:
        BindError: the port is in use or not allowed (naming ``--port``), or the host is not an
            address of this machine (naming ``--host``).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family=family, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        why = exc.strerror or str(exc)
        if exc.errno == errno.EADDRINUSE:
            raise BindError(
                f"--port={port}: {host}:{port} is already in use ({why}; another server listens there); "
                "stop it or give a free --port"
            ) from None
        if exc.errno == errno.EACCES:
            raise BindError(
                f"--port={port}: binding {host}:{port} is not permitted ({why}); give a port >= 1024"
            ) from None
        raise BindError(
            f"--host={host!r}: cannot bind {host}:{port} ({why}); give an address of this machine"
        ) from None
    sock.set_inheritable(True)
    return sock


def build_server(args: argparse.Namespace, model_dir: Path, template_kwargs: dict | None = None):
    """The FastAPI app serving ``model_dir`` and its ``ServedModel``: tokenizer, limits, backend,
    engine runner. template_kwargs: the default chat-template kwargs (:func:`default_template_kwargs`;
    None = parsed from ``args``).

    Raises:
        ValueError: a bad flag value, or an unusable checkpoint file (``CheckpointError``, named).
        FileNotFoundError: a checkpoint without weight files.
    """
    from .app import build_app

    served = build_served(
        model_dir,
        args.served_model_name or args.model,
        args.max_model_len,
        (
            default_template_kwargs(args.default_chat_template_kwargs, model_dir=model_dir)
            if template_kwargs is None
            else template_kwargs
        ),
    )
    backend: GenerationBackend = build_backend(
        args, model_dir, served.stop_token_ids, served.max_model_len, served.decode
    )
    return build_app(served, EngineRunner(backend), args.api_key), served


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _not_cancelled(record: logging.LogRecord) -> bool:
    """Log filter: False for a record of a task cancelled (a request a forced exit or the shutdown
    timeout cut off), and for uvicorn's own line on that timeout (the server says it in its own)."""
    if isinstance(record.msg, str) and record.msg.startswith("Cancel %s running task(s)"):
        return False
    return not (record.exc_info and isinstance(record.exc_info[1], asyncio.CancelledError))


class GracefulServer(uvicorn.Server):
    """uvicorn's server, saying why it stops: the first SIGINT / SIGTERM (``stop_signal``) is
    named in one line on stderr as the graceful shutdown begins (no new connections, requests in
    flight finish, a second Ctrl-C cuts that short; then the app's shutdown stops the engine, after
    a second Ctrl-C too).

    ``on_stop`` (the app's ``Controller.stop``) is awaited first: it ends the requests that would
    never finish (held at a paused server's gate, frozen by ``/pause`` mode keep), which the wait
    for requests in flight would otherwise wait on forever; the line says how many it ended.

    The wait for requests in flight lasts at most ``config.timeout_graceful_shutdown`` seconds
    (``--graceful-shutdown-timeout``; a client can hold a request open forever: headers sent and
    never the body, a stream never read): then uvicorn cancels the requests left, one more line
    counts them, and the app's shutdown stops the engine."""

    def __init__(self, config: uvicorn.Config, on_stop: Callable[[], Awaitable[int]] | None = None):
        super().__init__(config)
        self.stop_signal: int | None = None
        self.on_stop = on_stop
        self.timed_out = False  # the shutdown timeout cut the requests left off (and said so)

    def handle_exit(self, sig: int, frame) -> None:
        if self.stop_signal is None:
            self.stop_signal = sig
        super().handle_exit(sig, frame)

    async def _wait_tasks_to_complete(self) -> None:
        """uvicorn's wait for the requests in flight, which it runs under its
        ``timeout_graceful_shutdown`` and cancels when that runs out (then it cancels the requests
        left and goes on to the app's shutdown): here that cancellation also says how many."""
        try:
            await super()._wait_tasks_to_complete()
        except asyncio.CancelledError:
            timeout = self.config.timeout_graceful_shutdown
            if timeout is not None and not self.force_exit:
                self.timed_out = True
                logging.getLogger("uvicorn.error").addFilter(_not_cancelled)  # the cut requests' CancelledError
                cut = len(self.server_state.tasks)
                print(
                    f"m3-rollout server: --graceful-shutdown-timeout {timeout:g} s passed, {cut} request(s) in "
                    "flight cut off",
                    file=sys.stderr,
                    flush=True,
                )
            raise

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        ended = await self.on_stop() if self.on_stop is not None else 0
        if self.stop_signal is not None:
            name = signal.Signals(self.stop_signal).name + (" (Ctrl-C)" if self.stop_signal == signal.SIGINT else "")
            tail = f"; {ended} paused request(s) end with finish reason abort" if ended else ""
            print(
                f"m3-rollout server: {name} received, shutting down (requests in flight finish, then the engine "
                f"stops){tail}",
                file=sys.stderr,
                flush=True,
            )
        await super().shutdown(sockets=sockets)
        if not self.force_exit:
            return
        # NOTE: on a forced exit (a second Ctrl-C) uvicorn skips the app's shutdown (the engine was
        # never stopped, and the lifespan task, cancelled as the loop closed, logged a CancelledError
        # traceback), and each request still in flight, cancelled then too, logged one as an
        # "Exception in ASGI application". The second Ctrl-C cuts short the wait for requests only:
        # the engine stops, and the cut requests are counted in one line instead. After the shutdown
        # timeout (a second Ctrl-C while the engine stops) the requests left were cut off and counted
        # already, though a cancelled one may not have ended yet: this Ctrl-C cut none.
        cut = 0 if self.timed_out else len(self.server_state.tasks)
        logging.getLogger("uvicorn.error").addFilter(_not_cancelled)
        if cut:
            print(f"m3-rollout server: second Ctrl-C, {cut} request(s) in flight cut off", file=sys.stderr, flush=True)
        done = getattr(self.lifespan, "shutdown_event", None)  # LifespanOn's; lifespan "off" has none
        if done is not None and not done.is_set():
            await self.lifespan.shutdown()

    def on_stop_signal(self, sig: int, frame) -> None:
        """The handler uvicorn finds (and restores after it): a stop before uvicorn takes the
        signals over; nothing once the server is stopping, as when uvicorn raises the signal again
        after its shutdown."""
        if not self.should_exit:
            self.handle_exit(sig, frame)


def run_server(args: argparse.Namespace, app, served: ServedModel, sock: socket.socket) -> None:
    """Print the "serving" line (``sock`` is bound: the address is ours) and run uvicorn on ``sock``
    until SIGINT (Ctrl-C) or SIGTERM: either is a requested stop, a graceful shutdown with one
    line on stderr (:class:`GracefulServer`; requests still in flight after
    ``args.graceful_shutdown_timeout`` seconds are cut off, with one more line), after which this
    returns (exit status 0). ``app``: ``app.build_app``'s (its controller ends what a pause holds
    as the shutdown begins).

    NOTE: uvicorn restores the handlers it found and then raises the stop signal again; Python's
    defaults made that a KeyboardInterrupt for SIGINT, death by SIGTERM (status 143, no line) for
    SIGTERM, and nothing for a SIGINT ignored (a shell's ``&`` job). The handlers it finds here are
    the server's own (:meth:`GracefulServer.on_stop_signal`), so the raised-again signal does
    nothing, and a signal before uvicorn takes over is a graceful stop too.

    Raises:
        SystemExit(3): uvicorn could not start (its startup-failure status).
    """
    print(f"m3-rollout server: serving {served.name!r} on http://{args.host}:{args.port}", flush=True)
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=args.graceful_shutdown_timeout,  # seconds (a float works: asyncio's timeout)
    )
    server = GracefulServer(config, app.state.controller.stop)
    previous = {sig: signal.signal(sig, server.on_stop_signal) for sig in STOP_SIGNALS}
    try:
        server.run(sockets=[sock])
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if not server.started:
        raise SystemExit(3)

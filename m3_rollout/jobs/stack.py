"""The rollout side of a run, built once from the config: checkpoint, chat format, generation
backend, environment, prompts and sampling settings.

Governing idea: the GRPO loop (``m3_rollout.jobs.grpo``), ``python -m m3_rollout.dump generate`` and
the offline replay all need the same pieces built the same way (same per-step seed formula, same
backend choice, same validation settings), so a dump made without training means what one made
during training does. The cheap, config-driven pieces (prompts, environment) are built first, so a
bad data path, JSONL record, tool name or reward function is reported before a checkpoint is
built or a rollout worker started.
"""

from __future__ import annotations

import subprocess
import sys
import time
import weakref
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from m3_rollout.chat.template import ChatFormat
from m3_rollout.chat.tokenizer import load_tokenizer
from m3_rollout.config import ConfigError, MasterConfig, check_devices
from m3_rollout.engine.interface import GenerationBackend
from m3_rollout.parallel.process_group import free_port
from m3_rollout.rollout.data import PromptSource, load_jsonl
from m3_rollout.rollout.environment import Environment
from m3_rollout.rollout.group_rollout import RolloutSettings
from m3_rollout.server.client import HTTPBackend

#: Offset of the validation sampling seed from ``grpo.seed``.
VAL_SEED_OFFSET = 17


def batch_seed(cfg: MasterConfig, b: int) -> int:
    """Sampling seed of prompt batch ``b`` (the synchronous loop's step b) of a run seeded ``grpo.seed``."""
    return cfg.grpo.seed * 100_003 + b


@dataclass
class RolloutStack:
    """What one run generates with. ``settings`` has no seed; use :meth:`settings_for`."""

    model_dir: Path
    build_info: dict
    chat: ChatFormat
    max_len: int
    backend: GenerationBackend | None
    env: Environment
    source: PromptSource
    settings: RolloutSettings

    def settings_for(self, cfg: MasterConfig, b: int) -> RolloutSettings:
        """Sampling settings of prompt batch ``b``."""
        return replace(self.settings, seed=batch_seed(cfg, b))

    def validation_settings(self, cfg: MasterConfig) -> RolloutSettings:
        """Held-out evaluation: one sample per prompt at ``grpo.val_temperature`` (no top-p / top-k),
        seed ``grpo.seed + VAL_SEED_OFFSET``, the training turn and length limits."""
        g, gen = cfg.grpo, cfg.policy.generation
        return RolloutSettings(
            n=1,
            max_turns=g.max_rollout_turns,
            max_total_len=self.max_len,
            max_new_tokens=gen.max_new_tokens,
            temperature=g.val_temperature,
            seed=g.seed + VAL_SEED_OFFSET,
            logprobs_mode=gen.logprobs_mode,
        )


def build_prompt_source(cfg: MasterConfig) -> PromptSource:
    """Train / validation prompts of ``data`` (the arithmetic generator or ``data.path``).

    Raises:
        ConfigError: ``data.path`` missing or unreadable, a bad JSONL record (file:line named), or
            too few records for ``grpo.num_val_prompts``.
    """
    from m3_rollout.rollout.environments import build_task

    g, d = cfg.grpo, cfg.data
    if d.source != "jsonl":
        return PromptSource(build_task(d), g.seed, g.num_val_prompts)
    try:
        return PromptSource(None, g.seed, g.num_val_prompts, records=load_jsonl(d.path))
    except FileNotFoundError as exc:
        raise ConfigError(f"data.path={d.path!r}: {exc}; give an existing JSONL file") from None
    except (ValueError, OSError) as exc:
        raise ConfigError(f"data.path={d.path!r}: {exc}") from None


def build_env(cfg: MasterConfig) -> Environment:
    """The environment of ``env`` (``m3_rollout.rollout.environments.build_environment``).

    Raises:
        ConfigError: an unknown tool in ``env.jsonl.tools`` or a bad ``env.jsonl.reward_fn``.
    """
    from m3_rollout.rollout.environments import build_environment
    from m3_rollout.rollout.environments.jsonl_env import load_reward_fn
    from m3_rollout.rollout.environments.tools import TOOL_FACTORIES

    env = cfg.env
    if env.name == "jsonl":
        bad_tools = [t for t in env.jsonl.tools if t not in TOOL_FACTORIES]
        if bad_tools:
            raise ConfigError(
                f"invalid configuration:\n  env.jsonl.tools={list(env.jsonl.tools)!r}: "
                f"unknown {bad_tools}; choose from {sorted(TOOL_FACTORIES)}"
            )
        try:
            load_reward_fn(env.jsonl.reward_fn)
        except ValueError as exc:  # "reward_fn='x': cannot import ..."
            raise ConfigError(f"env.jsonl.{exc}") from None
    try:
        return build_environment(env)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def generation_device(cfg: MasterConfig) -> torch.device:
    """Device of the in-process engine: ``cluster.device`` (colocated with the trainer), checked
    against this machine (``m3_rollout.config.check_devices``).

    Raises:
        ConfigError: CUDA asked for where there is none, or a device index / GPU count past what exists.
    """
    check_devices(cfg, torch.cuda.is_available(), torch.cuda.device_count())
    return torch.device(cfg.cluster.device)


#: Seconds a job-started server waits for requests in flight once the job stops it (its
#: ``--graceful-shutdown-timeout``), and seconds the job waits for it to exit before SIGKILL: the
#: difference is the engine's stop (EP workers included), which a SIGKILL would skip.
SERVER_SHUTDOWN_TIMEOUT_S = 10.0
SERVER_STOP_GRACE_S = 30.0


def server_command(cfg: MasterConfig, model_dir: Path, max_len: int, port: int) -> list[str]:
    """argv of the rollout server a ``policy.generation.backend=http`` job starts for ``model_dir``
    (``http_base_url`` null): ``python -m m3_rollout.serve`` on 127.0.0.1:``port`` with the
    generation dtype, device, context limit and engine settings the in-process engine would get,
    and a shutdown bounded well inside the job's SIGKILL grace (:data:`SERVER_SHUTDOWN_TIMEOUT_S`)."""
    gen = cfg.policy.generation
    cmd = [sys.executable, "-m", "m3_rollout.serve", "--model", str(model_dir), "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "--dtype", gen.dtype, "--device", cfg.cluster.device]
    cmd += ["--max-model-len", str(max_len), "--max-num-seqs", str(gen.max_num_seqs)]
    cmd += ["--max-num-batched-tokens", str(gen.max_num_batched_tokens)]
    cmd += ["--kv-cache-memory-gb", str(gen.kv_cache_memory_gb)]
    cmd += ["--kv-cache-memory-fraction", str(gen.kv_cache_memory_fraction)]
    if gen.msa_prefill_scratch_mb is not None:
        cmd += ["--msa-prefill-scratch-mb", str(gen.msa_prefill_scratch_mb)]
    cmd += ["--index-cache-dtype", gen.index_cache_dtype]
    if gen.quantize_index_queries:
        cmd.append("--quantize-index-queries")
    cmd += ["--async-scheduling", {None: "auto", True: "on", False: "off"}[gen.async_scheduling]]
    if not gen.enable_prefix_caching:
        cmd.append("--no-prefix-caching")
    if gen.enable_cuda_graphs:
        cmd.append("--enable-cuda-graphs")
    if cfg.policy.routing_replay:
        cmd.append("--record-routing")
    if gen.record_block_selection:
        cmd.append("--record-block-selection")
    if gen.batch_invariant:
        cmd.append("--batch-invariant")
    cmd += ["--invariant-sparse-attention", gen.invariant_sparse_attention]  # the trainer's scorer's choice too
    if gen.http_api_key:
        cmd += ["--api-key", gen.http_api_key]
    cmd += ["--graceful-shutdown-timeout", str(SERVER_SHUTDOWN_TIMEOUT_S)]
    return cmd


def _stop_process(proc: subprocess.Popen, grace_s: float = SERVER_STOP_GRACE_S) -> None:
    """SIGTERM (uvicorn shuts the engine down), then SIGKILL after ``grace_s``."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class ServerProcess:
    """A rollout server subprocess the job owns: started by :meth:`start`, stopped by :meth:`stop`
    (also when this object is collected or the interpreter exits, so an error path cannot leave
    it running)."""

    def __init__(self, cmd: list[str], log_path: Path):
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_path = log_path
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self._finalizer = weakref.finalize(self, _stop_process, self.proc)

    def log_tail(self, n_chars: int = 2000) -> str:
        return self.log_path.read_text(errors="replace")[-n_chars:]

    def wait_healthy(self, base_url: str, api_key: str | None, timeout_s: float) -> None:
        """Poll ``/health`` until it answers 200.

        Raises:
            RuntimeError: the process exited, or no healthy answer within ``timeout_s`` (the
                process is stopped); both quote the end of the server's log.
        """
        import httpx

        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"the rollout server exited with status {self.proc.returncode} before it was healthy; "
                    f"end of {self.log_path}:\n{self.log_tail()}"
                )
            try:
                if httpx.get(f"{base_url}/health", headers=headers, timeout=5.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(
                    f"the rollout server at {base_url} was not healthy within "
                    f"policy.generation.http_startup_timeout_s={timeout_s}; end of {self.log_path}:\n{self.log_tail()}"
                )
            time.sleep(0.5)

    def stop(self) -> None:
        self._finalizer()


class OwnedServerBackend(HTTPBackend):
    """An :class:`HTTPBackend` whose server this job started: ``shutdown`` also stops the server."""

    def __init__(self, server: ServerProcess, base_url: str, **kwargs):
        super().__init__(base_url, **kwargs)
        self.server = server

    def shutdown(self) -> None:
        try:
            super().shutdown()
        finally:
            self.server.stop()


def build_http_backend(cfg: MasterConfig, model_dir: Path, max_len: int) -> HTTPBackend:
    """The ``policy.generation.backend=http`` backend: a client of ``http_base_url``, or of a
    server started here for ``model_dir`` (:func:`server_command`, its log in
    ``logger.log_dir/rollout_server.log``) once its ``/health`` answers.

    Weight updates cast to ``policy.generation.dtype`` on the wire (router >= fp32, as the
    in-process refit copies), over ``weight_sync.backend`` (auto: NCCL when ``cluster.device`` is
    CUDA, else gloo); the first ``update_weights`` hosts the group here and has the server join.

    Raises:
        RuntimeError: a job-started server that exits or is not healthy within
            ``policy.generation.http_startup_timeout_s`` (it is stopped; its log tail is quoted).
    """
    gen, ws = cfg.policy.generation, cfg.weight_sync
    sync_backend = ws.backend if ws.backend != "auto" else ("nccl" if cfg.cluster.device.startswith("cuda") else "gloo")
    kwargs = dict(
        api_key=gen.http_api_key,
        max_concurrency=gen.max_num_seqs,
        return_routed_experts=cfg.policy.routing_replay,
        return_block_selection=gen.record_block_selection,
        weight_sync_backend=sync_backend,
        generation_dtype=getattr(torch, gen.dtype),
        bucket_size_mb=ws.bucket_size_mb,
        weight_sync_timeout_s=ws.timeout_s,
    )
    if gen.http_base_url is not None:
        return HTTPBackend(gen.http_base_url, **kwargs)
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    server = ServerProcess(
        server_command(cfg, model_dir, max_len, port), Path(cfg.logger.log_dir) / "rollout_server.log"
    )
    try:
        server.wait_healthy(base_url, gen.http_api_key, gen.http_startup_timeout_s)
    except BaseException:
        server.stop()
        raise
    return OwnedServerBackend(server, base_url, **kwargs)


def build_generation_backend(cfg: MasterConfig, model_dir: Path, chat: ChatFormat, max_len: int) -> GenerationBackend:
    """The generation backend of ``cfg`` for the checkpoint in ``model_dir``.

    ``policy.generation.backend=http``: :func:`build_http_backend` (a rollout server). Otherwise
    the EP rollout service when ``policy.generation.expert_parallel_size > 1`` or a launcher is
    configured (``m3_rollout/service``); with ``policy.generation.colocated_placement=
    worker_process`` that service is one rollout worker process on ``cluster.device`` beside the
    trainer (EP=P > 1: P workers, rank r on cuda:r with the trainer on one of those GPUs, or all on
    the CPU), refit through the trainer's CUDA IPC stage (shared memory on CPU), its sleep / wake-up
    and restarts (``cluster.max_restarts``) handled by the service; else the in-process native
    engine on ``cluster.device`` in ``policy.generation.dtype`` (router in fp32, spec §6; on CUDA
    with the fused-layer weights packed, ``M3ForCausalLM.pack_fused_weights``; CUDA graphs and
    async scheduling per ``policy.generation``). On CUDA the engine (in either placement) sizes
    its KV pool from the memory free at this call (``policy.generation.kv_cache_memory_fraction``),
    so a colocated job builds its trainer first.

    Raises:
        ConfigError: an ``expert_parallel_size`` that does not divide the model's experts, or a
            device this machine lacks; ValueError from the engine / service on bad engine settings;
            RuntimeError from :func:`build_http_backend` when a job-started server does not come up.
    """
    from m3_rollout.engine.native_backend import NativeBackend
    from m3_rollout.model import load_checkpoint
    from m3_rollout.model.configuration import M3Config
    from m3_rollout.parallel.expert_sharding import expert_range
    from m3_rollout.service.factory import attach_local_weight_sync, build_rollout_service

    p, gen = cfg.policy, cfg.policy.generation
    device = generation_device(cfg)
    try:  # the EP split of the experts, checked before any worker starts
        expert_range(M3Config.from_pretrained(str(model_dir)).num_local_experts, gen.expert_parallel_size, 0)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if gen.backend == "http":
        return build_http_backend(cfg, model_dir, max_len)
    backend = build_rollout_service(cfg, model_dir, chat.stop_token_ids, max_len)
    if backend is not None:
        return backend
    # Cast on load (router gate and bias read from the file in fp32): casting a loaded fp32 model
    # would round them through the generation dtype, and the frozen bias is never refit.
    model = load_checkpoint(model_dir, dtype=getattr(torch, gen.dtype), device=device)
    if model.lm_head.weight.is_cuda:
        model.pack_fused_weights()
    backend = NativeBackend(
        model,
        chat.stop_token_ids,
        max_model_len=max_len,
        max_num_seqs=gen.max_num_seqs,
        detokenize=chat.decode,
        record_routing=p.routing_replay,
        **gen.engine_kwargs(),
    )
    attach_local_weight_sync(backend, cfg.weight_sync, p.freeze)
    return backend


def build_rollout_stack(cfg: MasterConfig, with_backend: bool = True, model_name: str | None = None) -> RolloutStack:
    """Resolve the checkpoint and build the rollout pieces of ``cfg``.

    The backend is :func:`build_generation_backend`'s; with ``with_backend=False`` none is built
    (replay / inspection, or a colocated job that builds its trainer first and then sets
    ``RolloutStack.backend``). ``model_name`` overrides ``policy.model_name``.

    Raises:
        ConfigError: bad data, environment, device or checkpoint settings (see
            ``build_prompt_source``, ``build_env``, ``generation_device``; a ``policy.model_name``
            that is not a checkpoint; an ``policy.generation.expert_parallel_size`` that does not
            divide the model's experts); ValueError from the engine / service on bad engine settings.
    """
    from m3_rollout.jobs.builtin import check_model_name, resolve_model
    from m3_rollout.model.configuration import M3Config

    p, gen = cfg.policy, cfg.policy.generation
    name = model_name or p.model_name
    try:
        check_model_name(name)
    except (FileNotFoundError, ValueError) as exc:
        raise ConfigError(f"policy.model_name={name!r}: {exc}" if model_name is None else str(exc)) from None
    if with_backend:
        generation_device(cfg)  # before a checkpoint is built
    source = build_prompt_source(cfg)
    env = build_env(cfg)
    try:
        model_dir, info = resolve_model(name, progress=cfg.logger.progress_bar)
        chat = ChatFormat(load_tokenizer(model_dir), thinking_mode=p.thinking_mode)
        model_cfg = M3Config.from_pretrained(str(model_dir))
        max_len = min(p.max_total_sequence_length, model_cfg.max_position_embeddings)
        backend = build_generation_backend(cfg, Path(model_dir), chat, max_len) if with_backend else None
    except BaseException:
        env.close()
        raise
    settings = RolloutSettings(
        n=cfg.grpo.num_generations_per_prompt,
        max_turns=cfg.grpo.max_rollout_turns,
        max_total_len=max_len,
        max_new_tokens=gen.max_new_tokens,
        temperature=gen.temperature,
        top_p=gen.top_p,
        top_k=gen.top_k,
        logprobs_mode=gen.logprobs_mode,
        mask_truncated_turns=cfg.env.mask_truncated_turns,
        truncated_turn_reward=cfg.env.truncated_turn_reward,
    )
    return RolloutStack(Path(model_dir), info, chat, max_len, backend, env, source, settings)

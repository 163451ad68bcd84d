"""NeMo RL's generation interface over this project's engine, without importing nemo_rl.

Governing idea: NeMo RL's GRPO loop talks to its generator in batched, right-padded tensors and
drives the generator's memory and weights through a few calls (``GenerationInterface`` in
``nemo_rl/models/generation/interfaces.py``). :class:`NemoRLGeneration` has those methods and
turns each into the ``GenerationBackend`` contract (design.md §3): one token-in request per row,
the engine's sleep / wake-up (``m3_rollout/engine/sleep.py``) for the colocated memory handoff,
and the weight receiver (``m3_rollout/weight_sync``) for refits. nemo_rl is not imported (its
published package is a placeholder); a ``BatchedDataDict`` passed in comes back as one, since the
output container is built with the input's type from a plain dict.

Data (NeMo RL's ``GenerationDatumSpec`` in, ``GenerationOutputSpec`` out), for B rows:
  in   input_ids             int [B, S], row i's L_i prompt tokens, then the pad id
       input_lengths         int [B] (L_i)
       stop_strings          optional, per row: a list of strings or None (added to the config's)
  out  output_ids            [B, S + G_max] (input_ids' dtype): the prompt INCLUDED, then row i's G_i
                             generated tokens at L_i .. L_i + G_i - 1, then the pad id
       logprobs              float32, same shape: 0 at prompt and pad positions, generated token j's
                             logprob at L_i + j: in the distribution sampled from (temperature,
                             top-k, top-p: "processed", the default), or the model's own
                             log-softmax (``vllm_cfg.logprobs_mode: raw_logprobs``, and any
                             ``greedy`` row: vLLM's temperature 0, not 0 after a top-1 filter)
       generation_lengths    int64 [B] (G_i)
       unpadded_sequence_lengths  int64 [B] (L_i + G_i)
       truncated             bool [B]: stopped by the token limit (finish_reason "length")
  ``generate_async`` yields (row index, one-row dict of width L_i + G_i) as each row finishes.
  A row with no room under the engine's ``max_model_len`` (L_i >= it) is not run: G_i = 0 and
  ``truncated`` False, as NeMo RL's vLLM worker answers it; a longer row ends at the limit with
  ``truncated`` True.

GRPO call order (colocated, as NeMo RL's ``grpo.py`` drives it; ``tests/test_nemo_rl_adapter.py``):
  prepare_for_generation -> generate -> finish_generation (the engine sleeps, the trainer trains)
  -> prepare_for_generation (wake-up) -> update_weights_via_ipc (or update_weights_from_collective)
  -> invalidate_kv_cache -> generate with the new weights.

Refit names: the trainer may name tensors as its in-memory model does (transformers' text / VL
names, or this project's stacked ``experts.w13`` / ``experts.w2``) or by the released names;
``ReleasedNaming`` (over ``m3_rollout.model.loading.released_pairs``) maps each to released-name
views, here for the in-process refit and on each trainer rank for the collective one.
"""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import AsyncIterator, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from m3_rollout.engine.interface import FINISH_ERROR, GenerationBackend, GenerationRequest, SampleOutput, SamplingParams
from m3_rollout.engine.native_backend import NativeBackend
from m3_rollout.model import M3Config, M3ForCausalLM
from m3_rollout.model.loading import RELEASED_PREFIX, iter_released_tensors, released_pairs
from m3_rollout.service import RolloutService
from m3_rollout.weight_sync import RolloutWeightSync, WeightSyncGroup


class ReleasedNaming:
    """The trainer's tensors, in any naming of the module docstring, as the released-name views the
    weight receiver takes, in the served model's order; the one place both refit paths map names.

    ``NemoRLGeneration`` uses it for ``prepare_refit_info`` / ``update_weights_via_ipc``; a trainer
    rank feeding the collective refit wraps its tensors with it, so the ``WeightSender`` on every
    trainer rank sends released names whatever its model calls them::

        naming = ReleasedNaming(model_config)
        sender = WeightSender(lambda: naming(policy.model.named_parameters()), BroadcastChannel(group))

    Args:
        model: the served model's ``M3Config`` (shapes only: a meta-device copy is built once) or an
            ``M3ForCausalLM`` holding every expert.

    ``__call__(items)`` takes (name, tensor) pairs (meta tensors for shape checks) and returns
    [(``language_model.``-prefixed released name, view)] covering the model exactly once. Raises
    ValueError listing unknown, missing, duplicated and mis-shaped tensors.
    """

    def __init__(self, model: M3Config | M3ForCausalLM):
        if isinstance(model, M3Config):
            with torch.device("meta"):  # shapes only: no memory
                model = M3ForCausalLM(model)
        self.model = model
        self.want = {n: tuple(t.shape) for n, t in iter_released_tensors(model, prefix="")}

    def __call__(self, items: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        try:
            pairs = list(released_pairs(self.model, ((n, t.detach()) for n, t in items)))
        except (KeyError, ValueError) as exc:
            raise ValueError(f"refit tensors do not match the served model: {exc.args[0]}") from None
        count = Counter(n for n, _ in pairs)
        problems = [f"missing {n}" for n in self.want if n not in count]
        problems += [f"given {count[n]} times: {n}" for n in count if count[n] > 1]
        problems += [
            f"{n}: shape {tuple(t.shape)} != {self.want[n]}" for n, t in pairs if tuple(t.shape) != self.want[n]
        ]
        if problems:
            raise ValueError(
                f"refit tensors do not match the served model ({len(problems)} problems):\n  "
                + "\n  ".join(problems[:20])
            )
        by_name = dict(pairs)
        return [(RELEASED_PREFIX + n, by_name[n]) for n in self.want]


#: NeMo RL's ``policy.generation.vllm_cfg.logprobs_mode`` (vLLM's engine argument; NeMo RL's
#: ``VllmSpecificArgs`` takes these two) -> ``SamplingParams.logprobs_mode``. vLLM's
#: "raw_logits" / "processed_logits" return logits, not the logprobs NeMo RL's
#: ``GenerationOutputSpec`` holds, and are refused.
LOGPROBS_MODES = {"processed_logprobs": "processed", "raw_logprobs": "raw"}


def logprobs_mode_of(config: Mapping) -> str:
    """The ``SamplingParams.logprobs_mode`` of NeMo RL's ``policy.generation`` dict: its
    ``vllm_cfg.logprobs_mode`` as :data:`LOGPROBS_MODES` maps it; "processed" (the distribution
    sampled from, what the trainer scores at the generation temperature) when absent or null.
    NOTE: vLLM's own default is "raw_logprobs"; give it to get vLLM's numbers at temperature != 1
    or with top-k / top-p.

    Raises:
        ValueError: any other value, naming the key and the accepted values.
    """
    mode = (config.get("vllm_cfg") or {}).get("logprobs_mode")
    if mode is None:
        return "processed"
    if not isinstance(mode, str) or mode not in LOGPROBS_MODES:
        why = " (logits, not the logprobs this adapter returns)" if mode in ("raw_logits", "processed_logits") else ""
        raise ValueError(
            f"NemoRLGeneration: policy.generation.vllm_cfg.logprobs_mode={mode!r}{why}: must be one of "
            f"{sorted(LOGPROBS_MODES)} (or absent: processed_logprobs)"
        )
    return LOGPROBS_MODES[mode]


#: NeMo RL ``policy.generation`` keys the adapter reads (``NemoRLGeneration``, ``logprobs_mode_of``).
READ_KEYS = (
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "_pad_token_id",
    "stop_token_ids",
    "stop_strings",
    "colocated.enabled",
    "vllm_cfg.logprobs_mode",
)

#: Keys (and sections) that only set up NeMo RL's own vLLM process, its refit transport or its
#: bookkeeping: whatever they hold, the generated tokens and logprobs are the same here, so they pass
#: without a word (token ids in and out: no tokenizer; the backend holds its weights and is refit
#: through this adapter, not NeMo RL's transport; ``generate_async`` works either way; a row ends at
#: the context limit as ``cap_max_tokens_to_context`` asks). NeMo RL's grpo_math_1B sets most of them.
QUIET_KEYS = (
    "backend",
    "model_name",
    "pad_token_id",
    "_debug_payload_metrics",
    "port_range_low",
    "port_range_high",
    "use_async_rollouts",
    "refit_transport",
    "refit_cfg",
    "real_quant_export_cpu_offload",
    "colocated.resources",
    "vllm_cfg.async_engine",
    "vllm_cfg.skip_tokenizer_init",
    "vllm_cfg.load_format",
    "vllm_cfg.use_tqdm",
    "vllm_cfg.cap_max_tokens_to_context",
    "vllm_cfg.enable_vllm_metrics_logger",
    "vllm_cfg.vllm_metrics_logger_interval",
    "vllm_cfg.distributed_executor_backend",
    "vllm_cfg.env_vars",
    "vllm_cfg.http_refit_api_key_env_var",
    "vllm_cfg.http_refit_server_port",
    "vllm_cfg.zmq_refit_server_port",
)

#: Sections that configure one of NeMo RL's other generation backends (``backend`` names the one that
#: runs): quiet unless ``backend`` names theirs (grpo_math_1B carries ``mcore_generation_config``
#: under ``backend: vllm``).
BACKEND_SECTIONS = {
    "mcore_generation_config": "megatron",
    "sglang_cfg": "sglang",
    "trtllm_cfg": "trtllm",
    "trtllm_kwargs": "trtllm",
    "dynamo_cfg": "dynamo",
}

#: NeMo RL's validation-only sampling keys and the training keys they default to (``${.temperature}``).
VALIDATION_KEYS = {"val_temperature": "temperature", "val_top_p": "top_p", "val_top_k": "top_k"}


def _served(backend: GenerationBackend) -> tuple[int | None, torch.dtype | None, int | None]:
    """(context limit, served dtype, expert-parallel size) of ``backend``; None where not known."""
    if isinstance(backend, NativeBackend):
        return backend.engine.config.max_model_len, backend.model.model.embed_tokens.weight.dtype, 1
    if isinstance(backend, RolloutService):
        dtype = getattr(torch, backend.spec.dtype, None)
        return _context_limit(backend), dtype if isinstance(dtype, torch.dtype) else None, backend.world_size
    return None, None, None


def _judge(key: str, value, served: tuple) -> tuple[str, str] | None:
    """What becomes of NeMo RL's ``policy.generation.<key>`` = ``value`` that the adapter does not
    read, on a backend ``served`` (``_served``): None (it changes nothing here), ("warn", what
    happens instead) or ("refuse", why and what to do)."""
    limit, dtype, ep = served
    if key == "vllm_cfg.max_model_len":
        if limit is None:
            return "warn", "the backend's own context limit applies"
        if value != limit:
            return "refuse", (
                f"the backend's max_model_len is {limit}, so rows would end at {limit} tokens, not {value}: "
                f"build the backend with max_model_len={value} (or set this key to {limit})"
            )
        return None
    if key in ("vllm_cfg.tensor_parallel_size", "vllm_cfg.pipeline_parallel_size"):
        return None if value == 1 else ("warn", "the backend holds the whole model (EP shards only the experts)")
    if key == "vllm_cfg.expert_parallel_size":
        return None if value == ep else ("warn", f"the backend's expert-parallel size ({ep or 'its own'}) applies")
    if key == "vllm_cfg.precision":
        if dtype is not None and getattr(torch, str(value), None) == dtype:
            return None
        return "warn", f"the backend serves its model in {dtype or 'the dtype it was built with'}"
    if key == "vllm_cfg.gpu_memory_utilization":
        return "warn", (
            "the KV cache was sized when the backend was built (EngineConfig kv_cache_memory_fraction, of the "
            "memory free after the weights load, or kv_cache_memory_gb)"
        )
    if key == "vllm_cfg.enforce_eager":
        return None if value is False else ("warn", "CUDA graphs are the backend's EngineConfig.enable_cuda_graphs")
    if key == "vllm_cfg.kv_cache_dtype":
        return None if value == "auto" else ("warn", "the KV cache is held in the served model's dtype")
    if key == "vllm_cfg.enable_return_routed_experts":
        return None if not value else ("refuse", "this adapter returns no routed experts in its output: set it false")
    if key == "vllm_kwargs":
        return None if not value else ("warn", "vLLM's engine arguments; the backend's EngineConfig applies")
    if value is None or value is False or value == 0 or value == "" or value == {} or value == []:
        return None  # an optional feature left off (NeMo RL's defaults)
    return "warn", "this adapter does not read it"


def check_unread_keys(config: Mapping, backend: GenerationBackend) -> None:
    """Say what becomes of the keys of NeMo RL's ``policy.generation`` dict the adapter does not
    read (:data:`READ_KEYS`): one ``UserWarning`` per key that is ignored although it would change
    vLLM's generation (naming the key and what happens instead); quiet for :data:`QUIET_KEYS`, the
    sections of backends ``backend`` does not name (:data:`BACKEND_SECTIONS`), validation sampling
    equal to training's (:data:`VALIDATION_KEYS`) and values this backend matches anyway (NeMo RL's
    defaults: tensor_parallel_size 1, ...).

    Raises:
        ValueError: a key whose value this backend cannot honour and that changes the output
            (``vllm_cfg.max_model_len`` other than the backend's limit,
            ``vllm_cfg.enable_return_routed_experts``), naming the key and what to do.
    """
    served = _served(backend)
    other_backends = [k for k, name in BACKEND_SECTIONS.items() if config.get("backend") != name]
    for key, value in _flat_keys(config):
        if key in READ_KEYS or any(key == q or key.startswith(q + ".") for q in (*QUIET_KEYS, *other_backends)):
            continue
        if key in VALIDATION_KEYS:  # quiet at NeMo RL's default: the training value
            train = VALIDATION_KEYS[key]
            if value == config.get(train):
                continue
            verdict = "warn", f"validation rows are sampled as every row is, with {train}={config.get(train)!r}"
        else:
            verdict = _judge(key, value, served)
        if verdict is None:
            continue
        kind, text = verdict
        if kind == "refuse":
            raise ValueError(f"NemoRLGeneration: policy.generation.{key}={value!r}: {text}")
        warnings.warn(f"NemoRLGeneration: policy.generation.{key}={value!r} is ignored: {text}", stacklevel=3)


def _flat_keys(config: Mapping, prefix: str = "") -> list[tuple[str, object]]:
    """(dotted key, value) of every leaf of ``config``; ``vllm_kwargs`` is one leaf (vLLM's own)."""
    out = []
    for k, v in config.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping) and v and key != "vllm_kwargs":
            out += _flat_keys(v, key + ".")
        else:
            out.append((key, v))
    return out


class NemoRLGeneration:
    """NeMo RL's ``GenerationInterface`` methods over a ``GenerationBackend``.

    Args:
        backend: the generator; a ``NativeBackend`` (the in-process engine, with its
            ``LocalWeightSync`` attached) supports every method, other backends all but the
            collective refit (``init_collective``).
        config: NeMo RL's ``policy.generation`` dict: ``max_new_tokens``, ``temperature``,
            ``top_p``, ``top_k`` (None = off) and ``_pad_token_id`` are read; ``stop_token_ids``,
            ``stop_strings``, ``colocated.enabled`` (default True) and ``vllm_cfg.logprobs_mode``
            (:func:`logprobs_mode_of`: the sampled rows' logprobs) when present. Every other key
            is checked by :func:`check_unread_keys`: a warning when it is ignored, a refusal when
            its value cannot be honoured and changes the output.
        model_config: the served model's ``M3Config`` (its shapes check refit names, through a
            meta-device copy); default: the ``NativeBackend``'s model itself.
        sleep_level: what ``finish_generation`` releases when colocated: 1 = the KV cache, 2 =
            also the weights (to host memory). NOTE: vLLM's level 1 offloads weights too.
        seed: base of the sampling seed; call k of ``generate`` / ``generate_async`` samples with
            seed + k and row i with sample index i, so calls and rows draw different tokens.

    Raises:
        ValueError: a config key is missing, a sampling value is out of range,
            ``vllm_cfg.logprobs_mode`` is not one of :data:`LOGPROBS_MODES`, or an unread key
            cannot be honoured (:func:`check_unread_keys`; each named).
    """

    def __init__(
        self,
        backend: GenerationBackend,
        config: Mapping,
        model_config: M3Config | None = None,
        sleep_level: int = 1,
        seed: int = 0,
    ):
        missing = [k for k in ("max_new_tokens", "temperature", "top_p", "top_k", "_pad_token_id") if k not in config]
        if missing:
            raise ValueError(f"NemoRLGeneration: the generation config lacks {missing} (NeMo RL's policy.generation)")
        if sleep_level not in (1, 2):
            raise ValueError(f"NemoRLGeneration: sleep_level={sleep_level!r}: must be 1 or 2")
        self.backend = backend
        self.pad_id = int(config["_pad_token_id"])
        self.params = SamplingParams(
            temperature=config["temperature"],
            top_p=config["top_p"],
            top_k=-1 if config["top_k"] is None else config["top_k"],
            max_new_tokens=config["max_new_tokens"],
            stop_token_ids=tuple(config.get("stop_token_ids") or ()),
            stop_strings=tuple(config.get("stop_strings") or ()),
            logprobs_mode=logprobs_mode_of(config),
        )
        self.params.validate()  # checked here; kept as given (temperature 0 stays greedy for every row)
        self.colocated = bool(config.get("colocated", {}).get("enabled", True))
        check_unread_keys(config, backend)
        self.sleep_level, self.seed = sleep_level, seed
        if model_config is None and not isinstance(backend, NativeBackend):
            raise ValueError(f"NemoRLGeneration: pass model_config for a {type(backend).__name__}")
        # the served model itself when in process (all experts: one engine), else a meta-device copy
        self._naming = ReleasedNaming(backend.model if model_config is None else model_config)
        self.max_model_len = _context_limit(backend)
        self._calls = 0
        self._asleep = False
        self._refit_names: set[str] | None = None
        self._collective: RolloutWeightSync | None = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nemo-rl-refit")
        self._logger_metrics: dict[str, float] = {}

    # ---- generation -------------------------------------------------------------------------
    def _requests(self, data: Mapping, greedy: bool) -> tuple[torch.Tensor, list[int], list[GenerationRequest | None]]:
        """Check a ``GenerationDatumSpec`` batch; one n=1 request per row, None for a row with no
        room under ``max_model_len`` (it is not run: nothing to generate)."""
        ids, lengths = data["input_ids"], data["input_lengths"]
        if ids.ndim != 2 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
            raise ValueError(f"input_ids: must be an integer tensor [B, S], got {ids.dtype} {tuple(ids.shape)}")
        lens = [int(x) for x in torch.as_tensor(lengths).reshape(-1).tolist()]  # a tensor or a plain list
        if len(lens) != ids.shape[0]:
            raise ValueError(f"input_lengths has {len(lens)} entries for {ids.shape[0]} rows of input_ids")
        for i, n in enumerate(lens):
            if not 1 <= n <= ids.shape[1]:
                raise ValueError(f"input_lengths[{i}]={n}: must be in [1, {ids.shape[1]}] (the padded width)")
            if bool((ids[i, n:] != self.pad_id).any()):
                raise ValueError(
                    f"input_ids row {i} is not right-padded with the pad id {self.pad_id} after its "
                    f"{n} tokens (NeMo RL's GenerationDatumSpec: right padding)"
                )
        stops = data.get("stop_strings") or [None] * len(lens)
        if len(stops) != len(lens):
            raise ValueError(f"stop_strings has {len(stops)} entries for {len(lens)} rows of input_ids (one per row)")
        stops = [(s,) if isinstance(s, str) else s for s in stops]  # a row's one string, not its characters
        call, self._calls = self._calls, self._calls + 1
        reqs = []
        for i, n in enumerate(lens):
            extra = tuple(s for s in (stops[i] or ()) if s not in self.params.stop_strings)
            params = SamplingParams(
                # temperature 0: the engine's greedy (SamplingParams.validate), as NeMo RL's vLLM
                # worker asks for it: the argmax token, the model's own log-softmax as its logprob
                temperature=0.0 if greedy else self.params.temperature,
                top_p=self.params.top_p,
                top_k=self.params.top_k,
                max_new_tokens=self.params.max_new_tokens,
                stop_token_ids=self.params.stop_token_ids,
                seed=self.seed + call,
                stop_strings=self.params.stop_strings + extra,
                logprobs_mode=self.params.logprobs_mode,  # a greedy row's are "raw" whatever it says
            )
            full = self.max_model_len is not None and n >= self.max_model_len
            reqs.append(None if full else GenerationRequest(f"nemo-rl-{call}-{i}", ids[i, :n].tolist(), params, i))
        return ids, lens, reqs

    def _pack(self, container: type, ids: torch.Tensor, lens: list[int], outs: list[SampleOutput | None]) -> Mapping:
        """``GenerationOutputSpec`` of rows ``ids`` / ``lens`` and their outputs (module docstring;
        None: a row that was not run, no tokens)."""
        for o in outs:
            if o is not None and o.finish_reason == FINISH_ERROR:
                raise RuntimeError(f"generation failed for request {o.request_id}: {o.error}")
        outs = [SampleOutput("", 0, [], [], [], "not run", 0) if o is None else o for o in outs]  # not truncated
        width = ids.shape[1] + max((len(o.output_ids) for o in outs), default=0)
        out_ids = torch.full((len(outs), width), self.pad_id, dtype=ids.dtype)
        logprobs = torch.zeros((len(outs), width), dtype=torch.float32)
        for i, (n, o) in enumerate(zip(lens, outs)):
            g = len(o.output_ids)
            out_ids[i, :n] = ids[i, :n].cpu()
            out_ids[i, n : n + g] = torch.tensor(o.output_ids, dtype=ids.dtype)
            logprobs[i, n : n + g] = torch.tensor(o.logprobs, dtype=torch.float32)
        gen = torch.tensor([len(o.output_ids) for o in outs], dtype=torch.long)
        return container(
            {
                "output_ids": out_ids.to(ids.device),
                "logprobs": logprobs.to(ids.device),
                "generation_lengths": gen.to(ids.device),
                "unpadded_sequence_lengths": (torch.tensor(lens, dtype=torch.long) + gen).to(ids.device),
                "truncated": torch.tensor([o.finish_reason == "length" for o in outs], device=ids.device),
            }
        )

    def generate(self, data: Mapping, greedy: bool = False) -> Mapping:
        """Generate one continuation per row of a ``GenerationDatumSpec`` batch.

        ``greedy``: sample at temperature 0, the engine's greedy (``SamplingParams``), as NeMo RL's
        vLLM worker does: the most likely token with the model's unfiltered log-softmax as its
        logprob, as vLLM's temperature 0 returns it; the config's temperature, top-k and top-p are
        ignored, as there.
        Returns the ``GenerationOutputSpec`` (module docstring) in ``type(data)``.

        Raises:
            ValueError: a batch that is not right-padded integer ids with lengths in [1, S].
            RuntimeError: the engine failed a row (names the request and the reason).
        """
        if data["input_ids"].shape[0] == 0:
            return self._pack(type(data), data["input_ids"], [], [])
        ids, lens, reqs = self._requests(data, greedy)
        outs = iter(self.backend.generate([r for r in reqs if r is not None]))
        return self._pack(type(data), ids, lens, [None if r is None else next(outs) for r in reqs])

    async def generate_async(self, data: Mapping, greedy: bool = False) -> AsyncIterator[tuple[int, Mapping]]:
        """Yield (row index, one-row ``GenerationOutputSpec`` of width L_i + G_i) as rows finish
        (NeMo RL's per-sample streaming). Raises what :meth:`generate` raises."""
        if data["input_ids"].shape[0] == 0:
            return
        ids, lens, reqs = self._requests(data, greedy)
        for i, r in enumerate(reqs):
            if r is None:
                yield i, self._pack(type(data), ids[i : i + 1, : lens[i]], [lens[i]], [None])
        row_of = {r.request_id: i for i, r in enumerate(reqs) if r is not None}
        async for out in self.backend.generate_async([r for r in reqs if r is not None]):
            i = row_of[out.request_id]
            yield i, self._pack(type(data), ids[i : i + 1, : lens[i]], [lens[i]], [out])

    # ---- memory handoff ---------------------------------------------------------------------
    def prepare_for_generation(self, *args, **kwargs) -> bool:
        """Wake the engine if ``finish_generation`` put it to sleep (idempotent: a no-op when
        awake). NeMo RL's ``tags`` ("weights", "kv_cache") are accepted; one wake-up restores both.
        Returns True. Raises the engine's ``WakeUpError`` when out of memory."""
        if self._asleep:
            rec = self.backend.wake_up()
            self._asleep = False
            self._logger_metrics.update(wake_seconds=rec["seconds"], wake_gb_restored=rec["gb_restored"])
        return True

    def finish_generation(self, *args, release_gpu: bool = True, **kwargs) -> bool:
        """End a generation phase. Colocated and ``release_gpu``: the engine sleeps at
        ``sleep_level`` (its memory goes to the trainer); otherwise the prefix cache is reset and the
        engine keeps serving. Returns True. Raises RuntimeError when samples are unfinished."""
        if self.colocated and release_gpu:
            if not self._asleep:
                rec = self.backend.sleep(self.sleep_level)
                self._asleep = True
                self._logger_metrics.update(sleep_seconds=rec["seconds"], sleep_gb_freed=rec["gb_freed"])
        else:
            self.backend.reset_prefix_cache()
        return True

    def blocks_training(self) -> bool:
        """Whether the engine must stand down before a training step: True when colocated."""
        return self.colocated

    def wake_carries_weight_updates(self) -> bool:
        """False: waking up does not load new weights; the loop refits explicitly."""
        return False

    @property
    def requires_kv_scale_sync(self) -> bool:
        """False: no FP8 KV-cache scales to synchronise."""
        return False

    def invalidate_kv_cache(self) -> bool:
        """Drop every reusable cached prefix (computed with the old weights). Returns True."""
        self.backend.reset_prefix_cache()
        return True

    def get_logger_metrics(self) -> dict[str, float]:
        """Seconds and GiB of the last sleep / wake-up (``sleep_seconds``, ``sleep_gb_freed``,
        ``wake_seconds``, ``wake_gb_restored``) since :meth:`clear_logger_metrics`."""
        return dict(self._logger_metrics)

    def clear_logger_metrics(self) -> None:
        self._logger_metrics.clear()

    # ---- refit ------------------------------------------------------------------------------
    def prepare_refit_info(self, state_dict_info: Mapping[str, tuple]) -> None:
        """Check the trainer's tensor list once: ``{name: (shape, dtype)}`` (NeMo RL's
        ``policy.prepare_refit_info()``) in any naming of the module docstring must cover every
        tensor of the served model exactly once with its shape. Later updates must send these names.

        Raises:
            ValueError: listing the unknown, missing, duplicated and mis-shaped tensors.
        """
        metas = [(n, torch.empty(tuple(s), dtype=d, device="meta")) for n, (s, d) in state_dict_info.items()]
        self._naming(metas)
        self._refit_names = set(state_dict_info)

    def update_weights_via_ipc(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int | None = None
    ) -> bool:
        """Refit from tensors in this process (NeMo RL's ``update_weights_via_ipc_zmq`` counterpart
        for a colocated trainer): names as in :meth:`prepare_refit_info`, copied in place through
        the backend's weight receiver (``update_weights``: its checks, ``atomic``, version rule).
        ``version``: default the served version + 1. Returns True.

        Raises:
            ValueError: names differ from ``prepare_refit_info``'s, or the receiver rejected the
                update (names the tensors; nothing changed with ``weight_sync.atomic``).
            RuntimeError: the engine sleeps at level 2 (call prepare_for_generation first).
        """
        if self._asleep and self.sleep_level == 2:
            raise RuntimeError("update_weights_via_ipc: the weights are offloaded; call prepare_for_generation")
        items = list(named_tensors)
        if self._refit_names is not None:
            got = {n for n, _ in items}
            if got != self._refit_names:
                extra, lost = sorted(got - self._refit_names), sorted(self._refit_names - got)
                raise ValueError(
                    f"update_weights_via_ipc: names differ from prepare_refit_info's: "
                    f"{len(extra)} new {extra[:5]}, {len(lost)} missing {lost[:5]}"
                )
        pairs = self._naming(items)
        self.backend.update_weights(self.backend.weight_version + 1 if version is None else version, pairs)
        return True

    def init_collective(
        self,
        ip: str,
        port: int,
        world_size: int,
        *,
        train_world_size: int,
        backend: str = "gloo",
        timeout_s: float = 60.0,
        bucket_size_mb: float = 512,
    ) -> list[Future]:
        """Join the refit group the trainer's ranks and this engine form
        (``m3_rollout.weight_sync.WeightSyncGroup``), as NeMo RL's generation workers do: the
        trainer's ranks are 0 .. train_world_size - 1 (rank 0 hosts the store at ``ip:port`` and is
        the source of every tensor; every trainer rank runs ``WeightSender.update`` over a
        ``BroadcastChannel`` of its own rank), this engine the rank after them. Runs the handshake.
        Non-blocking like NeMo RL's: returns one future (True when joined) while the trainer's
        ranks build their side (``WeightSender.handshake``). ``bucket_size_mb`` must equal the
        sender's.

        Raises:
            NotImplementedError: the backend is not the in-process engine.
            ValueError: ``world_size`` != ``train_world_size`` + 1 (this engine is the one
                generation rank) or ``train_world_size`` < 1; the future raises
                WeightSyncTimeout / HandshakeError.
        """
        if not isinstance(self.backend, NativeBackend):
            raise NotImplementedError(
                f"init_collective needs the in-process engine (NativeBackend), not {type(self.backend).__name__}; "
                "EP rollout workers join the trainer's group through RolloutService(weight_sync=...)"
            )
        if train_world_size < 1 or world_size != train_world_size + 1:
            raise ValueError(
                f"init_collective(world_size={world_size}, train_world_size={train_world_size}): the refit group is "
                "the trainer's ranks (0 .. train_world_size - 1) and this engine (one generation rank): use "
                f"world_size = train_world_size + 1 with train_world_size >= 1"
            )
        engine = self.backend.engine

        def join() -> bool:
            device = engine.model.lm_head.weight.device
            rank = train_world_size  # the generation ranks follow the trainer's
            group = WeightSyncGroup(ip, port, rank, world_size, backend, timeout_s, device, train_world_size)
            sync = RolloutWeightSync(engine, group, bucket_size_mb)
            try:
                sync.handshake()
            except BaseException:
                group.close()
                raise
            self._close_collective()
            self._collective = sync
            return True

        return [self._pool.submit(join)]

    def update_weights_from_collective(self) -> list[Future]:
        """Receive one update broadcast by trainer rank 0 (``WeightSender.update`` on every trainer
        rank, called while the future runs). Returns one future: True when committed; it raises ValueError naming the
        receiver's errors when the update was rejected.

        Raises:
            RuntimeError: no group (call init_collective first), or the weights are offloaded
                (sleep level 2: call prepare_for_generation first).
        """
        if self._collective is None:
            raise RuntimeError("update_weights_from_collective: no weight-sync group; call init_collective first")
        if self._asleep and self.sleep_level == 2:
            raise RuntimeError("update_weights_from_collective: the weights are offloaded; call prepare_for_generation")
        sync = self._collective

        def receive() -> bool:
            result = sync.update().result
            if not result.ok:
                raise ValueError(f"weight update rejected (version {result.version}): {'; '.join(result.errors)}")
            return True

        return [self._pool.submit(receive)]

    def _close_collective(self) -> None:
        if self._collective is not None:
            self._collective.group.close()
            self._collective = None

    def shutdown(self) -> bool:
        """Leave the weight-sync group and shut the backend down; safe to call again. Returns True."""
        self._close_collective()
        self._pool.shutdown(wait=True)
        self.backend.shutdown()
        return True


def _context_limit(backend: GenerationBackend) -> int | None:
    """The backend's ``max_model_len`` (prompt + generated tokens), None when it has none to read."""
    if isinstance(backend, NativeBackend):
        return backend.engine.config.max_model_len
    if isinstance(backend, RolloutService):
        return backend.spec.engine.get("max_model_len")
    return None

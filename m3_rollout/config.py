"""Typed configuration for the GRPO job: YAML in NeMo RL's layout plus ``key=value`` overrides.

One governing idea: the schema below *is* the documentation of every key. YAML files and
command-line overrides are merged into it with OmegaConf's structured configs, so an unknown key
or a value of the wrong type fails at start, and ``validate`` then checks ranges and cross-key
rules. Every error names the key, the value, and what is allowed.

Layout (NeMo RL): ``grpo``, ``loss_fn``, ``policy`` (incl. ``policy.generation``), ``data``,
``env``, ``logger``, ``checkpointing``, ``cluster``.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError


class ConfigError(ValueError):
    """A configuration key is unknown, has the wrong type, or is out of range."""


@dataclass
class AsyncGRPOConfig:
    # Generation of the next steps' groups overlaps training (a background rollout thread feeding
    # a queue). A group generated with weight version v is used at a step whose policy version is
    # V only if V - v <= max_trajectory_age_steps; older groups are dropped and counted.
    enabled: bool = False
    max_trajectory_age_steps: int = 1
    # A step waits at most this long for its groups, then trains on the groups it has.
    group_timeout_s: float = 600.0


@dataclass
class GRPOConfig:
    num_prompts_per_step: int = 16
    # >= 2 (the group baseline needs other samples); policy.train_global_batch_size divides
    # num_prompts_per_step * num_generations_per_prompt.
    num_generations_per_prompt: int = 8
    # 0 = validation only: held-out accuracy at step 0 (needs val_at_start), no training, no checkpoint.
    max_num_steps: int = 60
    # Tool-use turns per trajectory: a turn is one model generation; a tool call adds a turn.
    max_rollout_turns: int = 2
    normalize_rewards: bool = True
    use_leave_one_out_baseline: bool = False
    val_period: int = 10
    val_at_start: bool = True
    val_at_end: bool = True
    num_val_prompts: int = 256
    # Held-out accuracy is measured by sampling at this temperature, one sample per prompt
    # (no top-p / top-k); 0 = greedy (the engine's argmax, vLLM's rule).
    val_temperature: float = 1.0
    seed: int = 42  # in [0, 2**40): torch / numpy seeds and the samplers' int64 seeds derive from it
    # DAPO dynamic sampling: drop groups whose rewards are all equal and draw more prompt batches,
    # at most dynamic_sampling_max_gen_batches generation batches per step. Samples that failed to
    # generate do not count: a group with fewer than two generated samples is dropped too.
    use_dynamic_sampling: bool = False
    dynamic_sampling_max_gen_batches: int = 3
    # DAPO overlong filtering: trajectories cut by a token limit get no loss (their loss_mask is
    # zeroed in the trajectory itself, so token counts and dumps show what was trained).
    overlong_filtering: bool = False
    async_grpo: AsyncGRPOConfig = field(default_factory=AsyncGRPOConfig)


@dataclass
class LossConfig:
    ratio_clip_min: float = 0.2
    ratio_clip_max: float = 0.2
    # True: loss = sum over all generated tokens / number of generated tokens in the global batch.
    token_level_loss: bool = True
    # Dual clip (for A < 0 the per-token loss is capped at c * |A|); null = off, else > 1.
    ratio_clip_c: float | None = None
    # KL(pi || pi_ref) penalty weight; 0 = off and reference logprobs are not computed.
    reference_policy_kl_penalty: float = 0.0
    reference_policy_kl_type: str = "k3"  # k1 | k2 | k3 (Schulman 2020 estimators)
    # Importance weights exp(trainer_prev_lp - generator_lp) on the per-token loss:
    # tis = truncated at truncated_importance_sampling_ratio; mis = tokens outside
    # [mis_ratio_min, mis_ratio_max] dropped.
    use_importance_sampling_correction: bool = False
    importance_sampling_type: str = "tis"
    truncated_importance_sampling_ratio: float = 2.0
    mis_ratio_min: float = 0.5
    mis_ratio_max: float = 2.0


@dataclass
class OptimizerConfig:
    name: str = "adamw"
    lr: float = 3.0e-4
    weight_decay: float = 0.01
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1.0e-8


@dataclass
class FreezeConfig:
    # The score-only indexer gets no gradient through the discrete block selection; keep it fixed.
    indexer: bool = True
    router_bias: bool = True
    # Extra regular expressions (re.search on parameter names) of tensors to keep fixed.
    patterns: list[str] = field(default_factory=list)


@dataclass
class SchedulerConfig:
    # Linear warmup over warmup_steps optimizer steps, then constant | linear | cosine decay to
    # min_lr_ratio * lr at the end of the last GRPO step. Steps count nominal optimizer steps:
    # GRPO step k trains from position k * (num_prompts_per_step * num_generations_per_prompt /
    # train_global_batch_size) whatever its row count (failed samples left out, dynamic sampling
    # or async GRPO short of groups), so a short step neither stretches warmup nor delays the end.
    name: str = "constant"
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0


@dataclass
class GenerationConfig:
    # native: the engine runs in this process (expert_parallel_size=1, cluster.launcher=auto) or in
    # rollout worker processes (EP service). http: generation goes to a rollout server's /generate
    # (m3_rollout/server, HTTPBackend) and each refit goes through the server's weight-sync group
    # (weight_sync.backend / bucket_size_mb / timeout_s apply; running requests continue on the new
    # weights). Needs expert_parallel_size=1, sleep_level=0, cluster.launcher=auto and no
    # weight_sync.probe (the server refits without them).
    backend: str = "native"
    # backend=http: the server's address, e.g. "http://127.0.0.1:8000"; it must serve this run's
    # checkpoint in `dtype` (the weight sync casts to it). null: the job starts a server itself
    # (`python -m m3_rollout.serve` on 127.0.0.1, a free port, with this section's engine settings
    # and cluster.device; log in logger.log_dir/rollout_server.log) and stops it at the end.
    http_base_url: str | None = None
    # backend=http: sent as "Authorization: Bearer KEY" (and given to a job-started server).
    http_api_key: str | None = None
    # backend=http, job-started server: seconds to wait for its /health before the job fails.
    http_startup_timeout_s: float = 300.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0 = off (vLLM's rule)
    # Tokens one turn may generate; the whole trajectory is also capped by
    # policy.max_total_sequence_length.
    max_new_tokens: int = 48
    logprobs_mode: str = "processed"
    dtype: str = "bfloat16"
    expert_parallel_size: int = 1
    max_num_seqs: int = 256
    # Native engine (m3_rollout/engine/config.py EngineConfig). Cache memory in GiB: the KV page pool
    # plus the MSA prefill scratch below (the pool gets the rest); 0 = auto (CUDA:
    # kv_cache_memory_fraction of free memory, scratch included; CPU: room for max_num_seqs full sequences).
    kv_cache_memory_gb: float = 0.0
    kv_cache_memory_fraction: float = 0.8
    # MiB bound of the sparse prefill's KV-major scratch (partial outputs of one pass of prefill tokens;
    # kernels/paged_layout.py), allocated once inside the cache memory above, on CUDA, and only when
    # max_num_batched_tokens reaches the KV-major path (16384 prefill tokens). null = passes of
    # min(16384, max_num_batched_tokens) tokens (4160 MiB at M3 shapes in bf16); a number = the longest
    # pass (a multiple of 1024 tokens) that fits (same outputs up to rounding, another speed). 0 = no
    # scratch, the KV-major path off (union-list tiles). A value below one 1024-token pass is refused.
    msa_prefill_scratch_mb: float | None = None
    # Per-step token budget (decode tokens + prefill chunks); a longer prompt is chunked.
    max_num_batched_tokens: int = 4096
    # Reuse full KV pages across requests (a GRPO group's prompt, earlier turns).
    enable_prefix_caching: bool = True
    # Capture decode steps as CUDA graphs (GPU only; ignored on CPU).
    enable_cuda_graphs: bool = False
    # Launch step N+1 before step N's sampled ids reach the host (EngineConfig.async_scheduling);
    # null = on for CUDA, off on CPU. Same tokens and logprobs either way.
    async_scheduling: bool | None = None
    # Colocated memory handoff (LLMEngine.sleep / wake_up): 0 = off; 1 = the engine frees its KV
    # cache while the trainer trains; 2 = also moves its weights to pinned host memory. Colocated
    # engines only (expert_parallel_size=1 in either colocated_placement, or the EP workers of
    # colocated_placement=worker_process: every rank sleeps), synchronous GRPO only.
    sleep_level: int = 0
    # Where the colocated engine (beside the trainer, sharing its device) runs:
    # in_process: in the trainer's process (expert_parallel_size=1, cluster.launcher=auto; refit = a
    # direct in-place copy);
    # worker_process: in rollout worker processes (cluster.launcher auto | mp | ray: the shape of one
    # rollout actor per GPU beside the trainer), refit through trainer memory shared once
    # (weight_sync/ipc.py: CUDA IPC on a GPU, shared memory on CPU; no host round trip, no NCCL),
    # their sleep / wake-up forwarded; dead workers are restarted (cluster.max_restarts) on the
    # shared source's weights. expert_parallel_size=1: one worker on cluster.device. P > 1: P EP
    # workers, each keeping its own experts: with cluster.device=cpu all on the CPU (EP group over
    # gloo; cluster.gpus_per_node=0); on CUDA rank r on cuda:r (P <= cluster.gpus_per_node, one
    # node) with the trainer on one of them (cluster.device = cuda:0 .. cuda:P-1: the trainer shares
    # a GPU with a rank; the ranks on other GPUs peer-copy from it). Needs backend=native,
    # weight_sync.method=auto (weight_sync.timeout_s bounds each wait), no
    # cluster.gpus_per_node with cluster.device=cpu, and no cluster.ray_address but null / local (Ray
    # joining a cluster could start the workers on another node) unless cluster.launcher=mp.
    colocated_placement: str = "in_process"
    # Sparse layers' index-key cache: bfloat16 (the KV dtype) or fp8_e4m3 (e4m3 codes + one fp32
    # scale per token; about half the bytes a long-context decode step reads; the block choice is
    # made on the dequantized keys, so it can differ from bfloat16's near ties: docs/benchmarks.md).
    index_cache_dtype: str = "bfloat16"
    # With index_cache_dtype=fp8_e4m3: the score kernels quantize the index queries to e4m3 too (one
    # scale per row), so the scores are fp8 x fp8 tensor-core dots: the fastest index format
    # (docs/benchmarks.md, "fp8q": the 1M decode step 1.23x faster than FP8 keys with bf16 queries on
    # an H200, 1.07x on an H100; 128K prefill scores 1.9x on an H100), with a little more selection
    # drift from bfloat16 keys (0.92-0.94 of the blocks kept vs 0.94-0.95). The trainer's
    # batch-invariant scorer uses the same format.
    quantize_index_queries: bool = False
    # Block-selection record (design.md §2.3): the engine records every sparse layer's selected KV
    # blocks per token and KV head (prompt, tool and sampled tokens); the trajectories carry it to
    # the trainer (policy.index_replay, the train/msa_selection_agreement metric) and the dumps.
    # Costs one copy of an int16 [tokens, sparse layers, KV heads, top-k] buffer per engine step.
    record_block_selection: bool = False
    # Batch-invariant mode (issue 24, design.md §4.6): the engine's kernels reduce every token in one
    # fixed order, so its logits and logprobs do not depend on the batch, the other sequences or the
    # chunking. CUDA only (on the CPU the engine warns and runs the fast kernels); slower (fixed GEMM
    # / MoE tiles and attention splits, no skinny GEMM). The trainer's prev logprobs and the value of
    # the loss's logprobs then come from the same paged forward (jobs/invariant_scoring.py; the
    # gradient from the training forward, trainers/policy.py).
    batch_invariant: bool = False
    # The sparse layers' attention in batch-invariant mode (EngineConfig.invariant_sparse_attention):
    # page_partials (default: the KV-major per-page partials; meets issue 24's 32K-prefill target,
    # decode about 1 % slower; GPU-checked on an H100 2026-12-05, docs/benchmarks.md) or union (the
    # union walk, other bits). The job's rollout engines, EP workers, a job-started server and the
    # trainer's scorer all get it (bitwise on-policy needs one choice).
    # = m3_rollout.engine.config.DEFAULT_INVARIANT_SPARSE_ATTENTION (this module imports nothing of the project)
    invariant_sparse_attention: str = "page_partials"

    def engine_kwargs(self) -> dict:
        """The EngineConfig fields this section sets (besides max_model_len / max_num_seqs)."""
        return dict(
            kv_cache_memory_gb=self.kv_cache_memory_gb,
            kv_cache_memory_fraction=self.kv_cache_memory_fraction,
            msa_prefill_scratch_mb=self.msa_prefill_scratch_mb,
            max_num_batched_tokens=self.max_num_batched_tokens,
            enable_prefix_caching=self.enable_prefix_caching,
            enable_cuda_graphs=self.enable_cuda_graphs,
            async_scheduling=self.async_scheduling,
            index_cache_dtype=self.index_cache_dtype,
            quantize_index_queries=self.quantize_index_queries,
            record_block_selection=self.record_block_selection,
            batch_invariant=self.batch_invariant,
            invariant_sparse_attention=self.invariant_sparse_attention,
        )


@dataclass
class PolicyConfig:
    # "builtin:tiny-calculator" builds (or finds in the cache) the embedded tiny M3 checkpoint;
    # anything else is a path to a checkpoint directory (config.json + safetensors + tokenizer).
    model_name: str = "builtin:tiny-calculator"
    # Truncation policy: a trajectory stops with finish_reason "length" once prompt + generated +
    # tool tokens reach this many tokens; a tool turn that would overflow is cut and the
    # trajectory ends there. Truncated trajectories keep their tokens and get reward 0 unless
    # they already answered (env.truncated_turn_reward changes that).
    max_total_sequence_length: int = 192
    # Trainer numerics. float32: fp32 weights, AdamW states and compute (the CPU main job).
    # bfloat16: fp32 master weights and AdamW states; forward and backward run in a bf16 copy cast
    # as the generator casts (router and norms in fp32, spec §6), gradients accumulate in fp32 and
    # the optimizer steps the fp32 masters (the copy is refreshed from them). float64: tests.
    precision: str = "float32"
    # Recompute each decoder layer's activations in the backward pass instead of keeping them
    # (torch.utils.checkpoint): less activation memory for about one more forward of compute.
    activation_checkpointing: bool = False
    train_global_batch_size: int = 128
    # Rows per forward / backward within an optimizer step: divides train_global_batch_size, or is
    # at least it (one forward per optimizer step; m3_trainers.step caps it at the global batch, its
    # pre-update scoring too).
    train_micro_batch_size: int = 64
    max_grad_norm: float = 1.0
    thinking_mode: str = "disabled"
    # Routing replay: the trainer's MoE layers use the experts the rollout engine chose
    # (SampleOutput.routed_experts) instead of their own router's top-k. The step metrics then also
    # hold the mismatch without replay (token_mult_prob_error_without_replay, ...; one more scoring
    # forward per step).
    routing_replay: bool = False
    # Block-selection (index) replay: the trainer's sparse layers attend the KV blocks the rollout
    # engine selected (policy.generation.record_block_selection, which it needs) instead of their
    # own indexer's top-k; tokens without a record keep the trainer's own choice. The step metrics
    # then also hold the mismatch without any replay (*_without_replay, one more scoring forward).
    index_replay: bool = False
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    freeze: FreezeConfig = field(default_factory=FreezeConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)


@dataclass
class DataConfig:
    # "calculator" = the built-in generator of arithmetic prompts; or a JSONL path whose records
    # have "messages" or "prompt" plus "answer".
    source: str = "calculator"
    path: str | None = None
    min_digits: int = 2
    max_digits: int = 4
    operations: str = "+-*"
    # Calculator calls an episode needs: 1 = the single-step task (a op b); n > 1 = chains of 1..n
    # operations, each call carrying the previous result (rollout/environments/multistep.py), the
    # later operands of step_min_digits..step_max_digits digits. Needs grpo.max_rollout_turns > n.
    max_tool_calls: int = 1
    step_min_digits: int = 1
    step_max_digits: int = 2


@dataclass
class CalculatorEnvConfig:
    max_expression_chars: int = 64
    timeout_s: float = 1.0


@dataclass
class JsonlEnvConfig:
    # Reward function "package.module.function" called as fn(answer_text, record) -> float.
    reward_fn: str = "m3_rollout.rollout.environments.jsonl_env.last_number_reward"
    # Built-in tools offered to the model, by name: calculator, convert_units (checked when the
    # environment is built, m3_rollout/jobs/stack.py).
    tools: list[str] = field(default_factory=lambda: ["calculator"])
    system_prompt: str | None = None
    timeout_s: float = 1.0


@dataclass
class EnvConfig:
    # calculator: the built-in arithmetic task's scoring (last integer of the answer == the
    # record's "answer", calculator tool), also for data.source=jsonl records of one's own;
    # jsonl: records of data.path (needs data.source=jsonl) scored by env.jsonl.reward_fn with
    # env.jsonl.tools.
    name: str = "calculator"
    # Tools run in this many worker processes; each call is killed after the environment's
    # timeout_s; tool output longer than max_tool_output_chars is cut.
    num_tool_workers: int = 2
    max_tool_output_chars: int = 2048
    # A model turn cut by a token limit is kept (flagged) but gets loss_mask 0.
    mask_truncated_turns: bool = False
    # Reward of a trajectory whose last model turn was cut by a token limit: null = the environment
    # scores what the cut turn said (an answer already written counts); a number (e.g. 0.0, or a
    # negative penalty) replaces that score.
    truncated_turn_reward: float | None = None
    calculator: CalculatorEnvConfig = field(default_factory=CalculatorEnvConfig)
    jsonl: JsonlEnvConfig = field(default_factory=JsonlEnvConfig)


@dataclass
class WandbConfig:
    project: str = "m3-rollout"
    name: str = "grpo-tiny-m3"
    # auto: online when WANDB_API_KEY is set, offline otherwise; "disabled" turns wandb off.
    mode: str = "auto"
    # The wandb team / user the run belongs to (null = the key's default), the group runs are
    # gathered under, and the run's tags.
    entity: str | None = None
    group: str | None = None
    tags: list[str] = field(default_factory=list)
    # A resumed run (checkpointing.resume) continues the wandb run its checkpoint recorded:
    # "allow" (continue it, or start a new one when the checkpoint has none) or "must" (the
    # checkpoint must name one); "never": always a new run.
    resume: str = "allow"


@dataclass
class LoggerConfig:
    log_dir: str = "outputs/logs"
    wandb_enabled: bool = True
    wandb: WandbConfig = field(default_factory=WandbConfig)
    print_sample_every: int = 5
    progress_bar: bool = True


@dataclass
class CheckpointingConfig:
    enabled: bool = True
    checkpoint_dir: str = "outputs/checkpoints"
    save_final: bool = True
    # Save every save_period steps (0 = only the final one); keep the keep_top_k best by
    # metric_name (null = keep all); resume continues from the latest step_* in checkpoint_dir.
    # metric_name: a metric the run logs (docs/metrics.md: "validation/accuracy", "train/reward",
    # ...) or NeMo RL's "val:accuracy" / "train:reward"; a name no step logs stops the job at start;
    # null (as in NeMo RL): keep_top_k keeps the newest checkpoints.
    save_period: int = 0
    keep_top_k: int | None = None
    metric_name: str | None = "validation/accuracy"
    higher_is_better: bool = True
    resume: bool = False


@dataclass
class ClusterConfig:
    num_nodes: int = 1
    gpus_per_node: int = 0
    # Ray cluster to join (e.g. "ray://head:10001" or "auto"); "local" = start a new local instance;
    # null = Ray's own lookup (RAY_ADDRESS, then a cluster `ray start` ran on this machine), else a new
    # local instance (with colocated_placement=worker_process: always a new local instance). An
    # instance the job starts runs its workers at the driver's niceness (service.launchers.init_ray).
    ray_address: str | None = None
    # Rollout worker processes, one per EP rank (m3_rollout/service): "auto" = the in-process
    # engine when policy.generation.expert_parallel_size is 1 (and colocated_placement=in_process),
    # otherwise Ray actors when Ray is installed, else torch.multiprocessing; "ray" / "mp" force
    # that launcher (also for EP=1: with colocated_placement=in_process that is one worker refit
    # over the broadcast group, not colocated; with worker_process the worker on cluster.device).
    # EP workers on GPUs: rank r runs on cuda:r (with Ray, use "mp" where the driver must pick the GPUs).
    launcher: str = "auto"
    # CPUs each Ray actor asks for (fractional: 2 workers + the trainer share a 2-core machine).
    worker_cpus: float = 0.5
    # Seconds an EP collective (or the group's rendezvous) waits for a peer before it fails.
    collective_timeout_s: float = 60.0
    # Group restarts allowed within one generate call after a worker failure.
    max_restarts: int = 2
    # Lockstep engine steps per driver round trip.
    steps_per_call: int = 64
    # Device of the trainer and of the colocated engine (policy.generation.expert_parallel_size=1,
    # in its process or in its worker process: policy.generation.colocated_placement; with
    # worker_process and EP=P > 1 the GPU the trainer shares with EP rank N, N < P), which share
    # it and take turns: "cpu", "cuda" (= cuda:0) or "cuda:N". Checked at
    # start against the machine (check_devices; device_problem, the rule serve's --device uses too):
    # no CUDA, or an index past the device count, stops the job naming the key.
    device: str = "cpu"


@dataclass
class RolloutDumpConfig:
    # Offline rollout dumps (m3_rollout/dump, docs/rollout_dump_schema.md): one Parquet shard per
    # dumped step in `dir`; retention deletes the oldest shards (0 = no limit).
    enabled: bool = False
    # Default: inside the run's logger.log_dir (an OmegaConf interpolation, resolved by load_config),
    # so a run given its own log_dir keeps its dumps apart too.
    dir: str = "${logger.log_dir}/rollout_dumps"
    every_n_steps: int = 1
    max_bytes: int = 0
    keep_last_n_steps: int = 0


@dataclass
class WeightProbeConfig:
    # Post-update probe (m3_rollout/weight_sync/probe.py): after every refit each rollout rank
    # re-scores num_prompts fixed sequences of num_tokens ids and compares them with the trainer's
    # logprobs; beyond threshold (largest per-prompt mean |logprob difference|, nats per token)
    # the update fails (atomic: rolled back) or the rank is marked invalid.
    enabled: bool = False
    num_prompts: int = 2
    num_tokens: int = 16
    threshold: float = 0.1


@dataclass
class WeightSyncConfig:
    # Trainer -> rollout refit (m3_rollout/weight_sync, design.md §3); every backend receives
    # through the same WeightReceiver. broadcast: a private trainer + rollout-ranks group (gloo on
    # CPU, NCCL on GPU) to the EP workers; colocated: the in-process engine, per-tensor copies;
    # auto: colocated for the in-process engine, broadcast for rollout workers.
    method: str = "auto"
    # broadcast only (rejected with the in-process engine unless left at the default):
    backend: str = "auto"  # auto = nccl on CUDA, gloo otherwise
    bucket_size_mb: float = 512.0
    # a ring of three wire buffers per end (pack k+1 / send k / unpack k-1 overlap, on side
    # streams on GPU); false: one buffer, one bucket at a time (less memory)
    double_buffer: bool = True
    timeout_s: float = 60.0
    master_port: int = 0  # 0 = pick a free port
    # true: stage, validate, commit only if every rank succeeded (old weights and version stay on
    # failure); false: copy as validated (no stage), a failure marks ranks that wrote bytes
    # invalid. Finite values are checked either way.
    atomic: bool = True
    # Running requests at an update: abort (re-queue from the prompt) | drain (finish on the old
    # weights first) | continue (pause, swap, resume; later tokens carry the new version).
    in_flight: str = "abort"
    recompute_kv_after_update: bool = False
    # Send the frozen tensors (policy.freeze: indexer, router bias) with every update, not only
    # the first one a rollout receives.
    send_frozen: bool = False
    probe: WeightProbeConfig = field(default_factory=WeightProbeConfig)


_BROADCAST_ONLY = ("backend", "bucket_size_mb", "double_buffer", "timeout_s", "master_port")


#: The longest weight-sync collective timeout taken (seconds: an hour), by ``weight_sync.timeout_s``
#: and the server's ``/init_weight_sync``: a join holds the control plane that long, and a huge value
#: overflows the collective's timedelta.
MAX_WEIGHT_SYNC_TIMEOUT_S = 3600.0


def _check_weight_sync(e: list[str], cfg: MasterConfig) -> None:
    """weight_sync keys: ranges, and every key must take effect in the resolved mode."""
    ws = cfg.weight_sync
    _check(e, ws.bucket_size_mb > 0, "weight_sync.bucket_size_mb", ws.bucket_size_mb, "must be > 0 (MiB)")
    _check(
        e,
        0 < ws.timeout_s <= MAX_WEIGHT_SYNC_TIMEOUT_S,
        "weight_sync.timeout_s",
        ws.timeout_s,
        f"must be in (0, {MAX_WEIGHT_SYNC_TIMEOUT_S:g}] (seconds)",
    )
    _check(
        e,
        0 <= ws.master_port < 65536,
        "weight_sync.master_port",
        ws.master_port,
        "must be 0 (pick a free port) or a TCP port < 65536",
    )
    _check(
        e,
        not ws.recompute_kv_after_update or ws.in_flight == "continue",
        "weight_sync.recompute_kv_after_update",
        ws.recompute_kv_after_update,
        "only applies with weight_sync.in_flight=continue",
    )
    pr = ws.probe
    _check(e, pr.num_prompts >= 1, "weight_sync.probe.num_prompts", pr.num_prompts, "must be >= 1")
    _check(e, pr.num_tokens >= 2, "weight_sync.probe.num_tokens", pr.num_tokens, "must be >= 2")
    _check(e, pr.threshold > 0, "weight_sync.probe.threshold", pr.threshold, "must be > 0 (nats per token)")
    gen = cfg.policy.generation
    if gen.backend == "http":
        _check_http_weight_sync(e, ws)
        return
    if gen.colocated_placement == "worker_process":
        _check(
            e,
            ws.method == "auto",
            "weight_sync.method",
            ws.method,
            "policy.generation.colocated_placement=worker_process refits its worker through the trainer's shared "
            "stage (CUDA IPC / shared memory); leave weight_sync.method=auto",
        )
        defaults = WeightSyncConfig()
        for key in _BROADCAST_ONLY:
            value = getattr(ws, key)
            _check(
                e,
                key == "timeout_s" or value == getattr(defaults, key),
                f"weight_sync.{key}",
                value,
                "only applies to the broadcast group of rollout workers; colocated_placement=worker_process "
                "moves the weights through the trainer's shared stage (leave it at its default)",
            )
        return
    in_process = gen.expert_parallel_size == 1 and cfg.cluster.launcher == "auto"
    if in_process:
        _check(
            e,
            ws.method in ("auto", "colocated"),
            "weight_sync.method",
            ws.method,
            "the in-process engine (expert_parallel_size=1, cluster.launcher=auto) is refit in-process: "
            "use auto or colocated, or set cluster.launcher=mp|ray for rollout workers",
        )
        defaults = WeightSyncConfig()
        for key in _BROADCAST_ONLY:
            value = getattr(ws, key)
            _check(
                e,
                value == getattr(defaults, key),
                f"weight_sync.{key}",
                value,
                "only applies to the broadcast group of rollout workers; the in-process engine is refit "
                "by per-tensor copies (leave it at its default)",
            )
    else:
        _check(
            e,
            ws.method in ("auto", "broadcast"),
            "weight_sync.method",
            ws.method,
            "rollout workers are separate processes: refit goes through the broadcast group (use auto or broadcast)",
        )


#: weight_sync keys the rollout server's refit does not take (HTTPBackend): left at their defaults.
_HTTP_FIXED = ("master_port", "double_buffer", "atomic", "recompute_kv_after_update", "send_frozen")


def _check_http_weight_sync(e: list[str], ws: WeightSyncConfig) -> None:
    """weight_sync keys with policy.generation.backend=http: the server's group takes backend,
    bucket_size_mb and timeout_s; the rest must stay at their defaults."""
    _check(
        e,
        ws.method in ("auto", "broadcast"),
        "weight_sync.method",
        ws.method,
        "policy.generation.backend=http refits the server through its weight-sync group (use auto or broadcast)",
    )
    defaults = WeightSyncConfig()
    for key in _HTTP_FIXED:
        value = getattr(ws, key)
        _check(
            e,
            value == getattr(defaults, key),
            f"weight_sync.{key}",
            value,
            "is not configurable with policy.generation.backend=http (the server's refit is atomic, "
            "on a free port, frozen tensors with the first update only); leave it at its default",
        )
    _check(
        e,
        not ws.probe.enabled,
        "weight_sync.probe.enabled",
        ws.probe.enabled,
        "the rollout server has no post-update probe; use policy.generation.backend=native for it",
    )


def _check_worker_process(e: list[str], cfg: MasterConfig) -> None:
    """policy.generation.colocated_placement=worker_process: rollout worker processes refit from
    the trainer's memory on its node, which rules out the HTTP backend and GPU workers beside a CPU
    trainer. EP=1: one worker on cluster.device. EP=P > 1 on CUDA: rank r on cuda:r, so P GPUs on
    one node, the trainer on one of them (cluster.device = cuda:0 .. cuda:P-1). No Ray cluster
    address: the workers must start on the trainer's node."""
    gen, c = cfg.policy.generation, cfg.cluster
    if gen.colocated_placement != "worker_process":
        return
    _check(
        e,
        gen.backend == "native",
        "policy.generation.colocated_placement",
        gen.colocated_placement,
        "needs policy.generation.backend=native (a rollout server is a process of its own, refit over HTTP)",
    )
    ep = gen.expert_parallel_size
    try:
        index = cuda_index(c.device)
    except ValueError:  # refused as cluster.device itself
        index = None
    if ep > 1 and index is not None:
        _check(
            e,
            c.gpus_per_node >= ep,
            "cluster.gpus_per_node",
            c.gpus_per_node,
            f"must be >= policy.generation.expert_parallel_size={ep} with policy.generation.colocated_placement="
            "worker_process on CUDA: EP rank r runs on cuda:r",
        )
        _check(
            e,
            c.num_nodes == 1,
            "cluster.num_nodes",
            c.num_nodes,
            "must be 1 with policy.generation.colocated_placement=worker_process: the workers open the trainer's "
            "memory by CUDA IPC handle, which works on one node only",
        )
        _check(
            e,
            index < ep,
            "cluster.device",
            c.device,
            f"must be one of cuda:0 .. cuda:{ep - 1} with policy.generation.colocated_placement=worker_process and "
            f"policy.generation.expert_parallel_size={ep}: EP rank r runs on cuda:r and the trainer shares the GPU "
            "of one rank (for a trainer on a GPU of its own use colocated_placement=in_process, the broadcast EP "
            "service)",
        )
    _check(
        e,
        c.ray_address in (None, "", "local") or c.launcher == "mp",
        "cluster.ray_address",
        c.ray_address,
        "must be null (or 'local') with policy.generation.colocated_placement=worker_process (or set "
        "cluster.launcher=mp): "
        "Ray could place the rollout workers on another node of that cluster, where the trainer's memory "
        "cannot be opened",
    )
    _check(
        e,
        not (c.device == "cpu" and c.gpus_per_node > 0),
        "cluster.gpus_per_node",
        c.gpus_per_node,
        "must be 0 with policy.generation.colocated_placement=worker_process and cluster.device=cpu: the "
        "rollout worker runs on the trainer's device (cluster.device), not on a GPU of its own",
    )


def _check_http_backend(e: list[str], cfg: MasterConfig) -> None:
    """policy.generation keys of the HTTP backend, and what it cannot do."""
    gen = cfg.policy.generation
    if gen.backend != "http":
        for key in ("http_base_url", "http_api_key"):
            value = getattr(gen, key)
            _check(
                e,
                value is None,
                f"policy.generation.{key}",
                value,
                "only applies with policy.generation.backend=http; remove it or set the backend",
            )
        return
    url = gen.http_base_url
    _check(
        e,
        url is None or re.fullmatch(r"https?://[^/\s]+(/\S*)?", url) is not None,
        "policy.generation.http_base_url",
        url,
        "must be null (the job starts a server) or an http(s) URL such as 'http://127.0.0.1:8000'",
    )
    _check(
        e,
        gen.http_startup_timeout_s > 0,
        "policy.generation.http_startup_timeout_s",
        gen.http_startup_timeout_s,
        "must be > 0 (seconds)",
    )
    _check(
        e,
        gen.expert_parallel_size == 1,
        "policy.generation.expert_parallel_size",
        gen.expert_parallel_size,
        "must be 1 with policy.generation.backend=http: it sizes the job's own EP rollout service, and the server "
        "the job starts runs one engine; for an expert-parallel server start `m3-rollout serve "
        "--expert-parallel-size P` yourself and give policy.generation.http_base_url (every EP rank joins the "
        "weight sync), or use backend=native for the job's EP rollout service",
    )
    _check(
        e,
        gen.sleep_level == 0,
        "policy.generation.sleep_level",
        gen.sleep_level,
        "must be 0 with policy.generation.backend=http: the server's engine cannot sleep / wake up on request",
    )
    _check(
        e,
        cfg.cluster.launcher == "auto",
        "cluster.launcher",
        cfg.cluster.launcher,
        "must be auto with policy.generation.backend=http (the server is the rollout; no workers are launched)",
    )


@dataclass
class MasterConfig:
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    loss_fn: LossConfig = field(default_factory=LossConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    data: DataConfig = field(default_factory=DataConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    checkpointing: CheckpointingConfig = field(default_factory=CheckpointingConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    rollout_dump: RolloutDumpConfig = field(default_factory=RolloutDumpConfig)
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)


_CHOICES = {
    "policy.generation.backend": ("native", "http"),
    "policy.generation.colocated_placement": ("in_process", "worker_process"),
    "policy.generation.logprobs_mode": ("processed", "raw"),
    "policy.generation.dtype": ("float32", "bfloat16", "float16"),
    # = m3_rollout.engine.config.INVARIANT_SPARSE_ATTENTIONS (this module imports nothing of the project)
    "policy.generation.invariant_sparse_attention": ("union", "page_partials"),
    "policy.precision": ("float32", "bfloat16", "float64"),
    "policy.thinking_mode": ("disabled", "enabled", "adaptive"),
    "policy.optimizer.name": ("adamw",),
    "logger.wandb.mode": ("auto", "online", "offline", "disabled"),
    "logger.wandb.resume": ("allow", "must", "never"),
    "cluster.launcher": ("auto", "ray", "mp"),
    "loss_fn.reference_policy_kl_type": ("k1", "k2", "k3"),
    "loss_fn.importance_sampling_type": ("tis", "mis"),
    "policy.scheduler.name": ("constant", "linear", "cosine"),
    "weight_sync.method": ("auto", "broadcast", "colocated"),
    "weight_sync.backend": ("auto", "gloo", "nccl"),
    "weight_sync.in_flight": ("abort", "drain", "continue"),
}


def _bad_value_message(key: str, msg: str) -> str:
    """The ConfigError text for OmegaConf's ValidationError ``msg`` on ``key``. An empty override
    (``key=``) or a null reaches a key that needs a value as "Incompatible value 'None'": say that
    it is empty and what it takes (the choices of a ``_CHOICES`` key) instead."""
    if msg.startswith("Incompatible value 'None'"):
        kind = re.search(r"of type '([^']+)'", msg)
        name = kind.group(1) if kind else "value"
        takes = f"one of {list(_CHOICES[key])}" if key in _CHOICES else f"{'an' if name[0] in 'aeiou' else 'a'} {name}"
        return f"bad value for {key}: empty or null, but it needs {takes}; give it a value or leave the key out"
    return f"bad value for {key}: {msg}"


def _check(errors: list[str], ok: bool, key: str, value: Any, allowed: str) -> None:
    if not ok:
        errors.append(f"{key}={value!r}: {allowed}")


def _non_finite_floats(obj: Any, prefix: str = ""):
    """(dotted key, value) of every float field of a config dataclass that is NaN or +-inf."""
    for f in dataclasses.fields(obj):
        value, key = getattr(obj, f.name), prefix + f.name
        if dataclasses.is_dataclass(value):
            yield from _non_finite_floats(value, key + ".")
        elif isinstance(value, float) and not math.isfinite(value):
            yield key, value


def _section_of(class_name: str, cls: type = None, prefix: str = "") -> str | None:
    """Dotted path of the config section whose dataclass is called ``class_name``."""
    for f in dataclasses.fields(cls or MasterConfig):
        t = f.default_factory if f.default_factory is not dataclasses.MISSING else None  # type: ignore[misc]
        if isinstance(t, type) and dataclasses.is_dataclass(t):
            if t.__name__ == class_name:
                return prefix + f.name
            found = _section_of(class_name, t, prefix + f.name + ".")
            if found:
                return found
    return None


def _check_group_size(e: list[str], g: GRPOConfig, training: bool) -> None:
    """grpo.num_generations_per_prompt >= 2 for a run that trains: every advantage estimator
    compares a sample with the others of its group (``m3_trainers.advantages.group_advantages``:
    the group mean, or with ``use_leave_one_out_baseline`` the mean of the others), so a group of
    one sample gets advantage exactly 0 whatever its reward and the policy-gradient loss is 0.
    Without training (``dump generate``) one sample per prompt is a sample to dump: >= 1."""
    n = g.num_generations_per_prompt
    if not training:
        _check(e, n >= 1, "grpo.num_generations_per_prompt", n, "must be >= 1")
        return
    _check(
        e,
        n >= 2,
        "grpo.num_generations_per_prompt",
        n,
        "must be >= 2: GRPO's advantage compares each sample with the other samples of its prompt "
        "(the group mean; with grpo.use_leave_one_out_baseline=true the mean of the others), so a group "
        "of 1 gets advantage 0 under either baseline and nothing is learned",
    )


def _check_global_batch(e: list[str], g: GRPOConfig, batch: int) -> None:
    """policy.train_global_batch_size divides the step's samples (prompts x generations), so every
    GRPO step is a whole number of optimizer steps; the message gives both factors and the fixes."""
    prompts, n = g.num_prompts_per_step, g.num_generations_per_prompt
    total = prompts * n
    if batch >= 1 and total % batch == 0:
        return
    fix = f"set policy.train_global_batch_size={total} or a divisor of it"
    if batch >= 1:
        # the smallest prompt count whose samples batch divides: prompts must be a multiple of it
        step = batch // math.gcd(batch, n)
        fix += f", or set grpo.num_prompts_per_step to a multiple of {step} (e.g. {step * math.ceil(prompts / step)})"
    _check(
        e,
        False,
        "policy.train_global_batch_size",
        batch,
        f"must divide the samples of a step, grpo.num_prompts_per_step * grpo.num_generations_per_prompt = "
        f"{prompts} * {n} = {total}; {fix}",
    )


def _check_micro_batch(e: list[str], p: PolicyConfig) -> None:
    """policy.train_micro_batch_size divides policy.train_global_batch_size, or is at least it.
    ``m3_trainers.step`` runs each optimizer step on ``train_global_batch_size`` rows, split into
    micro-batches of ``train_micro_batch_size`` from its first row (gradients accumulated under one
    global normaliser): a micro batch below the global one that does not divide it leaves a ragged
    last micro-batch in every optimizer step, whose boundaries are not those of the step's
    pre-update scoring pass (micro-batches from the step's first row). One at least the global
    batch is one forward per optimizer step. The message names a divisor to use."""
    gbs, mbs = p.train_global_batch_size, p.train_micro_batch_size
    if gbs < 1 or mbs < 1 or mbs >= gbs or gbs % mbs == 0:  # (< 1: refused on their own)
        return
    below = max(d for d in range(1, mbs) if gbs % d == 0)
    _check(
        e,
        False,
        "policy.train_micro_batch_size",
        mbs,
        f"must divide policy.train_global_batch_size={gbs} (each optimizer step's {gbs} rows are split into "
        f"micro-batches of {mbs}, leaving a ragged last one of {gbs % mbs}) or be >= it (one forward per "
        f"optimizer step); set policy.train_micro_batch_size={below} (the largest divisor of {gbs} below {mbs}) "
        f"or {gbs}",
    )


def _check_env_keys(e: list[str], env: EnvConfig) -> None:
    """``env.jsonl.*`` is read by ``env.name=jsonl`` alone and ``env.calculator.*`` by
    ``env.name=calculator`` alone (``rollout.environments.build_environment``): with the other
    environment a key set away from its default would be ignored silently (the calculator
    environment scores with its own rule, tool and prompt; the jsonl one offers its tools at their
    defaults, with ``env.jsonl.timeout_s``), so it is refused naming the fix. A key given at its
    default value cannot be told from an absent one, and changes nothing."""
    readers = {  # env.name -> (its section env.<name>.*'s dataclass, why another environment ignores it)
        "calculator": (
            CalculatorEnvConfig,
            "is read only with env.name=calculator; env.name=jsonl scores with env.jsonl.* (its reward_fn, "
            "its tools at their defaults, the tool timeout env.jsonl.timeout_s) and would ignore it: set "
            "env.name=calculator or leave the key out",
        ),
        "jsonl": (
            JsonlEnvConfig,
            "is read only with env.name=jsonl; env.name=calculator (the default) scores with its own rule "
            "(the answer's last integer against the record's, the calculator tool, its own system prompt; "
            "env.calculator.*) and would ignore it: set env.name=jsonl (with data.source=jsonl and "
            "data.path) or leave the key out",
        ),
    }
    for section, (kind, why) in readers.items():
        if env.name == section or env.name not in readers:
            continue
        default = kind()
        for f in dataclasses.fields(kind):
            value = getattr(getattr(env, section), f.name)
            if value != getattr(default, f.name):
                _check(e, False, f"env.{section}.{f.name}", value, why)


def ignored_setting_warnings(cfg: MasterConfig) -> list[str]:
    """``[warn]`` lines for settings this run reads nowhere but that a user may think apply: today
    ``policy.generation.invariant_sparse_attention`` away from its default while
    ``policy.generation.batch_invariant`` is off (the fast mode has no such choice). A warning, not
    an error: an A/B of the two modes flips batch_invariant alone on one config."""
    gen = cfg.policy.generation
    default = GenerationConfig.invariant_sparse_attention
    if gen.batch_invariant or gen.invariant_sparse_attention == default:
        return []
    return [
        f"[warn] policy.generation.invariant_sparse_attention={gen.invariant_sparse_attention} has no effect: it "
        "chooses the batch-invariant mode's sparse attention and policy.generation.batch_invariant is false "
        f"(set it true to use it, or leave the key at its default {default!r})"
    ]


def validate(cfg: MasterConfig, training: bool = True) -> None:
    """Check ranges and cross-key rules.

    ``training``: False for a command that only rolls out (``dump generate``): the rules that
    exist for the GRPO update alone are relaxed: grpo.num_generations_per_prompt >= 2 becomes >= 1,
    and policy.train_global_batch_size / train_micro_batch_size need not divide the step's samples
    / the global batch (their ranges are still checked).

    Raises:
        ConfigError: listing every violation as ``key=value: allowed``.
    """
    e: list[str] = []
    for key, value in _non_finite_floats(cfg):
        _check(e, False, key, value, "must be a finite number")
    g, p, gen = cfg.grpo, cfg.policy, cfg.policy.generation
    tree = OmegaConf.structured(cfg)  # once: building it is most of this function's time (~0.1 s)
    for key, choices in _CHOICES.items():
        value = OmegaConf.select(tree, key)
        _check(e, value in choices, key, value, f"must be one of {list(choices)}")
    for key in ("num_prompts_per_step", "max_rollout_turns", "val_period", "num_val_prompts"):
        value = getattr(g, key)
        _check(e, value >= 1, f"grpo.{key}", value, "must be >= 1")
    _check_group_size(e, g, training)
    _check(e, g.max_num_steps >= 0, "grpo.max_num_steps", g.max_num_steps, "must be >= 0 (0 = validation only)")
    _check(
        e,
        g.max_num_steps > 0 or g.val_at_start,
        "grpo.max_num_steps",
        g.max_num_steps,
        "0 trains nothing and only measures held-out accuracy at step 0, which grpo.val_at_start=false turns "
        "off, so the run would do nothing; give a number of steps, or set grpo.val_at_start=true to evaluate",
    )
    _check(
        e,
        0 <= g.seed < 2**40,
        "grpo.seed",
        g.seed,
        "must be in [0, 2**40) (the sampling seeds derive from it as seed * 100003 + step, kept in int64)",
    )
    _check(e, g.val_temperature >= 0, "grpo.val_temperature", g.val_temperature, "must be >= 0 (0 = greedy)")
    # NOTE: the engine reads temperature 0 as greedy (vLLM's rule), but a greedy group is n copies of
    # one sample: equal rewards, every GRPO advantage 0, nothing to learn; and the trainer divides
    # the logits by this temperature when it scores the rollouts.
    _check(
        e,
        gen.temperature > 0,
        "policy.generation.temperature",
        gen.temperature,
        "must be > 0: 0 is greedy, whose n samples per prompt are identical (every GRPO advantage 0) and "
        "which the trainer cannot score (it divides the logits by the temperature); for greedy held-out "
        "accuracy set grpo.val_temperature=0",
    )
    _check(e, 0 < gen.top_p <= 1, "policy.generation.top_p", gen.top_p, "must be in (0, 1]")
    _check(e, gen.top_k >= -1, "policy.generation.top_k", gen.top_k, "must be -1 or 0 (off) or >= 1")
    _check(e, gen.max_new_tokens >= 1, "policy.generation.max_new_tokens", gen.max_new_tokens, "must be >= 1")
    _check(e, gen.max_num_seqs >= 1, "policy.generation.max_num_seqs", gen.max_num_seqs, "must be >= 1")
    _check(
        e,
        gen.kv_cache_memory_gb >= 0,
        "policy.generation.kv_cache_memory_gb",
        gen.kv_cache_memory_gb,
        "must be >= 0 (0 = size automatically)",
    )
    _check(
        e,
        gen.index_cache_dtype in ("bfloat16", "fp8_e4m3"),
        "policy.generation.index_cache_dtype",
        gen.index_cache_dtype,
        "must be bfloat16 or fp8_e4m3",
    )
    _check(
        e,
        not gen.quantize_index_queries or gen.index_cache_dtype == "fp8_e4m3",
        "policy.generation.quantize_index_queries",
        gen.quantize_index_queries,
        "needs policy.generation.index_cache_dtype=fp8_e4m3 (queries are quantized like the FP8 index keys)",
    )
    _check(
        e,
        0 < gen.kv_cache_memory_fraction <= 1,
        "policy.generation.kv_cache_memory_fraction",
        gen.kv_cache_memory_fraction,
        "must be in (0, 1]",
    )
    _check(
        e,
        gen.msa_prefill_scratch_mb is None or gen.msa_prefill_scratch_mb >= 0,
        "policy.generation.msa_prefill_scratch_mb",
        gen.msa_prefill_scratch_mb,
        "must be null (one 16384-token pass) or >= 0 MiB (0 = KV-major prefill off)",
    )
    _check(
        e,
        gen.max_num_batched_tokens >= 1,
        "policy.generation.max_num_batched_tokens",
        gen.max_num_batched_tokens,
        "must be >= 1",
    )
    _check(
        e,
        gen.expert_parallel_size >= 1,
        "policy.generation.expert_parallel_size",
        gen.expert_parallel_size,
        "must be >= 1 (and divide the model's routed experts per layer)",
    )
    c = cfg.cluster
    n_gpus = c.num_nodes * c.gpus_per_node
    _check(
        e,
        n_gpus == 0 or gen.expert_parallel_size <= n_gpus,
        "policy.generation.expert_parallel_size",
        gen.expert_parallel_size,
        f"needs one GPU per EP rank; the cluster has {n_gpus}",
    )
    try:
        cuda_index(c.device)
    except ValueError as exc:
        _check(e, False, "cluster.device", c.device, str(exc))
    _check(e, c.worker_cpus > 0, "cluster.worker_cpus", c.worker_cpus, "must be > 0 (fractions are fine)")
    _check(e, c.collective_timeout_s > 0, "cluster.collective_timeout_s", c.collective_timeout_s, "must be > 0")
    _check(e, c.max_restarts >= 0, "cluster.max_restarts", c.max_restarts, "must be >= 0")
    _check(e, c.steps_per_call >= 1, "cluster.steps_per_call", c.steps_per_call, "must be >= 1")
    _check(
        e,
        p.max_total_sequence_length >= 16,
        "policy.max_total_sequence_length",
        p.max_total_sequence_length,
        "must be >= 16",
    )
    _check(e, p.train_micro_batch_size >= 1, "policy.train_micro_batch_size", p.train_micro_batch_size, "must be >= 1")
    if training:  # the batch rules shape optimizer steps: `dump generate` runs none
        _check_micro_batch(e, p)
        if g.num_prompts_per_step >= 1 and g.num_generations_per_prompt >= 2:  # else refused above
            _check_global_batch(e, g, p.train_global_batch_size)
    else:
        gbs = p.train_global_batch_size
        _check(e, gbs >= 1, "policy.train_global_batch_size", gbs, "must be >= 1")
    _check(e, p.optimizer.lr > 0, "policy.optimizer.lr", p.optimizer.lr, "must be > 0")
    _check(e, p.max_grad_norm > 0, "policy.max_grad_norm", p.max_grad_norm, "must be > 0")
    for key in ("ratio_clip_min", "ratio_clip_max"):
        value = getattr(cfg.loss_fn, key)
        _check(e, 0 <= value < 1, f"loss_fn.{key}", value, "must be in [0, 1)")
    lf = cfg.loss_fn
    _check(
        e,
        lf.reference_policy_kl_penalty >= 0.0,
        "loss_fn.reference_policy_kl_penalty",
        lf.reference_policy_kl_penalty,
        "must be >= 0 (0 = off)",
    )
    _check(
        e,
        lf.ratio_clip_c is None or lf.ratio_clip_c > 1,
        "loss_fn.ratio_clip_c",
        lf.ratio_clip_c,
        "must be null (off) or > 1",
    )
    _check(
        e,
        lf.truncated_importance_sampling_ratio > 0,
        "loss_fn.truncated_importance_sampling_ratio",
        lf.truncated_importance_sampling_ratio,
        "must be > 0",
    )
    _check(
        e,
        0 <= lf.mis_ratio_min <= 1 <= lf.mis_ratio_max,
        "loss_fn.mis_ratio_min/mis_ratio_max",
        (lf.mis_ratio_min, lf.mis_ratio_max),
        "need 0 <= mis_ratio_min <= 1 <= mis_ratio_max",
    )
    _check(
        e,
        not lf.use_importance_sampling_correction or (gen.top_k in (-1, 0) and gen.top_p == 1.0),
        "loss_fn.use_importance_sampling_correction",
        lf.use_importance_sampling_correction,
        "needs policy.generation.top_k=-1 and top_p=1.0: the trainer scores the temperature-only "
        "distribution, so the weights would compare different distributions",
    )
    sch = p.scheduler
    _check(e, sch.warmup_steps >= 0, "policy.scheduler.warmup_steps", sch.warmup_steps, "must be >= 0")
    _check(e, 0 <= sch.min_lr_ratio <= 1, "policy.scheduler.min_lr_ratio", sch.min_lr_ratio, "must be in [0, 1]")
    a = g.async_grpo
    _check(
        e,
        a.max_trajectory_age_steps >= 1,
        "grpo.async_grpo.max_trajectory_age_steps",
        a.max_trajectory_age_steps,
        "must be >= 1 (0 would mean synchronous: set grpo.async_grpo.enabled=false)",
    )
    _check(e, a.group_timeout_s > 0, "grpo.async_grpo.group_timeout_s", a.group_timeout_s, "must be > 0")
    _check(
        e,
        not (a.enabled and g.use_dynamic_sampling),
        "grpo.use_dynamic_sampling",
        g.use_dynamic_sampling,
        "cannot be combined with grpo.async_grpo.enabled=true (the async queue fixes the groups per "
        "step); turn one of them off",
    )
    _check(
        e,
        g.dynamic_sampling_max_gen_batches >= 1,
        "grpo.dynamic_sampling_max_gen_batches",
        g.dynamic_sampling_max_gen_batches,
        "must be >= 1",
    )
    gen = p.generation
    _check(e, gen.sleep_level in (0, 1, 2), "policy.generation.sleep_level", gen.sleep_level, "must be 0, 1 or 2")
    colocated = gen.expert_parallel_size == 1 or gen.colocated_placement == "worker_process"
    _check(
        e,
        not (gen.sleep_level in (1, 2) and (a.enabled or not colocated)),
        "policy.generation.sleep_level",
        gen.sleep_level,
        "needs synchronous GRPO (grpo.async_grpo.enabled=false) and a colocated engine "
        "(policy.generation.expert_parallel_size=1, or colocated_placement=worker_process): the engine cannot "
        "sleep while it generates, and EP workers on GPUs of their own have nothing to hand over",
    )
    ck = cfg.checkpointing
    _check(e, ck.save_period >= 0, "checkpointing.save_period", ck.save_period, "must be >= 0 (0 = final only)")
    _check(
        e,
        ck.keep_top_k is None or ck.keep_top_k >= 1,
        "checkpointing.keep_top_k",
        ck.keep_top_k,
        "must be null (keep all) or >= 1",
    )
    d = cfg.data
    _check(
        e,
        d.source in ("calculator", "jsonl"),
        "data.source",
        d.source,
        "must be 'calculator' (built-in generator) or 'jsonl' (with data.path)",
    )
    _check(e, d.source != "jsonl" or bool(d.path), "data.path", d.path, "must name a JSONL file when data.source=jsonl")
    env = cfg.env
    _check(e, env.name in ("calculator", "jsonl"), "env.name", env.name, "must be 'calculator' or 'jsonl'")
    _check(
        e,
        env.name != "jsonl" or d.source == "jsonl",
        "env.name",
        env.name,
        "env.name=jsonl needs data.source=jsonl and data.path",
    )
    _check_env_keys(e, env)
    _check(e, env.num_tool_workers >= 1, "env.num_tool_workers", env.num_tool_workers, "must be >= 1")
    _check(e, env.max_tool_output_chars >= 1, "env.max_tool_output_chars", env.max_tool_output_chars, "must be >= 1")
    for key, value in (
        ("env.calculator.timeout_s", env.calculator.timeout_s),
        ("env.jsonl.timeout_s", env.jsonl.timeout_s),
    ):
        _check(e, value > 0, key, value, "must be > 0 (seconds)")
    _check(
        e,
        1 <= d.min_digits <= d.max_digits <= 9,
        "data.min_digits/max_digits",
        (d.min_digits, d.max_digits),
        "need 1 <= min_digits <= max_digits <= 9",
    )
    _check(
        e,
        1 <= d.step_min_digits <= d.step_max_digits <= 9,
        "data.step_min_digits/step_max_digits",
        (d.step_min_digits, d.step_max_digits),
        "need 1 <= step_min_digits <= step_max_digits <= 9",
    )
    _check(e, d.max_tool_calls >= 1, "data.max_tool_calls", d.max_tool_calls, "must be >= 1")
    _check(
        e,
        d.source != "calculator" or g.max_rollout_turns > d.max_tool_calls,
        "grpo.max_rollout_turns",
        g.max_rollout_turns,
        f"must be > data.max_tool_calls={d.max_tool_calls} (one turn per call, then the answer)",
    )
    _check(
        e,
        bool(d.operations) and set(d.operations) <= set("+-*"),
        "data.operations",
        d.operations,
        "a non-empty subset of '+-*'",
    )
    rd = cfg.rollout_dump
    _check(e, rd.every_n_steps >= 1, "rollout_dump.every_n_steps", rd.every_n_steps, "must be >= 1")
    _check(e, rd.max_bytes >= 0, "rollout_dump.max_bytes", rd.max_bytes, "must be >= 0 (0 = no limit)")
    _check(
        e,
        rd.keep_last_n_steps >= 0,
        "rollout_dump.keep_last_n_steps",
        rd.keep_last_n_steps,
        "must be >= 0 (0 = keep all)",
    )
    _check(e, not rd.enabled or bool(rd.dir), "rollout_dump.dir", rd.dir, "must be set when rollout_dump.enabled")
    _check_http_backend(e, cfg)
    _check_worker_process(e, cfg)
    _check_weight_sync(e, cfg)
    _check(
        e,
        not p.index_replay or p.generation.record_block_selection,
        "policy.index_replay",
        p.index_replay,
        "needs policy.generation.record_block_selection=true (the selection to replay)",
    )
    opt = p.optimizer
    for key in ("beta1", "beta2"):
        value = getattr(opt, key)
        _check(e, 0 <= value < 1, f"policy.optimizer.{key}", value, "must be in [0, 1)")
    _check(e, opt.eps >= 0, "policy.optimizer.eps", opt.eps, "must be >= 0")
    _check(e, opt.weight_decay >= 0, "policy.optimizer.weight_decay", opt.weight_decay, "must be >= 0")
    for pat in p.freeze.patterns:
        try:
            re.compile(pat)
        except re.error as exc:
            _check(e, False, "policy.freeze.patterns", pat, f"is not a regular expression ({exc})")
    if e:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(e))


_DEVICE_FORMS = "'cpu', 'cuda' or 'cuda:N' (N = device index)"  # what cuda_index accepts


def cuda_index(device: str) -> int | None:
    """The CUDA device index a device string names, as ``torch.device`` reads it: None for
    ``"cpu"``, 0 for ``"cuda"``, N for ``"cuda:N"`` (N in ASCII digits, no leading zero).

    Raises:
        ValueError: any other string (``"gpu"``, ``"cuda:x"``, ``"cuda:"``, ``"cuda:01"``, ``"CUDA"``),
            saying the accepted forms.
    """
    if device == "cpu":
        return None
    found = re.fullmatch(r"cuda(?::(0|[1-9][0-9]*))?", device)
    if found is None:
        raise ValueError(f"must be {_DEVICE_FORMS}")
    return int(found.group(1) or 0)


def device_problem(
    device: str, key: str, cuda_available: bool, cuda_device_count: int, auto: bool = False
) -> str | None:
    """Why ``device`` cannot be used on this machine (None: it can): the one rule for a device
    request, behind ``cluster.device`` (:func:`check_devices`) and the rollout server's ``--device``.

    Args:
        device: ``"cpu"``, ``"cuda"`` or ``"cuda:N"`` (anything else is a problem, :func:`cuda_index`),
            or ``"auto"`` where ``auto`` is set.
        key: the config key or flag the fix names (``"cluster.device"``, ``"--device"``).
        cuda_available: ``torch.cuda.is_available()``.
        cuda_device_count: ``torch.cuda.device_count()`` (read as 0 when CUDA is not available).
        auto: ``key`` also takes ``"auto"`` (CUDA when there is one, else cpu; always usable):
            serve's ``--device`` does, ``cluster.device`` does not.

    Returns:
        None, or one line without the key / value prefix: the accepted forms for a malformed
        string (with ``auto``, also the fix ``{key}=auto``); for CUDA asked for where there is none
        or an index past the device count, the devices present and what to use instead
        (``{key}=cpu``, or an index below the count).
    """
    if auto and device == "auto":
        return None
    try:
        index = cuda_index(device)
    except ValueError as exc:
        if not auto:
            return str(exc)
        return f"must be 'auto', {_DEVICE_FORMS}; use {key}=auto for CUDA when there is one, else cpu"
    count = cuda_device_count if cuda_available else 0
    if index is None or index < count:
        return None
    fix = f"{key}=cpu or an index < {count}" if count else f"{key}=cpu"
    return f"{_cuda_devices_present(cuda_available, cuda_device_count)}; use {fix}"


def _cuda_devices_present(cuda_available: bool, cuda_device_count: int) -> str:
    count = cuda_device_count if cuda_available else 0
    have = f"this machine has {count} CUDA device(s)"
    return have if cuda_available else have + " (torch.cuda.is_available() is False)"


def check_devices(cfg: MasterConfig, cuda_available: bool, cuda_device_count: int) -> None:
    """Check ``cluster.device`` and ``cluster.gpus_per_node`` against this machine (at job start);
    ``cluster.device`` by :func:`device_problem`, the rule the rollout server's ``--device`` shares.

    Args:
        cfg: a validated config.
        cuda_available: ``torch.cuda.is_available()``.
        cuda_device_count: ``torch.cuda.device_count()``.

    Raises:
        ConfigError: CUDA asked for (``cluster.device=cuda[:N]``, ``cluster.gpus_per_node > 0`` or
            ``weight_sync.backend=nccl``) on a machine without it, a device index past the device
            count, or more GPUs per node than this machine has; each names the key and the devices
            present.
    """
    c, e = cfg.cluster, []
    count = cuda_device_count if cuda_available else 0
    have = _cuda_devices_present(cuda_available, cuda_device_count)
    problem = device_problem(c.device, "cluster.device", cuda_available, cuda_device_count)
    _check(e, problem is None, "cluster.device", c.device, problem)
    _check(
        e,
        c.gpus_per_node <= count,
        "cluster.gpus_per_node",
        c.gpus_per_node,
        f"{have}; use at most {count} (0 = CPU rollout workers)",
    )
    _check(
        e,
        cfg.weight_sync.backend != "nccl" or count > 0,
        "weight_sync.backend",
        cfg.weight_sync.backend,
        f"NCCL needs CUDA devices and {have}; use weight_sync.backend=gloo (or auto)",
    )
    if e:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(e))


def load_yaml_with_defaults(path: str | Path, _chain: tuple[Path, ...] = ()):
    """Load a YAML file, resolving its ``defaults:`` key first (inheritance between configs).

    ``defaults:`` is a path or a list of paths (relative to the file's directory; a relative one
    that is not there is looked up among the packaged configs as ``--config`` is, so a user's
    YAML can say ``defaults: grpo_bf16_ep.yaml`` with the package installed and no clone); they
    are loaded (recursively) and merged in order, then the file itself on top, so a child only
    states what it changes. Returns an untyped OmegaConf DictConfig.

    Raises:
        FileNotFoundError: the file or a parent does not exist (the chain is named).
        ConfigError: a file that is not UTF-8 text or not valid YAML (the file is named), a cycle
            in the ``defaults:`` chain, or a ``defaults:`` value that is not a path or list of paths.
    """
    path = Path(path).resolve()
    if path in _chain:
        raise ConfigError("defaults: cycle " + " -> ".join(str(p) for p in (*_chain, path)))
    if not path.is_file():
        via = f" (named in defaults: of {_chain[-1]})" if _chain else ""
        raise FileNotFoundError(f"config file not found: {path}{via}")
    import yaml

    try:
        data = OmegaConf.to_container(OmegaConf.load(path)) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML ({' '.join(str(exc).split())})") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte offset {exc.start}); save the file as UTF-8") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    parents = data.pop("defaults", None)
    data = _nest(translate_nemo_rl(_flatten(data)))  # NeMo RL's keys -> this schema's
    if parents is None:
        parents = []
    elif isinstance(parents, str):
        parents = [parents]
    if not isinstance(parents, list) or not all(isinstance(x, str) for x in parents):
        raise ConfigError(f"{path}: defaults={parents!r}: must be a path or a list of paths to YAML files")
    merged = OmegaConf.create({})
    for parent in parents:
        target = path.parent / parent
        if not target.is_file():
            target = packaged_config(Path(parent)) or target
        merged = OmegaConf.merge(merged, load_yaml_with_defaults(target, (*_chain, path)))
    return OmegaConf.merge(merged, OmegaConf.create(data))


def packaged_configs_dir() -> Path:
    """The directory of the configs that ship with the package.

    An installed wheel holds them in ``m3_rollout/configs`` (pyproject.toml maps the repository's
    top-level ``configs/`` there, so that folder stays the one source); a source checkout or an
    editable install reads the repository's ``configs/`` itself.
    """
    here = Path(__file__).resolve().parent
    installed = here / "configs"
    return installed if installed.is_dir() else here.parent / "configs"


def packaged_config(name: Path) -> Path | None:
    """The packaged config a relative ``name`` means (a leading ``configs/`` dropped, ``.yaml``
    added when it has no suffix), or None (absolute, or no such file)."""
    if name.is_absolute() or ".." in name.parts:  # only files inside the packaged configs
        return None
    parts = name.parts[1:] if name.parts[:1] == ("configs",) else name.parts
    if not parts:
        return None
    candidate = packaged_configs_dir().joinpath(*parts)
    if candidate.suffix == "":
        candidate = candidate.with_suffix(".yaml")
    return candidate if candidate.is_file() else None


def resolve_config_path(path: str | Path) -> Path:
    """The YAML file that ``--config path`` means.

    A file at ``path`` (relative to the working directory) wins. Otherwise a relative path is
    looked up among the packaged configs (``packaged_configs_dir``), a leading ``configs/`` dropped
    and ``.yaml`` added when the name has no suffix, so ``configs/grpo_bf16_ep.yaml``,
    ``grpo_bf16_ep.yaml`` and ``grpo_bf16_ep`` all name the shipped main-job config when the
    package is installed without a clone. ``defaults:`` inside a packaged config then resolve
    next to it.

    Raises:
        FileNotFoundError: neither exists; the message lists the packaged config names.
    """
    given = Path(path).expanduser()
    if given.is_file():
        return given
    found = packaged_config(given)
    if found is not None:
        return found
    packaged = packaged_configs_dir()
    names = sorted(p.relative_to(packaged).as_posix() for p in packaged.rglob("*.yaml")) if packaged.is_dir() else []
    raise FileNotFoundError(
        f"config file not found: {given.resolve()} (nor among the packaged configs in {packaged}: "
        f"{', '.join(names) or 'none'}); give a YAML path or one of those names"
    )


def _suggest_key(schema, key: str) -> str:
    """ ", did you mean 'x.y'?" for the closest existing key, or "".

    A key whose last part is the name of existing keys (a bare ``lr``, or ``optimizer.lr`` without
    its section) gets those full keys (``policy.optimizer.lr``; several: "one of ..."). Otherwise
    each dotted part that is not a key of its section is replaced by the closest one there, so a
    typo in a section name (``polcy.model_name``) is corrected as one in a leaf key is; no
    suggestion when some part has no close key or the corrected key does not exist.
    """
    import difflib

    last = key.split(".")[-1]
    named = [k for k, _ in _walk(OmegaConf.to_container(schema, resolve=False)) if k.split(".")[-1] == last]
    if len(named) == 1:
        return f", did you mean {named[0]!r}?"
    if named:
        return f", did you mean one of {', '.join(repr(k) for k in named)}?"
    node, fixed = schema, []
    for part in key.split("."):
        if not OmegaConf.is_dict(node):
            return ""
        names = [str(k) for k in node.keys()]
        if part not in names:
            close = difflib.get_close_matches(part, names, n=1)
            if not close:
                return ""
            part = close[0]
        fixed.append(part)
        try:
            node = node[part]
        except OmegaConfBaseException:  # e.g. an interpolation naming no key on the way: no suggestion
            return ""
    return f", did you mean {'.'.join(fixed)!r}?"


# ------------------------------------------------------------------------ NeMo RL's keys
def _rejected(why: str) -> Callable[[Any], list[tuple[str, Any]]]:
    def reject(value: Any) -> list[tuple[str, Any]]:
        raise ConfigError(why)

    return reject


def _rename(key: str, convert: Callable[[Any], Any] = lambda v: v) -> Callable[[Any], list[tuple[str, Any]]]:
    return lambda value: [(key, convert(value))]


def _is_type(value: Any) -> list[tuple[str, Any]]:
    kinds = {"tis": "tis", "icepop": "mis"}
    if value not in kinds:
        raise ConfigError(
            f"loss_fn.truncated_importance_sampling_type={value!r}: this loss has 'tis' (clamp above "
            f"loss_fn.truncated_importance_sampling_ratio) and 'icepop' (= loss_fn.importance_sampling_type=mis, "
            f"tokens outside [mis_ratio_min, mis_ratio_max] dropped); no untruncated or sequence-level weights"
        )
    return [("loss_fn.importance_sampling_type", kinds[value])]


def _betas(value: Any) -> list[tuple[str, Any]]:
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise ConfigError(f"policy.optimizer.kwargs.betas={value!r}: must be [beta1, beta2]")
    return [("policy.optimizer.beta1", value[0]), ("policy.optimizer.beta2", value[1])]


def _logprobs_mode(value: Any) -> list[tuple[str, Any]]:
    modes = {"processed_logprobs": "processed", "raw_logprobs": "raw"}
    if value not in modes:
        raise ConfigError(
            f"policy.generation.vllm_cfg.logprobs_mode={value!r}: 'processed_logprobs' or 'raw_logprobs' "
            "(policy.generation.logprobs_mode=processed | raw)"
        )
    return [("policy.generation.logprobs_mode", modes[value])]


#: NeMo RL's config keys for the concepts both have (``docs/metrics.md`` lists them): each maps the
#: value to this schema's (key, value) pairs, or raises ConfigError naming the key to use instead.
#: Applied to every YAML file and to the command-line overrides before the schema sees them.
NEMO_RL_KEYS: dict[str, Callable[[Any], list[tuple[str, Any]]]] = {
    "grpo.max_val_samples": _rename("grpo.num_val_prompts"),
    "grpo.val_batch_size": _rejected(
        "grpo.val_batch_size: held-out prompts are generated in one batch; grpo.num_val_prompts sets how many"
    ),
    "grpo.max_num_epochs": _rejected(
        "grpo.max_num_epochs: prompt batches are drawn without epochs; grpo.max_num_steps ends the run"
    ),
    "policy.refit_buffer_size_gb": _rename("weight_sync.bucket_size_mb", lambda gb: float(gb) * 1024),
    "policy.dtensor_cfg.activation_checkpointing": _rename("policy.activation_checkpointing"),
    "policy.optimizer.kwargs.lr": _rename("policy.optimizer.lr"),
    "policy.optimizer.kwargs.weight_decay": _rename("policy.optimizer.weight_decay"),
    "policy.optimizer.kwargs.eps": _rename("policy.optimizer.eps"),
    "policy.optimizer.kwargs.betas": _betas,
    "policy.generation.vllm_cfg.enforce_eager": _rename("policy.generation.enable_cuda_graphs", lambda v: not v),
    "policy.generation.vllm_cfg.max_model_len": _rename("policy.max_total_sequence_length"),
    "policy.generation.vllm_cfg.expert_parallel_size": _rename("policy.generation.expert_parallel_size"),
    "policy.generation.vllm_cfg.precision": _rename("policy.generation.dtype"),
    "policy.generation.vllm_cfg.logprobs_mode": _logprobs_mode,
    "policy.generation.vllm_cfg.gpu_memory_utilization": _rejected(
        "policy.generation.vllm_cfg.gpu_memory_utilization: this engine sizes only its KV cache, after the "
        "weights are loaded: policy.generation.kv_cache_memory_fraction (of the free memory) or "
        "policy.generation.kv_cache_memory_gb"
    ),
    "policy.generation.vllm_cfg.tensor_parallel_size": _rejected(
        "policy.generation.vllm_cfg.tensor_parallel_size: the engine has no tensor parallelism; it shards the "
        "experts: policy.generation.expert_parallel_size"
    ),
    "policy.generation.colocated.enabled": _rejected(
        "policy.generation.colocated.enabled: the engine is colocated with the trainer when "
        "policy.generation.expert_parallel_size=1 (with cluster.launcher=auto, or "
        "policy.generation.colocated_placement=worker_process for a worker process on cluster.device); "
        "policy.generation.sleep_level hands its memory to the trainer"
    ),
    "loss_fn.truncated_importance_sampling_type": _is_type,
    "loss_fn.kl_input_clamp_value": _rejected(
        "loss_fn.kl_input_clamp_value: the KL estimate is not clamped here (loss_fn.reference_policy_kl_type)"
    ),
    "loss_fn.kl_output_clamp_value": _rejected(
        "loss_fn.kl_output_clamp_value: the KL estimate is not clamped here (loss_fn.reference_policy_kl_type)"
    ),
}


def translate_nemo_rl(items: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """(dotted key, value) pairs of one source (a YAML file or the overrides) with NeMo RL's keys
    (``NEMO_RL_KEYS``) replaced by this schema's; other pairs pass unchanged, in order.

    NeMo RL's truncated importance sampling reads two keys together: with
    ``truncated_importance_sampling_type=icepop`` in the same source, its
    ``truncated_importance_sampling_ratio`` / ``_ratio_min`` are the band (``mis_ratio_max`` /
    ``mis_ratio_min``); with ``tis`` the lower bound must be 0 or null (this TIS only clamps above).
    A null ratio (NeMo RL: no truncation; the type is then ignored, so a null type is too) is
    accepted only beside ``use_importance_sampling_correction: false`` in the same source.

    Raises:
        ConfigError: a NeMo RL key this schema rejects, naming the key to use.
    """
    return [(k, v) for _, k, v in _translate(items)]


def _translate(items: list[tuple[str, Any]]) -> list[tuple[int, str, Any]]:
    """``translate_nemo_rl`` with the index of the input pair each output pair came from."""
    given = dict(items)
    icepop = given.get("loss_fn.truncated_importance_sampling_type") == "icepop"
    # NeMo RL's null ratio = no truncation, and then it ignores the type: with the correction off in
    # the same source (its default loss_fn section) there is nothing to translate
    no_truncation = "loss_fn.truncated_importance_sampling_ratio" in given and (
        given["loss_fn.truncated_importance_sampling_ratio"] is None
    )
    out: list[tuple[int, str, Any]] = []
    for i, (key, value) in enumerate(items):
        if key == "loss_fn.truncated_importance_sampling_ratio" and value is None:
            if given.get("loss_fn.use_importance_sampling_correction") is not False:
                raise ConfigError(
                    "loss_fn.truncated_importance_sampling_ratio=null (NeMo RL: untruncated importance weights): "
                    "this loss always truncates them: give a ratio > 0 (default 2.0), or set "
                    "loss_fn.use_importance_sampling_correction=false next to it (the weights are then only reported)"
                )
        elif key == "loss_fn.truncated_importance_sampling_type" and value is None and no_truncation:
            pass
        elif key == "loss_fn.truncated_importance_sampling_ratio" and icepop:
            out.append((i, "loss_fn.mis_ratio_max", value))
        elif key == "loss_fn.truncated_importance_sampling_ratio_min":
            if icepop:
                out.append((i, "loss_fn.mis_ratio_min", value))
            elif value not in (None, 0, 0.0):
                raise ConfigError(
                    f"loss_fn.truncated_importance_sampling_ratio_min={value!r}: TIS here clamps above only; for a "
                    "band use loss_fn.importance_sampling_type=mis with loss_fn.mis_ratio_min / mis_ratio_max"
                )
        elif key in NEMO_RL_KEYS:
            out += [(i, k, v) for k, v in NEMO_RL_KEYS[key](value)]
        else:
            out.append((i, key, value))
    return out


def _walk(node: dict, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted key, value) of every key of a nested mapping, in order: a section (its value the
    mapping) comes right before its keys."""
    for k, v in node.items():
        key = f"{prefix}{k}"
        yield key, v
        if isinstance(v, dict):
            yield from _walk(v, key + ".")


def _flatten(node: dict) -> list[tuple[str, Any]]:
    """(dotted key, leaf value) pairs of a nested mapping; an empty mapping is a leaf."""
    return [(key, v) for key, v in _walk(node) if not (isinstance(v, dict) and v)]


def _nest(items: list[tuple[str, Any]]) -> dict:
    """The nested mapping of (dotted key, value) pairs (inverse of ``_flatten``)."""
    root: dict = {}
    for key, value in items:
        *parents, leaf = key.split(".")
        node = root
        for p in parents:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"config key {key!r}: {p!r} is a value, not a section")
        node[leaf] = value
    return root


def _override_value(text: str) -> Any:
    """An override's value as OmegaConf's command-line grammar reads it (true -> True, 1e-3 ->
    0.001, [a, b] -> a list, null -> None, anything else a string)."""
    return OmegaConf.to_container(OmegaConf.from_dotlist([f"v={text}"]))["v"]


def _override_text(value: Any) -> str:
    """``value`` written back in OmegaConf's command-line grammar (inverse of ``_override_value``)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_override_text(v) for v in value) + "]"
    return str(value)


def parse_overrides(schema, overrides: list[str] | tuple[str, ...]) -> list[str]:
    """``key=value`` overrides, Hydra-style, as plain ``key=value`` strings for ``schema``.

    ``key=value`` sets an existing key; ``++key=value`` sets it too (Hydra: add or override);
    ``+key=value`` adds a key that must not exist yet: every key of this typed schema exists with
    its default, so ``+`` of a known key is an error (use ``key=`` or ``++key=``) and ``+`` of an
    unknown key is the unknown-key error (a typed schema takes no new keys). ``~key`` (Hydra's
    delete) is refused the same way. NeMo RL's keys are translated first (``translate_nemo_rl``).

    Raises:
        ConfigError: a malformed override, an unknown key (with the closest key), ``+`` of an
            existing key, ``~``, or a rejected NeMo RL key.
    """
    parsed: list[tuple[str, str, Any]] = []  # (mode, key, value)
    for item in overrides:
        mode = "++" if item.startswith("++") else "+" if item.startswith("+") else "~" if item.startswith("~") else ""
        body = item[len(mode) :]
        if mode == "~":
            raise ConfigError(
                f"override {item!r}: keys cannot be deleted from this typed schema; set the key to the value you want"
            )
        if "=" not in body:
            raise ConfigError(f"override {item!r} is not of the form key=value (e.g. grpo.max_num_steps=5)")
        key, text = body.split("=", 1)
        parsed.append((mode, key.strip(), text))
    out = []
    for i, k, v in _translate([(key, _override_value(text)) for _, key, text in parsed]):
        mode, key, text = parsed[i]
        exists = OmegaConf.select(schema, k, default="__missing__") != "__missing__"
        item = f"{mode}{key}={text}"
        if not exists:
            why = "; a typed schema takes no new keys (+ and ++ add none)" if mode else ""
            raise ConfigError(
                f"unknown config key {k!r} in override {item!r}{_suggest_key(schema, k)}{why}; "
                f"see m3_rollout/config.py for the keys"
            )
        if mode == "+":
            raise ConfigError(
                f"override {item!r}: '+' adds a key that must not exist, and {k!r} exists (every key of this "
                f"typed schema does, with its default): use {k}=... or ++{k}=..."
            )
        out.append(f"{k}={text}" if k == key else f"{k}={_override_text(v)}")  # a key of ours: as written
    return out


def load_config(
    path: str | Path | None, overrides: list[str] | tuple[str, ...] = (), training: bool = True
) -> MasterConfig:
    """Load a YAML config, apply ``key=value`` overrides, type-check and validate.

    Args:
        path: YAML file in the layout of :class:`MasterConfig` (may inherit others through
            ``defaults:``, see ``load_yaml_with_defaults``), found as ``resolve_config_path``
            says (a packaged config by name when no such file exists); None starts from the
            defaults.
        overrides: dotted ``key=value`` strings, e.g. ``grpo.max_num_steps=5``.
        training: False for a command that trains nothing (``dump generate``; :func:`validate`).

    Returns:
        A :class:`MasterConfig` instance (plain dataclasses, no OmegaConf objects).

    Raises:
        ConfigError: unknown key, wrong type, malformed override or out-of-range value.
        FileNotFoundError: ``path`` is neither a file nor a packaged config name.
    """
    schema = OmegaConf.structured(MasterConfig)
    try:
        if path is not None:
            schema = OmegaConf.merge(schema, load_yaml_with_defaults(resolve_config_path(path)))
        overrides = parse_overrides(schema, overrides)
        if overrides:
            schema = OmegaConf.merge(schema, OmegaConf.from_dotlist(list(overrides)))
    except ConfigKeyError as exc:  # a key of the YAML file (overrides are checked in parse_overrides)
        hint = _suggest_key(OmegaConf.structured(MasterConfig), str(exc.full_key)) if exc.full_key else ""
        raise ConfigError(
            f"unknown config key: {exc.full_key or exc}{hint}; see m3_rollout/config.py for the keys"
        ) from None
    except ValidationError as exc:
        if exc.full_key:
            raise ConfigError(_bad_value_message(str(exc.full_key), str(exc.msg).splitlines()[0])) from None
        # e.g. "grpo: 5": OmegaConf names the section's class, not its key.
        text = str(exc).splitlines()[0]
        cls = re.search(r"subclass of (\w+)", text)
        section = _section_of(cls.group(1)) if cls else None
        where = f"section {section!r} must be a mapping of keys: " if section else ""
        raise ConfigError(f"bad value: {where}{text}") from None
    except OmegaConfBaseException as exc:
        raise ConfigError(f"config error: {exc}") from None
    try:
        cfg: MasterConfig = OmegaConf.to_object(schema)  # type: ignore[assignment]
    except OmegaConfBaseException as exc:  # e.g. an interpolation ${...} naming no key
        raise ConfigError(f"config error: {' '.join(str(exc).split())}") from None
    validate(cfg, training)
    return cfg


def to_dict(cfg: MasterConfig) -> dict:
    """Plain nested dict of the config (for logging and checkpoint metadata)."""
    return dataclasses.asdict(cfg)

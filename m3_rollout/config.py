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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError


class ConfigError(ValueError):
    """A configuration key is unknown, has the wrong type, or is out of range."""


@dataclass
class GRPOConfig:
    num_prompts_per_step: int = 16
    num_generations_per_prompt: int = 8
    max_num_steps: int = 60
    # Tool-use turns per trajectory: a turn is one model generation; a tool call adds a turn.
    max_rollout_turns: int = 2
    normalize_rewards: bool = True
    use_leave_one_out_baseline: bool = False
    val_period: int = 10
    val_at_start: bool = True
    val_at_end: bool = True
    num_val_prompts: int = 256
    # Held-out accuracy is measured by sampling at this temperature, one sample per prompt.
    val_temperature: float = 1.0
    seed: int = 42


@dataclass
class LossConfig:
    ratio_clip_min: float = 0.2
    ratio_clip_max: float = 0.2
    # True: loss = sum over all generated tokens / number of generated tokens in the global batch.
    token_level_loss: bool = True
    reference_policy_kl_penalty: float = 0.0


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


@dataclass
class GenerationConfig:
    backend: str = "native"
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 = off
    # Tokens one turn may generate; the whole trajectory is also capped by
    # policy.max_total_sequence_length.
    max_new_tokens: int = 48
    logprobs_mode: str = "processed"
    dtype: str = "bfloat16"
    expert_parallel_size: int = 1
    max_num_seqs: int = 256


@dataclass
class PolicyConfig:
    # "builtin:tiny-calculator" builds (or finds in the cache) the embedded tiny M3 checkpoint;
    # anything else is a path to a checkpoint directory (config.json + safetensors + tokenizer).
    model_name: str = "builtin:tiny-calculator"
    # Truncation policy: a trajectory stops with finish_reason "length" once prompt + generated +
    # tool tokens reach this many tokens; a tool turn that would overflow is cut and the
    # trajectory ends there. Truncated trajectories keep their tokens and get reward 0 unless
    # they already answered.
    max_total_sequence_length: int = 192
    precision: str = "float32"  # trainer (master weights) dtype
    train_global_batch_size: int = 128
    train_micro_batch_size: int = 64
    max_grad_norm: float = 1.0
    thinking_mode: str = "disabled"
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    freeze: FreezeConfig = field(default_factory=FreezeConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)


@dataclass
class DataConfig:
    # "calculator" = the built-in generator of arithmetic prompts; or a JSONL path whose records
    # have "messages" or "prompt" plus "answer".
    source: str = "calculator"
    path: Optional[str] = None
    min_digits: int = 2
    max_digits: int = 4
    operations: str = "+-*"


@dataclass
class CalculatorEnvConfig:
    max_expression_chars: int = 64
    timeout_s: float = 1.0


@dataclass
class EnvConfig:
    calculator: CalculatorEnvConfig = field(default_factory=CalculatorEnvConfig)


@dataclass
class WandbConfig:
    project: str = "m3-rollout"
    name: str = "grpo-tiny-m3"
    # auto: online when WANDB_API_KEY is set, offline otherwise; "disabled" turns wandb off.
    mode: str = "auto"


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


@dataclass
class ClusterConfig:
    num_nodes: int = 1
    gpus_per_node: int = 0
    ray_address: Optional[str] = None


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


_CHOICES = {
    "policy.generation.backend": ("native",),
    "policy.generation.logprobs_mode": ("processed", "raw"),
    "policy.generation.dtype": ("float32", "bfloat16", "float16"),
    "policy.precision": ("float32", "float64"),
    "policy.thinking_mode": ("disabled", "enabled", "adaptive"),
    "policy.optimizer.name": ("adamw",),
    "logger.wandb.mode": ("auto", "online", "offline", "disabled"),
}


def _check(errors: list[str], ok: bool, key: str, value: Any, allowed: str) -> None:
    if not ok:
        errors.append(f"{key}={value!r}: {allowed}")


def validate(cfg: MasterConfig) -> None:
    """Check ranges and cross-key rules.

    Raises:
        ConfigError: listing every violation as ``key=value: allowed``.
    """
    e: list[str] = []
    g, p, gen = cfg.grpo, cfg.policy, cfg.policy.generation
    for key, choices in _CHOICES.items():
        value = OmegaConf.select(OmegaConf.structured(cfg), key)
        _check(e, value in choices, key, value, f"must be one of {list(choices)}")
    for key in ("num_prompts_per_step", "num_generations_per_prompt", "max_rollout_turns",
                "val_period", "num_val_prompts"):
        value = getattr(g, key)
        _check(e, value >= 1, f"grpo.{key}", value, "must be >= 1")
    _check(e, g.max_num_steps >= 0, "grpo.max_num_steps", g.max_num_steps, "must be >= 0")
    _check(e, g.val_temperature > 0, "grpo.val_temperature", g.val_temperature, "must be > 0")
    _check(e, gen.temperature > 0, "policy.generation.temperature", gen.temperature,
           "must be > 0 (use a small value such as 1e-3 for near-greedy)")
    _check(e, 0 < gen.top_p <= 1, "policy.generation.top_p", gen.top_p, "must be in (0, 1]")
    _check(e, gen.top_k == -1 or gen.top_k >= 1, "policy.generation.top_k", gen.top_k,
           "must be -1 (off) or >= 1")
    _check(e, gen.max_new_tokens >= 1, "policy.generation.max_new_tokens", gen.max_new_tokens,
           "must be >= 1")
    _check(e, gen.max_num_seqs >= 1, "policy.generation.max_num_seqs", gen.max_num_seqs, "must be >= 1")
    _check(e, gen.expert_parallel_size == 1, "policy.generation.expert_parallel_size",
           gen.expert_parallel_size, "only 1 is supported until expert parallelism lands")
    _check(e, p.max_total_sequence_length >= 16, "policy.max_total_sequence_length",
           p.max_total_sequence_length, "must be >= 16")
    _check(e, p.train_micro_batch_size >= 1, "policy.train_micro_batch_size",
           p.train_micro_batch_size, "must be >= 1")
    total = g.num_prompts_per_step * g.num_generations_per_prompt
    _check(e, p.train_global_batch_size >= 1 and total % p.train_global_batch_size == 0,
           "policy.train_global_batch_size", p.train_global_batch_size,
           f"must divide num_prompts_per_step * num_generations_per_prompt = {total}")
    _check(e, p.optimizer.lr > 0, "policy.optimizer.lr", p.optimizer.lr, "must be > 0")
    _check(e, p.max_grad_norm > 0, "policy.max_grad_norm", p.max_grad_norm, "must be > 0")
    for key in ("ratio_clip_min", "ratio_clip_max"):
        value = getattr(cfg.loss_fn, key)
        _check(e, 0 <= value < 1, f"loss_fn.{key}", value, "must be in [0, 1)")
    _check(e, cfg.loss_fn.reference_policy_kl_penalty == 0.0, "loss_fn.reference_policy_kl_penalty",
           cfg.loss_fn.reference_policy_kl_penalty, "only 0.0 is supported so far")
    d = cfg.data
    _check(e, d.source in ("calculator", "jsonl"), "data.source", d.source,
           "must be 'calculator' (built-in generator) or 'jsonl' (with data.path)")
    _check(e, d.source != "jsonl" or bool(d.path), "data.path", d.path,
           "must name a JSONL file when data.source=jsonl")
    _check(e, 1 <= d.min_digits <= d.max_digits <= 9, "data.min_digits/max_digits",
           (d.min_digits, d.max_digits), "need 1 <= min_digits <= max_digits <= 9")
    _check(e, bool(d.operations) and set(d.operations) <= set("+-*"), "data.operations",
           d.operations, "a non-empty subset of '+-*'")
    if e:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(e))


def load_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> MasterConfig:
    """Load a YAML config, apply ``key=value`` overrides, type-check and validate.

    Args:
        path: YAML file in the layout of :class:`MasterConfig`; None starts from the defaults.
        overrides: dotted ``key=value`` strings, e.g. ``grpo.max_num_steps=5``.

    Returns:
        A :class:`MasterConfig` instance (plain dataclasses, no OmegaConf objects).

    Raises:
        ConfigError: unknown key, wrong type, malformed override or out-of-range value.
        FileNotFoundError: ``path`` does not exist.
    """
    schema = OmegaConf.structured(MasterConfig)
    try:
        if path is not None:
            path = Path(path)
            if not path.is_file():
                raise FileNotFoundError(f"config file not found: {path}")
            schema = OmegaConf.merge(schema, OmegaConf.load(path))
        for item in overrides:
            if "=" not in item:
                raise ConfigError(f"override {item!r} is not of the form key=value (e.g. grpo.max_num_steps=5)")
            key = item.split("=", 1)[0].strip()
            if OmegaConf.select(schema, key, default="__missing__") == "__missing__":
                raise ConfigError(f"unknown config key {key!r} in override {item!r}; "
                                  f"see m3_rollout/config.py for the keys")
        if overrides:
            schema = OmegaConf.merge(schema, OmegaConf.from_dotlist(list(overrides)))
    except ConfigKeyError as exc:
        raise ConfigError(f"unknown config key: {exc.full_key or exc}; see m3_rollout/config.py "
                          f"for the keys") from None
    except ValidationError as exc:
        raise ConfigError(f"bad value for {exc.full_key}: {str(exc.msg).splitlines()[0]}") from None
    except OmegaConfBaseException as exc:
        raise ConfigError(f"config error: {exc}") from None
    cfg: MasterConfig = OmegaConf.to_object(schema)  # type: ignore[assignment]
    validate(cfg)
    return cfg


def to_dict(cfg: MasterConfig) -> dict:
    """Plain nested dict of the config (for logging and checkpoint metadata)."""
    return dataclasses.asdict(cfg)

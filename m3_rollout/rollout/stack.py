"""The rollout side of a run, built once from the config: checkpoint, chat format, generation
backend, environment, prompts and sampling settings.

Governing idea: the GRPO loop (``m3_rollout.grpo``), ``python -m m3_rollout.dump generate`` and
the offline replay all need the same pieces built the same way (same per-step seed formula, same
backend choice), so a dump made without training means what one made during training does.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch

from m3_rollout.chat.template import ChatFormat
from m3_rollout.chat.tokenizer import load_tokenizer
from m3_rollout.engine.interface import GenerationBackend
from m3_rollout.rollout.data import PromptSource, load_jsonl
from m3_rollout.rollout.environment import Environment
from m3_rollout.rollout.group_rollout import RolloutSettings


def batch_seed(cfg, b: int) -> int:
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

    def settings_for(self, cfg, b: int) -> RolloutSettings:
        """Sampling settings of prompt batch ``b``."""
        return replace(self.settings, seed=batch_seed(cfg, b))


def build_policy(cfg, model, total_opt_steps: int):
    """The trainer's ``Policy`` as every entry point builds it (optimizer, schedule, freeze policy)."""
    from m3_trainers.policy import Policy

    p = cfg.policy
    return Policy(
        model,
        lr=p.optimizer.lr,
        weight_decay=p.optimizer.weight_decay,
        betas=(p.optimizer.beta1, p.optimizer.beta2),
        eps=p.optimizer.eps,
        max_grad_norm=p.max_grad_norm,
        freeze_indexer=p.freeze.indexer,
        freeze_router_bias=p.freeze.router_bias,
        freeze_patterns=p.freeze.patterns,
        warmup_steps=p.scheduler.warmup_steps,
        lr_schedule=p.scheduler.name,
        total_steps=total_opt_steps,
        min_lr_ratio=p.scheduler.min_lr_ratio,
        reference_model=cfg.loss_fn.reference_policy_kl_penalty > 0,
        routing_replay=p.routing_replay,
    )


def build_rollout_stack(cfg, with_backend: bool = True, model_name: str | None = None) -> RolloutStack:
    """Resolve the checkpoint and build the rollout pieces of ``cfg`` (a ``MasterConfig``).

    The backend is the EP rollout service when ``policy.generation.expert_parallel_size > 1`` or a
    launcher is configured (``m3_rollout/service``), else the in-process native engine; with
    ``with_backend=False`` none is built (replay / inspection). ``model_name`` overrides
    ``policy.model_name``. Raises ConfigError / ValueError from the pieces on bad settings.
    """
    from m3_rollout.builtin import resolve_model
    from m3_rollout.engine.native_backend import NativeBackend
    from m3_rollout.model import load_checkpoint
    from m3_rollout.model.configuration import M3Config
    from m3_rollout.rollout.environments import build_environment
    from m3_rollout.rollout.environments.calculator import ArithmeticTask
    from m3_rollout.service.factory import build_rollout_service

    g, p, gen, d = cfg.grpo, cfg.policy, cfg.policy.generation, cfg.data
    model_dir, info = resolve_model(model_name or p.model_name, progress=cfg.logger.progress_bar)
    chat = ChatFormat(load_tokenizer(model_dir), thinking_mode=p.thinking_mode)
    max_len = min(p.max_total_sequence_length, M3Config.from_pretrained(str(model_dir)).max_position_embeddings)
    backend = None
    if with_backend:
        backend = build_rollout_service(cfg, model_dir, chat.stop_token_ids, max_len)
        if backend is None:
            model = load_checkpoint(model_dir, dtype=torch.float32).cast_for_inference(getattr(torch, gen.dtype))
            backend = NativeBackend(
                model,
                chat.stop_token_ids,
                max_model_len=max_len,
                max_num_seqs=gen.max_num_seqs,
                detokenize=chat.decode,
                record_routing=p.routing_replay,
                **gen.engine_kwargs(),
            )
    task = ArithmeticTask(d.min_digits, d.max_digits, d.operations) if d.source == "calculator" else None
    source = PromptSource(task, g.seed, g.num_val_prompts, records=load_jsonl(d.path) if d.source == "jsonl" else None)
    settings = RolloutSettings(
        n=g.num_generations_per_prompt,
        max_turns=g.max_rollout_turns,
        max_total_len=max_len,
        max_new_tokens=gen.max_new_tokens,
        temperature=gen.temperature,
        top_p=gen.top_p,
        top_k=gen.top_k,
        logprobs_mode=gen.logprobs_mode,
        mask_truncated_turns=cfg.env.mask_truncated_turns,
    )
    return RolloutStack(Path(model_dir), info, chat, max_len, backend, build_environment(cfg.env), source, settings)

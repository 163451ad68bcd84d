"""Supervised warm start of the embedded tiny M3 on calculator demonstrations.

Governing idea: GRPO needs a policy that succeeds sometimes, not always. We fine-tune a randomly
initialised tiny M3 on perfect demonstrations (tool call -> tool result -> answer) and stop as
soon as *sampled* success (temperature 1, one sample per prompt) on the fixed held-out set
enters a target window (default 0.25-0.45), leaving room for RL to improve. If one evaluation
interval overshoots the window, we return to the last snapshot below it and evaluate more often.
"""

from __future__ import annotations

import copy
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from m3_rollout.chat.template import ChatFormat
from m3_rollout.model import M3ForCausalLM
from m3_rollout.rollout.environments.calculator import ArithmeticTask, CalculatorEnvironment
from m3_trainers.policy import split_param_groups, token_logprobs


@dataclass
class WarmStartConfig:
    """SFT knobs (all part of the checkpoint cache key)."""

    batch_size: int = 64
    lr: float = 3e-3
    warmup_steps: int = 20
    weight_decay: float = 0.01
    max_steps: int = 3000
    max_seconds: float = 900.0  # safety cap: ~180 s on 2 idle Xeon cores; a loaded machine may need 2-3x
    eval_every: int = 50
    target_low: float = 0.25
    target_high: float = 0.45
    seed: int = 0


def demonstration(chat: ChatFormat, env: CalculatorEnvironment, record: dict) -> tuple[list[int], list[int]]:
    """Token ids and loss mask of one perfect episode: call the calculator, then answer.

    Returns:
        (ids [L], mask [L]) with mask 1 on the assistant's tokens (both turns, eos included).
    """
    messages, _ = env.reset(record)
    prompt = chat.prompt_ids(messages, tools=env.tool_schemas())
    call = {
        "type": "function",
        "function": {"name": "calculator", "arguments": json.dumps({"expression": record["expression"]})},
    }
    turn1 = chat.assistant_ids(content="", tool_calls=[call])
    tool = chat.tool_turn_ids([record["answer"]])
    turn2 = chat.assistant_ids(content=record["answer"])
    ids = prompt + turn1 + tool + turn2
    mask = [0] * len(prompt) + [1] * len(turn1) + [0] * len(tool) + [1] * len(turn2)
    return ids, mask


def _pad(seqs: list[tuple[list[int], list[int]]]) -> tuple[torch.Tensor, torch.Tensor]:
    l = max(len(ids) for ids, _ in seqs)
    ids_t = torch.zeros((len(seqs), l), dtype=torch.long)
    mask_t = torch.zeros((len(seqs), l))
    for i, (ids, mask) in enumerate(seqs):
        ids_t[i, : len(ids)] = torch.tensor(ids)
        mask_t[i, : len(ids)] = torch.tensor(mask, dtype=torch.float32)
    return ids_t, mask_t


@dataclass
class WarmStartResult:
    steps: int
    accuracy: float
    history: list[tuple[int, float]] = field(default_factory=list)
    seconds: float = 0.0
    in_window: bool = False


def warm_start(
    model: M3ForCausalLM,
    chat: ChatFormat,
    task: ArithmeticTask,
    env: CalculatorEnvironment,
    evaluate: Callable[[M3ForCausalLM], float],
    cfg: WarmStartConfig,
    exclude: set[str] | frozenset = frozenset(),
    progress: Callable[[int, float | None, float], None] | None = None,
) -> WarmStartResult:
    """Fine-tune ``model`` in place until ``evaluate(model)`` lands in the target window.

    Args:
        model: fp32 ``M3ForCausalLM`` (trained in place).
        evaluate: returns sampled success in [0, 1] on the held-out prompts.
        exclude: held-out user texts never used as demonstrations.
        progress: called as progress(step, accuracy or None, loss).

    Returns:
        :class:`WarmStartResult`; ``in_window`` False if the step/time budget ran out first (the
        model is then the snapshot whose accuracy was closest to the window).
    """
    t0 = time.perf_counter()
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    groups = split_param_groups(model, freeze_indexer=False, freeze_router_bias=True, weight_decay=cfg.weight_decay)
    opt = torch.optim.AdamW(groups, lr=cfg.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / cfg.warmup_steps))

    def snapshot():
        return copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()), copy.deepcopy(sched.state_dict())

    def restore(snap):
        model.load_state_dict(snap[0])
        opt.load_state_dict(snap[1])
        sched.load_state_dict(snap[2])

    history: list[tuple[int, float]] = []
    model.eval()
    acc = evaluate(model)
    history.append((0, acc))
    best = (abs(acc - (cfg.target_low + cfg.target_high) / 2), 0, snapshot(), acc)
    below = (0, snapshot())  # last snapshot known to be below the window
    eval_every, step = cfg.eval_every, 0
    while not (cfg.target_low <= acc <= cfg.target_high):
        if step >= cfg.max_steps or time.perf_counter() - t0 > cfg.max_seconds:
            restore(best[2])
            return WarmStartResult(best[1], best[3], history, time.perf_counter() - t0, False)
        model.train()
        loss_val = 0.0
        for _ in range(eval_every):
            recs = []
            while len(recs) < cfg.batch_size:
                r = task.record(rng)
                if r["messages"][-1]["content"] not in exclude:
                    recs.append(r)
            ids, mask = _pad([demonstration(chat, env, r) for r in recs])
            lp = token_logprobs(model, ids)
            loss = -(lp * mask).sum() / mask.sum()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1
            loss_val = float(loss.detach())
            if progress:
                progress(step, None, loss_val)
        model.eval()
        acc = evaluate(model)
        history.append((step, acc))
        if progress:
            progress(step, acc, loss_val)
        dist = (
            0.0
            if cfg.target_low <= acc <= cfg.target_high
            else min(abs(acc - cfg.target_low), abs(acc - cfg.target_high))
        )
        if dist < best[0]:
            best = (dist, step, snapshot(), acc)
        if acc < cfg.target_low:
            below = (step, snapshot())
        elif acc > cfg.target_high:
            if eval_every == 1:  # cannot refine further: keep the closest snapshot
                restore(best[2])
                return WarmStartResult(best[1], best[3], history, time.perf_counter() - t0, False)
            # Overshot: go back to the last point below the window and evaluate 4x as often.
            restore(below[1])
            step = below[0]
            eval_every = max(1, eval_every // 4)
    return WarmStartResult(step, acc, history, time.perf_counter() - t0, True)

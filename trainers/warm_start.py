"""Supervised warm start of an embedded M3 on calculator demonstrations (single- or multi-step).

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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from m3_rollout.chat.template import ChatFormat
from m3_rollout.model import M3ForCausalLM
from m3_rollout.rollout.environments.calculator import ArithmeticTask, CalculatorEnvironment, tool_steps
from m3_rollout.rollout.environments.multistep import MultiStepArithmeticTask
from m3_trainers.policy import split_param_groups, token_logprobs


@dataclass
class WarmStartConfig:
    """SFT knobs (all part of the checkpoint cache key)."""

    batch_size: int = 64
    lr: float = 3e-3
    warmup_steps: int = 20
    weight_decay: float = 0.01
    max_steps: int = 3000
    # Safety net, not a budget: checked only between evaluation intervals, so the trained steps follow
    # max_steps / eval_every alone (the same steps on a quiet or a loaded machine); hitting it ends
    # the build outside its window with a warning. ~180 s on 2 idle Xeon cores; on 2 cores at load
    # 3-4 the same steps ran at 12-15 s each (a 900 s cap stopped such a build at step 100,
    # accuracy 0.0, 2026-12-03), so the cap allows ~25x the idle time.
    max_seconds: float = 5400.0
    eval_every: int = 50
    target_low: float = 0.25
    target_high: float = 0.45
    seed: int = 0


def demonstration(chat: ChatFormat, env: CalculatorEnvironment, record: dict) -> tuple[list[int], list[int]]:
    """Token ids and loss mask of one perfect episode: one calculator call per step, then the answer.

    A single-step record gives prompt, call, tool turn, answer; a multi-step record
    (``multistep.MultiStepArithmeticTask``) one call + tool turn per operation, each call's
    expression carrying the previous tool result (``calculator.tool_steps``).

    Returns:
        (ids [L], mask [L]) with mask 1 on the assistant's tokens (every turn, eos included).
    """
    messages, _ = env.reset(record)
    ids = chat.prompt_ids(messages, tools=env.tool_schemas())
    mask = [0] * len(ids)
    for expression, result in tool_steps(record):
        call = {
            "type": "function",
            "function": {"name": "calculator", "arguments": json.dumps({"expression": expression})},
        }
        turn = chat.assistant_ids(content="", tool_calls=[call])
        tool = chat.tool_turn_ids([result])
        ids += turn + tool
        mask += [1] * len(turn) + [0] * len(tool)
    answer = chat.assistant_ids(content=str(record["answer"]))
    return ids + answer, mask + [1] * len(answer)


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
    """Outcome of :func:`warm_start`.

    Attributes:
        steps: SFT steps of the returned model.
        accuracy: its held-out sampled success.
        history: (step, accuracy) of every evaluation, in order.
        seconds: wall time of the whole warm start (training and evaluations).
        in_window: the accuracy is inside the target window (False: step or time cap reached).
        step_seconds: mean wall time of one SFT step (batch building included), seconds.
        eval_seconds: total wall time of the evaluations, seconds.
        time_capped: the wall-clock safety cap ``max_seconds`` ended the warm start (a loaded
            machine); the model is then not the one the step schedule reaches.
    """

    steps: int
    accuracy: float
    history: list[tuple[int, float]] = field(default_factory=list)
    seconds: float = 0.0
    in_window: bool = False
    step_seconds: float = 0.0
    eval_seconds: float = 0.0
    time_capped: bool = False


def warm_start(
    model: M3ForCausalLM,
    chat: ChatFormat,
    task: ArithmeticTask | MultiStepArithmeticTask,
    env: CalculatorEnvironment,
    evaluate: Callable[[M3ForCausalLM], float],
    cfg: WarmStartConfig,
    exclude: set[str] | frozenset = frozenset(),
    progress: Callable[[int, float | None, float | None], None] | None = None,
) -> WarmStartResult:
    """Fine-tune ``model`` in place until ``evaluate(model)`` lands in the target window.

    Trains on the model's device. On CUDA the forward runs under bf16 autocast (fp32 master
    weights and optimizer) and the next batch's demonstrations are rendered on a thread while the
    GPU trains; the batches, and so the CPU results, are the same either way.

    Args:
        model: fp32 ``M3ForCausalLM`` on its training device (trained in place).
        task: the record generator (``ArithmeticTask`` or ``MultiStepArithmeticTask``).
        evaluate: returns sampled success in [0, 1] on the held-out prompts.
        exclude: held-out user texts never used as demonstrations.
        progress: called as progress(step, accuracy or None, loss or None): once after the
            evaluation of the untrained model (step 0, loss None), after every SFT step (accuracy
            None) and after every later evaluation.

    Returns:
        :class:`WarmStartResult`; ``in_window`` False if the step/time budget ran out first (the
        model is then the snapshot whose accuracy was closest to the window, the later one on a tie).
        ``cfg.max_seconds`` is checked only before each interval of ``eval_every`` steps, never
        inside one, so the steps trained and evaluated are those of the step schedule whatever the
        machine's speed; a run it stops has ``time_capped`` True.
    """
    t0 = time.perf_counter()
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    device = next(model.parameters()).device
    cuda = device.type == "cuda"
    groups = split_param_groups(model, freeze_indexer=False, freeze_router_bias=True, weight_decay=cfg.weight_decay)
    opt = torch.optim.AdamW(groups, lr=cfg.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / cfg.warmup_steps))

    def snapshot():
        return copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()), copy.deepcopy(sched.state_dict())

    def restore(snap):
        model.load_state_dict(snap[0])
        opt.load_state_dict(snap[1])
        sched.load_state_dict(snap[2])

    def next_batch() -> tuple[torch.Tensor, torch.Tensor]:
        recs = []
        while len(recs) < cfg.batch_size:
            r = task.record(rng)
            if r["messages"][-1]["content"] not in exclude:
                recs.append(r)
        ids, mask = _pad([demonstration(chat, env, r) for r in recs])
        return (ids.pin_memory(), mask.pin_memory()) if cuda else (ids, mask)

    prefetch = ThreadPoolExecutor(1) if cuda else None
    pending = prefetch.submit(next_batch) if prefetch else None

    def take_batch() -> tuple[torch.Tensor, torch.Tensor]:
        nonlocal pending
        if prefetch is None:
            return next_batch()
        ids, mask = pending.result()
        pending = prefetch.submit(next_batch)
        return ids.to(device, non_blocking=True), mask.to(device, non_blocking=True)

    history: list[tuple[int, float]] = []
    timing = {"steps": 0, "train": 0.0, "eval": 0.0}

    def timed_eval() -> float:
        model.eval()
        te = time.perf_counter()
        a = evaluate(model)
        timing["eval"] += time.perf_counter() - te
        return a

    def result(steps: int, a: float, in_window: bool, time_capped: bool = False) -> WarmStartResult:
        return WarmStartResult(
            steps,
            a,
            history,
            time.perf_counter() - t0,
            in_window,
            timing["train"] / max(timing["steps"], 1),
            timing["eval"],
            time_capped,
        )

    try:
        acc = timed_eval()
        history.append((0, acc))
        if progress:
            progress(0, acc, None)
        best = (abs(acc - (cfg.target_low + cfg.target_high) / 2), 0, snapshot(), acc)
        below = (0, snapshot())  # last snapshot known to be below the window
        eval_every, step = cfg.eval_every, 0
        while not (cfg.target_low <= acc <= cfg.target_high):
            time_capped = time.perf_counter() - t0 > cfg.max_seconds
            if step >= cfg.max_steps or time_capped:
                restore(best[2])
                return result(best[1], best[3], False, time_capped and step < cfg.max_steps)
            model.train()
            loss_val = 0.0
            for _ in range(eval_every):
                ts = time.perf_counter()
                ids, mask = take_batch()
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
                    lp = token_logprobs(model, ids)
                loss = -(lp * mask).sum() / mask.sum()
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                sched.step()
                step += 1
                loss_val = float(loss.detach())
                timing["steps"] += 1
                timing["train"] += time.perf_counter() - ts
                if progress:
                    progress(step, None, loss_val)
            acc = timed_eval()
            history.append((step, acc))
            if progress:
                progress(step, acc, loss_val)
            dist = (
                0.0
                if cfg.target_low <= acc <= cfg.target_high
                else min(abs(acc - cfg.target_low), abs(acc - cfg.target_high))
            )
            if dist <= best[0]:  # a tie keeps the later (more trained) snapshot
                best = (dist, step, snapshot(), acc)
            if acc < cfg.target_low:
                below = (step, snapshot())
            elif acc > cfg.target_high:
                if eval_every == 1:  # cannot refine further: keep the closest snapshot
                    restore(best[2])
                    return result(best[1], best[3], False)
                # Overshot: go back to the last point below the window and evaluate 4x as often.
                restore(below[1])
                step = below[0]
                eval_every = max(1, eval_every // 4)
        return result(step, acc, True)
    finally:
        if prefetch is not None:
            prefetch.shutdown(wait=True, cancel_futures=True)

"""Supervised warm start of an embedded M3 on calculator demonstrations (single- or multi-step).

Governing idea: GRPO needs a policy that succeeds sometimes, not always. We fine-tune a randomly
initialised tiny M3 on perfect demonstrations (tool call -> tool result -> answer) and stop as
soon as *sampled* success (temperature 1, one sample per prompt) on the fixed held-out set
enters a target window (default 0.25-0.45), leaving room for RL to improve. If one evaluation
interval overshoots the window, we return to the last snapshot below it and evaluate more often.

Resumable: everything the loop depends on (weights, optimizer, LR schedule, data position, RNG,
the snapshots it may go back to, the evaluation interval) is one :class:`WarmStartState`, handed to
a ``save`` callback as it goes (``warm_start_progress.ProgressStore`` writes it to disk); a warm
start resumed from it returns the same model as one never interrupted.
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
        seconds: wall time of the whole warm start (training and evaluations; a resumed warm
            start counts the runs before it too).
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


@dataclass
class Snapshot:
    """The trained state at one evaluated step, which the window search may go back to.

    Attributes:
        id: unique within one warm start (a progress store writes each snapshot once, by id).
        step: SFT steps of the snapshot's model.
        accuracy: its held-out accuracy.
        model / optimizer / scheduler: deep copies of the three state dicts.
    """

    id: int
    step: int
    accuracy: float
    model: dict
    optimizer: dict
    scheduler: dict


@dataclass
class WarmStartState:
    """Everything :func:`warm_start` needs to go on where it stopped: its saved progress.

    Taken after every evaluation and every ``save_every`` SFT steps. A warm start resumed from it
    trains the same batches, evaluates at the same steps and goes back to the same snapshots as
    one never stopped, so it returns the same model (bitwise on the CPU).

    Attributes:
        step: SFT steps of the current model (after going back to a snapshot: the snapshot's).
        eval_every: the current evaluation interval (``cfg.eval_every``, quartered at each overshoot).
        interval_end: the step of the next evaluation while an interval is trained; None right
            after an evaluation (the window and cap checks come next).
        accuracy: the latest evaluation's held-out accuracy.
        loss: the latest SFT step's loss (nan before the first).
        history: (step, accuracy) of every evaluation so far.
        best: the snapshot closest to the window (returned when a cap ends the warm start).
        best_distance: its distance to the window (to the window's middle for step 0's).
        below: the latest snapshot below the window (where an overshoot goes back to).
        seconds: wall time spent in the warm start so far, every run of it counted (the time cap
            counts this).
        train_steps / train_seconds / eval_seconds: timing totals (the result's means).
        model / optimizer / scheduler: the current state dicts (references to the live tensors:
            write them out before training on).
        data_rng: ``random.Random.getstate()`` of the demonstration sampler after the batches
            trained so far (a batch prefetched on CUDA and not trained yet is not counted).
        torch_rng: ``torch.get_rng_state()`` (uint8 tensor).
        cuda_rng: the training device's CUDA RNG state, None on the CPU.
    """

    step: int
    eval_every: int
    interval_end: int | None
    accuracy: float
    loss: float
    history: list[tuple[int, float]]
    best: Snapshot
    best_distance: float
    below: Snapshot
    seconds: float
    train_steps: int
    train_seconds: float
    eval_seconds: float
    model: dict
    optimizer: dict
    scheduler: dict
    data_rng: tuple
    torch_rng: torch.Tensor
    cuda_rng: torch.Tensor | None = None

    @property
    def next_snapshot_id(self) -> int:
        """The id of the next snapshot: ids count the snapshots taken (0 at step 0), and the latest
        one taken is always ``best`` or ``below`` (an evaluation takes one only to make it the best,
        or the latest below the window), so it has the highest id of the two."""
        return max(self.best.id, self.below.id) + 1


def warm_start(
    model: M3ForCausalLM,
    chat: ChatFormat,
    task: ArithmeticTask | MultiStepArithmeticTask,
    env: CalculatorEnvironment,
    evaluate: Callable[[M3ForCausalLM], float],
    cfg: WarmStartConfig,
    exclude: set[str] | frozenset = frozenset(),
    progress: Callable[[int, float | None, float | None], None] | None = None,
    resume: WarmStartState | None = None,
    save: Callable[[WarmStartState], None] | None = None,
    save_every: int = 10,
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
            None) and after every later evaluation. A resumed warm start calls it from the step
            it resumes at on.
        resume: progress a ``save`` call got from an earlier, interrupted warm start of the same
            model, task, ``cfg`` and ``exclude`` (the caller checks that): the weights, optimizer,
            schedule, data position and RNG are loaded from it and the warm start goes on from
            ``resume.step`` (step 0's evaluation is not repeated).
        save: called with the progress so far after every evaluation and after every
            ``save_every`` SFT steps (counted over all runs, never right before an evaluation,
            which saves anyway); it must write the state out before returning.
        save_every: SFT steps between two saves inside an evaluation interval (0: at evaluations only).

    Returns:
        :class:`WarmStartResult`; ``in_window`` False if the step/time budget ran out first (the
        model is then the snapshot whose accuracy was closest to the window, the later one on a tie).
        ``cfg.max_seconds`` is checked only before each interval of ``eval_every`` steps, never
        inside one, so the steps trained and evaluated are those of the step schedule whatever the
        machine's speed; a run it stops has ``time_capped`` True.
    """
    t0 = time.perf_counter() - (resume.seconds if resume is not None else 0.0)
    device = next(model.parameters()).device
    cuda = device.type == "cuda"
    groups = split_param_groups(model, freeze_indexer=False, freeze_router_bias=True, weight_decay=cfg.weight_decay)
    opt = torch.optim.AdamW(groups, lr=cfg.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / cfg.warmup_steps))
    rng = random.Random(cfg.seed)
    if resume is None:
        torch.manual_seed(cfg.seed)
    else:
        model.load_state_dict(resume.model)
        opt.load_state_dict(resume.optimizer)
        sched.load_state_dict(resume.scheduler)
        rng.setstate(resume.data_rng)
        torch.set_rng_state(resume.torch_rng)
        if cuda and resume.cuda_rng is not None:
            torch.cuda.set_rng_state(resume.cuda_rng, device)
    mid = (cfg.target_low + cfg.target_high) / 2
    in_window = lambda a: cfg.target_low <= a <= cfg.target_high  # noqa: E731

    def restore(snap: Snapshot) -> None:
        # NOTE: copies: Optimizer.load_state_dict keeps the tensors it is given when their dtype and
        # device already fit, so without them the training after a go-back would update the
        # snapshot's moments in place, and a second go-back to it would get those updated moments.
        model.load_state_dict(snap.model)
        opt.load_state_dict(copy.deepcopy(snap.optimizer))
        sched.load_state_dict(copy.deepcopy(snap.scheduler))

    def next_batch() -> tuple[torch.Tensor, torch.Tensor]:
        recs = []
        while len(recs) < cfg.batch_size:
            r = task.record(rng)
            if r["messages"][-1]["content"] not in exclude:
                recs.append(r)
        ids, mask = _pad([demonstration(chat, env, r) for r in recs])
        return (ids.pin_memory(), mask.pin_memory()) if cuda else (ids, mask)

    # The sampler's state after the batches trained so far (what a save records): on CUDA the
    # thread has already drawn the next batch, so it is taken before each prefetch is submitted.
    data_rng = [rng.getstate()]
    prefetch = ThreadPoolExecutor(1) if cuda else None
    pending = prefetch.submit(next_batch) if prefetch else None

    def take_batch() -> tuple[torch.Tensor, torch.Tensor]:
        nonlocal pending
        if prefetch is None:
            batch = next_batch()
            data_rng[0] = rng.getstate()
            return batch
        ids, mask = pending.result()
        data_rng[0] = rng.getstate()  # the worker is idle: nothing draws until the submit below
        pending = prefetch.submit(next_batch)
        return ids.to(device, non_blocking=True), mask.to(device, non_blocking=True)

    def timed_eval() -> tuple[float, float]:
        """(held-out accuracy, seconds it took)."""
        model.eval()
        te = time.perf_counter()
        a = evaluate(model)
        return a, time.perf_counter() - te

    def snapshot(snap_id: int, step: int, acc: float) -> Snapshot:
        return Snapshot(
            snap_id,
            step,
            acc,
            copy.deepcopy(model.state_dict()),
            copy.deepcopy(opt.state_dict()),
            copy.deepcopy(sched.state_dict()),
        )

    def capture(st: WarmStartState) -> WarmStartState:
        st.seconds = time.perf_counter() - t0
        st.model, st.optimizer, st.scheduler = model.state_dict(), opt.state_dict(), sched.state_dict()
        st.data_rng, st.torch_rng = data_rng[0], torch.get_rng_state()
        st.cuda_rng = torch.cuda.get_rng_state(device) if cuda else None
        return st

    def result(st: WarmStartState, snap: Snapshot | None, time_capped: bool = False) -> WarmStartResult:
        steps, acc = (st.step, st.accuracy) if snap is None else (snap.step, snap.accuracy)
        return WarmStartResult(
            steps,
            acc,
            st.history,
            time.perf_counter() - t0,
            snap is None,
            st.train_seconds / max(st.train_steps, 1),
            st.eval_seconds,
            time_capped,
        )

    try:
        if resume is not None:
            st = resume
        else:
            acc, eval_seconds = timed_eval()
            if progress:
                progress(0, acc, None)
            first = snapshot(0, 0, acc)
            st = WarmStartState(
                step=0,
                eval_every=cfg.eval_every,
                interval_end=None,
                accuracy=acc,
                loss=float("nan"),
                history=[(0, acc)],
                best=first,
                best_distance=abs(acc - mid),
                below=first,
                seconds=0.0,
                train_steps=0,
                train_seconds=0.0,
                eval_seconds=eval_seconds,
                model={},
                optimizer={},
                scheduler={},
                data_rng=rng.getstate(),
                torch_rng=torch.get_rng_state(),
            )
            if save:
                save(capture(st))
        while True:
            if st.interval_end is None:
                if in_window(st.accuracy):
                    return result(st, None)
                time_capped = time.perf_counter() - t0 > cfg.max_seconds
                if st.step >= cfg.max_steps or time_capped:
                    restore(st.best)
                    return result(st, st.best, time_capped and st.step < cfg.max_steps)
                st.interval_end = st.step + st.eval_every
            model.train()
            while st.step < st.interval_end:
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
                st.step += 1
                st.loss = float(loss.detach())
                st.train_steps += 1
                st.train_seconds += time.perf_counter() - ts
                if progress:
                    progress(st.step, None, st.loss)
                if save and save_every and st.train_steps % save_every == 0 and st.step < st.interval_end:
                    save(capture(st))
            acc, eval_seconds = timed_eval()
            st.eval_seconds += eval_seconds
            st.history.append((st.step, acc))
            if progress:
                progress(st.step, acc, st.loss)
            dist = 0.0 if in_window(acc) else min(abs(acc - cfg.target_low), abs(acc - cfg.target_high))
            snap = None
            if dist <= st.best_distance or acc < cfg.target_low:
                snap = snapshot(st.next_snapshot_id, st.step, acc)
            if dist <= st.best_distance:  # a tie keeps the later (more trained) snapshot
                st.best, st.best_distance = snap, dist
            st.accuracy, st.interval_end = acc, None
            if acc < cfg.target_low:
                st.below = snap
            elif acc > cfg.target_high:
                if st.eval_every == 1:  # cannot refine further: keep the closest snapshot
                    restore(st.best)
                    return result(st, st.best)
                # Overshot: go back to the last point below the window and evaluate 4x as often.
                restore(st.below)
                st.step = st.below.step
                st.eval_every = max(1, st.eval_every // 4)
            if save:  # in the window too: a Ctrl-C while the caller writes the result loses nothing
                save(capture(st))
    finally:
        if prefetch is not None:
            prefetch.shutdown(wait=True, cancel_futures=True)

"""Replay a dump: re-score stored trajectories with a checkpoint, or train GRPO on them offline.

Governing idea: a dump holds everything a GRPO step consumes (token ids, loss mask, rollout
logprobs, rewards, advantages), so both jobs skip generation. Re-scoring
(``m3_rollout.dump.replay.rescore``) computes log p(token_t | tokens_<t) at the stored sampling
temperature and compares it with the stored rollout logprobs on sampled tokens. Offline training
feeds each dumped step, in step order, through the GRPO loop's own training step
(``m3_trainers.step.train_step_on_groups``), by default at the LR-schedule position the run trained
it at (:func:`schedule_indices`).

Scoring path: the engine's scoring API (``LLMEngine.score``, design.md §3.2) when the engine
package provides it, else the model forward the trainer uses (``m3_trainers.policy.token_logprobs``).
Both return the same quantity; the report names the one used.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence

import torch

from m3_rollout.config import MasterConfig
from m3_rollout.dump.reader import DumpError, DumpRead
from m3_rollout.dump.records import trajectories_from_rows
from m3_rollout.engine.interface import FINISH_ERROR
from m3_rollout.jobs.step_metrics import rollout_metrics
from m3_rollout.model import M3ForCausalLM
from m3_trainers.loss import ClippedPGLossFn
from m3_trainers.policy import Policy, token_logprobs
from m3_trainers.step import train_step_on_groups


# ---------------------------------------------------------------------------- scorers
class ForwardScorer:
    """Token logprobs from one full forward per micro-batch (``m3_trainers.policy.token_logprobs``).

    Args:
        model: ``M3ForCausalLM`` (fp32 or fp64 for exact comparisons).
        micro_batch_size: rows per forward.
    """

    name = "model-forward"

    def __init__(self, model: M3ForCausalLM, micro_batch_size: int = 16):
        self.model = model.eval()
        self.micro_batch_size = micro_batch_size

    @torch.no_grad()
    def score(self, seqs: Sequence[Sequence[int]], temperature: float) -> list[list[float]]:
        """Per sequence, [L] floats: 0 at position 0, then log p(token_t | tokens_<t) at ``temperature``."""
        device = next(self.model.parameters()).device
        out: list[list[float]] = []
        for s in range(0, len(seqs), self.micro_batch_size):
            chunk = seqs[s : s + self.micro_batch_size]
            width = max(len(x) for x in chunk)
            ids = torch.zeros((len(chunk), width), dtype=torch.long)
            for i, x in enumerate(chunk):
                ids[i, : len(x)] = torch.tensor(list(x))
            lp = token_logprobs(self.model, ids.to(device), temperature).cpu()  # right padding is causal-safe
            out.extend(lp[i, : len(x)].tolist() for i, x in enumerate(chunk))
        return out


class EngineScorer:
    """Token logprobs through the engine's scoring API (design.md §3.2):
    ``engine.score(token_ids, temperature=T) -> [L]`` (entry 0 = 0), one sequence per call on
    pages borrowed for the call. An engine whose ``score`` takes no temperature is used at
    temperature 1 only; other temperatures go to ``fallback``.
    """

    name = "engine.score"

    def __init__(self, engine, fallback: ForwardScorer):
        import inspect

        self.engine = engine
        self.fallback = fallback
        self.takes_temperature = "temperature" in inspect.signature(engine.score).parameters

    def score(self, seqs: Sequence[Sequence[int]], temperature: float) -> list[list[float]]:
        if temperature != 1.0 and not self.takes_temperature:
            return self.fallback.score(seqs, temperature)
        out = []
        for x in seqs:
            lp = (
                self.engine.score(list(x), temperature=temperature)
                if self.takes_temperature
                else self.engine.score(list(x))
            )
            lp = lp.tolist() if hasattr(lp, "tolist") else list(lp)
            if len(lp) == len(x) - 1:
                lp = [0.0] + lp
            if len(lp) != len(x):
                raise ValueError(f"engine.score returned {len(lp)} logprobs for {len(x)} tokens")
            out.append([float(v) for v in lp])
        return out


def make_scorer(
    model: M3ForCausalLM, max_model_len: int, micro_batch_size: int = 16, prefer_engine: bool = True
) -> tuple[ForwardScorer | EngineScorer, str]:
    """The scorer to use and why: the engine's ``score`` when ``m3_rollout.engine.engine``
    provides ``LLMEngine.score``, else the model forward."""
    fallback = ForwardScorer(model, micro_batch_size)
    if not prefer_engine:
        return fallback, "model forward (asked for)"
    try:
        from m3_rollout.engine.config import EngineConfig
        from m3_rollout.engine.engine import LLMEngine
    except ImportError as exc:
        return fallback, f"model forward (engine scoring API not available: {exc})"
    if not hasattr(LLMEngine, "score"):
        return fallback, "model forward (LLMEngine has no score())"
    try:
        # One sequence at a time: a page pool for one max_model_len sequence is enough.
        engine = LLMEngine(
            model, EngineConfig(max_model_len=max_model_len, max_num_seqs=1, enable_prefix_caching=False)
        )
    except Exception as exc:  # an engine that cannot be built here must not stop a replay
        return fallback, f"model forward (LLMEngine could not be built: {type(exc).__name__}: {exc})"
    return EngineScorer(engine, fallback), "engine scoring API (LLMEngine.score)"


# ---------------------------------------------------------------------------- offline GRPO
LR_STEPS = ("dumped", "replayed")  # schedule_indices' lr_steps


def schedule_indices(steps: Sequence[int], cfg: MasterConfig, lr_steps: str = "dumped") -> tuple[dict[int, int], int]:
    """Where the replayed steps sit on the LR schedule: each dumped step's GRPO step index (0-based,
    ``train_step_on_groups``' ``grpo_step_index``) and the schedule's length in GRPO steps (build
    the policy with ``total_optimizer_steps(cfg, length)``).

    ``lr_steps``:
      "dumped" (default): the run's own schedule. Dumped step s (the shard's step number, 1-based,
        which every shard records: file name, metadata and ``step`` column) is GRPO step s - 1 of a
        schedule over ``cfg.grpo.max_num_steps`` steps, as the GRPO loop trained it, so replaying
        steps 5-7, or a dump with a step missing (``rollout_dump.every_n_steps``, retention, a step
        skipped without groups), trains each step at the LR the run used. The dump stores no
        config (only ``config_hash``), so the replay's config must give the run's
        ``grpo.max_num_steps`` (and batch sizes, ``policy.optimizer.lr``, ``policy.scheduler.*``).
      "replayed": the replayed steps as a run of their own: the i-th in step order (0-based) is GRPO
        step i of a schedule over the number replayed (warmup and decay over that selection), e.g.
        to fine-tune offline on a few dumped steps.

    Args:
        steps: the dumped step numbers to replay (any order, no duplicates).
        cfg: the replay's config (``grpo.max_num_steps``).

    Returns:
        ({dumped step: GRPO step index}, number of GRPO steps the schedule spans).

    Raises:
        ValueError: ``lr_steps`` not in ``LR_STEPS``.
        DumpError: with "dumped", a step past ``grpo.max_num_steps``: the message names both numbers
            and what to pass instead.
    """
    if lr_steps not in LR_STEPS:
        raise ValueError(f"lr_steps={lr_steps!r}: one of {list(LR_STEPS)}")
    ordered = sorted(steps)
    if lr_steps == "replayed":
        return {s: i for i, s in enumerate(ordered)}, len(ordered)
    total = cfg.grpo.max_num_steps
    past = [s for s in ordered if s > total]
    if past:
        raise DumpError(
            f"step {past[-1]} of the dump is past the LR schedule of grpo.max_num_steps={total} (the replay config's; "
            f"the dump stores no config): pass the original run's grpo.max_num_steps (at least {past[-1]}) as an "
            f"override to train each step at the run's LR, or --lr-steps replayed for a schedule over the "
            f"{len(ordered)} replayed step(s) alone"
        )
    return {s: s - 1 for s in ordered}, total


def lr_differences(read: DumpRead, history: Sequence[dict]) -> list[str]:
    """One line per replayed step whose LR differs from the ``lr`` its shard's ``step_metrics``
    records (GRPO-loop dumps record it; ``dump generate`` dumps train nothing and do not): the
    replay config's schedule (``grpo.max_num_steps``, batch sizes, ``policy.optimizer.lr``,
    ``policy.scheduler.*``) or ``lr_steps`` is not the run's. Empty when all agree or none is recorded."""
    logged = {info.step: info.step_metrics.get("lr") for info in read.shards}
    return [
        f"step {h['step']}: replay trained at lr {h['lr']!r}, the run logged {logged[h['step']]!r}"
        for h in history
        if logged.get(h["step"]) is not None and h.get("lr") != logged[h["step"]]
    ]


def train_offline(
    read: DumpRead,
    cfg: MasterConfig,
    policy: Policy,
    loss_fn: ClippedPGLossFn,
    pad_id: int = 0,
    recompute_advantages: bool = False,
    log: Callable[[int, dict], None] | None = None,
    lr_steps: str = "dumped",
) -> list[dict]:
    """Run one GRPO training step per dumped step, in step order, without generating.

    Each step's rows become ``Trajectory`` records; advantages are the stored ones (the values
    the run trained with) or, with ``recompute_advantages`` or when a shard has none, computed from
    the rewards under ``cfg.grpo``. The step is ``m3_trainers.step.train_step_on_groups``, the GRPO
    loop's own (overlong filtering, routing replay, several optimizer steps per batch and the
    combined metrics as configured), trained at the temperature stored in the rows' sampling params.
    Each step trains at the LR-schedule position :func:`schedule_indices` gives it under
    ``lr_steps`` (default "dumped": dumped step s is GRPO step s - 1 of the run, so the replay
    trains at the run's LRs); build ``policy`` with ``total_optimizer_steps(cfg, n)``, n the
    schedule length :func:`schedule_indices` returns (``cfg.grpo.max_num_steps`` for "dumped").

    Returns:
        per-step metrics dicts (numbers only, with "step", "rows" and "reward" (``train/reward``:
        over the rows that generated), the trainer's metric names of docs/metrics.md).

    Raises:
        DumpError: before any step trains, for a step whose every row failed to generate
            (finish_reason "error"; a ``dump generate`` dump keeps one, the GRPO loop stops there):
            it has nothing to train; the message names the steps to replay instead (``--steps``);
            or for a step past the schedule (:func:`schedule_indices`).
    """
    gen = cfg.policy.generation
    steps: dict[int, list[dict]] = {}
    for r in read.table.to_pylist():
        steps.setdefault(r["step"], []).append(r)
    failed = [s for s in sorted(steps) if all(r["finish_reason"] == FINISH_ERROR for r in steps[s])]
    if failed:
        rest = " ".join(str(s) for s in sorted(steps) if s not in failed)
        raise DumpError(
            f"step {failed[0]}: all {len(steps[failed[0]])} rows failed to generate (finish_reason error), so it "
            f"has nothing to train ({len(failed)} such step(s): {failed}); "
            + (f"replay the others with --steps {rest}" if rest else "no step of the dump can train")
        )
    index_of, _ = schedule_indices(steps, cfg, lr_steps)
    history = []
    for step in sorted(steps):
        srows = sorted(steps[step], key=lambda r: (r["group_id"], r["sample_index"]))
        trajs = trajectories_from_rows(srows)
        temperature = float(json.loads(srows[0]["sampling_params"]).get("temperature", gen.temperature))
        stored = None
        if not recompute_advantages and all(r["advantage"] is not None for r in srows):
            stored = torch.tensor([r["advantage"] for r in srows], dtype=torch.float32)
        res = train_step_on_groups(
            policy, loss_fn, trajs, cfg, temperature, pad_id=pad_id, advantages=stored, grpo_step_index=index_of[step]
        )
        metrics = {
            "step": step,
            "rows": len(trajs),
            "reward": rollout_metrics(trajs, torch.tensor([t.reward for t in trajs]))["reward"],
            **{k: v for k, v in res.metrics.items() if isinstance(v, (int, float))},
        }
        history.append(metrics)
        if log:
            log(step, metrics)
    return history

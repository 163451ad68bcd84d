"""Replay a dump: re-score stored trajectories with a checkpoint, or train GRPO on them offline.

Governing idea: a dump holds everything a GRPO step consumes (token ids, loss mask, rollout
logprobs, rewards, advantages), so both jobs skip generation. Re-scoring
(``m3_rollout.dump.replay.rescore``) computes log p(token_t | tokens_<t) at the stored sampling
temperature and compares it with the stored rollout logprobs on sampled tokens. Offline training
feeds each dumped step, in step order, through the GRPO loop's own training step
(``m3_trainers.step.train_step_on_groups``).

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
def train_offline(
    read: DumpRead,
    cfg: MasterConfig,
    policy: Policy,
    loss_fn: ClippedPGLossFn,
    pad_id: int = 0,
    recompute_advantages: bool = False,
    log: Callable[[int, dict], None] | None = None,
) -> list[dict]:
    """Run one GRPO training step per dumped step, in step order, without generating.

    Each step's rows become ``Trajectory`` records; advantages are the stored ones (the values
    the run trained with) or, with ``recompute_advantages`` or when a shard has none, computed from
    the rewards under ``cfg.grpo``. The step is ``m3_trainers.step.train_step_on_groups``, the GRPO
    loop's own (overlong filtering, routing replay, several optimizer steps per batch and the
    combined metrics as configured), trained at the temperature stored in the rows' sampling params.
    The i-th replayed step (0-based) is GRPO step i of the LR schedule (``grpo_step_index``): build
    ``policy`` with ``total_optimizer_steps(cfg, number of steps replayed)`` for the schedule to end
    at the last one.

    Returns:
        per-step metrics dicts (numbers only, with "step", "rows" and "reward" (``train/reward``:
        over the rows that generated), the trainer's metric names of docs/metrics.md).

    Raises:
        DumpError: before any step trains, for a step whose every row failed to generate
            (finish_reason "error"; a ``dump generate`` dump keeps one, the GRPO loop stops there):
            it has nothing to train; the message names the steps to replay instead (``--steps``).
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
    history = []
    for index, step in enumerate(sorted(steps)):
        srows = sorted(steps[step], key=lambda r: (r["group_id"], r["sample_index"]))
        trajs = trajectories_from_rows(srows)
        temperature = float(json.loads(srows[0]["sampling_params"]).get("temperature", gen.temperature))
        stored = None
        if not recompute_advantages and all(r["advantage"] is not None for r in srows):
            stored = torch.tensor([r["advantage"] for r in srows], dtype=torch.float32)
        res = train_step_on_groups(
            policy, loss_fn, trajs, cfg, temperature, pad_id=pad_id, advantages=stored, grpo_step_index=index
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

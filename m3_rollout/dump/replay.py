"""Replay a dump: re-score stored trajectories with a checkpoint, or train GRPO on them offline.

Governing idea: a dump holds everything a GRPO step consumes (token ids, loss mask, rollout
logprobs, rewards, advantages), so both jobs skip generation. Re-scoring computes
log p(token_t | tokens_<t) at the stored sampling temperature and compares it with the stored
rollout logprobs on sampled tokens (the train/inference mismatch of design.md §2 step 5, measured
against any checkpoint). Offline training feeds each dumped step, in step order, through the
trainer's own pieces (``m3_trainers.batch``, ``m3_trainers.policy``, ``m3_trainers.loss``).

Scoring path: the engine's scoring API (``LLMEngine.score``, contracts.md) when the engine
package provides it, else the model forward the trainer uses (``m3_trainers.policy.token_logprobs``).
Both return the same quantity; the report names the one used.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from m3_rollout.dump.reader import DumpRead
from m3_rollout.dump.records import trajectory_from_row
from m3_rollout.model import M3ForCausalLM

SCORE_COLUMNS = ["step", "group_id", "sample_index", "token_ids", "loss_mask", "rollout_logprobs", "sampling_params"]


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
        from m3_trainers.policy import token_logprobs

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
    """Token logprobs through the engine's scoring API (contracts.md):
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
        from m3_rollout.engine.engine import EngineConfig, LLMEngine
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


# ---------------------------------------------------------------------------- re-scoring
@dataclass
class RescoreStats:
    """Mismatch of one step on sampled tokens: mean / max |stored - rescored| logprob,
    token_mult_prob_error = mean exp(|diff|) (1.0 = identical; m3_trainers.policy's definition)."""

    step: int
    rows: int
    tokens: int
    mean_abs_diff: float
    max_abs_diff: float
    token_mult_prob_error: float


def rescore(
    read: DumpRead, scorer, progress: Callable[[int, int], None] | None = None
) -> tuple[list[RescoreStats], dict[tuple[int, int, int], list[float]]]:
    """Re-score every row of ``read``.

    Returns:
        (per-step stats in step order, {(step, group_id, sample_index): [L] rescored logprobs}).
    """
    rows = read.table.select(SCORE_COLUMNS).to_pylist()
    by_temp: dict[float, list[int]] = {}
    for i, r in enumerate(rows):
        by_temp.setdefault(float(json.loads(r["sampling_params"]).get("temperature", 1.0)), []).append(i)
    scores: dict[int, list[float]] = {}
    done = 0
    for temp, idx in by_temp.items():
        for s in range(0, len(idx), 64):
            chunk = idx[s : s + 64]
            for i, lp in zip(chunk, scorer.score([rows[i]["token_ids"] for i in chunk], temp)):
                scores[i] = lp
            done += len(chunk)
            if progress:
                progress(done, len(rows))
    stats: dict[int, list] = {}
    for i, r in enumerate(rows):
        acc = stats.setdefault(r["step"], [0, 0, 0.0, 0.0, 0.0])
        acc[0] += 1
        for m, a, b in zip(r["loss_mask"], r["rollout_logprobs"], scores[i]):
            if m:
                d = abs(a - b)
                acc[1] += 1
                acc[2] += d
                acc[3] = max(acc[3], d)
                acc[4] += math.exp(d)
    out = [
        RescoreStats(step, a[0], a[1], a[2] / max(a[1], 1), a[3], a[4] / max(a[1], 1) if a[1] else 1.0)
        for step, a in sorted(stats.items())
    ]
    keyed = {(r["step"], r["group_id"], r["sample_index"]): scores[i] for i, r in enumerate(rows)}
    return out, keyed


# ---------------------------------------------------------------------------- offline GRPO
def train_offline(
    read: DumpRead,
    cfg,
    policy,
    loss_fn,
    pad_id: int = 0,
    recompute_advantages: bool = False,
    log: Callable[[int, dict], None] | None = None,
) -> list[dict]:
    """Run one GRPO training phase per dumped step, in step order, without generating.

    Each step's rows become ``Trajectory`` records; advantages are the stored ones (the values
    the run trained with) or, with ``recompute_advantages`` or when a shard has none,
    ``m3_trainers.advantages.group_advantages`` under ``cfg.grpo``. The step then runs as the GRPO
    loop's train phase: overlong filtering (``grpo.overlong_filtering``) and routing replay
    (``policy.routing_replay``) as configured; when the batch spans several optimizer steps, the
    logprobs before the first update (and the reference's, for a KL penalty) are computed once;
    one ``policy.train_step`` per ``policy.train_global_batch_size`` slice. Trained at the
    temperature stored in the rows' sampling params.

    Returns:
        per-step metrics dicts (with "step" and "rows").
    """
    from m3_trainers.advantages import group_advantages, overlong_filter_mask
    from m3_trainers.batch import batch_from_trajectories
    from m3_trainers.policy import mismatch_metrics

    g, p, gen = cfg.grpo, cfg.policy, cfg.policy.generation
    rows = read.table.to_pylist()
    steps: dict[int, list[dict]] = {}
    for r in rows:
        steps.setdefault(r["step"], []).append(r)
    history = []
    for step in sorted(steps):
        srows = sorted(steps[step], key=lambda r: (r["group_id"], r["sample_index"]))
        trajs = [trajectory_from_row(r) for r in srows]
        temperature = float(json.loads(srows[0]["sampling_params"]).get("temperature", gen.temperature))
        if recompute_advantages or any(r["advantage"] is None for r in srows):
            adv = group_advantages(
                torch.tensor([t.reward for t in trajs]),
                torch.tensor([t.group_index for t in trajs]),
                g.normalize_rewards,
                g.use_leave_one_out_baseline,
            )
        else:
            adv = torch.tensor([r["advantage"] for r in srows], dtype=torch.float32)
        sample_mask = (
            overlong_filter_mask([t.finish_reason for t in trajs]) if getattr(g, "overlong_filtering", False) else None
        )
        batch = batch_from_trajectories(
            trajs, adv, pad_id=pad_id, sample_mask=sample_mask, with_routing=getattr(p, "routing_replay", False)
        )
        gbs = min(p.train_global_batch_size, len(trajs))
        prev = ref = None
        if gbs < len(trajs):
            prev = policy.get_logprobs(batch, temperature, p.train_micro_batch_size)
            if getattr(loss_fn, "needs_reference", False):
                ref = policy.get_logprobs(batch, temperature, p.train_micro_batch_size, reference=True)
        tm: dict = {}
        for s in range(0, len(trajs), gbs):
            mb = batch.slice(slice(s, s + gbs))
            l = mb.token_ids.shape[1]
            tm = policy.train_step(
                mb,
                loss_fn,
                temperature,
                p.train_micro_batch_size,
                None if prev is None else prev[s : s + gbs, :l],
                None if ref is None else ref[s : s + gbs, :l],
            )
        if prev is not None:  # mismatch over the whole batch, as the GRPO loop logs it
            tm.update(mismatch_metrics(batch.rollout_logprobs, prev, batch.loss_mask))
        metrics = {
            "step": step,
            "rows": len(trajs),
            "reward_mean": float(sum(t.reward for t in trajs) / len(trajs)),
            **{k: v for k, v in tm.items() if isinstance(v, (int, float))},
        }
        history.append(metrics)
        if log:
            log(step, metrics)
    return history

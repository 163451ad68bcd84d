"""Re-scoring a dump: the stored rollout logprobs against a scorer's logprobs of the same tokens.

Governing idea: a dump holds the token ids, loss mask and rollout logprobs of every trajectory, so
the train/inference mismatch of design.md §2 step 5 can be measured against any checkpoint without
generating. ``rescore`` takes any scorer with ``score(seqs, temperature) -> [[logprob per token]]``
(entry 0 = 0); the scorers themselves (model forward, engine scoring API) and offline GRPO training
on a dump are job-layer code: ``m3_rollout.jobs.replay``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass

from m3_rollout.dump.reader import DumpRead

SCORE_COLUMNS = ["step", "group_id", "sample_index", "token_ids", "loss_mask", "rollout_logprobs", "sampling_params"]


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

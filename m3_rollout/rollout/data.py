"""Prompt sources for GRPO: the built-in arithmetic generator or a JSONL file.

Records are dicts with ``messages`` (chat messages) or ``prompt`` (one user text), plus
``answer``. The held-out validation set is fixed by the global seed and never appears in
training batches.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from m3_rollout.rollout.environments.calculator import ArithmeticTask

_VAL_SEED_OFFSET = 1_000_003


def load_jsonl(path: str | Path) -> list[dict]:
    """Read prompt records from a JSONL file.

    Raises:
        FileNotFoundError: no such file.
        ValueError: a line is not JSON, or a record lacks ``answer`` or both ``messages`` and
            ``prompt`` (the line number is given).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"data.path: no such JSONL file: {path}")
    records = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
        if not isinstance(rec, dict) or "answer" not in rec or not ("messages" in rec or "prompt" in rec):
            raise ValueError(f"{path}:{lineno}: a record needs 'answer' and 'messages' or 'prompt'")
        records.append(rec)
    if not records:
        raise ValueError(f"{path}: no records")
    return records


def _key(rec: dict) -> str:
    return json.dumps(rec.get("messages", rec.get("prompt")), sort_keys=True)


class PromptSource:
    """Deterministic train / validation prompt streams.

    Args:
        task: the arithmetic generator (used when ``records`` is None).
        seed: global seed.
        num_val: size of the held-out set.
        records: records of a JSONL file; the last ``num_val`` (after a seeded shuffle) are held
            out, the rest are sampled for training.
    """

    def __init__(self, task: ArithmeticTask | None, seed: int, num_val: int, records: list[dict] | None = None):
        self.task, self.seed = task, seed
        if records is not None:
            recs = list(records)
            random.Random(seed).shuffle(recs)
            if len(recs) <= num_val:
                raise ValueError(
                    f"{len(recs)} records cannot give {num_val} held-out prompts and a training set; "
                    f"lower grpo.num_val_prompts"
                )
            self.val = recs[-num_val:]
            self._train = recs[:-num_val]
        else:
            assert task is not None
            self.val = task.records(seed + _VAL_SEED_OFFSET, num_val)
            self._train = None
        self._val_keys = {_key(r) for r in self.val}

    def train_batch(self, step: int, count: int) -> list[dict]:
        """The ``count`` training prompts of GRPO step ``step`` (same every rerun)."""
        if self._train is not None:
            rng = random.Random(self.seed * 7919 + step)
            return [rng.choice(self._train) for _ in range(count)]
        rng = random.Random(self.seed * 7919 + step)
        out: list[dict] = []
        while len(out) < count:
            rec = self.task.record(rng)
            if _key(rec) not in self._val_keys:
                out.append(rec)
        return out

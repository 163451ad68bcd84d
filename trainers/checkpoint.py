"""Training checkpoints: the policy in the released layout plus everything needed to resume.

Governing idea: a checkpoint directory is written under a temporary name, fsynced and renamed
(the parent fsynced after it: ``m3_rollout.model.atomic_file``), so a directory named ``step_{k}``
is always complete, a power cut included; resuming from it continues exactly where the
run stopped (same weights, optimizer moments, LR-schedule position, data position and RNG).

Layout (NeMo RL-like)::

    <checkpoint_dir>/step_{k}/
        policy/                 released checkpoint: config.json (VL-shaped, M3Config.to_dict),
                                model.safetensors (``language_model.*`` names), tokenizer files;
                                loadable by m3_rollout.model.load_checkpoint and by transformers'
                                MiniMaxM3SparseForConditionalGeneration.from_pretrained
        optimizer.pt            {"optimizer": AdamW state_dict, "scheduler": LambdaLR state_dict}
        training_state.pt       {"step", "data": collector state, "python_rng", "torch_rng"}
        training_info.json      {"step", "metrics": {...}} (human-readable; keep_top_k reads it)

Retention (``keep_top_k``): keep the k best checkpoints by ``metric_name`` (checkpoints without
the metric rank last) and always the newest one, so a resume never loses progress.
"""

from __future__ import annotations

import json
import math
import random
import re
import shutil
from pathlib import Path

import torch

from m3_rollout.chat.template import CHAT_DEFAULTS_FILE, write_chat_defaults
from m3_rollout.model import save_checkpoint
from m3_rollout.model.atomic_file import write_dir_atomic
from m3_rollout.model.loading import INDEX_FILE, SINGLE_FILE, load_named_tensors

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
    CHAT_DEFAULTS_FILE,
)
_STEP_RE = re.compile(r"^step_(\d+)$")


def copy_tokenizer_files(src_dir: Path, dst_dir: Path) -> None:
    """Copy the tokenizer / chat-template files that exist in ``src_dir``."""
    for name in TOKENIZER_FILES:
        if (Path(src_dir) / name).is_file():
            shutil.copy(Path(src_dir) / name, Path(dst_dir) / name)


def iter_weight_files(model_dir: Path):
    """(name, tensor) of every tensor in a released checkpoint directory (single file or shards)."""
    from safetensors import safe_open

    index = model_dir / INDEX_FILE
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else [SINGLE_FILE]
    for fname in files:
        with safe_open(str(model_dir / fname), framework="pt", device="cpu") as f:
            for key in f.keys():
                yield key, f.get_tensor(key)


def optimizer_param_names(policy) -> list[list[str]]:
    """The names of the tensors each optimizer param group trains, in the optimizer's order (what
    its state is matched by on load)."""
    names = {id(p): n for n, p in policy.model.named_parameters()}
    return [[names.get(id(p), "?") for p in g["params"]] for g in policy.optimizer.param_groups]


class CheckpointManager:
    """Save, find, load and prune training checkpoints under ``root``.

    Args:
        root: ``checkpointing.checkpoint_dir``.
        keep_top_k: None = keep all.
        metric_name: key in the metrics given to ``save`` (e.g. "validation/accuracy"); None:
            keep the newest ``keep_top_k``.
        higher_is_better: ranking direction.
    """

    def __init__(
        self,
        root: str | Path,
        keep_top_k: int | None = None,
        metric_name: str | None = "validation/accuracy",
        higher_is_better: bool = True,
    ):
        self.root = Path(root)
        self.keep_top_k, self.metric_name, self.higher_is_better = keep_top_k, metric_name, higher_is_better

    def steps(self) -> list[int]:
        """Steps of the complete checkpoints present, ascending."""
        if not self.root.is_dir():
            return []
        return sorted(int(m.group(1)) for p in self.root.iterdir() if p.is_dir() and (m := _STEP_RE.match(p.name)))

    def path(self, step: int) -> Path:
        return self.root / f"step_{step}"

    def latest(self) -> Path | None:
        steps = self.steps()
        return self.path(steps[-1]) if steps else None

    def save(
        self,
        step: int,
        policy,
        tokenizer_dir: Path | None,
        data_state: dict,
        metrics: dict,
        chat_template_kwargs: dict | None = None,
    ) -> Path:
        """Write ``step_{step}`` (replacing an existing one), then apply retention.

        Args:
            policy: ``m3_trainers.policy.Policy``.
            tokenizer_dir: directory whose tokenizer files are copied next to the weights.
            chat_template_kwargs: the rendering the run trained in (e.g. its thinking mode), written
                as the policy's ``CHAT_DEFAULTS_FILE`` so a server renders requests the same way
                (None: the file copied from ``tokenizer_dir``, if any).
            data_state: the rollout collector's state (prompt-batch position).
            metrics: numbers recorded in training_info.json (keep_top_k ranks by ``metric_name``).

        Returns:
            the final directory.
        """
        final = self.path(step)
        with write_dir_atomic(final) as tmp:  # whole and on the disk, or not there
            save_checkpoint(policy.model, policy.model.config, tmp / "policy")
            if tokenizer_dir is not None:
                copy_tokenizer_files(tokenizer_dir, tmp / "policy")
            if chat_template_kwargs is not None:
                write_chat_defaults(tmp / "policy", chat_template_kwargs)
            torch.save(
                {
                    "optimizer": policy.optimizer.state_dict(),
                    "scheduler": policy.scheduler.state_dict(),
                    "param_names": optimizer_param_names(policy),
                },
                tmp / "optimizer.pt",
            )
            torch.save(
                {
                    "step": step,
                    "data": dict(data_state),
                    "python_rng": random.getstate(),
                    "torch_rng": torch.get_rng_state(),
                },
                tmp / "training_state.pt",
            )
            clean = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(v)}
            (tmp / "training_info.json").write_text(json.dumps({"step": step, "metrics": clean}, indent=1))
        self.prune()
        return final

    def _score(self, step: int) -> float | None:
        try:
            info = json.loads((self.path(step) / "training_info.json").read_text())
        except (OSError, ValueError):
            return None
        v = info.get("metrics", {}).get(self.metric_name) if self.metric_name is not None else None
        return None if v is None else float(v)

    def prune(self) -> list[int]:
        """Apply ``keep_top_k``; returns the removed steps."""
        steps = self.steps()
        if self.keep_top_k is None or len(steps) <= self.keep_top_k:
            return []
        sign = 1.0 if self.higher_is_better else -1.0

        def rank(s: int) -> tuple:
            v = self._score(s)
            return (v is not None, sign * v if v is not None else 0.0, s)  # ties: newer first

        best = sorted(steps, key=rank, reverse=True)[: self.keep_top_k]
        keep = set(best) | {steps[-1]}
        removed = [s for s in steps if s not in keep]
        for s in removed:
            shutil.rmtree(self.path(s), ignore_errors=True)
        return removed

    @staticmethod
    def load(path: str | Path, policy) -> dict:
        """Restore weights (in place), optimizer, scheduler and RNG from ``path`` into ``policy``.

        Returns:
            {"step": int, "data": dict} to continue the loop from.

        Raises:
            FileNotFoundError: a file of the layout is missing (named).
            ValueError: the weights do not match the policy's model, or the optimizer's tensors
                are not the ones the checkpoint's optimizer state belongs to (``policy.freeze.*``
                changed: AdamW's state is matched by position, so the moments would land on other
                tensors).
        """
        path = Path(path)
        for name in ("policy", "optimizer.pt", "training_state.pt"):
            if not (path / name).exists():
                raise FileNotFoundError(f"checkpoint {path} lacks {name}; it is not a training checkpoint")
        with torch.no_grad():
            load_named_tensors(policy.model, iter_weight_files(path / "policy"))
        opt = torch.load(path / "optimizer.pt", weights_only=False)
        saved, now = opt.get("param_names"), optimizer_param_names(policy)
        if saved is not None and saved != now:
            diff = sorted(set(map(tuple, saved)) ^ set(map(tuple, now)) or {("order",)})
            raise ValueError(
                f"checkpoint {path}: the optimizer trains other tensors than the run that saved it (e.g. "
                f"{'/'.join(diff[0])}); policy.freeze.* (or the weight-decay grouping) changed since: resume with the "
                "saved settings, or start a new run from its policy/ weights (policy.model_name=.../policy)"
            )
        try:
            policy.optimizer.load_state_dict(opt["optimizer"])
        except ValueError as exc:  # a checkpoint without param_names and another group layout
            raise ValueError(
                f"checkpoint {path}: its optimizer state does not fit this run's optimizer ({exc})"
            ) from None
        policy.scheduler.load_state_dict(opt["scheduler"])
        state = torch.load(path / "training_state.pt", weights_only=False)
        random.setstate(state["python_rng"])
        torch.set_rng_state(state["torch_rng"])
        return {"step": int(state["step"]), "data": state["data"]}

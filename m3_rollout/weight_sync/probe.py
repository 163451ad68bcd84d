"""Post-update probe: re-score a fixed token set on the rollout after a refit and compare it with
the trainer's logprobs for the same tokens (``weight_sync.probe``).

Governing idea: checksums and finite checks see bytes, not meaning. A wrong expert layout (an
expert's rows landing in another expert's slot), a stale cache or a buffer overwritten after the
copy pass every byte check yet change what the model computes. The probe measures that directly:
the sender scores ``num_prompts`` fixed pseudo-random sequences of ``num_tokens`` ids with the
weights it sends (the trainer's reference), the update carries ids + reference logprobs, and every
rank re-scores them with its freshly written weights. The figure is the largest per-prompt mean
absolute logprob difference (nats per token); beyond ``threshold`` the update fails (atomic ranks
roll back) or the rank becomes invalid (non-atomic).

Token ids: ``probe_token_ids`` draws them from a fixed-seed generator over the vocabulary (the
embedding's row count in the manifest), so both ends and every update use the same set.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

# ids [T] int64 -> logprobs [T] float (entry 0 = 0, entry i = log p(id_i | ids_<i)), the
# convention of LLMEngine.score.
Scorer = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class ProbeSettings:
    """``weight_sync.probe``: ``num_prompts`` sequences of ``num_tokens`` ids; ``threshold`` in
    nats per token (largest per-prompt mean |logprob difference| allowed); ``seed`` fixes the ids."""

    num_prompts: int = 2
    num_tokens: int = 16
    threshold: float = 0.1
    seed: int = 1234

    def __post_init__(self):
        if self.num_prompts < 1 or self.num_tokens < 2:
            raise ValueError(
                f"weight_sync.probe: num_prompts={self.num_prompts} must be >= 1 and num_tokens={self.num_tokens} >= 2"
            )
        if not self.threshold > 0:
            raise ValueError(f"weight_sync.probe.threshold={self.threshold}: must be > 0 (nats per token)")


@dataclass
class ProbeData:
    """What an update carries for the probe: ``ids`` int64 [P, T], ``reference`` float32 [P, T]
    (the sender's logprobs, entry 0 of each row unused), ``threshold`` (nats per token)."""

    ids: torch.Tensor
    reference: torch.Tensor
    threshold: float


def probe_token_ids(vocab_size: int, settings: ProbeSettings) -> torch.Tensor:
    """int64 [num_prompts, num_tokens] ids in [0, vocab_size), the same for a given seed."""
    g = torch.Generator().manual_seed(int(settings.seed))
    return torch.randint(0, int(vocab_size), (settings.num_prompts, settings.num_tokens), generator=g)


def build_probe(vocab_size: int, settings: ProbeSettings, reference: Scorer) -> ProbeData:
    """Sender side: the probe ids and their logprobs under the weights being sent."""
    ids = probe_token_ids(vocab_size, settings)
    ref = torch.stack([reference(row).float().cpu().reshape(-1) for row in ids])
    if ref.shape != ids.shape:
        raise ValueError(f"probe reference scorer returned {list(ref.shape)} logprobs for ids {list(ids.shape)}")
    return ProbeData(ids, ref, float(settings.threshold))


def probe_drift(data: ProbeData, scorer: Scorer) -> float:
    """Receiver side: largest per-prompt mean |reference - rollout| logprob over positions 1..T-1
    (nats per token); NaN scores count as infinite drift."""
    worst = 0.0
    for row, ref in zip(data.ids, data.reference):
        got = scorer(row).float().cpu().reshape(-1)
        d = (got[1:] - ref[1:]).abs().mean().item()
        worst = max(worst, d if d == d else float("inf"))
    return worst


def model_scorer(model: torch.nn.Module) -> Scorer:
    """A ``Scorer`` over a plain (unsharded) ``M3ForCausalLM`` (``model(ids) -> logits``): the
    trainer's reference logprobs, fp32 log-softmax at temperature 1."""

    @torch.no_grad()
    def score(ids: torch.Tensor) -> torch.Tensor:
        dev = next(model.parameters()).device
        logits = model(ids.reshape(1, -1).to(dev))[0].float()
        lp = torch.log_softmax(logits[:-1], dim=-1).gather(1, ids[1:].to(dev).reshape(-1, 1)).reshape(-1)
        return torch.cat([lp.new_zeros(1), lp]).cpu()

    return score

"""Block-selection (index) replay and the selection-agreement metric, trainer side.

Governing idea (design.md §2.3, "Block-selection replay"): the rollout engine records which KV
blocks each sparse layer selected for every token (``TrainBatch.block_selection``). For one
forward, :func:`replay_block_selection` hands each sparse layer its slice of the record
(``M3Attention.block_replay``, as ``replay_routing`` hands the MoE its experts): the layer still
computes its own top-k, optionally adds the agreement counts of that choice against the record
(``indexer.selection_agreement``) to a :class:`SelectionAgreement`, and, when replaying, attends the
recorded blocks instead (``indexer.replayed_blocks``: forced local / init blocks and causality
kept; unrecorded rows keep the own choice).

Gradients: the block choice is discrete in both modes, so replay changes which keys each query
attends and nothing else; the gradients of q, k, v, the projections and everything below flow
exactly as without replay for that mask. The indexer's own parameters are not connected to the
loss in either mode (top-k has no gradient): they are frozen by default (``policy.freeze.indexer``),
and unfrozen they still get no gradient (``.grad`` stays None), so AdamW skips them, weight decay
included, and they never change (``tests/test_block_selection_replay.py`` checks it). Replay does
not change that: training the indexer would need its own loss (e.g. a distillation of attention
scores into block scores), which M3's RL recipe does not have.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from m3_rollout.model import M3ForCausalLM
from m3_rollout.model.attention import BlockReplay


@contextmanager
def replay_block_selection(
    model: M3ForCausalLM,
    block_selection: torch.Tensor | None,
    replay: bool,
    agreement: SelectionAgreement | None = None,
):
    """Within the block, every sparse layer of ``model`` sees the recorded selection.

    Args:
        block_selection: int [B, L, S, G, K] for the next forward over [B, L] tokens (-1 rows =
            not recorded); None = nothing to replay or measure (the block is a no-op).
        replay: attend the recorded blocks; False = the layers only measure their agreement.
        agreement: where the layers add their counts (None = not measured).

    Raises:
        ValueError: S, G or K do not match the model.
    """
    layers = model.sparse_attention_layers()
    if block_selection is None or not (replay or agreement is not None):
        yield
        return
    dims = tuple(block_selection.shape[2:])
    if dims != model.selection_dims():
        raise ValueError(f"block_selection has [S, G, K] = {list(dims)}; the model has {list(model.selection_dims())}")
    try:
        for j, attn in enumerate(layers):
            stats = None if agreement is None else agreement.stats[j]
            attn.block_replay = BlockReplay(block_selection[:, :, j], replay, stats)  # [B, L, G, K]
        yield
    finally:
        for attn in layers:
            attn.block_replay = None


class SelectionAgreement:
    """Per sparse layer: how often the trainer's own top-k equals the rollout's (summed over forwards).

    Attributes:
        layer_ids: model layer index of each sparse layer.
        stats: float64 [S, 3] on ``device``: rows (token, KV head) compared, rows whose block sets
            are equal, sum of |own ∩ rollout| / |rollout| (``indexer.selection_agreement``).
    """

    def __init__(self, model: M3ForCausalLM, device: torch.device | str):
        self.layer_ids = [a.layer_idx for a in model.sparse_attention_layers()]
        self.stats = torch.zeros(len(self.layer_ids), 3, dtype=torch.float64, device=device)

    def metrics(self) -> dict:
        """``msa_selection_agreement`` (mean over sparse layers of the fraction of (token, KV head)
        selections equal as sets), ``msa_selection_overlap`` (mean over layers of the mean
        |own ∩ rollout| / |rollout|), and both per layer (``.../layer_{i}``, i = model layer
        index); {} when no row was compared. One host read."""
        rows, equal, overlap = self.stats.cpu().double().unbind(dim=1)
        if float(rows.sum()) == 0:
            return {}
        n = rows.clamp(min=1)
        agree, over = (equal / n).tolist(), (overlap / n).tolist()
        out = {"msa_selection_agreement": sum(agree) / len(agree), "msa_selection_overlap": sum(over) / len(over)}
        for i, a, o in zip(self.layer_ids, agree, over):
            out[f"msa_selection_agreement/layer_{i}"] = a
            out[f"msa_selection_overlap/layer_{i}"] = o
        return out

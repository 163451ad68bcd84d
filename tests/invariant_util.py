"""Test helpers of the batch-invariance tests (CPU: tests/test_kernels_invariant.py,
tests/test_model_batch_invariant.py; GPU: tests/gpu/test_invariant_ops_gpu.py). No side effects on
import (the GPU tests import it too: nothing here sets TRITON_INTERPRET).

- ``invariance_failures``: the bitwise batch-invariance check of a row-wise op.
- ``row_meta`` / ``per_row_attention``: the reference paged attention run one row at a time, a
  stand-in for the invariant attention kernels (tested on their own), so the model-level tests check every
  other op of the paged forward.
"""

from __future__ import annotations

import dataclasses

import torch

from m3_kernels.paged_layout import PagedMetadata
from m3_rollout.engine.reference_ops import msa_attention_ref, paged_attention_ref
from m3_rollout.model.paged_ops import PagedOps

N_TARGET = 4  # rows 0..N_TARGET-1 of the inputs are the targets, the rest the "other sequences"


def invariance_failures(fn, rows: tuple[torch.Tensor, ...], sizes=(3, 32), seed: int = 0) -> list[str]:
    """Names of the batchings in which the target rows (0..N_TARGET-1 of every tensor in ``rows``,
    all [R, ...] with R >= max(sizes)) do not get the bits they get alone.

    ``fn(*row_slices) -> [T, ...]`` is a row-wise op. Batchings: ``batch{n}`` for n in sizes (n < 4:
    the first n rows; else the targets at random positions among n - 4 other rows) and
    ``mixed_all`` (all R rows shuffled). [] = invariant on these inputs.
    """
    r = rows[0].shape[0]
    alone = torch.cat([fn(*(x[i : i + 1] for x in rows)) for i in range(N_TARGET)])
    g = torch.Generator().manual_seed(seed)
    others = N_TARGET + torch.randperm(r - N_TARGET, generator=g)
    batchings = {}
    for n in sizes:
        if n <= N_TARGET:
            batchings[f"batch{n}"] = torch.arange(n)
        else:
            order = torch.cat([torch.arange(N_TARGET), others[: n - N_TARGET]])
            batchings[f"batch{n}"] = order[torch.randperm(n, generator=g)]
    batchings["mixed_all"] = torch.randperm(r, generator=g)
    bad = []
    for name, order in batchings.items():
        out = fn(*(x[order.to(x.device)] for x in rows))
        targets = [i for i in range(N_TARGET) if (order == i).any()]
        where = [int((order == i).nonzero()) for i in targets]
        if not torch.equal(out[where], alone[targets]):
            bad.append(name)
    return bad


def row_meta(meta: PagedMetadata, r: int) -> tuple[slice, PagedMetadata]:
    """(token slice, metadata) of row r of a step, as a step of that row alone."""
    qsl = meta.query_start_loc.tolist()
    a, b = qsl[r], qsl[r + 1]
    seq = meta.seq_lens[r : r + 1]
    return slice(a, b), PagedMetadata(
        meta.positions[a:b],
        meta.slot_mapping[a:b],
        meta.block_tables[r : r + 1],
        meta.context_lens[r : r + 1],
        seq,
        torch.tensor([0, b - a], dtype=meta.query_start_loc.dtype, device=meta.query_start_loc.device),
        int(r < meta.num_decodes),
        meta.decode_query_len,
        b - a,
        int(seq.max()),
    )


def per_row_attention(ops: PagedOps) -> PagedOps:
    """``ops`` with its attention fields replaced by the reference attention run one row at a time
    (a row's attention then never sees the other rows' shapes: invariant by construction)."""

    def paged(q, k_cache, v_cache, meta, scale, topk_ids=None):
        outs = []
        for r in range(meta.num_rows):
            s, m = row_meta(meta, r)
            ids = None if topk_ids is None else topk_ids[s]
            outs.append(paged_attention_ref(q[s], k_cache, v_cache, m, scale, ids))
        return torch.cat(outs)

    def msa(q, iq, k_cache, v_cache, index_cache, meta, scale, topk, init_blocks, local_blocks, sel_out=None):
        outs = []
        for r in range(meta.num_rows):
            s, m = row_meta(meta, r)
            sel = None if sel_out is None else sel_out[s]
            outs.append(
                msa_attention_ref(
                    q[s], iq[s], k_cache, v_cache, index_cache, m, scale, topk, init_blocks, local_blocks, sel
                )
            )
        return torch.cat(outs)

    return dataclasses.replace(ops, paged_attention=paged, msa_attention=msa)

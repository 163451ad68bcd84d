"""Synthetic paged batches for the MSA kernel tests and benchmark (layout: kernels/paged_layout.py).

Governing idea: build exactly the tensors the engine hands the ops — one layer's K/V/index-key
pages in a shuffled physical order, block tables, flat varlen query tokens, decode-first rows —
from a list of (context_len, query_len) rows, with random contents.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from m3_kernels.paged_layout import PagedMetadata


@dataclass
class PagedBatch:
    """One layer's inputs. q [T, nh, d]; iq [T, G, di]; k, v [P, G, ps, d]; ik [P, ps, di]; meta."""

    q: torch.Tensor
    iq: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    ik: torch.Tensor
    meta: PagedMetadata


def make_paged_batch(
    rows: list[tuple[int, int]],
    num_decodes: int,
    *,
    page_size: int,
    kv_heads: int,
    q_heads: int,
    head_dim: int,
    index_dim: int,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
    seed: int = 0,
    spare_pages: int = 3,
    table_width: int | None = None,
) -> PagedBatch:
    """Random paged batch.

    rows: (context_len, query_len) per row, decode rows first (the first ``num_decodes`` rows must
    share one query length, the decode_query_len). Physical pages are a random permutation with
    ``spare_pages`` unused pages mixed in; block tables are padded with -1 to ``table_width``
    (default: the widest row). Cache contents are N(0, 1) everywhere (pages past a row's length
    hold garbage the ops must ignore).
    Raises ValueError for decode rows of unequal query length or a too narrow table_width.
    """
    dql = rows[0][1] if num_decodes else 1
    if any(ql != dql for _, ql in rows[:num_decodes]):
        raise ValueError(f"make_paged_batch: decode rows need one query length, got {rows[:num_decodes]}")
    gen = torch.Generator(device="cpu").manual_seed(seed)
    ps = page_size
    seq = [c + ql for c, ql in rows]
    npages = [-(-s // ps) for s in seq]
    width = table_width or max(npages)
    if width < max(npages):
        raise ValueError(f"make_paged_batch: table_width={width} < {max(npages)} pages needed")
    total = sum(npages) + spare_pages
    perm = torch.randperm(total, generator=gen)
    bt = torch.full((len(rows), width), -1, dtype=torch.int32)
    at = 0
    for r, n in enumerate(npages):
        bt[r, :n] = perm[at : at + n].to(torch.int32)
        at += n
    positions = torch.cat([torch.arange(c, c + ql) for c, ql in rows])
    slot = torch.cat(
        [
            bt[r, torch.arange(c, c + ql) // ps].long() * ps + torch.arange(c, c + ql) % ps
            for r, (c, ql) in enumerate(rows)
        ]
    )
    qsl = torch.zeros(len(rows) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor([ql for _, ql in rows]), 0)
    meta = PagedMetadata(
        positions=positions.to(device),
        slot_mapping=slot.to(device),
        block_tables=bt.to(device),
        context_lens=torch.tensor([c for c, _ in rows], dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq, dtype=torch.int32, device=device),
        query_start_loc=qsl.to(device),
        num_decodes=num_decodes,
        decode_query_len=dql,
        max_query_len=max(ql for _, ql in rows),
        max_seq_len=max(seq),
    )
    t = positions.shape[0]
    dgen = torch.Generator(device=device).manual_seed(seed + 1)

    def rnd(*shape):
        return torch.randn(*shape, generator=dgen, device=device, dtype=torch.float32).to(dtype)

    return PagedBatch(
        q=rnd(t, q_heads, head_dim),
        iq=rnd(t, kv_heads, index_dim),
        k=rnd(total, kv_heads, ps, head_dim),
        v=rnd(total, kv_heads, ps, head_dim),
        ik=rnd(total, ps, index_dim),
        meta=meta,
    )

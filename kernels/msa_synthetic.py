"""Synthetic paged batches for the MSA kernel tests and benchmark (layout: kernels/paged_layout.py).

Governing idea: build exactly the tensors the engine hands the ops — one layer's K/V/index-key
pages in a shuffled physical order, block tables, flat varlen query tokens, decode-first rows —
from a list of (context_len, query_len) rows, with random contents (``make_paged_batch``), or
from named sequences with fixed per-position contents (``random_sequences`` + ``make_step_batch``),
so that the same position can be run in differently shaped steps (the batch-invariance tests).
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


@dataclass
class SequenceContents:
    """Per-position contents of named sequences (position i of sequence s = row i of each tensor):
    q [N, nh, d], iq [N, G, di], k, v [N, G, d], ik [N, di]."""

    q: dict[str, torch.Tensor]
    iq: dict[str, torch.Tensor]
    k: dict[str, torch.Tensor]
    v: dict[str, torch.Tensor]
    ik: dict[str, torch.Tensor]


def random_sequences(
    lengths: dict[str, int],
    *,
    kv_heads: int,
    q_heads: int,
    head_dim: int,
    index_dim: int,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
    seed: int = 0,
) -> SequenceContents:
    """N(0, 1) contents for sequences {name: length} (drawn in fp32 with a seeded generator on ``device``)."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).to(dtype)

    out = SequenceContents({}, {}, {}, {}, {})
    for name, n in lengths.items():
        out.q[name], out.iq[name] = rnd(n, q_heads, head_dim), rnd(n, kv_heads, index_dim)
        out.k[name], out.v[name] = rnd(n, kv_heads, head_dim), rnd(n, kv_heads, head_dim)
        out.ik[name] = rnd(n, index_dim)
    return out


def make_step_batch(
    seqs: SequenceContents,
    rows: list[tuple[str, int, int]],
    num_decodes: int,
    *,
    page_size: int,
    pad_rows: int = 0,
    table_width: int | None = None,
    seed: int = 0,
) -> PagedBatch:
    """One step's inputs over named sequences, the caches as the engine leaves them after the step's writes.

    rows: (sequence, context_len, query_len), decode rows first (the first ``num_decodes`` share one
    query length). Every row gets its own physical pages (a seeded shuffle, two spare pages) holding
    its sequence's K / V / index keys at positions < context_len + query_len and zeros after (the
    slots later tokens write), so a decode row sees a half-written last page. ``pad_rows`` CUDA-graph
    padding rows follow the decode rows (engine/decode_graph.py: position 0, slot -1, query length 1,
    context 0, block 0 = the null page, the last page; random queries); they count as decode rows.
    Block tables are -1 padded to ``table_width`` (default: the widest row).
    Raises ValueError for decode rows of unequal query length or a too narrow table_width.
    """
    dql = rows[0][2] if num_decodes else 1
    if any(ql != dql for _, _, ql in rows[:num_decodes]) or (pad_rows and dql != 1):
        raise ValueError(f"make_step_batch: decode rows (and padding rows) need one query length, got {rows}")
    name0 = next(iter(seqs.k))
    dtype, dev = seqs.k[name0].dtype, seqs.k[name0].device
    g, d = seqs.k[name0].shape[1:]
    nh, di = seqs.q[name0].shape[1], seqs.ik[name0].shape[1]
    ps = page_size
    npages = [-(-(c + ql) // ps) for _, c, ql in rows]
    width = table_width or max(npages)
    if width < max(npages):
        raise ValueError(f"make_step_batch: table_width={width} < {max(npages)} pages needed")
    gen = torch.Generator(device="cpu").manual_seed(seed)
    n_real = sum(npages)
    null = n_real + 2  # two spare pages, then the null page
    perm = torch.randperm(n_real + 2, generator=gen).to(dev)
    k = torch.zeros(null + 1, g, ps, d, dtype=dtype, device=dev)
    v = torch.zeros_like(k)
    ik = torch.zeros(null + 1, ps, di, dtype=dtype, device=dev)
    padded: list = list(rows[:num_decodes]) + [None] * pad_rows + list(rows[num_decodes:])
    bt = torch.full((len(padded), width), -1, dtype=torch.int32, device=dev)
    qs, iqs, pos, slots, ctx, seq_lens, qlens = [], [], [], [], [], [], []
    dgen = torch.Generator(device=dev).manual_seed(seed + 1)
    at = 0
    for r, row in enumerate(padded):
        if row is None:
            bt[r, 0] = null
            qs.append(torch.randn(1, nh, d, generator=dgen, device=dev).to(dtype))
            iqs.append(torch.randn(1, g, di, generator=dgen, device=dev).to(dtype))
            pos.append(torch.zeros(1, dtype=torch.long, device=dev))
            slots.append(torch.full((1,), -1, dtype=torch.long, device=dev))
            ctx.append(0)
            seq_lens.append(1)
            qlens.append(1)
            continue
        name, c, ql = row
        end = c + ql
        pages = perm[at : at + -(-end // ps)]
        at += pages.shape[0]
        bt[r, : pages.shape[0]] = pages.to(torch.int32)
        p_all = torch.arange(end, device=dev)
        page_of, off = pages[p_all // ps], p_all % ps
        k[page_of, :, off] = seqs.k[name][:end]
        v[page_of, :, off] = seqs.v[name][:end]
        ik[page_of, off] = seqs.ik[name][:end]
        p = p_all[c:]
        qs.append(seqs.q[name][c:end])
        iqs.append(seqs.iq[name][c:end])
        pos.append(p)
        slots.append(page_of[c:].long() * ps + off[c:])
        ctx.append(c)
        seq_lens.append(end)
        qlens.append(ql)
    qsl = torch.zeros(len(padded) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(qlens), 0)
    nd = num_decodes + pad_rows
    meta = PagedMetadata(
        positions=torch.cat(pos),
        slot_mapping=torch.cat(slots),
        block_tables=bt,
        context_lens=torch.tensor(ctx, dtype=torch.int32, device=dev),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
        query_start_loc=qsl.to(dev),
        num_decodes=nd,
        decode_query_len=dql,
        max_query_len=max(qlens),
        max_seq_len=max(seq_lens),
    )
    return PagedBatch(q=torch.cat(qs), iq=torch.cat(iqs), k=k, v=v, ik=ik, meta=meta)

"""Model runner: a scheduled step -> per-step paged metadata -> one model forward -> logits.

Governing idea: tensors are made in one place. :func:`prepare_inputs` turns plain lists (token
ids, context lengths, block tables of the scheduled rows) into the flat varlen
:class:`PagedMetadata` of ``engine/paged_cache.py``; :class:`ModelRunner` moves it to the device
and calls ``M3ForCausalLM.forward_paged``, returning the logits of the rows that sample.

NOTE (context passing): metadata is passed explicitly (``forward_paged(ids, meta, kv)``), not
through a global context object.

CUDA graphs (GPU only, off by default, untested on this CPU machine): decode steps use
preallocated buffers sized ``max_num_seqs`` (:class:`DecodeBuffers`), so a captured graph can be
replayed after copying the step's inputs into them; see :class:`CudaGraphDecode`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from m3_rollout.engine.paged_cache import PagedKVCache, PagedMetadata


@dataclass
class StepInputs:
    """Host tensors of one step: ``input_ids [T]`` int64, ``meta`` and ``logits_indices [N]``
    (index of the last token of every row that samples, in row order)."""

    input_ids: torch.Tensor
    meta: PagedMetadata
    logits_indices: torch.Tensor


def prepare_inputs(chunks: list[list[int]], context_lens: list[int], block_tables: list[list[int]],
                   page_size: int, num_decodes: int, sample_rows: list[bool] | None = None,
                   decode_query_len: int = 1) -> StepInputs:
    """Build the flat varlen inputs of one step (layout: engine/paged_cache.py).

    Args:
        chunks: per row r, the query token ids (decode rows first: ``num_decodes`` rows of
            ``decode_query_len`` tokens each, then prefill chunks).
        context_lens: per row, tokens already in the pages before this step.
        block_tables: per row, physical pages covering at least ``context_len + len(chunk)``.
        page_size: ps. sample_rows: which rows' last-token logits are wanted (default all).

    Returns:
        StepInputs on the CPU. Raises ValueError on inconsistent lengths or a missing page.
    """
    r = len(chunks)
    if not (len(context_lens) == len(block_tables) == r):
        raise ValueError(f"rows disagree: {r} chunks, {len(context_lens)} context_lens, "
                         f"{len(block_tables)} block tables")
    qlens = [len(c) for c in chunks]
    if any(q != decode_query_len for q in qlens[:num_decodes]):
        raise ValueError(f"decode rows must have decode_query_len={decode_query_len} tokens, got {qlens[:num_decodes]}")
    seq_lens = [c + q for c, q in zip(context_lens, qlens)]
    width = max((len(b) for b in block_tables), default=0)
    for i, (b, s) in enumerate(zip(block_tables, seq_lens)):
        if len(b) * page_size < s:
            raise ValueError(f"row {i}: {len(b)} pages cannot hold {s} tokens (page_size {page_size})")
    flat_ids = [t for c in chunks for t in c]
    flat_bt = [p for b in block_tables for p in (b + [-1] * (width - len(b)))]
    bt = torch.tensor(flat_bt, dtype=torch.int32).view(r, width)  # [R, max_pages]
    qlen_t = torch.tensor(qlens, dtype=torch.int64)
    ctx_t = torch.tensor(context_lens, dtype=torch.int64)
    qsl = torch.zeros(r + 1, dtype=torch.int64)
    torch.cumsum(qlen_t, 0, out=qsl[1:])
    t = len(flat_ids)
    row = torch.repeat_interleave(torch.arange(r), qlen_t)  # [T]
    positions = ctx_t[row] + torch.arange(t) - qsl[row]  # [T]
    page = bt.long()[row, positions // page_size] if t else torch.zeros(0, dtype=torch.int64)
    slot = page * page_size + positions % page_size  # [T]
    if sample_rows is None:
        sample_rows = [True] * r
    last = qsl[1:] - 1  # [R]
    logits_indices = last[torch.tensor(sample_rows, dtype=torch.bool)] if r else last
    meta = PagedMetadata(
        positions=positions, slot_mapping=slot, block_tables=bt,
        context_lens=ctx_t.to(torch.int32), seq_lens=(ctx_t + qlen_t).to(torch.int32),
        query_start_loc=qsl.to(torch.int32), num_decodes=num_decodes, decode_query_len=decode_query_len,
        max_query_len=max(qlens, default=0), max_seq_len=max(seq_lens, default=0))
    return StepInputs(torch.tensor(flat_ids, dtype=torch.int64), meta, logits_indices)


def meta_to(meta: PagedMetadata, device: torch.device) -> PagedMetadata:
    """The same metadata with its tensors on ``device`` (host ints unchanged)."""
    if meta.positions.device == device:
        return meta
    move = lambda x: x.to(device, non_blocking=True)  # noqa: E731
    return PagedMetadata(move(meta.positions), move(meta.slot_mapping), move(meta.block_tables),
                         move(meta.context_lens), move(meta.seq_lens), move(meta.query_start_loc),
                         meta.num_decodes, meta.decode_query_len, meta.max_query_len, meta.max_seq_len)


class DecodeBuffers:
    """Preallocated device tensors for decode steps of up to ``max_num_seqs`` rows (stable
    addresses for CUDA-graph replay). Padding rows: token 0 at position 0, slot -1, context 0,
    block 0 = the null page, the rest -1 (their outputs are dropped)."""

    def __init__(self, max_num_seqs: int, max_pages: int, device: torch.device, null_page: int):
        n = max_num_seqs
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.block_tables = torch.full((n, max_pages), -1, dtype=torch.int32, device=device)
        # NOTE: padding rows (seq_len 1) still read their block 0 in the kernels: point it at the
        # null page (paged_cache.py), where their slot -1 writes also land; outputs are dropped.
        self.null_page = null_page
        self.block_tables[:, 0] = null_page
        self.context_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)

    def fill(self, inputs: StepInputs, padded_rows: int, max_seq_len: int) -> tuple[torch.Tensor, PagedMetadata]:
        """Copy a decode step's host inputs into the first rows; return views of ``padded_rows`` rows."""
        m, r = inputs.meta, inputs.meta.num_rows
        self.input_ids[:r].copy_(inputs.input_ids)
        self.positions[:r].copy_(m.positions)
        self.slot_mapping[:r].copy_(m.slot_mapping)
        self.slot_mapping[r:padded_rows].fill_(-1)
        self.block_tables[:padded_rows].fill_(-1)
        self.block_tables[r:padded_rows, 0] = self.null_page
        self.block_tables[:r, :m.block_tables.shape[1]].copy_(m.block_tables)
        self.context_lens[:r].copy_(m.context_lens)
        self.context_lens[r:padded_rows].zero_()
        self.seq_lens[:r].copy_(m.seq_lens)
        self.seq_lens[r:padded_rows].fill_(1)
        p = padded_rows
        meta = PagedMetadata(self.positions[:p], self.slot_mapping[:p], self.block_tables[:p], self.context_lens[:p],
                             self.seq_lens[:p], self.query_start_loc[:p + 1], p, 1, 1, max_seq_len)
        return self.input_ids[:p], meta


class CudaGraphDecode:
    """GPU-ONLY, EXPERIMENTAL: capture one decode forward per padded batch size and replay it.

    Requires the MSA/MoE ops to be capturable (no host syncs, fixed shapes): true for the Triton
    kernels of issues 4/5, not for the PyTorch references (which sync on data-dependent shapes).
    The captured ``max_seq_len`` is the engine's ``max_model_len``, so the graphs stay valid for
    every step. Capture failures disable the path (eager fallback) with a warning.
    """

    def __init__(self, model, kv: PagedKVCache, buffers: DecodeBuffers, max_num_seqs: int, max_model_len: int):
        assert kv.device.type == "cuda", "CUDA graphs are GPU-only"
        self.model, self.kv, self.buffers = model, kv, buffers
        self.max_model_len = max_model_len
        self.sizes = sorted({min(s, max_num_seqs) for s in (1, 2, 4, 8, 16, 32, 64, 128, 256, max_num_seqs)})
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None

    def capture(self) -> None:
        for size in reversed(self.sizes):
            ids, meta = self.buffers.input_ids[:size], PagedMetadata(
                self.buffers.positions[:size], self.buffers.slot_mapping[:size], self.buffers.block_tables[:size],
                self.buffers.context_lens[:size], self.buffers.seq_lens[:size],
                self.buffers.query_start_loc[:size + 1], size, 1, 1, self.max_model_len)
            self.model.forward_paged(ids, meta, self.kv)  # warm-up (kernel autotune, allocations)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                out = self.model.forward_paged(ids, meta, self.kv)
            self.pool = graph.pool()
            self.graphs[size] = (graph, out)

    def run(self, inputs: StepInputs) -> torch.Tensor | None:
        """Logits [R, V] of a plain decode step, or None when no graph fits (caller runs eager)."""
        r = inputs.meta.num_rows
        size = next((s for s in self.sizes if s >= r), None)
        if size is None or size not in self.graphs:
            return None
        self.buffers.fill(inputs, size, self.max_model_len)
        graph, out = self.graphs[size]
        graph.replay()
        return out[:r]


class ModelRunner:
    """Runs ``forward_paged`` for a step and returns the sampled rows' logits.

    Args:
        model: ``M3ForCausalLM`` on its device, eval mode; kv: the page pool.
        max_num_seqs, max_model_len: sizes of the decode buffers / graphs.
        enable_cuda_graphs: GPU only; ignored (with eager execution) on other devices.
    """

    def __init__(self, model, kv: PagedKVCache, max_num_seqs: int, max_model_len: int,
                 enable_cuda_graphs: bool = False):
        self.model, self.kv = model, kv
        self.device = kv.device
        self.page_size = kv.page_size
        self.graphs: CudaGraphDecode | None = None
        if enable_cuda_graphs and self.device.type == "cuda":
            max_pages = -(-max_model_len // self.page_size)
            buffers = DecodeBuffers(max_num_seqs, max_pages, self.device, kv.null_page)
            try:
                self.graphs = CudaGraphDecode(model, kv, buffers, max_num_seqs, max_model_len)
                with torch.no_grad():
                    self.graphs.capture()
            except Exception as exc:  # NOTE: eager fallback; the references are not capturable
                import warnings

                warnings.warn(f"CUDA-graph capture failed, decode runs eagerly: {exc}")
                self.graphs = None

    @torch.no_grad()
    def execute(self, inputs: StepInputs) -> torch.Tensor:
        """One model forward; returns logits [N, V] (model dtype) of ``inputs.logits_indices``."""
        m = inputs.meta
        if self.graphs is not None and m.num_decodes == m.num_rows > 0 and m.decode_query_len == 1:
            out = self.graphs.run(inputs)
            if out is not None:
                return out[inputs.logits_indices.to(self.device)]
        meta = meta_to(m, self.device)
        return self.model.forward_paged(inputs.input_ids.to(self.device), meta, self.kv,
                                        inputs.logits_indices.to(self.device))

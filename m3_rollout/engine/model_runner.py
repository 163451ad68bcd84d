"""Model runner: a scheduled step -> per-step paged metadata -> one forward + sampler on the device.

Governing idea: tensors are made in one place. :func:`prepare_inputs` turns plain lists (token
ids, context lengths, block tables of the scheduled rows) into the flat varlen
:class:`PagedMetadata` of ``kernels/paged_layout.py``; :class:`ModelRunner` moves it to the device,
calls ``M3ForCausalLM.forward_paged``, samples the rows that sample (``sampler.sample_rows``, no
host syncs) and starts one non-blocking copy of the sampled ids + logprobs to the host
(:class:`StepLaunch`; the caller decides when to wait for it: async scheduling waits one step later).

NOTE (context passing): metadata and the fast-op table are passed explicitly
(``forward_paged(ids, meta, kv, ops)``; ``ops`` from ``engine/ops.py``), not through a global
context object.

CUDA graphs (GPU only): plain decode steps replay captured forward + sampler graphs over inputs
that :func:`prepare_decode` writes into the graphs' fixed staging buffers (``engine/decode_graph.py``);
other steps run eagerly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from m3_kernels.paged_layout import PagedMetadata
from m3_rollout.engine.interface import PositionLogprobs
from m3_rollout.engine.ops import paged_ops_for
from m3_rollout.engine.paged_cache import PagedKVCache
from m3_rollout.engine.sampler import Penalties, position_logprobs, sample_rows, top_logprobs_rows, unpack_sampling
from m3_rollout.model.numerics import compute_dtype
from m3_rollout.model.paged_ops import PagedOps

if TYPE_CHECKING:
    from m3_rollout.engine.decode_graph import DecodeStage


@dataclass
class StepInputs:
    """Host tensors of one step: ``input_ids [T]`` int64, ``meta``, ``logits_indices [N]``
    (index of the last token of every row that samples, in row order) and ``prompt_indices [M]``
    (the tokens whose logits score prompt logprobs, rows in order; None when no row asks)."""

    input_ids: torch.Tensor
    meta: PagedMetadata
    logits_indices: torch.Tensor
    prompt_indices: torch.Tensor | None = None


def prepare_inputs(
    chunks: list[list[int]],
    context_lens: list[int],
    block_tables: list[list[int]],
    page_size: int,
    num_decodes: int,
    sample_rows: list[bool] | None = None,
    decode_query_len: int = 1,
    prompt_spans: list[tuple[int, int]] | None = None,
) -> StepInputs:
    """Build the flat varlen inputs of one step (layout: kernels/paged_layout.py).

    Args:
        chunks: per row r, the query token ids (decode rows first: ``num_decodes`` rows of
            ``decode_query_len`` tokens each, then prefill chunks).
        context_lens: per row, tokens already in the pages before this step.
        block_tables: per row, physical pages covering at least ``context_len + len(chunk)``.
        page_size: ps. sample_rows: which rows' last-token logits are wanted (default all).
        prompt_spans: per row, (first, count): the chunk's tokens first .. first + count - 1 whose
            logits score prompt logprobs ((0, 0): none); None = no row.

    Returns:
        StepInputs on the CPU. Raises ValueError on inconsistent lengths or a missing page.
    """
    r = len(chunks)
    if not (len(context_lens) == len(block_tables) == r):
        raise ValueError(
            f"rows disagree: {r} chunks, {len(context_lens)} context_lens, {len(block_tables)} block tables"
        )
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
        positions=positions,
        slot_mapping=slot,
        block_tables=bt,
        context_lens=ctx_t.to(torch.int32),
        seq_lens=(ctx_t + qlen_t).to(torch.int32),
        query_start_loc=qsl.to(torch.int32),
        num_decodes=num_decodes,
        decode_query_len=decode_query_len,
        max_query_len=max(qlens, default=0),
        max_seq_len=max(seq_lens, default=0),
    )
    prompt_indices = None
    if prompt_spans is not None and any(n for _, n in prompt_spans):
        starts = qsl[:-1].tolist()
        prompt_indices = torch.tensor(
            [starts[i] + j for i, (a, n) in enumerate(prompt_spans) for j in range(a, a + n)], dtype=torch.int64
        )
    return StepInputs(torch.tensor(flat_ids, dtype=torch.int64), meta, logits_indices, prompt_indices)


def prepare_decode(
    stage: DecodeStage,
    block_tables_out: np.ndarray,
    input_ids: list[int],
    token_src: list[int],
    context_lens: list[int],
    block_tables: list[list[int]],
    page_size: int,
) -> None:
    """Write a plain decode step of R rows (one query token each) into a decode graph's host
    staging (``decode_graph.CudaGraphDecode.stage_rows``): the captured-graph counterpart of
    :func:`prepare_inputs`, filling fixed pinned buffers with plain numpy writes (no tensors
    built; the host-time-critical path).

    Args:
        stage: the named staging fields of the R rows (int64 [R] each).
        block_tables_out: int32 [R, max_pages], -1 filled; row r gets ``block_tables[r]``.
        input_ids: per row, the query token id (ignored where ``token_src[r] >= 0``).
        token_src: per row, -1 or the index into the runner's ``last_tokens`` holding the id.
        context_lens: per row, tokens already in the pages (the query token's position).
        block_tables: per row, physical pages covering at least ``context_len + 1`` tokens.
        page_size: ps.
    """
    slots = []
    for i, (c, table) in enumerate(zip(context_lens, block_tables)):
        block_tables_out[i, : len(table)] = table
        slots.append(table[c // page_size] * page_size + c % page_size)
    stage.host_ids[:] = input_ids
    stage.token_src[:] = token_src
    stage.positions[:] = context_lens
    stage.slot_mapping[:] = slots
    stage.context_lens[:] = context_lens
    stage.seq_lens[:] = stage.context_lens + 1


def meta_to(meta: PagedMetadata, device: torch.device) -> PagedMetadata:
    """The same metadata with its tensors on ``device`` (host ints unchanged)."""
    if meta.positions.device == device:
        return meta
    move = lambda x: x.to(device, non_blocking=True)  # noqa: E731
    return PagedMetadata(
        move(meta.positions),
        move(meta.slot_mapping),
        move(meta.block_tables),
        move(meta.context_lens),
        move(meta.seq_lens),
        move(meta.query_start_loc),
        meta.num_decodes,
        meta.decode_query_len,
        meta.max_query_len,
        meta.max_seq_len,
    )


@dataclass
class SampleBatch:
    """Host description of a step's sampling (N sample rows).

    packed: int64 [NUM_SAMPLING_FIELDS, N] (``sampler.pack_sampling``). expand: logits row of each
    sample row (a group leader's prompt logits serve its n samples), None = row i -> logits row i.
    need_top_k / need_top_p: any row filters. raw_mode: "processed", "raw" or "mixed" (per-row
    flag in ``packed``). num_row_seqs: the first sample rows that are scheduled rows (not forked
    children); their ids are kept on the device (``ModelRunner.last_tokens``) as the next step's
    inputs. penalties: the rows with penalties / logit biases (host tensors), or None.
    """

    packed: np.ndarray
    expand: list[int] | None
    need_top_k: bool
    need_top_p: bool
    raw_mode: str
    num_row_seqs: int
    top: TopAsk | None = None
    penalties: Penalties | None = None


@dataclass
class TopAsk:
    """The sample rows of a step whose requests ask for top logprobs (``SamplingParams.top_logprobs``):
    ``rows`` (sample-row indices, ascending) and each one's ``ks`` (>= 1). Steps with none pass None."""

    rows: list[int]
    ks: list[int]

    def compute(self, logits, params, raw, need_top_k: bool, need_top_p: bool, batch_invariant: bool, penalties=None):
        """``sampler.top_logprobs_rows`` of these rows -> (int64 [2 * M * k'] (ids, then logprobs as
        float64 bits), k'), k' = min(max(ks), V): the tail of a step's result copy. penalties: the
        step's (device) :class:`Penalties`, as the sampler applied them, or None."""
        rows = torch.tensor(self.rows, dtype=torch.int64).to(logits.device, non_blocking=True)
        ids, vals = top_logprobs_rows(
            logits, params, raw, rows, max(self.ks), need_top_k, need_top_p, batch_invariant, penalties
        )
        return torch.cat([ids.reshape(-1), vals.double().view(torch.int64).reshape(-1)]), ids.shape[1]


PROMPT_LOGITS_BYTES = 1 << 28  # fp32 logits of one row chunk of prompt logprobs, at most


@dataclass
class PromptAsk:
    """The prefill rows of a step that score prompt positions (``SamplingParams.prompt_logprobs``),
    in row order: ``counts`` (positions per row, >= 1), each row's ``filters`` ((temperature, top_k,
    top_p): ``SamplingParams.logprob_filters``) and ``ks`` (top-list lengths, >= 0), ``targets``
    ([sum counts] each position's next prompt token; the positions are ``StepInputs.prompt_indices``)."""

    counts: list[int]
    filters: list[tuple[float, int, float]]
    ks: list[int]
    targets: list[int]

    def compute(self, model, ops, hidden: torch.Tensor, batch_invariant: bool, token_logprobs=None):
        """Score the positions from their final hidden states ``hidden`` [M, H]: per row, in chunks
        of at most ``PROMPT_LOGITS_BYTES`` of fp32 logits (never a [M, V] array), the lm_head
        (``ops.project``) then ``sampler.position_logprobs``. Returns (int64 [M * (2 + 2 k')]:
        logprobs (float64 bits) [M], ranks [M], top ids [M, k'], top logprobs (float64 bits) [M, k'],
        k'), k' = min(max(ks), V): the tail of a step's result copy."""
        v = model.lm_head.weight.shape[0]
        k, step = min(max(self.ks), v), max(1, PROMPT_LOGITS_BYTES // (4 * v))
        tgt = torch.tensor(self.targets, dtype=torch.int64).to(hidden.device, non_blocking=True)
        parts, start = [], 0
        for n, (temperature, top_k, top_p) in zip(self.counts, self.filters):
            for a in range(start, start + n, step):
                b = min(a + step, start + n)
                logits = ops.project(model.lm_head, hidden[a:b])  # [R, V]
                parts.append(
                    position_logprobs(logits, tgt[a:b], k, temperature, top_k, top_p, batch_invariant, token_logprobs)
                )
            start += n
        own, rank, ids, vals = (torch.cat(x) for x in zip(*parts))
        flat = [own.double().view(torch.int64), rank, ids.reshape(-1), vals.double().view(torch.int64).reshape(-1)]
        return torch.cat(flat), k


class StepLaunch:
    """A launched step's sampled ids and logprobs on their way to the host.

    ``flat``: int64 [2 * width] (ids, then logprobs as float64 bits), then the top lists
    (:meth:`fetch_top`), then the prompt scores (:meth:`fetch_prompt`), host memory (pinned on
    CUDA, filled by a non-blocking copy that ``event`` follows). :meth:`fetch` waits for it.
    """

    def __init__(
        self,
        flat: torch.Tensor | None,
        width: int,
        rows: int,
        event=None,
        top: TopAsk | None = None,
        top_k: int = 0,
        prompt: PromptAsk | None = None,
        prompt_k: int = 0,
    ):
        self.flat, self.width, self.rows, self.event = flat, width, rows, event
        self.top, self.top_k = top, top_k  # the asking rows and the listed k' (their lists follow the logprobs)
        self.prompt, self.prompt_k = prompt, prompt_k  # the rows scoring prompt positions, their k' (at the end)

    def fetch_prompt(self) -> list[list[PositionLogprobs]]:
        """Per :class:`PromptAsk` row, its positions' ``PositionLogprobs`` (the row's own k entries
        at most, tokens the filters removed left out); [] when no row asked. Waits for the copy."""
        if self.prompt is None:
            return []
        if self.event is not None:
            self.event.synchronize()
        m, k = len(self.prompt.targets), self.prompt_k
        tail = self.flat[self.flat.shape[0] - m * (2 + 2 * k) :]
        own = tail[:m].view(torch.float64).tolist()
        rank = tail[m : 2 * m].tolist()
        ids = tail[2 * m : 2 * m + m * k].tolist()
        vals = tail[2 * m + m * k :].view(torch.float64).tolist()
        out, i = [], 0
        for n, want in zip(self.prompt.counts, self.prompt.ks):
            row = []
            want = min(want, k)  # k' = min(max(ks), V): a k above the vocabulary lists all of it
            for j in range(i, i + n):
                pairs = zip(ids[j * k : j * k + want], vals[j * k : j * k + want])
                row.append(PositionLogprobs(own[j], rank[j], [(t, x) for t, x in pairs if x != float("-inf")]))
            out.append(row)
            i += n
        return out

    def fetch_top(self) -> dict[int, list[tuple[int, float]]]:
        """Sample row -> its top (token id, logprob) list, most likely first, the row's own k
        entries at most, tokens the filters removed (-inf) left out; {} when no row asked. Call
        after :meth:`fetch` (the copy has landed)."""
        if self.top is None:
            return {}
        m, k, base = len(self.top.rows), self.top_k, 2 * self.width
        ids = self.flat[base : base + m * k].tolist()
        lps = self.flat[base + m * k : base + 2 * m * k].view(torch.float64).tolist()
        out = {}
        for i, (row, want) in enumerate(zip(self.top.rows, self.top.ks)):
            pairs = zip(ids[i * k : i * k + want], lps[i * k : i * k + want])
            out[row] = [(t, v) for t, v in pairs if v != float("-inf")]
        return out

    def fetch(self) -> tuple[list[int], list[float]]:
        """(ids, logprobs) of the ``rows`` sample rows; blocks until the copy has landed."""
        if self.rows == 0:
            return [], []
        if self.event is not None:
            self.event.synchronize()
        w, r = self.width, self.rows
        return self.flat[:r].tolist(), self.flat[w : w + r].view(torch.float64).tolist()


class ModelRunner:
    """Runs one step on the device: forward, sampler, and the copy of the results to the host.

    Args:
        model: ``M3ForCausalLM`` on its device, eval mode; kv: the page pool.
        max_num_seqs, max_model_len: sizes of the decode graphs' buffers.
        enable_cuda_graphs: GPU only; ignored (eager execution) on other devices. "eager": the
            staged decode path of ``decode_graph.py`` with its bodies run eagerly (any device; tests).
        cuda_graph_batch_sizes: padded decode sizes to capture (default: powers of two to 256).
        max_num_batched_tokens: the step token budget (bounds the rows of a step, hence
            the length of ``last_tokens``).
        fused_sampler: decode graphs sample with the one-kernel Triton sampler (None = on CUDA).
        ops: the fast-op table of the model's paged forward (``self.ops``); None =
            ``paged_ops_for(kv.device, <the model's activation dtype>)``.
        selection_buffer: the block-selection record's step buffer (int16 [>= tokens of a step,
            S, G, K], ``selection_cache.SelectionCache.step_buffer``) every forward writes its
            sparse layers' choices into; None = not recorded.
        token_logprobs: the sampler's logprob op for every step, eager and graph (batch-invariant
            mode: ``engine.ops.invariant_token_logprobs``); None = ``torch.log_softmax`` (and the
            fused Triton sampler in the decode graphs).
        batch_invariant: the sampler's top-k / top-p supports depend on each row alone
            (``sampler.process_logits``; ``EngineConfig.batch_invariant``), eager and graph steps.
    """

    def __init__(
        self,
        model,
        kv: PagedKVCache,
        max_num_seqs: int,
        max_model_len: int,
        enable_cuda_graphs: bool = False,
        cuda_graph_batch_sizes: tuple[int, ...] | None = None,
        max_num_batched_tokens: int = 0,
        fused_sampler: bool | None = None,
        ops: PagedOps | None = None,
        selection_buffer: torch.Tensor | None = None,
        token_logprobs=None,
        batch_invariant: bool = False,
    ):
        self.model, self.kv = model, kv
        self.selection_buffer = selection_buffer
        self.token_logprobs = token_logprobs
        self.batch_invariant = batch_invariant
        self.device = kv.device
        self.ops = paged_ops_for(self.device, model.model.embed_tokens.weight.dtype) if ops is None else ops
        self.page_size = kv.page_size
        self.cuda = self.device.type == "cuda"
        cap = max(max_num_seqs, max_num_batched_tokens, 1)
        # Sampled ids of the last step's scheduled rows (sample-row order), read by the next step
        # for rows whose input token has not reached the host (async scheduling).
        self.last_tokens = torch.zeros(cap, dtype=torch.int64, device=self.device)
        self._out_host: list[torch.Tensor] = []
        self._out_flip = 0
        self.graphs = None
        staged_only = enable_cuda_graphs == "eager"  # the staged decode path without graphs (CPU tests)
        if staged_only or (enable_cuda_graphs and self.cuda):
            from m3_rollout.engine.decode_graph import CudaGraphDecode

            try:
                graphs = CudaGraphDecode(
                    model,
                    kv,
                    self.ops,
                    max_num_seqs,
                    max_model_len,
                    self.last_tokens,
                    cuda_graph_batch_sizes,
                    use_graphs=not staged_only,
                    fused_sampler=fused_sampler,
                    selection_buffer=selection_buffer,
                    token_logprobs=token_logprobs,
                    batch_invariant=batch_invariant,
                )
                with torch.no_grad():
                    graphs.capture()
                self.graphs = graphs
            except Exception as exc:  # NOTE: eager fallback; the references are not capturable
                if staged_only:
                    raise
                import warnings

                warnings.warn(f"CUDA-graph capture failed, decode runs eagerly: {exc}", stacklevel=2)

    # ---- sleep / wake-up ---------------------------------------------------------------------
    def release_graphs(self) -> None:
        """Drop the captured decode graphs and their memory pool (engine sleep; no-op without graphs)."""
        if self.graphs is not None:
            self.graphs.release()

    def capture_graphs(self) -> None:
        """Re-capture the decode graphs over the current tensor addresses (engine wake-up)."""
        if self.graphs is not None:
            with torch.no_grad():
                self.graphs.capture()

    # ---- eager path ----------------------------------------------------------------------------
    @torch.no_grad()
    def forward(
        self, inputs: StepInputs, token_src: list[int] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Eager forward; (logits [N, V] (model dtype) of ``inputs.logits_indices``, final hidden
        states [M, H] of ``inputs.prompt_indices`` or None).

        token_src: per token, -1 (use ``inputs.input_ids``) or an index into ``last_tokens`` (the
        previous step's sampled id); None = all from the host."""
        ids = inputs.input_ids.to(self.device, non_blocking=True)
        if token_src is not None and any(i >= 0 for i in token_src):
            src = torch.tensor(token_src, dtype=torch.int64).to(self.device, non_blocking=True)
            ids = torch.where(src >= 0, self.last_tokens[src.clamp(min=0)], ids)
        meta = meta_to(inputs.meta, self.device)
        logits_indices = inputs.logits_indices.to(self.device, non_blocking=True)
        kept = None if inputs.prompt_indices is None else inputs.prompt_indices.to(self.device, non_blocking=True)
        out = self.model.forward_paged(
            ids, meta, self.kv, self.ops, logits_indices, selection_out=self.selection_buffer, hidden_indices=kept
        )
        return (out, None) if kept is None else out

    @torch.no_grad()
    def launch(
        self,
        inputs: StepInputs,
        token_src: list[int] | None,
        sampling: SampleBatch | None,
        prompt: PromptAsk | None = None,
    ) -> StepLaunch:
        """Eager forward + sampler of any step; results come back through :class:`StepLaunch`.
        ``prompt``: the rows scoring prompt positions (``inputs.prompt_indices``), scored after
        the sampler from their own lm_head projection (the sampled rows' logits keep their bits)."""
        logits, hidden = self.forward(inputs, token_src)
        parts, rows, top, top_k = [], 0, None, 0
        if sampling is not None:
            parts, rows, top, top_k = self._sample(logits, sampling)
        prompt_k = 0
        if prompt is not None:
            extra, prompt_k = prompt.compute(self.model, self.ops, hidden, self.batch_invariant, self.token_logprobs)
            parts.append(extra)
        if not parts:
            return StepLaunch(None, 0, 0)
        return self._to_host(torch.cat(parts), rows, rows, top, top_k, prompt, prompt_k)

    def _sample(self, logits: torch.Tensor, sampling: SampleBatch) -> tuple[list, int, TopAsk | None, int]:
        """The sampler of an eager step: (result parts: ids, logprobs (float64 bits), top lists;
        sample rows; the asking rows; their listed k')."""
        if sampling.expand is not None:
            logits = logits[torch.tensor(sampling.expand, dtype=torch.int64).to(self.device, non_blocking=True)]
        packed = torch.from_numpy(sampling.packed).to(self.device, non_blocking=True)
        params, positions, raw = unpack_sampling(packed)
        mode = raw if sampling.raw_mode == "mixed" else sampling.raw_mode
        penalties = sampling.penalties
        if penalties is not None:  # read before this step's ids overwrite last_tokens
            penalties = penalties.to(self.device, self.last_tokens)
        logits = logits.to(compute_dtype(logits.dtype))
        tokens, lps = sample_rows(
            logits,
            params,
            positions,
            mode,
            sampling.need_top_k,
            sampling.need_top_p,
            self.token_logprobs,
            self.batch_invariant,
            penalties,
        )
        k = sampling.num_row_seqs
        self.last_tokens[:k].copy_(tokens[:k])
        parts, top_k = [tokens, lps.double().view(torch.int64)], 0
        if sampling.top is not None:  # after the sampling, which it leaves as it was
            extra, top_k = sampling.top.compute(
                logits,
                params,
                raw,
                sampling.need_top_k,
                sampling.need_top_p,
                self.batch_invariant,
                penalties,
            )
            parts.append(extra)
        return parts, tokens.shape[0], sampling.top, top_k

    # ---- graph path -------------------------------------------------------------------------------
    def graph_size(self, rows: int) -> int | None:
        """Padded decode size for ``rows`` rows, or None when no captured graph fits."""
        return None if self.graphs is None else self.graphs.size_for(rows)

    @torch.no_grad()
    def launch_graph(
        self,
        rows: int,
        s: int,
        need_top_k: bool,
        need_top_p: bool,
        top: TopAsk | None = None,
        penalties: Penalties | None = None,
    ) -> StepLaunch:
        """Replay the decode graphs of size ``s`` on the staged inputs (``self.graphs.stage_rows``).
        ``top``: rows asking for top logprobs; their lists are computed eagerly from the graph's
        logits after its sampler ran (the forward and the sampled ids / logprobs are the graphs').
        ``penalties`` (host tensors, rows < ``rows``): the sampler then runs eagerly."""
        if penalties is not None:
            penalties = penalties.to(self.device, self.last_tokens)
        flat = self.graphs.launch(s, need_top_k, need_top_p, penalties)
        top_k = 0
        if top is not None:
            extra, top_k = self.graphs.top_logprobs(s, top, need_top_k, need_top_p, penalties)
            flat = torch.cat([flat, extra])
        return self._to_host(flat, s, rows, top, top_k)

    def _to_host(
        self,
        flat: torch.Tensor,
        width: int,
        rows: int,
        top: TopAsk | None = None,
        top_k: int = 0,
        prompt: PromptAsk | None = None,
        prompt_k: int = 0,
    ) -> StepLaunch:
        if not self.cuda:  # a copy: ``flat`` may be a static buffer the next step overwrites
            return StepLaunch(flat.clone(), width, rows, None, top, top_k, prompt, prompt_k)
        n = flat.shape[0]
        if not self._out_host or self._out_host[0].shape[0] < n:
            self._out_host = [torch.empty(max(n, 4096), dtype=torch.int64).pin_memory() for _ in range(2)]
        self._out_flip ^= 1
        host = self._out_host[self._out_flip][:n]
        host.copy_(flat, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return StepLaunch(host, width, rows, event, top, top_k, prompt, prompt_k)

"""CUDA-graph decode steps: one host-to-device copy in, forward + sampler replayed, one copy out.

Governing idea: a plain decode step (every row one query token, every row samples) has fixed
shapes once the batch is padded to a captured size, so everything the GPU does for it can be
replayed from CUDA graphs reading static buffers. The host writes the step's per-row numbers
into the named fields of a pinned staging array (:class:`DecodeStage`, int64 [F, S]) and the block tables (int32
[S, max_pages]), two views of one byte buffer (stage first, then the block-table rows), so one
non-blocking copy of its first bytes moves a step to the device; the forward graph's prologue
derives the model inputs from them (input ids of rows whose last token is still on the device
are gathered from the runner's ``last_tokens``, written by the previous step's sampler); the
sampler graph (temperature, keyed Gumbel-max, processed and raw logprobs) writes the sampled ids
and logprobs into one int64 [2, s] buffer and ``last_tokens``; one non-blocking copy brings that
back into pinned memory and an event marks it ready. Host staging is double-buffered: with async
scheduling the host fills step N+1's buffer while step N's copy may still be queued.

Padding rows (``r < row < s``): token 0 at position 0, slot -1 (writes land in the null page),
block 0 = the null page, context 0, temperature 1; their outputs are never read.

Capture needs CUDA and capturable MSA / MoE ops (the Triton kernels; the PyTorch references
sync on data-dependent shapes). With ``use_graphs=False`` the same bodies run eagerly on any
device (tests of the staged path on the CPU). Layout of the metadata: ``kernels/paged_layout.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from m3_kernels.paged_layout import PagedMetadata
from m3_rollout.engine.paged_cache import PagedKVCache
from m3_rollout.engine.sampler import (
    NUM_SAMPLING_FIELDS,
    Penalties,
    pack_sampling,
    sample_rows,
    sampling_fields,
    unpack_sampling,
    vocab_hash,
)
from m3_rollout.model.numerics import compute_dtype
from m3_rollout.model.paged_ops import PagedOps

# Fields of the int64 staging array, one row each, in this order; then the packed sampling
# parameters (sampler.SAMPLING_FIELDS). Code reads them through DecodeStage, never by row number.
STAGE_FIELDS = ("host_ids", "token_src", "positions", "slot_mapping", "context_lens", "seq_lens")
NUM_STAGE_ROWS = len(STAGE_FIELDS) + NUM_SAMPLING_FIELDS


@dataclass
class DecodeStage:
    """Named views of the first s columns of a staging array (numpy on the host, torch on the
    device); every field int64 [s].

    host_ids: input id when it is on the host. token_src: -1 (use host_ids) or the index into the
    runner's ``last_tokens`` holding the input id (sampled by the previous step, still on the
    device). positions: the query token's position (= context_lens). slot_mapping: KV slot the
    token is written to (-1 = nowhere). context_lens / seq_lens: tokens in the pages before / after
    this step. sampling: int64 [NUM_SAMPLING_FIELDS, s], the packed sampling parameters
    (``sampler.pack_sampling``).
    """

    host_ids: np.ndarray | torch.Tensor
    token_src: np.ndarray | torch.Tensor
    positions: np.ndarray | torch.Tensor
    slot_mapping: np.ndarray | torch.Tensor
    context_lens: np.ndarray | torch.Tensor
    seq_lens: np.ndarray | torch.Tensor
    sampling: np.ndarray | torch.Tensor

    @classmethod
    def of(cls, stage, s: int) -> DecodeStage:
        """Views of ``stage`` (int64 [NUM_STAGE_ROWS, >= s]) columns 0..s-1."""
        k = len(STAGE_FIELDS)
        return cls(*(stage[i, :s] for i in range(k)), stage[k:, :s])


def _pad_column() -> np.ndarray:
    """int64 [NUM_STAGE_ROWS, 1]: the staging values of a padding row (token 0 from the host at
    position 0, written nowhere, seq_len 1, temperature 1, no top-k / top-p)."""
    col = np.zeros((NUM_STAGE_ROWS, 1), dtype=np.int64)
    pad = DecodeStage.of(col, 1)
    pad.token_src[:] = -1
    pad.slot_mapping[:] = -1
    pad.seq_lens[:] = 1
    pack_sampling(pad.sampling, [1.0], [-1], [1.0], [0], [0], [0], [False])
    return col


class _EagerReplay:
    """Stands in for a captured graph: ``replay()`` runs the body (``use_graphs=False``)."""

    def __init__(self, body):
        self.body, self.result = body, None

    def replay(self) -> None:
        self.result = self.body()


def invariant_logprobs_into(out: torch.Tensor, logits: torch.Tensor, sampling: torch.Tensor, token_logprobs) -> None:
    """Batch-invariant mode after the fused sampler (``sampler_triton.keyed_gumbel_sample``, which
    picks ``sampler.sample_rows``' ids): overwrite the logprobs in ``out[1]`` (the kernel's own,
    merged over vocabulary chunks in an order no other path shares) with ``sample_rows``' value
    for the same ids: the logits upcast to fp32, then one launch of ``token_logprobs`` with the
    rows' temperatures and raw flags (the op divides each "processed" row by its fp32 temperature
    with IEEE division, as ``sampler.process_logits`` does, and leaves "raw" rows as they are).
    Those are the bits of the eager steps and of the trainer's scorer (``engine.score.PagedScorer``),
    whatever the step's batch. The upcast is needed: the op's partial sums follow its load layout,
    which Triton picks by element size (8 bf16 / 4 fp32 values per thread), and every other caller
    hands it fp32 rows.

    Args:
        out: int64 [2, s]: row 0 the sampled ids (read), row 1 the logprobs as float64 bits (written).
        logits: [s, V] the forward's logits, fp32 / fp16 / bf16 (fp64 raises ValueError, as the
            eager route's op does: the fused sampler computes in fp32, so for fp64 logits its ids
            may differ from ``sample_rows``').
        sampling: int64 [NUM_SAMPLING_FIELDS, s] packed parameters (``sampler.pack_sampling``).
        token_logprobs: the sampler's logprob op (``engine.ops.invariant_token_logprobs``), taking
            the ``temperature`` / ``raw`` / ``out`` keywords (``sampler.TokenLogprobs``).
    """
    if logits.dtype == torch.float64:
        raise ValueError("invariant_logprobs_into: fp64 logits (the invariant logprob op takes bf16 / fp16 / fp32)")
    f = sampling_fields(sampling)
    token_logprobs(
        logits.float(),
        out[0],
        temperature=f.temperature.view(torch.float64),
        raw=f.raw,
        out=out[1].view(torch.float64),
    )


class CudaGraphDecode:
    """Decode forward + sampler graphs per padded batch size, with their static buffers.

    Args:
        model: ``M3ForCausalLM`` (eval, on CUDA); kv: the page pool; ops: the fast-op table the
            forward runs with (``engine/ops.py``; the runner's).
        max_num_seqs: S, rows of the staging buffers (largest size captured).
        max_model_len: the ``max_seq_len`` the graphs are captured with (valid for every step).
        last_tokens: int64 [>= S] device buffer of the previous step's sampled ids (runner-owned).
        sizes: padded batch sizes to capture (default 1, 2, 4, ..., 256 and S, capped at S).
        use_graphs: False = run the captured bodies eagerly (any device; for tests).
        fused_sampler: sample with the Triton sampler (``sampler_triton.py``, same tokens) when no
            row filters by top-k / top-p, and build the inputs with one Triton launch; None = on CUDA.
        selection_buffer: the block-selection record's step buffer (int16 [>= S rows, ...]); the
            captured forward of size s writes rows 0..s-1 (padding rows too; their slots are -1).
        token_logprobs: the sampler's batch-invariant logprob op (``sampler.sample_rows``); when
            given, the fused Triton sampler still picks the ids (``sample_rows``' ids) and
            ``invariant_logprobs_into`` computes the logprobs again with this op, in the order
            the eager steps and the trainer use (the fused kernel's chunk merge differs;
            batch-invariant mode: one logprob order for every step).
        batch_invariant: filtered steps sample with row-invariant top-k / top-p supports
            (``sampler.process_logits``).
    """

    def __init__(
        self,
        model,
        kv: PagedKVCache,
        ops: PagedOps,
        max_num_seqs: int,
        max_model_len: int,
        last_tokens: torch.Tensor,
        sizes: tuple[int, ...] | None = None,
        use_graphs: bool = True,
        fused_sampler: bool | None = None,
        selection_buffer: torch.Tensor | None = None,
        token_logprobs=None,
        batch_invariant: bool = False,
    ):
        dev = kv.device
        self.selection_buffer = selection_buffer
        self.token_logprobs = token_logprobs
        self.batch_invariant = batch_invariant
        self.fused_sampler = dev.type == "cuda" if fused_sampler is None else fused_sampler
        assert dev.type == "cuda" or not use_graphs, "CUDA graphs are GPU-only"
        self.use_graphs = use_graphs
        self.model, self.kv, self.ops, self.last_tokens = model, kv, ops, last_tokens
        self.max_model_len = max_model_len
        self.page_size = kv.page_size
        sizes = sizes or (1, 2, 4, 8, 16, 32, 64, 128, 256, max_num_seqs)
        self.sizes = sorted({min(s, max_num_seqs) for s in sizes})
        n, self.max_pages = max_num_seqs, -(-max_model_len // kv.page_size)
        self.null_page = kv.null_page
        self.pad = _pad_column()
        # One byte buffer per side: stage int64 [F, S], then block tables int32 [S, max_pages].
        self.stage_bytes = NUM_STAGE_ROWS * n * 8
        self.row_bytes = self.max_pages * 4
        nbytes = self.stage_bytes + n * self.row_bytes
        # Device side (static addresses).
        self.dev_buf = torch.zeros(nbytes, dtype=torch.uint8, device=dev)
        self.stage, self.block_tables = self._views(self.dev_buf)
        self._pad_device_stage()
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.context_lens = torch.zeros(n, dtype=torch.int32, device=dev)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=dev)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self.out = torch.zeros(2 * n, dtype=torch.int64, device=dev)  # size s uses out[:2s] as [2, s]
        # Host side: pinned, double-buffered.
        pin = (lambda t: t.pin_memory()) if dev.type == "cuda" else (lambda t: t)  # noqa: E731
        self.host_buf = [pin(torch.zeros(nbytes, dtype=torch.uint8)) for _ in range(2)]
        views = [self._views(b) for b in self.host_buf]
        self.stage_np = [v[0].numpy() for v in views]
        self.bt_np = [v[1].numpy() for v in views]
        self.flip = 0
        # size -> (forward graph, its logits [s, V] (a callable when eager), sampler graph)
        self.graphs: dict[int, tuple] = {}
        # size -> each MoE layer's expert ids [s, K] as that size's graph writes them (the routing
        # record reads ``M3MoE.last_topk_ids``; after capture those name the last captured size's
        # tensors, so a replay of another size must point them at its own outputs).
        self.topk_ids: dict[int, list[torch.Tensor | None]] = {}
        self.pool = None
        vocab_hash(model.config.vocab_size, dev)  # cached outside the graphs' memory

    def _views(self, buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n = (buf.shape[0] - self.stage_bytes) // self.row_bytes
        stage = buf[: self.stage_bytes].view(torch.int64).view(NUM_STAGE_ROWS, n)
        bt = buf[self.stage_bytes :].view(torch.int32).view(n, self.max_pages)
        return stage, bt

    def _pad_device_stage(self) -> None:
        """Every device staging row a padding row (what capture's warm-up runs on)."""
        self.stage.copy_(torch.from_numpy(np.repeat(self.pad, self.stage.shape[1], axis=1)))
        self.block_tables.fill_(-1)
        self.block_tables[:, 0] = self.null_page

    # ---- captured bodies -------------------------------------------------------------------
    def _forward(self, s: int) -> torch.Tensor:
        st = DecodeStage.of(self.stage, s)
        if self.fused_sampler:  # one Triton launch instead of seven small torch kernels
            from m3_rollout.engine.sampler_triton import decode_prologue

            decode_prologue(
                st.host_ids,
                st.token_src,
                st.context_lens,
                st.seq_lens,
                self.last_tokens,
                self.input_ids,
                self.context_lens,
                self.seq_lens,
            )
        else:
            src = st.token_src
            ids = torch.where(src >= 0, self.last_tokens[src.clamp(min=0)], st.host_ids)
            self.input_ids[:s].copy_(ids)
            self.context_lens[:s].copy_(st.context_lens)
            self.seq_lens[:s].copy_(st.seq_lens)
        meta = PagedMetadata(
            positions=st.positions,
            slot_mapping=st.slot_mapping,
            block_tables=self.block_tables[:s],
            context_lens=self.context_lens[:s],
            seq_lens=self.seq_lens[:s],
            query_start_loc=self.query_start_loc[: s + 1],
            num_decodes=s,
            decode_query_len=1,
            max_query_len=1,
            max_seq_len=self.max_model_len,
        )
        return self.model.forward_paged(
            self.input_ids[:s], meta, self.kv, self.ops, selection_out=self.selection_buffer
        )  # [s, V]

    def sample_into_out(
        self,
        logits: torch.Tensor,
        s: int,
        need_top_k: bool = False,
        need_top_p: bool = False,
        penalties: Penalties | None = None,
    ) -> torch.Tensor:
        """Sample rows 0..s-1 of ``logits`` with the staged parameters (and ``penalties``, device
        tensors: never inside a graph); write ids + logprob bits into ``out[:2s]`` and
        ``last_tokens[:s]``; returns the [2, s] int64 view."""
        out = self.out[: 2 * s].view(2, s)
        if self.fused_sampler and not (need_top_k or need_top_p) and penalties is None:
            from m3_rollout.engine.sampler_triton import keyed_gumbel_sample

            sampling = DecodeStage.of(self.stage, s).sampling
            p = sampling_fields(sampling)
            keyed_gumbel_sample(
                logits,
                p.temperature.view(torch.float64),
                p.seed,
                p.sample_id,
                p.position,
                p.raw,
                vocab_hash(logits.shape[1], logits.device),
                self.out[: 2 * s],
                self.last_tokens,
            )
            if self.token_logprobs is not None:  # the logprob again, from the invariant op
                invariant_logprobs_into(out, logits, sampling, self.token_logprobs)
            return out
        params, positions, raw = unpack_sampling(DecodeStage.of(self.stage, s).sampling)
        tokens, lps = sample_rows(
            logits.to(compute_dtype(logits.dtype)),
            params,
            positions,
            raw,
            need_top_k,
            need_top_p,
            self.token_logprobs,
            self.batch_invariant,
            penalties,
        )
        out[0].copy_(tokens)
        out[1].copy_(lps.double().view(torch.int64))
        self.last_tokens[:s].copy_(tokens)
        return out

    def top_logprobs(
        self, s: int, top, need_top_k: bool, need_top_p: bool, penalties: Penalties | None = None
    ) -> tuple[torch.Tensor, int]:
        """Eager, after :meth:`launch` of size ``s``: ``model_runner.TopAsk.compute`` of the rows
        ``top`` names over that size's logits and staged sampling parameters (outside the graphs:
        its shape follows the asking rows); ``penalties``: the step's device penalties, as
        :meth:`launch` applied them."""
        logits = self.graphs[s][1]()
        params, _, raw = unpack_sampling(DecodeStage.of(self.stage, s).sampling)
        x = logits.to(compute_dtype(logits.dtype))
        return top.compute(x, params, raw, need_top_k, need_top_p, self.batch_invariant, penalties)

    def capture(self) -> None:
        """Capture every size (largest first, one shared memory pool) over the current addresses of
        the model's weights and the page pool (again after an engine wake-up: ``sleep.py``)."""
        self._pad_device_stage()  # the last step's rows would write real pages during warm-up
        if not self.use_graphs:
            for size in self.sizes:
                fwd = _EagerReplay(lambda s=size: self._forward(s))
                samp = _EagerReplay(lambda s=size, f=fwd: self.sample_into_out(f.result, s))
                self.graphs[size] = (fwd, lambda f=fwd: f.result, samp)
            return
        for size in reversed(self.sizes):
            logits = self._forward(size)  # warm-up (kernel autotune, allocations)
            self.sample_into_out(logits, size)
            torch.cuda.synchronize()
            fwd = torch.cuda.CUDAGraph()
            with torch.cuda.graph(fwd, pool=self.pool):
                logits = self._forward(size)
            self.topk_ids[size] = [m.last_topk_ids for m in self.model.moe_layers()]
            self.pool = fwd.pool()
            samp = torch.cuda.CUDAGraph()
            with torch.cuda.graph(samp, pool=self.pool):
                self.sample_into_out(logits, size)
            self.graphs[size] = (fwd, lambda out=logits: out, samp)
        torch.cuda.synchronize()

    def release(self) -> None:
        """Drop every graph and their memory pool (engine sleep: the addresses they replay are about
        to be freed). ``capture`` makes them again."""
        self.graphs.clear()
        self.topk_ids.clear()
        for moe in self.model.moe_layers():  # they may name outputs in the pool being freed
            moe.last_topk_ids = None
        self.pool = None

    # ---- one step ----------------------------------------------------------------------------
    def size_for(self, rows: int) -> int | None:
        return next((s for s in self.sizes if s >= rows and s in self.graphs), None)

    def stage_rows(self, rows: int) -> tuple[DecodeStage, np.ndarray, int]:
        """Host staging for a step of ``rows`` rows, padded to a captured size s (padding rows
        already filled): (the stage fields of rows 0..rows-1, their block tables int32
        [rows, max_pages] filled with -1, s). The caller fills every field and the block tables
        (``model_runner.prepare_decode``, ``sampler.pack_sampling``)."""
        s = self.size_for(rows)
        self.flip ^= 1
        st, bt = self.stage_np[self.flip][:, :s], self.bt_np[self.flip][:s]
        st[:, rows:s] = self.pad
        bt.fill(-1)
        bt[rows:s, 0] = self.null_page
        return DecodeStage.of(st, rows), bt[:rows], s

    def device_stage(self, rows: int) -> DecodeStage:
        """Device views of the staged fields of rows 0..rows-1 (valid once the step is launched)."""
        return DecodeStage.of(self.stage, rows)

    def launch(self, s: int, need_top_k: bool, need_top_p: bool, penalties: Penalties | None = None) -> torch.Tensor:
        """Copy the staged step in and replay size ``s``; returns the device int64 [2 * s]
        (s sampled ids, then s logprobs as float64 bits; rows past the real ones are padding).
        A step that filters (top-k / top-p) or has ``penalties`` (device tensors) samples eagerly."""
        k = self.stage_bytes + s * self.row_bytes  # stage + the first s block-table rows
        self.dev_buf[:k].copy_(self.host_buf[self.flip][:k], non_blocking=True)
        fwd, logits, samp = self.graphs[s]
        fwd.replay()
        for moe, ids in zip(self.model.moe_layers(), self.topk_ids.get(s, ())):
            moe.last_topk_ids = ids  # this size's static outputs, not the last captured size's
        if need_top_k or need_top_p or penalties is not None:  # filtered / penalised: eager (rare in RL)
            self.sample_into_out(logits(), s, need_top_k, need_top_p, penalties)
        else:
            samp.replay()
        return self.out[: 2 * s]

"""LLMEngine: requests in, one model forward per ``step()``, sampled tokens out.

Governing idea: the engine core loop of vLLM v1 / nano-vllm in one place. ``add_request``
validates and expands a request into sequences (leader + children to fork); ``step`` asks the
scheduler for a plan, builds the step's tensors (model_runner), runs exactly one
``forward_paged``, samples every row whose chunk reached its last token in one vectorised
sampler call (a group leader's logits row is shared by its n samples), forks children after the
prompt's prefill, and turns finished sequences into :class:`SampleOutput` records.

A step is launched (forward + sampler + one non-blocking copy of the sampled ids / logprobs to
the host) and processed (tokens appended, forks, stop checks, outputs) as two phases. Synchronous
stepping processes a step right after launching it; with ``async_scheduling`` (vLLM-style) step
N+1 is launched before step N is processed, so the host's bookkeeping runs while the GPU computes:
a sequence whose step-N token is not on the host yet counts it as *pending* (``Sequence.num_pending``)
and its step-N+1 input id is taken on the device from the runner's ``last_tokens``. Plain decode
steps run on captured CUDA graphs (``decode_graph.py``). Host time per phase: ``EngineStats.phase_seconds``.

Step API contract: /work/notes/contracts.md ("Engine step API").
"""

from __future__ import annotations

import dataclasses
import numbers
import operator
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import numpy as np
import torch

from m3_rollout.engine.block_manager import BlockManager
from m3_rollout.engine.decode_graph import SAMPLING_ROW
from m3_rollout.engine.interface import GenerationRequest, SampleOutput, SamplingParams, StreamDelta
from m3_rollout.engine.model_runner import ModelRunner, SampleBatch, StepLaunch, meta_to, prepare_inputs
from m3_rollout.engine.paged_cache import PagedKVCache, page_bytes
from m3_rollout.engine.sampler import NUM_SAMPLING_FIELDS, pack_sampling
from m3_rollout.engine.scheduler import ScheduledRow, Scheduler, SchedulerOutput
from m3_rollout.engine.sequence import SeqStatus, Sequence
from m3_rollout.model.numerics import compute_dtype

CPU_AUTO_KV_BYTES = 256 * 2**20  # cap of the automatic CPU page pool (pages are zero-filled up front)


def _is_index(t) -> bool:
    try:
        operator.index(t)
        return True
    except TypeError:
        return False


def _token_ids(ids) -> list[int]:
    """Token ids as plain ints (Python / numpy ints, 0-d integer tensors); TypeError for floats,
    strings and other non-integers (never silently truncated)."""
    return [operator.index(t) for t in ids]


@dataclass
class EngineConfig:
    """Engine sizes and switches.

    Attributes:
        max_model_len: longest sequence (prompt + generated), tokens.
        max_num_seqs: most running samples per step.
        max_num_batched_tokens: per-step token budget (decodes + prefill chunks).
        kv_cache_memory_gb: KV page pool size in GiB; 0 = automatic: on CUDA
            ``kv_cache_memory_fraction`` of the free device memory, elsewhere room for
            ``max_num_seqs`` sequences of ``max_model_len`` tokens, at most ``CPU_AUTO_KV_BYTES``.
        num_pages: explicit page count (overrides the memory budget; tests).
        enable_prefix_caching: reuse full pages across requests (GRPO groups, multi-turn).
        enable_cuda_graphs: capture decode steps (forward + sampler) on CUDA (GPU-only; ignored elsewhere).
            "eager": the same staged decode path with the bodies run eagerly (any device; tests).
        async_scheduling: launch step N+1 before step N's sampled ids reach the host and process
            step N's outputs while the device runs N+1 (hides the host's per-step work behind the
            GPU; same tokens and logprobs as synchronous stepping). None = on for CUDA, off
            elsewhere (on the CPU nothing overlaps; outputs then come one ``step()`` later).
        fused_sampler: decode graphs sample with Triton kernels (``engine/sampler_triton.py``,
            same tokens as the PyTorch sampler) unless a row uses top-k / top-p, and build their
            inputs with one Triton launch; None = on CUDA.
        eos_token_ids: tokens that end every sample.
    """

    max_model_len: int
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 4096
    kv_cache_memory_gb: float = 0.0
    kv_cache_memory_fraction: float = 0.8
    num_pages: int | None = None
    enable_prefix_caching: bool = True
    enable_cuda_graphs: bool | str = False
    # Padded decode batch sizes captured (default 1, 2, 4, 8, 16, 32, 64, 128, 256 and
    # max_num_seqs, each capped at max_num_seqs); fewer sizes = faster start.
    cuda_graph_batch_sizes: tuple[int, ...] | None = None
    async_scheduling: bool | None = None
    fused_sampler: bool | None = None
    # Routing record (issue 6): SampleOutput.routed_experts = expert ids of every MoE layer for
    # every token, kept per KV page (m3_rollout/parallel/routing_record.py).
    record_routing: bool = False
    eos_token_ids: tuple[int, ...] = ()

    def validate(self) -> EngineConfig:
        """Raises ValueError naming the bad field."""
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"EngineConfig.{name}={getattr(self, name)}: must be >= 1")
        if self.kv_cache_memory_gb < 0:
            raise ValueError(f"EngineConfig.kv_cache_memory_gb={self.kv_cache_memory_gb}: must be >= 0 (0 = auto)")
        if not 0 < self.kv_cache_memory_fraction <= 1:
            raise ValueError(f"EngineConfig.kv_cache_memory_fraction={self.kv_cache_memory_fraction}: in (0, 1]")
        if self.num_pages is not None and self.num_pages < 1:
            raise ValueError(f"EngineConfig.num_pages={self.num_pages}: must be >= 1")
        return self

    def resolve_num_pages(self, page_size: int, bytes_per_page: int, device: torch.device) -> int:
        if self.num_pages is not None:
            return self.num_pages
        if self.kv_cache_memory_gb > 0:
            return int(self.kv_cache_memory_gb * 2**30 // bytes_per_page)
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            return int(free * self.kv_cache_memory_fraction // bytes_per_page)
        want = self.max_num_seqs * -(-self.max_model_len // page_size)
        floor = -(-self.max_model_len // page_size)  # one full-length sequence
        return max(floor, min(want, CPU_AUTO_KV_BYTES // bytes_per_page))


@dataclass
class EngineStats:
    """Counters behind :meth:`LLMEngine.metrics` (host numbers only)."""

    steps: int = 0
    forward_seconds: float = 0.0
    generated_tokens: int = 0
    prompt_tokens_computed: int = 0  # prompt positions whose K/V were computed (not prefix hits)
    batched_tokens: int = 0
    rows: int = 0
    forks: int = 0
    # Async scheduling: decode rows whose input id was taken on the device (the previous step's
    # sampled id, not yet on the host), and sampled tokens dropped because their sample had
    # finished or was aborted while the step ran.
    device_input_rows: int = 0
    dropped_tokens: int = 0
    graph_steps: int = 0  # steps run on the decode graphs
    # Host seconds per step phase (perf_counter; always on, ~0.1 us per reading): schedule,
    # prepare (step tensors), forward (launch; includes the graph fill), sample (sampler launch),
    # sync (waiting for the sampled ids / logprobs on the host), output (bookkeeping, stop checks).
    phase_seconds: dict = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))


PHASES = ("schedule", "prepare", "forward", "sample", "sync", "output")


@dataclass
class _Launched:
    """A step whose forward + sampler were launched: what processing its results needs.

    samples: sequences sampled, in device order (the scheduled rows that sample first, then
    forked-to-be children); order: processing order (each leader followed by its children);
    leaders: the scheduled rows that sample; index: seq_id -> position in ``samples`` (a pending
    row's input for the next step is ``last_tokens[index]``); version: weights that ran it.
    """

    rows: list[ScheduledRow]
    samples: list[Sequence]
    order: list[int]
    leaders: list[Sequence]
    index: dict[int, int]
    result: StepLaunch
    version: int


class LLMEngine:
    """The native generation engine (in-process; one device).

    Args:
        model: ``M3ForCausalLM`` in the generation dtype on its device (KV dtype = lm_head dtype).
        config: :class:`EngineConfig`.
        detokenize: optional ``ids -> text`` callback, needed for ``stop_strings``.
    Raises ValueError when the page pool cannot hold one ``max_model_len`` sequence.
    """

    def __init__(self, model, config: EngineConfig, detokenize: Callable[[list[int]], str] | None = None):
        self.config = config.validate()
        self.model = model.eval()
        self.model_config = model.config
        weight = model.lm_head.weight
        self.device, self.kv_dtype = weight.device, weight.dtype
        ps = self.model_config.sparse_block_size
        num_pages = config.resolve_num_pages(ps, page_bytes(self.model_config, self.kv_dtype), self.device)
        if num_pages * ps < config.max_model_len:
            raise ValueError(
                f"KV cache of {num_pages} pages x {ps} tokens cannot hold one sequence of "
                f"max_model_len={config.max_model_len}; raise kv_cache_memory_gb or lower max_model_len"
            )
        self.kv = PagedKVCache(self.model_config, num_pages, self.kv_dtype, self.device)
        self.block_manager = BlockManager(num_pages, ps, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens)
        self.runner = ModelRunner(
            self.model,
            self.kv,
            config.max_num_seqs,
            config.max_model_len,
            config.enable_cuda_graphs,
            config.cuda_graph_batch_sizes,
            config.max_num_batched_tokens,
            config.fused_sampler,
        )
        # NOTE: None = on for CUDA (GPU round 1, H200: identical tokens, host time hidden), off on
        # the CPU (nothing to overlap there; outputs would come one step() later).
        self.async_scheduling = (
            self.device.type == "cuda" if config.async_scheduling is None else bool(config.async_scheduling)
        )
        self._inflight: _Launched | None = None  # async scheduling: the launched, unprocessed step
        self.routing = None  # RoutingCache when config.record_routing (hooks: step, _fork, _routed)
        if config.record_routing:
            from m3_rollout.parallel.routing_record import RoutingCache

            self.routing = RoutingCache.for_model(self.model, num_pages, ps)
        self.detokenize = detokenize
        self.eos = frozenset(int(t) for t in config.eos_token_ids)
        self._version = 0
        self._paused = False
        # Set by weight sync when a failed non-atomic update left the weights invalid: new
        # requests fail with this text until a full update succeeds (weight_sync/in_flight.py).
        self.refuse_reason: str | None = None
        self._pending: list[SampleOutput | StreamDelta] = []
        self._live: dict[str, list[Sequence]] = {}  # request_id -> its unfinished sequences
        self._next_seq = 0
        self._next_req = 0
        self.stats = EngineStats()
        self._t0 = time.perf_counter()

    # ---- requests ------------------------------------------------------------------------
    def _check_request(self, req: GenerationRequest) -> str | None:
        """Error text naming the bad field, or None."""
        if self.refuse_reason is not None:
            return self.refuse_reason
        p = req.params
        try:
            p.validate()
        except ValueError as exc:
            return str(exc)
        idx = req.sample_index
        if not isinstance(idx, numbers.Integral) or not -(2**63) <= idx <= 2**63 - p.n:
            return (
                f"GenerationRequest.sample_index={idx!r}: samples sample_index .. sample_index + n - 1 "
                "must be integers in [-2**63, 2**63) (they key the sampler's int64 hash)"
            )
        try:
            ids = _token_ids(req.prompt_ids)
        except TypeError:
            bad = next(t for t in req.prompt_ids if not _is_index(t))
            return f"GenerationRequest.prompt_ids: token ids must be integers, got {bad!r}"
        vocab = self.model_config.vocab_size
        if not ids:
            return "GenerationRequest.prompt_ids: empty prompt"
        if min(ids) < 0 or max(ids) >= vocab:
            bad = next(t for t in ids if not 0 <= t < vocab)
            return f"GenerationRequest.prompt_ids: token id {bad} outside the vocabulary [0, {vocab})"
        if len(ids) >= self.config.max_model_len:
            return (
                f"GenerationRequest.prompt_ids: prompt of {len(ids)} tokens leaves no room under "
                f"max_model_len={self.config.max_model_len}"
            )
        if p.stop_strings and self.detokenize is None:
            return "SamplingParams.stop_strings: this engine has no detokenize callback"
        return None

    def _error_outputs(self, req: GenerationRequest, error: str) -> list[SampleOutput]:
        return [
            SampleOutput(
                req.request_id, req.sample_index + j, list(req.prompt_ids), [], [], "error", self._version, error=error
            )
            for j in range(max(req.params.n, 1))
        ]

    def add_request(self, req: GenerationRequest, stream: bool = False) -> None:
        """Queue ``req`` as ``params.n`` samples (sample_index + j). A bad request does not raise:
        its error records (one per sample, one if n < 1) come out of the next ``step()``."""
        error = self._check_request(req)
        if error is not None:
            self._pending.extend(self._error_outputs(req, error))
            return
        p = req.params
        prompt = _token_ids(req.prompt_ids)  # plain ints (numpy / 0-d tensor ids normalised)
        max_len = min(len(prompt) + p.max_new_tokens, self.config.max_model_len)
        stops = self.eos | frozenset(p.stop_token_ids)
        key = self._next_req
        self._next_req += 1
        seqs = []
        for j in range(p.n):
            seqs.append(
                Sequence(self._next_seq, req.request_id, key, req.sample_index + j, p, prompt, stops, max_len, stream)
            )
            self._next_seq += 1
        leader = seqs[0]
        leader.children = seqs[1:]
        self._live.setdefault(req.request_id, []).extend(seqs)
        self.scheduler.add(leader)

    def abort(self, request_id: str) -> None:
        """Stop every sample of ``request_id``; each yields a finish_reason "abort" record next step."""
        for seq in self._live.pop(request_id, []):
            routed = self._routed(seq)  # before its pages are freed
            if self._is_scheduled(seq):  # unforked children hold no pages and sit in no queue
                self.scheduler.remove(seq)
            seq.status, seq.finish_reason = SeqStatus.FINISHED, "abort"
            self._pending.append(self._output(seq, routed))

    def _is_scheduled(self, seq: Sequence) -> bool:
        return seq in self.scheduler.running or seq in self.scheduler.waiting

    def abort_all(self) -> list[GenerationRequest]:
        """Drop every unfinished sample; return one n=1 request per sample to re-queue later
        (same prompt, params and sample index: the keyed sampler repeats its tokens)."""
        self.drain()
        out = []
        for rid in list(self._live):
            for seq in self._live.pop(rid):
                if self._is_scheduled(seq):
                    self.scheduler.remove(seq)
                seq.status = SeqStatus.FINISHED
                out.append(
                    GenerationRequest(
                        rid, seq.token_ids[: seq.prompt_len], dataclasses.replace(seq.params, n=1), seq.sample_index
                    )
                )
        return out

    def has_unfinished(self) -> bool:
        return bool(self._live) or bool(self._pending) or self._inflight is not None

    def num_unfinished(self) -> int:
        """Unfinished samples (for least-loaded placement)."""
        return sum(len(v) for v in self._live.values())

    # ---- control -------------------------------------------------------------------------
    def pause(self) -> None:
        """No forward runs (except ``step(force_forward=True)``'s empty one) until ``resume``.
        The step in flight (async scheduling) is landed first; its outputs come from the next step()."""
        self.drain()
        self._paused = True

    def resume(self) -> None:
        self._paused = False

    @property
    def paused(self) -> bool:
        return self._paused

    def reset_prefix_cache(self) -> None:
        """Forget every reusable page (after a weight update)."""
        self.drain()
        self.block_manager.reset_prefix_cache(list(self.scheduler.running))

    @property
    def weight_version(self) -> int:
        return self._version

    def set_weight_version(self, version: int) -> None:
        self._version = int(version)

    def preempt_all(self) -> int:
        """Preempt every running sequence by recompute: its KV pages are freed and it waits at the
        front of the queue (running order kept) to re-prefill prompt + generated tokens under the
        current weights (weight_sync.recompute_kv_after_update). Returns how many were preempted."""
        self.drain()
        running = list(self.scheduler.running)
        for seq in reversed(running):
            self.scheduler._preempt(seq, SchedulerOutput())
        return len(running)

    # ---- the step ------------------------------------------------------------------------
    def step(self, force_forward: bool = False) -> list[SampleOutput | StreamDelta]:
        """Run at most one model forward; return finished samples, errors and stream deltas.

        ``force_forward=True`` runs exactly one forward even with nothing to schedule (T = 0
        tokens) or while paused, so every EP rank runs every MoE layer once per step.

        With ``async_scheduling`` the step launched here is processed by the NEXT call (or by
        :meth:`drain`): this call launches step N, then waits for step N-1's sampled ids and turns
        them into outputs while the device runs step N. Tokens and logprobs equal the synchronous
        engine's (keyed sampler); a sample that finished at step N-1 has its step-N token dropped.
        """
        t_start = time.perf_counter()
        outputs, self._pending = self._pending, []
        ph = self.stats.phase_seconds
        plan = SchedulerOutput() if self._paused else self.scheduler.schedule()
        ph["schedule"] += time.perf_counter() - t_start
        if plan.is_empty and not force_forward:
            if self._inflight is not None:
                outputs.extend(self._finish_inflight())
            return outputs
        launched = self._launch(plan)
        if self._inflight is not None:
            outputs.extend(self._finish_inflight())
        self._commit(plan)
        if self.async_scheduling and launched.samples:
            self._inflight = launched
            if not self._live:  # only dropped rows left in flight: land them now
                outputs.extend(self._finish_inflight())
        else:
            outputs.extend(self._process(launched))
        self.stats.forward_seconds += time.perf_counter() - t_start
        return outputs

    def drain(self) -> None:
        """Land the step in flight (async scheduling); its outputs come out of the next ``step()``."""
        if self._inflight is not None:
            self._pending.extend(self._finish_inflight())

    def _finish_inflight(self) -> list:
        launched, self._inflight = self._inflight, None
        return self._process(launched)

    def _launch(self, plan: SchedulerOutput) -> _Launched:
        """Build the step's inputs and start forward + sampler + result copy on the device."""
        ph = self.stats.phase_seconds
        t0 = time.perf_counter()
        rows = plan.rows
        prev = self._inflight
        leaders = [r.seq for r in rows if r.sample]
        samples, expand, order = list(leaders), None, []
        for i, seq in enumerate(leaders):
            order.append(i)
            if seq.num_pending:  # its children were sampled with the step in flight (fork pending)
                continue
            for child in seq.children:  # the prompt's last logits serve the whole group
                order.append(len(samples))
                samples.append(child)
                if expand is None:
                    expand = list(range(len(leaders)))
                expand.append(i)
        n_rows = len(rows)
        size = None
        if (
            self.runner.graphs is not None
            and n_rows
            and plan.num_decodes == n_rows
            and expand is None
            and len(leaders) == n_rows
        ):
            size = self.runner.graph_size(n_rows)
        if size is not None:
            self.stats.graph_steps += 1
            result, slot_mapping = self._launch_graph(rows, prev, size, samples, t0)
        else:
            result, slot_mapping = self._launch_eager(plan, prev, samples, expand, t0)
        t1 = time.perf_counter()
        if self.routing is not None:
            self.routing.record(slot_mapping, self.model)
        st = self.stats
        st.device_input_rows += sum(1 for r in rows if r.seq.num_pending)
        for seq in leaders:
            seq.num_pending += 1
        st.steps += 1
        st.rows += n_rows
        st.batched_tokens += plan.num_batched_tokens
        ph["forward"] += time.perf_counter() - t1
        return _Launched(
            rows, samples, order, leaders, {q.seq_id: i for i, q in enumerate(leaders)}, result, self._version
        )

    @staticmethod
    def _sampling_columns(samples: list[Sequence]):
        """(temperature, top_k, top_p, seed, sample_index, position, raw) columns of the sample rows;
        position = the index the sampled token will take (``num_tokens`` before it)."""
        temp, top_k, top_p, seed, sid, raw = zip(*[s.sampling_key for s in samples])
        return temp, top_k, top_p, seed, sid, [s.num_tokens for s in samples], raw

    @staticmethod
    def _sampling_flags(cols) -> tuple[bool, bool, str]:
        _, top_k, top_p, _, _, _, raw = cols
        n_raw = sum(raw)
        mode = "processed" if n_raw == 0 else "raw" if n_raw == len(raw) else "mixed"
        return max(top_k) > 0, min(top_p) < 1, mode

    def _launch_graph(self, rows, prev, size: int, samples, t0: float):
        """Plain decode step on the captured graphs: fill the pinned staging rows, replay."""
        ph = self.stats.phase_seconds
        n = len(rows)
        graphs = self.runner.graphs
        st, bt, s = graphs.stage_rows(n)
        ps = self.kv.page_size
        ids, src, ctx, slot = [], [], [], []
        for i, r in enumerate(rows):
            q = r.seq
            c, table = q.num_computed, q.block_table
            bt[i, : len(table)] = table
            if q.num_pending:
                ids.append(0)
                src.append(prev.index[q.seq_id])
            else:
                ids.append(q.token_ids[c])
                src.append(-1)
            ctx.append(c)
            slot.append(table[c // ps] * ps + c % ps)
        st[0, :n] = ids
        st[1, :n] = src
        st[2, :n] = ctx
        st[3, :n] = slot
        st[4, :n] = ctx
        st[5, :n] = st[4, :n] + 1
        t1 = time.perf_counter()
        ph["prepare"] += t1 - t0
        cols = self._sampling_columns(samples)
        pack_sampling(st[SAMPLING_ROW:, :n], *cols)
        need_k, need_p, _ = self._sampling_flags(cols)
        t2 = time.perf_counter()
        ph["sample"] += t2 - t1
        result = self.runner.launch_graph(n, s, need_k, need_p)
        ph["forward"] += time.perf_counter() - t2
        return result, graphs.stage[3, :n]

    def _launch_eager(self, plan: SchedulerOutput, prev, samples, expand, t0: float):
        ph = self.stats.phase_seconds
        rows = plan.rows
        chunks, token_src, pending = [], [], False
        for r in rows:
            q = r.seq
            if q.num_pending:  # its input is the previous step's sampled id, still on the device
                assert r.num_tokens == 1 and prev is not None, f"{q}: pending token outside a decode row"
                chunks.append([0])
                token_src.append(prev.index[q.seq_id])
                pending = True
            else:
                chunks.append(q.token_ids[q.num_computed : q.num_computed + r.num_tokens])
                token_src.extend([-1] * r.num_tokens)
        inputs = prepare_inputs(
            chunks,
            [r.seq.num_computed for r in rows],
            [r.seq.block_table for r in rows],
            self.kv.page_size,
            plan.num_decodes,
            [r.sample for r in rows],
        )
        t1 = time.perf_counter()
        ph["prepare"] += t1 - t0
        sampling = None
        if samples:
            cols = self._sampling_columns(samples)
            packed = np.empty((NUM_SAMPLING_FIELDS, len(samples)), dtype=np.int64)
            pack_sampling(packed, *cols)
            need_k, need_p, mode = self._sampling_flags(cols)
            sampling = SampleBatch(packed, expand, need_k, need_p, mode, sum(1 for r in rows if r.sample))
        t2 = time.perf_counter()
        ph["sample"] += t2 - t1
        result = self.runner.launch(inputs, token_src if pending else None, sampling)
        ph["forward"] += time.perf_counter() - t2
        return result, inputs.meta.slot_mapping

    def _commit(self, plan: SchedulerOutput) -> None:
        """Count the launched step's tokens as computed; register newly full pages (their
        tokens are all on the host by now: the previous step's outputs were processed)."""
        t0 = time.perf_counter()
        st = self.stats
        ps = self.kv.page_size
        register = self.block_manager.register_full_pages
        finished = SeqStatus.FINISHED
        for r in plan.rows:
            seq = r.seq
            if seq.status is finished:  # finished / aborted while the step ran
                continue
            if seq.num_computed < seq.prompt_len:
                st.prompt_tokens_computed += min(seq.num_computed + r.num_tokens, seq.prompt_len) - seq.num_computed
            seq.num_computed += r.num_tokens
            hashes = seq.page_hashes
            if hashes is not None and len(hashes) < seq.num_computed // ps:  # a page filled up
                register(seq)
        self.stats.phase_seconds["output"] += time.perf_counter() - t0

    def _process(self, launched: _Launched) -> list:
        """Wait for a launched step's sampled ids / logprobs; append them, fork, stream, finish."""
        ph = self.stats.phase_seconds
        t0 = time.perf_counter()
        tokens, lps = launched.result.fetch()
        t1 = time.perf_counter()
        ph["sync"] += t1 - t0
        for seq in launched.leaders:
            seq.num_pending -= 1
        samples, version = launched.samples, launched.version
        live: list[Sequence] = []
        for j in launched.order:
            seq = samples[j]
            if seq.status == SeqStatus.FINISHED:  # aborted / finished before this token landed: dropped
                self.stats.dropped_tokens += 1
                continue
            seq.token_ids.append(tokens[j])
            seq.logprobs.append(lps[j])
            seq.weight_versions.append(version)
            live.append(seq)
        self.stats.generated_tokens += len(live)
        out: list = []
        for seq in launched.leaders:
            if seq.children and seq.status != SeqStatus.FINISHED:
                self._fork(seq)
        for seq in live:
            if seq.stream:
                n = seq.num_streamed
                out.append(
                    StreamDelta(
                        seq.request_id, seq.sample_index, seq.output_ids[n:], seq.logprobs[n:], seq.weight_versions[n:]
                    )
                )
                seq.num_streamed = len(seq.logprobs)
            toks = seq.token_ids
            if toks[-1] not in seq.stop_set and len(toks) < seq.max_len and not seq.params.stop_strings:
                continue  # fast path of _finish_reason: still running
            reason = self._finish_reason(seq)
            if reason is not None:
                routed = self._routed(seq)  # before its pages are freed
                self.scheduler.remove(seq)
                seq.finish_reason = reason
                live_seqs = self._live.get(seq.request_id)
                if live_seqs is not None:
                    live_seqs.remove(seq)
                    if not live_seqs:
                        del self._live[seq.request_id]
                out.append(self._output(seq, routed))
        ph["output"] += time.perf_counter() - t1
        return out

    def _fork(self, leader: Sequence) -> None:
        # Preempted since its prompt's last chunk was launched (async scheduling): no pages to share.
        lost = leader.num_computed < leader.prompt_len
        for child in leader.children:
            child.token_ids = leader.token_ids[: leader.prompt_len] + child.token_ids[leader.prompt_len :]
            copy = False if lost else self.block_manager.fork(leader, child)
            if copy is False:  # no page for the partial copy: prefill it later (prefix-cache hit)
                child.block_table, child.num_computed, child.page_hashes = [], 0, []
                self.scheduler.add(child)
                continue
            if copy is not None:
                self.kv.copy_page(*copy)
                if self.routing is not None:
                    self.routing.copy_page(*copy)
            self.scheduler.add_running(child)
            self.stats.forks += 1
        leader.children = []

    def _finish_reason(self, seq: Sequence) -> str | None:
        if seq.token_ids[-1] in seq.stop_set:
            return "stop"
        if seq.params.stop_strings:
            text = self.detokenize(seq.output_ids)
            if any(s in text for s in seq.params.stop_strings):
                return "stop"
        if len(seq.token_ids) >= seq.max_len:
            return "length"
        return None

    def _routed(self, seq: Sequence):
        """The routing record of ``seq`` (int16 [num_tokens, n_moe_layers, top_k]; -1 rows for tokens
        never run) while it still holds its pages; None when recording is off."""
        if self.routing is None:
            return None
        return self.routing.gather(seq.block_table, seq.num_computed, len(seq.token_ids))

    def _output(self, seq: Sequence, routed=None) -> SampleOutput:
        versions = list(seq.weight_versions)
        return SampleOutput(
            seq.request_id,
            seq.sample_index,
            seq.token_ids[: seq.prompt_len],
            seq.output_ids,
            list(seq.logprobs),
            seq.finish_reason or "abort",
            versions[-1] if versions else self._version,
            token_weight_versions=versions,
            routed_experts=routed,
        )

    # ---- scoring and metrics --------------------------------------------------------------
    @torch.no_grad()
    def score(self, token_ids: Seq[int], positions: Seq[int] | None = None, temperature: float = 1.0) -> torch.Tensor:
        """Prompt logprobs of a stored trajectory under the served weights (re-scoring).

        Runs the sequence through the paged path in chunks of ``max_num_batched_tokens`` on
        pages borrowed for the call (call between steps; no prefix reuse, every position's
        logits are needed).

        Args:
            token_ids: [L] ints. positions: optional indices i (1 <= i < L) to return; default all.
            temperature: logits are divided by it (the trainer's convention).
        Returns:
            fp32 (fp64 for an fp64 model) [L] with entry 0 = 0 and entry i = log p(token_i | tokens_<i)
            or, with ``positions``, [len(positions)] of those entries.
        Raises:
            ValueError: empty / too long / out-of-vocabulary ids, bad positions or temperature <= 0;
            RuntimeError: not enough free KV pages now.
        """
        if not temperature > 0:
            raise ValueError(f"score temperature={temperature}: must be > 0")
        self.drain()
        ids = list(token_ids)
        req_err = self._check_request(GenerationRequest("score", ids, SamplingParams()))
        if req_err is not None and not (len(ids) == self.config.max_model_len and "max_model_len" in req_err):
            raise ValueError(req_err.replace("GenerationRequest.prompt_ids", "score token_ids"))
        ids = _token_ids(ids)
        seq = Sequence(-1, "score", -1, 0, SamplingParams(), ids, frozenset(), len(ids))
        bm = self.block_manager
        if not bm.ensure(seq, len(ids)):
            raise RuntimeError(
                f"score: {bm.pages_for(len(ids))} KV pages needed, {bm.num_free_pages} free; "
                "call it when fewer requests are running"
            )
        try:
            chunks = []
            step = self.config.max_num_batched_tokens
            for start in range(0, len(ids), step):
                chunk = ids[start : start + step]
                inp = prepare_inputs([chunk], [start], [seq.block_table], self.kv.page_size, 0)
                logits = self.model.forward_paged(
                    inp.input_ids.to(self.device), meta_to(inp.meta, self.device), self.kv, self.runner.ops
                )
                chunks.append(logits.to(compute_dtype(logits.dtype)).cpu())
        finally:
            bm.free_seq(seq)
        logits = torch.cat(chunks) / temperature  # [L, V]
        tgt = torch.tensor(ids[1:], dtype=torch.int64)
        lp = torch.log_softmax(logits[:-1], dim=-1).gather(1, tgt[:, None]).squeeze(1)
        lp = torch.cat([torch.zeros(1, dtype=lp.dtype), lp])  # [L]
        if positions is None:
            return lp
        pos = torch.tensor(list(positions), dtype=torch.int64)
        if len(pos) and (int(pos.min()) < 0 or int(pos.max()) >= len(ids)):
            raise ValueError(f"score positions must be in [0, {len(ids)}), got {positions}")
        return lp[pos]

    def metrics(self) -> dict:
        """KV pages in use, prefix-cache hit rate, preemptions, tokens/s, batch size per step."""
        st, bm = self.stats, self.block_manager
        return {
            "kv_pages_in_use": bm.num_used_pages,
            "kv_pages_total": bm.num_pages,
            "kv_usage": bm.num_used_pages / bm.num_pages,
            "prefix_cache_hit_rate": bm.hit_rate,
            "prefix_cache_hit_tokens": bm.hit_tokens,
            "num_preemptions": self.scheduler.num_preemptions,
            "generated_tokens": st.generated_tokens,
            "prompt_tokens_computed": st.prompt_tokens_computed,
            "steps": st.steps,
            "forks": st.forks,
            "async_scheduling": self.async_scheduling,
            "device_input_rows": st.device_input_rows,
            "dropped_tokens": st.dropped_tokens,
            "graph_steps": st.graph_steps,
            "generation_tokens_per_s": st.generated_tokens / st.forward_seconds if st.forward_seconds else 0.0,
            "mean_batch_rows_per_step": st.rows / st.steps if st.steps else 0.0,
            "mean_tokens_per_step": st.batched_tokens / st.steps if st.steps else 0.0,
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            **{f"host_ms_per_step_{k}": 1000 * v / st.steps if st.steps else 0.0 for k, v in st.phase_seconds.items()},
        }

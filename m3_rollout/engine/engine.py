"""LLMEngine: requests in, one model forward per ``step()``, sampled tokens out.

Governing idea: the engine core loop of vLLM v1 / nano-vllm. ``add_request`` validates a request
once (``requests.py``) and expands it into sequences (leader + children to fork); ``step`` asks
the scheduler for a plan, launches exactly one ``forward_paged`` + sampler call for it
(``launch.py``; a group leader's logits row is shared by its n samples), forks children after the
prompt's prefill, and turns finished sequences into :class:`SampleOutput` records. Sizes:
``config.py``; counters and ``metrics()``: ``stats.py``; re-scoring: ``score.py``; stop strings
(a tail window decoded per step): ``stop_strings.py``. Prompt logprobs (``SamplingParams.
prompt_logprobs``, vLLM's way) are scored by the prefill chunks' own forwards
(``launch.prompt_ask``) and appended to the group's ``sequence.PromptScores`` when a step is processed.

A step is launched (forward + sampler + one non-blocking copy of the sampled ids / logprobs to
the host) and processed (tokens appended, forks, stop checks, outputs) as two phases. Synchronous
stepping processes a step right after launching it; with ``async_scheduling`` (vLLM-style) step
N+1 is launched before step N is processed, so the host's bookkeeping runs while the GPU computes:
a sequence whose step-N token is not on the host yet counts it as *pending* (``Sequence.num_pending``)
and its step-N+1 input id is taken on the device from the runner's ``last_tokens``. Plain decode
steps run on captured CUDA graphs (``decode_graph.py``). Host time per phase: ``EngineStats.phase_seconds``.

Step API contract: docs/design.md §3.2 (the engine step API).
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq

import torch

from m3_kernels.paged_layout import KV_MAJOR_MIN_TOKENS
from m3_rollout.engine.block_manager import BlockManager
from m3_rollout.engine.config import EngineConfig
from m3_rollout.engine.interface import GenerationRequest, SampleOutput, StreamDelta, as_int
from m3_rollout.engine.launch import LaunchedStep, StepLauncher
from m3_rollout.engine.model_runner import ModelRunner
from m3_rollout.engine.ops import bind_prefill_scratch, invariant_token_logprobs, paged_ops_for
from m3_rollout.engine.paged_cache import MIB, PagedKVCache, page_bytes, prefill_scratch_bytes
from m3_rollout.engine.requests import CheckedRequest, check_prompt, check_request, error_outputs, sample_groups
from m3_rollout.engine.scheduler import Scheduler, SchedulerOutput
from m3_rollout.engine.score import (
    SCORE_PAGES_HINT,
    PositionLogprobs,
    check_score_temperature,
    check_top_logprobs,
    check_top_logprobs_filters,
    pages_error,
    score_tokens,
    top_logprobs,
)
from m3_rollout.engine.selection_cache import SelectionCache
from m3_rollout.engine.sequence import SeqStatus, Sequence
from m3_rollout.engine.sleep import GIB, MemoryHandoff, Resize, resize_storage
from m3_rollout.engine.stats import EngineStats, engine_metrics
from m3_rollout.engine.stop_strings import contains_stop_string
from m3_rollout.model.numerics import compute_dtype
from m3_rollout.model.paged_ops import PagedOps
from m3_rollout.model.selection_record import SelectionRecord, SelectionSegment


class LLMEngine:
    """The native generation engine (in-process; one device).

    Args:
        model: ``M3ForCausalLM`` in the generation dtype on its device (KV dtype = lm_head dtype).
        config: :class:`EngineConfig`.
        detokenize: optional ``ids -> text`` callback, needed for ``stop_strings``; every id must
            decode to >= 1 byte (markers kept), since each step decodes only a tail window of the
            output (``stop_strings.contains_stop_string``).
        ops: the paged forward's fast-op table (``engine/ops.py``); None = ``paged_ops_for`` the
            model's device and activation dtype (with ``config``'s ``batch_invariant`` and
            ``invariant_sparse_attention``). A table that ``takes_prefill_scratch`` gets the
            engine's KV-major prefill scratch bound (``prefill_scratch``).
        resize: the allocation function of sleep / wake-up (``sleep.resize_storage``; CPU tests
            inject a counting fake).

    Memory: the page pool and ``prefill_scratch`` (uint8 [bytes]: the sparse prefill's KV-major
    partial outputs, sized by ``msa_prefill_scratch_mb``, ``paged_cache.prefill_scratch_bytes``;
    empty when the table takes none or the path cannot run) share the cache budget
    (``kv_cache_memory_gb`` or the CUDA fraction): pages = (budget - scratch) // page bytes. Both
    are released by ``sleep`` and restored by ``wake_up``; ``metrics()`` reports both.
    Raises ValueError when the page pool cannot hold one ``max_model_len`` sequence, or for a
    ``msa_prefill_scratch_mb`` below one KV-major pass.
    """

    def __init__(
        self,
        model,
        config: EngineConfig,
        detokenize: Callable[[list[int]], str] | None = None,
        ops: PagedOps | None = None,
        resize: Resize = resize_storage,
    ):
        self.config = config.validate()
        self.model = model.eval()
        self.model_config = model.config
        weight = model.lm_head.weight
        self.device, self.kv_dtype = weight.device, weight.dtype
        self.sampler_dtype = compute_dtype(self.kv_dtype)  # what the sampler divides logits in
        ps = self.model_config.sparse_block_size
        if ops is None:  # batch_invariant: the fixed-order table (design.md §4.6; CPU: warns, fast table)
            ops = paged_ops_for(
                self.device,
                model.model.embed_tokens.weight.dtype,
                batch_invariant=config.batch_invariant,
                invariant_sparse_attention=config.invariant_sparse_attention,
            )
        scratch_bytes = 0
        if ops.takes_prefill_scratch:  # the attention inputs (q, K/V pages) are in the KV dtype
            # an invariant table that takes one ("page_partials") runs the KV-major path at every length
            scratch_bytes = prefill_scratch_bytes(
                self.model_config,
                self.kv_dtype,
                config.msa_prefill_scratch_mb,
                config.max_num_batched_tokens,
                min_tokens=1 if config.batch_invariant else KV_MAJOR_MIN_TOKENS,
            )
        num_pages = config.resolve_num_pages(
            ps, page_bytes(self.model_config, self.kv_dtype, config.index_cache_dtype), self.device, scratch_bytes
        )
        scratch_note = (
            f" after the MSA prefill scratch of {scratch_bytes / MIB:.1f} MiB (msa_prefill_scratch_mb)"
            if scratch_bytes
            else ""
        )
        if num_pages * ps < config.max_model_len:
            raise ValueError(
                f"KV cache of {num_pages} pages x {ps} tokens{scratch_note} cannot hold one sequence of "
                f"max_model_len={config.max_model_len}; raise kv_cache_memory_gb or lower max_model_len"
            )
        # The KV-major prefill's partial outputs: one buffer inside the budget, bound into the attention
        # ops (an empty one keeps the kernels from allocating their own: the path is then off).
        self.prefill_scratch: torch.Tensor | None = None
        if ops.takes_prefill_scratch:
            self.prefill_scratch = torch.empty(scratch_bytes, dtype=torch.uint8, device=self.device)
            ops = bind_prefill_scratch(ops, self.prefill_scratch)
        self.kv = PagedKVCache(
            self.model_config,
            num_pages,
            self.kv_dtype,
            self.device,
            config.index_cache_dtype,
            config.quantize_index_queries,
        )
        self.kv_cache_bytes = sum(t.numel() * t.element_size() for t in self.kv.tensors())  # as allocated
        self.prefill_scratch_bytes = scratch_bytes
        self.block_manager = BlockManager(num_pages, ps, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens)
        # Block-selection record (hooks: launcher, _process, _fork, _selection); its step buffer is
        # written by every forward, the decode graphs included.
        self.selection: SelectionCache | None = None
        if config.record_block_selection:
            cap = max(config.max_num_seqs, config.max_num_batched_tokens, 1)
            self.selection = SelectionCache.for_model(self.model, num_pages, ps, cap)
        token_logprobs = None
        if config.batch_invariant:  # design.md §4.6: the fixed-order logprob op (the forward's table: above)
            token_logprobs = invariant_token_logprobs(self.device)
        self.runner = ModelRunner(
            self.model,
            self.kv,
            config.max_num_seqs,
            config.max_model_len,
            config.enable_cuda_graphs,
            config.cuda_graph_batch_sizes,
            config.max_num_batched_tokens,
            config.fused_sampler,
            ops,
            None if self.selection is None else self.selection.step_buffer,
            token_logprobs,
            config.batch_invariant,  # top-k / top-p per row (sampler.process_logits); any device
        )
        # NOTE: None = on for CUDA (GPU round 1, H200: identical tokens, host time hidden), off on
        # the CPU (nothing to overlap there; outputs would come one step() later).
        self.async_scheduling = (
            self.device.type == "cuda" if config.async_scheduling is None else bool(config.async_scheduling)
        )
        self._inflight: LaunchedStep | None = None  # async scheduling: the launched, unprocessed step
        self.routing = None  # RoutingCache when config.record_routing (hooks: launch, _fork, _routed)
        if config.record_routing:
            from m3_rollout.parallel.routing_record import RoutingCache

            self.routing = RoutingCache.for_model(self.model, num_pages, ps)
        self.detokenize = detokenize
        self.eos = frozenset(int(t) for t in config.eos_token_ids)
        self._version = 0
        self._weights_updated = False  # set by the first accepted weight update (weights_updated)
        self._weight_writes = 0  # weight_writes: changes with every write of the weights
        self._paused = False
        # Set by weight sync when a failed non-atomic update left the weights invalid: new
        # requests fail with this text until a full update succeeds (weight_sync/in_flight.py).
        self.refuse_reason: str | None = None
        self._pending: list[SampleOutput | StreamDelta] = []
        self._live: dict[str, list[Sequence]] = {}  # request_id -> its unfinished sequences
        self._next_seq = 0
        self._next_req = 0
        self.stats = EngineStats()
        self.launcher = StepLauncher(self.runner, self.stats, self.routing, self.selection)
        caches = self.kv.tensors()
        self.memory = MemoryHandoff(
            caches
            + ([self.routing.table] if self.routing is not None else [])
            + ([self.selection.step_buffer] if self.selection is not None else [])
            + ([self.prefill_scratch] if scratch_bytes else []),
            self._weight_tensors,
            self.runner.release_graphs,
            self.runner.capture_graphs,
            self.device,
            f"lower policy.generation.kv_cache_memory_gb (EngineConfig.kv_cache_memory_gb={config.kv_cache_memory_gb}"
            f"{'; 0 = sized at start-up from kv_cache_memory_fraction' if not config.kv_cache_memory_gb else ''}; "
            f"the KV cache has {num_pages} pages{scratch_note})",
            resize,
        )

    # ---- requests ------------------------------------------------------------------------
    def check_request(self, req: GenerationRequest) -> CheckedRequest:
        """Validate ``req`` for this engine (``requests.check_request``; refused while
        ``refuse_reason`` is set). Raises ValueError naming the bad field; RuntimeError while asleep."""
        self.check_awake("add a request")
        if self.refuse_reason is not None:
            raise ValueError(self.refuse_reason)
        return check_request(
            req,
            self.model_config.vocab_size,
            self.config.max_model_len,
            self.sampler_dtype,
            self.detokenize is not None,
        )

    def add_request(self, req: GenerationRequest, stream: bool = False) -> None:
        """Queue ``req`` as ``params.n`` samples (sample_index + j), in groups of at most
        ``max_num_seqs`` (``requests.sample_groups``). A bad request does not raise: its error
        records (one per sample, one if n is not a valid count) come out of the next ``step()``.
        Raises RuntimeError while asleep (``check_awake``)."""
        self.check_awake("add a request")
        try:
            checked = self.check_request(req)
        except ValueError as exc:
            self._pending.extend(error_outputs(req, str(exc), self._version))
            return
        p, prompt = checked.params, checked.prompt_ids
        max_len = min(len(prompt) + p.max_new_tokens, self.config.max_model_len)
        stops = (frozenset() if p.ignore_eos else self.eos) | frozenset(p.stop_token_ids)
        key = self._next_req
        self._next_req += 1
        seqs = []
        box = [None]  # the request's shared prompt segment of the block-selection record
        for j in range(p.n):
            seqs.append(
                Sequence(
                    self._next_seq,
                    req.request_id,
                    key,
                    checked.sample_index + j,
                    p,
                    prompt,
                    stops,
                    max_len,
                    stream,
                    checked.block_selection_from,
                    box,
                )
            )
            self._next_seq += 1
        self._live.setdefault(req.request_id, []).extend(seqs)
        for group in sample_groups(p.n, self.config.max_num_seqs):
            leader = seqs[group.start]
            leader.children = seqs[group.start + 1 : group.stop]
            for child in leader.children:  # the leader's prefill scores the prompt for its group
                child.prompt_scores = leader.prompt_scores
            self.scheduler.add(leader)

    def abort(self, request_id: str) -> None:
        """Stop every sample of ``request_id``; each yields a finish_reason "abort" record next step."""
        if self.selection is not None and request_id in self._live:
            self.selection.land(self.selection.last_serial)  # aborts are rare: wait for every step
        for seq in self._live.pop(request_id, []):
            routed, selected = self._routed(seq), self._selection(seq)  # before its pages are freed
            if self._is_scheduled(seq):  # unforked children hold no pages and sit in no queue
                self.scheduler.remove(seq)
            seq.status, seq.finish_reason = SeqStatus.FINISHED, "abort"
            self._pending.append(self._output(seq, routed, selected))

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
                        rid,
                        seq.token_ids[: seq.prompt_len],
                        dataclasses.replace(seq.params, n=1),
                        seq.sample_index,
                        seq.record_from,
                    )
                )
        return out

    def unfinished_samples(self, request_id: str) -> list[Sequence]:
        """The unfinished sequences of ``request_id`` (empty when none)."""
        return list(self._live.get(request_id, ()))

    @property
    def step_in_flight(self) -> bool:
        """A launched step's results are not processed yet (async scheduling)."""
        return self._inflight is not None

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
        """An accepted weight update set the weights to ``version`` (weight sync's in-flight policy)."""
        self._version = int(version)
        self._weights_updated = True

    @property
    def weights_updated(self) -> bool:
        """Whether an accepted update set the weights (False while the engine serves the
        checkpoint it loaded): a new weight-sync group's receiver then keeps the version rule
        (``weight_sync.rollout_sync.engine_receiver``)."""
        return self._weights_updated

    @property
    def weight_writes(self) -> int:
        """The weight-write count: changes with every write of the weights
        (:meth:`count_weight_write`), also one that keeps the version number (an update re-sent
        with ``replace``). Every sampled token is stamped with it (``SampleOutput.token_weight_writes``),
        so a caller can tell whether the weights served now are the ones a token was sampled with."""
        return self._weight_writes

    def count_weight_write(self, writes: int | None = None) -> None:
        """The weights were written (an accepted update, or bytes of a rejected non-atomic one):
        the write count becomes ``writes`` (an EP service's group-wide count, so that every rank
        stamps alike; ``RolloutService``) or goes up by one, and every sequence holding computed
        KV has it marked stale (``Sequence.kv_stale``: its later tokens are stamped -1 until a
        preemption recomputes its KV). Call between steps (the weight-sync in-flight policy does,
        with the engine paused and no step in flight)."""
        self.drain()
        self._weight_writes = self._weight_writes + 1 if writes is None else int(writes)
        for seq in self.scheduler.running:
            if seq.num_computed > 0:
                seq.kv_stale = True

    def preempt_all(self) -> int:
        """Preempt every running sequence by recompute: its KV pages are freed and it waits at the
        front of the queue (running order kept) to re-prefill prompt + generated tokens under the
        current weights (weight_sync.recompute_kv_after_update). Returns how many were preempted."""
        self.drain()
        running = list(self.scheduler.running)
        for seq in reversed(running):
            self.scheduler.preempt(seq)
        return len(running)

    # ---- sleep / wake-up (sleep.py) ------------------------------------------------------
    def sleep(self, level: int = 1) -> dict:
        """Release device memory for another phase (training): level 1 frees the KV cache, the
        index-key cache, the routing records, the MSA prefill scratch and the decode graphs, and
        empties the prefix cache (the pages' contents are gone); level 2 also moves the weights to
        host memory (pinned on CUDA). Parameters and every view of them keep their identity (``sleep.py``).

        Sleeping while asleep deepens to ``level`` if it is higher (else frees nothing).
        NOTE: refused, not drained, with samples unfinished: a drain could run for a whole
        generation phase, and the RL loop sleeps only once its rollouts are collected, so an
        unfinished sample means a caller bug (``abort_all`` hands them back for re-queueing).
        Outputs already made (e.g. abort records) wait for the first step after wake-up; so do a
        launched step's, which sleep lands first when no sample is unfinished (async scheduling:
        the step launched before the last ``abort``).

        Returns {"level", "gb_freed" (GiB), "seconds"} for the step metrics.
        Raises:
            RuntimeError: samples are unfinished or a step is in flight.
            ValueError: level not 1 or 2, or a tensor that cannot be released in place.
        """
        if not self._live:
            self.drain()  # a step launched before the last abort: its outputs wait in _pending
        if self._live or self._inflight is not None:
            raise RuntimeError(
                f"sleep: {self.num_unfinished()} samples are unfinished; finish them, or abort them "
                "(abort_all() returns them as requests to re-queue after wake_up) before sleeping"
            )
        if not self.memory.level:
            self.block_manager.reset()  # every page free, no prefix hits: the contents are dropped
        return self.memory.sleep(level)

    def wake_up(self) -> dict:
        """Re-allocate what ``sleep`` released (same shapes; caches zeroed, weights copied back in
        place) and re-capture the decode graphs. A no-op when awake.

        Returns {"level" (woken from; 0 = was awake), "gb_restored" (GiB), "seconds",
        "graph_capture_seconds"} for the step metrics.
        Raises sleep.WakeUpError (naming policy.generation.kv_cache_memory_gb) when out of
        memory; the engine then stays asleep and wake_up may be retried.
        """
        return self.memory.wake_up()

    @property
    def asleep(self) -> bool:
        return self.memory.level > 0

    @property
    def weights_offloaded(self) -> bool:
        """Asleep at level 2: the parameters have no device memory, so nothing may read or write
        them (weight sync included: its cached views would write freed memory) until ``wake_up``."""
        return self.memory.weights_offloaded

    @property
    def weight_storage_generation(self) -> int:
        """How many wake-ups re-allocated the weights (level 2): each moved every weight storage to
        a new address (the views followed). Raw addresses cached elsewhere (weight sync's copy
        plan) must be re-read when this changes."""
        return self.memory.weight_generation

    def check_awake(self, what: str) -> None:
        """Raises RuntimeError when asleep (the page pool, and at level 2 the weights, have no memory)."""
        if self.memory.level:
            raise RuntimeError(f"engine is asleep (level {self.memory.level}): call wake_up() before you {what}")

    def _weight_tensors(self):
        """The model's parameters and buffers on the engine's device (what sleep level 2 offloads)."""
        for t in itertools.chain(self.model.parameters(), self.model.buffers()):
            if t.device == self.device:
                yield t

    # ---- the step ------------------------------------------------------------------------
    def step(self, force_forward: bool = False) -> list[SampleOutput | StreamDelta]:
        """Run at most one model forward; return finished samples, errors and stream deltas.

        ``force_forward=True`` runs exactly one forward even with nothing to schedule (T = 0
        tokens) or while paused, so every EP rank runs every MoE layer once per step.

        With ``async_scheduling`` the step launched here is processed by the NEXT call (or by
        :meth:`drain`): this call launches step N, then waits for step N-1's sampled ids and turns
        them into outputs while the device runs step N. Tokens and logprobs equal the synchronous
        engine's (keyed sampler); a sample that finished at step N-1 has its step-N token dropped.
        Raises RuntimeError while asleep (``check_awake``).
        """
        self.check_awake("step")
        t_start = time.perf_counter()
        outputs, self._pending = self._pending, []
        ph = self.stats.phase_seconds
        plan = SchedulerOutput() if self._paused else self.scheduler.schedule()
        ph["schedule"] += time.perf_counter() - t_start
        if plan.is_empty and not force_forward:
            if self._inflight is not None:
                outputs.extend(self._finish_inflight())
            return outputs
        launched = self.launcher.launch(plan, self._inflight, self._version, self._weight_writes)
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

    def _process(self, launched: LaunchedStep) -> list:
        """Wait for a launched step's sampled ids / logprobs; append them, fork, stream, finish."""
        ph = self.stats.phase_seconds
        t0 = time.perf_counter()
        tokens, lps = launched.result.fetch()
        tops = launched.result.fetch_top()
        self._record_prompt_scores(launched)
        if self.selection is not None:  # a sampling step was waited for: its record copy is queued right behind
            self.selection.land(launched.serial if launched.samples else None)
        t1 = time.perf_counter()
        ph["sync"] += t1 - t0
        for seq in launched.leaders:
            seq.num_pending -= 1
        samples, version, writes = launched.samples, launched.version, launched.writes
        n_leaders, stale_rows = len(launched.leaders), launched.stale
        stale = False
        live: list[Sequence] = []
        for j in launched.order:  # each leader, then the children sampled from its logits row
            seq = samples[j]
            if j < n_leaders:
                # its KV when the step was launched (a preemption since may have cleared kv_stale);
                # a child's first token comes from its leader's KV
                stale = j in stale_rows
            if seq.status == SeqStatus.FINISHED:  # aborted / finished before this token landed: dropped
                self.stats.dropped_tokens += 1
                continue
            seq.token_ids.append(tokens[j])
            seq.logprobs.append(lps[j])
            if seq.top_logprobs is not None:
                seq.top_logprobs.append(tops.get(j, []))
            seq.weight_versions.append(version)
            seq.weight_writes.append(-1 if stale else writes)
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
                        seq.request_id,
                        seq.sample_index,
                        seq.token_ids[seq.prompt_len + n :],  # not output_ids[n:]: a copy of every token per step
                        seq.logprobs[n:],
                        seq.weight_versions[n:],
                        seq.weight_writes[n:],
                        None if seq.top_logprobs is None else seq.top_logprobs[n:],
                    )
                )
                seq.num_streamed = len(seq.logprobs)
            toks = seq.token_ids
            if toks[-1] not in seq.stop_set and len(toks) < seq.max_len and not seq.params.stop_strings:
                continue  # fast path of _finish_reason: still running
            reason = self._finish_reason(seq)
            if reason is not None:
                routed, selected = self._routed(seq), self._selection(seq)  # before its pages are freed
                self.scheduler.remove(seq)
                seq.finish_reason = reason
                live_seqs = self._live.get(seq.request_id)
                if live_seqs is not None:
                    live_seqs.remove(seq)
                    if not live_seqs:
                        del self._live[seq.request_id]
                out.append(self._output(seq, routed, selected))
        ph["output"] += time.perf_counter() - t1
        return out

    def _record_prompt_scores(self, launched: LaunchedStep) -> None:
        """Append the prompt logprobs a launched step scored to their groups' ``PromptScores``
        (before its sampled tokens, so a sample that ends at this step carries them all), each
        stamped like a token sampled at that step (``-1`` on stale KV)."""
        for (seq, first, stale), rows in zip(launched.prompt_rows, launched.result.fetch_prompt()):
            if seq.status == SeqStatus.FINISHED:  # aborted while the step ran
                continue
            ps = seq.prompt_scores
            assert len(ps.entries) == first, f"{seq}: prompt entry {first} recorded after {len(ps.entries) - 1}"
            ps.entries.extend(rows)
            ps.writes.extend([-1 if stale else launched.writes] * len(rows))

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
                if self.selection is not None:
                    self.selection.copy_page(*copy)
            self.scheduler.add_running(child)
            self.stats.forks += 1
        leader.children = []

    def _finish_reason(self, seq: Sequence) -> str | None:
        if seq.token_ids[-1] in seq.stop_set:
            return "stop"
        stops = seq.params.stop_strings
        if stops:  # only the tail a new occurrence can lie in is decoded (stop_strings.py)
            if contains_stop_string(self.detokenize, seq.token_ids, seq.prompt_len, seq.num_stop_checked, stops):
                return "stop"
            seq.num_stop_checked = len(seq.token_ids) - seq.prompt_len
        if len(seq.token_ids) >= seq.max_len:
            return "length"
        return None

    def _routed(self, seq: Sequence):
        """The routing record of ``seq`` (int16 [num_tokens, n_moe_layers, top_k]; -1 rows for tokens
        never run) while it still holds its pages; None when recording is off."""
        if self.routing is None:
            return None
        return self.routing.gather(seq.block_table, seq.num_computed, len(seq.token_ids))

    def _selection(self, seq: Sequence) -> SelectionRecord | None:
        """The block-selection record of ``seq`` from ``seq.record_from`` while it still holds its
        pages (None when recording is off): positions run by the steps processed so far, at most
        up to the last sampled token (never run; with async scheduling it may be in flight). With
        n > 1 the prompt part is a segment of its own, one object shared by the request's samples
        when theirs are equal (compared in the table, no copy). The rows are copied off the table on
        the cache's worker thread (``SelectionCache.gather_later``); a segment waits for its copy
        on first use."""
        sel = self.selection
        if sel is None:
            return None
        start = min(seq.record_from, seq.num_computed)
        end = max(start, min(seq.num_computed, len(seq.token_ids) - 1))
        p_end = min(max(seq.prompt_len, start), end) if seq.params.n > 1 else start  # n = 1: one segment
        segs = []
        if p_end > start:
            shared = seq.selection_box[0]
            if shared is not None and shared.start == start and sel.equals(seq.block_table, start, p_end, shared.rows):
                segs.append(shared)
            else:
                fut = sel.gather_later(seq.block_table, start, p_end)
                segs.append(SelectionSegment.from_future(start, p_end - start, sel.dims, fut))
                if shared is None:
                    seq.selection_box[0] = segs[-1]
        if end > p_end:
            fut = sel.gather_later(seq.block_table, p_end, end)
            segs.append(SelectionSegment.from_future(p_end, end - p_end, sel.dims, fut))
        return SelectionRecord(segs)

    def _output(self, seq: Sequence, routed=None, selected=None) -> SampleOutput:
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
            block_selection=selected,
            token_weight_writes=list(seq.weight_writes),
            top_logprobs=None if seq.top_logprobs is None else list(seq.top_logprobs),
            prompt_logprobs=None if seq.prompt_scores is None else list(seq.prompt_scores.entries),
            prompt_weight_writes=[] if seq.prompt_scores is None else list(seq.prompt_scores.writes),
        )

    # ---- scoring and metrics --------------------------------------------------------------
    def score(self, token_ids: Seq[int], positions: Seq[int] | None = None, temperature: float = 1.0) -> torch.Tensor:
        """Prompt logprobs of a stored trajectory under the served weights (re-scoring).

        Runs the sequence through the paged path in chunks of ``max_num_batched_tokens`` on
        pages borrowed for the call (call between steps; no prefix reuse, every position's
        logits are needed; ``score.py``). Same as ``prepare_score(...)()``.

        Args:
            token_ids: [L] ints. positions: optional indices i (0 <= i < L) to return; default all.
            temperature: logits are divided by it (the trainer's convention).
        Returns:
            fp32 (fp64 for an fp64 model) [L] with entry 0 = 0 and entry i = log p(token_i | tokens_<i)
            or, with ``positions``, [len(positions)] of those entries.
        Raises:
            ValueError: empty / too long / out-of-vocabulary ids, bad positions, or a temperature
            that is not finite, <= 0 or so small that logits / temperature overflows; the weights
            are refused (``refuse_reason``: a failed non-atomic update);
            RuntimeError: not enough free KV pages now, or the engine is asleep.
        """
        return self.prepare_score(token_ids, positions, temperature)()

    def prepare_score(
        self, token_ids: Seq[int], positions: Seq[int] | None = None, temperature: float = 1.0
    ) -> Callable[[], torch.Tensor]:
        """Every check of :meth:`score`, the free KV pages included, with no forward run; returns
        the zero-argument call that runs the forwards and returns what ``score`` returns. Nothing
        may run on the engine between the two (so the pages stay free): an EP rank prepares, agrees
        with its peers that every rank can run, then runs (``RolloutWorker``: the forwards are
        collective). Raises what ``score`` raises, before any forward."""
        self.check_awake("score")
        temperature = check_score_temperature(temperature, self.sampler_dtype)
        self.drain()
        if self.refuse_reason is not None:
            raise ValueError(self.refuse_reason)
        ids = check_prompt(
            token_ids, self.model_config.vocab_size, self.config.max_model_len, "score token_ids", room_for_output=False
        )
        pos = None
        if positions is not None:
            try:
                idx = [as_int(i) for i in positions]
            except TypeError:
                msg = f"score positions: must be a sequence of integer indices, got {positions!r:.200}"
                raise ValueError(msg) from None
            if idx and (min(idx) < 0 or max(idx) >= len(ids)):
                raise ValueError(f"score positions must be in [0, {len(ids)}), got {positions}")
            pos = torch.tensor(idx, dtype=torch.int64)
        if self.block_manager.pages_for(len(ids)) > self.block_manager.num_free_pages:
            raise pages_error(self.block_manager, len(ids), SCORE_PAGES_HINT)

        def run() -> torch.Tensor:
            lp = score_tokens(
                self.model,
                self.runner.ops,
                self.kv,
                self.block_manager,
                ids,
                self.config.max_num_batched_tokens,
                temperature,
                self.runner.token_logprobs,
            )
            return lp if pos is None else lp[pos]

        return run

    def top_logprobs(
        self,
        token_ids: Seq[int],
        start: int,
        k: int,
        temperature: float = 1.0,
        top_k: int = -1,
        top_p: float = 1.0,
        with_tokens: bool = False,
    ) -> list[list[tuple[int, float]]] | list[PositionLogprobs]:
        """The ``k`` most likely tokens and their logprobs at positions ``start .. L - 1`` of
        ``token_ids`` under the served weights (the server's ``top_logprobs``): one plain forward,
        log-softmax of the logits processed as the sampler does (/ ``temperature``, then
        ``top_k`` / ``top_p``; the defaults: the model's own logprobs) in fp32 (fp64 for an fp64
        model), tokens the filters removed left out (``score.top_logprobs``). Borrows no KV pages;
        call between steps. Same as ``prepare_top_logprobs(...)()``.

        Args:
            token_ids: [L] ints, L >= 2. start: first position, 1 <= start <= L - 1.
            k: tokens per position, >= 1 (>= 0 ``with_tokens``; more than the vocabulary: all of it).
            temperature, top_k, top_p: the processing, by ``SamplingParams``' rules.
            with_tokens: also each position's own token's logprob and rank (the server's prompt
                logprobs).
        Returns:
            [L - start] lists of (token id, logprob), most likely first; ``with_tokens``:
            [L - start] ``score.PositionLogprobs`` (logprob, rank, top list).
        Raises:
            ValueError naming ``top_logprobs token_ids`` (empty, one token, too long, out of the
            vocabulary), ``top_logprobs start``, ``k``, ``temperature``, ``top_k`` or ``top_p``;
            or the weights are refused (``refuse_reason``); RuntimeError: the engine is asleep.
        """
        return self.prepare_top_logprobs(token_ids, start, k, temperature, top_k, top_p, with_tokens)()

    def prepare_top_logprobs(
        self,
        token_ids: Seq[int],
        start: int,
        k: int,
        temperature: float = 1.0,
        top_k: int = -1,
        top_p: float = 1.0,
        with_tokens: bool = False,
    ) -> Callable[[], list[list[tuple[int, float]]] | list[PositionLogprobs]]:
        """Every check of :meth:`top_logprobs` with no forward run; returns the zero-argument call
        that runs it (as :meth:`prepare_score`). Raises what ``top_logprobs`` raises."""
        self.check_awake("compute top logprobs")
        ids = check_prompt(
            token_ids,
            self.model_config.vocab_size,
            self.config.max_model_len,
            "top_logprobs token_ids",
            room_for_output=False,
        )
        first, k = check_top_logprobs(ids, start, k, bool(with_tokens))
        temperature, top_k, top_p = check_top_logprobs_filters(temperature, top_k, top_p, self.sampler_dtype)
        if self.refuse_reason is not None:
            raise ValueError(self.refuse_reason)
        invariant, lp_op = self.config.batch_invariant, self.runner.token_logprobs
        with_tokens = bool(with_tokens)
        return lambda: top_logprobs(self.model, ids, first, k, temperature, top_k, top_p, invariant, with_tokens, lp_op)

    def metrics(self) -> dict:
        """KV pages in use, prefix-cache hit rate, preemptions, tokens/s, batch size per step
        (``stats.engine_metrics``); the cache memory: ``kv_cache_gb`` (page pool: K, V, index keys)
        and ``msa_prefill_scratch_gb`` (the KV-major prefill scratch), GiB as allocated at start-up;
        sleep level and the last sleep / wake-up (``sleep.MemoryHandoff``)."""
        return {
            **engine_metrics(self.stats, self.block_manager, self.scheduler, self.async_scheduling),
            "kv_cache_gb": self.kv_cache_bytes / GIB,
            "msa_prefill_scratch_gb": self.prefill_scratch_bytes / GIB,
            **self.memory.metrics(),
        }

"""Step launch: a scheduler plan -> one forward + sampler started on the device (no waiting).

Governing idea: launching a step is separate from processing its results, so async scheduling
can launch step N+1 before step N's sampled ids reach the host. :meth:`StepLauncher.launch`
decides which sequences sample (a group leader's last prompt logits row serves its n samples),
hands plain per-row lists to the runner's input builders (``model_runner.prepare_inputs`` for
eager steps, ``model_runner.prepare_decode`` for the captured decode graphs) and returns a
:class:`LaunchedStep`, everything processing the step later needs.

Rows whose requests ask for prompt logprobs (``prompt_ask``) also keep the hidden states of
their chunk's prompt positions, scored in the same eager step (``model_runner.PromptAsk``).

A sequence whose previous token is still on the device (``Sequence.num_pending``) takes its input
id from the runner's ``last_tokens`` at index ``prev.index[seq_id]``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from m3_rollout.engine.model_runner import (
    ModelRunner,
    PromptAsk,
    SampleBatch,
    StepLaunch,
    TopAsk,
    prepare_decode,
    prepare_inputs,
)
from m3_rollout.engine.sampler import NUM_SAMPLING_FIELDS, Penalties, pack_sampling
from m3_rollout.engine.scheduler import ScheduledRow, SchedulerOutput
from m3_rollout.engine.sequence import Sequence
from m3_rollout.engine.stats import EngineStats


@dataclass
class LaunchedStep:
    """A step whose forward + sampler were launched: what processing its results needs.

    rows: the scheduled rows. samples: sequences sampled, in device order (the scheduled rows
    that sample first, then forked-to-be children). order: processing order (each leader
    followed by its children). leaders: the scheduled rows that sample. index: seq_id ->
    position in ``samples`` (a pending row's input for the next step is ``last_tokens[index]``).
    result: the sampled ids / logprobs on their way to the host. version: weights that ran it.
    serial: the step's number (``EngineStats.steps`` after it; the block-selection record lands by it).
    writes: the engine's weight-write count when it was launched (``LLMEngine.weight_writes``).
    stale: positions in ``leaders`` whose KV was stale when it was launched (``Sequence.kv_stale``):
        their tokens (and their children's first ones) are stamped -1. Read at launch, since with
        async scheduling the next step's scheduling may preempt such a sequence (clearing the flag)
        before this step's tokens land.
    prompt_rows: per row scoring prompt positions (``result.fetch_prompt()`` order): (sequence,
        index of its first entry in ``PromptScores.entries``, its KV stale at launch).
    """

    rows: list[ScheduledRow]
    samples: list[Sequence]
    order: list[int]
    leaders: list[Sequence]
    index: dict[int, int]
    result: StepLaunch
    version: int
    serial: int = 0
    writes: int = 0
    stale: frozenset[int] = frozenset()
    prompt_rows: list[tuple[Sequence, int, bool]] = field(default_factory=list)


def sampling_columns(samples: list[Sequence]):
    """(temperature, top_k, top_p, seed, sample_index, position, raw) columns of the sample rows;
    position = the index the sampled token will take (``num_tokens`` before it)."""
    temp, top_k, top_p, seed, sid, raw = zip(*[s.sampling_key for s in samples])
    return temp, top_k, top_p, seed, sid, [s.num_tokens for s in samples], raw


def sampling_flags(cols) -> tuple[bool, bool, str]:
    """(any row top-k, any row top-p, logprobs mode "processed" / "raw" / "mixed") of the columns."""
    _, top_k, top_p, _, _, _, raw = cols
    n_raw = sum(raw)
    mode = "processed" if n_raw == 0 else "raw" if n_raw == len(raw) else "mixed"
    return max(top_k) > 0, min(top_p) < 1, mode


def top_ask(samples: list[Sequence]) -> TopAsk | None:
    """The sample rows whose requests ask for top logprobs (``SamplingParams.top_logprobs``), None if none."""
    rows = [i for i, s in enumerate(samples) if s.params.top_logprobs]
    return TopAsk(rows, [samples[i].params.top_logprobs for i in rows]) if rows else None


def prompt_ask(rows: list[ScheduledRow]) -> tuple[list[tuple[int, int]] | None, PromptAsk | None, list]:
    """The prompt positions this step's rows score (``SamplingParams.prompt_logprobs``): a row
    whose request asks and whose chunk holds positions p <= P - 2 no launched step has scored yet
    (``PromptScores.asked``; entry p + 1 is predicted by position p's logits; P - 1's are the
    sampler's) scores them, and ``asked`` moves past them (so a recompute after a preemption
    scores nothing twice). Returns (``prepare_inputs``' prompt_spans and the :class:`PromptAsk`,
    both None when no row scores, ``LaunchedStep.prompt_rows``)."""
    spans, ask, out = None, None, []
    for i, r in enumerate(rows):
        q, ps = r.seq, r.seq.prompt_scores
        if ps is None or ps.asked >= q.prompt_len:  # the hot path: one test per row
            continue
        lo, hi = max(q.num_computed, ps.asked - 1), min(q.num_computed + r.num_tokens, q.prompt_len - 1)
        if hi <= lo:
            continue
        assert lo == ps.asked - 1, f"{q}: prompt position {ps.asked - 1} skipped (a prefix-cache read?)"
        if ask is None:
            spans, ask = [(0, 0)] * len(rows), PromptAsk([], [], [], [])
        spans[i] = (lo - q.num_computed, hi - lo)
        ask.counts.append(hi - lo)
        ask.filters.append(ps.filters)
        ask.ks.append(ps.k)
        ask.targets.extend(q.token_ids[lo + 1 : hi + 1])
        out.append((q, ps.asked, q.kv_stale))
        ps.asked = hi + 1
    return spans, ask, out


def penalty_batch(samples: list[Sequence], prev: LaunchedStep | None) -> Penalties | None:
    """The sampler's :class:`Penalties` for the sample rows that ask for penalties or logit biases
    (None when none does): their generated tokens (a pending one read on the device, from the
    runner's ``last_tokens`` at ``prev.index``) and, for a repetition penalty, their prompts. Host
    work proportional to those rows' tokens; other rows cost one flag test."""
    rows = [i for i, s in enumerate(samples) if s.penalized]
    if not rows:
        return None
    seqs = [samples[i] for i in rows]
    return Penalties.build(
        rows,
        [s.params for s in seqs],
        [s.token_ids[s.prompt_len :] for s in seqs],
        [s.token_ids[: s.prompt_len] if s.params.repetition_penalty != 1 else () for s in seqs],
        [prev.index[s.seq_id] if s.num_pending else -1 for s in seqs],
    )


class StepLauncher:
    """Launches scheduled steps on ``runner``; adds to ``stats`` (steps, rows, host phase times)
    and records routing (``routing.record``) and block selections (``selection.launch``: the
    step's one copy of its rows to the host) of every launched step, when recording is on."""

    def __init__(self, runner: ModelRunner, stats: EngineStats, routing=None, selection=None):
        self.runner, self.stats, self.routing, self.selection = runner, stats, routing, selection
        self.page_size = runner.page_size

    def launch(self, plan: SchedulerOutput, prev: LaunchedStep | None, version: int, writes: int = 0) -> LaunchedStep:
        """Build the step's inputs and start forward + sampler + result copy on the device.
        ``prev``: the launched, unprocessed previous step (async scheduling) or None; ``version`` /
        ``writes``: the engine's weight version and weight-write count, stamped on its tokens."""
        ph = self.stats.phase_seconds
        t0 = time.perf_counter()
        rows = plan.rows
        leaders = [r.seq for r in rows if r.sample]
        samples, expand, order, stale = list(leaders), None, [], []
        for i, seq in enumerate(leaders):
            order.append(i)
            if seq.kv_stale:
                stale.append(i)
            if seq.num_pending:  # its children were sampled with the step in flight (fork pending)
                continue
            for child in seq.children:  # the prompt's last logits serve the whole group
                order.append(len(samples))
                samples.append(child)
                if expand is None:
                    expand = list(range(len(leaders)))
                expand.append(i)
        n_rows = len(rows)
        spans, prompt, prompt_rows = prompt_ask(rows)
        size = None
        if n_rows and plan.num_decodes == n_rows and expand is None and len(leaders) == n_rows and prompt is None:
            size = self.runner.graph_size(n_rows)
        if size is not None:
            self.stats.graph_steps += 1
            result, slot_mapping, host_slots = self._launch_graph(rows, prev, samples, t0)
        else:
            result, slot_mapping, host_slots = self._launch_eager(plan, prev, samples, expand, t0, spans, prompt)
        t1 = time.perf_counter()
        if self.routing is not None:
            self.routing.record(slot_mapping, self.runner.model)
        serial = self.stats.steps + 1
        if self.selection is not None:
            self.selection.launch(serial, host_slots)
        st = self.stats
        st.device_input_rows += sum(1 for r in rows if r.seq.num_pending)
        for seq in leaders:
            seq.num_pending += 1
        st.steps += 1
        st.rows += n_rows
        st.batched_tokens += plan.num_batched_tokens
        ph["forward"] += time.perf_counter() - t1
        return LaunchedStep(
            rows,
            samples,
            order,
            leaders,
            {q.seq_id: i for i, q in enumerate(leaders)},
            result,
            version,
            serial,
            writes,
            frozenset(stale),
            prompt_rows,
        )

    def _launch_graph(self, rows, prev, samples, t0: float) -> tuple[StepLaunch, torch.Tensor, np.ndarray]:
        """Plain decode step on the captured graphs: fill the pinned staging fields, replay.
        Returns (result, the device slot mapping, the host slot mapping [rows])."""
        ph = self.stats.phase_seconds
        graphs = self.runner.graphs
        stage, block_tables, s = graphs.stage_rows(len(rows))
        ids, src, ctx, tables = [], [], [], []
        for r in rows:
            q = r.seq
            if q.num_pending:
                ids.append(0)
                src.append(prev.index[q.seq_id])
            else:
                ids.append(q.token_ids[q.num_computed])
                src.append(-1)
            ctx.append(q.num_computed)
            tables.append(q.block_table)
        prepare_decode(stage, block_tables, ids, src, ctx, tables, self.page_size)
        t1 = time.perf_counter()
        ph["prepare"] += t1 - t0
        cols = sampling_columns(samples)
        pack_sampling(stage.sampling, *cols)
        need_k, need_p, _ = sampling_flags(cols)
        penalties = penalty_batch(samples, prev)
        t2 = time.perf_counter()
        ph["sample"] += t2 - t1
        result = self.runner.launch_graph(len(rows), s, need_k, need_p, top_ask(samples), penalties)
        ph["forward"] += time.perf_counter() - t2
        return result, graphs.device_stage(len(rows)).slot_mapping, stage.slot_mapping

    def _launch_eager(
        self, plan: SchedulerOutput, prev, samples, expand, t0: float, spans=None, prompt: PromptAsk | None = None
    ) -> tuple[StepLaunch, torch.Tensor, np.ndarray]:
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
            self.page_size,
            plan.num_decodes,
            [r.sample for r in rows],
            prompt_spans=spans,
        )
        t1 = time.perf_counter()
        ph["prepare"] += t1 - t0
        sampling = None
        if samples:
            cols = sampling_columns(samples)
            packed = np.empty((NUM_SAMPLING_FIELDS, len(samples)), dtype=np.int64)
            pack_sampling(packed, *cols)
            need_k, need_p, mode = sampling_flags(cols)
            n_rows = sum(1 for r in rows if r.sample)
            sampling = SampleBatch(
                packed, expand, need_k, need_p, mode, n_rows, top_ask(samples), penalty_batch(samples, prev)
            )
        t2 = time.perf_counter()
        ph["sample"] += t2 - t1
        result = self.runner.launch(inputs, token_src if pending else None, sampling, prompt)
        ph["forward"] += time.perf_counter() - t2
        return result, inputs.meta.slot_mapping, inputs.meta.slot_mapping.numpy()

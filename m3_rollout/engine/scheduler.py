"""Continuous-batching scheduler: which sequences run how many tokens this step (no tensors).

Governing idea (vLLM v1 / nano-vllm): one token budget per step. Running sequences go first, in
arrival order: a decode takes one token, a partly prefilled prompt takes the next chunk. When a
running sequence needs a page and none is left, the most recently arrived running sequence is
preempted by recompute (its pages are freed and it re-enters the waiting queue at the front; on
re-admission the prefix cache usually gives its pages back). Then waiting sequences are admitted
while budget, rows and pages last (chunked prefill: a prompt may take several steps). Rows are
returned decode-first (query length 1), as the paged metadata requires.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from m3_rollout.engine.block_manager import BlockManager
from m3_rollout.engine.sequence import SeqStatus, Sequence


@dataclass(slots=True)
class ScheduledRow:
    """``seq`` computes tokens ``seq.num_computed : seq.num_computed + num_tokens`` this step;
    ``sample`` is True when the chunk ends at the sequence's last token (its logits are sampled)."""

    seq: Sequence
    num_tokens: int
    sample: bool


@dataclass
class SchedulerOutput:
    """One step's plan. rows: decode rows (num_tokens == 1) first, then prefill chunks."""

    rows: list[ScheduledRow] = field(default_factory=list)
    num_decodes: int = 0
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(r.num_tokens for r in self.rows)

    @property
    def is_empty(self) -> bool:
        return not self.rows


class Scheduler:
    """Admission, chunking and preemption.

    Args:
        block_manager: the page manager; max_num_seqs: most rows (running samples) at once,
        counting a group leader's unforked children; max_num_batched_tokens: per-step token budget.
    """

    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order; the last one is preempted first
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        """Queue ``seq`` (a group leader with its unforked children, or a lone sample)."""
        assert seq.group_size <= self.max_num_seqs, (
            f"{seq}: a group of {seq.group_size} samples cannot run within max_num_seqs={self.max_num_seqs}; "
            "split it (requests.sample_groups)"
        )
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """A forked child that already holds pages joins the running set."""
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Drop a finished / aborted sequence and free its pages."""
        if seq.status == SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SeqStatus.WAITING:
            self.waiting.remove(seq)
        self.bm.free_seq(seq)
        seq.status = SeqStatus.FINISHED

    def num_rows(self) -> int:
        return sum(s.group_size for s in self.running)

    def preempt(self, seq: Sequence, out: SchedulerOutput | None = None) -> None:
        """Preempt running ``seq`` by recompute: free its pages, put it at the front of the
        waiting queue (listed in ``out.preempted`` when a plan is being built)."""
        self.running.remove(seq)
        self.bm.free_seq(seq)
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        if out is not None:
            out.preempted.append(seq)

    def schedule(self) -> SchedulerOutput:
        """Plan one step. Never exceeds the token budget, ``max_num_seqs`` or the page pool."""
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        planned: list[ScheduledRow] = []
        queue = deque(self.running)
        ps = self.bm.page_size
        while queue and budget > 0:
            seq = queue.popleft()
            total = len(seq.token_ids) + seq.num_pending  # seq.num_tokens, inlined (hot loop)
            if total >= seq.max_len:
                continue  # async scheduling: its pending token is its last (finishes "length")
            n = min(total - seq.num_computed, budget)
            if seq.num_computed + n <= len(seq.block_table) * ps:  # fast path: its pages suffice
                planned.append(ScheduledRow(seq, n, seq.num_computed + n == total))
                budget -= n
                continue
            while not self.bm.ensure(seq, n):
                victim = queue.pop() if queue else seq
                self.preempt(victim, out)
                if victim is seq:
                    break
            else:
                planned.append(ScheduledRow(seq, n, seq.num_computed + n == seq.num_tokens))
                budget -= n
        if not out.preempted and self.waiting:
            rows = self.num_rows()
            while self.waiting and budget > 0:
                seq = self.waiting[0]
                if self.running and rows + seq.group_size > self.max_num_seqs:
                    break
                if seq.num_pending:
                    break  # preempted while its last token was in flight: admit once it landed
                self.bm.admit(seq)
                n = min(seq.num_tokens - seq.num_computed, budget)
                if not self.bm.ensure(seq, n):
                    self.bm.free_seq(seq)
                    break
                self.waiting.popleft()
                seq.status = SeqStatus.RUNNING
                self.running.append(seq)
                rows += seq.group_size
                planned.append(ScheduledRow(seq, n, seq.num_computed + n == seq.num_tokens))
                budget -= n
        decodes = [r for r in planned if r.num_tokens == 1]
        out.rows = decodes + [r for r in planned if r.num_tokens != 1]
        out.num_decodes = len(decodes)
        # End-of-step invariants.
        assert out.num_batched_tokens <= self.max_num_batched_tokens, "token budget exceeded"
        assert len({id(r.seq) for r in out.rows}) == len(out.rows), "a sequence scheduled twice"
        assert self.num_rows() <= self.max_num_seqs, f"{self.num_rows()} rows > max_num_seqs={self.max_num_seqs}"
        for r in out.rows:
            assert r.seq.status == SeqStatus.RUNNING and r.num_tokens >= 1
            assert len(r.seq.block_table) * self.bm.page_size >= r.seq.num_computed + r.num_tokens
        return out

"""One sample's host-side state in the engine (no tensors).

Governing idea: a request with ``n`` samples becomes ``n`` :class:`Sequence` records. Only the
first one (the group leader) is scheduled for the prompt's prefill; the other samples are forked
from it once that prefill is done (full pages shared, partial last page copied), so a GRPO
group computes its prompt once. A sequence's KV state is fully described by ``num_computed``
(tokens whose K/V sit in its pages) and ``block_table`` (logical page -> physical page).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence as Seq

from m3_rollout.engine.interface import SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class PromptScores:
    """A sample group's prompt logprobs (``SamplingParams.prompt_logprobs``), filled chunk by chunk
    by its leader's prefill (``launch.prompt_ask``) and shared by the group's samples.

    Attributes:
        k: top tokens per position. filters: (temperature, top_k, top_p) of the distribution
            (``SamplingParams.logprob_filters``).
        entries: [None, then one ``PositionLogprobs`` per prompt position 1.. scored so far] (in order).
        writes: [len(entries) - 1] the weight-write count each entry was scored under (-1: on KV
            computed partly under weights written over since).
        asked: entries 0 .. asked - 1 are recorded or in a launched step (entry i comes from the
            logits of position i - 1).
    """

    __slots__ = ("k", "filters", "entries", "writes", "asked")

    def __init__(self, params: SamplingParams):
        self.k, self.filters = params.prompt_logprobs, params.logprob_filters()
        self.entries: list = [None]
        self.writes: list[int] = []
        self.asked = 1


class Sequence:
    """A running / waiting sample.

    Attributes:
        seq_id: engine-unique id (also the preemption order: a larger id is preempted first).
        request_id: the caller's request id; req_key: the engine's unique number of the request.
        sample_index: absolute sample index (randomness key).
        token_ids: prompt + generated tokens; prompt_len: tokens of the prompt.
        logprobs, weight_versions: one entry per generated token.
        weight_writes: one entry per generated token: the engine's weight-write count
            (``LLMEngine.weight_writes``) the token was sampled under, or -1 when its KV was
            computed partly under weights written over since (``kv_stale``).
        num_computed: leading tokens whose K/V/index-K are in the pages.
        block_table: physical page of each logical page.
        page_hashes: chain hashes of the leading full pages registered so far (prefix cache).
        children: samples to fork from this leader when its prefill completes (empty after).
        stream: the caller wants :class:`StreamDelta` records; num_streamed: tokens sent so far.
        num_pending: tokens sampled by a launched step whose values have not reached the host yet
            (async scheduling: 0 or 1). ``num_tokens`` counts them, ``token_ids`` does not; the
            scheduler plans with ``num_tokens`` (a pending token is the next decode's input, taken
            on the device from the previous step's sampled ids).
        num_stop_checked: output tokens whose text was checked for stop strings and held none
            (the next check decodes only a tail window past them: ``stop_strings.py``).
        record_from: first position whose block-selection record the output carries
            (``GenerationRequest.block_selection_from``).
        selection_box: one-element list shared by the samples of a request: the first finished
            sample's prompt segment of the block-selection record, reused by the others when
            theirs is equal (a GRPO group's prompt is one object).
        kv_stale: some of its computed KV was computed under weights written over since (a weight
            update landed while it held KV and it went on without recomputing it: in_flight
            "continue" without ``recompute_kv_after_update``); cleared when its pages are freed
            (preemption recomputes everything under the weights then served).
        prompt_scores: its group's :class:`PromptScores` when the request asks for prompt
            logprobs, else None. While they are not all asked for, the sequence reads no prefix
            cache (``reads_prefix_cache``): every prompt position's logits must be computed.
    """

    __slots__ = (
        "seq_id",
        "request_id",
        "req_key",
        "sample_index",
        "params",
        "token_ids",
        "prompt_len",
        "logprobs",
        "top_logprobs",
        "weight_versions",
        "weight_writes",
        "num_computed",
        "block_table",
        "page_hashes",
        "status",
        "finish_reason",
        "children",
        "stream",
        "num_streamed",
        "stop_set",
        "max_len",
        "num_cached",
        "num_pending",
        "num_stop_checked",
        "sampling_key",
        "penalized",
        "record_from",
        "selection_box",
        "kv_stale",
        "prompt_scores",
    )

    def __init__(
        self,
        seq_id: int,
        request_id: str,
        req_key: int,
        sample_index: int,
        params: SamplingParams,
        prompt_ids: Seq[int],
        stop_set: frozenset,
        max_len: int,
        stream: bool = False,
        record_from: int = 0,
        selection_box: list | None = None,
    ):
        self.seq_id = seq_id
        self.request_id, self.req_key, self.sample_index = request_id, req_key, sample_index
        self.params = params
        self.token_ids = list(prompt_ids)
        self.prompt_len = len(self.token_ids)
        self.logprobs: list[float] = []
        # per generated token its top (token id, logprob) list, when the request asks (else None)
        self.top_logprobs: list[list[tuple[int, float]]] | None = [] if params.top_logprobs else None
        self.weight_versions: list[int] = []
        self.weight_writes: list[int] = []
        self.kv_stale = False
        self.num_computed = 0
        self.num_cached = 0  # tokens reused from the prefix cache at the last admission
        self.block_table: list[int] = []
        self.page_hashes: list[bytes] = []
        self.status = SeqStatus.WAITING
        self.finish_reason: str | None = None
        self.children: list[Sequence] = []
        self.stream, self.num_streamed = stream, 0
        self.stop_set = stop_set
        # Longest total length: prompt + max_new_tokens, capped by the engine's max_model_len.
        self.max_len = max_len
        self.num_pending = 0
        self.num_stop_checked = 0
        self.record_from = record_from
        self.selection_box = [None] if selection_box is None else selection_box
        # Per-sample sampler inputs that never change: (temperature, top_k, top_p, seed,
        # sample_index, raw logprobs) (engine: one tuple per row per step, no attribute walks).
        self.sampling_key = (
            params.temperature,
            params.top_k,
            params.top_p,
            params.seed,
            sample_index,
            params.logprobs_mode == "raw",
        )
        # Penalties / logit biases on: the sampler reads its tokens each step (launch.penalty_batch).
        self.penalized = params.penalized
        self.prompt_scores = None if params.prompt_logprobs is None else PromptScores(params)

    @property
    def num_tokens(self) -> int:
        """Tokens including the pending one (see ``num_pending``)."""
        return len(self.token_ids) + self.num_pending

    @property
    def reads_prefix_cache(self) -> bool:
        """False while some prompt position's logprob is still to be scored (vLLM's rule)."""
        return self.prompt_scores is None or self.prompt_scores.asked >= self.prompt_len

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len :]

    @property
    def group_size(self) -> int:
        """Rows this sequence will occupy once its children are forked."""
        return 1 + len(self.children)

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, req={self.request_id!r}, sample={self.sample_index}, "
            f"tokens={self.num_tokens}, computed={self.num_computed}, status={self.status.value})"
        )

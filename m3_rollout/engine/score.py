"""Re-scoring: per-token logprobs of a stored trajectory under the served weights; top logprobs.

Governing idea: scoring reuses the generation path exactly (the paged forward of
``model_runner.prepare_inputs`` prefill chunks — one sequence's, or several sequences' packed into
one forward — on KV pages borrowed from the pool for the call, every position's logits kept), so a
re-scored token's logprob is the one generation would give it. No sampling, no prefix reuse, no
scheduler. Top logprobs (the server's ``top_logprobs``, :func:`top_logprobs`) are one plain model
forward, which borrows no pages; the in-process server and the EP workers both call it through
``LLMEngine.top_logprobs`` / ``prepare_top_logprobs``. With ``with_tokens`` each position's own
token's logprob and rank come with its top ``k``: the server's prompt logprobs for a backend whose
outputs carry none (the engine computes them in its prefill, ``SamplingParams.prompt_logprobs``,
with the same ``sampler.position_logprobs``).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from m3_rollout.engine.block_manager import BlockManager
from m3_rollout.engine.interface import PositionLogprobs, SamplingParams, check_temperature, int_or_none
from m3_rollout.engine.model_runner import meta_to, prepare_inputs
from m3_rollout.engine.ops import bind_prefill_scratch
from m3_rollout.engine.paged_cache import PagedKVCache, prefill_scratch_bytes
from m3_rollout.engine.sampler import TokenLogprobs, gather_logprobs, position_logprobs, process_logits
from m3_rollout.engine.sequence import Sequence
from m3_rollout.model.numerics import compute_dtype
from m3_rollout.model.paged_ops import PagedOps


def check_score_temperature(temperature, dtype: torch.dtype, name: str = "score temperature") -> float:
    """``temperature`` as a float the logits (compute ``dtype``) can be divided by; ValueError
    (naming ``name``) for a non-number, non-finite, <= 0 or overflowing value
    (``interface.check_temperature``: 0 is no greedy mode here, it divides the logits)."""
    try:
        return check_temperature(temperature, dtype)
    except ValueError as exc:
        raise ValueError(str(exc).replace("SamplingParams.temperature", name)) from None


def check_top_logprobs_filters(temperature, top_k, top_p, dtype: torch.dtype) -> tuple[float, int, float]:
    """(temperature, top_k, top_p) of a top-logprobs call: the filters of a distribution, not
    sampling params, so temperature > 0 (``interface.check_temperature``) and top_k -1 (off) or >= 1
    (neither greedy nor top_k 0, which ``SamplingParams.validate`` translates); top_p in (0, 1].
    ValueError naming ``top_logprobs temperature`` / ``top_k`` / ``top_p``."""
    try:
        check_temperature(temperature, dtype)
        if int_or_none(top_k) == 0:
            raise ValueError(f"SamplingParams.top_k={top_k!r}: must be -1 (off) or >= 1")
        p = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p).validate(dtype)
    except ValueError as exc:
        raise ValueError(str(exc).replace("SamplingParams.", "top_logprobs ")) from None
    return p.temperature, p.top_k, p.top_p


SCORE_PAGES_HINT = "call it when fewer requests are running"  # what a caller of score short of pages can do


def pages_error(block_manager: BlockManager, num_tokens: int, hint: str) -> RuntimeError:
    """The error of a scoring call whose ``num_tokens`` tokens find too few free KV pages."""
    return RuntimeError(
        f"score: {block_manager.pages_for(num_tokens)} KV pages needed, {block_manager.num_free_pages} free; {hint}"
    )


def check_top_logprobs(ids: list[int], start, k, with_tokens: bool = False) -> tuple[int, int]:
    """(start, k) as ints for the top-``k`` logprobs of positions ``start .. len(ids) - 1`` of the
    checked ids ``ids`` (position i is predicted from tokens 0 .. i - 1, so 1 <= start < len(ids)).
    ``with_tokens``: the positions' own tokens are scored too, so ``k`` may be 0.

    Raises:
        ValueError naming ``top_logprobs token_ids`` (fewer than 2 ids), ``top_logprobs start``
        (not an integer in [1, len(ids) - 1]) or ``top_logprobs k`` (not an integer >= 1; >= 0
        ``with_tokens``).
    """
    if len(ids) < 2:
        raise ValueError(
            "top_logprobs token_ids: a single token; at least 2 are needed (position i's top logprobs are "
            "predicted from tokens 0 .. i - 1, for i >= 1)"
        )
    s = int_or_none(start)
    if s is None or not 1 <= s < len(ids):
        raise ValueError(
            f"top_logprobs start={start!r}: must be an integer in [1, {len(ids) - 1}] (len(token_ids) - 1)"
        )
    n = int_or_none(k)
    low = 0 if with_tokens else 1
    if n is None or n < low:
        raise ValueError(f"top_logprobs k={k!r}: must be an integer >= {low}")
    return s, n


@torch.no_grad()
def top_logprobs(
    model,
    ids: list[int],
    start: int,
    k: int,
    temperature: float,
    top_k: int = -1,
    top_p: float = 1.0,
    batch_invariant: bool = False,
    with_tokens: bool = False,
    token_logprobs: TokenLogprobs | None = None,
) -> list[list[tuple[int, float]]] | list[PositionLogprobs]:
    """The ``k`` most likely tokens at positions ``start .. len(ids) - 1`` of ``ids`` under
    ``model``: one plain forward over ``ids[:-1]``, the log-softmax of the logits processed as the
    sampler processes them (``sampler.position_logprobs``, as the engine's prefill scores prompt
    logprobs: / ``temperature``, then the ``top_k`` / ``top_p`` filters; the defaults filter
    nothing) in the logits' compute dtype (fp32; fp64 for an fp64 model; ``batch_invariant``: the
    sampler's tie rule of that mode; ``token_logprobs``: the sampler's logprob op for the positions'
    own tokens): the "processed" logprobs of the distribution sampled from. Tokens the filters
    removed (logprob -inf) are left out, so a position may list fewer than ``k`` (one under
    top_k 1). Arguments as :func:`check_top_logprobs` / :func:`check_top_logprobs_filters`
    return them (1 <= start < len(ids), k >= 1, or >= 0 ``with_tokens``; k above the vocabulary
    gives all of it). Under EP the forward is collective: every rank calls this with the same ids.

    Returns:
        [len(ids) - start] lists of (token id, logprob), most likely first (ties: ``torch.topk``'s
        order); ``with_tokens``: [len(ids) - start] :class:`PositionLogprobs`, which add the
        position's own token's (``ids[i]``) logprob in the same distribution and its rank.
    """
    device = model.lm_head.weight.device
    logits = model(torch.tensor([ids[:-1]], device=device))[0, start - 1 :]  # [G, V]: position start .. L-1
    tgt = torch.tensor(ids[start:], dtype=torch.int64, device=device)  # [G]
    own, rank, idx, vals = position_logprobs(logits, tgt, k, temperature, top_k, top_p, batch_invariant, token_logprobs)
    rows = [
        [(t, v) for t, v in zip(i.tolist(), lv.tolist()) if v != float("-inf")] for i, lv in zip(idx.cpu(), vals.cpu())
    ]
    if not with_tokens:
        return rows
    return [PositionLogprobs(lp, r, row) for lp, r, row in zip(own.tolist(), rank.tolist(), rows)]


def paged_packed_logits(
    model,
    ops: PagedOps,
    kv: PagedKVCache,
    block_manager: BlockManager,
    rows: list[list[int]],
    chunk_tokens: int,
    hint: str,
) -> Iterator[tuple[list[tuple[int, int, int]], torch.Tensor]]:
    """The paged forward over ``rows`` (token ids [L_r] each, plain ints; an empty row is skipped)
    packed into prefill forwards of at most ``chunk_tokens`` tokens, as the engine's scheduler packs
    several sequences' prefill chunks into one step: rows in order, each forward filled up to
    ``chunk_tokens``, a row split where the budget ends and continued at the head of the next
    forward (its chunk k+1 always runs in a later forward than its chunk k).

    Pages: a row's pages (``pages_for(L_r)``) are taken from ``block_manager`` when its first token
    joins a pack — when they are not free, the pack so far is run first (a shorter forward), which
    gives back every row it finishes — and a row's pages go back right after the forward that ran
    its last token; all of them when the iteration ends or is abandoned.

    Yields:
        per forward (pieces, logits): pieces = [(r, start, n)] in the logits' row order (row r's
        tokens start .. start + n - 1), logits [sum n, V] in the model dtype on ``kv``'s device, the
        positions' logits as generation computes them.
    Raises:
        RuntimeError (ending with ``hint``): a row's pages are not free with no other row of the
        call holding any.
    """
    device = kv.device
    live: dict[int, Sequence] = {}  # row -> its pages, from its first piece to its last forward

    def forward(pack: list[tuple[int, int, int]]) -> torch.Tensor:
        inp = prepare_inputs(
            [rows[r][s : s + n] for r, s, n in pack],
            [s for _, s, _ in pack],
            [live[r].block_table for r, _, _ in pack],
            kv.page_size,
            0,
        )
        logits = model.forward_paged(inp.input_ids.to(device), meta_to(inp.meta, device), kv, ops)  # [T, V]
        for r, s, n in pack:
            if s + n == len(rows[r]):
                block_manager.free_seq(live.pop(r))
        return logits

    pack: list[tuple[int, int, int]] = []
    used = 0
    try:
        for r, ids in enumerate(rows):
            if not ids:
                continue
            seq = Sequence(-1, "score", -1, 0, SamplingParams(), ids, frozenset(), len(ids))
            if not block_manager.ensure(seq, len(ids)):
                if pack:
                    yield pack, forward(pack)  # gives back the pages of every row it finishes
                    pack, used = [], 0
                if not block_manager.ensure(seq, len(ids)):
                    raise pages_error(block_manager, len(ids), hint)
            live[r] = seq
            start = 0
            while start < len(ids):
                n = min(len(ids) - start, chunk_tokens - used)
                pack.append((r, start, n))
                start, used = start + n, used + n
                if used == chunk_tokens:
                    yield pack, forward(pack)
                    pack, used = [], 0
        if pack:
            yield pack, forward(pack)
    finally:
        for seq in live.values():
            block_manager.free_seq(seq)


@torch.no_grad()
def score_tokens(
    model,
    ops: PagedOps,
    kv: PagedKVCache,
    block_manager: BlockManager,
    ids: list[int],
    chunk_tokens: int,
    temperature: float,
    token_logprobs: TokenLogprobs | None = None,
) -> torch.Tensor:
    """Logprobs of ``ids`` [L] (checked plain ints) under ``model``.

    Args:
        ops: the engine's fast-op table (``LLMEngine.runner.ops``).
        chunk_tokens: tokens per forward (the step budget). temperature: logits are divided by it.
        token_logprobs: the sampler's logprob op (``LLMEngine.runner.token_logprobs``; batch-invariant
            mode), run on the model's device; None = ``torch.log_softmax`` on the host.
    Returns:
        fp32 (fp64 for an fp64 model) [L]: entry 0 = 0, entry i = log p(token_i | tokens_<i).
    Raises:
        RuntimeError: not enough free KV pages now.
    """
    device = kv.device
    chunks = [
        logits.to(compute_dtype(logits.dtype)).cpu()
        for _, logits in paged_packed_logits(model, ops, kv, block_manager, [ids], chunk_tokens, SCORE_PAGES_HINT)
    ]
    logits = torch.cat(chunks) / temperature  # [L, V]
    tgt = torch.tensor(ids[1:], dtype=torch.int64)
    if token_logprobs is None:
        lp = gather_logprobs(logits[:-1], tgt)
    else:
        lp = gather_logprobs(logits[:-1].to(device), tgt.to(device), token_logprobs).cpu()
    return torch.cat([torch.zeros(1, dtype=lp.dtype), lp])  # [L]


SCORER_LOGITS_BYTES = 1 << 30  # fp32 logits of one PagedScorer forward, at most


class PagedScorer:
    """The trainer's no-grad logprob scoring through the engine's paged forward (batch-invariant
    mode, design.md §4.6): a batch of sequences packed into prefill forwards of at most
    ``chunk_tokens`` tokens (``paged_packed_logits``) on a scratch page pool of its own, logits
    kept on the model's device, each target's logprob taken exactly as the engine's sampler takes
    a sampled token's ("processed": logits in the compute dtype divided by the temperature in that
    dtype, ``sampler.process_logits``; then ``sampler.gather_logprobs`` with ``token_logprobs``).
    With the invariant ``ops`` / ``token_logprobs`` of the engine and the same weights (the
    trainer's compute copy = what the refit sends) a token's logprob is bitwise the one the engine
    recorded for it, whatever the engine batched it with — and whatever this scorer packs it with:
    a sequence alone or among others, split anywhere, gives the same bits.

    Args:
        config: the model's ``M3Config`` (page size = ``sparse_block_size``).
        ops: the engine's ``PagedOps`` table (``engine.ops.paged_ops_for(..., batch_invariant=True,
            invariant_sparse_attention=<the engine's EngineConfig.invariant_sparse_attention>)``).
            A table that takes a prefill scratch (the invariant one built with "page_partials")
            gets one of its own, ``prefill_scratch``: one forward's KV-major pass
            (``paged_cache.prefill_scratch_bytes`` for ``chunk_tokens``, at every length).
        max_model_len: the longest sequence scored (tokens).
        chunk_tokens: tokens per forward (the engine's ``max_num_batched_tokens``), lowered so one
            forward's fp32 logits [chunk_tokens, V] stay under ``SCORER_LOGITS_BYTES``.
        dtype, device: the KV dtype (the compute copy's weight dtype) and the model's device.
        index_cache_dtype, quantize_index_queries: as the engine's ``EngineConfig`` (the block
            selection reads the index-key cache: it must be coded as the engine's).
        token_logprobs: the sampler's logprob op (``engine.ops.invariant_token_logprobs``); None =
            ``torch.log_softmax``.

    The pool: max(pages of one ``max_model_len`` sequence, 2 x pages of ``chunk_tokens``) — one
    forward's tokens plus a partial page for each of up to ``chunk_tokens / page_size`` sequences
    (sequences of a page or more on average); a pack that does not fit is run early (a shorter
    forward, the same bits).

    Raises:
        ValueError: ``chunk_tokens`` or ``max_model_len`` < 1.
    """

    def __init__(
        self,
        config,
        ops: PagedOps,
        max_model_len: int,
        chunk_tokens: int,
        dtype: torch.dtype,
        device: torch.device | str,
        index_cache_dtype: str = "bfloat16",
        quantize_index_queries: bool = False,
        token_logprobs: TokenLogprobs | None = None,
    ):
        if chunk_tokens < 1 or max_model_len < 1:
            raise ValueError(f"PagedScorer: chunk_tokens={chunk_tokens}, max_model_len={max_model_len}: must be >= 1")
        ps = config.sparse_block_size
        # one forward's fp32 logits stay under SCORER_LOGITS_BYTES (M3's 200K vocabulary: 1,341
        # tokens); any pack size gives the same bits, so the cap only bounds memory
        chunk_tokens = max(1, min(chunk_tokens, SCORER_LOGITS_BYTES // (4 * config.vocab_size)))
        self.prefill_scratch: torch.Tensor | None = None
        if ops.takes_prefill_scratch:  # any pass size gives the same bits: one forward's tokens
            nbytes = prefill_scratch_bytes(config, dtype, None, chunk_tokens, min_tokens=1)
            self.prefill_scratch = torch.empty(nbytes, dtype=torch.uint8, device=device)
            ops = bind_prefill_scratch(ops, self.prefill_scratch)
        pages = max(-(-max_model_len // ps), 2 * -(-chunk_tokens // ps))
        self.ops, self.chunk_tokens, self.max_model_len = ops, chunk_tokens, max_model_len
        self.token_logprobs = token_logprobs
        self.kv = PagedKVCache(config, pages, dtype, device, index_cache_dtype, quantize_index_queries)
        self.block_manager = BlockManager(pages, ps, enable_prefix_caching=False)

    @torch.no_grad()
    def __call__(self, model, rows: list[list[int]], temperature: float) -> list[torch.Tensor]:
        """Logprobs of each row of ``rows`` (token ids [L_i], plain ints, 1 <= L_i <= max_model_len)
        under ``model`` (on the scorer's device, weights in its KV dtype). A row's last token is
        not run (its logits predict nothing): the forwards carry sum(L_i - 1) tokens.

        Returns:
            per row, [L_i] in the logits' compute dtype (fp32; fp64 for an fp64 model) on the device:
            entry 0 = 0, entry i = log p(token_i | tokens_<i) at ``temperature``.
        Raises:
            ValueError: some L_i outside [1, max_model_len] (nothing is run).
        """
        for ids in rows:
            if not 1 <= len(ids) <= self.max_model_len:
                raise ValueError(f"PagedScorer: {len(ids)} tokens, max_model_len={self.max_model_len}")
        device, dtype = self.kv.device, compute_dtype(self.kv.dtype)
        parts: list[list[torch.Tensor]] = [[torch.zeros(1, dtype=dtype, device=device)] for _ in rows]
        # the pool is this scorer's and holds a max_model_len row: never short
        hint = "the PagedScorer pool is sized for max_model_len: a bug"
        inputs = [ids[:-1] for ids in rows]  # position i's target is token i + 1
        for pieces, logits in paged_packed_logits(
            model, self.ops, self.kv, self.block_manager, inputs, self.chunk_tokens, hint
        ):
            t = logits.shape[0]  # [T, V] in the model dtype, what the runner hands the sampler
            temp = torch.full((t,), float(temperature), dtype=torch.float64, device=device)
            processed = process_logits(
                logits, temp, torch.full((t,), -1, device=device), torch.ones(t, device=device), False, False
            )
            tgt = [tok for r, s, n in pieces for tok in rows[r][s + 1 : s + 1 + n]]
            lp = gather_logprobs(processed, torch.tensor(tgt, dtype=torch.int64, device=device), self.token_logprobs)
            for (r, _, _), piece in zip(pieces, lp.split([n for _, _, n in pieces])):
                parts[r].append(piece)  # [n]; a row's pieces come in order
        return [torch.cat(p) for p in parts]  # [L_i] each

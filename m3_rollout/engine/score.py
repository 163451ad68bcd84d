"""Re-scoring: per-token logprobs of a stored trajectory under the served weights.

Governing idea: scoring reuses the generation path exactly (the paged forward of
``model_runner.prepare_inputs`` chunks on KV pages borrowed from the pool for the call, every
position's logits kept), so a re-scored token's logprob is the one generation would give it.
No sampling, no prefix reuse, no scheduler.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from m3_rollout.engine.block_manager import BlockManager
from m3_rollout.engine.interface import SamplingParams
from m3_rollout.engine.model_runner import meta_to, prepare_inputs
from m3_rollout.engine.paged_cache import PagedKVCache
from m3_rollout.engine.sampler import TokenLogprobs, gather_logprobs, process_logits
from m3_rollout.engine.sequence import Sequence
from m3_rollout.model.numerics import compute_dtype
from m3_rollout.model.paged_ops import PagedOps


def check_score_temperature(temperature, dtype: torch.dtype) -> float:
    """``temperature`` as a float the logits (compute ``dtype``) can be divided by; ValueError
    (naming ``score temperature``) for a non-number, non-finite, <= 0 or overflowing value (the
    rule of ``SamplingParams.temperature``)."""
    try:
        return SamplingParams(temperature=temperature).validate(dtype).temperature
    except ValueError as exc:
        raise ValueError(str(exc).replace("SamplingParams.temperature", "score temperature")) from None


def paged_chunk_logits(
    model, ops: PagedOps, kv: PagedKVCache, block_manager: BlockManager, ids: list[int], chunk_tokens: int, hint: str
) -> Iterator[tuple[int, torch.Tensor]]:
    """The paged forward over ``ids`` [L] in prefill chunks of ``chunk_tokens`` on pages borrowed
    from ``block_manager`` for the call (freed when the iteration ends or is abandoned): yields
    (start, logits [chunk, V] in the model dtype on ``kv``'s device) per chunk, as generation
    computes them. Raises RuntimeError, ending with ``hint``, when the pool lacks free pages."""
    seq = Sequence(-1, "score", -1, 0, SamplingParams(), ids, frozenset(), len(ids))
    if not block_manager.ensure(seq, len(ids)):
        raise RuntimeError(
            f"score: {block_manager.pages_for(len(ids))} KV pages needed, {block_manager.num_free_pages} free; {hint}"
        )
    device = kv.device
    try:
        for start in range(0, len(ids), chunk_tokens):
            chunk = ids[start : start + chunk_tokens]
            inp = prepare_inputs([chunk], [start], [seq.block_table], kv.page_size, 0)
            yield start, model.forward_paged(inp.input_ids.to(device), meta_to(inp.meta, device), kv, ops)
    finally:
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
        for _, logits in paged_chunk_logits(
            model, ops, kv, block_manager, ids, chunk_tokens, "call it when fewer requests are running"
        )
    ]
    logits = torch.cat(chunks) / temperature  # [L, V]
    tgt = torch.tensor(ids[1:], dtype=torch.int64)
    if token_logprobs is None:
        lp = gather_logprobs(logits[:-1], tgt)
    else:
        lp = gather_logprobs(logits[:-1].to(device), tgt.to(device), token_logprobs).cpu()
    return torch.cat([torch.zeros(1, dtype=lp.dtype), lp])  # [L]


class PagedScorer:
    """The trainer's no-grad logprob scoring through the engine's paged forward (batch-invariant
    mode, design.md §4.6): per sequence, prefill chunks of ``chunk_tokens`` on a scratch page pool
    of its own, logits kept on the model's device, each target's logprob taken exactly as the
    engine's sampler takes a sampled token's ("processed": logits in the compute dtype divided by
    the temperature in that dtype, ``sampler.process_logits``; then ``sampler.gather_logprobs``
    with ``token_logprobs``). With the invariant ``ops`` / ``token_logprobs`` of the engine and
    the same weights (the trainer's compute copy = what the refit sends) a token's logprob is
    bitwise the one the engine recorded for it, whatever the engine batched it with.

    Args:
        config: the model's ``M3Config`` (page size = ``sparse_block_size``).
        ops: the engine's ``PagedOps`` table (``engine.ops.paged_ops_for(..., batch_invariant=True)``);
            tables that take a prefill scratch are refused (the invariant one takes none).
        max_model_len: the longest sequence scored (tokens); the pool holds one such sequence.
        chunk_tokens: tokens per forward (the engine's ``max_num_batched_tokens``; the invariant
            kernels make the chunking irrelevant to the bits).
        dtype, device: the KV dtype (the compute copy's weight dtype) and the model's device.
        index_cache_dtype, quantize_index_queries: as the engine's ``EngineConfig`` (the block
            selection reads the index-key cache: it must be coded as the engine's).
        token_logprobs: the sampler's logprob op (``engine.ops.invariant_token_logprobs``); None =
            ``torch.log_softmax``.

    Raises:
        ValueError: ``chunk_tokens`` or ``max_model_len`` < 1, or ``ops`` takes a prefill scratch.
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
        if ops.takes_prefill_scratch:
            raise ValueError(
                "PagedScorer: the ops table takes a prefill scratch (bind one, or use the invariant table)"
            )
        ps = config.sparse_block_size
        pages = -(-max_model_len // ps)
        self.ops, self.chunk_tokens, self.max_model_len = ops, chunk_tokens, max_model_len
        self.token_logprobs = token_logprobs
        self.kv = PagedKVCache(config, pages, dtype, device, index_cache_dtype, quantize_index_queries)
        self.block_manager = BlockManager(pages, ps, enable_prefix_caching=False)

    @torch.no_grad()
    def __call__(self, model, ids: list[int], temperature: float) -> torch.Tensor:
        """Logprobs of ``ids`` [L] (plain ints, 1 <= L <= max_model_len) under ``model`` (on the
        scorer's device, weights in its KV dtype).

        Returns:
            [L] in the logits' compute dtype (fp32; fp64 for an fp64 model) on the device: entry 0 = 0,
            entry i = log p(token_i | tokens_<i) at ``temperature``.
        Raises:
            ValueError: L outside [1, max_model_len].
        """
        if not 1 <= len(ids) <= self.max_model_len:
            raise ValueError(f"PagedScorer: {len(ids)} tokens, max_model_len={self.max_model_len}")
        device = self.kv.device
        lps = []
        # the pool is this scorer's and holds max_model_len tokens: never short
        hint = "the PagedScorer pool is sized for max_model_len: a bug"
        chunks = paged_chunk_logits(model, self.ops, self.kv, self.block_manager, ids, self.chunk_tokens, hint)
        try:
            for start, logits in chunks:
                tgt = ids[start + 1 : start + 1 + logits.shape[0]]  # the next token of each position (last: none)
                n = len(tgt)
                if n == 0:
                    break
                logits = logits[:n].to(compute_dtype(logits.dtype))  # [n, V], what the runner hands the sampler
                temp = torch.full((n,), float(temperature), dtype=torch.float64, device=device)
                processed = process_logits(
                    logits, temp, torch.full((n,), -1, device=device), torch.ones(n, device=device), False, False
                )
                tokens = torch.tensor(tgt, dtype=torch.int64, device=device)
                lps.append(gather_logprobs(processed, tokens, self.token_logprobs))
        finally:
            chunks.close()  # the pages go back now, also after the break
        head = torch.zeros(1, dtype=lps[0].dtype if lps else compute_dtype(self.kv.dtype), device=device)
        return torch.cat([head, *lps])  # [L]

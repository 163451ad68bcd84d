"""Re-scoring: per-token logprobs of a stored trajectory under the served weights.

Governing idea: scoring reuses the generation path exactly (the paged forward of
``model_runner.prepare_inputs`` chunks on KV pages borrowed from the pool for the call, every
position's logits kept), so a re-scored token's logprob is the one generation would give it.
No sampling, no prefix reuse, no scheduler.
"""

from __future__ import annotations

import torch

from m3_rollout.engine.block_manager import BlockManager
from m3_rollout.engine.interface import SamplingParams
from m3_rollout.engine.model_runner import meta_to, prepare_inputs
from m3_rollout.engine.paged_cache import PagedKVCache
from m3_rollout.engine.sampler import TokenLogprobs, gather_logprobs
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
    seq = Sequence(-1, "score", -1, 0, SamplingParams(), ids, frozenset(), len(ids))
    if not block_manager.ensure(seq, len(ids)):
        raise RuntimeError(
            f"score: {block_manager.pages_for(len(ids))} KV pages needed, {block_manager.num_free_pages} free; "
            "call it when fewer requests are running"
        )
    device = kv.device
    try:
        chunks = []
        for start in range(0, len(ids), chunk_tokens):
            chunk = ids[start : start + chunk_tokens]
            inp = prepare_inputs([chunk], [start], [seq.block_table], kv.page_size, 0)
            logits = model.forward_paged(inp.input_ids.to(device), meta_to(inp.meta, device), kv, ops)
            chunks.append(logits.to(compute_dtype(logits.dtype)).cpu())
    finally:
        block_manager.free_seq(seq)
    logits = torch.cat(chunks) / temperature  # [L, V]
    tgt = torch.tensor(ids[1:], dtype=torch.int64)
    if token_logprobs is None:
        lp = gather_logprobs(logits[:-1], tgt)
    else:
        lp = gather_logprobs(logits[:-1].to(device), tgt.to(device), token_logprobs).cpu()
    return torch.cat([torch.zeros(1, dtype=lp.dtype), lp])  # [L]

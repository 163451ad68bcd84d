"""The trainer's batch-invariant scoring (issue 24, design.md §4.6), wired by the job layer.

With ``policy.generation.batch_invariant`` the prev logprobs the trainer compares with the rollout's
(``token_mult_prob_error``, ``gen_kl_error``) and feeds the loss come from the engine's paged
forward with the engine's invariant ops table and logprob op, run on the trainer's compute copy
(bf16 weights cast from the fp32 masters exactly as the refit sends them): ``Policy.scorer``. The
trainers may not import the engine, so it is built here and handed in.
"""

from __future__ import annotations

from m3_rollout.config import MasterConfig
from m3_rollout.engine.ops import invariant_token_logprobs, paged_ops_for
from m3_rollout.engine.score import PagedScorer


def invariant_scorer(cfg: MasterConfig, compute_model, max_model_len: int) -> PagedScorer | None:
    """A ``PagedScorer`` for ``compute_model`` (the trainer's compute copy, ``Policy.compute``) when
    ``policy.generation.batch_invariant`` is on, else None.

    The ops table (with ``policy.generation.invariant_sparse_attention``, the engine's choice: another
    sparse attention would reduce in another order and break the bitwise match), the logprob op, the
    chunk (``max_num_batched_tokens``) and the index-key cache coding are the engine's for the same
    config (``LLMEngine.__init__``); the scratch pool (one forward's sequences, at least one of
    ``max_model_len`` tokens) is on the model's device in its weight dtype. Off CUDA the tables are
    the fast ones (``paged_ops_for`` warns): the scoring then only matches to rounding.
    """
    gen = cfg.policy.generation
    if not gen.batch_invariant:
        return None
    w = compute_model.lm_head.weight
    ops = paged_ops_for(
        w.device,
        compute_model.model.embed_tokens.weight.dtype,
        batch_invariant=True,
        invariant_sparse_attention=gen.invariant_sparse_attention,
    )
    return PagedScorer(
        compute_model.config,
        ops,
        max_model_len,
        gen.max_num_batched_tokens,
        w.dtype,
        w.device,
        gen.index_cache_dtype,
        gen.quantize_index_queries,
        token_logprobs=invariant_token_logprobs(w.device),
    )

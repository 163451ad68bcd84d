"""Request admission: a :class:`GenerationRequest` is checked once, field by field, before it is queued.

Governing idea: a bad request must fail alone. :func:`check_request` validates every field
(types and ranges of the sampling parameters, the sample index, the prompt's token ids) and
returns a :class:`CheckedRequest` of plain Python values, or raises ValueError naming the field;
the engine turns that error into the request's :func:`error_outputs` instead of raising out of a
call that also holds valid requests (:func:`aborted_outputs`: the records of one aborted before it
reached the engine). :func:`sample_groups` splits a request's n samples into
groups the scheduler can admit (at most ``max_num_seqs`` rows each).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from m3_rollout.engine.interface import (
    FINISH_ERROR,
    GenerationRequest,
    SampleOutput,
    SamplingParams,
    as_int,
    int_or_none,
)


@dataclass(frozen=True)
class CheckedRequest:
    """A validated request: ``prompt_ids`` plain ints [P], ``params`` plain values
    (``SamplingParams.validate``), ``sample_index`` an int with sample_index + n - 1 < 2**63,
    ``block_selection_from`` an int in [0, P]."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    sample_index: int
    block_selection_from: int = 0


def check_prompt(ids, vocab_size: int, max_model_len: int, name: str, room_for_output: bool = True) -> list[int]:
    """Token ids [P] as plain ints (Python / numpy ints, 0-d integer tensors).

    Raises ValueError, naming ``name``, for a non-sequence, non-integer (bool, float, str) or
    out-of-vocabulary id, an empty prompt, or one too long for ``max_model_len`` (one token of
    room is needed when ``room_for_output``).
    """
    try:
        items = list(ids)
    except TypeError:
        raise ValueError(f"{name}: must be a sequence of token ids, got {ids!r}") from None
    out = []
    for t in items:
        try:
            out.append(as_int(t))
        except TypeError:
            raise ValueError(f"{name}: token ids must be integers, got {t!r}") from None
    if not out:
        raise ValueError(f"{name}: empty prompt")
    if min(out) < 0 or max(out) >= vocab_size:
        bad = next(t for t in out if not 0 <= t < vocab_size)
        raise ValueError(f"{name}: token id {bad} outside the vocabulary [0, {vocab_size})")
    if len(out) >= max_model_len + (0 if room_for_output else 1):
        raise ValueError(
            f"{name}: prompt of {len(out)} tokens leaves no room under max_model_len={max_model_len}"
            if room_for_output
            else f"{name}: {len(out)} tokens exceed max_model_len={max_model_len}"
        )
    return out


def check_request(
    req: GenerationRequest, vocab_size: int, max_model_len: int, compute_dtype: torch.dtype, can_detokenize: bool
) -> CheckedRequest:
    """Validate ``req`` for an engine of this vocabulary, ``max_model_len`` and sampler
    ``compute_dtype`` (fp32 / fp64: bounds the temperature).

    Raises:
        ValueError naming the bad field (the request's error text).
    """
    if not isinstance(req.params, SamplingParams):
        raise ValueError(f"GenerationRequest.params={req.params!r:.80}: must be a SamplingParams")
    params = req.params.validate(compute_dtype)
    idx = req.sample_index
    first = int_or_none(idx)
    if first is None or not -(2**63) <= first <= 2**63 - params.n:
        raise ValueError(
            f"GenerationRequest.sample_index={idx!r}: samples sample_index .. sample_index + n - 1 "
            "must be integers in [-2**63, 2**63) (they key the sampler's int64 hash)"
        )
    prompt = check_prompt(req.prompt_ids, vocab_size, max_model_len, "GenerationRequest.prompt_ids")
    bad_bias = [t for t, _ in params.logit_bias if t >= vocab_size]
    if bad_bias:
        raise ValueError(f"SamplingParams.logit_bias: token id {bad_bias[0]} outside the vocabulary [0, {vocab_size})")
    if params.stop_strings and not can_detokenize:
        raise ValueError("SamplingParams.stop_strings: this engine has no detokenize callback")
    frm = int_or_none(req.block_selection_from)
    if frm is None or not 0 <= frm <= len(prompt):
        raise ValueError(
            f"GenerationRequest.block_selection_from={req.block_selection_from!r}: must be an integer in "
            f"[0, {len(prompt)}] (the prompt's length)"
        )
    return CheckedRequest(req.request_id, prompt, params, first, frm)


def error_outputs(req: GenerationRequest, error: str, weight_version: int) -> list[SampleOutput]:
    """The error records of a rejected request: one per ``req.output_indices()`` (one per
    sample, or a single one when ``n`` or ``sample_index`` is not a valid integer)."""
    return [
        SampleOutput(req.request_id, i, _prompt_of(req), [], [], FINISH_ERROR, weight_version, error=error)
        for i in req.output_indices()
    ]


def aborted_outputs(req: GenerationRequest, weight_version: int) -> list[SampleOutput]:
    """The records of a request aborted before it reached the engine (e.g. held at the server's
    admission gate): one per ``req.output_indices()``, finish reason "abort", no tokens, as the
    engine ends a sample aborted before its prefill ran (``top_logprobs`` [] when asked;
    ``prompt_logprobs`` [None], no position scored, when ``params.prompt_logprobs`` asks, so that
    no caller scores the prompt for it: it ran no model work and must run none)."""
    params = req.params
    sampling = isinstance(params, SamplingParams)
    tops = bool(sampling and params.top_logprobs)
    prompt_scored = sampling and params.prompt_logprobs is not None
    return [
        SampleOutput(
            req.request_id,
            i,
            _prompt_of(req),
            [],
            [],
            "abort",
            weight_version,
            top_logprobs=[] if tops else None,
            prompt_logprobs=[None] if prompt_scored else None,
        )
        for i in req.output_indices()
    ]


def _prompt_of(req: GenerationRequest) -> list:
    try:
        return list(req.prompt_ids)
    except TypeError:
        return []


def sample_groups(n: int, max_num_seqs: int) -> list[range]:
    """Split samples 0..n-1 into consecutive groups of at most ``max_num_seqs``.

    NOTE: each group is one leader (prefilled once) plus children forked from it, and occupies
    ``len(group)`` rows once forked; a group wider than ``max_num_seqs`` would overrun the row
    limit, so n > max_num_seqs is queued as several groups (as vLLM queues a request's samples).
    Later groups of the same prompt find its full pages in the prefix cache. The keyed sampler
    makes the tokens independent of the grouping.
    """
    return [range(s, min(s + max_num_seqs, n)) for s in range(0, n, max_num_seqs)]

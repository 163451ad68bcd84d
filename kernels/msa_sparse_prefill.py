"""Pipelined sparse prefill: the lightning indexer's block scores of the next tokens run beside the
KV-major attention of the tokens before them.

Which prefill path is this: the SPARSE layers' prefill rows, called by ``msa_fused_decode.msa_attention``
(the engine's op on CUDA). It is ``msa_index_topk.index_topk`` followed by
``msa_paged_attention.paged_attention`` on the same tensors, with the same result bit for bit; only
the order of the launches differs.

Governing idea: at long prompts the index scores are bound by the tensor cores (FP8 dots, ~20 % of
the 128K layer) and the KV-major attention by memory and latency (query gathers, partial outputs,
the LSE merge). Run back to back they do not overlap. Here the scores run in windows of
``SCORE_WINDOW_TOKENS`` tokens on a side stream, all launched up front; the attention, on the
caller's stream, runs its passes (``paged_attention``'s KV-major passes) and before each pass waits
for the windows that cover its tokens, then ranks their top-k blocks (``select_topk_blocks``) into
the selection it reads. While the attention of pass c runs, the scores of the later windows can run
on whatever the attention leaves of each SM.
Exactness: a window scores whole query tiles (the tiles whose first token lies in it), the score of
a (token, head, block) does not depend on which launch computed it, and the top-k of a token reads
only its own scores: the selection and the output equal the unpipelined path's.
CUDA-graph capture: the side stream is forked from and joined back to the caller's stream with
events, as stream capture requires. Off CUDA (the interpreter) the windows run in order on the one
stream, which the CPU tests use to check the windowing.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from m3_kernels.msa_fp8 import split_index_cache
from m3_kernels.paged_layout import PagedMetadata

PIPELINE = False  # True: score windows on a side stream beside the attention passes (not measured on a GPU yet)
SCORE_WINDOW_TOKENS = 8192  # tokens per score window (a multiple of every score tile, 16..64 tokens)
_SIDE_STREAMS: dict = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """One side stream per device for the score windows (created on first use)."""
    key = torch.device(device).index
    if key not in _SIDE_STREAMS:
        _SIDE_STREAMS[key] = torch.cuda.Stream(device=device)
    return _SIDE_STREAMS[key]


def sparse_prefill(
    q: torch.Tensor,
    iq: torch.Tensor,
    k_cache_l: torch.Tensor,
    v_cache_l: torch.Tensor,
    index_cache_l,
    meta: PagedMetadata,
    scale: float,
    topk: int,
    init_blocks: int = 0,
    local_blocks: int = 1,
    scratch: torch.Tensor | None = None,
    sel_out: torch.Tensor | None = None,
    window_tokens: int | None = None,
) -> torch.Tensor:
    """Sparse attention of prefill rows: index scores, top-k blocks, attention (spec §3.4-3.5).

    q: [T, nh, d]; iq: [T, G, di]; k_cache_l, v_cache_l: [P, G, ps, d]; index_cache_l: [P, ps, di] or an
    ``FP8IndexCache``; meta: prefill rows only (``meta.num_decodes == 0``, e.g.
    ``msa_fused_decode.prefill_part``). Returns [T, nh, d] in q.dtype: ``paged_attention(q, ...,
    index_topk(iq, ...))``, the same bits. scratch: ``paged_attention``'s KV-major buffer; sel_out:
    optional [T, G, K] integer tensor that receives the selection. window_tokens: tokens per score
    window (default ``SCORE_WINDOW_TOKENS``; a positive multiple of 64).
    Raises ValueError for decode rows in ``meta``, a bad window, or what ``index_topk`` /
    ``paged_attention`` raise.
    """
    # NOTE: imported at call time so the interpreter tests' reloaded modules (msa_interpret) are used.
    from m3_kernels.msa_index_topk import check_index_inputs, index_block_scores, index_topk, select_topk_blocks
    from m3_kernels.msa_paged_attention import paged_attention

    if meta.num_decodes:
        raise ValueError(f"sparse_prefill: meta has {meta.num_decodes} decode rows; pass its prefill part only")
    w = SCORE_WINDOW_TOKENS if window_tokens is None else window_tokens
    if w < 64 or w % 64:
        raise ValueError(f"sparse_prefill: window_tokens={w}; needs a positive multiple of 64 (the score tiles)")
    check_index_inputs(iq, index_cache_l, topk)
    t = q.shape[0]
    if not PIPELINE or t <= w:
        ids = index_topk(iq, index_cache_l, meta, topk, init_blocks, local_blocks)
        if sel_out is not None:
            sel_out.copy_(ids)
        return paged_attention(q, k_cache_l, v_cache_l, meta, scale, ids, scratch=scratch)
    g, nbp = iq.shape[1], meta.block_tables.shape[1]
    ps = split_index_cache(index_cache_l)[0].shape[1]
    scores = torch.empty(t, g, nbp, dtype=torch.float32, device=q.device)
    ids = torch.empty(t, g, topk, dtype=torch.int32, device=q.device)
    side = _side_stream(q.device) if q.is_cuda else None
    windows = [(lo, min(lo + w, t)) for lo in range(0, t, w)]
    scored = []  # per window: its event on the side stream (CUDA), or None
    if side is not None:
        side.wait_stream(torch.cuda.current_stream(q.device))  # fork: the inputs are ready
        if not torch.cuda.is_current_stream_capturing():  # (a graph's pool is not reused while it lives)
            for x in (scores, iq, *split_index_cache(index_cache_l)[:2]):  # not reused before the side stream is done
                if x is not None:
                    x.record_stream(side)
    with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
        for win in windows:
            index_block_scores(iq, index_cache_l, meta, window=win, out=scores)
            scored.append(side.record_event() if side is not None else None)
    done = 0  # the selection of tokens [0, done) is in ids

    def before_pass(t0: int, t1: int) -> None:
        nonlocal done
        if t1 <= done:
            return
        # every token < t1 lies in a tile whose first token is < t1: the windows starting below t1
        ev = scored[(t1 - 1) // w]
        if ev is not None:
            torch.cuda.current_stream(q.device).wait_event(ev)
        sub = dataclasses.replace(meta, positions=meta.positions[done:t1])  # select_topk_blocks reads positions
        select_topk_blocks(scores[done:t1], sub, topk, ps, init_blocks, local_blocks, out=ids[done:t1])
        done = t1

    out = paged_attention(q, k_cache_l, v_cache_l, meta, scale, ids, scratch=scratch, before_pass=before_pass)
    before_pass(0, t)  # every path calls it up to t; kept for a path that would not
    if side is not None:  # join: the caller's stream is ordered after every window (graph capture needs it)
        torch.cuda.current_stream(q.device).wait_event(scored[-1])
    if sel_out is not None:
        sel_out.copy_(ids)
    return out

"""Index block scores, value by value, against the PyTorch reference (spec §3.4), on CPU.

The selection tests elsewhere compare block ids, which hide two kinds of score error: the diagonal
block is always forced (local_blocks >= 1), so a causal-mask slip inside it never changes a
selection, and a positive factor common to a row's scores (the FP8 query scale) never changes an
order; with power-of-two scales, rows of one binade also hide a query scale taken per tile instead
of per row (so index head 1 is scaled down here). Here every written entry [t, g, b],
b <= pos(t) // ps, of the fast kernels (``msa_index_topk.index_block_scores``: decode split-K
launch and prefill tiles) and of the batch-invariant kernel
(``invariant_attention.invariant_index_scores``) is compared with the max over keys u <= pos(t) of
block b of <iq[t, g], ik[u]> (``reference_ops.index_block_scores_ref``, the scores
``index_topk_ref`` selects from), on fp32 keys and on the FP8 cache with and without query
quantization (dequantized keys / queries in the reference). Interpreter, tiny preset shapes
(tests/test_kernels_msa*.py), fp32 queries.
"""

from __future__ import annotations

import pytest
import torch

from m3_kernels.msa_interpret import interpreted_invariant_attention, interpreted_kernels
from m3_kernels.msa_synthetic import make_paged_batch
from m3_kernels.paged_layout import FP8IndexCache, quantize_index_keys
from m3_rollout.engine.reference_ops import index_block_scores_ref, unpad_queries

mi, _, _ = interpreted_kernels()
ia = interpreted_invariant_attention()

PS, G, NH, D = 16, 2, 8, 32
# decode rows at positions 40 and 300 (offsets 8 and 12 in their last block), then prefill rows:
# 12 tokens from 56 (across the block edge at 64) and 37 tokens from 0 (three blocks, every offset)
ROWS, DECODES = [(40, 1), (300, 1), (56, 12), (0, 37)], 2
CACHES = ["fp32", "fp8", "fp8_q"]


def reference_scores(iq: torch.Tensor, cache, meta) -> list[torch.Tensor]:
    """Per token t: [G, pos(t) // PS + 1], the reference's block maxima (``index_block_scores_ref``)."""
    scores, _ = index_block_scores_ref(iq, cache, meta)  # [R, G, Sq, nb], rows padded
    flat = unpad_queries(scores.permute(0, 2, 1, 3), meta)  # [T, G, nb]
    return [flat[t, :, : p // PS + 1] for t, p in enumerate(meta.positions.long().tolist())]


def batch_and_cache(kind: str):
    b = make_paged_batch(
        ROWS, DECODES, page_size=PS, kv_heads=G, q_heads=NH, head_dim=D, index_dim=D, dtype=torch.float32, seed=3
    )
    # index head 1 at ~1/30 of head 0's magnitude: the two rows of a (token, head) tile fall in other
    # power-of-two binades, so an FP8 query scale taken per tile instead of per row changes the codes
    b.iq[:, 1] *= 0.03
    cache = b.ik if kind == "fp32" else FP8IndexCache(*quantize_index_keys(b.ik), kind == "fp8_q")
    return b, cache


def assert_scores_match(got: torch.Tensor, want: list[torch.Tensor], what: str) -> None:
    for t, ref in enumerate(want):
        got_t = got[t, :, : ref.shape[1]]
        torch.testing.assert_close(got_t, ref, atol=1e-5, rtol=1e-5, msg=lambda m, t=t: f"{what}, token {t}: {m}")


@pytest.mark.parametrize("kind", CACHES)
def test_fast_index_scores_equal_reference_block_maxima(kind):
    b, cache = batch_and_cache(kind)
    want = reference_scores(b.iq, cache, b.meta)
    assert len(want) == 51 and max(w.shape[1] for w in want) == 19
    assert_scores_match(mi.index_block_scores(b.iq, cache, b.meta), want, f"index_block_scores ({kind})")


@pytest.mark.parametrize("kind", CACHES)
def test_invariant_index_scores_equal_reference_block_maxima(kind):
    b, cache = batch_and_cache(kind)
    scores, done = ia.invariant_index_scores(b.iq, cache, b.meta)
    assert done == 0  # no decode top-k asked for
    assert_scores_match(scores, reference_scores(b.iq, cache, b.meta), f"invariant_index_scores ({kind})")

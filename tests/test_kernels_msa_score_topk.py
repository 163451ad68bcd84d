"""Long-context MSA decode path ("score_topk": kernels/msa_score_topk.py + the candidate merge of
kernels/msa_fused_decode.py) vs the PyTorch references, on CPU under the Triton interpreter.

Tiny preset shapes (8 q heads / 2 KV heads / d 32 / block 16 / top-k 4). Checks: each score
program's list is exactly the top-k of its slice of blocks in the reference's order; the merged
selection equals ``index_topk_ref`` (ids, order, -1 padding) for several split counts (one block
per program up to one program per row), in the kernel's merge and in the PyTorch merge; exact
ties placed across program boundaries and more tied blocks in one program than k; forced init /
local blocks; rows with fewer blocks than k; rows of different lengths and decode_query_len 3 in
one launch; the attention output; the routing by block-table width. fp32 / fp16 only.
"""

from __future__ import annotations

import pytest
import torch

from m3_kernels.msa_interpret import interpreted_kernels, interpreted_module
from m3_kernels.msa_synthetic import make_paged_batch
from m3_rollout.engine.reference_ops import index_topk_ref, paged_attention_ref

md = interpreted_kernels().fused_decode  # sets TRITON_INTERPRET=1 and (re)loads the kernel modules
st = interpreted_module("m3_kernels.msa_score_topk")

PS, G, NH, D, K = 16, 2, 8, 32, 4
SCALE = D**-0.5
ATOL = {torch.float32: 2e-5, torch.float16: 3e-3}
# decode rows of different lengths: 700 (44 blocks), 40 (3 blocks < K), 300, 63 (block edge - 1), 64
ROWS = ([(700, 1), (40, 1), (300, 1), (63, 1), (64, 1)], 5)


def _batch(spec, dtype=torch.float32, seed=0, **kw):
    rows, nd = spec
    return make_paged_batch(
        rows, nd, page_size=PS, kv_heads=G, q_heads=NH, head_dim=D, index_dim=D, dtype=dtype, seed=seed, **kw
    )


def _decode_ids(b, splits=None, init_blocks=0, local_blocks=1, ids_dtype=torch.int32):
    """(ids, out) of the score_topk path with ``splits`` score programs per row."""
    nd = b.meta.num_decodes
    td = nd * b.meta.decode_query_len
    cands = st.decode_score_topk(b.iq, b.ik, b.meta, nd, K, init_blocks, local_blocks, splits=splits)
    ids = torch.full((td, G, K), -7, dtype=ids_dtype)
    out = md.decode_select_attend(b.q, b.k, b.v, b.meta, SCALE, K, cands=cands, ids_out=ids)
    return ids, out, cands


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_score_topk_path_matches_reference(dtype):
    b = _batch(ROWS, dtype)
    sel = index_topk_ref(b.iq, b.ik, b.meta, K)
    want = paged_attention_ref(b.q, b.k, b.v, b.meta, SCALE, sel)
    ids = torch.full((5, G, K), -7, dtype=torch.int32)
    got = md.msa_decode(b.q, b.iq, b.k, b.v, b.ik, b.meta, SCALE, K, ids_out=ids, decode_path="score_topk")
    assert torch.equal(ids, sel)  # same blocks, same order, -1 padding
    assert (ids[1] == -1).sum() == G * (K - 3)  # position 40: 3 candidate blocks
    torch.testing.assert_close(got.float(), want.float(), atol=ATOL[dtype], rtol=0)


@pytest.mark.parametrize("splits", [1, 3, 7, 44])
def test_every_split_count_merges_to_the_reference(splits):
    # 44 splits of the 44-block table: one block per program (lists mostly EMPTY); 1: one program per row.
    b = _batch(ROWS, seed=1)
    sel = index_topk_ref(b.iq, b.ik, b.meta, K)
    ids, got, (cand, bps) = _decode_ids(b, splits)
    assert cand.shape[2] == min(splits, 44) and torch.equal(ids, sel)
    assert torch.equal(st.candidate_block_ids(cand, bps, b.meta.positions, PS, K), sel)  # PyTorch merge
    torch.testing.assert_close(got, paged_attention_ref(b.q, b.k, b.v, b.meta, SCALE, sel), atol=2e-5, rtol=0)


def test_each_program_keeps_the_top_k_of_its_slice():
    # The full reference order (top-k = every block) restricted to a program's blocks: its first k
    # are the program's list (stored unsorted: compared as sets), EMPTY where the slice has fewer.
    b = _batch(ROWS, seed=2)
    nb = 44
    full = index_topk_ref(b.iq, b.ik, b.meta, nb, 1, 2)  # [T, G, nb] every candidate in order
    cand, bps = st.decode_score_topk(b.iq, b.ik, b.meta, 5, K, 1, 2, splits=6)
    assert bps == 8
    n_blk = b.meta.positions // PS + 1
    for t in range(5):
        for g in range(G):
            order = [x for x in full[t, g].tolist() if x >= 0]
            for s in range(cand.shape[2]):
                if s * bps >= n_blk[t]:
                    continue  # not written, not read
                want = [x for x in order if s * bps <= x < (s + 1) * bps][:K]
                keys = cand[t, g, s].tolist()
                got = [0x7FFFFFFF - (k & 0xFFFFFFFF) for k in keys if k != st.EMPTY_KEY]
                assert sorted(got) == sorted(want), (t, g, s)


def _tied_batch():
    # Row 0: position 300 (19 blocks), row 1: position 90 (6 blocks). Every key of block b equals c_b,
    # queries are small positive integers, so block scores are exact multiples of c_b (bitwise ties).
    b = _batch(([(300, 1), (90, 1)], 2), seed=3)
    c = torch.ones(19)
    c[[3, 4, 6, 7, 8, 9, 10, 12]] = 2.0  # the tied maxima straddle program boundaries
    for r in range(2):
        for blk in range(int(b.meta.positions[r]) // PS + 1):
            b.ik[int(b.meta.block_tables[r, blk])] = c[blk]
    b.iq.copy_(torch.arange(b.iq.numel(), dtype=torch.float32).view_as(b.iq) % 3 + 1)
    return b


@pytest.mark.parametrize("splits", [3, 5])
def test_exact_ties_across_program_boundaries(splits):
    # splits 3 (7 blocks each): five tied blocks (7..12) in one program, more than k; 5 (4 each): the
    # tied 3 | 4 straddle a boundary; ties go to the lower id, forced init 0 and local 18 first.
    b = _tied_batch()
    sel = index_topk_ref(b.iq, b.ik, b.meta, K, 1, 1)
    assert sel[0].tolist() == [[0, 18, 3, 4]] * G
    assert sel[1].tolist() == [[0, 5, 3, 4]] * G
    ids, got, _ = _decode_ids(b, splits, init_blocks=1, local_blocks=1)
    assert torch.equal(ids, sel)
    torch.testing.assert_close(got, paged_attention_ref(b.q, b.k, b.v, b.meta, SCALE, sel), atol=2e-5, rtol=0)
    # no forced init block: the tie among 3, 4, 6, 7, ... fills three slots
    ids, _, _ = _decode_ids(b, splits)
    assert ids[0].tolist() == [[18, 3, 4, 6]] * G
    assert torch.equal(ids, index_topk_ref(b.iq, b.ik, b.meta, K))


def test_all_scores_equal_and_nan_block():
    b = _batch(([(200, 1), (90, 1)], 2), seed=4)
    b.ik.fill_(1.0)
    b.iq.copy_(torch.arange(b.iq.numel(), dtype=torch.float32).view_as(b.iq) % 3)
    ids, _, _ = _decode_ids(b, 4)
    assert ids[0].tolist() == [[12, 0, 1, 2]] * G and ids[1].tolist() == [[5, 0, 1, 2]] * G
    c = _batch(([(300, 1)], 1), seed=7)
    c.ik[int(c.meta.block_tables[0, 3]), 5] = float("nan")  # block 3's score -> -1e30
    ids, _, _ = _decode_ids(c, 3)
    assert torch.equal(ids, index_topk_ref(c.iq, c.ik, c.meta, K)) and 3 not in ids.tolist()


def test_verify_rows_and_forced_blocks_in_one_launch():
    # decode_query_len 3: every token of a row has its own causal cut-off, forced blocks and merge;
    # the row's programs cover the longest token's blocks; rows of 61 / 300 / 16 tokens.
    b = _batch(([(61, 3), (300, 3), (16, 3), (20, 12)], 3), seed=5)
    sel = index_topk_ref(b.iq, b.ik, b.meta, K, 1, 2)
    for splits in (None, 5):
        ids, got, _ = _decode_ids(b, splits, init_blocks=1, local_blocks=2, ids_dtype=torch.int16)
        assert torch.equal(ids.int(), sel[:9])
        torch.testing.assert_close(got, paged_attention_ref(b.q, b.k, b.v, b.meta, SCALE, sel)[:9], atol=2e-5, rtol=0)
    assert sel[3, :, :3].tolist() == [[0, 17, 18]] * G  # position 300: init 0, locals 17 and 18 first


def test_routing_by_table_width():
    # Narrow tables: the rank path; from SCORE_TOPK_MIN_BLOCKS pages: LONG_DECODE_PATH; "rank" refused on
    # tables wider than MAX_FUSED_BLOCKS; the other long route stays callable and agrees (both at the real
    # widths: tests/test_kernels_msa_decode.py runs them on narrower tables with the limits lowered).
    assert md.select_decode_path(md.SCORE_TOPK_MIN_BLOCKS - 1) == "rank"
    assert md.select_decode_path(md.SCORE_TOPK_MIN_BLOCKS) == md.LONG_DECODE_PATH
    assert md.select_decode_path(md.SCORE_TOPK_MIN_BLOCKS, "score_topk") == "score_topk"
    with pytest.raises(ValueError, match="rank"):
        md.select_decode_path(md.MAX_FUSED_BLOCKS + 1, "rank")
    with pytest.raises(ValueError, match="decode_path"):
        md.select_decode_path(10, "fast")
    b = _batch(([(4200, 1), (33, 1)], 2), seed=6, table_width=300)  # 263 blocks, table of 300
    sel = index_topk_ref(b.iq, b.ik, b.meta, K)
    want = paged_attention_ref(b.q, b.k, b.v, b.meta, SCALE, sel)
    assert st.score_topk_splits(300, 2, K) == 32
    other = "score_topk" if md.LONG_DECODE_PATH == "index_topk" else "index_topk"
    for path in (None, other):
        ids = torch.full((2, G, K), -7, dtype=torch.int32)
        got = md.msa_decode(b.q, b.iq, b.k, b.v, b.ik, b.meta, SCALE, K, ids_out=ids, decode_path=path)
        assert torch.equal(ids, sel), path
        torch.testing.assert_close(got, want, atol=2e-5, rtol=0)


def test_split_policy(monkeypatch):
    # Powers of two, bounded by the program target, the merge size and 8 blocks per program.
    assert st.score_topk_splits(8192, 1, 16) == 256  # 1M context, one row: 32 blocks per program
    assert st.score_topk_splits(1024, 1, 16) == 128  # 128K: 8 blocks per program
    assert st.score_topk_splits(8192, 8, 16) == 32
    assert st.score_topk_splits(8192, 1, 64) == 64  # merge bound 4096 / 64
    assert st.score_topk_splits(5, 300, 4) == 1
    monkeypatch.setattr(st, "MAX_MERGE_CANDIDATES", 64)
    b = _batch(ROWS)
    with pytest.raises(ValueError, match="MAX_MERGE_CANDIDATES"):
        st.decode_score_topk(b.iq, b.ik, b.meta, 5, K, splits=44)

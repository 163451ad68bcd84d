"""Fused MSA decode path (kernels/msa_fused_decode.py) vs the PyTorch references, on CPU under the Triton
interpreter.

Tiny preset shapes (spec §7 A: 8 q heads / 2 KV heads / d 32 / block 16 / top-k 4): sparse beyond
64 tokens. Checks the in-register top-k (exact block ids and order of ``index_topk_ref``), the split
attention with the last-arrival merge, the long-context routes for wide block tables (score_topk by
default, tests/test_kernels_msa_score_topk.py in depth; index_topk when asked), decode_query_len > 1,
mixed decode + prefill steps through ``msa_attention``,
ties, and that a second call gives the same result (arrival counters re-armed to 0; CUDA-graph
replays rely on it). fp32 and fp16 only (the interpreter mishandles bf16).
"""

from __future__ import annotations

import pytest
import torch

from m3_kernels.msa_interpret import interpreted_kernels
from m3_kernels.msa_synthetic import make_paged_batch
from m3_rollout.engine.reference_ops import index_topk_ref, paged_attention_ref

md = interpreted_kernels().fused_decode  # sets TRITON_INTERPRET=1 and (re)loads the kernel modules

PS, G, NH, D, K = 16, 2, 8, 32, 4
SCALE = D**-0.5
# decode rows: 40 (<= K*B = 64, partial block: 3 candidates), 700 (sparse, partial), 63 (block
# edge - 1), 64 (first token of a new block); then prefill rows: 65 fresh tokens, a 30-token
# chunk after a 100-token prefix hit.
MIXED = ([(40, 1), (700, 1), (63, 1), (64, 1), (0, 33), (100, 9)], 4)
VERIFY = ([(61, 3), (300, 3), (16, 3), (20, 12)], 3)  # speculative verify rows + one prefill chunk
ATOL = {torch.float32: 2e-5, torch.float16: 3e-3}


def _batch(spec, dtype, seed=0, **kw):
    rows, nd = spec
    return make_paged_batch(
        rows, nd, page_size=PS, kv_heads=G, q_heads=NH, head_dim=D, index_dim=D, dtype=dtype, seed=seed, **kw
    )


def _reference(b, init_blocks=0, local_blocks=1):
    sel = index_topk_ref(b.iq, b.ik, b.meta, K, init_blocks, local_blocks)
    return sel, paged_attention_ref(b.q, b.k, b.v, b.meta, SCALE, sel)


def _decode(b, **kw):
    td = b.meta.num_decodes * b.meta.decode_query_len
    ids = torch.full((td, G, K), -7, dtype=torch.int32)
    out = md.msa_decode(b.q, b.iq, b.k, b.v, b.ik, b.meta, SCALE, K, ids_out=ids, **kw)
    return ids, out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_decode_matches_reference(dtype):
    b = _batch(MIXED, dtype)
    sel, want = _reference(b)
    ids, got = _decode(b)
    assert got.shape == (4, NH, D) and got.dtype == dtype
    assert torch.equal(ids, sel[:4])  # same blocks in the same order, -1 padding
    assert (ids[0] == -1).sum() == G * (K - 3)  # position 40 -> 3 candidate blocks
    torch.testing.assert_close(got.float(), want[:4].float(), atol=ATOL[dtype], rtol=0)


@pytest.mark.parametrize("splits", [1, 4])
def test_split_counts_and_repeat_calls_agree(splits):
    # Each split count merges differently (S = 1: no merge); the second call must equal the first
    # (the last-arriving split resets its arrival counter to 0).
    b = _batch(MIXED, torch.float32, seed=1)
    _, want = _reference(b)
    sc = md.decode_scores(b.iq, b.ik, b.meta, b.meta.num_decodes)
    first = md.decode_select_attend(b.q, b.k, b.v, b.meta, SCALE, K, scores=sc, splits=splits)
    second = md.decode_select_attend(b.q, b.k, b.v, b.meta, SCALE, K, scores=sc, splits=splits)
    torch.testing.assert_close(first, want[:4], atol=ATOL[torch.float32], rtol=0)
    assert torch.equal(first, second)
    assert int(md.arrival_counters(1, b.q.device).abs().sum()) == 0


def test_verify_rows_forced_init_and_local_blocks():
    # decode_query_len 3: every query position has its own causal cut-off and selection.
    b = _batch(VERIFY, torch.float32, seed=3)
    sel, want = _reference(b, init_blocks=1, local_blocks=2)
    ids, got = _decode(b, init_blocks=1, local_blocks=2)
    assert torch.equal(ids, sel[:9])
    assert ids[3, :, :3].tolist() == [[0, 17, 18]] * G  # position 300: init 0, locals 17 and 18 first
    torch.testing.assert_close(got, want[:9], atol=ATOL[torch.float32], rtol=0)


def test_ties_go_to_lower_block_id():
    # All index keys equal -> all block scores equal: own block, then the lowest ids.
    b = _batch(([(200, 1), (90, 1)], 2), torch.float32)
    b.ik.fill_(1.0)
    b.iq.copy_(torch.arange(b.iq.numel(), dtype=torch.float32).view_as(b.iq) % 3)
    ids, _ = _decode(b)
    assert ids[0].tolist() == [[12, 0, 1, 2]] * G  # position 200 -> own block 12
    assert ids[1].tolist() == [[5, 0, 1, 2]] * G
    assert torch.equal(ids, index_topk_ref(b.iq, b.ik, b.meta, K))


def test_nan_scores_rank_last():
    # A NaN index key poisons its block's score: the reference maps it to -1e30 (spec §3.4).
    b = _batch(([(300, 1)], 1), torch.float32, seed=7)
    page = int(b.meta.block_tables[0, 3])
    b.ik[page, 5] = float("nan")
    ids, _ = _decode(b)
    assert torch.equal(ids, index_topk_ref(b.iq, b.ik, b.meta, K))
    assert 3 not in ids.tolist()


@pytest.mark.parametrize("path", ["score_topk", "index_topk"])
@pytest.mark.parametrize("forced", [(0, 1), (1, 2)], ids=["local1", "init1_local2"])
def test_wide_table_routes(forced, path, monkeypatch):
    # Block table wider than MAX_FUSED_BLOCKS (lowered to 64 here: rows of 1100 tokens = 69 blocks of 16,
    # 33 (fewer blocks than k) and 700, table 80; the real widths run in
    # tests/test_kernels_msa_score_topk.py::test_routing_by_table_width): with
    # decode_path="score_topk" the score kernel keeps a top-k per program and the attention kernel merges
    # them; with "index_topk", index_topk's chunk lists (32-block chunks: three) are merged there. The fused
    # attention kernel attends and merges.
    monkeypatch.setattr(md, "MAX_FUSED_BLOCKS", 64)
    monkeypatch.setattr(interpreted_kernels().index_topk, "TOPK_CHUNK", 32)
    b = _batch(([(1100, 1), (33, 1), (700, 1)], 3), torch.float32, seed=5, table_width=80)
    sel, want = _reference(b, *forced)
    ids, got = _decode(b, init_blocks=forced[0], local_blocks=forced[1], decode_path=path)
    assert torch.equal(ids, sel)
    torch.testing.assert_close(got, want, atol=ATOL[torch.float32], rtol=0)


@pytest.mark.parametrize("path", ["score_topk", "index_topk"])
def test_verify_rows_through_the_wide_table_routes(monkeypatch, path):
    # The same routes for q_len 3 rows (forced here by a narrow MAX_FUSED_BLOCKS).
    monkeypatch.setattr(md, "MAX_FUSED_BLOCKS", 8)
    b = _batch(VERIFY, torch.float32, seed=6)
    sel, want = _reference(b)
    ids, got = _decode(b, decode_path=path)
    assert torch.equal(ids, sel[:9])
    torch.testing.assert_close(got, want[:9], atol=ATOL[torch.float32], rtol=0)


@pytest.mark.parametrize(
    ("merge", "topk"),
    [("attention_network", 3), ("attention_network", 4), ("attention_rounds", 3), ("merge_launch", 4), ("cap", 4)],
)
def test_index_topk_route_merges_chunk_winners(merge, topk, monkeypatch):
    # The index_topk route with 16-block chunks (5 chunk lists per row at 1100 tokens, table 80): the
    # attention kernel merges the chunk winners in its prologue (tl.topk network or rounds), or
    # index_topk's own merge launch picks first; same ids as the reference, ties across chunks (equal
    # keys on 40 pages, above every other block: they fill the free slots, lower ids first, across the
    # chunk edge at block 32) and a NaN block included; topk 3 < KP 4 (the lists' 4th key is a real
    # lower key). "cap": more chunk keys (8 lists x 4) than MAX_MERGE_CANDIDATES per (token, head) take
    # the merge launch.
    ksel = interpreted_kernels().index_topk
    monkeypatch.setattr(ksel, "TOPK_CHUNK", 16)
    if merge == "cap":
        monkeypatch.setattr(md.msa_score_topk, "MAX_MERGE_CANDIDATES", 16)
    sources = []
    attend = md.decode_select_attend
    monkeypatch.setattr(
        md, "decode_select_attend", lambda *a, **kw: (sources.append(kw.get("cands") is not None), attend(*a, **kw))[1]
    )
    monkeypatch.setattr(md, "INDEX_TOPK_MERGE_IN_ATTENTION", merge != "merge_launch")
    monkeypatch.setattr(md.msa_score_topk, "MERGE_NETWORK", merge == "attention_network")
    b = _batch(([(1100, 1), (33, 1), (600, 1)], 3), torch.float32, seed=9, table_width=80)
    for r in (0, 2):  # blocks 30..69 (row 2: 30..37) hold one key, along both heads' queries: equal maxima
        key = 8 * (b.iq[r, 0] / b.iq[r, 0].norm() + b.iq[r, 1] / b.iq[r, 1].norm())
        for j in range(40):
            if int(b.meta.block_tables[r, 30 + j]) >= 0:
                b.ik[int(b.meta.block_tables[r, 30 + j])] = key
    b.ik[int(b.meta.block_tables[0, 7]), 3] = float("nan")
    sel = index_topk_ref(b.iq, b.ik, b.meta, topk)
    want = paged_attention_ref(b.q, b.k, b.v, b.meta, SCALE, sel)
    ids = torch.full((3, G, topk), -7, dtype=torch.int32)
    got = md.msa_decode(b.q, b.iq, b.k, b.v, b.ik, b.meta, SCALE, topk, ids_out=ids, decode_path="index_topk")
    assert torch.equal(ids, sel)
    assert (sel[0] == 7).sum() == 0  # the NaN block lost; after the local block the tied ones, lower ids first
    assert sel[[0, 2], :, 1:].tolist() == [[list(range(30, 29 + topk))] * G] * 2
    assert sources == [merge.startswith("attention")]  # chunk lists merged in the attention kernel, or ids
    torch.testing.assert_close(got, want, atol=ATOL[torch.float32], rtol=0)


@pytest.mark.parametrize("spec", [MIXED, VERIFY], ids=["mixed", "verify_q3"])
def test_msa_attention_whole_step(spec):
    # Decode rows through the fused path, prefill rows through the prefill kernels.
    b = _batch(spec, torch.float16, seed=2)
    _, want = _reference(b)
    got = md.msa_attention(b.q, b.iq, b.k, b.v, b.ik, b.meta, SCALE, K)
    torch.testing.assert_close(got.float(), want.float(), atol=ATOL[torch.float16], rtol=0)


@pytest.mark.parametrize("wide", [False, True], ids=["fused", "wide_table"])
def test_msa_attention_writes_the_block_selection_record(wide, monkeypatch):
    # The engine's record: each sparse layer writes its [T, G, K] choice into an int16 view of
    # the step buffer [T, S, G, K] (stride S*G*K over tokens): the fused decode kernel from its
    # registers (rank path, or the candidate merge of the long-context path on wide tables), the
    # prefill rows index_topk's; same output. (The wide case: the decode rows only; their route is
    # all it changes.)
    if wide:
        monkeypatch.setattr(md, "MAX_FUSED_BLOCKS", 8)
    b = _batch((MIXED[0][:4], 4) if wide else MIXED, torch.float32, seed=7)
    sel, want = _reference(b)
    buf = torch.full((sel.shape[0] + 2, 3, G, K), -9, dtype=torch.int16)
    got = md.msa_attention(b.q, b.iq, b.k, b.v, b.ik, b.meta, SCALE, K, sel_out=buf[: sel.shape[0], 1])
    assert torch.equal(buf[: sel.shape[0], 1].int(), sel)
    assert (buf[:, 0] == -9).all() and (buf[:, 2] == -9).all() and (buf[sel.shape[0] :] == -9).all()
    torch.testing.assert_close(got, want, atol=ATOL[torch.float32], rtol=0)


def test_prefill_only_and_bad_inputs():
    b = _batch(([(0, 40), (20, 9)], 0), torch.float32, seed=4)
    _, want = _reference(b)
    torch.testing.assert_close(
        md.msa_attention(b.q, b.iq, b.k, b.v, b.ik, b.meta, SCALE, K), want, atol=ATOL[torch.float32], rtol=0
    )
    d = _batch(([(20, 1)], 1), torch.float32)
    with pytest.raises(ValueError, match="topk=65"):
        md.msa_decode(d.q, d.iq, d.k, d.v, d.ik, d.meta, SCALE, 65)
    with pytest.raises(ValueError, match="dtypes"):
        md.msa_decode(d.q, d.iq.half(), d.k, d.v, d.ik, d.meta, SCALE, K)
    with pytest.raises(ValueError, match="head_dim=24"):
        md.msa_decode(
            d.q[..., :24].contiguous(),
            d.iq,
            d.k[..., :24].contiguous(),
            d.v[..., :24].contiguous(),
            d.ik,
            d.meta,
            SCALE,
            K,
        )


def test_given_ids_are_a_set_duplicates_count_once():
    # decode_select_attend on a given selection (the wide-table route): a block id repeated at a later
    # slot is attended once, as paged_attention_ref treats the selection (a set); -1 stays empty.
    b = _batch(([(40, 1), (700, 1)], 2), torch.float32, seed=1)
    sel = index_topk_ref(b.iq, b.ik, b.meta, K)
    sel[1, 0, 3] = sel[1, 0, 0]  # long row: one slot repeats the first block
    sel[0, 1, 3] = sel[0, 1, 1]  # short row: the -1 pad replaced by a repeat
    sel[1, 1, 2] = -1
    want = paged_attention_ref(b.q, b.k, b.v, b.meta, SCALE, sel)
    got = md.decode_select_attend(b.q, b.k, b.v, b.meta, SCALE, K, topk_ids=sel)
    torch.testing.assert_close(got, want, atol=ATOL[torch.float32], rtol=0)
    # precondition: the reference treats the selection as a set (dropping the repeat changes nothing)
    once = sel.clone()
    once[1, 0, 3] = -1
    assert (paged_attention_ref(b.q, b.k, b.v, b.meta, SCALE, once)[1] - want[1]).abs().max() < 1e-6


def test_ids_out_rules_hold_on_every_route():
    # ids_out must be int16 / int32 with unit stride over K on every decode route (the narrow "rank"
    # table here), not only where the attention kernel stores it.
    b = _batch(([(200, 1), (90, 1)], 2), torch.float32)
    for bad in (torch.zeros(2, G, K, dtype=torch.int64), torch.zeros(2, K, G, dtype=torch.int32).transpose(1, 2)):
        for path in ("rank", "index_topk"):
            with pytest.raises(ValueError, match="ids_out"):
                md.msa_decode(b.q, b.iq, b.k, b.v, b.ik, b.meta, SCALE, K, ids_out=bad, decode_path=path)

"""MSA Triton kernels vs their PyTorch references, on CPU under the Triton interpreter.

Tiny preset shapes (spec §7 A: 8 q heads / 2 KV heads / d 32 / block 16 / top-k 4): sparse beyond
64 tokens. Batches mix decode and prefill rows of different lengths, partial last blocks,
contexts <= and > top_k x block, prefix-hit chunks and speculative-verify decode (q_len > 1).
fp32 and fp16 only (the interpreter mishandles bf16).
"""

from __future__ import annotations

import pytest
import torch

from m3_kernels.msa_interpret import interpreted_kernels
from m3_kernels.msa_synthetic import make_paged_batch
from m3_kernels.paged_layout import kv_major_token_bytes
from m3_rollout.engine.ops import bind_prefill_scratch
from m3_rollout.engine.reference_ops import index_topk_ref, paged_attention_ref
from m3_rollout.model.paged_ops import PagedOps

mi, ma, md = interpreted_kernels()

PS, G, NH, D, K = 16, 2, 8, 32, 4
SCALE = D**-0.5
# decode rows (q_len 1): 40 (<= K*B, partial block), 700 (sparse, partial), 63 (block edge - 1);
# prefill rows: 65 fresh tokens (crosses K*B), a 30-token chunk after a 100-token prefix hit.
MIXED = ([(40, 1), (700, 1), (63, 1), (0, 65), (100, 30)], 3)
# speculative verify: 3 decode rows of 3 query tokens each, then one prefill chunk (crosses K*B)
VERIFY = ([(61, 3), (300, 3), (16, 3), (50, 15)], 3)
# the KV-major prefill tests (their cost grows with prefill tokens and table width): two decode rows (the
# prefill part starts at an offset), a fresh 18-token row (short contexts: -1 entries; every token selects
# block 0: segments of several tiles) and a 12-token chunk after a 90-token prefix hit (sparse); both
# prefill rows cross a block edge.
KV_MIXED = ([(40, 1), (63, 1), (0, 18), (90, 12)], 2)
# fp16 tolerance: the kernel rounds softmax probabilities to fp16 for the PV dot (~2^-11 relative)
ATOL = {torch.float32: 2e-5, torch.float16: 3e-3}


def _batch(spec, dtype, seed=0, **kw):
    rows, nd = spec
    return make_paged_batch(
        rows, nd, page_size=PS, kv_heads=G, q_heads=NH, head_dim=D, index_dim=D, dtype=dtype, seed=seed, **kw
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_index_topk_matches_reference_mixed_batch(dtype):
    b = _batch(MIXED, dtype)
    want = index_topk_ref(b.iq, b.ik, b.meta, K)
    if dtype == torch.float32:
        got = mi.index_topk(b.iq, b.ik, b.meta, K)
    else:  # fp16 changes the score kernel's dots only: the selection kernel reads fp32 scores (run above)
        got = _select_from_scores(mi.index_block_scores(b.iq, b.ik, b.meta), b.meta.positions, K, 0, 1)
    assert got.dtype == torch.int32 and got.shape == want.shape == (b.meta.num_tokens, G, K)
    assert torch.equal(got, want)
    # sanity of the comparison itself: short contexts are padded, long ones are full
    assert (got[0] == -1).sum() == G * (K - 3)  # position 40 -> 3 candidate blocks
    assert (got[1] >= 0).all()


def test_index_topk_forced_init_local_and_verify_rows():
    b = _batch(VERIFY, torch.float32, seed=3)
    got = mi.index_topk(b.iq, b.ik, b.meta, K, init_blocks=1, local_blocks=2)
    want = index_topk_ref(b.iq, b.ik, b.meta, K, init_blocks=1, local_blocks=2)
    assert torch.equal(got, want)
    # token at position 300 (row 1, first query): forced init 0 then locals 17, 18 lead the list
    assert got[3, :, :3].tolist() == [[0, 17, 18]] * G


@pytest.mark.parametrize("network", [True, False], ids=["tl.topk", "rounds"])
def test_index_topk_ties_go_to_lower_block_id(network, monkeypatch):
    # Every index key equal -> every block score equal: the selection is forced local block, then
    # the lowest ids (independent expectation, exact integer arithmetic); the bitonic network and
    # the K rounds of max-and-remove alike.
    monkeypatch.setattr(mi, "TOPK_NETWORK", network)
    b = _batch(([(200, 1), (90, 1)], 2), torch.float32)
    b.ik.fill_(1.0)
    b.iq.copy_(torch.arange(b.iq.numel(), dtype=torch.float32).view_as(b.iq) % 3)
    got = mi.index_topk(b.iq, b.ik, b.meta, K)
    assert got[0].tolist() == [[12, 0, 1, 2]] * G  # position 200 -> own block 12
    assert got[1].tolist() == [[5, 0, 1, 2]] * G  # position 90 -> own block 5
    assert torch.equal(got, index_topk_ref(b.iq, b.ik, b.meta, K))


@pytest.mark.parametrize("network", [True, False], ids=["tl.topk", "rounds"])
def test_index_topk_split_k_chunks_and_wide_table(network, monkeypatch):
    # 600 context -> 38 blocks in 16-block chunks (TOPK_CHUNK lowered from 256; the kernels' chunk size is a
    # parameter, test_decode_topk_nan_scores_and_topk_not_a_power_of_two runs 256): the top-k runs in three
    # chunks plus the merge kernel; the block table is wider than any row (graph-style fixed width). Both
    # selection networks.
    monkeypatch.setattr(mi, "TOPK_NETWORK", network)
    monkeypatch.setattr(mi, "TOPK_CHUNK", 16)
    b = _batch(([(600, 1), (33, 1)], 2), torch.float32, seed=5, table_width=48)
    got = mi.index_topk(b.iq, b.ik, b.meta, K)
    assert torch.equal(got, index_topk_ref(b.iq, b.ik, b.meta, K))
    b.ik.fill_(1.0)  # all scores equal: ties across chunks go to the lower id in the merge too
    got = mi.index_topk(b.iq, b.ik, b.meta, K)
    assert got[0, 0].tolist() == [600 // 16, 0, 1, 2] and torch.equal(got, index_topk_ref(b.iq, b.ik, b.meta, K))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_sparse_attention_matches_reference_mixed_batch(dtype):
    b = _batch(MIXED, dtype, seed=1)
    sel = index_topk_ref(b.iq, b.ik, b.meta, K)
    got = ma.paged_attention(b.q, b.k, b.v, b.meta, SCALE, sel)
    want = paged_attention_ref(b.q, b.k, b.v, b.meta, SCALE, sel)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), atol=ATOL[dtype], rtol=0)
    if dtype != torch.float32:
        return
    # the selection is a set: a permuted list gives the same output (spec invariance 5)
    perm = sel[:, :, torch.tensor([2, 0, 3, 1])]
    torch.testing.assert_close(
        ma.paged_attention(b.q, b.k, b.v, b.meta, SCALE, perm).float(), want.float(), atol=ATOL[dtype], rtol=0
    )


def test_dense_attention_matches_reference_mixed_batch():
    b = _batch(MIXED, torch.float32, seed=2)
    got = ma.paged_attention(b.q, b.k, b.v, b.meta, SCALE, None)
    want = paged_attention_ref(b.q, b.k, b.v, b.meta, SCALE, None)
    torch.testing.assert_close(got, want, atol=ATOL[torch.float32], rtol=0)


def test_verify_decode_equals_prefill_and_reference():
    # q_len > 1 decode (each position its own cut-off and selection) vs the same tokens run as
    # prefill rows (num_decodes = 0) vs the reference.
    b = _batch(VERIFY, torch.float32, seed=4)
    sel = index_topk_ref(b.iq, b.ik, b.meta, K)
    dec = ma.paged_attention(b.q, b.k, b.v, b.meta, SCALE, sel)
    b.meta.num_decodes = 0
    pre = ma.paged_attention(b.q, b.k, b.v, b.meta, SCALE, sel)
    sel_pre = mi.index_topk(b.iq, b.ik, b.meta, K)
    b.meta.num_decodes = 3
    want = paged_attention_ref(b.q, b.k, b.v, b.meta, SCALE, sel)
    torch.testing.assert_close(dec, want, atol=2e-5, rtol=0)
    torch.testing.assert_close(pre, want, atol=2e-5, rtol=0)
    assert torch.equal(sel_pre, sel)
    assert torch.equal(mi.index_topk(b.iq, b.ik, b.meta, K), sel)


def test_prefill_tile_size_does_not_change_result():
    b = _batch(([(0, 37), (120, 21)], 0), torch.float32, seed=6)
    sel = index_topk_ref(b.iq, b.ik, b.meta, K)
    one = ma.paged_attention(b.q, b.k, b.v, b.meta, SCALE, sel, prefill_block_m=2)
    four = ma.paged_attention(b.q, b.k, b.v, b.meta, SCALE, sel, prefill_block_m=8)
    torch.testing.assert_close(one, four, atol=2e-6, rtol=0)
    torch.testing.assert_close(one, paged_attention_ref(b.q, b.k, b.v, b.meta, SCALE, sel), atol=2e-5, rtol=0)


def test_unsupported_sizes_raise_naming_the_size():
    b = _batch(([(20, 1)], 1), torch.float32)
    with pytest.raises(ValueError, match="head_dim=24"):
        ma.paged_attention(
            b.q[..., :24].contiguous(), b.k[..., :24].contiguous(), b.v[..., :24].contiguous(), b.meta, SCALE
        )
    with pytest.raises(ValueError, match="topk=65"):
        mi.index_topk(b.iq, b.ik, b.meta, 65)
    with pytest.raises(ValueError, match="page_size"):
        mi.index_topk(b.iq, b.ik[:, :12].contiguous(), b.meta, K)
    with pytest.raises(ValueError, match="dtype"):
        ma.paged_attention(b.q.double(), b.k.double(), b.v.double(), b.meta, SCALE)


def test_index_topk_prefill_score_variants(monkeypatch):
    # the GPU's causal-split score loop (unmasked blocks before the tile, masked diagonal; here with
    # two key sub-tiles per page) gives the reference selection; rows start mid-block and cross
    # block edges. (The plain masked loop is what the other tests run on CPU.)
    cfg = {"split_causal": True, "block_m": 4, "nsub": 2}
    b = _batch(([(0, 21), (37, 40)], 0), torch.float32, seed=7)
    got = mi.index_topk(b.iq, b.ik, b.meta, K, prefill_config=cfg)
    want = index_topk_ref(b.iq, b.ik, b.meta, K)
    assert torch.equal(got, want)
    # the multi-row top-k program (4 rows per program, rows cut mid-program: 61 tokens x 2 heads) selects the same
    scores = mi.index_block_scores(b.iq, b.ik, b.meta, cfg)
    monkeypatch.setattr(mi, "TOPK_ROWS_MIN", 0)  # this small batch takes the multi-row program too
    assert torch.equal(mi.select_topk_blocks(scores, b.meta, K, PS, rows_per_program=4), want)
    # page ids read as vectors of pvc blocks (chunks cut mid-row): every causal score keeps its bits
    causal = torch.arange(scores.shape[2]).view(1, 1, -1) <= (b.meta.positions // PS).view(-1, 1, 1)
    causal = causal.expand_as(scores)
    # ... and with other store tiles (store_b 1: each block's maxima stored at once), and with the key
    # sub-tiles read through a tensor descriptor (tma)
    variants = ({"pvc": 2}, {"pvc": 4}, {"store_b": 1}, {"store_b": 2, "pvc": 2}, {"store_b": 4, "nsub": 1})
    for extra in variants + ({"tma": True, "pvc": 2}, {"tma": True, "nsub": 1, "store_b": 1}):
        got_s = mi.index_block_scores(b.iq, b.ik, b.meta, {**cfg, **extra})
        assert torch.equal(got_s[causal], scores[causal]), extra
        assert torch.equal(mi.index_topk(b.iq, b.ik, b.meta, K, prefill_config={**cfg, **extra}), want)
    for bad in ({"store_b": 3}, {"store_b": 0}, {"pvc": 6}, {"pvc": -2}):
        with pytest.raises(ValueError, match=f"{next(iter(bad))}="):
            mi.index_block_scores(b.iq, b.ik, b.meta, {**cfg, **bad})


def test_chunk_top_k_pdl_flags_are_ignored_off_cuda():
    """topk_chunk_keys' launch-chaining flags (CUDA-only programmatic dependent launch) change
    nothing on the CPU: the interpreter would fail on griddepcontrol, so they must be dropped there."""
    b = _batch(([(90, 1), (40, 1)], 2), torch.float32, seed=4)
    scores = mi.index_block_scores(b.iq, b.ik, b.meta)
    plain, chunk = mi.topk_chunk_keys(scores, b.meta, K, PS, chunk=2)
    chained, _ = mi.topk_chunk_keys(scores, b.meta, K, PS, chunk=2, pdl=True, trigger=True)
    assert chunk == 2 and plain.shape[2] == scores.shape[2] // 2
    assert torch.equal(plain, chained)


def _select_from_scores(scores, positions, k, init_blocks, local_blocks):
    """Plain-Python selection from a score table (spec §3.4 order): forced blocks by id, then score desc, ties
    to the lower id, NaN as -1e30, -1 padding."""
    t_n, g_n, _ = scores.shape
    out = torch.full((t_n, g_n, k), -1, dtype=torch.int32)
    for t in range(t_n):
        n = int(positions[t]) // PS + 1
        for g in range(g_n):
            row = scores[t, g].tolist()

            def order(blk):
                if blk < init_blocks or blk >= n - local_blocks:
                    return (0, 0.0, blk)
                v = row[blk]
                return (1, 1e30 if v != v else -v, blk)

            picked = sorted(range(n), key=order)[:k]
            out[t, g, : len(picked)] = torch.tensor(picked, dtype=torch.int32)
    return out


def test_decode_scores_through_tma_descriptor_one_split(monkeypatch):
    # The CUDA decode launch reads keys through a TensorDescriptor (``decode_score_config``; forced
    # here, the interpreter runs descriptors). It must give the pointer loads' block maxima also when
    # the decode rows get one split: a one-page table (contexts < ps), or more decode rows than the
    # format's program count (here 4 programs; on the GPU bf16 264 // 133+ rows) -- one split used
    # to send the descriptor down the prefill-tile loop, which does pointer arithmetic on it.
    programs = [4]
    monkeypatch.setattr(
        mi, "decode_score_config", lambda iq, c: {"tma": True, "programs": programs[0], "num_warps": 4, "num_stages": 6}
    )
    for spec in (([(5, 1), (10, 1)], 2), ([(40, 3), (300, 3), (16, 3)], 3), ([(40, 1), (700, 1)], 2)):
        b = _batch(spec, torch.float16, seed=5)
        got = mi.index_block_scores(b.iq, b.ik, b.meta)
        programs[0] = 1 << 20  # and many splits
        many = mi.index_block_scores(b.iq, b.ik, b.meta)
        programs[0] = 4
        with monkeypatch.context() as m:
            m.setattr(mi, "decode_score_config", lambda iq, c: {})
            want = mi.index_block_scores(b.iq, b.ik, b.meta)
        causal = torch.arange(want.shape[2])[None, None, :] < (b.meta.positions.long() // PS + 1)[:, None, None]
        for x in (got, many):
            assert torch.equal(torch.where(causal, x, 0.0), torch.where(causal, want, 0.0)), spec


def test_tma_keys_need_contiguous_16_byte_aligned_pages():
    # A descriptor needs the [P * ps, di] view and a 16-byte aligned base (TensorDescriptor asserts
    # it): a contiguous keys view at an odd element offset must take the pointer loads.
    pool = torch.zeros(2 * 4 * PS * D + 1, dtype=torch.float16)
    assert mi.tma_keys_ok(pool[: 4 * PS * D].view(4, PS, D))
    assert not mi.tma_keys_ok(pool[1 : 1 + 4 * PS * D].view(4, PS, D))  # 2-byte offset
    assert not mi.tma_keys_ok(pool[: 8 * PS * D].view(8, PS, D)[::2])  # every other page
    assert not mi.tma_keys_ok(pool[: 4 * PS * 2 * D].view(4, PS, 2 * D)[:, :, :D])  # padded rows


def test_topk_rows_kernel_size_tiers_ties_and_nan(monkeypatch):
    # the prefill top-k program sizes its key tile to its rows' causal candidates (1/8, 1/4, 1/2 or the whole
    # chunk of 64 blocks here: a 44-page table); exact ties, -0.0 vs 0.0 and a NaN score keep the reference
    # order. Scores are given (the select kernel reads only them and the positions): tokens at both sides of
    # every tile boundary (9 / 17 / 33 blocks need the next tile: its last block is a forced local one), a
    # longer row after a shorter one, and 17 tokens (the last 4-row program is cut in half).
    pos = torch.tensor([5, 40, 63, 64, 100, 127, 128, 200, 255, 256, 400, 511, 512, 600, 699, 300, 339])
    meta = type("Meta", (), {"positions": pos.to(torch.int32)})()
    g = torch.Generator().manual_seed(11)
    scores = torch.randn(len(pos), G, 44, generator=g)  # entries past a token's blocks too: never read
    scores[:, 0, 3] = scores[:, 0, 9] = 10.0  # head 0: exact ties between blocks 3 and 9 on top
    scores[:, 1] = -scores[:, 1].abs() - 0.5  # head 1: -0.0 (block 5) and 0.0 (block 6) on top: equal
    scores[:, 1, 5] = -0.0
    scores[:, 1, 6] = 0.0
    scores[4:, 1, 2] = float("nan")  # above every score if not read as -1e30
    monkeypatch.setattr(mi, "TOPK_ROWS_MIN", 0)
    for init, local in ((1, 2), (0, 1)):
        want = _select_from_scores(scores, pos, K, init, local)
        assert (want[0] == -1).any() and (want[-1] >= 0).all()  # short rows pad, long rows are full
        for rows in (2, 4):
            got = mi.select_topk_blocks(
                scores, meta, K, PS, init_blocks=init, local_blocks=local, rows_per_program=rows
            )
            assert torch.equal(got, want), (init, local, rows)
    # position 339 (22 blocks), local block 21 first: ties to the lower id, -0.0 == 0.0, the NaN block last
    assert want[-1, :, :3].tolist() == [[21, 3, 9], [21, 5, 6]]


@pytest.mark.parametrize("network", [True, False], ids=["tl.topk", "rounds"])
def test_decode_topk_nan_scores_and_topk_not_a_power_of_two(network, monkeypatch):
    # Decode-sized selection (chunk kernel, one chunk of 64 blocks and two chunks of 256 + merge):
    # a NaN block score counts as -1e30 (spec §3.4; it must not outrank the forced local block),
    # K = 3 / 5 / 12 (the network sorts next_pow2(K) keys and stores the first K), init and
    # several local blocks, -inf scores and exact ties across chunks; the same ids as the
    # plain-Python selection, the bitonic network and the rounds alike.
    monkeypatch.setattr(mi, "TOPK_NETWORK", network)
    g = torch.Generator().manual_seed(7)
    for nbp, positions in ((40, [600, 5, 100, 639]), (300, [4700, 40, 3000])):
        pos = torch.tensor(positions, dtype=torch.int32)
        meta = type("Meta", (), {"positions": pos})()
        scores = torch.randn(len(positions), G, nbp, generator=g)
        scores[..., 7] = float("nan")
        scores[..., 11::5] = float("-inf")
        scores[..., nbp - 20 :] = scores[..., 2:22]  # exact ties (across the two chunks at 300)
        for k, init, local in ((3, 0, 1), (5, 1, 2), (12, 2, 3)):
            want = _select_from_scores(scores, pos, k, init, local)
            got = mi.select_topk_blocks(scores, meta, k, PS, init_blocks=init, local_blocks=local)
            assert torch.equal(got, want), (nbp, k)


@pytest.mark.parametrize("network", [True, False], ids=["tl.topk", "rounds"])
def test_decode_topk_of_one_block(network, monkeypatch):
    # K = 1 (check_index_inputs allows 1..64): tl.topk(x, 1) reduces its hypercube to a scalar and
    # fails to build (triton 3.6 sort_impl; a front-end error, the GPU's too), so K = 1 takes the
    # one round. One chunk of 2 and of 64 blocks, two chunks + merge; local_blocks 0 and 1.
    monkeypatch.setattr(mi, "TOPK_NETWORK", network)
    g = torch.Generator().manual_seed(3)
    for nbp, positions in ((2, [20, 3]), (40, [600, 100]), (300, [4700, 40])):
        pos = torch.tensor(positions, dtype=torch.int32)
        meta = type("Meta", (), {"positions": pos})()
        scores = torch.randn(len(positions), G, nbp, generator=g)
        for local in (0, 1):
            got = mi.select_topk_blocks(scores, meta, 1, PS, local_blocks=local)
            assert torch.equal(got, _select_from_scores(scores, pos, 1, 0, local)), (nbp, local)


def test_prefill_union_kernel_lists_and_masks():
    # the per-tile union list: sorted distinct valid blocks, bit i = tile token i selected it;
    # invalid entries (-1, > own block) are dropped. Expectation built in plain Python.
    b = _batch(([(0, 40), (50, 9)], 0), torch.float32, seed=8)
    sel = index_topk_ref(b.iq, b.ik, b.meta, K)
    sel[5, 0, 1] = 2  # token at position 5: block 2 lies after its own block 0 -> dropped
    bm, n_qtiles = 4, 10
    nt = b.meta.num_rows * n_qtiles
    ulist = torch.full((nt * G * bm * K,), -7, dtype=torch.int32)
    umask, upage = torch.zeros_like(ulist), torch.zeros_like(ulist)
    ucount = torch.zeros(nt * G, dtype=torch.int32)
    bt = b.meta.block_tables
    ma.tile_union_kernel[(nt, G)](
        sel,
        b.meta.query_start_loc,
        b.meta.positions,
        bt,
        ulist,
        umask,
        upage,
        ucount,
        0,
        n_qtiles,
        K,
        sel.stride(0),
        sel.stride(1),
        bt.stride(0),
        PS=PS,
        BLOCK_M=bm,
        KP=K,
    )
    qsl, pos = b.meta.query_start_loc.tolist(), b.meta.positions.tolist()
    for r in range(2):
        for qt in range(n_qtiles):
            toks = [t for t in range(qsl[r] + qt * bm, qsl[r] + qt * bm + bm) if t < qsl[r + 1]]
            for g in range(G):
                slot = (r * n_qtiles + qt) * G + g
                want = {}
                for i, t in enumerate(toks):
                    for blk in sel[t, g].tolist():
                        if 0 <= blk <= pos[t] // PS:
                            want[blk] = want.get(blk, 0) | (1 << i)
                n = int(ucount[slot])
                assert n == len(want)
                got_l = ulist[slot * bm * K : slot * bm * K + n].tolist()
                assert got_l == sorted(want)
                assert umask[slot * bm * K : slot * bm * K + n].tolist() == [want[x] for x in got_l]
                assert upage[slot * bm * K : slot * bm * K + n].tolist() == [int(bt[r, x]) for x in got_l]


@pytest.mark.parametrize(
    "dtype,cfg",
    [
        (torch.float32, {"seg": 8, "tok": 2}),
        (torch.float16, {}),
        (torch.float32, {"seg": 4, "prefetch": False}),
        (torch.float32, {"seg": 8, "tok": 2, "prefetch": "pipeline"}),
        (torch.float16, {"prefetch": "pipeline"}),
        # a segment length that is not a power of two, on the 16-bit default (deferred) loop
        (torch.float16, {"seg": 6, "tok": 2}),
        (torch.float32, {"seg": 5, "prefetch": "pipeline"}),
        (torch.float32, {"seg": 5, "tok": 2, "prefetch": "deferred"}),
    ],
)
def test_kv_major_prefill_matches_reference(dtype, cfg):
    # KV-major prefill (bucketed entries, per-page partials, LSE merge) over mixed decode + prefill
    # rows, with token chunks smaller than the prefill part (two chunks) and a duplicated entry.
    b = _batch(KV_MIXED, dtype, seed=9)
    sel = index_topk_ref(b.iq, b.ik, b.meta, K)
    sel[25, 1, 3] = sel[25, 1, 0]  # duplicate block in one token's list (position 95: 4 blocks): still a set
    want = paged_attention_ref(b.q, b.k, b.v, b.meta, SCALE, sel)
    got = ma.paged_attention(b.q, b.k, b.v, b.meta, SCALE, sel, prefill_config={"impl": "kv", "kv_chunk": 16, **cfg})
    torch.testing.assert_close(got.float(), want.float(), atol=ATOL[dtype], rtol=0)


def test_kv_major_step_index_is_built_once_per_step_and_not_carried_by_replace():
    """The KV-major prefill's per-step index tensors (bucket -> page, each prefill token's row and
    own block) go into ``meta.memo`` on the first sparse layer and are reused, not rebuilt, by the
    next (same objects); a second layer (other q / selection) on the same meta gives the bits of a
    call on a fresh meta; ``dataclasses.replace`` (another step's meta) starts with an empty memo."""
    import dataclasses

    b = _batch(KV_MIXED, torch.float32, seed=5)
    sel = index_topk_ref(b.iq, b.ik, b.meta, K)
    cfg = {"impl": "kv", "kv_chunk": 16}
    assert not b.meta.memo
    ma.paged_attention(b.q, b.k, b.v, b.meta, SCALE, sel, prefill_config=cfg)
    (key,) = [k for k in b.meta.memo if k[0] == "kv_major"]
    built = b.meta.memo[key]
    q2 = torch.flip(b.q, dims=[0]).contiguous()  # another layer's queries and selection
    sel2 = torch.flip(sel, dims=[2]).contiguous()
    got = ma.paged_attention(q2, b.k, b.v, b.meta, SCALE, sel2, prefill_config=cfg)
    assert all(x is y for x, y in zip(b.meta.memo[key], built, strict=True))
    fresh = dataclasses.replace(b.meta)
    assert not fresh.memo
    assert torch.equal(got, ma.paged_attention(q2, b.k, b.v, fresh, SCALE, sel2, prefill_config=cfg))
    want = paged_attention_ref(q2, b.k, b.v, b.meta, SCALE, sel2)
    torch.testing.assert_close(got, want, atol=ATOL[torch.float32], rtol=0)


def test_kv_major_step_index_follows_the_rows_and_ignores_spare_table_rows():
    """The memo's key holds every size its tensors are built from: the same meta run again with
    its decode rows counted as prefill rows (``num_decodes`` changed in place, as the verify test
    does) gets new tensors and the reference's output; a block table with spare rows past the
    step's rows (which the invariant kernels accept) gives the bits of the exact table."""
    import dataclasses

    cfg = {"impl": "kv", "kv_chunk": 16}
    b = _batch(KV_MIXED, torch.float32, seed=5)
    sel = index_topk_ref(b.iq, b.ik, b.meta, K)
    first = ma.paged_attention(b.q, b.k, b.v, b.meta, SCALE, sel, prefill_config=cfg)
    bt = b.meta.block_tables
    spare = dataclasses.replace(b.meta, block_tables=torch.cat([bt, torch.full((3, bt.shape[1]), -1, dtype=bt.dtype)]))
    assert torch.equal(ma.paged_attention(b.q, b.k, b.v, spare, SCALE, sel, prefill_config=cfg), first)
    b.meta.num_decodes = 0
    got = ma.paged_attention(b.q, b.k, b.v, b.meta, SCALE, sel, prefill_config=cfg)
    assert len([k for k in b.meta.memo if k[0] == "kv_major"]) == 2
    want = paged_attention_ref(b.q, b.k, b.v, b.meta, SCALE, sel)
    torch.testing.assert_close(got, want, atol=ATOL[torch.float32], rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kv_major_pipelined_and_deferred_loops_give_the_prefetching_loops_bits(dtype):
    # prefetch="pipeline" reads the segment's entry ids as vectors and gathers each tile's from them;
    # "deferred" also issues the next tile's QK dot before this tile's softmax. The tiles and their
    # dots are the prefetching loop's, so every output bit is the same. seg 7 = 3 tiles of 2 tokens
    # and one of 1: the look-ahead runs past the segment's end (a tile with no valid row).
    b = _batch(KV_MIXED, dtype, seed=4)
    sel = index_topk_ref(b.iq, b.ik, b.meta, K)
    cfg = {"impl": "kv", "kv_chunk": 16, "seg": 7, "tok": 2}
    base = ma.paged_attention(b.q, b.k, b.v, b.meta, SCALE, sel, prefill_config={**cfg, "prefetch": True})
    assert base.abs().sum() > 0
    for loop in ma.KV_SEG_LOOPS:
        got = ma.paged_attention(b.q, b.k, b.v, b.meta, SCALE, sel, prefill_config={**cfg, "prefetch": loop})
        assert torch.equal(base, got), loop


def test_decode_selection_is_a_set():
    # decode rows of paged_attention (split-K): a block id repeated at a later slot counts once, as in
    # the reference and the prefill paths (a double count moved outputs by ~0.2 before).
    b = _batch(([(40, 1), (700, 1)], 2), torch.float32, seed=1)
    sel = index_topk_ref(b.iq, b.ik, b.meta, K)
    sel[1, 0, 3] = sel[1, 0, 0]
    sel[0, 0, 3] = sel[0, 0, 0]  # replaces the -1 pad of the short row
    sel[0, 1, 1] = sel[0, 1, 2] = sel[0, 1, 0]
    got = ma.paged_attention(b.q, b.k, b.v, b.meta, SCALE, sel)
    torch.testing.assert_close(
        got, paged_attention_ref(b.q, b.k, b.v, b.meta, SCALE, sel), atol=ATOL[torch.float32], rtol=0
    )


def test_prefill_config_errors_name_the_knob_and_empty_prefill_rows_run():
    b = _batch(([(20, 1), (30, 0), (0, 40)], 1), torch.float32, seed=2)
    sel = index_topk_ref(b.iq, b.ik, b.meta, K)
    for bad, match in (
        ({"kv_chunk": 0}, "kv_chunk=0"),
        ({"seg": 0}, "seg=0"),
        ({"tok": 6}, "tok=6"),
        ({"impl": "dense"}, "impl='dense'"),
        ({"chunk": 4}, "unknown prefill_config key 'chunk'"),
        ({"prefetch": "deep"}, "prefetch='deep'"),
        ({"prefetch": 1}, "prefetch=1"),  # not True: it ran neither loop variant
    ):
        with pytest.raises(ValueError, match=match):
            ma.paged_attention(b.q, b.k, b.v, b.meta, SCALE, sel, prefill_config={"impl": "kv", **bad})
    with pytest.raises(ValueError, match="rows_per_program=3"):
        mi.select_topk_blocks(mi.index_block_scores(b.iq, b.ik, b.meta), b.meta, K, PS, rows_per_program=3)
    # a prefill row with no query tokens (between a decode row and a prefill row) on the KV-major path
    want = paged_attention_ref(b.q, b.k, b.v, b.meta, SCALE, sel)
    got = ma.paged_attention(b.q, b.k, b.v, b.meta, SCALE, sel, prefill_config={"impl": "kv"})
    torch.testing.assert_close(got, want, atol=ATOL[torch.float32], rtol=0)
    only_dec = _batch(([(20, 1), (30, 0)], 1), torch.float32, seed=2)
    sel_d = index_topk_ref(only_dec.iq, only_dec.ik, only_dec.meta, K)
    torch.testing.assert_close(
        ma.paged_attention(
            only_dec.q, only_dec.k, only_dec.v, only_dec.meta, SCALE, sel_d, prefill_config={"impl": "kv"}
        ),
        paged_attention_ref(only_dec.q, only_dec.k, only_dec.v, only_dec.meta, SCALE, sel_d),
        atol=ATOL[torch.float32],
        rtol=0,
    )


# ---- the KV-major path in a caller's scratch (the engine's buffer; kernels/paged_layout.py) ----
SENTINEL = 0x5A


def _scratch(tokens: int, dtype, extra: int = 0) -> torch.Tensor:
    """uint8 scratch holding ``tokens`` prefill tokens of a KV-major pass (+ ``extra`` bytes), sentinel-filled."""
    return torch.full((tokens * kv_major_token_bytes(NH, D, K, dtype) + extra,), SENTINEL, dtype=torch.uint8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kv_major_scratch_passes_equal_one_pass(dtype, monkeypatch):
    # The automatic path choice with the threshold lowered: 30 prefill tokens take the KV-major path.
    # A scratch of 8 tokens (4 passes) gives the output of one that holds every prefill token (1 pass)
    # within the module's tolerance (the interpreter's numpy dots may round a row differently at
    # another place in a tile: 1 ulp here); the same passes in the kernel's own per-call buffer (None,
    # or the kv_chunk knob) give it bit for bit; the passes write only the first capacity x
    # bytes-per-token of the scratch.
    monkeypatch.setattr(ma, "KV_MAJOR_MIN_TOKENS", 16)
    b = _batch(KV_MIXED, dtype, seed=9)
    sel = index_topk_ref(b.iq, b.ik, b.meta, K)
    tp = b.meta.num_tokens - b.meta.num_decodes
    assert tp == 30
    outs = {}
    for cap in (tp, 8):
        scratch = _scratch(cap, dtype, extra=64)
        outs[cap] = ma.paged_attention(b.q, b.k, b.v, b.meta, SCALE, sel, scratch=scratch)
        assert ma.kv_major_capacity(scratch, NH, D, K, dtype) == cap
        assert (scratch[:-64] != SENTINEL).any() and (scratch[-64:] == SENTINEL).all()
    assert torch.equal(ma.paged_attention(b.q, b.k, b.v, b.meta, SCALE, sel), outs[tp])  # one pass of its own
    assert torch.equal(ma.paged_attention(b.q, b.k, b.v, b.meta, SCALE, sel, prefill_config={"kv_chunk": 8}), outs[8])
    torch.testing.assert_close(outs[8].float(), outs[tp].float(), atol=ATOL[dtype], rtol=0)
    want = paged_attention_ref(b.q, b.k, b.v, b.meta, SCALE, sel)
    torch.testing.assert_close(outs[8].float(), want.float(), atol=ATOL[dtype], rtol=0)
    if dtype == torch.float32:  # a kv_chunk knob shorter than the scratch shortens the passes; a longer one is cut
        six = ma.paged_attention(b.q, b.k, b.v, b.meta, SCALE, sel, prefill_config={"kv_chunk": 6})
        for chunk, same in ((6, six), (1000, outs[8])):
            cfg, scratch = {"kv_chunk": chunk}, _scratch(8, dtype)
            got = ma.paged_attention(b.q, b.k, b.v, b.meta, SCALE, sel, prefill_config=cfg, scratch=scratch)
            assert torch.equal(got, same)
            # passes of 6 tokens leave the bytes past 6 tokens' partials untouched (here the same bits either way)
            assert (scratch[6 * kv_major_token_bytes(NH, D, K, dtype) :] != SENTINEL).any() == (chunk > 8)


def test_kv_major_scratch_that_holds_no_token_takes_union_tiles(monkeypatch):
    # An empty scratch (EngineConfig.msa_prefill_scratch_mb=0) turns the KV-major path off at every
    # length: the union-list tiles run; forcing impl="kv" into it is refused; a malformed scratch too.
    monkeypatch.setattr(ma, "KV_MAJOR_MIN_TOKENS", 16)
    b = _batch(KV_MIXED, torch.float32, seed=9)
    sel = index_topk_ref(b.iq, b.ik, b.meta, K)
    empty = torch.empty(0, dtype=torch.uint8)
    short = _scratch(0, torch.float32, extra=kv_major_token_bytes(NH, D, K, torch.float32) - 1)  # < one token
    union = ma.paged_attention(b.q, b.k, b.v, b.meta, SCALE, sel, prefill_config={"impl": "union"})
    for scratch in (empty, short):
        assert torch.equal(ma.paged_attention(b.q, b.k, b.v, b.meta, SCALE, sel, scratch=scratch), union)
    assert (short == SENTINEL).all()
    with pytest.raises(ValueError, match="holds no token of the KV-major path"):
        ma.paged_attention(b.q, b.k, b.v, b.meta, SCALE, sel, prefill_config={"impl": "kv"}, scratch=empty)
    for bad in (torch.empty(64, dtype=torch.float32), torch.empty(8, 8, dtype=torch.uint8)):
        with pytest.raises(ValueError, match="scratch must be a contiguous uint8 vector"):
            ma.paged_attention(b.q, b.k, b.v, b.meta, SCALE, sel, scratch=bad)
    torch.testing.assert_close(union, paged_attention_ref(b.q, b.k, b.v, b.meta, SCALE, sel), atol=2e-5, rtol=0)


def test_engine_table_binds_the_scratch_into_both_attention_ops(monkeypatch):
    # The engine's binding (engine/ops.py bind_prefill_scratch) over the Triton ops: msa_attention of a
    # mixed step (fused decode rows + KV-major prefill rows in passes of the bound scratch's 8 tokens)
    # equals the unbound call (one pass) and the reference; the dense op ignores the scratch.
    monkeypatch.setattr(ma, "KV_MAJOR_MIN_TOKENS", 16)
    ops = PagedOps(paged_attention=ma.paged_attention, msa_attention=md.msa_attention, takes_prefill_scratch=True)
    scratch = _scratch(8, torch.float32)
    bound = bind_prefill_scratch(ops, scratch)
    assert not bound.takes_prefill_scratch
    with pytest.raises(ValueError, match="take no scratch"):
        bind_prefill_scratch(bound, scratch)
    b = _batch(KV_MIXED, torch.float32, seed=4)
    got = bound.msa_attention(b.q, b.iq, b.k, b.v, b.ik, b.meta, SCALE, K)
    assert (scratch != SENTINEL).any()  # the prefill rows' passes ran in the bound buffer
    unbound = md.msa_attention(b.q, b.iq, b.k, b.v, b.ik, b.meta, SCALE, K)
    torch.testing.assert_close(got, unbound, atol=2e-5, rtol=0)
    sel = index_topk_ref(b.iq, b.ik, b.meta, K)
    torch.testing.assert_close(got, paged_attention_ref(b.q, b.k, b.v, b.meta, SCALE, sel), atol=2e-5, rtol=0)
    dense = bound.paged_attention(b.q, b.k, b.v, b.meta, SCALE, None)
    torch.testing.assert_close(dense, paged_attention_ref(b.q, b.k, b.v, b.meta, SCALE, None), atol=2e-5, rtol=0)

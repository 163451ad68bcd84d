"""MSA Triton kernels on a CUDA GPU at real M3 shapes (64 q heads / 4 KV heads / d 128 / block 128 /
top-k 16); skipped without CUDA.

Tolerances (stated):
- bf16 attention: max abs error vs the fp32-softmax PyTorch reference on the same bf16 inputs
  <= 2e-2 (outputs are convex combinations of N(0, 1) values, |out| < ~1; the kernel rounds the
  softmax probabilities to bf16 for the PV tensor-core dot, 2^-9 relative, plus the bf16 output
  rounding of 2^-9 relative on both sides).
- fp32 attention and scores: the kernels use ``input_precision="ieee"`` (no tf32), so fp32 outputs
  match to 1e-4.
- bf16 selection: scores are fp32 sums of exact bf16 products, so kernel and reference differ only
  by summation order; selections must be identical except at near-ties, where the block scores of
  the two choices differ by < 1e-3.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip(
        "TRITON_INTERPRET=1 in this process (CPU interpreter tests ran first); run tests/gpu alone",
        allow_module_level=True,
    )

from m3_kernels import msa_fused_decode, msa_index_topk, msa_paged_attention  # noqa: E402
from m3_kernels.msa_synthetic import make_paged_batch  # noqa: E402
from m3_rollout.engine.reference_ops import (  # noqa: E402
    gather_pages,
    index_topk_ref,
    pad_queries,
    paged_attention_ref,
    token_rows,
)
from m3_rollout.model.indexer import block_scores  # noqa: E402

PS, G, NH, D, K = 128, 4, 64, 128, 16
SCALE = D**-0.5
# decode rows: 1000 (<= K*B = 2048, partial block), 2048 edge, 9000; prefill: 2500 fresh tokens, a
# 300-token chunk after a 4096-token prefix hit (sizes bounded by the dense reference's memory).
MIXED = ([(999, 1), (2047, 1), (8999, 1), (0, 2500), (4096, 300)], 3)
VERIFY = ([(5000, 4), (130, 4), (20000, 4)], 3)


def _batch(spec, dtype, seed=0):
    rows, nd = spec
    return make_paged_batch(
        rows, nd, page_size=PS, kv_heads=G, q_heads=NH, head_dim=D, index_dim=D, dtype=dtype, device="cuda", seed=seed
    )


def _check_selection(b, got, want):
    """Equal, except near-ties whose scores differ by < 1e-3 (summation order)."""
    if torch.equal(got, want):
        return
    q, pos = pad_queries(b.iq, b.meta)
    scores = block_scores(q, gather_pages(b.ik, b.meta, head_axis=False), pos, PS)  # [R, G, Sq, nb]
    row, off = token_rows(b.meta)
    s = scores.permute(0, 2, 1, 3)[row, off]  # [T, G, nb]
    bad = (got != want).any(-1)  # [T, G]
    assert bad.float().mean() < 0.01, f"{int(bad.sum())} of {bad.numel()} selections differ"
    sg = s.gather(-1, got.long().clamp_min(0)).sort(-1).values
    sw = s.gather(-1, want.long().clamp_min(0)).sort(-1).values
    assert (sg - sw)[bad].abs().max() < 1e-3


@pytest.mark.parametrize("spec", [MIXED, VERIFY], ids=["mixed", "verify_q4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_index_topk_real_shapes(spec, dtype):
    b = _batch(spec, dtype)
    got = msa_index_topk.index_topk(b.iq, b.ik, b.meta, K)
    _check_selection(b, got, index_topk_ref(b.iq, b.ik, b.meta, K))


@pytest.mark.parametrize("spec", [MIXED, VERIFY], ids=["mixed", "verify_q4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_attention_real_shapes(spec, dtype):
    b = _batch(spec, dtype, seed=1)
    sel = index_topk_ref(b.iq, b.ik, b.meta, K)
    atol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    for ids in (sel, None):
        got = msa_paged_attention.paged_attention(b.q, b.k, b.v, b.meta, SCALE, ids)
        want = paged_attention_ref(b.q, b.k, b.v, b.meta, SCALE, ids)
        err = (got.float() - want.float()).abs().max().item()
        print(f"{dtype} {'sparse' if ids is not None else 'dense'} max abs err {err:.3e}")
        assert err <= atol


def test_decode_step_cuda_graph_replay():
    # Graph-safety: capture index_topk + paged_attention for a decode batch, then advance every
    # row's position in place (same pages) and replay; the replay equals a fresh eager call.
    b = _batch(([(6000, 1), (3000, 1), (70000, 1)], 3), torch.bfloat16, seed=2)
    m = b.meta

    def step():
        sel = msa_index_topk.index_topk(b.iq, b.ik, m, K)
        return sel, msa_paged_attention.paged_attention(b.q, b.k, b.v, m, SCALE, sel)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sel_g, out_g = step()
    m.positions.add_(10)
    m.seq_lens.add_(10)
    m.context_lens.add_(10)
    graph.replay()
    sel_e, out_e = step()
    torch.testing.assert_close(sel_g, sel_e, rtol=0, atol=0)
    torch.testing.assert_close(out_g, out_e, rtol=0, atol=0)


# ---- sparse prefill paths (kernels/msa_paged_attention.py): union-list tiles and KV-major buckets ----
PREFILL = ([(0, 2200), (5000, 260), (60, 700)], 0)


@pytest.mark.parametrize("impl", ["union", "kv"])
def test_sparse_prefill_paths_real_shapes(impl):
    # bf16 tolerance as above (the KV-major path also rounds each block's normalised partial output
    # to bf16 before the LSE merge: one more 2^-9 relative rounding of a convex combination).
    from m3_kernels.msa_paged_attention import paged_attention

    b = _batch(PREFILL, torch.bfloat16, seed=6)
    sel = index_topk_ref(b.iq, b.ik, b.meta, K)
    want = paged_attention_ref(b.q, b.k, b.v, b.meta, SCALE, sel).float()
    got = paged_attention(b.q, b.k, b.v, b.meta, SCALE, sel, prefill_config={"impl": impl, "kv_chunk": 1000})
    err = (got.float() - want).abs().max().item()
    print(f"prefill {impl}: max abs err {err:.3e}")
    assert err <= 2e-2


def test_kv_major_in_a_caller_scratch_real_shapes():
    # The engine's scratch (policy.generation.msa_prefill_scratch_mb): passes of the scratch's capacity.
    # A scratch of the kernel's own pass size gives its output bit for bit (the engine's default is
    # today's output); shorter passes stay within the bf16 tolerance (printed: whether bit-equal too);
    # with a scratch the call allocates no partial outputs (its peak beyond the output is the glue).
    from m3_kernels.msa_paged_attention import kv_major_capacity, paged_attention
    from m3_kernels.paged_layout import kv_major_token_bytes

    b = _batch(PREFILL, torch.bfloat16, seed=6)
    sel = index_topk_ref(b.iq, b.ik, b.meta, K)
    tp = b.meta.num_tokens  # 3160 prefill tokens
    per = kv_major_token_bytes(NH, D, K, torch.bfloat16)
    assert per == 266240
    want = paged_attention_ref(b.q, b.k, b.v, b.meta, SCALE, sel).float()
    own = paged_attention(b.q, b.k, b.v, b.meta, SCALE, sel, prefill_config={"impl": "kv"})  # one pass of its own
    for cap in (tp, 1024, 256):
        scratch = torch.empty(cap * per, dtype=torch.uint8, device="cuda")
        assert kv_major_capacity(scratch, NH, D, K, torch.bfloat16) == cap
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        got = paged_attention(b.q, b.k, b.v, b.meta, SCALE, sel, prefill_config={"impl": "kv"}, scratch=scratch)
        torch.cuda.synchronize()
        extra = torch.cuda.max_memory_allocated() - base - got.numel() * got.element_size()
        mine = paged_attention(b.q, b.k, b.v, b.meta, SCALE, sel, prefill_config={"impl": "kv", "kv_chunk": cap})
        assert torch.equal(got, mine)  # the same passes in the kernel's own buffer
        err = (got.float() - want).abs().max().item()
        print(
            f"scratch of {cap} tokens: bit-equal to one pass {torch.equal(got, own)}, max abs err {err:.3e}, "
            f"peak beyond the output {extra / 2**20:.1f} MiB (a pass's partials: {cap * per / 2**20:.1f} MiB)"
        )
        assert err <= 2e-2 and extra < 0.1 * cap * per
        if cap == tp:
            assert torch.equal(got, own)


@pytest.mark.skipif(torch.cuda.get_device_capability()[0] != 9, reason="the Gluon segment kernel is for sm_90")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("spec", [PREFILL, ([(0, 20000)], 0)], ids=["mixed", "20k"])
def test_kv_segment_sm90_equals_the_triton_segment_loop(spec, dtype):
    # kernels/msa_kv_segment_sm90.py runs the Triton segment loop's ops on the same MMA layouts (QK
    # and PV as m64n128k16 wgmma, the same reductions), only reordered in time: the same bits.
    from m3_kernels.msa_paged_attention import paged_attention

    b = _batch(spec, dtype, seed=8)
    sel = index_topk_ref(b.iq, b.ik, b.meta, K)
    tri = paged_attention(b.q, b.k, b.v, b.meta, SCALE, sel, prefill_config={"impl": "kv", "prefetch": "deferred"})
    glu = paged_attention(b.q, b.k, b.v, b.meta, SCALE, sel, prefill_config={"impl": "kv", "prefetch": "sm90"})
    diff = (glu.float() - tri.float()).abs()
    print(f"sm90 vs deferred: {(glu != tri).float().mean().item():.2e} of outputs differ, max {diff.max().item():.3e}")
    assert torch.equal(glu, tri)


@pytest.mark.parametrize("impl", ["union", "kv"])
def test_sparse_prefill_cuda_graph_replay(impl):
    # indexer + sparse prefill captured once; new query / index-query contents written in place,
    # replayed: equals a fresh eager call (no host syncs, fixed grids).
    from m3_kernels.msa_index_topk import index_topk
    from m3_kernels.msa_paged_attention import paged_attention

    b = _batch(([(0, 1500), (3000, 400)], 0), torch.bfloat16, seed=7)

    def step():
        sel = index_topk(b.iq, b.ik, b.meta, K)
        return paged_attention(b.q, b.k, b.v, b.meta, SCALE, sel, prefill_config={"impl": impl})

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_g = step()
    b.q.copy_(torch.randn_like(b.q))
    b.iq.copy_(torch.randn_like(b.iq))
    graph.replay()
    torch.testing.assert_close(out_g, step(), rtol=0, atol=0)


def test_dense_prefill_past_2_31_query_elements_equals_the_sequence_alone():
    # 272 sequences x 1,024 tokens = 278,528 prefill tokens: the last query row starts at element
    # 278,527 x 64 x 128 > 2**31, so an int32 token x row-stride offset wraps (before the int64 offsets:
    # a CUDA error). The last sequence's rows equal that sequence run alone (the same pages).
    import dataclasses

    from m3_kernels.msa_paged_attention import paged_attention

    n, length = 272, 1024
    b = make_paged_batch(
        [(0, length)] * n, 0, page_size=PS, kv_heads=G, q_heads=NH, head_dim=D, index_dim=D,
        dtype=torch.bfloat16, device="cuda", seed=1,
    )  # fmt: skip
    assert (b.meta.num_tokens - 1) * NH * D > 2**31
    out = paged_attention(b.q, b.k, b.v, b.meta, SCALE)
    one = make_paged_batch(
        [(0, length)], 0, page_size=PS, kv_heads=G, q_heads=NH, head_dim=D, index_dim=D, dtype=torch.bfloat16,
        device="cuda", seed=1,
    )  # fmt: skip
    last = dataclasses.replace(one.meta, block_tables=b.meta.block_tables[-1:])  # the last sequence's pages
    alone = paged_attention(b.q[-length:].contiguous(), b.k, b.v, last, SCALE)
    assert torch.equal(out[-length:], alone)
    assert torch.isfinite(out).all()


# ---- fused decode path (kernels/msa_fused_decode.py) through msa_fused_decode.msa_attention ----

WIDE = ([(40000, 1), (3000, 1)], 2)  # block table of 313 pages > MAX_FUSED_BLOCKS: the long-context path
LONG_PATHS = ["index_topk", "score_topk"]  # LONG_DECODE_PATH: the default, and the fused one still being measured


@pytest.mark.parametrize("long_path", LONG_PATHS)
@pytest.mark.parametrize("spec", [MIXED, VERIFY, WIDE], ids=["mixed", "verify_q4", "wide_table"])
def test_msa_attention_fused_decode_real_shapes(spec, long_path, monkeypatch):
    # Selection: same rule as test_index_topk_real_shapes; output vs the reference on the reference's
    # own selection (bf16 tolerance above), and a repeated call is bit-identical (counters re-armed).
    monkeypatch.setattr(msa_fused_decode, "LONG_DECODE_PATH", long_path)
    b = _batch(spec, torch.bfloat16, seed=3)
    td = b.meta.num_decodes * b.meta.decode_query_len
    sel = index_topk_ref(b.iq, b.ik, b.meta, K)
    ids = torch.full((td, G, K), -7, dtype=torch.int32, device="cuda")
    dec = msa_fused_decode.msa_decode(b.q, b.iq, b.k, b.v, b.ik, b.meta, SCALE, K, ids_out=ids)
    dmeta = msa_fused_decode.decode_part(b.meta)
    # selections compared as sets (near-tie rule of _check_selection)
    ids_set, sel_set = ids.sort(-1).values, sel[:td].sort(-1).values
    _check_selection(_DecodeView(b, dmeta, td), ids_set, sel_set)
    want = paged_attention_ref(b.q, b.k, b.v, b.meta, SCALE, sel)
    if torch.equal(ids_set, sel_set):
        assert (dec.float() - want[:td].float()).abs().max().item() <= 2e-2
    got = msa_fused_decode.msa_attention(b.q, b.iq, b.k, b.v, b.ik, b.meta, SCALE, K)
    same_sel = paged_attention_ref(b.q, b.k, b.v, b.meta, SCALE, torch.cat([ids, sel[td:]]))
    err = (got.float() - same_sel.float()).abs().max().item()
    print(f"msa_attention {spec[0][:2]}: max abs err {err:.3e}")
    assert err <= 2e-2
    assert torch.equal(got, msa_fused_decode.msa_attention(b.q, b.iq, b.k, b.v, b.ik, b.meta, SCALE, K))


class _DecodeView:
    """The decode rows of a batch, shaped like a batch for ``_check_selection``."""

    def __init__(self, b, meta, td):
        self.iq, self.ik, self.meta = b.iq[:td], b.ik, meta


@pytest.mark.parametrize("long_path", LONG_PATHS)
def test_msa_attention_cuda_graph_replay(long_path, monkeypatch):
    # Capture the engine's sparse-layer call for a decode batch, advance every row in place and
    # replay (twice: counters re-armed in the graph); the replay equals a fresh eager call.
    monkeypatch.setattr(msa_fused_decode, "LONG_DECODE_PATH", long_path)
    b = _batch(([(6000, 1), (3000, 1), (70000, 1)], 3), torch.bfloat16, seed=2)
    b2 = _batch(([(6000, 1), (3000, 1), (7000, 1)], 3), torch.bfloat16, seed=5)
    assert msa_fused_decode.select_decode_path(b.meta.block_tables.shape[1]) == long_path
    assert msa_fused_decode.select_decode_path(b2.meta.block_tables.shape[1]) == "rank"
    for bb in (b, b2):  # wide table (long_path) and short table (rank route)
        m = bb.meta

        def step():
            return msa_fused_decode.msa_attention(bb.q, bb.iq, bb.k, bb.v, bb.ik, m, SCALE, K)

        step()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out_g = step()
        m.positions.add_(10)
        m.seq_lens.add_(10)
        m.context_lens.add_(10)
        graph.replay()
        graph.replay()
        torch.testing.assert_close(out_g, step(), rtol=0, atol=0)


# ---- long-context decode path "score_topk" (kernels/msa_score_topk.py: score + top-k per program,
# candidate merge in the attention kernel) ----
# rows of different lengths in one launch (300K, 40K, 3K, 130 tokens: 2,344-page table, 256 score programs
# per row), 16 rows of 40K (16 programs per row), verify rows (q_len 4) with forced init + local blocks
LONG = ([(300000, 1), (40000, 1), (3000, 1), (130, 1)], 4)
MANY = ([(40000 + 997 * i, 1) for i in range(16)], 16)
LONG_VERIFY = ([(200000, 4), (5000, 4)], 2)


@pytest.mark.parametrize(
    ("spec", "forced"), [(LONG, (0, 1)), (MANY, (0, 1)), (LONG_VERIFY, (1, 2))], ids=["long", "many", "verify_q4"]
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_score_topk_decode_real_shapes(spec, forced, dtype, monkeypatch):
    # Selection vs the reference (near-tie rule of _check_selection) and vs index_topk on the same keys
    # (same rule; equality printed); output vs the reference on the path's own selection (bf16 2e-2,
    # fp32 1e-4); a repeated call is bit-identical (arrival counters re-armed).
    monkeypatch.setattr(msa_fused_decode, "LONG_DECODE_PATH", "score_topk")  # not the default yet (bench_msa)
    b = _batch(spec, dtype, seed=4)
    td = b.meta.num_decodes * b.meta.decode_query_len
    assert msa_fused_decode.select_decode_path(b.meta.block_tables.shape[1]) == "score_topk"
    want = index_topk_ref(b.iq, b.ik, b.meta, K, *forced)
    tri = msa_index_topk.index_topk(b.iq, b.ik, b.meta, K, *forced)
    ids = torch.full((td, G, K), -7, dtype=torch.int32, device="cuda")

    def run():
        return msa_fused_decode.msa_decode(b.q, b.iq, b.k, b.v, b.ik, b.meta, SCALE, K, *forced, ids_out=ids)

    out = run()
    same = (torch.equal(ids, tri), torch.equal(ids, want))
    print(f"score_topk {dtype} {spec[0][:2]}: ids == index_topk {same[0]}, == reference {same[1]}")
    _check_selection(b, ids, want)
    _check_selection(b, ids, tri)
    ref = paged_attention_ref(b.q, b.k, b.v, b.meta, SCALE, ids)
    err = (out.float() - ref.float()).abs().max().item()
    print(f"  max abs err {err:.3e}")
    assert err <= (2e-2 if dtype == torch.bfloat16 else 1e-4)
    assert torch.equal(out, run())


def test_score_topk_split_counts_agree_real_shapes():
    # The split count changes only which program holds a block: the merged choice is the same for 1..256
    # score programs per row (bf16, 1M-style table of 2,344 pages).
    from m3_kernels import msa_score_topk

    b = _batch(([(300000, 1), (3000, 1)], 2), torch.bfloat16, seed=6)
    base = None
    for splits in (1, 16, 100, 256):
        cands = msa_score_topk.decode_score_topk(b.iq, b.ik, b.meta, 2, K, splits=splits)
        ids = torch.full((2, G, K), -7, dtype=torch.int32, device="cuda")
        msa_fused_decode.decode_select_attend(b.q, b.k, b.v, b.meta, SCALE, K, cands=cands, ids_out=ids)
        assert torch.equal(ids, msa_score_topk.candidate_block_ids(*cands, b.meta.positions, PS, K))
        base = ids if base is None else base
        assert torch.equal(ids, base), splits


@pytest.mark.parametrize("ctx", [40_000, 1 << 20])
def test_topk_network_equals_the_rounds_at_long_decode(ctx, monkeypatch):
    """The decode selection's chunk + merge kernels: one tl.topk network per chunk and merge
    (``TOPK_NETWORK``) give exactly the ids of K rounds of max-and-remove, on random scores and on
    scores with many ties (a few distinct values), for 4 rows x 4 heads at ``ctx`` tokens."""
    t, nbp = 4, ctx // PS + 1
    g = torch.Generator(device="cuda").manual_seed(ctx)
    pos = torch.tensor([ctx - 1, ctx // 2, 5000, 130], device="cuda")
    b = make_paged_batch(
        [(int(p), 1) for p in pos], t, page_size=PS, kv_heads=G, q_heads=G, head_dim=16, index_dim=16,
        dtype=torch.float32, device="cuda", seed=3, spare_pages=0, table_width=nbp,
    )  # fmt: skip
    for scores in (
        torch.randn(t, G, nbp, generator=g, device="cuda"),
        torch.randint(0, 4, (t, G, nbp), generator=g, device="cuda").float(),
    ):
        got = {}
        for net in (True, False):
            monkeypatch.setattr(msa_index_topk, "TOPK_NETWORK", net)
            got[net] = msa_index_topk.select_topk_blocks(scores, b.meta, K, PS, 0, 1)
        assert torch.equal(got[True], got[False])
        for r in range(t):  # independent: own block first, then score desc, ties to the lower id
            n = int(pos[r]) // PS + 1
            for h in range(G):
                vals = scores[r, h, :n].tolist()
                vals[n - 1] = float("inf")
                order = sorted(range(n), key=lambda i: (-vals[i], i))[:K]
                assert got[True][r, h].tolist() == order + [-1] * (K - len(order)), (r, h)


@pytest.mark.parametrize("ctx", [40_000, 1 << 20])
def test_index_topk_route_pdl_chaining_modes_give_the_same_bits(ctx, monkeypatch):
    """Every launch chaining of the long-context decode route (``INDEX_TOPK_PDL_MODES``: the chunk
    top-k as a plain or PDL launch after the scores, the scores / chunk top-k triggering their
    dependents at their start or not) writes the same selection and output as the plain launches,
    eager and replayed from a CUDA graph, for each index-key format. The index queries alternate
    between two sets in one static buffer, so the scratch the launches reuse holds the OTHER set's
    scores / chunk keys when a call starts: a chunk top-k or attention launch that read its input
    before its producer's stores were visible would return the other set's selection here."""
    from m3_kernels.paged_layout import FP8IndexCache, quantize_index_keys

    b = _batch(([(ctx - 1, 1), (3000, 1)], 2), torch.bfloat16, seed=9)
    assert msa_fused_decode.select_decode_path(b.meta.block_tables.shape[1]) == "index_topk"
    iq_sets = (b.iq.clone(), torch.randn_like(b.iq))
    iq = b.iq  # the static input every call reads
    for fmt in ("bf16", "fp8", "fp8q"):
        cache = b.ik if fmt == "bf16" else FP8IndexCache(*quantize_index_keys(b.ik), fmt == "fp8q")
        ids = torch.full((2, G, K), -7, dtype=torch.int32, device="cuda")
        want = []
        monkeypatch.setitem(msa_fused_decode.INDEX_TOPK_PDL, fmt, "off")  # no PDL edge before K2's own
        for one in iq_sets:
            iq.copy_(one)
            out = msa_fused_decode.msa_decode(b.q, iq, b.k, b.v, cache, b.meta, SCALE, K, ids_out=ids)
            want.append((ids.clone(), out.clone()))
        assert not torch.equal(want[0][0], want[1][0])  # the two sets select differently
        for mode in msa_fused_decode.INDEX_TOPK_PDL_MODES:
            monkeypatch.setitem(msa_fused_decode.INDEX_TOPK_PDL, fmt, mode)
            for i in (0, 1, 0, 1):
                iq.copy_(iq_sets[i])
                ids.fill_(-7)
                out = msa_fused_decode.msa_decode(b.q, iq, b.k, b.v, cache, b.meta, SCALE, K, ids_out=ids)
                assert torch.equal(ids, want[i][0]), (fmt, mode, i)
                assert torch.equal(out, want[i][1]), (fmt, mode, i)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                g_out = msa_fused_decode.msa_decode(b.q, iq, b.k, b.v, cache, b.meta, SCALE, K, ids_out=ids)
            for i in (0, 1, 0, 1):
                iq.copy_(iq_sets[i])
                ids.fill_(-7)
                graph.replay()
                torch.cuda.synchronize()
                assert torch.equal(ids, want[i][0]), (fmt, mode, "graph", i)
                assert torch.equal(g_out, want[i][1]), (fmt, mode, "graph", i)


@pytest.mark.parametrize("ctx", [40_000, 1 << 20])
def test_index_topk_route_merge_in_attention_equals_the_merge_launch(ctx, monkeypatch):
    """The long-context decode route: the chunk winners merged in the attention kernel's prologue
    (``INDEX_TOPK_MERGE_IN_ATTENTION``, one tl.topk network) choose exactly the ids of index_topk's own
    merge launch, and attend to them with the same bits (same slots, same kernel after the prologue);
    also with the merge as rounds (``MERGE_NETWORK`` off). Two decode rows (ctx and 3,000 tokens), bf16."""
    from m3_kernels import msa_score_topk

    b = _batch(([(ctx - 1, 1), (3000, 1)], 2), torch.bfloat16, seed=8)
    assert msa_fused_decode.select_decode_path(b.meta.block_tables.shape[1]) == "index_topk"
    got = {}
    for merge_in_attn, net in ((True, True), (True, False), (False, True)):
        monkeypatch.setattr(msa_fused_decode, "INDEX_TOPK_MERGE_IN_ATTENTION", merge_in_attn)
        monkeypatch.setattr(msa_score_topk, "MERGE_NETWORK", net)
        ids = torch.full((2, G, K), -7, dtype=torch.int32, device="cuda")
        out = msa_fused_decode.msa_decode(b.q, b.iq, b.k, b.v, b.ik, b.meta, SCALE, K, ids_out=ids)
        got[(merge_in_attn, net)] = (ids, out)
    ids0, out0 = got[(False, True)]
    assert torch.equal(ids0, msa_index_topk.index_topk(b.iq, b.ik, b.meta, K))
    for key, (ids, out) in got.items():
        assert torch.equal(ids, ids0), key
        assert torch.equal(out, out0), key

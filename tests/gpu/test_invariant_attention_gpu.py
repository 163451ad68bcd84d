"""Batch-invariant MSA attention (kernels/invariant_attention.py) on a CUDA GPU at real M3 shapes
(64 q heads / 4 KV heads / d 128 / block 128 / top-k 16); skipped without CUDA.

What only the GPU can check: that a fixed-shape tensor-core dot gives a row the same bits wherever
the row sits in the tile and whatever the other rows hold (the CPU tests replace the interpreter's
BLAS dot by a fixed-order one), so that the kernels' rule (decode rows padded into the prefill
tile, one compiled kernel for both) makes decode and prefill bitwise equal in bf16.

Bitwise (``torch.equal``) checks, bf16 and fp32: a decode step of position p vs row p of a prefill
(contexts below and above top_k x block = 2048, so the sparse path selects); chunked prefill vs
one chunk; a sequence in decode batches of 1 / 3 / 32 rows, beside prefill rows and CUDA-graph
padding rows, with another block-table width; a CUDA-graph replay vs eager; a 20K-token context.
The top-k kernel alone at M3 shapes: exactly ``select_blocks``'s order on engineered scores up to
1M context (8192 blocks: ties, forced blocks, fewer candidates than K, NaN, -0.0 / +0.0), and a
row's ids the same at batch 1 and among 32 rows (prints us per launch; no timing assertion); the
short-context sort (``TOPK_SHORT_PATH``) on and off, fused in the decode score launch or not: the same ids.
Tolerances vs the PyTorch references (stated as in tests/gpu/test_msa_gpu.py): bf16 attention
<= 2e-2 max abs, fp32 <= 1e-4; selections equal except near-ties (< 1e-3 apart, summation order).
The invariance tests (decode vs prefill row, chunking, batch sizes / mixed steps / padding) run the
sparse layer with each choice of ``sparse_impl`` (ids "msa" = the union walk of ``inv_attn_kernel``,
"msa_pp" = per-page partials, the default; page partials are also checked through the engine in
tests/gpu/test_invariant_ops_gpu.py); the all-blocks-equals-dense check and the reference check name
``sparse_impl="union"`` (``UNION``): the first holds for the union walk only.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

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

from m3_kernels import invariant_attention as ia  # noqa: E402
from m3_kernels.msa_synthetic import make_paged_batch, make_step_batch, random_sequences  # noqa: E402
from m3_rollout.engine.reference_ops import (  # noqa: E402
    gather_pages,
    index_topk_ref,
    pad_queries,
    paged_attention_ref,
    token_rows,
)
from m3_rollout.model.indexer import block_scores, select_blocks  # noqa: E402

PS, G, NH, D, K = 128, 4, 64, 128, 16
SCALE = D**-0.5
LENS = {"a": 5000, "b": 1500, "c": 3000, "d": 20000}  # a: 40 blocks (sparse), b: 12 blocks (<= K)
DTYPES = [torch.bfloat16, torch.float32]
UNION = "union"  # the sparse calls' choice (module docstring); not the default, page partials
SEQS: dict = {}
ALONE: dict = {}


def seqs(dtype):
    if dtype not in SEQS:
        SEQS[dtype] = random_sequences(
            LENS, kv_heads=G, q_heads=NH, head_dim=D, index_dim=D, dtype=dtype, device="cuda", seed=0
        )
    return SEQS[dtype]


def step(dtype, rows, num_decodes, **kw):
    return make_step_batch(seqs(dtype), rows, num_decodes, page_size=PS, **kw)


def run(b, sparse):
    """sparse: False (a dense layer) or the sparse layer's ``sparse_impl`` ("union" / "page_partials")."""
    if not sparse:
        return ia.invariant_paged_attention(b.q, b.k, b.v, b.meta, SCALE), None
    sel = torch.full((b.meta.num_tokens, G, K), -7, dtype=torch.int32, device="cuda")
    return ia.invariant_msa_attention(b.q, b.iq, b.k, b.v, b.ik, b.meta, SCALE, K, sel_out=sel, sparse_impl=sparse), sel


def alone(dtype, name, sparse):
    key = (dtype, name, sparse)
    if key not in ALONE:
        ALONE[key] = run(step(dtype, [(name, 0, LENS[name])], 0), sparse)
    return ALONE[key]


def slices(b):
    qsl = b.meta.query_start_loc.tolist()
    return [slice(x, y) for x, y in zip(qsl[:-1], qsl[1:], strict=True)]


def assert_equal(got, want, what):
    assert torch.equal(got, want), f"{what}: {int((got != want).sum())} of {got.numel()} elements differ"


@pytest.mark.parametrize("sparse", [UNION, "page_partials", False], ids=["msa", "msa_pp", "dense"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_step_equals_prefill_row(dtype, sparse):
    want, want_sel = alone(dtype, "a", sparse)
    pos = [0, 127, 128, 2047, 2048, 2049, 3333, 4999]
    got, sel = run(step(dtype, [("a", p, 1) for p in pos], len(pos), seed=1), sparse)
    assert_equal(got, want[pos], "decode vs prefill output")
    if sparse:
        assert_equal(sel, want_sel[pos], "decode vs prefill selection")
        assert (sel[-1] >= 0).all()  # 40 candidate blocks: K selected
    got, sel = run(step(dtype, [("a", 3000, 4), ("a", 4990, 4)], 2, seed=2), sparse)  # verify rows
    idx = [3000, 3001, 3002, 3003, 4990, 4991, 4992, 4993]
    assert_equal(got, want[idx], "verify vs prefill output")
    if sparse:
        assert_equal(sel, want_sel[idx], "verify vs prefill selection")


@pytest.mark.parametrize("sparse", [UNION, "page_partials", False], ids=["msa", "msa_pp", "dense"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_chunked_prefill_equals_one_chunk(dtype, sparse):
    want, want_sel = alone(dtype, "a", sparse)
    rows = [("a", 0, 1000), ("a", 1000, 1048), ("a", 2048, 2000), ("a", 4048, 952)]  # edges in / on blocks
    got, sel = run(step(dtype, rows, 0, seed=3), sparse)
    assert_equal(got, want, "chunked vs one chunk")
    if sparse:
        assert_equal(sel, want_sel, "chunked vs one chunk selection")
    # the same chunks as four separate steps
    for i, row in enumerate(rows):
        got, sel = run(step(dtype, [row], 0, seed=10 + i), sparse)
        assert_equal(got, want[row[1] : row[1] + row[2]], f"chunk {i} alone")


@pytest.mark.parametrize("sparse", [UNION, "page_partials", False], ids=["msa", "msa_pp", "dense"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_batch_sizes_mixed_steps_and_padding(dtype, sparse):
    want, want_sel = alone(dtype, "a", sparse)
    others = [("b", 1499, 1), ("c", 2999, 1), ("c", 2100, 1), ("b", 700, 1)]
    for n in (1, 3, 32):
        rows = ([("a", 4999, 1)] + (others * 8)[: n - 1])[::-1]  # a's row last
        for pad, width in ((0, None), (5, 64)):
            got, sel = run(step(dtype, rows, n, pad_rows=pad, table_width=width, seed=n + pad), sparse)
            assert_equal(got[n - 1], want[4999], f"batch {n}, {pad} padding rows")
            if sparse:
                assert_equal(sel[n - 1], want_sel[4999], f"selection, batch {n}, {pad} padding rows")
    rows = [("c", 2999, 1), ("a", 4999, 1), ("b", 0, 1500), ("a", 4000, 1000), ("c", 0, 600)]
    b = step(dtype, rows, 2, table_width=80, seed=5)
    got, sel = run(b, sparse)
    sl = slices(b)
    assert_equal(got[sl[1]], want[4999:5000], "a's decode row in a mixed step")
    assert_equal(got[sl[3]], want[4000:5000], "a's chunk after a prefix hit in a mixed step")
    assert_equal(got[sl[2]], alone(dtype, "b", sparse)[0], "b in a mixed step")
    if sparse:
        assert_equal(sel[sl[3]], want_sel[4000:5000], "a's chunk selection in a mixed step")


@pytest.mark.parametrize("dtype", DTYPES)
def test_sparse_with_every_block_equals_dense(dtype):
    # the union walk only (``run`` passes UNION): page partials (the default) reduce per page and
    # merge by LSE, another order than the dense layer's inv_attn_kernel, other bits
    out_sparse, sel = alone(dtype, "b", UNION)  # 12 blocks <= K: every causal block selected
    assert_equal(out_sparse, alone(dtype, "b", False)[0], "sparse (all blocks) vs dense")


@pytest.mark.parametrize("sparse", [UNION, "page_partials"], ids=["msa", "msa_pp"])
def test_long_context_decode_equals_prefill(sparse):
    want, want_sel = alone(torch.bfloat16, "d", sparse)
    pos = [19999, 16384, 9000]
    got, sel = run(step(torch.bfloat16, [("d", p, 1) for p in pos], 3, seed=6), sparse)
    assert_equal(got, want[pos], "20K decode vs prefill")
    assert_equal(sel, want_sel[pos], "20K decode vs prefill selection")


@pytest.mark.parametrize("sparse", [UNION, "page_partials"], ids=["msa", "msa_pp"])
def test_cuda_graph_replay_equals_eager(sparse):
    b = step(torch.bfloat16, [("a", 4999, 1), ("c", 2999, 1), ("b", 900, 1)], 3, pad_rows=1, seed=7)
    run(b, sparse)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_g, sel_g = run(b, sparse)
    b.q.copy_(torch.randn_like(b.q))
    b.iq.copy_(torch.randn_like(b.iq))
    graph.replay()
    out_e, sel_e = run(b, sparse)
    assert_equal(out_g, out_e, "graph replay vs eager")
    assert_equal(sel_g, sel_e, "graph replay vs eager selection")


# ------------------------------------------------------------------------------- vs the references

MIXED = ([(999, 1), (2047, 1), (8999, 1), (0, 2500), (4096, 300)], 3)


def _check_selection(b, got, want):
    """Equal, except near-ties whose scores differ by < 1e-3 (summation order)."""
    if torch.equal(got, want):
        return
    q, pos = pad_queries(b.iq, b.meta)
    scores = block_scores(q, gather_pages(b.ik, b.meta, head_axis=False), pos, PS)  # [R, G, Sq, nb]
    row, off = token_rows(b.meta)
    s = scores.permute(0, 2, 1, 3)[row, off]  # [T, G, nb]
    bad = (got != want).any(-1)
    assert bad.float().mean() < 0.01, f"{int(bad.sum())} of {bad.numel()} selections differ"
    sg = s.gather(-1, got.long().clamp_min(0)).sort(-1).values
    sw = s.gather(-1, want.long().clamp_min(0)).sort(-1).values
    assert (sg - sw)[bad].abs().max() < 1e-3


@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_reference_real_shapes(dtype):
    b = make_paged_batch(
        MIXED[0], MIXED[1], page_size=PS, kv_heads=G, q_heads=NH, head_dim=D, index_dim=D, dtype=dtype, device="cuda"
    )
    sel = index_topk_ref(b.iq, b.ik, b.meta, K)
    _check_selection(b, ia.invariant_index_topk(b.iq, b.ik, b.meta, K), sel)
    atol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    for ids in (sel, None):
        got = ia.invariant_paged_attention(b.q, b.k, b.v, b.meta, SCALE, ids, sparse_impl=UNION)
        err = (got.float() - paged_attention_ref(b.q, b.k, b.v, b.meta, SCALE, ids).float()).abs().max().item()
        print(f"{dtype} {'sparse' if ids is not None else 'dense'} max abs err {err:.3e}")
        assert err <= atol


# ------------------------------------------------------------------------------------ top-k alone


def _topk_scores(t: int, nb: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores [t, G, nb] fp32, positions [t] int32): positions from 0 to 1M - 1 (8192 blocks), few
    distinct values (ties, -0.0 / +0.0), NaN, ascending and constant rows."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    pos = torch.randint(0, nb * PS, (t,), generator=gen, device="cuda", dtype=torch.int32)
    pos[:8] = torch.tensor([0, 127, 128, 300, 2047, 2048, nb * PS - 1, nb * PS - 128], dtype=torch.int32)
    s = torch.randint(-4, 4, (t, G, nb), generator=gen, device="cuda").float()
    s = torch.where(s == 0, torch.where(torch.rand(s.shape, generator=gen, device="cuda") < 0.5, -0.0, 0.0), s)
    s[1::5, :, ::11] = float("nan")
    s[2] = torch.arange(nb, device="cuda", dtype=torch.float32)  # ascending: every chunk merges
    s[3] = 1.0  # constant: all ties
    s[4] = torch.randn(G, nb, generator=gen, device="cuda")
    return s, pos


def _select_ref(s, pos, init, local):
    s = s.nan_to_num(nan=-1e30, posinf=float("inf"), neginf=float("-inf"))  # as the score kernel writes NaN
    return select_blocks(s[:, :, None], pos[:, None].long(), K, PS, init, local)[:, :, 0].int()


@pytest.mark.parametrize(("init", "local"), [(0, 1), (1, 2)])
def test_select_blocks_exact_order_to_1m_context(init, local):
    s, pos = _topk_scores(64, 8192)
    got = ia.invariant_select_blocks(s, SimpleNamespace(positions=pos), K, PS, init, local)
    assert_equal(got, _select_ref(s, pos, init, local), "top-k vs select_blocks")
    # a row alone, and among 32 rows of other positions: the same ids
    for i in (6, 2, 4, 9):
        one = ia.invariant_select_blocks(s[i : i + 1], SimpleNamespace(positions=pos[i : i + 1]), K, PS, init, local)
        assert_equal(one[0], got[i], f"row {i} alone vs in the batch")


@pytest.mark.parametrize("dtype", DTYPES)
def test_short_topk_path_gives_the_walks_ids(dtype, monkeypatch):
    # ``TOPK_SHORT_PATH`` (programs whose rows have <= KP = 16 candidates sort 16 keys instead of
    # walking 128-block chunks) on and off, the decode top-k fused in the score launch or not: the
    # same ids. Decode rows at positions 199 (2 candidates), 2047 (16 = KP), 2048 (17), 4999 (40) and
    # more, a 64-block table (32 score programs per tile, 1 to 20 of them active); a prefill chunk
    # across position 2048 (one token per top-k program); forced init / local blocks; blocks 1..3
    # tied above the rest (positive queries, all keys 1). Against the reference up to near-ties
    # (summation order), and the top-k launch alone on engineered scores (ties, NaN, -0.0 / +0.0).
    from m3_kernels import split_k

    pos = [199, 2047, 2048, 4999, 127, 128, 1000, 3000]
    rows = [(p, 1) for p in pos] + [(1990, 120)]
    b = make_paged_batch(
        rows, len(pos), page_size=PS, kv_heads=G, q_heads=NH, head_dim=D, index_dim=D, dtype=dtype, device="cuda",
        seed=9, table_width=64,
    )  # fmt: skip
    b.iq.abs_()
    for r in range(b.meta.num_rows):
        for j in range(1, 4):
            b.ik[int(b.meta.block_tables[r, j])] = 1.0
    got = {}
    for short in (True, False):
        for fused in (True, False):
            monkeypatch.setattr(ia, "TOPK_SHORT_PATH", short)
            monkeypatch.setattr(ia, "DECODE_FUSED_TOPK", fused)
            got[short, fused] = ia.invariant_index_topk(b.iq, b.ik, b.meta, K, init_blocks=1, local_blocks=2)
    for key, ids in got.items():
        assert_equal(ids, got[True, True], f"ids with short path, fused top-k {key} vs (True, True)")
    assert int(split_k.tile_counters(b.iq.device, 1).abs().sum()) == 0
    ids = got[True, True]
    _check_selection(b, ids, index_topk_ref(b.iq, b.ik, b.meta, K, init_blocks=1, local_blocks=2))
    n = b.meta.positions.long() // PS + 1
    assert (ids[n >= 5][..., 3] == 1).all()  # the tie of blocks 1..3 after the 3 forced: the lowest id
    assert (ids[n <= 2][..., 2:] == -1).all() and (ids[n >= K] >= 0).all()
    s, p = _topk_scores(64, 512)
    p[8:16] = torch.tensor([0, 1, 255, 256, 1919, 1920, 2047, 2048], dtype=torch.int32)  # 1, 2, 2, 3, 15, 16, 16, 17
    sel = {}
    for short in (True, False):
        monkeypatch.setattr(ia, "TOPK_SHORT_PATH", short)
        sel[short] = ia.invariant_select_blocks(s, SimpleNamespace(positions=p), K, PS, 1, 2)
    assert_equal(sel[True], sel[False], "top-k alone, short path vs walk")
    assert_equal(sel[True], _select_ref(s, p, 1, 2), "top-k alone vs select_blocks")


def test_select_blocks_launch_time_printout():
    # informational: us per launch of the top-k alone (CUDA-graph replays of 20 launches), decode sizes
    cases = [(ctx, nb, n, "random") for ctx, nb in ((320, 512), (32768, 512), (1 << 20, 8192)) for n in (1, 32)]
    for ctx, nb, n, kind in cases + [(1 << 20, 8192, 1, "ascending")]:  # ascending: every chunk merges
        if kind == "ascending":
            s = torch.arange(nb, device="cuda", dtype=torch.float32).expand(n, G, nb).contiguous()
        else:
            s = torch.randn(n, G, nb, device="cuda")
        meta = SimpleNamespace(positions=torch.full((n,), ctx - 1, dtype=torch.int32, device="cuda"))
        ia.invariant_select_blocks(s, meta, K, PS)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(20):
                ia.invariant_select_blocks(s, meta, K, PS)
        graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        us = start.elapsed_time(end) * 1e3 / 200
        print(f"top-k ctx {ctx} batch {n} {kind} scores: {us:.1f} us per launch")

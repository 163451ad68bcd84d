"""Batch-invariant MSA attention (kernels/invariant_attention.py) on CPU under the Triton interpreter.

Two kinds of checks, tiny preset shapes (spec §7 A: 8 q heads / 2 KV heads / d 32 / block 16 /
top-k 4, sparse beyond 64 tokens; one case at d 64 / block 32), fp32 and fp16 (the interpreter
mishandles bf16; fp16 in the reference checks, decode vs prefill rows and the all-blocks check, the
chunked and batched checks fp32 only: the same kernel code, the dtype changes only the dots' input
rounding):
- against the PyTorch references (``index_topk_ref`` exactly, attention within tolerance);
- bitwise (``torch.equal``) invariance of a position's output and block choice: a decode step at
  position p vs row p of a prefill; one chunk vs several; a sequence alone vs beside other
  sequences (decode and prefill rows, other lengths, another block-table width); CUDA-graph padding
  rows present vs absent; a sparse layer selecting every block vs the dense layer.
Each step's caches are built as the engine leaves them: every row has its own physical pages (in a
shuffled order) holding its sequence's keys up to the end of its query chunk, zeros after (the
slots a later token will write), so a decode step really sees a half-written page. The fast
kernels (msa_paged_attention) fail the decode-vs-prefill check: it is not vacuous.
NOTE: the interpreter's own dot (numpy matmul) is not row-invariant (BLAS micro-kernels), so this
module runs with ``msa_interpret.fixed_order_dot``; that a fixed-shape tensor-core dot is (and the
rule "decode padded into the prefill tile shape") is checked by tests/gpu/test_invariant_attention_gpu.py.
The bitwise checks rank blocks in top-k chunks of 16, not 128 (``INVARIANCE_TOPK_CHUNK``: one chunk
either way at their sizes; the top-k's own tests here run the kernels' chunk).
The sparse layers' calls here name ``sparse_impl="union"`` (``UNION``): this module checks
``inv_attn_kernel``'s union walk, which the engine runs with ``invariant_sparse_attention="union"``;
the default, page partials, is checked by tests/test_invariant_page_partials.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from m3_kernels.msa_interpret import fixed_order_dot, interpreted_invariant_attention, interpreted_kernels
from m3_kernels.msa_synthetic import PagedBatch, SequenceContents, make_paged_batch, make_step_batch, random_sequences
from m3_kernels.paged_layout import FP8IndexCache, quantize_index_keys
from m3_rollout.engine.ops import invariant_attention_fields
from m3_rollout.engine.reference_ops import index_topk_ref, msa_attention_ref, paged_attention_ref
from m3_rollout.model.indexer import select_blocks
from m3_rollout.model.paged_ops import PagedOps

ia = interpreted_invariant_attention()
_, fast_attn, _ = interpreted_kernels()

PS, G, NH, D, K = 16, 2, 8, 32, 4
SCALE = D**-0.5
ATOL = {torch.float32: 2e-5, torch.float16: 3e-3}  # fp16: probabilities rounded for the PV dot
DTYPES = [torch.float32, torch.float16]
LENS = {"a": 150, "b": 45, "c": 100}  # a: sparse (10 blocks > K), b: dense-equal, c: 7 blocks
# The sparse calls' choice: the union walk (module docstring). Not the default (page partials):
# test_sparse_with_every_block_selected_equals_dense holds for the union walk only.
UNION = "union"


# ------------------------------------------------------------------------------------------ helpers


def make_seqs(dtype: torch.dtype, seed: int = 0) -> SequenceContents:
    return random_sequences(LENS, kv_heads=G, q_heads=NH, head_dim=D, index_dim=D, dtype=dtype, seed=seed)


def make_step(seqs: SequenceContents, rows: list, num_decodes: int, **kw) -> PagedBatch:
    """``make_step_batch``: every row on private pages holding its sequence up to the end of its chunk."""
    return make_step_batch(seqs, rows, num_decodes, page_size=PS, **kw)


# The bitwise invariance checks (``run``) rank blocks in top-k chunks of 16 instead of the kernels'
# 128 (``TOPK_CHUNK``): every table here (<= 16 blocks) is one chunk either way, the same branch; the
# chunk only sets the width of the exact integer network, whose interpreted cost dominates these
# tests. The kernels' chunk, and rows over several chunks, are checked against the reference by the
# top-k tests above (and the sparse tests of test_invariant_page_partials / the trainer test).
INVARIANCE_TOPK_CHUNK = 16


def run(step: PagedBatch, sparse: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(attention output [T, nh, d], block choice [T, G, K] or None) of one step."""
    if not sparse:
        return ia.invariant_paged_attention(step.q, step.k, step.v, step.meta, SCALE), None
    assert step.meta.block_tables.shape[1] <= INVARIANCE_TOPK_CHUNK  # one top-k chunk, as with 128
    sel = torch.full((step.meta.num_tokens, G, K), -7, dtype=torch.int32)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ia, "TOPK_CHUNK", INVARIANCE_TOPK_CHUNK)
        out = ia.invariant_msa_attention(
            step.q, step.iq, step.k, step.v, step.ik, step.meta, SCALE, K, sel_out=sel, sparse_impl=UNION
        )
    return out, sel


def token_slices(step: PagedBatch) -> list[slice]:
    qsl = step.meta.query_start_loc.tolist()
    return [slice(a, b) for a, b in zip(qsl[:-1], qsl[1:], strict=True)]


@pytest.fixture(autouse=True, scope="module")
def _row_invariant_dot():
    """The interpreter's dot made row-invariant like the GPU's (msa_interpret.fixed_order_dot)."""
    with fixed_order_dot():
        yield


_ALONE: dict = {}


def alone(dtype: torch.dtype, name: str, sparse: bool):
    """Output and choice of sequence ``name`` prefilled alone in one chunk (cached per test session)."""
    key = (dtype, name, sparse)
    if key not in _ALONE:
        _ALONE[key] = run(make_step(make_seqs(dtype), [(name, 0, LENS[name])], 0), sparse)
    return _ALONE[key]


def assert_rows_equal(got, want, what: str) -> None:
    assert torch.equal(got, want), f"{what}: {int((got != want).sum())} elements differ"


# ------------------------------------------------------------------------------- vs the references

MIXED = ([(40, 1), (700, 1), (63, 1), (0, 65), (100, 30)], 3)  # as tests/test_kernels_msa.py
VERIFY = ([(61, 3), (300, 3), (16, 3), (20, 45)], 3)


def _batch(spec, dtype, seed=0, **kw):
    rows, nd = spec
    return make_paged_batch(
        rows, nd, page_size=PS, kv_heads=G, q_heads=NH, head_dim=D, index_dim=D, dtype=dtype, seed=seed, **kw
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_msa_attention_matches_reference(dtype):
    b = _batch(MIXED, dtype, seed=1)
    sel = torch.zeros(b.meta.num_tokens, 3, G, K, dtype=torch.int16)[:, 1]  # strided int16, as the engine's record
    got = ia.invariant_msa_attention(b.q, b.iq, b.k, b.v, b.ik, b.meta, SCALE, K, sel_out=sel, sparse_impl=UNION)
    want_sel = index_topk_ref(b.iq, b.ik, b.meta, K)
    want = msa_attention_ref(b.q, b.iq, b.k, b.v, b.ik, b.meta, SCALE, K)
    assert torch.equal(sel.int(), want_sel)
    assert (want_sel[1] >= 0).all() and (want_sel[0] == -1).sum() == G * (K - 3)  # sparse and padded rows
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), atol=ATOL[dtype], rtol=0)
    dense = ia.invariant_paged_attention(b.q, b.k, b.v, b.meta, SCALE)
    torch.testing.assert_close(
        dense.float(), paged_attention_ref(b.q, b.k, b.v, b.meta, SCALE).float(), atol=ATOL[dtype], rtol=0
    )


def test_index_topk_forced_blocks_verify_rows_and_wide_table():
    b = _batch(VERIFY, torch.float32, seed=3, table_width=40)
    got = ia.invariant_index_topk(b.iq, b.ik, b.meta, K, init_blocks=1, local_blocks=2)
    assert torch.equal(got, index_topk_ref(b.iq, b.ik, b.meta, K, init_blocks=1, local_blocks=2))
    assert got[3, :, :3].tolist() == [[0, 17, 18]] * G  # position 300: init 0, then locals 17, 18


@pytest.mark.filterwarnings("ignore:All-NaN slice:RuntimeWarning")
def test_index_topk_ties_go_to_lower_block_id_and_nan_blocks_lose():
    b = _batch(([(200, 1), (90, 1)], 2), torch.float32)
    b.ik.fill_(1.0)
    b.iq.copy_(torch.arange(b.iq.numel(), dtype=torch.float32).view_as(b.iq) % 3)
    got = ia.invariant_index_topk(b.iq, b.ik, b.meta, K)
    assert got[0].tolist() == [[12, 0, 1, 2]] * G  # own block 12, then the lowest ids
    assert got[1].tolist() == [[5, 0, 1, 2]] * G
    b.ik[b.meta.block_tables[0, 1]] = float("nan")  # block 1 of row 0: its score becomes -1e30
    got = ia.invariant_index_topk(b.iq, b.ik, b.meta, K)
    assert got[0].tolist() == [[12, 0, 2, 3]] * G
    assert torch.equal(got, index_topk_ref(b.iq, b.ik, b.meta, K))


@pytest.mark.filterwarnings("ignore:All-NaN slice:RuntimeWarning")
@pytest.mark.parametrize("spec", [([(2400, 1), (40, 1), (700, 1), (0, 30)], 3), ([(2300, 3), (61, 3), (20, 9)], 2)])
def test_decode_topk_in_the_score_launch_equals_the_topk_launch(spec, monkeypatch):
    # Decode rows rank their blocks in their score launch (DECODE_FUSED_TOPK: the last of a tile's
    # split programs runs the streaming top-k); prefill rows take _inv_topk_kernel from the first
    # prefill token on. Same ids as the top-k launch for every row and as the reference, over
    # 150-block rows (two 128-block chunks of the streaming top-k; 75 split programs per tile),
    # verify rows (q_len 3: three tokens ranked by one program), forced init / local blocks, ties
    # across a chunk edge and a NaN block; the split-K counters are all zero again afterwards.
    from m3_kernels import split_k

    b = _batch(spec, torch.float32, seed=4, table_width=160)
    for r in range(b.meta.num_rows):
        for j in range(40):
            b.ik[int(b.meta.block_tables[r, 100 + j]) % b.ik.shape[0]] = 0.25  # ties across block 128
    b.ik[int(b.meta.block_tables[0, 7])] = float("nan")
    want = index_topk_ref(b.iq, b.ik, b.meta, K, init_blocks=1, local_blocks=2)
    got = {}
    for fused in (True, False):
        monkeypatch.setattr(ia, "DECODE_FUSED_TOPK", fused)
        got[fused] = ia.invariant_index_topk(b.iq, b.ik, b.meta, K, init_blocks=1, local_blocks=2)
    assert torch.equal(got[True], got[False]) and torch.equal(got[True], want)
    assert int(split_k.tile_counters(torch.device("cpu"), 1).abs().sum()) == 0
    td = b.meta.num_decodes * b.meta.decode_query_len
    assert (want[:td] >= 100).any() and not (want[0] == 7).any()  # tied blocks compete; the NaN block lost


def _spy_key_widths(monkeypatch) -> list[int]:
    """Widths of the [rows, width] key tiles the interpreted top-k builds (``block_selection_keys``,
    called by the kernels through ia's globals): KP = the short path ran, TOPK_CHUNK = the walk."""
    widths, build = [], ia.block_selection_keys

    def spy(s, b, cand, n_cand, init_blocks, local_blocks):
        widths.append(int(s.shape[1]))
        return build(s, b, cand, n_cand, init_blocks, local_blocks)

    monkeypatch.setattr(ia, "block_selection_keys", spy)
    return widths


@pytest.mark.filterwarnings("ignore:All-NaN slice:RuntimeWarning")
@pytest.mark.parametrize(
    "spec",
    [
        # decode rows (1 token): 2, 3, 4 (= KP, twice) and 5, 19 candidates; the split walk of 20
        # programs per tile (table_width 40) with 1, 2, 3 and 10 active splits
        ([(20, 1), (47, 1), (48, 1), (63, 1), (64, 1), (300, 1)], 6),
        # verify rows (3 tokens ranked by one program: 4, 4, 5 candidates; 1, 2, 2), then prefill
        # chunks whose top-k programs (2 tokens each at G = 2) hold 4 + 4 and 4 + 5 candidates
        ([(61, 3), (16, 3), (61, 6), (0, 40)], 2),
    ],
    ids=["decode", "verify_prefill"],
)
def test_short_topk_path_gives_the_walks_ids(spec, monkeypatch):
    # TOPK_SHORT_PATH: a top-k program whose rows have at most KP candidates each sorts its KP keys
    # instead of walking TOPK_CHUNK-wide chunks. The same ids, short path on or off, fused in the
    # decode score launch or not, as the reference: candidate counts below, at and above KP, mixed in
    # one program, forced init / local blocks and tied scores (the lower block id first); the spy
    # shows which path ran, and the split-K counters are all zero again afterwards.
    from m3_kernels import split_k

    b = _batch(spec, torch.float32, seed=8, table_width=40)
    b.iq.abs_()  # positive queries: blocks 1..3 of every row (all keys 1.0) tie above every other block
    for r in range(b.meta.num_rows):
        for j in range(1, 4):
            b.ik[int(b.meta.block_tables[r, j])] = 1.0
    want = index_topk_ref(b.iq, b.ik, b.meta, K, init_blocks=1, local_blocks=2)
    widths = _spy_key_widths(monkeypatch)
    got = {}
    for short in (True, False):
        for fused in (True, False):
            monkeypatch.setattr(ia, "TOPK_SHORT_PATH", short)
            monkeypatch.setattr(ia, "DECODE_FUSED_TOPK", fused)
            widths.clear()
            got[short, fused] = ia.invariant_index_topk(b.iq, b.ik, b.meta, K, init_blocks=1, local_blocks=2)
            assert set(widths) == ({K, ia.TOPK_CHUNK} if short else {ia.TOPK_CHUNK}), (short, fused)
    for key, ids in got.items():
        assert torch.equal(ids, want), f"short path, fused top-k {key}: {int((ids != want).sum())} ids differ"
    assert int(split_k.tile_counters(torch.device("cpu"), 1).abs().sum()) == 0
    # from 5 candidates on: forced 0 and the last two (+inf, ascending ids), then the tie of 1 and 2 (and
    # 3), won by block 1; up to 4 (the short path) the tied blocks are forced or all selected
    long_rows = b.meta.positions >= 4 * PS
    assert long_rows.any() and (want[long_rows][..., 3] == 1).all()
    assert (want[b.meta.positions // PS == 3] == torch.tensor([0, 2, 3, 1], dtype=torch.int32)).all()


@pytest.mark.parametrize("short", [True, False])
def test_short_topk_path_orders_ties_and_forced_blocks(short, monkeypatch):
    # the top-k launch alone on engineered scores, KP = 16 (K = 13): rows of 1..16 candidates (the
    # short path) and 17, 200 (the walk) in one launch and in mixed programs (4 heads = 1 token per
    # program; 1 head = 4 tokens per program); all-equal scores, -0.0 / +0.0, NaN (-1e30) and +-inf
    widths = _spy_key_widths(monkeypatch)
    monkeypatch.setattr(ia, "TOPK_SHORT_PATH", short)
    pos = torch.tensor([0, 15, 100, 239, 240, 255, 256, 3199, 47, 250], dtype=torch.int32)
    s = torch.randint(-2, 2, (len(pos), 4, 200), generator=torch.Generator().manual_seed(9)).float()
    s[s == 0] = torch.tensor([-0.0, 0.0]).repeat(int((s == 0).sum()))[: int((s == 0).sum())]
    s[2] = 1.0  # all ties: the forced blocks, then the lowest ids
    s[3, :, 4], s[3, :, 9], s[3, :, 11] = float("-inf"), float("inf"), -1e30
    for g, init, local in ((4, 2, 1), (1, 0, 3)):
        got = ia.invariant_select_blocks(s[:, :g].contiguous(), SimpleNamespace(positions=pos), 13, PS, init, local)
        want = select_blocks(s[:, :g, None], pos[:, None].long(), 13, PS, init, local)[:, :, 0]
        assert torch.equal(got, want.int()), f"{int((got != want).any(-1).sum())} rows differ"
        n2 = 100 // PS + 1
        forced = list(range(init)) + list(range(n2 - local, n2))
        assert got[2, 0].tolist() == forced + [i for i in range(n2) if i not in forced] + [-1] * (13 - n2)
    assert set(widths) == ({16, ia.TOPK_CHUNK} if short else {ia.TOPK_CHUNK})


def test_ids_outputs_must_be_contiguous_int32_and_name_the_op():
    # The top-k kernels index ids at (t * G + g) * K + k: a strided view (like the engine's int16
    # record) would get another row's ids and writes past it (breaker pass, 2026-12-03); they raise.
    b = _batch(([(700, 1), (40, 1)], 2), torch.float32)
    scores, _ = ia.invariant_index_scores(b.iq, b.ik, b.meta)
    rec = torch.zeros(2, 3, G, K, dtype=torch.int32)[:, 1]  # strided [T, G, K]
    with pytest.raises(ValueError, match="invariant_select_blocks: the ids output must be a contiguous int32"):
        ia.invariant_select_blocks(scores, b.meta, K, PS, out=rec)
    with pytest.raises(ValueError, match="invariant_index_scores: the ids output"):
        ia.invariant_index_scores(b.iq, b.ik, b.meta, dict(ids=torch.zeros(2, G, K, dtype=torch.int64), topk=K))
    out = torch.zeros(2, G, K, dtype=torch.int32)
    assert ia.invariant_select_blocks(scores, b.meta, K, PS, out=out) is out
    assert torch.equal(out, index_topk_ref(b.iq, b.ik, b.meta, K))


def _engineered_scores(g: int, nb: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores [T, g, nb] fp32, positions [T] int32) for the select-only test below: block edges,
    rows with fewer candidates than K, rows over 1..5 chunks of 128 blocks, many ties (-0.0 and
    +0.0 among them), NaN / +-inf scores, ascending / descending / constant rows, NaN garbage past
    a row's candidates."""
    g_ = torch.Generator().manual_seed(7)
    pos = torch.tensor([0, 5, 16, 47, 243, 256, 2047, 2048, 4807, 9599, 7000, 9000], dtype=torch.int32)
    t = len(pos)
    s = torch.randint(-3, 3, (t, g, nb), generator=g_).float()
    zero = s == 0
    s[zero] = torch.where(torch.rand(int(zero.sum()), generator=g_) < 0.5, -0.0, 0.0)
    s[0, 0, 0] = float("nan")
    s[9, :, ::7] = float("nan")
    s[9, :, 5], s[9, :, 9], s[9, :, 300] = float("-inf"), float("inf"), float("inf")
    s[3, :, 3:] = float("nan")  # past position 47's 3 candidates: never read
    s[10] = torch.arange(nb, dtype=torch.float32)  # ascending: every chunk merges
    s[11] = -torch.arange(nb, dtype=torch.float32)  # descending: every later chunk is skipped
    s[8] = 1.0  # constant: all ties, the lowest ids win
    s[8, 1, 250] = 1.5  # ... but for one late block of one head
    return s, pos


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")
@pytest.mark.parametrize(("g", "k", "init", "local"), [(4, 16, 1, 2), (2, 5, 2, 3)])
def test_select_blocks_order_matches_reference_on_ties_and_long_rows(g, k, init, local):
    # the top-k kernel alone, against the model's select_blocks on the same scores (NaN -> -1e30 as
    # the score kernel writes them); 600 blocks = 5 chunks, mixed positions in one launch
    scores, pos = _engineered_scores(g, 600)
    got = ia.invariant_select_blocks(scores, SimpleNamespace(positions=pos), k, PS, init, local)
    want = select_blocks(
        scores.nan_to_num(nan=-1e30, posinf=float("inf"), neginf=float("-inf"))[:, :, None],
        pos[:, None].long(),
        k,
        PS,
        init,
        local,
    )[:, :, 0]
    assert got.dtype == torch.int32 and got.shape == (len(pos), g, k)
    assert torch.equal(got, want.int()), f"{int((got != want).any(-1).sum())} rows differ"
    assert got[0, :, 1:].eq(-1).all() and got[2, :, 2:].eq(-1).all()  # 1 and 2 candidates: -1 padded
    n8 = 4807 // PS + 1  # constant row: forced (ascending ids), then the lowest ids (ties)
    forced = list(range(init)) + list(range(n8 - local, n8))
    rest = [i for i in range(n8) if i not in forced and i != 250]
    assert got[8, 0].tolist() == (forced + sorted(rest + [250]))[:k]
    assert got[8, 1].tolist() == (forced + [250] + rest)[:k]  # its one higher score right after the forced


def _odd_scores(g: int, nb: int, pos: list[int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores [T, g, nb] fp32 with many ties, positions [T] int32); rows 0..2 all equal, all -inf,
    all +inf (where T allows)."""
    s = torch.randint(-2, 2, (len(pos), g, nb), generator=torch.Generator().manual_seed(seed)).float()
    for i, v in enumerate((1.0, float("-inf"), float("inf"))[: len(pos)]):
        s[i] = v
    return s, torch.tensor(pos, dtype=torch.int32)


@pytest.mark.parametrize(
    ("g", "k", "init", "local", "nb", "pos"),
    [
        # 3 heads (padded to 4: one token per program); forced blocks overlapping each other and
        # outnumbering the candidates of the early positions; positions on block edges
        (3, 3, 2, 3, 40, [0, 15, 16, 31, 32, 63, 64, 639]),
        # 1 head: 4 tokens per program and 5 tokens (one program half empty); K = 12, no forced block
        (1, 12, 0, 0, 300, [4799, 0, 2047, 2048, 191]),
        # K = 130 > one chunk of 128 (KP = 256 = the chunk), 2 chunks
        (1, 130, 1, 1, 256, [4095, 4000, 2100]),
    ],
)
def test_select_blocks_odd_k_heads_and_forced_blocks_match_reference(g, k, init, local, nb, pos):
    scores, p = _odd_scores(g, nb, pos, seed=k)
    got = ia.invariant_select_blocks(scores, SimpleNamespace(positions=p), k, PS, init, local)
    want = select_blocks(scores[:, :, None], p[:, None].long(), k, PS, init, local)[:, :, 0]
    assert torch.equal(got, want.int()), f"{int((got != want).any(-1).sum())} rows differ"


def test_fp8_index_cache_matches_reference_and_is_invariant():
    # decode rows at 149 (10 blocks), 64 (5) and 17 (2 < K: -1 padded) vs the same positions as
    # prefill rows (three chunks of a, each on pages holding a up to its end)
    seqs = make_seqs(torch.float32, seed=5)
    pre = make_step(seqs, [("a", 10, 10), ("a", 60, 10), ("a", 140, 10)], 0)
    dec = make_step(seqs, [("a", p, 1) for p in (149, 64, 17)], 3)
    got = {}
    for name, st in (("pre", pre), ("dec", dec)):
        cache = FP8IndexCache(*quantize_index_keys(st.ik), quantize_queries=True)
        got[name] = ia.invariant_index_topk(st.iq, cache, st.meta, K)
        assert torch.equal(got[name], index_topk_ref(st.iq, cache, st.meta, K))
    assert (got["pre"][29] >= 0).all() and (got["pre"][7, :, 2:] == -1).all()  # 149 selects K; 17 pads
    assert_rows_equal(got["dec"], got["pre"][[29, 14, 7]], "fp8 selection, decode vs prefill")


def test_head_dim_64_block_32_and_errors_name_the_field():
    b = make_paged_batch(
        [(70, 1), (0, 40)], 1, page_size=32, kv_heads=G, q_heads=NH, head_dim=64, index_dim=64, dtype=torch.float32
    )
    sel = index_topk_ref(b.iq, b.ik, b.meta, 2)
    assert torch.equal(ia.invariant_index_topk(b.iq, b.ik, b.meta, 2), sel)
    got = ia.invariant_paged_attention(b.q, b.k, b.v, b.meta, 0.125, sel, sparse_impl=UNION)
    torch.testing.assert_close(got, paged_attention_ref(b.q, b.k, b.v, b.meta, 0.125, sel), atol=2e-5, rtol=0)
    with pytest.raises(ValueError, match="head_dim"):
        ia.invariant_paged_attention(b.q[..., :24], b.k[..., :24], b.v[..., :24], b.meta, 0.1)
    with pytest.raises(ValueError, match="topk"):
        ia.invariant_index_topk(b.iq, b.ik, b.meta, 65)
    with pytest.raises(ValueError, match="dtypes"):
        ia.invariant_paged_attention(b.q.half(), b.k, b.v, b.meta, 0.1)


def test_paged_ops_fields():
    fields = invariant_attention_fields(interpret=True, invariant_sparse_attention=UNION)
    ops = PagedOps(**fields)
    assert ops.paged_attention.func.__name__ == "invariant_paged_attention"
    assert ops.msa_attention.func.__name__ == "invariant_msa_attention"
    assert ops.msa_attention.keywords["sparse_impl"] == UNION and not ops.takes_prefill_scratch


# ------------------------------------------------------------------------------ bitwise invariance

DECODE_POS = [0, 15, 16, 63, 64, 65, 100, 149]  # block edges, K*B edge, sparse positions


@pytest.mark.parametrize("sparse", [True, False], ids=["msa", "dense"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_step_equals_prefill_row(dtype, sparse):
    seqs = make_seqs(dtype)
    want, want_sel = alone(dtype, "a", sparse)
    # one decode row per position, each with its own half-written pages (as the engine's step p)
    step = make_step(seqs, [("a", p, 1) for p in DECODE_POS], len(DECODE_POS), seed=1)
    got, sel = run(step, sparse)
    assert_rows_equal(got, want[DECODE_POS], "decode vs prefill output")
    if sparse:
        assert_rows_equal(sel, want_sel[DECODE_POS], "decode vs prefill selection")
        assert (sel[-1] >= 0).all() and (want_sel[149] >= 0).all()  # the sparse case selects K of 10 blocks
    # speculative-verify rows (3 query tokens each) give the same bits too
    step = make_step(seqs, [("a", 61, 3), ("a", 120, 3)], 2, seed=2)
    got, sel = run(step, sparse)
    idx = [61, 62, 63, 120, 121, 122]
    assert_rows_equal(got, want[idx], "verify vs prefill output")
    if sparse:
        assert_rows_equal(sel, want_sel[idx], "verify vs prefill selection")


@pytest.mark.parametrize("sparse", [True, False], ids=["msa", "dense"])
def test_chunked_prefill_equals_one_chunk(sparse):
    # chunk edges inside a block (40), on a block edge (64) and past K*B; each chunk is its own step
    # (its pages hold only the tokens written so far), here three rows of one launch; fp32 (module
    # docstring: fp16's prefill tiles are test_decode_step_equals_prefill_row's reference)
    dtype = torch.float32
    want, want_sel = alone(dtype, "a", sparse)
    step = make_step(make_seqs(dtype), [("a", 0, 40), ("a", 40, 24), ("a", 64, 86)], 0, seed=3)
    got, sel = run(step, sparse)
    assert_rows_equal(got, want, "chunked vs one chunk output")
    if sparse:
        assert_rows_equal(sel, want_sel, "chunked vs one chunk selection")


@pytest.mark.parametrize("sparse", [True, False], ids=["msa", "dense"])
def test_sequence_alone_equals_batched_with_others(sparse):
    dtype = torch.float32  # fp32 (module docstring)
    seqs = make_seqs(dtype)
    want, want_sel = alone(dtype, "a", sparse)
    # a mixed step: decode rows of c and a, then prefill chunks of b (fresh), a (after a 120-token
    # prefix hit, across the split edge at 128) and c; a wider block table than any row needs
    rows = [("c", 99, 1), ("a", 149, 1), ("b", 0, 45), ("a", 120, 30), ("c", 0, 20)]
    step = make_step(seqs, rows, 2, table_width=16, seed=4)
    got, sel = run(step, sparse)
    sl = token_slices(step)
    assert_rows_equal(got[sl[1]], want[149:150], "a's decode row in a mixed batch")
    assert_rows_equal(got[sl[3]], want[120:150], "a's prefill chunk in a mixed batch")
    b_out, b_sel = alone(dtype, "b", sparse)
    assert_rows_equal(got[sl[2]], b_out, "b in a mixed batch")
    if sparse:
        assert_rows_equal(sel[sl[1]], want_sel[149:150], "selection of a's decode row")
        assert_rows_equal(sel[sl[3]], want_sel[120:150], "selection of a's chunk")
        assert_rows_equal(sel[sl[2]], b_sel, "selection of b")
    # the same decode rows as a plain decode step, with and without CUDA-graph padding rows
    dec_rows = [("c", 99, 1), ("a", 149, 1), ("b", 44, 1)]
    plain, plain_sel = run(make_step(seqs, dec_rows, 3, seed=5), sparse)
    padded, padded_sel = run(make_step(seqs, dec_rows, 3, pad_rows=2, table_width=12, seed=6), sparse)
    assert_rows_equal(padded[:3], plain, "decode with vs without padding rows")
    assert_rows_equal(plain[:2], torch.cat([got[sl[0]], got[sl[1]]]), "plain vs mixed")
    assert_rows_equal(plain[2:3], b_out[44:45], "b's decode vs its prefill row")
    if sparse:
        assert_rows_equal(padded_sel[:3], plain_sel, "selection with vs without padding rows")


@pytest.mark.parametrize("dtype", DTYPES)
def test_sparse_with_every_block_selected_equals_dense(dtype):
    # sequence b (45 tokens, 3 blocks <= K): the MSA layer selects every causal block, and its bits
    # equal the dense layer's (same pages in the same order, spec invariance 1 made bitwise).
    # NOTE: the union walk only (``run`` passes UNION): the dense layer always takes inv_attn_kernel,
    # and page partials (the default) reduce per page and merge by LSE, another order, other bits.
    out_sparse, sel = alone(dtype, "b", True)
    out_dense, _ = alone(dtype, "b", False)
    assert (sel >= 0).sum() == sum(min(K, p // PS + 1) for p in range(LENS["b"])) * G
    assert_rows_equal(out_sparse, out_dense, "sparse (all blocks) vs dense")


def test_tile_choice_keeps_the_bits_and_bad_choices_name_the_field():
    """``tile_rows`` / ``warps`` (the tile sweep): another power-of-two tile gives the same bits here
    (the GPU test checks the compiled ones); a tile that is no power of two, below one 16-row dot
    or 0, and a warp count that is no power of two, raise ValueError naming the keyword (they
    failed inside the kernel, or 0 / negative silently took another tile)."""
    want, _ = alone(torch.float32, "b", False)
    b = make_step(make_seqs(torch.float32), [("b", 0, LENS["b"])], 0)
    assert_rows_equal(
        ia.invariant_paged_attention(b.q, b.k, b.v, b.meta, SCALE, tile_rows=16, warps=2), want, "16 rows"
    )
    for rows in (48, 0, 8, -64):
        with pytest.raises(ValueError, match="tile_rows"):
            ia.invariant_paged_attention(b.q, b.k, b.v, b.meta, SCALE, tile_rows=rows)
    for warps in (3, 0, 32):
        with pytest.raises(ValueError, match="warps"):
            ia.invariant_paged_attention(b.q, b.k, b.v, b.meta, SCALE, warps=warps)


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")
def test_fast_kernels_fail_the_decode_check():
    # the same decode-vs-prefill comparison on the fast dense kernel (split-K decode + merge): not
    # bitwise equal, so the invariance tests above can fail
    seqs = make_seqs(torch.float32)
    one = make_step(seqs, [("a", 0, LENS["a"])], 0)
    dec = make_step(seqs, [("a", p, 1) for p in (100, 149)], 2, seed=1)
    want = fast_attn.paged_attention(one.q, one.k, one.v, one.meta, SCALE)
    got = fast_attn.paged_attention(dec.q, dec.k, dec.v, dec.meta, SCALE)
    torch.testing.assert_close(got, want[[100, 149]], atol=2e-5, rtol=0)
    assert not torch.equal(got, want[[100, 149]])

"""Split attention of kernels/invariant_attention.py: contexts spanning several ``ATTN_SPLIT_BLOCKS`` splits.

The attention walks a token's keys split by split (``ATTN_SPLIT_BLOCKS`` blocks each, ascending),
folding each split's online softmax into the total in ascending split order: in registers for
prefill tiles, through one program per split plus ``_inv_merge_kernel`` for decode rows. These
tests check bitwise (``torch.equal``), fp32 under the Triton interpreter with
``msa_interpret.fixed_order_dot``, that a position's output does not depend on the path: decode
vs prefill row, speculative-verify rows, chunked prefill (chunk edges inside and on split edges),
a sequence alone vs beside other rows, CUDA-graph padding rows and a wider block table; for a dense
layer of 20 pages (5 splits) and a sparse layer whose engineered selections spread over every
split (with empty slots, repeated ids and ids past the token's block); a sparse layer selecting
every block gives the dense layer's bits; both match the PyTorch reference within tolerance.
The sparse calls name ``sparse_impl="union"``: the splits are the union walk's (page partials, the
default, have none; tests/test_invariant_page_partials.py), and the all-blocks-equals-dense check
holds for the union walk only.
NOTE: this module runs with ``ATTN_SPLIT_BLOCKS`` = ``SPLIT_B`` = 4 (the kernels' 8 halved): the
same kernels, split logic and split counts on contexts half as long (a prefill's interpreter time
grows with the square of the context). The kernels' own 8 is checked across a split edge (decode
rows merging two splits) by tests/test_invariant_attention.py, and at M3 shapes by tests/gpu.
"""

from __future__ import annotations

import pytest
import torch

from m3_kernels.msa_interpret import fixed_order_dot, interpreted_invariant_attention
from m3_kernels.msa_synthetic import PagedBatch, make_step_batch, random_sequences
from m3_rollout.engine.reference_ops import paged_attention_ref

ia = interpreted_invariant_attention()

PS, G, NH, D = 16, 2, 8, 32
SCALE = D**-0.5
DTYPE = torch.float32
SPLIT_B = 4  # ATTN_SPLIT_BLOCKS here (module NOTE)
LENS = {"a": 5 * SPLIT_B * PS, "b": 6 * PS + 5}  # a: 20 pages = 5 splits of 4; b: 7 pages (2 splits)
SEL_K = 8  # engineered selection width (sparse case)
UNION = "union"  # the sparse calls' choice (module docstring); not the default, page partials


@pytest.fixture(autouse=True, scope="module")
def _row_invariant_dot():
    """The interpreter's dot made row-invariant like the GPU's (msa_interpret.fixed_order_dot); the
    kernels' split width ``SPLIT_B`` for this module (module NOTE)."""
    with fixed_order_dot(), pytest.MonkeyPatch.context() as mp:
        mp.setattr(ia, "ATTN_SPLIT_BLOCKS", SPLIT_B)
        yield


SEQS = random_sequences(LENS, kv_heads=G, q_heads=NH, head_dim=D, index_dim=D, dtype=DTYPE, seed=11)


def step(rows: list, num_decodes: int, **kw) -> PagedBatch:
    return make_step_batch(SEQS, rows, num_decodes, page_size=PS, **kw)


def engineered_ids(positions: torch.Tensor, k: int = SEL_K) -> torch.Tensor:
    """[T, G, k] int32 block ids that depend only on each token's position and the head: the local
    block, ids spread over every split of the context, a repeated id, an empty slot and an id past
    the token's own block (which the kernel ignores)."""
    p = positions.long()[:, None, None]
    nb = p // PS + 1
    j = torch.arange(k)[None, None, :]
    g = torch.arange(G)[None, :, None]
    ids = (j * nb // k + p * 3 + g) % nb  # spread evenly over the context
    ids = torch.where(j == 0, nb - 1, ids)
    ids = torch.where(j == 2, ids[:, :, 1:2].expand_as(ids), ids)  # a repeated id counts once
    ids = torch.where(j == k - 2, nb + 3, ids)  # past the token's block: ignored
    ids = torch.where(j == k - 1, -1, ids)  # an empty slot
    return ids.to(torch.int32)


def run(b: PagedBatch, sparse: bool) -> torch.Tensor:
    ids = engineered_ids(b.meta.positions) if sparse else None
    return ia.invariant_paged_attention(b.q, b.k, b.v, b.meta, SCALE, ids, sparse_impl=UNION)


_ALONE: dict = {}


def alone(name: str, sparse: bool) -> torch.Tensor:
    key = (name, sparse)
    if key not in _ALONE:
        _ALONE[key] = run(step([(name, 0, LENS[name])], 0), sparse)
    return _ALONE[key]


def assert_rows_equal(got, want, what: str) -> None:
    assert torch.equal(got, want), f"{what}: {int((got != want).sum())} elements differ"


SPLIT_KEYS = SPLIT_B * PS
DECODE_POS = [0, SPLIT_KEYS - 1, SPLIT_KEYS, SPLIT_KEYS + 1, 2 * SPLIT_KEYS + 7, 4 * SPLIT_KEYS - 1, LENS["a"] - 1]


def test_the_context_spans_several_splits():
    assert ia.ATTN_SPLIT_BLOCKS == SPLIT_B  # the module's split width is in force
    assert LENS["a"] // PS >= 4 * ia.ATTN_SPLIT_BLOCKS + 1  # 5 splits: the merge order is exercised


@pytest.mark.parametrize("sparse", [True, False], ids=["sparse", "dense"])
def test_split_matches_reference(sparse):
    b = step([("a", LENS["a"] - 1, 1), ("b", 100, 1), ("a", 0, 65), ("b", 50, 30)], 2)
    ids = engineered_ids(b.meta.positions) if sparse else None
    got = run(b, sparse)
    if sparse:  # the reference takes no id past the token's block
        ids = torch.where(ids > (b.meta.positions // PS)[:, None, None], -1, ids)
    want = paged_attention_ref(b.q, b.k, b.v, b.meta, SCALE, ids)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=0)


@pytest.mark.parametrize("pipelined", [True, False], ids=["pipelined_walk", "union_walk"])
@pytest.mark.parametrize("programs", [256, 3], ids=["program_per_split", "strided_programs"])
@pytest.mark.parametrize("sparse", [True, False], ids=["sparse", "dense"])
def test_split_decode_and_verify_rows_equal_prefill_rows(sparse, programs, pipelined, monkeypatch):
    # DECODE_PROGRAMS 3: one or two decode programs per tile, each taking several splits in turn;
    # DECODE_PIPELINE: one-token decode rows walk their sorted blocks in a pipelined loop, or the union
    monkeypatch.setattr(ia, "DECODE_PROGRAMS", programs)
    monkeypatch.setattr(ia, "DECODE_PIPELINE", pipelined)
    want = alone("a", sparse)
    one = run(step([("a", LENS["a"] - 1, 1)], 1, seed=5), sparse)
    assert_rows_equal(one, want[-1:], "batch 1 decode")
    got = run(step([("a", p, 1) for p in DECODE_POS], len(DECODE_POS), seed=1), sparse)
    assert_rows_equal(got, want[DECODE_POS], "decode vs prefill")
    # verify rows crossing a split edge and ending on one
    rows = [("a", SPLIT_KEYS - 2, 3), ("a", 3 * SPLIT_KEYS - 3, 3)]
    got = run(step(rows, 2, seed=2), sparse)
    idx = [p + i for _, p, _ in rows for i in range(3)]
    assert_rows_equal(got, want[idx], "verify vs prefill")


@pytest.mark.parametrize("sparse", [True, False], ids=["sparse", "dense"])
def test_split_chunked_prefill_and_batch_mix_equal_alone(sparse):
    want, want_b = alone("a", sparse), alone("b", sparse)
    # chunks ending inside a split, on a split edge and inside a page, three rows of one launch
    edges = [0, 50, SPLIT_KEYS, 3 * SPLIT_KEYS + 9, LENS["a"]]
    got = run(step([("a", lo, hi - lo) for lo, hi in zip(edges[:-1], edges[1:], strict=True)], 0, seed=3), sparse)
    assert_rows_equal(got, want, "chunked vs one chunk")
    # decode rows of a and b beside prefill rows (after a prefix hit), a wider table
    rows = [("b", LENS["b"] - 1, 1), ("a", LENS["a"] - 1, 1), ("b", 0, 40), ("a", 2 * SPLIT_KEYS + 3, 75)]
    b = step(rows, 2, table_width=24, seed=4)
    got = run(b, sparse)
    qsl = b.meta.query_start_loc.tolist()
    assert_rows_equal(got[qsl[0] : qsl[1]], want_b[-1:], "b's decode row in a mixed batch")
    assert_rows_equal(got[qsl[1] : qsl[2]], want[-1:], "a's decode row in a mixed batch")
    assert_rows_equal(got[qsl[2] : qsl[3]], want_b[:40], "b's prefill chunk")
    lo = 2 * SPLIT_KEYS + 3
    assert_rows_equal(got[qsl[3] : qsl[4]], want[lo : lo + 75], "a's chunk after a prefix hit")
    # decode rows with CUDA-graph padding rows
    padded = run(step([("a", LENS["a"] - 1, 1), ("b", 75, 1)], 2, pad_rows=3, table_width=32, seed=6), sparse)
    assert_rows_equal(padded[:2], torch.cat([want[-1:], want_b[75:76]]), "decode with padding rows")


def test_split_sparse_with_every_block_selected_equals_dense():
    # every causal block selected (K = 32 >= 20 blocks, ids in a position-dependent order): the
    # sparse walk visits the dense layer's pages in the dense order, split for split
    b = step([("a", 0, LENS["a"])], 0)
    p = b.meta.positions.long()
    k = torch.arange(32)
    nb = (p // PS + 1)[:, None]
    ids = torch.where(k[None, :] < nb, (k[None, :] + 3 * p[:, None]) % nb, -1)  # a rotation of 0..nb-1
    ids = ids[:, None, :].expand(-1, G, -1).to(torch.int32).contiguous()
    # the union walk only: page partials (the default) reduce per page and merge, other bits
    got = ia.invariant_paged_attention(b.q, b.k, b.v, b.meta, SCALE, ids, sparse_impl=UNION)
    assert_rows_equal(got, alone("a", False), "sparse (all blocks) vs dense")
    dec = step([("a", LENS["a"] - 1, 1)], 1, seed=7)
    ids1 = ids[-1:].clone()
    dec_out = ia.invariant_paged_attention(dec.q, dec.k, dec.v, dec.meta, SCALE, ids1, sparse_impl=UNION)
    assert_rows_equal(dec_out, got[-1:], "decode")


@pytest.mark.parametrize("sparse_impl", [UNION, "page_partials"])
def test_non_contiguous_ids_give_the_contiguous_ids_bits(sparse_impl):
    """The kernels read a token's K slots at unit stride: a transposed view of the same ids (strides
    (8, 1, 2)) must be copied, not read as laid out (it was, giving another selection's output);
    both sparse attentions."""
    b = step([("a", LENS["a"] - 1, 1), ("b", 75, 1)], 2, seed=7)
    ids = engineered_ids(b.meta.positions)
    strided = ids.transpose(1, 2).contiguous().transpose(1, 2)
    assert torch.equal(strided, ids) and not strided.is_contiguous()
    want = ia.invariant_paged_attention(b.q, b.k, b.v, b.meta, SCALE, ids, sparse_impl=sparse_impl)
    got = ia.invariant_paged_attention(b.q, b.k, b.v, b.meta, SCALE, strided, sparse_impl=sparse_impl)
    assert_rows_equal(got, want, "strided ids")

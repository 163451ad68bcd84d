"""Sparse attention by per-page partials (``sparse_impl="page_partials"``) on CPU.

kernels/invariant_page_partials.py: prefill rows take the fast KV-major path (kv_seg_attn_kernel +
``kv_major_merge_kernel``) at every length with one launch set; decode rows one program per
(token, KV head, slot) entry running kv_seg's loop on a one-entry tile, then the same merge. Checked
under the Triton interpreter in fp32 (and fp16) with ``msa_interpret.fixed_order_dot`` (the
interpreter's BLAS dot is not row-invariant, a GPU tensor-core dot of a fixed shape is assumed to
be: tests/gpu checks that), the kernels called with ``sparse_impl="page_partials"``:
- a decode row's output is bitwise the prefill row's at its position (one chunk, several chunks,
  speculative-verify rows), with engineered selections holding repeats, -1 slots and ids past the
  token's block;
- a sequence's prefill rows are bitwise the same alone and beside other sequences, decode rows,
  a prefix hit, graph padding rows, a wider block table, and in passes of a small scratch;
- outputs equal the PyTorch reference within fp32 / fp16 tolerance (also ``invariant_msa_attention``);
- the choice is the default (a call or table that names none runs it) and dense layers ignore
  it; ``sparse_impl="union"`` keeps the union walk; an ops table built with it
  (``invariant_sparse_attention``) keeps it and takes the KV-major scratch, and the engine and the
  trainer's ``PagedScorer`` bind one, at every prefill length;
- compiled for sm_90 (no GPU, kernels/mma_check.py), the decode kernel's dots are the prefill
  kernel's: the same MMA layout, operand types and wgmma instructions;
- metadata that does not describe q's tokens, a strided head dim or a misaligned scratch are
  refused with ValueErrors naming the op;
- end to end, the engine's sampled logprobs of a sequence are bitwise the same alone, batched
  in padded decode steps, chunked and after a prefix hit (that they equal the trainer scorer's:
  tests/test_trainer_invariant_scoring.py).
Shapes: 8 q heads / 2 KV heads / d 32 / block 16 (RH 4: tiles of 4 entries x 4 rows).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from paged_model_util import small_paged_model  # tests/ on sys.path

from m3_kernels.msa_interpret import fixed_order_dot, interpreted_invariant_attention
from m3_kernels.msa_synthetic import PagedBatch, make_paged_batch, make_step_batch, random_sequences
from m3_kernels.paged_layout import KV_CHUNK_TOKENS, KV_MAJOR_MIN_TOKENS, kv_major_token_bytes
from m3_rollout.engine.config import EngineConfig
from m3_rollout.engine.engine import LLMEngine
from m3_rollout.engine.ops import bind_prefill_scratch, interpreted_paged_ops, invariant_attention_fields
from m3_rollout.engine.reference_ops import index_topk_ref, msa_attention_ref, paged_attention_ref
from m3_rollout.engine.score import PagedScorer
from m3_rollout.model.paged_ops import PagedOps

ia = interpreted_invariant_attention()

ROOT = Path(__file__).resolve().parents[1]
PP = "page_partials"
PS, G, NH, D, K = 16, 2, 8, 32, 5
SCALE = D**-0.5
ATOL = {torch.float32: 2e-5, torch.float16: 3e-3}
LENS = {"a": 100, "b": 45, "c": 60}  # a: 7 blocks, b: 3, c: 4 (3 valid distinct ids of K = 5 at most)
DECODE_POS = [0, 15, 16, 47, 48, 79, 80, 99]


@pytest.fixture(autouse=True, scope="module")
def _row_invariant_dot():
    with fixed_order_dot():
        yield


def engineered_ids(positions: torch.Tensor) -> torch.Tensor:
    """[T, G, K] int32 ids from the position and head only: the own block first, ids spread over the
    context, a repeat of slot 1 at slot 2, an id past the token's block, a -1 slot."""
    p = positions.long()[:, None, None]
    nb = p // PS + 1
    j = torch.arange(K)[None, None, :]
    g = torch.arange(G)[None, :, None]
    ids = (j * nb // K + p * 3 + g) % nb
    ids = torch.where(j == 0, nb - 1, ids)
    ids = torch.where(j == 2, ids[:, :, 1:2].expand_as(ids), ids)
    ids = torch.where(j == K - 2, nb + 3, ids)
    ids = torch.where(j == K - 1, -1, ids)
    return ids.to(torch.int32)


def for_reference(ids: torch.Tensor, b: PagedBatch) -> torch.Tensor:
    """ids with those past the token's block as -1 (the kernels ignore them; the reference cannot index them)."""
    return torch.where(ids > (b.meta.positions // PS).view(-1, 1, 1), -1, ids)


_SEQS: dict = {}


def seqs(dtype):
    if dtype not in _SEQS:
        _SEQS[dtype] = random_sequences(LENS, kv_heads=G, q_heads=NH, head_dim=D, index_dim=D, dtype=dtype, seed=7)
    return _SEQS[dtype]


def step(dtype, rows: list, num_decodes: int, **kw) -> PagedBatch:
    return make_step_batch(seqs(dtype), rows, num_decodes, page_size=PS, **kw)


def run(b: PagedBatch, scratch=None) -> torch.Tensor:
    ids = engineered_ids(b.meta.positions)
    return ia.invariant_paged_attention(b.q, b.k, b.v, b.meta, SCALE, ids, scratch=scratch, sparse_impl=PP)


def scratch_of(tokens: int, dtype, extra: int = 0) -> torch.Tensor:
    return torch.full((tokens * kv_major_token_bytes(NH, D, K, dtype) + extra,), 0x5A, dtype=torch.uint8)


_ALONE: dict = {}


def alone(dtype, name: str) -> torch.Tensor:
    if (dtype, name) not in _ALONE:
        _ALONE[dtype, name] = run(step(dtype, [(name, 0, LENS[name])], 0))
    return _ALONE[dtype, name]


def assert_rows_equal(got, want, what: str) -> None:
    assert torch.equal(got, want), f"{what}: {int((got != want).sum())} elements differ"


def test_decode_rows_equal_prefill_rows():
    dtype = torch.float32
    want = alone(dtype, "a")
    chunked = run(step(dtype, [("a", 0, 40), ("a", 40, 24), ("a", 64, 36)], 0, seed=3))  # edges in / on a block
    assert_rows_equal(chunked, want, "several chunks vs one")
    dec = run(step(dtype, [("a", p, 1) for p in DECODE_POS], len(DECODE_POS), seed=1))
    assert_rows_equal(dec, want[DECODE_POS], "decode rows vs prefill rows")
    for pos in (DECODE_POS[3], DECODE_POS[-1]):  # one decode row alone (a batch-1 decode step)
        assert_rows_equal(run(step(dtype, [("a", pos, 1)], 1, seed=1)), want[[pos]], f"decode row {pos} alone")
    verify = run(step(dtype, [("a", 61, 3), ("a", 95, 3)], 2, seed=2))  # decode_query_len 3
    assert_rows_equal(verify, want[[61, 62, 63, 95, 96, 97]], "verify rows vs prefill rows")


def test_prefill_rows_alone_equal_batched_and_in_scratch_passes():
    dtype = torch.float32
    want_a, want_b = alone(dtype, "a"), alone(dtype, "b")  # one pass each, buffers of their own
    # decode rows, a CUDA-graph padding row, then b fresh and a after a 70-token prefix hit; a wider
    # table; the caller's scratch: 16-token prefill passes, the decode partials in its head
    rows = [("c", 59, 1), ("a", 99, 1), ("b", 0, 45), ("a", 70, 30)]
    b = step(dtype, rows, 2, table_width=12, pad_rows=1, seed=4)
    scratch = scratch_of(16, dtype)
    got = run(b, scratch)
    assert (scratch != 0x5A).any()
    qsl = b.meta.query_start_loc.tolist()  # rows: c, a, padding, b, a
    sl = [slice(x, y) for x, y in zip(qsl[:-1], qsl[1:])]
    assert_rows_equal(got[sl[1]], want_a[99:100], "a's decode row beside others")
    assert_rows_equal(got[sl[3]], want_b, "b beside others, in 16-token passes")
    assert_rows_equal(got[sl[4]], want_a[70:100], "a's chunk after a prefix hit")
    # a scratch too small for one token: the path cannot be off, its buffers come per call
    assert_rows_equal(run(b, scratch_of(0, dtype, extra=7)), got, "scratch holding no token")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_matches_reference(dtype):
    b = make_paged_batch(
        [(40, 3), (300, 3), (20, 20), (0, 30)], 2,
        page_size=PS, kv_heads=G, q_heads=NH, head_dim=D, index_dim=D, dtype=dtype, seed=5,
    )  # fmt: skip
    ids = engineered_ids(b.meta.positions)
    got = ia.invariant_paged_attention(b.q, b.k, b.v, b.meta, SCALE, ids, sparse_impl=PP)
    want = paged_attention_ref(b.q, b.k, b.v, b.meta, SCALE, for_reference(ids, b))
    torch.testing.assert_close(got.float(), want.float(), atol=ATOL[dtype], rtol=0)
    if dtype != torch.float32:
        return
    got = ia.invariant_msa_attention(b.q, b.iq, b.k, b.v, b.ik, b.meta, SCALE, 4, sparse_impl=PP)  # top-k, attention
    want = msa_attention_ref(b.q, b.iq, b.k, b.v, b.ik, b.meta, SCALE, 4)
    assert (index_topk_ref(b.iq, b.ik, b.meta, 4)[3] >= 0).all()  # position 300: 4 of 19 blocks selected
    torch.testing.assert_close(got.float(), want.float(), atol=ATOL[dtype], rtol=0)


def test_choice_is_the_default_and_dense_layers_ignore_it(monkeypatch):
    """Page partials are the default (issue 24's 32K-prefill target met; GPU-checked on an H100,
    2026-12-05): a call that names no ``sparse_impl`` runs them, with their bits; "union" does not;
    dense layers take the union kernel whatever the choice."""
    b = step(torch.float32, [("c", 59, 1), ("b", 29, 16)], 1)  # b's chunk crosses a block edge
    dense = ia.invariant_paged_attention(b.q, b.k, b.v, b.meta, SCALE, sparse_impl=PP)
    assert ia.DEFAULT_SPARSE_IMPL == PP and ia.SPARSE_IMPLS == ("union", PP)
    assert not hasattr(ia, "SPARSE_IMPL")  # no module global decides
    assert invariant_attention_fields(interpret=True)["takes_prefill_scratch"]
    ids = engineered_ids(b.meta.positions)
    want = paged_attention_ref(b.q, b.k, b.v, b.meta, SCALE, for_reference(ids, b))
    pp = ia.invariant_paged_attention(b.q, b.k, b.v, b.meta, SCALE, ids, sparse_impl=PP)
    calls = []
    real = ia.page_partials_attention
    monkeypatch.setattr(ia, "page_partials_attention", lambda *a: calls.append(1) or real(*a))
    default = ia.invariant_paged_attention(b.q, b.k, b.v, b.meta, SCALE, ids)
    assert calls and torch.equal(default, pp)  # the default ran page partials, their bits
    calls.clear()
    union = ia.invariant_paged_attention(b.q, b.k, b.v, b.meta, SCALE, ids, sparse_impl="union")
    assert not calls and not torch.equal(union, pp)  # the union walk: other bits on this batch
    for got in (default, union):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=0)
    assert_rows_equal(ia.invariant_paged_attention(b.q, b.k, b.v, b.meta, SCALE), dense, "dense layer")
    assert not calls  # dense layers never take page partials
    with pytest.raises(ValueError, match="sparse_impl='pages'"):
        ia.invariant_paged_attention(b.q, b.k, b.v, b.meta, SCALE, ids, sparse_impl="pages")
    for device in ("cpu", "cuda"):  # refused before any device rule (the CPU falls back to references)
        with pytest.raises(ValueError, match="invariant_sparse_attention='pages'"):
            invariant_attention_fields(device, invariant_sparse_attention="pages")
    with pytest.raises(ValueError, match="invariant_sparse_attention='pages'"):
        invariant_attention_fields(interpret=True, invariant_sparse_attention="pages")
    with pytest.raises(ValueError, match="invariant_paged_attention: scratch must be a contiguous uint8"):
        ia.invariant_paged_attention(b.q, b.k, b.v, b.meta, SCALE, ids, scratch=torch.zeros(8, dtype=torch.int32))


def test_bad_inputs_are_refused_naming_the_op():
    """Metadata that does not describe q's tokens (the kernels index positions / tables by token and
    row: before, fewer tokens ran silently, more read past the positions: a torch shape error with
    page partials, out-of-bounds reads with the union walk), q without a unit head-dim stride (the
    error named the caches) and a scratch whose fp32 views cannot start 4-byte aligned: ValueErrors
    naming the op, for both choices, before any launch."""
    b = step(torch.float32, [("c", 59, 1), ("b", 0, 45)], 1)
    ids = engineered_ids(b.meta.positions)
    t = b.q.shape[0]
    for impl in (PP, "union"):  # (before: the union walk's out-of-bounds reads could crash the process)

        def attn(q, meta=b.meta, sel=None, scratch=None, impl=impl):
            sel = ids[: q.shape[0]] if sel is None else sel
            return ia.invariant_paged_attention(q, b.k, b.v, meta, SCALE, sel, scratch=scratch, sparse_impl=impl)

        for q in (b.q[: t - 1], torch.cat([b.q, b.q[:1]])):  # one token fewer / more than the metadata's
            sel = torch.cat([ids, ids[:1]])[: q.shape[0]]
            with pytest.raises(ValueError, match=r"invariant_paged_attention: metadata of \(46,\) positions.*T=4[57]"):
                attn(q, sel=sel)
        with pytest.raises(ValueError, match=r"invariant_index_scores: metadata of \(46,\) positions.*T=45"):
            ia.invariant_msa_attention(b.q[1:], b.iq[1:], b.k, b.v, b.ik, b.meta, SCALE, K, sparse_impl=impl)
        for bad in ({"num_decodes": 3}, {"decode_query_len": 47}):  # more decode rows / tokens than there are
            with pytest.raises(ValueError, match="invariant_paged_attention: metadata of"):
                attn(b.q, meta=dataclasses.replace(b.meta, **bad))
        narrow = dataclasses.replace(b.meta, block_tables=b.meta.block_tables[:1])
        with pytest.raises(ValueError, match=r"block_tables \(1, 4\).*2 rows"):
            attn(b.q, meta=narrow)
        q_strided = b.q.transpose(1, 2).contiguous().transpose(1, 2)
        with pytest.raises(ValueError, match=r"invariant_paged_attention: q \(46, 8, 32\).*unit stride"):
            attn(q_strided)
        with pytest.raises(ValueError, match="invariant_paged_attention: scratch must start 4-byte aligned"):
            attn(b.q, scratch=scratch_of(64, torch.float32, extra=1)[1:])
    assert_rows_equal(attn(b.q, scratch=scratch_of(64, torch.float32, extra=4)[4:]), attn(b.q), "aligned slice")


@pytest.mark.parametrize("built", ["union", PP])
def test_table_keeps_the_sparse_attention_it_was_built_with(built, monkeypatch):
    """``invariant_attention_fields(invariant_sparse_attention=...)`` binds the choice into the table's
    ops: they take its path (whether page_partials_attention runs) and its bits, which differ from
    the other choice's on this batch, also with a scratch bound as the engine binds one."""
    fields = invariant_attention_fields(interpret=True, invariant_sparse_attention=built)
    pp = built == PP
    assert fields["takes_prefill_scratch"] == pp
    assert fields["paged_attention"].keywords["sparse_impl"] == fields["msa_attention"].keywords["sparse_impl"] == built
    flipped = "union" if pp else PP
    calls = []
    real = ia.page_partials_attention
    monkeypatch.setattr(ia, "page_partials_attention", lambda *a: calls.append(1) or real(*a))

    def ran_page_partials(fn, *args, **kw):
        calls.clear()
        out = fn(*args, **kw)
        return out, bool(calls)

    b = step(torch.float32, [("c", 59, 1), ("a", 99, 1), ("b", 29, 16)], 2)  # b's chunk crosses a block edge
    ids = engineered_ids(b.meta.positions)
    attn = (b.q, b.k, b.v, b.meta, SCALE, ids)
    want, ran = ran_page_partials(ia.invariant_paged_attention, *attn, sparse_impl=built)
    assert ran == pp
    other, ran = ran_page_partials(ia.invariant_paged_attention, *attn, sparse_impl=flipped)
    assert ran != pp and not torch.equal(want, other)  # the two paths' bits differ on this batch
    got, ran = ran_page_partials(fields["paged_attention"], *attn)
    assert ran == pp
    assert_rows_equal(got, want, f"paged_attention of a table built with {built}")
    msa = (b.q, b.iq, b.k, b.v, b.ik, b.meta, SCALE, 3)
    want, _ = ran_page_partials(ia.invariant_msa_attention, *msa, sparse_impl=built)
    got, ran = ran_page_partials(fields["msa_attention"], *msa)
    assert ran == pp
    assert_rows_equal(got, want, f"msa_attention of a table built with {built}")
    if pp:  # as the engine binds its scratch: the choice survives bind_prefill_scratch
        bound = bind_prefill_scratch(PagedOps(**fields), scratch_of(64, torch.float32))
        got, ran = ran_page_partials(bound.msa_attention, *msa)
        assert ran and bound.msa_attention.keywords["sparse_impl"] == built
        assert_rows_equal(got, want, "msa_attention with a bound scratch")


def test_engine_and_scorer_bind_a_scratch_for_every_prefill_length():
    """Built with page partials the invariant table takes the KV-major scratch: the engine sizes it
    for one step's prefill even below KV_MAJOR_MIN_TOKENS (this path runs at every length), the
    trainer's scorer binds one of its own for its forwards; both reach the attention ops."""
    fields = invariant_attention_fields(interpret=True, invariant_sparse_attention=PP)
    assert fields["takes_prefill_scratch"] and fields["msa_attention"].func is ia.invariant_msa_attention
    table = dataclasses.replace(interpreted_paged_ops(batch_invariant=True), **fields)
    model = small_paged_model(0, vocab_size=96, head_dim=16, page_size=PS, layers=2)
    cfg = model.config
    per_token = kv_major_token_bytes(cfg.num_attention_heads, cfg.head_dim, cfg.sparse_topk_blocks, torch.float32)
    ecfg = EngineConfig(max_model_len=40, max_num_seqs=4, num_pages=20, max_num_batched_tokens=16, batch_invariant=True)
    assert ecfg.max_num_batched_tokens < KV_MAJOR_MIN_TOKENS
    engine = LLMEngine(model, ecfg, ops=table)
    assert engine.prefill_scratch.numel() == 16 * per_token
    assert engine.runner.ops.paged_attention.keywords["scratch"] is engine.prefill_scratch
    scorer = PagedScorer(cfg, table, 40, 11, torch.float32, "cpu")
    assert scorer.prefill_scratch.numel() == min(11, KV_CHUNK_TOKENS) * per_token
    assert scorer.ops.msa_attention.keywords["scratch"] is scorer.prefill_scratch
    assert not scorer.ops.takes_prefill_scratch


def test_decode_kernel_compiles_to_the_prefill_kernels_tensor_core_code():
    """bf16 at M3 shapes for sm_90 (a subprocess: the kernels must be compiled, not interpreted): the
    interpreter cannot tell a 64-row wgmma from a 16-row mma.sync, so a decode kernel that the
    compiler lowered to other instructions than kv_seg_attn_kernel would pass the bitwise tests above
    and fail on the GPU; this catches it on the CPU (what the same instructions give is for tests/gpu)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, "-m", "m3_kernels.mma_check"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr[-3000:]
    code = json.loads(run.stdout.strip().splitlines()[-1])
    seg, dec = code["kv_seg_attn_kernel/bf16"], code["pp_decode_kernel/bf16"]
    assert dec == seg
    assert seg["layouts"] and all("versionMajor = 3" in layout for layout in seg["layouts"])  # wgmma (Hopper)
    assert len(seg["dots"]) == 2  # QK (q and K from shared memory) and PV (probabilities in registers)
    assert seg["instructions"] and all(i.startswith("wgmma.mma_async") for i in seg["instructions"])


def test_engine_sequence_bits_alone_batched_chunked_after_a_prefix_hit_and_padded(monkeypatch):
    """The engine in batch-invariant mode with page partials (the interpreted invariant table, its
    KV-major scratch bound): sequence a's sampled tokens and logprobs (prompt 34 tokens > top-k 2 x
    block 16, so the sparse layer selects) are bitwise the same generated alone, beside b and c in
    the staged decode path padded to 4 rows (CUDA-graph padding rows, run eagerly), with its prefill
    chunked by 16 tokens (a 16-token scratch), and after a prefix-cache hit on its first two pages.
    Every token costs under the interpreter: b and c are short, "alone" is the prefix-cache run's
    first wave (a by itself on an empty cache), one run has both the other sequences and the padding
    rows. That the trainer's ``PagedScorer`` on this table gives the engine's logprobs (decode rows
    = prefill rows at the engine level): tests/test_trainer_invariant_scoring.py."""
    import m3_rollout.engine.engine as engine_mod
    from m3_kernels.fused_interpret import interpreted_invariant_ops
    from m3_rollout.engine.interface import GenerationRequest, SampleOutput, SamplingParams

    fields = invariant_attention_fields(interpret=True, invariant_sparse_attention=PP)
    table = dataclasses.replace(interpreted_paged_ops(batch_invariant=True), **fields)
    model = small_paged_model(0, vocab_size=96, head_dim=16, page_size=PS, layers=2)
    gen = torch.Generator().manual_seed(5)
    prompts = {n: torch.randint(0, 96, (ln,), generator=gen).tolist() for n, ln in (("a", 34), ("b", 4), ("c", 6))}
    params = SamplingParams(temperature=0.9, max_new_tokens=3, seed=3)
    metas = []  # (decode rows, prefill context lengths) of every page-partials call
    real = ia.page_partials_attention

    def spy(*args):
        meta = args[3]
        metas.append((meta.num_decodes, meta.context_lens[meta.num_decodes :].tolist()))
        return real(*args)

    def generate(waves, **kw):
        cfg = {"max_model_len": 48, "max_num_seqs": 4, "num_pages": 24, "max_num_batched_tokens": 64, **kw}
        engine = LLMEngine(model, EngineConfig(batch_invariant=True, **cfg), ops=table)
        per_token = kv_major_token_bytes(4, 16, 2, torch.float32)
        assert engine.prefill_scratch.numel() == cfg["max_num_batched_tokens"] * per_token
        done = {}
        for wave in waves:
            for rid, name in wave:
                engine.add_request(GenerationRequest(rid, prompts[name], params))
            while engine.has_unfinished():
                outs = [o for o in engine.step() if isinstance(o, SampleOutput)]
                done.update({o.request_id: (o.output_ids, o.logprobs) for o in outs})
        return done

    inv = interpreted_invariant_ops()  # CPU: the engine keeps torch's logprob op (the invariant one is CUDA only)
    monkeypatch.setattr(engine_mod, "invariant_token_logprobs", lambda device: inv.token_logprobs)
    monkeypatch.setattr(ia, "page_partials_attention", spy)
    n_a = len(prompts["a"])
    prefix_run = generate([[("a1", "a")], [("a2", "a"), ("b", "b")]], enable_prefix_caching=True)
    want, got = prefix_run["a1"], {"prefix hit": prefix_run["a2"]}  # a1: a alone (the first wave, no hit)
    assert len(want[0]) == 3 and [0] in [ctx for _, ctx in metas]  # a1's prefill: from 0, alone
    assert any(ctx in ([32, 0], [0, 32]) for _, ctx in metas)  # a2's beside b, after two cached pages
    metas.clear()
    padded = {"enable_cuda_graphs": "eager", "cuda_graph_batch_sizes": (4,)}
    got["batched, padded"] = generate([[("b", "b"), ("a", "a"), ("c", "c")]], **padded)["a"]
    assert (4, []) in metas  # decode steps of 3 live rows padded to 4
    metas.clear()
    got["chunked"] = generate([[("a", "a")]], max_num_batched_tokens=16)["a"]
    assert any(0 < c < n_a for _, ctx in metas for c in ctx)  # a prefill chunk after earlier ones
    assert [what for what, out in got.items() if out != want] == []  # every run whose a differs

"""Engine features built and tested on the CPU, on a CUDA GPU: prompt logprobs scored in the
prefill (``SamplingParams.prompt_logprobs``), the sampler's top-logprob lists
(``SamplingParams.top_logprobs``), and presence / frequency / repetition penalties and logit_bias.
On the GPU they run through the Triton paged kernels, the captured decode graphs (fused sampler)
and async scheduling, none of which the CPU tests reach. Skipped without CUDA.

Model: the bench config (configs/bench/m3_bench_300m.json: V 32000, page = block 128) cut to 2
layers (one dense-attention, one sparse), random weights; prompts of 60-300 tokens.

Tolerances. fp32: the engine's values against a plain PyTorch forward of the same tokens
(``LLMEngine.top_logprobs``, the server's scoring path) within 1e-4 (two forward paths in fp32,
IEEE dots in the Triton kernels). With 32000 random logits a rank or a top-list order can flip on
a near tie (two logits closer than the paths' difference), so :func:`_check_top` lets two entries
swap only when their values are within the tolerance, and a rank may move only over tokens whose
raw logits lie within 1e-5 of the token's own (:func:`_rank_bounds`); without near ties both are
exact. The number of exact ranks / lists is printed. bf16 in batch-invariant mode: bitwise.

The helpers take the model (any device) so the same checks run on a small CPU model.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("TRITON_INTERPRET=1 in this process; run tests/gpu alone", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the CPU tests' helpers

from test_engine_async import _drive  # noqa: E402  run requests to the end, pages freed
from test_engine_gpu import _get_model, _model  # noqa: E402  tests/gpu: the 2-layer bench model on cuda
from test_sampler_penalties import _direct  # noqa: E402  one row's penalties + bias in plain torch

from m3_kernels import invariant_ops as inv  # noqa: E402
from m3_rollout.engine.config import EngineConfig  # noqa: E402
from m3_rollout.engine.engine import LLMEngine  # noqa: E402
from m3_rollout.engine.interface import GenerationRequest, SamplingParams  # noqa: E402
from m3_rollout.engine.ops import invariant_token_logprobs, paged_ops_for  # noqa: E402
from m3_rollout.engine.score import PagedScorer  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TOL = 1e-4
RANK_TOL = 1e-5  # raw logits of the two fp32 paths differ far less (sums over 1024-wide rows)
EXTRA = 10  # reference lists this many entries past k, so a token swapped in on a near tie is found
MAX_LEN = 512


def _prompt(n, seed, vocab):
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _engine(model, graphs, async_mode, budget, ops=None, **kw):
    """An engine holding 16 samples of MAX_LEN tokens; ``graphs``: EngineConfig.enable_cuda_graphs
    (True on CUDA; "eager" runs the same staged decode path on any device)."""
    pages = 16 * -(-MAX_LEN // model.config.sparse_block_size)
    cfg = EngineConfig(
        max_model_len=MAX_LEN,
        max_num_seqs=16,
        num_pages=pages,
        max_num_batched_tokens=budget,
        enable_cuda_graphs=graphs,
        cuda_graph_batch_sizes=(4, 16),
        async_scheduling=async_mode,
        **kw,
    )
    return LLMEngine(model, cfg, ops=ops)


def _check_top(got, want, k, tol):
    """A top list ``got`` [(id, logprob)] of length min(k, kept) against a longer reference list
    ``want`` (k + EXTRA entries of the same distribution, most likely first): the i-th values
    agree within ``tol`` and each listed id is one of the reference's with its value within
    ``tol`` (ids may differ from the reference's order only among values within ``tol``).
    Returns whether the ids were the reference's in its order."""
    assert len(got) == min(k, len(want)), (len(got), k, len(want))
    ref = dict(want)
    for (t, v), (_, wv) in zip(got, want):
        assert abs(v - wv) <= tol, (t, v, wv)
        assert t in ref and abs(ref[t] - v) <= tol, (t, v, ref.get(t))
    return [t for t, _ in got] == [t for t, _ in want[: len(got)]]


def _rank_bounds(logits, target, tol):
    """(lowest, highest) 1-based rank of ``target`` among ``logits`` [V] (ties counted before it,
    vLLM's rule) when every logit may move by ``tol``."""
    own = logits[target]
    return int((logits > own + tol).sum()) + 1, int((logits >= own - tol).sum())


def check_prompt_logprobs(model, graphs, async_mode, budget=64, tol=TOL, rank_tol=RANK_TOL):
    """Prompt logprobs of a chunked prefill (``budget`` tokens per step) against the scoring
    forward; returns (exact ranks, top lists with the reference's ids in order, positions)."""
    v = model.config.vocab_size
    spec = [  # (id, prompt length, params); "e" does not ask
        ("a", 181, dict(n=2, temperature=0.7, prompt_logprobs=3)),
        ("b", 250, dict(temperature=1.3, top_k=40, prompt_logprobs=5)),
        ("c", 97, dict(top_p=0.9, logprobs_mode="raw", prompt_logprobs=4)),
        ("d", 129, dict(top_p=0.8, prompt_logprobs=0)),
        ("e", 60, dict(n=2)),
    ]
    reqs = [
        GenerationRequest(rid, _prompt(n, i, v), SamplingParams(seed=10 + i, max_new_tokens=8 + 2 * i, **p), 10 * i)
        for i, (rid, n, p) in enumerate(spec)
    ]
    eng = _engine(model, graphs, async_mode, budget)
    outs = _drive(eng, reqs)
    if graphs:
        assert eng.stats.graph_steps > 0  # decode steps still ran on the decode graphs
    if async_mode:
        assert eng.stats.device_input_rows > 0
    assert len(outs) == 7
    exact = [0, 0, 0]
    with torch.no_grad():
        for r in reqs[:4]:
            o, p, k = outs[(r.request_id, r.sample_index)], r.prompt_ids, r.params.prompt_logprobs
            got = o.prompt_logprobs
            assert len(got) == len(p) and got[0] is None and o.prompt_weight_writes == [0] * (len(p) - 1)
            want = eng.top_logprobs(p, 1, k + EXTRA, *r.params.logprob_filters(), with_tokens=True)
            logits = model(torch.tensor([p[:-1]], device=eng.device))[0].to(torch.float64)  # [P - 1, V] raw
            for i, (g, w) in enumerate(zip(got[1:], want, strict=True)):
                assert abs(g.logprob - w.logprob) <= tol or g.logprob == w.logprob == float("-inf"), (r.request_id, i)
                lo, hi = _rank_bounds(logits[i], p[i + 1], rank_tol)
                assert lo <= g.rank <= hi, (r.request_id, i, g.rank, lo, hi, w.rank)
                exact[0] += g.rank == w.rank
                exact[1] += _check_top(g.top, w.top, k, tol)
            exact[2] += len(p) - 1
    assert outs[("a", 0)].prompt_logprobs == outs[("a", 1)].prompt_logprobs  # scored once for the group
    assert all(len(e.top) == 4 for e in outs[("c", 20)].prompt_logprobs[1:])  # raw: no filter removes any
    assert all(e.top == [] for e in outs[("d", 30)].prompt_logprobs[1:])  # k = 0: logprob and rank only
    assert any(e.logprob == float("-inf") for e in outs[("d", 30)].prompt_logprobs[1:])  # top-p 0.8 drops some
    assert all(outs[("e", 40 + j)].prompt_logprobs is None for j in range(2))
    return tuple(exact)


def _pos_equal(a, b, tol=1e-6):
    """Two prompt-logprob lists: own logprobs and ranks bitwise; top lists (``torch.log_softmax``
    of the processed row, not claimed invariant) of equal length, values within ``tol``, an id in
    both with values within ``tol``. Returns whether the top lists were bitwise equal too."""
    assert len(a) == len(b) and a[0] is None and b[0] is None
    assert [(e.logprob, e.rank) for e in a[1:]] == [(e.logprob, e.rank) for e in b[1:]]
    for x, y in zip(a[1:], b[1:]):
        assert len(x.top) == len(y.top)
        assert all(abs(u - w) <= tol for (_, u), (_, w) in zip(x.top, y.top))
        ref = dict(y.top)
        assert all(abs(u - ref[t]) <= tol for t, u in x.top if t in ref)
    return a == b


def check_invariant_prompt_logprobs(
    model, graphs, budgets=(4096, 64), target_len=300, other_len=100, ops=None, token_logprobs=None
):
    """Batch-invariant mode: a ``target_len``-token prompt's prompt logprobs (temperature 1, no
    filters) alone and beside 7 other prompts (``other_len`` tokens and up), with each step budget
    of ``budgets`` (one prefill chunk, then several); and the trainer's ``PagedScorer`` of the
    prompt packed after another sequence. ``ops`` / ``token_logprobs``:
    None = the engine's own table and op (CUDA), and ``paged_ops_for(..., batch_invariant=True)``
    / ``invariant_token_logprobs`` for the scorer; a CPU check passes the interpreted ones.
    Returns whether every run's top lists were bitwise equal to the first's."""
    v, dev = model.config.vocab_size, model.lm_head.weight.device
    dtype = model.lm_head.weight.dtype
    target = _prompt(target_len, 7, v)
    others = [_prompt(other_len + other_len * i // 4, 20 + i, v) for i in range(7)]
    params = SamplingParams(temperature=1.0, prompt_logprobs=2, seed=3, max_new_tokens=6)
    runs, bitwise_tops = {}, True
    for budget in budgets:
        eng = _engine(model, graphs, True, budget, ops=ops, batch_invariant=True)
        if token_logprobs is not None:  # CPU: the engine takes torch's (the invariant op is CUDA only)
            eng.runner.token_logprobs = token_logprobs
            if eng.runner.graphs is not None:
                eng.runner.graphs.token_logprobs = token_logprobs
        t = GenerationRequest("t", target, params)
        side = [GenerationRequest(f"o{i}", p, SamplingParams(seed=i, max_new_tokens=6)) for i, p in enumerate(others)]
        for reqs in ([t], side[:2] + [t] + side[2:]):  # alone, then third of eight
            runs[(budget, len(reqs))] = _drive(eng, reqs)[("t", 0)]
        assert not graphs or eng.stats.graph_steps > 0
    first = runs[(budgets[0], 1)]
    for key, o in runs.items():
        bitwise_tops &= _pos_equal(o.prompt_logprobs, first.prompt_logprobs)
        assert o.output_ids == first.output_ids and o.logprobs == first.logprobs, key
    scorer_ops = ops if ops is not None else paged_ops_for(dev, dtype, batch_invariant=True)
    scorer_lp = token_logprobs if token_logprobs is not None else invariant_token_logprobs(dev)
    scorer = PagedScorer(model.config, scorer_ops, MAX_LEN, 4096, dtype, dev, token_logprobs=scorer_lp)
    scored = scorer(model, [others[3], target], 1.0)[1][1:].cpu()  # [P - 1], entry i = prompt token i + 1
    got = torch.tensor([e.logprob for e in first.prompt_logprobs[1:]], dtype=torch.float64).to(scored.dtype)
    assert torch.equal(got, scored), (got - scored).abs().max()
    return bitwise_tops


def _sampled_reference(eng, o, params, k):
    """Per generated token of ``o`` the reference top list (k + EXTRA entries) of the distribution
    the sampler drew it from: the scoring forward (``LLMEngine.top_logprobs``) with the request's
    filters, or raw; for a penalised "processed" request the plain forward's logits with the
    penalties and biases applied by ``test_sampler_penalties._direct`` (fp64, no filters)."""
    p = o.prompt_ids
    if not (params.penalized and params.logprobs_mode == "processed"):
        return eng.top_logprobs(p + o.output_ids, len(p), k + EXTRA, *params.logprob_filters())
    with torch.no_grad():
        logits = eng.model(torch.tensor([p + o.output_ids[:-1]], device=eng.device))[0, len(p) - 1 :]
    logits = logits.to(torch.float64).cpu()  # [G, V]
    rows = []
    for j in range(len(o.output_ids)):
        lp = torch.log_softmax(_direct(logits[j], params, p, o.output_ids[:j]), -1)
        vals, ids = lp.topk(k + EXTRA)
        rows.append(list(zip(ids.tolist(), vals.tolist())))
    return rows


BOOSTED = 7


def check_sampler_tops_and_penalties(model, graphs, tol=TOL):
    """Top lists and penalties through the graph + async engine and the eager sync engine: the
    same tokens, the lists against :func:`_sampled_reference`, the sampled token's entry equal to
    its logprob. Returns the outputs of the graph + async engine."""
    v = model.config.vocab_size
    pen = dict(presence_penalty=1.5, frequency_penalty=0.5, repetition_penalty=1.3)
    bias = ((BOOSTED, 10.0), (11, -100.0))
    shared = _prompt(120, 9, v)
    spec = [  # (id, prompt, params): filtered and penalised rows stop after 8 tokens, then plain decodes
        ("t0", _prompt(150, 1, v), dict(n=2, top_logprobs=5, max_new_tokens=24)),
        ("t1", _prompt(90, 2, v), dict(top_logprobs=3, temperature=0.8, top_k=50)),
        ("t2", _prompt(200, 3, v), dict(top_logprobs=4, top_p=0.9, logprobs_mode="raw")),
        ("t3", _prompt(70, 4, v), dict(max_new_tokens=24)),  # asks for no list
        ("p0", shared, dict(n=2, top_logprobs=4, temperature=0.9, logit_bias=bias, **pen)),
        ("p1", shared, dict(top_logprobs=3, logprobs_mode="raw", logit_bias=bias, **pen)),
        ("u0", shared, dict(n=2, top_logprobs=4, temperature=0.9)),  # p0 without penalties or biases
    ]
    reqs = []
    for i, (rid, prompt, p) in enumerate(spec):
        twin = rid[0] in "pu"  # p0, p1 and u0: one seed, one sample index
        p = {"max_new_tokens": 8, "seed": 50 if twin else 30 + i, **p}
        reqs.append(GenerationRequest(rid, prompt, SamplingParams(**p), 100 if twin else 10 * i))
    fast_eng = _engine(model, graphs, True, 512)
    fast = _drive(fast_eng, reqs)
    assert fast_eng.stats.graph_steps > 0 and fast_eng.stats.device_input_rows > 0
    plain_eng = _engine(model, False, False, 512)
    plain = _drive(plain_eng, reqs)
    assert {k: o.output_ids for k, o in fast.items()} == {k: o.output_ids for k, o in plain.items()}
    params = {r.request_id: r.params for r in reqs}
    for outs, eng in ((fast, fast_eng), (plain, plain_eng)):
        for (rid, idx), o in outs.items():
            p, k = params[rid], params[rid].top_logprobs
            if not k:
                assert o.top_logprobs is None
                continue
            assert len(o.top_logprobs) == len(o.output_ids)
            want = _sampled_reference(eng, o, p, k)
            for j, (row, w, tid, lp) in enumerate(zip(o.top_logprobs, want, o.output_ids, o.logprobs, strict=True)):
                _check_top(row, w, k, tol)
                if tid in dict(row):  # the sampled token's entry is its sampled logprob
                    assert abs(dict(row)[tid] - lp) <= 1e-5, (rid, idx, j)
    for j in (100, 101):
        pen_ids, plain_ids = fast[("p0", j)].output_ids, fast[("u0", j)].output_ids
        assert pen_ids != plain_ids and BOOSTED in pen_ids  # same seed and sample index: the bias moved the draw
        assert 11 not in pen_ids
    assert fast[("p0", 100)].top_logprobs[0][0][0] == BOOSTED  # +10 on a near-flat row: first of the first list
    return fast


def test_prompt_logprobs_of_a_chunked_prefill_equal_the_scoring_forward():
    """fp32, prefill chunks of 64 tokens (prompts of 60-250 tokens span several steps, beside other
    requests' chunks and decodes), on the decode graphs with async scheduling and on the eager
    synchronous engine: every prompt position's logprob and top-k values equal the plain scoring
    forward's (``LLMEngine.top_logprobs(..., with_tokens=True)``) within 1e-4, ranks and top ids
    equal (up to near ties); the two samples of an n=2 request carry the one list the leader
    scored, a raw request lists k entries everywhere, k = 0 lists none, a request that does not
    ask gets None, and the decode graphs still serve the decode steps."""
    model = _get_model(torch.float32)
    for graphs, async_mode in ((True, True), (False, False)):
        ranks, tops, n = check_prompt_logprobs(model, graphs, async_mode)
        print(f"graphs={graphs} async={async_mode}: exact ranks {ranks}/{n}, top ids in the reference order {tops}/{n}")


def test_bf16_batch_invariant_prompt_logprobs_equal_the_trainer_scorer_bitwise():
    """bf16, ``EngineConfig(batch_invariant=True)``, decode graphs + async scheduling: a 300-token
    prompt's prompt logprobs (temperature 1, no filters) are bitwise the same alone and beside 7
    other prompts, prefilled in one chunk (budget 4096) and in chunks of 64 mixed with the others'
    (own logprobs and ranks bitwise, top lists within 1e-6), its sampled tokens and logprobs too,
    and bitwise equal to the trainer's ``PagedScorer`` (invariant table and logprob op) of the
    prompt packed after another sequence."""
    bitwise = check_invariant_prompt_logprobs(_get_model(torch.bfloat16), True)
    print(f"batch-invariant prompt logprobs: top lists bitwise equal across runs: {bitwise}")


def test_bf16_batch_invariant_whole_k_widths_equal_the_trainer_scorer_bitwise():
    """The check above on a model whose every projection and expert is a whole-K GEMM
    (``invariant_ops.whole_k``: K >= 3,072, one chain in every band): hidden 3,072, 24 query heads
    x 128 (o_proj K 3,072), expert / shared / dense widths 3,072 (2 layers, random weights). Alone
    vs beside others, one chunk vs chunks of 64, engine vs the trainer's ``PagedScorer``: bitwise."""
    w = 3072
    model = _model(
        torch.bfloat16, hidden_size=w, num_attention_heads=24, intermediate_size=w,
        shared_intermediate_size=w, dense_intermediate_size=w,
    )  # fmt: skip
    assert inv.WHOLE_K and inv.whole_k(torch.bfloat16, w) and not inv.whole_k(torch.bfloat16, w - 1)
    bitwise = check_invariant_prompt_logprobs(model, True)
    print(f"whole-K widths: top lists bitwise equal across runs: {bitwise}")


def test_sampler_top_lists_and_penalties_through_graphs_and_async_scheduling():
    """fp32: requests with top lists (processed, top-k, raw top-p; n=2), penalised and biased
    requests (presence 1.5, frequency 0.5, repetition 1.3, biases +10 / -100; processed and raw) and
    their unpenalised twin, on the decode graphs (fused sampler once the filtered / penalised rows
    finish) with async scheduling and on the eager synchronous engine: the same tokens; each top
    list equals the reference within 1e-4 (the scoring forward with the request's filters; raw rows
    the model's own, penalties or not; penalised rows the plain forward with the penalties applied
    in fp64 by the CPU test's direct computation), the sampled token's entry is its logprob; the
    penalised request's tokens differ from its twin's under the same seed and sample index."""
    outs = check_sampler_tops_and_penalties(_get_model(torch.float32), True)
    print(f"penalised p0 tokens {outs[('p0', 100)].output_ids}, unpenalised u0 {outs[('u0', 100)].output_ids}")

"""The engine's fast decode path on a CUDA GPU: captured forward + sampler graphs over staged inputs
(fused Triton sampler), with and without async scheduling, against the plain eager synchronous
engine (PyTorch sampler), same seeds. Skipped without CUDA.

Model: the bench config (configs/bench/m3_bench_300m.json: page = block 128, top-16 blocks) cut to
2 layers (one dense-attention, one sparse), random weights; prompts of 100-300 tokens.
Stated tolerances:
- bf16 (the serving dtype): graphs with vs without async scheduling replay the same graphs on the
  same rows (n = 1 requests, no stops): identical ids and logprobs. Fast path vs plain path: the
  plain engine re-scores the fast path's tokens (``LLMEngine.score``, eager bf16 forward): the
  fast path's logprobs (temperature 1, no filter, so processed = raw) agree within bf16 rounding of
  two forward paths (one-pass prefill vs token-by-token decode): max |diff| <= 0.25, mean <= 0.02
  (random-model logits have std ~0.6, so a wrong position or token shows as ~0.5 on average).
- fp32: identical ids (the keyed sampler's randomness does not depend on the batch; fp32 logits of
  padded graph batches and eager batches differ only by summation order, far below the gaps between
  Gumbel-perturbed scores); logprobs within 1e-3 (different batch shapes; async scheduling forks a
  group's samples one step later).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("TRITON_INTERPRET=1 in this process; run tests/gpu alone", allow_module_level=True)

from m3_rollout.engine.config import EngineConfig  # noqa: E402
from m3_rollout.engine.engine import LLMEngine  # noqa: E402
from m3_rollout.engine.interface import GenerationRequest, SampleOutput, SamplingParams  # noqa: E402
from m3_rollout.model import M3Config, M3ForCausalLM  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def _model(dtype=torch.float32, layers=2, **widths):
    """The bench config cut to ``layers`` layers (``widths``: further config keys, e.g. wider
    projections), random weights N(0, 0.02) / N(0, 0.05) for vectors, cast to ``dtype`` on cuda."""
    raw = json.loads((ROOT / "configs/bench/m3_bench_300m.json").read_text())
    raw = {k: v for k, v in raw.items() if not k.startswith("_")}
    raw.update(
        num_hidden_layers=layers,
        layer_types=raw["layer_types"][:layers],
        mlp_layer_types=raw["mlp_layer_types"][:layers],
        **widths,
    )
    cfg = M3Config.from_dict(raw)
    torch.manual_seed(0)
    with torch.device("cuda"):
        m = M3ForCausalLM(cfg)
        with torch.no_grad():
            for p in m.parameters():
                p.normal_(0, 0.02) if p.ndim >= 2 else p.normal_(0, 0.05)
    return m.cast_for_inference(dtype).eval()


_MODELS: dict = {}


def _get_model(dtype):
    if dtype not in _MODELS:
        _MODELS[dtype] = _model(dtype)
    return _MODELS[dtype]


def _requests():
    g = torch.Generator().manual_seed(0)
    reqs = []
    for i in range(6):
        prompt = torch.randint(3, 32000, (100 + 40 * i,), generator=g).tolist()
        p = SamplingParams(
            n=(4, 1, 2)[i % 3],
            seed=11 + i,
            max_new_tokens=20 + 4 * i,
            temperature=(1.0, 0.8, 1.0)[i % 3],
            top_k=(-1, -1, 50)[i % 3],
            logprobs_mode=("processed", "raw")[i % 2],
            stop_token_ids=(5, 6, 7),
        )
        reqs.append(GenerationRequest(f"r{i}", prompt, p, sample_index=100 * i))
    return reqs


def _run(graphs: bool, async_mode: bool, dtype=torch.float32, reqs=None):
    eng = LLMEngine(
        _get_model(dtype),
        EngineConfig(
            max_model_len=512,
            max_num_seqs=16,
            num_pages=256,
            enable_cuda_graphs=graphs,
            cuda_graph_batch_sizes=(8, 16),
            async_scheduling=async_mode,
        ),
    )
    for r in reqs or _requests():
        eng.add_request(r)
    outs = {}
    while eng.has_unfinished():
        for o in eng.step():
            if isinstance(o, SampleOutput):
                outs[(o.request_id, o.sample_index)] = o
    assert eng.metrics()["kv_pages_in_use"] == 0
    return outs, eng


def _compare(a, b, tol):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].output_ids == b[k].output_ids, k
        assert a[k].finish_reason == b[k].finish_reason, k
        diff = max((abs(p - q) for p, q in zip(a[k].logprobs, b[k].logprobs)), default=0.0)
        assert diff <= tol, (k, diff)


def _requests_bf16():
    """16 single-sample requests, all running every step (no stops, same length): every decode
    step has 16 rows, the captured size, in every mode."""
    g = torch.Generator().manual_seed(1)
    reqs = []
    for i in range(16):
        prompt = torch.randint(3, 32000, (100 + 13 * i,), generator=g).tolist()
        p = SamplingParams(
            seed=50 + i,
            max_new_tokens=24,
            temperature=(1.0, 0.8)[i % 2 if i < 12 else 0],
            top_k=50 if i == 3 else -1,
            logprobs_mode=("processed", "raw")[(i // 2) % 2],
        )
        reqs.append(GenerationRequest(f"b{i}", prompt, p, sample_index=i))
    return reqs


def test_bf16_fast_path_equals_sync_graphs_and_plain_path_scores_its_tokens():
    reqs = _requests_bf16()
    fast, ef = _run(True, True, torch.bfloat16, reqs)
    graph_sync, _ = _run(True, False, torch.bfloat16, reqs)
    assert ef.runner.graphs is not None and ef.stats.graph_steps > ef.stats.steps // 2
    assert ef.stats.device_input_rows > 0
    _compare(graph_sync, fast, 1e-6)
    plain = LLMEngine(_get_model(torch.bfloat16), EngineConfig(max_model_len=512, max_num_seqs=16, num_pages=256))
    diffs = []
    for r in reqs:
        if r.params.temperature != 1.0 or r.params.top_k > 0:
            continue
        o = fast[(r.request_id, r.sample_index)]
        lp = plain.score(o.prompt_ids + o.output_ids)[len(o.prompt_ids) :]
        diffs += [abs(a - b) for a, b in zip(o.logprobs, lp.tolist())]
    assert len(diffs) >= 8 * 24
    assert max(diffs) <= 0.25 and sum(diffs) / len(diffs) <= 0.02, (max(diffs), sum(diffs) / len(diffs))
    plain_out, _ = _run(False, False, torch.bfloat16, reqs)
    same = sum(plain_out[k].output_ids == fast[k].output_ids for k in fast)
    print(
        f"bf16: {same}/{len(fast)} samples token-identical between the plain and the fast path; "
        f"fast-path logprobs vs plain re-scoring: max |diff| {max(diffs):.4f}, mean {sum(diffs) / len(diffs):.5f}"
    )


def test_graphs_and_async_scheduling_match_the_eager_sync_engine():
    plain, _ = _run(False, False)
    graph_sync, eg = _run(True, False)
    graph_async, ea = _run(True, True)
    assert eg.runner.graphs is not None and eg.stats.graph_steps > eg.stats.steps // 2
    assert ea.stats.graph_steps > ea.stats.steps // 2 and ea.stats.device_input_rows > 0
    _compare(plain, graph_sync, 1e-3)
    _compare(graph_sync, graph_async, 1e-3)
    assert sum(len(o.output_ids) for o in plain.values()) > 300


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_sampler_picks_the_torch_samplers_tokens(dtype):
    """One-kernel Triton sampler vs ``sampler.sample_rows`` on the GPU: identical ids (fp64 libdevice
    log = torch's CUDA log; IEEE division), logprobs within 1e-5, over 2 x 64 rows x 32000 tokens."""
    from m3_rollout.engine.sampler import SamplingTensors, sample_rows, vocab_hash
    from m3_rollout.engine.sampler_triton import keyed_gumbel_sample

    g = torch.Generator(device="cuda").manual_seed(0)
    n, v = 64, 32000
    for rep in range(2):
        logits = (torch.randn(n, v, device="cuda", generator=g) * 4).to(dtype)
        temp = torch.rand(n, device="cuda", dtype=torch.float64, generator=g) + 0.5
        seeds = torch.randint(-(2**62), 2**62, (n,), device="cuda", generator=g)
        sids = torch.arange(n, device="cuda") + 1000 * rep
        pos = torch.randint(0, 70000, (n,), device="cuda", generator=g)
        raw = (torch.arange(n, device="cuda") % 3 == 0).long()
        params = SamplingTensors(temp, torch.full((n,), -1, device="cuda"), torch.ones(n, device="cuda"), seeds, sids)
        tok, lp = sample_rows(logits.float(), params, pos, raw != 0, False, False)
        out = torch.zeros(2 * n, dtype=torch.int64, device="cuda")
        last = torch.zeros(n, dtype=torch.int64, device="cuda")
        keyed_gumbel_sample(logits, temp, seeds, sids, pos, raw, vocab_hash(v, torch.device("cuda")), out, last)
        assert torch.equal(out[:n], tok) and torch.equal(last, tok)
        assert (out[n:].view(torch.float64) - lp.double()).abs().max().item() < 1e-5


def test_block_selection_record_through_graphs_and_async_scheduling():
    """The block-selection record on the GPU path: the fused decode kernel writes it from registers
    inside the captured graphs, prefill chunks copy index_topk's ids, one copy per step lands it on
    the host. fp32, prompts past 16 x 128 tokens (real selection), a forked group: the record of the
    graphs + async engine equals the eager synchronous engine's (same kernels) exactly, and a plain
    PyTorch forward's block choice on at least 99.9 % of (token, layer, head) rows (cuBLAS vs
    Triton summation order can flip a near tie)."""
    import numpy as np

    from m3_rollout.model.selection_record import canonical_rows

    g = torch.Generator().manual_seed(3)
    reqs = [
        GenerationRequest(f"s{i}", torch.randint(3, 32000, (2300 + 350 * i,), generator=g).tolist(), p)
        for i, p in enumerate([SamplingParams(n=3, max_new_tokens=40, seed=1), SamplingParams(max_new_tokens=30)])
    ]
    model = _get_model(torch.float32)
    recs = {}
    for graphs, async_mode in ((True, True), (False, False)):
        eng = LLMEngine(
            model,
            EngineConfig(
                max_model_len=4096,
                max_num_seqs=8,
                num_pages=128,
                max_num_batched_tokens=1024,  # chunked prefill
                enable_cuda_graphs=graphs,
                cuda_graph_batch_sizes=(4,),
                async_scheduling=async_mode,
                record_block_selection=True,
            ),
        )
        for r in reqs:
            eng.add_request(r)
        outs = {}
        while eng.has_unfinished():
            outs.update({(o.request_id, o.sample_index): o for o in eng.step() if isinstance(o, SampleOutput)})
        recs[graphs] = outs
        assert not graphs or eng.stats.graph_steps > 0
    agree = total = 0
    for k, o in recs[True].items():
        n = len(o.prompt_ids) + len(o.output_ids) - 1
        got = o.block_selection.dense(n)
        assert o.block_selection.end == n
        assert np.array_equal(canonical_rows(got), canonical_rows(recs[False][k].block_selection.dense(n))), k
        with torch.no_grad():
            model(torch.tensor([o.prompt_ids + o.output_ids], device="cuda"))
        want = torch.stack([a.last_selected_blocks[0].permute(1, 0, 2) for a in model.sparse_attention_layers()], 1)
        same = (canonical_rows(got) == canonical_rows(want[:n].cpu().short().numpy())).all(-1)
        agree, total = agree + int(same.sum()), total + same.size
    print(f"block-selection record vs plain fp32 forward: {agree}/{total} rows equal")
    assert agree >= 0.999 * total


def test_routing_record_through_graphs_of_several_sizes_and_async_scheduling():
    """The routing record on the GPU path. Graphs of sizes 1, 2, 4 and 8 are captured (largest
    first, so after capture every MoE layer's ``last_topk_ids`` names the size-1 graph's output, and
    each eager prefill step renames it); decode steps replay other sizes. fp32, a forked group and
    single samples, so the batch shrinks through several sizes as samples stop: the record of the
    graphs + async engine equals the eager synchronous engine's on every run token (as sets of
    expert ids), and a plain PyTorch forward's choice on >= 99.9 % of (token, layer) rows."""
    import numpy as np

    g = torch.Generator().manual_seed(5)
    reqs = [
        GenerationRequest(
            f"q{i}", torch.randint(3, 32000, (60 + 45 * i,), generator=g).tolist(), SamplingParams(**p, seed=i)
        )
        for i, p in enumerate([dict(n=4, max_new_tokens=36), dict(max_new_tokens=13), dict(n=2, max_new_tokens=25)])
    ]
    model = _get_model(torch.float32)
    recs = {}
    for graphs, async_mode in ((True, True), (False, False)):
        eng = LLMEngine(
            model,
            EngineConfig(
                max_model_len=512,
                max_num_seqs=8,
                num_pages=64,
                enable_cuda_graphs=graphs,
                cuda_graph_batch_sizes=(1, 2, 4, 8),
                async_scheduling=async_mode,
                record_routing=True,
            ),
        )
        for r in reqs:
            eng.add_request(r)
        outs = {}
        while eng.has_unfinished():
            outs.update({(o.request_id, o.sample_index): o for o in eng.step() if isinstance(o, SampleOutput)})
        recs[graphs] = outs
        assert not graphs or eng.stats.graph_steps > 0
    assert len(recs[True]) == 7
    agree = total = 0
    for k, o in recs[True].items():
        n = len(o.prompt_ids) + len(o.output_ids) - 1  # the last sampled token never ran
        got = np.sort(np.asarray(o.routed_experts)[:n], axis=-1)
        assert got.shape[1:] == (1, 4) and (got >= 0).all(), k
        assert np.array_equal(got, np.sort(np.asarray(recs[False][k].routed_experts)[:n], axis=-1)), k
        with torch.no_grad():
            model(torch.tensor([o.prompt_ids + o.output_ids], device="cuda"))
        want = torch.stack([m.last_topk_ids for m in model.moe_layers()], 1)[:n].sort(-1).values.cpu().numpy()
        same = (got == want).all(-1)
        agree, total = agree + int(same.sum()), total + same.size
    print(f"routing record vs plain fp32 forward: {agree}/{total} rows equal")
    assert agree >= 0.999 * total


def test_msa_prefill_scratch_inside_the_cache_budget_and_a_long_prefill():
    """policy.generation.msa_prefill_scratch_mb on the GPU (bf16, 16 q heads x top-16 x d 128: 66,560
    scratch bytes per prefill token): the default scratch is one 16K-token pass (1040 MiB) inside
    kv_cache_memory_gb (pages = (budget - scratch) // page bytes); an 18,000-token prompt prefilled in
    one step takes the KV-major path and gives the tokens and logprobs of the kernels' own per-call
    buffer (the engine before the scratch was counted) bit for bit; 4096-token passes the same tokens
    (logprobs within bf16 rounding); 0 (union tiles) runs. Sleep level 1 frees the scratch, wake-up
    restores it."""
    import dataclasses

    from m3_rollout.engine.ops import paged_ops_for
    from m3_rollout.engine.paged_cache import page_bytes

    model = _get_model(torch.bfloat16)
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(3, 32000, (18000,), generator=g).tolist()
    req = GenerationRequest("long", prompt, SamplingParams(seed=9, max_new_tokens=4))
    budget = 2 * 2**30
    per_page = page_bytes(model.config, torch.bfloat16)

    def run(scratch_mb, ops=None):
        cfg = EngineConfig(
            max_model_len=18432,
            max_num_seqs=2,
            max_num_batched_tokens=20480,
            kv_cache_memory_gb=budget / 2**30,
            msa_prefill_scratch_mb=scratch_mb,
        )
        eng = LLMEngine(model, cfg, ops=ops)
        eng.add_request(req)
        outs = []
        while eng.has_unfinished():
            outs += [o for o in eng.step() if isinstance(o, SampleOutput)]
        return outs[0], eng

    own_table = dataclasses.replace(paged_ops_for("cuda", torch.bfloat16), takes_prefill_scratch=False)
    before, e0 = run(None, own_table)  # no scratch: the kernels allocate their own, as before
    assert e0.prefill_scratch is None and e0.block_manager.num_pages == budget // per_page
    default, ed = run(None)
    assert ed.prefill_scratch.numel() == 16384 * 66560 == 1040 * 2**20
    assert ed.block_manager.num_pages == (budget - 1040 * 2**20) // per_page
    assert ed.metrics()["msa_prefill_scratch_gb"] == 1040 / 1024
    assert default.output_ids == before.output_ids and default.logprobs == before.logprobs
    short, es = run(260)  # 4096-token passes
    assert es.prefill_scratch.numel() == 4096 * 66560
    assert short.output_ids == default.output_ids
    diff = max(abs(a - b) for a, b in zip(short.logprobs, default.logprobs))
    assert diff <= 0.25
    union, eu = run(0)
    assert eu.prefill_scratch.numel() == 0 and eu.block_manager.num_pages == budget // per_page
    assert len(union.output_ids) == 4
    print(
        f"long prefill: 4096-token passes logprob max |diff| {diff:.2e} "
        f"(bit-equal {short.logprobs == default.logprobs}); "
        f"union tiles same tokens {union.output_ids == default.output_ids}"
    )
    del e0, es, eu
    buf = ed.prefill_scratch
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    ed.sleep(1)
    assert buf.untyped_storage().nbytes() == 0 and torch.cuda.memory_allocated() <= held - buf.numel()
    ed.wake_up()
    assert buf.untyped_storage().nbytes() == buf.numel()
    ed.add_request(dataclasses.replace(req, request_id="again"))
    again = []
    while ed.has_unfinished():
        again += [o for o in ed.step() if isinstance(o, SampleOutput)]
    assert again[0].output_ids == default.output_ids

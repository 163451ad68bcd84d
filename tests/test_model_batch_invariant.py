"""Batch-invariant mode at the model / engine level on CPU (issue 24; design.md §4.6).

The paged forward with the invariant table's non-attention ops (``engine.ops.interpreted_paged_ops(
batch_invariant=True)``: kernels/invariant_ops.py and fused_layers' per-row kernels under the Triton
interpreter, fp32) gives a sequence's logits and cache entries bitwise the same alone and batched
with other sequences. Attention is not invariant yet (the other half of issue 24): these tests run
the reference attention one row at a time (``per_row_attention``), invariant by construction, so
they check everything else: projections, norms + RoPE + cache writes, router, routed and shared
experts, lm_head, and the sampler's logprobs. The interpreter's ``tl.dot`` runs per tile row
(tests/interpreter_dot.py: numpy's BLAS is position-dependent on the CPU, the GPU is not).

Also: the table's wiring (every GEMM through ``linear``, no skinny GEMM; decode-sized steps take the
one-launch router and gate|up + SwiGLU routes with the bits of the two-launch ones, checked against
a prefill of the same positions with the invariant attention), and the config key's path to
``EngineConfig``.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from interpreter_dot import row_wise_dot  # tests/ on sys.path
from invariant_util import per_row_attention
from paged_model_util import small_paged_model

from m3_kernels.fused_interpret import interpreted_invariant_ops
from m3_rollout.engine.model_runner import prepare_inputs
from m3_rollout.engine.ops import interpreted_paged_ops, paged_ops_for
from m3_rollout.engine.paged_cache import PagedKVCache
from m3_rollout.model.paged_ops import PagedOps

PS = 4


@pytest.fixture(autouse=True, scope="module")
def per_row_dot():
    with row_wise_dot():
        yield


INVARIANT = per_row_attention(interpreted_paged_ops(batch_invariant=True))
INV_OPS = interpreted_invariant_ops()  # the module whose ops the table holds


def _model(seed=0):
    """Two layers: a dense one and a sparse-attention + MoE one (every layer kind; each op of the
    forward runs per layer, so more layers repeat the same checks at the interpreter's cost)."""
    return small_paged_model(seed, vocab_size=96, page_size=PS, layers=2)


def _seqs():
    g = torch.Generator().manual_seed(5)
    return {name: torch.randint(0, 96, (n,), generator=g).tolist() for name, n in (("a", 12), ("b", 7), ("c", 10))}


PAGES = {"a": [0, 3, 5], "b": [1, 4], "c": [2, 6, 7]}


@torch.no_grad()
def _run(model, rows: list[str], ops: PagedOps = INVARIANT, decode: bool = True):
    """Prefill every row's prompt but its last token (one step), then decode that token (a second
    step); returns ({row: prefill logits of all its tokens}, {row: decode logits}, kv)."""
    seqs = _seqs()
    kv = PagedKVCache(model.config, 12, torch.float32)
    bt = [PAGES[r] for r in rows]
    pre = prepare_inputs([seqs[r][:-1] for r in rows], [0] * len(rows), bt, PS, 0)
    logits = model.forward_paged(pre.input_ids, pre.meta, kv, ops)  # every token's logits
    qsl = pre.meta.query_start_loc.tolist()
    prefill = {r: logits[qsl[i] : qsl[i + 1]] for i, r in enumerate(rows)}
    if not decode:
        return prefill, {}, kv
    dec = prepare_inputs([seqs[r][-1:] for r in rows], [len(seqs[r]) - 1 for r in rows], bt, PS, len(rows))
    out = model.forward_paged(dec.input_ids, dec.meta, kv, ops)
    return prefill, {r: out[i] for i, r in enumerate(rows)}, kv


def test_logits_and_cache_of_a_sequence_do_not_depend_on_the_batch():
    """Sequence a alone vs between b and c (other pages, other lengths; 12 tokens > top-k 2 x block
    4, so its sparse layers select): prefill logits of every token, the decode step's logits and
    a's K / V / index-K pages are bitwise equal."""
    m = _model()
    pre1, dec1, kv1 = _run(m, ["a"])
    pre3, dec3, kv3 = _run(m, ["b", "a", "c"])
    assert torch.equal(pre1["a"], pre3["a"])
    assert torch.equal(dec1["a"], dec3["a"])
    for name in ("k_cache", "v_cache", "index_cache"):
        c1, c3 = getattr(kv1, name), getattr(kv3, name)
        assert torch.equal(c1[:, PAGES["a"]], c3[:, PAGES["a"]]), name
    # the reference (PyTorch, fp64) agrees: the invariant ops compute the model, not something else
    want = m.double()(torch.tensor([_seqs()["a"]]))[0]
    assert (pre1["a"].double() - want[:-1]).abs().max() < 1e-4
    assert (dec1["a"].double() - want[-1]).abs().max() < 1e-4


def test_model_check_catches_a_batch_dependent_gemm():
    """(c) at the model level: the same comparison with a ``linear`` that splits K once a step has
    more than 16 rows (the kind of heuristic cuBLAS or an autotuner applies) tells the two apart:
    a's 11 prompt rows alone run one pass, beside b and c (26 rows) two halves."""
    linear = INVARIANT.linear

    def split_k_when_large(x, w, bias=None):
        if x.shape[0] <= 16:
            return linear(x, w, bias)
        h = x.shape[1] // 2
        lo = linear(x[:, :h].contiguous(), w[:, :h].contiguous())
        return lo + linear(x[:, h:].contiguous(), w[:, h:].contiguous(), bias)

    m = _model()
    ops = dataclasses.replace(INVARIANT, linear=split_k_when_large)
    pre1, _, _ = _run(m, ["a"], ops, decode=False)
    pre3, _, _ = _run(m, ["b", "a", "c"], ops, decode=False)
    assert not torch.equal(pre1["a"], pre3["a"])
    assert (pre1["a"] - pre3["a"]).abs().max() < 1e-4  # same maths, other rounding


def test_decode_step_takes_the_fused_routes_with_the_prefill_bits():
    """A decode step (1 row) takes the table's one-launch routes, ``linear_swiglu`` (dense MLP and
    shared expert, packed gate|up weights) and ``router_gemm_topk``; a prefill of more than
    LINEAR_DECODE_ROWS rows takes the two-launch ones (``linear`` + ``swiglu``, fp32 ``linear`` +
    ``router_topk``). With the invariant attention (interpreted; the per-row reference attention
    above runs a prefill's rows together, so its decode rows are not its prefill rows) the decode
    step's logits equal the prefill's logits of the same position bitwise, and so do the caches;
    spies show which route each step took."""
    from m3_kernels.msa_interpret import fixed_order_dot
    from m3_rollout.engine.ops import invariant_attention_fields

    ps = 16  # the invariant attention's smallest page / head dim
    m = small_paged_model(0, vocab_size=96, head_dim=ps, page_size=ps, layers=2).pack_fused_weights()
    g = torch.Generator().manual_seed(11)
    n = INV_OPS.LINEAR_DECODE_ROWS + 9  # 41 tokens (3 blocks, top-2: the sparse layer selects)
    seq = torch.randint(0, 96, (n,), generator=g).tolist()
    table = [[0, 1, 2]]
    calls = []

    def spy(op, name):
        def wrapped(x, *args, **kwargs):
            calls.append((name, x.shape[0]))
            return op(x, *args, **kwargs)

        return wrapped

    attention = invariant_attention_fields(interpret=True)
    base = dataclasses.replace(interpreted_paged_ops(batch_invariant=True), **attention)
    names = ("linear_swiglu", "router_gemm_topk", "swiglu", "router_topk")
    ops = dataclasses.replace(base, **{name: spy(getattr(base, name), name) for name in names})
    with torch.no_grad(), fixed_order_dot():  # the attention tests' per-row dot (msa_interpret)
        kv_full = PagedKVCache(m.config, 4, torch.float32)
        pre = prepare_inputs([seq], [0], table, ps, 0)
        full = m.forward_paged(pre.input_ids, pre.meta, kv_full, ops)  # [n, V]
        assert sorted(set(calls)) == [("router_topk", n), ("swiglu", n)]
        calls.clear()
        kv = PagedKVCache(m.config, 4, torch.float32)
        pre = prepare_inputs([seq[:-1]], [0], table, ps, 0)
        m.forward_paged(pre.input_ids, pre.meta, kv, ops)
        assert sorted(set(calls)) == [("router_topk", n - 1), ("swiglu", n - 1)]
        calls.clear()
        dec = prepare_inputs([seq[-1:]], [n - 1], table, ps, 1)
        out = m.forward_paged(dec.input_ids, dec.meta, kv, ops)  # [1, V]
    # the dense layer's MLP and the MoE layer's shared expert, the MoE layer's router: one launch each
    assert sorted(calls) == [("linear_swiglu", 1), ("linear_swiglu", 1), ("router_gemm_topk", 1)]
    assert torch.equal(out[0], full[n - 1])
    for name in ("k_cache", "v_cache", "index_cache"):
        assert torch.equal(getattr(kv, name), getattr(kv_full, name)), name


def test_every_gemm_goes_through_the_tables_linear(monkeypatch):
    """No F.linear (nor nn.Linear) runs in the invariant forward; linear sees the router's fp32 GEMM
    where the router takes its two-launch route (here turned off for every T, as with
    ``ROUTER_GEMM_TOPK_FUSE`` off: this 12-row step is decode-sized, where the table's default is
    the one-launch ``router_gemm_topk``, test_decode_step_takes_the_fused_routes_with_the_prefill_bits)."""
    m = _model()
    seen = []
    linear = INVARIANT.linear

    def counting(x, w, bias=None):
        seen.append((x.dtype, tuple(w.shape)))
        return linear(x, w, bias)

    def forbidden(*args, **kwargs):
        raise AssertionError("F.linear called on the batch-invariant path")

    ops = dataclasses.replace(INVARIANT, linear=counting, router_gemm_topk_ok=INV_OPS.router_gemm_topk_never)
    monkeypatch.setattr(torch.nn.functional, "linear", forbidden)
    pre = prepare_inputs([_seqs()["a"]], [0], [[0, 3, 5]], PS, 0)
    with torch.no_grad():
        m.forward_paged(pre.input_ids, pre.meta, PagedKVCache(m.config, 8, torch.float32), ops)
    c = m.config
    shapes = {s for _, s in seen}
    assert (c.vocab_size, c.hidden_size) in shapes  # lm_head
    assert (c.num_local_experts, c.hidden_size) in shapes  # router (fp32)
    assert (c.hidden_size, c.num_attention_heads * c.head_dim) in shapes  # o_proj
    gate = m.moe_layers()[0].gate.weight
    assert INVARIANT.skinny_linear is None and INVARIANT.router_gemm_topk_ok(1, gate)
    assert not ops.router_gemm_topk_ok(1, gate)


def test_layer_by_layer_path_takes_linear_too(monkeypatch):
    """A table with only ``linear`` (no fused layer path): the projections, MLPs, router and
    lm_head of the layer-by-layer path call it; same logits as F.linear within fp32 order."""
    m = _model()
    base = paged_ops_for("cpu", torch.float32)
    ops = per_row_attention(dataclasses.replace(base, linear=INVARIANT.linear))
    assert not ops.fused_layers
    pre = prepare_inputs([_seqs()["a"]], [0], [[0, 3, 5]], PS, 0)
    with torch.no_grad():
        want = m.forward_paged(pre.input_ids, pre.meta, PagedKVCache(m.config, 8, torch.float32), base)
        monkeypatch.setattr(torch.nn.functional, "linear", None)  # any F.linear / nn.Linear call fails
        got = m.forward_paged(pre.input_ids, pre.meta, PagedKVCache(m.config, 8, torch.float32), ops)
    assert (got - want).abs().max() < 1e-4


def test_paged_ops_rejects_linear_with_skinny_gemm():
    fused = interpreted_paged_ops()
    assert fused.skinny_linear is not None
    with pytest.raises(ValueError, match="skinny_linear"):
        dataclasses.replace(fused, linear=INVARIANT.linear)


def test_cpu_batch_invariant_table_warns_and_falls_back():
    with pytest.warns(UserWarning, match="batch_invariant") as rec:
        ops = paged_ops_for("cpu", torch.float32, batch_invariant=True, invariant_sparse_attention="union")
    assert ops.linear is None and not ops.fused_layers
    # the warning names the sparse-attention choice it drops, so a user who set it sees that it does nothing
    assert "invariant_sparse_attention='union' has no effect" in str(rec[0].message)


def test_engine_batch_invariant_generation():
    """LLMEngine with EngineConfig.batch_invariant and the invariant table (per-row attention):
    sequence a's sampled tokens and logprobs are the same generated alone and beside b and c
    (prefills and decodes batched with them), with the invariant logprob op in the sampler."""
    from m3_kernels.fused_interpret import interpreted_invariant_ops
    from m3_rollout.engine.config import EngineConfig
    from m3_rollout.engine.engine import LLMEngine
    from m3_rollout.engine.interface import GenerationRequest, SampleOutput, SamplingParams

    m = _model()
    seqs = _seqs()
    inv = interpreted_invariant_ops()

    def generate(names):
        cfg = EngineConfig(max_model_len=32, max_num_seqs=4, num_pages=24, batch_invariant=True)
        engine = LLMEngine(m, cfg, ops=INVARIANT)
        engine.runner.token_logprobs = inv.token_logprobs  # CPU: the engine leaves torch's (CUDA only)
        params = SamplingParams(temperature=0.9, max_new_tokens=4, seed=3)
        for name in names:
            engine.add_request(GenerationRequest(name, seqs[name], params))
        done = {}
        while engine.has_unfinished():
            for out in engine.step():
                if isinstance(out, SampleOutput):
                    done[out.request_id] = out
        return done

    alone = generate(["a"])["a"]
    mixed = generate(["b", "a", "c"])["a"]
    assert len(alone.output_ids) == 4
    assert alone.output_ids == mixed.output_ids
    assert alone.logprobs == mixed.logprobs  # bitwise (python floats of the fp32 values)


def test_engine_without_ops_builds_the_invariant_table(monkeypatch):
    """EngineConfig.batch_invariant with no ``ops`` handed in: the engine asks ``paged_ops_for`` for
    the invariant table (regression: the merge with the prefill scratch built the fast table first,
    so the later ``ops is None`` check never took the invariant one; on CPU no warning either)."""
    import m3_rollout.engine.engine as engine_mod
    from m3_rollout.engine.config import EngineConfig

    asked = []

    def spy(device, dtype, *args, **kwargs):
        asked.append(kwargs.get("batch_invariant", False))
        return paged_ops_for(device, dtype, *args, **kwargs)

    monkeypatch.setattr(engine_mod, "paged_ops_for", spy)
    cfg = EngineConfig(max_model_len=32, max_num_seqs=2, num_pages=16, batch_invariant=True)
    with pytest.warns(UserWarning, match="batch_invariant"):  # CPU: the mode is unavailable, said so
        engine_mod.LLMEngine(_model(), cfg)
    assert asked == [True]
    asked.clear()
    engine_mod.LLMEngine(_model(), dataclasses.replace(cfg, batch_invariant=False))
    assert asked == [False]


def test_config_key_reaches_the_engine_config_and_the_server(tmp_path):
    """policy.generation.batch_invariant: off in the main job config, threaded like the other
    engine keys (engine_kwargs -> EngineConfig, also the EP workers' dict) and to the server's CLI."""
    from m3_rollout.config import load_config
    from m3_rollout.engine.config import EngineConfig
    from m3_rollout.jobs.stack import server_command
    from m3_rollout.server.cli import parse_args

    main = "configs/grpo_bf16_ep.yaml"
    assert load_config(main).policy.generation.batch_invariant is False
    over = ["policy.generation.batch_invariant=true", "policy.generation.expert_parallel_size=1"]
    cfg = load_config(main, [*over, "policy.generation.backend=http"])
    kwargs = cfg.policy.generation.engine_kwargs()
    assert kwargs["batch_invariant"] is True
    assert EngineConfig(max_model_len=64, **kwargs).validate().batch_invariant
    cmd = server_command(cfg, tmp_path, 64, 1234)
    assert "--batch-invariant" in cmd and parse_args(cmd[3:]).batch_invariant
    assert not parse_args(["--model", str(tmp_path)]).batch_invariant

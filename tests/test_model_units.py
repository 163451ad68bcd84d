"""Hand-computed checks of the M3 building blocks (spec §3, §7 "recommended invariance tests")."""

from __future__ import annotations

import math

import pytest
import torch

from m3_rollout.model import M3Config, M3ForCausalLM, tiny_config
from m3_rollout.model.attention import AttentionInputs, M3Attention
from m3_rollout.model.indexer import NAN_SCORE, block_scores, select_blocks, selected_key_mask
from m3_rollout.model.moe import M3MoE, route, swiglu_oai
from m3_rollout.model.norm import GemmaRMSNorm, gemma_rms_norm
from m3_rollout.model.rope import apply_rope, rope_cos_sin

INF = float("inf")


def _randomise(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            std = 0.5 if p.ndim == 1 else (0.3 if ("w13" in name or "gate_proj" in name or "up_proj" in name) else 0.1)
            p.copy_(torch.randn(p.shape, generator=g) * std)


# ------------------------------------------------------------------ indexer
def test_block_scores_hand_case():
    # keys along one axis: <iq, ik[u]> = [1, 3, 2, 5, 4]; block size 2 -> blocks {0,1} {2,3} {4}
    ik = torch.tensor([[1.0, 0], [3, 0], [2, 0], [5, 0], [4, 0]])[None]  # [1, 5, 2]
    iq = torch.tensor([1.0, 0]).expand(1, 3, 1, 2)  # [1, Sq=3, G=1, 2]
    q_pos = torch.tensor([[1, 2, 4]])
    s = block_scores(iq, ik, q_pos, block_size=2)
    assert s.shape == (1, 1, 3, 3) and s.dtype == torch.float32
    expected = torch.tensor(
        [
            [3.0, -INF, -INF],  # pos 1: only block 0 is a candidate
            [3.0, 2.0, -INF],  # pos 2: own block holds key 2 only (key 3 = 5 is in the future)
            [3.0, 5.0, 4.0],
        ]
    )
    assert torch.equal(s[0, 0], expected)
    ik_nan = ik.clone()
    ik_nan[0, 0, 0] = float("nan")
    s = block_scores(iq, ik_nan, q_pos, block_size=2)
    assert (s[0, 0, :, 0] == NAN_SCORE).all() and torch.equal(s[0, 0, 2, 1:], expected[2, 1:])


def test_block_scores_explicit_key_positions_are_order_free():
    """The no-cache path (explicit key positions, scatter-max) equals the slot path, whatever the key order."""
    g = torch.Generator().manual_seed(0)
    iq, ik = torch.randn(2, 37, 3, 8, generator=g), torch.randn(2, 37, 8, generator=g)
    pos = torch.arange(37).expand(2, 37)
    ref = block_scores(iq, ik, pos, 5)
    perm = torch.randperm(37, generator=g)
    assert torch.equal(block_scores(iq, ik[:, perm], pos, 5, k_pos=pos[:, perm]), ref)
    sel = select_blocks(ref, pos, 3, 5, 0, 1)
    permuted = selected_key_mask(sel, pos, 37, 5, k_pos=pos[:, perm])
    assert torch.equal(permuted, selected_key_mask(sel, pos, 37, 5)[..., perm])


def test_select_ties_go_to_lower_block_id():
    scores = torch.tensor([5.0, 7, 7, 3, 7, 0]).view(1, 1, 1, 6)
    sel = select_blocks(scores, torch.tensor([[5 * 16]]), topk=3, block_size=16, init_blocks=0, local_blocks=1)
    assert sel.tolist() == [[[[5, 1, 2]]]]  # own block forced, then the 7s at ids 1, 2 (not 4)


def test_select_pads_with_minus_one():
    scores = torch.tensor([1.0, 2, 3, -INF, -INF, -INF]).view(1, 1, 1, 6)
    sel = select_blocks(scores, torch.tensor([[2 * 16 + 1]]), topk=4, block_size=16, init_blocks=0, local_blocks=1)
    assert sel.tolist() == [[[[2, 1, 0, -1]]]]
    short = select_blocks(scores[..., :2], torch.tensor([[17]]), topk=4, block_size=16, init_blocks=0, local_blocks=1)
    assert short.tolist() == [[[[1, 0, -1, -1]]]]  # fewer score columns than K


def test_select_init_and_local_blocks_variant_a2():
    """Variant A2 (init 1, local 2): blocks 0 and the own + previous block are forced."""
    scores = torch.tensor([0.0, 1, 9, 4, 9, 2, -5, -7]).view(1, 1, 1, 8)
    q = torch.tensor([[7 * 16 + 3]])  # own block 7
    sel = select_blocks(scores, q, topk=4, block_size=16, init_blocks=1, local_blocks=2)
    assert sel.tolist() == [[[[0, 6, 7, 2]]]]  # forced 0, 6, 7 (low scores), then the best other: 2 (tie with 4)
    sel = select_blocks(scores, torch.tensor([[16]]), topk=4, block_size=16, init_blocks=1, local_blocks=2)
    assert sel.tolist() == [[[[0, 1, -1, -1]]]]  # init and local overlap


def test_selected_key_mask_hand_case():
    sel = torch.tensor([[1, -1]]).view(1, 1, 1, 2)
    mask = selected_key_mask(sel, torch.tensor([[3]]), sk=6, block_size=2)
    assert mask[0, 0, 0].tolist() == [False, False, True, True, False, False]


def _naive_sparse_attention(attn: M3Attention, x: torch.Tensor, cfg: M3Config) -> torch.Tensor:
    """Per-(query, head) loops straight from spec §3.4-3.5, on the layer's own projections."""
    s = x.shape[1]
    cos, sin = rope_cos_sin(torch.arange(s), cfg.rotary_dim, cfg.rope_theta)
    cos, sin = cos[:, None], sin[:, None]
    x = x[0]
    q = apply_rope(attn.q_norm(attn.q_proj(x).view(s, attn.num_heads, -1)), cos, sin)
    k = apply_rope(attn.k_norm(attn.k_proj(x).view(s, attn.num_kv_heads, -1)), cos, sin)
    v = attn.v_proj(x).view(s, attn.num_kv_heads, -1)
    iq = apply_rope(attn.index_q_norm(attn.index_q_proj(x).view(s, attn.num_index_heads, -1)), cos, sin)
    ik = apply_rope(attn.index_k_norm(attn.index_k_proj(x)), cos[:, 0], sin[:, 0])
    bs, topk = attn.block_size, attn.topk
    group = attn.num_heads // attn.num_kv_heads
    out = torch.zeros(s, attn.num_heads, q.shape[-1], dtype=x.dtype)
    for t in range(s):
        n = t // bs + 1
        for g in range(attn.num_kv_heads):
            score = {b: max(float(iq[t, g] @ ik[u]) for u in range(b * bs, min((b + 1) * bs, t + 1))) for b in range(n)}
            forced = {b for b in range(n) if b < attn.init_blocks or b >= n - attn.local_blocks}
            others = sorted((b for b in range(n) if b not in forced), key=lambda b: (-score[b], b))
            chosen = forced | set(others[: max(0, topk - len(forced))])
            keys = [u for u in range(t + 1) if u // bs in chosen]
            for h in range(g * group, (g + 1) * group):
                logits = torch.stack([q[t, h] @ k[u, g] for u in keys]) * attn.scale
                out[t, h] = torch.softmax(logits, 0) @ v[keys, g]
    return attn.o_proj(out.reshape(1, s, -1))


def test_sparse_attention_with_init_blocks_matches_naive_loops():
    cfg = tiny_config(sparse_init_block=1, sparse_local_block=2)
    attn = M3Attention(cfg, layer_idx=1).double()
    _randomise(attn, seed=3)
    s = 100  # 7 blocks of 16 > K = 4: init 0 + local 2 + 1 chosen
    x = torch.randn(1, s, cfg.hidden_size, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    pos = torch.arange(s)[None]
    cos, sin = rope_cos_sin(pos, cfg.rotary_dim, cfg.rope_theta)
    inputs = AttentionInputs(pos, cos, sin)
    with torch.no_grad():
        ours = attn(x, inputs)
        ref = _naive_sparse_attention(attn, x, cfg)
        assert (ours - ref).abs().max() < 1e-12
        attn.init_blocks = 0  # the init block is not chosen by score alone for some queries
        assert (attn(x, inputs) - ours).abs().max() > 1e-3


def test_short_sequences_equal_dense_attention():
    """seq <= K*B: every candidate block is selected, so sparse layers equal dense causal attention."""
    sparse = M3ForCausalLM(tiny_config()).double()
    _randomise(sparse, seed=5)
    dense = M3ForCausalLM(tiny_config(sparse_attention_freq=[0] * 4, sparse_disable_index_value=[0] * 4)).double()
    result = dense.load_state_dict(sparse.state_dict(), strict=False)
    assert result.missing_keys == [] and all("index_" in k for k in result.unexpected_keys)
    ids = torch.randint(0, 1024, (2, 80), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        a, b = sparse(ids), dense(ids)
    assert (a[:, :64] - b[:, :64]).abs().max() < 1e-12  # K*B = 64
    assert (a[:, 64:] - b[:, 64:]).abs().max() > 1e-3


# ------------------------------------------------------------------ norm / rope / swiglu
def test_gemma_norm_zero_weight_is_plain_rmsnorm():
    x = torch.randn(3, 5, 64, dtype=torch.bfloat16)
    norm = GemmaRMSNorm(64, eps=1e-6)
    assert torch.equal(norm.weight, torch.zeros(64))
    y = norm(x)
    xf = x.float()
    plain = (xf / torch.sqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16)
    assert y.dtype == torch.bfloat16 and (y.float() - plain.float()).abs().max() <= 2**-7
    w = torch.randn(64)
    x64 = x.double()
    ref = x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + w.double())
    assert (gemma_rms_norm(x64, w.double(), 1e-6) - ref).abs().max() < 1e-12


def test_rope_rotates_only_first_rotary_dim_channels_neox_pairs():
    theta, r, p = 5e6, 16, 37
    x = torch.randn(2, 32, dtype=torch.float64)  # [heads, d]
    cos, sin = rope_cos_sin(torch.tensor(p), r, theta)
    assert cos.shape == (8,) and cos.dtype == torch.float32
    y = apply_rope(x, cos, sin)
    assert torch.equal(y[:, r:], x[:, r:])
    for i in range(r // 2):
        a = p * theta ** (-2 * i / r)
        c, s = math.cos(a), math.sin(a)
        assert torch.allclose(y[:, i], x[:, i] * c - x[:, i + 8] * s, atol=1e-6)
        assert torch.allclose(y[:, i + 8], x[:, i + 8] * c + x[:, i] * s, atol=1e-6)
    # relative: <rope(q, p1), rope(k, p2)> depends on p1 - p2 only
    q, k = torch.randn(32, dtype=torch.float64), torch.randn(32, dtype=torch.float64)

    def dot(p1, p2):
        c1, s1 = rope_cos_sin(torch.tensor(p1), r, theta)
        c2, s2 = rope_cos_sin(torch.tensor(p2), r, theta)
        return float(apply_rope(q, c1, s1) @ apply_rope(k, c2, s2))

    assert abs(dot(10, 3) - dot(107, 100)) < 1e-5


def test_swiglu_oai_clamps():
    alpha, lim = 1.702, 7.0

    def f(g, u):
        t = torch.tensor([g, u], dtype=torch.float64)
        return float(swiglu_oai(t[:1], t[1:], alpha, lim))

    def ref(g, u):
        return g / (1 + math.exp(-alpha * g)) * (u + 1.0)

    assert f(1.0, 2.0) == pytest.approx(ref(1.0, 2.0), rel=1e-12)
    assert f(10.0, 2.0) == pytest.approx(ref(7.0, 2.0), rel=1e-12)  # gate upper clamp
    assert f(1.0, -10.0) == pytest.approx(ref(1.0, -7.0), rel=1e-12)  # up lower clamp
    assert f(1.0, 10.0) == pytest.approx(ref(1.0, 7.0), rel=1e-12)  # up upper clamp
    assert f(-20.0, 2.0) == pytest.approx(ref(-20.0, 2.0), rel=1e-9)  # no lower clamp on the gate
    assert f(-20.0, 2.0) != pytest.approx(ref(-7.0, 2.0), rel=1e-3)
    bf = swiglu_oai(torch.tensor([3.0], dtype=torch.bfloat16), torch.tensor([1.0], dtype=torch.bfloat16), alpha, lim)
    assert bf.dtype == torch.bfloat16


# ------------------------------------------------------------------ MoE
def test_route_ties_and_bias_for_selection_only():
    logits = torch.zeros(1, 8)
    w, ids = route(logits, None, 2, 2.0)
    assert ids.tolist() == [[0, 1]] and torch.allclose(w, torch.tensor([[1.0, 1.0]]))
    bias = torch.zeros(8)
    bias[5] = 1.0
    logits[0, 3] = 2.0
    w, ids = route(logits, bias, 2, 2.0)
    assert ids.tolist() == [[5, 3]]
    s5, s3 = 0.5, 1 / (1 + math.exp(-2.0))  # unbiased sigmoid scores weight the experts
    assert torch.allclose(w, torch.tensor([[2 * s5 / (s5 + s3), 2 * s3 / (s5 + s3)]]))


def test_moe_matches_naive_per_token_loop():
    cfg = tiny_config()
    moe = M3MoE(cfg).double()
    _randomise(moe, seed=7)
    x = torch.randn(2, 9, cfg.hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        out = moe(x)
    assert out.shape == x.shape and moe.last_topk_ids.shape == (18, cfg.num_experts_per_tok)
    inter = cfg.intermediate_size
    flat = x.reshape(-1, cfg.hidden_size)
    with torch.no_grad():
        for t in range(flat.shape[0]):
            y = flat[t]
            s = torch.sigmoid(moe.gate.weight @ y)
            top = sorted(range(cfg.num_local_experts), key=lambda e: -(s[e] + moe.e_score_correction_bias[e]).item())
            top = top[: cfg.num_experts_per_tok]
            assert sorted(top) == sorted(moe.last_topk_ids[t].tolist())
            wsum = sum(s[e] for e in top)
            routed = 0
            for e in top:
                h = moe.experts.w13[e] @ y
                a = swiglu_oai(h[:inter], h[inter:], cfg.swiglu_alpha, cfg.swiglu_limit)
                routed = routed + cfg.routed_scaling_factor * s[e] / wsum * (moe.experts.w2[e] @ a)
            sh = moe.shared_experts
            shared = sh.down_proj.weight @ swiglu_oai(sh.gate_proj.weight @ y, sh.up_proj.weight @ y, 1.702, 7.0)
            assert torch.allclose(out.view(-1, cfg.hidden_size)[t], routed + shared, atol=1e-12, rtol=0)


# ------------------------------------------------------------------ model-level
def test_router_stays_fp32_in_bf16_inference():
    model = M3ForCausalLM(tiny_config())
    _randomise(model, seed=9)
    ids = torch.randint(0, 1024, (1, 100), generator=torch.Generator().manual_seed(10))
    with torch.no_grad():
        ref = model(ids)
        model.cast_for_inference(torch.bfloat16)
        for moe in model.moe_layers():
            assert moe.gate.weight.dtype == torch.float32 and moe.e_score_correction_bias.dtype == torch.float32
            assert not moe.e_score_correction_bias.requires_grad
        assert model.lm_head.weight.dtype == torch.bfloat16
        out = model(ids)
    assert out.dtype == torch.bfloat16
    # bf16 weights + activations vs fp32: same greedy token almost everywhere
    assert (out.float().argmax(-1) == ref.argmax(-1)).float().mean() > 0.9


def test_gradients_flow_for_training():
    model = M3ForCausalLM(tiny_config())
    ids = torch.randint(0, 1024, (2, 70), generator=torch.Generator().manual_seed(11))
    model(ids).float().logsumexp(-1).mean().backward()
    layer = model.model.layers[1]
    for p in (layer.block_sparse_moe.gate.weight, layer.block_sparse_moe.experts.w13, layer.self_attn.q_proj.weight,
              model.model.layers[0].mlp.up_proj.weight, model.model.embed_tokens.weight):  # fmt: skip
        assert p.grad is not None and p.grad.abs().sum() > 0
    assert layer.block_sparse_moe.e_score_correction_bias.grad is None


def test_real_config_shapes_and_parameter_count():
    """The default config is the real model: validate it and count parameters on `meta` (spec §1.3)."""
    cfg = M3Config().validate()
    with torch.device("meta"):
        model = M3ForCausalLM(cfg)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert shapes["model.layers.3.self_attn.q_proj.weight"] == (8192, 6144)
    assert shapes["model.layers.3.self_attn.index_q_proj.weight"] == (512, 6144)
    assert shapes["model.layers.3.self_attn.index_k_proj.weight"] == (128, 6144)
    assert shapes["model.layers.3.block_sparse_moe.experts.w13"] == (128, 6144, 6144)
    assert shapes["model.layers.3.block_sparse_moe.experts.w2"] == (128, 6144, 3072)
    assert shapes["model.layers.2.mlp.gate_proj.weight"] == (12288, 6144)
    assert "model.layers.2.self_attn.index_q_proj.weight" not in shapes
    total = sum(math.prod(s) for s in shapes.values())
    assert 420e9 < total < 432e9, total  # spec §1.3: ~426B text parameters


def test_paged_ops_table_checks_its_groups_and_routes_the_experts():
    """PagedOps refuses a partial fused-layer group / a lone skinny GEMM; the MoE calls the table's
    fused_experts (same result here: it is grouped_experts) only when autograd is not recording."""
    from m3_rollout.model.moe import grouped_experts
    from m3_rollout.model.paged_ops import PagedOps

    def attn(*args):
        raise AssertionError("not called")

    with pytest.raises(ValueError, match="missing"):
        PagedOps(attn, attn, add_rms_norm=attn)
    with pytest.raises(ValueError, match="skinny_linear"):
        PagedOps(attn, attn, skinny_linear=attn)
    assert not PagedOps(attn, attn).fused_layers
    calls = []

    def fused(x, ids, weights, w13, w2, *, alpha, limit, beta, expert_range):
        calls.append(x.shape[0])
        return grouped_experts(x, ids, weights, w13, w2, lambda g, u: swiglu_oai(g, u, alpha, limit, beta))

    cfg = tiny_config()
    torch.manual_seed(0)
    moe = M3MoE(cfg)
    x = torch.randn(5, cfg.hidden_size)
    with torch.no_grad():
        want = moe(x)
        got = moe(x, fused_experts=fused)
    assert calls == [5] and torch.equal(got, want)
    moe(x, fused_experts=fused).sum().backward()  # parameters require grad: the PyTorch path
    assert calls == [5] and moe.experts.w13.grad is not None


def test_grouped_gemm_experts_equal_the_per_expert_loop_with_gradients():
    """``grouped_experts_gemm`` (two ``torch._grouped_mm`` over the expert-sorted pairs, no host
    sync) against the per-expert loop ``grouped_experts``, fp32 on the CPU: outputs and the
    gradients of x, the routing weights, w13 and w2 agree to fp32 rounding, with experts that get no
    token (empty groups) and one that gets most. The CPU jobs keep the loop (``use_grouped_gemm``)."""
    from m3_rollout.model.moe import StackedExperts, grouped_experts, grouped_experts_gemm, use_grouped_gemm

    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no _grouped_mm")
    cfg = tiny_config()
    torch.manual_seed(0)
    ex = StackedExperts(cfg)
    t, k, e = 37, cfg.num_experts_per_tok, cfg.num_local_experts
    ids = torch.stack([torch.randperm(e - 1)[:k] for _ in range(t)])  # expert e-1 gets nothing
    has1 = (ids[:20] == 1).any(-1)
    ids[:20, 0] = torch.where(has1, ids[:20, 0], 1)  # expert 1 takes a large group (ids stay distinct)
    assert all(len(set(r.tolist())) == k for r in ids) and (ids[:20] == 1).any(-1).all()
    x0 = torch.randn(t, cfg.hidden_size)
    w0 = torch.rand(t, k)
    outs, grads = [], []
    for fn in (grouped_experts, grouped_experts_gemm):
        ex.zero_grad()
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        y = fn(x, ids, w, ex.w13, ex.w2, ex.act)
        (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
        outs.append(y.detach())
        grads.append([x.grad, w.grad, ex.w13.grad.clone(), ex.w2.grad.clone()])
    assert torch.allclose(outs[0], outs[1], rtol=1e-5, atol=1e-6)
    for a, b in zip(*grads):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6), (a - b).abs().max()
    assert use_grouped_gemm(x0) is None  # CPU: the loop


def test_grouped_gemm_edge_shapes_and_out_of_memory_not_swallowed(monkeypatch):
    """``grouped_experts_gemm`` vs the loop on the CPU at the edges: no tokens, every pair on one
    expert (the last; all other groups empty), K = 1, int32 ids, a non-contiguous x. And
    ``StackedExperts``: an out-of-memory error of the grouped GEMM is raised, not taken as a kernel
    that refuses the shapes (regression: it switched the process to the loop for good)."""
    import m3_rollout.model.moe as moe

    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no _grouped_mm")
    cfg = tiny_config()
    torch.manual_seed(0)
    ex = moe.StackedExperts(cfg).requires_grad_(False)
    e, k, h = cfg.num_local_experts, cfg.num_experts_per_tok, cfg.hidden_size
    x = torch.randn(h, 9).t()  # [9, H], not contiguous
    ids = torch.stack([torch.randperm(e)[:k] for _ in range(9)])
    w = torch.rand(9, k)
    cases = [
        (torch.randn(0, h), ids[:0], w[:0]),
        (x, torch.full((9, 1), e - 1), w[:, :1]),
        (x, ids[:, :1], w[:, :1]),
        (x, ids.to(torch.int32), w),
    ]
    for xs, i, ws in cases:
        want = moe.grouped_experts(xs, i.long(), ws, ex.w13, ex.w2, ex.act)
        got = moe.grouped_experts_gemm(xs, i, ws, ex.w13, ex.w2, ex.act)
        assert got.shape == want.shape and torch.allclose(got, want, rtol=1e-5, atol=1e-5)

    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory (test)")

    monkeypatch.setattr(moe, "use_grouped_gemm", lambda x: torch.float32)
    monkeypatch.setattr(moe, "grouped_experts_gemm", oom)
    monkeypatch.setattr(moe, "_GROUPED_GEMM_OK", True)
    with pytest.raises(torch.OutOfMemoryError):
        ex(x, ids, w)
    assert moe._GROUPED_GEMM_OK

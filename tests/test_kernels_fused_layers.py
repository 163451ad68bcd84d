"""Fused layer kernels (kernels/fused_layers.py) vs the model's PyTorch ops, on CPU under the Triton
interpreter (fp32 / fp16 only: the interpreter mishandles bf16).

References are the model's own functions (norm.gemma_rms_norm, rope.apply_rope / rope_cos_sin,
attention.write_paged_kv, moe.swiglu_oai, moe.route), so the tests pin "same maths, same roundings".
Tolerances (stated): fp32 1e-5 absolute (values are O(1); fp32 reduction order / FMA only);
fp16 one fp16 ulp at |x| <= 4 (4e-3): the kernels round at the same points as the PyTorch path, so
only an fp32 difference straddling a rounding boundary can flip the last bit.
"""

from __future__ import annotations

import pytest
import torch

from m3_kernels.fused_interpret import interpreted_fused_layers
from m3_rollout.model.attention import write_paged_kv
from m3_rollout.model.moe import route, swiglu_oai
from m3_rollout.model.norm import gemma_rms_norm
from m3_rollout.model.rope import apply_rope, rope_cos_sin

fl = interpreted_fused_layers()
ATOL = {torch.float32: 1e-5, torch.float16: 4e-3}
EPS = 1e-6


def _rand(*shape, dtype, gen, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("sparse", [False, True])
@pytest.mark.parametrize("table", [False, True])
def test_qkv_norm_rope_write_matches_pytorch(dtype, sparse, table):
    gen = torch.Generator().manual_seed(1)
    nh, g, d, di, r, ps, pages = 4, 2, 16, 8, 8, 4, 5  # d != di, rotary on part of each head
    t = 6
    nidx = g if sparse else 0
    width = nh * d + 2 * g * d + ((nidx + 1) * di if sparse else 0)
    qkv = _rand(t, width, dtype=dtype, gen=gen, scale=2.0)
    positions = torch.tensor([0, 5, 6, 7, 19, 3])
    slot = torch.tensor([2, 9, -1, 11, 17, 0])  # -1: padding -> null page
    cos, sin = rope_cos_sin(positions, r, 10000.0)
    qw, kw = _rand(d, dtype=dtype, gen=gen, scale=0.3), _rand(d, dtype=dtype, gen=gen, scale=0.3)
    iqw, ikw = _rand(di, dtype=dtype, gen=gen, scale=0.3), _rand(di, dtype=dtype, gen=gen, scale=0.3)
    kc, vc = torch.zeros(pages + 1, g, ps, d, dtype=dtype), torch.zeros(pages + 1, g, ps, d, dtype=dtype)
    ic = torch.zeros(pages + 1, ps, di, dtype=dtype) if sparse else None
    kc_ref, vc_ref = kc.clone(), vc.clone()
    ic_ref = ic.clone() if sparse else None

    # reference: the model's PyTorch ops in forward_paged order
    c, s = cos[:, None, :], sin[:, None, :]
    o = [0, nh * d, nh * d + g * d, nh * d + 2 * g * d, nh * d + 2 * g * d + nidx * di]
    q_ref = apply_rope(gemma_rms_norm(qkv[:, o[0] : o[1]].reshape(t, nh, d), qw, EPS), c, s)
    k_ref = apply_rope(gemma_rms_norm(qkv[:, o[1] : o[2]].reshape(t, g, d), kw, EPS), c, s)
    v_ref = qkv[:, o[2] : o[3]].reshape(t, g, d)
    iq_ref = ik_ref = None
    if sparse:
        iq_ref = apply_rope(gemma_rms_norm(qkv[:, o[3] : o[4]].reshape(t, nidx, di), iqw, EPS), c, s)
        ik_ref = apply_rope(gemma_rms_norm(qkv[:, o[4] :], ikw, EPS), cos, sin)
    write_paged_kv(slot, k_ref, v_ref, ik_ref, kc_ref, vc_ref, ic_ref)

    kw_idx = (
        dict(index_q_norm_w=iqw, index_k_norm_w=ikw, num_index_heads=nidx, index_dim=di, index_cache=ic)
        if sparse
        else {}
    )
    if table:  # cos/sin rows looked up by position in [max_pos, r/2] tables
        kw_idx["positions"] = positions
        cos, sin = rope_cos_sin(torch.arange(24), r, 10000.0)
    q, iq = fl.qkv_norm_rope_write(qkv, cos, sin, slot, qw, kw, nh, g, d, kc, vc, EPS, **kw_idx)
    tol = ATOL[dtype]
    torch.testing.assert_close(q.float(), q_ref.float(), atol=tol, rtol=0)
    torch.testing.assert_close(kc.float(), kc_ref.float(), atol=tol, rtol=0)
    assert torch.equal(vc, vc_ref)  # V is a plain copy
    if sparse:
        torch.testing.assert_close(iq.float(), iq_ref.float(), atol=tol, rtol=0)
        torch.testing.assert_close(ic.float(), ic_ref.float(), atol=tol, rtol=0)
    else:
        assert iq is None
    # rotation really happened on the first r channels only (guards a no-op kernel + no-op reference)
    plain = gemma_rms_norm(qkv[:, : nh * d].reshape(t, nh, d), qw, EPS)
    assert (q[1:, :, :r].float() - plain[1:, :, :r].float()).abs().max() > 0.1
    torch.testing.assert_close(q[..., r:].float(), plain[..., r:].float(), atol=tol, rtol=0)


def test_qkv_norm_rope_write_rejects_bad_width():
    qkv = torch.zeros(2, 10)
    cos = torch.zeros(2, 2)
    kc = torch.zeros(2, 1, 2, 4)
    with pytest.raises(ValueError, match="qkv"):
        fl.qkv_norm_rope_write(
            qkv,
            cos,
            cos,
            torch.zeros(2, dtype=torch.long),
            torch.zeros(4),
            torch.zeros(4),
            1,
            1,
            4,
            kc,
            kc.clone(),
            EPS,
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_add_rms_norm_matches_pytorch(dtype):
    gen = torch.Generator().manual_seed(2)
    t, n = 5, 48  # n not a power of two: masked lanes
    x, x2, res = (_rand(t, n, dtype=dtype, gen=gen) for _ in range(3))
    w = _rand(n, dtype=dtype, gen=gen, scale=0.2)
    # two addends + residual (MoE: routed + shared), with the fp32 router copy
    res_ref = res + (x + x2)
    y_ref = gemma_rms_norm(res_ref, w, EPS)
    res_k = res.clone()
    y, y32 = fl.add_rms_norm(x, w, EPS, residual=res_k, x2=x2, want_fp32=True)
    tol = ATOL[dtype]
    torch.testing.assert_close(res_k.float(), res_ref.float(), atol=tol, rtol=0)
    torch.testing.assert_close(y.float(), y_ref.float(), atol=tol, rtol=0)
    assert y32.dtype == torch.float32 and torch.equal(y32, y.float())
    # one addend; and the plain norm (no residual)
    res_k = res.clone()
    y, none = fl.add_rms_norm(x, w, EPS, residual=res_k)
    assert none is None
    torch.testing.assert_close(y.float(), gemma_rms_norm(res + x, w, EPS).float(), atol=tol, rtol=0)
    y, _ = fl.add_rms_norm(x, w, EPS)
    torch.testing.assert_close(y.float(), gemma_rms_norm(x, w, EPS).float(), atol=tol, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_swiglu_matches_pytorch(dtype):
    gen = torch.Generator().manual_seed(3)
    t, i = 3, 40
    gu = _rand(t, 2 * i, dtype=dtype, gen=gen, scale=6.0)  # hits both clamps (limit 7)
    got = fl.swiglu(gu, 1.702, 7.0, 1.0)
    ref = swiglu_oai(gu[:, :i], gu[:, i:], 1.702, 7.0, 1.0)
    torch.testing.assert_close(got.float(), ref.float(), atol=ATOL[dtype] * 8, rtol=ATOL[dtype])


@pytest.mark.parametrize("with_bias", [False, True])
def test_router_topk_matches_route(with_bias):
    gen = torch.Generator().manual_seed(4)
    t, e, k = 7, 12, 3
    logits = torch.randn(t, e, generator=gen)
    logits[0, 5] = logits[0, 2]  # exact tie: the lower expert id must win
    logits[0, 2] += 5.0
    logits[0, 5] += 5.0
    bias = torch.randn(e, generator=gen) * 0.5 if with_bias else None
    w, ids = fl.router_topk(logits, bias, k, 2.0)
    w_ref, ids_ref = route(logits, bias, k, 2.0)
    assert torch.equal(ids, ids_ref)
    torch.testing.assert_close(w, w_ref, atol=1e-6, rtol=0)
    assert ids[0, 0] == 2 and ids[0, 1] == 5 or with_bias  # tie order (without bias)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_router_gemm_topk_matches_linear_and_route(dtype):
    gen = torch.Generator().manual_seed(6)
    t, h, e, k = 5, 72, 12, 3  # h not a multiple of the H chunk
    x = _rand(t, h, dtype=dtype, gen=gen)
    gw = torch.randn(e, h, generator=gen) * 0.3
    bias = torch.randn(e, generator=gen) * 0.2
    w, ids = fl.router_gemm_topk(x, gw, bias, k, 2.0)
    w_ref, ids_ref = route(torch.nn.functional.linear(x.float(), gw), bias, k, 2.0)
    assert torch.equal(ids, ids_ref)
    torch.testing.assert_close(w, w_ref, atol=1e-5, rtol=0)
    assert fl.router_gemm_topk_ok(t, gw) and not fl.router_gemm_topk_ok(1 << 22, gw)


def test_zero_tokens_launch_nothing():
    q, iq = fl.qkv_norm_rope_write(
        torch.zeros(0, 3 * 4),
        torch.zeros(0, 1),
        torch.zeros(0, 1),
        torch.zeros(0, dtype=torch.long),
        torch.zeros(4),
        torch.zeros(4),
        1,
        1,
        4,
        torch.zeros(2, 1, 2, 4),
        torch.zeros(2, 1, 2, 4),
        EPS,
    )
    assert q.shape == (0, 1, 4) and iq is None
    y, _ = fl.add_rms_norm(torch.zeros(0, 8), torch.zeros(8), EPS)
    assert y.shape == (0, 8)


@pytest.mark.parametrize("t", [1, 5, 20])
def test_skinny_linear_matches_linear(t):
    gen = torch.Generator().manual_seed(7)
    n, k = 40, 300  # N and K not multiples of the tiles
    x = _rand(t, k, dtype=torch.float16, gen=gen)
    w = _rand(n, k, dtype=torch.float16, gen=gen, scale=0.1)
    got = fl.skinny_linear(x, w)
    ref = torch.nn.functional.linear(x.float(), w.float())
    torch.testing.assert_close(got.float(), ref, atol=4e-3, rtol=2e-3)  # fp32 accumulation, one fp16 rounding
    # the gate|up GEMM with SwiGLU-OAI in the epilogue: [2n, k] packed weight -> [t, n] activation,
    # each product rounded to fp16 first, like the gate|up GEMM followed by swiglu_oai
    wgu = _rand(2 * n, k, dtype=torch.float16, gen=gen, scale=0.5)
    got = fl.skinny_linear(x, wgu, (1.702, 7.0, 1.0))
    gu = torch.nn.functional.linear(x.float(), wgu.float()).half()
    ref = swiglu_oai(gu[:, :n], gu[:, n:], 1.702, 7.0, 1.0)
    assert got.shape == (t, n) and gu.abs().max() > 7.0  # the clamps bite
    torch.testing.assert_close(got.float(), ref.float(), atol=2e-2, rtol=4e-3)
    with pytest.raises(ValueError, match="gate\\|up"):
        fl.skinny_linear(x, wgu[1:], (1.702, 7.0, 1.0))  # odd row count
    with pytest.raises(ValueError, match="alpha, limit, beta"):
        fl.skinny_linear(x, wgu, ())  # not None, not three numbers: no silent SwiGLU launch
    with pytest.raises(ValueError, match="weight"):
        fl.skinny_linear(x, wgu[0])  # a 1-D weight
    one = fl.skinny_linear(x, wgu[[0, n]], (1.702, 7.0, 1.0))  # I = 1
    torch.testing.assert_close(one.float(), ref[:, :1].float(), atol=2e-2, rtol=4e-3)
    assert not fl.skinny_linear_ok(torch.zeros(33, k, dtype=torch.float16), w)  # > 32 tokens: cuBLAS
    assert not fl.skinny_linear_ok(x.float(), w.float())  # fp32 stays on cuBLAS

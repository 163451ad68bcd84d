"""The model's fused paged path (model/fused.py + kernels/fused_layers.py, handed in through
``engine.ops.interpreted_paged_ops``) == its PyTorch paged path, run on CPU with the Triton kernels
in the interpreter (fp32); plus packed weights under weight sync.

Tolerance (stated): fp32 logits within 2e-5 absolute, caches within 1e-5 (fp32 reduction order in
the norms and the router/gemm accumulation order only).
"""

from __future__ import annotations

import pytest
import torch
from paged_model_util import small_paged_model  # tests/ on sys.path

from m3_kernels.fused_interpret import interpreted_fused_layers
from m3_rollout.engine.model_runner import prepare_inputs
from m3_rollout.engine.ops import interpreted_paged_ops, paged_ops_for
from m3_rollout.engine.paged_cache import PagedKVCache
from m3_rollout.model.fused import packed_linear, packed_ok
from m3_rollout.model.loading import load_released_tensor

FUSED = interpreted_paged_ops()  # fused layer ops under the Triton interpreter (CPU)
PYTORCH = paged_ops_for("cpu", torch.float32)  # the engine's CPU table: PyTorch path
PS = 4


def _model(seed=0):
    return small_paged_model(seed, vocab_size=64, page_size=PS)


def _steps():
    """Prefill of two rows (11 and 6 tokens), then a decode step of both rows (sparse: 12 > 2*4)."""
    g = torch.Generator().manual_seed(5)
    a, b = torch.randint(0, 64, (12,), generator=g).tolist(), torch.randint(0, 64, (7,), generator=g).tolist()
    bt = [[0, 3, 5], [1, 4]]
    yield prepare_inputs([a[:11], b[:6]], [0, 0], bt, PS, 0)
    yield prepare_inputs([a[11:], b[6:]], [11, 6], bt, PS, 2)


@torch.no_grad()
def _run(model, fused):
    assert not PYTORCH.fused_layers and FUSED.fused_layers
    kv = PagedKVCache(model.config, 8, torch.float32)
    logits = [model.forward_paged(s.input_ids, s.meta, kv, FUSED if fused else PYTORCH) for s in _steps()]
    return logits, kv


@pytest.mark.parametrize("per_token_router", [True, False])
def test_fused_paged_forward_matches_pytorch_path(per_token_router, monkeypatch):
    if not per_token_router:  # the cuBLAS router GEMM + router_topk route (prefill-sized steps)
        monkeypatch.setattr(interpreted_fused_layers(), "ROUTER_GEMM_MAX_ELEMS", 0)
    m = _model()
    want, kv_want = _run(m, fused=False)
    got, kv_got = _run(m, fused=True)
    for g, w in zip(got, want):
        assert (g - w).abs().max().item() < 2e-5
    for name in ("k_cache", "v_cache", "index_cache"):
        assert (getattr(kv_got, name) - getattr(kv_want, name)).abs().max().item() < 1e-5
    moe = m.moe_layers()[0]
    assert moe.last_topk_ids.shape == (2, m.config.num_experts_per_tok)


def test_packed_weights_follow_in_place_weight_sync():
    m = _model()
    m.pack_fused_weights()
    attn = m.model.layers[1].self_attn
    mlp = m.model.layers[0].mlp
    assert packed_ok(attn.packed_proj, attn.projection_linears())
    assert packed_ok(mlp.packed_gate_up, [mlp.gate_proj, mlp.up_proj])
    # a weight update through the released name lands in the packed buffer (same storage)
    new_k = torch.randn_like(attn.k_proj.weight)
    load_released_tensor(m, "model.layers.1.self_attn.k_proj.weight", new_k)
    off = attn.q_proj.weight.shape[0]
    assert torch.equal(attn.packed_proj[off : off + new_k.shape[0]], new_k)
    new_up = torch.randn_like(mlp.up_proj.weight)
    load_released_tensor(m, "model.layers.0.mlp.up_proj.weight", new_up)
    assert torch.equal(mlp.packed_gate_up[mlp.gate_proj.weight.shape[0] :], new_up)
    # fused (packed GEMMs) still equals the PyTorch path after the update
    want, _ = _run(m, fused=False)
    got, _ = _run(m, fused=True)
    for g, w in zip(got, want):
        assert (g - w).abs().max().item() < 2e-5
    # re-pointing a parameter breaks the aliasing: detected, and the projection falls back to
    # per-Linear GEMMs, which see the new storage (a packed GEMM would use the stale buffer)
    new_v = attn.v_proj.weight.data.clone() + 1.0
    attn.v_proj.weight.data = new_v
    assert not packed_ok(attn.packed_proj, attn.projection_linears())
    x = torch.randn(3, m.config.hidden_size)
    want_qkv = torch.cat([torch.nn.functional.linear(x, lin.weight) for lin in attn.projection_linears()], -1)
    assert torch.equal(packed_linear(x, attn.packed_proj, attn.projection_linears()), want_qkv)


def test_fused_paged_forward_fp16_with_skinny_gemm():
    """fp16 (the GPU dtype the Triton skinny GEMM takes): fused path with the decode GEMMs on Triton
    (decode step: T = 2 <= 32) vs the PyTorch path; tolerance 3e-2 (fp16 roundings in different
    places: cuBLAS-free fp32 accumulation vs CPU fp16 matmul)."""
    m = _model().cast_for_inference(torch.float16)
    want, _ = _run(m, fused=False)
    assert FUSED.skinny_linear is not None
    kv = PagedKVCache(m.config, 8, torch.float16)
    with torch.no_grad():
        got = [m.forward_paged(s.input_ids, s.meta, kv, FUSED) for s in _steps()]
    for g, w in zip(got, want):
        assert (g.float() - w.float()).abs().max().item() < 3e-2

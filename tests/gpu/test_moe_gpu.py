"""Fused MoE on a CUDA GPU, bf16, real shapes; skipped without CUDA.

Tolerance (flash-attention style error budget): against an fp32 PyTorch reference (same bf16
inputs, weights upcast, `grouped_experts` in fp32), the kernel's max abs error must be at most
2x the max abs error of the same reference computed in bf16 by PyTorch, plus 1e-3 of the output
scale (max |ref|). The kernel accumulates in fp32 and rounds fewer intermediates than the bf16
reference, so it is usually below 1x.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from m3_kernels.fused_moe import GemmTile, MoEKernelConfig, default_config, fused_experts  # noqa: E402
from m3_rollout.engine.ops import paged_ops_for  # noqa: E402
from m3_rollout.model import tiny_config  # noqa: E402
from m3_rollout.model.moe import M3MoE, grouped_experts, route, swiglu_oai  # noqa: E402

ALPHA, LIMIT, BETA, SCALING = 1.702, 7.0, 1.0, 2.0
# MoE sizes of the benchmark model configs/bench/m3_bench_300m.json.
BENCH_MOE = dict(
    hidden_size=1024, intermediate_size=512, num_local_experts=16, num_experts_per_tok=4, shared_intermediate_size=512
)
BENCH_JSON = Path(__file__).resolve().parents[2] / "configs" / "bench" / "m3_bench_300m.json"

OPS = paged_ops_for("cuda", torch.bfloat16)  # the engine table: fused_experts = the Triton MoE


def _act(g, u):
    return swiglu_oai(g, u, ALPHA, LIMIT, BETA)


def _weights(e, h, inter, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    # scales make gate/up ~ N(0, 2^2) for unit x: a few percent of gates pass the clamp at 7
    w13 = (torch.randn(e, 2 * inter, h, device="cuda", generator=g) * (2.0 / h**0.5)).bfloat16()
    w2 = (torch.randn(e, h, inter, device="cuda", generator=g) * inter**-0.5).bfloat16()
    return w13, w2


def _routing(t, e, k, h, seed, forced=None):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(t, h, device="cuda", generator=g).bfloat16()
    logits = torch.randn(t, e, device="cuda", generator=g)  # fp32 router logits
    if forced is not None:
        logits[:, forced] = 30.0
    weights, ids = route(logits, None, k, SCALING)
    return x, ids, weights


def _check(x, ids, weights, w13, w2, rng, name, config=None):
    a, b = rng
    out = fused_experts(
        x, ids, weights, w13[a:b], w2[a:b], alpha=ALPHA, limit=LIMIT, beta=BETA, expert_range=rng, config=config
    )
    torch.cuda.synchronize()
    w_local = weights * ((ids >= a) & (ids < b))
    ref32 = grouped_experts(x.float(), ids, w_local, w13.float(), w2.float(), _act)
    ref16 = grouped_experts(x, ids, w_local, w13, w2, _act).float()
    err = (out.float() - ref32).abs().max().item()
    err16 = (ref16 - ref32).abs().max().item()
    scale = ref32.abs().max().item()
    print(f"{name}: max|ref|={scale:.3g} kernel err={err:.3g} bf16-ref err={err16:.3g}")
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    assert torch.isfinite(out).all()
    assert err <= 2 * err16 + 1e-3 * scale, f"{name}: kernel err {err:.3g} > 2 x bf16 reference err {err16:.3g}"


def test_real_shapes_h6144_i3072_e128_top4():
    """Spec §1.2 real sizes: hidden 6144, expert width 3072, 128 experts, top-4."""
    e, h, inter, k = 128, 6144, 3072, 4
    w13, w2 = _weights(e, h, inter, 0)
    for t in (1, 5, 64, 700):
        x, ids, weights = _routing(t, e, k, h, t)
        _check(x, ids, weights, w13, w2, (0, e), f"real T={t}")
    x, ids, weights = _routing(96, e, k, h, 7)
    _check(x, ids, weights, w13, w2, (32, 64), "real T=96 EP slice [32,64)")


# Large-T kernel paths named explicitly (default_config picks one of them by rows per expert).
LARGE_PATHS = {
    "aligned_bm128": MoEKernelConfig(128, GemmTile(128, 64, 8, 4), GemmTile(256, 64, 8, 3)),
    "tma_bm64": MoEKernelConfig(64, GemmTile(128, 64, 4, 4, 4), GemmTile(256, 64, 8, 4, 4), tma=True),
    "ragged_permuted": MoEKernelConfig(
        128, GemmTile(128, 64, 8, 4, 4), GemmTile(256, 64, 8, 3, 4), ragged=True, permute=True
    ),
    "ragged_fat_permuted": MoEKernelConfig(
        128, GemmTile(128, 64, 8, 3, 4), GemmTile(256, 64, 8, 3, 4), ragged=True, fat_tail=64, permute=True
    ),
    "ragged_fat_gather": MoEKernelConfig(
        128, GemmTile(128, 64, 8, 3, 4), GemmTile(256, 64, 8, 3, 4), ragged=True, fat_tail=64
    ),
}


def test_large_t_paths_real_shape():
    """T=4096 on the real sizes (~128 rows per expert, tails of every height) through each large-T path."""
    e, h, inter, k = 128, 6144, 3072, 4
    w13, w2 = _weights(e, h, inter, 2)
    x, ids, weights = _routing(4096, e, k, h, 11)
    print("default at T=4096:", default_config(4096 * k, e, h, inter))
    for name, cfg in LARGE_PATHS.items():
        _check(x, ids, weights, w13, w2, (0, e), f"real T=4096 {name}", config=cfg)
    x, ids, weights = _routing(1500, e, k, h, 12)
    _check(
        x,
        ids,
        weights,
        w13,
        w2,
        (64, 128),
        "real T=1500 EP slice [64,128) ragged_fat_gather",
        config=LARGE_PATHS["ragged_fat_gather"],
    )


def test_large_t_path_cuda_graph():
    """The ragged path (align, permute, TMA GEMMs, combine) replays in a CUDA graph with new routing."""
    e, h, inter, k = 16, 1024, 512, 4
    w13, w2 = _weights(e, h, inter, 3)
    x, ids, weights = _routing(2048, e, k, h, 13)
    cfg = LARGE_PATHS["ragged_fat_gather"]
    run = lambda: fused_experts(x, ids, weights, w13, w2, alpha=ALPHA, limit=LIMIT, config=cfg)  # noqa: E731
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        run()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = run()
    x2, ids2, weights2 = _routing(2048, e, k, h, 14)
    x.copy_(x2), ids.copy_(ids2), weights.copy_(weights2)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(static_out, run(), atol=0, rtol=0)
    _check(x, ids, weights, w13, w2, (0, e), "bench T=2048 graph replay inputs", config=cfg)


def test_bench_moe_sizes_match_json():
    cfg = json.loads(BENCH_JSON.read_text())
    assert {key: cfg[key] for key in BENCH_MOE} == BENCH_MOE


def test_bench_model_shapes():
    e, h = BENCH_MOE["num_local_experts"], BENCH_MOE["hidden_size"]
    inter, k = BENCH_MOE["intermediate_size"], BENCH_MOE["num_experts_per_tok"]
    w13, w2 = _weights(e, h, inter, 1)
    for t in (1, 7, 128, 3000):
        x, ids, weights = _routing(t, e, k, h, 100 + t)
        _check(x, ids, weights, w13, w2, (0, e), f"bench T={t}")
    x, ids, weights = _routing(513, e, k, h, 5, forced=3)  # expert 3 gets every token
    assert (ids == 3).any(-1).all()
    _check(x, ids, weights, w13, w2, (0, e), "bench T=513 one expert gets all")
    x, ids, weights = _routing(200, e, k, h, 6)
    _check(x, ids, weights, w13, w2, (4, 12), "bench T=200 EP slice [4,12)")
    empty = fused_experts(x[:0], ids[:0], weights[:0], w13, w2, alpha=ALPHA, limit=LIMIT)
    assert empty.shape == (0, h)


def _bench_moe_module():
    cfg = tiny_config(**BENCH_MOE)
    torch.manual_seed(0)
    moe = M3MoE(cfg).cuda()
    moe.experts.bfloat16()
    moe.shared_experts.bfloat16()
    with torch.no_grad():
        moe.e_score_correction_bias.normal_(std=0.1)
    return moe, cfg.hidden_size


def test_module_hook_and_cuda_graph_decode():
    """M3MoE with the fused op handed in (the engine's ``PagedOps.fused_experts`` on CUDA) takes the
    fused path; router + align + kernels capture in a CUDA graph."""
    moe, h = _bench_moe_module()
    x = torch.randn(4, h, device="cuda").bfloat16()
    with torch.no_grad():
        out = moe(x, fused_experts=OPS.fused_experts)
        weights, ids = moe.router(x)
        ref = grouped_experts(x, ids, weights, moe.experts.w13, moe.experts.w2, moe.experts.act) + moe.shared_experts(x)
        torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)

        static_x = x.clone()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            moe(static_x, fused_experts=OPS.fused_experts)  # warm-up: compiles the kernels outside the capture
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):  # raises if anything in the path syncs with the host
            static_out = moe(static_x, fused_experts=OPS.fused_experts)
        new_x = torch.randn(4, h, device="cuda").bfloat16() * 3
        static_x.copy_(new_x)
        graph.replay()
        torch.cuda.synchronize()
        eager = moe(new_x, fused_experts=OPS.fused_experts)
        assert not torch.equal(eager, out)  # the new input routes differently / gives new values
        torch.testing.assert_close(static_out, eager, atol=0, rtol=0)


def test_training_experts_take_the_grouped_gemm_without_host_syncs():
    """The trainer's routed experts on the H200 (bf16 autocast over fp32 weights, as the SFT warm
    start and the bf16 compute copy run): ``StackedExperts`` takes ``grouped_experts_gemm`` (two
    ``torch._grouped_mm``), which makes no host sync (CUDA sync-debug mode 'error' raises on one),
    and its output and gradients match the per-expert loop within bf16 rounding (relative 2e-2 of
    each tensor's max)."""
    import m3_rollout.model.moe as moe
    from m3_rollout.model.moe import StackedExperts, grouped_experts_gemm, use_grouped_gemm

    cfg = tiny_config(**BENCH_MOE)
    torch.manual_seed(0)
    ex = StackedExperts(cfg).cuda()
    t, k, e = 4096, cfg.num_experts_per_tok, cfg.num_local_experts
    ids = torch.stack([torch.randperm(e - 1)[:k] for _ in range(t)]).cuda()  # one expert gets nothing
    x0 = torch.randn(t, cfg.hidden_size, device="cuda")
    w0 = torch.rand(t, k, device="cuda")

    def run(experts):  # experts(x, w) -> y under bf16 autocast; y and every gradient
        ex.zero_grad()
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            assert use_grouped_gemm(x) == torch.bfloat16
            y = experts(x, w)
        (y.float() * torch.linspace(-1, 1, y.numel(), device="cuda").view_as(y)).sum().backward()
        return [y.detach().float(), x.grad, w.grad, ex.w13.grad.clone(), ex.w2.grad.clone()]

    def gemm(x, w):
        return grouped_experts_gemm(x, ids, w, ex.w13, ex.w2, ex.act, torch.bfloat16)

    def gemm_checked(x, w):
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:  # the op itself (a sync raises here, not inside StackedExperts' fallback)
            y = gemm(x, w)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        with torch.no_grad():  # and StackedExperts takes it (same bits as the op)
            assert torch.equal(ex(x, ids, w), y) and moe._GROUPED_GEMM_OK
        return y

    res = [run(gemm_checked), run(lambda x, w: grouped_experts(x, ids, w, ex.w13, ex.w2, ex.act))]
    for a, b in zip(*res):
        err = (a - b).abs().max().item()
        assert err <= 2e-2 * b.abs().max().item(), err
    for a, b in zip(res[0][3:], res[1][3:]):  # expert weight gradients, each expert against its own scale
        assert torch.count_nonzero(a[e - 1]) == 0 and torch.count_nonzero(b[e - 1]) == 0  # the expert with no tokens
        per_expert = (a[: e - 1] - b[: e - 1]).abs().amax(dim=(1, 2)) / b[: e - 1].abs().amax(dim=(1, 2))
        assert per_expert.max().item() <= 2e-2, per_expert.max().item()
    # run to run deterministic: output and every gradient bitwise equal
    assert all(torch.equal(a, b) for a, b in zip(res[0], run(gemm)))


def _gpu_preset_model():
    """(config, fp32 CUDA model) of builtin:m3-gpu-small's shapes, seed 0."""
    from m3_rollout.jobs.builtin import gpu_small_spec
    from m3_rollout.model import M3ForCausalLM

    cfg = tiny_config(**gpu_small_spec().model_overrides)
    torch.manual_seed(0)
    return cfg, M3ForCausalLM(cfg).cuda().float()


def _relative_diffs(a: dict, b: dict) -> dict:
    """{name: |a - b| / |b|} over b's tensors (Frobenius norms)."""
    return {n: ((a[n] - b[n]).norm() / b[n].norm().clamp_min(1e-30)).item() for n in b}


def test_sft_steps_on_the_gpu_preset_take_the_same_path_with_grouped_gemm_and_loop():
    """The warm start's training on the GPU preset's shapes (builtin:m3-gpu-small: 16 experts top-4,
    hidden 768; a batch of 32 x 300 tokens with padded tails, bf16 autocast over fp32 masters,
    AdamW lr 2e-3, clip 1.0, as trainers/warm_start.py runs it) with the routed experts as grouped
    GEMMs vs the per-expert loop, from the same initial weights on the same batches. Session 9/10
    builds with the grouped GEMM needed 750-1,050 SFT steps to reach the accuracy window where the
    loop needed ~430; this test says whether the two differ at the first gradient and over 20 steps (losses within 5 %).
    Measured 2026-12-02 (H200): losses within 0.03 % over the 20 steps; so the grouped GEMM is not
    why those builds took longer (a deterministic build since took 512 steps)."""
    import copy

    import m3_rollout.model.moe as moe
    from m3_trainers.policy import token_logprobs

    cfg, base = _gpu_preset_model()
    gen = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(20):
        ids = torch.randint(3, cfg.vocab_size, (32, 300), generator=gen)
        lens = torch.randint(200, 301, (32,), generator=gen)
        mask = (torch.arange(300)[None, :] < lens[:, None]).float()
        mask[:, :150] = 0.0  # the prompt part carries no loss
        ids = torch.where(torch.arange(300)[None, :] < lens[:, None], ids, 0)  # pad id 0 in the tail
        batches.append((ids.cuda(), mask.cuda()))
    runs = {}
    old = moe._GROUPED_GEMM_ENV
    try:
        for grouped in (True, False):
            moe._GROUPED_GEMM_ENV = grouped
            model = copy.deepcopy(base)
            opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
            losses, first_grads = [], None
            for ids, mask in batches:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    lp = token_logprobs(model, ids)
                loss = -(lp * mask).sum() / mask.sum()
                opt.zero_grad(set_to_none=True)
                loss.backward()
                if first_grads is None:
                    named = model.named_parameters()
                    first_grads = {n: p.grad.detach().clone() for n, p in named if p.grad is not None}
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                losses.append(loss.item())
            runs[grouped] = (losses, first_grads)
            assert moe._GROUPED_GEMM_OK  # the grouped run did not fall back to the loop
    finally:
        moe._GROUPED_GEMM_ENV = old
    (la, ga), (lb, gb) = runs[True], runs[False]
    assert ga.keys() == gb.keys()
    rel = _relative_diffs(ga, gb)
    worst = sorted(rel.items(), key=lambda kv: -kv[1])[:5]
    print("first-step gradient relative difference, worst 5:", worst)
    print("losses grouped:", [round(x, 4) for x in la])
    print("losses loop:   ", [round(x, 4) for x in lb])
    # the GRPO trainer's forward: the bf16 compute copy (no autocast), logprobs loop vs grouped
    lps = {}
    try:
        for grouped in (True, False):
            moe._GROUPED_GEMM_ENV = grouped
            with torch.no_grad():
                lps[grouped] = token_logprobs(copy.deepcopy(base).bfloat16(), batches[0][0])
    finally:
        moe._GROUPED_GEMM_ENV = old
    d = (lps[True] - lps[False]).abs()
    print(f"bf16 logprobs, grouped vs loop: max |d| {d.max().item():.3e}, mean |d| {d.mean().item():.3e}")
    # First-step gradients: the combine adds a token's K slots in slot order, the loop in expert
    # order; that fp32 difference flips a few bf16 roundings and router top-k near-ties downstream,
    # which moves the last MoE layers' router and expert gradients (H200 2026-12-02: the five worst
    # 6-12 %, all routers / experts of layers 6 and 7). An index_add combine, which happened to add
    # in the loop's order, gave 0.18 % at most. So: the median parameter within 3e-2, all within 0.25.
    assert sorted(rel.values())[len(rel) // 2] <= 3e-2, worst
    assert worst[0][1] <= 0.25, worst
    for a, b in zip(la, lb):
        assert abs(a - b) <= 5e-2 * abs(b), (la, lb)
    assert d.mean().item() <= 2e-2, d.mean().item()


def test_first_step_gradients_with_only_the_combine_swapped(monkeypatch):
    """Which part of the grouped GEMM moves the preset's first-step gradients away from the loop's:
    the same model and batch, bf16 autocast over fp32 weights, through (a) the loop, (b)
    ``grouped_experts_gemm`` (slot-order sum), (c) the same grouped GEMMs with the combine swapped
    for one index_add over all pairs (the code before 2026-12-02, which on the H200 gave 0.18 % at
    most against the loop). (c) vs (a) must stay within 3e-2 of every parameter's norm; (b) vs (a)
    and (b) vs (c) are printed: large (b) differences with a small (c) one put them on the
    summation order of the combine, amplified by router top-k flips."""
    import copy

    import m3_rollout.model.moe as moe
    from m3_trainers.policy import token_logprobs

    cfg, base = _gpu_preset_model()
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, cfg.vocab_size, (32, 300), generator=gen).cuda()
    slot_order = moe.grouped_experts_gemm

    def index_add_combine(x, ids_, weights, w13, w2, act, dtype=None):
        t, k = ids_.shape
        inter, dt = w2.shape[-1], dtype or x.dtype
        flat = ids_.reshape(-1)
        order = torch.argsort(flat, stable=True)
        token = order // k
        experts = torch.arange(w13.shape[0], device=flat.device, dtype=flat.dtype)
        offs = torch.searchsorted(flat[order], experts, right=True).to(torch.int32)
        h = torch._grouped_mm(x[token].to(dt), w13.to(dt).transpose(1, 2), offs=offs)
        y = torch._grouped_mm(act(h[:, :inter], h[:, inter:]), w2.to(dt).transpose(1, 2), offs=offs)
        y = (y.to(weights.dtype) * weights.reshape(-1)[order, None]).to(x.dtype)
        return torch.zeros_like(x).index_add_(0, token, y)

    def first_grads(env, fn):
        monkeypatch.setattr(moe, "_GROUPED_GEMM_ENV", env)
        monkeypatch.setattr(moe, "grouped_experts_gemm", fn)
        model = copy.deepcopy(base)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = -token_logprobs(model, ids).mean()
        loss.backward()
        assert moe._GROUPED_GEMM_OK
        return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}

    loop, slots = first_grads(False, slot_order), first_grads(True, slot_order)
    added = first_grads(True, index_add_combine)

    def worst(a, b):
        return sorted(_relative_diffs(a, b).items(), key=lambda kv: -kv[1])[:3]

    print("slot-order combine vs loop:", worst(slots, loop))
    print("index_add combine vs loop:", worst(added, loop))
    print("slot-order vs index_add combine:", worst(slots, added))
    assert worst(added, loop)[0][1] <= 3e-2


@pytest.mark.parametrize("t,e,rng", [(65, 16, (0, 16)), (128, 16, (4, 12)), (300, 128, (0, 128)), (511, 128, (32, 96))])
def test_single_program_align_equals_the_torch_path_up_to_the_chunked_bound(t, e, rng):
    """Compiled: ``align_by_expert_small`` (one program; the batch-invariant chunked path takes it up
    to ``CHUNKED_SMALL_ALIGN_MAX_ASSIGNMENTS`` assignments, 512 tokens x top-4) gives the torch path's
    sorted ids, tile owners and row count at 260-2,044 assignments, skewed routing, whole and sliced
    expert ranges; and ``align_by_expert`` picks it only below the bound it is given."""
    from m3_kernels.moe_align import (
        CHUNKED_SMALL_ALIGN_MAX_ASSIGNMENTS,
        align_by_expert,
        align_by_expert_small,
        align_by_expert_torch,
    )

    g = torch.Generator().manual_seed(t + e)
    hot = torch.randint(0, e, (4,), generator=g)
    ids = torch.stack([torch.randperm(e, generator=g)[:4] for _ in range(t)])
    ids[: t // 2, 0] = hot[0]  # half the tokens send a slot to one expert
    ids = ids.cuda()
    assert ids.numel() <= CHUNKED_SMALL_ALIGN_MAX_ASSIGNMENTS
    for m in (16, 64):
        want, got = align_by_expert_torch(ids, rng, m), align_by_expert_small(ids, rng, m)
        for f in ("sorted_ids", "tile_expert", "num_rows"):
            assert torch.equal(getattr(got, f), getattr(want, f)), (m, f)
        picked = align_by_expert(ids, rng, m, small_max=CHUNKED_SMALL_ALIGN_MAX_ASSIGNMENTS)
        assert torch.equal(picked.sorted_ids, want.sorted_ids)

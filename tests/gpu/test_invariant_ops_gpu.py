"""Batch-invariant mode on a CUDA GPU (issue 24; design.md §4.6): the compiled bits.

The CPU tests (tests/test_kernels_invariant.py, tests/test_model_batch_invariant.py) check the
kernels' structure under the interpreter; here the compiled kernels (bf16, and the fp32 router
GEMM) at M3-bench shapes (configs/bench/m3_bench_300m.json: H 1024, 16 q / 4 KV heads, d 128,
16 experts top-4, V 32000) must give target rows bitwise the same alone, in batches of 3, 32,
300 and mixed among thousands of other rows (``invariant_util.invariance_failures``), and stay
within stated tolerances of the references (bf16 outputs: one bf16 rounding of an fp32-accumulated
result, atol 2e-2 / rtol 2^-7 at |y| ~ 1; fp32: 1e-4 relative to ~sqrt(K) magnitudes).

Model level: the bench model (2 layers, bf16) with ``paged_ops_for(..., batch_invariant=True)`` and
the reference attention run per row (invariant by construction; the invariant attention kernels
are the other half of the issue): a sequence's logits alone == beside other sequences, bitwise.
Engine level (with the invariant attention kernels): graphs + async scheduling, a request
alone vs among 31 others, identical tokens and logprobs.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("TRITON_INTERPRET=1 in this process; run tests/gpu alone", allow_module_level=True)

import sys  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: invariant_util

from invariant_util import invariance_failures, per_row_attention  # noqa: E402

from m3_kernels import fused_layers as fl  # noqa: E402
from m3_kernels import invariant_ops as inv  # noqa: E402
from m3_rollout.engine.config import EngineConfig  # noqa: E402
from m3_rollout.engine.engine import LLMEngine  # noqa: E402
from m3_rollout.engine.interface import GenerationRequest, SampleOutput, SamplingParams  # noqa: E402
from m3_rollout.engine.model_runner import meta_to, prepare_inputs  # noqa: E402
from m3_rollout.engine.ops import paged_ops_for  # noqa: E402
from m3_rollout.engine.paged_cache import PagedKVCache  # noqa: E402
from m3_rollout.model import M3Config, M3ForCausalLM  # noqa: E402
from m3_rollout.model.moe import grouped_experts, swiglu_oai  # noqa: E402

DEV = torch.device("cuda")
SIZES = (3, 32, 300)
BENCH = Path(__file__).resolve().parents[2] / "configs" / "bench" / "m3_bench_300m.json"
ALPHA, LIMIT, BETA = 1.702, 7.0, 1.0


def _rand(*shape, gen, dtype, scale=1.0):
    return (torch.randn(*shape, generator=gen, device=DEV) * scale).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n,k", [(2560, 1024), (1024, 2048), (16, 1024), (32000, 1024)])  # qkv, o/down, router, lm_head
def test_linear_bits_do_not_depend_on_the_batch(dtype, n, k):
    g = torch.Generator(device=DEV).manual_seed(n + k)
    x = _rand(4096, k, gen=g, dtype=dtype)
    w = _rand(n, k, gen=g, dtype=dtype, scale=k**-0.5)
    assert invariance_failures(lambda xs: inv.linear(xs, w), (x,), SIZES) == []
    ref = torch.nn.functional.linear(x[:64].double(), w.double())
    tol = dict(atol=2e-2, rtol=2**-7) if dtype == torch.bfloat16 else dict(atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(inv.linear(x[:64], w).double(), ref, **tol)
    # packed vs split weights: each column's bits are its own projection's (the trainer does not pack)
    assert torch.equal(
        inv.linear(x[:300], w), torch.cat([inv.linear(x[:300], w[: n // 2]), inv.linear(x[:300], w[n // 2 :])], -1)
    )


def _force_split_below(monkeypatch, below):
    """Split-K below ``below`` output tiles in every band (the bf16 decode band has its own
    threshold, ``LinearConfig.split_k_below``)."""
    monkeypatch.setattr(inv, "SPLIT_K_BELOW_PROGRAMS", below)
    dec = {d: dataclasses.replace(c, split_k_below=None) for d, c in inv.LINEAR_DECODE_CONFIGS.items()}
    monkeypatch.setattr(inv, "LINEAR_DECODE_CONFIGS", dec)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n,k", [(2560, 1024), (1024, 2048), (6144, 3072)])
def test_linear_split_k_gives_the_unsplit_bits(dtype, n, k, monkeypatch):
    """Compiled: the K chunks run as separate programs + the combine pass (decode-sized launches)
    give the bits of one program walking every chunk (prefill-sized launches), with and without
    bias, for 1 and 64 rows (the threshold forced both ways)."""
    g = torch.Generator(device=DEV).manual_seed(n + 2 * k)
    x = _rand(64, k, gen=g, dtype=dtype)
    w = _rand(n, k, gen=g, dtype=dtype, scale=k**-0.5)
    bias = torch.randn(n, generator=g, device=DEV)
    got = {}
    for below in (0, 10**9):
        _force_split_below(monkeypatch, below)
        got[below] = [inv.linear(x, w), inv.linear(x, w, bias), inv.linear(x[5:6], w)]
    for a, b in zip(got[0], got[10**9]):
        assert torch.equal(a, b)


# M3 q|k|v, M3 shared down, bench o; K with a half-empty last 128-wide step and with a tail chunk
@pytest.mark.parametrize("n,k", [(9216, 6144), (6144, 3072), (1024, 2048), (1024, 2 * 256 + 64), (1024, 2 * 256 + 40)])
def test_linear_k_step_keeps_the_bf16_bits(n, k):
    """Compiled, bf16: the K step of a dot (16 / 64 / 128 columns; the decode band steps 128, the
    other bands 64) leaves every bit as it is, split or not, at 1 and 32 rows, and equal to the rows
    of a 4,096-row (prefill band) call: each dot is a chain of 16-deep MMAs whatever its step (the
    masked columns past K add zeros)."""
    g = torch.Generator(device=DEV).manual_seed(n + 3 * k)
    x = _rand(4096, k, gen=g, dtype=torch.bfloat16)
    w = _rand(n, k, gen=g, dtype=torch.bfloat16, scale=k**-0.5)
    ref = inv.linear(x, w)
    dec = inv.linear_config(torch.bfloat16, 1)
    for below in (0, 10**9):
        for step in (16, 64, 128):
            cfg = dataclasses.replace(dec, block_k=step, split_k_below=below)
            assert torch.equal(inv.linear(x[7:8], w, cfg=cfg), ref[7:8]), (below, step)
            assert torch.equal(inv.linear(x[100:132], w, cfg=cfg), ref[100:132]), (below, step)


def test_fused_experts_bits_do_not_depend_on_the_batch():
    g = torch.Generator(device=DEV).manual_seed(1)
    t, e, h, i, k = 2048, 16, 1024, 512, 4
    x = _rand(t, h, gen=g, dtype=torch.bfloat16)
    ids = torch.rand(t, e, generator=g, device=DEV).topk(k, -1).indices
    w = torch.rand(t, k, generator=g, device=DEV) + 0.1
    w = w / w.sum(-1, keepdim=True) * 2.0
    w13 = _rand(e, 2 * i, h, gen=g, dtype=torch.bfloat16, scale=2 * h**-0.5)
    w2 = _rand(e, h, i, gen=g, dtype=torch.bfloat16, scale=i**-0.5)

    def fn(xs, ii, ww):
        return inv.fused_experts(xs, ii, ww, w13, w2, alpha=ALPHA, limit=LIMIT, beta=BETA)

    assert invariance_failures(fn, (x, ids, w), SIZES) == []
    act = lambda a, b: swiglu_oai(a, b, ALPHA, LIMIT, BETA)  # noqa: E731
    ref = grouped_experts(x[:64].float(), ids[:64], w[:64], w13.float(), w2.float(), act)
    torch.testing.assert_close(fn(x[:64], ids[:64], w[:64]).float(), ref, atol=3e-2, rtol=2e-2)


@pytest.mark.parametrize("h,i,e", [(1024, 512, 16), (6144, 3072, 16), (6144, 3072, 128)])  # bench, M3 x2
def test_fused_experts_ragged_prefill_band_gives_the_chunked_bits(h, i, e, monkeypatch):
    """Compiled, bf16: the prefill band (``INVARIANT_MOE_PREFILL_CONFIG``: ragged tiles of 16 to
    128 rows through TMA, K chunks folded at their ends) at 2,048 and 600 tokens, with and without
    the fat tail, gives every token the bits of the aligned chunked kernels: split (1 and 32
    tokens, decode band), the middle band's flat loop (300 tokens) and an unsplit aligned call of
    all 2,048 tokens."""
    g = torch.Generator(device=DEV).manual_seed(h + i + e)
    t, k = 2048, 4
    x = _rand(t, h, gen=g, dtype=torch.bfloat16)
    ids = torch.rand(t, e, generator=g, device=DEV).topk(k, -1).indices
    w = torch.rand(t, k, generator=g, device=DEV) + 0.1
    w13 = _rand(e, 2 * i, h, gen=g, dtype=torch.bfloat16, scale=2 * h**-0.5)
    w2 = _rand(e, h, i, gen=g, dtype=torch.bfloat16, scale=i**-0.5)
    base = inv.INVARIANT_MOE_PREFILL_CONFIG
    assert inv.moe_config(torch.bfloat16, t) == base and base.ragged and base.k_chunk

    def run(n):
        return inv.fused_experts(x[:n], ids[:n], w[:n], w13, w2, alpha=ALPHA, limit=LIMIT, beta=BETA)

    whole = run(t)
    for n in (1, 32, 300, 600):
        assert torch.equal(run(n), whole[:n]), n
    monkeypatch.setattr(inv, "INVARIANT_MOE_PREFILL_CONFIG", dataclasses.replace(base, fat_tail=64))
    assert torch.equal(run(t), whole) and torch.equal(run(600), whole[:600])
    monkeypatch.setattr(inv, "MOE_PREFILL_ROWS", 10**9)  # every size on the aligned chunked kernels
    assert torch.equal(run(t), whole)


# M3 q|k|v, M3 shared down, M3 dense down
@pytest.mark.parametrize("n,k", [(9216, 6144), (6144, 3072), (6144, 12288)])
def test_whole_k_linear_gives_one_set_of_bits_in_every_band(n, k, monkeypatch):
    """Compiled, bf16, ``invariant_ops.WHOLE_K`` on (the default since this passed): a whole-K
    weight's rows through the decode band (1 / 32 rows), the middle band (33 / 300 rows, forced
    into the flat loop) and the prefill band (4,096 rows, TMA) are bitwise equal, never split even
    where the chunked launch would; a part of the weight (512 columns, k_proj-sized) gives its
    packed columns' bits; other bits than the chunked sum; within bf16 of F.linear;
    ``linear_swiglu`` (decode) equals ``linear`` + ``swiglu`` on the packed weight."""
    monkeypatch.setattr(inv, "WHOLE_K", True)
    assert inv.whole_k(torch.bfloat16, k)
    g = torch.Generator(device=DEV).manual_seed(n + 5 * k)
    x = _rand(4096, k, gen=g, dtype=torch.bfloat16)
    w = _rand(n, k, gen=g, dtype=torch.bfloat16, scale=k**-0.5)
    ref = inv.linear(x, w)
    for below in (0, 10**9):
        _force_split_below(monkeypatch, below)
        for lo, hi in ((7, 8), (100, 132), (200, 233), (500, 800)):
            assert torch.equal(inv.linear(x[lo:hi], w), ref[lo:hi]), (below, lo, hi)
        assert torch.equal(inv.linear(x[:32], w[512:1024]), ref[:32, 512:1024]), below
    monkeypatch.setattr(inv, "WHOLE_K", False)
    assert not torch.equal(inv.linear(x[:64], w), ref[:64])  # the chunked sum's bits differ somewhere
    monkeypatch.setattr(inv, "WHOLE_K", True)
    got = inv.linear(x[:64], w).double()
    torch.testing.assert_close(got, torch.nn.functional.linear(x[:64].double(), w.double()), atol=2e-2, rtol=2**-7)
    for t in (1, 32):
        want = fl.swiglu(inv.linear(x[:t], w), ALPHA, LIMIT, BETA)
        assert torch.equal(inv.linear_swiglu(x[:t], w, ALPHA, LIMIT, BETA), want), t


@pytest.mark.parametrize("e", [16, 128])
def test_whole_k_fused_experts_gives_one_set_of_bits_in_every_band(e, monkeypatch):
    """Compiled, bf16, M3 expert shapes (H 6144, I 3072, top-4), ``invariant_ops.WHOLE_K`` on: the
    ragged prefill band (the fast mode's K loop) at 2,048 / 600 tokens, the aligned kernels' decode
    (1 / 32 tokens) and middle (300) bands and an aligned 2,048-token call give every token the same
    bits; other bits than the chunked sum."""
    monkeypatch.setattr(inv, "WHOLE_K", True)
    h, i, t, k = 6144, 3072, 2048, 4
    assert inv.whole_k(torch.bfloat16, min(h, i))
    g = torch.Generator(device=DEV).manual_seed(e + 17)
    x = _rand(t, h, gen=g, dtype=torch.bfloat16)
    ids = torch.rand(t, e, generator=g, device=DEV).topk(k, -1).indices
    w = torch.rand(t, k, generator=g, device=DEV) + 0.1
    w13 = _rand(e, 2 * i, h, gen=g, dtype=torch.bfloat16, scale=2 * h**-0.5)
    w2 = _rand(e, h, i, gen=g, dtype=torch.bfloat16, scale=i**-0.5)

    def run(n):
        return inv.fused_experts(x[:n], ids[:n], w[:n], w13, w2, alpha=ALPHA, limit=LIMIT, beta=BETA)

    whole = run(t)
    for n in (1, 32, 300, 600):
        assert torch.equal(run(n), whole[:n]), n
    monkeypatch.setattr(inv, "MOE_PREFILL_ROWS", 10**9)  # every size on the aligned kernels
    assert torch.equal(run(t), whole)
    monkeypatch.setattr(inv, "WHOLE_K", False)
    assert not torch.equal(run(300), whole[:300])


def _bench_moe(dtype, t=2048, seed=5):
    g = torch.Generator(device=DEV).manual_seed(seed)
    e, h, i, k = 16, 1024, 512, 4
    x = _rand(t, h, gen=g, dtype=dtype)
    ids = torch.rand(t, e, generator=g, device=DEV).topk(k, -1).indices
    w = torch.rand(t, k, generator=g, device=DEV) + 0.1
    w = w / w.sum(-1, keepdim=True) * 2.0
    w13 = _rand(e, 2 * i, h, gen=g, dtype=dtype, scale=2 * h**-0.5)
    w2 = _rand(e, h, i, gen=g, dtype=dtype, scale=i**-0.5)
    return x, ids, w, w13, w2


def _counters_zero() -> bool:
    buf = inv.tile_counters(DEV, 1)
    return buf is not None and int(buf.abs().sum()) == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_experts_split_k_gives_the_unsplit_bits(dtype, monkeypatch):
    """Compiled: the routed experts' K chunks split over programs (the last program of each tile
    combining them in chunk order, kernels/moe_chunked.py) give the bits of one program walking
    every chunk, for 1, 3, 32 and 33 tokens; 20 repeats of the split launch give identical bits
    (no race in the ticket protocol); the tile counters are zero afterwards."""
    x, ids, w, w13, w2 = _bench_moe(dtype, t=64)

    def fn(t):
        return inv.fused_experts(x[:t], ids[:t], w[:t], w13, w2, alpha=ALPHA, limit=LIMIT, beta=BETA)

    for t in (1, 3, 32, 33):
        got = {}
        for below in (0, 10**9):
            cfg = dataclasses.replace(inv.INVARIANT_MOE_CONFIG, split_k_below=below)
            monkeypatch.setattr(inv, "INVARIANT_MOE_CONFIG", cfg)
            got[below] = fn(t)
        assert torch.equal(got[0], got[10**9]), t
        for _ in range(20):
            assert torch.equal(fn(t), got[10**9]), t
    torch.cuda.synchronize()
    assert _counters_zero()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_linear_in_kernel_combine_equals_the_combine_pass(dtype, monkeypatch):
    """Compiled: split launches combining in the kernel (last program per tile) == the separate
    combine pass == the unsplit launch, 1 and 32 rows, with bias; 20 repeats identical."""
    g = torch.Generator(device=DEV).manual_seed(7)
    x = _rand(32, 2048, gen=g, dtype=dtype)
    w = _rand(1024, 2048, gen=g, dtype=dtype, scale=2048**-0.5)
    bias = torch.randn(1024, generator=g, device=DEV)
    got = []
    for below, fused in ((10**9, True), (10**9, False), (0, True)):
        _force_split_below(monkeypatch, below)
        monkeypatch.setattr(inv, "SPLIT_K_FUSED_COMBINE", fused)
        got.append((inv.linear(x, w, bias), inv.linear(x[:1], w)))
        if fused and below:
            for _ in range(20):
                assert torch.equal(inv.linear(x, w, bias), got[-1][0])
    for other in got[1:]:
        for a, b in zip(got[0], other):
            assert torch.equal(a, b)
    torch.cuda.synchronize()
    assert _counters_zero()


def _assert_replays_give(step, want, split_k: bool = True) -> None:
    # capture step() (after the caller's eager warm-up, which created the split-K counter buffer) in
    # a CUDA graph; every one of 10 replays must give the eager outputs ``want`` bitwise, and (for
    # split_k steps) the counters end at zero (each split launch re-arms its own)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for _ in range(10):
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(out, want))
    assert not split_k or _counters_zero()


def test_split_k_under_cuda_graph_replay():
    """Decode-sized linear + routed experts (both split, in-kernel combine) captured in a CUDA graph
    after an eager warm-up: every replay gives the eager bits (the counters reset themselves)."""
    g = torch.Generator(device=DEV).manual_seed(9)
    x, ids, w, w13, w2 = _bench_moe(torch.bfloat16, t=4)
    wl = _rand(2560, 1024, gen=g, dtype=torch.bfloat16, scale=1024**-0.5)

    def step():
        y = inv.linear(x, wl)
        return y, inv.fused_experts(x, ids, w, w13, w2, alpha=ALPHA, limit=LIMIT, beta=BETA)

    want = step()  # eager warm-up: creates the counter buffer
    _assert_replays_give(step, want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_norm_router_and_logprob_bits_do_not_depend_on_the_batch(dtype):
    g = torch.Generator(device=DEV).manual_seed(2)
    x, res = _rand(4096, 1024, gen=g, dtype=dtype), _rand(4096, 1024, gen=g, dtype=dtype)
    nw = _rand(1024, gen=g, dtype=dtype, scale=0.1)

    def add_norm(xs, rs):
        r = rs.clone()
        y, y32 = inv.add_rms_norm(xs, nw, 1e-6, residual=r, want_fp32=True)
        return torch.cat([y.float(), y32, r.float()], -1)

    assert invariance_failures(add_norm, (x, res), SIZES) == []
    gate = _rand(16, 1024, gen=g, dtype=torch.float32, scale=1024**-0.5)
    bias = _rand(16, gen=g, dtype=torch.float32, scale=0.01)

    def router(xs):
        w, ids = fl.router_topk(inv.linear(xs.float(), gate), bias, 4, 2.0)
        return torch.cat([w, ids.float()], -1)

    assert invariance_failures(router, (x,), SIZES) == []
    logits = _rand(4096, 32000, gen=g, dtype=dtype, scale=3.0)
    tokens = torch.randint(0, 32000, (4096,), generator=g, device=DEV)
    assert invariance_failures(inv.token_logprobs, (logits, tokens), SIZES) == []
    ref = torch.log_softmax(logits[:64].double(), -1).gather(1, tokens[:64, None]).squeeze(1)
    torch.testing.assert_close(inv.token_logprobs(logits[:64], tokens[:64]).double(), ref, atol=5e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("v", [32000, 200064])  # the bench model's vocabulary; M3's
def test_logprobs_with_temperature_in_the_launch_equal_the_divided_rows(dtype, v):
    """The decode graphs' logprob call (``token_logprobs`` of fp32 rows with ``temperature`` /
    ``raw`` / fp64 ``out``, ``decode_graph.invariant_logprobs_into``) == torch's fp32 division then
    the op (``sampler.process_logits`` + ``gather_logprobs``: the eager steps' and the trainer
    scorer's route), bitwise, eager and under graph replay (``out`` poisoned with NaN in the graph
    before the call, so a replay that writes nothing fails). ``dtype``: the rows' values are
    bf16- or fp32-valued; the op always gets them upcast to fp32, as the graph hands them."""
    g = torch.Generator(device=DEV).manual_seed(13)
    n = 33
    logits = _rand(n, v, gen=g, dtype=dtype, scale=4.0).float()  # as the forward's rows are upcast
    tokens = torch.randint(0, v, (n,), generator=g, device=DEV)
    temp = torch.rand(n, generator=g, device=DEV, dtype=torch.float64) * 1.5 + 0.2
    raw = (torch.arange(n, device=DEV) % 3 == 0).long()
    scaled = logits / temp.float()[:, None]
    want = torch.where(raw != 0, inv.token_logprobs(logits, tokens), inv.token_logprobs(scaled, tokens)).double()
    out = torch.empty(n, dtype=torch.float64, device=DEV)

    def step():
        out.fill_(float("nan"))
        return (inv.token_logprobs(logits, tokens, temperature=temp, raw=raw, out=out),)

    assert torch.equal(step()[0], want)
    _assert_replays_give(step, (want,), split_k=False)


def _model(layers=2):
    raw = {k: v for k, v in json.loads(BENCH.read_text()).items() if not k.startswith("_")}
    raw.update(
        num_hidden_layers=layers,
        layer_types=raw["layer_types"][:layers],
        mlp_layer_types=raw["mlp_layer_types"][:layers],
    )
    torch.manual_seed(0)
    with torch.device(DEV):
        m = M3ForCausalLM(M3Config.from_dict(raw))
        with torch.no_grad():
            for p in m.parameters():
                p.normal_(0, 0.02) if p.ndim >= 2 else p.normal_(0, 0.05)
    return m.cast_for_inference(torch.bfloat16).eval()


@torch.no_grad()
def test_model_logits_of_a_sequence_do_not_depend_on_the_batch():
    """Sequence a (2100 tokens: above top-k 16 x block 128, so its sparse layer selects) alone vs
    between two others, prefill (all tokens' logits) then one decode step: bitwise equal."""
    m = _model()
    ops = per_row_attention(paged_ops_for(DEV, torch.bfloat16, batch_invariant=True))
    assert ops.linear is inv.linear and ops.skinny_linear is None
    g = torch.Generator().manual_seed(3)
    seqs = {n: torch.randint(3, 32000, (L,), generator=g).tolist() for n, L in (("a", 2100), ("b", 300), ("c", 900))}
    pages = {"a": list(range(0, 17)), "b": list(range(17, 20)), "c": list(range(20, 28))}

    def run(rows):
        kv = PagedKVCache(m.config, 40, torch.bfloat16, DEV)
        bt = [pages[r] for r in rows]
        pre = prepare_inputs([seqs[r][:-1] for r in rows], [0] * len(rows), bt, 128, 0)
        logits = m.forward_paged(pre.input_ids.to(DEV), meta_to(pre.meta, DEV), kv, ops)
        i = rows.index("a")
        qsl = pre.meta.query_start_loc.tolist()
        dec = prepare_inputs([seqs[r][-1:] for r in rows], [len(seqs[r]) - 1 for r in rows], bt, 128, len(rows))
        out = m.forward_paged(dec.input_ids.to(DEV), meta_to(dec.meta, DEV), kv, ops)
        return logits[qsl[i] : qsl[i + 1]], out[i]

    pre1, dec1 = run(["a"])
    pre3, dec3 = run(["b", "a", "c"])
    assert torch.equal(pre1, pre3)
    assert torch.equal(dec1, dec3)


@pytest.mark.parametrize("sparse_impl", ["union", "page_partials"])
def test_engine_logprobs_do_not_depend_on_the_batch(sparse_impl):
    """Graphs + async scheduling: request a alone (decode graph of size 1) vs among 31 others (size
    32, prefills batched with theirs): identical tokens and logprobs (bitwise), and the trainer's
    scorer gives the same bits; for both invariant sparse attentions (``EngineConfig.
    invariant_sparse_attention``, the scorer's table built with the same: the KV-major per-page
    partials, the default, whose decode kernel must give the prefill kernel's bits on the GPU too,
    and the union walk)."""
    m = _model()
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 32000, (200 + 37 * i,), generator=g).tolist() for i in range(32)]

    def generate(n):
        cfg = EngineConfig(
            max_model_len=2048,
            max_num_seqs=32,
            num_pages=600,
            enable_cuda_graphs=True,
            cuda_graph_batch_sizes=(1, 32),
            batch_invariant=True,
            invariant_sparse_attention=sparse_impl,
        )
        eng = LLMEngine(m, cfg)
        for i in range(n):
            eng.add_request(GenerationRequest(f"r{i}", prompts[i], SamplingParams(seed=i, max_new_tokens=32)))
        outs = {}
        while eng.has_unfinished():
            for o in eng.step():
                if isinstance(o, SampleOutput):
                    outs[o.request_id] = o
        return outs["r0"]

    alone, mixed = generate(1), generate(32)
    assert alone.output_ids == mixed.output_ids
    assert alone.logprobs == mixed.logprobs
    # The trainer's scorer (packed prefill forwards, the same ops and logprob op) gives the bits
    # the graphs' fused sampler + invariant logprob recorded (decode_graph.invariant_logprobs_into).
    from m3_rollout.engine.ops import invariant_token_logprobs
    from m3_rollout.engine.score import PagedScorer

    ops = paged_ops_for(DEV, torch.bfloat16, batch_invariant=True, invariant_sparse_attention=sparse_impl)
    scorer = PagedScorer(m.config, ops, 2048, 4096, torch.bfloat16, DEV, token_logprobs=invariant_token_logprobs(DEV))
    row = prompts[0] + alone.output_ids
    other = prompts[5] + prompts[6][:100]  # packed with another sequence
    scored = scorer(m, [other, row], 1.0)[1][len(prompts[0]) :].cpu()
    assert torch.equal(scored, torch.tensor(alone.logprobs, dtype=torch.float64).float())


# ----------------------------------------------------------------------------- fused decode routes
# gate|up GEMM + SwiGLU: bench shared expert / dense MLP (H 1024, I 512 / 2048), M3 shared / dense
# (H 6144, I 3072 / 12288)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("i,k", [(512, 1024), (2048, 1024), (3072, 6144), (12288, 6144)])
def test_linear_swiglu_gives_the_bits_of_linear_and_swiglu(dtype, i, k, monkeypatch):
    """Compiled: ``linear_swiglu`` (one launch; gate and up tiles half the width of linear's, each
    summed as linear sums it, rounded, then swiglu's expression) == ``fused_layers.swiglu(linear(x,
    w))`` bitwise at 1 and 32 rows, with the default split threshold and forced split / unsplit
    (the in-kernel combine of both gate and up); gate / up values past the clamp (limit 7)."""
    g = torch.Generator(device=DEV).manual_seed(i + k)
    x = _rand(32, k, gen=g, dtype=dtype, scale=2.0)
    w = _rand(2 * i, k, gen=g, dtype=dtype, scale=4 * k**-0.5)  # gate / up ~ N(0, 8^2)
    for below in (None, 0, 10**9):
        if below is not None:
            _force_split_below(monkeypatch, below)
        for t in (1, 32):
            got = inv.linear_swiglu(x[:t], w, ALPHA, LIMIT, BETA)
            want = fl.swiglu(inv.linear(x[:t], w), ALPHA, LIMIT, BETA)
            assert torch.equal(got, want), (below, t, int((got != want).sum()))
    torch.cuda.synchronize()
    assert _counters_zero()


# router: the bench model's 16 experts (top-4, H 1024); M3's 128 (top-8, H 6144: fused route at 1 row only)
@pytest.mark.parametrize("xdtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("e,h,top_k", [(16, 1024, 4), (128, 6144, 8)])
def test_router_gemm_topk_gives_the_bits_of_linear_and_router_topk(xdtype, e, h, top_k):
    """Compiled: ``router_gemm_topk`` (one launch: per (token, K chunk) fp32 partials, the token's last
    program adds them in chunk order and runs router_topk's top-k) == ``router_topk(linear(x.float(),
    w))`` bitwise, weights and ids, at 1 and 32 rows, with and without bias; 10 repeats identical
    (the in-kernel combine); the table's predicate admits the shape at 1 row."""
    g = torch.Generator(device=DEV).manual_seed(e + h)
    x = _rand(32, h, gen=g, dtype=xdtype)
    w = _rand(e, h, gen=g, dtype=torch.float32, scale=h**-0.5)
    bias = _rand(e, gen=g, dtype=torch.float32, scale=0.01)
    assert inv.router_gemm_topk_ok(1, w)
    for b in (None, bias):
        for t in (1, 32):
            got = inv.router_gemm_topk(x[:t], w, b, top_k, 2.5)
            want = fl.router_topk(inv.linear(x[:t].float(), w), b, top_k, 2.5)
            assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0]), (b is None, t)
            for _ in range(10):
                again = inv.router_gemm_topk(x[:t], w, b, top_k, 2.5)
                assert torch.equal(again[0], got[0]) and torch.equal(again[1], got[1])
    torch.cuda.synchronize()
    assert _counters_zero()


def test_fused_decode_routes_under_cuda_graph_replay():
    """``linear_swiglu`` (split, in-kernel combine) and ``router_gemm_topk`` at bench shapes, 4 rows,
    captured in a CUDA graph after an eager warm-up: every replay gives the eager bits, and those of
    the two-launch routes."""
    g = torch.Generator(device=DEV).manual_seed(10)
    x = _rand(4, 1024, gen=g, dtype=torch.bfloat16)
    wgu = _rand(1024, 1024, gen=g, dtype=torch.bfloat16, scale=1024**-0.5)
    gate = _rand(16, 1024, gen=g, dtype=torch.float32, scale=1024**-0.5)
    bias = _rand(16, gen=g, dtype=torch.float32, scale=0.01)

    def step():
        return (inv.linear_swiglu(x, wgu, ALPHA, LIMIT, BETA), *inv.router_gemm_topk(x, gate, bias, 4, 2.0))

    want = step()  # eager warm-up: creates the counter buffer
    two = (
        fl.swiglu(inv.linear(x, wgu), ALPHA, LIMIT, BETA),
        *fl.router_topk(inv.linear(x.float(), gate), bias, 4, 2.0),
    )
    assert all(torch.equal(a, b) for a, b in zip(want, two))
    _assert_replays_give(step, want)

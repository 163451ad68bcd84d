"""Batch-invariant ops (kernels/invariant_ops.py) on CPU under the Triton interpreter, fp32 and fp16.

For each op:
(a) it equals the PyTorch reference (stated tolerances: fp32 ~1e-5 relative to O(1) values, fp32
    reduction order only; fp16 outputs one fp16 rounding (2e-3) of an fp32-accumulated result);
(b) batch invariance, bitwise (``torch.equal``): target rows computed alone (one call per row), in a
    batch of 3, at random positions of a batch of 32 and of all rows mixed give identical bits;
(c) the check has teeth: ``invariance_failures`` reports a linear whose reduction order depends on
    the batch (split-K above 8 rows), and the dispatch picks its configuration from T's band only
    (linear: decode / middle / prefill tiles, same K chunks and steps, same bits; the MoE one tile
    config for every number of rows).

The interpreter's ``tl.dot`` runs here one tile row at a time (tests/interpreter_dot.py: numpy's
BLAS gives a row position-dependent bits, a CPU artifact); so (b) checks the kernels' structure (no
cross-row or T-dependent reduction, masks, configs); the GPU test (tests/gpu/test_invariant_ops_gpu.py)
checks the compiled bits.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from interpreter_dot import row_wise_dot  # tests/ on sys.path
from invariant_util import invariance_failures

from m3_kernels.fused_interpret import interpreted_invariant_ops
from m3_rollout.model.moe import grouped_experts, route, swiglu_oai
from m3_rollout.model.norm import gemma_rms_norm

inv = interpreted_invariant_ops()
DTYPES = [torch.float32, torch.float16]
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=2e-3, atol=2e-3)}
ALPHA, LIMIT, BETA = 1.702, 7.0, 1.0
N_ROWS = 40  # rows 0..N_TARGET-1 are the targets, the rest the "other sequences" (invariant_util)


@pytest.fixture(autouse=True, scope="module")
def per_row_dot():
    with row_wise_dot():
        yield


def _rand(*shape, gen, dtype, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


# ----------------------------------------------------------------------------- linear
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", [96, 70])  # 70: the last K block is partial
def test_linear_matches_reference(dtype, k):
    g = torch.Generator().manual_seed(1)
    x, w = _rand(37, k, gen=g, dtype=dtype), _rand(50, k, gen=g, dtype=dtype, scale=k**-0.5)
    bias = _rand(50, gen=g, dtype=dtype)
    ref = torch.nn.functional.linear(x.double(), w.double())
    torch.testing.assert_close(inv.linear(x, w).double(), ref, **TOL[dtype])
    torch.testing.assert_close(inv.linear(x, w, bias).double(), ref + bias.double(), **TOL[dtype])
    assert inv.linear(x, w).dtype == dtype
    assert inv.linear(x[:0], w).shape == (0, 50)


def test_linear_router_fp32_and_strided_rows():
    """The fp32 router GEMM (exact fp32 products) on a row-strided view equals F.linear in fp64."""
    g = torch.Generator().manual_seed(2)
    x = _rand(9, 2 * 64, gen=g, dtype=torch.float32)[:, :64]  # row stride 128
    w = _rand(16, 64, gen=g, dtype=torch.float32)
    ref = torch.nn.functional.linear(x.double(), w.double())
    torch.testing.assert_close(inv.linear(x, w).double(), ref, rtol=1e-6, atol=1e-5)


def test_linear_rejects_bad_inputs():
    x = torch.zeros(3, 8)
    with pytest.raises(ValueError, match="dtype"):
        inv.linear(x, torch.zeros(4, 8, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"\[T, K\]"):
        inv.linear(x, torch.zeros(4, 9))
    with pytest.raises(ValueError, match="contiguous"):
        inv.linear(x, torch.zeros(8, 4).t())
    with pytest.raises(ValueError, match="not supported"):
        inv.linear(x.double(), torch.zeros(4, 8, dtype=torch.float64))


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_is_batch_invariant(dtype):
    g = torch.Generator().manual_seed(3)
    x, w = _rand(N_ROWS, 96, gen=g, dtype=dtype), _rand(70, 96, gen=g, dtype=dtype, scale=0.1)
    assert invariance_failures(lambda xs: inv.linear(xs, w), (x,)) == []
    # packed weights (q|k|v): each column gets the bits of the GEMM over its own block of rows
    w1, w2 = w[:30], w[30:]
    assert torch.equal(inv.linear(x, w), torch.cat([inv.linear(x, w1), inv.linear(x, w2)], -1))


def test_invariance_check_catches_a_batch_dependent_reduction():
    """(c): a GEMM that splits K in two parts once the batch reaches 8 rows (a split-K heuristic
    keyed on T, as cuBLAS / autotuned kernels have) fails the check; same kernel otherwise."""
    g = torch.Generator().manual_seed(4)
    x, w = _rand(N_ROWS, 128, gen=g, dtype=torch.float32), _rand(64, 128, gen=g, dtype=torch.float32)

    def split_k_when_large(xs):
        if xs.shape[0] < 8:
            return inv.linear(xs, w)
        # split at 32: not a k_chunk (64) boundary, so the association really differs
        return inv.linear(xs[:, :32].contiguous(), w[:, :32].contiguous()) + inv.linear(
            xs[:, 32:].contiguous(), w[:, 32:].contiguous()
        )

    assert set(invariance_failures(split_k_when_large, (x,))) == {"batch32", "mixed_all"}


class LaunchSpy:
    """Stands in for a Triton kernel: records (constexprs + launch options, grid) and forwards."""

    def __init__(self, kernel):
        self.kernel, self.calls = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.calls.append((tuple(sorted(kwargs.items())), grid))
            return self.kernel[grid](*args, **kwargs)

        return launch


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_config_depends_on_the_row_band_only_and_not_the_bits(dtype, monkeypatch):
    """(c): the tile configuration is chosen from T's band alone (decode <= LINEAR_DECODE_ROWS,
    prefill >= LINEAR_PREFILL_ROWS, middle between; fp32 one tile below FP32_PREFILL_ROWS), never from N (a packed
    and a split weight agree), and every band's configuration gives a row the bits of every other
    (the same K chunks in the same order; SPLIT too, next test): rows 0..2 alone, among 32, 300 and
    600 rows are bitwise equal."""
    spy = LaunchSpy(inv._linear_kernel)
    monkeypatch.setattr(inv, "_linear_kernel", spy)
    g = torch.Generator().manual_seed(5)
    k = 2 * inv.linear_config(dtype).k_chunk + 16  # two chunks and a tail
    w = _rand(80, k, gen=g, dtype=dtype, scale=k**-0.5)
    x = _rand(600, k, gen=g, dtype=dtype)
    outs = {t: inv.linear(x[:t], w) for t in (3, 32, 300, 600)}
    for t in (3, 32, 300, 600):
        inv.linear(x[:t], w[:16])
    blocks = [(dict(c[0])["BLOCK_M"], dict(c[0])["BLOCK_N"], dict(c[0])["FLAT"]) for c in spy.calls]
    want = [inv.linear_config(dtype, t) for t in (3, 32, 300, 600)] * 2
    assert blocks == [(c.block_m, c.block_n, c.flat) for c in want]
    if dtype != torch.float32:  # three different tiles really ran
        assert len(set(blocks)) == 3 and (True in {f for *_, f in blocks})
    for t in (3, 32, 300):
        assert torch.equal(outs[t][:3], outs[600][:3])
    torch.testing.assert_close(outs[600].double(), torch.nn.functional.linear(x.double(), w.double()), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_split_k_gives_the_unsplit_bits(dtype, monkeypatch):
    """A decode-sized launch runs its K chunks as separate programs plus a combine pass; a large
    one runs them in one program. Same rows, both ways, with and without bias, K not a multiple of
    the chunk: bitwise equal, and both launches really ran (the spy sees SPLIT True and False)."""
    import m3_kernels.invariant_ops as io

    spy = LaunchSpy(inv._linear_kernel)
    monkeypatch.setattr(inv, "_linear_kernel", spy)
    g = torch.Generator().manual_seed(8)
    k = 3 * inv.linear_config(dtype).k_chunk + 40
    x, w = _rand(5, k, gen=g, dtype=dtype), _rand(70, k, gen=g, dtype=dtype, scale=0.1)
    bias = torch.randn(70, generator=g)
    got = {}
    for below in (0, 10**9):  # never split / always split (when there are >= 2 chunks)
        monkeypatch.setattr(io, "SPLIT_K_BELOW_PROGRAMS", below)
        got[below] = (inv.linear(x, w), inv.linear(x, w, bias), inv.linear(x[2:3], w))
    assert {dict(c[0])["SPLIT"] for c in spy.calls} == {True, False}
    for a, b in zip(got[0], got[10**9]):
        assert torch.equal(a, b)
    ref = torch.nn.functional.linear(x.double(), w.double(), bias.double())
    torch.testing.assert_close(got[0][1].double(), ref, **TOL[dtype])


def test_linear_flat_prefill_loop_gives_the_nested_and_split_bits(monkeypatch):
    """The prefill band's flat K loop really runs (no split: the band test's few-tile launches
    split, which skips it) and gives rows the bits of the middle band's nested loop and of the
    decode band's split launch, at the band edges (511 / 512, 32 / 33 rows), with two chunks and a
    tail chunk, with K below one K step, with and without bias (fp16: fp32 has one band)."""
    dtype = torch.float16
    spy = LaunchSpy(inv._linear_kernel)
    monkeypatch.setattr(inv, "_linear_kernel", spy)
    # the pointer loads' flat loop (the TMA one: next test)
    monkeypatch.setitem(
        inv.LINEAR_PREFILL_CONFIGS, dtype, dataclasses.replace(inv.LINEAR_PREFILL_CONFIGS[dtype], tma=False)
    )
    g = torch.Generator().manual_seed(12)
    cfg = inv.linear_config(dtype)
    for k in (2 * cfg.k_chunk + 16, cfg.block_k - 24):
        x, w = _rand(512, k, gen=g, dtype=dtype), _rand(24, k, gen=g, dtype=dtype, scale=k**-0.5)
        bias = _rand(24, gen=g, dtype=dtype)
        for b in (None, bias):
            monkeypatch.setattr(inv, "SPLIT_K_BELOW_PROGRAMS", 0)  # never split: flat / nested loops
            flat, nested, mid = inv.linear(x, w, b), inv.linear(x[:511], w, b), inv.linear(x[:33], w, b)
            monkeypatch.setattr(inv, "SPLIT_K_BELOW_PROGRAMS", 10**9)  # always split (>= 2 chunks)
            dec, split = inv.linear(x[:32], w, b), inv.linear(x, w, b)
            for other in (nested, mid, dec, split):
                assert torch.equal(other, flat[: other.shape[0]])
            ref = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
            torch.testing.assert_close(flat.double(), ref, **TOL[dtype])
    ran = {(dict(c[0])["FLAT"], dict(c[0])["SPLIT"]) for c in spy.calls}
    assert (True, False) in ran and (False, False) in ran and (False, True) in ran


def test_linear_fp32_prefill_band_gives_the_small_tile_bits(monkeypatch):
    """fp32 (the router GEMM) takes its own prefill band from FP32_PREFILL_ROWS rows: the wide tile,
    one flat loop, never split (even with few output tiles); its rows equal the same rows through
    the middle band's small tile (300 rows) and the decode band's (3 rows), both split launches here,
    with two chunks and a tail chunk, with and without bias."""
    dtype = torch.float32
    spy = LaunchSpy(inv._linear_kernel)
    monkeypatch.setattr(inv, "_linear_kernel", spy)
    band = inv.LINEAR_PREFILL_CONFIGS[dtype]
    t = inv.FP32_PREFILL_ROWS
    assert inv.linear_config(dtype, t) == band and inv.linear_config(dtype, t - 1) == inv.LINEAR_CONFIGS[dtype]
    g = torch.Generator().manual_seed(14)
    k = 2 * band.k_chunk + 16
    x, w = _rand(t, k, gen=g, dtype=dtype), _rand(24, k, gen=g, dtype=dtype, scale=k**-0.5)
    bias = _rand(24, gen=g, dtype=dtype)
    for b in (None, bias):
        wide, mid, dec = inv.linear(x, w, b), inv.linear(x[:300], w, b), inv.linear(x[:3], w, b)
        assert torch.equal(mid, wide[:300]) and torch.equal(dec, wide[:3])
        ref = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
        torch.testing.assert_close(wide.double(), ref, **TOL[dtype])
    launches = [(dict(c[0])["BLOCK_M"], dict(c[0])["BLOCK_N"], dict(c[0])["SPLIT"]) for c in spy.calls]
    assert (band.block_m, band.block_n, False) in launches  # 64 tiles < 264, unsplit all the same
    small = inv.linear_config(dtype, 3)
    assert (small.block_m, small.block_n, True) in launches  # 3 and 300 rows: split over the chunks


def test_linear_tma_prefill_loop_gives_the_pointer_loops_bits(monkeypatch):
    """LinearConfig.tma: the prefill band's tiles through TMA descriptors (``_linear_tma_kernel``)
    give the pointer loads' bits (out-of-range rows, columns and K read as zero either way): 512
    rows (a partial last row tile), 24 columns (a partial column tile), two chunks and a tail, K
    below one K step, with and without bias. A launch that would split K, or operands TMA cannot
    cover (a row stride off 16 bytes), take the pointer kernel (same bits)."""
    dtype = torch.float16
    spy = LaunchSpy(inv._linear_tma_kernel)
    monkeypatch.setattr(inv, "_linear_tma_kernel", spy)
    monkeypatch.setattr(inv, "SPLIT_K_BELOW_PROGRAMS", 0)
    g = torch.Generator().manual_seed(13)
    base = inv.LINEAR_PREFILL_CONFIGS[dtype]
    for k in (2 * base.k_chunk + 16, base.block_k - 24):
        x, w = _rand(512, k, gen=g, dtype=dtype), _rand(24, k, gen=g, dtype=dtype, scale=k**-0.5)
        bias = _rand(24, gen=g, dtype=dtype)
        for b in (None, bias):
            monkeypatch.setitem(inv.LINEAR_PREFILL_CONFIGS, dtype, dataclasses.replace(base, tma=False))
            want = inv.linear(x, w, b)
            monkeypatch.setitem(inv.LINEAR_PREFILL_CONFIGS, dtype, dataclasses.replace(base, tma=True))
            n_tma = len(spy.calls)
            assert torch.equal(inv.linear(x, w, b), want)
            assert len(spy.calls) == n_tma + 1
    odd = torch.zeros(512, 2 * base.k_chunk + 17, dtype=dtype)[:, :-1]  # row stride 529 halves: no TMA
    odd.copy_(_rand(512, odd.shape[1], gen=g, dtype=dtype))
    w2 = _rand(24, odd.shape[1], gen=g, dtype=dtype)
    n_tma = len(spy.calls)
    got = inv.linear(odd, w2)
    assert len(spy.calls) == n_tma
    monkeypatch.setitem(inv.LINEAR_PREFILL_CONFIGS, dtype, dataclasses.replace(base, tma=False))
    assert torch.equal(got, inv.linear(odd, w2))


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_cfg_must_sum_k_as_the_dtype_does(dtype):
    """``linear(cfg=...)`` (the launch-configuration sweep) takes any tile but refuses another K
    chunk or (fp32 / fp16: the dtypes the interpreter runs, where the step sets the order) another
    K step: a k_chunk that is not a multiple of block_k summed a chunk's overhang twice (wrong
    results, silently), another multiple gave other bits."""
    g = torch.Generator().manual_seed(13)
    own = inv.linear_config(dtype)
    k = 3 * own.k_chunk + 8
    x, w = _rand(5, k, gen=g, dtype=dtype), _rand(24, k, gen=g, dtype=dtype, scale=k**-0.5)
    other_tile = inv.LinearConfig(16, 32, own.block_k, 4, 2, own.k_chunk, flat=True)
    assert torch.equal(inv.linear(x, w, cfg=other_tile), inv.linear(x, w))
    for kc, bk, match in (
        (own.k_chunk + own.block_k // 2, own.block_k, "chunks of"),
        (2 * own.k_chunk, own.block_k, "chunks of"),
        (own.k_chunk, 16, "K steps of"),
    ):
        with pytest.raises(ValueError, match=match):
            inv.linear(x, w, cfg=inv.LinearConfig(16, 32, bk, 4, 2, kc))


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(block_k=8), "powers of two >= 16 dividing half"),
        (dict(block_k=24), "powers of two >= 16 dividing half"),
        (dict(block_k=256), "at least two steps per chunk"),  # a one-step chunk
        (dict(block_k=128.0), "must be ints"),
        (dict(block_m=24), "powers of two >= 16"),
        (dict(block_n=0), "powers of two >= 16"),
        (dict(block_m=-16), "powers of two >= 16"),  # an empty grid: uninitialised output before
        (dict(num_warps=3), "warps 1, 2, 4, 8 or 16"),
        (dict(num_stages=0), "stages >= 1"),
        (dict(split_k_below=-1), "split_k_below"),
        (dict(split_k_below=True), "split_k_below"),
        (dict(k_chunk=512), "another chunk changes the bits"),
    ],
)
def test_bf16_cfg_rules(change, match):
    """bf16 (refused before any launch, so it runs on the CPU): any K step that is a power of two
    >= 16 dividing half a chunk is taken (16 / 32 / 64 / 128: the same MMA chain on the GPU); every
    other field is checked with a message naming the rule; every table entry passes the check."""
    dec = inv.linear_config(torch.bfloat16, 1)
    for step in (16, 32, 64, 128):
        inv._check_linear_config(dataclasses.replace(dec, block_k=step), torch.bfloat16)
    x, w = torch.zeros(2, 512, dtype=torch.bfloat16), torch.zeros(8, 512, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=match):
        inv.linear(x, w, cfg=dataclasses.replace(dec, **change))
    for table in (inv.LINEAR_CONFIGS, inv.LINEAR_DECODE_CONFIGS, inv.LINEAR_PREFILL_CONFIGS):
        for dtype, cfg in table.items():
            inv._check_linear_config(cfg, dtype)


def test_whole_k_weights_sum_k_in_one_chain_in_every_band(monkeypatch):
    """``WHOLE_K``: a GEMM whose K is at least ``WHOLE_K_MIN_K`` (patched to 600: K = 784 qualifies,
    528 does not) sums K in one chain from zero in every band: the decode band (3 / 32 rows), the
    middle band (forced into the flat loop, 33 / 300 rows) and the prefill band's TMA loop (600 rows)
    give a row the same bits, never split even where every launch would
    (``SPLIT_K_BELOW_PROGRAMS`` huge); those bits differ from the chunked sum's (one chain vs chunk
    partials); a packed weight's columns equal its parts' (the rule reads K, not N); a K below the
    threshold keeps its chunked bits and split launch; ``linear_swiglu`` follows ``linear``."""
    from m3_kernels.fused_interpret import interpreted_fused_layers

    fl = interpreted_fused_layers()
    dtype = torch.float16
    monkeypatch.setattr(inv, "WHOLE_K", False)  # first the chunked sums
    monkeypatch.setattr(inv, "WHOLE_K_MIN_K", 600)
    monkeypatch.setattr(inv, "SPLIT_K_BELOW_PROGRAMS", 10**9)  # every chunked launch splits
    spy, tma = LaunchSpy(inv._linear_kernel), LaunchSpy(inv._linear_tma_kernel)
    monkeypatch.setattr(inv, "_linear_kernel", spy)
    monkeypatch.setattr(inv, "_linear_tma_kernel", tma)
    g = torch.Generator().manual_seed(23)
    chunk = inv.linear_config(dtype).k_chunk
    k, k_short = 3 * chunk + 16, 2 * chunk + 16  # 784 / 528: chunks and a tail either way
    x = _rand(600, k, gen=g, dtype=dtype)
    w = _rand(200, k, gen=g, dtype=dtype, scale=k**-0.5)
    w_short = _rand(200, k_short, gen=g, dtype=dtype, scale=k_short**-0.5)
    x_short = x[:32, :k_short].contiguous()
    chunked, chunked_short = inv.linear(x[:32], w), inv.linear(x_short, w_short)
    monkeypatch.setattr(inv, "WHOLE_K", True)
    assert inv.whole_k(dtype, k) and not inv.whole_k(dtype, k_short) and not inv.whole_k(torch.float32, 10**6)
    spy.calls.clear()
    outs = {t: inv.linear(x[:t], w) for t in (3, 32, 33, 300, 600)}
    for t in (3, 32, 33, 300):
        assert torch.equal(outs[t], outs[600][:t]), t
    whole_launches = [dict(c[0]) for c in spy.calls]  # 3 / 32 / 33 / 300 rows (600: TMA)
    assert len(whole_launches) == 4 and all(c["K_CHUNK"] == 0 and c["FLAT"] and not c["SPLIT"] for c in whole_launches)
    assert [dict(c[0])["K_CHUNK"] for c in tma.calls] == [0]
    assert not torch.equal(outs[32], chunked)  # one chain: other bits than the chunk partials
    assert torch.equal(inv.linear(x[:300], w[:64]), outs[300][:, :64])  # a part == its packed columns
    assert torch.equal(inv.linear(x_short, w_short), chunked_short)  # K below the threshold: chunked
    assert dict(spy.calls[-1][0])["SPLIT"]
    torch.testing.assert_close(outs[600].double(), torch.nn.functional.linear(x.double(), w.double()), **TOL[dtype])
    for t in (1, 32):
        want = fl.swiglu(inv.linear(x[:t], w), ALPHA, LIMIT, BETA)
        assert torch.equal(inv.linear_swiglu(x[:t], w, ALPHA, LIMIT, BETA), want), t


# ----------------------------------------------------------------------------- gate|up GEMM + SwiGLU
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("flat", [False, True])
def test_linear_swiglu_gives_the_bits_of_linear_and_swiglu(dtype, flat, monkeypatch):
    """``linear_swiglu`` (one launch: each program a gate tile and its up tile, summed as ``linear``
    sums them, rounded as it stores them, then ``swiglu``'s expression) == ``fused_layers.swiglu(
    linear(x, w))`` bitwise: 1 / 3 / 32 rows, split and unsplit launches (the spy sees both), the
    nested chunk loops and the flat loop (the bf16 decode band's, GPU only otherwise: patched in
    here for linear too), K with a tail chunk, I = 40 (not a multiple of the 16 / 32-wide tiles),
    gate and up values past the clamp (limit 7) on both sides; a row's bits alone == among 32."""
    from m3_kernels.fused_interpret import interpreted_fused_layers

    fl = interpreted_fused_layers()
    table = inv.LINEAR_DECODE_CONFIGS if dtype in inv.LINEAR_DECODE_CONFIGS else inv.LINEAR_CONFIGS
    monkeypatch.setitem(table, dtype, dataclasses.replace(table[dtype], flat=flat))
    spy = LaunchSpy(inv._linear_swiglu_kernel)
    monkeypatch.setattr(inv, "_linear_swiglu_kernel", spy)
    g = torch.Generator().manual_seed(21)
    k = 2 * inv.linear_config(dtype, 1).k_chunk + 40  # two chunks and a tail
    i = 40
    x = _rand(32, k, gen=g, dtype=dtype, scale=2.0)
    w = _rand(2 * i, k, gen=g, dtype=dtype, scale=4 * k**-0.5)  # gate / up ~ N(0, 8^2): past +-7 often
    gu = inv.linear(x, w).float()
    assert (gu[:, :i] > LIMIT).any() and (gu[:, i:] > LIMIT).any() and (gu[:, i:] < -LIMIT).any()
    for below in (0, 10**9):  # never split / always split (>= 2 chunks)
        monkeypatch.setattr(inv, "SPLIT_K_BELOW_PROGRAMS", below)
        outs = {}
        for t in (1, 3, 32):
            outs[t] = inv.linear_swiglu(x[:t], w, ALPHA, LIMIT, BETA)
            assert outs[t].shape == (t, i) and outs[t].dtype == dtype
            assert torch.equal(outs[t], fl.swiglu(inv.linear(x[:t], w), ALPHA, LIMIT, BETA)), (below, t)
        assert torch.equal(outs[1], outs[32][:1]) and torch.equal(outs[3], outs[32][:3])
    assert {dict(c[0])["SPLIT"] for c in spy.calls} == {True, False}
    assert {dict(c[0])["FLAT"] for c in spy.calls} == {flat}
    ref = swiglu_oai(gu[:, :i].to(dtype).double(), gu[:, i:].to(dtype).double(), ALPHA, LIMIT, BETA)
    torch.testing.assert_close(outs[32].double(), ref, **TOL[dtype])


def test_linear_swiglu_edges_and_refusals(monkeypatch):
    """Without the in-kernel combine (``SPLIT_K_FUSED_COMBINE`` off) a split launch runs as linear +
    swiglu (same bits, no fused launch); K of one chunk never splits; T = 0 gives [0, I]. Refused,
    naming the op: more than LINEAR_DECODE_ROWS rows, an odd weight row count, mixed dtypes, a
    strided last dim, a dtype linear does not take."""
    from m3_kernels.fused_interpret import interpreted_fused_layers

    fl = interpreted_fused_layers()
    spy = LaunchSpy(inv._linear_swiglu_kernel)
    monkeypatch.setattr(inv, "_linear_swiglu_kernel", spy)
    g = torch.Generator().manual_seed(22)
    x, w = _rand(3, 200, gen=g, dtype=torch.float32), _rand(48, 200, gen=g, dtype=torch.float32, scale=0.3)
    monkeypatch.setattr(inv, "SPLIT_K_FUSED_COMBINE", False)
    assert torch.equal(inv.linear_swiglu(x, w, ALPHA, LIMIT, BETA), fl.swiglu(inv.linear(x, w), ALPHA, LIMIT, BETA))
    assert spy.calls == []
    monkeypatch.setattr(inv, "SPLIT_K_FUSED_COMBINE", True)
    x1, w1 = x[:, :40].contiguous(), w[:, :40].contiguous()  # one chunk
    assert torch.equal(inv.linear_swiglu(x1, w1, ALPHA, LIMIT, BETA), fl.swiglu(inv.linear(x1, w1), ALPHA, LIMIT, BETA))
    assert [dict(c[0])["SPLIT"] for c in spy.calls] == [False]
    assert inv.linear_swiglu(x[:0], w, ALPHA, LIMIT, BETA).shape == (0, 24)
    assert inv.linear_swiglu_ok(inv.LINEAR_DECODE_ROWS) and not inv.linear_swiglu_ok(inv.LINEAR_DECODE_ROWS + 1)
    for args, match in (
        ((torch.zeros(inv.LINEAR_DECODE_ROWS + 1, 200), w), "decode-sized"),
        ((x, w[:47]), r"\[2I, K\]"),
        ((x, w.half()), "dtype"),
        ((x, torch.zeros(200, 48).t()), "contiguous"),
        ((x.double(), w.double()), "not supported"),
    ):
        with pytest.raises(ValueError, match=match):
            inv.linear_swiglu(*args, ALPHA, LIMIT, BETA)


# ----------------------------------------------------------------------------- routed experts
def _moe_case(dtype, t=N_ROWS, e=6, h=32, inter=16, k=2, seed=6):
    g = torch.Generator().manual_seed(seed)
    ids = torch.rand(t, e, generator=g).topk(k, -1).indices
    weights = torch.rand(t, k, generator=g) + 0.1
    weights = weights / weights.sum(-1, keepdim=True) * 2.0
    x = _rand(t, h, gen=g, dtype=dtype, scale=2.0)
    w13 = _rand(e, 2 * inter, h, gen=g, dtype=dtype, scale=2 * h**-0.5)
    w2 = _rand(e, h, inter, gen=g, dtype=dtype, scale=inter**-0.5)
    return x, ids, weights, w13, w2


def _experts(x, ids, weights, w13, w2, expert_range=None):
    return inv.fused_experts(x, ids, weights, w13, w2, alpha=ALPHA, limit=LIMIT, beta=BETA, expert_range=expert_range)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_experts_matches_reference(dtype):
    x, ids, weights, w13, w2 = _moe_case(dtype)
    act = lambda g, u: swiglu_oai(g, u, ALPHA, LIMIT, BETA)  # noqa: E731
    ref = grouped_experts(x.double(), ids, weights.double(), w13.double(), w2.double(), act)
    got = _experts(x, ids, weights, w13, w2)
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(got.double(), ref, **tol)
    # EP local slice: slots routed to other ranks add nothing
    local = _experts(x, ids, weights, w13[2:5], w2[2:5], expert_range=(2, 5))
    inside = ((ids >= 2) & (ids < 5)).double()
    ref_local = grouped_experts(x.double(), ids, weights.double() * inside, w13.double(), w2.double(), act)
    torch.testing.assert_close(local.double(), ref_local, **tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_experts_is_batch_invariant(dtype):
    x, ids, weights, w13, w2 = _moe_case(dtype)
    fn = lambda xs, i, w: _experts(xs, i, w, w13, w2)  # noqa: E731
    assert invariance_failures(fn, (x, ids, weights)) == []
    fn_local = lambda xs, i, w: _experts(xs, i, w, w13[1:4], w2[1:4], expert_range=(1, 4))  # noqa: E731
    assert invariance_failures(fn_local, (x, ids, weights)) == []


def test_fused_experts_dispatch_has_one_config_per_band(monkeypatch):
    """(c): the stock heuristic picks tiles (and the ragged layout) by rows per expert; the
    invariant entry passes one aligned config per band of T (16-row tiles up to MOE_DECODE_ROWS
    tokens, 64 above; the same K chunks and steps), and the combine runs in slot order. A token's
    output is the same in either band (bitwise, below)."""
    seen = []
    stock = inv.fm.fused_experts

    def spy(*args, config=None, **kwargs):
        seen.append(config)
        return stock(*args, config=config, **kwargs)

    monkeypatch.setattr(inv.fm, "fused_experts", spy)
    for t in (1, 3, 32, 300):
        x, ids, weights, w13, w2 = _moe_case(torch.float16, t=t, e=4)
        _experts(x, ids, weights, w13, w2)
    assert len(seen) == 4 and seen[0] == seen[1] == seen[2] != seen[3]
    assert [c.block_m for c in seen] == [inv.MOE_DECODE_BLOCK_M] * 3 + [inv.INVARIANT_MOE_CONFIG.block_m]
    for cfg, t in zip(seen, (1, 3, 32, 300)):
        assert cfg == inv.moe_config(torch.float16, t) and not (cfg.ragged or cfg.tma or cfg.permute)
        assert (cfg.k_chunk, cfg.w13, cfg.w2) == (inv.INVARIANT_MOE_CONFIG.k_chunk, seen[3].w13, seen[3].w2)
    x, ids, weights, w13, w2 = _moe_case(torch.float16, t=300, e=4)
    whole = _experts(x, ids, weights, w13, w2)  # middle band
    assert torch.equal(_experts(x[5:8], ids[5:8], weights[5:8], w13, w2), whole[5:8])  # decode band
    stock_configs = {inv.fm.default_config(t * 2, 4, 32, 16) for t in (1, 3, 32, 300)}
    assert len(stock_configs) > 1  # why the invariant entry exists


# ----------------------------------------------------------------------------- norms, router
@pytest.mark.parametrize("dtype", DTYPES)
def test_norms_are_batch_invariant(dtype):
    """rms_norm / add_rms_norm (fused_layers' kernel, reused): the reference, and bitwise per row
    with a residual and a second addend (the residual written in place is per row too)."""
    g = torch.Generator().manual_seed(7)
    n = 48
    x, x2, res = (_rand(N_ROWS, n, gen=g, dtype=dtype) for _ in range(3))
    w = _rand(n, gen=g, dtype=dtype, scale=0.3)
    torch.testing.assert_close(inv.rms_norm(x, w, 1e-6), gemma_rms_norm(x, w, 1e-6), **TOL[dtype])
    assert invariance_failures(lambda xs: inv.rms_norm(xs, w, 1e-6), (x,)) == []

    def add_norm(xs, x2s, rs):
        r = rs.clone()
        y, y32 = inv.add_rms_norm(xs, w, 1e-6, residual=r, x2=x2s, want_fp32=True)
        return torch.cat([y.float(), y32, r.float()], -1)

    assert invariance_failures(add_norm, (x, x2, res)) == []


def test_router_route_is_batch_invariant():
    """fp32 router logits through the invariant linear, then router_topk (the table's two-launch
    route; ``router_gemm_topk``, its one-launch twin for decode-sized steps, gives the same bits:
    next test): ids and weights per row; ``router_gemm_topk_never`` (the fusion turned off) says no."""
    from m3_kernels.fused_interpret import interpreted_fused_layers

    fl = interpreted_fused_layers()
    g = torch.Generator().manual_seed(8)
    x, gate = _rand(N_ROWS, 64, gen=g, dtype=torch.float32), _rand(8, 64, gen=g, dtype=torch.float32)
    bias = _rand(8, gen=g, dtype=torch.float32, scale=0.1)

    def router(xs):
        w, ids = fl.router_topk(inv.linear(xs, gate), bias, 2, 2.5)
        return torch.cat([w, ids.float()], -1)

    assert invariance_failures(router, (x,)) == []
    w_ref, ids_ref = route(torch.nn.functional.linear(x, gate), bias, 2, 2.5)
    out = router(x)
    assert torch.equal(out[:, 2:].long(), ids_ref)
    torch.testing.assert_close(out[:, :2], w_ref, rtol=1e-5, atol=1e-6)
    assert not any(inv.router_gemm_topk_never(t, gate) for t in (1, 8, 4096))


@pytest.mark.parametrize("xdtype", DTYPES)
@pytest.mark.parametrize("e, h", [(16, 2 * 64 + 24), (12, 2 * 64 + 24), (16, 40)])  # tail chunk; one chunk
def test_router_gemm_topk_gives_the_bits_of_linear_and_router_topk(xdtype, e, h, monkeypatch):
    """``router_gemm_topk`` (one launch: fp32 logits summed in linear's fp32 K chunks and steps,
    then router_topk's top-k) == ``router_topk(linear(x.float(), w))`` bitwise, weights and ids:
    x fp16 / fp32 (upcast in the kernel), E = 16 and 12 (not a power of two), H with a tail chunk
    and H of one chunk, with and without bias, 1 / 3 / 32 rows; ties: experts 3 and 7 have the
    same weight row (and bias), so the same logits (and choice), and row 1 of x is zero (every
    logit 0): the lower expert id first, as ``route``. No linear launch runs."""
    from m3_kernels.fused_interpret import interpreted_fused_layers

    fl = interpreted_fused_layers()
    linear_spy = LaunchSpy(inv._linear_kernel)
    g = torch.Generator().manual_seed(23)
    x = _rand(32, h, gen=g, dtype=xdtype)
    x[1] = 0
    w = _rand(e, h, gen=g, dtype=torch.float32, scale=h**-0.5)
    w[3] = 3 * w[3]  # a large score for many tokens: the tie below is among the chosen
    w[7] = w[3]
    bias = _rand(e, gen=g, dtype=torch.float32, scale=0.1)
    bias[7] = bias[3]
    ties = 0
    for b in (None, bias):
        for t in (1, 3, 32):
            monkeypatch.setattr(inv, "_linear_kernel", linear_spy)
            got_w, got_ids = inv.router_gemm_topk(x[:t], w, b, 4, 2.5)
            assert linear_spy.calls == []
            monkeypatch.undo()
            want_w, want_ids = fl.router_topk(inv.linear(x[:t].float(), w), b, 4, 2.5)
            assert torch.equal(got_ids, want_ids) and torch.equal(got_w, want_w), (b is None, t)
            assert got_w.dtype == torch.float32 and got_ids.dtype == torch.int64
        logits64 = torch.nn.functional.linear(x.double(), w.double())
        ids_ref = route(logits64, None if b is None else b.double(), 4, 2.5)[1]
        assert torch.equal(got_ids, ids_ref)
        both = (got_ids == 3).any(-1) & (got_ids == 7).any(-1)
        ties += int(both.sum())
        pos = lambda ids, v: (ids == v).int().argmax(-1)  # noqa: E731
        assert (pos(got_ids, 3) < pos(got_ids, 7))[both].all()  # equal choice: the lower id first
        if b is None:  # row 1: every score 0.5, the K lowest ids in order
            assert torch.equal(got_ids[1], torch.arange(4))
    assert ties > 0


def test_router_gemm_topk_predicate_fallback_and_refusals(monkeypatch):
    """``router_gemm_topk_ok``: decode-sized steps (<= LINEAR_DECODE_ROWS) of a small router (T x E x H
    <= ROUTER_FUSE_MAX_ELEMS: the bench model's 16 x 1024 up to 32 rows, M3's 128 x 6144 at 1 row).
    Without the in-kernel combine the two launches run (same bits). T = 0; bad inputs refused."""
    from m3_kernels.fused_interpret import interpreted_fused_layers

    fl = interpreted_fused_layers()
    bench, m3 = torch.empty(16, 1024), torch.empty(128, 6144)
    assert inv.router_gemm_topk_ok(32, bench) and not inv.router_gemm_topk_ok(33, bench)
    assert inv.router_gemm_topk_ok(1, m3) and not inv.router_gemm_topk_ok(2, m3)
    g = torch.Generator().manual_seed(24)
    x, w = _rand(3, 100, gen=g, dtype=torch.float16), _rand(8, 100, gen=g, dtype=torch.float32)
    spy = LaunchSpy(inv._router_gemm_topk_kernel)
    monkeypatch.setattr(inv, "_router_gemm_topk_kernel", spy)
    monkeypatch.setattr(inv, "SPLIT_K_FUSED_COMBINE", False)
    got = inv.router_gemm_topk(x, w, None, 2, 1.0)
    want = fl.router_topk(inv.linear(x.float(), w), None, 2, 1.0)
    assert spy.calls == [] and torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert [r.shape for r in inv.router_gemm_topk(x[:0], w, None, 2, 1.0)] == [(0, 2), (0, 2)]
    for args, match in (
        ((x, w.half()), "fp32"),
        ((x, w[:, :99]), "top_k"),
        ((x.double(), w), "bf16/fp16/fp32"),
        ((torch.zeros(100, 3).t(), w), "contiguous"),
    ):
        with pytest.raises(ValueError, match=match):
            inv.router_gemm_topk(*args, None, 2, 1.0)
    with pytest.raises(ValueError, match="top_k"):
        inv.router_gemm_topk(x, w, None, 9, 1.0)
    with pytest.raises(ValueError, match="bias"):
        inv.router_gemm_topk(x, w, torch.zeros(7), 2, 1.0)


# ----------------------------------------------------------------------------- logprobs
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("v", [300, 2500])  # one partial segment; two segments of LOGPROB_SEGMENT, the second partial
def test_token_logprobs(dtype, v):
    g = torch.Generator().manual_seed(9)
    logits = _rand(N_ROWS, v, gen=g, dtype=dtype, scale=3.0)
    tokens = torch.randint(0, v, (N_ROWS,), generator=g)
    ref = torch.log_softmax(logits.double(), -1).gather(1, tokens[:, None]).squeeze(1)
    got = inv.token_logprobs(logits, tokens)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=2e-5)
    assert invariance_failures(inv.token_logprobs, (logits, tokens)) == []
    masked = logits.float().masked_fill(torch.rand(N_ROWS, v, generator=g) < 0.5, float("-inf"))
    masked[torch.arange(N_ROWS), tokens] = 1.0  # a top-k / top-p masked row, the token kept
    ref_m = torch.log_softmax(masked.double(), -1).gather(1, tokens[:, None]).squeeze(1)
    torch.testing.assert_close(inv.token_logprobs(masked, tokens).double(), ref_m, rtol=1e-5, atol=2e-5)
    if v > inv.LOGPROB_SEGMENT:  # a whole segment masked (past a top-k cut): it adds 0, not NaN
        cut = logits.float().clone()
        cut[:, inv.LOGPROB_SEGMENT :] = float("-inf")
        in_front = tokens % inv.LOGPROB_SEGMENT
        ref_c = torch.log_softmax(cut.double(), -1).gather(1, in_front[:, None]).squeeze(1)
        torch.testing.assert_close(inv.token_logprobs(cut, in_front).double(), ref_c, rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_token_logprobs_with_temperature_in_the_launch(dtype):
    """``temperature`` / ``raw`` / ``out`` (the decode graphs' single launch): each row's bits are
    the op's on ``logits.float() / T.float()`` (torch's IEEE division; a temperature whose division
    rounds), or on the row as it is for a raw row; fp64 ``out`` holds the fp32 values exactly."""
    g = torch.Generator().manual_seed(12)
    n, v = 6, 2500
    logits = _rand(n, v, gen=g, dtype=dtype, scale=3.0)
    tokens = torch.randint(0, v, (n,), generator=g)
    temp = torch.tensor([0.7, 1.3, 0.3, 1.0, 0.9, 1.7], dtype=torch.float64)
    raw = torch.tensor([0, 1, 0, 0, 1, 0])
    x32 = logits.float()
    scaled = x32 / temp.float()[:, None]
    assert not torch.equal(scaled * temp.float()[:, None], x32)  # some divisions round
    want = torch.where(raw != 0, inv.token_logprobs(logits, tokens), inv.token_logprobs(scaled, tokens))
    got = inv.token_logprobs(logits, tokens, temperature=temp, raw=raw)
    assert got.dtype == torch.float32 and torch.equal(got, want)
    out = torch.full((n,), float("nan"), dtype=torch.float64)
    assert inv.token_logprobs(logits, tokens, temperature=temp.float(), raw=raw.bool(), out=out) is out
    assert torch.equal(out, want.double())
    every = inv.token_logprobs(logits, tokens, temperature=temp)  # no raw: every row scaled
    assert torch.equal(every, inv.token_logprobs(scaled, tokens))
    assert not torch.equal(every, got)
    with pytest.raises(ValueError, match="raw must be"):
        inv.token_logprobs(logits, tokens, raw=raw)
    with pytest.raises(ValueError, match="temperature must be"):
        inv.token_logprobs(logits, tokens, temperature=temp[:3])
    with pytest.raises(ValueError, match="out must be"):
        inv.token_logprobs(logits, tokens, out=torch.empty(n, dtype=torch.float16))


def test_sampler_uses_the_logprob_op():
    """sample_rows with the op: same tokens as without (the argmax needs no op), logprobs from
    the op (bitwise per row), within fp32 order of torch's log_softmax."""
    from m3_rollout.engine.sampler import SamplingTensors, sample_rows

    g = torch.Generator().manual_seed(10)
    n, v = 6, 1500
    logits = _rand(n, v, gen=g, dtype=torch.float32, scale=2.0)
    params = SamplingTensors(
        temperature=torch.full((n,), 0.7, dtype=torch.float64),
        top_k=torch.full((n,), -1),
        top_p=torch.ones(n),
        seeds=torch.arange(n),
        sample_ids=torch.arange(n),
    )
    pos = torch.arange(n) + 5
    raw = torch.tensor([True, False] * 3)
    tok_ref, lp_ref = sample_rows(logits, params, pos, raw, False, False)
    tok, lp = sample_rows(logits, params, pos, raw, False, False, inv.token_logprobs)
    assert torch.equal(tok, tok_ref)
    torch.testing.assert_close(lp, lp_ref, rtol=1e-5, atol=2e-5)
    x = logits / params.temperature.float()[:, None]
    want = torch.where(raw, inv.token_logprobs(logits, tok), inv.token_logprobs(x, tok))
    assert torch.equal(lp, want)

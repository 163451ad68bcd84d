"""Split-K of the batch-invariant GEMMs (kernels/split_k.py, kernels/moe_chunked.py, the linear of
kernels/invariant_ops.py) on CPU under the Triton interpreter.

The reduction is defined as an fp32 partial per fixed K chunk, then a left-to-right sum of the
chunk partials. Checked here, bitwise (``torch.equal``):
(a) the routed-expert GEMMs give the same bits with their K chunks split over programs (the
    tile's last program combining them) as with one program walking every chunk, for 1, 3 and
    33 tokens, K spanning full and partial chunks and partial BLOCK_K steps; both launch kinds
    really ran for both GEMMs;
(b) with a split threshold that makes one token split and a batch not, a token's bits alone
    equal its bits in batches of 3 and 32 and among all rows (``invariance_failures``);
(c) the linear's in-kernel combine equals the separate combine pass;
(d) every split launch hands its tile counters back at zero (the next launch / graph replay
    starts from zeros), and the configs keep k_chunk a multiple of 2 x block_k.

The interpreter's ``tl.dot`` runs one tile row at a time (tests/interpreter_dot.py); the GPU test
(tests/gpu/test_invariant_ops_gpu.py) checks the compiled bits.
"""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch
import triton
from interpreter_dot import row_wise_dot  # tests/ on sys.path
from invariant_util import invariance_failures

from m3_kernels.fused_interpret import interpreted_invariant_ops
from m3_rollout.model.moe import grouped_experts, swiglu_oai
from m3_rollout.parallel.ep_moe import combine_slots

inv = interpreted_invariant_ops()
ALPHA, LIMIT, BETA = 1.702, 7.0, 1.0
H, INTER, E, TOP_K = 556, 288, 6, 2  # chunks of 256: H = 2 x 256 + 44, I = 256 + 32 (partial BLOCK_K steps)


@pytest.fixture(autouse=True, scope="module")
def per_row_dot():
    with row_wise_dot():
        yield


class LaunchSpy:
    """Stands in for a Triton kernel: records each launch's keyword arguments (constexprs and launch
    options) in ``calls`` and forwards."""

    def __init__(self, kernel, calls: list | None = None):
        self.kernel, self.calls = kernel, [] if calls is None else calls

    @property
    def splits(self) -> list[bool]:
        return [kw["SPLIT"] for kw in self.calls]

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.calls.append(kwargs)
            return self.kernel[grid](*args, **kwargs)

        return launch


def _counters_zero() -> bool:
    buf = inv.tile_counters(torch.device("cpu"), 1)
    return buf is not None and int(buf.abs().sum()) == 0


def _moe_case(dtype, t=40, seed=11, h=H, inter=INTER):
    g = torch.Generator().manual_seed(seed)
    ids = torch.rand(t, E, generator=g).topk(TOP_K, -1).indices
    weights = torch.rand(t, TOP_K, generator=g) + 0.1
    weights = weights / weights.sum(-1, keepdim=True) * 2.0
    x = (torch.randn(t, h, generator=g) * 2.0).to(dtype)
    w13 = (torch.randn(E, 2 * inter, h, generator=g) * 2 * h**-0.5).to(dtype)
    w2 = (torch.randn(E, h, inter, generator=g) * inter**-0.5).to(dtype)
    return x, ids, weights, w13, w2


def _experts(x, ids, weights, w13, w2):
    return inv.fused_experts(x, ids, weights, w13, w2, alpha=ALPHA, limit=LIMIT, beta=BETA)


def _set_moe_split_below(monkeypatch, below: int) -> None:
    monkeypatch.setattr(inv, "INVARIANT_MOE_CONFIG", dataclasses.replace(inv.INVARIANT_MOE_CONFIG, split_k_below=below))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_fused_experts_split_k_gives_the_unsplit_bits(dtype, monkeypatch):
    """(a) + reference: never split vs always split (>= 2 chunks), 1 / 3 / 33 tokens (fp16: 3 / 33, the
    decode and middle bands; the one-token tile is fp32's, the dtype only changes the dots' inputs)."""
    mc = sys.modules["m3_kernels.moe_chunked"]  # the interpreted module fused_moe calls into
    spies = {name: LaunchSpy(getattr(mc, name)) for name in ("moe_w13_chunked_kernel", "moe_w2_chunked_kernel")}
    for name, spy in spies.items():
        monkeypatch.setattr(mc, name, spy)
    x, ids, weights, w13, w2 = _moe_case(dtype)
    for t in (1, 3, 33) if dtype == torch.float32 else (3, 33):
        got = {}
        for below in (0, 10**9):
            _set_moe_split_below(monkeypatch, below)
            got[below] = _experts(x[:t], ids[:t], weights[:t], w13, w2)
        assert torch.equal(got[0], got[10**9]), t
        assert _counters_zero()
    assert all(set(spy.splits) == {True, False} for spy in spies.values())
    act = lambda g, u: swiglu_oai(g, u, ALPHA, LIMIT, BETA)  # noqa: E731
    ref = grouped_experts(x[:33].double(), ids[:33], weights[:33].double(), w13.double(), w2.double(), act)
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=3e-2)  # fp16: act rounded
    torch.testing.assert_close(got[10**9].double(), ref, **tol)


def test_fused_experts_split_k_whole_blocks(monkeypatch):
    """(a) with H and I multiples of BLOCK_K (the loads without K masks): H = 512, I = 512, 3 tokens."""
    x, ids, weights, w13, w2 = _moe_case(torch.float32, t=3, h=512, inter=512)
    got = []
    for below in (0, 10**9):
        _set_moe_split_below(monkeypatch, below)
        got.append(_experts(x, ids, weights, w13, w2))
    assert torch.equal(got[0], got[1])
    act = lambda g, u: swiglu_oai(g, u, ALPHA, LIMIT, BETA)  # noqa: E731
    ref = grouped_experts(x.double(), ids, weights.double(), w13.double(), w2.double(), act)
    torch.testing.assert_close(got[1].double(), ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("h,inter", [(552, 280), (512, 512)], ids=["partial-steps", "whole-steps"])
def test_fused_experts_ragged_prefill_band_gives_the_chunked_bits(dtype, h, inter, monkeypatch):
    """(a''): the prefill band (``INVARIANT_MOE_PREFILL_CONFIG``: the ragged tiles of
    kernels/moe_ragged.py, 16- to 128-row MMAs, with the K chunks folded in) gives every token the
    bits of the aligned chunked kernels, split (decode band, 3 tokens) and unsplit (one flat loop,
    middle band); H / I multiples of 8 (TMA) with partial K steps and without; with and without the
    fat tail (an expert's 128-row tile carrying its remainder); an EP slice. Both kernel families
    really ran."""
    mr = sys.modules["m3_kernels.moe_ragged"]  # the interpreted module fused_moe calls into
    ks = []
    for name in ("moe_w13_ragged_kernel", "moe_w2_ragged_kernel"):
        monkeypatch.setattr(mr, name, LaunchSpy(getattr(mr, name), ks))
    t = 200
    x, ids, weights, w13, w2 = _moe_case(dtype, t=t, h=h, inter=inter)
    ids = _skewed_ids(t)  # rows per expert 150 / 30 / 40 / 100 / 70 / 10: every ragged tile kind
    base = inv.INVARIANT_MOE_CONFIG
    _set_moe_split_below(monkeypatch, 0)
    mid = _experts(x, ids, weights, w13, w2)  # aligned, unsplit, flat loop (t between the bands)
    _set_moe_split_below(monkeypatch, 10**9)
    dec = [_experts(x[i : i + 3], ids[i : i + 3], weights[i : i + 3], w13, w2) for i in (0, 97)]
    monkeypatch.setattr(inv, "INVARIANT_MOE_CONFIG", base)
    monkeypatch.setattr(inv, "MOE_PREFILL_ROWS", 3)
    for fat in (0, 64):
        monkeypatch.setattr(
            inv, "INVARIANT_MOE_PREFILL_CONFIG", dataclasses.replace(inv.INVARIANT_MOE_PREFILL_CONFIG, fat_tail=fat)
        )
        rows = sys.modules["m3_kernels.moe_ragged"].align_ragged(ids, (0, E), fat).tile_rows.tolist()
        # MMA heights: 150 rows -> a fat tile (128 + 32) or 128 + 32; 100 / 70 -> 128; 40 -> 64; 30 -> 32; 10 -> 16
        assert (160 in rows) == (fat == 64) and {16, 32, 48, 80, 112} <= set(rows), rows
        n0 = len(ks)
        pre = _experts(x, ids, weights, w13, w2)
        assert len(ks) == n0 + 2 and all(k["K_CHUNK"] == base.k_chunk and k["FAT"] == fat for k in ks[n0:])
        assert torch.equal(pre, mid), fat
        assert torch.equal(dec[0], pre[:3]) and torch.equal(dec[1], pre[97:100]), fat
    local = dict(alpha=ALPHA, limit=LIMIT, beta=BETA, expert_range=(1, 4))
    pre_ep = inv.fused_experts(x, ids, weights, w13[1:4], w2[1:4], **local)
    monkeypatch.setattr(inv, "MOE_PREFILL_ROWS", 10**9)
    assert torch.equal(pre_ep, inv.fused_experts(x, ids, weights, w13[1:4], w2[1:4], **local))


def test_fused_experts_whole_k_one_chain_in_every_band(monkeypatch):
    """``WHOLE_K`` (``whole_k`` of min(H, I) >= ``WHOLE_K_MIN_K``, patched to 280): the decode band
    (3 tokens, aligned 16-row tiles), the middle band (aligned 64-row tiles) and the ragged prefill
    band (every tile kind) sum K as one chain, never split even where every chunked launch would:
    a token's bits are the same in all three, they differ from the chunked sum's, both kernel
    families ran with K_CHUNK 0 (the fast mode's ragged loop); the EP path's one-slot calls
    (``EPExperts.local_experts``: ids [N, 1]) combined in slot order in fp32 (``combine_slots``)
    give the one-call bits; fp32 keeps its chunks; within fp16 of the reference."""
    dtype = torch.float16
    mc, mr = sys.modules["m3_kernels.moe_chunked"], sys.modules["m3_kernels.moe_ragged"]
    aligned, ragged = [], []
    for name in ("moe_w13_chunked_kernel", "moe_w2_chunked_kernel"):
        monkeypatch.setattr(mc, name, LaunchSpy(getattr(mc, name), aligned))
    for name in ("moe_w13_ragged_kernel", "moe_w2_ragged_kernel"):
        monkeypatch.setattr(mr, name, LaunchSpy(getattr(mr, name), ragged))
    t, h, inter = 200, 552, 280  # K: two 256-wide chunks and a tail; partial K steps
    x, ids, weights, w13, w2 = _moe_case(dtype, t=t, h=h, inter=inter)
    ids = _skewed_ids(t)
    monkeypatch.setattr(inv, "WHOLE_K", False)
    chunked = _experts(x, ids, weights, w13, w2)  # the middle band's chunked sums
    monkeypatch.setattr(inv, "WHOLE_K", True)
    monkeypatch.setattr(inv, "WHOLE_K_MIN_K", 280)
    assert inv.whole_k(dtype, min(h, inter)) and not inv.whole_k(torch.float32, min(h, inter))
    assert not inv.whole_k(dtype, 250)
    _set_moe_split_below(monkeypatch, 10**9)  # a chunked launch would split at every size
    aligned.clear()
    dec = [_experts(x[i : i + 3], ids[i : i + 3], weights[i : i + 3], w13, w2) for i in (0, 97)]
    mid = _experts(x, ids, weights, w13, w2)
    one_slot = [_experts(x, ids[:, j : j + 1], weights[:, j : j + 1], w13, w2) for j in range(TOP_K)]
    back = torch.stack(one_slot, 1).reshape(t * TOP_K, h)  # pair t * K + j's row, as it comes home
    assert torch.equal(mid, combine_slots(back, torch.arange(t * TOP_K), t, TOP_K))  # the EP route
    monkeypatch.setattr(inv, "MOE_PREFILL_ROWS", 3)
    pre = _experts(x, ids, weights, w13, w2)
    assert torch.equal(pre, mid)
    assert torch.equal(dec[0], pre[:3]) and torch.equal(dec[1], pre[97:100])
    assert not torch.equal(mid, chunked)  # one chain: other bits than the folded chunks
    assert len(aligned) == 10 and all(k["K_CHUNK"] == 0 and not k["SPLIT"] for k in aligned)
    assert len(ragged) == 2 and all(k["K_CHUNK"] == 0 for k in ragged)
    act = lambda g, u: swiglu_oai(g, u, ALPHA, LIMIT, BETA)  # noqa: E731
    ref = grouped_experts(x.double(), ids, weights.double(), w13.double(), w2.double(), act)
    torch.testing.assert_close(pre.double(), ref, rtol=2e-2, atol=3e-2)


def _skewed_ids(t: int) -> torch.Tensor:
    # [t, 2] expert ids with 150 / 30 / 40 / 100 / 70 / 10 slots per expert (t = 200), two distinct
    # experts per token, tokens shuffled: a fat tile, 128-row tiles and 64 / 32 / 16-row tails
    counts = [150, 30, 40, 100, 70, 10]
    labels = torch.repeat_interleave(torch.arange(E), torch.tensor(counts))
    ids = torch.stack([labels[:t], labels[t:]], dim=1)
    assert ids.shape == (t, TOP_K) and bool((ids[:, 0] != ids[:, 1]).all())
    return ids[torch.randperm(t, generator=torch.Generator().manual_seed(3))]


def test_fused_experts_bits_do_not_depend_on_the_split_choice(monkeypatch):
    """(b): split below 20 tiles: a token alone splits (3 row tiles x 5 column tiles), a batch of 3
    or more does not (7+ row tiles); its bits are the same everywhere. Also with an EP slice."""
    _set_moe_split_below(monkeypatch, 20)
    x, ids, weights, w13, w2 = _moe_case(torch.float32)
    fn = lambda xs, i, w: _experts(xs, i, w, w13, w2)  # noqa: E731
    assert invariance_failures(fn, (x, ids, weights)) == []

    def fn_local(xs, i, w):
        return inv.fused_experts(xs, i, w, w13[1:4], w2[1:4], alpha=ALPHA, limit=LIMIT, beta=BETA, expert_range=(1, 4))

    assert invariance_failures(fn_local, (x, ids, weights)) == []
    assert _counters_zero()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_linear_fused_combine_equals_the_combine_pass(dtype, monkeypatch):
    """(c): split launches combine in the kernel (default) or in _linear_combine_kernel: same bits,
    and the unsplit launch's; with and without bias."""
    g = torch.Generator().manual_seed(12)
    k = 3 * inv.linear_config(dtype).k_chunk + 40
    x = torch.randn(5, k, generator=g).to(dtype)
    w = (torch.randn(70, k, generator=g) * 0.1).to(dtype)
    bias = torch.randn(70, generator=g)
    got = []
    for below, fused in ((10**9, True), (10**9, False), (0, True)):
        monkeypatch.setattr(inv, "SPLIT_K_BELOW_PROGRAMS", below)
        monkeypatch.setattr(inv, "SPLIT_K_FUSED_COMBINE", fused)
        got.append((inv.linear(x, w), inv.linear(x, w, bias), inv.linear(x[3:4], w, bias)))
        assert _counters_zero()
    for other in got[1:]:
        for a, b in zip(got[0], other):
            assert torch.equal(a, b)


def test_a_configs_split_threshold_decides_the_split(monkeypatch):
    """(c'): ``LinearConfig.split_k_below`` (the bf16 decode band's 64) decides whether a launch
    splits its K chunks, over the module's SPLIT_K_BELOW_PROGRAMS (None: the module's); either way
    the same bits."""
    g = torch.Generator().manual_seed(14)
    cfg = inv.linear_config(torch.float32)
    k = 3 * cfg.k_chunk + 8
    x = torch.randn(3, k, generator=g)
    w = torch.randn(40, k, generator=g) * 0.1
    splits = []
    real_counters = inv.tile_counters
    monkeypatch.setattr(inv, "tile_counters", lambda *a: splits.append(a) or real_counters(*a))
    got = []
    tiles = triton.cdiv(3, cfg.block_m) * triton.cdiv(40, cfg.block_n)  # 2 (fp32: 32 x 32 tiles)
    cases = [(0, 10**9), (10**9, 0), (10**9, None), (0, None), (0, tiles), (0, tiles + 1), (tiles, None)]
    for module_below, own_below in cases:
        monkeypatch.setattr(inv, "SPLIT_K_BELOW_PROGRAMS", module_below)
        splits.clear()
        got.append(inv.linear(x, w, cfg=dataclasses.replace(cfg, split_k_below=own_below)))
        below = module_below if own_below is None else own_below
        assert bool(splits) == (tiles < below), (module_below, own_below)  # split below, not at, the threshold
    assert all(torch.equal(got[0], other) for other in got[1:])
    assert inv.LINEAR_DECODE_CONFIGS[torch.bfloat16].split_k_below == 64


def test_chunk_sizes_and_layout_checks():
    """(d): k_chunk a multiple of 2 x block_k everywhere (a one-step chunk may be folded into the
    accumulator's dot by the compiler); k_chunk refuses the TMA / permuted layouts. Every row band
    sums the dtype's chunks; the K step may differ between bands only for bf16 (on the GPU a dot
    is a chain of 16-deep MMAs whatever its K step: tests/gpu checks the bits), never for the
    dtypes the interpreter runs (its dot is one matmul per K step, so the step sets the order)."""
    for table in (inv.LINEAR_CONFIGS, inv.LINEAR_DECODE_CONFIGS, inv.LINEAR_PREFILL_CONFIGS):
        for dtype, cfg in table.items():
            assert cfg.k_chunk == inv.LINEAR_CONFIGS[dtype].k_chunk
            assert cfg.block_k == inv.LINEAR_CONFIGS[dtype].block_k or dtype == torch.bfloat16
            assert cfg.k_chunk % (2 * cfg.block_k) == 0
    bad_step = dataclasses.replace(inv.linear_config(torch.bfloat16, 1), block_k=256)  # one-step chunks
    with pytest.raises(ValueError, match="at least two steps per chunk"):
        inv.linear(torch.zeros(1, 512, dtype=torch.bfloat16), torch.zeros(4, 512, dtype=torch.bfloat16), cfg=bad_step)
    for dtype in (torch.bfloat16, torch.float32):
        cfg = inv.moe_config(dtype)
        assert cfg.k_chunk and all(cfg.k_chunk % (2 * tile.block_k) == 0 for tile in (cfg.w13, cfg.w2))
    with pytest.raises(ValueError, match="2 x block_k"):
        sys.modules["m3_kernels.moe_chunked"].check_k_chunk(64, inv.INVARIANT_MOE_CONFIG.w13)
    x, ids, weights, w13, w2 = _moe_case(torch.float32, t=2)
    for bad in (
        dataclasses.replace(inv.INVARIANT_MOE_PREFILL_CONFIG, permute=True),
        dataclasses.replace(inv.INVARIANT_MOE_CONFIG, tma=True),
    ):
        with pytest.raises(ValueError, match="no tma / permute"):
            inv.fm.fused_experts(x, ids, weights, w13, w2, alpha=ALPHA, limit=LIMIT, config=bad)

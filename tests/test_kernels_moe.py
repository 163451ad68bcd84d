"""Fused MoE kernels on CPU: alignment in plain torch, Triton kernels under TRITON_INTERPRET=1.

Triton picks interpreter or compiler when a kernel is *defined*, so once any test has imported
triton without TRITON_INTERPRET the kernels in this process would compile for a GPU. The kernel
cases therefore run in one subprocess (this file's __main__) with the variable set; the parent
builds the inputs, compares the outputs with `moe.grouped_experts`, and keeps all asserts.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from m3_kernels.moe_align import align_by_expert, align_by_expert_torch, max_padded_rows
from m3_rollout.model.moe import grouped_experts, swiglu_oai

ALPHA, LIMIT, BETA = 1.702, 7.0, 1.0


def _act(g, u):
    return swiglu_oai(g, u, ALPHA, LIMIT, BETA)


# ---------------------------------------------------------------- alignment (pure torch)


def _align_by_loop(ids: torch.Tensor, a: int, b: int, m: int) -> tuple[list[int], list[int], int]:
    """Independent reference: walk experts in order, append their flat slots, pad each to m."""
    flat = ids.reshape(-1).tolist()
    sentinel = len(flat)
    rows, tiles = [], []
    for e in range(a, b):
        mine = [i for i, v in enumerate(flat) if v == e]
        if not mine:
            continue
        n_pad = -(-len(mine) // m) * m
        rows += mine + [sentinel] * (n_pad - len(mine))
        tiles += [e - a] * (n_pad // m)
    return rows, tiles, len(rows)


def test_align_worked_example_from_docstring():
    ids = torch.tensor([[0, 2], [2, 0], [0, 5]])
    al = align_by_expert(ids, (0, 3), 4)
    assert al.sorted_ids[:8].tolist() == [0, 3, 4, 6, 1, 2, 6, 6]
    assert al.tile_expert.tolist()[:2] == [0, 2] and set(al.tile_expert.tolist()[2:]) == {-1}
    assert al.num_rows.tolist() == [8]
    assert al.sorted_ids.dtype == al.tile_expert.dtype == al.num_rows.dtype == torch.int32


ALIGN_CASES = [  # (T, K, E global, expert_range, block_m, seed)
    (13, 4, 8, (0, 8), 4, 0),
    (1, 4, 128, (0, 128), 16, 1),
    (50, 2, 6, (2, 5), 8, 2),
    (64, 1, 3, (0, 3), 16, 3),
    (32, 4, 128, (32, 64), 16, 4),
    (7, 3, 5, (4, 5), 16, 5),
    (300, 4, 128, (0, 128), 16, 6),  # past the decode bound: the invariant chunked path's single program
    (512, 4, 16, (4, 16), 64, 7),  # CHUNKED_SMALL_ALIGN_MAX_ASSIGNMENTS (2048) assignments, other ranks' dropped
]


def _align_ids(t, k, e_global, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(e_global, generator=g)[:k] for _ in range(t)])  # [T, K] distinct per token


@pytest.mark.parametrize("t,k,e_global,rng,m,seed", ALIGN_CASES)
def test_align_matches_loop(t, k, e_global, rng, m, seed):
    ids = _align_ids(t, k, e_global, seed)
    al = align_by_expert(ids, rng, m)
    rows, tiles, used = _align_by_loop(ids, rng[0], rng[1], m)
    p = max_padded_rows(t * k, rng[1] - rng[0], m)
    assert al.sorted_ids.shape == (p,) and al.tile_expert.shape == (p // m,)
    assert al.num_rows.item() == used <= p
    assert al.sorted_ids[:used].tolist() == rows
    assert al.tile_expert[: used // m].tolist() == tiles
    assert (al.tile_expert[used // m :] == -1).all()


def _ragged_by_loop(ids, a, b):
    """Independent reference: per expert pad to 16 rows, cut 128-row tiles, remember (start, rows, expert)."""
    flat = ids.reshape(-1).tolist()
    tiles, row = [], 0
    for e in range(a, b):
        n = sum(1 for v in flat if v == e)
        padded = -(-n // 16) * 16
        for j in range(0, padded, 128):
            tiles.append((row + j, min(128, padded - j), e - a))
        row += padded
    return tiles, row


def test_ragged_worked_example_from_docstring():
    from m3_kernels.moe_ragged import align_ragged

    ids = torch.tensor([0] * 150 + [1] * 20).reshape(-1, 1)
    for fat, want in ((64, [(0, 160, 0), (160, 32, 1)]), (0, [(0, 128, 0), (128, 32, 0), (160, 32, 1)])):
        rt = align_ragged(ids, (0, 2), fat)
        n = rt.num_tiles.item()
        assert list(zip(rt.tile_row[:n].tolist(), rt.tile_rows[:n].tolist(), rt.tile_expert[:n].tolist())) == want
        assert rt.num_rows.item() == 192 and rt.sorted_ids[150:160].tolist() == [170] * 10  # padding sentinel


RAGGED_CASES = [(300, 2, 4, (0, 4), 0), (97, 4, 16, (4, 12), 1), (1, 1, 3, (0, 3), 2)]  # (T, K, E, range, seed)


@pytest.mark.parametrize("t,k,e_global,rng,seed", RAGGED_CASES)
def test_align_ragged_tiles_match_loop(t, k, e_global, rng, seed):
    from m3_kernels.moe_ragged import align_ragged, max_tile_slots

    ids = _align_ids(t, k, e_global, seed)
    rt = align_ragged(ids, rng)
    tiles, used = _ragged_by_loop(ids, *rng)
    n = rt.num_tiles.item()
    assert rt.tile_row.shape == (max_tile_slots(t * k, rng[1] - rng[0]),) and n == len(tiles)
    got = list(zip(rt.tile_row[:n].tolist(), rt.tile_rows[:n].tolist(), rt.tile_expert[:n].tolist()))
    assert got == tiles and rt.num_rows.item() == used
    if t == 300:  # 150 rows per expert on average: full 128-row tiles and tails both occur
        assert 128 in rt.tile_rows[:n].tolist() and min(rt.tile_rows[:n].tolist()) < 128
    # fat_tail: a remainder of <= fat_tail rows joins the expert's last full tile
    for fat_tail in (32, 64):
        fat = align_ragged(ids, rng, fat_tail=fat_tail)
        want = []
        for row0, rows, e in tiles:
            if want and want[-1][2] == e and want[-1][1] == 128 and rows <= fat_tail:
                want[-1] = (want[-1][0], 128 + rows, e)
            else:
                want.append((row0, rows, e))
        nf = fat.num_tiles.item()
        got = list(zip(fat.tile_row[:nf].tolist(), fat.tile_rows[:nf].tolist(), fat.tile_expert[:nf].tolist()))
        assert got == want, fat_tail
    with pytest.raises(ValueError, match="fat_tail"):
        align_ragged(ids, rng, fat_tail=48)
    # the sorted rows are the 16-padded alignment of the same assignments
    assert rt.sorted_ids.tolist() == align_by_expert_torch(ids, rng, 16).sorted_ids.tolist()


def test_align_rejects_bad_range():
    with pytest.raises(ValueError, match="expert_range"):
        align_by_expert(torch.zeros(2, 2, dtype=torch.long), (3, 3), 16)
    with pytest.raises(ValueError, match=r"\[T, K\]"):
        align_by_expert(torch.zeros(4, dtype=torch.long), (0, 3), 16)


# ---------------------------------------------------------------- kernels under the interpreter


def _config(bm, n1, k1, n2, k2, *, group=(0, 0), **flags):
    """Kernel config as plain data (the parent process never imports triton); flags: permute/tma/ragged."""
    return {"block_m": bm, "w13": (n1, k1, 4, 3, group[0]), "w2": (n2, k2, 4, 3, group[1]), "flags": flags}


def _make_case(name, dtype, t, k, e_global, h, inter, seed, *, rng=None, forced=None, x_scale=1.0, config=None):
    """Random MoE inputs; `forced` puts that expert in every token's slot 0."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(t, e_global, generator=g)
    if forced is not None:
        scores[:, forced] = 2.0
    ids = scores.topk(k, dim=-1).indices  # [T, K] distinct experts per token
    weights = torch.rand(t, k, generator=g) + 0.1
    weights = weights / weights.sum(-1, keepdim=True) * 2.0  # routed_scaling_factor 2.0
    x = torch.randn(t, h, generator=g) * x_scale
    w13 = torch.randn(e_global, 2 * inter, h, generator=g) * h**-0.5 * 2.0
    w2 = torch.randn(e_global, h, inter, generator=g) * inter**-0.5
    return {
        "name": name,
        "dtype": dtype,
        "x": x.to(dtype),
        "ids": ids,
        "weights": weights,
        "w13": w13.to(dtype),
        "w2": w2.to(dtype),
        "range": rng or (0, e_global),
        "config": config,
    }


CASES = [
    # random routing, experts 3 and 7 never chosen (no tokens), ragged H / I against the tiles
    dict(
        name="fp32_ragged_empty_experts",
        dtype=torch.float32,
        t=11,
        k=2,
        e_global=8,
        h=48,
        inter=24,
        seed=0,
        x_scale=3.0,
        config=_config(16, 16, 32, 32, 16),
    ),
    # every token routes slot 0 to expert 2: one expert spans several row tiles
    dict(
        name="fp32_one_expert_gets_all",
        dtype=torch.float32,
        t=37,
        k=3,
        e_global=5,
        h=32,
        inter=16,
        seed=1,
        forced=2,
        config=_config(16, 16, 16, 16, 16),
    ),
    # EP local slice [2, 6) of 8 experts
    dict(
        name="fp32_local_slice",
        dtype=torch.float32,
        t=9,
        k=4,
        e_global=8,
        h=32,
        inter=32,
        seed=2,
        rng=(2, 6),
        config=_config(16, 32, 16, 16, 32),
    ),
    # fp16 with the library's default tile choice
    dict(name="fp16_default_config", dtype=torch.float16, t=6, k=2, e_global=4, h=64, inter=32, seed=3, x_scale=2.0),
    dict(
        name="fp16_local_slice_forced",
        dtype=torch.float16,
        t=20,
        k=2,
        e_global=6,
        h=32,
        inter=16,
        seed=4,
        rng=(3, 6),
        forced=4,
        config=_config(32, 16, 32, 32, 16),
    ),
    # expert-sorted x (moe_permute) with grouped program order (groups of 2 / 3 row tiles)
    dict(
        name="fp32_permuted_grouped",
        dtype=torch.float32,
        t=23,
        k=2,
        e_global=5,
        h=40,
        inter=24,
        seed=5,
        config=_config(16, 16, 16, 16, 16, group=(2, 3), permute=True),
    ),
    # TMA descriptor loads; I=24 against block_n 16: the last gate tile reads up rows (never stored)
    dict(
        name="fp32_tma_ragged_n",
        dtype=torch.float32,
        t=19,
        k=3,
        e_global=6,
        h=48,
        inter=24,
        seed=6,
        rng=(1, 5),
        config=_config(16, 16, 16, 32, 32, group=(3, 0), tma=True),
    ),
    # H=20 in fp16 is 40-byte rows: not TMA-aligned, the config falls back to pointer loads
    dict(
        name="fp16_tma_unaligned_falls_back",
        dtype=torch.float16,
        t=9,
        k=2,
        e_global=4,
        h=20,
        inter=16,
        seed=7,
        config=_config(16, 16, 16, 16, 16, tma=True, ragged=True),
    ),
    # ragged tiles: expert 2 gets 150 rows (a 128-row tile + a 32-row tail), the others 16/32/64 tails
    dict(
        name="fp16_ragged_tiles",
        dtype=torch.float16,
        t=150,
        k=2,
        e_global=6,
        h=32,
        inter=16,
        seed=8,
        forced=2,
        x_scale=2.0,
        config=_config(16, 16, 16, 16, 16, group=(2, 2), ragged=True),
    ),
    # fat tail: expert 1 gets ~150 rows (128 + 22): one program runs a 128-row and a 64-row MMA
    dict(
        name="fp32_ragged_fat_tail",
        dtype=torch.float32,
        t=150,
        k=2,
        e_global=5,
        h=32,
        inter=16,
        seed=10,
        forced=1,
        config=_config(16, 16, 32, 16, 16, group=(3, 2), ragged=True, fat_tail=64),
    ),
    dict(
        name="fp32_ragged_fat_permuted",
        dtype=torch.float32,
        t=150,
        k=2,
        e_global=5,
        h=32,
        inter=16,
        seed=11,
        forced=3,
        config=_config(16, 16, 16, 32, 16, group=(2, 2), ragged=True, fat_tail=64, permute=True),
    ),
    # fat tail of 32 rows (expert 0 gets ~140 rows: one 128-row + 32-row program)
    dict(
        name="fp16_ragged_fat32",
        dtype=torch.float16,
        t=140,
        k=2,
        e_global=4,
        h=32,
        inter=16,
        seed=12,
        forced=0,
        config=_config(16, 16, 16, 16, 16, group=(4, 4), ragged=True, fat_tail=32),
    ),
    dict(
        name="fp32_ragged_local_slice",
        dtype=torch.float32,
        t=40,
        k=3,
        e_global=8,
        h=24,
        inter=32,
        seed=9,
        rng=(2, 6),
        config=_config(16, 32, 16, 16, 32, ragged=True),
    ),
]


def _build_cases():
    out = []
    for c in CASES:
        c = dict(c)
        out.append(
            _make_case(
                c.pop("name"),
                c.pop("dtype"),
                c.pop("t"),
                c.pop("k"),
                c.pop("e_global"),
                c.pop("h"),
                c.pop("inter"),
                c.pop("seed"),
                **c,
            )
        )
    out[0]["ids"][out[0]["ids"] == 3] = 0  # no token for experts 3 and 7 (ids stay distinct per token:
    out[0]["ids"][out[0]["ids"] == 7] = 1  # k=2 rows hit by both maps are fixed just below)
    bad = out[0]["ids"][:, 0] == out[0]["ids"][:, 1]
    out[0]["ids"][bad, 1] = torch.where(out[0]["ids"][bad, 0] == 5, 6, 5)
    return out


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    """Run every case through `fused_experts` in a TRITON_INTERPRET=1 subprocess; returns (cases, outputs)."""
    cases = _build_cases()
    align_in = [(_align_ids(t, k, e, seed), rng, m) for t, k, e, rng, m, seed in ALIGN_CASES]
    ragged_in = [(_align_ids(t, k, e, seed), rng, fat) for t, k, e, rng, seed in RAGGED_CASES for fat in (0, 32, 64)]
    d = tmp_path_factory.mktemp("fused_moe")
    torch.save({"moe": cases, "align": align_in, "ragged": ragged_in}, d / "in.pt")
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, __file__, str(d / "in.pt"), str(d / "out.pt")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"interpreter worker failed:\n{proc.stdout}\n{proc.stderr}"
    out = torch.load(d / "out.pt")
    return cases, out["moe"], align_in, out["align"], ragged_in, out["ragged"]


def _reference(case, dtype):
    """grouped_experts over the FULL expert set with out-of-slice slots weighted 0, in `dtype`."""
    a, b = case["range"]
    inside = (case["ids"] >= a) & (case["ids"] < b)
    w = case["weights"] * inside
    return grouped_experts(case["x"].to(dtype), case["ids"], w, case["w13"].to(dtype), case["w2"].to(dtype), _act)


@pytest.mark.parametrize("idx", range(len(CASES)), ids=[c["name"] for c in CASES])
def test_fused_experts_matches_reference(interpreted, idx):
    cases, outs = interpreted[:2]
    case, got = cases[idx], outs[idx]
    assert got.shape == case["x"].shape and got.dtype == case["dtype"]
    ref64 = _reference(case, torch.float64)
    assert ref64.abs().max() > 0.1  # the case produces real signal
    if case["dtype"] == torch.float32:
        torch.testing.assert_close(got.double(), ref64, rtol=1e-4, atol=1e-4)
    else:
        # flash-attention style budget: at most 2x the error of the same maths done in fp16 by PyTorch
        ref_lp = _reference(case, case["dtype"]).double()
        budget = 2 * (ref_lp - ref64).abs().max().item() + 1e-3
        err = (got.double() - ref64).abs().max().item()
        assert err <= budget, f"{case['name']}: max err {err:.3g} > budget {budget:.3g}"


@pytest.mark.parametrize("idx", range(len(ALIGN_CASES)))
def test_one_launch_align_kernel_matches_torch_path(interpreted, idx):
    """The decode-size Triton alignment (used on CUDA) equals the tensor-op alignment exactly."""
    align_in, align_out = interpreted[2:4]
    ids, rng, m = align_in[idx]
    want = align_by_expert_torch(ids, rng, m)
    sorted_ids, tile_expert, num_rows = align_out[idx]
    assert num_rows.tolist() == want.num_rows.tolist()
    assert sorted_ids.tolist() == want.sorted_ids.tolist()
    assert tile_expert.tolist() == want.tile_expert.tolist()


@pytest.mark.parametrize("idx", range(3 * len(RAGGED_CASES)))
def test_triton_ragged_align_matches_torch_path(interpreted, idx):
    """The three-launch Triton alignment (used on CUDA) equals align_ragged_torch exactly."""
    from m3_kernels.moe_ragged import align_ragged_torch

    ragged_in, ragged_out = interpreted[4:6]
    ids, rng, fat = ragged_in[idx]
    want = align_ragged_torch(ids, rng, fat)
    for name, got in zip(
        ("sorted_ids", "tile_row", "tile_expert", "tile_rows", "num_tiles", "num_rows"), ragged_out[idx]
    ):
        assert got.tolist() == getattr(want, name).tolist(), name


def test_cases_cover_edges(interpreted):
    cases = interpreted[0]
    c0 = cases[0]
    used = set(c0["ids"].unique().tolist())
    assert {3, 7}.isdisjoint(used) and c0["ids"].shape[0] > 0
    assert (c0["ids"][:, 0] != c0["ids"][:, 1]).all()
    gate = torch.einsum("th,eih->tei", c0["x"], c0["w13"][:, :24])
    assert (gate > LIMIT).any() and (gate < -LIMIT).any()  # clamps exercised (upper clamp on gate)
    assert (cases[1]["ids"][:, 0] == 2).all()
    a, b = cases[2]["range"]
    assert ((cases[2]["ids"] < a) | (cases[2]["ids"] >= b)).any()  # slots owned by other ranks exist


def test_fused_experts_rejects_bad_inputs():
    from m3_kernels.fused_moe import fused_experts

    x = torch.zeros(3, 16)
    ids = torch.zeros(3, 2, dtype=torch.long)
    w = torch.ones(3, 2)
    w13, w2 = torch.zeros(4, 32, 16), torch.zeros(4, 16, 16)
    with pytest.raises(ValueError, match="expert_range"):
        fused_experts(x, ids, w, w13, w2, alpha=ALPHA, limit=LIMIT, expert_range=(0, 8))
    with pytest.raises(ValueError, match="w2"):
        fused_experts(x, ids, w, w13, torch.zeros(4, 16, 8), alpha=ALPHA, limit=LIMIT)
    with pytest.raises(ValueError, match="dtype"):
        fused_experts(x.half(), ids, w, w13, w2, alpha=ALPHA, limit=LIMIT)
    with pytest.raises(ValueError, match="weights"):
        fused_experts(x, ids, w[:, :1], w13, w2, alpha=ALPHA, limit=LIMIT)


def _interpret_worker(in_path: str, out_path: str) -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    from m3_kernels.fused_moe import GemmTile, MoEKernelConfig, fused_experts
    from m3_kernels.moe_align import align_by_expert_small
    from m3_kernels.moe_ragged import align_ragged_triton

    payload = torch.load(in_path)
    aligned = []
    for ids, rng, m in payload["align"]:
        al = align_by_expert_small(ids, rng, m)
        aligned.append((al.sorted_ids, al.tile_expert, al.num_rows))
    ragged = []
    for ids, rng, fat in payload["ragged"]:
        rt = align_ragged_triton(ids, rng, fat)
        ragged.append((rt.sorted_ids, rt.tile_row, rt.tile_expert, rt.tile_rows, rt.num_tiles, rt.num_rows))
    outs = []
    for case in payload["moe"]:
        a, b = case["range"]
        cfg = case["config"]
        if cfg is not None:
            cfg = MoEKernelConfig(cfg["block_m"], GemmTile(*cfg["w13"]), GemmTile(*cfg["w2"]), **cfg["flags"])
        outs.append(
            fused_experts(
                case["x"],
                case["ids"],
                case["weights"],
                case["w13"][a:b].contiguous(),
                case["w2"][a:b].contiguous(),
                alpha=ALPHA,
                limit=LIMIT,
                beta=BETA,
                expert_range=(a, b),
                config=cfg,
            )
        )
    torch.save({"moe": outs, "align": aligned, "ragged": ragged}, out_path)


if __name__ == "__main__":
    _interpret_worker(sys.argv[1], sys.argv[2])

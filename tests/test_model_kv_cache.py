"""KV cache semantics (kv_cache.py): write-then-read with slot == position makes prefill, chunked
prefill, token-by-token decode and mixed-position right-padded batches agree (spec §4.4, §7 (3))."""

from __future__ import annotations

import pytest
import torch

from m3_rollout.model import KVCache, M3ForCausalLM, tiny_config

TOL = 1e-9


@pytest.fixture(scope="module")
def model():
    cfg = tiny_config()
    m = M3ForCausalLM(cfg).double().eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in m.named_parameters():
            std = 0.5 if p.ndim == 1 else (0.3 if ("w13" in name or "gate_proj" in name or "up_proj" in name) else 0.1)
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * std)
    return m


def _ids(n, seed, batch=1):
    return torch.randint(0, 1024, (batch, n), generator=torch.Generator().manual_seed(seed))


def _run_chunks(model, ids, chunks, max_len=None):
    cache = KVCache(model.config, 1, max_len or ids.shape[1], dtype=torch.float64)
    outs, start = [], 0
    for n in chunks:
        pos = torch.arange(start, start + n)[None]
        outs.append(model(ids[:, start : start + n], pos, cache))
        start += n
    assert start == ids.shape[1]
    return torch.cat(outs, dim=1)


@torch.no_grad()
def test_prefill_decode_and_chunks_agree(model):
    s = 150  # > K*B = 64: sparse selection is active
    ids = _ids(s, 1)
    ref = model(ids)  # no cache
    full = _run_chunks(model, ids, [s], max_len=200)
    decode = _run_chunks(model, ids, [50] + [1] * 100)
    chunked = _run_chunks(model, ids, [7, 16, 20, 33, 1, 40, 33])  # edges inside and at 16-token blocks
    for name, out in (("prefill", full), ("decode", decode), ("chunked", chunked)):
        diff = (out - ref).abs().max().item()
        assert diff < TOL, f"{name}: {diff:.3e}"


@torch.no_grad()
def test_mixed_positions_with_right_padding_match_rows_alone(model):
    lens, prompts = [150, 90, 37], [100, 60, 20]
    rows = [_ids(n, 10 + i)[0] for i, n in enumerate(lens)]
    alone = [model(r[None])[0] for r in rows]
    b, max_len = len(rows), 160
    cache = KVCache(model.config, b, max_len, dtype=torch.float64)
    got = [dict() for _ in rows]  # position -> logits

    def step(feeds):
        """feeds[r] = (start position, number of real tokens); right-pad to the widest."""
        width = max(n for _, n in feeds)
        ids = torch.zeros(b, width, dtype=torch.long)
        pos = torch.zeros(b, width, dtype=torch.long)
        for r, (p0, n) in enumerate(feeds):
            pos[r] = torch.arange(p0, p0 + width)  # pads continue the row's positions
            ids[r, :n] = rows[r][p0 : p0 + n]
        out = model(ids, pos, cache)
        for r, (p0, n) in enumerate(feeds):
            for j in range(n):
                got[r][p0 + j] = out[r, j]

    step([(0, p) for p in prompts])  # right-padded prefill
    cur = list(prompts)
    step([(cur[0], 5), (cur[1], 3), (cur[2], 1)])  # a chunk step with per-row lengths
    cur = [cur[0] + 5, cur[1] + 3, cur[2] + 1]
    while any(c < n for c, n in zip(cur, lens)):
        step([(c, 1 if c < n else 0) for c, n in zip(cur, lens)])  # finished rows: one pad token
        cur = [c + 1 if c < n else c for c, n in zip(cur, lens)]
    for r, n in enumerate(lens):
        out = torch.stack([got[r][p] for p in range(n)])
        diff = (out - alone[r]).abs().max().item()
        assert diff < TOL, f"row {r}: {diff:.3e}"


@torch.no_grad()
def test_no_cache_right_padding_and_explicit_positions(model):
    """Without a cache (the trainer path) right padding does not leak into real tokens, and
    explicit positions behave like the default ones."""
    a, b = _ids(120, 20)[0], _ids(70, 21)[0]
    batch = torch.zeros(2, 120, dtype=torch.long)
    batch[0], batch[1, :70] = a, b
    out = model(batch)
    assert (out[0] - model(a[None])[0]).abs().max() < TOL
    assert (out[1, :70] - model(b[None])[0]).abs().max() < TOL
    pos = torch.arange(120).expand(2, 120)
    assert torch.equal(model(batch, pos.clone()), out)


@torch.no_grad()
def test_cache_errors_and_row_reselection(model):
    cache = KVCache(model.config, 2, 32, dtype=torch.float64)
    ids = _ids(8, 30, batch=2)
    with pytest.raises(ValueError, match="max_len 32"):
        model(ids, torch.arange(30, 38).expand(2, 8), cache)
    with pytest.raises(ValueError, match="batch_size 2"):
        model(ids[:1], torch.arange(8)[None], cache)
    ref = model(ids[1:2], torch.arange(8)[None])
    model(ids, torch.arange(8).expand(2, 8), cache)
    # drop row 0 the way the engine does (index_select on every tensor): sizes follow the tensors
    for tensors in (cache.k, cache.v, cache.index_k):
        for i, t in enumerate(tensors):
            if t is not None:
                tensors[i] = t.index_select(0, torch.tensor([1]))
    assert cache.batch_size == 1 and cache.max_len == 32
    nxt = _ids(1, 31)
    out = model(nxt, torch.tensor([[8]]), cache)
    full = model(torch.cat([ids[1:2], nxt], dim=1))
    assert (out[0, 0] - full[0, 8]).abs().max() < TOL
    assert (ref[0] - full[0, :8]).abs().max() < TOL

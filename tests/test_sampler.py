"""Sampler: keyed randomness, exact distribution, top-k / top-p support, logprob modes."""

import math

import torch

from m3_rollout.engine.sampler import SamplingTensors, keyed_uniform, process_logits, sample


def _params(n, temperature=1.0, top_k=-1, top_p=1.0, seed=0, sample_ids=None):
    return SamplingTensors(
        torch.full((n,), temperature),
        torch.full((n,), top_k, dtype=torch.long),
        torch.full((n,), top_p),
        torch.full((n,), seed, dtype=torch.long),
        torch.arange(n) if sample_ids is None else sample_ids,
    )


def test_uniform_depends_only_on_its_keys():
    seeds = torch.tensor([1, 1, 2, 1])
    samples = torch.tensor([0, 1, 0, 0])
    pos = torch.tensor([5, 5, 5, 6])
    u = keyed_uniform(seeds, samples, pos, 16)
    assert u.shape == (4, 16) and bool(((u > 0) & (u < 1)).all())
    # Each row differs from the others (different key) ...
    for i in range(4):
        for j in range(i + 1, 4):
            assert not torch.equal(u[i], u[j])
    # ... and a row is the same whatever shares its batch or its order.
    alone = keyed_uniform(seeds[2:3], samples[2:3], pos[2:3], 16)
    assert torch.equal(alone[0], u[2])
    flipped = keyed_uniform(seeds.flip(0), samples.flip(0), pos.flip(0), 16)
    assert torch.equal(flipped.flip(0), u)


def test_uniforms_are_uniform():
    u = keyed_uniform(torch.zeros(2000, dtype=torch.long), torch.arange(2000), torch.zeros(2000, dtype=torch.long), 50)
    assert abs(float(u.mean()) - 0.5) < 0.005
    assert abs(float(u.var()) - 1 / 12) < 0.002


def test_gumbel_max_matches_softmax_frequencies():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).repeat(20000, 1)
    tokens, lps = sample(logits, _params(20000, sample_ids=torch.arange(20000)), torch.zeros(20000, dtype=torch.long))
    freq = torch.bincount(tokens, minlength=4).float() / 20000
    expected = torch.softmax(logits[0], -1)
    assert torch.allclose(freq, expected, atol=0.012), (freq, expected)
    assert torch.allclose(lps, torch.log(expected)[tokens])


def test_temperature_and_processed_vs_raw_logprobs():
    logits = torch.tensor([[1.0, 0.5, 0.0]])
    p = _params(1, temperature=0.5)
    tok, lp = sample(logits, p, torch.tensor([3]), "processed")
    assert math.isclose(float(lp), float(torch.log_softmax(logits[0] / 0.5, -1)[tok]), rel_tol=1e-6)
    tok2, lp_raw = sample(logits, p, torch.tensor([3]), "raw")
    assert int(tok2) == int(tok)
    assert math.isclose(float(lp_raw), float(torch.log_softmax(logits[0], -1)[tok]), rel_tol=1e-6)


def test_top_k_and_top_p_restrict_support():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    k = process_logits(logits, torch.ones(1), torch.tensor([2]), torch.ones(1))
    assert torch.isinf(k[0, 2:]).all() and torch.isfinite(k[0, :2]).all()
    # top_p=0.7: 0.5 alone is below 0.7, so the token crossing the threshold (0.3) is kept.
    pp = process_logits(logits, torch.ones(1), torch.tensor([-1]), torch.tensor([0.7]))
    assert torch.isfinite(pp[0, :2]).all() and torch.isinf(pp[0, 2:]).all()
    n = 4000
    tokens, lps = sample(logits.repeat(n, 1), _params(n, top_p=0.7), torch.zeros(n, dtype=torch.long))
    assert set(tokens.tolist()) == {0, 1}
    renorm = torch.tensor([0.5, 0.3]) / 0.8
    assert torch.allclose(lps, torch.log(renorm)[tokens], atol=1e-5)


def test_rows_are_independent_of_batch_composition():
    torch.manual_seed(0)
    logits = torch.randn(6, 100)
    p = _params(6, sample_ids=torch.tensor([3, 1, 4, 1, 5, 9]), seed=7)
    pos = torch.tensor([10, 11, 12, 13, 14, 15])
    full, _ = sample(logits, p, pos)
    part, _ = sample(
        logits[2:4],
        SamplingTensors(*(t[2:4] for t in (p.temperature, p.top_k, p.top_p, p.seeds, p.sample_ids))),
        pos[2:4],
    )
    assert torch.equal(full[2:4], part)


def test_fused_triton_sampler_equals_torch_sampler():
    """``sampler_triton.keyed_gumbel_sample`` (Triton interpreter here) vs ``sample_rows``: same
    ids, logprobs within 1e-5, processed and raw rows, bf16 and fp32 logits, V not a block multiple."""
    import os

    import pytest

    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        pytest.skip("needs TRITON_INTERPRET=1 (tests/conftest.py sets it without a GPU)")
    from m3_rollout.engine.sampler import sample_rows, vocab_hash
    from m3_rollout.engine.sampler_triton import keyed_gumbel_sample

    g = torch.Generator().manual_seed(3)
    n, v = 5, 1500
    for dtype in (torch.float32, torch.bfloat16):
        logits = (torch.randn(n, v, generator=g) * 3).to(dtype)
        temp = torch.tensor([1.0, 0.7, 1.3, 0.5, 2.0], dtype=torch.float64)
        seeds = torch.tensor([1, -5, 2**62, 7, 0])
        sids = torch.tensor([0, 2, 3, -4, 9])
        pos = torch.tensor([5, 7, 0, 33, 2**40])
        raw = torch.tensor([0, 1, 0, 1, 0])
        params = SamplingTensors(temp, torch.full((n,), -1), torch.ones(n), seeds, sids)
        tok, lp = sample_rows(logits.float(), params, pos, raw != 0, False, False)
        out, last = torch.zeros(2 * n, dtype=torch.int64), torch.zeros(n, dtype=torch.int64)
        keyed_gumbel_sample(
            logits, temp, seeds, sids, pos, raw, vocab_hash(v, torch.device("cpu")), out, last, block=512
        )
        assert out[:n].tolist() == tok.tolist() == last.tolist()
        assert (out[n:].view(torch.float64) - lp.double()).abs().max().item() < 1e-5

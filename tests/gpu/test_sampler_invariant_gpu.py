"""The sampler's batch-invariant top-k / top-p on a CUDA GPU (issue 24; design.md §4.6).

CPU counterpart: tests/test_sampler_invariant.py. Here at the bench vocabulary (V 32000), fp32
logits on the GPU: a row's support, sampled token and logprob (with the invariant logprob op
``m3_kernels.invariant_ops.token_logprobs``) alone == in a batch of 64 == in shuffled subsets,
bitwise; ``prefix_sums`` gives the CPU's bits (elementwise IEEE adds only). Prints how many mass
values the fast path's ``torch.cumsum`` gives a row alone differently from the same row batched
(the library scans a single row with another algorithm; informational, not asserted).
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("TRITON_INTERPRET=1 in this process; run tests/gpu alone", allow_module_level=True)

from m3_kernels.invariant_ops import token_logprobs  # noqa: E402
from m3_rollout.engine.sampler import SamplingTensors, prefix_sums, process_logits, sample  # noqa: E402

DEV = torch.device("cuda")
N, V = 64, 32000


def _case():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, V, generator=g) * torch.linspace(0.5, 6.0, N)[:, None]
    x[::7, 100:400] = 3.0  # ties
    p = SamplingTensors(
        temperature=(0.6 + torch.rand(N, generator=g, dtype=torch.float64)),
        top_k=torch.where(torch.arange(N) % 3 == 0, torch.tensor(50), torch.tensor(-1)),
        top_p=torch.where(torch.arange(N) % 5 == 0, torch.tensor(1.0), 0.5 + 0.5 * torch.rand(N, generator=g)),
        seeds=torch.arange(N) + 3,
        sample_ids=torch.arange(N),
    )
    return x.to(DEV), SamplingTensors(*(t.to(DEV) for t in (p.temperature, p.top_k, p.top_p, p.seeds, p.sample_ids)))


def _take(p, rows):
    return SamplingTensors(*(t[rows] for t in (p.temperature, p.top_k, p.top_p, p.seeds, p.sample_ids)))


def test_prefix_sums_gpu_bits_equal_cpu_bits():
    x = torch.rand(N, V, generator=torch.Generator().manual_seed(1))
    assert torch.equal(prefix_sums(x.to(DEV)).cpu(), prefix_sums(x))


def test_invariant_sampling_does_not_depend_on_the_batch():
    x, p = _case()
    full = process_logits(x, p.temperature, p.top_k, p.top_p, batch_invariant=True)
    pos = torch.full((N,), 77, device=DEV)
    tok, lp = sample(x, p, pos, token_logprobs=token_logprobs, batch_invariant=True)
    g = torch.Generator().manual_seed(2)
    batchings = [[r] for r in range(N)] + [torch.randperm(N, generator=g)[:n].tolist() for n in (2, 5, 33)]
    for rows in batchings:
        q = _take(p, rows)
        assert torch.equal(process_logits(x[rows], q.temperature, q.top_k, q.top_p, batch_invariant=True), full[rows])
        t, l = sample(x[rows], q, pos[rows], token_logprobs=token_logprobs, batch_invariant=True)
        assert torch.equal(t, tok[rows]) and torch.equal(l, lp[rows]), rows
    probs = torch.softmax(x.sort(-1, descending=True).values, -1)
    alone = torch.cat([torch.cumsum(probs[r : r + 1], -1) for r in range(N)])
    print(
        f"fast path: {int((alone != torch.cumsum(probs, -1)).sum())} of {N * V} cumsum values differ alone vs batched"
    )

"""The sampler's top-k / top-p in batch-invariant mode (issue 24; design.md §4.6), fp32 on the CPU.

A row's support (the finite entries of ``process_logits``), its sampled token and its logprob
must be a function of that row alone. The fast path's ``torch.softmax`` + ``torch.cumsum`` are
library reductions whose order may follow the tensor's shape: on CUDA the cumsum of a single row
takes a device-wide scan (cub), that of several rows a per-row block scan, so a row alone and
batched get different mass bits and, at a threshold, a different kept set. The CPU runs both
sequentially, so the alone-vs-batched checks here hold for either path; what gives them teeth on
the CPU is (a) the invariant path calls neither reduction (they are made to raise), (b)
``prefix_sums``' bits for position i depend on positions 0..i alone (not the row length nor the
number of rows), and (c) a top_p = 1 row keeps its whole support when another row makes the step
filter. tests/gpu/test_sampler_invariant_gpu.py checks the bits on a GPU.
"""

from __future__ import annotations

import pytest
import torch

import m3_rollout.engine.sampler as sampler_mod
from m3_rollout.engine.sampler import SamplingTensors, prefix_sums, process_logits, sample

V = 300  # not a power of two: the scan's last pass is partial


def _rows(n=7, seed=0):
    """n rows of different contents: scales 0.5..8 (flat to peaked), one with tied logits, one
    with -inf entries (a masked vocabulary tail)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, V, generator=g) * torch.linspace(0.5, 8.0, n)[:, None]
    x[1, 10:60] = 2.5  # ties straddling top-k / top-p boundaries
    x[2, 250:] = float("-inf")
    return x


def _params(n):
    return SamplingTensors(
        temperature=torch.tensor([1.0, 0.7, 1.3, 0.9, 1.0, 0.5, 1.1][:n], dtype=torch.float64),
        top_k=torch.tensor([-1, 40, -1, 5, 100, -1, -1][:n]),
        top_p=torch.tensor([0.9, 0.8, 0.95, 1.0, 0.6, 0.99, 1.0][:n]),
        seeds=torch.arange(n) + 11,
        sample_ids=torch.arange(n) * 3,
    )


def _take(p: SamplingTensors, rows) -> SamplingTensors:
    return SamplingTensors(*(t[rows] for t in (p.temperature, p.top_k, p.top_p, p.seeds, p.sample_ids)))


def test_prefix_sums_fixed_association():
    g = torch.Generator().manual_seed(1)
    x = torch.rand(5, 1000, generator=g)
    s = prefix_sums(x)
    torch.testing.assert_close(s.double(), x.double().cumsum(-1), rtol=1e-6, atol=0)
    for m in (1, 2, 3, 17, 256, 257, 999):  # position i's bits do not depend on the length
        assert torch.equal(prefix_sums(x[:, :m]), s[:, :m])
    for r in range(5):  # nor on the other rows
        assert torch.equal(prefix_sums(x[r : r + 1]), s[r : r + 1])
    assert torch.equal(prefix_sums(x[0]), s[0])  # 1-D
    assert prefix_sums(x[:, :0]).shape == (5, 0)


def test_invariant_support_token_and_logprob_do_not_depend_on_the_batch():
    """Every row alone (its own need flags) vs in the batch of 7 and in shuffled subsets: same
    support, token and logprob, bitwise, over 20 positions (different Gumbel draws)."""
    x, p = _rows(), _params(7)
    full = process_logits(x, p.temperature, p.top_k, p.top_p, batch_invariant=True)
    sizes = torch.isfinite(full).sum(-1)
    assert (sizes[:6] < V).all() and sizes[6] == V  # rows 0-5 filter; row 6 (top_p 1, no top-k) does not
    assert (sizes > 1).sum() >= 5
    g = torch.Generator().manual_seed(2)
    batchings = [list(range(7)), *(torch.randperm(7, generator=g)[:4].tolist() for _ in range(3))]
    for pos in range(20):
        positions = torch.full((7,), 100 + pos)
        tok, lp = sample(x, p, positions, batch_invariant=True)
        for r in range(7):
            t1, l1 = sample(x[r : r + 1], _take(p, [r]), positions[:1], batch_invariant=True)
            assert int(t1) == int(tok[r]) and torch.equal(l1, lp[r : r + 1]), (pos, r)
        for rows in batchings:
            tb, lb = sample(x[rows], _take(p, rows), positions[rows], batch_invariant=True)
            assert torch.equal(tb, tok[rows]) and torch.equal(lb, lp[rows]), (pos, rows)
    for r in range(7):
        q = _take(p, [r])
        alone = process_logits(x[r : r + 1], q.temperature, q.top_k, q.top_p, batch_invariant=True)
        assert torch.equal(alone, full[r : r + 1])


def test_top_p_one_row_keeps_everything_when_another_row_filters():
    """need_top_p is the batch's: a top_p = 1 row with a long tail far below the head keeps the
    support it has alone (no filtering at all) beside a row with top_p < 1."""
    x = torch.zeros(2, V)
    x[0, 0] = 30.0  # the rest of row 0: mass ~ 1e-13 each, rounds the mass before them to 1.0
    x[1] = torch.linspace(3, -3, V)
    p = SamplingTensors(torch.ones(2, dtype=torch.float64), torch.tensor([-1, -1]), torch.tensor([1.0, 0.5]),
                        torch.zeros(2, dtype=torch.long), torch.arange(2))  # fmt: skip
    batch = process_logits(x, p.temperature, p.top_k, p.top_p, batch_invariant=True)
    alone = process_logits(x[:1], p.temperature[:1], p.top_k[:1], p.top_p[:1], batch_invariant=True)
    assert torch.equal(batch[:1], alone) and torch.isfinite(alone).all()
    assert torch.isinf(batch[1]).any()  # row 1 did filter
    fast = process_logits(x, p.temperature, p.top_k, p.top_p)
    fast_alone = process_logits(x[:1], p.temperature[:1], p.top_k[:1], p.top_p[:1])
    # the fast path too: its rounded mass reaches 1.0 before row 0's tail, which it used to drop
    assert torch.equal(fast[:1], fast_alone) and torch.isfinite(fast[0]).all() and torch.isinf(fast[1]).any()


def test_invariant_top_p_keeps_the_fast_paths_rule():
    """Same rule as the fast path (smallest prefix whose mass reaches top_p, the crossing token
    kept): equal supports on random rows with top_p < 1 (no mass within rounding of top_p), and the
    worked example."""
    x, p = _rows(seed=3), _params(7)
    inv = process_logits(x, p.temperature, p.top_k, p.top_p, batch_invariant=True)
    fast = process_logits(x, p.temperature, p.top_k, p.top_p)
    rows = p.top_p < 1
    assert rows.sum() == 5 and torch.equal(torch.isfinite(inv[rows]), torch.isfinite(fast[rows]))
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    pp = process_logits(logits, torch.ones(1), torch.tensor([-1]), torch.tensor([0.7]), batch_invariant=True)
    assert torch.isfinite(pp[0, :2]).all() and torch.isinf(pp[0, 2:]).all()


def test_invariant_path_calls_no_shape_ordered_reduction(monkeypatch):
    """The invariant top-p uses neither torch.softmax nor torch.cumsum (whose CUDA order depends on
    the batch shape); the fast path does (so the patch would catch a regression)."""

    def boom(*args, **kwargs):
        raise AssertionError("a library reduction in the invariant top-p")

    x, p = _rows(), _params(7)
    monkeypatch.setattr(torch, "softmax", boom)
    monkeypatch.setattr(torch, "cumsum", boom)
    monkeypatch.setattr(torch.Tensor, "cumsum", boom)
    monkeypatch.setattr(torch.Tensor, "softmax", boom)
    process_logits(x, p.temperature, p.top_k, p.top_p, batch_invariant=True)
    with pytest.raises(AssertionError, match="library reduction"):
        process_logits(x, p.temperature, p.top_k, p.top_p)


def test_ties_are_ranked_by_token_id():
    """Stable sort: with 50 tied logits and top_k = 5, the 5 lowest token ids of the tie are kept."""
    x = torch.zeros(1, V)
    x[0, 100:150] = 1.0
    out = process_logits(x, torch.ones(1), torch.tensor([5]), torch.ones(1), batch_invariant=True)
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == list(range(100, 105))


def test_engine_hands_the_flag_to_the_sampler(monkeypatch):
    """EngineConfig.batch_invariant reaches sample_rows in the runner's steps (and the staged
    decode path), on any device (the sampler part needs no kernel)."""
    from paged_model_util import small_paged_model  # tests/ on sys.path

    import m3_rollout.engine.decode_graph as graph_mod
    import m3_rollout.engine.model_runner as runner_mod
    from m3_rollout.engine.config import EngineConfig
    from m3_rollout.engine.engine import LLMEngine
    from m3_rollout.engine.interface import GenerationRequest, SamplingParams
    from m3_rollout.engine.ops import reference_paged_ops

    seen = []

    def spy(*args, **kwargs):
        seen.append(args[7] if len(args) > 7 else kwargs.get("batch_invariant", False))
        return sampler_mod.sample_rows(*args, **kwargs)

    monkeypatch.setattr(runner_mod, "sample_rows", spy)
    monkeypatch.setattr(graph_mod, "sample_rows", spy)
    for graphs in (False, "eager"):
        for flag in (True, False):
            seen.clear()
            cfg = EngineConfig(
                max_model_len=32, max_num_seqs=2, num_pages=16, batch_invariant=flag, enable_cuda_graphs=graphs
            )
            engine = LLMEngine(small_paged_model(0, vocab_size=96), cfg, ops=reference_paged_ops())
            assert engine.runner.batch_invariant is flag
            engine.add_request(GenerationRequest("a", [1, 2, 3], SamplingParams(max_new_tokens=3, top_p=0.9, seed=1)))
            while engine.has_unfinished():
                engine.step()
            assert seen and set(seen) == {flag}, (graphs, flag, seen)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_graph_steps_recompute_the_fused_samplers_logprobs_with_the_invariant_op(dtype):
    """Batch-invariant decode graphs pick ids with the fused Triton sampler (``sample_rows``' ids)
    and ``decode_graph.invariant_logprobs_into`` recomputes their logprobs in one launch of the
    invariant op (temperature and raw flags inside): the bits must be ``sample_rows``' with the
    same op (upcast, fp32 division, then the op), for processed and raw rows and temperatures
    whose division rounds (the eager steps' and the trainer scorer's values). The op runs under
    the Triton interpreter (fp32 / fp16)."""
    import numpy as np

    from m3_kernels.fused_interpret import interpreted_invariant_ops
    from m3_rollout.engine.decode_graph import invariant_logprobs_into
    from m3_rollout.engine.sampler import NUM_SAMPLING_FIELDS, pack_sampling, sample_rows

    kernel_op = interpreted_invariant_ops().token_logprobs
    seen = []

    def op(logits, tokens, **kw):  # the kernel op, recording the dtype it is handed
        seen.append(logits.dtype)
        return kernel_op(logits, tokens, **kw)

    x = _rows().to(dtype)
    n = x.shape[0]
    p = _params(n)
    p = SamplingTensors(p.temperature, torch.full((n,), -1), torch.ones(n), p.seeds, p.sample_ids)
    positions = torch.arange(n) * 5 + 2
    raw = torch.arange(n) % 2 == 1
    tok, lp = sample_rows(x.float(), p, positions, raw, False, False, op, True)
    packed = np.zeros((NUM_SAMPLING_FIELDS, n), dtype=np.int64)
    pack_sampling(
        packed,
        p.temperature.numpy(),
        p.top_k.numpy(),
        p.top_p.double().numpy(),
        p.seeds.numpy(),
        p.sample_ids.numpy(),
        positions.numpy(),
        raw.numpy(),
    )
    out = torch.stack([tok, torch.full((n,), -1, dtype=torch.int64)])
    seen.clear()
    invariant_logprobs_into(out, x, torch.from_numpy(packed), op)
    # fp32 rows, as sample_rows hands them: the GPU kernel's partial sums follow its load layout,
    # which Triton picks by element size (the interpreter has no layouts, so the dtype is checked)
    assert seen == [torch.float32]
    assert torch.equal(out[0], tok)
    assert torch.equal(out[1].view(torch.float64), lp.double())
    processed_only = torch.stack([tok, torch.zeros(n, dtype=torch.int64)])
    packed[-1] = 0  # every row "processed": the raw rows' values must change (the test has teeth)
    invariant_logprobs_into(processed_only, x, torch.from_numpy(packed), op)
    changed = processed_only[1].view(torch.float64) != lp.double()
    assert torch.equal(changed, raw & (p.temperature != 1.0))
    with pytest.raises(ValueError, match="fp64 logits"):
        invariant_logprobs_into(processed_only, x.double(), torch.from_numpy(packed), op)

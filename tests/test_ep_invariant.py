"""Batch-invariant mode under expert parallelism (issue 24; design.md §4.6): EP=2 == EP=1, bitwise.

Two gloo ranks on the CPU, the invariant table's MoE ops under the Triton interpreter
(``interpreted_paged_ops(batch_invariant=True)``: the fp32 router ``linear`` + ``router_topk``,
``invariant_ops.fused_experts``, the shared expert through ``linear``), the interpreter's ``tl.dot``
in a fixed per-row order (``msa_interpret.fixed_order_dot``: numpy's BLAS is position-dependent on
the CPU, the GPU is not). Same seeded MoE layer on each rank (8 experts, top-4), experts [0, 4) /
[4, 8): a token's routed and shared outputs and expert ids from the EP layer equal, bitwise, the
EP=1 layer's on that token in the rank's whole batch, whether it is computed in its batch, alone,
among a shuffled subset, or beside a peer with a different batch or none
(tests/ep_invariant_util.py). fp32 and fp16.

Teeth, checked on the inputs: tokens whose K slots are not in expert-id order and pairs crossing
ranks both ways. The combine this replaced (weight applied after the expert's rounding, pairs
summed in expert order by ``index_add_`` in x.dtype) fails the fp32 case (summation order); a
combine in slot order in fp32 that still applied the weight at home fails the fp16 case (the fused
op rounds W2·act × w once).

Also the pieces of the combine: the routing weights' trip in the dispatched rows, and the slot-order
fp32 sum against the fused MoE's own combine kernel (interpreted).
"""

from __future__ import annotations

import pytest
import torch
from ep_invariant_util import EPCase, check_ep_invariant, run_ep_invariant  # tests/ on sys.path

from m3_rollout.parallel.ep_moe import WEIGHT_COLUMNS, combine_slots, split_weight_columns, with_weight_columns

TIMEOUT_S = 300


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_ep2_invariant_moe_equals_ep1_bitwise(dtype):
    check_ep_invariant(run_ep_invariant(EPCase(dtype, tokens=(9, 6)), TIMEOUT_S))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_weight_columns_round_trip(dtype):
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(7, 24, generator=g).to(dtype)
    w = torch.rand(7, generator=g, dtype=torch.float64) * 3  # cast to fp32 on the way, as the fused op reads it
    packed = with_weight_columns(rows, w)
    assert packed.dtype == dtype and packed.shape == (7, 24 + WEIGHT_COLUMNS)
    back_rows, back_w = split_weight_columns(packed, 24)
    assert torch.equal(back_rows, rows) and torch.equal(back_w, w.float())
    assert with_weight_columns(torch.zeros(3, 64, dtype=dtype), w[:3]).stride(0) % 16 == 0  # H = 64 is
    with pytest.raises(ValueError, match="fp32 weight bits"):
        with_weight_columns(rows.double(), w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_combine_slots_is_the_fused_moe_combine(dtype):
    """combine_slots on pairs in expert-sorted order == m3_kernels.fused_moe.moe_combine on the same
    rows in (token, slot) layout, bitwise (interpreted kernel; signed zeros included)."""
    from m3_kernels.fused_interpret import interpreted_invariant_ops

    fm = interpreted_invariant_ops().fm
    g = torch.Generator().manual_seed(1)
    t, k, h = 11, 4, 40
    rows = (torch.randn(t * k, h, generator=g) * torch.logspace(-3, 3, h)).to(dtype)  # [T*K, H], magnitudes mixed
    rows[:k, :3] = -0.0  # token 0: every slot -0.0 in three columns
    ids = torch.rand(t, 8, generator=g).argsort(-1)[:, :k]  # [T, K] distinct experts, not sorted
    order = torch.argsort(ids.reshape(-1), stable=True)
    got = combine_slots(rows[order], order, t, k)
    want = fm.moe_combine(rows, ids, (0, 8))
    bits = torch.int16 if dtype == torch.float16 else torch.int32
    assert torch.equal(got.view(bits), want.view(bits))  # torch.equal alone takes -0.0 == 0.0

"""Colocated direct weight sync on a CUDA GPU (weight_sync/direct.py): the fused finite check
(torch._foreach_norm L1 + L-inf, one host sync) and the fused per-tensor copy; skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from m3_rollout.model import M3ForCausalLM, iter_released_tensors, tiny_config  # noqa: E402
from m3_rollout.parallel import shard_experts  # noqa: E402
from m3_rollout.weight_sync import ColocatedChannel, WeightReceiver, WeightSender, WeightUpdateError  # noqa: E402
from m3_rollout.weight_sync.direct import nonfinite  # noqa: E402

NAME = "language_model.model.layers.2.block_sparse_moe.experts.6.w3.weight"


def _model(seed: int, ep_rank: int | None = None) -> M3ForCausalLM:
    torch.manual_seed(seed)
    m = M3ForCausalLM(tiny_config()).float()
    if ep_rank is not None:
        shard_experts(m, ep_rank, 2, None)
    return m.cuda().eval()


def test_nonfinite_cuda_matches_per_tensor_reference():
    g = torch.Generator(device="cuda").manual_seed(0)
    ts = [torch.randn(n, device="cuda", generator=g) * 100 for n in (5, 0, 70000, 3, 9, 1)]
    dst = [torch.float32, torch.bfloat16, torch.bfloat16, torch.bfloat16, torch.float16, torch.float32]
    ts[2][40000] = float("nan")  # NaN deep inside a tensor larger than one multi-tensor-apply chunk
    ts[4][8] = 70000.0  # finite in fp32, +inf in fp16
    ts[5][0] = -float("inf")
    want = [i for i, (t, d) in enumerate(zip(ts, dst)) if not bool(torch.isfinite(t.to(d).float()).all())]
    assert want == [2, 4, 5]
    assert nonfinite(ts, dst) == want


@pytest.mark.parametrize("atomic", [True, False])
def test_direct_update_cuda_bitwise_in_place_ep2(atomic):
    trainer = _model(1)
    ms = [_model(0, r).cast_for_inference(torch.bfloat16) for r in range(2)]  # router stays fp32 (spec §6)
    rxs = [WeightReceiver(m, atomic=atomic, version=1) for m in ms]
    ptrs = [{n: p.data_ptr() for n, p in m.named_parameters()} for m in ms]
    WeightSender(
        lambda: iter_released_tensors(trainer), ColocatedChannel(rxs, "cuda", direct=True), 64, torch.bfloat16
    ).update(2, include_frozen=True)
    t = dict(trainer.named_parameters())
    for r, (m, rx) in enumerate(zip(ms, rxs)):
        assert rx.version == 2 and rx.valid
        for n, p in m.named_parameters():
            ref = t[n].detach()
            if n.endswith(("experts.w13", "experts.w2")):
                ref = ref[4 * r : 4 * r + 4]
            assert p.data_ptr() == ptrs[r][n], n
            want = ref.to(p.dtype).contiguous()  # bf16, or fp32 for the router gate and bias
            assert torch.equal(p.detach().contiguous().view(torch.uint8), want.view(torch.uint8)), n


def test_direct_atomic_cuda_rejects_nan_keeping_old_weights():
    trainer, m = _model(1), _model(0)
    rx = WeightReceiver(m, atomic=True, version=3)
    old = {n: p.detach().clone() for n, p in m.named_parameters()}

    def named():
        for n, x in iter_released_tensors(trainer):
            if n == NAME:
                x = x.clone()
                x.view(-1)[-1] = float("nan")
            yield n, x

    with pytest.raises(WeightUpdateError, match="non-finite values in"):
        WeightSender(named, ColocatedChannel([rx], "cuda", direct=True), 64).update(4)
    assert rx.version == 3 and rx.valid
    assert all(torch.equal(p, old[n]) for n, p in m.named_parameters())

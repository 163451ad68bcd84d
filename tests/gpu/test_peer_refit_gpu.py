"""Refit of a rollout model on another GPU than its sources (an EP worker on cuda:1 reading the
trainer's IPC stage on cuda:0, ``policy.generation.colocated_placement=worker_process`` with EP):
the receiver's cached plan keeps those pairs out of the fused kernel (``copy_plan.PeerCopy``) and
copies the sources' CURRENT bytes at every update. Needs 2 CUDA GPUs (skipped otherwise).

Checked in one process (no IPC: the peer-copy path is the receiver's): two EP=2 shards in bf16 on
cuda:0 and cuda:1 refit from an fp32 trainer on cuda:0 are bitwise the trainer's cast after a first
update and again after the trainer changed in place (the same source objects: a snapshot would
serve the old bytes); a NaN in rank 1's expert is refused with both ranks on their old weights.
"""

from __future__ import annotations

import pytest
import torch

if torch.cuda.device_count() < 2:
    pytest.skip("needs 2 CUDA GPUs", allow_module_level=True)

from m3_rollout.model import M3ForCausalLM, tiny_config  # noqa: E402
from m3_rollout.parallel import shard_experts  # noqa: E402
from m3_rollout.weight_sync import (  # noqa: E402
    ColocatedChannel,
    ReleasedTensors,
    WeightReceiver,
    WeightSender,
    WeightUpdateError,
)


def _model(seed: int) -> M3ForCausalLM:
    torch.manual_seed(seed)
    return M3ForCausalLM(tiny_config()).float().eval()


def _assert_cast(ms, trainer) -> None:
    want = {n: p.detach() for n, p in trainer.named_parameters()}
    for m in ms:
        for name, p in m.named_parameters():
            ref = want[name]
            if name.endswith(("experts.w13", "experts.w2")):
                a, b = m.get_submodule(name.rsplit(".", 1)[0]).expert_range
                ref = ref[a:b]
            assert torch.equal(p.detach().cpu(), ref.to(p.dtype).cpu()), name


def test_rank_on_another_gpu_reads_the_current_source_at_every_update():
    trainer = _model(1).to("cuda:0")
    ms = []
    for r in range(2):
        m = _model(0).cast_for_inference(torch.bfloat16)
        shard_experts(m, r, 2, None)
        ms.append(m.to(f"cuda:{r}"))
    rxs = [WeightReceiver(m, atomic=True, version=0) for m in ms]
    sender = WeightSender(
        lambda: ReleasedTensors(trainer), ColocatedChannel(rxs, "cuda:0", direct=True), 64, torch.bfloat16
    )
    sender.update(1, include_frozen=True)
    _assert_cast(ms, trainer)
    local, remote = rxs[0]._plan_cache, rxs[1]._plan_cache
    assert local.peer is None  # rank 0 shares the trainer's GPU: the fused plan only
    assert remote.peer is not None and remote.plan.n_pairs == 0  # rank 1: every pair a peer copy
    assert all(s.device == torch.device("cuda:0") for s in remote.peer.srcs)
    assert all(r.dst.device == torch.device("cuda:1") for r in remote.peer.runs)
    with torch.no_grad():  # trained in place: same source objects, new bytes
        trainer.lm_head.weight.mul_(-1.0)
        trainer.model.layers[2].block_sparse_moe.experts.w2.mul_(3.0)
    sender.update(2, include_frozen=True)
    assert rxs[1]._plan_cache is remote  # the cached plan, reused
    _assert_cast(ms, trainer)
    old = [{n: p.detach().clone() for n, p in m.named_parameters()} for m in ms]
    w2 = trainer.model.layers[2].block_sparse_moe.experts.w2
    with torch.no_grad():
        w2[6, 0, 0] = float("nan")  # rank 1's expert 6
        trainer.lm_head.weight.mul_(2.0)
    with pytest.raises(WeightUpdateError, match="receiver 1: non-finite values in .*experts[.]6[.]w2"):
        sender.update(3, include_frozen=True)
    for m, rx, o in zip(ms, rxs, old):
        assert rx.version == 2 and rx.valid
        assert all(torch.equal(p, o[n]) for n, p in m.named_parameters())

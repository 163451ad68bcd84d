"""The GRPO loop's path when rollout runs in workers: RolloutService.update_weights over the
weight-sync broadcast group (weight_sync.method=broadcast), EP=2 workers, gloo.

After an update the service's tokens equal an in-process engine loaded with the new weights
(EP=1, same keyed randomness), every generated token carries the new version, and a rejected
update (a NaN the service's own checks do not see, injected after packing) leaves both atomic
ranks on the old version, still generating the old tokens.
"""

from __future__ import annotations

import pytest
import torch

from m3_rollout.config import FreezeConfig, WeightSyncConfig
from m3_rollout.engine.interface import GenerationRequest, SamplingParams
from m3_rollout.engine.native_backend import NativeBackend
from m3_rollout.model import iter_released_tensors, load_checkpoint
from m3_rollout.parallel import EPGroupSpec
from m3_rollout.service import RolloutService, WorkerSpec

EOS = 3
MAX_LEN = 96


@pytest.fixture(scope="module")
def model_dir(tiny_ep_model_dir):
    return tiny_ep_model_dir


def _requests():
    gen = torch.Generator().manual_seed(3)
    return [
        GenerationRequest(
            f"g{g}",
            torch.randint(4, 256, (9 + 7 * g,), generator=gen).tolist(),
            SamplingParams(n=2, max_new_tokens=10, seed=10 + g, stop_token_ids=(EOS,)),
        )
        for g in range(3)
    ]


def _key(outs):
    return [(o.request_id, o.sample_index, o.output_ids) for o in outs]


def test_service_updates_through_broadcast_group(model_dir):
    engine = {"max_model_len": MAX_LEN, "max_num_seqs": 16, "eos_token_ids": (EOS,), "num_pages": 64}
    spec = WorkerSpec(
        model_dir=str(model_dir),
        group=EPGroupSpec(2, "127.0.0.1", 0, "gloo", timeout_s=20),
        dtype="float32",
        engine=engine,
    )
    ws = WeightSyncConfig(bucket_size_mb=0.05, timeout_s=20)
    svc = RolloutService(
        spec, launcher="mp", steps_per_call=8, start_timeout_s=120, weight_sync=ws, freeze=FreezeConfig()
    )
    reqs = _requests()
    try:
        new = load_checkpoint(model_dir, dtype=torch.float32)
        with torch.no_grad():
            new.lm_head.weight.mul_(-1.0)
            new.model.layers[2].block_sparse_moe.experts.w2.mul_(3.0)  # experts of both EP ranks
        svc.update_weights(4, iter_released_tensors(new))
        assert svc.last_weight_sync["buckets"] > 10 and svc.weight_version == 4
        ref = NativeBackend(new, (EOS,), max_model_len=MAX_LEN, max_num_seqs=16, num_pages=64).generate(reqs)
        outs = svc.generate(reqs)
        assert _key(outs) == _key(ref)
        assert all(o.token_weight_versions == [4] * len(o.output_ids) for o in outs)
        writes = svc.weight_writes  # the group's weight-write count: every rank stamps it
        assert all(o.token_weight_writes == [writes] * len(o.output_ids) for o in outs)

        # a NaN slipped in after the service's host-side checks: both atomic ranks reject it
        def nan_with_valid_checksum(k, buf):  # buf = data + int64 checksum trailer
            if k == 3:
                buf[:8].view(torch.float32).fill_(float("nan"))
                buf[-8:].view(torch.int64).copy_(buf[:-8].view(torch.int64).sum().reshape(1))

        sender = svc._ws_sender
        sender.fault = nan_with_valid_checksum
        worse = load_checkpoint(model_dir, dtype=torch.float32)
        with pytest.raises(
            ValueError, match="rank 1: non-finite values in language_model.model.layers.0.self_attn.q_proj.weight"
        ):
            svc.update_weights(5, iter_released_tensors(worse))
        sender.fault = None
        again = svc.generate(reqs)
        assert _key(again) == _key(ref)
        assert all(o.token_weight_versions == [4] * len(o.output_ids) for o in again)
        assert svc.weight_writes == writes  # nothing was written: the count stays
        assert all(o.token_weight_writes == [writes] * len(o.output_ids) for o in again)
    finally:
        svc.shutdown()


def test_a_one_worker_service_names_no_rank_in_a_refusal(model_dir):
    """One worker (no EP) is the group's only rollout rank: its refusals said "rank 1: ..."."""
    spec = WorkerSpec(
        model_dir=str(model_dir),
        group=EPGroupSpec(1, "127.0.0.1", 0, "gloo", timeout_s=20),
        dtype="float32",
        engine={"max_model_len": MAX_LEN, "max_num_seqs": 4, "eos_token_ids": (EOS,), "num_pages": 16},
    )
    ws = WeightSyncConfig(bucket_size_mb=0.05, timeout_s=20)
    svc = RolloutService(
        spec, launcher="mp", steps_per_call=8, start_timeout_s=120, weight_sync=ws, freeze=FreezeConfig()
    )
    try:
        named = list(iter_released_tensors(load_checkpoint(model_dir, dtype=torch.float32)))
        svc.update_weights(2, named)
        with pytest.raises(ValueError) as exc:
            svc.update_weights(2, named)
        assert str(exc.value) == (
            "weight update 2 rejected:\n  update version 2 refused: this engine holds version 2; versions only "
            "increase (an update that re-sends the version held must say replace=True)"
        )
        assert svc.weight_version == 2
    finally:
        svc.shutdown()

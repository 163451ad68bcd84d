"""RolloutService over torch.multiprocessing workers: EP=2 generation equals EP=1, failure handling.

A seeded tiny M3 is saved once; the EP=1 reference is the in-process engine (NativeBackend) in
fp32, the EP=2 service loads the same checkpoint as two expert shards in two processes (gloo).
With randomness keyed by (seed, sample index, position), tokens must be identical.
"""

from __future__ import annotations

import pytest
import torch

from m3_rollout.engine.interface import GenerationRequest, SamplingParams
from m3_rollout.engine.native_backend import NativeBackend
from m3_rollout.model import iter_released_tensors, load_checkpoint
from m3_rollout.parallel import EPGroupSpec
from m3_rollout.service import RolloutFailure, RolloutService, WorkerSpec
from m3_rollout.service.launchers import GroupFailure

EOS = 3
MAX_LEN = 96


@pytest.fixture(scope="module")
def model_dir(tiny_ep_model_dir):
    return tiny_ep_model_dir


def _requests(tag: str = "") -> list[GenerationRequest]:
    gen = torch.Generator().manual_seed(7)
    reqs = []
    for g in range(5):  # GRPO groups of 3 samples, prompts of 5..40 tokens (some span pages)
        prompt = torch.randint(4, 256, (5 + 9 * g,), generator=gen).tolist()
        params = SamplingParams(n=3, temperature=1.0, max_new_tokens=12 + g, seed=100 + g, stop_token_ids=(EOS,))
        reqs.append(GenerationRequest(f"{tag}g{g}", prompt, params))
    reqs.append(GenerationRequest(f"{tag}bad", [1, 999], SamplingParams(n=2)))  # token outside the vocabulary
    return reqs


def _engine_kwargs() -> dict:
    return {
        "max_model_len": MAX_LEN,
        "max_num_seqs": 16,
        "eos_token_ids": (EOS,),
        "num_pages": 64,
        "record_routing": True,
    }


def _service(model_dir, world: int, **kwargs) -> RolloutService:
    spec = WorkerSpec(
        model_dir=str(model_dir),
        group=EPGroupSpec(world, "127.0.0.1", 0, "gloo", timeout_s=20),
        dtype="float32",
        engine=_engine_kwargs(),
        **kwargs.pop("spec", {}),
    )
    return RolloutService(
        spec, launcher="mp", steps_per_call=kwargs.pop("steps_per_call", 8), start_timeout_s=120, **kwargs
    )


def _reference(model_dir, reqs):
    backend = NativeBackend(
        load_checkpoint(model_dir, dtype=torch.float32),
        (EOS,),
        max_model_len=MAX_LEN,
        max_num_seqs=16,
        num_pages=64,
        record_routing=True,
    )
    return backend.generate(reqs)


def _key(outs):
    return [(o.request_id, o.sample_index, o.output_ids, o.finish_reason) for o in outs]


def test_ep2_tokens_equal_ep1_and_weights_update(model_dir):
    reqs = _requests()
    ref = _reference(model_dir, reqs)
    svc = _service(model_dir, 2)
    try:
        assert [i["expert_range"] for i in svc.rank_info] == [(0, 4), (4, 8)]
        assert all(i["bytes_read"] < i["bytes_in_files"] for i in svc.rank_info)
        outs = svc.generate(reqs)
        assert _key(outs) == _key(ref)
        for a, b in zip(outs, ref):
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
            if a.finish_reason != "error":  # routing records agree too (global expert ids on every rank)
                assert a.routed_experts.shape == (len(a.prompt_ids) + len(a.output_ids), 3, 2)
                assert (a.routed_experts == b.routed_experts).all()
        assert [o.finish_reason for o in outs if o.request_id == "bad"] == ["error", "error"]
        m = svc.metrics()
        assert m["restarts"] == 0 and len(m["tokens_per_expert"][0]) == 8
        # a run with work placed on one rank only: the idle rank steps empty forwards, nothing hangs
        one = svc.generate(reqs[:1])
        assert _key(one) == _key(ref[:3])
        # weights: a changed lm_head reaches both ranks (and the reference agrees)
        model = load_checkpoint(model_dir, dtype=torch.float32)
        with torch.no_grad():
            model.lm_head.weight.mul_(-1.0)
        svc.update_weights(5, iter_released_tensors(model))
        ref2 = NativeBackend(model, (EOS,), max_model_len=MAX_LEN, max_num_seqs=16, num_pages=64).generate(reqs[:2])
        outs2 = svc.generate(reqs[:2])
        assert _key(outs2) == _key(ref2)
        assert svc.weight_version == 5 and all(o.weight_version == 5 for o in outs2)
        with pytest.raises(ValueError, match="missing"):
            svc.update_weights(6, [(n, t) for n, t in iter_released_tensors(model) if "lm_head" not in n])
    finally:
        svc.shutdown()


def test_worker_killed_mid_generation_is_restarted_and_requests_complete(model_dir):
    reqs = _requests("k")
    ref = _reference(model_dir, reqs)
    # rank 1 SIGKILLs itself after 3 lockstep steps (first incarnation only)
    svc = _service(model_dir, 2, spec={"fault_after_steps": 3, "fault_rank": 1}, steps_per_call=2)
    try:
        first_pids = svc.worker_pids()
        outs = svc.generate(reqs)
        assert _key(outs) == _key(ref)  # resubmitted samples repeat their tokens exactly
        assert svc.restarts == 1 and len(svc.failures) == 1
        f = svc.failures[0]
        assert 1 in f["ranks"] and f["lost_request_ids"]  # which requests were lost is reported
        assert set(f["lost_request_ids"]) <= {r.request_id for r in reqs}
        assert set(svc.worker_pids()).isdisjoint(first_pids)  # every rank was restarted
    finally:
        svc.shutdown()


def test_gives_up_after_max_restarts_with_lost_requests(model_dir):
    # max_restarts=0: the first failure is final; the caller gets the lost ids to resubmit
    svc = _service(model_dir, 2, spec={"fault_after_steps": 1, "fault_rank": 0}, max_restarts=0)
    try:
        reqs = _requests("x")[:2]
        with pytest.raises(RolloutFailure) as info:
            svc.generate(reqs)
        assert info.value.lost_request_ids == ["xg0", "xg1"]
        assert svc.restarts == 1  # the service already restarted the group
        # the caller resubmits: the restarted group (incarnation 1 does not fault) completes them
        assert _key(svc.generate(reqs)) == _key(_reference(model_dir, reqs))
    finally:
        svc.shutdown()


def test_mis_shaped_expert_update_is_rejected_before_any_rank_changes(model_dir):
    # Adversarial review: experts.5.* live on rank 1 only. A wrong shape there used to reach the
    # ranks: rank 0 took the update, rank 1 refused it (a GroupFailure, not a ValueError), the
    # group kept serving with mixed weights, and rank 0's stale pipe reply broke the next call.
    reqs = _requests("s")[:2]
    ref = _reference(model_dir, reqs)
    svc = _service(model_dir, 2)
    try:
        model = load_checkpoint(model_dir, dtype=torch.float32)
        with torch.no_grad():
            model.lm_head.weight.mul_(-1.0)  # a change rank 0 would apply if the update went through
        bad_name = next(n for n, _ in iter_released_tensors(model) if ".experts.5.w1" in n)
        tensors = [(n, t[:-1] if n == bad_name else t) for n, t in iter_released_tensors(model)]
        with pytest.raises(ValueError, match=f"shape of {bad_name.replace('.', '[.]')}"):
            svc.update_weights(3, tensors)
        assert svc.weight_version == 0
        outs = svc.generate(reqs)  # both ranks still serve the old weights
        assert _key(outs) == _key(ref) and all(o.weight_version == 0 for o in outs if o.finish_reason != "error")
        # Past the service's check (here: the service's copy of the shapes is made to agree with
        # the bad tensor; in general, a rank refusing for any reason): the group restarts on the
        # last good weights instead of serving rank 0's new lm_head beside rank 1's old one.
        for shapes in svc._rank_shapes:
            if bad_name in shapes:
                shapes[bad_name] = tuple(dict(tensors)[bad_name].shape)
        with pytest.raises(GroupFailure, match="update_weights"):
            svc.update_weights(3, tensors)
        assert svc.weight_version == 0
        assert svc.restarts == 1 and _key(svc.generate(reqs)) == _key(ref)
        # A launcher call that failed on one rank leaves the other rank's reply in its pipe: the
        # launcher refuses further calls (generate restarts the group) instead of reading it.
        good = dict(iter_released_tensors(load_checkpoint(model_dir, dtype=torch.float32)))
        per_rank = [(7, {n: good[n] for n in names}) for names in svc._rank_names]
        per_rank[1] = (7, {bad_name: good[bad_name]})  # rank 1: "missing ..." ValueError
        with pytest.raises(GroupFailure):
            svc.launcher.call("update_weights", per_rank, 60.0)
        assert _key(svc.generate(reqs)) == _key(ref) and svc.restarts == 2
    finally:
        svc.shutdown()

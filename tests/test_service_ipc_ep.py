"""EP=2 rollout workers refit through the trainer's shared stage (``RolloutService(refit="ipc")``,
``policy.generation.colocated_placement=worker_process`` with ``expert_parallel_size=2``) on CPU:
two worker processes, their EP group over gloo, every update read from the trainer's
shared-memory stage (on a GPU node: rank r on cuda:r, the stage on the trainer's GPU).

Checked with real values: after an update both ranks serve the trainer's weights (the same tokens
and logprobs as an in-process engine given them, bitwise weight digests per rank, each rank
holding only its own experts); an in-place change of the trainer reaches both ranks through the
cached plans; a non-finite expert of rank 1 is refused and BOTH ranks stay on the old version
(atomic); a killed worker restarts the group on the stage's weights; a worker lost after a
rejected update cannot be given the served weights and generate says so (score and top logprobs
too); sleep / wake-up reach both ranks. ``RolloutService.score`` / ``top_logprobs`` (one forward
on every rank) equal the in-process engine's, between two steps of the step API too, and follow
the updates. The factory's placement (CPU, and CUDA with faked device properties) and the config
rules are checked without starting workers.
"""

from __future__ import annotations

import copy
import hashlib
import os
import re
import signal
from types import SimpleNamespace

import pytest
import torch

from m3_rollout.config import ConfigError, FreezeConfig, WeightSyncConfig, load_config
from m3_rollout.engine.interface import GenerationRequest, SampleOutput, SamplingParams
from m3_rollout.engine.native_backend import NativeBackend
from m3_rollout.model import load_checkpoint
from m3_rollout.parallel import EPGroupSpec
from m3_rollout.service import RolloutFailure, RolloutService, WorkerSpec, factory
from m3_rollout.service.service import LOST
from m3_rollout.weight_sync import ReleasedTensors

EOS = 3
MAX_LEN = 96
EXPERT6 = "language_model.model.layers.2.block_sparse_moe.experts.6.w2.weight"


@pytest.fixture(scope="module")
def model_dir(tiny_ep_model_dir):
    return tiny_ep_model_dir


def _requests():
    gen = torch.Generator().manual_seed(5)
    return [
        GenerationRequest(
            f"g{g}",
            torch.randint(4, 256, (7 + 9 * g,), generator=gen).tolist(),
            SamplingParams(n=2, max_new_tokens=10, seed=20 + g, stop_token_ids=(EOS,)),
        )
        for g in range(3)
    ]


def _key(outs):
    return [(o.request_id, o.sample_index, o.output_ids) for o in outs]


def _native(model) -> NativeBackend:
    """The in-process engine (EP=1) on a copy of ``model``'s weights as they are now."""
    return NativeBackend(copy.deepcopy(model), (EOS,), max_model_len=MAX_LEN, max_num_seqs=16, num_pages=64)


def _reference(model, reqs):
    return _native(model).generate(reqs)


def _digests(model) -> dict[str, tuple[str, str]]:
    """The trainer's released tensors as ``RolloutWorker.weight_digests`` (fp32 workers: no cast)."""
    out = {}
    for name, t in ReleasedTensors(model):
        data = t.detach().to("cpu", copy=True).reshape(-1).view(torch.uint8).numpy().tobytes()
        out[name] = (str(t.dtype), hashlib.sha256(data).hexdigest())
    return out


def _assert_serves(svc, model, reqs, version: int) -> None:
    """Both ranks hold the trainer's bytes (each its own experts only) and generate as EP=1 would."""
    ref = _reference(model, reqs)
    outs = svc.generate(reqs)  # first: a lost worker is restarted here
    assert _key(outs) == _key(ref)
    for a, b in zip(outs, ref):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
        assert a.token_weight_versions == [version] * len(a.output_ids)
        assert a.token_weight_writes == [svc.weight_writes] * len(a.output_ids)  # both ranks stamp the group's
    want = _digests(model)
    ranks = svc.weight_digests()
    experts = [{n for n in d if ".experts." in n} for d in ranks]
    assert experts[0] and experts[1] and not experts[0] & experts[1]  # each rank: its own experts
    assert set(ranks[0]) | set(ranks[1]) == set(want)
    for d in ranks:
        assert d == {n: want[n] for n in d}


def _service(model_dir, atomic: bool = True) -> RolloutService:
    engine = {"max_model_len": MAX_LEN, "max_num_seqs": 16, "eos_token_ids": (EOS,), "num_pages": 64}
    spec = WorkerSpec(
        model_dir=str(model_dir),
        group=EPGroupSpec(2, "127.0.0.1", 0, None, timeout_s=30),  # gloo: CPU
        dtype="float32",
        engine=engine,
        device="cpu",
    )
    ws = WeightSyncConfig(timeout_s=30, atomic=atomic)
    return RolloutService(
        spec,
        launcher="mp",
        steps_per_call=8,
        start_timeout_s=120,
        weight_sync=ws,
        freeze=FreezeConfig(),
        refit="ipc",
        trainer_device="cpu",
    )


def test_ep2_workers_refit_through_the_shared_stage(model_dir):
    reqs = _requests()
    trainer = load_checkpoint(model_dir, dtype=torch.float32)
    named = ReleasedTensors(trainer)  # the GRPO loop's source: the same objects every update
    w2 = trainer.model.layers[2].block_sparse_moe.experts.w2
    svc = _service(model_dir)
    try:
        assert [i["expert_range"] for i in svc.rank_info] == [(0, 4), (4, 8)]
        with torch.no_grad():  # experts of both ranks and a replicated tensor change
            trainer.lm_head.weight.mul_(-1.0)
            w2.mul_(3.0)
        svc.update_weights(4, named)
        assert svc.weight_version == 4 and svc.last_weight_sync["ipc_source"] == "stage"
        assert [r["version"] for r in svc.last_weight_sync["ranks"]] == [4, 4]
        _assert_serves(svc, trainer, reqs, 4)

        with torch.no_grad():  # trained in place: the cached plans read the refilled stage
            trainer.lm_head.weight.mul_(0.5)
            w2[5].add_(0.25)  # rank 1's expert 5
        svc.update_weights(5, named)
        _assert_serves(svc, trainer, reqs, 5)
        before = svc.generate(reqs)

        # (a) an update the trainer refuses itself (a tensor outside the handshake) is withdrawn:
        # the ranks end it at once with version 5 kept; the group is not restarted (the workers
        # used to wait out weight_sync.timeout_s, fail, and be restarted)
        restarts = svc.restarts
        bogus = [*named, ("language_model.model.bogus.weight", torch.zeros(2))]
        with pytest.raises(ValueError, match="not in the handshake list"):
            svc.update_weights(6, bogus)
        assert svc.restarts == restarts and svc.weight_version == 5
        assert [(r["ok"], r["version"], r["valid"]) for r in svc.last_weight_sync["ranks"]] == [(False, 5, True)] * 2
        # ... and it did not touch the stage: a worker lost now restarts the group on version 5
        # (the refit used to forget the stage's version, and generate refused until the next update)
        os.kill(svc.worker_pids()[0], signal.SIGKILL)
        _assert_serves(svc, trainer, reqs, 5)
        assert svc.restarts == restarts + 1

        # (b) a NaN in an expert only rank 1 holds: rank 1 refuses, rank 0 must not commit either
        with torch.no_grad():
            w2[6, 0, 0] = float("nan")
            trainer.lm_head.weight.mul_(2.0)  # a change rank 0 would have written
        with pytest.raises(ValueError, match=f"rank 1: non-finite values in {re.escape(EXPERT6)}"):
            svc.update_weights(6, named)
        ranks = svc.last_weight_sync["ranks"]
        assert [(r["ok"], r["version"], r["valid"]) for r in ranks] == [(False, 5, True), (False, 5, True)]
        assert svc.weight_version == 5
        again = svc.generate(reqs)
        assert _key(again) == _key(before)
        assert all(o.token_weight_versions == [5] * len(o.output_ids) for o in again)

        # a worker lost now cannot be given version 5: the stage holds the refused fill
        os.kill(svc.worker_pids()[0], signal.SIGKILL)
        with pytest.raises(RolloutFailure, match="call update_weights first"):
            svc.generate(reqs)
        with torch.no_grad():
            w2[6, 0, 0] = 1.0
        svc.update_weights(7, named)  # the restarted ranks take the next accepted update
        _assert_serves(svc, trainer, reqs, 7)

        # (c) a worker killed between steps: the group restarts on the stage's weights (version 7),
        # although the trainer has trained since (the stage is not refilled)
        served = copy.deepcopy(trainer)
        with torch.no_grad():
            trainer.lm_head.weight.add_(1.0)
        restarts = svc.restarts
        os.kill(svc.worker_pids()[1], signal.SIGKILL)
        _assert_serves(svc, served, reqs, 7)
        assert svc.restarts == restarts + 1

        # sleep / wake-up reach both ranks; an update waits for the wake-up at level 2
        record = svc.sleep(2)
        assert record["level"] == 2 and record["gb_freed"] > 0
        with pytest.raises(RuntimeError, match="wake_up"):
            svc.update_weights(8, named)
        assert svc.wake_up()["gb_restored"] > 0
        svc.update_weights(8, named)
        _assert_serves(svc, trainer, reqs, 8)
    finally:
        svc.shutdown()


def test_non_atomic_rejection_that_left_a_rank_invalid_stops_generate_until_the_next_update(model_dir):
    # atomic=false: rank 0 writes its tensors while rank 1 refuses a NaN in its expert. The stage
    # holds the refused fill, so the last good weights cannot be re-sent (the broadcast service's
    # repair): generate must refuse, not serve rank 0's half-written weights as the old version
    # (and hand back rank 0's requests empty).
    reqs = _requests()
    trainer = load_checkpoint(model_dir, dtype=torch.float32)
    named = ReleasedTensors(trainer)
    w2 = trainer.model.layers[2].block_sparse_moe.experts.w2
    svc = _service(model_dir, atomic=False)
    try:
        svc.update_weights(1, named)
        with torch.no_grad():
            w2[6, 0, 0] = float("nan")
            trainer.lm_head.weight.mul_(2.0)
        with pytest.raises(ValueError, match="rank 1: non-finite values"):
            svc.update_weights(2, named)
        assert [r["valid"] for r in svc.last_weight_sync["ranks"]] == [False, True]
        with pytest.raises(RolloutFailure, match=r"rank\(s\) 0 invalid: .*update 2 .*call update_weights first") as exc:
            svc.generate(reqs)
        assert exc.value.lost_request_ids == sorted(r.request_id for r in reqs)
        ids = reqs[2].prompt_ids
        with pytest.raises(RolloutFailure, match=r"rank\(s\) 0 invalid: .*update 2 "):  # scoring refuses alike
            svc.score(ids)
        with pytest.raises(RolloutFailure, match=r"rank\(s\) 0 invalid: .*update 2 "):
            svc.top_logprobs(ids, 1, 3)
        # the step API (the EP server's) refuses alike: error records, no token from rank 0's
        # half-written experts (rank 1's requests would read them through the all-to-all)
        for r in reqs:
            svc.add_request(r, stream=True)
        outs = svc.step()
        assert not svc.has_unfinished()
        want = sorted((r.request_id, r.sample_index + j) for r in reqs for j in range(r.params.n))
        assert sorted((o.request_id, o.sample_index) for o in outs) == want
        assert all(o.finish_reason == "error" and not o.output_ids for o in outs)
        assert all(re.search(r"rank\(s\) 0 invalid: .*update 2 .*call update_weights first", o.error) for o in outs)
        with torch.no_grad():
            w2[6, 0, 0] = 1.0
        svc.update_weights(3, named)
        _assert_serves(svc, trainer, reqs, 3)
    finally:
        svc.shutdown()


def _assert_scores(svc, engine, ids: list[int]) -> torch.Tensor:
    """RolloutService.score / top_logprobs equal the in-process engine's (EP=1) on ``ids``; returns
    the EP=2 logprobs."""
    got, want = svc.score(ids), engine.score(ids)
    assert got.dtype == torch.float32 and got.shape == (len(ids),) and got[0] == 0
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    part = svc.score(ids, positions=[5, 1, 20], temperature=0.7)
    torch.testing.assert_close(part, engine.score(ids, [5, 1, 20], 0.7), atol=1e-4, rtol=0)
    start = len(ids) - 8
    tops = svc.top_logprobs(ids, start, 5, 0.7)
    want_tops = engine.top_logprobs(ids, start, 5, 0.7)
    assert len(tops) == 8
    for row, want_row in zip(tops, want_tops):
        assert [t for t, _ in row] == [t for t, _ in want_row]
        assert [v for _, v in row] == pytest.approx([v for _, v in want_row], abs=1e-4)
    for i, row in enumerate(svc.top_logprobs(ids, start, 256), start):  # k = V: every token's logprob
        assert dict(row)[ids[i]] == pytest.approx(float(got[i]), abs=1e-4)  # the scored token's, at T = 1
    return got


def test_ep2_score_and_top_logprobs_equal_ep1_between_steps_and_after_updates(model_dir):
    # Every rank runs the same forward with the same ids (the MoE all-to-alls pair up) and rank 0's
    # result comes back: the values are the in-process engine's. Bad arguments are refused with
    # the engine's own messages, and the group goes on serving. Between two steps of the step API
    # (the server's): requests keep their pages and finish with the reference tokens; a rank short
    # of KV pages refuses the call for every rank (a rank that scored alone would wait for its peer
    # in the all-to-all until the group timeout). After an update the values are the new weights'.
    trainer = load_checkpoint(model_dir, dtype=torch.float32)
    named = ReleasedTensors(trainer)
    gen = torch.Generator().manual_seed(9)
    ids = torch.randint(4, 256, (64,), generator=gen).tolist()
    svc = _service(model_dir)
    try:
        engine = _native(trainer).engine
        before = _assert_scores(svc, engine, ids)
        # the processed distribution (temperature, top-k, top-p): at most top_k tokens, renormalised
        filtered = svc.top_logprobs(ids, 50, 5, 0.7, 3, 0.9)
        for row, want in zip(filtered, engine.top_logprobs(ids, 50, 5, 0.7, 3, 0.9), strict=True):
            assert [t for t, _ in row] == [t for t, _ in want]
            assert [v for _, v in row] == pytest.approx([v for _, v in want], abs=1e-4)
            assert 1 <= len(row) <= 3 and torch.logsumexp(torch.tensor([v for _, v in row]), 0) == pytest.approx(
                0, abs=1e-5
            )
        bad = [
            (lambda b: b.score([]), "score token_ids: empty prompt"),
            (lambda b: b.score(ids, positions=[64]), r"score positions must be in \[0, 64\)"),
            (lambda b: b.score(ids, temperature=0.0), "score temperature=0.0: must be > 0"),
            (lambda b: b.top_logprobs([], 1, 3), "top_logprobs token_ids: empty prompt"),
            (lambda b: b.top_logprobs([7], 1, 3), "top_logprobs token_ids: a single token"),
            (lambda b: b.top_logprobs(ids, 0, 3), r"top_logprobs start=0: must be an integer in \[1, 63\]"),
            (lambda b: b.top_logprobs(ids, 64, 3), r"top_logprobs start=64: must be an integer in \[1, 63\]"),
            (lambda b: b.top_logprobs(ids, 1, 0), "top_logprobs k=0: must be an integer >= 1"),
            (lambda b: b.top_logprobs(ids, 1, 3, -1.0), "top_logprobs temperature=-1.0: must be > 0"),
            (lambda b: b.top_logprobs(ids, 1, 3, 1.0, 0), "top_logprobs top_k=0: must be -1"),
            (lambda b: b.top_logprobs(ids, 1, 3, 1.0, -1, 1.5), r"top_logprobs top_p=1.5: must be in \(0, 1\]"),
        ]
        for call, message in bad:
            with pytest.raises(ValueError, match=message) as ep:
                call(svc)
            with pytest.raises(ValueError) as one:
                call(engine)
            assert str(ep.value) == str(one.value)  # the same words as EP=1
        assert svc.restarts == 0

        # the step API: every request on rank 0 (their prompts extend the anchor's, whose rank
        # holds that prefix), 61 of its 64 pages taken after one step; rank 1 idle
        fill = torch.randint(4, 256, (10, 93), generator=gen).tolist()
        reqs = [GenerationRequest("anchor", [5], SamplingParams(max_new_tokens=2, seed=1))]
        reqs += [
            GenerationRequest(f"f{i}", [5, *p], SamplingParams(max_new_tokens=2, seed=i)) for i, p in enumerate(fill)
        ]
        for r in reqs:
            svc.add_request(r)
        outs = [o for o in svc.step() if isinstance(o, SampleOutput)]
        assert not outs and svc.engine_metrics()["kv_pages_in_use"] == 1 + 10 * 6
        with pytest.raises(RuntimeError, match=r"^rank 0: score: 4 KV pages needed, 3 free; call it when fewer"):
            svc.score(ids)  # 64 tokens: rank 1 alone could run them
        torch.testing.assert_close(svc.score(ids[:48]), engine.score(ids[:48]), atol=1e-4, rtol=0)  # 3 pages
        got, want = svc.top_logprobs(ids, 60, 2), engine.top_logprobs(ids, 60, 2)
        assert [[t for t, _ in row] for row in got] == [[t for t, _ in row] for row in want]
        assert [v for row in got for _, v in row] == pytest.approx([v for row in want for _, v in row], abs=1e-4)
        while svc.has_unfinished():
            outs += [o for o in svc.step() if isinstance(o, SampleOutput)]
        ref = _reference(trainer, reqs)
        assert sorted(_key(outs)) == sorted(_key(ref))
        assert svc.engine_metrics()["kv_pages_in_use"] == 0 and svc.restarts == 0

        with torch.no_grad():  # a replicated tensor and experts of both ranks change
            trainer.lm_head.weight.mul_(-1.0)
            trainer.model.layers[2].block_sparse_moe.experts.w2.mul_(3.0)
        svc.update_weights(1, named)
        after = _assert_scores(svc, _native(trainer).engine, ids)
        assert float((after - before).abs().max()) > 0.5

        svc.sleep(1)
        with pytest.raises(RuntimeError, match=r"sleep \(level 1\): call wake_up\(\) before you score"):
            svc.score(ids)
        svc.wake_up()
        torch.testing.assert_close(svc.score(ids), after, atol=0, rtol=0)
    finally:
        svc.shutdown()


def test_ep2_score_after_a_worker_died_restarts_the_group_or_refuses(model_dir):
    # A worker that died between two calls: score / top_logprobs restart the group on the served
    # weights and run (as generate does; they raised the launcher's GroupFailure, which did not say
    # that the group was back); the step API's live requests are resubmitted, as after a failed
    # step (a streamed one gets error records). With no restart left the call fails, and the next
    # one, whose start cannot give the new workers the served weights (a rejected update overwrote
    # the stage), must refuse: it scored (and generate generated) with the checkpoint's weights as
    # the served version.
    trainer = load_checkpoint(model_dir, dtype=torch.float32)
    named = ReleasedTensors(trainer)
    ids = torch.randint(4, 256, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    svc = _service(model_dir)
    try:
        with torch.no_grad():
            trainer.lm_head.weight.mul_(-1.0)
        svc.update_weights(1, named)
        engine = _native(trainer).engine
        writes = svc.weight_writes
        os.kill(svc.worker_pids()[1], signal.SIGKILL)
        torch.testing.assert_close(svc.score(ids), engine.score(ids), atol=1e-4, rtol=0)
        assert svc.restarts == 1
        # fresh workers (their engines count from 0): the group's count moved on, so no stamp of the
        # earlier group can be taken for one of the weights served now
        assert svc.weight_writes > writes
        outs = svc.generate(_requests())
        assert all(o.token_weight_writes == [svc.weight_writes] * len(o.output_ids) for o in outs)

        reqs = _requests()
        for r in reqs:
            svc.add_request(r, stream=r.request_id == "g0")
        svc.step()
        os.kill(svc.worker_pids()[0], signal.SIGKILL)
        got, want = svc.top_logprobs(ids, 30, 3), engine.top_logprobs(ids, 30, 3)
        assert [[t for t, _ in row] for row in got] == [[t for t, _ in row] for row in want]
        assert svc.restarts == 2
        outs = []
        for _ in range(20):
            outs += [o for o in svc.step() if isinstance(o, SampleOutput)]
            if not svc.has_unfinished():
                break
        assert not svc.has_unfinished()
        # the streamed request ends with error records; the others were resubmitted on the restarted
        # group and give the served weights' tokens
        assert [(o.finish_reason, LOST in o.error) for o in outs if o.request_id == "g0"] == [("error", True)] * 2
        assert sorted(_key(o for o in outs if o.request_id != "g0")) == sorted(_key(_reference(trainer, reqs[1:])))

        with torch.no_grad():
            trainer.model.layers[2].block_sparse_moe.experts.w2[6, 0, 0] = float("nan")
        with pytest.raises(ValueError, match="rank 1: non-finite values"):
            svc.update_weights(2, named)
        svc.max_restarts = 0
        os.kill(svc.worker_pids()[0], signal.SIGKILL)
        with pytest.raises(RolloutFailure, match=r"gave up after 0 restarts"):
            svc.score(ids)
        with pytest.raises(RolloutFailure, match="not the served version 1: .*call update_weights first"):
            svc.score(ids)
        with pytest.raises(RolloutFailure, match="call update_weights first"):
            svc.generate(reqs)
    finally:
        svc.shutdown()


def test_factory_places_ep_workers_beside_the_trainer(model_dir, monkeypatch):
    made = {}
    monkeypatch.setattr(factory, "RolloutService", lambda spec, **kw: made.update(spec=spec, **kw) or "service")
    base = ["policy.generation.colocated_placement=worker_process", "policy.generation.expert_parallel_size=2"]
    cfg = load_config(None, [*base, "cluster.launcher=mp"])
    assert factory.build_rollout_service(cfg, model_dir, (EOS,), MAX_LEN) == "service"
    spec = made["spec"]
    assert (spec.device, spec.device_uuid, spec.group.world_size) == ("cpu", None, 2)
    assert made["refit"] == "ipc" and made["trainer_device"] == "cpu" and made["worker_gpus"] == 0.0
    assert spec.num_threads == max(1, torch.get_num_threads() // 2)  # the trainer's threads, split
    # on a GPU node (device properties faked): rank r on cuda:r, each rank's GPU named by UUID
    props = lambda dev: SimpleNamespace(uuid=f"GPU-{torch.device(dev).index}")  # noqa: E731
    monkeypatch.setattr(torch.cuda, "get_device_properties", props)
    assert factory.worker_placement("cuda:1", 2) == ("cuda", ("GPU-0", "GPU-1"))
    assert factory.worker_placement("cuda:1", 1) == ("cuda:1", "GPU-1")
    assert factory.worker_placement("cpu", 2) == ("cpu", None)


def test_config_accepts_ep_worker_process_on_cpu_and_refuses_bad_cuda_placements():
    base = ["policy.generation.colocated_placement=worker_process", "policy.generation.expert_parallel_size=2"]
    cfg = load_config(None, [*base, "cluster.launcher=mp", "policy.generation.sleep_level=1"])
    assert cfg.policy.generation.expert_parallel_size == 2 and cfg.policy.generation.sleep_level == 1
    ok = load_config(None, [*base, "cluster.device=cuda:1", "cluster.gpus_per_node=2"])  # trainer beside rank 1
    assert ok.cluster.device == "cuda:1"
    cases = [
        (["cluster.device=cuda:2", "cluster.gpus_per_node=4"], "cluster.device='cuda:2'", "cuda:0 .. cuda:1"),
        (["cluster.device=cuda", "cluster.gpus_per_node=1"], "cluster.gpus_per_node=1", "EP rank r runs on cuda:r"),
        (
            ["cluster.device=cuda:0", "cluster.gpus_per_node=2", "cluster.num_nodes=2"],
            "cluster.num_nodes=2",
            "one node",
        ),
        (["cluster.gpus_per_node=2"], "cluster.gpus_per_node=2", "must be 0"),  # GPU workers beside a CPU trainer
    ]
    for extra, key, why in cases:
        with pytest.raises(ConfigError, match=re.escape(key) + ".*" + re.escape(why)):
            load_config(None, [*base, *extra])
    # sleep stays refused for EP workers of the broadcast service (GPUs of their own)
    with pytest.raises(ConfigError, match="policy.generation.sleep_level=1"):
        load_config(None, ["policy.generation.expert_parallel_size=2", "policy.generation.sleep_level=1"])

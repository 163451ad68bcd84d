"""Weight sync over a real gloo broadcast group: trainer + rollout ranks in separate processes.

Scenario "ep1": trainer + two EP=1 rollout ranks (rank 1 atomic, rank 2 not). Update 1 is good
(bitwise weights, logits within 1e-5); update 2 carries a NaN (both ranks check finite values), update 3 a
corrupted bucket, and
during update 4 the trainer process dies midway. The atomic rank stays on version 1 serving the
version-1 logits throughout; the non-atomic rank rejects 2 and 3 before touching anything past
the bad bucket and is marked invalid after the interrupted 4. A restarted trainer then serves
on the same port: both ranks rebuild the group, redo the handshake, take update 5 and are valid.

Scenario "ep2": trainer + two rollout ranks that form an EP=2 group (each holds 4 of the 8
experts of every MoE layer). Update 1 atomic, update 2 (new weights) non-atomic: owned expert rows
and every replicated tensor are bitwise the trainer's, and the EP forward's logits agree with the
trainer's within 1e-5.

Every process rebuilds the trainer's weights from the same seeds to check bitwise equality
independently of the wire.
"""

from __future__ import annotations

import os
import traceback

import torch
import torch.multiprocessing as mp
from mp_results import get_results, put_result

from m3_rollout.model import M3ForCausalLM, iter_released_tensors, tiny_config
from m3_rollout.parallel import EPGroupSpec, destroy_ep_group, free_port, init_ep_group, shard_experts
from m3_rollout.weight_sync import BroadcastChannel, WeightReceiver, WeightSender, WeightSyncGroup, WeightUpdateError

TIMEOUT_S = 120
GROUP_TIMEOUT_S = 20
BUCKET_MB = 0.05
NAN_NAME = "language_model.model.layers.2.block_sparse_moe.experts.6.w1.weight"


def _model(seed: int) -> M3ForCausalLM:
    torch.manual_seed(seed)
    m = M3ForCausalLM(tiny_config()).float().eval()
    with torch.no_grad():
        for moe in m.moe_layers():
            moe.gate.weight.mul_(8.0)
            moe.e_score_correction_bias.normal_(0, 0.1)
    return m


def _ids() -> torch.Tensor:
    return torch.randint(0, 1024, (2, 29), generator=torch.Generator().manual_seed(11))


def _logits(m) -> torch.Tensor:
    with torch.no_grad():
        return m(_ids()).float()


def _bitwise_equal(rx: M3ForCausalLM, ref: M3ForCausalLM) -> bool:
    for name, p in rx.named_parameters():
        want = ref.get_parameter(name)
        if name.endswith(("experts.w13", "experts.w2")):
            a, b = getattr(rx.get_submodule(name.rsplit(".", 1)[0]), "expert_range", (0, want.shape[0]))
            want = want[a:b]
        if not torch.equal(p, want):
            return False
    return True


# ---------------------------------------------------------------------------------- ep1 scenario
def _trainer_ep1(port: int, results) -> None:
    try:
        torch.set_num_threads(1)
        model = _model(1)
        group = WeightSyncGroup("127.0.0.1", port, 0, 3, "gloo", GROUP_TIMEOUT_S)
        sender = WeightSender(lambda: iter_released_tensors(model), BroadcastChannel(group), BUCKET_MB)
        sender.handshake()
        sender.update(1, include_frozen=True)
        errors = []

        def with_nan():
            for n, t in iter_released_tensors(model):
                if n == NAN_NAME:
                    t = t.clone()
                    t[0, 0] = float("nan")
                yield n, t

        sender.named_tensors = with_nan
        for version, fault in ((2, None), (3, lambda k, buf: buf.__setitem__(7, buf[7] ^ 1) if k == 60 else None)):
            sender.fault = fault
            try:
                sender.update(version)
                errors.append(None)
            except WeightUpdateError as exc:
                errors.append(str(exc))
            sender.named_tensors = lambda: iter_released_tensors(model)
        put_result(results, {"who": "trainer", "errors": errors})

        def die(k, buf):
            if k == 40:  # the trainer dies with half the update sent
                os._exit(3)

        sender.fault = die
        sender.update(4)
    except Exception:  # noqa: BLE001
        put_result(results, {"who": "trainer", "error": traceback.format_exc()})


def _restarted_trainer(port: int, results) -> None:
    try:
        torch.set_num_threads(1)
        model = _model(2)
        group = WeightSyncGroup("127.0.0.1", port, 0, 3, "gloo", GROUP_TIMEOUT_S)
        sender = WeightSender(lambda: iter_released_tensors(model), BroadcastChannel(group), BUCKET_MB)
        sender.handshake()
        stats = sender.update(5, include_frozen=True)
        put_result(results, {"who": "trainer2", "stats": stats})
    except Exception:  # noqa: BLE001
        put_result(results, {"who": "trainer2", "error": traceback.format_exc()})


def _receiver_ep1(rank: int, port: int, results) -> None:
    try:
        torch.set_num_threads(1)
        model = _model(0)
        ref1, ref2 = _model(1), _model(2)
        ptrs = [p.data_ptr() for p in model.parameters()]
        rx = WeightReceiver(model, atomic=(rank == 1))
        group = WeightSyncGroup("127.0.0.1", port, rank, 3, "gloo", GROUP_TIMEOUT_S)
        rx.handshake(group)
        log = []
        for _ in range(4):
            r = rx.receive_update(group, int(BUCKET_MB * 2**20))
            log.append(
                {
                    "ok": r.ok,
                    "version": r.version,
                    "valid": r.valid,
                    "rebuild": r.needs_rebuild,
                    "errors": r.errors,
                    "bitwise_v1": _bitwise_equal(model, ref1),
                    "logits_v1": float((_logits(model) - _logits(ref1)).abs().max()),
                }
            )
        group.rebuild()  # the trainer was restarted: new store, new token
        rx.handshake(group)
        r = rx.receive_update(group, int(BUCKET_MB * 2**20))
        log.append(
            {
                "ok": r.ok,
                "version": r.version,
                "valid": r.valid,
                "bitwise_v2": _bitwise_equal(model, ref2),
                "logits_v2": float((_logits(model) - _logits(ref2)).abs().max()),
            }
        )
        put_result(
            results, {"who": f"rank{rank}", "log": log, "ptrs_same": ptrs == [p.data_ptr() for p in model.parameters()]}
        )
    except Exception:  # noqa: BLE001
        put_result(results, {"who": f"rank{rank}", "error": traceback.format_exc()})


# ---------------------------------------------------------------------------------- ep2 scenario
def _trainer_ep2(port: int, results) -> None:
    try:
        torch.set_num_threads(1)
        model = _model(1)
        group = WeightSyncGroup("127.0.0.1", port, 0, 3, "gloo", GROUP_TIMEOUT_S)
        sender = WeightSender(lambda: iter_released_tensors(model), BroadcastChannel(group), BUCKET_MB)
        sender.update(1, include_frozen=True)
        with torch.no_grad():
            model.load_state_dict(_model(2).state_dict())
        sender.update(2, include_frozen=True)
        put_result(results, {"who": "trainer"})
    except Exception:  # noqa: BLE001
        put_result(results, {"who": "trainer", "error": traceback.format_exc()})


def _receiver_ep2(rank: int, port: int, ep_spec: EPGroupSpec, results) -> None:
    try:
        torch.set_num_threads(1)
        ep_group = init_ep_group(ep_spec, rank - 1)
        model = _model(0)
        shard_experts(model, rank - 1, 2, ep_group)
        rx = WeightReceiver(model, atomic=True)
        group = WeightSyncGroup("127.0.0.1", port, rank, 3, "gloo", GROUP_TIMEOUT_S)
        rx.handshake(group)
        out = {"who": f"rank{rank}", "range": model.moe_layers()[0].experts.expert_range, "log": []}
        for _version, atomic, seed in ((1, True, 1), (2, False, 2)):
            rx.atomic = atomic
            r = rx.receive_update(group, int(BUCKET_MB * 2**20))
            ref = _model(seed)
            with torch.no_grad():
                diff = float((model(_ids()) - ref(_ids())).abs().max())  # EP forward (collective)
            out["log"].append({"ok": r.ok, "version": r.version, "bitwise": _bitwise_equal(model, ref), "logits": diff})
        put_result(results, out)
    except Exception:  # noqa: BLE001
        put_result(results, {"who": f"rank{rank}", "error": traceback.format_exc()})
    finally:
        destroy_ep_group()


def _collect(results, n):
    return get_results(results, n, TIMEOUT_S, "who")


def _join(procs):
    for p in procs:
        p.join(timeout=TIMEOUT_S)
        if p.is_alive():
            p.kill()


def test_ep1_atomic_and_not_corruptions_sender_killed_and_rebuild():
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_trainer_ep1, args=(port, results))]
    procs += [ctx.Process(target=_receiver_ep1, args=(r, port, results)) for r in (1, 2)]
    for p in procs:
        p.start()
    try:
        trainer = _collect(results, 1)["trainer"]
        procs[0].join(timeout=TIMEOUT_S)
        assert procs[0].exitcode == 3  # killed midway through update 4
        restarted = ctx.Process(target=_restarted_trainer, args=(port, results))
        restarted.start()
        procs.append(restarted)
        got = _collect(results, 3)
    finally:
        _join(procs)
    nan_err, bad_err = trainer["errors"]
    assert f"rank 1: non-finite values in {NAN_NAME}" in nan_err
    assert f"rank 2: non-finite values in {NAN_NAME}" in nan_err
    assert "rank 1: bucket 60 (torch.float32, 52428 bytes) checksum mismatch" in bad_err
    atomic, plain = got["rank1"]["log"], got["rank2"]["log"]
    for log in (atomic, plain):
        assert log[0]["ok"] and log[0]["version"] == 1 and log[0]["bitwise_v1"] and log[0]["logits_v1"] <= 1e-5
    # atomic rank: every failure leaves version 1, bitwise-equal weights and identical logits
    for step in atomic[1:4]:
        assert not step["ok"] and step["valid"] and step["version"] == 1
        assert step["bitwise_v1"] and step["logits_v1"] == 0.0
    assert atomic[3]["rebuild"] and "update interrupted" in atomic[3]["errors"][0]
    # non-atomic rank: NaN / checksum hit mid-update -> invalid; interrupted -> invalid
    assert [s["valid"] for s in plain[1:4]] == [False, False, False]
    assert plain[3]["rebuild"]
    # after the rebuild, a restarted trainer's full update lands everywhere
    for rank in ("rank1", "rank2"):
        last = got[rank]["log"][4]
        assert last["ok"] and last["valid"] and last["version"] == 5 and last["bitwise_v2"]
        assert last["logits_v2"] <= 1e-5
        assert got[rank]["ptrs_same"]
    assert got["trainer2"]["stats"]["buckets"] > 50


def test_ep2_receivers_atomic_then_not():
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    spec = EPGroupSpec(world_size=2, addr="127.0.0.1", port=free_port(), backend="gloo", timeout_s=GROUP_TIMEOUT_S)
    procs = [ctx.Process(target=_trainer_ep2, args=(port, results))]
    procs += [ctx.Process(target=_receiver_ep2, args=(r, port, spec, results)) for r in (1, 2)]
    for p in procs:
        p.start()
    try:
        got = _collect(results, 3)
    finally:
        _join(procs)
    assert got["rank1"]["range"] == (0, 4) and got["rank2"]["range"] == (4, 8)
    for rank in ("rank1", "rank2"):
        for version, step in enumerate(got[rank]["log"], start=1):
            assert step["ok"] and step["version"] == version and step["bitwise"], (rank, step)
            assert step["logits"] <= 1e-5, (rank, step)

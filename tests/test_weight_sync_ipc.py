"""IPC refit between two processes (weight_sync/ipc.py) over CPU shared memory: the protocol a
CUDA IPC stage runs on a GPU. A spawned worker holds a bf16 rollout copy behind a WeightReceiver;
the trainer (this process) updates it through WeightSender + IpcChannel. Checked: the worker's
weights equal the trainer's cast bitwise after each update (digests cross by value), a non-finite
update is refused naming the tensor with the old weights and version kept, in-place trainer
changes reach the worker through the cached plan, and a worker killed between updates fails the
next update, after which a restarted worker re-opens the stage and is refit."""

from __future__ import annotations

import copy
import hashlib
import traceback

import pytest
import torch
import torch.multiprocessing as mp
from mp_results import get_results, put_result

from m3_rollout.model import M3ForCausalLM, tiny_config
from m3_rollout.weight_sync import (
    CastCopy,
    IpcChannel,
    IpcRolloutSync,
    ReleasedTensors,
    WeightReceiver,
    WeightSender,
    WeightUpdateError,
    default_frozen,
)
from m3_rollout.weight_sync.ipc import stage_layout, stage_views
from m3_rollout.weight_sync.manifest import TensorSpec
from m3_rollout.weight_sync.probe import ProbeSettings, model_scorer

TIMEOUT_S = 120.0
NAME = "language_model.model.layers.2.block_sparse_moe.experts.5.w2.weight"


def _rollout_model() -> M3ForCausalLM:
    torch.manual_seed(0)
    return M3ForCausalLM(tiny_config()).cast_for_inference(torch.bfloat16).eval()


def digest(model: torch.nn.Module) -> str:
    """sha256 of every parameter's bytes in named_parameters order."""
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        h.update(name.encode())
        h.update(p.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _worker(endpoint, tag: str, results, probe: bool = False) -> None:
    try:
        torch.set_num_threads(1)
        model = _rollout_model()
        rx = WeightReceiver(model, atomic=True, version=0, scorer=model_scorer(model) if probe else None)
        ptrs = [p.data_ptr() for p in model.parameters()]

        def report(outcome) -> None:
            r = outcome.result
            moved = [p.data_ptr() for p in model.parameters()] != ptrs
            put_result(
                results,
                {
                    "tag": tag,
                    "version": r.version,
                    "ok": r.ok,
                    "valid": r.valid,
                    "errors": r.errors,
                    "digest": digest(model),
                    "moved": moved,
                    "drift": r.probe_drift,
                },
            )

        IpcRolloutSync(rx, endpoint, timeout_s=TIMEOUT_S).serve(on_update=report)
    except Exception:  # noqa: BLE001
        put_result(results, {"tag": tag, "error": traceback.format_exc()})


def _expected(trainer: M3ForCausalLM) -> str:
    ref = _rollout_model()
    t = dict(trainer.named_parameters())
    with torch.no_grad():
        for n, p in ref.named_parameters():
            p.copy_(t[n])
    return digest(ref)


def test_stage_layout_aligns_entries_in_the_given_order():
    specs = [
        TensorSpec("a", (3,), torch.bfloat16),
        TensorSpec("b", (5,), torch.float32),
        TensorSpec("c", (8,), torch.bfloat16),
    ]
    offsets, total = stage_layout(specs, [2, 0])
    assert offsets == [16, 32, 0] and total == 64  # c (16 B), a (6 -> 16 B), then b (20 -> 32 B)
    buf = torch.zeros(total, dtype=torch.uint8)
    views = stage_views(buf, offsets, ((1, (5,), torch.float32), (2, (2, 4), torch.bfloat16)))
    views[0].fill_(1.5)
    assert views[1].shape == (2, 4) and buf[32:52].view(torch.float32).tolist() == [1.5] * 5


def test_ipc_refit_two_processes_bitwise_refusal_and_worker_restart():
    torch.manual_seed(1)
    trainer = M3ForCausalLM(tiny_config()).float().eval()
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    channel = IpcChannel(n_workers=1, device="cpu", timeout_s=TIMEOUT_S)
    sender = WeightSender(lambda: ReleasedTensors(trainer), channel, generation_dtype=torch.bfloat16)
    procs = [ctx.Process(target=_worker, args=(channel.endpoint, "first", results))]
    procs[0].start()
    try:
        sender.update(1, include_frozen=True)
        got = get_results(results, 1, TIMEOUT_S, "tag")["first"]
        assert got["ok"] and got["version"] == 1 and not got["moved"]
        assert got["digest"] == _expected(trainer)

        w2 = dict(trainer.named_parameters())["model.layers.2.block_sparse_moe.experts.w2"]
        keep = w2.detach()[5, 0, 0].item()
        with torch.no_grad():
            w2[5, 0, 0] = float("nan")
        with pytest.raises(WeightUpdateError, match=f"non-finite values in {NAME.replace('.', '[.]')}"):
            sender.update(2)
        got = get_results(results, 1, TIMEOUT_S, "tag")["first"]
        assert not got["ok"] and got["version"] == 1 and got["valid"]
        with torch.no_grad():
            w2[5, 0, 0] = keep
            for n, p in trainer.named_parameters():
                if not default_frozen("language_model." + n):  # frozen ones travel with include_frozen only
                    p.mul_(1.5)  # in place: the cached plan must read the new values
        before = got["digest"]
        sender.update(3)
        got = get_results(results, 1, TIMEOUT_S, "tag")["first"]
        assert got["ok"] and got["version"] == 3 and got["digest"] == _expected(trainer) != before

        procs[0].kill()
        procs[0].join(TIMEOUT_S)
        with pytest.raises(WeightUpdateError, match="went away|interrupted"):
            sender.update(4)
        assert channel.needs_rebuild
        results = ctx.Queue()  # a killed writer may hold the old queue's write lock forever
        procs.append(ctx.Process(target=_worker, args=(channel.endpoint, "restarted", results)))
        procs[1].start()
        with torch.no_grad():
            for p in trainer.parameters():
                p.add_(0.25)
        sender.update(5, include_frozen=True)  # a fresh worker needs the frozen tensors too
        got = get_results(results, 1, TIMEOUT_S, "tag")["restarted"]
        assert got["ok"] and got["version"] == 5 and got["digest"] == _expected(trainer)
    finally:
        channel.close()
        for p in procs:
            p.join(TIMEOUT_S)
            if p.is_alive():
                p.kill()


def test_an_update_the_trainer_refuses_itself_is_withdrawn_and_the_worker_stays_in_step():
    """The sender refuses an int tensor / a tensor outside the handshake before filling anything.
    The worker, waiting in its update call, used to hear nothing (a service's receive then ran
    into its timeout and restarted the group); now it gets "withdrawn", ends that update refused
    with weights and version kept, and the next update lands."""
    torch.manual_seed(2)
    trainer = M3ForCausalLM(tiny_config()).float().eval()
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    channel = IpcChannel(n_workers=1, device="cpu", timeout_s=TIMEOUT_S)
    sender = WeightSender(lambda: ReleasedTensors(trainer), channel, generation_dtype=torch.bfloat16)
    good = sender.named_tensors

    def int_tensor():
        for i, (name, t) in enumerate(good()):
            yield name, (t.to(torch.int32) if i == 3 else t)

    def extra_tensor():
        yield from good()
        yield "language_model.model.bogus.weight", torch.zeros(2)

    proc = ctx.Process(target=_worker, args=(channel.endpoint, "w", results))
    proc.start()
    try:
        sender.update(1, include_frozen=True)
        first = get_results(results, 1, TIMEOUT_S, "tag")["w"]
        assert first["ok"] and first["version"] == 1
        for v, (bad, why) in enumerate(
            ((int_tensor, "not a real floating-point dtype"), (extra_tensor, "not in the handshake list")), start=2
        ):
            sender.named_tensors = bad
            try:
                with pytest.raises(WeightUpdateError, match=why):
                    sender.update(v)
            finally:
                sender.named_tensors = good
            got = get_results(results, 1, TIMEOUT_S, "tag")["w"]
            assert "error" not in got, got.get("error")
            assert not got["ok"] and got["version"] == 1 and got["valid"]
            assert got["digest"] == first["digest"]
            assert any(f"update {v} withdrawn by the trainer before sending" in e for e in got["errors"])
            assert not channel.needs_rebuild
        with torch.no_grad():
            for n, p in trainer.named_parameters():
                if not default_frozen("language_model." + n):
                    p.mul_(0.5)
        sender.update(4)
        got = get_results(results, 1, TIMEOUT_S, "tag")["w"]
        assert got["ok"] and got["version"] == 4 and got["digest"] == _expected(trainer) != first["digest"]
    finally:
        channel.close()
        proc.join(TIMEOUT_S)
        if proc.is_alive():
            proc.kill()


def test_ipc_refit_with_a_probe_exchanges_its_verdict_and_rolls_back():
    """An update carrying a probe takes the second verdict exchange (an update without one skips
    it); a drift over the threshold rolls the atomic worker back to its old weights and version."""
    torch.manual_seed(1)
    trainer = M3ForCausalLM(tiny_config()).float().eval()
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    channel = IpcChannel(n_workers=1, device="cpu", timeout_s=TIMEOUT_S)
    released = ReleasedTensors(trainer)
    sender = WeightSender(
        lambda: released,
        channel,
        generation_dtype=torch.bfloat16,
        probe=ProbeSettings(threshold=5.0),
        reference=model_scorer(trainer),
    )
    proc = ctx.Process(target=_worker, args=(channel.endpoint, "probed", results, True))
    proc.start()
    try:
        stats = sender.update(1, include_frozen=True)
        got = get_results(results, 1, TIMEOUT_S, "tag")["probed"]
        assert got["ok"] and got["version"] == 1 and got["digest"] == _expected(trainer)
        assert got["drift"] is not None and 0 < got["drift"] < 5.0 and stats["probe_drift"] == got["drift"]
        with torch.no_grad():
            for p in trainer.parameters():
                p.mul_(1.5)
        sender.probe = ProbeSettings(threshold=1e-9)  # bf16 vs fp32 logprobs always drift more
        with pytest.raises(WeightUpdateError, match="probe drift"):
            sender.update(2, include_frozen=True)
        after = get_results(results, 1, TIMEOUT_S, "tag")["probed"]
        assert not after["ok"] and after["version"] == 1 and after["digest"] == got["digest"]
        sender.probe = None
        sender.update(3, include_frozen=True)  # no probe: one exchange fewer, same result
        got = get_results(results, 1, TIMEOUT_S, "tag")["probed"]
        assert got["ok"] and got["version"] == 3 and got["drift"] is None and got["digest"] == _expected(trainer)
    finally:
        channel.close()
        proc.join(TIMEOUT_S)
        if proc.is_alive():
            proc.kill()


def test_a_closed_channel_leaves_no_socket_folder_behind():
    import os

    channel = IpcChannel(n_workers=1, device="cpu", timeout_s=5.0)
    folder = os.path.dirname(channel.address)
    assert os.path.isdir(folder) and os.path.basename(folder).startswith("m3_ipc_")
    channel.close()
    assert not os.path.exists(folder)  # it used to stay: one empty folder in /tmp per channel


def test_ipc_channel_has_no_bucket_path_for_a_fault_hook():
    torch.manual_seed(1)
    trainer = M3ForCausalLM(tiny_config()).float().eval()
    channel = IpcChannel(n_workers=1, device="cpu", timeout_s=5)
    try:
        with pytest.raises(ValueError, match="IpcChannel moves no buckets"):
            WeightSender(lambda: ReleasedTensors(trainer), channel, fault=lambda k, buf: None)
        with pytest.raises(WeightUpdateError, match="0 of 1 rollout workers connected"):
            WeightSender(lambda: ReleasedTensors(trainer), IpcChannel(1, "cpu", timeout_s=0.2)).update(1)
    finally:
        channel.close()


def _policy_pair():
    """(fp32 masters, their bf16 compute copy, the CastCopy between them) as ``Policy`` holds them
    at policy.precision=bfloat16, the copy cast once."""
    torch.manual_seed(1)
    master = M3ForCausalLM(tiny_config()).float().eval()
    compute = copy.deepcopy(master).cast_for_inference(torch.bfloat16)
    cast = CastCopy(master, compute)
    cast.refresh()
    return master, compute, cast


def test_ipc_refit_reads_the_trainers_compute_copy_and_never_casts_under_a_reader():
    """share_copy: the worker opens the trainer's attested bf16 copy (here moved into shared
    memory; a CUDA IPC handle on a GPU) and refits straight from it: no stage, bitwise the masters'
    cast, a NaN refused from the cast's flags with the old weights kept. The cast refuses to run
    while the copy is lent to an update a worker has not acknowledged (a worker killed mid-way),
    until the channel is rebuilt for the restarted worker; a copy written since its cast falls
    back to the stage for that update, and the next cast goes back to the copy."""
    master, compute, cast = _policy_pair()
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    channel = IpcChannel(n_workers=1, device="cpu", timeout_s=TIMEOUT_S, share_copy=True)
    named = ReleasedTensors(master, cast=cast)  # what Policy.named_released_tensors gives
    sender = WeightSender(lambda: named, channel, generation_dtype=torch.bfloat16)
    procs = [ctx.Process(target=_worker, args=(channel.endpoint, "first", results))]
    procs[0].start()
    try:
        sender.update(1, include_frozen=True)
        got = get_results(results, 1, TIMEOUT_S, "tag")["first"]
        assert got["ok"] and got["version"] == 1 and not got["moved"] and got["digest"] == _expected(master)
        assert channel.stats["source"] == "copy" and channel.stage is None and cast.lent_to is None
        assert all(p.is_shared() for p in compute.parameters())  # moved once, in place
        assert channel.can_resend()
        first = got["digest"]

        w2 = dict(master.named_parameters())["model.layers.2.block_sparse_moe.experts.w2"]
        with torch.no_grad():
            w2[5, 0, 0] = float("nan")  # an optimizer step gone wrong: the next cast flags it
        assert not channel.can_resend()  # the masters moved on: the copy will be cast again
        with pytest.raises(WeightUpdateError, match=f"non-finite values in {NAME.replace('.', '[.]')}"):
            sender.update(2)
        got = get_results(results, 1, TIMEOUT_S, "tag")["first"]
        assert not got["ok"] and got["version"] == 1 and got["valid"] and got["digest"] == first
        assert channel.stats["source"] == "copy" and cast.lent_to is None

        with torch.no_grad():
            w2[5, 0, 0] = 0.5
            for p in master.parameters():
                p.mul_(1.5)
        sender.update(3, include_frozen=True)
        got = get_results(results, 1, TIMEOUT_S, "tag")["first"]
        assert got["ok"] and got["version"] == 3 and got["digest"] == _expected(master)

        with torch.no_grad():  # a write into the copy after its cast: its flags no longer vouch for it
            next(compute.parameters()).mul_(1.0)
        sender.update(4)
        got = get_results(results, 1, TIMEOUT_S, "tag")["first"]
        assert got["ok"] and got["version"] == 4 and channel.stats["source"] == "stage"
        assert got["digest"] == _expected(master) and channel.stage is not None

        procs[0].kill()
        procs[0].join(TIMEOUT_S)
        with torch.no_grad():
            for p in master.parameters():
                p.add_(0.25)
        with pytest.raises(WeightUpdateError, match="went away|interrupted"):
            sender.update(5)  # cast (nothing reads the copy yet), lent, then the worker is gone
        assert channel.needs_rebuild and cast.lent_to is not None
        with torch.no_grad():
            next(master.parameters()).mul_(0.5)
        with pytest.raises(RuntimeError, match="lent to the IPC refit to version 5"):
            cast.refresh()  # the trainer's next optimizer step: refused while a reader may be reading
        results = ctx.Queue()  # a killed writer may hold the old queue's write lock forever
        procs.append(ctx.Process(target=_worker, args=(channel.endpoint, "restarted", results)))
        procs[1].start()
        sender.update(6, include_frozen=True)  # rebuild (the worker is back: reclaimed), cast, copy
        got = get_results(results, 1, TIMEOUT_S, "tag")["restarted"]
        assert got["ok"] and got["version"] == 6 and got["digest"] == _expected(master)
        assert channel.stats["source"] == "copy" and cast.lent_to is None
    finally:
        channel.close()
        for p in procs:
            p.join(TIMEOUT_S)
            if p.is_alive():
                p.kill()


def test_a_channel_on_cuda_without_an_index_shares_a_copy_on_the_current_gpu(monkeypatch):
    """``IpcChannel(device="cuda")`` (what ``cluster.device=cuda`` gives) names the current GPU; the
    copy's cast plan says ``cuda:N``. The two must compare equal, or the channel would fill the
    stage for a compute copy it could share. CPU stand-in: the current GPU is 0, and the cast's plan
    reports ``cuda:0`` (the copy's tensors stay on the CPU; no handle is opened here)."""
    from m3_rollout.weight_sync.manifest import UpdateHeader
    from m3_rollout.weight_sync.sender import sender_manifest

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    master, compute, cast = _policy_pair()
    cast.refresh()
    channel = IpcChannel(n_workers=1, device="cuda", timeout_s=1.0)
    try:
        assert channel.device == torch.device("cuda", 0)
        cast.plan.device = torch.device("cuda", 0)  # where a copy on the GPU was cast
        named = ReleasedTensors(master, cast=cast)
        sender = WeightSender(lambda: named, channel, generation_dtype=torch.bfloat16)
        sender.manifest = sender_manifest(named, torch.bfloat16, sender.frozen)
        sources, entries, _, attestation = sender._sources(True, direct=True)
        assert attestation is cast
        shared = channel._shared_copy(UpdateHeader(1, True, entries), sources, attestation)
        assert shared is not None and shared[0] is cast and len(shared[2]) == len(sources)
    finally:
        channel.close()


class _Conn:
    """Stands in for the worker's connection: records what the worker sends."""

    def __init__(self):
        self.sent = []

    def send_bytes(self, data):
        self.sent.append(data)


@pytest.mark.parametrize("atomic", [False, True])
def test_worker_alternating_copy_and_stage_reuses_its_views_and_copy_plans(atomic, monkeypatch):
    """A trainer switching its source between the compute copy and the stage (``share_copy`` set
    per update, as bench_weight_sync.py does) re-sends the source each switch; the worker keeps one
    set of views per source and the receiver one plan per view list, so after the first update
    from each no plan is built again (a rebuild is O(tensors) Python and table uploads: ~0.2 s at
    8 GB on an H200). Every update lands the bytes of the source it names."""
    from m3_rollout.weight_sync import receiver as receiver_module
    from m3_rollout.weight_sync.ipc import _flat, copy_places
    from m3_rollout.weight_sync.sender import sender_manifest

    built = []

    class CountingPlan(receiver_module.CopyPlan):
        def __init__(self, *args, **kwargs):
            built.append(1)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(receiver_module, "CopyPlan", CountingPlan)
    master, compute, cast = _policy_pair()
    named = ReleasedTensors(master, cast=cast)
    manifest = sender_manifest(named, torch.bfloat16, default_frozen)
    sender = WeightSender(lambda: named, IpcChannel(1, "cpu", timeout_s=1.0), generation_dtype=torch.bfloat16)
    sender.manifest = manifest
    sources, entries, _, _ = sender._sources(True, direct=True)
    sender.channel.close()
    offsets, total = stage_layout(manifest, [i for i, _, _ in entries])
    stage = torch.zeros(total, dtype=torch.uint8)
    for v, s in zip(stage_views(stage, offsets, entries), sources):
        v.copy_(-s)  # the stage holds other values than the copy: each update shows what it read
    places = copy_places(sources, cast.storages())
    rollout = _rollout_model()
    rx = WeightReceiver(rollout, atomic=atomic, version=0)
    assert rx.check_handshake(manifest) == []
    sync = IpcRolloutSync(rx, ("unused", b""), timeout_s=1.0)
    sync.conn = _Conn()
    sync.copy = [_flat(st) for st in cast.storages()]
    sync.stage, sync.offsets = stage, offsets
    want = {"copy": digest(compute), "stage": None}
    for version in range(1, 7):
        kind = "copy" if version % 2 else "stage"
        source = ("copy", [tuple(p) for p in places]) if kind == "copy" else ("stage",)  # unpickled: new objects
        result = sync._receive(version, True, False, entries if version == 1 else None, [], None, source, True)
        assert result.ok and result.version == version
        got = {n: p.detach().clone() for n, p in rollout.named_parameters()}
        copy_params = dict(compute.named_parameters())
        sign = 1 if kind == "copy" else -1
        assert all(torch.equal(got[n], sign * copy_params[n]) for n in got), kind
        if want[kind] is None:
            want[kind] = digest(rollout)
        assert digest(rollout) == want[kind]
    assert len(built) == 2  # one plan per source, built at its first update
    assert len(sync.conn.sent) == 6  # one ack per update


def test_a_trainer_tensor_off_the_stage_device_is_refused_not_snapshotted():
    """The stage's fill plan is cached while the sender passes the same tensors; a source on
    another device than the stage was copied there once (``s.to(device)``) and that snapshot was
    filled again at every later update. Now such a source is refused, naming the tensor and both
    devices (CPU stand-in: one trainer tensor on the meta device, the stage on the CPU)."""
    from m3_rollout.weight_sync.manifest import UpdateHeader
    from m3_rollout.weight_sync.sender import sender_manifest

    torch.manual_seed(1)
    trainer = M3ForCausalLM(tiny_config()).float().eval()
    channel = IpcChannel(n_workers=1, device="cpu", timeout_s=1.0)
    try:
        named = ReleasedTensors(trainer)
        sender = WeightSender(lambda: named, channel, generation_dtype=torch.bfloat16)
        sender.manifest = sender_manifest(named, torch.bfloat16, sender.frozen)
        sources, entries, _, _ = sender._sources(True, direct=True)
        header = UpdateHeader(1, True, entries)
        channel._manifest = sender.manifest
        channel._ensure_stage(header, sources)
        assert channel._fill_stage(header, sources) == []  # every source on the stage's device: filled
        k = len(sources) // 2
        away = [s.to("meta") if i == k else s for i, s in enumerate(sources)]
        name = sender.manifest[entries[k][0]].name
        with pytest.raises(ValueError, match=f"{name} is on meta, the stage on cpu \\(1 tensors elsewhere\\)"):
            channel._fill_stage(header, away)
    finally:
        channel.close()


def test_a_withdrawn_update_leaves_the_stage_able_to_restart_a_worker():
    """``IpcRefit``: version 1 accepted, then an update the trainer refuses itself (a tensor outside
    the handshake) is withdrawn before the stage is touched, so the stage still holds version 1
    as the worker accepted it. A worker lost after that is handed version 1 (``holds`` / ``resend``);
    the refit used to forget it, and the service then refused ``generate`` until the next update."""
    from m3_rollout.config import WeightSyncConfig
    from m3_rollout.service.ipc_refit import IpcRefit

    torch.manual_seed(3)
    trainer = M3ForCausalLM(tiny_config()).float().eval()
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    refit = IpcRefit(WeightSyncConfig(timeout_s=TIMEOUT_S), 1, "cpu", torch.bfloat16, default_frozen)
    named = ReleasedTensors(trainer)
    procs = [ctx.Process(target=_worker, args=(refit.channel.endpoint, "first", results))]
    procs[0].start()
    try:
        refit.send(1, named)
        first = get_results(results, 1, TIMEOUT_S, "tag")["first"]
        assert first["ok"] and first["version"] == 1 and first["digest"] == _expected(trainer)
        assert refit.holds(1)

        bogus = [*named, ("language_model.model.bogus.weight", torch.zeros(2))]
        with pytest.raises(WeightUpdateError, match="not in the handshake list"):
            refit.send(2, bogus)
        got = get_results(results, 1, TIMEOUT_S, "tag")["first"]
        assert not got["ok"] and got["version"] == 1 and got["digest"] == first["digest"]
        assert refit.holds(1) and refit.stage_version == 1  # the stage was not touched

        procs[0].kill()
        procs[0].join(TIMEOUT_S)
        refit.lost_workers()
        with torch.no_grad():  # the trainer trains on; the stage keeps what the workers accepted
            for p in trainer.parameters():
                p.add_(0.25)
        results = ctx.Queue()  # a killed writer may hold the old queue's write lock forever
        procs.append(ctx.Process(target=_worker, args=(refit.channel.endpoint, "restarted", results)))
        procs[1].start()
        refit.resend()
        got = get_results(results, 1, TIMEOUT_S, "tag")["restarted"]
        assert got["ok"] and got["version"] == 1 and got["digest"] == first["digest"]
    finally:
        refit.close()
        for p in procs:
            p.join(TIMEOUT_S)
            if p.is_alive():
                p.kill()

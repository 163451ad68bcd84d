"""The bucketed weight-sync pipeline on a CUDA GPU (ring.py, unpack.py, buckets.BucketPacker):
pack / transfer / unpack on their own streams, checksums and finite flags on the device, one
host sync per update, a refused one included; skipped without CUDA.

In one process the pipeline runs in loopback (``ColocatedChannel(direct=False)``: a device copy
on a transfer stream stands in for the broadcast). The real process-group path runs with two
processes on the one GPU over gloo with CUDA tensors (NCCL cannot put two ranks on one GPU): its
async broadcast work orders the receiver's side stream like NCCL's does.
"""

from __future__ import annotations

import sys
import traceback
import warnings
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: mp_results

import torch.multiprocessing as mp  # noqa: E402
from mp_results import get_results, put_result  # noqa: E402

from m3_rollout.model import M3ForCausalLM, iter_released_tensors, tiny_config  # noqa: E402
from m3_rollout.parallel import free_port, shard_experts  # noqa: E402
from m3_rollout.weight_sync import (  # noqa: E402
    BroadcastChannel,
    ColocatedChannel,
    ReleasedTensors,
    WeightReceiver,
    WeightSender,
    WeightSyncGroup,
    WeightUpdateError,
    plan_buckets,
    unpack,
)
from m3_rollout.weight_sync.manifest import wire_dtype  # noqa: E402

BUCKET_MB = 0.05  # ~52 KB: the tiny model spans ~40 bf16 / ~80 fp32 buckets (expected_buckets)
NAN_NAME = "language_model.model.layers.2.block_sparse_moe.experts.6.w3.weight"


def _model(seed: int, ep_rank: int | None = None) -> M3ForCausalLM:
    torch.manual_seed(seed)
    m = M3ForCausalLM(tiny_config()).float()
    if ep_rank is not None:
        shard_experts(m, ep_rank, 2, None)
    return m.cuda().eval()


def expected_buckets(trainer: M3ForCausalLM, bucket_mb: float, dtype: torch.dtype | None = None) -> int:
    """Buckets of an update carrying every released tensor of ``trainer`` (frozen ones included)
    on a ``dtype`` wire (router >= fp32): the plan both ends derive from the header."""
    entries = [(tuple(t.shape), wire_dtype(n, t.dtype, dtype)) for n, t in iter_released_tensors(trainer)]
    return len(plan_buckets(entries, int(bucket_mb * 2**20)))


def _bitwise(trainer: M3ForCausalLM, m: M3ForCausalLM, ep_rank: int | None = None) -> list[str]:
    """Names of ``m``'s parameters that differ from the trainer's cast to their dtype."""
    t = dict(trainer.named_parameters())
    bad = []
    for n, p in m.named_parameters():
        ref = t[n].detach()
        if ep_rank is not None and n.endswith(("experts.w13", "experts.w2")):
            ref = ref[4 * ep_rank : 4 * ep_rank + 4]
        want = ref.to(p.dtype).contiguous()
        if not torch.equal(p.detach().contiguous().view(torch.uint8), want.view(torch.uint8)):
            bad.append(n)
    return bad


@pytest.mark.parametrize("atomic", [True, False])
def test_loopback_pipeline_bitwise_in_place_ep2(atomic):
    """fp32 trainer -> bf16 wire (router fp32) -> two EP=2 receivers, twice (the second update
    reuses every cached pass, with new trainer values written in place)."""
    trainer = _model(1)
    ms = [_model(0, r).cast_for_inference(torch.bfloat16) for r in range(2)]
    rxs = [WeightReceiver(m, atomic=atomic, version=1) for m in ms]
    ptrs = [{n: p.data_ptr() for n, p in m.named_parameters()} for m in ms]
    source = ReleasedTensors(trainer)
    sender = WeightSender(lambda: source, ColocatedChannel(rxs, "cuda", direct=False), BUCKET_MB, torch.bfloat16)
    want = expected_buckets(trainer, BUCKET_MB, torch.bfloat16)
    assert want > 20  # many buckets: tensors split across them, every ring slot reused
    for version in (2, 3):
        stats = sender.update(version, include_frozen=True)
        assert stats["buckets"] == want
        for r, (m, rx) in enumerate(zip(ms, rxs)):
            assert rx.version == version and rx.valid
            assert _bitwise(trainer, m, r) == []
            assert all(p.data_ptr() == ptrs[r][n] for n, p in m.named_parameters())
        with torch.no_grad():
            for p in trainer.parameters():
                p.mul_(-0.5)


def _count_syncs(fn) -> int:
    """Synchronizing CUDA calls made by ``fn()`` (torch.cuda.set_sync_debug_mode warnings)."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def _verdict_reads_under_error_mode(fn, monkeypatch) -> int:
    """Run ``fn()`` with every synchronizing CUDA call an error except the verdict read
    (``unpack.read_verdict``, run in the default mode and counted): any other sync raises where
    it happens, so a failure names the call. Returns the number of verdict reads."""
    reads = []
    real_read = unpack.read_verdict

    def read(t):
        torch.cuda.set_sync_debug_mode("default")
        try:
            reads.append(t.numel())
            return real_read(t)
        finally:
            torch.cuda.set_sync_debug_mode("error")

    monkeypatch.setattr(unpack, "read_verdict", read)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
        monkeypatch.setattr(unpack, "read_verdict", real_read)
    return len(reads)


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
@pytest.mark.parametrize("atomic", [True, False])
def test_loopback_update_syncs_the_host_once_whatever_the_bucket_count(atomic, dtype, monkeypatch):
    """One synchronizing CUDA call per bucketed update (the verdict read), for many buckets and
    few, atomic or not, on an fp32 or a bf16 wire; the updates after a layout change included
    (their first update builds the layout: ring, stage, passes). Any other sync fails the
    error-mode run at the call that made it."""
    trainer = _model(1)
    m = _model(0) if dtype is None else _model(0).cast_for_inference(dtype)
    rx = WeightReceiver(m, atomic=atomic, version=0)
    source = ReleasedTensors(trainer)
    counts, buckets, version = [], [], 0
    for bucket_mb in (BUCKET_MB, 1.0, BUCKET_MB):
        sender = WeightSender(lambda: source, ColocatedChannel([rx], "cuda", direct=False), bucket_mb, dtype)
        version += 1
        sender.update(version, include_frozen=True)  # builds the layout and the passes (tables go to the device)
        version += 1
        reads = _verdict_reads_under_error_mode(lambda v=version: sender.update(v, include_frozen=True), monkeypatch)
        assert reads == 1
        version += 1
        counts.append(_count_syncs(lambda v=version: sender.update(v, include_frozen=True)))
        buckets.append(sender.stats["buckets"])
        assert buckets[-1] == expected_buckets(trainer, bucket_mb, dtype)
        assert rx.version == version and _bitwise(trainer, m) == []
    assert buckets[0] > 20 and buckets[1] < 10
    assert counts == [1, 1, 1]  # the verdict read, and nothing per bucket


@pytest.mark.parametrize("atomic", [True, False])
def test_loopback_refused_update_syncs_the_host_once(atomic, monkeypatch):
    """A refused update synchronizes the host once too, atomic or not: the verdict read names the
    tensor holding a NaN (written into the trainer in place, so the sender's cached passes carry
    it) or the bucket torn on the receiver; nothing re-reads the parameters a non-atomic rank
    wrote. Any other sync fails the error-mode run at the call that made it."""
    trainer = _model(1)
    m = _model(0).cast_for_inference(torch.bfloat16)
    rx = WeightReceiver(m, atomic=atomic, version=0)
    source = ReleasedTensors(trainer)
    sender = WeightSender(lambda: source, ColocatedChannel([rx], "cuda", direct=False), BUCKET_MB, torch.bfloat16)
    sender.update(1, include_frozen=True)  # builds the layout and the passes
    sender.update(2, include_frozen=True)  # every pass launched once (compiled-kernel fast path from now on)

    def refused(match: str):
        def run() -> None:
            with pytest.raises(WeightUpdateError, match=match):
                sender.update(3, include_frozen=True)

        return run

    target = dict(iter_released_tensors(trainer))[NAN_NAME]
    with torch.no_grad():
        target.view(-1)[7] = float("nan")
    nan = f"non-finite values in {NAN_NAME.replace('.', '[.]')}"
    assert _verdict_reads_under_error_mode(refused(nan), monkeypatch) == 1
    assert _count_syncs(refused(nan)) == 1
    assert rx.version == 2 and rx.valid == atomic
    with torch.no_grad():
        target.view(-1)[7] = 0.25
    rx.fault = lambda k, buf: buf[10:11].bitwise_xor_(0x40) if k == 5 else None
    torn = "bucket 5 .* checksum mismatch; holds "
    assert _verdict_reads_under_error_mode(refused(torn), monkeypatch) == 1
    assert _count_syncs(refused(torn)) == 1
    assert rx.version == 2 and rx.valid == atomic
    rx.fault = None
    assert _count_syncs(lambda: sender.update(3, include_frozen=True)) == 1
    assert rx.version == 3 and rx.valid and _bitwise(trainer, m) == []


@pytest.mark.parametrize("atomic", [True, False])
def test_loopback_rejects_receiver_side_corruption_and_nan(atomic):
    trainer, m = _model(1), _model(0)
    rx = WeightReceiver(m, atomic=atomic, version=3)
    old = {n: p.detach().clone() for n, p in m.named_parameters()}

    def flip(k, buf):
        if k == 5:
            buf[10] ^= 0x40

    rx.fault = flip
    channel = ColocatedChannel([rx], "cuda", direct=False)
    with pytest.raises(WeightUpdateError, match="bucket 5 .* checksum mismatch; holds language_model.model.embed"):
        WeightSender(lambda: iter_released_tensors(trainer), channel, BUCKET_MB).update(4)
    assert rx.version == 3 and rx.valid == atomic
    if atomic:
        assert all(torch.equal(p, old[n]) for n, p in m.named_parameters())
    rx.fault = None

    def with_nan():
        for n, x in iter_released_tensors(trainer):
            if n == NAN_NAME:
                x = x.clone()
                x.view(-1)[7] = float("nan")
            yield n, x

    with pytest.raises(WeightUpdateError, match=f"non-finite values in {NAN_NAME.replace('.', '[.]')}"):
        WeightSender(with_nan, channel, BUCKET_MB).update(4)
    assert rx.version == 3 and rx.valid == atomic
    if atomic:
        assert all(torch.equal(p, old[n]) for n, p in m.named_parameters())
    WeightSender(lambda: iter_released_tensors(trainer), channel, BUCKET_MB).update(5, include_frozen=True)
    assert rx.version == 5 and rx.valid and _bitwise(trainer, m) == []


# ------------------------------------------------------------------ two processes, gloo on CUDA tensors
def _trainer(port: int, results) -> None:
    try:
        model = _model(1)
        group = WeightSyncGroup("127.0.0.1", port, 0, 2, "gloo", 60, device="cuda:0")
        source = ReleasedTensors(model)
        sender = WeightSender(lambda: source, BroadcastChannel(group), BUCKET_MB)
        sender.update(1, include_frozen=True)
        sender.fault = lambda k, buf: buf.__setitem__(3, buf[3] ^ 1) if k == 20 else None
        try:
            sender.update(2)
            err = None
        except WeightUpdateError as exc:
            err = str(exc)
        sender.fault = None
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(-2.0)
        sender.update(3, include_frozen=True)
        put_result(results, {"who": "trainer", "error_2": err, "buckets": sender.stats["buckets"]})
    except Exception:  # noqa: BLE001
        put_result(results, {"who": "trainer", "error": traceback.format_exc()})


def _receiver(port: int, results) -> None:
    try:
        model = _model(0)
        rx = WeightReceiver(model, atomic=True)
        group = WeightSyncGroup("127.0.0.1", port, 1, 2, "gloo", 60, device="cuda:0")
        rx.handshake(group)
        log = []
        ref = _model(1)
        for _ in range(3):
            r = rx.receive_update(group, int(BUCKET_MB * 2**20))
            log.append({"ok": r.ok, "version": r.version, "errors": r.errors, "bad": _bitwise(ref, model)})
            if len(log) == 2:
                with torch.no_grad():
                    for p in ref.parameters():
                        p.mul_(-2.0)
        put_result(results, {"who": "rank1", "log": log})
    except Exception:  # noqa: BLE001
        put_result(results, {"who": "rank1", "error": traceback.format_exc()})


def test_gloo_cuda_tensors_two_processes_one_gpu():
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=f, args=(port, results)) for f in (_trainer, _receiver)]
    for p in procs:
        p.start()
    try:
        got = get_results(results, 2, 300, "who")
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    log = got["rank1"]["log"]
    assert log[0]["ok"] and log[0]["version"] == 1 and log[0]["bad"] == []
    assert not log[1]["ok"] and log[1]["version"] == 1 and log[1]["bad"] == []  # atomic: old weights kept
    # the group's one rollout rank: its errors name no rank
    assert "\n  bucket 20 " in got["trainer"]["error_2"] and "checksum mismatch" in got["trainer"]["error_2"]
    assert log[2]["ok"] and log[2]["version"] == 3 and log[2]["bad"] == []
    assert got["trainer"]["buckets"] == expected_buckets(_model(1), BUCKET_MB) > 20

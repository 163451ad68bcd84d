"""The attested refit (weight_sync/cast_copy.py): the trainer's bf16 copy, refreshed by one fused
cast that leaves finite flags, is sent in place of the fp32 masters and validated from those flags
(no check pass); stale or non-covering flags fall back to the check pass. Plus the host-side cost
of an update: no Python work per released tensor or per run, one host sync at most."""

from __future__ import annotations

import collections
import copy

import pytest
import torch
from torch.overrides import TorchFunctionMode

from m3_rollout.model import M3ForCausalLM, tiny_config
from m3_rollout.weight_sync import (
    CastCopy,
    ColocatedChannel,
    ReleasedTensors,
    WeightReceiver,
    WeightSender,
    WeightUpdateError,
)
from m3_rollout.weight_sync import copy_plan as copy_plan_module
from m3_rollout.weight_sync.copy_plan import CopyPlan

W2 = "model.layers.2.block_sparse_moe.experts.w2"
W2_NAME = "language_model.model.layers.2.block_sparse_moe.experts.5.w2.weight"  # expert 5 of that w2


def _config(experts: int = 8, layers: int = 3):
    freq = [0] + [1] * (layers - 1)
    return tiny_config(
        num_local_experts=experts,
        num_hidden_layers=layers,
        moe_layer_freq=freq,
        sparse_attention_freq=freq,
        sparse_disable_index_value=freq,
    )


def _trainer(cfg=None):
    """(fp32 master, its bf16 compute copy, the CastCopy between them), as ``Policy`` holds them."""
    torch.manual_seed(1)
    master = M3ForCausalLM(cfg or _config()).float()
    compute = copy.deepcopy(master).cast_for_inference(torch.bfloat16)
    return master, compute, CastCopy(master, compute)


def _rollout(cfg=None):
    torch.manual_seed(0)
    return M3ForCausalLM(cfg or _config()).cast_for_inference(torch.bfloat16).eval()


def _bits(t):
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _cast_of(master, rollout) -> bool:
    """Every rollout parameter is bitwise the master's cast (router stays fp32)."""
    want = dict(master.named_parameters())
    return all(torch.equal(_bits(p), _bits(want[n].to(p.dtype))) for n, p in rollout.named_parameters())


class _CountChecks:
    """Counts ``CopyPlan.check`` passes (the fallback) while active."""

    def __init__(self, monkeypatch):
        self.n = 0
        orig = CopyPlan.check

        def check(plan):
            self.n += 1
            orig(plan)

        monkeypatch.setattr(CopyPlan, "check", check)


@pytest.mark.parametrize("atomic", [True, False])
def test_attested_refit_sends_the_cast_copy_without_a_check_pass(atomic, monkeypatch):
    master, compute, cast = _trainer()
    rollout = _rollout()
    rx = WeightReceiver(rollout, atomic=atomic)
    named = ReleasedTensors(master, cast=cast)
    sender = WeightSender(lambda: named, ColocatedChannel([rx], direct=True), 1, torch.bfloat16)
    checks = _CountChecks(monkeypatch)
    sender.update(1, include_frozen=True)
    assert rx.last_verdict == "attested" and checks.n == 0 and cast.casts == 1
    assert _cast_of(master, rollout) and rx.version == 1
    with torch.no_grad():  # an optimizer step: the masters move on, the sender's refresh re-casts
        for p in master.parameters():
            p.mul_(-1.5)
    sender.update(2, include_frozen=True)
    assert rx.last_verdict == "attested" and checks.n == 0 and cast.casts == 2
    assert _cast_of(master, rollout) and rx.version == 2
    sender.update(3, include_frozen=True)  # nothing changed: no cast, no check, the verdict read back once per cast
    assert cast.casts == 2 and checks.n == 0 and rx.version == 3


@pytest.mark.parametrize("atomic", [True, False])
def test_stale_flags_fall_back_to_the_check_pass_and_catch_a_nan_written_after_the_cast(atomic, monkeypatch):
    master, compute, cast = _trainer()
    rollout = _rollout()
    rx = WeightReceiver(rollout, atomic=atomic)
    named = ReleasedTensors(master, cast=cast)
    sender = WeightSender(lambda: named, ColocatedChannel([rx], direct=True), 1, torch.bfloat16)
    sender.update(1, include_frozen=True)
    checks = _CountChecks(monkeypatch)
    w2 = dict(compute.named_parameters())[W2]
    with torch.no_grad():  # a finite write into the copy after its cast: the flags are stale
        w2[0, 0, 0] = 0.25
    assert not cast.current()
    sender.update(2, include_frozen=True)
    assert rx.last_verdict == "checked" and checks.n == 1 and rx.version == 2
    assert torch.equal(_bits(dict(rollout.named_parameters())[W2]), _bits(w2))  # what was sent, checked
    old = {n: p.detach().clone() for n, p in rollout.named_parameters()}
    with torch.no_grad():
        w2[5, 1, 2] = float("nan")  # after the cast: the flags say finite, the copy is not
    with pytest.raises(WeightUpdateError, match=f"non-finite values in {W2_NAME.replace('.', '[.]')}"):
        sender.update(3, include_frozen=True)
    assert rx.last_verdict == "checked" and checks.n == 2
    assert rx.version == 2 and rx.valid
    assert all(torch.equal(_bits(p), _bits(old[n])) for n, p in rollout.named_parameters())


@pytest.mark.parametrize("atomic", [True, False])
def test_a_nan_in_the_master_is_refused_from_the_flags_keeping_the_old_weights(atomic, monkeypatch):
    master, compute, cast = _trainer()
    rollout = _rollout()
    rx = WeightReceiver(rollout, atomic=atomic, version=3)
    named = ReleasedTensors(master, cast=cast)
    sender = WeightSender(lambda: named, ColocatedChannel([rx], direct=True), 1, torch.bfloat16)
    sender.update(4, include_frozen=True)
    old = {n: p.detach().clone() for n, p in rollout.named_parameters()}
    checks = _CountChecks(monkeypatch)
    with torch.no_grad():
        dict(master.named_parameters())[W2][5, 3, 1] = float("inf")
    with pytest.raises(WeightUpdateError, match=f"non-finite values in {W2_NAME.replace('.', '[.]')}"):
        sender.update(5, include_frozen=True)
    assert rx.last_verdict == "attested" and checks.n == 0  # refused from the cast's own flags
    assert rx.version == 4 and rx.valid
    assert all(torch.equal(_bits(p), _bits(old[n])) for n, p in rollout.named_parameters())
    with torch.no_grad():
        dict(master.named_parameters())[W2][5, 3, 1] = 0.5  # repaired: the next update goes through
    sender.update(5, include_frozen=True)
    assert rx.version == 5 and _cast_of(master, rollout)


def test_flags_are_trusted_only_for_sources_they_cover_and_copies_that_cannot_overflow(monkeypatch):
    master, compute, cast = _trainer()
    cast.refresh()
    own = [t for _, t in cast.released]
    assert cast.current() and cast.covers(own) and cast.covers([own[3][1:]])
    assert not cast.covers([own[3].clone()]) and not cast.covers([own[3].t()] if own[3].ndim == 2 else [own[3][::2]])
    checks = _CountChecks(monkeypatch)
    # the receiver is handed the cast with sources it did not write: it checks them itself
    rollout = _rollout()
    rx = WeightReceiver(rollout, atomic=True)
    other = ReleasedTensors(copy.deepcopy(compute))
    sender = WeightSender(lambda: other, ColocatedChannel([rx], direct=True), 1, torch.bfloat16)
    sender.handshake()
    sources, entries, _, _ = sender._sources(True, direct=True)
    from m3_rollout.weight_sync.manifest import UpdateHeader

    rx.receive_direct(UpdateHeader(1, True, entries), sources, attested=cast)
    assert rx.last_verdict == "checked" and checks.n == 1
    rx.complete(True)
    # a cast on the way (bf16 -> fp16 could overflow) means the source's flags do not vouch
    x16, xb, x32 = torch.zeros(4, dtype=torch.float16), torch.zeros(4, dtype=torch.bfloat16), torch.zeros(4)
    assert CopyPlan([xb, x32], [xb.clone(), x16]).keeps_finite  # same dtype, widening
    assert not CopyPlan([x16], [xb]).keeps_finite and not CopyPlan([xb], [x32]).keeps_finite


@pytest.mark.parametrize("atomic", [True, False])
def test_packed_copy_and_packed_rollout_are_attested(atomic, monkeypatch):
    """On CUDA ``cast_for_inference`` packs q/k/v (+ index q/k) and gate/up into one buffer each,
    in the trainer's compute copy and in the rollout model alike, while the fp32 masters stay
    separate storages: the cast writes q, k, v as separate runs, the refit merges them into one
    run. Adjacent written ranges cover it: the refit is attested (no check pass)."""
    torch.manual_seed(1)
    master = M3ForCausalLM(_config()).float()
    compute = copy.deepcopy(master).cast_for_inference(torch.bfloat16).pack_fused_weights()
    cast = CastCopy(master, compute)
    rollout = _rollout().pack_fused_weights()
    rx = WeightReceiver(rollout, atomic=atomic)
    named = ReleasedTensors(master, cast=cast)
    sender = WeightSender(lambda: named, ColocatedChannel([rx], direct=True), 1, torch.bfloat16)
    checks = _CountChecks(monkeypatch)
    sender.update(1, include_frozen=True)
    q = compute.model.layers[0].self_attn.q_proj.weight
    assert (
        q.untyped_storage().data_ptr() == compute.model.layers[0].self_attn.k_proj.weight.untyped_storage().data_ptr()
    )
    assert any(len(r.members) > 1 for r in rx._plan_cache.plan.runs)  # the refit merged packed views
    assert rx.last_verdict == "attested" and checks.n == 0 and _cast_of(master, rollout)
    with torch.no_grad():
        for p in master.parameters():
            p.mul_(-1.5)
    sender.update(2)  # without the frozen tensors, as every refit after the first
    assert rx.last_verdict == "attested" and checks.n == 0 and cast.casts == 2 and rx.version == 2
    assert not cast.covers([torch.empty(8, dtype=torch.bfloat16)])  # memory the cast never wrote


class _Calls(TorchFunctionMode):
    """Counts torch API calls (tensor methods included) made while active."""

    def __init__(self):
        super().__init__()
        self.calls: collections.Counter = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls[getattr(func, "__name__", str(func))] += 1
        return func(*args, **(kwargs or {}))


class _Kernel:
    """Stands in for ``runs_kernel``: counts launches (the host path of the CUDA plan on a CPU)."""

    launches = 0

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            _Kernel.launches += 1

        return launch


@pytest.mark.parametrize("attested", [True, False])
def test_update_host_work_is_independent_of_the_tensor_count(attested, monkeypatch):
    """The per-update path of the CUDA plan does no work per released tensor or per run: the torch
    calls of a warm update are the same for 8 and 32 experts (88 vs 232 released tensors, the same
    parameters) and O(parameters) C-level reads at most (the sender's layout / version checks),
    with one launch per dtype group per pass and at most one host sync (``.item()``)."""
    monkeypatch.setattr(copy_plan_module, "runs_kernel", _Kernel())
    monkeypatch.setattr(copy_plan_module, "_use_triton", lambda device: True)
    seen = {}
    for experts in (8, 32):
        master, compute, cast = _trainer(_config(experts))
        rx = WeightReceiver(_rollout(_config(experts)), atomic=True)
        named = ReleasedTensors(master, cast=cast) if attested else ReleasedTensors(compute)
        sender = WeightSender(lambda named=named: named, ColocatedChannel([rx], direct=True), 1, torch.bfloat16)
        sender.update(1, include_frozen=True)
        with torch.no_grad():  # a training step in between: the attested path casts and syncs once
            next(master.parameters()).add_(1.0)
        _Kernel.launches = 0
        with _Calls() as mode:
            sender.update(2, include_frozen=True)
        plan = rx._plan_cache.plan
        n_params = len(list(master.parameters()))
        groups = len(plan._groups)
        assert rx.last_verdict == ("attested" if attested else "checked")
        cast_launches = groups if attested else 0  # the refresh's copy + check pass (trainer side)
        assert _Kernel.launches == cast_launches + (1 if attested else 2) * groups
        assert mode.calls["item"] <= 1 and mode.calls["nonzero"] == 0
        assert sum(mode.calls.values()) - mode.calls["data_ptr"] - mode.calls["__get__"] < 20
        # addresses, version counters: sender layout + masters' versions + copy's after a cast +
        # the receiver's currency check; attributes read one C-level map per parameter list
        assert mode.calls["data_ptr"] + mode.calls["__get__"] <= 4 * n_params + 8
        seen[experts] = (len(sender.manifest), dict(mode.calls))
    assert seen[8][0] < seen[32][0] and seen[8][1] == seen[32][1]


def test_the_cast_refuses_to_write_a_copy_lent_to_a_reader():
    """The ordering rule of a copy another process reads (ipc.py): while lent, a refresh that
    would cast raises and leaves the copy as it was; a refresh with nothing to cast is fine;
    once reclaimed the cast runs. ``share_memory`` moves the storages in place: the copy's
    released views follow and are still covered by the cast's ranges."""
    master, compute, cast = _trainer()
    cast.refresh()
    before = {n: _bits(p).clone() for n, p in compute.named_parameters()}
    cast.lend("a test reader")
    assert not cast.pending() and cast.refresh() is False  # nothing to cast: no write, no error
    with torch.no_grad():
        next(master.parameters()).add_(1.0)
    assert cast.pending()
    with pytest.raises(RuntimeError, match="lent to a test reader"):
        cast.refresh()
    assert all(torch.equal(_bits(p), before[n]) for n, p in compute.named_parameters())
    cast.reclaim()
    assert cast.refresh() and not cast.pending() and _cast_of(master, compute)
    views = [t for _, t in cast.released]
    ptrs = [t.data_ptr() for t in views]
    cast.share_memory()
    assert all(p.is_shared() for p in compute.parameters())
    assert [t.data_ptr() for t in views] != ptrs and cast.covers(views) and cast.current()
    assert _cast_of(master, compute)

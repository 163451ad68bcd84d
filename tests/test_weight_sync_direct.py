"""Colocated direct weight sync (ColocatedChannel(direct=True), weight_sync/direct.py): per-tensor
copies into the rollout's views with no buckets; bitwise results, storage kept, EP expert rows,
atomic rejection of non-finite / overflowing / malformed updates with old weights and version kept."""

from __future__ import annotations

import pytest
import torch

from m3_rollout.model import M3ForCausalLM, iter_released_tensors, tiny_config
from m3_rollout.parallel import shard_experts
from m3_rollout.weight_sync import (
    ColocatedChannel,
    ReleasedTensors,
    WeightReceiver,
    WeightSender,
    WeightUpdateError,
    copy_plan,
)
from m3_rollout.weight_sync.copy_plan import KERNELS, CopyPlan, build_runs
from m3_rollout.weight_sync.direct import nonfinite

EXPERT = "language_model.model.layers.2.block_sparse_moe.experts.{}.w3.weight"


def _model(seed: int) -> M3ForCausalLM:
    torch.manual_seed(seed)
    return M3ForCausalLM(tiny_config()).float().eval()


def _send(trainer, receivers, dtype=None, named=None, direct=True):
    named = named or (lambda: iter_released_tensors(trainer))
    return WeightSender(named, ColocatedChannel(receivers, direct=direct), 0.05, dtype)


def _with(trainer, name, fn):
    def named():
        for n, t in iter_released_tensors(trainer):
            if n == name:
                t = t.clone()
                fn(t)
            yield n, t

    return named


@pytest.mark.parametrize("atomic", [True, False])
@pytest.mark.parametrize("ep", [1, 2])
def test_direct_update_bitwise_in_place_with_expert_rows(atomic, ep):
    trainer = _model(1)
    rx_models, rxs = [], []
    for r in range(ep):
        m = _model(0).cast_for_inference(torch.bfloat16)  # bf16 rollout, router fp32
        if ep > 1:
            shard_experts(m, r, ep, None)
        rx_models.append(m)
        rxs.append(WeightReceiver(m, atomic=atomic, version=2))
    ptrs = [{n: p.data_ptr() for n, p in m.named_parameters()} for m in rx_models]
    stats = _send(trainer, rxs, torch.bfloat16).update(3, include_frozen=True)
    released = list(iter_released_tensors(trainer))
    assert stats["buckets"] == 0
    assert stats["bytes"] == sum(
        t.numel() * (4 if "gate.weight" in n or "correction_bias" in n else 2) for n, t in released
    )
    want = dict(trainer.named_parameters())
    for m, rx, ptr in zip(rx_models, rxs, ptrs):
        assert rx.version == 3 and rx.valid
        for name, p in m.named_parameters():
            assert p.data_ptr() == ptr[name], name
            ref = want[name].detach()
            if name.endswith(("experts.w13", "experts.w2")):
                a, b = m.get_submodule(name.rsplit(".", 1)[0]).expert_range if ep > 1 else (0, ref.shape[0])
                ref = ref[a:b]
            ref = ref.to(p.dtype)  # router stays fp32: exact fp32 bits; the rest rounds once to bf16
            assert torch.equal(
                p.view(torch.int16 if p.dtype == torch.bfloat16 else torch.int32),
                ref.view(torch.int16 if p.dtype == torch.bfloat16 else torch.int32),
            ), name
    if ep == 2:  # rank 1 holds experts [4, 8): local row 1 = global expert 5, gate rows before up rows
        w13 = rx_models[1].model.layers[2].block_sparse_moe.experts.w13
        inter = w13.shape[1] // 2
        t_w13 = trainer.model.layers[2].block_sparse_moe.experts.w13
        assert torch.equal(w13[1, inter:].float(), t_w13[5, inter:].to(torch.bfloat16).float())
        assert torch.equal(w13[1, :inter].float(), t_w13[5, :inter].to(torch.bfloat16).float())


def test_direct_matches_bucket_path_bitwise():
    trainer = _model(1)
    a, b = _model(0).cast_for_inference(torch.bfloat16), _model(0).cast_for_inference(torch.bfloat16)
    _send(trainer, [WeightReceiver(a)], torch.bfloat16, direct=True).update(1, include_frozen=True)
    _send(trainer, [WeightReceiver(b)], torch.bfloat16, direct=False).update(1, include_frozen=True)
    pb = dict(b.named_parameters())
    for n, p in a.named_parameters():
        assert torch.equal(p.detach().reshape(-1).view(torch.uint8), pb[n].detach().reshape(-1).view(torch.uint8)), n


@pytest.mark.parametrize("case", ["nan", "inf", "bf16 overflow"])
def test_direct_atomic_rejects_non_finite_keeping_old_weights(case):
    trainer = _model(1)
    rx_model = _model(0).cast_for_inference(torch.bfloat16)
    rx = WeightReceiver(rx_model, atomic=True, version=4)
    old = {n: p.detach().clone() for n, p in rx_model.named_parameters()}
    name = EXPERT.format(6)
    value = {"nan": float("nan"), "inf": float("-inf"), "bf16 overflow": 3.4e38}[case]  # 3.4e38 is finite in fp32
    assert (case != "bf16 overflow") or torch.isinf(torch.tensor(value).to(torch.bfloat16))
    sender = _send(trainer, [rx], torch.bfloat16)
    sender.handshake()
    sender.named_tensors = _with(trainer, name, lambda t: t.view(-1)[7].fill_(value))
    with pytest.raises(WeightUpdateError, match=f"non-finite values in {name.replace('.', '[.]')}"):
        sender.update(5)
    assert rx.version == 4 and rx.valid
    assert all(torch.equal(p, old[n]) for n, p in rx_model.named_parameters())
    sender.named_tensors = lambda: iter_released_tensors(trainer)  # the next good update goes through
    sender.update(6)
    assert rx.version == 6 and torch.equal(rx_model.lm_head.weight, trainer.lm_head.weight.to(torch.bfloat16))


def test_direct_atomic_two_receivers_all_or_nothing():
    """EP=2: the NaN sits in an expert only rank 1 owns; rank 0 must not commit either."""
    trainer = _model(1)
    ms = []
    for r in range(2):
        m = _model(0)
        shard_experts(m, r, 2, None)
        ms.append(m)
    rxs = [WeightReceiver(m, atomic=True, version=1) for m in ms]
    old = [{n: p.detach().clone() for n, p in m.named_parameters()} for m in ms]
    sender = _send(trainer, rxs, named=_with(trainer, EXPERT.format(6), lambda t: t.view(-1)[0].fill_(float("nan"))))
    with pytest.raises(WeightUpdateError) as exc:
        sender.update(2)
    assert f"receiver 1: non-finite values in {EXPERT.format(6)}" in str(exc.value)
    r0 = sender.channel.results[0]
    assert not r0.ok and not r0.changed and "receiver 0: update 2 not applied: another rank failed" in r0.errors
    for m, rx, o in zip(ms, rxs, old):
        assert rx.version == 1 and rx.valid
        assert all(torch.equal(p, o[n]) for n, p in m.named_parameters())


@pytest.mark.parametrize("atomic", [True, False])
def test_sources_on_another_device_are_read_anew_at_every_update(monkeypatch, atomic):
    """An EP worker on cuda:1 reads the trainer's stage on cuda:0: such pairs (here: the sources of
    layer 2 and the head, made "remote" by ``reads_across``) must not be snapshotted into the cached
    plan nor handed to the fused plan; every update copies their current bytes (``PeerCopy``), and
    a NaN in one of them is refused before any write, on both ranks."""
    trainer = _model(1)
    remote = {p.untyped_storage().data_ptr() for n, p in trainer.named_parameters() if ".layers.2." in n}
    remote.add(trainer.lm_head.weight.untyped_storage().data_ptr())
    monkeypatch.setattr(copy_plan, "reads_across", lambda src, dst: src.untyped_storage().data_ptr() in remote)
    ms = []
    for r in range(2):
        m = _model(0).cast_for_inference(torch.bfloat16)
        shard_experts(m, r, 2, None)
        ms.append(m)
    rxs = [WeightReceiver(m, atomic=atomic, version=0) for m in ms]
    sender = _send(trainer, rxs, torch.bfloat16, named=lambda: ReleasedTensors(trainer))

    def assert_served(version: int) -> None:
        for m, rx in zip(ms, rxs):
            assert rx.version == version and rx.valid
            assert torch.equal(m.lm_head.weight, trainer.lm_head.weight.to(torch.bfloat16))
            moe, t_moe = m.model.layers[2].block_sparse_moe.experts, trainer.model.layers[2].block_sparse_moe.experts
            a, b = moe.expert_range
            assert torch.equal(moe.w2, t_moe.w2[a:b].to(torch.bfloat16))
            assert torch.equal(
                m.model.layers[0].self_attn.q_proj.weight,
                trainer.model.layers[0].self_attn.q_proj.weight.to(torch.bfloat16),
            )

    sender.update(1, include_frozen=True)
    assert_served(1)
    plans = [rx._plan_cache for rx in rxs]
    for c in plans:  # the remote pairs hold the trainer's tensors themselves, outside the fused plan
        assert c.peer is not None and 0 < c.peer.n_pairs < len(c.pairs)
        assert all(s.untyped_storage().data_ptr() in remote for s in c.peer.srcs)
        assert not any(r.src.untyped_storage().data_ptr() in remote for r in c.plan.runs)
        assert c.plan.n_pairs + c.peer.n_pairs == len(c.pairs)
    with torch.no_grad():  # the trainer trains in place: the same source objects, new bytes
        trainer.lm_head.weight.mul_(-1.0)
        trainer.model.layers[2].block_sparse_moe.experts.w2.mul_(3.0)
        trainer.model.layers[0].self_attn.q_proj.weight.add_(0.5)
    sender.update(2, include_frozen=True)
    assert all(rx._plan_cache is c for rx, c in zip(rxs, plans))  # the cached plans, reused
    assert_served(2)
    w2 = trainer.model.layers[2].block_sparse_moe.experts.w2
    old = [{n: p.detach().clone() for n, p in m.named_parameters()} for m in ms]
    with torch.no_grad():
        w2[6, 0, 0] = float("nan")  # expert 6: rank 1's, a remote source
        trainer.lm_head.weight.mul_(2.0)  # and a change every rank would write
    with pytest.raises(WeightUpdateError, match="receiver 1: non-finite values in .*experts[.]6[.]w2"):
        sender.update(3, include_frozen=True)
    # rank 1 refused before writing a byte; atomic rank 0 waited for it, a non-atomic one wrote its
    # (finite) share on its own verdict and is invalid until the next full update
    for r, (m, rx, o) in enumerate(zip(ms, rxs, old)):
        kept = atomic or r == 1
        assert rx.version == 2 and rx.valid == kept
        assert all(torch.equal(p, o[n]) for n, p in m.named_parameters()) == kept
    with torch.no_grad():
        w2[6, 0, 0] = 1.0
    sender.update(4, include_frozen=True)
    assert_served(4)


def test_direct_header_errors_and_non_atomic_semantics():
    trainer = _model(1)
    name_shape = "language_model.model.layers.1.self_attn.o_proj.weight"
    rx_model = _model(0)
    old = {n: p.detach().clone() for n, p in rx_model.named_parameters()}
    rx = WeightReceiver(rx_model, atomic=False, version=2)
    sender = _send(trainer, [rx])
    sender.handshake()
    sender.named_tensors = lambda: ((n, t[:, :-1] if n == name_shape else t) for n, t in iter_released_tensors(trainer))
    with pytest.raises(WeightUpdateError, match=rf"shape of {name_shape}: update \[128, 255\], handshake \[128, 256\]"):
        sender.update(3)
    # header rejected before any copy: still valid on version 2, weights untouched
    assert rx.valid and rx.version == 2
    assert all(torch.equal(p, old[n]) for n, p in rx_model.named_parameters())
    # non-atomic means no staging, not no validation: with its default settings it rejects a NaN
    # before touching anything (it used to copy it through while an atomic peer refused the update)
    sender.named_tensors = _with(trainer, EXPERT.format(1), lambda t: t.view(-1)[0].fill_(float("nan")))
    with pytest.raises(WeightUpdateError, match=f"non-finite values in {EXPERT.format(1).replace('.', '[.]')}"):
        sender.update(4)
    assert rx.valid and rx.version == 2
    assert not torch.isnan(rx_model.model.layers[2].block_sparse_moe.experts.w13).any()
    assert all(torch.equal(p, old[n]) for n, p in rx_model.named_parameters())


def test_nonfinite_and_copy_plan_against_per_tensor_reference():
    g = torch.Generator().manual_seed(0)
    ts = [torch.randn(n, generator=g) * 100 for n in (5, 0, 17, 3, 9, 1)]
    dst = [torch.float32, torch.bfloat16, torch.float16, torch.bfloat16, torch.float16, torch.float32]
    ts[2][4] = float("nan")
    ts[4][8] = 70000.0  # finite in fp32, +inf in fp16
    ts[5][0] = float("inf")
    ts.append(torch.full((4,), -3.39e38, dtype=torch.float32))  # rounds to bf16 max, stays finite
    dst.append(torch.bfloat16)
    want = [i for i, (t, d) in enumerate(zip(ts, dst)) if not bool(torch.isfinite(t.to(d).float()).all())]
    assert want == [2, 4, 5]
    assert nonfinite(ts, dst) == want
    outs = [torch.empty(t.shape, dtype=d) for t, d in zip(ts, dst)]
    plan = CopyPlan(outs, ts)
    plan.check()
    assert sorted(set(plan.bad_members()) & set(want)) == want  # flagged runs hold every bad tensor
    assert nonfinite([ts[i] for i in plan.bad_members()], [dst[i] for i in plan.bad_members()]) != []
    plan.copy()
    for o, t, d in zip(outs, ts, dst):
        assert torch.equal(o.float(), t.to(d).float()) or (torch.isnan(o.float()) == torch.isnan(t)).all()
    with pytest.raises(ValueError, match="destination dtypes"):
        nonfinite(ts, dst[:-1])


def test_copy_plan_merges_contiguous_runs_and_copies_bitwise():
    """Expert rows of one stacked buffer on both sides merge into one run (destination order),
    a non-contiguous source stays alone; the copy equals per-tensor ``copy_`` bitwise."""
    g = torch.Generator().manual_seed(0)
    src = torch.randn(4, 6, 3, generator=g)  # 4 "experts", rows 0:3 = w1, 3:6 = w3
    dst = torch.zeros(4, 6, 3, dtype=torch.bfloat16)
    other_src, other_dst = torch.randn(5, 2, generator=g).t(), torch.zeros(2, 5, dtype=torch.bfloat16)
    # manifest order interleaves w1 / w3 per expert, plus the non-contiguous pair in the middle
    pairs = [(dst[e, :3], src[e, :3]) for e in range(4)] + [(other_dst, other_src)]
    pairs += [(dst[e, 3:], src[e, 3:]) for e in range(4)]
    runs = build_runs([d for d, _ in pairs], [s for _, s in pairs])
    assert sorted(len(r.members) for r in runs) == [1, 8]
    big = next(r for r in runs if len(r.members) == 8)
    assert big.members == [0, 5, 1, 6, 2, 7, 3, 8] and big.dst.numel() == dst.numel()
    plan = CopyPlan([d for d, _ in pairs], [s for _, s in pairs])
    plan.check()
    assert plan.bad_runs() == []
    plan.copy()
    assert torch.equal(dst.view(torch.int16), src.to(torch.bfloat16).view(torch.int16))
    assert torch.equal(other_dst.view(torch.int16), other_src.to(torch.bfloat16).view(torch.int16))
    src[2, 4, 1] = float("inf")
    plan.check()
    assert plan.bad_members() == sorted(big.members)  # the run is flagged; direct.nonfinite names the tensor
    # merge=False (the bucket pipeline's passes): one run per pair, so the flag names the pair itself
    single = CopyPlan([d for d, _ in pairs], [s for _, s in pairs], merge=False)
    assert sorted(m for r in single.runs for m in r.members) == list(range(9))
    assert all(len(r.members) == 1 for r in single.runs)
    single.check()
    assert single.bad_members() == [7]  # expert 2's w3 rows
    with pytest.raises(ValueError, match="pair 0 has 3 source and 2 destination elements"):
        CopyPlan([torch.zeros(2)], [torch.zeros(3)])


def _interpreter():
    import os

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs TRITON_INTERPRET=1 (set by tests/conftest.py before triton is imported)")


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")
@pytest.mark.parametrize("variant", sorted(KERNELS))
def test_copy_plan_kernel_variants_under_the_interpreter_match_torch_bitwise(variant):
    """Every kernel variant (TRITON_INTERPRET=1 on CPU, tests/conftest.py) against torch: full
    chunks (unmasked path), a run's tail (vectorised part + last elements), an unaligned group,
    fp32 -> fp16 casts (the interpreter's bf16 is wrong; bf16 rounding is checked on the GPU,
    tests/gpu), check-only writes nothing, copy + check flags exactly the runs holding a NaN / inf /
    fp16 overflow and sets the ``any`` flag."""
    _interpreter()
    block = KERNELS[variant].block
    g = torch.Generator().manual_seed(0)
    n = 2 * block + 37  # two full chunks, then a tail of 32 vectorised elements + 5 more
    a_src, a_dst = torch.randn(n, generator=g), torch.zeros(n + 8)
    h_src, h_dst = torch.randn(block + 9, generator=g) * 100, torch.zeros(block + 9, dtype=torch.float16)
    u_src, u_dst = torch.randn(301, generator=g).half(), torch.zeros(304, dtype=torch.float16)
    pairs = [(a_dst[:n], a_src), (h_dst, h_src), (u_dst[3:], u_src)]  # u: 6 bytes in, an unaligned group
    plan = CopyPlan([d for d, _ in pairs], [s for _, s in pairs], kernel=True, config=variant)
    assert plan.triton and len(plan.runs) == 3 and plan.config == KERNELS[variant]
    plan.check()
    assert not plan.any_bad() and plan.bad_runs() == [] and all(torch.count_nonzero(d) == 0 for d, _ in pairs)
    plan.copy()
    for d, s in pairs:
        assert torch.equal(d.view(torch.uint8), s.to(d.dtype).view(torch.uint8))
    assert torch.count_nonzero(a_dst[n:]) == 0 and torch.count_nonzero(u_dst[:3]) == 0
    k_a, k_h, k_u = (next(k for k, r in enumerate(plan.runs) if r.dst.data_ptr() == d.data_ptr()) for d, _ in pairs)
    for dst, src, i, value, run in (
        (a_dst, a_src, block - 1, float("nan"), k_a),  # last element of a full chunk
        (a_dst, a_src, 2 * block + 3, float("-inf"), k_a),  # vectorised part of the tail
        (a_dst, a_src, n - 1, float("nan"), k_a),  # the tail's last elements
        (h_dst, h_src, 5, 7e4, k_h),  # finite in fp32, +inf in fp16
        (u_dst, u_src, 300, float("inf"), k_u),
    ):
        keep = src[i].item()
        src[i] = value
        plan.copy_check()
        assert plan.any_bad() and plan.bad_runs() == [run], (i, plan.flags.tolist())
        assert not torch.isfinite(dst.float()).all()  # copy + check writes the values it flags
        src[i] = keep
    plan.check()
    assert not plan.any_bad()


def test_copy_plan_relocate_follows_a_moved_storage():
    """A destination storage that moves in place (as engine sleep level 2 / wake_up frees and
    regrows it): after ``relocate()`` the kernel writes the new address, not the old one."""
    _interpreter()
    g = torch.Generator().manual_seed(0)
    a_src, b_src = torch.randn(64, generator=g), torch.randn(64, generator=g)
    a_dst, b_dst = torch.zeros(64), torch.zeros(64)
    plan = CopyPlan([a_dst, b_dst], [a_src, b_src], kernel=True)
    assert len(plan.runs) == 2
    moving = plan.runs[-1].dst  # not the group's anchor (the first run), so its offset is in the table
    storage = moving.untyped_storage()
    old_ptr = storage.data_ptr()
    # Freed and regrown, the storage may land anywhere, its old address included (CI once got
    # it back). A CPU storage's resize_ allocates the new memory before it frees the old one,
    # so growing the live storage always moves it: the move this test needs, every time.
    storage.resize_(2 * 64 * 4)
    assert storage.data_ptr() != old_ptr
    moving.zero_()
    plan.relocate()
    plan.copy()
    assert torch.equal(a_dst, a_src) and torch.equal(b_dst, b_src)


class _Compiled:
    """Stands in for Triton's ``CompiledKernel``: records ``run`` calls."""

    def __init__(self):
        self.function, self.packed_metadata, self.runs = "fn", "meta", []

    def run(self, *args):
        self.runs.append(args)


class _Jit:
    """Stands in for ``runs_kernel``: records each full launch (parameters by name) and returns
    one compiled kernel per mode, as ``JITFunction.run`` does."""

    def __init__(self, arg_names):
        self.arg_names, self.calls, self.kernels = arg_names, [], {}

    def __getitem__(self, grid):
        def launch(*args, num_warps, **constexprs):
            params = dict(zip(self.arg_names, args)) | constexprs
            self.calls.append((grid, params))
            return self.kernels.setdefault((params["STORE"], params["CHECK"]), _Compiled())

        return launch


def test_copy_plan_launches_the_compiled_kernel_directly_after_its_first_launch(monkeypatch):
    """After a group's first launch of a mode through Triton's JIT function, later launches call
    the compiled kernel's launcher with what ``JITFunction.run`` passes (grid, stream, function,
    packed metadata, no launch metadata, no hooks, then every kernel parameter in signature
    order); binding the flags elsewhere or a launch hook being set takes the full path again."""
    from m3_rollout.weight_sync import copy_plan

    if copy_plan.triton is None:
        pytest.skip("needs triton")
    names = list(copy_plan.runs_kernel.arg_names)
    jit = _Jit(names)
    monkeypatch.setattr(copy_plan, "runs_kernel", jit)
    monkeypatch.setattr(copy_plan, "_use_triton", lambda device: True)
    monkeypatch.setattr(copy_plan, "_fast_launch_device", lambda device: True)
    monkeypatch.setattr(copy_plan, "_raw_stream", lambda index: 777)
    srcs = [torch.randn(300), torch.randn(5, 7).half()]
    dsts = [torch.empty(300, dtype=torch.bfloat16), torch.empty(35)]
    plan = CopyPlan(dsts, srcs)
    groups = len(plan._groups)
    assert groups == 2
    for _ in range(3):
        plan.copy()
        plan.copy_check()
    assert len(jit.calls) == 2 * groups  # one full launch per (group, mode)
    for (store, check), kernel in jit.kernels.items():
        full = [p for _, p in jit.calls if (p["STORE"], p["CHECK"]) == (store, check)]
        assert len(kernel.runs) == 2 * groups
        for k, call in enumerate(kernel.runs):
            params = full[k % groups]  # the launches of an update go over the groups in order
            assert call[:9] == (params["n_programs"], 1, 1, 777, "fn", "meta", None, None, None)
            assert len(call[9:]) == len(names)
            assert all(a is params[n] for a, n in zip(call[9:], names)), k
    flags = torch.zeros_like(plan.flags)
    plan.bind_flags(flags)
    plan.copy_check()
    assert len(jit.calls) == 3 * groups and jit.calls[-1][1]["flags"] is flags
    hook = lambda metadata: None  # noqa: E731
    copy_plan._RUNTIME.launch_enter_hook.add(hook)
    try:
        plan.copy_check()
        assert len(jit.calls) == 4 * groups  # a profiler's hook: the full path, which calls it
    finally:
        copy_plan._RUNTIME.launch_enter_hook.remove(hook)

"""Refit on one CUDA GPU (weight_sync/copy_plan.py, weight_sync/ipc.py). Skipped without CUDA.

Checks: every Triton copy-plan variant (``copy_plan.KERNELS``) rounds fp32 -> bf16 exactly like
torch and flags an overflow in the same pass; the direct in-process update through
``ReleasedTensors`` (cached plan, reused across updates) is bitwise and in place, and refuses a NaN
keeping the old weights, from the masters (check pass) and from an attested bf16 cast copy
(``CastCopy``: no check pass; a NaN in the master refused from the cast's flags); one GRPO step with
the in-process engine where the engine sleeps at level 2 while the trainer trains and the refit
after ``wake_up`` is bitwise equal to the trainer's cast; the same in two processes on the GPU
(the engine in a spawned worker refit through the trainer's CUDA IPC stage, after its own
sleep / wake-up), with the worker killed and restarted mid-run; a worker refit from the trainer's
attested compute copy itself, opened by CUDA IPC handle (no stage), with the cast refused while
the copy is lent to an unacknowledged update. About a minute on an H200.
"""

from __future__ import annotations

import sys
import traceback
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: mp_results

import torch.multiprocessing as mp  # noqa: E402
from mp_results import get_results, put_result  # noqa: E402

from m3_rollout.model import iter_released_tensors  # noqa: E402
from m3_rollout.rollout.group_rollout import run_group_rollouts  # noqa: E402
from m3_rollout.weight_sync import (  # noqa: E402
    CastCopy,
    ColocatedChannel,
    IpcChannel,
    IpcRolloutSync,
    ReleasedTensors,
    WeightReceiver,
    WeightSender,
    WeightUpdateError,
)
from m3_rollout.weight_sync.copy_plan import KERNELS, CopyPlan  # noqa: E402
from m3_rollout.weight_sync.direct import nonfinite  # noqa: E402
from m3_trainers.batch import TrainBatch  # noqa: E402

TIMEOUT_S = 300.0
ROOT = Path(__file__).resolve().parents[2]


def _job_imports():
    """The job / config layer (omegaconf): imported by the GRPO-step tests only, so the kernel and
    direct-path tests run on a device without omegaconf; those tests skip there."""
    pytest.importorskip("omegaconf")
    from m3_rollout.config import load_config
    from m3_rollout.jobs.stack import build_generation_backend, build_rollout_stack
    from m3_trainers.step import build_loss_fn, build_policy, load_trainer_model, train_step_on_groups
    from m3_trainers.weight_sender import build_weight_sender

    return (
        load_config,
        build_generation_backend,
        build_rollout_stack,
        build_loss_fn,
        build_policy,
        load_trainer_model,
        train_step_on_groups,
        build_weight_sender,
    )


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("variant", sorted(KERNELS))
def test_copy_plan_kernel_rounds_like_torch_and_flags_overflow(variant):
    g = torch.Generator(device="cuda").manual_seed(0)
    block = KERNELS[variant].block
    srcs = [torch.randn(n, device="cuda", generator=g) * 3 for n in (3 * block + 5, 7, 4096)]
    srcs.append(torch.randn(1000, device="cuda", generator=g).to(torch.bfloat16))
    buf = torch.zeros(3 * block + 5 + 3 + 4096 + 1000, dtype=torch.bfloat16, device="cuda")
    router = torch.zeros(7, device="cuda")  # an fp32 destination (router tensors stay fp32)
    o = 3 * block + 5
    dsts = [buf[:o], router, buf[o + 3 : o + 3 + 4096], buf[o + 3 + 4096 :]]  # one starts unaligned
    plan = CopyPlan(dsts, srcs, config=variant)
    assert plan.triton
    plan.check()
    assert plan.bad_runs() == [] and torch.count_nonzero(buf) == 0
    plan.copy()
    for d, s in zip(dsts, srcs):
        assert torch.equal(_bits(d), _bits(s.to(d.dtype)))
    srcs[0][2 * block + 1] = 3.4e38  # finite in fp32 (max 3.403e38), rounds to +inf in bf16 (max 3.390e38)
    plan.copy_check()
    members = plan.bad_members()
    assert 0 in members and [
        members[i] for i in nonfinite([srcs[i] for i in members], [dsts[i].dtype for i in members])
    ] == [0]


def _bench():
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_weight_sync", ROOT / "scripts" / "bench_weight_sync.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("atomic", [True, False])
def test_direct_update_with_cached_plan_bitwise_in_place_and_refuses_nan(atomic):
    bench = _bench()
    cfg = bench.synthetic_config(0.2)
    trainer = bench.build_model(1, torch.float32, "cuda", cfg=cfg)  # fp32 masters -> bf16 rollout
    rollout = bench.build_model(0, torch.bfloat16, "cuda", cfg=cfg)
    rx = WeightReceiver(rollout, atomic=atomic)
    source = ReleasedTensors(trainer)
    sender = WeightSender(lambda: source, ColocatedChannel([rx], "cuda", direct=True), 64, torch.bfloat16)
    ptrs = {n: p.data_ptr() for n, p in rollout.named_parameters()}
    t = dict(trainer.named_parameters())
    for version in (1, 2):
        sender.update(version, include_frozen=True)  # version 2 reuses the plan built by version 1
        for n, p in rollout.named_parameters():
            assert p.data_ptr() == ptrs[n] and torch.equal(_bits(p), _bits(t[n].to(p.dtype))), n
        with torch.no_grad():
            for q in trainer.parameters():
                q.mul_(-1.25)  # in place: the cached plan reads the new values
    old = {n: p.detach().clone() for n, p in rollout.named_parameters()}
    with torch.no_grad():
        t["model.layers.1.block_sparse_moe.experts.w13"][3, 0, 0] = float("nan")
    with pytest.raises(WeightUpdateError, match=r"non-finite values in .*layers\.1\.block_sparse_moe\.experts\.3\.w1"):
        sender.update(3, include_frozen=True)
    assert rx.version == 2 and rx.valid
    assert all(torch.equal(_bits(p), _bits(old[n])) for n, p in rollout.named_parameters())


@pytest.mark.parametrize("atomic", [True, False])
def test_attested_direct_update_is_bitwise_and_refuses_a_nan_in_the_master(atomic):
    bench = _bench()
    cfg = bench.synthetic_config(0.2)
    master = bench.build_model(1, torch.float32, "cuda", cfg=cfg)
    compute = bench.build_model(2, torch.bfloat16, "cuda", cfg=cfg)  # the trainer's bf16 copy
    cast = CastCopy(master, compute)
    rollout = bench.build_model(0, torch.bfloat16, "cuda", cfg=cfg)
    rx = WeightReceiver(rollout, atomic=atomic)
    named = ReleasedTensors(master, cast=cast)
    sender = WeightSender(lambda: named, ColocatedChannel([rx], "cuda", direct=True), 64, torch.bfloat16)
    ptrs = {n: p.data_ptr() for n, p in rollout.named_parameters()}
    t = dict(master.named_parameters())
    for version in (1, 2):
        sender.update(version, include_frozen=True)
        assert rx.last_verdict == "attested" and cast.casts == version
        for n, p in rollout.named_parameters():
            assert p.data_ptr() == ptrs[n] and torch.equal(_bits(p), _bits(t[n].to(p.dtype))), n
        with torch.no_grad():
            for q in master.parameters():
                q.mul_(-1.25)  # an optimizer step: the next update re-casts
    old = {n: p.detach().clone() for n, p in rollout.named_parameters()}
    with torch.no_grad():
        t["model.layers.1.block_sparse_moe.experts.w13"][3, 0, 0] = float("nan")
    with pytest.raises(WeightUpdateError, match=r"non-finite values in .*layers\.1\.block_sparse_moe\.experts\.3\.w1"):
        sender.update(3, include_frozen=True)
    assert rx.last_verdict == "attested" and rx.version == 2 and rx.valid
    assert all(torch.equal(_bits(p), _bits(old[n])) for n, p in rollout.named_parameters())


def _overrides(out) -> list[str]:
    return [
        "cluster.device=cuda",
        "cluster.launcher=auto",
        "policy.generation.expert_parallel_size=1",
        "policy.precision=bfloat16",
        "policy.generation.enable_cuda_graphs=true",
        "policy.generation.kv_cache_memory_gb=1.0",
        "grpo.max_num_steps=1",
        "grpo.val_at_start=false",
        "grpo.val_at_end=false",
        "checkpointing.enabled=false",
        "logger.wandb_enabled=false",
        f"logger.log_dir={out}/logs",
        f"checkpointing.checkpoint_dir={out}/ckpt",
    ]


@pytest.fixture()
def out(tmp_path, monkeypatch):
    monkeypatch.setenv("M3_ROLLOUT_CACHE", str(tmp_path / "cache"))  # inherited by spawned workers
    return tmp_path / "run"


def _assert_engine_is_trainer_cast(engine_tensors, master: dict) -> None:
    for name, t in engine_tensors:
        want = master[name].to(t.device, t.dtype)  # bf16 cast; router gate / bias: the fp32 master
        assert torch.equal(_bits(t), _bits(want)), name


def test_grpo_step_in_process_refit_after_sleep_wake_is_bitwise(out):
    (
        load_config,
        build_generation_backend,
        build_rollout_stack,
        build_loss_fn,
        build_policy,
        load_trainer_model,
        train_step_on_groups,
        build_weight_sender,
    ) = _job_imports()
    cfg = load_config(str(ROOT / "configs/grpo_smoke.yaml"), _overrides(out))
    stack = build_rollout_stack(cfg, with_backend=False)
    backend = None
    try:
        policy = build_policy(cfg, load_trainer_model(cfg, stack.model_dir), 1)
        backend = build_generation_backend(cfg, stack.model_dir, stack.chat, stack.max_len)
        engine = backend.engine
        backend.update_weights(0, policy.named_released_tensors())
        records = stack.source.train_batch(1, cfg.grpo.num_prompts_per_step)
        trajs, _ = run_group_rollouts(backend, stack.chat, stack.env, records, stack.settings_for(cfg, 1))
        backend.sleep(2)  # weights to host while the trainer trains (policy.generation.sleep_level=2)
        adv = torch.tensor([1.0, -1.0] * (len(trajs) // 2))
        res = train_step_on_groups(
            policy, build_loss_fn(cfg.loss_fn), trajs, cfg, cfg.policy.generation.temperature, advantages=adv
        )
        assert not res.metrics["skipped_step"]
        with pytest.raises(RuntimeError, match="wake_up"):
            backend.update_weights(1, policy.named_released_tensors())
        backend.wake_up()
        ptrs = [p.data_ptr() for p in engine.model.parameters()]
        backend.update_weights(1, policy.named_released_tensors())
        assert backend.weight_sync.receiver.last_verdict == "attested"  # the policy's bf16 copy, from its flags
        assert [p.data_ptr() for p in engine.model.parameters()] == ptrs
        _assert_engine_is_trainer_cast(iter_released_tensors(engine.model), dict(policy.named_released_tensors()))
        again, _ = run_group_rollouts(backend, stack.chat, stack.env, records[:1], stack.settings_for(cfg, 2))
        assert all(t.num_generated > 0 for t in again)  # captured graphs read the refit storage
    finally:
        stack.env.close()
        if backend is not None:
            backend.shutdown()


def _engine_worker(overrides: list[str], endpoint, tag: str, updates: int, results) -> None:
    """A rollout worker process: the in-process engine of the config on this GPU, refit through the
    trainer's IPC stage by the engine's own receiver; sleeps (level 2) and wakes between updates;
    reports each update with its engine weights (copied to the host) by value."""
    try:
        from m3_rollout.config import load_config
        from m3_rollout.jobs.stack import build_rollout_stack

        cfg = load_config(str(ROOT / "configs/grpo_smoke.yaml"), overrides)
        stack = build_rollout_stack(cfg)
        backend = stack.backend
        sync = IpcRolloutSync(backend.weight_sync.receiver, endpoint, timeout_s=TIMEOUT_S)
        for k in range(updates):
            if k > 0:
                backend.sleep(2)
                backend.wake_up()
            outcome = sync.update(wait_s=float("inf"))
            if outcome is None:
                break
            r = outcome.result
            records = stack.source.train_batch(1, 1)
            trajs, _ = run_group_rollouts(backend, stack.chat, stack.env, records, stack.settings_for(cfg, 1))
            put_result(
                results,
                {
                    "tag": f"{tag}{k}",
                    "ok": r.ok,
                    "version": r.version,
                    "errors": r.errors,
                    "generated": sum(t.num_generated for t in trajs),
                    "weights": {n: t.detach().cpu() for n, t in iter_released_tensors(backend.engine.model)},
                },
            )
        stack.env.close()
        backend.shutdown()
    except Exception:  # noqa: BLE001
        put_result(results, {"tag": f"{tag}-error", "error": traceback.format_exc()})


def _policy_step(policy, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, 200, (4, 24), generator=g)
    mask = torch.zeros(4, 24)
    mask[:, 8:] = 1
    batch = TrainBatch(ids, mask, torch.zeros(4, 24), torch.tensor([1.0, -1.0, 0.5, -0.5]), torch.full((4,), 24))
    from m3_trainers.loss import ClippedPGLossFn

    m = policy.train_step(batch, ClippedPGLossFn(), 1.0, 2)
    assert m["grad_norm"] > 0


def test_grpo_step_two_processes_ipc_refit_bitwise_and_worker_restart(out):
    (
        load_config,
        build_generation_backend,
        build_rollout_stack,
        build_loss_fn,
        build_policy,
        load_trainer_model,
        train_step_on_groups,
        build_weight_sender,
    ) = _job_imports()
    overrides = _overrides(out)
    cfg = load_config(str(ROOT / "configs/grpo_smoke.yaml"), overrides)
    stack = build_rollout_stack(cfg, with_backend=False)  # builds the cached checkpoint first
    stack.env.close()
    policy = build_policy(cfg, load_trainer_model(cfg, stack.model_dir), 1)
    channel = IpcChannel(n_workers=1, device="cuda", timeout_s=TIMEOUT_S)
    gen_dtype = getattr(torch, cfg.policy.generation.dtype)
    sender = build_weight_sender(policy, cfg.weight_sync, gen_dtype, cfg.policy.freeze, ipc=channel)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_engine_worker, args=(overrides, channel.endpoint, "first", 3, results))]
    procs[0].start()
    try:
        sender.update(1, include_frozen=True)
        got = get_results(results, 1, TIMEOUT_S, "tag")["first0"]
        assert got["ok"] and got["version"] == 1 and got["generated"] > 0
        _assert_engine_is_trainer_cast(got["weights"].items(), dict(policy.named_released_tensors()))

        _policy_step(policy, 1)  # one training step on the GPU, then the refit after the worker's wake-up
        sender.update(2)
        got = get_results(results, 1, TIMEOUT_S, "tag")["first1"]
        assert got["ok"] and got["version"] == 2 and got["generated"] > 0
        _assert_engine_is_trainer_cast(got["weights"].items(), dict(policy.named_released_tensors()))

        procs[0].kill()  # mid-run: the next update fails, a restarted worker is refit
        procs[0].join(TIMEOUT_S)
        _policy_step(policy, 2)
        with pytest.raises(WeightUpdateError):
            sender.update(3)
        procs.append(ctx.Process(target=_engine_worker, args=(overrides, channel.endpoint, "again", 1, results)))
        procs[1].start()
        sender.update(4, include_frozen=True)
        got = get_results(results, 1, TIMEOUT_S, "tag")["again0"]
        assert got["ok"] and got["version"] == 4 and got["generated"] > 0
        _assert_engine_is_trainer_cast(got["weights"].items(), dict(policy.named_released_tensors()))
    finally:
        channel.close()
        for p in procs:
            p.join(TIMEOUT_S)
            if p.is_alive():
                p.kill()


# ------------------------------------------------------------------ IPC from the trainer's compute copy
def _copy_worker(endpoint, tag: str, results) -> None:
    """A rollout worker process on this GPU: a bare bf16 receiver refit by IPC; reports each
    update with its weights copied to the host (by value)."""
    try:
        from m3_rollout.model import M3ForCausalLM, tiny_config

        torch.manual_seed(0)
        model = M3ForCausalLM(tiny_config()).cast_for_inference(torch.bfloat16).cuda().eval()
        rx = WeightReceiver(model, atomic=tag.endswith("atomic"), version=0)
        ptrs = [p.data_ptr() for p in model.parameters()]

        def report(outcome) -> None:
            r = outcome.result
            put_result(
                results,
                {
                    "tag": tag,
                    "ok": r.ok,
                    "version": r.version,
                    "valid": r.valid,
                    "errors": r.errors,
                    "moved": [p.data_ptr() for p in model.parameters()] != ptrs,
                    "weights": {n: p.detach().cpu() for n, p in model.named_parameters()},
                },
            )

        IpcRolloutSync(rx, endpoint, timeout_s=TIMEOUT_S).serve(on_update=report)
    except Exception:  # noqa: BLE001
        put_result(results, {"tag": tag, "error": traceback.format_exc()})


def _is_cast_of(weights: dict, master) -> bool:
    m = dict(master.named_parameters())
    return all(torch.equal(_bits(w), _bits(m[n].detach().to(w.dtype).cpu())) for n, w in weights.items())


def test_ipc_refit_reads_the_trainers_compute_copy_by_cuda_ipc():
    """The worker opens the trainer's attested bf16 compute copy by CUDA IPC handle and refits
    straight from it (no stage on the GPU): bitwise the masters' cast; a NaN in a master refused
    from the cast's flags, old weights kept; the cast refuses to run while the copy is lent to an
    update the (killed) worker never acknowledged, until the channel is rebuilt for the restarted
    worker, which is refit bitwise. The first worker is non-atomic, the restarted one atomic."""
    import copy

    from m3_rollout.model import M3ForCausalLM, tiny_config

    torch.manual_seed(1)
    master = M3ForCausalLM(tiny_config()).float().cuda()
    cast = CastCopy(master, copy.deepcopy(master).cast_for_inference(torch.bfloat16))
    cast.refresh()
    named = ReleasedTensors(master, cast=cast)
    channel = IpcChannel(n_workers=1, device="cuda", timeout_s=60.0)
    sender = WeightSender(lambda: named, channel, generation_dtype=torch.bfloat16)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_copy_worker, args=(channel.endpoint, "first-direct", results))]
    procs[0].start()
    try:
        sender.update(1, include_frozen=True)
        got = get_results(results, 1, TIMEOUT_S, "tag")["first-direct"]
        assert got["ok"] and got["version"] == 1 and not got["moved"] and _is_cast_of(got["weights"], master)
        assert channel.stats["source"] == "copy" and channel.stage is None and cast.lent_to is None
        w2 = dict(master.named_parameters())["model.layers.2.block_sparse_moe.experts.w2"]
        with torch.no_grad():
            w2[5, 0, 0] = float("nan")
        with pytest.raises(WeightUpdateError, match="non-finite values in language_model.model.layers.2"):
            sender.update(2)
        bad = get_results(results, 1, TIMEOUT_S, "tag")["first-direct"]
        assert not bad["ok"] and bad["version"] == 1 and bad["valid"]
        assert all(torch.equal(bad["weights"][n], w) for n, w in got["weights"].items())
        with torch.no_grad():
            w2[5, 0, 0] = 0.5
            for p in master.parameters():
                p.mul_(-1.5)
        sender.update(3, include_frozen=True)  # every parameter moved, the frozen ones too
        got = get_results(results, 1, TIMEOUT_S, "tag")["first-direct"]
        assert got["ok"] and got["version"] == 3 and _is_cast_of(got["weights"], master)

        procs[0].kill()
        procs[0].join(TIMEOUT_S)
        with torch.no_grad():
            for p in master.parameters():
                p.add_(0.125)
        with pytest.raises(WeightUpdateError):
            sender.update(4)
        assert cast.lent_to is not None
        with torch.no_grad():
            next(master.parameters()).mul_(0.5)
        with pytest.raises(RuntimeError, match="lent to the IPC refit to version 4"):
            cast.refresh()
        procs.append(ctx.Process(target=_copy_worker, args=(channel.endpoint, "again-atomic", results)))
        procs[1].start()
        sender.update(5, include_frozen=True)
        got = get_results(results, 1, TIMEOUT_S, "tag")["again-atomic"]
        assert got["ok"] and got["version"] == 5 and _is_cast_of(got["weights"], master)
        assert channel.stats["source"] == "copy" and cast.lent_to is None
    finally:
        channel.close()
        for p in procs:
            p.join(TIMEOUT_S)
            if p.is_alive():
                p.kill()

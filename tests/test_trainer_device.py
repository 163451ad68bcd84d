"""Trainer device and precision: the device keys checked at start (exit 2 naming the key), the
bf16 compute copy over fp32 masters, activation checkpointing (with routing replay), the counted
FLOPs, and the step's metrics computed on the device the policy lives on (device=cpu here, through
the same code as CUDA; tests/gpu/test_grpo_gpu.py runs it on a GPU)."""

import pytest
import torch

from m3_rollout.config import ConfigError, check_devices, load_config
from m3_rollout.model import M3ForCausalLM, tiny_config
from m3_trainers.batch import TrainBatch
from m3_trainers.loss import ClippedPGLossFn
from m3_trainers.policy import Policy, active_parameter_count, token_logprobs
from m3_trainers.step import build_policy, master_dtype


def _model(seed=0):
    torch.manual_seed(seed)
    m = M3ForCausalLM(tiny_config(vocab_size=50, max_position_embeddings=128))
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.1 if p.ndim >= 2 else 0.05)
    return m


def _batch(b=4, l=12, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 50, (b, l), generator=g)
    mask = torch.zeros(b, l)
    mask[:, 5:] = 1
    mask[1, 9:] = 0
    lengths = torch.full((b,), l)
    lengths[1] = 9
    ids[1, 9:] = 0
    return TrainBatch(ids, mask, torch.zeros(b, l), torch.tensor([1.0, -0.5, 0.25, -1.0])[:b], lengths)


# ------------------------------------------------------------------ config keys and start checks
def test_device_and_precision_keys_load_and_bad_values_name_the_key():
    cfg = load_config(
        "configs/grpo_bf16_ep.yaml",
        ["cluster.device=cuda:1", "policy.precision=bfloat16", "policy.activation_checkpointing=true"],
    )
    assert cfg.cluster.device == "cuda:1" and cfg.policy.precision == "bfloat16"
    assert cfg.policy.activation_checkpointing is True and master_dtype(cfg) == torch.float32
    assert load_config("configs/grpo_bf16_ep.yaml").cluster.device == "cpu"
    with pytest.raises(ConfigError, match=r"cluster.device='gpu0'"):
        load_config("configs/grpo_bf16_ep.yaml", ["cluster.device=gpu0"])
    with pytest.raises(ConfigError, match=r"policy.precision='fp16'"):
        load_config("configs/grpo_bf16_ep.yaml", ["policy.precision=fp16"])


@pytest.mark.parametrize(
    "overrides, available, count, needle",
    [
        (["cluster.device=cuda"], False, 0, r"has 0 CUDA device\(s\) \(.*\); use cluster.device=cpu$"),
        (["cluster.device=cuda:2"], True, 2, r"cluster.device='cuda:2': this machine has 2 CUDA.*or an index < 2$"),
        (["cluster.gpus_per_node=4"], True, 1, r"cluster.gpus_per_node=4: this machine has 1 CUDA"),
        (["cluster.gpus_per_node=2"], False, 0, r"cluster.gpus_per_node=2: this machine has 0"),
        # started the EP workers, then died in their NCCL init with a traceback (exit 1)
        (["weight_sync.backend=nccl"], False, 0, r"weight_sync.backend='nccl': NCCL needs CUDA devices"),
    ],
)
def test_check_devices_names_the_key(overrides, available, count, needle):
    cfg = load_config("configs/grpo_bf16_ep.yaml", overrides)
    with pytest.raises(ConfigError, match=needle):
        check_devices(cfg, available, count)


def test_check_devices_accepts_what_exists():
    check_devices(load_config("configs/grpo_bf16_ep.yaml"), False, 0)
    cfg = load_config("configs/grpo_bf16_ep.yaml", ["cluster.device=cuda:1", "cluster.gpus_per_node=2"])
    check_devices(cfg, True, 2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_job_asking_for_a_gpu_without_one_exits_2_naming_the_key(tmp_path, capsys, monkeypatch):
    from m3_rollout.jobs.grpo import main

    monkeypatch.setenv("M3_ROLLOUT_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as exc:
        main(
            [
                "--config",
                "configs/grpo_smoke.yaml",
                "cluster.device=cuda",
                f"logger.log_dir={out}/logs",
                f"checkpointing.checkpoint_dir={out}/ckpt",
            ]
        )
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "cluster.device='cuda'" in err and "torch.cuda.is_available() is False" in err
    assert not (tmp_path / "cache").exists()  # stopped before a checkpoint was built
    assert not out.exists()  # and before the output directories were created


def test_build_policy_follows_the_config():
    cfg = load_config("configs/grpo_smoke.yaml", ["policy.precision=bfloat16", "policy.activation_checkpointing=true"])
    policy = build_policy(cfg, _model(), 1)
    assert policy.device == torch.device("cpu") and policy.model.lm_head.weight.dtype == torch.float32
    assert policy.compute is not policy.model and policy.compute.lm_head.weight.dtype == torch.bfloat16
    fp32 = build_policy(load_config("configs/grpo_smoke.yaml"), _model(), 1)
    assert fp32.compute is fp32.model  # the CPU main job: no copy


# ------------------------------------------------------------------ bf16 compute over fp32 masters
def test_bf16_compute_copy_is_the_masters_cast_and_steps_the_masters():
    m = _model()
    policy = Policy(m, lr=1e-2, compute_dtype=torch.bfloat16)
    c = policy.compute
    # cast like the generator: bf16 weights, router gate and bias in fp32 (spec §6)
    assert c.lm_head.weight.dtype == torch.bfloat16 and m.lm_head.weight.dtype == torch.float32
    assert all(moe.gate.weight.dtype == torch.float32 for moe in c.moe_layers())
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    metrics = policy.train_step(_batch(), ClippedPGLossFn(), 1.0, 2)
    assert metrics["grad_norm"] > 0 and not metrics["skipped_step"]
    # masters moved in fp32, with fp32 grads and AdamW states
    moved = [n for n, p in m.named_parameters() if not torch.equal(p, before[n])]
    assert moved and all(p.grad is None or p.grad.dtype == torch.float32 for p in m.parameters())
    state = policy.optimizer.state[m.lm_head.weight]
    assert state["exp_avg"].dtype == torch.float32
    # no gradient is left on the copy; the next call refreshes it from the masters, bitwise
    assert all(p.grad is None for p in c.parameters())
    policy.get_logprobs(_batch(), 1.0, 4)
    for (n, pm), pc in zip(m.named_parameters(), c.parameters()):
        assert torch.equal(pc, pm.to(pc.dtype)), n


def test_the_compute_copy_is_cast_once_per_optimizer_step_with_flags_a_refit_can_trust():
    """The refresh is one fused cast (weight_sync.CastCopy) right after each optimizer step, skipped
    while the masters are unchanged, redone when something else wrote them (a checkpoint load);
    its flags are current for the copy the refit sends."""
    m = _model()
    policy = Policy(m, lr=1e-2, compute_dtype=torch.bfloat16)
    released = policy.named_released_tensors()
    cast = released.cast
    assert policy.named_released_tensors() is released and cast.master is m and cast.copy is policy.compute
    assert cast.casts == 1 and cast.current() and not cast.any_bad()
    policy.train_step(_batch(), ClippedPGLossFn(), 1.0, 2)
    assert cast.casts == 2 and cast.current()  # after the step; the step's own scoring cast nothing
    for (n, pm), pc in zip(m.named_parameters(), policy.compute.parameters()):
        assert torch.equal(pc, pm.to(pc.dtype)), n
    policy.get_logprobs(_batch(), 1.0, 4)
    assert cast.casts == 2
    with torch.no_grad():
        m.lm_head.weight.mul_(0.5)  # the masters written outside the optimizer (a checkpoint load)
    policy.get_logprobs(_batch(), 1.0, 4)
    assert cast.casts == 3 and torch.equal(policy.compute.lm_head.weight, m.lm_head.weight.to(torch.bfloat16))
    assert Policy(_model(), lr=1e-2).named_released_tensors().cast is None  # full precision: no copy


def test_bf16_gradient_is_close_to_the_fp32_one_and_accumulates_in_fp32():
    grads = {}
    for dtype, mbs in ((None, 4), (torch.bfloat16, 4), (torch.bfloat16, 1)):
        m = _model()
        policy = Policy(m, lr=1e-3, max_grad_norm=1e9, compute_dtype=dtype)
        policy.train_step(_batch(), ClippedPGLossFn(), 1.0, mbs)
        grads[(dtype, mbs)] = torch.cat([p.grad.flatten() for p in m.parameters() if p.grad is not None])
    ref = grads[(None, 4)]
    for key in ((torch.bfloat16, 4), (torch.bfloat16, 1)):
        g = grads[key]
        cos = torch.nn.functional.cosine_similarity(g, ref, dim=0)
        assert g.dtype == torch.float32 and cos > 0.99, (key, float(cos))


def test_bf16_reference_model_is_a_frozen_bf16_copy():
    policy = Policy(_model(), lr=1e-2, compute_dtype=torch.bfloat16, reference_model=True)
    assert policy.reference.lm_head.weight.dtype == torch.bfloat16
    assert not any(p.requires_grad for p in policy.reference.parameters())
    fn = ClippedPGLossFn(reference_policy_kl_penalty=0.1)
    first = policy.train_step(_batch(), fn, 1.0, 4)
    second = policy.train_step(_batch(), fn, 1.0, 4)
    assert first["kl_penalty"] == pytest.approx(0.0, abs=1e-6) and second["kl_penalty"] > 0


# ------------------------------------------------------------------ activation checkpointing
def _record(model, ids):
    with torch.no_grad():
        model(ids)
    b, l = ids.shape
    return torch.stack([moe.last_topk_ids.view(b, l, -1) for moe in model.moe_layers()], dim=2)


@pytest.mark.parametrize("replay", [False, True])
def test_activation_checkpointing_gives_the_same_loss_and_gradients(replay):
    """fp64: checkpointed layers recompute exactly what the plain forward kept, also when the
    MoE replays routes recorded by another model (the recompute runs after replay_routing ended)."""
    batch = _batch()
    if replay:
        other = _model(5).double()
        batch.routed_experts = _record(other, batch.token_ids)
    out = {}
    for ckpt in (False, True):
        m = _model().double()
        policy = Policy(m, lr=1e-3, max_grad_norm=1e9, routing_replay=replay, activation_checkpointing=ckpt)
        metrics = policy.train_step(batch, ClippedPGLossFn(), 1.0, 2)
        out[ckpt] = metrics["loss"], {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
    assert out[True][0] == pytest.approx(out[False][0], rel=1e-12)
    assert out[True][1].keys() == out[False][1].keys()
    for n, g in out[False][1].items():
        assert torch.allclose(out[True][1][n], g, rtol=1e-10, atol=1e-14), n
    if replay:  # the replayed routes really changed the gradient
        m = _model().double()
        Policy(m, lr=1e-3, max_grad_norm=1e9).train_step(batch, ClippedPGLossFn(), 1.0, 2)
        n = "lm_head.weight"
        assert (m.lm_head.weight.grad - out[True][1][n]).abs().max() > 1e-6


def test_activation_checkpointing_keeps_parameter_names_and_no_grad_path():
    m = _model()
    names = [n for n, _ in m.named_parameters()]
    policy = Policy(m, lr=1e-3, activation_checkpointing=True)
    assert [n for n, _ in policy.model.named_parameters()] == names
    ids = _batch().token_ids
    with torch.no_grad():
        assert torch.equal(token_logprobs(policy.model, ids), token_logprobs(_model(), ids))


# ------------------------------------------------------------------ counted FLOPs and metrics
def test_active_parameters_count_the_routed_experts_at_top_k_over_e():
    m = _model()
    cfg = m.config
    expert = sum(p.numel() for n, p in m.named_parameters() if ".experts.w" in n)
    embed = m.model.embed_tokens.weight.numel()
    total = sum(p.numel() for p in m.parameters())
    want = total - embed - expert + expert * cfg.num_experts_per_tok / cfg.num_local_experts
    assert abs(active_parameter_count(m) - want) <= 1 and cfg.num_experts_per_tok < cfg.num_local_experts


def test_train_step_reports_counted_flops_and_throughput():
    m = _model()
    policy = Policy(m, lr=1e-3)
    batch = _batch()
    metrics = policy.train_step(batch, ClippedPGLossFn(), 1.0, 2)
    n = active_parameter_count(m)
    # micro-batches of 2 rows, each trimmed to its longest row: rows 0-1 -> 12, rows 2-3 -> 12
    assert metrics["train_flops"] == 6 * n * 4 * 12
    assert metrics["logprob_flops"] == 2 * n * 4 * 12  # the prev-logprob forward
    assert metrics["train_tflops_per_s"] == pytest.approx(metrics["train_flops"] / metrics["train_seconds"] / 1e12)


def test_logprobs_live_on_the_policy_device_and_metrics_are_python_numbers():
    policy = Policy(_model(), lr=1e-3, device="cpu")
    batch = _batch()
    lp = policy.get_logprobs(batch, 1.0, 3)
    assert lp.device == policy.device and lp.dtype == torch.float32 and lp.shape == batch.token_ids.shape
    metrics = policy.train_step(batch, ClippedPGLossFn(), 1.0, 3)
    assert all(isinstance(v, (int, float, bool)) for v in metrics.values())
    # rollout logprobs equal to the trainer's: no mismatch
    again = policy.get_logprobs(batch, 1.0, 3)
    batch.rollout_logprobs = again * batch.loss_mask
    same = policy.train_step(batch, ClippedPGLossFn(), 1.0, 3)
    assert same["token_mult_prob_error"] == pytest.approx(1.0, abs=1e-6) and same["gen_kl_error"] < 1e-10

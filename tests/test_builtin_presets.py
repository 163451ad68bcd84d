"""Built-in checkpoint presets: stable cache keys, the GPU preset's shape, a CPU build of its pipeline."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from m3_rollout.jobs import builtin
from m3_rollout.model import M3ForCausalLM, load_checkpoint, tiny_config
from m3_trainers.warm_start import WarmStartConfig

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def test_cpu_presets_keep_their_cache_keys():
    # Keys of the builds made before the template / task / device fields existed: the CPU main job
    # keeps using its cached checkpoint (and its accuracies).
    assert builtin.builtin_spec("tiny-calculator", "cpu").key() == "2a33a638673bc974"
    assert builtin.builtin_spec("tiny-random", "cpu").key() == "e654ede72c36b0be"
    # Random weights do not depend on the device; a warm start does.
    assert builtin.builtin_spec("tiny-random", "cuda").key() == "e654ede72c36b0be"
    assert builtin.builtin_spec("tiny-calculator", "cuda:0").key() != "2a33a638673bc974"
    assert builtin.builtin_spec("tiny-calculator", "cuda:0").device == "cuda"


def test_gpu_preset_shape():
    spec = builtin.builtin_spec("m3-gpu-small", "cuda")
    assert spec.template == "m3_full" and spec.task_name == "multistep" and spec.device == "cuda"
    assert spec.key() != builtin.builtin_spec("m3-gpu-small", "cpu").key()
    cfg = tiny_config(vocab_size=1024, **spec.model_overrides)
    assert [cfg.is_sparse_layer(i) for i in range(cfg.num_hidden_layers)] == [False] + [True] * 7
    assert (cfg.sparse_block_size, cfg.sparse_topk_blocks, cfg.num_local_experts, cfg.num_experts_per_tok) == (
        64,
        4,
        16,
        4,
    )
    with torch.device("meta"):
        n = sum(p.numel() for p in M3ForCausalLM(cfg).parameters())
    assert 150e6 < n < 180e6  # 164.6 M with the preset's ~1,024-token vocabulary
    assert spec.warm_start.max_seconds <= 300 and spec.eval_max_turns == 4


def _cpu_sized_gpu_spec() -> builtin.TinyCheckpointSpec:
    """The m3-gpu-small build (full template, multi-step task, 4-turn held-out rollouts) at CPU size:
    two SFT steps towards an unreachable window, so it stops at max_steps."""
    return dataclasses.replace(
        builtin.gpu_small_spec(),
        model_overrides={
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "moe_layer_freq": [0, 1],
            "sparse_attention_freq": [0, 1],
            "sparse_disable_index_value": [0, 1],
            "sparse_block_size": 64,
            "max_position_embeddings": 1024,
        },
        tokenizer_vocab_size=512,
        tokenizer_corpus=300,
        num_val=4,
        warm_start=WarmStartConfig(batch_size=2, max_steps=2, eval_every=1, target_low=0.99, target_high=1.0),
        eval_max_new_tokens=8,
        device="cpu",
    )


def test_gpu_preset_pipeline_builds_on_cpu(tmp_path):
    spec = _cpu_sized_gpu_spec()
    report = builtin.build_checkpoint(spec, tmp_path / "ckpt", progress=False)
    assert report["warm_start_steps"] <= 2 and not report["in_window"]
    assert [s for s, _ in report["history"]] == [0, 1, 2]
    assert report["step_seconds"] > 0 and report["eval_seconds"] > 0
    assert json.loads((tmp_path / "ckpt" / "build_report.json").read_text())["spec"]["task_name"] == "multistep"
    model = load_checkpoint(tmp_path / "ckpt", dtype=torch.float32)
    assert model.config.sparse_block_size == 64
    assert "<thinking_instructions>" in (tmp_path / "ckpt" / "chat_template.jinja").read_text()


def test_build_progress_prints_the_step_0_evaluation_and_has_a_total(tmp_path, capsys, monkeypatch):
    # The build announces that step 0 evaluates the untrained model: that evaluation gets its line
    # (it had none; the first line came at the first SFT evaluation), and the bar has a total (ETA).
    totals = []
    real_tqdm = builtin.tqdm

    def recording_tqdm(*args, **kw):
        totals.append(kw.get("total"))
        return real_tqdm(*args, **kw)

    monkeypatch.setattr(builtin, "tqdm", recording_tqdm)
    spec = _cpu_sized_gpu_spec()
    report = builtin.build_checkpoint(spec, tmp_path / "ckpt", progress=True)
    captured = capsys.readouterr()
    out = captured.out + captured.err
    assert "step 0 first evaluates the untrained model" in out
    lines = [ln for ln in out.splitlines() if ln.startswith("warm start: step ")]
    assert [ln.split(",")[0] for ln in lines[1:]] == ["warm start: step 0", "warm start: step 1", "warm start: step 2"]
    acc = dict(report["history"])
    assert lines[1].startswith(f"warm start: step 0, untrained model, held-out accuracy {acc[0]:.3f}, ")
    assert f"held-out accuracy {acc[2]:.3f}" in lines[3] and "loss " in lines[3]
    assert totals == [2]  # min(expected_steps, max_steps) of this spec


def test_gpu_config_matches_the_preset():
    from m3_rollout.config import ClusterConfig, load_config
    from m3_rollout.rollout.environments import build_task

    if "device" not in ClusterConfig.__dataclass_fields__:
        pytest.skip("configs/grpo_h200.yaml sets cluster.device, which the trainer-on-device work adds")
    cfg = load_config(CONFIGS / "grpo_h200.yaml", ["grpo.seed=43"])
    spec = builtin.builtin_spec(cfg.policy.model_name.removeprefix("builtin:"), cfg.cluster.device)
    # GRPO's prompts come from the task the checkpoint was warm-started on.
    assert build_task(cfg.data) == spec.make_task()
    assert cfg.grpo.seed == 43 and cfg.cluster.device == "cuda" and spec.device == "cuda"
    assert cfg.grpo.max_rollout_turns == spec.eval_max_turns == 4
    assert cfg.policy.max_total_sequence_length == spec.eval_max_total_len
    assert cfg.policy.generation.expert_parallel_size == 1 and cfg.policy.generation.max_new_tokens == 48
    # Inherited from the main job through defaults: (the loss and its clipping).
    assert cfg.loss_fn.ratio_clip_max == 0.2 and cfg.env.calculator.max_expression_chars == 64


def test_multi_gpu_config_is_the_gpu_job_with_the_rollout_on_other_gpus():
    """configs/grpo_h200_x2.yaml (issue 25): the one-GPU job's model, task, seed and batches, with
    EP=2 rollout workers on cuda:0-1 and the trainer on cuda:2 (3 GPUs); on 2 GPUs the override its
    header gives (one worker on cuda:0, trainer on cuda:1) validates."""
    from m3_rollout.config import ConfigError, check_devices, load_config, to_dict

    one, multi = load_config(CONFIGS / "grpo_h200.yaml"), load_config(CONFIGS / "grpo_h200_x2.yaml")
    a, b = to_dict(one), to_dict(multi)
    gen = multi.policy.generation
    assert (gen.expert_parallel_size, gen.sleep_level, gen.enable_cuda_graphs) == (2, 0, False)
    assert (multi.cluster.device, multi.cluster.gpus_per_node, multi.cluster.launcher) == ("cuda:2", 2, "mp")
    for section in ("grpo", "data", "env", "loss_fn", "weight_sync"):
        assert a[section] == b[section], section
    same_policy = {k: v for k, v in a["policy"].items() if k != "generation"}
    assert same_policy == {k: v for k, v in b["policy"].items() if k != "generation"}
    for cfg, gpus in ((multi, 3), (multi, 4)):
        check_devices(cfg, True, gpus)
    with pytest.raises(ConfigError, match="cluster.device='cuda:2'"):
        check_devices(multi, True, 2)
    two = ["policy.generation.expert_parallel_size=1", "cluster.device=cuda:1", "cluster.gpus_per_node=1"]
    check_devices(load_config(CONFIGS / "grpo_h200_x2.yaml", two), True, 2)
    assert (
        multi.logger.log_dir != one.logger.log_dir
        and multi.checkpointing.checkpoint_dir != one.checkpointing.checkpoint_dir
    )


def test_colocated_multi_gpu_config_is_the_gpu_job_with_ep_workers_beside_the_trainer():
    """configs/grpo_h200_x2_colocated.yaml (issue 25, "colocated"): the one-GPU job's model, task,
    seed and batches, with EP=2 rollout workers on cuda:0-1 refit through CUDA IPC and the trainer
    on cuda:0 beside rank 0: 2 GPUs suffice, 1 does not."""
    from m3_rollout.config import ConfigError, check_devices, load_config, to_dict

    one, colo = load_config(CONFIGS / "grpo_h200.yaml"), load_config(CONFIGS / "grpo_h200_x2_colocated.yaml")
    a, b = to_dict(one), to_dict(colo)
    gen = colo.policy.generation
    assert (gen.expert_parallel_size, gen.colocated_placement, gen.sleep_level) == (2, "worker_process", 1)
    assert (colo.cluster.device, colo.cluster.gpus_per_node, colo.cluster.launcher) == ("cuda:0", 2, "mp")
    for section in ("grpo", "data", "env", "loss_fn", "weight_sync"):
        assert a[section] == b[section], section
    same_policy = {k: v for k, v in a["policy"].items() if k != "generation"}
    assert same_policy == {k: v for k, v in b["policy"].items() if k != "generation"}
    assert colo.policy.precision == gen.dtype == "bfloat16"  # the workers read the trainer's compute copy
    check_devices(colo, True, 2)
    with pytest.raises(ConfigError, match="cluster.gpus_per_node=2"):
        check_devices(colo, True, 1)
    with pytest.raises(ConfigError, match="cluster.device='cuda:2'"):  # a trainer beside no rank
        load_config(CONFIGS / "grpo_h200_x2_colocated.yaml", ["cluster.device=cuda:2", "cluster.gpus_per_node=3"])
    assert (
        colo.logger.log_dir != one.logger.log_dir
        and colo.checkpointing.checkpoint_dir != one.checkpointing.checkpoint_dir
    )


def test_multi_step_needs_a_turn_per_call():
    from m3_rollout.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"grpo.max_rollout_turns=2: must be > data.max_tool_calls=3"):
        load_config(CONFIGS / "grpo_bf16_ep.yaml", ["data.max_tool_calls=3"])
    with pytest.raises(ConfigError, match="data.step_min_digits/step_max_digits"):
        load_config(CONFIGS / "grpo_bf16_ep.yaml", ["data.step_min_digits=3"])
    assert load_config(CONFIGS / "grpo_bf16_ep.yaml", ["data.max_tool_calls=3", "grpo.max_rollout_turns=4"])

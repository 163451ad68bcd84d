"""Built-in checkpoint presets: stable cache keys, the GPU preset's shape, a CPU build of its pipeline."""

import dataclasses
import json

import torch

from m3_rollout.jobs import builtin
from m3_rollout.model import M3ForCausalLM, load_checkpoint, tiny_config
from m3_trainers.warm_start import WarmStartConfig


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
    assert spec.warm_start.max_seconds <= 150 and spec.eval_max_turns == 4


def test_gpu_preset_pipeline_builds_on_cpu(tmp_path):
    # The m3-gpu-small build (full template, multi-step task, 4-turn held-out rollouts) at CPU size:
    # two SFT steps towards an unreachable window, so it stops at max_steps.
    spec = dataclasses.replace(
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
    report = builtin.build_checkpoint(spec, tmp_path / "ckpt", progress=False)
    assert report["warm_start_steps"] <= 2 and not report["in_window"]
    assert [s for s, _ in report["history"]] == [0, 1, 2]
    assert report["step_seconds"] > 0 and report["eval_seconds"] > 0
    assert json.loads((tmp_path / "ckpt" / "build_report.json").read_text())["spec"]["task_name"] == "multistep"
    model = load_checkpoint(tmp_path / "ckpt", dtype=torch.float32)
    assert model.config.sparse_block_size == 64
    assert "<thinking_instructions>" in (tmp_path / "ckpt" / "chat_template.jinja").read_text()

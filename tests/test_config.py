"""Config loading: YAML + overrides, unknown keys and bad values fail with the key named."""

import pytest

from m3_rollout.config import ConfigError, load_config

MAIN = "configs/grpo_bf16_ep.yaml"


def test_main_config_loads_with_overrides():
    cfg = load_config(MAIN, ["grpo.max_num_steps=5", "policy.generation.temperature=0.7",
                             "policy.model_name=/tmp/ckpt"])
    assert cfg.grpo.max_num_steps == 5
    assert cfg.policy.generation.temperature == pytest.approx(0.7)
    assert cfg.policy.model_name == "/tmp/ckpt"
    assert cfg.grpo.num_prompts_per_step == 16 and cfg.grpo.num_generations_per_prompt == 8
    assert cfg.policy.generation.dtype == "bfloat16"


@pytest.mark.parametrize("override, needle", [
    ("grpo.num_prompt_per_step=3", "grpo.num_prompt_per_step"),
    ("policy.generation.temprature=1", "temprature"),
    ("grpo.max_num_steps=abc", "grpo.max_num_steps"),
    ("policy.generation.temperature=0", "policy.generation.temperature"),
    ("policy.generation.top_p=1.5", "policy.generation.top_p"),
    ("policy.generation.dtype=int8", "policy.generation.dtype"),
    ("policy.train_global_batch_size=7", "policy.train_global_batch_size"),
    ("grpo.max_num_steps", "key=value"),
])
def test_bad_overrides_name_the_key(override, needle):
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        load_config(MAIN, [override])


def test_missing_file():
    with pytest.raises(FileNotFoundError):
        load_config("configs/nope.yaml")

"""Config loading: YAML + overrides, unknown keys and bad values fail with the key named."""

import pytest

from m3_rollout.config import ConfigError, load_config

MAIN = "configs/grpo_bf16_ep.yaml"


def test_main_config_loads_with_overrides():
    cfg = load_config(
        MAIN, ["grpo.max_num_steps=5", "policy.generation.temperature=0.7", "policy.model_name=/tmp/ckpt"]
    )
    assert cfg.grpo.max_num_steps == 5
    assert cfg.policy.generation.temperature == pytest.approx(0.7)
    assert cfg.policy.model_name == "/tmp/ckpt"
    assert cfg.grpo.num_prompts_per_step == 16 and cfg.grpo.num_generations_per_prompt == 8
    assert cfg.policy.generation.dtype == "bfloat16"


@pytest.mark.parametrize(
    "override, needle",
    [
        ("grpo.num_prompt_per_step=3", "grpo.num_prompt_per_step"),
        ("policy.generation.temprature=1", "temprature"),
        ("grpo.max_num_steps=abc", "grpo.max_num_steps"),
        ("policy.generation.temperature=0", "policy.generation.temperature"),
        ("policy.generation.top_p=1.5", "policy.generation.top_p"),
        ("policy.generation.dtype=int8", "policy.generation.dtype"),
        ("policy.train_global_batch_size=7", "policy.train_global_batch_size"),
        ("grpo.max_num_steps", "key=value"),
        ("policy.index_replay=true", "policy.index_replay"),  # without record_block_selection
    ],
)
def test_bad_overrides_name_the_key(override, needle):
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        load_config(MAIN, [override])


@pytest.mark.parametrize(
    "override, suggestion",
    [
        ("polcy.model_name=x", "policy.model_name"),  # a typo in the section
        ("policy.generaton.temperature=1", "policy.generation.temperature"),  # in a subsection
        ("polcy.modl_name=x", "policy.model_name"),  # in both
        ("policy.model_nme=x", "policy.model_name"),  # in the leaf (as before)
    ],
)
def test_unknown_keys_get_the_closest_key_whichever_part_is_misspelt(override, suggestion):
    with pytest.raises(ConfigError, match=f"did you mean '{suggestion}'"):
        load_config(MAIN, [override])


def test_unknown_key_without_a_close_one_gets_no_suggestion_and_yaml_keys_get_one(tmp_path):
    with pytest.raises(ConfigError) as exc:
        load_config(MAIN, ["zzzzzz.model_name=x"])
    assert "did you mean" not in str(exc.value)
    (tmp_path / "typo.yaml").write_text("polcy:\n  model_name: x\n")
    with pytest.raises(ConfigError, match="unknown config key: polcy, did you mean 'policy'"):
        load_config(tmp_path / "typo.yaml")


def test_missing_file():
    with pytest.raises(FileNotFoundError):
        load_config("configs/nope.yaml")


def test_defaults_inheritance_and_overrides(tmp_path):
    base = tmp_path / "base.yaml"
    base.write_text("defaults: configs_link/main.yaml\ngrpo:\n  max_num_steps: 7\n  seed: 3\n")
    (tmp_path / "configs_link").mkdir()
    (tmp_path / "configs_link" / "main.yaml").write_text(open(MAIN).read())
    child = tmp_path / "child.yaml"
    child.write_text("defaults: [base.yaml]\ngrpo:\n  seed: 9\nloss_fn:\n  ratio_clip_c: 3.0\n")
    cfg = load_config(child, ["grpo.num_prompts_per_step=4", "policy.train_global_batch_size=32"])
    assert cfg.grpo.max_num_steps == 7  # from base
    assert cfg.grpo.seed == 9  # child wins over base
    assert cfg.loss_fn.ratio_clip_c == 3.0
    assert cfg.grpo.num_prompts_per_step == 4  # override wins over all files
    assert cfg.policy.optimizer.lr == pytest.approx(3e-4)  # from the main config two levels up
    smoke = load_config("configs/grpo_smoke.yaml")
    assert smoke.policy.model_name == "builtin:tiny-random" and smoke.policy.generation.dtype == "bfloat16"
    asyncc = load_config("configs/grpo_async.yaml")
    assert asyncc.grpo.async_grpo.enabled and asyncc.grpo.async_grpo.max_trajectory_age_steps == 1
    assert asyncc.policy.optimizer.lr == pytest.approx(3e-4) and asyncc.grpo.max_num_steps == 60


def test_defaults_cycle_and_missing_parent(tmp_path):
    (tmp_path / "a.yaml").write_text("defaults: b.yaml\n")
    (tmp_path / "b.yaml").write_text("defaults: a.yaml\n")
    with pytest.raises(ConfigError, match="cycle"):
        load_config(tmp_path / "a.yaml")
    (tmp_path / "c.yaml").write_text("defaults: nope.yaml\n")
    with pytest.raises(FileNotFoundError, match="nope.yaml.*c.yaml"):
        load_config(tmp_path / "c.yaml")
    (tmp_path / "d.yaml").write_text("defaults: {x: 1}\n")
    with pytest.raises(ConfigError, match="defaults"):
        load_config(tmp_path / "d.yaml")


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["grpo.async_grpo.enabled=true", "grpo.use_dynamic_sampling=true"], "grpo.use_dynamic_sampling"),
        (["grpo.async_grpo.max_trajectory_age_steps=0"], "max_trajectory_age_steps"),
        (["loss_fn.ratio_clip_c=1.0"], "loss_fn.ratio_clip_c"),
        (["loss_fn.reference_policy_kl_type=k7"], "reference_policy_kl_type"),
        (
            ["loss_fn.use_importance_sampling_correction=true", "policy.generation.top_k=5"],
            "use_importance_sampling_correction",
        ),
        (["loss_fn.mis_ratio_min=1.5"], "mis_ratio_min"),
        (["policy.scheduler.name=step"], "policy.scheduler.name"),
        (["checkpointing.keep_top_k=0"], "checkpointing.keep_top_k"),
        (["loss_fn.reference_policy_kl_penalty=-1"], "reference_policy_kl_penalty"),
    ],
)
def test_incompatible_options_are_named(overrides, needle):
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        load_config(MAIN, overrides)


def test_new_options_load():
    cfg = load_config(
        MAIN,
        [
            "loss_fn.reference_policy_kl_penalty=0.01",
            "loss_fn.use_importance_sampling_correction=true",
            "loss_fn.importance_sampling_type=mis",
            "policy.freeze.patterns=[lm_head]",
            "policy.routing_replay=true",
            "checkpointing.keep_top_k=3",
        ],
    )
    assert cfg.loss_fn.reference_policy_kl_penalty == pytest.approx(0.01)
    assert cfg.policy.freeze.patterns == ["lm_head"] and cfg.policy.routing_replay
    assert cfg.checkpointing.keep_top_k == 3


# --- adversarial review ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "override, needle",
    [
        # inf passes every "> 0" check; it makes lr / temperature meaningless and a tool timeout of
        # inf crashed the tool pool (OverflowError in the wait).
        ("policy.optimizer.lr=inf", "policy.optimizer.lr"),
        ("policy.generation.temperature=inf", "policy.generation.temperature"),
        ("env.calculator.timeout_s=inf", "env.calculator.timeout_s"),
        ("grpo.async_grpo.group_timeout_s=inf", "grpo.async_grpo.group_timeout_s"),
        ("policy.max_grad_norm=-inf", "policy.max_grad_norm"),
        # Values torch.optim.AdamW would reject only after the model is loaded.
        ("policy.optimizer.beta1=1.5", "policy.optimizer.beta1"),
        ("policy.optimizer.beta2=-0.1", "policy.optimizer.beta2"),
        ("policy.optimizer.eps=-1e-8", "policy.optimizer.eps"),
        ("policy.optimizer.weight_decay=-1", "policy.optimizer.weight_decay"),
        # Checked at start rather than when the environment / optimizer is built.
        ("policy.freeze.patterns=['(']", "policy.freeze.patterns"),
        # torch.manual_seed raised OverflowError (exit 1 with a traceback) after the build
        ("grpo.seed=99999999999999999999999", "grpo.seed"),
        ("grpo.seed=-1", "grpo.seed"),
        ("grpo.seed=1099511627776", "grpo.seed"),
    ],
)
def test_more_bad_values_name_the_key(override, needle):
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        load_config(MAIN, [override])


def test_yaml_errors_are_config_errors_naming_the_file(tmp_path):
    (tmp_path / "section.yaml").write_text("grpo: 5\n")
    with pytest.raises(ConfigError, match="grpo"):
        load_config(tmp_path / "section.yaml")
    (tmp_path / "syntax.yaml").write_text("grpo:\n  seed: [1\n")
    with pytest.raises(ConfigError, match="syntax.yaml"):
        load_config(tmp_path / "syntax.yaml")
    (tmp_path / "interp.yaml").write_text("grpo:\n  seed: ${grpo.nope}\n")
    with pytest.raises(ConfigError, match="grpo.nope"):
        load_config(tmp_path / "interp.yaml")
    with pytest.raises(ConfigError, match="grpo"):
        load_config(MAIN, ["grpo=1"])


def test_unknown_tool_is_a_config_error_where_the_environment_is_built(tmp_path):
    # m3_rollout.config imports no project module: the tool names are checked by the job when it
    # builds the environment, with the message load_config gave before.
    from m3_rollout.jobs.stack import build_env

    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "1+1", "answer": "2"}\n')
    cfg = load_config(
        MAIN, ["env.name=jsonl", "data.source=jsonl", f"data.path={path}", "env.jsonl.tools=[calculator,bogus]"]
    )
    with pytest.raises(ConfigError, match=r"env\.jsonl\.tools=\['calculator', 'bogus'\]: unknown \['bogus'\]"):
        build_env(cfg)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["policy.generation.sleep_level=3"], "policy.generation.sleep_level=3: must be 0, 1 or 2"),
        (
            ["policy.generation.sleep_level=1", "grpo.async_grpo.enabled=true"],
            "policy.generation.sleep_level=1: needs synchronous GRPO",
        ),
    ],
)
def test_sleep_level_is_checked_with_one_message_naming_it(overrides, message):
    with pytest.raises(ConfigError) as exc:
        load_config("configs/grpo_bf16_ep.yaml", ["policy.generation.expert_parallel_size=1", *overrides])
    lines = [ln for ln in str(exc.value).splitlines() if "sleep_level" in ln]
    assert len(lines) == 1 and message in lines[0], str(exc.value)


def test_defaults_name_a_packaged_config_from_any_directory(tmp_path):
    """`--config` found the shipped configs by name, `defaults:` did not: a user's YAML outside a
    clone could not inherit the main config (an installed package has no configs/ folder)."""
    smoke = load_config("configs/grpo_smoke.yaml")
    for name in ("grpo_smoke.yaml", "configs/grpo_smoke.yaml", "grpo_smoke"):
        (tmp_path / "mine.yaml").write_text(f"defaults: {name}\ngrpo:\n  max_num_steps: 2\n")
        cfg = load_config(tmp_path / "mine.yaml")
        assert cfg.grpo.max_num_steps == 2 and cfg.logger.log_dir == smoke.logger.log_dir == "outputs/smoke/logs"
    # a file next to the child still wins over the packaged one of the same name
    (tmp_path / "grpo_smoke.yaml").write_text("logger:\n  log_dir: here/logs\n")
    (tmp_path / "mine.yaml").write_text("defaults: grpo_smoke.yaml\n")
    assert load_config(tmp_path / "mine.yaml").logger.log_dir == "here/logs"


def test_defaults_with_dotdot_are_not_looked_up_among_the_packaged_configs(tmp_path):
    (tmp_path / "mine.yaml").write_text("defaults: ../configs/grpo_smoke.yaml\n")
    with pytest.raises(FileNotFoundError, match=r"grpo_smoke\.yaml.*named in defaults: of .*mine\.yaml"):
        load_config(tmp_path / "mine.yaml")

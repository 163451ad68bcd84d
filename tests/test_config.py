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
    "override, takes",
    [
        ("policy.generation.invariant_sparse_attention=", "one of ['union', 'page_partials']"),
        ("policy.precision=null", "one of ['float32', 'bfloat16', 'float64']"),
        ("policy.model_name=", "a str"),
        ("grpo.max_num_steps=", "an int"),
    ],
)
def test_an_empty_value_says_it_is_empty_and_what_the_key_takes(override, takes):
    key = override.split("=")[0]
    with pytest.raises(ConfigError) as exc:
        load_config(MAIN, [override])
    assert str(exc.value).startswith(f"bad value for {key}: empty or null, but it needs {takes}")
    assert "Incompatible value" not in str(exc.value)


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
        load_config(MAIN, ["zzzzzz.qqqqqq=x"])  # (zzzzzz.model_name now gets policy.model_name)
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


def test_top_k_0_and_greedy_validation_load_and_greedy_training_says_why():
    """top_k 0 is off as in the engine (vLLM); val_temperature 0 is greedy validation; training
    temperature 0 is refused saying why (identical group samples) and what to use instead."""
    cfg = load_config(MAIN, ["policy.generation.top_k=0", "grpo.val_temperature=0"])
    assert cfg.policy.generation.top_k == 0 and cfg.grpo.val_temperature == 0
    cfg = load_config(MAIN, ["policy.generation.top_k=0", "loss_fn.use_importance_sampling_correction=true"])
    assert cfg.policy.generation.top_k == 0
    with pytest.raises(ConfigError, match="policy.generation.top_k=-2: must be -1 or 0 \\(off\\) or >= 1"):
        load_config(MAIN, ["policy.generation.top_k=-2"])
    with pytest.raises(ConfigError, match="grpo.val_temperature=-0.5: must be >= 0 \\(0 = greedy\\)"):
        load_config(MAIN, ["grpo.val_temperature=-0.5"])
    with pytest.raises(ConfigError) as exc:
        load_config(MAIN, ["policy.generation.temperature=0"])
    assert "identical (every GRPO advantage 0)" in str(exc.value) and "grpo.val_temperature=0" in str(exc.value)
    assert "near-greedy" not in str(exc.value)


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
        # the server's /init_weight_sync refuses more than an hour: refused at load, not at the first refit
        ("weight_sync.timeout_s=7200", "weight_sync.timeout_s"),
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


@pytest.mark.parametrize(
    "override, suggestion",
    [
        ("lr=1e-4", "did you mean 'policy.optimizer.lr'?"),  # a bare key: no section to correct
        ("optimizer.lr=1e-4", "did you mean 'policy.optimizer.lr'?"),  # its section left out
        ("zzzzzz.model_name=x", "did you mean 'policy.model_name'?"),
        (
            "timeout_s=3",
            "did you mean one of 'env.calculator.timeout_s', 'env.jsonl.timeout_s', 'weight_sync.timeout_s'?",
        ),
    ],
)
def test_a_key_without_its_sections_gets_the_full_keys_of_that_name(override, suggestion):
    """`lr=1e-4` said only "unknown config key 'lr'": the fuzzy match corrects each dotted part in
    its own section, and no top-level section is close to 'lr'."""
    with pytest.raises(ConfigError) as exc:
        load_config(MAIN, [override])
    assert suggestion in str(exc.value)


def test_one_walk_gives_the_flat_keys_and_every_key_a_suggestion_may_name():
    """``_flatten`` (leaves; an empty section is one) and the "did you mean" key list (sections
    too, each before its keys) are the one walk ``_walk``; ``_nest`` inverts ``_flatten``."""
    from m3_rollout import config

    tree = {"a": {"b": 1, "c": {}, "e": {"f": None}}, "d": [2]}
    assert list(config._walk(tree)) == [
        ("a", tree["a"]), ("a.b", 1), ("a.c", {}), ("a.e", {"f": None}), ("a.e.f", None), ("d", [2]),
    ]  # fmt: skip
    assert config._flatten(tree) == [("a.b", 1), ("a.c", {}), ("a.e.f", None), ("d", [2])]
    assert config._nest(config._flatten(tree)) == tree
    with pytest.raises(ConfigError, match="did you mean 'policy.optimizer'"):  # a section's name alone
        load_config(MAIN, ["optimizer=1"])


def test_the_batch_rule_gives_both_factors_and_the_fixes():
    """grpo.num_generations_per_prompt=4 alone: the message said only "must divide
    num_prompts_per_step * num_generations_per_prompt = 64"."""
    with pytest.raises(ConfigError) as exc:
        load_config(MAIN, ["grpo.num_generations_per_prompt=4"])
    msg = str(exc.value)
    assert (
        "policy.train_global_batch_size=128: must divide the samples of a step, grpo.num_prompts_per_step * "
        "grpo.num_generations_per_prompt = 16 * 4 = 64; set policy.train_global_batch_size=64 or a divisor of "
        "it, or set grpo.num_prompts_per_step to a multiple of 32 (e.g. 32)"
    ) in msg
    # both fixes it names load
    load_config(MAIN, ["grpo.num_generations_per_prompt=4", "policy.train_global_batch_size=64"])
    load_config(MAIN, ["grpo.num_generations_per_prompt=4", "grpo.num_prompts_per_step=32"])
    with pytest.raises(ConfigError, match=r"= 16 \* 8 = 128; .*multiple of 7 \(e\.g\. 21\)"):
        load_config(MAIN, ["policy.train_global_batch_size=7"])
    load_config(MAIN, ["policy.train_global_batch_size=7", "grpo.num_prompts_per_step=21"])


def test_a_micro_batch_that_does_not_divide_the_global_batch_is_refused_with_the_fix():
    """policy.train_micro_batch_size was not checked against the global batch: 48 of 128 ran each
    optimizer step as micro-batches of 48, 48 and a ragged 32. Now refused, naming both keys and
    the micro batches that fit; a divisor, or one at least the global batch, loads."""
    with pytest.raises(ConfigError) as exc:
        load_config(MAIN, ["policy.train_micro_batch_size=48"])
    assert (
        "policy.train_micro_batch_size=48: must divide policy.train_global_batch_size=128 (each optimizer step's "
        "128 rows are split into micro-batches of 48, leaving a ragged last one of 32) or be >= it (one forward "
        "per optimizer step); set policy.train_micro_batch_size=32 (the largest divisor of 128 below 48) or 128"
    ) in str(exc.value)
    for mbs in (32, 128, 256):
        load_config(MAIN, [f"policy.train_micro_batch_size={mbs}"])
    with pytest.raises(ConfigError, match=r"train_micro_batch_size=5: .*set policy\.train_micro_batch_size=4 "):
        load_config(MAIN, ["policy.train_global_batch_size=16", "policy.train_micro_batch_size=5"])


@pytest.mark.parametrize("leave_one_out", [False, True])
def test_one_generation_per_prompt_is_refused_on_its_own(leave_one_out):
    """n=1 was refused only by the batch rule (16 * 1 samples, batch 128), whose fix (batch 16)
    gave a run that learns nothing: a group of one sample has advantage 0 under either baseline."""
    import torch

    from m3_trainers.advantages import group_advantages

    adv = group_advantages(torch.tensor([1.0, 0.0, 1.0]), torch.arange(3), leave_one_out=leave_one_out)
    assert adv.tolist() == [0.0, 0.0, 0.0]  # why: nothing to compare a lone sample with
    over = ["grpo.num_generations_per_prompt=1", f"grpo.use_leave_one_out_baseline={leave_one_out}"]
    for extra in ([], ["policy.train_global_batch_size=16", "policy.train_micro_batch_size=16"]):
        with pytest.raises(ConfigError) as exc:
            load_config(MAIN, over + extra)
        msg = str(exc.value)
        assert "grpo.num_generations_per_prompt=1: must be >= 2" in msg and "advantage 0" in msg
        assert "train_global_batch_size" not in msg  # not the batch rule's fix as well
    two = ["grpo.num_generations_per_prompt=2", "policy.train_global_batch_size=32", "policy.train_micro_batch_size=32"]
    load_config(MAIN, [*two, f"grpo.use_leave_one_out_baseline={leave_one_out}"])


def test_zero_steps_is_validation_only_and_refused_without_it():
    """grpo.max_num_steps=0 measures held-out accuracy at step 0 and trains nothing (the job's loop
    is empty, no end validation, no final checkpoint); without grpo.val_at_start it did nothing."""
    assert load_config(MAIN, ["grpo.max_num_steps=0"]).grpo.max_num_steps == 0
    with pytest.raises(ConfigError) as exc:
        load_config(MAIN, ["grpo.max_num_steps=0", "grpo.val_at_start=false"])
    assert "grpo.max_num_steps=0: 0 trains nothing" in str(exc.value)
    assert "grpo.val_at_start=true" in str(exc.value)


def test_rollout_dumps_follow_the_runs_log_dir(tmp_path):
    """The smoke config wrote its dumps to outputs/smoke/rollout_dumps whatever logger.log_dir and
    checkpointing.checkpoint_dir said."""
    run = tmp_path / "run"
    cfg = load_config(
        "configs/grpo_smoke.yaml", [f"logger.log_dir={run}/logs", f"checkpointing.checkpoint_dir={run}/ckpt"]
    )
    assert cfg.rollout_dump.dir == f"{run}/logs/rollout_dumps"
    assert load_config("configs/grpo_smoke.yaml").rollout_dump.dir == "outputs/smoke/logs/rollout_dumps"
    assert load_config(MAIN).rollout_dump.dir == "outputs/logs/rollout_dumps"
    assert load_config(MAIN, [f"rollout_dump.dir={tmp_path}/d"]).rollout_dump.dir == f"{tmp_path}/d"


def test_env_jsonl_keys_with_the_calculator_environment_are_refused(tmp_path):
    """env.jsonl.* were ignored silently with env.name=calculator (the default): a reward function,
    tool list or system prompt given there changed nothing. Now each is refused naming env.name=jsonl;
    with env.name=jsonl they load, and a key at its default value changes nothing either way."""
    data = tmp_path / "q.jsonl"
    data.write_text("".join(f'{{"prompt": "What is {i} + {i}?", "answer": {2 * i}}}\n' for i in range(12)))
    src = ["data.source=jsonl", f"data.path={data}", "grpo.num_val_prompts=4"]
    keys = [
        "env.jsonl.reward_fn=m3_rollout.rollout.environments.jsonl_env.exact_match_reward",
        "env.jsonl.tools=[calculator,convert_units]",
        "env.jsonl.system_prompt=Be brief.",
        "env.jsonl.timeout_s=5.0",
    ]
    with pytest.raises(ConfigError) as exc:
        load_config(MAIN, [*src, *keys])
    msg = str(exc.value)
    for key in keys:
        name = key.split("=")[0]
        assert f"{name}=" in msg
    assert msg.count("is read only with env.name=jsonl") == 4 and "set env.name=jsonl" in msg
    with pytest.raises(ConfigError, match=r"env\.jsonl\.system_prompt='Be brief\.': is read only with env\.name=jsonl"):
        load_config(MAIN, ["env.jsonl.system_prompt=Be brief."])  # the calculator's own data too
    cfg = load_config(MAIN, [*src, "env.name=jsonl", *keys])
    assert cfg.env.jsonl.system_prompt == "Be brief." and cfg.env.jsonl.timeout_s == 5.0
    load_config(MAIN, [*src, "env.jsonl.tools=[calculator]"])  # the default: nothing ignored


def test_batch_rules_apply_only_to_training_configs():
    """Review finding: `dump generate` (``load_config(..., training=False)``) trains nothing, yet a
    group size of 2 or more still had to fit policy.train_global_batch_size (and the micro batch
    the global one): now those training-only rules are skipped there, and kept for the GRPO job."""
    over = ["grpo.num_prompts_per_step=3", "grpo.num_generations_per_prompt=2"]  # 6 samples per step
    with pytest.raises(ConfigError, match=r"policy\.train_global_batch_size=128: must divide the samples of a step"):
        load_config(MAIN, over)
    cfg = load_config(MAIN, over, training=False)
    assert (cfg.grpo.num_generations_per_prompt, cfg.policy.train_global_batch_size) == (2, 128)
    ragged = [*over, "policy.train_global_batch_size=6", "policy.train_micro_batch_size=4"]
    with pytest.raises(ConfigError, match=r"policy\.train_micro_batch_size=4: must divide"):
        load_config(MAIN, ragged)
    assert load_config(MAIN, ragged, training=False).policy.train_micro_batch_size == 4
    with pytest.raises(ConfigError, match=r"policy\.train_micro_batch_size=0: must be >= 1"):  # a range: kept
        load_config(MAIN, [*over, "policy.train_micro_batch_size=0"], training=False)
    with pytest.raises(ConfigError, match=r"policy\.train_global_batch_size=0: must be >= 1"):
        load_config(MAIN, [*over, "policy.train_global_batch_size=0"], training=False)


def test_env_calculator_keys_with_the_jsonl_environment_are_refused(tmp_path):
    """Review finding, the reverse of the rule above: env.calculator.* were ignored silently with
    env.name=jsonl (its calculator tool keeps its defaults, its timeout is env.jsonl.timeout_s). Now
    each is refused naming env.name=calculator; with the calculator environment they load, and a
    key at its default value changes nothing either way."""
    data = tmp_path / "q.jsonl"
    data.write_text("".join(f'{{"prompt": "What is {i} + {i}?", "answer": {2 * i}}}\n' for i in range(12)))
    src = ["data.source=jsonl", f"data.path={data}", "grpo.num_val_prompts=4"]
    keys = ["env.calculator.max_expression_chars=16", "env.calculator.timeout_s=5.0"]
    with pytest.raises(ConfigError) as exc:
        load_config(MAIN, [*src, "env.name=jsonl", *keys])
    msg = str(exc.value)
    assert "env.calculator.max_expression_chars=16: is read only with env.name=calculator" in msg
    assert "env.calculator.timeout_s=5.0: is read only with env.name=calculator" in msg
    assert msg.count("set env.name=calculator") == 2 and "env.jsonl.timeout_s" in msg
    cfg = load_config(MAIN, [*src, *keys])  # the calculator environment reads them
    assert (cfg.env.calculator.max_expression_chars, cfg.env.calculator.timeout_s) == (16, 5.0)
    load_config(MAIN, [*src, "env.name=jsonl", "env.calculator.timeout_s=1.0"])  # the default: nothing ignored


def test_jsonl_data_with_the_calculator_environment_is_scored_by_the_calculator(tmp_path):
    """data.source=jsonl with env.name left at calculator (as README documents): the calculator
    environment scores the file's records, reward 1 iff the answer's last integer is the record's."""
    from m3_rollout.jobs.stack import build_env, build_prompt_source
    from m3_rollout.rollout.environment import ModelTurn
    from m3_rollout.rollout.environments.calculator import CalculatorEnvironment

    data = tmp_path / "q.jsonl"
    data.write_text("".join(f'{{"prompt": "What is {i} + {i}?", "answer": {2 * i}}}\n' for i in range(12)))
    cfg = load_config(MAIN, ["data.source=jsonl", f"data.path={data}", "grpo.num_val_prompts=4"])
    assert cfg.env.name == "calculator"
    record = build_prompt_source(cfg).train_batch(1, 1)[0]
    env = build_env(cfg)
    try:
        assert isinstance(env, CalculatorEnvironment)
        _, state = env.reset(record)
        assert env.step(state, ModelTurn(f"It is {record['answer']}.")).reward == 1.0
        assert env.step(state, ModelTurn(f"It is {record['answer'] + 1}.")).reward == 0.0
    finally:
        env.close()

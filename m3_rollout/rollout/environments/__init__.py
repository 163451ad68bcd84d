"""Environments (design.md §3): ``build_environment`` picks one from the ``env`` config,
``build_task`` the calculator prompt generator from the ``data`` config."""

from __future__ import annotations

from m3_rollout.rollout.environment import Environment, ToolSettings
from m3_rollout.rollout.environments.calculator import ArithmeticTask
from m3_rollout.rollout.environments.multistep import MultiStepArithmeticTask


def build_task(data_cfg) -> ArithmeticTask | MultiStepArithmeticTask:
    """The calculator prompt generator of ``data_cfg`` (an ``m3_rollout.config.DataConfig``):
    the single-step task when ``max_tool_calls`` is 1, else chains of 1..max_tool_calls calls.

    Raises:
        ValueError: digit ranges or operations the task refuses.
    """
    d = data_cfg
    if d.max_tool_calls == 1:
        return ArithmeticTask(d.min_digits, d.max_digits, d.operations)
    return MultiStepArithmeticTask(
        1, d.max_tool_calls, d.min_digits, d.max_digits, d.step_min_digits, d.step_max_digits, d.operations
    )


def build_environment(env_cfg) -> Environment:
    """The environment named by ``env_cfg.name`` (an ``m3_rollout.config.EnvConfig``).

    Raises:
        ValueError: unknown ``env.name``, or a bad ``env.jsonl`` tool list / reward path.
    """
    if env_cfg.name == "calculator":
        from m3_rollout.rollout.environments.calculator import CalculatorEnvironment

        settings = ToolSettings(env_cfg.num_tool_workers, env_cfg.calculator.timeout_s, env_cfg.max_tool_output_chars)
        return CalculatorEnvironment(env_cfg.calculator.max_expression_chars, settings)
    if env_cfg.name == "jsonl":
        from m3_rollout.rollout.environments.jsonl_env import JsonlEnvironment

        j = env_cfg.jsonl
        settings = ToolSettings(env_cfg.num_tool_workers, j.timeout_s, env_cfg.max_tool_output_chars)
        try:
            return JsonlEnvironment(j.reward_fn, list(j.tools), j.system_prompt, settings)
        except ValueError as exc:
            raise ValueError(f"env.jsonl: {exc}") from None
    raise ValueError(f"env.name={env_cfg.name!r}: must be 'calculator' or 'jsonl'")

"""A generic environment for user datasets: JSONL prompt records, built-in tools by name, and a
reward function given by dotted path.

Records (one JSON object a line): ``messages`` (chat messages) or ``prompt`` (one user text),
plus whatever the reward function reads (usually ``answer``). The episode: the model may call the
configured tools for as many turns as the rollout allows; its first turn without a tool call is
the final answer, scored by ``reward_fn(answer_text, record) -> float``.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable

from m3_rollout.rollout.environment import Environment, EnvStep, ModelTurn, ToolSettings, parse_error_observation
from m3_rollout.rollout.environments.calculator import final_answer
from m3_rollout.rollout.environments.tools import TOOL_FACTORIES

__all__ = ["JsonlEnvironment", "load_reward_fn", "exact_match_reward", "last_number_reward"]

RewardFn = Callable[[str | None, dict], float]


def exact_match_reward(answer_text: str | None, record: dict) -> float:
    """1.0 iff the answer, stripped, equals ``str(record["answer"])`` stripped."""
    return float(answer_text is not None and answer_text.strip() == str(record["answer"]).strip())


def last_number_reward(answer_text: str | None, record: dict) -> float:
    """1.0 iff the answer's last integer equals ``record["answer"]`` (commas ignored)."""
    return float(final_answer(answer_text) == str(record["answer"]).strip())


def load_reward_fn(path: str) -> RewardFn:
    """Import a reward function from ``"package.module.function"`` or ``"package.module:function"``.

    Raises:
        ValueError: malformed path, module not importable, attribute missing or not callable
            (the message names the path and what to give instead).
    """
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"reward_fn={path!r}: give a dotted path 'package.module.function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"reward_fn={path!r}: cannot import module {module_name!r} ({exc})") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"reward_fn={path!r}: {module_name!r} has no callable {attr!r}")
    return fn


MAX_REWARD = 1e30  # |reward| above it is a reward error: fp32 holds it, and group statistics stay finite


class JsonlEnvironment(Environment):
    """Episodes from JSONL records with a user-chosen reward.

    Args:
        reward_fn: dotted path (see ``load_reward_fn``) or a callable ``(answer_text, record) -> float``.
        tools: built-in tool names (keys of ``tools.TOOL_FACTORIES``), possibly empty.
        system_prompt: system message put before a record's ``prompt`` (records with
            ``messages`` bring their own).
        tool_settings: worker pool settings.

    Raises:
        ValueError: an unknown tool name or a bad reward path.
    """

    def __init__(
        self,
        reward_fn: str | RewardFn = "m3_rollout.rollout.environments.jsonl_env.exact_match_reward",
        tools: list[str] | tuple[str, ...] = (),
        system_prompt: str | None = None,
        tool_settings: ToolSettings | None = None,
    ):
        super().__init__(tool_settings)
        unknown = [t for t in tools if t not in TOOL_FACTORIES]
        if unknown:
            raise ValueError(f"tools={list(tools)}: unknown {unknown}; choose from {sorted(TOOL_FACTORIES)}")
        self.tools = [TOOL_FACTORIES[t]() for t in tools]
        self.reward_fn = load_reward_fn(reward_fn) if isinstance(reward_fn, str) else reward_fn
        self.system_prompt = system_prompt

    def reset(self, record: dict) -> tuple[list[dict], dict]:
        if "messages" in record:
            messages = [dict(m) for m in record["messages"]]
        elif "prompt" in record:
            messages = ([{"role": "system", "content": self.system_prompt}] if self.system_prompt else []) + [
                {"role": "user", "content": str(record["prompt"])}
            ]
        else:
            raise ValueError("a prompt record needs 'messages' or 'prompt'")
        return messages, {"record": record, "tool_calls": 0}

    def step(self, state: dict, turn: ModelTurn) -> EnvStep:
        info = {"tool_calls": state["tool_calls"]}
        if turn.tool_calls:
            observations = self.tool_observations(turn)  # a call it stopped inside last: an error
            state["tool_calls"] += len(turn.tool_calls)
            return EnvStep(observations, 0.0, False, {"tool_calls": state["tool_calls"]})
        if turn.parse_error:
            return EnvStep([parse_error_observation(turn.parse_error)], 0.0, False, info)
        try:
            reward = float(self.reward_fn(turn.content, state["record"]))
        except Exception as exc:  # a reward bug is reported, scored 0, and does not stop training
            return EnvStep([], 0.0, True, {**info, "reward_error": f"{type(exc).__name__}: {exc}"})
        if not math.isfinite(reward):
            return EnvStep([], 0.0, True, {**info, "reward_error": f"non-finite reward {reward}"})
        if abs(reward) > MAX_REWARD:  # the job's fp32 rewards would turn it into inf
            return EnvStep([], 0.0, True, {**info, "reward_error": f"reward {reward:g} beyond +-{MAX_REWARD:g}"})
        return EnvStep([], reward, True, info)

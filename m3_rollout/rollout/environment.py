"""Environment plug-in contract (design.md §3): a task, its tools and its reward.

Governing idea: the rollout loop owns tokens; an environment only sees parsed model turns. It
``reset``s a prompt record into chat messages and, after every model turn, ``step``s on what the
model said (tool calls or a final answer) and returns tool observations, a reward, and whether
the episode is over. Tools are plain Python callables with a JSON schema; a malformed call or a
tool exception becomes an error observation for the model, never a crash of the loop.
"""

from __future__ import annotations

import abc
import json
from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass
class Tool:
    """A callable tool with an OpenAI-style function schema.

    Attributes:
        name: function name the model calls.
        description: one line shown in the tools section of the prompt.
        parameters: JSON schema of the arguments object.
        fn: called with the decoded arguments as keyword arguments; returns the observation text.
    """

    name: str
    description: str
    parameters: dict
    fn: Callable[..., str]

    def schema(self) -> dict:
        """OpenAI ``tools`` entry: {"type": "function", "function": {name, description, parameters}}."""
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}

    def call(self, arguments_json: str) -> str:
        """Run the tool on a JSON arguments string; any failure becomes an ``Error: ...`` text."""
        try:
            args = json.loads(arguments_json) if arguments_json.strip() else {}
        except json.JSONDecodeError as exc:
            return f"Error: arguments are not valid JSON ({exc.msg})"
        if not isinstance(args, dict):
            return "Error: arguments must be an object"
        try:
            return str(self.fn(**args))
        except TypeError as exc:
            return f"Error: bad arguments for {self.name}: {exc}"
        except Exception as exc:  # a tool bug must not kill the rollout
            return f"Error: {type(exc).__name__}: {exc}"


@dataclass
class ModelTurn:
    """What the model said in one turn, already parsed.

    Attributes:
        content: text outside the tool-call block (None if empty).
        tool_calls: list of {"name": str, "arguments": json str} in call order.
        parse_error: reason the tool-call block was malformed, if it was.
        truncated: the turn ended inside an unterminated call or hit a length limit.
    """

    content: str | None
    tool_calls: list[dict] = field(default_factory=list)
    parse_error: str | None = None
    truncated: bool = False


@dataclass
class EnvStep:
    """Result of one environment step.

    Attributes:
        observations: tool results to show the model as one tool turn (empty when done).
        reward: reward of the episode so far (final when ``done``).
        done: no further model turn.
        info: free-form metrics for logging (e.g. {"tool_calls": 1}).
    """

    observations: list[str]
    reward: float
    done: bool
    info: dict[str, Any] = field(default_factory=dict)


class Environment(abc.ABC):
    """A task with tools and a reward. One instance serves many episodes; episode state lives in
    the ``state`` dict that ``reset`` returns and ``step`` receives."""

    tools: list[Tool] = []

    def tool_schemas(self) -> list[dict]:
        return [t.schema() for t in self.tools]

    @abc.abstractmethod
    def reset(self, record: dict) -> tuple[list[dict], dict]:
        """Start an episode. Returns (chat messages for the prompt, episode state)."""

    @abc.abstractmethod
    def step(self, state: dict, turn: ModelTurn) -> EnvStep:
        """Advance on the model's turn."""

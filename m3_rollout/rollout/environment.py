"""Environment plug-in contract (design.md §3): a task, its tools and its reward.

Governing idea: the rollout loop owns tokens; an environment only sees parsed model turns. It
``reset``s a prompt record into chat messages and, after every model turn, ``step``s on what the
model said (tool calls or a final answer) and returns tool observations, a reward, and whether
the episode is over. Tools are plain Python callables with a JSON schema. Before a tool runs,
``run_tool_calls`` checks the call: a call the parser flagged (malformed XML, cut off), an
unknown tool name or arguments that break the schema become error observations for the model.
Valid calls run in a ``ToolProcessPool`` (time limit, capped output); nothing is ever a crash.
A call the turn ended inside is no call (its text is content): it gets the parse-error
observation ``parse_error_observation(UNFINISHED_CALL)``, alone or after the results of the calls
the turn closed before it (``tool_observations``).
"""

from __future__ import annotations

import abc
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jsonschema

from m3_rollout.rollout.tool_pool import ToolProcessPool

# The parse error an environment gets for a turn that ended inside a tool call (the stop token, a
# stop string, or a token limit): the parser returns that call's text as content, not as a call,
# and this makes the built-in environments answer it like a malformed call instead of scoring it
# as an answer (a cut turn then gets reward 0: it did not answer).
UNFINISHED_CALL = "the turn ended inside a tool call, before its </invoke>; nothing was run"


def parse_error_observation(reason: str) -> str:
    """The observation the built-in environments answer a turn's parse error with (``reason``:
    ``ModelTurn.parse_error``, e.g. ``UNFINISHED_CALL``)."""
    return f"Error: malformed tool call ({reason})"


@dataclass
class Tool:
    """A callable tool with an OpenAI-style function schema.

    Attributes:
        name: function name the model calls.
        description: one line shown in the tools section of the prompt.
        parameters: JSON schema of the arguments object (validated before every call).
        fn: called with the decoded arguments as keyword arguments; returns the observation text.
            Must be a plain function (it runs in a forked worker process).
    """

    name: str
    description: str
    parameters: dict
    fn: Callable[..., str]

    def schema(self) -> dict:
        """OpenAI ``tools`` entry: {"type": "function", "function": {name, description, parameters}}."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }

    def check_arguments(self, arguments_json: str) -> tuple[dict | None, str | None]:
        """Decode and validate a JSON arguments string: (arguments, None) or (None, error text)."""
        try:
            args = json.loads(arguments_json) if arguments_json.strip() else {}
        except json.JSONDecodeError as exc:
            return None, f"Error: arguments are not valid JSON ({exc.msg})"
        if not isinstance(args, dict):
            return None, "Error: arguments must be an object"
        error = jsonschema.exceptions.best_match(jsonschema.Draft202012Validator(self.parameters).iter_errors(args))
        if error is not None:
            where = "/".join(str(p) for p in error.absolute_path)
            return None, f"Error: invalid arguments for {self.name}{' at ' + where if where else ''}: {error.message}"
        return args, None

    def call(self, arguments_json: str) -> str:
        """Validate and run the tool in this process (no time limit; tests and debugging)."""
        args, error = self.check_arguments(arguments_json)
        if error:
            return error
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
        content: text outside the tool-call block (None if empty), followed by the verbatim text
            of a tool call the turn ended inside (the parser cannot parse a cut call; see truncated).
        tool_calls: list of {"id", "name", "arguments" (JSON string), optional "truncated" (bool)
            and "error" (str)} in call order, as the tool parser flagged them (the parser sets no
            "truncated": a call cut off is in content; the flag is for calls built elsewhere).
        parse_error: reason the tool-call block was malformed, if it was (the rollout also sets
            it, to ``UNFINISHED_CALL`` unless a closed call was malformed, for a turn that ended
            inside a tool call, stopped or cut by a token limit, so the call is answered with an
            error, not scored as an answer).
        truncated: the turn ended inside an unterminated call or hit a length limit. The rollout
            passes tool_calls only for a turn that stopped (not cut by a limit), so with
            tool_calls it means: the turn stopped inside a further call after them.
        reasoning: text of the think span, if any.
        finish_reason: the engine's finish reason of this turn ("stop", "length", ...).
    """

    content: str | None
    tool_calls: list[dict] = field(default_factory=list)
    parse_error: str | None = None
    truncated: bool = False
    reasoning: str | None = None
    finish_reason: str = "stop"


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


@dataclass
class ToolSettings:
    """How tools run. num_workers processes; each call killed after timeout_s seconds; output
    cut to max_output_chars characters."""

    num_workers: int = 2
    timeout_s: float = 1.0
    max_output_chars: int = 2048


class Environment(abc.ABC):
    """A task with tools and a reward. One instance serves many episodes; episode state lives in
    the ``state`` dict that ``reset`` returns and ``step`` receives.

    Subclasses set ``self.tools`` and call ``super().__init__(tool_settings)``.
    """

    tools: list[Tool] = []

    def __init__(self, tool_settings: ToolSettings | None = None):
        self.tool_settings = tool_settings or ToolSettings()
        self._pool: ToolProcessPool | None = None

    def tool_schemas(self) -> list[dict]:
        return [t.schema() for t in self.tools]

    @property
    def pool(self) -> ToolProcessPool:
        """The worker pool, started on first use with the tools defined by then."""
        if self._pool is None:
            s = self.tool_settings
            self._pool = ToolProcessPool(
                {t.name: t.fn for t in self.tools}, s.num_workers, s.timeout_s, s.max_output_chars
            )
        return self._pool

    def run_tool_calls(self, calls: list[dict]) -> list[str]:
        """One observation per call, in order: an error text for a flagged, unknown or
        schema-violating call, else the tool's (capped) output from the worker pool."""
        by_name = {t.name: t for t in self.tools}
        out: list[str | None] = [None] * len(calls)
        jobs: list[tuple[str, dict]] = []
        slots: list[int] = []
        for i, call in enumerate(calls):
            name = call.get("name")
            if call.get("error"):
                out[i] = f"Error: malformed tool call to {name!r} ({call['error']}); nothing was run"
            elif call.get("truncated"):
                out[i] = f"Error: the call to {name!r} was cut off before </invoke>; nothing was run"
            elif name not in by_name:
                out[i] = f"Error: unknown tool {name!r}; available tools: {', '.join(sorted(by_name)) or 'none'}"
            else:
                args, error = by_name[name].check_arguments(call.get("arguments", ""))
                if error:
                    out[i] = error
                else:
                    jobs.append((name, args))
                    slots.append(i)
        for i, text in zip(slots, self.pool.run(jobs)):
            out[i] = text
        return [o if o is not None else "Error: no result" for o in out]

    def tool_observations(self, turn: ModelTurn) -> list[str]:
        """The tool turn's observations for a turn with tool calls: one per call
        (``run_tool_calls``), then, when the turn stopped inside a further call (``truncated``),
        the observation that call gets when it is the turn's only one,
        ``parse_error_observation(UNFINISHED_CALL)``, so that it is answered too."""
        observations = self.run_tool_calls(turn.tool_calls)
        if turn.truncated:
            observations.append(parse_error_observation(UNFINISHED_CALL))
        return observations

    def close(self) -> None:
        """Stop the tool workers."""
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    @abc.abstractmethod
    def reset(self, record: dict) -> tuple[list[dict], dict]:
        """Start an episode. Returns (chat messages for the prompt, episode state)."""

    @abc.abstractmethod
    def step(self, state: dict, turn: ModelTurn) -> EnvStep:
        """Advance on the model's turn."""

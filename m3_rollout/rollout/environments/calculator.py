"""The default task: multi-digit arithmetic with a ``calculator`` tool.

A tiny model cannot multiply 4-digit numbers in its head, but it can copy the expression into an
M3 tool call, read the result from the tool turn, and answer. Reward 1 for a correct final
answer (the last integer of the final, tool-free assistant turn), else 0.

The calculator never ``eval``s model text (``tools.safe_calculate``: an ``ast`` walk with bounds
on text length, operand digits, exponents and result size); it runs in the tool worker pool.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from m3_rollout.rollout.environment import Environment, EnvStep, ModelTurn, ToolSettings, parse_error_observation
from m3_rollout.rollout.environments.tools import calculator_tool, safe_calculate

SYSTEM_PROMPT = "Use the calculator tool for arithmetic."
_QUESTIONS = ("What is {e}?", "Compute {e}.", "Calculate {e}.", "{e} = ?")
_INT = re.compile(r"-?\d+")


class RecordTask:
    """Base of the task generators: a subclass draws one prompt record with ``record(rng)``
    ({"messages", "answer", ...}); :meth:`records` draws a reproducible set of distinct ones."""

    def record(self, rng: random.Random) -> dict:
        raise NotImplementedError

    def records(self, seed: int, count: int, exclude: set[str] | frozenset = frozenset()) -> list[dict]:
        """``count`` records from ``seed``; questions in ``exclude`` (user texts) are skipped."""
        rng = random.Random(seed)
        out: list[dict] = []
        while len(out) < count:
            rec = self.record(rng)
            if rec["messages"][-1]["content"] not in exclude:
                out.append(rec)
        return out


@dataclass(frozen=True)
class ArithmeticTask(RecordTask):
    """Generator of ``{"messages", "answer"}`` records from a seed.

    Args:
        min_digits, max_digits: operand lengths (inclusive).
        operations: subset of "+-*".
    """

    min_digits: int = 2
    max_digits: int = 4
    operations: str = "+-*"

    def record(self, rng: random.Random) -> dict:
        """One prompt record: {"messages": [system, user], "answer": str, "expression": str}."""

        def operand() -> int:
            d = rng.randint(self.min_digits, self.max_digits)
            return rng.randint(10 ** (d - 1), 10**d - 1)

        a, b, op = operand(), operand(), rng.choice(self.operations)
        expr = f"{a}{op}{b}"
        question = rng.choice(_QUESTIONS).format(e=f"{a} {op} {b}")
        return {
            "messages": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}],
            "answer": str(safe_calculate(expr)),
            "expression": expr,
        }


def tool_steps(record: dict) -> list[tuple[str, str]]:
    """The calculator calls a perfect episode of ``record`` makes, as (expression, result) pairs.

    A multi-step record (``calls`` and ``results``, see ``multistep.MultiStepArithmeticTask``) gives
    one pair per operation; a single-step record gives ``[(expression, answer)]``.

    Raises:
        KeyError: a record with neither ``calls``/``results`` nor ``expression``/``answer``.
    """
    if "calls" in record:
        return list(zip(record["calls"], record["results"], strict=True))
    return [(record["expression"], str(record["answer"]))]


def final_answer(text: str | None) -> str | None:
    """The last integer in an answer text (commas inside numbers ignored), or None."""
    if not text:
        return None
    found = _INT.findall(text.replace(",", ""))
    return found[-1] if found else None


class CalculatorEnvironment(Environment):
    """Episode: the model may call ``calculator`` (any number of turns up to the rollout's turn
    limit), then must answer without a tool call. Reward = 1.0 iff that answer's last integer
    equals the record's ``answer``.
    """

    def __init__(self, max_expression_chars: int = 64, tool_settings: ToolSettings | None = None):
        super().__init__(tool_settings)
        self.max_expression_chars = max_expression_chars
        self.tools = [calculator_tool(max_expression_chars)]

    def reset(self, record: dict) -> tuple[list[dict], dict]:
        if "messages" in record:
            messages = [dict(m) for m in record["messages"]]
        elif "prompt" in record:
            messages = [
                {"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": str(record["prompt"])},
            ]
        else:
            raise ValueError("a prompt record needs 'messages' or 'prompt' (and 'answer')")
        if "answer" not in record:
            raise ValueError("a prompt record needs an 'answer'")
        return messages, {"answer": str(record["answer"]).strip(), "tool_calls": 0}

    def step(self, state: dict, turn: ModelTurn) -> EnvStep:
        if turn.tool_calls:
            observations = self.tool_observations(turn)  # a call it stopped inside last: an error
            state["tool_calls"] += len(turn.tool_calls)
            return EnvStep(observations, 0.0, False, {"tool_calls": state["tool_calls"]})
        if turn.parse_error:
            return EnvStep([parse_error_observation(turn.parse_error)], 0.0, False, {"tool_calls": state["tool_calls"]})
        correct = final_answer(turn.content) == state["answer"]
        return EnvStep([], 1.0 if correct else 0.0, True, {"tool_calls": state["tool_calls"]})

"""The default task: multi-digit arithmetic with a ``calculator`` tool.

A tiny model cannot multiply 4-digit numbers in its head, but it can copy the expression into an
M3 tool call, read the result from the tool turn, and answer. Reward 1 for a correct final
answer (the last integer of the final, tool-free assistant turn), else 0.

The calculator never ``eval``s model text: it parses ``int op int ...`` with Python's ``ast``
and walks only integer constants, unary minus and + - * nodes, with a size limit.
"""

from __future__ import annotations

import ast
import random
import re
import warnings
from dataclasses import dataclass

from m3_rollout.rollout.environment import Environment, EnvStep, ModelTurn, Tool

SYSTEM_PROMPT = "Use the calculator tool for arithmetic."
_QUESTIONS = ("What is {e}?", "Compute {e}.", "Calculate {e}.", "{e} = ?")
_INT = re.compile(r"-?\d+")


def safe_calculate(expression: str, max_chars: int = 64) -> int:
    """Evaluate an integer expression with + - * and parentheses, without ``eval``.

    Raises:
        ValueError: expression too long, empty, or containing anything but integers, + - *,
            unary minus and parentheses; or an intermediate result above 10**30.
    """
    if len(expression) > max_chars:
        raise ValueError(f"expression longer than {max_chars} characters")
    try:
        with warnings.catch_warnings():  # model text like "12]3" makes ast warn before failing
            warnings.simplefilter("ignore", SyntaxWarning)
            tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"cannot parse expression {expression!r}") from None

    def walk(node: ast.AST) -> int:
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            v = walk(node.operand)
            return -v if isinstance(node.op, ast.USub) else v
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult)):
            a, b = walk(node.left), walk(node.right)
            v = a + b if isinstance(node.op, ast.Add) else a - b if isinstance(node.op, ast.Sub) else a * b
            if abs(v) > 10 ** 30:
                raise ValueError("result too large")
            return v
        raise ValueError(f"unsupported syntax in {expression!r}: only integers, + - * and parentheses")

    return walk(tree)


@dataclass(frozen=True)
class ArithmeticTask:
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
            return rng.randint(10 ** (d - 1), 10 ** d - 1)

        a, b, op = operand(), operand(), rng.choice(self.operations)
        expr = f"{a}{op}{b}"
        question = rng.choice(_QUESTIONS).format(e=f"{a} {op} {b}")
        return {"messages": [{"role": "system", "content": SYSTEM_PROMPT},
                             {"role": "user", "content": question}],
                "answer": str(safe_calculate(expr)), "expression": expr}

    def records(self, seed: int, count: int, exclude: set[str] | frozenset = frozenset()) -> list[dict]:
        """``count`` records from ``seed``; questions in ``exclude`` (user texts) are skipped."""
        rng = random.Random(seed)
        out: list[dict] = []
        while len(out) < count:
            rec = self.record(rng)
            if rec["messages"][-1]["content"] not in exclude:
                out.append(rec)
        return out


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

    def __init__(self, max_expression_chars: int = 64):
        self.max_expression_chars = max_expression_chars
        self.tools = [Tool(
            name="calculator",
            description="Evaluate an integer arithmetic expression.",
            parameters={"type": "object",
                        "properties": {"expression": {"type": "string", "description": "e.g. 12*34"}},
                        "required": ["expression"]},
            fn=self._calculator,
        )]
        self._by_name = {t.name: t for t in self.tools}

    def _calculator(self, expression: str) -> str:
        try:
            return str(safe_calculate(str(expression), self.max_expression_chars))
        except ValueError as exc:
            return f"Error: {exc}"

    def reset(self, record: dict) -> tuple[list[dict], dict]:
        if "messages" in record:
            messages = [dict(m) for m in record["messages"]]
        elif "prompt" in record:
            messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": str(record["prompt"])}]
        else:
            raise ValueError("a prompt record needs 'messages' or 'prompt' (and 'answer')")
        if "answer" not in record:
            raise ValueError("a prompt record needs an 'answer'")
        return messages, {"answer": str(record["answer"]).strip(), "tool_calls": 0}

    def step(self, state: dict, turn: ModelTurn) -> EnvStep:
        if turn.tool_calls:
            observations = []
            for call in turn.tool_calls:
                tool = self._by_name.get(call["name"])
                observations.append(tool.call(call["arguments"]) if tool else f"Error: unknown tool {call['name']!r}")
            state["tool_calls"] += len(turn.tool_calls)
            return EnvStep(observations, 0.0, False, {"tool_calls": state["tool_calls"]})
        if turn.parse_error:
            return EnvStep([f"Error: malformed tool call ({turn.parse_error})"], 0.0, False,
                           {"tool_calls": state["tool_calls"]})
        correct = final_answer(turn.content) == state["answer"]
        return EnvStep([], 1.0 if correct else 0.0, True, {"tool_calls": state["tool_calls"]})

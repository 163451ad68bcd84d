"""The multi-step calculator task: a chain of one to three operations, one calculator call each.

"Compute 123 * 45, then add 678 to the result, then multiply the result by 9." The model calls
``calculator`` with ``123*45``, reads 5535 from the tool turn, calls it again with ``5535+678``
(carrying the intermediate result into the next expression), then ``6213*9``, and answers 55917.
The episode runs in the unchanged :class:`~m3_rollout.rollout.environments.calculator.CalculatorEnvironment`
(any number of tool turns up to the rollout's turn limit; reward 1 iff the final answer's last
integer is the chain's result), so only the prompts and the demonstrations differ from the
single-step task.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from m3_rollout.rollout.environments.calculator import RecordTask
from m3_rollout.rollout.environments.tools import safe_calculate

SYSTEM_PROMPT = "Use the calculator tool for every arithmetic step, one call per step, then give the final result."
_FIRST = ("Compute {e}", "Calculate {e}", "Start with {e}", "Take {e}")
_STEP = {
    "+": ("add {x} to the result", "add {x}"),
    "-": ("subtract {x} from the result", "subtract {x}"),
    "*": ("multiply the result by {x}", "multiply by {x}"),
}
_END = (".", ". What is the result?", ". What do you get?")


@dataclass(frozen=True)
class MultiStepArithmeticTask(RecordTask):
    """Generator of multi-step ``{"messages", "answer", "expression", "calls", "results"}`` records.

    A record's chain has ``c`` operations, ``c`` uniform in [min_calls, max_calls]: the first is
    ``a op b`` with operands of min_digits..max_digits digits; each later one applies ``op x`` to
    the previous result, ``x`` of step_min_digits..step_max_digits digits. Every intermediate
    result is an integer (ops from ``operations``, a subset of "+-*"), so the chain needs exactly
    ``c`` calculator calls.

    Args:
        min_calls, max_calls: number of operations (tool calls) per episode, 1 <= min <= max.
        min_digits, max_digits: digits of the first operation's two operands.
        step_min_digits, step_max_digits: digits of each later operand.
        operations: subset of "+-*".

    Raises:
        ValueError: counts or digit ranges out of order, or an operation outside "+-*".
    """

    min_calls: int = 1
    max_calls: int = 3
    min_digits: int = 2
    max_digits: int = 3
    step_min_digits: int = 1
    step_max_digits: int = 2
    operations: str = "+-*"

    def __post_init__(self) -> None:
        if not 1 <= self.min_calls <= self.max_calls:
            raise ValueError(
                f"min_calls={self.min_calls}, max_calls={self.max_calls}: need 1 <= min_calls <= max_calls"
            )
        for lo, hi, name in (
            (self.min_digits, self.max_digits, "min_digits/max_digits"),
            (self.step_min_digits, self.step_max_digits, "step_min_digits/step_max_digits"),
        ):
            if not 1 <= lo <= hi <= 9:
                raise ValueError(f"{name}=({lo}, {hi}): need 1 <= min <= max <= 9")
        if not self.operations or set(self.operations) - set("+-*"):
            raise ValueError(f"operations={self.operations!r}: give a non-empty subset of '+-*'")

    def record(self, rng: random.Random) -> dict:
        """One prompt record.

        Returns:
            {"messages": [system, user], "answer": str (final result), "expression": str (first
            call), "calls": [str] (one calculator expression per operation, each using the
            previous result), "results": [str] (each call's result; the last is the answer)}.
        """

        def operand(lo: int, hi: int) -> int:
            d = rng.randint(lo, hi)
            return rng.randint(10 ** (d - 1) if d > 1 else 2, 10**d - 1)

        n = rng.randint(self.min_calls, self.max_calls)
        a, b = operand(self.min_digits, self.max_digits), operand(self.min_digits, self.max_digits)
        op = rng.choice(self.operations)
        calls = [f"{a}{op}{b}"]
        results = [str(safe_calculate(calls[0]))]
        text = rng.choice(_FIRST).format(e=f"{a} {op} {b}")
        for _ in range(n - 1):
            op, x = rng.choice(self.operations), operand(self.step_min_digits, self.step_max_digits)
            calls.append(f"{results[-1]}{op}{x}")
            results.append(str(safe_calculate(calls[-1])))
            text += ", then " + rng.choice(_STEP[op]).format(x=x)
        text += rng.choice(_END)
        return {
            "messages": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": text}],
            "answer": results[-1],
            "expression": calls[0],
            "calls": calls,
            "results": results,
        }

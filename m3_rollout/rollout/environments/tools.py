"""Built-in tools: the bounded ``calculator`` and ``convert_units``, by name.

Governing idea: a tool is a plain function plus a JSON schema; nothing here ever ``eval``s model
text. ``TOOL_FACTORIES`` maps a tool name to a function building its ``Tool``, so environments
(e.g. the JSONL one) pick tools by name from the config.
"""

from __future__ import annotations

import ast
import math
import warnings
from dataclasses import dataclass

from m3_rollout.rollout.environment import Tool

__all__ = ["safe_calculate", "convert_units", "calculator_tool", "convert_units_tool", "TOOL_FACTORIES", "UNITS"]

_BINOPS = (ast.Add, ast.Sub, ast.Mult, ast.FloorDiv, ast.Mod, ast.Pow)


def safe_calculate(
    expression: str,
    max_chars: int = 64,
    max_operand_digits: int = 18,
    max_exponent: int = 32,
    max_abs_result: int = 10**30,
) -> int:
    """Evaluate an integer expression without ``eval``: walks Python's ``ast`` over integer
    constants, unary +/-, ``+ - * // % **`` and parentheses only.

    Bounds (all raise ValueError): ``max_chars`` on the text, ``max_operand_digits`` digits per
    integer literal, exponents in [0, ``max_exponent``], every intermediate result within
    ``max_abs_result`` (checked before a power is computed, so ``9**32`` never builds a huge int);
    division or modulo by zero.

    Raises:
        ValueError: empty/too long/unparsable expression, unsupported syntax, or a bound exceeded.
    """
    if len(expression) > max_chars:
        raise ValueError(f"expression longer than {max_chars} characters")
    try:
        with warnings.catch_warnings():  # model text like "12]3" makes ast warn before failing
            warnings.simplefilter("ignore", SyntaxWarning)
            tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, RecursionError, MemoryError):  # the last two: nesting beyond the parser
        raise ValueError(f"cannot parse expression {expression!r}") from None

    def bounded(v: int) -> int:
        if abs(v) > max_abs_result:
            raise ValueError("result too large")
        return v

    def walk(node: ast.AST) -> int:
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and type(node.value) is int:
            if len(str(node.value)) > max_operand_digits:
                raise ValueError(f"operand longer than {max_operand_digits} digits")
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            v = walk(node.operand)
            return -v if isinstance(node.op, ast.USub) else v
        if isinstance(node, ast.BinOp) and isinstance(node.op, _BINOPS):
            a, b = walk(node.left), walk(node.right)
            if isinstance(node.op, ast.Pow):
                if not 0 <= b <= max_exponent:
                    raise ValueError(f"exponent {b} outside [0, {max_exponent}]")
                if a not in (-1, 0, 1) and b * math.log10(abs(a)) > math.log10(max_abs_result):
                    raise ValueError("result too large")
                return bounded(a**b)
            if isinstance(node.op, (ast.FloorDiv, ast.Mod)) and b == 0:
                raise ValueError("division by zero")
            ops = {
                ast.Add: a.__add__,
                ast.Sub: a.__sub__,
                ast.Mult: a.__mul__,
                ast.FloorDiv: a.__floordiv__,
                ast.Mod: a.__mod__,
            }
            return bounded(ops[type(node.op)](b))
        raise ValueError(f"unsupported syntax in {expression!r}: only integers, + - * // % **, parentheses")

    try:
        return walk(tree)
    except RecursionError:  # only reachable with a large max_chars
        raise ValueError("expression nested too deeply") from None


@dataclass(frozen=True)
class _Calculator:
    """The calculator tool's function: ``expression`` is its only argument, so a call cannot raise
    its own length cap (``partial(..., max_chars=)`` took a ``max_chars`` the model wrote, which
    the schema, left as the warm-started checkpoint saw it, does not forbid). Picklable for the
    tool pool's worker processes."""

    max_chars: int = 64

    def __call__(self, expression: str) -> str:
        try:
            return str(safe_calculate(str(expression), self.max_chars))
        except ValueError as exc:
            return f"Error: {exc}"


def calculator_tool(max_expression_chars: int = 64) -> Tool:
    """The ``calculator`` tool (schema unchanged since the warm-started checkpoint saw it)."""
    return Tool(
        name="calculator",
        description="Evaluate an integer arithmetic expression.",
        parameters={
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. 12*34"}},
            "required": ["expression"],
        },
        fn=_Calculator(max_expression_chars),
    )


# unit -> (dimension, factor to the SI base unit); temperatures are affine and handled apart.
UNITS: dict[str, tuple[str, float]] = {
    "m": ("length", 1.0),
    "km": ("length", 1000.0),
    "cm": ("length", 0.01),
    "mm": ("length", 0.001),
    "mi": ("length", 1609.344),
    "yd": ("length", 0.9144),
    "ft": ("length", 0.3048),
    "in": ("length", 0.0254),
    "kg": ("mass", 1.0),
    "g": ("mass", 1e-3),
    "mg": ("mass", 1e-6),
    "lb": ("mass", 0.45359237),
    "oz": ("mass", 0.028349523125),
    "s": ("time", 1.0),
    "min": ("time", 60.0),
    "h": ("time", 3600.0),
    "day": ("time", 86400.0),
    "l": ("volume", 1e-3),
    "ml": ("volume", 1e-6),
    "gal": ("volume", 3.785411784e-3),
    "C": ("temperature", 1.0),
    "F": ("temperature", 1.0),
    "K": ("temperature", 1.0),
}
# Temperature unit -> (scale, offset) so that kelvin = value * scale + offset.
_TO_KELVIN = {"K": (1.0, 0.0), "C": (1.0, 273.15), "F": (5.0 / 9.0, 273.15 - 32.0 * 5.0 / 9.0)}


def convert_units(value: float, from_unit: str, to_unit: str) -> str:
    """Convert ``value`` between two units of one dimension (see ``UNITS``); result as
    ``"<number> <to_unit>"`` with 10 significant digits. Errors come back as text."""
    if from_unit not in UNITS or to_unit not in UNITS:
        bad = from_unit if from_unit not in UNITS else to_unit
        return f"Error: unknown unit {bad!r}; known: {', '.join(UNITS)}"
    (dim_a, fa), (dim_b, fb) = UNITS[from_unit], UNITS[to_unit]
    if dim_a != dim_b:
        return f"Error: cannot convert {dim_a} ({from_unit}) to {dim_b} ({to_unit})"
    if not abs(value) <= 1e15:  # also NaN, inf, and ints too large for a float
        return "Error: value must be finite and at most 1e15 in magnitude"
    if dim_a == "temperature":
        (sa, oa), (sb, ob) = _TO_KELVIN[from_unit], _TO_KELVIN[to_unit]
        result = (value * sa + oa - ob) / sb
    else:
        result = value * fa / fb
    return f"{result:.10g} {to_unit}"


def convert_units_tool() -> Tool:
    """The ``convert_units`` tool: length, mass, time, volume and temperature units."""
    return Tool(
        name="convert_units",
        description="Convert a value between units (length, mass, time, volume, temperature).",
        parameters={
            "type": "object",
            "properties": {
                "value": {"type": "number"},
                "from_unit": {"type": "string", "enum": list(UNITS)},
                "to_unit": {"type": "string", "enum": list(UNITS)},
            },
            "required": ["value", "from_unit", "to_unit"],
            "additionalProperties": False,
        },
        fn=convert_units,
    )


TOOL_FACTORIES = {"calculator": calculator_tool, "convert_units": convert_units_tool}

"""Schema typing of tool-call arguments (spec §5.4), stage 2b of the tool parser.

Governing idea: the XML carries no types, so the tool's JSON schema (`function.parameters`)
decides them. A text value is tried against the schema's types in a fixed priority (null,
integer, number, boolean, object, array, string); an element tree becomes an array or object as
the schema's container says. Without a schema a value stays the raw string, never JSON-parsed,
and every value produced re-serialises as strict JSON (no NaN / Infinity).
"""

from __future__ import annotations

import json
import math
from typing import Any

from m3_rollout.chat.tool_elements import Node, parse_body

__all__ = ["TEXT_KEY", "find_parameters", "parse_arguments"]

TEXT_KEY = "$text"  # reserved key for text mixed in between child elements

# Order in which a text value is tried against the schema's types (spec §5.4).
_TYPE_PRIORITY = ("null", "integer", "number", "boolean", "object", "array", "string")


def _listed(value: Any) -> list:
    """A schema keyword that should hold a list (`type`, `enum`, `anyOf`, ...) as a list: a
    single string becomes [it]; anything else that is not a list (malformed schema) is ignored."""
    if isinstance(value, str):
        return [value]
    return value if isinstance(value, list) else []


def _type_names(schema: dict) -> list[str]:
    """The `type` keyword's names (non-string entries of a malformed schema are ignored)."""
    return [t for t in _listed(schema.get("type")) if isinstance(t, str)]


def _container(schema: Any) -> tuple[str, dict] | None:
    """First array/object alternative of `schema`: ("array"|"object", the sub-schema holding its
    items/properties), looking through `type` lists, `items`/`properties`/`additionalProperties`
    and `anyOf`/`oneOf`."""
    if not isinstance(schema, dict):
        return None
    for t in _type_names(schema):
        if t in ("array", "object"):
            return t, schema
    if "items" in schema:
        return "array", schema
    if "properties" in schema or isinstance(schema.get("additionalProperties"), dict):
        return "object", schema
    for key in ("anyOf", "oneOf"):
        for alt in _listed(schema.get(key)):
            found = _container(alt)
            if found:
                return found
    return None


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):  # before int: bool is an int subclass
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def _schema_types(schema: dict) -> set[str]:
    """Types a value may take, from `type`, `enum` values and `anyOf`/`oneOf`/`allOf`."""
    types: set[str] = set(_type_names(schema))
    types.update(_json_type(v) for v in _listed(schema.get("enum")))
    for key in ("anyOf", "oneOf", "allOf"):
        for alt in _listed(schema.get(key)):
            if isinstance(alt, dict):
                types |= _schema_types(alt)
    return types


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _json_value(text: str) -> Any:
    """`json.loads` that refuses NaN / Infinity (Python's extension of JSON), so every value
    we put into `function.arguments` re-serialises as strict JSON; raises ValueError otherwise.

    NOTE: differs from vLLM, whose plain `json.loads` fallback lets `NaN` through and then emits
    arguments that a strict JSON reader rejects; here such text stays a string."""
    value = json.loads(text, parse_constant=_reject_constant)
    if isinstance(value, float) and not math.isfinite(value):  # e.g. "1e400" overflows to inf
        raise ValueError("non-finite number")
    if isinstance(value, (dict, list)) and not _finite_tree(value):
        raise ValueError("non-finite number")
    return value


def _finite_tree(value: Any) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, dict):
        return all(_finite_tree(v) for v in value.values())
    if isinstance(value, list):
        return all(_finite_tree(v) for v in value)
    return True


def _coerce(text: str, types: set[str]) -> tuple[bool, Any]:
    """Try each listed type in priority order; (True, value) on the first that fits."""
    stripped = text.strip()
    for t in _TYPE_PRIORITY:
        if t not in types:
            continue
        if t == "null" and stripped.lower() == "null":
            return True, None
        if t in ("integer", "number"):
            try:
                return True, int(stripped)
            except ValueError:
                pass
        if t == "number":
            try:
                f = float(stripped)
            except ValueError:
                continue
            if math.isfinite(f):
                return True, f
        if t == "boolean" and stripped.lower() in ("true", "1", "false", "0"):
            return True, stripped.lower() in ("true", "1")
        if t in ("object", "array"):
            try:
                v = _json_value(text)
            except (ValueError, RecursionError):
                continue
            if isinstance(v, dict if t == "object" else list):
                return True, v
        if t == "string":
            return True, text  # byte for byte: no trimming, no entity decoding
    return False, None


def _convert_text(text: str, schema: Any) -> Any:
    if not isinstance(schema, dict):
        return text  # no schema: the raw string, never JSON-parsed
    container = _container(schema)
    types = _schema_types(schema)
    if not types:
        # NOTE: the spec defaults to "string"; a schema that only gives items/properties still
        # clearly means a container, so we infer that type from them.
        types = {container[0]} if container else {"string"}
    if container and "string" not in types and not text.strip():
        return [] if container[0] == "array" else {}
    ok, value = _coerce(text, types)
    if ok:
        return value
    try:
        return _json_value(text)
    except (ValueError, RecursionError):
        return text


def _sub_schema(schema: dict | None, key: str) -> Any:
    """Schema of child `key` of an object schema: `properties[key]`, else `additionalProperties`."""
    if not isinstance(schema, dict):
        return None
    props = schema.get("properties")
    if isinstance(props, dict) and key in props:
        return props[key]
    extra = schema.get("additionalProperties")
    return extra if isinstance(extra, dict) else None


def _convert_object(children: list[tuple[str, Node]], schema: dict | None, text: str = "") -> dict:
    values: dict[str, list[Any]] = {}
    for key, child in children:
        values.setdefault(key, []).append(_convert(child, _sub_schema(schema, key)))
    # Repeated keys collect into a list (this is how `<item>` lists look without a schema).
    out = {key: vals[0] if len(vals) == 1 else vals for key, vals in values.items()}
    if text:
        out[TEXT_KEY] = text
    return out


def _convert(node: Node, schema: Any) -> Any:
    if isinstance(node, str):
        return _convert_text(node, schema)
    container = _container(schema)
    if container and container[0] == "array":
        items = container[1].get("items")
        # Child names are ignored in an array (normally `item`); tuple-style `items` lists apply
        # per position.
        return [
            _convert(child, items[i] if isinstance(items, list) and i < len(items) else items)
            for i, (_, child) in enumerate(node.children)
        ]
    return _convert_object(node.children, container[1] if container else None, node.text)


def find_parameters(tools: list[dict] | None, name: str) -> dict | None:
    """The `parameters` schema of tool `name` (OpenAI-wrapped or bare function objects)."""
    for tool in tools or []:
        fn = tool.get("function", tool) if isinstance(tool, dict) else None
        if isinstance(fn, dict) and fn.get("name") == name:
            params = fn.get("parameters")
            return params if isinstance(params, dict) else None
    return None


def parse_arguments(body: str, parameters: dict | None) -> tuple[dict[str, Any], str | None]:
    """Arguments dict of one invoke body and the first malformed-XML fault (or None).

    Args:
        body: text between `NS<invoke name="…">` and `NS</invoke>` (a finished invoke: one the end
            of the text cut off is not parsed, `tool_parser`).
        parameters: the tool's JSON schema for its arguments (`function.parameters`), or None.
    """
    params, error = parse_body(body)
    return _convert_object(params, parameters), error

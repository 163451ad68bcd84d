"""Parser for M3's namespaced-XML tool calls in model output (spec §5.3, §5.4).

Governing idea: two separate stages, shared by the streaming and the non-streaming parser.
1. `ToolCallScanner` — a state machine over the block-level terminals only (`<tool_call>`,
   `<invoke name=…>`, `</invoke>`). It is fed text in chunks, holds back a possible partial
   terminal at the end of a chunk, and emits events: content text, an invoke's name, an invoke's
   raw body. Parameter tags are not terminals; an invoke body is opaque text until `</invoke>`.
2. `parse_arguments` — turns one invoke body into a JSON-ready dict: an element parser over the
   namespaced tags, then conversion guided by the tool's JSON schema.
`StreamingToolParser` drives both over chunks and emits OpenAI-style deltas; `parse_tool_calls`
is that parser fed the whole text, so the two cannot disagree.

Format (NS = "]<]minimax[>["):
    NS<tool_call>\n NS<invoke name="NAME"> NS<key>VALUE NS</key> ... NS</invoke>\n ... NS</tool_call>
VALUE is raw text, nested elements (object), or NS<item> elements (array).
"""

from __future__ import annotations

import enum
import json
import math
from dataclasses import dataclass, field
from typing import Any

from m3_rollout.chat.markers import NS, TOOL_CALL_OPEN

__all__ = [
    "ParsedOutput",
    "ToolCall",
    "ToolCallScanner",
    "ScanEvent",
    "StreamingToolParser",
    "ToolCallDelta",
    "ToolStreamDelta",
    "parse_arguments",
    "parse_tool_calls",
]

BLOCK_OPEN = TOOL_CALL_OPEN
INVOKE_PREFIX = NS + "<invoke name="
INVOKE_CLOSE = NS + "</invoke>"
# Quote that may follow `name=` -> terminator that ends the name.
NAME_TERMINATORS = {'"': '">', "'": "'>", "": ">"}
MAX_DEPTH = 128
TEXT_KEY = "$text"  # reserved key for text mixed in between child elements


@dataclass
class ToolCall:
    """One parsed invocation. `arguments` is a JSON object string (json.dumps, ensure_ascii=False)."""

    id: str
    name: str
    arguments: str
    type: str = "function"
    # Flags of this call (not part of the OpenAI shape): the text ended inside it, or its XML was
    # malformed (the reason; parameters before the fault are in `arguments`).
    truncated: bool = False
    error: str | None = None

    def to_openai(self) -> dict[str, Any]:
        """OpenAI chat-completions `tool_calls[i]` dict."""
        return {"id": self.id, "type": self.type, "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ParsedOutput:
    """Result of parsing one model output.

    content: text before the tool-call block (None if empty, or whitespace-only with calls).
    tool_calls: invocations in order of appearance.
    truncated: the output ended inside an invocation; arguments parsed so far were kept.
    error: first malformed-XML fault, e.g. a mismatched closing tag; parameters before the
        fault were kept. None when the XML was well formed.
    """

    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)
    truncated: bool = False
    error: str | None = None


# ------------------------------------------------------------------------------------------------
# Stage 1: block-level scanner
# ------------------------------------------------------------------------------------------------


class _State(enum.Enum):
    CONTENT = "content"  # before the tool-call block: text is content
    BLOCK = "block"  # inside/after the block, between invokes: text is dropped
    NAME = "name"  # after `<invoke name=`: reading the tool name
    ARGS = "args"  # after the name: the invoke body, until `</invoke>`


@dataclass
class ScanEvent:
    """kind: "content" (text), "name" (an invoke's name is known), "invoke" (body complete, or
    cut off at end of text when `closed` is False)."""

    kind: str
    text: str = ""
    name: str | None = None
    closed: bool = True


def _partial_suffix(buf: str, marker: str) -> int:
    """Length of the longest suffix of `buf` that is a proper prefix of `marker`."""
    for n in range(min(len(buf), len(marker) - 1), 0, -1):
        if marker.startswith(buf[-n:]):
            return n
    return 0


class ToolCallScanner:
    """Incremental state machine over the block-level terminals (spec §5.4).

    CONTENT --NS<tool_call>--> BLOCK --NS<invoke name=--> NAME --name end--> ARGS
    --NS</invoke>--> BLOCK. NOTE: the spec's PREAMBLE and BETWEEN states behave the same (text is
    dropped, an invoke prefix starts a call) so they are one state here; `NS</tool_call>` needs no
    transition because nothing after the block is ever content again.
    """

    def __init__(self) -> None:
        self.state = _State.CONTENT
        self._buf = ""
        self._name_end = ""  # terminator of the current name, chosen by the opening quote
        self._name: str | None = None
        # Offset in `_buf` before which the current state's terminator is known to be absent, so
        # a long name or invoke body fed in small chunks is scanned once (linear, not quadratic).
        self._scanned = 0

    @property
    def current_name(self) -> str | None:
        """Name of the invoke being read (meaningful in the ARGS state)."""
        return self._name

    @property
    def pending_text(self) -> str:
        """Text received but not yet consumed (in ARGS: the body of the open invoke so far)."""
        return self._buf

    def feed(self, text: str) -> list[ScanEvent]:
        """Consume a chunk; return the events it completes."""
        self._buf += text
        events: list[ScanEvent] = []
        while self._step(events):
            pass
        return events

    def finish(self) -> list[ScanEvent]:
        """End of text: flush held-back content and close an unterminated invoke."""
        events: list[ScanEvent] = []
        if self.state is _State.CONTENT and self._buf:
            events.append(ScanEvent("content", self._buf))
        elif self.state is _State.NAME:
            # Cut off inside the name: which tool was meant is unknown, so no call is emitted.
            events.append(ScanEvent("invoke", name=None, closed=False))
        elif self.state is _State.ARGS:
            events.append(ScanEvent("invoke", text=self._buf, name=self._name, closed=False))
        elif self.state is _State.BLOCK and self._buf.startswith(INVOKE_PREFIX):
            # Cut right after `<invoke name=`: a call was started, its name is unknown.
            events.append(ScanEvent("invoke", name=None, closed=False))
        self._buf = ""
        self._scanned = 0
        self.state = _State.BLOCK
        return events

    def _step(self, events: list[ScanEvent]) -> bool:
        """Advance over one terminal if the buffer holds it; return False when more text is needed."""
        buf = self._buf
        if self.state is _State.CONTENT:
            i = buf.find(BLOCK_OPEN)
            if i < 0:
                keep = _partial_suffix(buf, BLOCK_OPEN)
                if len(buf) > keep:
                    events.append(ScanEvent("content", buf[: len(buf) - keep]))
                self._buf = buf[len(buf) - keep :]
                return False
            if i:
                events.append(ScanEvent("content", buf[:i]))
            self._buf = buf[i + len(BLOCK_OPEN) :]
            self.state = _State.BLOCK
            return True
        if self.state is _State.BLOCK:
            i = buf.find(INVOKE_PREFIX)
            j = i + len(INVOKE_PREFIX)
            if i < 0 or j == len(buf):  # absent, or the quote style is not known yet
                keep = len(buf) - i if i >= 0 else _partial_suffix(buf, INVOKE_PREFIX)
                self._buf = buf[len(buf) - keep :]
                return False
            quote = buf[j] if buf[j] in "\"'" else ""
            self._name_end = NAME_TERMINATORS[quote]
            self._buf = buf[j + len(quote) :]
            self.state = _State.NAME
            return True
        if self.state is _State.NAME:
            i = self._find(self._name_end)
            if i < 0:
                return False
            self._name = buf[:i].strip()
            events.append(ScanEvent("name", name=self._name))
            self._buf = buf[i + len(self._name_end) :]
            self.state = _State.ARGS
            return True
        # ARGS: arguments are not streamed piecewise (converted values are not prefix-stable).
        i = self._find(INVOKE_CLOSE)
        if i < 0:
            return False
        events.append(ScanEvent("invoke", text=buf[:i], name=self._name))
        self._buf = buf[i + len(INVOKE_CLOSE) :]
        self.state = _State.BLOCK
        return True

    def _find(self, marker: str) -> int:
        """`_buf.find(marker)`, skipping the part searched by earlier calls; on success the next
        state starts searching from 0 again."""
        i = self._buf.find(marker, self._scanned)
        self._scanned = 0 if i >= 0 else max(0, len(self._buf) - len(marker) + 1)
        return i


# ------------------------------------------------------------------------------------------------
# Stage 2a: element parser for an invoke body
# ------------------------------------------------------------------------------------------------


@dataclass
class _Element:
    """A parsed element with child elements; text-only elements are plain `str` instead."""

    children: list[tuple[str, _Element | str]]
    text: str  # non-blank text found between the children ("" when none)


class _Malformed(Exception):
    pass


class _Unterminated(Exception):
    pass


_OPEN = NS + "<"
_CLOSE = NS + "</"


def _open_tag(s: str, pos: int) -> tuple[str, int]:
    """Name of the opening tag at `pos` (which holds NS + "<") and the offset after its ">"."""
    start = pos + len(_OPEN)
    end = s.find(">", start)
    if end < 0:
        raise _Unterminated(f"unterminated tag at offset {pos}")
    return s[start:end], end + 1


def _parse_value(s: str, pos: int, name: str, depth: int) -> tuple[_Element | str, int]:
    """Parse the value of element `name` whose opening tag ends at `pos`; return it and the
    offset after its closing tag. Text is kept byte for byte; a namespaced closer always ends
    the value, and must name this element."""
    if depth > MAX_DEPTH:
        raise _Malformed(f"elements nested deeper than {MAX_DEPTH}")
    children: list[tuple[str, _Element | str]] = []
    texts: list[str] = []
    while True:
        i = s.find(NS, pos)
        if i < 0:
            raise _Unterminated(f"element {name!r} is not closed")
        texts.append(s[pos:i])
        if s.startswith(_CLOSE, i):
            end = s.find(">", i + len(_CLOSE))
            if end < 0:
                raise _Unterminated(f"element {name!r} is not closed")
            closer = s[i + len(_CLOSE) : end]
            if closer != name:
                raise _Malformed(f"closing tag {closer!r} does not match {name!r} at offset {i}")
            pos = end + 1
            break
        if s.startswith(_OPEN, i):
            child_name, pos = _open_tag(s, i)
            child, pos = _parse_value(s, pos, child_name, depth + 1)
            children.append((child_name, child))
        else:
            # A namespace marker not starting a tag is ordinary text.
            texts.append(NS)
            pos = i + len(NS)
    if not children:
        return "".join(texts), pos
    return _Element(children, "".join(t for t in texts if t.strip())), pos


def _parse_body(body: str, closed: bool) -> tuple[list[tuple[str, _Element | str]], str | None]:
    """Top-level parameters of an invoke body, up to the first fault, and the fault (or None).

    An element cut off by the end of a truncated invoke (`closed=False`) is no fault: the call
    was just not finished.
    """
    params: list[tuple[str, _Element | str]] = []
    pos = 0
    while True:
        while pos < len(body) and body[pos].isspace():
            pos += 1
        if pos == len(body):
            return params, None
        if not body.startswith(_OPEN, pos) or body.startswith(_CLOSE, pos):
            if not closed and INVOKE_CLOSE.startswith(body[pos:]):
                return params, None  # cut off inside the closing `</invoke>` itself
            return params, f"unexpected text at offset {pos}: {body[pos : pos + 30]!r}"
        try:
            name, value_pos = _open_tag(body, pos)
            value, pos = _parse_value(body, value_pos, name, 1)
        except _Unterminated as e:
            return params, (None if not closed else str(e))
        except _Malformed as e:
            return params, str(e)
        params.append((name, value))


# ------------------------------------------------------------------------------------------------
# Stage 2b: schema-guided conversion
# ------------------------------------------------------------------------------------------------

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


def _convert_object(children: list[tuple[str, _Element | str]], schema: dict | None, text: str = "") -> dict:
    values: dict[str, list[Any]] = {}
    for key, child in children:
        values.setdefault(key, []).append(_convert(child, _sub_schema(schema, key)))
    # Repeated keys collect into a list (this is how `<item>` lists look without a schema).
    out = {key: vals[0] if len(vals) == 1 else vals for key, vals in values.items()}
    if text:
        out[TEXT_KEY] = text
    return out


def _convert(node: _Element | str, schema: Any) -> Any:
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


def _find_parameters(tools: list[dict] | None, name: str) -> dict | None:
    """The `parameters` schema of tool `name` (OpenAI-wrapped or bare function objects)."""
    for tool in tools or []:
        fn = tool.get("function", tool) if isinstance(tool, dict) else None
        if isinstance(fn, dict) and fn.get("name") == name:
            params = fn.get("parameters")
            return params if isinstance(params, dict) else None
    return None


def parse_arguments(body: str, parameters: dict | None, closed: bool = True) -> tuple[dict[str, Any], str | None]:
    """Arguments dict of one invoke body and the first malformed-XML fault (or None).

    Args:
        body: text between `NS<invoke name="…">` and `NS</invoke>` (or end of text).
        parameters: the tool's JSON schema for its arguments (`function.parameters`), or None.
        closed: False when the invoke was cut off by the end of the text.
    """
    params, error = _parse_body(body, closed)
    return _convert_object(params, parameters), error


# ------------------------------------------------------------------------------------------------
# Entry point
# ------------------------------------------------------------------------------------------------


@dataclass
class ToolCallDelta:
    """One streamed piece of tool call `index` (OpenAI `delta.tool_calls[i]`).

    The first delta of a call carries `id` and `name`; `arguments` (the complete JSON object
    string, never a fragment) comes once, when the call's `</invoke>` arrives or the stream ends
    inside the call. A call with an empty body gets all three in one delta.
    """

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str | None = None

    def to_openai(self) -> dict[str, Any]:
        """OpenAI chat-completions chunk `delta.tool_calls[i]` dict (absent fields left out)."""
        out: dict[str, Any] = {"index": self.index}
        if self.id is not None:
            out["id"], out["type"] = self.id, "function"
        fn = {k: v for k, v in (("name", self.name), ("arguments", self.arguments)) if v is not None}
        if fn:
            out["function"] = fn
        return out


@dataclass
class ToolStreamDelta:
    """What one `feed` / `finish` call adds: content text and/or tool-call pieces."""

    content: str | None = None
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


class StreamingToolParser:
    """Incremental tool-call parser (spec §5.4, streaming): text in chunks -> OpenAI-style deltas.

    Governing idea: the block-level `ToolCallScanner` does all the chunk handling (it holds back a
    possibly partial terminal, e.g. the namespace marker split across chunks) and every call's
    body is converted only when complete, so the accumulated result does not depend on how the
    text was chunked. The non-streaming `parse_tool_calls` is this parser fed the whole text.

    Rules: content before the block streams as it arrives, except that while all content so far
    is whitespace it is held back, and dropped if a tool call follows (flushed at `finish`
    otherwise). A call's header (`id`, `name`) goes out once argument text follows its name; its
    arguments go out whole at its `</invoke>` (not piecewise: converted values are not prefix
    stable). `finish` closes an unterminated call (flag `truncated`) with the arguments parsed
    so far. `result()` gives the accumulated `ParsedOutput` at any time.

    Args:
        tools: the request's tools (OpenAI format) whose `parameters` schemas type the values.
        first_index: index of the first call; ids are `call_<index>` so they keep counting
            across the turns of a conversation.
    """

    def __init__(self, tools: list[dict] | None = None, first_index: int = 0):
        self.tools = tools
        self.first_index = first_index
        self._scanner = ToolCallScanner()
        self._held_ws = ""  # whitespace-only content held back until it is known to be content
        self._content: list[str] = []
        self._calls: list[ToolCall] = []
        self._header_sent = False  # header of the call being read (scanner in ARGS) is out
        self._truncated = False
        self._error: str | None = None
        self._finished = False

    def feed(self, text: str) -> ToolStreamDelta:
        """Consume the next chunk of decoded model output; return what it completes."""
        if self._finished:
            raise RuntimeError("StreamingToolParser.feed after finish(); make a new parser per output")
        delta = ToolStreamDelta()
        self._handle(self._scanner.feed(text), delta)
        if self._scanner.state is _State.ARGS and not self._header_sent:
            body = self._scanner.pending_text
            if body and not INVOKE_CLOSE.startswith(body):  # argument text, not the closer itself
                self._emit_header(delta)
        return delta

    def finish(self) -> ToolStreamDelta:
        """End of generation: flush held content, close an unterminated call."""
        if self._finished:
            return ToolStreamDelta()
        delta = ToolStreamDelta()
        self._handle(self._scanner.finish(), delta)
        if self._held_ws and not self._calls:
            self._add_content(self._held_ws, delta)
        self._held_ws = ""
        self._finished = True
        return delta

    def result(self) -> ParsedOutput:
        """Content, calls and flags accumulated so far (final after `finish`)."""
        content = "".join(self._content) or None
        return ParsedOutput(content, list(self._calls), self._truncated, self._error)

    # --- internals ---------------------------------------------------------------------------

    def _add_content(self, text: str, delta: ToolStreamDelta) -> None:
        self._content.append(text)
        delta.content = (delta.content or "") + text

    def _next_call_id(self) -> str:
        return f"call_{self.first_index + len(self._calls)}"

    def _emit_header(self, delta: ToolStreamDelta) -> None:
        self._held_ws = ""  # a tool call follows: whitespace-only content is formatting
        index = self.first_index + len(self._calls)
        delta.tool_calls.append(ToolCallDelta(index, self._next_call_id(), self._scanner.current_name))
        self._header_sent = True

    def _handle(self, events: list[ScanEvent], delta: ToolStreamDelta) -> None:
        for event in events:
            if event.kind == "content":
                if self._content:
                    self._add_content(event.text, delta)
                else:
                    self._held_ws += event.text
                    if self._held_ws.strip():
                        text, self._held_ws = self._held_ws, ""
                        self._add_content(text, delta)
            elif event.kind == "name":
                self._header_sent = False
            elif event.kind == "invoke":
                self._truncated |= not event.closed
                if event.name is None:  # cut off inside the name: which tool is unknown
                    continue
                args, fault = parse_arguments(event.text, _find_parameters(self.tools, event.name), event.closed)
                self._error = self._error or fault
                arguments = json.dumps(args, ensure_ascii=False)
                if self._header_sent:
                    delta.tool_calls.append(ToolCallDelta(self.first_index + len(self._calls), arguments=arguments))
                else:
                    self._held_ws = ""
                    delta.tool_calls.append(
                        ToolCallDelta(self.first_index + len(self._calls), self._next_call_id(), event.name, arguments)
                    )
                self._calls.append(
                    ToolCall(self._next_call_id(), event.name, arguments, truncated=not event.closed, error=fault)
                )
                self._header_sent = False


def parse_tool_calls(text: str, tools: list[dict] | None = None, first_index: int = 0) -> ParsedOutput:
    """Split a model output (its content part, after reasoning) into content and tool calls.

    Args:
        text: decoded model output, markers included.
        tools: the request's tools (OpenAI format); they give each parameter's schema. Names
            are not validated against them; an unknown tool's values stay raw strings.
        first_index: index of the first call, for ids `call_<index>` that keep counting across
            the turns of a conversation.

    Returns:
        `ParsedOutput`: content (None if empty, or whitespace-only before a call), calls in
        order, `truncated` (text ended inside a call), `error` (first malformed-XML fault).
    """
    parser = StreamingToolParser(tools, first_index)
    parser.feed(text)
    parser.finish()
    return parser.result()

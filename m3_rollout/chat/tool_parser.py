"""Streaming parser of M3's namespaced-XML tool calls in model output (spec §5.3, §5.4).

Governing idea: one parser for both cases. `StreamingToolParser` drives the block-level
`ToolCallScanner` (tool_scanner) over chunks and converts each invoke body with
`parse_arguments` (tool_arguments: element tree + schema typing) only once the body is complete,
so the accumulated result does not depend on how the text was chunked; it emits OpenAI-style
deltas. `parse_tool_calls` is that parser fed the whole text, so the two cannot disagree.
A call the end of the text cut off (max_tokens inside it) cannot be parsed: its text comes back
as content, verbatim, and the result is flagged `truncated` (nothing the model wrote is lost).

Format (NS = "]<]minimax[>["):
    NS<tool_call>\n NS<invoke name="NAME"> NS<key>VALUE NS</key> ... NS</invoke>\n ... NS</tool_call>
VALUE is raw text, nested elements (object), or NS<item> elements (array).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from m3_rollout.chat.tool_arguments import find_parameters, parse_arguments
from m3_rollout.chat.tool_scanner import ScanEvent, ToolCallScanner

__all__ = [
    "ParsedOutput",
    "StreamingToolParser",
    "ToolCall",
    "ToolCallDelta",
    "ToolStreamDelta",
    "parse_tool_calls",
]

NAMELESS_INVOKE = "invoke has no name"


@dataclass
class ToolCall:
    """One parsed invocation. `arguments` is a JSON object string (json.dumps, ensure_ascii=False)."""

    id: str
    name: str
    arguments: str
    type: str = "function"
    # Flags of this call (not part of the OpenAI shape): its XML was malformed (`error`, the
    # reason; parameters before the fault are in `arguments`). A nameless invoke is kept as a call
    # with name "" and `error` set, so a consumer answers it with an error. `truncated` is never
    # set by this parser any more (a cut-off invoke comes back as content, `ParsedOutput.truncated`);
    # it stays for rollout dumps written when a cut invoke was a call with this flag.
    truncated: bool = False
    error: str | None = None

    def to_openai(self) -> dict[str, Any]:
        """OpenAI chat-completions `tool_calls[i]` dict."""
        return {"id": self.id, "type": self.type, "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ParsedOutput:
    """Result of parsing one model output.

    content: text before the tool-call block (None if empty, or whitespace-only with calls),
        followed by the verbatim text of a call the end of the output cut off (see `truncated`).
    tool_calls: invocations closed by `</invoke>`, in order of appearance.
    truncated: the output ended inside a tool call (inside an invocation, or inside the block
        before any invocation closed): that call cannot be parsed, so it is not in `tool_calls`;
        its text, from `<tool_call>` when no call of the block closed, else from its `<invoke`,
        ends `content`.
    cut_text: that text of the cut call (the end of `content`), "" when not `truncated`; a
        consumer that returns only some calls (OpenAI's `parallel_tool_calls=false`) or wrote a
        call's opening itself (a forced tool choice) finds here what of `content` is the call's.
    error: first malformed-XML fault, e.g. a mismatched closing tag or an invoke without a
        name; parameters before the fault were kept. None when the XML was well formed.
    """

    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)
    truncated: bool = False
    error: str | None = None
    cut_text: str = ""


@dataclass
class ToolCallDelta:
    """One streamed piece of tool call `index` (OpenAI `delta.tool_calls[i]`).

    A call goes out in one delta, `id`, `name` and `arguments` (the complete JSON object string,
    never a fragment), when its `</invoke>` arrives: only then is it known to be a call (a stream
    that ends inside it sends its text as content instead, and a stream cannot take back a call
    header it sent).
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
    otherwise). A call goes out whole (`id`, `name`, arguments) at its `</invoke>` (arguments are
    not streamed piecewise: converted values are not prefix stable). When the text ends inside a
    call, `finish` sends that call's text as content (flag `truncated`; see `ParsedOutput`).
    `result()` gives the accumulated `ParsedOutput` at any time.

    Args:
        tools: the request's tools (OpenAI format) whose `parameters` schemas type the values.
        first_index: index of the first call (the in-process rollout counts on across the turns
            of a trajectory, so its ids stay distinct there).
        id_prefix: call ids are `<id_prefix><index>`. The default `call_` gives ids unique
            only within one conversation; the chat server passes a prefix made unique per
            response and choice (`openai_api.tool_call_id_prefix`).
    """

    def __init__(self, tools: list[dict] | None = None, first_index: int = 0, id_prefix: str = "call_"):
        self.tools = tools
        self.first_index = first_index
        self.id_prefix = id_prefix
        self._scanner = ToolCallScanner()
        self._held_ws = ""  # whitespace-only content held back until it is known to be content
        self._content: list[str] = []
        self._calls: list[ToolCall] = []
        self._truncated = False
        self._cut_text = ""
        self._error: str | None = None
        self._finished = False

    def feed(self, text: str) -> ToolStreamDelta:
        """Consume the next chunk of decoded model output; return what it completes."""
        if self._finished:
            raise RuntimeError("StreamingToolParser.feed after finish(); make a new parser per output")
        delta = ToolStreamDelta()
        self._handle(self._scanner.feed(text), delta)
        return delta

    def finish(self) -> ToolStreamDelta:
        """End of generation: flush held content; the text of a call cut off by the end is content."""
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
        return ParsedOutput(content, list(self._calls), self._truncated, self._error, self._cut_text)

    # --- internals ---------------------------------------------------------------------------

    def _add_content(self, text: str, delta: ToolStreamDelta) -> None:
        self._content.append(text)
        delta.content = (delta.content or "") + text

    def _next_call_id(self) -> str:
        return f"{self.id_prefix}{self.first_index + len(self._calls)}"

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
            elif event.kind == "cut":  # a call the end of the text cut off: its text is content
                self._truncated, self._cut_text = True, event.text
                if self._held_ws and not self._calls:  # no call followed: the whitespace is content
                    self._add_content(self._held_ws, delta)
                self._held_ws = ""
                self._add_content(event.text, delta)
            elif event.kind == "invoke":
                args, fault = parse_arguments(event.text, find_parameters(self.tools, event.name))
                if not event.name:  # `<invoke>` / `<invoke name="">`: a malformed call, not an answer
                    fault = NAMELESS_INVOKE + (f"; {fault}" if fault else "")
                self._error = self._error or fault
                arguments = json.dumps(args, ensure_ascii=False)
                self._held_ws = ""  # a tool call follows: whitespace-only content is formatting
                delta.tool_calls.append(
                    ToolCallDelta(self.first_index + len(self._calls), self._next_call_id(), event.name, arguments)
                )
                self._calls.append(ToolCall(self._next_call_id(), event.name, arguments, error=fault))


def parse_tool_calls(
    text: str, tools: list[dict] | None = None, first_index: int = 0, id_prefix: str = "call_"
) -> ParsedOutput:
    """Split a model output (its content part, after reasoning) into content and tool calls.

    Args:
        text: decoded model output, markers included.
        tools: the request's tools (OpenAI format); they give each parameter's schema. Names
            are not validated against them; an unknown tool's values stay raw strings.
        first_index, id_prefix: as `StreamingToolParser`'s (ids `<id_prefix><index>`).

    Returns:
        `ParsedOutput`: content (None if empty, or whitespace-only before a call; a call the end
        of the text cut off is not parsed: its text ends the content), calls in order,
        `truncated` (text ended inside a call), `error` (first malformed-XML fault).
    """
    parser = StreamingToolParser(tools, first_index, id_prefix)
    parser.feed(text)
    parser.finish()
    return parser.result()

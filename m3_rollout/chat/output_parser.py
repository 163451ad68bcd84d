"""One model turn's text -> reasoning, content and tool calls: the reasoning parser, then the
tool-call parser on the content (spec §5.5 last line), non-streaming and streaming.

Governing idea: a thin composition, no parsing of its own. The streaming form pipes the
reasoning parser's content deltas straight into the streaming tool parser, so both stages keep
their chunk invariance and the accumulated result equals `parse_model_output` of the whole text.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from m3_rollout.chat.reasoning_parser import StreamingReasoningParser
from m3_rollout.chat.tool_parser import StreamingToolParser, ToolCall, ToolCallDelta

__all__ = ["ParsedTurn", "OutputDelta", "StreamingOutputParser", "parse_model_output"]


@dataclass
class ParsedTurn:
    """A parsed model turn.

    reasoning: text of the think span (None when the turn had none).
    content: answer text outside the tool-call block (None if empty / whitespace before a call),
        followed by the verbatim text of a tool call the end of the text cut off.
    tool_calls: OpenAI-style calls in order (`ToolCall.to_openai()`), those closed by `</invoke>`.
    truncated: the text ended inside a tool call (not parsed: its text ends `content`).
    error: first malformed-XML fault of the tool-call block, or None.
    """

    reasoning: str | None
    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)
    truncated: bool = False
    error: str | None = None

    def to_message(self) -> dict:
        """The turn as an OpenAI assistant message (`reasoning_content` as vLLM names it)."""
        msg: dict = {"role": "assistant", "content": self.content}
        if self.reasoning is not None:
            msg["reasoning_content"] = self.reasoning
        if self.tool_calls:
            msg["tool_calls"] = [c.to_openai() for c in self.tool_calls]
        return msg


@dataclass
class OutputDelta:
    """What one chunk adds: reasoning text, content text, tool-call pieces."""

    reasoning: str | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


class StreamingOutputParser:
    """Chunks of one model turn in, `OutputDelta`s out; `result()` is the `ParsedTurn` so far.

    When the reasoning parser re-splits the content (enabled mode, a re-emitted `<mm:think>`,
    see `StreamingReasoningParser`), the tool parser starts over on the new content, so
    `result()` still equals `parse_model_output`; the deltas then repeat that content and its
    calls (a stream cannot take back what it sent).

    Args:
        thinking_mode: the request's thinking mode (decides whether output starts in reasoning).
        tools: the request's tools (schemas type the argument values).
        first_index: index of this turn's first tool call.
        id_prefix: tool-call ids are `<id_prefix><index>` (see `StreamingToolParser`); a re-split
            content's calls, parsed again, keep their ids.
    """

    def __init__(
        self, thinking_mode: str | None, tools: list[dict] | None = None, first_index: int = 0, id_prefix: str = "call_"
    ):
        self._reasoning = StreamingReasoningParser(thinking_mode)
        self._tool_args = (tools, first_index, id_prefix)
        self._tools = StreamingToolParser(*self._tool_args)

    def feed(self, text: str) -> OutputDelta:
        return self._route(self._reasoning.feed(text), final=False)

    def finish(self) -> OutputDelta:
        return self._route(self._reasoning.finish(), final=True)

    def _route(self, rd, final: bool) -> OutputDelta:
        out = OutputDelta(reasoning=rd.reasoning)
        if rd.content_restarted:  # the content was re-split: parse the new content from scratch
            self._tools = StreamingToolParser(*self._tool_args)
        for td in ([self._tools.feed(rd.content)] if rd.content else []) + ([self._tools.finish()] if final else []):
            if td.content:
                out.content = (out.content or "") + td.content
            out.tool_calls.extend(td.tool_calls)
        return out

    @property
    def cut_text(self) -> str:
        """The text of the tool call the turn ended inside, the end of `result().content` (see
        `ParsedOutput.cut_text`); "" when the turn did not end inside one."""
        return self._tools.result().cut_text

    def result(self) -> ParsedTurn:
        tool = self._tools.result()
        return ParsedTurn(self._reasoning.result()[0], tool.content, tool.tool_calls, tool.truncated, tool.error)


def parse_model_output(
    text: str, thinking_mode: str | None, tools: list[dict] | None = None, first_index: int = 0
) -> ParsedTurn:
    """Parse one model turn's decoded text (markers kept, stop token excluded).

    Raises:
        ValueError: unknown `thinking_mode`.
    """
    parser = StreamingOutputParser(thinking_mode, tools, first_index)
    parser.feed(text)
    parser.finish()
    return parser.result()

"""Split a model output into reasoning and content (spec §5.5), non-streaming and streaming.

Governing idea: the only per-request state is whether the output *starts inside* a think span,
which is true exactly when the prompt ended in `<mm:think>` (thinking_mode "enabled"). The split
is a pure function of (text, that flag), so the streaming parser recomputes it on the text so
far and emits only what was added. Reasoning is never stripped; the tool parser runs on the content.

One rule beyond vLLM 0.33: a tool-call block (`]<]minimax[>[<tool_call>`) that starts inside a
think span which is still unclosed at the end of the output ends the reasoning there; the block
and what follows become content, so the call is found (vLLM returns it all as reasoning). A
block inside a span that *is* closed later stays reasoning, as in vLLM (the model was thinking
about a call, then wrote its answer). And a run of stray `</mm:think>` right after the span's
end that a tool-call block follows is dropped whole, as the single closer is (none of it is content).
"""

from __future__ import annotations

from dataclasses import dataclass

from m3_rollout.chat.markers import THINK_CLOSE, THINK_OPEN, THINKING_MODES, TOOL_CALL_OPEN

__all__ = ["split_reasoning", "ReasoningDelta", "StreamingReasoningParser"]

_MARKERS = (THINK_OPEN, THINK_CLOSE, TOOL_CALL_OPEN)


def _check_mode(thinking_mode: str | None) -> None:
    if thinking_mode is not None and thinking_mode not in THINKING_MODES:
        raise ValueError(f"thinking_mode must be one of {THINKING_MODES}, got {thinking_mode!r}")


def _split(text: str, starts_in_reasoning: bool) -> tuple[str | None, str, str, bool]:
    """(reasoning, content_before, rest_of_content, hold_rest).

    `rest_of_content` is the part after the think span. `hold_rest` says the streaming parser
    must hold that part back because a later chunk may still change it: a tool-call block moved
    out of an unclosed span (a later closer turns it back into reasoning), or a rest that is so
    far only stray closers and whitespace (a tool-call block after them drops them)."""
    if not starts_in_reasoning and text.startswith(THINK_CLOSE):  # rule 1
        return (None, "", *_drop_closers_before_block(text[len(THINK_CLOSE) :]))
    if THINK_OPEN not in text:
        if not starts_in_reasoning:  # rule 3
            return None, text, "", False
        before, rest = "", text  # rule 2: the span is open from the first character
    else:
        before, _, rest = text.partition(THINK_OPEN)  # rule 4
    reasoning, closer, after = rest.partition(THINK_CLOSE)
    if closer:
        return (reasoning, before, *_drop_closers_before_block(after))
    i = reasoning.find(TOOL_CALL_OPEN)
    if i >= 0:  # unclosed span with a tool call inside: the call is content
        return reasoning[:i], before, reasoning[i:], True
    return reasoning, before, "", False


def _drop_closers_before_block(rest: str) -> tuple[str, bool]:
    """(rest, undecided) for the content right after the think span ended.

    A run of stray closers at its start (whitespace between them allowed) that a tool-call block
    follows is dropped, as the single closer that ended the span was: none of them is content.
    Without a block after the run the closers stay (spec §5.5 rule 1). `undecided`: `rest` is so
    far only whitespace and closers, so the streaming parser cannot tell which case it is yet.
    """
    pos, closers = 0, []
    while True:
        start = pos
        while pos < len(rest) and rest[pos].isspace():
            pos += 1
        if not rest.startswith(THINK_CLOSE, pos):
            pos = start
            break
        closers.append((start, pos))  # whitespace before this closer: rest[start:pos]
        pos += len(THINK_CLOSE)
    tail = rest[pos:]
    if not closers:
        return rest, not tail.strip()
    if tail.lstrip().startswith(TOOL_CALL_OPEN):
        return "".join(rest[a:b] for a, b in closers) + tail, False
    return rest, not tail.strip()


def split_reasoning(text: str, thinking_mode: str | None) -> tuple[str | None, str | None]:
    """Return (reasoning, content) of a decoded model output.

    Args:
        text: the model's output after the generation prompt, markers included.
        thinking_mode: the request's mode ("enabled" | "disabled" | "adaptive"; None = adaptive).

    Rules, in order (spec §5.5):
    1. Not starting in reasoning and the output starts with `</mm:think>`: that one closer is
       dropped -> (None, rest or None). Later stray closers stay in the content, except a run of
       them right after the span's end (this closer or the one closing the span of rule 2 / 4)
       that a tool-call block follows: the whole run is dropped, like a single closer.
    2. Starting in reasoning and no `<mm:think>` in the output: split at the first closer ->
       (before, after or None); without a closer everything is reasoning -> (text, None).
    3. No `<mm:think>` at all -> (None, text).
    4. Otherwise the first `<mm:think>` opens the span, the next closer ends it:
       (inside, before + after or None); unclosed -> (rest, before or None).
       NOTE: in enabled mode this treats text before a re-emitted opener as content (vLLM).
    Beyond vLLM: in an unclosed span (rules 2 and 4), a tool-call block ends the reasoning and
    is content from there on: (text before the block, before + block...).

    Raises:
        ValueError: unknown `thinking_mode`.
    """
    _check_mode(thinking_mode)
    reasoning, before, rest, _ = _split(text, thinking_mode == "enabled")
    if reasoning is None:
        return None, (before + rest) or None
    return reasoning, (before + rest) or None


@dataclass
class ReasoningDelta:
    """Text one `feed` / `finish` call adds to the reasoning and to the content (None = nothing).

    `content_restarted`: the content so far was re-split (enabled mode, re-emitted opener) and
    `content` is the whole new content, not an addition; a consumer that accumulated the earlier
    content (e.g. a streaming tool parser) must start over from this text.
    """

    reasoning: str | None = None
    content: str | None = None
    content_restarted: bool = False


def _partial_marker_len(text: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a marker."""
    best = 0
    for marker in _MARKERS:
        for n in range(min(len(text), len(marker) - 1), best, -1):
            if marker.startswith(text[-n:]):
                best = n
                break
    return best


class StreamingReasoningParser:
    """Streaming form of `split_reasoning`: chunks of output in, reasoning/content deltas out.

    After each chunk the split of the text so far is recomputed and only the added suffixes are
    emitted. Held back until the next chunk decides them: a trailing partial marker (a prefix of
    `<mm:think>`, `</mm:think>` or the tool-call opener, e.g. a text that is so far only part of
    the closer emits nothing), a tool-call block inside a still-unclosed think span (it is
    content only if the span stays unclosed; `finish` releases it), and content that is so far
    only stray closers (dropped if a tool-call block follows them).

    The deltas concatenate to `split_reasoning` of the whole text, except in the vLLM edge case
    of enabled mode with a re-emitted `<mm:think>`: the text before it already went out as
    reasoning, which a stream cannot take back; it is then sent again as content and the new
    span's reasoning follows the old one (`result()` still gives the non-streaming split).

    Args:
        thinking_mode: "enabled" | "disabled" | "adaptive" | None (= adaptive).
    """

    def __init__(self, thinking_mode: str | None):
        _check_mode(thinking_mode)
        self.thinking_mode = thinking_mode
        self._starts_in_reasoning = thinking_mode == "enabled"
        self._text = ""
        self._sent_reasoning = ""
        self._sent_content = ""
        self._finished = False

    def feed(self, text: str) -> ReasoningDelta:
        """Consume the next chunk; return the reasoning/content it settles."""
        if self._finished:
            raise RuntimeError("StreamingReasoningParser.feed after finish(); make a new parser per output")
        self._text += text
        safe = self._text[: len(self._text) - _partial_marker_len(self._text)]
        reasoning, before, rest, hold = _split(safe, self._starts_in_reasoning)
        return self._emit(reasoning or "", before + ("" if hold else rest))

    def finish(self) -> ReasoningDelta:
        """End of output: release everything held back."""
        if self._finished:
            return ReasoningDelta()
        self._finished = True
        reasoning, before, rest, _ = _split(self._text, self._starts_in_reasoning)
        return self._emit(reasoning or "", before + rest)

    def result(self) -> tuple[str | None, str | None]:
        """`split_reasoning` of all text fed so far."""
        return split_reasoning(self._text, self.thinking_mode)

    def _emit(self, reasoning: str, content: str) -> ReasoningDelta:
        delta = ReasoningDelta()
        delta.reasoning, self._sent_reasoning = _added(self._sent_reasoning, reasoning)
        delta.content_restarted = bool(self._sent_content) and not content.startswith(self._sent_content)
        delta.content, self._sent_content = _added(self._sent_content, content)
        return delta


def _added(sent: str, now: str) -> tuple[str | None, str]:
    """(delta to emit, new "sent" state). A split that no longer extends what was sent (the
    enabled-mode re-emitted opener) restarts from the new text: it is emitted whole."""
    if now.startswith(sent):
        return (now[len(sent) :] or None), now
    return (now or None), now

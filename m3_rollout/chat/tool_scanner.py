"""Block-level scanner of M3's namespaced-XML tool calls (spec §5.4), stage 1 of the tool parser.

Governing idea: only the block-level terminals (`<tool_call>`, `<invoke name=…>` / a nameless
`<invoke …>`, `</invoke>`) are recognised here; an invoke body is opaque text until its
`</invoke>`. The scanner is fed text in chunks, holds back a possible partial terminal at the end
of a chunk, and emits events (content text, a finished invoke's name and raw body, the raw text of
a call the end of the text cut off), so what it emits does not depend on how the text was
chunked. The body's elements and their typing are `tool_arguments`' job; driving both over a
stream is `tool_parser`'s.

Format (NS = "]<]minimax[>["):
    NS<tool_call>\\n NS<invoke name="NAME"> NS<key>VALUE NS</key> ... NS</invoke>\\n ... NS</tool_call>
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from m3_rollout.chat.markers import NS, TOOL_CALL_OPEN

__all__ = ["INVOKE_CLOSE", "ScanEvent", "ScanState", "ToolCallScanner"]

BLOCK_OPEN = TOOL_CALL_OPEN
BLOCK_CLOSE = NS + "</tool_call>"
INVOKE_TAG = NS + "<invoke"
INVOKE_PREFIX = INVOKE_TAG + " name="
INVOKE_CLOSE = NS + "</invoke>"
# Quote that may follow `name=` -> terminator that ends the name.
NAME_TERMINATORS = {'"': '">', "'": "'>", "": ">"}


class ScanState(enum.Enum):
    """Where the scanner is. NOTE: the spec's PREAMBLE and BETWEEN states behave the same (text
    is dropped, an invoke tag starts a call) so they are one state, BLOCK."""

    CONTENT = "content"  # before the tool-call block: text is content
    BLOCK = "block"  # inside/after the block, between invokes: text is dropped
    NAME = "name"  # after `<invoke name=` (or a nameless `<invoke`): reading up to the tag's end
    ARGS = "args"  # after the name: the invoke body, until `</invoke>`


@dataclass
class ScanEvent:
    """One thing the scanner settled.

    kind: "content" (`text` is content), "invoke" (an invoke closed by `</invoke>`: `name` is its
        name, "" for an invoke tag without one; `text` is its body), "cut" (the text ended inside
        a tool call: `text` is that call's text, verbatim, from the block's `<tool_call>` when no
        invoke of the text has closed yet, else from the cut invoke's `<invoke`; see `finish`).
    """

    kind: str
    text: str = ""
    name: str | None = None


def _partial_suffix(buf: str, marker: str) -> int:
    """Length of the longest suffix of `buf` that is a proper prefix of `marker`."""
    for n in range(min(len(buf), len(marker) - 1), 0, -1):
        if marker.startswith(buf[-n:]):
            return n
    return 0


class ToolCallScanner:
    """Incremental state machine over the block-level terminals (spec §5.4).

    CONTENT --NS<tool_call>--> BLOCK --NS<invoke name=--> NAME --name end--> ARGS
    --NS</invoke>--> BLOCK. An invoke tag without `name=` (`NS<invoke>`, `NS<invoke foo="x">`)
    goes through NAME up to its `>` and yields the name "": the parser flags it, so a nameless
    call is never mistaken for an answer without calls. `NS</tool_call>` needs no transition
    because nothing after the block is ever content again (`finish` only looks for it to tell a
    block the text cut off from a finished one).

    The text of the call being read is kept verbatim (`_raw` + `_buf`): from `NS<tool_call>`
    until an invoke closes, then from each `NS<invoke`, so a call the end of the text cuts off
    comes back whole as a "cut" event.
    """

    def __init__(self) -> None:
        self.state = ScanState.CONTENT
        self._buf = ""
        self._name_end = ""  # terminator of the current name, chosen by the opening quote
        self._nameless = False  # the current invoke tag has no `name=` attribute
        self._name: str | None = None
        # Offset in `_buf` before which the current state's terminator is known to be absent, so
        # a long name or invoke body fed in small chunks is scanned once (linear, not quadratic).
        self._scanned = 0
        self._raw = ""  # consumed text of the call being read (see the class docstring)
        self._invoke_closed = False  # an invoke of this text has closed

    def feed(self, text: str) -> list[ScanEvent]:
        """Consume a chunk; return the events it completes."""
        self._buf += text
        events: list[ScanEvent] = []
        while self._step(events):
            pass
        return events

    def finish(self) -> list[ScanEvent]:
        """End of text: flush held-back content, and hand back the text of a call it cut off.

        The text ended inside a tool call when it ended inside an invoke (its tag or its body, no
        `</invoke>`), or inside the block before any invoke closed and before `NS</tool_call>`.
        Such a call cannot be parsed (a cut tag has no name, a cut body incomplete arguments), so
        it is no call: its text comes back verbatim in one "cut" event, from `NS<tool_call>` while
        no invoke has closed (the whole block), else from the cut invoke's `NS<invoke` (the
        newline between invokes is the block's, dropped as before). Text after a finished invoke
        that starts no new one (the block's end, cut or not) is the block's and is dropped.
        """
        events: list[ScanEvent] = []
        if self.state is ScanState.CONTENT:
            if self._buf:
                events.append(ScanEvent("content", self._buf))
        else:
            text, held = self._raw + self._buf, self._buf
            # BLOCK holds back a possible invoke tag: `NS<invo` is one begun, `NS<` may close the block
            in_tag = held.startswith(INVOKE_TAG) or (INVOKE_TAG.startswith(held) and not BLOCK_CLOSE.startswith(held))
            in_invoke = self.state is not ScanState.BLOCK or in_tag
            block_unfinished = not self._invoke_closed and BLOCK_CLOSE not in text
            if in_invoke or block_unfinished:
                events.append(ScanEvent("cut", text))
        self._buf = self._raw = ""
        self._scanned = 0
        self.state = ScanState.BLOCK
        return events

    def _step(self, events: list[ScanEvent]) -> bool:
        """Advance over one terminal if the buffer holds it; return False when more text is needed."""
        buf = self._buf
        if self.state is ScanState.CONTENT:
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
            self._raw = BLOCK_OPEN
            self.state = ScanState.BLOCK
            return True
        if self.state is ScanState.BLOCK:
            return self._step_block(buf)
        if self.state is ScanState.NAME:
            i = self._find(self._name_end)
            if i < 0:
                return False
            self._name = "" if self._nameless else buf[:i].strip()
            self._raw += buf[: i + len(self._name_end)]
            self._buf = buf[i + len(self._name_end) :]
            self.state = ScanState.ARGS
            return True
        # ARGS: arguments are not streamed piecewise (converted values are not prefix-stable).
        i = self._find(INVOKE_CLOSE)
        if i < 0:
            return False
        events.append(ScanEvent("invoke", text=buf[:i], name=self._name))
        self._buf = buf[i + len(INVOKE_CLOSE) :]
        self._raw, self._invoke_closed = "", True
        self.state = ScanState.BLOCK
        return True

    def _step_block(self, buf: str) -> bool:
        """BLOCK: find the next invoke tag and decide whether it has a `name=` attribute. Text
        dropped here is kept in `_raw` only while no invoke has closed (a cut block comes back
        whole); a found tag starts `_raw` afresh once one has."""
        while True:
            i = buf.find(INVOKE_TAG)
            if i < 0:
                keep = len(buf) - _partial_suffix(buf, INVOKE_TAG)
                self._drop(buf[:keep])
                self._buf = buf[keep:]
                return False
            tag = buf[i:]
            j = len(INVOKE_PREFIX)
            if len(tag) <= j and INVOKE_PREFIX.startswith(tag):  # `name=` or its quote not seen yet
                self._drop(buf[:i])
                self._buf = tag
                return False
            if tag.startswith(INVOKE_PREFIX):
                quote = tag[j] if tag[j] in "\"'" else ""
                self._name_end, self._nameless = NAME_TERMINATORS[quote], False
                self._enter_tag(buf[:i], tag[: j + len(quote)])
                self._buf = tag[j + len(quote) :]
                self.state = ScanState.NAME
                return True
            after = tag[len(INVOKE_TAG)]
            if after == ">" or after.isspace():  # an invoke tag without `name=`: read to its `>`
                self._name_end, self._nameless = ">", True
                self._enter_tag(buf[:i], INVOKE_TAG)
                self._buf = tag[len(INVOKE_TAG) :]
                self.state = ScanState.NAME
                return True
            self._drop(buf[: i + len(INVOKE_TAG)])
            buf = tag[len(INVOKE_TAG) :]  # e.g. `<invokes`: not an invoke tag, dropped

    def _drop(self, text: str) -> None:
        """Block text outside any invoke: dropped, but kept for a cut block while no invoke closed."""
        if not self._invoke_closed:
            self._raw += text

    def _enter_tag(self, before: str, tag: str) -> None:
        """An invoke tag starts after the block text `before`; `tag` is its part consumed now."""
        self._drop(before)
        self._raw += tag  # after a closed invoke `_raw` is empty: the cut text starts at the tag

    def _find(self, marker: str) -> int:
        """`_buf.find(marker)`, skipping the part searched by earlier calls; on success the next
        state starts searching from 0 again."""
        i = self._buf.find(marker, self._scanned)
        self._scanned = 0 if i >= 0 else max(0, len(self._buf) - len(marker) + 1)
        return i

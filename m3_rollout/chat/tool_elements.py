"""Element parser for the body of one M3 tool-call invoke (spec §5.4), stage 2a of the tool parser.

Governing idea: an invoke body is a sequence of namespaced elements, `NS<key>VALUE NS</key>`,
where VALUE is raw text (kept byte for byte), nested elements (an object) or `NS<item>` elements
(an array). Only the namespace marker makes a tag, so text that merely looks like XML stays text;
a namespaced closer always ends the value and must name its element. This module builds the
element tree and reports the first fault; giving the values JSON types is `tool_arguments`' job.
"""

from __future__ import annotations

from dataclasses import dataclass

from m3_rollout.chat.markers import NS

__all__ = ["Element", "Node", "parse_body"]

MAX_DEPTH = 128
_OPEN = NS + "<"
_CLOSE = NS + "</"


@dataclass
class Element:
    """A parsed element with child elements; text-only elements are plain `str` instead.

    children: (tag name, child) in order; a name may repeat (list items).
    text: non-blank text found between the children ("" when none).
    """

    children: list[tuple[str, Element | str]]
    text: str


Node = Element | str


class _Malformed(Exception):
    """A fault in the body (an unclosed or mismatched element, too deep a nesting); the message says which."""


def _open_tag(s: str, pos: int) -> tuple[str, int]:
    """Name of the opening tag at `pos` (which holds NS + "<") and the offset after its ">"."""
    start = pos + len(_OPEN)
    end = s.find(">", start)
    if end < 0:
        raise _Malformed(f"unterminated tag at offset {pos}")
    return s[start:end], end + 1


def _parse_value(s: str, pos: int, name: str, depth: int) -> tuple[Node, int]:
    """Parse the value of element `name` whose opening tag ends at `pos`; return it and the
    offset after its closing tag."""
    if depth > MAX_DEPTH:
        raise _Malformed(f"elements nested deeper than {MAX_DEPTH}")
    children: list[tuple[str, Node]] = []
    texts: list[str] = []
    while True:
        i = s.find(NS, pos)
        if i < 0:
            raise _Malformed(f"element {name!r} is not closed")
        texts.append(s[pos:i])
        if s.startswith(_CLOSE, i):
            end = s.find(">", i + len(_CLOSE))
            if end < 0:
                raise _Malformed(f"element {name!r} is not closed")
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
    return Element(children, "".join(t for t in texts if t.strip())), pos


def parse_body(body: str) -> tuple[list[tuple[str, Node]], str | None]:
    """Top-level parameters of an invoke body, up to the first fault, and the fault (or None).

    Args:
        body: text between `NS<invoke name="…">` and `NS</invoke>`.

    Returns:
        ([(parameter name, value node), ...] in order, fault text or None). Parameters before a
        fault are kept.
    """
    params: list[tuple[str, Node]] = []
    pos = 0
    while True:
        while pos < len(body) and body[pos].isspace():
            pos += 1
        if pos == len(body):
            return params, None
        if not body.startswith(_OPEN, pos) or body.startswith(_CLOSE, pos):
            return params, f"unexpected text at offset {pos}: {body[pos : pos + 30]!r}"
        try:
            name, value_pos = _open_tag(body, pos)
            value, pos = _parse_value(body, value_pos, name, 1)
        except _Malformed as e:
            return params, str(e)
        params.append((name, value))

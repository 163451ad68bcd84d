"""Stop strings: does a sample's decoded output contain one, in work bounded per step.

Governing idea (vLLM's stop checker): the check runs after every step that appends tokens, and
the previous check found no stop string, so a new occurrence must end in the text of the tokens
appended since. Only a tail window of the output ids wide enough to hold such an occurrence is
decoded (``stop_window``), not the whole output: a sample of N tokens costs O(N * (new tokens +
longest stop string)) decoded ids instead of O(N^2). The answer equals ``any(s in
complete_text(detokenize(output_ids)) for s in stop_strings)`` (``contains_stop_string``): as in
vLLM, only text of complete characters is matched; a character whose bytes are still to come
(the decode ends in U+FFFD) is held back until the tokens after it are in.

Units: token counts are ids; stop-string lengths are characters (Python ``len`` of ``str``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

# Tokens of slack before the oldest token an occurrence can touch. One is needed: a decoder may
# rewrite the text of the window's first token (SentencePiece drops its leading space; the window
# may start inside a UTF-8 character, whose stray bytes decode as U+FFFD); the rest is margin.
WINDOW_MARGIN = 8


def complete_text(text: str) -> str:
    """``text`` without a last character that may still be incomplete: a decode ending in U+FFFD
    may end inside a multi-byte character whose remaining bytes the next tokens bring (vLLM's
    detokenizer releases no text that ends in U+FFFD). Only the last one is held: a U+FFFD followed
    by any character (another U+FFFD included) stands for a complete invalid byte sequence, text
    the output really has, so a stop string holding U+FFFD matches it once text follows.

    Args:
        text: a decode of output ids (``str``).
    Returns:
        ``text``, less its last character when that is U+FFFD.
    """
    return text[:-1] if text.endswith("\ufffd") else text


def stop_window(num_new: int, max_stop_chars: int) -> int:
    """Output tokens to decode so that every stop-string occurrence that ends in the text of the
    last ``num_new`` tokens lies inside the decoded window, at least one token past its start.

    Why the bound holds: a stop string of L characters is at most 4L UTF-8 bytes (a U+FFFD from
    invalid bytes stands for >= 1 byte), and every id decodes to >= 1 byte (byte-level BPE, markers
    kept), so the tokens before the new ones that hold bytes of the occurrence number at most 4L.

    Args:
        num_new: tokens appended since the last check, >= 0 (1 per plain decode step).
        max_stop_chars: characters of the longest stop string, >= 1.
    Returns:
        tokens: ``num_new + 4 * max_stop_chars + WINDOW_MARGIN``.
    """
    return num_new + 4 * max_stop_chars + WINDOW_MARGIN


def contains_stop_string(
    detokenize: Callable[[list[int]], str],
    token_ids: list[int],
    output_start: int,
    num_checked: int,
    stop_strings: Sequence[str],
) -> bool:
    """Whether ``complete_text(detokenize(token_ids[output_start:]))`` (the sample's output text of
    complete characters) contains one of ``stop_strings``, decoding only its last ``stop_window``
    ids.

    Precondition: the output's first ``num_checked`` tokens were checked and their text contained
    no stop string (0 before the first check); the new tokens are the ones after them (an
    occurrence may end in the character held back then: it lies in the window all the same, as
    the tokens before the new ones that hold its bytes still number at most 4 per character).

    The window's first characters may differ from the whole text's (a character cut by the window
    start decodes as U+FFFD, a first token may lose its leading space): dropping characters cannot
    create an occurrence, but U+FFFD can (a stop string holding U+FFFD), so a hit in a window that
    is not the whole output is confirmed on the whole text (once per sample, when it stops).

    Args:
        detokenize: ``ids -> text``; each id must decode to >= 1 byte of the text (markers kept,
            e.g. ``tokenizer.decode(ids, skip_special_tokens=False)``).
        token_ids: prompt + output ids; output_start: index of the first output id (prompt length).
        num_checked: output tokens already checked, 0 <= num_checked <= output length.
        stop_strings: non-empty strings (at least one).
    Returns:
        True when the whole output text of complete characters contains one of ``stop_strings``.
    """
    n = len(token_ids)
    assert output_start <= output_start + num_checked <= n, (output_start, num_checked, n)
    assert stop_strings and all(stop_strings), stop_strings
    window = stop_window(n - output_start - num_checked, max(map(len, stop_strings)))
    start = max(output_start, n - window)
    text = complete_text(detokenize(token_ids[start:]))
    if not any(s in text for s in stop_strings):
        return False
    if start == output_start:  # the window is the whole output
        return True
    text = complete_text(detokenize(token_ids[output_start:]))
    return any(s in text for s in stop_strings)

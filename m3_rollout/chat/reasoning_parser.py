"""Split a model output into reasoning and content (spec §5.5, non-streaming rules).

Governing idea: the only per-request state is whether the output *starts inside* a think span,
which is true exactly when the prompt ended in `<mm:think>` (thinking_mode "enabled"). The split
is a pure function of (text, that flag), so a streaming parser can recompute it on the text so
far and emit only what changed. Reasoning is never stripped; the tool parser runs on the content.
"""

from __future__ import annotations

from m3_rollout.chat.markers import THINK_CLOSE, THINK_OPEN, THINKING_MODES

__all__ = ["split_reasoning"]


def split_reasoning(text: str, thinking_mode: str | None) -> tuple[str | None, str | None]:
    """Return (reasoning, content) of a decoded model output.

    Args:
        text: the model's output after the generation prompt, markers included.
        thinking_mode: the request's mode ("enabled" | "disabled" | "adaptive"; None = adaptive).

    Rules, in order (spec §5.5):
    1. Not starting in reasoning and the output starts with `</mm:think>`: that one closer is
       dropped -> (None, rest or None). Later stray closers stay in the content.
    2. Starting in reasoning and no `<mm:think>` in the output: split at the first closer ->
       (before, after or None); without a closer everything is reasoning -> (text, None).
    3. No `<mm:think>` at all -> (None, text).
    4. Otherwise the first `<mm:think>` opens the span, the next closer ends it:
       (inside, before + after or None); unclosed -> (rest, before or None).
       NOTE: in enabled mode this treats text before a re-emitted opener as content.
    """
    if thinking_mode is not None and thinking_mode not in THINKING_MODES:
        raise ValueError(f"thinking_mode must be one of {THINKING_MODES}, got {thinking_mode!r}")
    starts_in_reasoning = thinking_mode == "enabled"

    if not starts_in_reasoning and text.startswith(THINK_CLOSE):  # rule 1
        return None, text[len(THINK_CLOSE) :] or None
    if THINK_OPEN not in text:
        if starts_in_reasoning:  # rule 2
            reasoning, closer, content = text.partition(THINK_CLOSE)
            return reasoning, (content or None) if closer else None
        return None, text  # rule 3
    before, _, rest = text.partition(THINK_OPEN)  # rule 4
    reasoning, closer, after = rest.partition(THINK_CLOSE)
    return reasoning, (before + after if closer else before) or None

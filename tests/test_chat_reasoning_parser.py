"""split_reasoning: the four non-streaming rules of spec §5.5."""

import pytest

from m3_rollout.chat.reasoning_parser import split_reasoning

O, C = "<mm:think>", "</mm:think>"


@pytest.mark.parametrize("mode", ["disabled", "adaptive", None])
def test_rule1_leading_closer_dropped_when_not_in_reasoning(mode):
    assert split_reasoning(C + "answer", mode) == (None, "answer")
    assert split_reasoning(C, mode) == (None, None)
    # Only that one leading closer goes; a later stray one stays in the content.
    assert split_reasoning(C + "a" + C + "b", mode) == (None, "a" + C + "b")


def test_rule2_enabled_output_starts_inside_reasoning():
    assert split_reasoning("think hard" + C + "answer", "enabled") == ("think hard", "answer")
    assert split_reasoning("r1" + C + "a" + C + "b", "enabled") == ("r1", "a" + C + "b")
    assert split_reasoning("still thinking", "enabled") == ("still thinking", None)
    assert split_reasoning("done" + C, "enabled") == ("done", None)
    # A leading closer in enabled mode means empty reasoning, not rule 1.
    assert split_reasoning(C + "answer", "enabled") == ("", "answer")


@pytest.mark.parametrize("mode", ["disabled", "adaptive"])
def test_rule3_no_opener_everything_is_content(mode):
    assert split_reasoning("plain answer", mode) == (None, "plain answer")
    assert split_reasoning("a" + C + "b", mode) == (None, "a" + C + "b")


def test_rule4_explicit_think_span():
    assert split_reasoning(O + "r" + C + "answer", "adaptive") == ("r", "answer")
    assert split_reasoning("pre " + O + "r" + C + " post", "adaptive") == ("r", "pre  post")
    assert split_reasoning(O + "r" + C, "adaptive") == ("r", None)
    # Unclosed: the rest is reasoning, content is what came before.
    assert split_reasoning(O + "unfinished", "adaptive") == ("unfinished", None)
    assert split_reasoning("pre" + O + "unfinished", "disabled") == ("unfinished", "pre")
    # Enabled mode with a re-emitted opener: text before it is content (spec's edge case).
    assert split_reasoning("x" + O + "r" + C + "a", "enabled") == ("r", "xa")
    # Reasoning is not stripped.
    assert split_reasoning(O + "\n r \n" + C + "a", "adaptive") == ("\n r \n", "a")


def test_unknown_mode_rejected():
    with pytest.raises(ValueError):
        split_reasoning("x", "on")

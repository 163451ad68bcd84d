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


# --- tool call inside an unclosed think span (beyond vLLM 0.33) -------------------------------

NS = "]<]minimax[>["
CALL = f'{NS}<tool_call>\n{NS}<invoke name="f">{NS}<a>1{NS}</a>{NS}</invoke>\n{NS}</tool_call>'


def test_tool_call_inside_unclosed_think_is_content():
    assert split_reasoning("let me call " + CALL, "enabled") == ("let me call ", CALL)
    assert split_reasoning(O + "r " + CALL, "adaptive") == ("r ", CALL)
    assert split_reasoning("pre" + O + "r" + CALL, "disabled") == ("r", "pre" + CALL)
    # A call inside a span that is closed later stays reasoning (as vLLM).
    assert split_reasoning("r " + CALL + C + "answer", "enabled") == ("r " + CALL, "answer")


# --- streaming ---------------------------------------------------------------------------------

from m3_rollout.chat.output_parser import StreamingOutputParser, parse_model_output  # noqa: E402
from m3_rollout.chat.reasoning_parser import StreamingReasoningParser  # noqa: E402

CASES = [
    ("enabled", "think" + C + "answer"),
    ("enabled", "still thinking"),
    ("enabled", C + "answer"),
    ("enabled", "let me call " + CALL),
    ("enabled", "r " + CALL + C + "answer"),
    ("adaptive", C + "answer" + C + "x"),
    ("adaptive", "pre " + O + "r" + C + " post"),
    ("adaptive", O + "unfinished " + CALL),
    ("disabled", "plain <mm:thin answer"),
    ("disabled", "a" + C + "b"),
    (None, O),
    ("adaptive", C),
]


def _stream(mode, chunks):
    p = StreamingReasoningParser(mode)
    deltas = [p.feed(c) for c in chunks] + [p.finish()]
    r = "".join(d.reasoning or "" for d in deltas)
    c = "".join(d.content or "" for d in deltas)
    return deltas, (r, c)


@pytest.mark.parametrize("mode,text", CASES)
def test_streaming_equals_non_streaming_for_any_chunking(mode, text):
    reasoning, content = split_reasoning(text, mode)
    expected = (reasoning or "", content or "")
    assert _stream(mode, [text])[1] == expected
    assert _stream(mode, list(text))[1] == expected
    for cut in range(1, len(text)):
        assert _stream(mode, [text[:cut], text[cut:]])[1] == expected, cut


def test_streaming_holds_partial_markers_and_prefix_of_closer():
    p = StreamingReasoningParser("adaptive")
    d = p.feed("</mm:th")
    assert (d.reasoning, d.content) == (None, None)  # so far only a prefix of the closer
    d = p.feed("ink>Hi")
    assert (d.reasoning, d.content) == (None, "Hi")
    p = StreamingReasoningParser("enabled")
    d = p.feed("abc</mm")
    assert (d.reasoning, d.content) == ("abc", None)
    d = p.feed(":think>x")
    assert (d.reasoning, d.content) == (None, "x")


def test_streaming_holds_tool_block_inside_open_span_until_decided():
    p = StreamingReasoningParser("enabled")
    d = p.feed("r " + CALL)
    assert (d.reasoning, d.content) == ("r ", None)  # the block may still turn out to be reasoning
    d = p.finish()
    assert (d.reasoning, d.content) == (None, CALL)
    p = StreamingReasoningParser("enabled")
    p.feed("r " + CALL)
    d = p.feed(C + "ans")
    assert (d.reasoning, d.content) == (CALL, "ans")


def test_streaming_enabled_reopened_span_documented_divergence():
    text = "x" + O + "r" + C + "a"
    deltas, (r, c) = _stream("enabled", list(text))
    assert split_reasoning(text, "enabled") == ("r", "xa")
    assert (r, c) == ("xr", "xa")  # "x" went out as reasoning before the opener arrived


@pytest.mark.parametrize("mode", ["enabled", "adaptive"])
def test_output_parser_finds_call_in_unclosed_think_streaming_and_not(mode):
    tools = [
        {
            "type": "function",
            "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}},
        }
    ]
    text = ("" if mode == "enabled" else O) + "need f " + CALL
    whole = parse_model_output(text, mode, tools)
    assert (whole.reasoning, whole.content, whole.truncated, whole.error) == ("need f ", None, False, None)
    assert [(c.name, c.arguments) for c in whole.tool_calls] == [("f", '{"a": 1}')]
    assert whole.to_message() == {
        "role": "assistant",
        "content": None,
        "reasoning_content": "need f ",
        "tool_calls": [{"id": "call_0", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}],
    }
    p = StreamingOutputParser(mode, tools)
    deltas = [p.feed(ch) for ch in text] + [p.finish()]
    assert "".join(d.reasoning or "" for d in deltas) == "need f "
    assert [tc.to_openai() for d in deltas for tc in d.tool_calls] == [
        {"index": 0, "id": "call_0", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    ]
    assert p.result() == whole


def test_output_parser_result_survives_enabled_reopened_span():
    # Enabled mode: "a</mm:think>b" first splits into reasoning "a" / content "b"; a later
    # `<mm:think>` re-splits it (rule 4) so the content becomes "a</mm:think>b". The reasoning
    # parser re-sends that content whole; the tool parser behind it must start over rather than
    # append it to the "b" it already has, so `result()` equals the non-streaming parse.
    tools = [
        {
            "type": "function",
            "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}},
        }
    ]
    for text in ("a" + C + "b" + O + "c", "a" + C + "b " + CALL + O + "c" + C + "d"):
        whole = parse_model_output(text, "enabled", tools)
        for chunks in ([text], list(text)):
            p = StreamingOutputParser("enabled", tools)
            for ch in chunks:
                p.feed(ch)
            p.finish()
            assert p.result() == whole, (text, chunks)
    assert parse_model_output("a" + C + "b" + O + "c", "enabled").content == "a" + C + "b"


@pytest.mark.parametrize(
    "mode,text",
    [
        ("disabled", C + C + CALL),
        ("adaptive", C + C + " " + C + "\n" + CALL),
        ("enabled", "r" + C + C + C + CALL),
        ("adaptive", O + "r" + C + C + CALL),
    ],
)
def test_run_of_stray_closers_before_a_tool_block_never_reaches_the_content(mode, text):
    reasoning, content = split_reasoning(text, mode)
    assert reasoning == ("r" if text.startswith(("r", O)) else None)
    assert content.strip() == CALL  # only whitespace between the closers is left before the block
    for chunks in ([text], list(text)):  # the stream agrees, whatever the chunking
        assert _stream(mode, chunks)[1] == (reasoning or "", content)
    turn = parse_model_output(text, mode)
    assert turn.content is None and [c.name for c in turn.tool_calls] == ["f"]


def test_stray_closers_without_a_tool_block_stay_in_the_content():
    assert split_reasoning(C + C + "answer", "disabled") == (None, C + "answer")
    assert split_reasoning(C + " " + C, "adaptive") == (None, " " + C)
    assert _stream("disabled", list(C + " " + C + "x"))[1] == ("", " " + C + "x")

"""StreamingToolParser: OpenAI-style deltas, chunk invariance, timing of headers and arguments."""

import json
import random

import pytest

from m3_rollout.chat.tool_parser import StreamingToolParser, ToolCallDelta, parse_tool_calls

NS = "]<]minimax[>["


def el(name, value=""):
    return f"{NS}<{name}>{value}{NS}</{name}>"


def invoke(name, body=""):
    return f'{NS}<invoke name="{name}">{body}{NS}</invoke>'


def block(*invokes):
    return f"{NS}<tool_call>\n" + "".join(i + "\n" for i in invokes) + f"{NS}</tool_call>"


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "grep",
            "parameters": {
                "type": "object",
                "properties": {
                    "-n": {"type": "boolean"},
                    "--max-count": {"type": "integer"},
                    "file.path": {"type": "string"},
                    "pattern": {"type": "string"},
                    "paths": {"type": "array", "items": {"type": "string"}},
                    "grid": {"type": "array", "items": {"type": "array", "items": {"type": "integer"}}},
                    "opts": {
                        "anyOf": [{"type": "null"}, {"type": "object", "properties": {"depth": {"type": "integer"}}}]
                    },
                    "none": {"type": "array"},
                    "empty": {"type": "object"},
                    "level": {"oneOf": [{"type": "integer"}, {"type": "boolean"}]},
                    "rows": {
                        "oneOf": [
                            {"type": "string"},
                            {
                                "type": "array",
                                "items": {
                                    "type": "object",
                                    "properties": {"id": {"type": "integer"}, "ok": {"type": "boolean"}},
                                },
                            },
                        ]
                    },
                },
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "tag",
            "parameters": {"type": "object", "properties": {"k": {"type": "array", "items": {"type": "integer"}}}},
        },
    },
]
# Byte-exact string: '<', '&', quotes, newlines, a tag-looking text without the namespace marker, a
# lone namespace marker (not a tag) and surrounding spaces.
RAW = '  a<b && "q" \'s\'\n</pattern> <x>&amp; ' + NS + 'x  '
TEXT = (
    "I will search.\n"
    + block(
        invoke(
            "grep",
            el("-n", "true")
            + el("--max-count", "3")
            + el("file.path", "src/a.py")
            + el("pattern", RAW)
            + el("paths", el("item", "only"))
            + el("grid", el("item", el("item", "7")))
            + el("opts", el("depth", "2"))
            + el("none")
            + el("empty", "\n")
            + el("level", "TRUE")
            + el("rows", el("item", el("id", "1") + el("ok", "0"))),
        ),
        invoke("tag", el("k", "1") + el("k", "2")),  # repeated argument name
        invoke("noargs"),
    )
    + "\ntext after the block is dropped"
)
EXPECTED_CONTENT = "I will search.\n"
EXPECTED_CALLS = [
    (
        "call_0",
        "grep",
        {
            "-n": True,
            "--max-count": 3,
            "file.path": "src/a.py",
            "pattern": RAW,
            "paths": ["only"],
            "grid": [[7]],
            "opts": {"depth": 2},
            "none": [],
            "empty": {},
            "level": True,
            "rows": [{"id": 1, "ok": False}],
        },
    ),
    ("call_1", "tag", {"k": [1, 2]}),
    ("call_2", "noargs", {}),
]


def accumulate(deltas):
    """Merge deltas the way an OpenAI client does: content concatenated, calls by index."""
    content, calls = "", {}
    for d in deltas:
        content += d.content or ""
        for tc in d.tool_calls:
            c = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
            if tc.id is not None:
                assert c["id"] is None, "id sent twice"
                c["id"], c["name"] = tc.id, tc.name
            if tc.arguments is not None:
                assert c["arguments"] == "", "arguments are sent once, whole"
                c["arguments"] = tc.arguments
    return content or None, [(c["id"], c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())]


def stream(chunks, tools=TOOLS):
    parser = StreamingToolParser(tools)
    deltas = [parser.feed(c) for c in chunks] + [parser.finish()]
    return accumulate(deltas), parser.result()


def random_chunks(text, rng):
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, 40)))
    return [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


def test_whole_text_exact_result():
    (content, calls), result = stream([TEXT])
    assert content == EXPECTED_CONTENT and calls == EXPECTED_CALLS
    assert (result.truncated, result.error) == (False, None)
    assert [(c.id, c.name, json.loads(c.arguments)) for c in result.tool_calls] == EXPECTED_CALLS
    # Non-streaming parse gives the same.
    ns = parse_tool_calls(TEXT, TOOLS)
    assert ns.content == EXPECTED_CONTENT and ns.tool_calls == result.tool_calls


def test_chunk_invariance_char_by_char_and_random():
    assert stream(list(TEXT))[0] == (EXPECTED_CONTENT, EXPECTED_CALLS)
    rng = random.Random(0)
    for _ in range(40):
        assert stream(random_chunks(TEXT, rng))[0] == (EXPECTED_CONTENT, EXPECTED_CALLS)


def test_namespace_token_split_at_every_offset():
    # Two chunks, split at every offset inside the first namespace marker and inside `</invoke>`.
    starts = [TEXT.index(NS), TEXT.index(f"{NS}</invoke>")]
    for s in starts:
        for k in range(1, len(NS) + len("</invoke>")):
            cut = s + k
            assert stream([TEXT[:cut], TEXT[cut:]])[0] == (EXPECTED_CONTENT, EXPECTED_CALLS), cut


def test_header_after_first_argument_text_and_arguments_at_invoke_close():
    parser = StreamingToolParser(TOOLS)
    head = "pre" + f"{NS}<tool_call>\n" + f'{NS}<invoke name="tag">'
    d = parser.feed(head)
    assert d.content == "pre" and d.tool_calls == []  # no argument text yet
    d = parser.feed(NS[:5])  # could still be the start of `</invoke>`: no header yet
    assert d.tool_calls == []
    d = parser.feed(NS[5:] + "<k>1")
    assert d.tool_calls == [ToolCallDelta(0, "call_0", "tag", None)]
    d = parser.feed(f"{NS}</k>")
    assert d.tool_calls == []  # arguments are not streamed piecewise
    d = parser.feed(f"{NS}</invoke>")
    assert d.tool_calls == [ToolCallDelta(0, arguments='{"k": 1}')]
    assert d.tool_calls[0].to_openai() == {"index": 0, "function": {"arguments": '{"k": 1}'}}


def test_empty_body_call_sends_name_and_arguments_together():
    parser = StreamingToolParser(None, first_index=4)
    deltas = [parser.feed(ch) for ch in block(invoke("noop"))] + [parser.finish()]
    pieces = [tc for d in deltas for tc in d.tool_calls]
    assert pieces == [ToolCallDelta(4, "call_4", "noop", "{}")]
    assert pieces[0].to_openai() == {
        "index": 4,
        "id": "call_4",
        "type": "function",
        "function": {"name": "noop", "arguments": "{}"},
    }


def test_whitespace_content_before_call_dropped_other_content_kept():
    deltas_ws = [StreamingToolParser().feed(" \n ")]
    assert deltas_ws[0].content is None  # held back
    assert stream([" \n", " " + block(invoke("f", el("a", "1")))], None)[0] == (None, [("call_0", "f", {"a": "1"})])
    # Whitespace with no call following is content after all.
    assert stream([" \n", " "], None)[0] == (" \n ", [])
    # Once real content started, later whitespace streams as is (same as non-streaming).
    (content, _), _ = stream(["a", "  \n", block(invoke("f"))], None)
    assert content == "a  \n" == parse_tool_calls("a  \n" + block(invoke("f")), None).content


@pytest.mark.parametrize("split", [1, 7, 20])
def test_truncated_call_closed_at_finish(split):
    text = (
        "x"
        + f"{NS}<tool_call>\n"
        + invoke("tag", el("k", "5"))
        + f'{NS}<invoke name="tag">'
        + el("k", "6")
        + f"{NS}<k>7"
    )
    chunks = [text[:split], text[split:]]
    (content, calls), result = stream(chunks)
    assert content == "x"
    # A bare scalar under an array schema stays a scalar (spec §5.4: no listed type fits -> JSON parse).
    assert calls == [("call_0", "tag", {"k": 5}), ("call_1", "tag", {"k": 6})]
    assert (result.truncated, result.error) == (True, None)


def test_error_flag_streams_parameters_before_fault():
    text = block(invoke("f", el("a", "1") + f"{NS}<b>2{NS}</c>"))
    (content, calls), result = stream(list(text), None)
    assert calls == [("call_0", "f", {"a": "1"})]
    assert "'c'" in result.error and result.truncated is False


def test_feed_after_finish_rejected():
    p = StreamingToolParser()
    p.finish()
    with pytest.raises(RuntimeError, match="new parser"):
        p.feed("x")


def test_long_argument_streamed_in_small_chunks_is_linear_time():
    # The scanner must not re-search the whole open invoke body on every chunk (quadratic: a
    # 400 kB body in 4-character chunks took ~13 s before; linear is well under a second).
    import time

    text = block(invoke("grep", el("pattern", "a" * 400_000)))
    parser = StreamingToolParser(TOOLS)
    t0 = time.perf_counter()
    for i in range(0, len(text), 4):
        parser.feed(text[i : i + 4])
    parser.finish()
    assert time.perf_counter() - t0 < 5.0
    assert parser.result() == parse_tool_calls(text, TOOLS)
    assert json.loads(parser.result().tool_calls[0].arguments) == {"pattern": "a" * 400_000}

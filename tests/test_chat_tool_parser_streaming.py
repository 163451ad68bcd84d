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
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, min(40, len(text) - 1))))
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


def test_a_call_goes_out_whole_at_invoke_close():
    # The header (id, name) used to go out with the first argument text; a stream then cut inside
    # the call had sent a call it could not take back. Now nothing of a call goes out before it closes.
    parser = StreamingToolParser(TOOLS)
    head = "pre" + f"{NS}<tool_call>\n" + f'{NS}<invoke name="tag">'
    d = parser.feed(head)
    assert d.content == "pre" and d.tool_calls == []
    for piece in (NS[:5], NS[5:] + "<k>1", f"{NS}</k>", f"{NS}</inv"):
        assert parser.feed(piece).tool_calls == []  # argument text: the call is not known to finish
    d = parser.feed("oke>")
    assert d.tool_calls == [ToolCallDelta(0, "call_0", "tag", '{"k": 1}')]
    assert d.tool_calls[0].to_openai() == {
        "index": 0,
        "id": "call_0",
        "type": "function",
        "function": {"name": "tag", "arguments": '{"k": 1}'},
    }


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


@pytest.mark.parametrize("split", [1, 7, 20, 60])
def test_cut_call_is_content_at_finish_earlier_calls_stay(split):
    # The cut call was sent as call_1 with {"k": 6}, its "7" lost.
    cut = f'{NS}<invoke name="tag">' + el("k", "6") + f"{NS}<k>7"
    text = "x" + f"{NS}<tool_call>\n" + invoke("tag", el("k", "5")) + "\n" + cut
    chunks = [text[:split], text[split:]]
    (content, calls), result = stream(chunks)
    assert content == "x" + cut  # the newline between the invokes is the block's
    # A bare scalar under an array schema stays a scalar (spec §5.4: no listed type fits -> JSON parse).
    assert calls == [("call_0", "tag", {"k": 5})]
    assert (result.truncated, result.error, result.content) == (True, None, "x" + cut)
    assert result == parse_tool_calls(text, TOOLS)


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


# A generation cut by max_tokens inside a tool call: nothing the model wrote may vanish. A call the
# end of the text cut off is not parsed; its text is content, streamed or not.
CUT_TEXT = "Let me check." + block(invoke("tag", el("k", "5")), invoke("grep", el("pattern", "a b") + el("-n", "true")))
SECOND = CUT_TEXT.index(f'{NS}<invoke name="grep"')
TAG_CALL = ("call_0", "tag", {"k": 5})


def _at(marker, extra=0, start=0):
    return CUT_TEXT.index(marker, start) + len(marker) + extra


@pytest.mark.parametrize(
    "cut, content, calls, truncated",
    [
        # inside the block, before any invoke: the whole block is content
        (_at("<tool_call>"), CUT_TEXT[: _at("<tool_call>")], [], True),
        (_at("<tool_call>\n" + NS[:4]), CUT_TEXT[: _at("<tool_call>\n" + NS[:4])], [], True),
        # inside the first call's name, and right after `name=`
        (_at('name="ta'), CUT_TEXT[: _at('name="ta')], [], True),
        (_at("<invoke name="), CUT_TEXT[: _at("<invoke name=")], [], True),
        # inside the first call's parameter value, and inside its closing </invoke>
        (_at("<k>"), CUT_TEXT[: _at("<k>")], [], True),
        (_at(f"{NS}</inv"), CUT_TEXT[: _at(f"{NS}</inv")], [], True),
        # after the first call's </invoke>: the call stands; the newline is the block's
        (_at("</invoke>"), "Let me check.", [TAG_CALL], False),
        (_at("</invoke>\n"), "Let me check.", [TAG_CALL], False),
        # the second call cut in its tag, its name, its parameter value: from its <invoke on
        (
            _at("</invoke>\n" + NS + "<inv"),
            "Let me check." + CUT_TEXT[SECOND : _at("</invoke>\n" + NS + "<inv")],
            [TAG_CALL],
            True,
        ),
        (_at('name="gr'), "Let me check." + CUT_TEXT[SECOND : _at('name="gr')], [TAG_CALL], True),
        (_at("<pattern>a "), "Let me check." + CUT_TEXT[SECOND : _at("<pattern>a ")], [TAG_CALL], True),
        # after the last </invoke>, before </tool_call> (in its marker, or before it)
        (
            _at("</invoke>", 0, SECOND),
            "Let me check.",
            [TAG_CALL, ("call_1", "grep", {"pattern": "a b", "-n": True})],
            False,
        ),
        (len(CUT_TEXT) - 3, "Let me check.", [TAG_CALL, ("call_1", "grep", {"pattern": "a b", "-n": True})], False),
    ],
)
def test_text_cut_inside_a_call_streamed_and_not(cut, content, calls, truncated):
    text = CUT_TEXT[:cut]
    whole = parse_tool_calls(text, TOOLS)
    assert (whole.content, whole.truncated, whole.error) == (content, truncated, None)
    assert [(c.id, c.name, json.loads(c.arguments)) for c in whole.tool_calls] == calls
    rng = random.Random(cut)
    for chunks in ([text], list(text), random_chunks(text, rng), random_chunks(text, rng)):
        (got_content, got_calls), result = stream(chunks)
        assert (got_content, got_calls) == (content, calls)  # what a client accumulates from the deltas
        assert result == whole


def test_every_cut_point_keeps_all_text_streamed_and_not():
    """For every prefix: calls are the invokes closed in it; when it ends inside a call, the
    content is the text before the block followed by that call's text, verbatim (the whole block
    while no invoke closed, else from the cut invoke's tag on)."""
    closes = [i + len(f"{NS}</invoke>") for i in range(len(CUT_TEXT)) if CUT_TEXT.startswith(f"{NS}</invoke>", i)]
    block_at = CUT_TEXT.index(f"{NS}<tool_call>")
    for cut in range(len(CUT_TEXT) + 1):
        text = CUT_TEXT[:cut]
        whole = parse_tool_calls(text, TOOLS)
        (content, calls), result = stream(list(text))
        assert result == whole and content == whole.content, cut
        assert len(calls) == sum(c <= cut for c in closes), cut
        if whole.truncated:
            start = block_at if cut < closes[0] else SECOND
            assert content == "Let me check." + text[start:], cut
            assert whole.cut_text == text[start:], cut  # the cut call's text, the end of the content
        else:
            assert whole.cut_text == "", cut
            assert content == (text or None if cut < block_at + len(f"{NS}<tool_call>") else "Let me check."), cut

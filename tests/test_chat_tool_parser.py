"""parse_tool_calls: the ]<]minimax[>[ XML tool-call format (spec §5.3, §5.4)."""

import json

import pytest

from m3_rollout.chat.template import load_template, render
from m3_rollout.chat.tool_parser import StreamingToolParser, parse_tool_calls
from m3_rollout.chat.tool_scanner import ToolCallScanner

NS = "]<]minimax[>["


def el(name, value=""):
    return f"{NS}<{name}>{value}{NS}</{name}>"


def invoke(name, body="", quote='"'):
    return f'{NS}<invoke name={quote}{name}{quote}>{body}{NS}</invoke>'


def block(*invokes):
    return f"{NS}<tool_call>\n" + "".join(i + "\n" for i in invokes) + f"{NS}</tool_call>"


def tool(name, properties, **extra):
    return {
        "type": "function",
        "function": {"name": name, "parameters": {"type": "object", "properties": properties, **extra}},
    }


def args_of(out, i=0):
    return json.loads(out.tool_calls[i].arguments)


def test_no_tool_call_is_plain_content():
    out = parse_tool_calls("Just an answer.\n", None)
    assert (out.content, out.tool_calls, out.truncated, out.error) == ("Just an answer.\n", [], False, None)
    assert parse_tool_calls("", None).content is None


def test_single_call_content_before_and_openai_shape():
    tools = [tool("get_weather", {"city": {"type": "string"}, "days": {"type": "integer"}})]
    text = "Let me check.\n" + block(invoke("get_weather", el("city", "Paris") + el("days", "3")))
    out = parse_tool_calls(text, tools)
    assert out.content == "Let me check.\n"  # content is not stripped
    assert out.tool_calls[0].to_openai() == {
        "id": "call_0",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'},
    }
    assert (out.truncated, out.error) == (False, None)


def test_whitespace_content_dropped_and_text_after_block_dropped():
    text = "\n  \n" + block(invoke("f", el("a", "1"))) + "\ntrailing chatter"
    out = parse_tool_calls(text, None)
    assert out.content is None
    assert [c.name for c in out.tool_calls] == ["f"]
    assert args_of(out) == {"a": "1"}  # no schema: raw string


def test_parallel_invokes_and_ids():
    text = block(invoke("a", el("x", "1")), invoke("b", el("y", "2")), invoke("a"))
    out = parse_tool_calls(text, None, first_index=5)
    assert [(c.id, c.name, c.arguments) for c in out.tool_calls] == [
        ("call_5", "a", '{"x": "1"}'),
        ("call_6", "b", '{"y": "2"}'),
        ("call_7", "a", "{}"),  # no-args call
    ]


def test_name_quoting_variants_and_stripping():
    text = block(invoke(" f1 ", quote='"'), invoke("f2", quote="'"), invoke("f3", quote=""))
    assert [c.name for c in parse_tool_calls(text, None).tool_calls] == ["f1", "f2", "f3"]


def test_scalar_typing_by_schema():
    props = {
        "i": {"type": "integer"},
        "n": {"type": "number"},
        "n_int": {"type": "number"},
        "b": {"type": "boolean"},
        "b0": {"type": "boolean"},
        "z": {"type": "null"},
        "opt": {"type": ["integer", "null"]},
        "e": {"enum": [1, 2, 3]},
        "any": {"anyOf": [{"type": "integer"}, {"type": "string"}]},
        "any_s": {"anyOf": [{"type": "integer"}, {"type": "string"}]},
        "s": {"type": "string"},
        "bad_int": {"type": "integer"},
        "inf": {"type": "number"},
    }
    body = "".join(
        [
            el("i", "42"),
            el("n", "2.5"),
            el("n_int", "7"),
            el("b", " TRUE "),
            el("b0", "0"),
            el("z", "Null"),
            el("opt", "null"),
            el("e", "2"),
            el("any", "17"),
            el("any_s", "seventeen"),
            el("s", "  007 &amp; <b>x</b>\n"),
            el("bad_int", "abc"),
            el("inf", "inf"),
        ]
    )
    out = parse_tool_calls(block(invoke("t", body)), [tool("t", props)])
    assert args_of(out) == {
        "i": 42,
        "n": 2.5,
        "n_int": 7,
        "b": True,
        "b0": False,
        "z": None,
        "opt": None,
        "e": 2,
        "any": 17,
        "any_s": "seventeen",
        "s": "  007 &amp; <b>x</b>\n",  # byte for byte: no trim, no entity decoding
        "bad_int": "abc",  # no listed type fits and not JSON: raw string
        "inf": "inf",  # non-finite numbers are rejected
    }


def test_no_schema_keeps_raw_strings_and_repeated_keys_become_list():
    body = el("n", "42") + el("flag", "true") + el("tags", el("item", "a") + el("item", "b"))
    body += el("k", "1") + el("k", "2")
    out = parse_tool_calls(block(invoke("unknown_tool", body)), [tool("other", {})])
    assert args_of(out) == {"n": "42", "flag": "true", "tags": {"item": ["a", "b"]}, "k": ["1", "2"]}


def test_nested_arrays_and_objects_with_schema():
    props = {
        "tags": {"type": "array", "items": {"type": "string"}},
        "matrix": {"type": "array", "items": {"type": "array", "items": {"type": "integer"}}},
        "cfg": {
            "type": "object",
            "properties": {"depth": {"type": "integer"}, "on": {"type": "boolean"}},
            "additionalProperties": {"type": "number"},
        },
        "points": {"type": "array", "items": {"type": "object", "properties": {"x": {"type": "integer"}}}},
        "maybe_list": {"anyOf": [{"type": "null"}, {"type": "array", "items": {"type": "integer"}}]},
        "json_list": {"type": "array", "items": {"type": "integer"}},
        "empty_list": {"type": "array"},
        "empty_obj": {"type": "object"},
        "blank_str_or_list": {"type": ["string", "array"]},
    }
    body = "\n".join(
        [
            el("tags", el("item", "a b") + el("item", "c")),
            el("matrix", el("item", el("item", "1") + el("item", "2")) + el("item", el("item", "3"))),
            el("cfg", el("depth", "2") + el("on", "false") + el("extra", "0.5")),
            el("points", el("item", el("x", "1")) + el("item", el("x", "2"))),
            el("maybe_list", el("item", "9")),
            el("json_list", "[1, 2]"),
            el("empty_list", "\n"),
            el("empty_obj"),
            el("blank_str_or_list", " "),
        ]
    )
    out = parse_tool_calls(block(invoke("t", body)), [tool("t", props)])
    assert args_of(out) == {
        "tags": ["a b", "c"],
        "matrix": [[1, 2], [3]],
        "cfg": {"depth": 2, "on": False, "extra": 0.5},
        "points": [{"x": 1}, {"x": 2}],
        "maybe_list": [9],
        "json_list": [1, 2],
        "empty_list": [],
        "empty_obj": {},
        "blank_str_or_list": " ",
    }
    assert out.error is None


def test_non_identifier_param_names_and_closer_ends_value():
    props = {"-n": {"type": "integer"}, "file.path": {"type": "string"}}
    # A non-namespaced "</file.path>" inside the value is just text; the namespaced closer ends it.
    body = el("-n", "5") + el("file.path", "/tmp/a</file.path>b")
    out = parse_tool_calls(block(invoke("t", body)), [tool("t", props)])
    assert args_of(out) == {"-n": 5, "file.path": "/tmp/a</file.path>b"}


def test_mixed_text_kept_under_reserved_key():
    out = parse_tool_calls(block(invoke("t", el("o", "note" + el("a", "1")))), None)
    assert args_of(out) == {"o": {"a": "1", "$text": "note"}}


def test_cut_invoke_is_no_call_its_text_is_content():
    # A cut call was reported as a call with the parameters before the cut ({"a": 1}): the cut
    # value ("half a val") vanished, and a client saw a call with partial arguments.
    props = {"a": {"type": "integer"}, "b": {"type": "string"}}
    call = f'{NS}<tool_call>\n{NS}<invoke name="t">' + el("a", "1") + f"{NS}<b>half a val"
    out = parse_tool_calls("ok" + call, [tool("t", props)])
    assert (out.content, out.tool_calls, out.truncated, out.error) == ("ok" + call, [], True, None)
    # Cut inside the closing </invoke> itself: still no call (its end was not written).
    cut = call.replace(f"{NS}<b>half a val", f"{NS}</inv")
    out = parse_tool_calls("ok" + cut, [tool("t", props)])
    assert (out.content, out.tool_calls, out.truncated) == ("ok" + cut, [], True)
    # Cut inside the name: the text was dropped, content None.
    out = parse_tool_calls(f'{NS}<tool_call>\n{NS}<invoke name="get_wea', None)
    assert (out.content, out.tool_calls, out.truncated) == (f'{NS}<tool_call>\n{NS}<invoke name="get_wea', [], True)


def test_malformed_xml_keeps_params_before_fault():
    body = el("a", "1") + f"{NS}<b>2{NS}</c>" + el("d", "4")
    out = parse_tool_calls(block(invoke("t", body), invoke("u", el("x", "y"))), None)
    assert args_of(out, 0) == {"a": "1"}
    assert "'c'" in out.error and "'b'" in out.error
    assert out.truncated is False
    assert args_of(out, 1) == {"x": "y"}  # later invokes are unaffected
    # Unclosed element in a terminated invoke is a fault too.
    out = parse_tool_calls(block(invoke("t", el("a", "1") + f"{NS}<b>2")), None)
    assert (args_of(out), out.error is not None) == ({"a": "1"}, True)
    # Stray text at the top level of the body.
    out = parse_tool_calls(block(invoke("t", el("a", "1") + "junk" + el("b", "2"))), None)
    assert (args_of(out), out.error.startswith("unexpected text")) == ({"a": "1"}, True)


def test_nesting_depth_limit():
    deep = "x"
    for _ in range(130):
        deep = el("o", deep)
    out = parse_tool_calls(block(invoke("t", el("ok", "1") + deep)), None)
    assert args_of(out) == {"ok": "1"}
    assert "128" in out.error


def test_scanner_streaming_chunks_give_same_events():
    text = "pre ]<]mini" + block(invoke("f", el("a", "1")), invoke("g")) + "post"
    whole = ToolCallScanner()
    expected = whole.feed(text) + whole.finish()
    chunked = ToolCallScanner()
    events = []
    for ch in text:  # one character at a time: every terminal is split somewhere
        events += chunked.feed(ch)
    events += chunked.finish()
    merged = []
    for e in events:  # content may arrive in more pieces; merge adjacent ones
        if merged and e.kind == merged[-1].kind == "content":
            merged[-1].text += e.text
        else:
            merged.append(e)
    assert merged == expected
    assert [(e.kind, e.name) for e in expected] == [("content", None), ("invoke", "f"), ("invoke", "g")]
    assert expected[0].text == "pre ]<]mini"


@pytest.mark.parametrize("template", ["m3_full", "m3_short"])
def test_round_trip_through_template_to_xml(template):
    properties = {
        "query": {"type": "string"},
        "limit": {"type": "integer"},
        "ratio": {"type": "number"},
        "exact": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "grid": {"type": "array", "items": {"type": "array", "items": {"type": "integer"}}},
        "filters": {
            "type": "object",
            "properties": {
                "lang": {"type": "string"},
                "years": {"type": "array", "items": {"type": "integer"}},
                "nested": {"type": "object", "properties": {"deep": {"type": ["boolean", "null"]}}},
            },
        },
        "nothing": {"type": "array"},
        "blank": {"type": "string"},
    }
    arguments = {
        "query": "  multi\nline <q> & 'quotes' \"x\" ",
        "limit": 10,
        "ratio": 0.25,
        "exact": False,
        "tags": ["a", "b c"],
        "grid": [[1, 2], [], [3]],
        "filters": {"lang": "en", "years": [2024, 2025], "nested": {"deep": True}},
        "nothing": [],
        "blank": "",
    }
    tools = [tool("search", properties), tool("noop", {})]
    calls = [
        {"id": "c0", "type": "function", "function": {"name": "search", "arguments": json.dumps(arguments)}},
        {"id": "c1", "type": "function", "function": {"name": "noop", "arguments": {}}},
    ]
    messages = [
        {"role": "user", "content": "find"},
        {"role": "assistant", "content": "Searching.", "tool_calls": calls},
    ]
    text = render(load_template(template), messages, tools, thinking_mode="disabled")
    # The assistant turn's body, as the model would have emitted it.
    emitted = text.split("]~b]ai\n</mm:think>")[1].split("[e~[")[0]
    out = parse_tool_calls(emitted, tools)
    assert out.content == "Searching."
    assert (out.error, out.truncated) == (None, False)
    assert [c.name for c in out.tool_calls] == ["search", "noop"]
    assert args_of(out, 0) == arguments
    assert args_of(out, 1) == {}


# --- adversarial review ------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity", "1e400"])
def test_arguments_are_strict_json_even_for_non_finite_values(value):
    # A number that is not finite is rejected by the schema types and by the JSON fallback, so
    # the raw text is kept: `function.arguments` must parse with a strict (RFC 8259) JSON reader.
    tools = [tool("f", {"x": {"type": "integer"}, "o": {"type": "object"}})]
    out = parse_tool_calls(block(invoke("f", el("x", value) + el("o", f'{{"k": {value}}}'))), tools)

    def strict(name):
        raise ValueError(f"non-standard JSON constant {name}")

    assert json.loads(out.tool_calls[0].arguments, parse_constant=strict) == {"x": value, "o": f'{{"k": {value}}}'}


@pytest.mark.parametrize(
    "schema, want",
    [
        ({"type": 5}, "7"),  # junk `type`: no usable type -> default string
        ({"type": ["integer", ["x"]]}, 7),  # the usable entry still counts
        ({"enum": 5}, "7"),
        ({"anyOf": 5}, "7"),
        ({"oneOf": [5, {"type": "integer"}]}, 7),
        ({"type": None, "items": 3}, 7),  # `items` implies array; "7" is no array -> JSON fallback
    ],
)
def test_malformed_schema_does_not_crash_the_parser(schema, want):
    # Schemas come from user environments; junk in them is ignored, the value still converts.
    out = parse_tool_calls(block(invoke("f", el("x", "7"))), [tool("f", {"x": schema})])
    assert args_of(out) == {"x": want} and out.error is None


def test_text_cut_right_after_invoke_prefix_is_truncated():
    # Cut inside the name (no name known yet) already says truncated; so must a cut right
    # after `name=` (the quote style is not known yet); the text is content either way.
    for tail in ('<invoke name=', '<invoke name="ca'):
        text = f"{NS}<tool_call>\n{NS}{tail}"
        out = parse_tool_calls(text, None)
        assert (out.content, out.tool_calls, out.truncated, out.error) == (text, [], True, None), tail


@pytest.mark.parametrize(
    "tag",
    [f"{NS}<invoke>", f'{NS}<invoke name="">', f"{NS}<invoke name=>", f'{NS}<invoke tool="calc">'],
)
def test_invoke_without_a_name_is_a_flagged_call_not_an_answer(tag):
    text = "Let me compute." + block(tag + el("expr", "1+2") + f"{NS}</invoke>")
    out = parse_tool_calls(text, [tool("calc", {"expr": {"type": "string"}})])
    assert out.content == "Let me compute."
    assert [(c.name, c.error) for c in out.tool_calls] == [("", "invoke has no name")]
    assert args_of(out) == {"expr": "1+2"}
    assert out.error == "invoke has no name"
    # Chunked one character at a time: the same call and flag.
    parser = StreamingToolParser()
    for ch in text:
        parser.feed(ch)
    parser.finish()
    assert parser.result().tool_calls == out.tool_calls and parser.result().error == out.error


def test_named_call_after_a_nameless_one_keeps_its_own_flags():
    out = parse_tool_calls(block(f"{NS}<invoke>{NS}</invoke>", invoke("f", el("a", "1"))), None)
    assert [(c.name, c.error) for c in out.tool_calls] == [("", "invoke has no name"), ("f", None)]
    assert parse_tool_calls(block(f"{NS}<invokes>junk"), None).tool_calls == []

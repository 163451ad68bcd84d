"""The Jinja chat templates m3_full / m3_short (spec §5.2, §5.3)."""

import json

import jinja2
import pytest
from transformers.utils.chat_template_utils import render_jinja_template

from m3_rollout.chat.template import load_template, normalize_messages, render
from m3_rollout.chat.tokenizer import train_tokenizer

FULL, SHORT = load_template("m3_full"), load_template("m3_short")

MODE_LINES = {
    "enabled": "Current thinking mode: enabled. You MUST think step by step before every response, "
    "including after receiving function/tool results.\n",
    "disabled": "Current thinking mode: disabled. Do not output any thinking process.\n",
    "adaptive": "Current thinking mode: adaptive. You are encouraged to think for complex decision-making, "
    "multi-step reasoning, or when analyzing function/tool results.\n",
}
GEN_PROMPTS = {"enabled": "]~b]ai\n<mm:think>", "disabled": "]~b]ai\n</mm:think>", "adaptive": "]~b]ai\n"}

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
USER = [{"role": "user", "content": "Hi"}]


@pytest.mark.parametrize("mode", ["enabled", "disabled", "adaptive"])
def test_full_mode_line_and_generation_prompt(mode):
    text = render(FULL, USER, add_generation_prompt=True, thinking_mode=mode)
    assert text.startswith("]~!b[]~b]system\n")
    assert text.count("Current thinking mode:") == 1
    assert "\n" + MODE_LINES[mode] + "</thinking_instructions>[e~[\n]~b]developer\n" in text
    assert text.endswith("]~b]user\nHi[e~[\n" + GEN_PROMPTS[mode])
    # Without the generation prompt the text ends with the last turn.
    assert render(FULL, USER, thinking_mode=mode).endswith("]~b]user\nHi[e~[\n")


def test_undefined_thinking_mode_is_adaptive():
    assert render(FULL, USER, add_generation_prompt=True) == render(
        FULL, USER, add_generation_prompt=True, thinking_mode="adaptive"
    )
    assert render(SHORT, USER, add_generation_prompt=True).endswith("]~b]ai\n")


def test_bad_thinking_mode_rejected():
    with pytest.raises(ValueError):
        render(FULL, USER, thinking_mode="on")


def test_developer_block_takes_first_system_message_or_default():
    text = render(FULL, [{"role": "system", "content": "Be terse."}] + USER)
    assert "[e~[\n]~b]developer\nBe terse.[e~[\n]~b]user\nHi" in text
    assert text.count("Be terse.") == 1  # not repeated as a turn
    assert "[e~[\n]~b]developer\nYou are a helpful assistant.[e~[\n" in render(FULL, USER)
    # The root system block never takes the request's system message.
    assert "Be terse." not in text.split("]~b]developer")[0]


def test_tools_section_present_iff_tools():
    with_tools = render(FULL, USER, tools=[WEATHER])
    tool_line = "<tool>" + json.dumps(WEATHER["function"], ensure_ascii=False) + "</tool>\n"
    assert "\n\n# Tools\n" in with_tools
    assert "<tools>\n" + tool_line + "</tools>\n\n" in with_tools
    assert "]<]minimax[>[<tool_call>" in with_tools.split("]~b]user")[0]  # instruction + example
    for text in (render(FULL, USER), render(FULL, USER, tools=[])):
        assert "<tools>" not in text and "# Tools" not in text and "]<]minimax[>[" not in text
    # Bare function objects are accepted as well as OpenAI-wrapped ones.
    assert render(FULL, USER, tools=[WEATHER["function"]]) == with_tools
    assert "\n<tools>{" in render(SHORT, USER, tools=[WEATHER])
    assert "<tools>" not in render(SHORT, USER)


# Hand-written: the short template's rendering of a multi-turn conversation with two parallel
# tool calls (arguments as a JSON string), two grouped tool results, kept reasoning, a follow-up.
MULTI_TURN = [
    {"role": "system", "content": "Sys."},
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_0",
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "arguments": '{"city": "Paris", "units": ["c"], "detail": {"wind": true, "skip": null}}',
                },
            },
            {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": {"tz": "CET", "n": 2}}},
        ],
    },
    {"role": "tool", "tool_call_id": "call_0", "content": "18C"},
    {"role": "tool", "tool_call_id": "call_1", "content": "12:00"},
    {"role": "assistant", "reasoning_content": "use both", "content": "18C at noon."},
    {"role": "user", "content": "Thanks"},
]
TURNS = (
    "]~b]user\nWeather in Paris?[e~[\n"
    "]~b]ai\n</mm:think>]<]minimax[>[<tool_call>\n"
    ']<]minimax[>[<invoke name="get_weather">]<]minimax[>[<city>Paris]<]minimax[>[</city>'
    "]<]minimax[>[<units>]<]minimax[>[<item>c]<]minimax[>[</item>]<]minimax[>[</units>"
    "]<]minimax[>[<detail>]<]minimax[>[<wind>true]<]minimax[>[</wind>]<]minimax[>[</detail>"
    "]<]minimax[>[</invoke>\n"
    ']<]minimax[>[<invoke name="get_time">]<]minimax[>[<tz>CET]<]minimax[>[</tz>]<]minimax[>[<n>2]<]minimax[>[</n>'
    "]<]minimax[>[</invoke>\n"
    "]<]minimax[>[</tool_call>[e~[\n"
    "]~b]tool\n<response>18C</response>\n<response>12:00</response>[e~[\n"
    "]~b]ai\n<mm:think>use both</mm:think>18C at noon.[e~[\n"
    "]~b]user\nThanks[e~[\n"
    "]~b]ai\n</mm:think>"
)


def test_short_multi_turn_exact_string():
    expected = (
        "]~!b[]~b]system\nYou are MiniMax-M3.\nCurrent thinking mode: disabled.[e~[\n"
        "]~b]developer\nSys.\n<tools>"
        '{"name":"get_weather","parameters":{"type":"object","properties":{"city":{"type":"string"}}}}'
        "</tools>[e~[\n" + TURNS
    )
    text = render(SHORT, MULTI_TURN, tools=[WEATHER], add_generation_prompt=True, thinking_mode="disabled")
    assert text == expected


def test_full_multi_turn_turns_exact_and_same_as_short():
    full = render(FULL, MULTI_TURN, tools=[WEATHER], add_generation_prompt=True, thinking_mode="disabled")
    short = render(SHORT, MULTI_TURN, tools=[WEATHER], add_generation_prompt=True, thinking_mode="disabled")
    assert full.endswith("</tools>\n\n" + full.split("</tools>\n\n")[1].split("[e~[\n")[0] + "[e~[\n" + TURNS)
    # Same markers and turn structure: the two differ only in the system and developer texts.
    head_full, head_short = full[: -len(TURNS)], short[: -len(TURNS)]
    for head in (head_full, head_short):
        assert head.startswith("]~!b[]~b]system\n")
        assert head.count("[e~[\n") == 2 and head.endswith("[e~[\n")
        assert "[e~[\n]~b]developer\nSys.\n" in head


def test_to_xml_encoding_rules():
    args = {"s": "a<b>&", "t": True, "f": False, "none": None, "i": -3, "x": 1.5, "empty": [], "obj": {}}
    messages = USER + [{"role": "assistant", "content": "", "tool_calls": [{"name": "f", "arguments": args}]}]
    body = render(SHORT, messages).split('<invoke name="f">')[1].split("]<]minimax[>[</invoke>")[0]
    ns = "]<]minimax[>["
    expected = "".join(
        f"{ns}<{k}>{v}{ns}</{k}>"
        for k, v in [
            ("s", "a<b>&"),
            ("t", "true"),
            ("f", "false"),
            ("i", "-3"),
            ("x", "1.5"),
            ("empty", ""),
            ("obj", ""),
        ]
    )
    assert body == expected  # null dropped, strings unescaped


def test_json_string_and_dict_arguments_render_the_same():
    def conv(arguments):
        call = {"type": "function", "function": {"name": "f", "arguments": arguments}}
        return USER + [{"role": "assistant", "content": "x", "tool_calls": [call]}]

    assert render(FULL, conv('{"a": [1, {"b": "c"}]}')) == render(FULL, conv({"a": [1, {"b": "c"}]}))
    # Rendered straight through transformers (no normalize_messages), a JSON string is refused
    # with a pointer to the fix instead of being written out as one text value.
    with pytest.raises(jinja2.exceptions.TemplateError, match="normalize_messages"):
        render_jinja_template([conv('{"a": 1}')], chat_template=FULL)
    with pytest.raises(ValueError):
        normalize_messages(conv("{not json"))
    with pytest.raises(ValueError):
        normalize_messages(conv("[1, 2]"))


def _short_prompt(tool_def, question):
    return render(
        SHORT,
        [{"role": "user", "content": question}],
        tools=[tool_def],
        add_generation_prompt=True,
        thinking_mode="disabled",
    )


def _fn(name, desc, **props):
    params = {"type": "object", "properties": {k: {"type": v} for k, v in props.items()}}
    return {"type": "function", "function": {"name": name, "description": desc, "parameters": params}}


def test_short_prompt_with_one_tool_is_about_50_tokens():
    tools = [
        _fn("get_weather", "Get the weather", city="string"),
        _fn("search", "Search the web", query="string"),
        _fn("get_time", "Get the time", tz="string"),
        _fn("add", "Add two numbers", a="number", b="number"),
        _fn("get_stock", "Get a stock price", symbol="string"),
    ]
    questions = [
        "What is the weather in Paris?",
        "Who wrote Hamlet?",
        "What time is it in Tokyo?",
        "What is 12 plus 30?",
        "What is the price of AAPL?",
        "Is it raining in London?",
        "Find the capital of Peru.",
        "What time is it in Berlin?",
        "Add 7 and 5.",
        "How is MSFT doing?",
    ]
    corpus = [_short_prompt(t, q) for t in tools for q in questions]
    tok = train_tokenizer(corpus * 3, vocab_size=1000)
    held_out = _short_prompt(_fn("get_weather", "Get the weather", city="string"), "What is the weather in Rome?")
    n = len(tok.encode(held_out, add_special_tokens=False))
    assert n <= 60, (n, held_out)
    # The full template's preamble alone is several times longer.
    full = render(FULL, [{"role": "user", "content": "What is the weather in Rome?"}], tools=[tools[0]])
    assert len(tok.encode(full, add_special_tokens=False)) > 3 * n

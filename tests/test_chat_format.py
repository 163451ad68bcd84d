"""ChatFormat: token pieces of a rollout add up to the template's rendering (token-in, token-out)."""

import json

import pytest

from m3_rollout.chat.reasoning_parser import split_reasoning
from m3_rollout.chat.template import ChatFormat, load_template, render
from m3_rollout.chat.tokenizer import train_tokenizer
from m3_rollout.chat.tool_parser import parse_tool_calls

MODES = ("enabled", "disabled", "adaptive")
CALC = {
    "type": "function",
    "function": {
        "name": "calc",
        "description": "Evaluate arithmetic",
        "parameters": {
            "type": "object",
            "properties": {"expr": {"type": "string"}, "digits": {"type": "integer"}, "tags": {"type": "array"}},
        },
    },
}
TOOLS = [CALC]
CALL = {"id": "call_0", "type": "function", "function": {"name": "calc", "arguments": '{"expr": "6*7", "digits": 2}'}}
MESSAGES = [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "What is 6*7?"}]


@pytest.fixture(scope="module")
def tok():
    template = load_template("m3_full")
    texts = []
    for i in range(20):
        messages = MESSAGES + [
            {"role": "assistant", "content": f"step {i}", "tool_calls": [CALL]},
            {"role": "tool", "content": str(6 * 7 * i)},
            {"role": "assistant", "reasoning_content": "done", "content": f"It is {42 * i}."},
        ]
        texts += [render(template, messages, TOOLS, True, mode) for mode in MODES]
    tok = train_tokenizer(texts, vocab_size=800)
    tok.chat_template = template
    return tok


@pytest.fixture(params=MODES)
def fmt(request, tok):
    return ChatFormat(tok, thinking_mode=request.param)


def test_eos_and_stop_ids_looked_up(fmt, tok):
    assert fmt.eos_token_id == tok.convert_tokens_to_ids("[e~[")
    assert fmt.stop_token_ids == [fmt.eos_token_id]


def test_prompt_ids_are_the_rendered_prompt(fmt):
    ids = fmt.prompt_ids(MESSAGES, TOOLS)
    assert fmt.decode(ids) == fmt.render(MESSAGES, TOOLS, add_generation_prompt=True)
    assert fmt.decode(ids).startswith("]~!b[]~b]system\n")  # markers kept by decode


def test_assistant_ids_hand_checked(tok):
    assert ChatFormat(tok, "disabled").decode(ChatFormat(tok, "disabled").assistant_ids("Hi 42")) == "Hi 42[e~["
    adaptive = ChatFormat(tok, "adaptive")
    assert adaptive.decode(adaptive.assistant_ids("Hi")) == "</mm:think>Hi[e~["
    assert adaptive.decode(adaptive.assistant_ids("Hi", reasoning="r")) == "<mm:think>r</mm:think>Hi[e~["
    enabled = ChatFormat(tok, "enabled")
    assert enabled.decode(enabled.assistant_ids("Hi", reasoning="r")) == "r</mm:think>Hi[e~["
    assert enabled.decode(enabled.assistant_ids("Hi")) == "</mm:think>Hi[e~["  # empty think span
    with pytest.raises(ValueError):
        ChatFormat(tok, "disabled").assistant_ids("Hi", reasoning="r")  # prompt already closed it


@pytest.mark.parametrize("reasoning", [None, "let me compute"])
def test_assistant_ids_match_rendered_assistant_turn(fmt, reasoning):
    if reasoning and fmt.thinking_mode == "disabled":
        with pytest.raises(ValueError):  # the disabled prompt already closed the think span
            fmt.assistant_ids("Computing.", [CALL], reasoning=reasoning)
        return
    ids = fmt.assistant_ids("Computing.", [CALL], reasoning=reasoning)
    assert ids[-1] == fmt.eos_token_id
    message = {"role": "assistant", "content": "Computing.", "tool_calls": [CALL]}
    if reasoning is not None or fmt.thinking_mode == "enabled":
        message["reasoning_content"] = reasoning or ""
    prompt = fmt.render(MESSAGES, TOOLS, add_generation_prompt=True)
    full = fmt.render(MESSAGES + [message], TOOLS)
    assert full == prompt + fmt.decode(ids) + "\n"
    # Token level too: the pieces are the ids of the whole rendered text.
    assert fmt.prompt_ids(MESSAGES, TOOLS) + ids + fmt.encode("\n") == fmt.encode(full)


def test_tool_turn_ids_hand_checked(tok):
    fmt = ChatFormat(tok, "disabled")
    expected = "\n]~b]tool\n<response>42</response>\n<response>b</response>[e~[\n]~b]ai\n</mm:think>"
    assert fmt.decode(fmt.tool_turn_ids(["42", "b"])) == expected
    enabled = ChatFormat(tok, "enabled")
    assert enabled.decode(enabled.tool_turn_ids(["x"])).endswith("[e~[\n]~b]ai\n<mm:think>")
    assert fmt.decode(fmt.user_turn_ids("more?")) == "\n]~b]user\nmore?[e~[\n]~b]ai\n</mm:think>"


def test_tool_turn_ids_equal_rendered_delta(fmt):
    reasoning = "r" if fmt.thinking_mode != "disabled" else None
    assistant = {"role": "assistant", "content": "", "tool_calls": [CALL]}
    if reasoning:
        assistant["reasoning_content"] = reasoning
    before = MESSAGES + [assistant]
    after = before + [{"role": "tool", "content": "42"}, {"role": "tool", "content": "ok"}]
    base = fmt.render(before, TOOLS)
    delta = fmt.render(after, TOOLS, add_generation_prompt=True)[len(base) - 1 :]  # from the "\n" after eos
    assert fmt.decode(fmt.tool_turn_ids(["42", "ok"])) == delta


def test_rollout_pieces_add_up_to_the_full_render(fmt):
    reasoning = None if fmt.thinking_mode == "disabled" else "6 times 7"
    ids = fmt.prompt_ids(MESSAGES, TOOLS)
    ids += fmt.assistant_ids("", [CALL], reasoning=reasoning)
    ids += fmt.tool_turn_ids(["42"])
    ids += fmt.assistant_ids("It is 42.")
    ids += fmt.user_turn_ids("Thanks!")

    first = {"role": "assistant", "content": "", "tool_calls": [CALL]}
    second = {"role": "assistant", "content": "It is 42."}
    if fmt.thinking_mode == "enabled":
        second["reasoning_content"] = ""
    if reasoning is not None:
        first["reasoning_content"] = reasoning
    conversation = MESSAGES + [
        first,
        {"role": "tool", "content": "42"},
        second,
        {"role": "user", "content": "Thanks!"},
    ]
    expected = fmt.render(conversation, TOOLS, add_generation_prompt=True)
    assert fmt.decode(ids) == expected
    assert ids == fmt.encode(expected)


def test_model_output_parses_back(fmt):
    """What assistant_ids emits is understood by the reasoning and tool parsers."""
    reasoning = None if fmt.thinking_mode == "disabled" else "think"
    ids = fmt.assistant_ids("Let me use calc.", [CALL], reasoning=reasoning)
    text = fmt.decode(ids[:-1])  # the engine strips the stop token
    got_reasoning, content = split_reasoning(text, fmt.thinking_mode)
    assert got_reasoning == reasoning
    out = parse_tool_calls(content, TOOLS)
    assert out.content == "Let me use calc."
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [("calc", {"expr": "6*7", "digits": 2})]


def test_needs_a_template(tok):
    bare = train_tokenizer(["abc"], vocab_size=300)
    with pytest.raises(ValueError):
        ChatFormat(bare)
    assert (
        ChatFormat(bare, chat_template=load_template("m3_short"))
        .render([{"role": "user", "content": "q"}], add_generation_prompt=True)
        .endswith("]~b]user\nq[e~[\n]~b]ai\n</mm:think>")
    )
    with pytest.raises(ValueError):
        ChatFormat(tok, thinking_mode="auto")

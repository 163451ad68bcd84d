"""parallel_tool_calls=false: a chat answer holding two tool calls keeps only the first, in the
non-streamed message and in the streamed deltas alike (the model is not constrained; the second
call is dropped, as vLLM does); the default keeps both."""

import pytest

from m3_rollout.chat.markers import NS
from m3_rollout.server.openai_api import ChatPrompt, _TurnParser

TOOLS = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}]
ANSWER = (
    f"{NS}<tool_call>\n"
    f"{NS}<invoke name=\"calc\">{NS}<expression>1+2{NS}</expression>{NS}</invoke>\n"
    f"{NS}<invoke name=\"calc\">{NS}<expression>3*4{NS}</expression>{NS}</invoke>\n"
    f"{NS}</tool_call>"
)


def _prompt(first_call_only: bool) -> ChatPrompt:
    return ChatPrompt([1], "disabled", "", True, TOOLS, first_call_only)


@pytest.mark.parametrize("first_call_only,expected", [(False, ["1+2", "3*4"]), (True, ["1+2"])])
def test_parallel_tool_calls_false_keeps_the_first_call_streamed_or_not(first_call_only, expected):
    whole = _TurnParser(_prompt(first_call_only), "call_x_0_")
    whole.feed(ANSWER)
    whole.finish()
    calls = whole.message()["tool_calls"]
    assert [c["function"]["arguments"] for c in calls] == [f'{{"expression": "{e}"}}' for e in expected]

    streamed = _TurnParser(_prompt(first_call_only), "call_x_0_")
    deltas = [streamed.feed(ANSWER[i : i + 7]) for i in range(0, len(ANSWER), 7)] + [streamed.finish()]
    indexes = {c.index for d in deltas for c in d.tool_calls}
    assert indexes == set(range(len(expected)))
    ids = [c.id for d in deltas for c in d.tool_calls if c.id is not None]
    assert ids == [c["id"] for c in calls] == [f"call_x_0_{i}" for i in range(len(expected))]

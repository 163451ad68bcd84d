"""OpenAI tool-call arguments (JSON strings) -> the dicts M3's chat templates take: `normalize_messages`."""

from __future__ import annotations

import copy

import pytest

from m3_rollout.chat.template import load_template, normalize_messages, render

USER = [{"role": "user", "content": "Plan the trip."}]
NESTED = {
    "route": {"from": "Oslo", "to": "Bergen", "stops": [{"city": "Voss", "nights": 1}, {"city": "Flam", "nights": 2}]},
    "travellers": ["ana", "li"],
    "budget": {"amount": 1200.5, "currency": "NOK", "flexible": False},
    "notes": None,
}


def _conv(arguments, call_id="call_7", name="book"):
    call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
    return USER + [{"role": "assistant", "content": None, "tool_calls": [call]}]


def _args(messages):
    return messages[1]["tool_calls"][0]["function"]["arguments"]


def test_nested_objects_and_arrays_decode_exactly():
    import json

    out = normalize_messages(_conv(json.dumps(NESTED)))
    assert _args(out) == NESTED  # nested objects, arrays of objects, floats, booleans, null
    assert "content" not in out[1]  # None values dropped, as transformers does


def test_input_is_not_changed_and_dicts_pass_through():
    given = _conv('{"a": [1, {"b": "c"}]}')
    before = copy.deepcopy(given)
    assert _args(normalize_messages(given)) == {"a": [1, {"b": "c"}]}
    assert given == before
    assert _args(normalize_messages(_conv({"a": 1}))) == {"a": 1}
    assert _args(normalize_messages(_conv(""))) == {}
    flat = USER + [{"role": "assistant", "content": "", "tool_calls": [{"name": "f", "arguments": '{"x": [2]}'}]}]
    assert normalize_messages(flat)[1]["tool_calls"][0]["arguments"] == {"x": [2]}


def test_rendered_xml_is_the_same_for_the_json_string_and_the_dict():
    import json

    template = load_template("m3_short")
    text = render(template, _conv(json.dumps(NESTED)))
    assert text == render(template, _conv(NESTED))
    assert "Voss" in text and "Bergen" in text


def test_invalid_json_names_the_tool_call():
    with pytest.raises(ValueError) as err:
        normalize_messages(_conv('{"route": {"from": "Oslo",}}'))
    msg = str(err.value)
    assert msg.startswith("messages[1].tool_calls[0] (id 'call_7', function 'book'): arguments are not valid JSON")
    assert "line 1 column 27" in msg and '{"route": {"from": "Oslo",}}' in msg


@pytest.mark.parametrize(
    ("arguments", "says"),
    [("[1, 2]", "must decode to a JSON object"), ('"text"', "got str"), (["a"], "got list ['a']"), (3, "got int 3")],
)
def test_arguments_that_are_not_an_object_are_refused(arguments, says):
    with pytest.raises(ValueError, match=r"messages\[1\]\.tool_calls\[0\] \(id 'call_7', function 'book'\)") as err:
        normalize_messages(_conv(arguments))
    assert says in str(err.value)

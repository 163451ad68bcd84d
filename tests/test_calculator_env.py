"""The calculator task: safe evaluation, rewards, malformed calls, prompt sources."""

import json

import pytest

from m3_rollout.rollout.data import PromptSource, load_jsonl
from m3_rollout.rollout.environment import ModelTurn
from m3_rollout.rollout.environments.calculator import (ArithmeticTask, CalculatorEnvironment, final_answer,
                                                        safe_calculate)


def test_safe_calculate():
    assert safe_calculate("12*34") == 408
    assert safe_calculate(" 1000 - 2*(3+4) ") == 986
    assert safe_calculate("-5+2") == -3
    for bad in ("__import__('os')", "2**100", "1/2", "a+1", "1.5*2", ""):
        with pytest.raises(ValueError):
            safe_calculate(bad)
    with pytest.raises(ValueError, match="longer"):
        safe_calculate("1+" * 40 + "1")


def test_episode_rewards():
    env = CalculatorEnvironment()
    messages, state = env.reset({"prompt": "What is 12 * 34?", "answer": 408})
    assert messages[-1] == {"role": "user", "content": "What is 12 * 34?"}
    step = env.step(state, ModelTurn(None, [{"name": "calculator", "arguments": json.dumps({"expression": "12*34"})}]))
    assert step.observations == ["408"] and not step.done and step.reward == 0.0
    assert env.step(state, ModelTurn("The answer is 408.")).reward == 1.0
    assert env.step(state, ModelTurn("409")).reward == 0.0
    bad = env.step(state, ModelTurn(None, [{"name": "calculator", "arguments": "{not json"}]))
    assert bad.observations[0].startswith("Error") and not bad.done
    unknown = env.step(state, ModelTurn(None, [{"name": "python", "arguments": "{}"}]))
    assert "unknown tool" in unknown.observations[0]
    wrong_args = env.step(state, ModelTurn(None, [{"name": "calculator", "arguments": '{"x": 1}'}]))
    assert wrong_args.observations[0].startswith("Error")
    assert final_answer("a 1,234 b 56") == "56" and final_answer("none") is None
    with pytest.raises(ValueError, match="answer"):
        env.reset({"prompt": "x"})


def test_task_records_are_seeded_and_correct():
    task = ArithmeticTask(2, 3, "*")
    a, b = task.records(1, 20), task.records(1, 20)
    assert a == b
    for r in a:
        x, y = r["expression"].split("*")
        assert int(r["answer"]) == int(x) * int(y) and 10 <= int(x) <= 999


def test_prompt_source_holds_out_validation(tmp_path):
    src = PromptSource(ArithmeticTask(), seed=3, num_val=50)
    val = {r["messages"][-1]["content"] for r in src.val}
    for step in range(1, 6):
        batch = src.train_batch(step, 16)
        assert batch == src.train_batch(step, 16)
        assert not val & {r["messages"][-1]["content"] for r in batch}
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": f"{i}+1", "answer": str(i + 1)}) for i in range(30)))
    src2 = PromptSource(None, seed=0, num_val=10, records=load_jsonl(path))
    assert len(src2.val) == 10 and len(src2.train_batch(1, 4)) == 4
    (tmp_path / "bad.jsonl").write_text('{"prompt": "x"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        load_jsonl(tmp_path / "bad.jsonl")

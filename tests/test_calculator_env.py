"""The calculator task: safe evaluation, rewards, malformed calls, prompt sources."""

import json

import pytest

from m3_rollout.rollout.data import PromptSource, load_jsonl
from m3_rollout.rollout.environment import ModelTurn
from m3_rollout.rollout.environments.calculator import (
    ArithmeticTask,
    CalculatorEnvironment,
    final_answer,
    safe_calculate,
)


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


# --- bounds, tools, worker pool, JSONL environment ----------------------------------------------

import os  # noqa: E402
import time  # noqa: E402

from m3_rollout.config import load_config  # noqa: E402
from m3_rollout.rollout.environment import ToolSettings  # noqa: E402
from m3_rollout.rollout.environments import build_environment  # noqa: E402
from m3_rollout.rollout.environments.jsonl_env import JsonlEnvironment, load_reward_fn  # noqa: E402
from m3_rollout.rollout.environments.tools import convert_units  # noqa: E402
from m3_rollout.rollout.tool_pool import ToolProcessPool, cap_output  # noqa: E402


def test_calculator_bounds_and_operators():
    assert safe_calculate("2**10 + 7//2 - 7%3") == 1024 + 3 - 1
    assert safe_calculate("(-3)**3") == -27
    with pytest.raises(ValueError, match="exponent"):
        safe_calculate("2**33")
    with pytest.raises(ValueError, match="exponent"):
        safe_calculate("2**-1")
    with pytest.raises(ValueError, match="too large"):
        safe_calculate("999999**6")  # 10**36 > 10**30, refused before computing
    with pytest.raises(ValueError, match="too large"):
        safe_calculate("(10**15)*(10**16)")
    with pytest.raises(ValueError, match="digits"):
        safe_calculate("1" * 19 + "+1")
    with pytest.raises(ValueError, match="zero"):
        safe_calculate("5%0")
    for bad in ("(lambda: 1)()", "[1][0]", "1 if 1 else 2", "abs(-1)", "1<2"):
        with pytest.raises(ValueError):
            safe_calculate(bad)


def test_convert_units():
    assert convert_units(5, "km", "m") == "5000 m"
    assert convert_units(100, "C", "F") == "212 F"
    assert convert_units(32, "F", "K") == "273.15 K"
    assert convert_units(1, "mi", "ft") == "5280 ft"
    assert convert_units(1, "lb", "g") == "453.59237 g"
    assert convert_units(1, "kg", "m").startswith("Error: cannot convert mass")
    assert convert_units(1, "parsec", "m").startswith("Error: unknown unit 'parsec'")


def _sleepy(seconds):
    time.sleep(float(seconds))
    return "woke"


def _crash():
    os._exit(3)


def _big(n):
    return "x" * int(n)


def test_tool_pool_timeout_kill_crash_and_output_cap():
    pool = ToolProcessPool(
        {"sleep": _sleepy, "crash": _crash, "big": _big}, num_workers=2, timeout_s=0.5, max_output_chars=10
    )
    try:
        t0 = time.monotonic()
        out = pool.run(
            [
                ("sleep", {"seconds": 30}),
                ("sleep", {"seconds": 0}),
                ("big", {"n": 25}),
                ("crash", {}),
                ("big", {"n": 3}),
                ("sleep", {"bad": 1}),
            ]
        )
        assert time.monotonic() - t0 < 5  # the 30 s call was killed at its limit
        assert out[0] == "Error: tool 'sleep' timed out after 0.5 s"
        assert out[1] == "woke"
        assert out[2] == "x" * 10 + "...[truncated 15 characters]" == cap_output("x" * 25, 10)
        assert out[3] == "Error: tool 'crash' crashed its worker process"
        assert out[4] == "xxx"
        assert out[5].startswith("Error: bad...[truncated")  # error texts are capped too
        assert pool.stats["timeouts"] == 1 and pool.stats["worker_deaths"] == 1
        assert pool.run([("sleep", {"seconds": 0})]) == ["woke"]  # replaced workers serve on
    finally:
        pool.close()
    with pytest.raises(ValueError, match="timeout_s"):
        ToolProcessPool({}, timeout_s=0)


def test_validation_turns_bad_calls_into_error_observations():
    env = CalculatorEnvironment(tool_settings=ToolSettings(num_workers=1))
    _, state = env.reset({"prompt": "x", "answer": 1})
    calls = [
        {"name": "calculator", "arguments": '{"expression": "6*7"}'},
        {"name": "calculator", "arguments": '{"expression": 5}'},
        {"name": "calculator", "arguments": '{"expression": "1", "extra": 1}', "truncated": True},
        {"name": "calculator", "arguments": "{}", "error": "closing tag 'b' does not match 'a'"},
        {"name": "nope", "arguments": "{}"},
    ]
    obs = env.step(state, ModelTurn(None, calls)).observations
    env.close()
    assert obs[0] == "42"
    assert obs[1] == "Error: invalid arguments for calculator at expression: 5 is not of type 'string'"
    assert obs[2] == "Error: the call to 'calculator' was cut off before </invoke>; nothing was run"
    assert obs[3] == (
        "Error: malformed tool call to 'calculator' (closing tag 'b' does not match 'a'); nothing was run"
    )
    assert obs[4] == "Error: unknown tool 'nope'; available tools: calculator"
    assert state["tool_calls"] == 5


def double_reward(answer_text, record):
    return 2.0 * float(answer_text == record["answer"])


def test_jsonl_environment_reward_by_dotted_path(tmp_path):
    env = JsonlEnvironment(f"{__name__}.double_reward", tools=["convert_units"], system_prompt="Convert.")
    try:
        messages, state = env.reset({"prompt": "5 km in m?", "answer": "5000"})
        assert messages == [{"role": "system", "content": "Convert."}, {"role": "user", "content": "5 km in m?"}]
        assert [t["function"]["name"] for t in env.tool_schemas()] == ["convert_units"]
        call = {"name": "convert_units", "arguments": '{"value": 5, "from_unit": "km", "to_unit": "m"}'}
        step = env.step(state, ModelTurn(None, [call]))
        assert (step.observations, step.done) == (["5000 m"], False)
        assert (env.step(state, ModelTurn("5000")).reward, env.step(state, ModelTurn("50")).reward) == (2.0, 0.0)
    finally:
        env.close()
    with pytest.raises(ValueError, match="no callable 'nope'"):
        load_reward_fn("m3_rollout.rollout.environments.jsonl_env.nope")
    with pytest.raises(ValueError, match="cannot import"):
        load_reward_fn("no_such_pkg.fn")
    with pytest.raises(ValueError, match="unknown"):
        JsonlEnvironment(tools=["shell"])
    # From the config: env.name=jsonl with the default reward (last integer of the answer).
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"prompt": "1+1", "answer": "2"}) + "\n")
    cfg = load_config(
        None,
        [
            "env.name=jsonl",
            "data.source=jsonl",
            f"data.path={path}",
            "env.jsonl.tools=[calculator,convert_units]",
            "env.max_tool_output_chars=4",
        ],
    )
    env = build_environment(cfg.env)
    try:
        _, state = env.reset({"prompt": "1+1", "answer": "2"})
        assert env.step(state, ModelTurn("It is 2.")).reward == 1.0
        call = {"name": "calculator", "arguments": '{"expression": "10**20"}'}
        assert env.step(state, ModelTurn(None, [call])).observations == ["1000...[truncated 17 characters]"]
    finally:
        env.close()
    with pytest.raises(Exception, match="env.name"):
        load_config(None, ["env.name=jsonl"])


# --- adversarial review ------------------------------------------------------------------------


def test_deep_nesting_is_a_value_error_not_a_recursion_error():
    # A long expression limit (env.calculator.max_expression_chars) lets the model nest deeper
    # than Python's recursion limit; that must still be the documented ValueError.
    for expr in ("-" * 3000 + "1", "(" * 1500 + "1" + ")" * 1500):
        with pytest.raises(ValueError):
            safe_calculate(expr, max_chars=10_000)


def test_convert_units_huge_integer_is_an_error_text():
    # The parser types a 400-digit "number" as a Python int; float() of it overflows.
    assert convert_units(10**400, "m", "km") == "Error: value must be finite and at most 1e15 in magnitude"


def _echo(text):
    return text


def _noisy():
    for i in range(2000):
        print("tool chatter", i)
    return "quiet result"


def test_tool_pool_survives_a_worker_that_died_between_runs():
    pool = ToolProcessPool({"echo": _echo}, num_workers=2, timeout_s=2.0)
    try:
        assert pool.run([("echo", {"text": "a"}), ("echo", {"text": "b"})]) == ["a", "b"]
        for w in pool._workers:  # e.g. the OOM killer, between two tool turns
            os.kill(w.proc.pid, 9)
            w.proc.join(5)
        assert pool.run([("echo", {"text": "c"}), ("echo", {"text": "d"})]) == ["c", "d"]
        # ... and no stale reply of an earlier run is ever taken for a later call's result.
        assert pool.run([("echo", {"text": "e"})]) == ["e"]
    finally:
        pool.close()


def test_tool_pool_drops_replies_of_an_interrupted_run(monkeypatch):
    # An exception while calls are in flight (here Ctrl-C in the wait) must not leave a reply
    # in a pipe that a later run would read as its own result.
    import m3_rollout.rollout.tool_pool as tp

    pool = ToolProcessPool({"echo": _echo}, num_workers=2, timeout_s=2.0)
    try:
        pool.run([("echo", {"text": "warm"})])
        real_wait = tp.wait

        def interrupted(*a, **kw):
            time.sleep(0.2)  # let the workers answer first
            monkeypatch.setattr(tp, "wait", real_wait)
            raise KeyboardInterrupt

        monkeypatch.setattr(tp, "wait", interrupted)
        with pytest.raises(KeyboardInterrupt):
            pool.run([("echo", {"text": "first"}), ("echo", {"text": "second"})])
        assert pool.run([("echo", {"text": "x"}), ("echo", {"text": "y"})]) == ["x", "y"]
    finally:
        pool.close()


def test_tool_pool_unsendable_arguments_are_an_error_text():
    pool = ToolProcessPool({"echo": _echo}, num_workers=2, timeout_s=2.0)
    try:
        out = pool.run([("echo", {"text": "ok"}), ("echo", {"text": lambda: 1})])
        assert out[0] == "ok" and out[1].startswith("Error: could not send the call to 'echo'")
        assert pool.run([("echo", {"text": "x"}), ("echo", {"text": "y"})]) == ["x", "y"]
    finally:
        pool.close()


def test_tool_output_with_lone_surrogates_and_prints_is_safe(capfd):
    pool = ToolProcessPool({"echo": _echo, "noisy": _noisy}, num_workers=1, timeout_s=5.0)
    try:
        # A lone surrogate cannot be tokenized (the tokenizer raises); it becomes U+FFFD.
        assert pool.run([("echo", {"text": "a\ud800b"})]) == ["a\ufffdb"]
        # What a tool prints is not its result and does not reach the trainer's stdout.
        assert pool.run([("noisy", {})]) == ["quiet result"]
    finally:
        pool.close()
    assert "tool chatter" not in capfd.readouterr().out


def test_tool_pool_rejects_non_finite_timeout():
    with pytest.raises(ValueError, match="timeout_s"):
        ToolProcessPool({}, timeout_s=float("inf"))


def test_a_call_cannot_raise_the_calculators_length_cap():
    """The tool's function was partial(_calculator, max_chars=cap): a call that added
    "max_chars": 1000000 (the schema allows extra properties) lifted env.calculator's cap."""
    env = CalculatorEnvironment(tool_settings=ToolSettings(num_workers=1))
    _, state = env.reset({"prompt": "x", "answer": 1})
    long = "+".join(["1"] * 400)  # 799 characters
    calls = [
        {"name": "calculator", "arguments": json.dumps({"expression": long})},
        {"name": "calculator", "arguments": json.dumps({"expression": long, "max_chars": 1000000})},
    ]
    obs = env.step(state, ModelTurn(None, calls)).observations
    env.close()
    assert obs[0] == "Error: expression longer than 64 characters"
    assert obs[1].startswith("Error:") and "max_chars" in obs[1] and "400" not in obs[1]


def huge_reward(answer_text, record):
    return float(record["answer"])


def test_a_reward_beyond_fp32_is_a_reward_error_not_a_crash():
    """1e39 passed the isfinite check, became inf in the job's fp32 rewards and stopped the run with
    a traceback ("rewards contain NaN/inf")."""
    env = JsonlEnvironment(f"{__name__}.huge_reward")
    try:
        for answer, reward, error in [("1e39", 0.0, "reward 1e+39 beyond +-1e+30"), ("-5e29", -5e29, None)]:
            _, state = env.reset({"prompt": "x", "answer": answer})
            step = env.step(state, ModelTurn("x"))
            assert (step.reward, step.info.get("reward_error")) == (reward, error)
    finally:
        env.close()

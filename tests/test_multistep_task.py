"""The multi-step calculator task: seeded chains, carried results, demonstrations, the GPU preset's lengths."""

import json
from types import SimpleNamespace

import pytest

from m3_rollout.chat.template import ChatFormat, load_template
from m3_rollout.chat.tokenizer import train_tokenizer
from m3_rollout.jobs.builtin import builtin_spec, corpus_texts
from m3_rollout.model import tiny_config
from m3_rollout.rollout.environment import ModelTurn
from m3_rollout.rollout.environments import build_task
from m3_rollout.rollout.environments.calculator import (
    ArithmeticTask,
    CalculatorEnvironment,
    safe_calculate,
    tool_steps,
)
from m3_rollout.rollout.environments.multistep import MultiStepArithmeticTask
from m3_trainers.warm_start import demonstration


def test_chains_are_seeded_and_carry_each_result():
    task = MultiStepArithmeticTask()
    recs = task.records(5, 300)
    assert recs == task.records(5, 300)
    counts = {1: 0, 2: 0, 3: 0}
    for r in recs:
        calls, results = r["calls"], r["results"]
        counts[len(calls)] += 1
        assert r["expression"] == calls[0] and r["answer"] == results[-1]
        for i, (expr, res) in enumerate(zip(calls, results)):
            assert str(safe_calculate(expr)) == res
            if i:  # a later call starts with the previous tool result
                assert expr.startswith(results[i - 1]) and expr[len(results[i - 1])] in "+-*"
                assert 2 <= int(expr[len(results[i - 1]) + 1 :]) <= 99
        assert r["messages"][-1]["content"].count(", then ") == len(calls) - 1
        assert tool_steps(r) == list(zip(calls, results))
    assert all(n > 60 for n in counts.values()), counts  # 1, 2 and 3 calls all occur


def test_build_task_keeps_the_single_step_task():
    rec = ArithmeticTask().records(42, 1)[0]
    assert "calls" not in rec and tool_steps(rec) == [(rec["expression"], rec["answer"])]
    cfg = SimpleNamespace(
        max_tool_calls=1, min_digits=2, max_digits=4, operations="+-*", step_min_digits=1, step_max_digits=2
    )
    assert build_task(cfg) == ArithmeticTask()
    multi = build_task(SimpleNamespace(**{**vars(cfg), "max_tool_calls": 3, "max_digits": 3}))
    assert multi == MultiStepArithmeticTask()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"min_calls": 0}, "min_calls"),
        ({"min_calls": 3, "max_calls": 2}, "min_calls"),
        ({"step_min_digits": 3, "step_max_digits": 2}, "step_min_digits"),
        ({"operations": "+/"}, "operations"),
    ],
)
def test_bad_knobs_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MultiStepArithmeticTask(**kwargs)


def test_three_call_episode_rewards_the_carried_result():
    rec = next(r for r in MultiStepArithmeticTask().records(1, 100) if len(r["calls"]) == 3)
    env = CalculatorEnvironment()
    try:
        _, state = env.reset(rec)
        for expr, result in tool_steps(rec):
            call = {"name": "calculator", "arguments": json.dumps({"expression": expr})}
            step = env.step(state, ModelTurn(None, [call]))
            assert step.observations == [result] and not step.done
        assert env.step(state, ModelTurn(f"The result is {rec['answer']}.")).reward == 1.0
        assert env.step(state, ModelTurn(rec["results"][0])).reward == 0.0  # stopping after one call
        assert state["tool_calls"] == 3
    finally:
        env.close()


@pytest.fixture(scope="module")
def full_chat():
    """The m3-gpu-small preset's tokenizer (vocab, corpus, full template, multi-step task)."""
    spec = builtin_spec("m3-gpu-small", "cpu")
    task, env, tpl = spec.make_task(), CalculatorEnvironment(), load_template(spec.template)
    tok = train_tokenizer(corpus_texts(tpl, task, env, spec.tokenizer_corpus), spec.tokenizer_vocab_size)
    tok.chat_template = tpl
    return ChatFormat(tok), task, env, spec


def test_multi_step_demonstration_is_the_rendered_conversation(full_chat):
    chat, task, env, _ = full_chat
    rec = next(r for r in task.records(3, 100) if len(r["calls"]) == 3)
    ids, mask = demonstration(chat, env, rec)
    messages, _ = env.reset(rec)
    convo = list(messages)
    for expr, result in tool_steps(rec):
        call = {"type": "function", "function": {"name": "calculator", "arguments": json.dumps({"expression": expr})}}
        convo += [{"role": "assistant", "content": "", "tool_calls": [call]}, {"role": "tool", "content": result}]
    convo.append({"role": "assistant", "content": rec["answer"]})
    assert chat.decode(ids) == chat.render(convo, tools=env.tool_schemas()).rstrip("\n")
    # prompt | call 1 | tool | call 2 | tool | call 3 | tool | answer: 7 switches of the mask
    edges = [i for i in range(1, len(mask)) if mask[i] != mask[i - 1]]
    assert len(edges) == 7 and mask[-1] == 1 and ids[-1] == chat.eos_token_id
    for k, expr in enumerate(rec["calls"]):
        turn = chat.decode(ids[edges[2 * k] : edges[2 * k + 1]])
        assert expr in turn and "calculator" in turn and turn.endswith(chat.eos_token)
    assert chat.decode(ids[edges[-1] :]) == rec["answer"] + chat.eos_token
    # The full template: thinking instructions in the system block, the tool list in the developer block.
    text = chat.decode(ids[: edges[0]])
    assert "<thinking_instructions>" in text and "# Tools" in text and '"name": "calculator"' in text


def test_gpu_preset_episodes_exceed_top_k_blocks(full_chat):
    chat, task, env, spec = full_chat
    cfg = tiny_config(vocab_size=len(chat.tokenizer), **spec.model_overrides)
    window = cfg.sparse_topk_blocks * cfg.sparse_block_size
    assert window == 256 and cfg.sparse_block_size == 64
    lengths: dict[int, list[int]] = {1: [], 2: [], 3: []}
    for r in task.records(11, 120):
        lengths[len(r["calls"])].append(len(demonstration(chat, env, r)[0]))
    # Every episode with a second call runs past top-k x block, so the sparse layers select;
    # the longest fits the rollout limit of configs/grpo_h200.yaml (512).
    assert min(lengths[2] + lengths[3]) > window
    assert max(lengths[3]) < spec.eval_max_total_len

"""Warm-start demonstrations and the multi-turn rollout tokens agree with the chat template."""

import json

import torch

from m3_rollout.chat.template import ChatFormat, load_template
from m3_rollout.chat.tokenizer import train_tokenizer
from m3_rollout.engine.native_backend import NativeBackend
from m3_rollout.jobs.builtin import corpus_texts
from m3_rollout.model import M3ForCausalLM, tiny_config
from m3_rollout.rollout.environments.calculator import ArithmeticTask, CalculatorEnvironment
from m3_rollout.rollout.group_rollout import RolloutSettings, run_group_rollouts
from m3_trainers.warm_start import demonstration


def _chat():
    task, env, tpl = ArithmeticTask(), CalculatorEnvironment(), load_template("m3_short")
    tok = train_tokenizer(corpus_texts(tpl, task, env, 300), 600)
    tok.chat_template = tpl
    return ChatFormat(tok), task, env


def test_demonstration_is_the_rendered_conversation():
    chat, task, env = _chat()
    rec = task.records(3, 1)[0]
    ids, mask = demonstration(chat, env, rec)
    messages, _ = env.reset(rec)
    call = {
        "type": "function",
        "function": {"name": "calculator", "arguments": json.dumps({"expression": rec["expression"]})},
    }
    convo = messages + [
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": rec["answer"]},
        {"role": "assistant", "content": rec["answer"]},
    ]
    rendered = chat.render(convo, tools=env.tool_schemas())
    assert chat.decode(ids) == rendered.rstrip("\n")
    # Mask = the two assistant turns, each ending with the end-of-message token.
    spans = [i for i in range(1, len(mask)) if mask[i] != mask[i - 1]]
    assert len(spans) == 3  # prompt | call turn | tool turn | answer turn
    assert ids[spans[1] - 1] == chat.eos_token_id and ids[-1] == chat.eos_token_id and mask[-1] == 1
    turn1 = chat.decode(ids[spans[0] : spans[1]])
    assert rec["expression"] in turn1 and "calculator" in turn1
    assert chat.decode(ids[spans[2] :]) == rec["answer"] + chat.eos_token


def test_rollout_token_bookkeeping():
    chat, task, env = _chat()
    torch.manual_seed(0)
    model = M3ForCausalLM(tiny_config(vocab_size=len(chat.tokenizer), max_position_embeddings=256)).eval()
    backend = NativeBackend(model, chat.stop_token_ids)
    recs = task.records(1, 3)
    settings = RolloutSettings(n=4, max_turns=2, max_total_len=120, max_new_tokens=30, seed=5)
    trajs, metrics = run_group_rollouts(backend, chat, env, recs, settings)
    assert len(trajs) == 12 and [t.group_index for t in trajs] == [0] * 4 + [1] * 4 + [2] * 4
    for t in trajs:
        assert len(t.token_ids) <= 120
        assert sum(t.loss_mask) == sum(e - s for s, e in t.turn_spans) > 0
        assert all(lp <= 0 for lp, m in zip(t.rollout_logprobs, t.loss_mask) if m)
        assert t.finish_reason in ("stop", "length", "max_turns")
        assert t.token_ids[: t.prompt_len] == trajs[t.group_index * 4].token_ids[: t.prompt_len]
    assert metrics["generated_tokens"] == sum(t.num_generated for t in trajs)
    again, _ = run_group_rollouts(backend, chat, env, recs, settings)
    assert [t.token_ids for t in again] == [t.token_ids for t in trajs]


class ScriptedBackend:
    """Replies with a perfect calculator episode: tool call on turn 1, the tool's result on turn 2."""

    def __init__(self, chat, records):
        self.chat, self.records, self.calls = chat, records, 0

    def generate(self, requests):
        from m3_rollout.engine.interface import SampleOutput

        outs = []
        for req in requests:
            gi = int(req.request_id.split("-")[0][1:])
            rec = self.records[gi]
            text = self.chat.decode(list(req.prompt_ids))
            if "<response>" not in text:
                call = {
                    "type": "function",
                    "function": {"name": "calculator", "arguments": json.dumps({"expression": rec["expression"]})},
                }
                ids = self.chat.assistant_ids(tool_calls=[call])
            else:
                result = text.rsplit("<response>", 1)[1].split("</response>", 1)[0]
                ids = self.chat.assistant_ids(content=f"It is {result}.")
            for j in range(req.params.n):
                outs.append(
                    SampleOutput(
                        req.request_id,
                        req.sample_index + j,
                        list(req.prompt_ids),
                        list(ids),
                        [-0.5] * len(ids),
                        "stop",
                        3,
                    )
                )
        self.calls += 1
        return outs


def test_multi_turn_tool_use_loop_matches_demonstration():
    chat, task, env = _chat()
    recs = task.records(8, 2)
    backend = ScriptedBackend(chat, recs)
    settings = RolloutSettings(n=2, max_turns=3, max_total_len=400, max_new_tokens=60, seed=0)
    trajs, metrics = run_group_rollouts(backend, chat, env, recs, settings)
    assert backend.calls == 2 and metrics["turns"] == 2
    for t in trajs:
        rec = recs[t.group_index]
        demo_ids, demo_mask = demonstration(chat, env, rec)
        assert t.reward == 1.0 and t.finish_reason == "stop"
        assert t.tool_calls == [{"name": "calculator", "arguments": json.dumps({"expression": rec["expression"]})}]
        # Same tokens as the template's rendering of the episode, except the free-form answer text.
        n_common = len(demo_ids) - len(chat.assistant_ids(content=rec["answer"]))
        assert t.token_ids[:n_common] == demo_ids[:n_common]
        assert t.loss_mask[:n_common] == demo_mask[:n_common]
        assert t.weight_version[t.turn_spans[0][0]] == 3 and t.weight_version[0] == -1
    # Turn limit: with one turn the episode ends after the call, unanswered.
    one, _ = run_group_rollouts(
        ScriptedBackend(chat, recs),
        chat,
        env,
        recs,
        RolloutSettings(n=1, max_turns=1, max_total_len=400, max_new_tokens=60),
    )
    assert all(t.finish_reason == "max_turns" and t.reward == 0.0 for t in one)
    # Length cap: the tool turn does not fit, the trajectory ends as "length" after the call.
    demo_ids, demo_mask = demonstration(chat, env, recs[0])
    call_end = demo_mask.index(0, demo_mask.index(1))  # first non-assistant token after the call turn
    short, _ = run_group_rollouts(
        ScriptedBackend(chat, recs[:1]),
        chat,
        env,
        recs[:1],
        RolloutSettings(n=1, max_turns=3, max_total_len=call_end + 5, max_new_tokens=60),
    )
    assert short[0].finish_reason == "length" and short[0].token_ids == demo_ids[:call_end]


class _Clock:
    """A perf_counter that advances one second per call (stands in for a slow, loaded machine)."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        self.now += 1.0
        return self.now


def test_time_cap_never_splits_an_eval_interval(monkeypatch):
    # The cap is hit during the first interval; the warm start still trains the whole interval and
    # evaluates at the scheduled step (3), so a capped build is a point of the step schedule, flagged.
    from m3_trainers import warm_start as ws

    chat, task, env = _chat()
    torch.manual_seed(0)
    model = M3ForCausalLM(tiny_config(vocab_size=len(chat.tokenizer), max_position_embeddings=256))
    monkeypatch.setattr(ws, "time", _Clock())
    cfg = ws.WarmStartConfig(batch_size=2, max_steps=30, max_seconds=5.0, eval_every=3)
    result = ws.warm_start(model, chat, task, env, lambda m: 0.0, cfg)
    assert [s for s, _ in result.history] == [0, 3]
    assert result.time_capped and not result.in_window and result.steps == 3
    # The step cap alone is not a time cap.
    monkeypatch.setattr(ws, "time", _Clock())
    cfg = ws.WarmStartConfig(batch_size=2, max_steps=3, max_seconds=1e9, eval_every=3)
    result = ws.warm_start(model, chat, task, env, lambda m: 0.0, cfg)
    assert [s for s, _ in result.history] == [0, 3] and not result.time_capped

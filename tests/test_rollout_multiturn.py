"""Token-in/token-out multi-turn rollouts: bridges, masks, engine finish reasons, re-scoring."""

import dataclasses

import pytest
import torch

from m3_rollout.chat.template import ChatFormat, load_template, render
from m3_rollout.chat.tokenizer import train_tokenizer
from m3_rollout.engine.interface import GenerationBackend, SampleOutput
from m3_rollout.model import M3ForCausalLM, tiny_config
from m3_rollout.rollout.environment import Environment, EnvStep, ModelTurn
from m3_rollout.rollout.environments.calculator import CalculatorEnvironment
from m3_rollout.rollout.environments.jsonl_env import JsonlEnvironment, last_number_reward
from m3_rollout.rollout.group_rollout import RolloutSettings, run_group_rollouts
from m3_trainers.policy import token_logprobs

MODES = ("enabled", "disabled", "adaptive")
REC = {
    "messages": [
        {"role": "system", "content": "Use the calculator tool for arithmetic."},
        {"role": "user", "content": "What is 12 * 34?"},
    ],
    "answer": "408",
}
CALL = {"id": "call_0", "type": "function", "function": {"name": "calculator", "arguments": {"expression": "12*34"}}}


@pytest.fixture(scope="module")
def tok():
    template = load_template("m3_short")
    tools = CalculatorEnvironment().tool_schemas()
    texts = []
    for i in range(15):
        convo = REC["messages"] + [
            {"role": "assistant", "content": f"ok {i}", "reasoning_content": "hm", "tool_calls": [CALL]},
            {"role": "tool", "content": str(408 * i)},
            {"role": "assistant", "content": f"It is {408 * i}."},
        ]
        texts += [render(template, convo, tools, True, m) for m in MODES]
    t = train_tokenizer(texts, vocab_size=700)
    t.chat_template = template
    return t


class ScriptedBackend(GenerationBackend):
    """Replies with scripted (ids, finish_reason) turns, one list per sample; records requests.
    Logprobs are distinct fake values so the test can find each token's."""

    def __init__(self, script):
        self.script, self.requests, self.turn = script, [], {}

    def generate(self, requests):
        outs = []
        for req in requests:
            self.requests.append(req)
            for j in range(req.params.n):
                s = req.sample_index + j
                k = self.turn.get(s, 0)
                self.turn[s] = k + 1
                ids, finish = self.script[s][k]
                outs.append(
                    SampleOutput(
                        req.request_id,
                        s,
                        list(req.prompt_ids),
                        list(ids),
                        [-0.001 * (i + 1) - k for i in range(len(ids))],
                        finish,
                        7,
                    )
                )
        return outs

    @property
    def weight_version(self):
        return 7

    def update_weights(self, version, named_tensors):
        raise NotImplementedError


def settings(**kw):
    base = dict(n=1, max_turns=3, max_total_len=400, max_new_tokens=60)
    return RolloutSettings(**{**base, **kw})


@pytest.mark.parametrize("mode", MODES)
def test_bridge_ids_equal_template_rendering_minus_earlier_tokens(tok, mode):
    chat = ChatFormat(tok, mode)
    env = CalculatorEnvironment()
    reasoning = None if mode == "disabled" else "need the tool"
    turn1 = chat.assistant_ids("Let me compute.", [CALL], reasoning=reasoning)
    turn2 = chat.assistant_ids("It is 408.", reasoning=None if mode == "disabled" else "got it")
    backend = ScriptedBackend({0: [(turn1, "stop"), (turn2, "stop")]})
    (t,), _ = run_group_rollouts(backend, chat, env, [REC], settings())
    env.close()
    tools = env.tool_schemas()
    assistant1 = {"role": "assistant", "content": "Let me compute.", "tool_calls": [CALL]}
    assistant2 = {"role": "assistant", "content": "It is 408."}
    if reasoning is not None:
        assistant1["reasoning_content"], assistant2["reasoning_content"] = reasoning, "got it"
    convo = REC["messages"] + [assistant1, {"role": "tool", "content": "408"}]
    prompt = chat.prompt_ids(REC["messages"], tools)
    # Next input = previous input + sampled ids + bridge ids, never re-rendered.
    assert [list(r.prompt_ids) for r in backend.requests] == [prompt, prompt + turn1 + t.turns[0].bridge]
    # The bridge is exactly what the template renders for the whole conversation after the earlier tokens.
    full = chat.encode(chat.render(convo, tools, add_generation_prompt=True))
    assert full[: len(prompt) + len(turn1)] == prompt + turn1
    assert t.turns[0].bridge == full[len(prompt) + len(turn1) :]
    suffix = {"enabled": "<mm:think>", "disabled": "</mm:think>", "adaptive": ""}[mode]
    assert chat.decode(t.turns[0].bridge) == "\n]~b]tool\n<response>408</response>[e~[\n]~b]ai\n" + suffix
    # The whole trajectory is the template's rendering of the final conversation, except the "\n"
    # the template puts after the last eos (the model stops at the eos and never samples it).
    final = chat.encode(chat.render(convo + [assistant2], tools))
    assert t.token_ids == final[:-1] and chat.decode(final[-1:]) == "\n"
    # The model's own reasoning stays in its context.
    if reasoning:
        assert reasoning in chat.decode(backend.requests[1].prompt_ids)
    # Masks, logprobs, versions: exactly on the sampled tokens.
    p1, b = len(prompt), len(t.turns[0].bridge)
    expect_mask = [0] * p1 + [1] * len(turn1) + [0] * b + [1] * len(turn2)
    assert t.loss_mask == expect_mask
    assert t.turn_spans == [(p1, p1 + len(turn1)), (p1 + len(turn1) + b, len(t.token_ids))]
    assert t.rollout_logprobs[p1 : p1 + 2] == [-0.001, -0.002] and t.rollout_logprobs[p1 - 1] == 0.0
    assert set(v for v, m in zip(t.weight_version, t.loss_mask) if m) == {7}
    assert set(v for v, m in zip(t.weight_version, t.loss_mask) if not m) == {-1}
    # Parse results and tool calls are stored.
    assert [r.finish_reason for r in t.turns] == ["stop", "stop"] and all(r.stop_sampled for r in t.turns)
    assert t.turns[0].parsed.reasoning == (reasoning if mode != "disabled" else None)
    assert t.turns[0].parsed.content == "Let me compute."
    assert [c.to_openai() for c in t.turns[0].parsed.tool_calls] == [
        {"id": "call_0", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "12*34"}'}}
    ]
    assert t.turns[0].observations == ["408"]
    assert t.tool_calls == [{"name": "calculator", "arguments": '{"expression": "12*34"}'}]
    assert (t.reward, t.finish_reason) == (1.0, "stop")


def test_stop_not_sampled_gets_appended_eos_with_mask_zero(tok):
    chat = ChatFormat(tok, "disabled")
    turn1 = chat.assistant_ids("Let me compute.", [CALL])[:-1]  # engine stopped without the eos token
    turn2 = chat.assistant_ids("408")
    backend = ScriptedBackend({0: [(turn1, "stop"), (turn2, "stop")]})
    (t,), _ = run_group_rollouts(backend, chat, CalculatorEnvironment(), [REC], settings())
    rec = t.turns[0]
    assert not rec.stop_sampled and rec.bridge[0] == chat.eos_token_id
    assert t.loss_mask[rec.end] == 0 and t.token_ids[rec.end] == chat.eos_token_id
    assert sum(t.loss_mask) == len(turn1) + len(turn2)
    assert t.reward == 1.0


@pytest.mark.parametrize("mask", [False, True])
def test_finish_reason_comes_from_engine_and_length_turns_flagged(tok, mask):
    chat = ChatFormat(tok, "disabled")
    # Ends in the eos token but the engine says "length": length it is (not inferred from the token).
    turn1 = chat.assistant_ids("The answer is 408")
    backend = ScriptedBackend({0: [(turn1, "length")]})
    (t,), _ = run_group_rollouts(backend, chat, CalculatorEnvironment(), [REC], settings(mask_truncated_turns=mask))
    rec = t.turns[0]
    assert (rec.finish_reason, rec.truncated, rec.masked, t.finish_reason) == ("length", True, mask, "length")
    assert sum(t.loss_mask) == (0 if mask else len(turn1))
    assert len(backend.requests) == 1  # no further turn
    assert t.reward == 1.0  # a cut turn is still scored on what it said


def test_flagged_and_unknown_calls_become_error_observations(tok):
    chat = ChatFormat(tok, "enabled")
    ns = "]<]minimax[>["
    # Turn 1: a call that starts inside the unclosed think span (found), an unknown tool, a
    # malformed call and a schema violation. Turn 2: answer.
    body = (
        f"I should call it {ns}<tool_call>\n"
        f'{ns}<invoke name="calculator">{ns}<expression>12*34{ns}</expression>{ns}</invoke>\n'
        f'{ns}<invoke name="python">{ns}<code>1{ns}</code>{ns}</invoke>\n'
        f'{ns}<invoke name="calculator">{ns}<expression>1{ns}</oops>{ns}</invoke>\n'
        f'{ns}<invoke name="calculator">{ns}<expr>1{ns}</expr>{ns}</invoke>\n'
        f"{ns}</tool_call>"
    )
    turn1 = chat.encode(body) + [chat.eos_token_id]
    turn2 = chat.assistant_ids("408", reasoning="ok")
    backend = ScriptedBackend({0: [(turn1, "stop"), (turn2, "stop")]})
    (t,), _ = run_group_rollouts(backend, chat, CalculatorEnvironment(), [REC], settings())
    rec = t.turns[0]
    assert rec.parsed.reasoning == "I should call it "
    assert [c.name for c in rec.parsed.tool_calls] == ["calculator", "python", "calculator", "calculator"]
    obs = rec.observations
    assert obs[0] == "408"
    assert obs[1].startswith("Error: unknown tool 'python'; available tools: calculator")
    assert obs[2].startswith("Error: malformed tool call to 'calculator'") and "'oops'" in obs[2]
    assert obs[3].startswith("Error: invalid arguments for calculator") and "expression" in obs[3]
    assert "<response>" + obs[1] + "</response>" in chat.decode(rec.bridge)
    assert t.reward == 1.0


class RecordingCalculator(CalculatorEnvironment):
    """The calculator environment, keeping every ModelTurn it was given."""

    def __init__(self):
        super().__init__()
        self.turns: list[ModelTurn] = []

    def step(self, state, turn: ModelTurn):
        self.turns.append(turn)
        return super().step(state, turn)


NS = "]<]minimax[>["
CUT_BODY = (
    f"Let me compute. {NS}<tool_call>\n"
    f'{NS}<invoke name="calculator">{NS}<expression>12*34{NS}</expression>{NS}</invoke>\n'
    f'{NS}<invoke name="calculator">{NS}<expression>400+8{NS}</expression>{NS}</invoke>\n'
    f"{NS}</tool_call>"
)
SECOND_CALL = CUT_BODY.index(f'{NS}<invoke name="calculator">', CUT_BODY.index("</invoke>"))


@pytest.mark.parametrize(
    "cut, content, n_calls",
    [
        # inside the first call's name / its parameter value: the whole block is content
        (CUT_BODY.index("calculator") + 4, CUT_BODY[: CUT_BODY.index("calculator") + 4], 0),
        (CUT_BODY.index("12*") + 3, CUT_BODY[: CUT_BODY.index("12*") + 3], 0),
        # inside the second call's value: the first call stands, the second is content
        (CUT_BODY.index("400+") + 4, "Let me compute. " + CUT_BODY[SECOND_CALL : CUT_BODY.index("400+") + 4], 1),
        # after the last </invoke>, before </tool_call>: both calls stand
        (CUT_BODY.index(f"{NS}</tool_call>") - 1, "Let me compute. ", 2),
    ],
)
def test_turn_cut_by_length_inside_a_call_gives_its_text_to_the_environment(tok, cut, content, n_calls):
    """max_new_tokens inside a call: the environment scored content without the cut call's text
    (and the trajectory's parse record dropped it too); now that text is the content's end."""
    chat = ChatFormat(tok, "disabled")
    text = CUT_BODY[:cut]
    ids = chat.encode(text)
    assert chat.decode(ids) == text
    env = RecordingCalculator()
    (t,), _ = run_group_rollouts(ScriptedBackend({0: [(ids, "length")]}), chat, env, [REC], settings())
    env.close()
    rec = t.turns[0]
    assert (rec.finish_reason, rec.truncated, t.finish_reason) == ("length", True, "length")
    assert rec.parsed.content == content and len(rec.parsed.tool_calls) == n_calls
    assert rec.parsed.truncated == (n_calls < 2)
    (turn,) = env.turns
    assert (turn.content, turn.truncated, turn.finish_reason) == (content, True, "length")
    assert len(t.tool_calls) == n_calls


def test_turn_cut_by_length_inside_a_call_is_not_scored_as_an_answer(tok):
    """max_new_tokens inside a call whose argument so far ends with the right number: the cut
    call's text is the content's end, and the calculator scored that text as the answer (reward 1
    for a turn that never answered). The environment is told the turn ended inside a call, as for
    a turn that stopped there, so the built-in ones give it reward 0."""
    from m3_rollout.rollout.group_rollout import UNFINISHED_CALL

    chat = ChatFormat(tok, "disabled")
    text = f'Let me check. {NS}<tool_call>\n{NS}<invoke name="calculator">{NS}<expression>408'
    env = RecordingCalculator()
    (t,), _ = run_group_rollouts(ScriptedBackend({0: [(chat.encode(text), "length")]}), chat, env, [REC], settings())
    env.close()
    (turn,) = env.turns
    assert (turn.content, turn.truncated, turn.parse_error) == (text, True, UNFINISHED_CALL)
    assert (t.reward, t.finish_reason) == (0.0, "length")
    # cut after the call closed: no unfinished call, the turn is scored as before
    done = CUT_BODY[: CUT_BODY.index(f"{NS}</tool_call>") - 1]
    env = RecordingCalculator()
    run_group_rollouts(ScriptedBackend({0: [(chat.encode(done), "length")]}), chat, env, [REC], settings())
    env.close()
    assert env.turns[0].parse_error is None


def test_turn_stopped_inside_a_call_gets_an_error_observation(tok):
    """The model samples its end-of-message token inside a call: the call is no call (its text is
    content), and the environment answers the parse error instead of scoring the turn as an answer."""
    from m3_rollout.rollout.group_rollout import UNFINISHED_CALL

    chat = ChatFormat(tok, "disabled")
    text = CUT_BODY[: CUT_BODY.index("12*") + 3]
    turn1 = chat.encode(text) + [chat.eos_token_id]
    turn2 = chat.assistant_ids("It is 408.")
    env = RecordingCalculator()
    backend = ScriptedBackend({0: [(turn1, "stop"), (turn2, "stop")]})
    (t,), _ = run_group_rollouts(backend, chat, env, [REC], settings())
    env.close()
    rec = t.turns[0]
    assert (rec.parsed.content, rec.parsed.tool_calls, rec.parsed.truncated) == (text, [], True)
    assert (env.turns[0].content, env.turns[0].parse_error) == (text, UNFINISHED_CALL)
    assert rec.observations == [f"Error: malformed tool call ({UNFINISHED_CALL})"]
    assert len(t.turns) == 2 and (t.reward, t.finish_reason) == (1.0, "stop")


class RecordingJsonl(JsonlEnvironment):
    """The JSONL environment with the calculator tool and the last-number reward, keeping every
    ModelTurn it was given."""

    def __init__(self):
        super().__init__(last_number_reward, tools=["calculator"])
        self.turns: list[ModelTurn] = []

    def step(self, state, turn: ModelTurn):
        self.turns.append(turn)
        return super().step(state, turn)


@pytest.mark.parametrize("make_env", [RecordingCalculator, RecordingJsonl], ids=["calculator", "jsonl"])
def test_turn_stopped_inside_a_call_after_closed_calls_answers_that_call_too(tok, make_env):
    """Closed calls, then the end-of-message token inside a further call: the closed calls ran and
    the unfinished one got no observation (the model was not told it was not run). Now, after the
    closed calls' results, it gets the parse-error observation it gets when it is the turn's only
    call; reward as for any tool turn (0, the episode goes on), and the next turn is scored."""
    from m3_rollout.rollout.group_rollout import UNFINISHED_CALL

    chat = ChatFormat(tok, "disabled")
    text = CUT_BODY[: CUT_BODY.index("400+") + 4]  # the first call closed, the second cut in its value
    turn1 = chat.encode(text) + [chat.eos_token_id]
    turn2 = chat.assistant_ids("It is 408.")
    env = make_env()
    backend = ScriptedBackend({0: [(turn1, "stop"), (turn2, "stop")]})
    (t,), _ = run_group_rollouts(backend, chat, env, [REC], settings())
    env.close()
    rec = t.turns[0]
    assert [c.name for c in rec.parsed.tool_calls] == ["calculator"] and rec.parsed.truncated
    assert (len(env.turns[0].tool_calls), env.turns[0].truncated) == (1, True)
    assert rec.observations == ["408", f"Error: malformed tool call ({UNFINISHED_CALL})"]
    assert "<response>" + rec.observations[1] + "</response>" in chat.decode(rec.bridge)
    assert len(t.turns) == 2 and (t.reward, t.finish_reason) == (1.0, "stop")


class EchoEnv(Environment):
    """Never done: every turn gets a one-line tool observation, until the turn limit."""

    def reset(self, record):
        return [{"role": "user", "content": "Say something."}], {}

    def step(self, state, turn: ModelTurn):
        return EnvStep(["ok"], 0.0, False)


def test_multiturn_rollout_logprobs_match_rescoring(tok):
    from m3_rollout.engine.native_backend import NativeBackend

    chat = ChatFormat(tok, "disabled")
    torch.manual_seed(0)
    model = M3ForCausalLM(tiny_config(vocab_size=len(tok), max_position_embeddings=512)).float().eval()
    # Make the eos likely so turns end by "stop" and the episode really has several turns.
    bias = torch.zeros(len(tok))
    bias[chat.eos_token_id] = 5.0
    model.lm_head.register_forward_hook(lambda mod, inp, out: out + bias.to(out.dtype))
    backend = NativeBackend(model, chat.stop_token_ids)
    env = EchoEnv()
    s = settings(n=3, max_turns=3, max_total_len=300, max_new_tokens=12, seed=3)
    trajs, _ = run_group_rollouts(backend, chat, env, [{}], s)
    assert max(len(t.turns) for t in trajs) == 3  # really multi-turn
    for t in trajs:
        # Ids are the prompt + for each turn (sampled ids + bridge ids), in order.
        rebuilt = list(t.token_ids[: t.prompt_len])
        for r in t.turns:
            assert rebuilt == t.token_ids[: r.start]
            rebuilt += t.token_ids[r.start : r.end] + r.bridge
        assert rebuilt == t.token_ids
        assert sum(t.loss_mask) == sum(r.end - r.start for r in t.turns)
        assert all(m == (any(r.start <= i < r.end for r in t.turns)) for i, m in enumerate(t.loss_mask))
        for r in t.turns:
            assert r.finish_reason in ("stop", "length")
            assert r.stop_sampled == (r.finish_reason == "stop")
        with torch.no_grad():
            lp = token_logprobs(model, torch.tensor([t.token_ids]))[0]
        mask = torch.tensor(t.loss_mask, dtype=torch.bool)
        torch.testing.assert_close(torch.tensor(t.rollout_logprobs)[mask], lp[mask].float(), atol=1e-4, rtol=0)


def test_multiturn_trajectory_carries_the_engines_routing_record(tok):
    """Routing replay wiring: engine (record_routing) -> SampleOutput.routed_experts -> Trajectory
    -> TrainBatch. The record equals a plain forward's expert choice for every recorded token
    (prompt, bridge and sampled tokens), and covers all but at most the last token."""
    from m3_rollout.engine.native_backend import NativeBackend
    from m3_trainers.batch import batch_from_trajectories

    chat = ChatFormat(tok, "disabled")
    torch.manual_seed(0)
    model = M3ForCausalLM(tiny_config(vocab_size=len(tok), max_position_embeddings=512)).float().eval()
    bias = torch.zeros(len(tok))
    bias[chat.eos_token_id] = 5.0
    model.lm_head.register_forward_hook(lambda mod, inp, out: out + bias.to(out.dtype))
    backend = NativeBackend(model, chat.stop_token_ids, record_routing=True)
    trajs, _ = run_group_rollouts(
        backend, chat, EchoEnv(), [{}], settings(n=2, max_turns=3, max_total_len=300, max_new_tokens=12, seed=3)
    )
    assert max(len(t.turns) for t in trajs) >= 2
    for t in trajs:
        rec = torch.as_tensor(t.routed_experts).long()  # [L', n_moe_layers, K]
        assert len(t.token_ids) - 1 <= rec.shape[0] <= len(t.token_ids)
        with torch.no_grad():
            model(torch.tensor([t.token_ids]))
        want = torch.stack([m.last_topk_ids.view(len(t.token_ids), -1) for m in model.moe_layers()], dim=1)
        known = rec[:, 0, 0] >= 0
        assert bool(known[:-1].all())  # only the last token may lack a record (never run forward)
        assert torch.equal(rec[known], want[: rec.shape[0]][known])
    batch = batch_from_trajectories(trajs, torch.zeros(len(trajs)), with_routing=True)
    for i, t in enumerate(trajs):
        rec = torch.as_tensor(t.routed_experts).long()
        assert torch.equal(batch.routed_experts[i, : rec.shape[0]], rec)
        assert bool((batch.routed_experts[i, rec.shape[0] :] == -1).all())  # padding / unrecorded


def test_multiturn_trajectory_carries_the_block_selection_record(tok):
    """Block-selection wiring: engine (record_block_selection) -> SampleOutput.block_selection (each
    turn only its new tokens: GenerationRequest.block_selection_from) -> Trajectory -> TrainBatch.
    The record equals a plain forward's block choice for every position but the last (never run);
    the group's samples share their prompt's segment."""
    from m3_rollout.engine.native_backend import NativeBackend
    from m3_trainers.batch import batch_from_trajectories

    chat = ChatFormat(tok, "disabled")
    torch.manual_seed(0)
    model = M3ForCausalLM(tiny_config(vocab_size=len(tok), max_position_embeddings=512)).float().eval()
    bias = torch.zeros(len(tok))
    bias[chat.eos_token_id] = 5.0
    model.lm_head.register_forward_hook(lambda mod, inp, out: out + bias.to(out.dtype))
    backend = NativeBackend(model, chat.stop_token_ids, record_block_selection=True)
    trajs, _ = run_group_rollouts(
        backend, chat, EchoEnv(), [{}], settings(n=2, max_turns=3, max_total_len=300, max_new_tokens=12, seed=3)
    )
    assert max(len(t.turns) for t in trajs) >= 2
    assert trajs[0].block_selection.segments[0] is trajs[1].block_selection.segments[0]  # the shared prompt
    for t in trajs:
        rec = t.block_selection
        assert rec.segments[0].start == 0 and rec.end == len(t.token_ids) - 1
        assert len(rec.segments) == 1 + len(t.turns)  # prompt, then each turn's new tokens
        with torch.no_grad():
            model(torch.tensor([t.token_ids]))
        want = torch.stack([a.last_selected_blocks[0].permute(1, 0, 2) for a in model.sparse_attention_layers()], 1)
        assert torch.equal(torch.from_numpy(rec.dense(rec.end)).long(), want[: rec.end])
    batch = batch_from_trajectories(trajs, torch.zeros(len(trajs)), with_block_selection=True)
    assert batch.block_selection.dtype == torch.int16 and batch.block_selection.shape[2:] == (3, 2, 4)
    for i, t in enumerate(trajs):
        end = t.block_selection.end
        assert torch.equal(batch.block_selection[i, :end], torch.from_numpy(t.block_selection.dense(end)))
        assert bool((batch.block_selection[i, end:] == -1).all())  # the last token, padding


def test_validation_at_val_temperature_0_is_greedy(tok):
    """grpo.val_temperature=0 (accepted by the config) reaches the engine's SamplingParams as vLLM's
    greedy: runs under two seeds give the same tokens, each the argmax of the model's logits, where
    temperature 1 gives other tokens under the two seeds."""
    from m3_rollout.config import load_config
    from m3_rollout.engine.native_backend import NativeBackend
    from m3_rollout.jobs.stack import RolloutStack

    chat = ChatFormat(tok, "disabled")
    torch.manual_seed(0)
    model = M3ForCausalLM(tiny_config(vocab_size=len(tok), max_position_embeddings=512)).float().eval()
    backend = NativeBackend(model, chat.stop_token_ids)
    stack = RolloutStack(None, {}, chat, 300, backend, EchoEnv(), None, settings())

    def rollouts(val_temperature, seed):
        cfg = load_config("configs/grpo_bf16_ep.yaml", [f"grpo.val_temperature={val_temperature}", f"grpo.seed={seed}"])
        s = dataclasses.replace(stack.validation_settings(cfg), max_turns=1, max_new_tokens=16)
        assert s.temperature == val_temperature
        trajs, _ = run_group_rollouts(backend, chat, stack.env, [{}, {}, {}], s)
        return trajs

    def tokens(trajs):
        return [t.token_ids[t.prompt_len :] for t in trajs]

    greedy = rollouts(0, seed=1)
    assert tokens(greedy) == tokens(rollouts(0, seed=2))
    assert tokens(rollouts(1, seed=1)) != tokens(rollouts(1, seed=2))  # the seeds do reach the sampler
    t = greedy[0]
    with torch.no_grad():
        logits = model(torch.tensor([t.token_ids]))[0, t.prompt_len - 1 : -1].float()
    picked = logits.gather(1, torch.tensor(t.token_ids[t.prompt_len :])[:, None])[:, 0]
    assert len(picked) == 16 and (picked >= logits.max(dim=1).values - 1e-4).all()

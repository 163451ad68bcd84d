"""GRPO group rollouts with multi-turn tool use (design.md §2, steps 2-3).

Governing idea: token-in, token-out. Each prompt is rendered once; its n samples are generated
together; when a sample calls a tool, the environment runs it and the tool turn's tokens are
appended to that sample's own token sequence, which is submitted again as the next turn's
prompt. Earlier turns are never re-rendered or re-tokenised, so the trainer sees exactly the
tokens the sampler produced (and the model keeps its own reasoning in context).

Next turn's input = previous input + the sampled ids + the bridge ids (the eos when the engine
did not sample one, "\n", the tool turn, the next generation prompt; all mask 0). Each turn's
finish reason is the engine's; a turn that ends by length ends the trajectory, is flagged, is
taken out of the loss when ``mask_truncated_turns`` is set, and is scored by the environment or
given ``truncated_turn_reward``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from m3_rollout.chat.output_parser import parse_model_output
from m3_rollout.chat.template import ChatFormat
from m3_rollout.engine.interface import FINISH_ERROR, GenerationBackend, GenerationRequest, SampleOutput, SamplingParams
from m3_rollout.rollout.environment import UNFINISHED_CALL, Environment, ModelTurn
from m3_rollout.rollout.trajectory import Trajectory


@dataclass
class RolloutSettings:
    """Knobs of one rollout call.

    Attributes:
        n: samples per prompt (GRPO group size).
        max_turns: most model turns per trajectory.
        max_total_len: cap on a trajectory's total tokens (truncation policy: generation stops at
            the cap with finish_reason "length"; a tool turn that does not fit ends the
            trajectory, also as "length").
        max_new_tokens: cap per model turn.
        temperature, top_p, top_k: sampling.
        seed: base seed; prompt i of the call uses seed ``seed * 1_000_003 + i``.
        mask_truncated_turns: a turn cut by a length limit gets loss_mask 0 (it is still kept,
            flagged in ``TurnRecord.truncated``); off = train on it like any other turn.
        truncated_turn_reward: reward of a trajectory whose last turn was cut by a length limit;
            None = the environment scores what the cut turn said (e.g. an answer already given).
    """

    n: int
    max_turns: int
    max_total_len: int
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int = 0
    logprobs_mode: str = "processed"
    mask_truncated_turns: bool = False
    truncated_turn_reward: float | None = None


def run_group_rollouts(
    backend: GenerationBackend, chat: ChatFormat, env: Environment, records: list[dict], settings: RolloutSettings
) -> tuple[list[Trajectory], dict]:
    """Roll out ``settings.n`` samples for every record.

    Returns:
        (trajectories ordered by (group, sample), metrics dict with timing and token counts).

    Raises:
        ValueError: a record that the environment cannot reset (named by index).
    """
    t0 = time.perf_counter()
    tools = env.tool_schemas()
    trajs: list[Trajectory] = []
    states: list[dict] = []
    seeds: list[int] = []
    for gi, rec in enumerate(records):
        try:
            messages, state = env.reset(rec)
        except ValueError as exc:
            raise ValueError(f"prompt record {gi}: {exc}") from None
        prompt = chat.prompt_ids(messages, tools=tools)
        seeds.append(settings.seed * 1_000_003 + gi)
        for j in range(settings.n):
            t = Trajectory(
                group_index=gi,
                sample_index=j,
                token_ids=[],
                loss_mask=[],
                rollout_logprobs=[],
                weight_version=[],
                prompt_len=len(prompt),
            )
            t.append(prompt, generated=False)
            trajs.append(t)
            states.append(dict(state))

    # Turn 1: one request per prompt with n samples (the samples share the prompt).
    pending = [(gi, None) for gi in range(len(records))]  # (group, sample or None = all n)
    turn = 0
    gen_tokens = 0
    while pending and turn < settings.max_turns:
        turn += 1
        requests, targets = [], []
        for gi, j in pending:
            idxs = [gi * settings.n + k for k in range(settings.n)] if j is None else [gi * settings.n + j]
            ctx = trajs[idxs[0]].token_ids
            room = settings.max_total_len - len(ctx)
            params = SamplingParams(
                n=len(idxs),
                temperature=settings.temperature,
                top_p=settings.top_p,
                top_k=settings.top_k,
                max_new_tokens=max(1, min(settings.max_new_tokens, room)),
                stop_token_ids=tuple(chat.stop_token_ids),
                seed=seeds[gi],
                logprobs_mode=settings.logprobs_mode,
            )
            rec = trajs[idxs[0]].block_selection  # turn 2+: only the new tokens' record comes back
            requests.append(
                GenerationRequest(
                    f"g{gi}-s{j}-t{turn}",
                    list(ctx),
                    params,
                    sample_index=0 if j is None else j,
                    block_selection_from=0 if rec is None else rec.end,
                )
            )
            targets.extend(idxs)
        outputs = backend.generate(requests)
        if len(outputs) != len(targets):
            raise RuntimeError(f"backend returned {len(outputs)} outputs for {len(targets)} samples")
        pending = []
        for idx, out in zip(targets, outputs):
            traj = trajs[idx]
            if out.finish_reason == FINISH_ERROR:
                traj.finish_reason = FINISH_ERROR
                traj.info["error"] = out.error
                continue
            gen_tokens += len(out.output_ids)
            if _model_turn(traj, states[idx], out, chat, env, tools, settings, turn):
                pending.append((traj.group_index, traj.sample_index))
    for t in trajs:
        t.check()
    seconds = time.perf_counter() - t0
    return trajs, {
        "rollout_seconds": seconds,
        "generated_tokens": gen_tokens,
        "generation_tokens_per_s": gen_tokens / max(seconds, 1e-9),
        "turns": turn,
    }


def _model_turn(
    traj: Trajectory,
    state: dict,
    out: SampleOutput,
    chat: ChatFormat,
    env: Environment,
    tools: list[dict],
    settings: RolloutSettings,
    turn: int,
) -> bool:
    """Append one sampled turn to ``traj``, step the environment, append the bridge.

    Returns True when the trajectory continues with another model turn.
    """
    ids = list(out.output_ids)
    versions = out.token_weight_versions
    versions = list(versions) if versions and len(versions) == len(ids) else out.weight_version
    record = traj.append(ids, generated=True, logprobs=list(out.logprobs), version=versions)
    if out.routed_experts is not None:  # routing replay: this turn's record covers prompt + output
        traj.routed_experts = out.routed_experts
    if out.block_selection is not None:  # this turn's new tokens (the request's block_selection_from on)
        traj.block_selection = (
            out.block_selection if traj.block_selection is None else traj.block_selection.then(out.block_selection)
        )
    # The finish reason is the engine's; the stop token is in the span only if it was sampled.
    stop_sampled = out.finish_reason == "stop" and bool(ids) and ids[-1] in chat.stop_token_ids
    text = chat.decode(ids[:-1] if stop_sampled else ids)
    traj.texts.append(text)
    parsed = parse_model_output(text, chat.thinking_mode, tools, first_index=len(traj.tool_calls))
    record.finish_reason, record.stop_sampled, record.parsed = out.finish_reason, stop_sampled, parsed
    calls = [{"id": c.id, "name": c.name, "arguments": c.arguments, "error": c.error} for c in parsed.tool_calls]
    traj.tool_calls.extend({"name": c.name, "arguments": c.arguments} for c in parsed.tool_calls)
    if out.finish_reason != "stop":
        # Cut by a token limit (or aborted): score what is there, no further turns.
        record.truncated = out.finish_reason == "length"
        if record.truncated and settings.mask_truncated_turns:
            traj.mask_span(record.start, record.end)
            record.masked = True
        result = env.step(
            state,
            ModelTurn(
                content=parsed.content,
                parse_error=UNFINISHED_CALL if parsed.truncated else None,  # cut inside a call: no answer
                truncated=True,
                reasoning=parsed.reasoning,
                finish_reason=out.finish_reason,
            ),
        )
        traj.reward, traj.finish_reason = result.reward, ("length" if record.truncated else out.finish_reason)
        if record.truncated and settings.truncated_turn_reward is not None:
            traj.reward = settings.truncated_turn_reward
        traj.info.update(result.info)
        return False
    result = env.step(
        state,
        ModelTurn(
            content=parsed.content,
            tool_calls=calls,
            parse_error=parsed.error or (UNFINISHED_CALL if parsed.truncated else None),
            truncated=parsed.truncated,
            reasoning=parsed.reasoning,
            finish_reason=out.finish_reason,
        ),
    )
    traj.reward = result.reward
    traj.info.update(result.info)
    if result.done:
        traj.finish_reason = "stop"
        return False
    if turn >= settings.max_turns:
        traj.finish_reason = "max_turns"
        return False
    record.observations = list(result.observations)
    # A stop the engine reported without sampling the token (e.g. a stop string): the turn still
    # needs its end-of-message marker; appended, so mask 0.
    bridge = ([] if stop_sampled else [chat.eos_token_id]) + chat.tool_turn_ids(result.observations)
    if len(traj.token_ids) + len(bridge) >= settings.max_total_len:
        traj.finish_reason = "length"
        return False
    record.bridge = bridge
    traj.append(bridge, generated=False)
    return True

"""Trajectory: one sampled multi-turn episode, as token-level arrays the trainer consumes.

Worked example (prompt P of 3 tokens, model turn of 2 tokens ending in eos, tool turn T of 2
tokens, final model turn of 2 tokens)::

    token_ids        P0  P1  P2  g0  eos T0  T1  a0  eos
    loss_mask        0   0   0   1   1   0   0   1   1
    rollout_logprobs 0   0   0   l   l   0   0   l   l     (sampling-distribution logprob)
    weight_version   -1  -1  -1  v   v   -1  -1  v   v
    turns            [TurnRecord(3, 5, ...), TurnRecord(7, 9, ...)]   (half-open spans of model turns)

``rollout_logprobs[t]`` is log p(token_ids[t] | token_ids[:t]) for generated tokens.

The tool turn T is the *bridge*: "\n" after the model's eos, the tool turn with the results and
the next generation prompt (plus the eos itself, mask 0, when the engine stopped without
sampling one). ``turns[i]`` records model turn i: its span, the engine's finish reason, the
parse result and the bridge that followed it; the span is stored there only (``turn_spans`` reads it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from m3_rollout.chat.output_parser import ParsedTurn
from m3_rollout.engine.interface import FINISH_ERROR
from m3_rollout.model.selection_record import SelectionRecord


@dataclass
class TurnRecord:
    """One model turn of a trajectory.

    Attributes:
        start, end: half-open span of the sampled tokens in ``Trajectory.token_ids``.
        finish_reason: the engine's ``SampleOutput.finish_reason`` for this turn ("stop",
            "length", "abort", ...), never inferred from the last token.
        stop_sampled: the engine sampled the stop token (it is in the span, mask 1).
        parsed: reasoning / content / tool calls / flags of the turn's text.
        (``Trajectory.append`` creates the record with the span; the rollout fills in the rest.)
        observations: the environment's tool results shown after this turn.
        bridge: ids appended after the turn (mask 0); empty for the last turn.
        truncated: the turn ended by a length limit.
        masked: its tokens were taken out of the loss (``RolloutSettings.mask_truncated_turns``, or
            the trainer's overlong filtering of the whole trajectory).
    """

    start: int
    end: int
    finish_reason: str = "stop"
    stop_sampled: bool = False
    parsed: ParsedTurn = field(default_factory=lambda: ParsedTurn(None, None))
    observations: list[str] = field(default_factory=list)
    bridge: list[int] = field(default_factory=list)
    truncated: bool = False
    masked: bool = False


@dataclass
class Trajectory:
    """One sample of a GRPO group.

    Attributes:
        group_index: which prompt of the step (GRPO group id).
        sample_index: which of the n samples of that prompt.
        token_ids: [L] all tokens (prompt, model turns, tool turns).
        loss_mask: [L] 1 on tokens the model sampled, 0 elsewhere.
        rollout_logprobs: [L] logprob of each sampled token under the sampling distribution, 0
            elsewhere.
        weight_version: [L] weight version that produced each token, -1 for non-generated ones.
        finish_reason: "stop" (answered), "length" (hit a token limit), "max_turns" (turn limit
            reached while still calling tools), "error" (``FINISH_ERROR``: the backend refused or
            lost a request; ``failed``).
        tool_calls: every parsed call, {"name", "arguments"} in order (ids and the truncated /
            error flags of each call are in ``turns[i].parsed.tool_calls``).
        turns: one ``TurnRecord`` per model turn: its half-open span [start, end) in ``token_ids``,
            parse results, engine finish reason, bridge.
        reward: environment reward.
        texts: decoded text of each model turn (for logging).
        prompt_len: number of prompt tokens.
        routed_experts: optional int16 array [L', n_moe_layers, top_k] of the experts the rollout
            engine chose for tokens 0..L'-1 (prompt, tool and generated tokens; the latest turn's
            record, which covers every earlier token); None when the engine did not record
            routing. L' may be < L (a token appended after the last forward); -1 = not recorded.
        block_selection: optional ``m3_rollout.model.selection_record.SelectionRecord``: the KV
            blocks every sparse layer selected for positions 0..E-1 (prompt, tool and generated
            tokens; each turn appends the segment of its new tokens, the group's samples share
            the prompt's segment); E <= L (the last token is never run). None when the engine did
            not record it.
    """

    group_index: int
    sample_index: int
    token_ids: list[int]
    loss_mask: list[int]
    rollout_logprobs: list[float]
    weight_version: list[int]
    prompt_len: int
    finish_reason: str = "length"
    tool_calls: list[dict] = field(default_factory=list)
    reward: float = 0.0
    texts: list[str] = field(default_factory=list)
    info: dict = field(default_factory=dict)
    turns: list[TurnRecord] = field(default_factory=list)
    routed_experts: object | None = None
    block_selection: SelectionRecord | None = None

    def append(
        self, ids: list[int], generated: bool, logprobs: list[float] | None = None, version: int | list[int] = -1
    ) -> TurnRecord | None:
        """Append a model turn (``generated``, with its logprobs and the weight version of the
        whole turn or of each token) or a non-sampled span (mask 0, version -1).

        Returns:
            the new turn's ``TurnRecord`` (span set, the rest defaults) for a model turn, else None.
        """
        start = len(self.token_ids)
        self.token_ids.extend(ids)
        self.loss_mask.extend([1 if generated else 0] * len(ids))
        if not generated:
            self.rollout_logprobs.extend([0.0] * len(ids))
            self.weight_version.extend([-1] * len(ids))
            return None
        assert logprobs is not None and len(logprobs) == len(ids), "one logprob per sampled token"
        versions = version if isinstance(version, list) else [version] * len(ids)
        assert len(versions) == len(ids), "one weight version per sampled token"
        self.rollout_logprobs.extend(float(x) for x in logprobs)
        self.weight_version.extend(int(v) for v in versions)
        record = TurnRecord(start, len(self.token_ids))
        self.turns.append(record)
        return record

    @property
    def turn_spans(self) -> list[tuple[int, int]]:
        """Half-open [start, end) of each model turn in ``token_ids`` (from ``turns``)."""
        return [(r.start, r.end) for r in self.turns]

    def mask_span(self, start: int, end: int) -> None:
        """Take tokens [start, end) out of the loss (e.g. a turn cut by a length limit)."""
        for i in range(start, end):
            self.loss_mask[i] = 0

    @property
    def num_generated(self) -> int:
        return sum(self.loss_mask)

    @property
    def failed(self) -> bool:
        """True when a generation request of this trajectory failed (finish_reason "error": the
        backend refused or lost it, ``info["error"]`` says why). Its ``reward`` is then a
        placeholder 0, not a score of an answer: the trainer leaves it out of its group's
        advantage statistics and out of the loss (``m3_trainers.advantages``)."""
        return self.finish_reason == FINISH_ERROR

    def check(self) -> None:
        """Assert the per-token arrays agree (raised on a bug, not on bad input)."""
        n = len(self.token_ids)
        assert len(self.loss_mask) == n == len(self.rollout_logprobs) == len(self.weight_version), (
            "trajectory arrays differ in length"
        )

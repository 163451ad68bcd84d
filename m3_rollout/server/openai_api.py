"""The OpenAI-compatible endpoints: chat completions and completions over the engine runner.

Governing idea: the chat layer already owns the format (``m3_rollout.chat``: the template renders
the prompt, ``StreamingOutputParser`` splits reasoning / content / tool calls chunk by chunk with
the same result as the whole-text parse), so this module only maps OpenAI fields onto
``SamplingParams`` and parser output onto OpenAI shapes. A streamed answer is the same parser fed
the same decoded text piece by piece, so its deltas concatenate to the non-streamed answer of the
same seed (the keyed sampler draws the same tokens either way).

``tool_choice``: "auto" parses tool calls, "none" returns the raw text as content (tool-call
markup included, unparsed), "required" and a named function force a call by writing its opening
(``]<]minimax[>[<tool_call>`` and the invoke tag, with the name for a named choice or for "required"
with a single tool) after the
generation prompt, cut back to where its tokens are the ones the whole call has
(``token_safe_opening``); the model continues from there (no grammar: the arguments are the
model's). In "enabled" thinking mode the forced opening first closes the think span, so such a
turn has empty reasoning. The opening is prompt text, not the model's: a forced call the output
cuts off (max_tokens, or the model's end right after the opening) returns as content only what the
model wrote after it, null when nothing; there is no call and the finish reason is the engine's
(nothing guarantees a call here; OpenAI's constrained decoding would). Generation ends where
the forced call closes (:func:`forced_call_end`: the block's closer, or with
``parallel_tool_calls=false`` the first call's), as nothing written after it is returned: a model
that writes on past its call answers with the call and finish reason "tool_calls" (for a named
function "stop", as OpenAI's and vLLM's), not "length" at ``max_tokens``.
``parallel_tool_calls=false`` keeps the first call only; a later call the output cut off is dropped
like a closed one (its text is not returned as content).

Generated tokens' ``top_logprobs`` are the sampler's (``SamplingParams.top_logprobs``,
``SampleOutput.top_logprobs``), and the prompt tokens' logprobs (completions ``echo``, vLLM's
``prompt_logprobs`` on both routes, ``/generate``'s ``sampling_params.prompt_logprobs``) the
engine's prefill's (``SamplingParams.prompt_logprobs``, ``SampleOutput.prompt_logprobs``, vLLM's
way): scores of the weights that ran the sample, kept whatever was written since, unless the
prompt's prefill itself ran across a weight write (:func:`prefill_prompt_rows`). For a backend
whose outputs carry none they come from one scoring forward through the engine
after the sample is generated (:meth:`OpenAIServing.score_sample`), in the distribution the sampled
logprobs come from (``logprobs_mode``), and only for tokens stamped with the weight-write count
that forward ran with (``SampleOutput.token_weight_writes``): anything sampled or prefilled with
weights written over since is left empty, with a note.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from m3_rollout.chat.markers import NS, THINK_CLOSE, THINKING_MODES, TOOL_CALL_OPEN
from m3_rollout.chat.output_parser import OutputDelta, StreamingOutputParser
from m3_rollout.chat.reasoning_parser import StreamingReasoningParser
from m3_rollout.chat.template import render
from m3_rollout.chat.tokenizer import TokenBytes
from m3_rollout.engine.interface import FINISH_ERROR, GenerationRequest, SampleOutput, SamplingParams, StreamDelta
from m3_rollout.engine.requests import aborted_outputs
from m3_rollout.engine.stop_strings import complete_text

from .control import Controller
from .protocol import (
    GENERATE_SAMPLING_KEYS,
    GENERATION_FAILED,
    MAX_TOP_LOGPROBS,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
    check_unserved_fields,
    request_seed,
)


@dataclass
class ServedModel:
    """What the HTTP layer knows about the served checkpoint.

    Attributes:
        name: model id clients send (``/v1/models``).
        tokenizer: transformers tokenizer whose vocabulary holds M3's markers.
        chat_template: Jinja source (the tokenizer's by default).
        stop_token_ids: ids that end every sample (the end-of-message marker).
        max_model_len: longest context (prompt + generated), tokens.
        vocab_size: the model's vocabulary size (token ids must be below it).
        default_chat_template_kwargs: applied under every request's ``chat_template_kwargs`` (the
            request's keys win); e.g. ``{"thinking_mode": "disabled"}`` for a checkpoint trained
            in that mode (``--default-chat-template-kwargs``).
    """

    name: str
    tokenizer: object
    chat_template: str
    stop_token_ids: list[int]
    max_model_len: int
    vocab_size: int
    created: int = field(default_factory=lambda: int(time.time()))
    default_chat_template_kwargs: dict = field(default_factory=dict)
    _token_bytes: TokenBytes | None = field(default=None, init=False, repr=False, compare=False)

    def template_kwargs(self, request_kwargs: dict | None) -> dict:
        """The server's default chat-template kwargs overlaid with a request's (a request that
        names a thinking mode either way, ``thinking_mode`` or ``enable_thinking``, drops both
        defaults)."""
        req = request_kwargs or {}
        base = dict(self.default_chat_template_kwargs)
        if req.keys() & THINKING_KEYS:
            for key in THINKING_KEYS:
                base.pop(key, None)
        return {**base, **req}

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        """Text with every marker kept (the parsers need them)."""
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def token_bytes(self, token_id: int) -> bytes:
        """The token's raw bytes (:class:`~m3_rollout.chat.tokenizer.TokenBytes`: a byte-level BPE
        token's own bytes, part of a multi-byte character included; a marker's UTF-8)."""
        if self._token_bytes is None:
            self._token_bytes = TokenBytes(self.tokenizer)
        return self._token_bytes(token_id)


def check_token_ids(served: ServedModel, ids: list[int], param: str) -> None:
    """400 naming ``param`` for an empty list or an id outside [0, vocab_size)."""
    if not ids:
        raise APIError(400, f"{param}: empty token list", param)
    bad = next((t for t in ids if not 0 <= t < served.vocab_size), None)
    if bad is not None:
        raise APIError(400, f"{param}: token id {bad} outside the vocabulary [0, {served.vocab_size})", param)


def check_prompt_logprobs(k: int | None, param: str, stream: bool = False) -> None:
    """vLLM's ``prompt_logprobs`` request field: null (off) or an integer in [0,
    ``MAX_TOP_LOGPROBS``], the top tokens listed per prompt position besides the prompt token
    itself. vLLM takes -1 for the whole vocabulary, capped by its ``--max-logprobs`` (20 by
    default, OpenAI's ``top_logprobs`` cap); here the cap is that same 20, which ``top_logprobs`` /
    ``logprobs`` have. ``stream``: the OpenAI routes refuse k >= 1 on a streamed request and take
    0 (sending no prompt logprobs), as vLLM's request validators do.

    Raises:
        APIError: 400 naming ``param``.
    """
    if k is None:
        return
    if not 0 <= k <= MAX_TOP_LOGPROBS:
        raise APIError(
            400,
            f"{param}={k}: must be null (off) or an integer in [0, {MAX_TOP_LOGPROBS}], the top tokens listed per "
            "prompt position besides the prompt token itself (0: the prompt token only; vLLM's -1, the whole "
            "vocabulary, is not served)",
            param,
        )
    if stream and k > 0:
        raise APIError(
            400,
            f"{param}={k}: prompt logprobs are not available with stream=true (as in vLLM); send stream=false",
            param,
        )


def check_prompt_length(served: ServedModel, n: int, param: str) -> None:
    if n >= served.max_model_len:
        raise APIError(
            400,
            f"This model's maximum context length is {served.max_model_len} tokens; the prompt has {n} tokens "
            "and leaves no room to generate. Shorten the prompt.",
            param,
            code="context_length_exceeded",
        )


# Engine field names (``SamplingParams.<name>``, ``GenerationRequest.<name>``) -> the request field a
# client sent, per endpoint; names not listed are the same on both sides (temperature, top_p, ...).
CHAT_FIELDS = {"prompt_ids": "messages", "max_new_tokens": "max_tokens", "stop_strings": "stop"}
COMPLETION_FIELDS = {"prompt_ids": "prompt", "max_new_tokens": "max_tokens", "stop_strings": "stop"}
GENERATE_FIELDS = {
    "prompt_ids": "input_ids",
    "sample_index": "sample_index",
    **{f: f"sampling_params.{key}" for f, key in GENERATE_SAMPLING_KEYS.items()},
}
_ENGINE_FIELD = re.compile(r"(?:SamplingParams|GenerationRequest)\.(\w+)")


def engine_error(message: str | None, fields: dict[str, str]) -> APIError:
    """The APIError for an engine error record (``finish_reason == "error"``).

    A bad request is a 400 ``invalid_request_error``: the engine names its own field first
    (``SamplingParams.temperature=1e-50: ...``, every check in ``engine.requests``); the error
    names the client's field instead (``fields`` maps engine names to request names, e.g.
    :data:`GENERATE_FIELDS`), in the message and as ``param``. An error about no field is the
    server's state, not the request (weights invalid after a failed update, a streamed request lost
    with a failed EP rank, a request the EP group could not finish within its restarts): a 503
    ``server_error`` with the engine's message, ``param`` None and code :data:`GENERATION_FAILED`,
    so a client retries instead of dropping the request as malformed."""
    message = message or "generation failed"
    m = _ENGINE_FIELD.match(message)
    if m is None:
        return APIError(503, message, None, type="server_error", code=GENERATION_FAILED)
    param = fields.get(m.group(1), m.group(1))
    return APIError(400, param + message[m.end() :], param)


THINKING_KEYS = frozenset({"thinking_mode", "enable_thinking"})


def thinking_mode_of(kwargs: dict | None) -> str | None:
    """The thinking mode of ``chat_template_kwargs``: ``thinking_mode`` ("enabled" | "disabled" |
    "adaptive") or vLLM's boolean ``enable_thinking``; None (the template's adaptive) when absent."""
    kwargs = kwargs or {}
    if kwargs.get("thinking_mode") is not None:
        mode = kwargs["thinking_mode"]
        if mode not in THINKING_MODES:
            raise APIError(
                400,
                f"chat_template_kwargs.thinking_mode={mode!r}: must be one of {list(THINKING_MODES)}",
                "chat_template_kwargs.thinking_mode",
            )
        return mode
    if "enable_thinking" in kwargs:
        flag = kwargs["enable_thinking"]
        if not isinstance(flag, bool):
            raise APIError(
                400, f"chat_template_kwargs.enable_thinking={flag!r}: must be a boolean", "chat_template_kwargs"
            )
        return "enabled" if flag else "disabled"
    return None


def sampling_params(
    served: ServedModel, req: SamplingFields, prompt_len: int, max_tokens: int | None
) -> SamplingParams:
    """OpenAI sampling fields -> SamplingParams; 400 naming the field for values the engine refuses.

    temperature 0 is greedy and top_k 0 or -1 is off (``SamplingParams``' rules, vLLM's: a greedy
    sample's logprobs are the model's own log-softmax); the default ``max_tokens`` is what the
    context leaves, and a larger one is capped there (the sample then ends with "length").
    vLLM fields this server does not serve are refused unless at their default
    (:func:`~m3_rollout.server.protocol.check_unserved_fields`).
    """
    check_unserved_fields(req)
    if req.stream_options is not None and not req.stream:
        raise APIError(
            400, "stream_options: only allowed with stream=true (it sets what the stream carries)", "stream_options"
        )
    kind = (req.response_format or {}).get("type", "text")
    if kind != "text":
        raise APIError(
            400,
            f"response_format: type {kind!r} is not supported by this server (no guided decoding); "
            'leave it out or send {"type": "text"}',
            "response_format",
        )
    top_k = -1 if req.top_k is None else req.top_k
    if top_k < -1:
        raise APIError(400, f"top_k={req.top_k}: must be -1 or 0 (off) or >= 1", "top_k")
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if any(not s for s in stops):
        raise APIError(400, "stop: stop strings must be non-empty", "stop")
    stop_ids = list(req.stop_token_ids or [])
    if stop_ids:
        check_token_ids(served, stop_ids, "stop_token_ids")
    room = served.max_model_len - prompt_len
    return SamplingParams(
        n=req.n,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=top_k,
        max_new_tokens=min(max_tokens or room, room),
        stop_token_ids=tuple(stop_ids),
        seed=request_seed(req.seed),
        logprobs_mode=req.logprobs_mode,
        stop_strings=tuple(stops),
        top_logprobs=sampler_top_logprobs(req),
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        logit_bias=logit_bias_pairs(served, req.logit_bias, "logit_bias"),
        prompt_logprobs=prefill_prompt_logprobs(req),
        ignore_eos=req.ignore_eos,
    )


def prefill_prompt_logprobs(req) -> int | None:
    """The top-list length the engine's prefill scores the prompt with
    (``SamplingParams.prompt_logprobs``): vLLM's ``prompt_logprobs``, completions ``echo`` with
    ``logprobs=k``, the larger of the two; None when neither asks or the answer is streamed (which
    sends none)."""
    if req.stream:
        return None
    asks = [req.prompt_logprobs] + ([req.logprobs] if getattr(req, "echo", False) else [])
    asks = [k for k in asks if k is not None]
    return max(asks) if asks else None


def sampler_top_logprobs(req) -> int:
    """The top list length the sampler computes per generated token (``SamplingParams.top_logprobs``):
    chat's ``top_logprobs`` when ``logprobs`` is true, completions' ``logprobs`` (an int); 0 = none."""
    lp = getattr(req, "logprobs", None)
    if isinstance(lp, bool) or lp is None:
        return (getattr(req, "top_logprobs", None) or 0) if lp else 0
    return lp


def logit_bias_pairs(served: ServedModel, bias: dict[str, float] | None, param: str) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``logit_bias`` (token id as a string -> bias) as ``SamplingParams.logit_bias``
    pairs, each bias clamped to [-100, 100] as vLLM does.

    Raises:
        APIError: 400 naming ``param`` for a key that is not an integer, an id outside the
        vocabulary or a NaN bias.
    """
    out: dict[int, float] = {}
    for key, value in (bias or {}).items():
        try:
            tok = int(key)
        except ValueError:
            raise APIError(400, f"{param}: key {key!r:.40} is not a token id", param) from None
        if not 0 <= tok < served.vocab_size:
            raise APIError(400, f"{param}: token id {tok} outside the vocabulary [0, {served.vocab_size})", param)
        if value != value:
            raise APIError(400, f"{param}: the bias of token {tok} is NaN", param)
        out[tok] = min(100.0, max(-100.0, float(value)))
    return tuple(out.items())


class StopMatcher:
    """Where one stop string occurs in text fed piece by piece (Knuth-Morris-Pratt): ``matched``
    is the length of the longest prefix of the stop string that ends the text so far, which is
    exactly what must be held back for it. Work per fed character is amortised O(1); building
    the failure table is O(len(stop))."""

    def __init__(self, stop: str):
        self.stop = stop
        fail = [0] * len(stop)  # fail[i]: longest proper border of stop[: i + 1]
        k = 0
        for i in range(1, len(stop)):
            c = stop[i]
            while k and stop[k] != c:
                k = fail[k - 1]
            if stop[k] == c:
                k += 1
            fail[i] = k
        self.fail = fail
        self.matched = 0

    def feed(self, text: str) -> int:
        """Advance over ``text``; return the index in ``text`` just after the stop string's first
        complete occurrence (then stop reading), or -1."""
        stop, fail, k, n = self.stop, self.fail, self.matched, len(self.stop)
        for i, c in enumerate(text):
            while k and stop[k] != c:
                k = fail[k - 1]
            if stop[k] == c:
                k += 1
                if k == n:
                    self.matched = k
                    return i + 1
        self.matched = k
        return -1


class TextStream:
    """Decoded text of one sample's generated ids, piece by piece, in time linear in the output.

    Detokenization is incremental: a push decodes the ids since the last settled point with the
    previous push's ids as left context (a token's text may depend on its neighbour) and takes
    what the new ids add. Held back: text that ends in an incomplete UTF-8 character (U+FFFD at
    the end of the decode), a trailing stop token (not part of the text), and the longest tail
    that may still begin a stop string (at most ``max(len(stop)) - 1`` characters, found by one
    :class:`StopMatcher` per stop string over the new text only); ``finish`` releases the rest,
    a trailing U+FFFD included, which no stop string matches (the engine's rule,
    ``stop_strings.complete_text``: a stop string holding U+FFFD matches it once text follows).
    The text is cut before the earliest-starting stop string (OpenAI drops it), or, with
    ``include_stop`` (vLLM's ``include_stop_str_in_output``), after the first stop string to
    complete, which it keeps (nothing is held back then: text released before a stop string
    completes is the text's either way). Either rule depends on the text alone, not on how the ids
    were split into pushes, so streamed and whole decodes agree.

    ``hidden_ids`` (the end-of-message ids an ``ignore_eos`` sample writes on, vLLM's
    ``skip_special_tokens``) are left out of the released text, and only there: the stop strings
    are matched on the text with their markers, as the engine matches them
    (``stop_strings.complete_text`` over ``ServedModel.decode``), so the cut and ``stop_reason``
    agree with where the engine stopped. A hidden marker's characters are tracked as a span of the
    text (``decode`` must give an id's text whole and independent of its neighbours: a special
    token's; the ids after one are decoded with it as their left context, so a push of many hidden
    ids costs work linear in its ids).
    """

    def __init__(
        self,
        decode: Callable[[list[int]], str],
        stop_ids: set[int],
        stop_strings: tuple[str, ...],
        request_stop_ids: set[int] = frozenset(),
        include_stop: bool = False,
        hidden_ids: set[int] = frozenset(),
    ):
        self.decode, self.stop_ids, self.include_stop = decode, stop_ids, include_stop
        self.request_stop_ids = request_stop_ids  # the request's own stop_token_ids (not end-of-message)
        self.hidden_ids = hidden_ids
        self._hidden: collections.deque[tuple[int, int]] = collections.deque()  # [start, end) in the text
        self._taken = 0  # characters of the text taken in so far (where the next new text starts)
        self._released = 0  # characters of the text released so far (where the held text starts)
        self.matchers = [StopMatcher(s) for s in stop_strings]
        self.ids: list[int] = []
        self._prefix = 0  # ids[_prefix:_read] were decoded last time: the left context
        self._read = 0  # ids before this index are text already
        self._held: collections.deque[str] = collections.deque()  # unreleased text, in pieces
        self.held_chars = 0  # characters held back (the pieces' total length)
        self.stopped = False  # a stop string was found; nothing more is text
        self.stop_string: str | None = None  # the stop string the text was cut at (OpenAI's stop_reason)

    @property
    def stop_reason(self) -> str | int | None:
        """vLLM's ``stop_reason``: the stop string that cut the text, else the request's stop token
        id that ended the sample, else None (end of message, length, abort)."""
        if self.stop_string is not None:
            return self.stop_string
        if self.ids and self.ids[-1] in self.request_stop_ids:
            return self.ids[-1]
        return None

    def push(self, ids: list[int]) -> str:
        """Add generated ids; return the text they settle."""
        self.ids.extend(ids)
        return self._visible(self._emit(self._new_text(final=False), final=False))

    def finish(self) -> str:
        return self._visible(self._emit(self._new_text(final=True), final=True))

    def _new_text(self, final: bool) -> str:
        ids = self.ids
        end = len(ids) - 1 if ids and ids[-1] in self.stop_ids else len(ids)
        if end <= self._read or self.stopped:
            return ""
        context = self.decode(ids[self._prefix : self._read]) if self._read > self._prefix else ""
        text = self.decode(ids[self._prefix : end])
        if not final and text.endswith("\ufffd"):
            return ""  # an incomplete character: wait for the ids that complete it
        # each hidden id's span: what it adds to the decode of the ids before it, decoded from the
        # previous hidden id on (its text is whole: the left context), so that each id is decoded a
        # bounded number of times however many hidden ids a push holds (an ignore_eos sample may
        # write thousands, and a non-streamed answer is one push)
        left, at, skip = self._prefix, self._taken - len(context), 0
        for k in range(self._read, end):
            if ids[k] in self.hidden_ids:
                before = at + len(self.decode(ids[left:k])) - skip
                after = at + len(self.decode(ids[left : k + 1])) - skip
                self._hidden.append((before, after))
                left, at, skip = k, after, after - before
        self._prefix, self._read = self._read, end
        self._taken += len(text) - len(context)
        return text[len(context) :]

    def _visible(self, text: str) -> str:
        """``text``, the next characters of the text released, without the hidden markers' spans."""
        start, self._released = self._released, self._released + len(text)
        if not self._hidden:
            return text
        out, at = [], start
        while self._hidden and self._hidden[0][0] < self._released:
            a, b = self._hidden[0]
            out.append(text[at - start : max(a, at) - start])
            at = max(at, min(b, self._released))
            if b > self._released:
                break  # the rest of the span is released later
            self._hidden.popleft()
        out.append(text[at - start :])
        return "".join(out)

    def _emit(self, new: str, final: bool) -> str:
        if self.stopped or not (new or final):
            return ""
        # finish releases a trailing U+FFFD (an incomplete last character) as text, but no stop
        # string may end in it: the engine matches complete characters only (stop_strings.complete_text)
        kept = complete_text(new) if final else new
        new, tail = kept, new[len(kept) :]
        ends = [(e, m.stop) for m in self.matchers if (e := m.feed(new)) >= 0]  # each one's first end in new
        if ends:
            if self.include_stop:  # after the first stop string to complete (the longest of those ending there)
                end, self.stop_string = min(ends, key=lambda h: (h[0], -len(h[1])))
                cut = self.held_chars + end
            else:  # before the earliest-starting stop string (it may begin in the held text)
                start, self.stop_string = min((e - len(stop), stop) for e, stop in ends)
                cut = self.held_chars + start
            self.stopped = True
            return ("".join(self._held) + new)[:cut]
        if new or tail:
            self._held.append(new + tail)
            self.held_chars += len(new + tail)
        hold = 0 if final or self.include_stop else max((m.matched for m in self.matchers), default=0)
        return self._release(self.held_chars - hold)

    def _release(self, n: int) -> str:
        """The first ``n`` held characters (taken off the held pieces)."""
        out = []
        while n > 0:
            piece = self._held.popleft()
            if len(piece) > n:
                self._held.appendleft(piece[n:])
                piece = piece[:n]
            out.append(piece)
            n -= len(piece)
            self.held_chars -= len(piece)
        return "".join(out)


@dataclass
class ChatPrompt:
    """A chat request turned into ids: the prompt ids (generation prompt and any forced tool-call
    opening included), the thinking mode, the forced text the parser sees first, whether tool
    calls are parsed, the tools whose schemas type the arguments, whether only the first call
    is returned (``parallel_tool_calls=false``), ``call_end``: the text that closes a forced
    call (:func:`forced_call_end`), where generation stops, or None, and whether ``tool_choice``
    named a function (its answer's finish reason is "stop": :func:`_finish_reason`)."""

    ids: list[int]
    thinking_mode: str | None
    forced: str
    parse_tools: bool
    tools: list[dict] | None
    first_call_only: bool = False
    call_end: str | None = None
    named: bool = False


def chat_prompt(served: ServedModel, req: ChatCompletionRequest) -> ChatPrompt:
    """Render and tokenize a chat request; 400 naming the field for messages the template refuses,
    an unknown named tool or a prompt that fills the context."""
    mode = thinking_mode_of(served.template_kwargs(req.chat_template_kwargs))
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    choice = req.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    if choice != "none" and not tools:
        raise APIError(400, f"tool_choice={_choice_text(choice)} needs `tools`", "tool_choice")
    opening, continuations = "", []
    if choice == "required" or not isinstance(choice, str):
        opening = (THINK_CLOSE if mode == "enabled" else "") + TOOL_CALL_OPEN + "\n" + NS + '<invoke name="'
        names = [t["function"]["name"] for t in tools]
        if not isinstance(choice, str) or len(names) == 1:  # "required" with one tool: that tool
            name = names[0] if isinstance(choice, str) else choice.function.name
            if name not in names:
                raise APIError(400, f"tool_choice names function {name!r}, which is not in `tools`", "tool_choice")
            opening += name + '">'
            continuations = [NS]
        else:
            continuations = [n + '">' + NS for n in names]
    messages = [m.model_dump(exclude_none=True) for m in req.messages]
    try:
        text = render(served.chat_template, messages, tools, add_generation_prompt=True, thinking_mode=mode)
    except ValueError as exc:
        raise APIError(400, f"messages: {exc}", "messages") from exc
    except Exception as exc:  # noqa: BLE001 - jinja's raise_exception and template errors
        raise APIError(400, f"messages: the chat template cannot render them: {exc}", "messages") from exc
    forced = token_safe_opening(served, text, opening, continuations) if opening else ""
    ids = served.encode(text + forced)
    check_prompt_length(served, len(ids), "messages")
    first_only = not req.parallel_tool_calls
    call_end = forced_call_end(forced, first_only)
    named = not isinstance(choice, str)
    return ChatPrompt(ids, mode, forced, choice != "none", tools, first_only, call_end, named)


def forced_call_end(forced: str, first_call_only: bool) -> str | None:
    """Where the answer to a forced ``tool_choice`` is complete: the first NS``</invoke>`` with
    ``parallel_tool_calls=false`` (only the first call is returned), else the block's
    NS``</tool_call>``; nothing the model writes after it is returned (text after the block and
    later calls are dropped, spec §5.4). Generation stops there (an engine stop string the text
    keeps: :meth:`OpenAIServing.prepare_chat`), so a model that writes on past its call does not
    run to ``max_tokens`` and end a finished call with "length". None when ``forced`` (the opening
    written into the prompt, :func:`token_safe_opening`) does not hold the block's opener: only
    then does the output start inside the block, where the first such closer is the call's.

    NOTE: generation then ends at the closer itself, without the end-of-message token a model
    writes after a block; OpenAI and vLLM end a forced call where its grammar completes."""
    if TOOL_CALL_OPEN not in forced:
        return None
    return NS + ("</invoke>" if first_call_only else "</tool_call>")


def token_safe_opening(served: ServedModel, text: str, opening: str, continuations: list[str]) -> str:
    """The longest prefix of a forced tool-call ``opening`` that, written after the prompt ``text``,
    tokenizes as the whole call does: encode(text + prefix) is a token prefix of encode(text +
    opening + c) for every continuation ``c`` (each tool's name and the rest of its invoke tag, or
    what follows a named one). The full opening can end inside a BPE merge (``name="`` is merged
    with the tool name, ``invoke`` with what follows it), and a model given those split tokens,
    which it never saw in training, closes the name at once and writes no call; from the safe
    prefix on it writes the rest itself. Only the last 256 characters of ``text`` are encoded
    (merges do not reach further back). Returns "" when no prefix is safe."""
    ctx = text[-256:]
    fulls = [served.encode(ctx + opening + c) for c in continuations]
    for end in range(len(opening), -1, -1):
        ids = served.encode(ctx + opening[:end])
        if all(f[: len(ids)] == ids for f in fulls):
            return opening[:end]
    return ""


def _choice_text(choice) -> str:
    return choice if isinstance(choice, str) else json.dumps(choice.model_dump())


def _logprob_entry(served: ServedModel, tid: int, lp: float, top: list[tuple[int, float]] | None) -> dict:
    """One chat ``logprobs.content`` item; ``top_logprobs`` is always a list, [] when none were asked
    for (OpenAI's schema types it as a required array). ``token`` is the token decoded alone (U+FFFD
    for part of a multi-byte character, as vLLM sends it); ``bytes`` are the token's raw bytes
    (:meth:`ServedModel.token_bytes`), so the items' bytes join into the UTF-8 of the text."""
    return {
        "token": served.decode([tid]),
        "logprob": lp,
        "bytes": list(served.token_bytes(tid)),
        "top_logprobs": [
            {"token": served.decode([i]), "logprob": v, "bytes": list(served.token_bytes(i))} for i, v in top or ()
        ],
    }


PROMPT_LOGPROB_FLOOR = -9999.0  # a prompt token's -inf logprob in JSON (which has no -inf), as vLLM sends it


def sampled_first(tid: int, lp: float, top: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """One position's completions ``top_logprobs`` as vLLM lists them: the position's own token
    (the sampled one; under ``echo`` the prompt's) with its logprob first, then the top ``k``
    without it, so k + 1 entries when the token is not among the top k, k when it is (OpenAI's
    completions spec: "up to logprobs + 1"). Chat's ``top_logprobs`` stay the top k, as OpenAI's
    (vLLM's chat lists the first k of these: the token first, so the k-th most likely is dropped
    when the token is not among them)."""
    return [(tid, lp)] + [(i, v) for i, v in top if i != tid]


def stale_note(stale: list[tuple[int, int, int | None]], served: int) -> str:
    """The text naming generated tokens whose top_logprobs are empty because the weights were
    written since they were sampled (:meth:`OpenAIServing.score_sample`): ``stale`` holds (token
    index, its weight version, its weight-write stamp: -1 for a token sampled on KV computed
    partly under earlier weights, None for a backend that stamps none); ``served``: the version
    held when the top logprobs ran."""
    idx = [i for i, _, _ in stale]
    where = f"index {idx[0]}" if len(idx) == 1 else f"indices {idx[0]}..{idx[-1]}"
    mixed = [i for i, _, w in stale if w == -1]
    written = [v for _, v, w in stale if w != -1]
    reasons = []
    if written:
        who = "they" if not mixed else f"{len(written)} of them"
        reasons.append(
            f"{who} were sampled with weight version(s) {', '.join(map(str, sorted(set(written))))}, and the server "
            f"held version(s) {served} when it computed top_logprobs, with weights written since (a weight update "
            "landed while or after the request ran; one re-sent with replace=True keeps the version number)"
        )
    if mixed:
        who = "they" if not written else f"{len(mixed)} of them"
        reasons.append(
            f"{who} were sampled on a KV cache computed partly with weights written over since (the request went "
            "on across a weight update without recomputing its KV: weight_sync.recompute_kv_after_update)"
        )
    return (
        f"top_logprobs are empty for {len(idx)} token(s) ({where}): {'; '.join(reasons)}; their logprob fields "
        "are the sampler's and exact"
    )


def prompt_stale_note(version: int, served: int, what: str) -> str:
    """The text for a sample whose prompt logprobs are left out (``what`` says how) because the
    weights were written since its prompt was run (:meth:`OpenAIServing.score_sample`)."""
    return (
        f"{what}: the sample's prompt was run with weight version {version}, and the server held version {served} "
        "when it scored the prompt, with weights written since (a weight update landed while or after the request "
        "ran; one re-sent with replace=True keeps the version number); scores from the weights served now would be "
        "another model's"
    )


def prefill_prompt_rows(out: SampleOutput) -> tuple[list | None, str | None]:
    """(rows of positions 1.., None): the prompt scores the engine's prefill computed for ``out``
    (``SampleOutput.prompt_logprobs`` [P]); or (None, why they are left out): the prefill ran across
    a weight write (its entries' ``prompt_weight_writes`` differ, or are -1: on KV computed partly
    with weights written over since), so they are no one model's, or the sample was aborted before
    its prompt was scored whole. Scores of the weights that prefilled the prompt are kept whatever
    was written since (as the sampler's logprobs are)."""
    w = out.prompt_weight_writes
    if len(out.prompt_logprobs) < len(out.prompt_ids):
        return None, "the sample was aborted before its prompt's prefill ended"
    if w and (w[0] == -1 or any(x != w[0] for x in w)):
        return None, (
            "the sample's prompt was prefilled across a weight update (its positions were scored under "
            "different weights, or on KV computed partly with weights written over since), so its scores "
            "are no one model's"
        )
    return out.prompt_logprobs[1:], None


@dataclass
class SampleScores:
    """What the scoring forward (or the engine's prefill, for the prompt) gives one sample
    (:meth:`OpenAIServing.score_sample`).

    Attributes:
        tops: per generated token from ``start`` on, its top-``k`` (token id, logprob), most likely
            first; [] for a token not sampled with the weights served now; None when ``k`` is 0.
        prompt: per prompt token from the second on, ``score.PositionLogprobs`` (its own logprob
            and rank, its top list); None when not asked or when ``prompt_stale``.
        prompt_stale: the prompt logprobs were asked but the sample's prompt ran with weights
            written over since (so they are left out); ``prompt_why`` says why when the engine's
            prefill scored them (:func:`prefill_prompt_rows`).
        stale: (index, version, weight-write stamp or None) of the generated tokens whose ``tops`` are [].
        version: the weight version served when the forward ran (None: no forward ran).
        prompt_version: the weight version the sample's first token (so its prompt) was run with.
    """

    tops: list[list[tuple[int, float]]] | None
    prompt: list | None = None
    prompt_stale: bool = False
    stale: list[tuple[int, int, int | None]] = field(default_factory=list)
    version: int | None = None
    prompt_version: int | None = None
    prompt_why: str | None = None

    def note(self, prompt_what: str = "") -> str | None:
        """The choice's note naming what is left out and why (None: nothing is); ``prompt_what``
        says how the left-out prompt logprobs show."""
        parts = []
        if self.stale:
            parts.append(stale_note(self.stale, self.version))
        if self.prompt_stale and self.prompt_why:
            parts.append(f"{prompt_what}: {self.prompt_why}")
        elif self.prompt_stale:
            parts.append(prompt_stale_note(self.prompt_version, self.version, prompt_what))
        return "; ".join(parts) or None


def vllm_prompt_logprobs(served: ServedModel, prompt: list[int], rows: list | None, k: int) -> list[dict | None]:
    """A sample's prompt logprobs in vLLM's ``prompt_logprobs`` shape: one entry per prompt token,
    the first None (nothing predicts it), then {token id as a string: {"logprob", "rank",
    "decoded_token"}} holding the prompt token itself (its rank by logit, 1-based, the floor
    ``PROMPT_LOGPROB_FLOOR`` for a logprob the top-k / top-p filters made -inf) and the top ``k``
    (ranks 1..k). ``rows``: the ``PositionLogprobs`` of positions 1.. (the prefill's,
    :func:`prefill_prompt_rows`, or the scoring forward's, :meth:`OpenAIServing.prompt_scores`), or
    None when they are left out: then every entry after the first is an empty dict."""
    out: list[dict | None] = [None]
    if rows is None:
        return out + [{} for _ in prompt[1:]]
    for t, row in zip(prompt[1:], rows):
        entry = {str(t): {"logprob": max(row.logprob, PROMPT_LOGPROB_FLOOR), "rank": row.rank, "decoded_token": None}}
        for rank, (i, v) in enumerate(row.top[:k], 1):
            entry.setdefault(str(i), {"logprob": v, "rank": rank, "decoded_token": None})
        for tid, d in entry.items():
            d["decoded_token"] = served.decode([int(tid)])
        out.append(entry)
    return out


class StreamScores:
    """The top logprobs of a streamed answer's chunks, for both stream routes (chat completions and
    completions): per sample, the weight versions and weight-write stamps of the tokens streamed so
    far, so that each delta's tokens are scored in one forward over the prompt and the sample
    before them, under the stale-weights guard of :meth:`OpenAIServing.score_sample` (a token
    whose stamp is not the count the forward ran with gets an empty top list, and the chunk a
    note).

    Args:
        score: :meth:`OpenAIServing.score_sample` of the serving object.
        prompt: the request's prompt ids. params: its sampling parameters (the distribution).
        k: top tokens per position (0: none, no forward). n: samples of the request.
    """

    def __init__(self, score: Callable, prompt: list[int], params: SamplingParams, k: int, n: int):
        self.score, self.prompt, self.params, self.k = score, prompt, params, k
        self.versions: list[list[int]] = [[] for _ in range(n)]  # per sample, one per token streamed so far
        self.writes: list[list[int]] = [[] for _ in range(n)]  # their weight-write stamps

    async def delta(self, item: StreamDelta, ids: list[int]) -> SampleScores:
        """The scores of ``item``'s tokens, the last ``len(item.token_ids)`` of ``ids`` (every token
        its sample has generated so far). Raises what ``score_sample`` raises (APIError)."""
        i = item.sample_index
        self.versions[i] += item.weight_versions
        self.writes[i] += item.weight_writes
        if self.k and item.top_logprobs is not None:  # the sampler's lists: no forward, nothing stale
            return SampleScores([row[: self.k] for row in item.top_logprobs])
        start = len(ids) - len(item.token_ids)  # this delta's first token
        return await self.score(self.prompt, ids, start, self.k, self.params, self.versions[i], self.writes[i])


def prompt_is_stale(out_ids: list[int], writes: list[int], served_writes: int) -> bool:
    """Whether a sample's prompt ran with weights other than those of ``served_writes`` (the
    weight-write count): its first generated token's stamp (``token_weight_writes[0]``: sampled
    from the prompt's last logits, -1 when part of the prompt's KV came from earlier weights)
    differs. A sample with no token has nothing to disagree with (False)."""
    return bool(out_ids) and (not writes or writes[0] != served_writes)


def completion_id(reqs: list[GenerationRequest]) -> str:
    """The ``id`` of a /v1/completions response (and of each of its chunks) for the engine
    requests ``OpenAIServing.prepare_completion`` built: the request's own ``cmpl-...`` id, one
    per response as OpenAI's and vLLM's. With several prompts each engine request carries it with
    a ``-{j}`` suffix (prompt j): those ids are internal (the engine's, the runner's)."""
    rid = reqs[0].request_id
    return rid if len(reqs) == 1 else rid.rsplit("-", 1)[0]


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _delta_dict(d: OutputDelta) -> dict:
    out: dict = {}
    if d.reasoning:
        out["reasoning_content"] = d.reasoning
    if d.content:
        out["content"] = d.content
    if d.tool_calls:
        out["tool_calls"] = [c.to_openai() for c in d.tool_calls]
    return out


def _merge(a: OutputDelta, b: OutputDelta) -> OutputDelta:
    return OutputDelta(
        reasoning=(a.reasoning or "") + (b.reasoning or "") or None,
        content=(a.content or "") + (b.content or "") or None,
        tool_calls=a.tool_calls + b.tool_calls,
    )


def tool_call_id_prefix(response_id: str, sample_index: int) -> str:
    """The prefix of the tool-call ids of one choice: ``call_<hex>_<sample_index>_``, ``<hex>`` the
    response id's uuid4 hex (``chatcmpl-<hex>``); a call's id is the prefix and its index, e.g.
    ``call_9f..e1_0_1`` for the second call of choice 0.

    Unique across requests, as OpenAI's and vLLM's random ids (agent frameworks key tool results
    by id over a whole conversation, so two turns' calls must not share one), and across the
    choices of one response. Derived from the response id rather than drawn per call so that the
    same call always gets the same id: a stream's delta and the final message agree, a call the
    parser sends again (a re-split content, see ``StreamingOutputParser``) keeps its id, and a
    logged response's ids can be recomputed. Only letters, digits and ``_`` (ids some APIs
    downstream accept)."""
    return f"call_{response_id.removeprefix('chatcmpl-')}_{sample_index}_"


class _TurnParser:
    """Parser of one chat sample: reasoning + tool calls, or reasoning only (tool_choice "none").
    With ``first_call_only`` (``parallel_tool_calls=false``) calls after the first are dropped, in
    the stream's deltas and in the message alike, and so is a later call the output cut off (its
    text would otherwise come back as content, see :meth:`_returned_cut`). ``id_prefix``: the
    choice's tool-call id prefix (:func:`tool_call_id_prefix`).

    A forced opening (``ChatPrompt.forced``) is fed first: it is the prompt's text, not the model's,
    so it never comes back as content: a forced call the output cut off returns only what the model
    wrote of it (nothing, ``content`` null, when it stopped right after the opening)."""

    def __init__(self, prompt: ChatPrompt, id_prefix: str):
        self.full = (
            StreamingOutputParser(prompt.thinking_mode, prompt.tools, id_prefix=id_prefix)
            if prompt.parse_tools
            else None
        )
        self.reasoning = None if prompt.parse_tools else StreamingReasoningParser(prompt.thinking_mode)
        self.first_call_only = prompt.first_call_only
        # the forced opening as the tool parser sees it: enabled mode's think closer is reasoning's
        self._forced_block = prompt.forced.removeprefix(THINK_CLOSE)
        self.first = self.feed(prompt.forced) if prompt.forced else OutputDelta()

    def _calls(self, d: OutputDelta) -> OutputDelta:
        if self.first_call_only and d.tool_calls:
            d.tool_calls = [c for c in d.tool_calls if c.index == 0]
        return d

    def _returned_cut(self) -> str:
        """What of the text of a call the output cut off (``cut_text``, the end of the content)
        comes back: all of it, except a later call with ``first_call_only`` (dropped like a closed
        one: nothing) and the forced opening of a cut forced call (only what follows it)."""
        cut = self.full.cut_text
        calls = self.full.result().tool_calls
        if self.first_call_only and calls:
            return ""
        if self._forced_block and not calls and cut.startswith(self._forced_block):
            return cut[len(self._forced_block) :]
        return cut

    def _with_returned_cut(self, content: str | None) -> str | None:
        """``content`` (ending with ``cut_text``) with the cut call's text as :meth:`_returned_cut` says."""
        cut = self.full.cut_text
        if not cut or content is None:
            return content
        assert content.endswith(cut), "a cut call's text ends the content"
        return content[: len(content) - len(cut)] + self._returned_cut() or None

    def feed(self, text: str) -> OutputDelta:
        if self.full is not None:
            return self._calls(self.full.feed(text))
        d = self.reasoning.feed(text)
        return OutputDelta(reasoning=d.reasoning, content=d.content)

    def finish(self) -> OutputDelta:
        if self.full is not None:
            d = self._calls(self.full.finish())  # a cut call's text comes only here, ending the content
            d.content = self._with_returned_cut(d.content)
            return d
        d = self.reasoning.finish()
        return OutputDelta(reasoning=d.reasoning, content=d.content)

    def message(self) -> dict:
        if self.full is not None:
            msg = self.full.result().to_message()
            msg["content"] = self._with_returned_cut(msg["content"])
            if self.first_call_only and msg.get("tool_calls"):
                msg["tool_calls"] = msg["tool_calls"][:1]
            return msg
        reasoning, content = self.reasoning.result()
        msg: dict = {"role": "assistant", "content": content}
        if reasoning is not None:
            msg["reasoning_content"] = reasoning
        return msg


def _finish_reason(out: SampleOutput, has_calls: bool, named: bool) -> str:
    """The choice's ``finish_reason``: the engine's, but "tool_calls" for an answer that ended
    ("stop") with calls, except when ``tool_choice`` named the function (``named``): "stop" then,
    as OpenAI answers a named choice and vLLM copies it ("required" and "auto" say "tool_calls")."""
    if out.finish_reason == "stop" and has_calls and not named:
        return "tool_calls"
    return out.finish_reason


class OpenAIServing:
    """Chat completions and completions for one served model; ``runner`` is the
    :class:`Controller` (admission, pause, abort) in front of the engine runner."""

    def __init__(self, served: ServedModel, runner: Controller):
        self.served, self.runner = served, runner

    def check_model(self, name: str) -> None:
        if name != self.served.name:
            raise APIError(
                404,
                f"The model `{name}` does not exist; this server serves `{self.served.name}` (see /v1/models).",
                "model",
                code="model_not_found",
            )

    @staticmethod
    def _chat_fields(req: ChatCompletionRequest) -> dict[str, str]:
        return {**CHAT_FIELDS, "max_new_tokens": "max_completion_tokens" if req.max_completion_tokens else "max_tokens"}

    def _text_stream(
        self,
        params: SamplingParams,
        include_stop: bool = False,
        call_end: str | None = None,
        skip_special_tokens: bool = True,
    ) -> TextStream:
        """The text of one sample. ``include_stop``: the request's ``include_stop_str_in_output``;
        ``call_end`` (:attr:`ChatPrompt.call_end`) is a stop string of the engine's alone: the text
        keeps it, and it is no ``stop_reason``. With ``ignore_eos`` the end-of-message token ends
        nothing (unless the request's own stop ids name it), and its marker is left out of the text
        as vLLM's ``skip_special_tokens`` (default true) leaves it out; false keeps it. The other
        markers are kept either way (the chat parsers read them); ids and logprobs keep every token."""
        eom = set() if params.ignore_eos else set(self.served.stop_token_ids)
        own = set(params.stop_token_ids) - eom  # the end-of-message marker stays a null stop_reason
        stops = tuple(s for s in params.stop_strings if s != call_end)
        hidden = set(self.served.stop_token_ids) if skip_special_tokens else set()
        return TextStream(self.served.decode, eom | own, stops, own, include_stop, hidden)

    async def forward_scores(
        self, ids: list[int], start: int, k: int, params: SamplingParams, with_tokens: bool, param: str
    ) -> tuple[list, int, int]:
        """One engine-loop forward over ``ids`` (``runner.top_logprobs``): positions ``start ..``,
        their top ``k`` (``with_tokens``: as ``score.PositionLogprobs``, with each position's own
        token's logprob and rank), in the distribution the request's sampled logprobs come from:
        the model's (``logprobs_mode`` "raw"), or the processed one sampled from (temperature,
        top-k, top-p; a greedy request: the model's own). Returns (rows, weight version, weight-write
        count the forward ran with).
        Raises APIError naming ``param``: 501 for a backend without a model, 503 when the engine or
        the EP group refuses the forward after the sample was generated (its message says why)."""
        try:
            return await self.runner.top_logprobs(ids, start, k, *params.logprob_filters(), with_tokens)
        except NotImplementedError as exc:
            raise APIError(501, str(exc), param) from exc
        except (ValueError, RuntimeError) as exc:  # the engine / EP group refused after generating
            # (e.g. weights lost to a rejected update, workers asleep): the request was valid
            raise APIError(
                503, f"{param} could not be computed: {exc}; retry the request", param, "server_error"
            ) from exc

    async def score_sample(
        self,
        prompt: list[int],
        out_ids: list[int],
        start: int,
        k: int,
        params: SamplingParams,
        versions: list[int],
        writes: list[int],
        prompt_k: int | None = None,
        sampled: list | None = None,
        prompt_scored: tuple | None = None,
        prefill: SampleOutput | None = None,
    ) -> SampleScores:
        """The top-``k`` logprobs of a sample's generated tokens ``start ..`` and, with ``prompt_k``
        (not None), its prompt tokens' logprobs (each one's own, its rank, its top ``prompt_k``):
        one engine-loop forward (:meth:`forward_scores`) over the prompt and the generated tokens,
        none when there is nothing to score (``k`` 0 without the prompt: ``tops`` None; no
        generated token from ``start`` on: ``tops`` []).

        The forward runs with the weights served now, and only scores of those very weights are
        returned (the stale-weights guard): a generated token whose weight-write stamp
        (``writes``: the sample's ``token_weight_writes``) differs from the forward's count (the
        weights were written since it was sampled, also by an update that kept the version
        number, or it was sampled on KV partly from earlier weights) gets an empty top list, and
        the prompt's logprobs are left out (``prompt_stale``) when the sample's first token's stamp
        differs (:func:`prompt_is_stale`); ``versions`` (the per-token versions) name them in the
        note. Raises what :meth:`forward_scores` raises.

        ``sampled``: the sample's own top lists from the sampler (``SampleOutput.top_logprobs``,
        computed when each token was sampled, under the weights that sampled it): when given,
        ``tops`` come from them, no forward runs for them and the guard has nothing to empty;
        the forward then runs over the prompt alone, and only when ``prompt_k`` asks for it.

        ``prompt_scored``: the request's :meth:`prompt_scores` with top >= ``prompt_k``, which the
        caller shares among the scores of its samples (and its ``prompt_logprobs``): when the
        prompt alone is to be scored (``sampled`` lists, or no generated token to score), its rows
        serve instead of a forward of this sample's own.

        ``prefill``: the sample's output; when it carries the prefill's prompt logprobs
        (``SampleOutput.prompt_logprobs``) they serve ``prompt_k`` under :func:`prefill_prompt_rows`'
        guard, with no forward for the prompt."""
        if prompt_k is not None and prefill is not None and prefill.prompt_logprobs is not None:
            scores = await self.score_sample(prompt, out_ids, start, k, params, versions, writes, None, sampled)
            scores.prompt, scores.prompt_why = prefill_prompt_rows(prefill)
            scores.prompt_stale = scores.prompt is None
            return scores
        want_tops = bool(k) and start < len(out_ids)
        no_tops = None if not k else []
        use_sampled = bool(k) and sampled is not None
        if use_sampled or (prompt_k is not None and not want_tops):  # nothing to score but the prompt
            tops = [row[:k] for row in sampled[start:]] if use_sampled else no_tops
            if prompt_k is None:
                return SampleScores(tops)
            if len(prompt) < 2:
                return SampleScores(tops, prompt=[])
            if prompt_scored is None:
                prompt_scored = await self.forward_scores(prompt, 1, prompt_k, params, True, "logprobs")
            rows, version, served = prompt_scored
            scores = SampleScores(tops, prompt=rows, version=version)
            if prompt_is_stale(out_ids, writes, served):
                scores.prompt, scores.prompt_stale = None, True
                scores.prompt_version = versions[0] if versions else version
            return scores
        if prompt_k is None:
            if not want_tops:
                return SampleScores(no_tops)
            tops, version, served = await self.forward_scores(
                prompt + out_ids, len(prompt) + start, k, params, False, "top_logprobs"
            )
            scores = SampleScores(tops, version=version)
        else:  # one forward for both: the prompt and the generated tokens
            ids = prompt + out_ids
            rows, version, served = await self.forward_scores(ids, 1, max(k, prompt_k), params, True, "logprobs")
            cut = len(prompt) - 1  # rows[i] is position i + 1: the prompt's positions come first
            tops = [r.top[:k] for r in rows[cut + start :]]
            scores = SampleScores(tops, prompt=rows[:cut], version=version)
            if prompt_is_stale(out_ids, writes, served):
                scores.prompt, scores.prompt_stale = None, True
                scores.prompt_version = versions[0] if versions else version
        for i in range(len(scores.tops or ())):
            j = start + i
            stamp = writes[j] if j < len(writes) else None
            if stamp != served:  # sampled with other weights (None: a backend that does not stamp writes)
                scores.tops[i] = []
                scores.stale.append((j, versions[j] if j < len(versions) else version, stamp))
        return scores

    async def prompt_scores(
        self,
        prompt: list[int],
        k: int,
        params: SamplingParams,
        param: str = "sampling_params.prompt_logprobs",
        outs: list[SampleOutput] | None = None,
    ) -> tuple:
        """A request's ``prompt_logprobs`` (``/generate``'s ``sampling_params.prompt_logprobs``, the
        OpenAI routes' ``prompt_logprobs``) for the samples ``outs`` that carry no prefill scores
        (``SampleOutput.prompt_logprobs``; a backend that computes none), the part they share: one
        forward over ``prompt`` (:meth:`forward_scores`, ``with_tokens``, top ``k``). Returns (rows
        of positions 1.., weight version, weight-write count), or (None, None, None) for a one-token
        prompt or when every sample of ``outs`` carries its own (no forward). ``outs`` None: no
        sample (a prompt scored alone). Raises APIError naming ``param`` as :meth:`forward_scores`."""
        if len(prompt) < 2 or (outs is not None and all(o.prompt_logprobs is not None for o in outs)):
            return None, None, None
        return await self.forward_scores(prompt, 1, k, params, True, param)

    def sample_prompt_logprobs(
        self, prompt: list[int], scored: tuple, out: SampleOutput | None, k: int
    ) -> tuple[list[dict | None], str | None]:
        """One sample's ``prompt_logprobs`` (vLLM's shape, :func:`vllm_prompt_logprobs`) and its
        ``prompt_logprobs_note`` or None: the engine's prefill scores when ``out`` carries them
        (guarded by :func:`prefill_prompt_rows`), else the request's :meth:`prompt_scores`, guarded
        as :meth:`score_sample` guards, so a sample whose prompt ran with weights written over since
        (:func:`prompt_is_stale`) gets empty entries and the note instead of another model's.
        ``out`` None: no sample (a prompt scored alone, completions ``max_tokens=0``), nothing to
        disagree with."""
        if out is not None and out.prompt_logprobs is not None:
            rows, why = prefill_prompt_rows(out)
            note = None if why is None else f"prompt_logprobs holds empty entries: {why}"
            return vllm_prompt_logprobs(self.served, prompt, rows, k), note
        rows, version, served = scored
        if rows is not None and out is not None and prompt_is_stale(out.output_ids, out.token_weight_writes, served):
            v = out.token_weight_versions[0] if out.token_weight_versions else version
            note = prompt_stale_note(v, version, "prompt_logprobs holds empty entries")
            return vllm_prompt_logprobs(self.served, prompt, None, k), note
        return vllm_prompt_logprobs(self.served, prompt, rows or [], k), None

    def request_prompt_logprobs(
        self, prompt: list[int], scored: tuple, outs: list[SampleOutput], k: int
    ) -> tuple[list[dict | None], str | None]:
        """The ``prompt_logprobs`` of a response that carries one list for all its samples (chat
        completions, vLLM's response-level field) and its note or None: the first sample's scores
        (:meth:`sample_prompt_logprobs`) only when every sample's are kept, else empty entries and
        the first left-out sample's note."""
        for out in outs:
            entries, note = self.sample_prompt_logprobs(prompt, scored, out, k)
            if note:
                return entries, note
        return self.sample_prompt_logprobs(prompt, scored, outs[0] if outs else None, k)

    # ---- chat ----------------------------------------------------------------------------------
    def prepare_chat(self, req: ChatCompletionRequest) -> tuple[ChatPrompt, GenerationRequest]:
        """Validate and build the engine request (400 / 404 on bad input). A forced call's
        ``call_end`` joins the engine's stop strings (generation ends where the call closes); when
        the request's ``stop`` already names it, it is the request's, cutting the text as any stop."""
        self.check_model(req.model)
        if req.top_logprobs and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", "top_logprobs")
        check_prompt_logprobs(req.prompt_logprobs, "prompt_logprobs", req.stream)
        prompt = chat_prompt(self.served, req)
        params = sampling_params(self.served, req, len(prompt.ids), req.max_completion_tokens or req.max_tokens)
        if prompt.call_end in params.stop_strings:
            prompt = dataclasses.replace(prompt, call_end=None)
        elif prompt.call_end is not None:
            params = dataclasses.replace(params, stop_strings=params.stop_strings + (prompt.call_end,))
        return prompt, GenerationRequest(f"chatcmpl-{uuid.uuid4().hex}", prompt.ids, params)

    async def chat(self, req: ChatCompletionRequest, prompt: ChatPrompt, greq: GenerationRequest) -> dict:
        """Non-streamed chat completion (OpenAI ``chat.completion`` object). With vLLM's
        ``prompt_logprobs=k`` the response (not each choice: the samples share the prompt, as in
        vLLM) carries ``prompt_logprobs`` in vLLM's shape (:func:`vllm_prompt_logprobs`) for the
        rendered prompt's ids (the generation prompt and any forced tool-call opening included),
        from the engine's prefill (or, from a backend without them, one forward after the samples
        are generated: :meth:`prompt_scores`), guarded as :meth:`request_prompt_logprobs` says
        (empty entries and a ``prompt_logprobs_note`` when a sample's are left out). A streamed request takes only
        ``prompt_logprobs=0`` and sends none, as vLLM (:func:`check_prompt_logprobs`)."""
        outs: list[SampleOutput] = []
        async for item in self.runner.stream(greq, stream=False):
            if isinstance(item, SampleOutput):
                outs.append(item)
        outs.sort(key=lambda o: o.sample_index)
        choices = []
        for out in outs:
            if out.finish_reason == FINISH_ERROR:
                raise engine_error(out.error, self._chat_fields(req))
            text = self._text_stream(
                greq.params, req.include_stop_str_in_output, prompt.call_end, req.skip_special_tokens
            )
            parser = _TurnParser(prompt, tool_call_id_prefix(greq.request_id, out.sample_index))
            parser.feed(text.push(out.output_ids))
            parser.feed(text.finish())
            parser.finish()
            message = parser.message()
            choice = {
                "index": out.sample_index,
                "message": message,
                "logprobs": None,
                "finish_reason": _finish_reason(out, bool(message.get("tool_calls")), prompt.named),
                "stop_reason": text.stop_reason,
            }
            if req.logprobs:
                k = req.top_logprobs or 0
                scores = await self.score_sample(
                    prompt.ids,
                    out.output_ids,
                    0,
                    k,
                    greq.params,
                    out.token_weight_versions,
                    out.token_weight_writes,
                    sampled=out.top_logprobs,
                )
                tops = scores.tops
                choice["logprobs"] = {
                    "content": [
                        _logprob_entry(self.served, t, lp, tops[i] if tops else None)
                        for i, (t, lp) in enumerate(zip(out.output_ids, out.logprobs))
                    ]
                }
                if scores.stale:
                    choice["top_logprobs_note"] = scores.note()
            if req.return_token_ids:
                choice["token_ids"] = out.output_ids
                choice["token_weight_versions"] = out.token_weight_versions
            choices.append(choice)
        body = {
            "id": greq.request_id,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.served.name,
            "choices": choices,
            "usage": self._usage(len(prompt.ids), outs),
            "weight_version": max((o.weight_version for o in outs), default=self.runner.weight_version),
        }
        if req.prompt_logprobs is not None:
            scored = await self.prompt_scores(prompt.ids, req.prompt_logprobs, greq.params, "prompt_logprobs", outs)
            body["prompt_logprobs"], note = self.request_prompt_logprobs(prompt.ids, scored, outs, req.prompt_logprobs)
            if note:
                body["prompt_logprobs_note"] = note
        if req.return_token_ids:
            body["prompt_token_ids"] = prompt.ids
        return body

    @staticmethod
    def _usage(prompt_len: int, outs: list[SampleOutput]) -> dict:
        completion = sum(len(o.output_ids) for o in outs)
        return {"prompt_tokens": prompt_len, "completion_tokens": completion, "total_tokens": prompt_len + completion}

    async def chat_stream(
        self, req: ChatCompletionRequest, prompt: ChatPrompt, greq: GenerationRequest
    ) -> AsyncIterator[str]:
        """SSE chunks of a streamed chat completion (``chat.completion.chunk``), then ``[DONE]``.

        Per choice: a first chunk with the role, deltas carrying ``reasoning_content``, ``content``
        and ``tool_calls`` (each call whole, id, name and arguments, when it closes; a call the
        generation cut off comes as ``content``), a last chunk with ``finish_reason``; with
        ``stream_options.include_usage`` a final chunk with empty choices and the usage.
        ``return_token_ids``: each chunk's choice carries the ids it adds (``token_ids``) and their
        weight versions; the first one the ``prompt_token_ids``.
        """
        created = int(time.time())
        base = {"id": greq.request_id, "object": "chat.completion.chunk", "created": created, "model": self.served.name}
        n = greq.params.n
        texts = [
            self._text_stream(greq.params, req.include_stop_str_in_output, prompt.call_end, req.skip_special_tokens)
            for _ in range(n)
        ]
        parsers = [_TurnParser(prompt, tool_call_id_prefix(greq.request_id, i)) for i in range(n)]
        has_calls = [False] * n
        outs: list[SampleOutput] = []
        scorer = StreamScores(self.score_sample, prompt.ids, greq.params, req.top_logprobs or 0, n)

        def chunk(i: int, delta: dict, finish: str | None = None, extra: dict | None = None) -> str:
            choice = {"index": i, "delta": delta, "logprobs": None, "finish_reason": finish, **(extra or {})}
            return _sse({**base, "choices": [choice]})

        for i in range(n):
            first = {"role": "assistant", "content": ""}
            extra = {"prompt_token_ids": prompt.ids} if req.return_token_ids and i == 0 else None
            yield chunk(i, {**first, **_delta_dict(parsers[i].first)}, extra=extra)
            has_calls[i] |= bool(parsers[i].first.tool_calls)
        try:
            async for item in self.runner.stream(greq, stream=True):
                if isinstance(item, StreamDelta):
                    i = item.sample_index
                    d = parsers[i].feed(texts[i].push(item.token_ids))
                    has_calls[i] |= bool(d.tool_calls)
                    extra = {}
                    if req.logprobs:
                        scores = await scorer.delta(item, texts[i].ids)
                        tops = scores.tops
                        extra["logprobs"] = {
                            "content": [
                                _logprob_entry(self.served, t, lp, tops[j] if tops else None)
                                for j, (t, lp) in enumerate(zip(item.token_ids, item.logprobs))
                            ]
                        }
                        if scores.stale:
                            extra["top_logprobs_note"] = scores.note()
                    if req.return_token_ids:
                        extra["token_ids"] = item.token_ids
                        extra["token_weight_versions"] = item.weight_versions
                    delta = _delta_dict(d)
                    if delta or extra:
                        yield chunk(i, delta, extra=extra)
                elif isinstance(item, SampleOutput):
                    if item.finish_reason == FINISH_ERROR:
                        raise engine_error(item.error, self._chat_fields(req))
                    i = item.sample_index
                    outs.append(item)
                    d = _merge(parsers[i].feed(texts[i].finish()), parsers[i].finish())
                    has_calls[i] |= bool(d.tool_calls)
                    yield chunk(
                        i,
                        _delta_dict(d),
                        _finish_reason(item, has_calls[i], prompt.named),
                        {"stop_reason": texts[i].stop_reason},
                    )
        except APIError as exc:
            yield _sse(exc.body())
        except Exception as exc:  # noqa: BLE001 - the stream has begun: the error is its last event
            yield _sse(APIError(500, f"generation failed: {exc}", None, type="server_error").body())
        if req.stream_options is not None and req.stream_options.include_usage:
            yield _sse({**base, "choices": [], "usage": self._usage(len(prompt.ids), outs)})
        yield "data: [DONE]\n\n"

    # ---- completions ---------------------------------------------------------------------------
    def prepare_completion(self, req: CompletionRequest) -> list[GenerationRequest]:
        """One engine request per prompt (a string, token ids, or a list of either); 400 naming the
        field for what this route cannot answer (see :meth:`completion`)."""
        self.check_model(req.model)
        check_prompt_logprobs(req.prompt_logprobs, "prompt_logprobs", req.stream)
        if req.stream and req.echo and req.logprobs is not None:
            raise APIError(
                400,
                "stream: echo with logprobs (the prompt tokens' logprobs) is answered whole, not streamed; send "
                "stream=false",
                "stream",
            )
        if req.max_tokens == 0:
            if not req.echo:
                raise APIError(
                    400,
                    "max_tokens=0 generates nothing: send echo=true (with logprobs=k to score the prompt) or "
                    "max_tokens >= 1",
                    "max_tokens",
                )
            if req.stream:
                raise APIError(
                    400, "stream: max_tokens=0 (the prompt alone) is answered whole; send stream=false", "stream"
                )
        p = req.prompt
        if isinstance(p, str) or (isinstance(p, list) and p and isinstance(p[0], int)):
            prompts = [p]
        else:
            prompts = list(p)
        if not prompts:
            raise APIError(400, "prompt: empty list", "prompt")
        reqs = []
        rid = f"cmpl-{uuid.uuid4().hex}"
        for j, q in enumerate(prompts):
            ids = self.served.encode(q) if isinstance(q, str) else list(q)
            check_token_ids(self.served, ids, "prompt")
            if req.max_tokens == 0:  # scored, not continued: it may fill the context
                if len(ids) > self.served.max_model_len:
                    raise APIError(
                        400,
                        f"This model's maximum context length is {self.served.max_model_len} tokens; the prompt has "
                        f"{len(ids)} tokens. Shorten the prompt.",
                        "prompt",
                        code="context_length_exceeded",
                    )
                params = sampling_params(self.served, req, len(ids) - 1, 1)  # the sampling fields, checked
            else:
                check_prompt_length(self.served, len(ids), "prompt")
                params = sampling_params(self.served, req, len(ids), req.max_tokens or 16)
            # one engine request per prompt; the response's id stays rid (completion_id)
            reqs.append(GenerationRequest(rid if len(prompts) == 1 else f"{rid}-{j}", ids, params))
        return reqs

    def _completion_logprobs(self, ids: list[int], token_logprobs: list, rows: list, offset: int = 0) -> dict:
        """OpenAI completions ``logprobs`` of the tokens ``ids`` whose text starts at character
        ``offset`` of the choice's text: each token's text, its logprob (None where unknown), its
        top list as {text: logprob} from ``rows`` (per token, None: no list, the first prompt
        token's; else (token id, logprob) pairs as :func:`sampled_first` orders them; a text that
        two ids decode to keeps the first one's logprob), and its text offset (the characters
        before it, token texts summed)."""
        toks = [self.served.decode([t]) for t in ids]
        offsets, pos = [], offset
        for t in toks:
            offsets.append(pos)
            pos += len(t)
        tops = []
        for row in rows:
            if row is None:
                tops.append(None)
                continue
            top: dict[str, float] = {}
            for i, v in row:
                top.setdefault(self.served.decode([i]), v)
            tops.append(top)
        return {"tokens": toks, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}

    @staticmethod
    def _sampled_rows(ids: list[int], lps: list[float], scores: SampleScores, start: int = 0) -> list[list]:
        """The completions top rows of generated tokens ``ids`` (the sample's tokens ``start ..``,
        sampler logprobs ``lps``): each token with its sampler logprob first, then its top ``k``
        from ``scores.tops`` (:func:`sampled_first`; k 0: the token alone); [] for a token the
        stale-weights guard left out (``scores.stale``), whose top list would be another model's."""
        stale = {j for j, _, _ in scores.stale}
        tops = scores.tops
        return [
            [] if start + i in stale else sampled_first(t, lp, tops[i] if tops else [])
            for i, (t, lp) in enumerate(zip(ids, lps))
        ]

    def _echo_logprobs(self, prompt: list[int], scores: SampleScores, k: int, out: SampleOutput | None) -> dict:
        """The completions ``logprobs`` of an echoed choice: the prompt tokens first (the first one's
        logprob and top list None, as vLLM and OpenAI send it; a prompt token the top-k / top-p
        filters removed at ``PROMPT_LOGPROB_FLOOR``; each top list the prompt token and its top
        ``k``, :func:`sampled_first`; all None with empty top lists when the prompt ran with weights
        written over since, ``scores.prompt_stale``), then the generated tokens of ``out`` (None:
        max_tokens 0) with the sampler's logprobs and their rows (:meth:`_sampled_rows`)."""
        rows = scores.prompt
        if rows is None:  # stale: another model's scores are not returned
            lps, prompt_rows = [None] * (len(prompt) - 1), [[] for _ in prompt[1:]]
        else:
            lps = [max(r.logprob, PROMPT_LOGPROB_FLOOR) for r in rows]
            prompt_rows = [sampled_first(t, lp, r.top[:k]) for t, lp, r in zip(prompt[1:], lps, rows)]
        out_ids, out_lps = (out.output_ids, out.logprobs) if out is not None else ([], [])
        out_rows = self._sampled_rows(out_ids, out_lps, scores)
        rows = [None] + prompt_rows + out_rows
        return self._completion_logprobs(prompt + out_ids, [None] + lps + list(out_lps), rows)

    async def completion(self, req: CompletionRequest, reqs: list[GenerationRequest]) -> dict:
        """Non-streamed completion (OpenAI ``text_completion`` object); choice index = prompt
        index * n + sample index.

        ``echo`` puts the prompt's text before each choice's; with ``logprobs=k`` the prompt
        tokens' logprobs come first in its ``logprobs`` (:meth:`_echo_logprobs`), the engine's
        prefill's (from a backend without them, the scoring forward, under the weights the sample's
        prompt ran with or not at all; ``top_logprobs_note`` says why). Each top list holds the
        position's own token first, then the top k (:func:`sampled_first`, as vLLM). vLLM's
        ``prompt_logprobs=p`` gives each choice a ``prompt_logprobs`` list in vLLM's shape
        (:func:`vllm_prompt_logprobs`), the engine's prefill's too, guarded per choice
        (:meth:`sample_prompt_logprobs`: empty entries and a ``prompt_logprobs_note``). From a backend
        whose outputs carry no prefill scores, the prompt is scored once, by one forward shared by its
        ``n`` choices' echo and ``prompt_logprobs`` (:meth:`prompt_scores`, top max(k, p)); one whose
        outputs carry no sampler top lists either has each echoed choice's prompt scored with its
        generated tokens (:meth:`score_sample`). ``max_tokens=0`` (with ``echo``) generates nothing:
        each of the ``n`` choices is the prompt, finish reason "length", its logprobs and prompt
        logprobs scored once under the weights served now, once the request is admitted
        (``Controller.admitted``: it waits while the server is paused, as a generation does; one
        ``/abort`` ended there runs no forward and is answered as any request aborted there,
        ``engine.requests.aborted_outputs``: finish reason "abort", the prompt's logprobs null with
        empty top lists, empty ``prompt_logprobs`` entries, and the notes)."""
        choices, all_outs, prompt_tokens = [], [], 0
        k, plp = req.logprobs, req.prompt_logprobs
        echo_k = k if req.echo else None  # the top k of the prompt tokens' echoed logprobs
        shared_k = max(echo_k or 0, plp or 0)  # the top k of the prompt's one scoring forward
        shared_param = "prompt_logprobs" if plp is not None else "logprobs"

        async def run(greq: GenerationRequest) -> list[SampleOutput]:
            if req.max_tokens == 0:
                return []
            return [o async for o in self.runner.stream(greq, stream=False) if isinstance(o, SampleOutput)]

        per_prompt = await asyncio.gather(*(run(g) for g in reqs))
        for p, (greq, outs) in enumerate(zip(reqs, per_prompt)):
            prompt_ids = list(greq.prompt_ids)
            prompt_tokens += len(prompt_ids)
            prefix = self.served.decode(prompt_ids) if req.echo else ""
            if req.max_tokens == 0:
                scored = prompt_scored = None
                admitted = True
                if k is not None or plp is not None:  # a forward for the client: admitted as a generation is
                    async with self.runner.admitted(greq.request_id) as admitted:
                        shared = (
                            await self.prompt_scores(prompt_ids, shared_k, greq.params, shared_param)
                            if admitted
                            else None
                        )
                    if admitted and k is not None:  # the prompt's rows of that forward: no forward of its own
                        scored = await self.score_sample(prompt_ids, [], 0, k, greq.params, [], [], k, None, shared)
                    if admitted and plp is not None:
                        prompt_scored = shared
                if admitted:
                    for i in range(greq.params.n):
                        choice = {"index": p * greq.params.n + i, "text": prefix, "logprobs": None}
                        choice.update(finish_reason="length", stop_reason=None)
                        if scored is not None:
                            choice["logprobs"] = self._echo_logprobs(prompt_ids, scored, k, None)
                        if prompt_scored is not None:
                            choice["prompt_logprobs"], _ = self.sample_prompt_logprobs(
                                prompt_ids, prompt_scored, None, plp
                            )
                        if req.return_token_ids:
                            choice.update(prompt_token_ids=prompt_ids, token_ids=[], token_weight_versions=[])
                        choices.append(choice)
                    continue
                # /abort ended it at the gate: answered below as a request aborted there (no forward)
                outs = aborted_outputs(greq, self.runner.weight_version)
            prompt_scored = None  # the prompt's scores, shared by its choices (once none is an error)
            for out in sorted(outs, key=lambda o: o.sample_index):
                if out.finish_reason == FINISH_ERROR:
                    raise engine_error(out.error, COMPLETION_FIELDS)
                # echo scores the prompt alone when the sampler listed the generated tokens' tops (or none are asked)
                echo_alone = echo_k is not None and (not echo_k or out.top_logprobs is not None)
                if prompt_scored is None and out.prompt_logprobs is None and (plp is not None or echo_alone):
                    prompt_scored = await self.prompt_scores(prompt_ids, shared_k, greq.params, shared_param)
                ts = self._text_stream(greq.params, req.include_stop_str_in_output, None, req.skip_special_tokens)
                text = ts.push(out.output_ids) + ts.finish()
                choice = {
                    "index": p * greq.params.n + out.sample_index,
                    "text": prefix + text,
                    "logprobs": None,
                    "finish_reason": out.finish_reason,
                    "stop_reason": ts.stop_reason,
                }
                if k is not None:
                    scores = await self.score_sample(
                        prompt_ids,
                        out.output_ids,
                        0,
                        k,
                        greq.params,
                        out.token_weight_versions,
                        out.token_weight_writes,
                        echo_k,
                        sampled=out.top_logprobs,
                        prompt_scored=prompt_scored,
                        prefill=out,
                    )
                    if req.echo:
                        choice["logprobs"] = self._echo_logprobs(prompt_ids, scores, k, out)
                    else:
                        rows = self._sampled_rows(out.output_ids, out.logprobs, scores)
                        choice["logprobs"] = self._completion_logprobs(out.output_ids, out.logprobs, rows, len(prefix))
                    note = scores.note("the prompt tokens' logprobs are null and their top_logprobs empty")
                    if note:
                        choice["top_logprobs_note"] = note
                if plp is not None:
                    choice["prompt_logprobs"], note = self.sample_prompt_logprobs(prompt_ids, prompt_scored, out, plp)
                    if note:
                        choice["prompt_logprobs_note"] = note
                if req.return_token_ids:
                    choice["prompt_token_ids"] = prompt_ids
                    choice["token_ids"] = out.output_ids
                    choice["token_weight_versions"] = out.token_weight_versions
                choices.append(choice)
                all_outs.append(out)
        completion = sum(len(o.output_ids) for o in all_outs)
        return {
            "id": completion_id(reqs),
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.served.name,
            "choices": choices,
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion,
                "total_tokens": prompt_tokens + completion,
            },
        }

    async def completion_stream(self, req: CompletionRequest, reqs: list[GenerationRequest]) -> AsyncIterator[str]:
        """SSE chunks of a streamed completion, prompts one after another, then ``[DONE]``.

        With ``logprobs=k`` each chunk that carries generated tokens carries their ``logprobs``
        (vLLM's way): ``tokens``, ``token_logprobs`` (the sampler's), ``top_logprobs`` (each token
        first, then its top k: :func:`sampled_first`) and ``text_offset`` (into the choice's whole
        text, as the non-streamed answer counts it), so the chunks' lists concatenate to the
        non-streamed answer's of the same seed. The top lists are the sampler's, carried by each
        delta (:class:`StreamScores`; a backend whose deltas carry none: one forward per chunk over
        the sample so far, guarded as the non-streamed ones: a token of weights written over since
        gets an empty list, its chunk a ``top_logprobs_note``). A chunk's tokens may run ahead of
        its text (text held back for a stop string or an incomplete character comes later).
        ``return_token_ids``: each choice's first chunk carries its ``prompt_token_ids``, each
        chunk its ``token_ids`` and their ``token_weight_versions``, as the non-streamed choice.
        ``prompt_logprobs``: only 0 gets here, and the chunks carry none, as vLLM's
        (:func:`check_prompt_logprobs`)."""
        created = int(time.time())
        outs: list[SampleOutput] = []
        prompt_tokens = 0
        k = req.logprobs
        for p, greq in enumerate(reqs):
            n = greq.params.n
            texts = [
                self._text_stream(greq.params, req.include_stop_str_in_output, None, req.skip_special_tokens)
                for _ in range(n)
            ]
            prompt_tokens += len(greq.prompt_ids)
            prefix = self.served.decode(list(greq.prompt_ids)) if req.echo else ""
            scorer = StreamScores(self.score_sample, list(greq.prompt_ids), greq.params, k or 0, n)
            offsets = [len(prefix)] * n  # per sample, the text offset of its next token
            unsent = [req.return_token_ids] * n  # the choice's prompt_token_ids still to send (first chunk)

            def chunk(i: int, text: str, finish: str | None = None, extra: dict | None = None) -> str:
                c = {"index": p * n + i, "text": text, "logprobs": None, "finish_reason": finish, **(extra or {})}
                if unsent[i]:
                    c["prompt_token_ids"], unsent[i] = list(greq.prompt_ids), False
                return _sse(
                    {
                        "id": completion_id(reqs),
                        "object": "text_completion",
                        "created": created,
                        "model": self.served.name,
                        "choices": [c],
                    }
                )

            if req.echo:
                for i in range(n):
                    yield chunk(i, prefix)
            try:
                async for item in self.runner.stream(greq, stream=True):
                    if isinstance(item, StreamDelta):
                        i = item.sample_index
                        text = texts[i].push(item.token_ids)
                        extra = {}
                        if req.return_token_ids:
                            extra.update(token_ids=item.token_ids, token_weight_versions=item.weight_versions)
                        if k is not None:
                            scores = await scorer.delta(item, texts[i].ids)
                            start = len(texts[i].ids) - len(item.token_ids)
                            rows = self._sampled_rows(item.token_ids, item.logprobs, scores, start)
                            lp = self._completion_logprobs(item.token_ids, item.logprobs, rows, offsets[i])
                            if lp["tokens"]:
                                offsets[i] = lp["text_offset"][-1] + len(lp["tokens"][-1])
                            extra["logprobs"] = lp
                            if scores.stale:
                                extra["top_logprobs_note"] = scores.note()
                        if text or extra:
                            yield chunk(i, text, extra=extra)
                    elif isinstance(item, SampleOutput):
                        if item.finish_reason == FINISH_ERROR:
                            raise engine_error(item.error, COMPLETION_FIELDS)
                        ts = texts[item.sample_index]
                        text = ts.finish()
                        outs.append(item)
                        yield chunk(item.sample_index, text, item.finish_reason, {"stop_reason": ts.stop_reason})
            except APIError as exc:
                yield _sse(exc.body())
                break
            except Exception as exc:  # noqa: BLE001 - the stream has begun: the error is its last event
                yield _sse(APIError(500, f"generation failed: {exc}", None, type="server_error").body())
                break
        if req.stream_options is not None and req.stream_options.include_usage:
            completion = sum(len(o.output_ids) for o in outs)
            usage = {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion,
                "total_tokens": prompt_tokens + completion,
            }
            yield _sse(
                {
                    "id": completion_id(reqs),
                    "object": "text_completion",
                    "created": created,
                    "model": self.served.name,
                    "choices": [],
                    "usage": usage,
                }
            )
        yield "data: [DONE]\n\n"

"""Request bodies of every endpoint (pydantic, strict types) and the OpenAI-shaped error.

Governing idea: a request is validated completely before anything reaches the engine, and every
rejection names the field (``error.param``) the way the OpenAI API does:
``{"error": {"message", "type", "param", "code"}}``. Types are strict (``"2"`` is not an integer,
``true`` is not a number); fields the server does not know are ignored, as vLLM and SGLang do, so
clients may send vendor extras, except vLLM's fields that change what vLLM returns and that this
server does not serve (:data:`UNSERVED_FIELDS`): those are refused (400 naming the field) unless at
vLLM's default; a null for an OpenAI field typed "X or null" is its default.
"""

from __future__ import annotations

import json
import secrets
import types
from collections.abc import Callable
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, field_validator

from m3_rollout.config import MAX_WEIGHT_SYNC_TIMEOUT_S
from m3_rollout.engine.interface import MAX_TOP_LOGPROBS  # noqa: F401  (the engine's cap, as the OpenAI API)

MAX_N = 128  # samples per request


GENERATION_FAILED = "generation_failed"  # the code of a 503 for an engine error about the server's state
# the code of /update_weights' 400 when the server is not in the trainer's weight-sync group (none
# joined, or its EP group restarted since): call /init_weight_sync, then send the update again
WEIGHT_SYNC_NOT_JOINED = "weight_sync_not_joined"
# the code of /update_weights' 400 when the server's ranks received the update to its end and
# refused it (its weights and version unchanged for an atomic update)
WEIGHT_UPDATE_REJECTED = "weight_update_rejected"

#: Each ``SamplingParams`` field ``/generate`` takes -> its key in ``sampling_params``
#: (:class:`GenerateSamplingParams`): what the remote client sends (``client.request_body``) and
#: how an engine error about a field names the client's one (``openai_api.GENERATE_FIELDS``).
GENERATE_SAMPLING_KEYS: dict[str, str] = {
    "n": "n",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "max_new_tokens": "max_new_tokens",
    "stop_token_ids": "stop_token_ids",
    "seed": "seed",
    "logprobs_mode": "logprobs_mode",
    "stop_strings": "stop",
    "top_logprobs": "top_logprobs",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "repetition_penalty": "repetition_penalty",
    "logit_bias": "logit_bias",
    "prompt_logprobs": "prompt_logprobs",
    "ignore_eos": "ignore_eos",
}


class APIError(Exception):
    """An error answered as ``{"error": {...}}`` with HTTP ``status``.

    Args:
        status: HTTP status (400 bad request, 401 auth, 404 unknown model, 409 conflict, 501 unsupported,
            503 the server cannot serve it now).
        message: what is wrong and what to do.
        param: the request field at fault (dotted path), or None.
        type: OpenAI error type ("invalid_request_error", "authentication_error", ...).
        code: OpenAI error code ("model_not_found", "invalid_api_key", ...), or None.
    """

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        type: str = "invalid_request_error",
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _members(ann) -> tuple:
    """The members of a union annotation other than None (``(ann,)`` for any other)."""
    if get_origin(ann) in (Union, types.UnionType):
        return tuple(a for a in get_args(ann) if a is not type(None))
    return (ann,)


def _annotation_at(model: type[BaseModel], path) -> Any:
    """The annotation of the value at ``path`` (field names, list indices, dict keys) in a request
    body of ``model``, an optional one's None dropped; None where the path leaves the schema."""
    ann: Any = model
    for part in path:
        ann = m[0] if len(m := _members(ann)) == 1 else ann
        # NOTE: get_origin first: on Python 3.10 list[X] is an instance of type, and issubclass
        # raises TypeError on it
        if get_origin(ann) is None and isinstance(ann, type) and issubclass(ann, BaseModel) and isinstance(part, str):
            if part not in ann.model_fields:
                return None
            ann = ann.model_fields[part].annotation
        elif get_origin(ann) is list and isinstance(part, int):
            ann = get_args(ann)[0]
        elif get_origin(ann) is dict and isinstance(part, str):
            ann = get_args(ann)[1]
        else:
            return None
    return m[0] if len(m := _members(ann)) == 1 else ann


def union_error(errors: list[dict], model: type[BaseModel] | None) -> tuple[str, str] | None:
    """(param, message) for a request field of ``model`` (the route's body) whose value matched no
    member of its union type, or None when the first of ``errors`` (pydantic's
    ``ValidationError.errors()``, ``body`` dropped from the locs) is not about one. Pydantic
    reports one error per member, each loc holding the member's tag (``prompt.str``,
    ``prompt.list[int].0``), so the first alone named a member as the field (``param``
    "stop.str") and one member's complaint as the fault (a list of floats as ``prompt``: "should
    be a valid string"). The message lists every member's complaint under the field's own path."""
    if model is None:
        return None
    loc0 = errors[0]["loc"]
    i = next((i for i in range(len(loc0)) if len(_members(_annotation_at(model, loc0[:i]))) > 1), None)
    if i is None:
        return None
    alts: dict[str, dict] = {}
    for e in errors:
        if len(e["loc"]) > i and list(e["loc"][:i]) == list(loc0[:i]):
            alts.setdefault(str(e["loc"][i]), e)
    param = ".".join(map(str, loc0[:i]))
    whole = next((e["input"] for e in alts.values() if len(e["loc"]) == i + 1 and "input" in e), None)
    got = "" if whole is None else f" (got {json.dumps(whole, default=str)[:100]})"
    parts = [
        tag + (f" at {'.'.join(map(str, e['loc'][i + 1 :]))}" if len(e["loc"]) > i + 1 else "") + f": {e['msg']}"
        for tag, e in alts.items()
    ]
    return param, f"{param}: matches none of its accepted types{got}: " + "; ".join(parts)


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


# ---- OpenAI chat -------------------------------------------------------------------------------
class FunctionDef(_Body):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(_Body):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatMessage(BaseModel):
    """One message; extra keys (``name``, ``tool_call_id``) pass through to the template."""

    model_config = ConfigDict(strict=True, extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    reasoning_content: str | None = None

    @field_validator("content")
    @classmethod
    def _parts_have_a_type(cls, content):
        # a text part's text must be a string: the template would write a null as "None" and a
        # number as its digits into the prompt (OpenAI's and vLLM's schemas refuse both)
        for i, part in enumerate(content if isinstance(content, list) else []):
            if not isinstance(part.get("type"), str):
                raise ValueError(f'content part {i} has no "type" (send {{"type": "text", "text": "..."}})')
            if part["type"] == "text" and not isinstance(part.get("text"), str):
                got = json.dumps(part.get("text"), default=str)[:40]
                raise ValueError(f'content part {i}: a text part\'s "text" must be a string (got {got})')
        return content


class StreamOptions(_Body):
    include_usage: bool = False


def _null_is_default(cls, value, info):
    """A JSON null for a field the OpenAI API types "X or null" means its default, as OpenAI and
    vLLM take it (clients that send every parameter send null for those they leave unset)."""
    return cls.model_fields[info.field_name].default if value is None else value


def _null(value, n: int) -> bool:
    return value is None


def _zero(value, n: int) -> bool:
    return value is None or (type(value) in (int, float) and value == 0)


def _false(value, n: int) -> bool:
    return value is None or value is False


def _true(value, n: int) -> bool:
    return value is None or value is True


def _empty(value, n: int) -> bool:
    return value is None or value == []


def _best_of_n(value, n: int) -> bool:
    return value is None or (type(value) is int and value == n)


#: vLLM request fields that change what vLLM returns and that this server does not serve: name ->
#: (whether a value, given the request's ``n``, is vLLM's default; that default, as the error says
#: it, ``{n}`` the request's; what vLLM does with the field). A default value passes (clients that send every field send
#: it); any other is refused with a 400 naming the field (:func:`check_unserved_fields`), as the
#: answer would silently differ from the one asked for. Fields that change nothing here pass
#: unread (``spaces_between_special_tokens``, ``priority``, ...; ``skip_special_tokens`` is served:
#: :class:`SamplingFields`).
UNSERVED_FIELDS: dict[str, tuple[Callable[[Any, int], bool], str, str]] = {
    "min_tokens": (_zero, "0", "a minimum output length"),
    "min_p": (_zero, "0 or null", "min-p filtering"),
    "bad_words": (_empty, "[] or null", "banned words"),
    "allowed_token_ids": (_null, "null", "a token allow-list"),
    "truncate_prompt_tokens": (_null, "null", "prompt truncation"),
    "guided_json": (_null, "null", "guided decoding"),
    "guided_regex": (_null, "null", "guided decoding"),
    "guided_choice": (_null, "null", "guided decoding"),
    "guided_grammar": (_null, "null", "guided decoding"),
    "structural_tag": (_null, "null", "guided decoding"),
    "structured_outputs": (_null, "null", "guided decoding"),
    "logits_processors": (_null, "null", "custom logits processors"),
    "use_beam_search": (_false, "false", "beam search"),
    "best_of": (_best_of_n, "null or n={n}", "best-of-n selection"),
    "return_tokens_as_token_ids": (_false, "false or null", "'token_id:N' logprob tokens"),
}
#: The same for /v1/chat/completions alone (on /v1/completions vLLM has no such field, or this
#: server serves it: ``echo``).
UNSERVED_CHAT_FIELDS: dict[str, tuple[Callable[[Any, int], bool], str, str]] = {
    "echo": (_false, "false", "echoing the last message"),
    "add_generation_prompt": (_true, "true", "a prompt without the generation prompt"),
    "continue_final_message": (_false, "false", "continuing the last message"),
    "chat_template": (_null, "null", "a request's own chat template"),
}


class SamplingFields(_Body):
    """Sampling fields shared by the OpenAI endpoints (OpenAI names; ``top_k`` / ``stop_token_ids``
    / ``logprobs_mode`` / ``return_token_ids`` / ``include_stop_str_in_output`` / ``ignore_eos`` as
    vLLM names its extensions). Fields not declared are kept (``model_extra``) only so that
    :func:`check_unserved_fields` sees them."""

    model_config = ConfigDict(strict=True, extra="allow")

    model: str
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0.0, le=100.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = None
    max_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's semantics (engine SamplingParams): presence / frequency over the generated tokens,
    # repetition (vLLM's extension) over prompt + generated ones; logit_bias: token id (a string) ->
    # bias, clamped to [-100, 100] as vLLM does (openai_api.logit_bias_pairs)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0, allow_inf_nan=False)
    logit_bias: dict[str, float] | None = None
    # named so that it is refused (400), not ignored: it changes what the client gets back
    response_format: dict[str, Any] | None = None
    logprobs_mode: Literal["processed", "raw"] = "processed"
    return_token_ids: bool = False
    user: str | None = None
    # vLLM's sampling extension: the prompt tokens' logprobs in vLLM's shape (completions: on each
    # choice; chat: on the response); checked in openai_api.check_prompt_logprobs (0 .. MAX_TOP_LOGPROBS,
    # streamed: 0 only, as vLLM)
    prompt_logprobs: int | None = None
    # vLLM's: a choice that a stop string ended keeps it at the end of its text (streamed alike;
    # openai_api.TextStream). The engine's ids hold its tokens either way (/generate returns ids)
    include_stop_str_in_output: bool = False
    # vLLM's: the end-of-message token does not end a sample (SamplingParams.ignore_eos), which
    # runs to max_tokens unless stop / stop_token_ids end it; its ids and logprobs keep such tokens
    ignore_eos: bool = False
    # vLLM's: true (its default) leaves the end-of-message marker an ignore_eos sample writes out of
    # the text (chat content, completion text, streamed alike); false keeps it. The other markers
    # stay either way: the chat parsers read them (openai_api.OpenAIServing._text_stream)
    skip_special_tokens: bool = True

    _nullable = field_validator("n", "stream", "skip_special_tokens", mode="before")(classmethod(_null_is_default))


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    parallel_tool_calls: bool = True

    _nullable_chat = field_validator("logprobs", "parallel_tool_calls", mode="before")(classmethod(_null_is_default))


class CompletionRequest(SamplingFields):
    """``echo`` with ``logprobs=k`` returns the prompt tokens' logprobs before the generated ones
    (the first prompt token's null); ``max_tokens=0`` (with ``echo``) scores the prompt alone."""

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False

    _nullable_echo = field_validator("echo", mode="before")(classmethod(_null_is_default))
    max_tokens: int | None = Field(None, ge=0)


def check_unserved_fields(req: SamplingFields) -> None:
    """Refuse a vLLM field this server does not serve (:data:`UNSERVED_FIELDS`, for chat also
    :data:`UNSERVED_CHAT_FIELDS`) sent at other than its default.

    Raises:
        APIError: 400 naming the field, its value and the default that passes.
    """
    table = {**UNSERVED_FIELDS, **(UNSERVED_CHAT_FIELDS if isinstance(req, ChatCompletionRequest) else {})}
    for name, value in (req.model_extra or {}).items():
        if name in table and not table[name][0](value, req.n):
            _, default, what = table[name]
            got = json.dumps(value, default=str)[:80]
            raise APIError(
                400,
                f"{name}={got}: not supported by this server ({what}); "
                f"leave it out or send its default ({default.format(n=req.n)})",
                name,
            )


def request_seed(seed: int | None) -> int:
    """The sampler seed of a request: its own, or (None, the default of every route) a fresh random
    62-bit seed, as vLLM does, so unseeded requests do not repeat each other."""
    return secrets.randbits(62) if seed is None else seed


# ---- RL extensions -----------------------------------------------------------------------------
class GenerateSamplingParams(_Body):
    """SGLang's ``sampling_params`` of ``/generate`` (``max_new_tokens``, ``stop``, ...). Unknown keys
    are refused (400 naming the key): a misspelled or OpenAI-named field (``max_tokens``) would
    otherwise be ignored silently."""

    model_config = ConfigDict(strict=True, extra="forbid")

    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = -1
    max_new_tokens: int = Field(64, ge=1)
    stop_token_ids: list[int] = Field(default_factory=list)
    stop: list[str] = Field(default_factory=list)
    # None (the default): a fresh random seed per request, as vLLM and the OpenAI routes here do, so
    # unseeded calls do not repeat each other. Give a seed for reproducible tokens: the same seed,
    # input ids, sample_index and weights give the same tokens (the sampler is keyed by them).
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)
    logprobs_mode: Literal["processed", "raw"] = "processed"
    # SGLang's / vLLM's penalties and logit_bias, as the OpenAI routes take them (SamplingFields)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, allow_inf_nan=False)
    logit_bias: dict[str, float] | None = None
    # vLLM's prompt_logprobs: each sample's output carries, per prompt token, its logprob, its rank
    # and the top k (null: off); checked in app.py (0 .. MAX_TOP_LOGPROBS)
    prompt_logprobs: int | None = None
    # the sampler's top k per generated token (engine SamplingParams.top_logprobs; 0: none): each
    # output (and streamed event) carries top_logprobs, per token [[token id, logprob], ...]. Named
    # as the engine field (and OpenAI chat's count), beside prompt_logprobs: the sampled tokens'
    # logprobs always come back, so SGLang's top-level return_logprob switch has nothing to switch,
    # and vLLM's name for it, logprobs, is the output field of those
    top_logprobs: int = Field(0, ge=0, le=MAX_TOP_LOGPROBS)
    # SGLang's / vLLM's ignore_eos: the end-of-message token does not end a sample
    # (SamplingParams.ignore_eos); stop_token_ids / stop still do
    ignore_eos: bool = False


class GenerateRequest(_Body):
    """Token-in/token-out generation: input ids + sampling params -> output ids, per-token
    logprobs, finish reason, per-token weight versions (and routed experts, block selections on request)."""

    input_ids: list[int] = Field(min_length=1)
    sampling_params: GenerateSamplingParams = Field(default_factory=GenerateSamplingParams)
    sample_index: int = 0
    rid: str | None = None
    stream: bool = False
    return_routed_experts: bool = False
    # Block-selection record (server started with --record-block-selection): each output carries
    # the indices of its segments in the response's block_selection_segments (base64 of coded
    # segments, m3_rollout/model/selection_record.py), for positions block_selection_from on.
    return_block_selection: bool = False
    block_selection_from: int = Field(0, ge=0)


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    tools: list[Tool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = False


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]


# ---- control plane -----------------------------------------------------------------------------
class InitWeightSyncRequest(_Body):
    """The trainer's weight-sync group: where rank 0 hosts its TCPStore, how many ranks, this
    server's rank, the backend ("gloo" on CPU, "nccl" on GPU)."""

    master_address: str
    master_port: int = Field(ge=1, le=65535)
    world_size: int = Field(ge=2)
    rank_offset: int = Field(1, ge=1)
    backend: Literal["gloo", "nccl"] = "gloo"
    # NOTE: bounded: the join holds the control plane for up to timeout_s (a 409 to every other
    # control call), and 1e308 s overflows the collective's timedelta
    timeout_s: float = Field(120.0, gt=0.0, le=MAX_WEIGHT_SYNC_TIMEOUT_S)
    bucket_size_mb: float = Field(512.0, gt=0.0)
    atomic: bool = True


class UpdateWeightsRequest(_Body):
    """``version``: the version the trainer sends (checked against the update's header);
    ``in_flight``: what running requests do (continue with later tokens on the new version,
    drain them first, or abort them)."""

    version: int | None = None
    in_flight: Literal["continue", "drain", "abort"] = "continue"


class PauseRequest(_Body):
    """``abort``: running requests end now (reason "abort"); ``drain``: they finish first;
    ``keep``: they stay in the engine, frozen, and continue at /resume. New requests wait."""

    mode: Literal["abort", "drain", "keep"] = "keep"


class AbortRequest(_Body):
    rid: str | None = None
    abort_all: bool = False

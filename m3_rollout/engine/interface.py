"""The generation contract the RL loop sees (design.md §3): requests in, sampled tokens out.

Governing idea: the GRPO loop knows nothing about caches or batching. It submits
:class:`GenerationRequest` records (token ids in, token ids + logprobs out: "token-in,
token-out", never re-tokenised text) to a :class:`GenerationBackend` and pushes new weights
through ``update_weights`` using the released checkpoint names, the same wire naming the
NCCL weight-sync path uses.
"""

from __future__ import annotations

import abc
import math
import numbers
import operator
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import torch

# NOTE (temperature floor): the sampler divides the logits by the temperature in its compute
# dtype (fp32; fp64 for an fp64 model). A trained model's logits stay far below MAX_ABS_LOGIT, so
# a temperature >= MAX_ABS_LOGIT / finfo(dtype).max keeps logits / temperature finite; a smaller
# one can overflow to inf, and inf - inf makes the step's logprobs NaN (and the sampled id padding).
MAX_ABS_LOGIT = 2.0**20
#: Samples one request may ask for (``SamplingParams.n``): a GRPO group is tens; the bound keeps a
#: typo from allocating one output record per sample.
MAX_SAMPLES_PER_REQUEST = 2**16
MAX_TOP_LOGPROBS = 20  # SamplingParams.top_logprobs cap (as the OpenAI API; the server's cap)


def min_temperature(dtype: torch.dtype) -> float:
    """Smallest temperature the sampler can divide logits of magnitude <= ``MAX_ABS_LOGIT`` by in
    ``dtype`` without overflow (fp32: ~3.1e-33, fp64: ~5.8e-303)."""
    return MAX_ABS_LOGIT / torch.finfo(dtype).max


def as_int(value) -> int:
    """``value`` as a plain int: Python / numpy integers and 0-d integer tensors.

    Raises TypeError for bools (True is not a count or a token id), floats (never truncated),
    strings and anything else.
    """
    if isinstance(value, bool) or (isinstance(value, torch.Tensor) and value.dtype == torch.bool):
        raise TypeError(f"{value!r} is a bool, not an integer")
    return operator.index(value)


def int_or_none(value) -> int | None:
    """``as_int(value)``, or None where it raises TypeError (for checks that word their own error)."""
    try:
        return as_int(value)
    except TypeError:
        return None


def _int_field(name: str, value, low: int, why: str = "") -> int:
    """``value`` as an int in [low, 2**63) (the sampler packs int64) or ValueError naming
    ``SamplingParams.<name>``."""
    v = int_or_none(value)
    if v is None or not low <= v < 2**63:
        bound = "in [-2**63, 2**63)" if low == -(2**63) else f">= {low} and < 2**63"
        raise ValueError(f"SamplingParams.{name}={value!r}: must be an integer {bound}{why}")
    return v


def _float_field(name: str, value) -> float:
    """``value`` as a finite float (ints and numpy floats accepted) or ValueError."""
    try:  # an int beyond the float range overflows in isfinite
        finite = not isinstance(value, bool) and isinstance(value, numbers.Real) and math.isfinite(value)
    except OverflowError:
        finite = False
    if not finite:
        raise ValueError(f"SamplingParams.{name}={value!r:.80}: must be a finite real number")
    return float(value)


def _tuple_field(name: str, value, what: str) -> tuple:
    if not isinstance(value, (tuple, list)):
        raise ValueError(f"SamplingParams.{name}={value!r}: must be a tuple of {what}")
    return tuple(value)


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. Training rollouts use temperature 1, no top-k / top-p.

    vLLM's conventions, for every entry point (the in-process and EP engines, ``/generate``, the
    OpenAI routes, the NeMo RL adapter): ``temperature`` 0 is greedy and ``top_k`` 0 or -1 is off.
    A greedy request takes the argmax token with the model's own log-softmax as its logprob, top
    lists and prompt logprobs alike, whatever ``logprobs_mode`` says (:meth:`validate` returns it
    as top-k 1 at temperature 1 with "raw" logprobs).

    ``seed`` and the sample index key all randomness: sample j of a request draws position p's
    token from uniforms keyed by (seed, sample_index + j, p), so reruns repeat and the n samples
    of a group differ. :meth:`validate` checks every field's type and range (the engine calls it
    once per request; a bad field fails that request alone).

    Penalties and logit biases (vLLM's semantics and order, ``sampler.process_logits``): the raw
    logits get ``logit_bias`` added, then repetition, frequency and presence penalties, then
    temperature / top-k / top-p. They change the distribution sampled from, so "processed"
    logprobs include them and "raw" ones do not; a trainer that scores the tokens without them (the
    GRPO job, whose generation config has no such fields) would not match "processed" logprobs.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 64
    stop_token_ids: tuple[int, ...] = ()
    seed: int = 0
    logprobs_mode: str = "processed"
    # Stop at the first token after which the decoded output contains one of these (needs the
    # engine's detokenize callback); the tokens that completed the string are kept.
    stop_strings: tuple[str, ...] = ()
    # The sampler lists each generated token's top-k alternatives (0 = none; at most
    # MAX_TOP_LOGPROBS) in the distribution its logprob comes from: SampleOutput.top_logprobs.
    top_logprobs: int = 0
    #: Subtracted once from the logit of every token the sample has generated so far (not the
    #: prompt's); in [-2, 2], 0 = off (OpenAI's presence_penalty).
    presence_penalty: float = 0.0
    #: Subtracted per occurrence among the sample's generated tokens; in [-2, 2], 0 = off.
    frequency_penalty: float = 0.0
    #: > 0, 1 = off: the logit of every token of the prompt or the output so far is divided by it
    #: when positive, multiplied by it otherwise (vLLM / HF repetition_penalty); one that would
    #: overflow the sampler's dtype (with the temperature) is refused (:meth:`validate`).
    repetition_penalty: float = 1.0
    #: ((token id, bias), ...): bias in [-100, 100] added to the token's raw logit; ids distinct and
    #: in the vocabulary (``engine.requests.check_request``).
    logit_bias: tuple[tuple[int, float], ...] = ()
    #: vLLM's prompt_logprobs: None = off; k in [0, MAX_TOP_LOGPROBS]: the prefill scores every
    #: prompt token (its logprob, rank and the top k, ``SampleOutput.prompt_logprobs``) in the
    #: distribution of :meth:`logprob_filters`. Such a request reads no prefix cache (as vLLM).
    prompt_logprobs: int | None = None
    #: vLLM's ignore_eos: the engine's end-of-sequence ids (``EngineConfig.eos_token_ids``, the
    #: end-of-message marker) do not end the sample, which runs on to ``max_new_tokens`` unless
    #: its own ``stop_token_ids`` or ``stop_strings`` end it; an eos it samples is an output token
    #: like any other.
    ignore_eos: bool = False

    def logprob_filters(self) -> tuple[float, int, float]:
        """(temperature, top_k, top_p) of the distribution this request's logprobs come from, as the
        prompt logprobs and the server's scoring forward take it: the processed one sampled from,
        or (1.0, -1, 1.0), the model's own, for ``logprobs_mode`` "raw" and for a greedy request
        (temperature 0, whatever its mode); top_k 0 is -1 (off). Penalties and logit biases are not
        in it (the sampler's own logprobs and top lists hold them)."""
        if self.logprobs_mode == "raw" or self.greedy:
            return (1.0, -1, 1.0)
        return (self.temperature, -1 if int_or_none(self.top_k) == 0 else self.top_k, self.top_p)

    @property
    def greedy(self) -> bool:
        """Whether this asks for greedy decoding: ``temperature`` 0 (vLLM's rule; a bool is no
        temperature, and :meth:`validate` refuses it)."""
        t = self.temperature
        return isinstance(t, numbers.Real) and not isinstance(t, bool) and t == 0

    @property
    def penalized(self) -> bool:
        """Whether any penalty or logit bias is on (the sampler then treats the row apart)."""
        return bool(
            self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1 or self.logit_bias
        )

    @property
    def num_outputs(self) -> int:
        """Output records a request with these params yields: ``n``, or 1 (its one error record)
        when ``n`` is not a valid count."""
        try:
            n = as_int(self.n)
        except TypeError:
            return 1
        return n if 1 <= n <= MAX_SAMPLES_PER_REQUEST else 1

    def validate(self, compute_dtype: torch.dtype | None = None) -> SamplingParams:
        """Check every field once; return a copy holding plain Python values (int, float, tuple).

        Integers must be integers (bools, floats and strings are not), floats finite and in range.
        ``compute_dtype``: the sampler's dtype (fp32, or fp64 for an fp64 model); when given, a
        temperature below :func:`min_temperature` of it is rejected (logits / temperature would
        overflow it), and so is a repetition penalty that would (:func:`_check_repetition_range`).
        vLLM's conventions are applied here: ``top_k`` 0 comes back as -1 (off), and
        ``temperature`` 0 (greedy) as top-k 1 at temperature 1, top-p 1, ``logprobs_mode`` "raw"
        (the class docstring), once the given values are checked.

        Raises:
            ValueError naming the field, its value and the accepted range.
        """
        n = _int_field("n", self.n, 1)
        if n > MAX_SAMPLES_PER_REQUEST:
            raise ValueError(
                f"SamplingParams.n={n}: at most {MAX_SAMPLES_PER_REQUEST} samples per request; split it into "
                "several requests"
            )
        temperature = _float_field("temperature", self.temperature)
        if temperature < 0:
            raise ValueError(f"SamplingParams.temperature={self.temperature!r}: must be >= 0 (0 = greedy)")
        if temperature > 0:
            check_temperature(self.temperature, compute_dtype)
        top_p = _float_field("top_p", self.top_p)
        if not 0 < top_p <= 1:
            raise ValueError(f"SamplingParams.top_p={self.top_p!r}: must be in (0, 1]")
        top_k = _int_field("top_k", self.top_k, -1, why=" (-1 or 0 = off)")
        top_k = -1 if top_k == 0 else top_k  # vLLM's "off" both
        max_new_tokens = _int_field("max_new_tokens", self.max_new_tokens, 1)
        stop_ids = _tuple_field("stop_token_ids", self.stop_token_ids, "integer token ids")
        for t in stop_ids:
            _int_field("stop_token_ids", t, 0, why=f" token id (in {self.stop_token_ids!r})")
        seed = _int_field("seed", self.seed, -(2**63), why=" (it keys the sampler's int64 hash)")
        if self.logprobs_mode not in ("processed", "raw"):
            raise ValueError(f"SamplingParams.logprobs_mode={self.logprobs_mode!r}: 'processed' or 'raw'")
        stop_strings = _tuple_field("stop_strings", self.stop_strings, "non-empty strings")
        if any(not isinstance(s, str) or not s for s in stop_strings):
            raise ValueError(f"SamplingParams.stop_strings={self.stop_strings!r}: must be non-empty strings")
        top_logprobs = _int_field("top_logprobs", self.top_logprobs, 0, why=" (0 = none)")
        if top_logprobs > MAX_TOP_LOGPROBS:
            raise ValueError(f"SamplingParams.top_logprobs={top_logprobs}: at most {MAX_TOP_LOGPROBS}")
        presence = _float_field("presence_penalty", self.presence_penalty)
        frequency = _float_field("frequency_penalty", self.frequency_penalty)
        for name, v in (("presence_penalty", presence), ("frequency_penalty", frequency)):
            if not -2 <= v <= 2:
                raise ValueError(f"SamplingParams.{name}={v!r}: must be in [-2, 2]")
        repetition = _float_field("repetition_penalty", self.repetition_penalty)
        if not repetition > 0:
            raise ValueError(f"SamplingParams.repetition_penalty={repetition!r}: must be > 0 (1 = off)")
        if compute_dtype is not None:
            # greedy (temperature 0) samples at temperature 1 (below)
            _check_repetition_range(repetition, temperature if temperature > 0 else 1.0, compute_dtype)
        bias = _logit_bias(self.logit_bias)
        prompt_logprobs = None
        if self.prompt_logprobs is not None:
            prompt_logprobs = _int_field("prompt_logprobs", self.prompt_logprobs, 0, why=" (None = off)")
            if prompt_logprobs > MAX_TOP_LOGPROBS:
                raise ValueError(f"SamplingParams.prompt_logprobs={prompt_logprobs}: at most {MAX_TOP_LOGPROBS}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"SamplingParams.ignore_eos={self.ignore_eos!r:.80}: must be a bool")
        checked = SamplingParams(
            n=n,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            max_new_tokens=max_new_tokens,
            stop_token_ids=tuple(as_int(t) for t in stop_ids),
            seed=seed,
            logprobs_mode=str(self.logprobs_mode),
            stop_strings=stop_strings,
            top_logprobs=top_logprobs,
            presence_penalty=presence,
            frequency_penalty=frequency,
            repetition_penalty=repetition,
            logit_bias=bias,
            prompt_logprobs=prompt_logprobs,
            ignore_eos=self.ignore_eos,
        )
        if temperature == 0:
            # NOTE (greedy, vLLM's temperature 0): the one greedy path of every entry point. Top-k 1
            # at temperature 1 takes exactly the argmax token (after any penalties and logit bias);
            # "raw" logprobs give it the model's own log-softmax, as vLLM's greedy rows get (its
            # greedy path filters nothing), not the 0.0 of the top-1-filtered distribution; top lists
            # and prompt logprobs come from that distribution too. vLLM's "processed_logprobs" of a
            # greedy row hold penalties and logit bias; these do not (the model's own logits).
            return replace(checked, temperature=1.0, top_k=1, top_p=1.0, logprobs_mode="raw")
        return checked


def check_temperature(value, compute_dtype: torch.dtype | None = None) -> float:
    """``value`` as a float the logits can be divided by: ValueError naming
    ``SamplingParams.temperature`` unless it is a finite real > 0 and, with ``compute_dtype`` (the
    sampler's fp32 / fp64), at least :func:`min_temperature` of it. Also the rule of the scoring
    calls (``engine.score``, top lists), whose temperature only divides logits: 0 is an error
    there, not greedy (a sampling mode: :meth:`SamplingParams.validate`)."""
    temperature = _float_field("temperature", value)
    if not temperature > 0:
        raise ValueError(
            f"SamplingParams.temperature={value!r}: must be > 0 (logits are divided by it; greedy "
            "decoding is a sampling request at temperature 0)"
        )
    if compute_dtype is not None and temperature < min_temperature(compute_dtype):
        floor = min_temperature(compute_dtype)
        raise ValueError(
            f"SamplingParams.temperature={value!r}: logits / temperature overflows the sampler's "
            f"{compute_dtype} (NaN logprobs); the smallest usable temperature is {floor:.3g} (greedy "
            "sampling: temperature 0)"
        )
    return temperature


def _check_repetition_range(repetition: float, temperature: float, dtype: torch.dtype) -> None:
    """Raise ValueError naming ``SamplingParams.repetition_penalty`` when the sampler could not apply
    it in ``dtype`` (its compute dtype) without NaN logprobs (the temperature floor's reasoning):
    below 1 it divides positive logits before the temperature does, so repetition * temperature
    must stay >= :func:`min_temperature` (a smaller one overflows the logit to inf, and inf - inf
    is NaN); above ``finfo(dtype).max`` it is inf in ``dtype``, and a logit of exactly 0 times inf
    is NaN."""
    floor, top = min_temperature(dtype), torch.finfo(dtype).max
    if repetition < 1 and repetition * temperature < floor:
        raise ValueError(
            f"SamplingParams.repetition_penalty={repetition!r}: a repeated token's logit / repetition_penalty / "
            f"temperature overflows the sampler's {dtype} (NaN logprobs); with temperature {temperature:.3g} the "
            f"smallest usable repetition_penalty is {floor / temperature:.3g} (1 = off)"
        )
    if repetition > top:
        raise ValueError(
            f"SamplingParams.repetition_penalty={repetition!r}: beyond the sampler's {dtype} range (NaN logprobs); "
            f"the largest usable repetition_penalty is {top:.3g} (1 = off)"
        )


def _logit_bias(value) -> tuple[tuple[int, float], ...]:
    """``SamplingParams.logit_bias`` checked: (id, bias) pairs, ids distinct integers >= 0, biases
    finite in [-100, 100] (the vocabulary bound is the engine's: ``requests.check_request``)."""
    pairs = _tuple_field("logit_bias", value, "(token id, bias) pairs")
    out, seen = [], set()
    for pair in pairs:
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise ValueError(f"SamplingParams.logit_bias: {pair!r:.80} is not a (token id, bias) pair")
        tok = _int_field("logit_bias", pair[0], 0, why=" token id")
        bias = _float_field("logit_bias", pair[1])
        if not -100 <= bias <= 100:
            raise ValueError(f"SamplingParams.logit_bias: bias {bias!r} of token {tok} must be in [-100, 100]")
        if tok in seen:
            raise ValueError(f"SamplingParams.logit_bias: token {tok} given twice")
        seen.add(tok)
        out.append((tok, bias))
    return tuple(out)


@dataclass
class GenerationRequest:
    """One prompt to continue ``params.n`` times.

    Attributes:
        request_id: caller's id, echoed in the outputs.
        prompt_ids: token ids of the whole context so far (earlier turns included).
        params: sampling parameters.
        sample_index: index of the first sample in the randomness key; sample j uses
            ``sample_index + j``. A multi-turn continuation of sample j passes n=1 and
            sample_index=j so it keeps its own random stream.
        block_selection_from: first position whose block-selection record the outputs carry
            (engines that record it; 0..len(prompt_ids)): a later turn passes the end of what the
            earlier turns' outputs recorded (``SelectionRecord.end``), so each turn sends only
            new tokens.
    """

    request_id: str
    prompt_ids: Sequence[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    sample_index: int = 0
    block_selection_from: int = 0

    def output_indices(self) -> list:
        """``sample_index`` of each output record this request yields: sample_index + j for
        j < ``params.num_outputs``, or ``[sample_index]`` as given (one error record) when it is not
        an integer."""
        try:
            first = as_int(self.sample_index)
        except TypeError:
            return [self.sample_index]
        if not isinstance(self.params, SamplingParams):
            return [first]
        return [first + j for j in range(self.params.num_outputs)]


# The finish reason of a request the backend refused or lost (``SampleOutput.error`` says why); a
# trajectory with a failed request keeps it (``Trajectory.failed``).
FINISH_ERROR = "error"


class PositionLogprobs(NamedTuple):
    """One prompt position's scores (``SampleOutput.prompt_logprobs``; ``score.top_logprobs``
    ``with_tokens``).

    Attributes:
        logprob: the position's own token's logprob in the processed distribution (-inf when the
            top-k / top-p filters removed it).
        rank: the token's 1-based rank among the whole vocabulary by logit, tokens of equal logit
            counted before it (vLLM's rule; the filters keep a prefix of this order, so a kept
            token's rank is the same in the processed distribution).
        top: the ``k`` most likely tokens, (token id, logprob), most likely first, tokens the
            filters removed left out.
    """

    logprob: float
    rank: int
    top: list[tuple[int, float]]


@dataclass
class SampleOutput:
    """One sampled continuation.

    Attributes:
        request_id, sample_index: which request / sample (``sample_index`` is absolute).
        prompt_ids: the request's prompt, [P] ints.
        output_ids: generated tokens [G], including the stop token when one was hit.
        logprobs: fp32 list [G], logprob of each generated token (see ``logprobs_mode``).
        finish_reason: "stop" (stop / eos token or stop string), "length" (max_new_tokens or
            context full), "abort" (aborted; output so far), or "error" (``FINISH_ERROR``;
            ``error`` says why; output may be empty).
        weight_version: version of the weights that produced the last token of this output (all of
            them unless weights changed while it ran; see ``token_weight_versions``).
        token_weight_versions: [G] version that produced each generated token.
        token_weight_writes: [G] the weight-write count each token was sampled under
            (``LLMEngine.weight_writes``; an EP service's group-wide count), -1 for a token sampled
            on KV computed partly under weights written over since (a request that went on across
            an update without recomputing its KV). Unlike the version, it changes with every write
            (an update that re-sends the same version with ``replace`` included), so "weights
            unchanged since token i" is ``token_weight_writes[i] == backend.weight_writes``. Empty
            for backends that do not count writes.
        top_logprobs: [G] per generated token its ``params.top_logprobs`` most likely (token id,
            logprob), most likely first, from the sampler at that step: the same distribution as
            ``logprobs`` (processed or raw; fp32 ``log_softmax``, so in batch-invariant mode the
            sampled token's entry may differ in its last bits from ``logprobs``: informational),
            tokens the top-k / top-p filters removed left out. None when not asked.
        routed_experts: optional int16 array [prompt + output len, n_moe_layers, top_k] (routing
            replay; filled by the routing-record work).
        block_selection: optional ``m3_rollout.model.selection_record.SelectionRecord``: the blocks
            every sparse layer selected for positions ``[request.block_selection_from, E)``, E =
            every position the engine ran (prompt + output length - 1: the last sampled token is
            never run); the samples of one request share the prompt's segment object.
        prompt_logprobs: ``params.prompt_logprobs`` asked: [P] entries, the first None (nothing
            predicts it), entry i the :class:`PositionLogprobs` of prompt token i computed by the
            prefill from the logits of position i - 1 (its top ``params.prompt_logprobs``; the
            distribution of ``SamplingParams.logprob_filters``); fewer than P when the sample was
            aborted before its prefill ended. The samples of a group share the entries. None when not
            asked (or from a backend that does not compute them).
        prompt_weight_writes: [len(prompt_logprobs) - 1] the weight-write count each entry from
            the second on was computed under (-1: on KV computed partly under weights written over
            since; ``token_weight_writes``' rule). Empty when not asked.
    """

    request_id: str
    sample_index: int
    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    weight_version: int
    error: str | None = None
    token_weight_versions: list[int] = field(default_factory=list)
    routed_experts: object | None = None
    block_selection: object | None = None
    token_weight_writes: list[int] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] | None = None
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    prompt_weight_writes: list[int] = field(default_factory=list)


@dataclass
class StreamDelta:
    """New tokens of one streaming sample since its previous delta (``step()`` output).

    Attributes:
        request_id, sample_index: which sample. token_ids / logprobs / weight_versions: the new
        generated tokens [k] with their logprobs and producing weight versions.
        weight_writes: [k] their weight-write counts (``SampleOutput.token_weight_writes``).
        top_logprobs: [k] their top lists (``SampleOutput.top_logprobs``), None when not asked.
    """

    request_id: str
    sample_index: int
    token_ids: list[int]
    logprobs: list[float]
    weight_versions: list[int]
    weight_writes: list[int] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] | None = None


class GenerationBackend(abc.ABC):
    """What the RL loop needs from a generation engine (design.md §3)."""

    @abc.abstractmethod
    def generate(self, requests: Sequence[GenerationRequest]) -> list[SampleOutput]:
        """Run all requests to completion; outputs ordered by request then sample."""

    async def generate_async(self, requests: Sequence[GenerationRequest]) -> AsyncIterator[SampleOutput]:
        """Yield outputs as they finish. Base version: runs ``generate`` then yields in order."""
        for out in self.generate(requests):
            yield out

    @property
    @abc.abstractmethod
    def weight_version(self) -> int:
        """Version of the weights now served."""

    @abc.abstractmethod
    def update_weights(self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy new weights in place (released checkpoint names) and set ``weight_version``."""

    def pause(self) -> None:
        """Stop admitting new work (no-op for synchronous backends)."""

    def resume(self) -> None:
        """Resume after ``pause``."""

    def reset_prefix_cache(self) -> None:
        """Drop reusable cached prefixes (no-op for backends without a prefix cache)."""

    def sleep(self, level: int = 1) -> dict:
        """Release device memory between generation phases (level 1: KV cache; level 2: also the
        weights, to host memory) and return {"level", "gb_freed" (GiB), "seconds"}. Base version:
        frees nothing (backends whose memory is not the trainer's to share)."""
        return {"level": 0, "gb_freed": 0.0, "seconds": 0.0}

    def wake_up(self) -> dict:
        """Take back what ``sleep`` released; return {"level" (woken from), "gb_restored" (GiB),
        "seconds", "graph_capture_seconds"}. Base version: nothing to take back."""
        return {"level": 0, "gb_restored": 0.0, "seconds": 0.0, "graph_capture_seconds": 0.0}

    def drain_events(self) -> list[dict]:
        """Worker failures since the last call, oldest first ({"time", "ranks", "error",
        "lost_request_ids", "recovered"}); the job logs them. Base version: a backend without
        workers has none."""
        return []

    def shutdown(self) -> None:
        """Release resources."""

"""The generation contract the RL loop sees (design.md §3): requests in, sampled tokens out.

Governing idea: the GRPO loop knows nothing about caches or batching. It submits
:class:`GenerationRequest` records (token ids in, token ids + logprobs out: "token-in,
token-out", never re-tokenised text) to a :class:`GenerationBackend` and pushes new weights
through ``update_weights`` using the released checkpoint names, the same wire naming the
NCCL weight-sync path uses.
"""

from __future__ import annotations

import abc
import numbers
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. Training rollouts use temperature 1, no top-k / top-p.

    ``seed`` and the sample index key all randomness: sample j of a request draws position p's
    token from uniforms keyed by (seed, sample_index + j, p), so reruns repeat and the n samples
    of a group differ.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 64
    stop_token_ids: tuple[int, ...] = ()
    seed: int = 0
    logprobs_mode: str = "processed"
    # Stop when the decoded output ends with one of these (needs the engine's detokenize
    # callback); the tokens that completed the string are kept.
    stop_strings: tuple[str, ...] = ()

    def validate(self) -> None:
        """Raises ValueError naming the bad field."""
        if self.n < 1:
            raise ValueError(f"SamplingParams.n={self.n}: must be >= 1")
        if not self.temperature > 0:
            raise ValueError(f"SamplingParams.temperature={self.temperature}: must be > 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p={self.top_p}: must be in (0, 1]")
        if self.top_k != -1 and self.top_k < 1:
            raise ValueError(f"SamplingParams.top_k={self.top_k}: must be -1 (off) or >= 1")
        if self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams.max_new_tokens={self.max_new_tokens}: must be >= 1")
        if self.logprobs_mode not in ("processed", "raw"):
            raise ValueError(f"SamplingParams.logprobs_mode={self.logprobs_mode!r}: 'processed' or 'raw'")
        if not isinstance(self.seed, numbers.Integral) or not -(2**63) <= self.seed < 2**63:
            raise ValueError(
                f"SamplingParams.seed={self.seed!r}: must be an integer in [-2**63, 2**63) "
                "(it keys the sampler's int64 hash)"
            )
        if any(not isinstance(s, str) or not s for s in self.stop_strings):
            raise ValueError(f"SamplingParams.stop_strings={self.stop_strings!r}: must be non-empty strings")


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
    """

    request_id: str
    prompt_ids: Sequence[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    sample_index: int = 0


@dataclass
class SampleOutput:
    """One sampled continuation.

    Attributes:
        request_id, sample_index: which request / sample (``sample_index`` is absolute).
        prompt_ids: the request's prompt, [P] ints.
        output_ids: generated tokens [G], including the stop token when one was hit.
        logprobs: fp32 list [G], logprob of each generated token (see ``logprobs_mode``).
        finish_reason: "stop" (stop / eos token or stop string), "length" (max_new_tokens or
            context full), "abort" (aborted; output so far), or "error" (``error`` says why;
            output may be empty).
        weight_version: version of the weights that produced the last token of this output (all of
            them unless weights changed while it ran; see ``token_weight_versions``).
        token_weight_versions: [G] version that produced each generated token.
        routed_experts: optional int16 array [prompt + output len, n_moe_layers, top_k] (routing
            replay; filled by the routing-record work).
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


@dataclass
class StreamDelta:
    """New tokens of one streaming sample since its previous delta (``step()`` output).

    Attributes:
        request_id, sample_index: which sample. token_ids / logprobs / weight_versions: the new
        generated tokens [k] with their logprobs and producing weight versions.
    """

    request_id: str
    sample_index: int
    token_ids: list[int]
    logprobs: list[float]
    weight_versions: list[int]


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

    def shutdown(self) -> None:
        """Release resources."""

"""Token sampler: fp32 logits -> (token, logprob), vectorised over the batch.

Governing idea: a sample's randomness is a pure function of (seed, sample index, position), so
a sample does not depend on which other requests share its batch, on the batch order, on
preemption, or on the expert-parallel size. We draw one uniform number per vocabulary entry
from a counter-based hash of (seed, sample, position, token id) and take the Gumbel-max of the
processed logits: argmax(logits / T + g) with g = -log(-log(u)) is an exact sample from
softmax(logits / T) (Gumbel-max trick), restricted to the top-k / top-p support.

Logprobs: ``torch.log_softmax`` of the row, or, in batch-invariant mode (design.md §4.6), the
caller's ``token_logprobs`` op (``m3_kernels.invariant_ops.token_logprobs``: one fixed reduction
order per row, the same in the eager step and the decode graphs). Tokens need no such op: the
Gumbel-max argmax is exact given the logits. The top-k / top-p support does: in batch-invariant
mode (``batch_invariant=True``) the sort is stable (ties ordered by token id) and top-p's mass
comes from :func:`prefix_sums` (elementwise adds in an order fixed per position) over
exp(logit - row max) instead of ``torch.softmax`` + ``torch.cumsum``, whose reductions the
library may order by the tensor's shape (CUDA ``cumsum`` of a single row takes another scan than
of several rows).

Shapes: N rows (one per running sample), V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Protocol

import numpy as np
import torch

from m3_rollout.model.numerics import compute_dtype


class TokenLogprobs(Protocol):
    """The batch-invariant logprob op (``m3_kernels.invariant_ops.token_logprobs``).

    ``op(logits [N, V], tokens [N])`` -> fp32 [N], log_softmax(logits)[r, tokens[r]] in one fixed
    reduction order per row. Keywords (the decode graphs' one call,
    ``decode_graph.invariant_logprobs_into``): ``temperature`` fp32 / fp64 [N] divides each row by
    its fp32 temperature first (IEEE division: :func:`process_logits`' bits), ``raw`` integer [N]
    exempts the nonzero rows, ``out`` fp32 / fp64 [N] receives the values.
    """

    def __call__(
        self,
        logits: torch.Tensor,
        tokens: torch.Tensor,
        *,
        temperature: torch.Tensor | None = None,
        raw: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor: ...


# splitmix64 constants, written as signed int64 (torch has no uint64 arithmetic).
GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15
MIX1 = -4658895280553007687  # 0xBF58476D1CE4E5B9
MIX2 = -7723592293110705685  # 0x94D049BB133111EB
SAMPLE_MUL = 0x2545F4914F6CDD1D
POS_MUL = 0x5851F42D4C957F2D & 0x7FFFFFFFFFFFFFFF


def _srl(x: torch.Tensor, n: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> n) & ((1 << (64 - n)) - 1)


def _splitmix64(x: torch.Tensor) -> torch.Tensor:
    x = x + GOLDEN
    x = (x ^ _srl(x, 30)) * MIX1
    x = (x ^ _srl(x, 27)) * MIX2
    return x ^ _srl(x, 31)


def keyed_uniform(
    seeds: torch.Tensor, sample_ids: torch.Tensor, positions: torch.Tensor, vocab_size: int
) -> torch.Tensor:
    """Uniform numbers in (0, 1) keyed by (seed, sample id, position, token id).

    Args:
        seeds, sample_ids, positions: int64 [N].
        vocab_size: V.

    Returns:
        float64 [N, V], each entry a deterministic function of its four keys only.
    """
    key = _splitmix64(seeds.to(torch.int64))
    key = _splitmix64(key ^ (sample_ids.to(torch.int64) * SAMPLE_MUL))
    key = _splitmix64(key ^ (positions.to(torch.int64) * POS_MUL))  # [N]
    bits = _splitmix64(key[:, None] ^ vocab_hash(vocab_size, key.device)[None, :])  # [N, V]
    # Top 53 bits -> (0, 1): add half an ulp so neither 0 nor 1 can occur.
    return (_srl(bits, 11).to(torch.float64) + 0.5) / float(1 << 53)


_VOCAB_HASH: dict[tuple[int, torch.device], torch.Tensor] = {}


def vocab_hash(vocab_size: int, device: torch.device) -> torch.Tensor:
    """``splitmix64(arange(V))`` int64 [V], cached per (V, device) (a constant of the keyed
    uniforms; call it once before CUDA-graph capture so the cached tensor is not graph memory)."""
    key = (vocab_size, torch.device(device))
    h = _VOCAB_HASH.get(key)
    if h is None:
        h = _VOCAB_HASH[key] = _splitmix64(torch.arange(vocab_size, dtype=torch.int64, device=device))
    return h


@dataclass
class SamplingTensors:
    """Per-row sampling parameters, shape [N] each (built once per step by the caller)."""

    temperature: torch.Tensor  # float64 [N], > 0 (cast to the logits' compute dtype)
    top_k: torch.Tensor  # int64 [N], -1 = off
    top_p: torch.Tensor  # float32 [N], in (0, 1]
    seeds: torch.Tensor  # int64 [N]
    sample_ids: torch.Tensor  # int64 [N]


@dataclass
class Penalties:
    """Penalties and logit biases of the M rows of a step that ask for any (vLLM's semantics;
    ``SamplingParams.presence_penalty`` etc.). Token lists are flat (row, id) pairs, so a step
    moves O(tokens of those rows), never an [M, V] array; :meth:`to` puts them on the device.

    rows: int64 [M] rows of the batch. presence, frequency, repetition: float64 [M] (0, 0, 1 = off).
    out_rows, out_ids: int64 [T] the generated tokens so far (row in 0..M-1, token id), repeats kept.
    prompt_rows, prompt_ids: int64 [P] prompt tokens (read by the repetition penalty alone; the
    launcher passes only those of rows whose repetition penalty is on).
    bias_rows, bias_ids: int64 [B], bias_values: float64 [B] (distinct (row, id) pairs).
    pending_rows, pending_src: int64 [Q] generated tokens still on the device (async scheduling):
    row in 0..M-1 and index into ``last_tokens`` (the runner's previous sampled ids); counted as
    generated tokens. pending_ids: int64 [Q] those tokens, read by :meth:`to`.
    """

    rows: torch.Tensor
    presence: torch.Tensor
    frequency: torch.Tensor
    repetition: torch.Tensor
    out_rows: torch.Tensor
    out_ids: torch.Tensor
    prompt_rows: torch.Tensor
    prompt_ids: torch.Tensor
    bias_rows: torch.Tensor
    bias_ids: torch.Tensor
    bias_values: torch.Tensor
    pending_rows: torch.Tensor
    pending_src: torch.Tensor
    pending_ids: torch.Tensor | None = None

    @classmethod
    def build(cls, rows: list[int], params: list, outputs: list, prompts: list, pending: list[int]) -> Penalties:
        """Host build. rows: batch rows; params: their ``SamplingParams``; outputs / prompts: their
        generated / prompt token id lists (prompts count for the repetition penalty only: the
        caller may pass () where it is off); pending: per row, -1 or the ``last_tokens`` index of
        a generated token not on the host."""

        def flat(lists):
            n = [len(x) for x in lists]
            r = np.repeat(np.arange(len(lists), dtype=np.int64), n)
            ids = np.fromiter((t for x in lists for t in x), dtype=np.int64, count=sum(n))
            return torch.from_numpy(r), torch.from_numpy(ids)

        f64 = lambda xs: torch.tensor(xs, dtype=torch.float64)  # noqa: E731
        out_rows, out_ids = flat(outputs)
        prompt_rows, prompt_ids = flat(prompts)
        bias = [(i, t, b) for i, p in enumerate(params) for t, b in p.logit_bias]
        q = [i for i, src in enumerate(pending) if src >= 0]
        return cls(
            rows=torch.tensor(rows, dtype=torch.int64),
            presence=f64([p.presence_penalty for p in params]),
            frequency=f64([p.frequency_penalty for p in params]),
            repetition=f64([p.repetition_penalty for p in params]),
            out_rows=out_rows,
            out_ids=out_ids,
            prompt_rows=prompt_rows,
            prompt_ids=prompt_ids,
            bias_rows=torch.tensor([b[0] for b in bias], dtype=torch.int64),
            bias_ids=torch.tensor([b[1] for b in bias], dtype=torch.int64),
            bias_values=f64([b[2] for b in bias]),
            pending_rows=torch.tensor(q, dtype=torch.int64),
            pending_src=torch.tensor([pending[i] for i in q], dtype=torch.int64),
        )

    def to(self, device: torch.device, last_tokens: torch.Tensor | None = None) -> Penalties:
        """A copy on ``device`` whose pending tokens are read from ``last_tokens`` (int64, on
        ``device``) now, in stream order: the step's sampler overwrites ``last_tokens`` with its own
        ids, and whatever applies these penalties after it (the top-logprob lists) must still see
        the previous step's."""
        fields = {k: v.to(device, non_blocking=True) for k, v in vars(self).items() if isinstance(v, torch.Tensor)}
        if last_tokens is not None and self.pending_rows.numel():
            fields["pending_ids"] = last_tokens[fields["pending_src"]]
        return Penalties(**fields)


def apply_penalties(x: torch.Tensor, pen: Penalties) -> torch.Tensor:
    """``x`` [N, V] (fp32 / fp64 raw logits) with ``pen``'s rows biased and penalised, in vLLM's order:
    + logit_bias; repetition (seen in prompt or output: positive / r, else * r); - frequency * count
    in the output; - presence * (count > 0). A new tensor; other rows keep their exact bits.

    Row-invariant (batch-invariant mode too): a row's result depends on its own tokens and logits
    alone; the counts are exact integer sums (any accumulation order), the rest elementwise.
    Raises RuntimeError (pending tokens without ``pen.last_tokens``)."""
    m, v = pen.rows.shape[0], x.shape[1]
    sub = x.index_select(0, pen.rows)  # [M, V]
    if pen.bias_ids.numel():
        sub = sub.index_put((pen.bias_rows, pen.bias_ids), pen.bias_values.to(x.dtype), accumulate=True)
    out_rows, out_ids = pen.out_rows, pen.out_ids
    if pen.pending_rows.numel():
        if pen.pending_ids is None:
            raise RuntimeError("Penalties: pending tokens need last_tokens (Penalties.to)")
        out_rows = torch.cat([out_rows, pen.pending_rows])
        out_ids = torch.cat([out_ids, pen.pending_ids])
    counts = torch.zeros(m, v, dtype=x.dtype, device=x.device)
    counts.index_put_((out_rows, out_ids), torch.ones_like(out_ids, dtype=x.dtype), accumulate=True)
    in_output = counts > 0
    seen = in_output.index_put((pen.prompt_rows, pen.prompt_ids), torch.ones_like(pen.prompt_ids, dtype=torch.bool))
    rep = torch.where(seen, pen.repetition.to(x.dtype)[:, None], torch.ones((), dtype=x.dtype, device=x.device))
    sub = torch.where(sub > 0, sub / rep, sub * rep)
    sub = sub - pen.frequency.to(x.dtype)[:, None] * counts
    sub = sub - pen.presence.to(x.dtype)[:, None] * in_output.to(x.dtype)
    return x.index_copy(0, pen.rows, sub)


def prefix_sums(x: torch.Tensor) -> torch.Tensor:
    """Inclusive prefix sums of x [..., L] along the last dim with a fixed association.

    Doubling scan (Hillis-Steele): ceil(log2 L) passes, pass j adds to every position i >= 2^j the
    value 2^j places earlier. Each output s[..., i] is a fixed tree of additions of x[..., 0..i]
    whose shape depends on i alone: not on L, the leading dims (the number of rows) or the device;
    only elementwise IEEE adds in x.dtype, so the same bits on the CPU and the GPU and for a row
    alone or in any batch. Error O(log L) roundings (a sequential sum: O(L)). Cost: ceil(log2 L)
    elementwise passes over x.
    """
    s = x
    d = 1
    n = x.shape[-1]
    while d < n:
        s = torch.cat([s[..., :d], s[..., d:] + s[..., :-d]], dim=-1)
        d *= 2
    return s


def top_p_keep_invariant(sorted_x: torch.Tensor, keep: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Batch-invariant top-p over one sorted row per row: bool [N, V], True where the mass of the
    higher-ranked kept tokens is below top_p.

    sorted_x: [N, V] processed logits sorted descending (column 0 = the row max); keep: bool [N, V]
    the support so far (top-k), a prefix of each row; top_p: [N]. The mass before position i is
    S[i - 1] / S[V - 1] with S = :func:`prefix_sums` of e = exp(sorted_x - row max) (0 outside
    ``keep``), all in sorted_x.dtype: elementwise ops and one fixed-order scan, so a row's result
    depends on that row alone (no library reduction whose order may follow the batch shape).
    Same rule as the fast path (the token that crosses top_p is kept), other roundings. A row with
    top_p >= 1 keeps every token (rounding cannot drop its tail), so it gets the same support
    whether or not another row of the batch makes the sampler filter (``need_top_p``).
    """
    e = torch.exp(sorted_x - sorted_x[:, :1]).masked_fill(~keep, 0.0)  # [N, V], e[:, 0] = 1
    s = prefix_sums(e)  # [N, V] inclusive
    before = torch.cat([torch.zeros_like(s[:, :1]), s[:, :-1]], dim=1)  # [N, V] exclusive
    p = top_p.to(s.dtype)[:, None]  # [N, 1]
    return (before / s[:, -1:] < p) | (p >= 1)


def process_logits(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    need_top_k: bool | None = None,
    need_top_p: bool | None = None,
    batch_invariant: bool = False,
    penalties: Penalties | None = None,
) -> torch.Tensor:
    """Apply logit biases and penalties (``penalties``' rows: :func:`apply_penalties`), then
    temperature, top-k and top-p; masked entries become -inf.

    Args:
        logits: [N, V] (any float dtype; computed in fp32).
        temperature: float [N] > 0. top_k: int64 [N], -1 = off. top_p: float [N] in (0, 1].
        need_top_k / need_top_p: whether any row filters (known on the host from the request
            parameters); None = find out from the tensors (a device-to-host sync on GPU).
            Passing False for a batch that filters is wrong (the filter is skipped).
        batch_invariant: a row's support depends on that row alone, bitwise (design.md §4.6):
            stable sort (tied logits ranked by token id, also at the top-k boundary) and
            :func:`top_p_keep_invariant` instead of ``torch.softmax`` + ``torch.cumsum``.
        penalties: the rows that ask for penalties / logit biases (on the logits' device), or None.

    Returns:
        fp32 [N, V] (fp64 for fp64 logits) processed logits; ``log_softmax`` of it is the distribution sampled from.
        Top-p keeps the smallest set of highest-probability tokens whose mass reaches top_p
        (the token that crosses the threshold is kept), as in vLLM / HF.
    """
    # fp32 (fp64 for a float64 model, so parity tests can compare logprobs at 1e-9).
    dtype = compute_dtype(logits.dtype)
    x = logits.to(dtype)
    if penalties is not None:
        x = apply_penalties(x, penalties)
    x = x / temperature.to(dtype)[:, None]
    n, v = x.shape
    need_k = bool((top_k > 0).any()) if need_top_k is None else need_top_k
    need_p = bool((top_p < 1).any()) if need_top_p is None else need_top_p
    if not (need_k or need_p):
        return x
    sorted_x, order = torch.sort(x, dim=-1, descending=True, stable=batch_invariant)
    keep = torch.ones_like(sorted_x, dtype=torch.bool)
    if need_k:
        k = torch.where(top_k > 0, top_k, torch.full_like(top_k, v)).clamp(max=v)
        keep &= torch.arange(v, device=x.device)[None, :] < k[:, None]
    if need_p and batch_invariant:
        keep &= top_p_keep_invariant(sorted_x, keep, top_p)
    elif need_p:
        probs = torch.softmax(sorted_x.masked_fill(~keep, float("-inf")), dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs
        # a top_p >= 1 row keeps its whole support: the rounded mass can reach 1.0 before its tail,
        # which would drop that tail only when another row of the batch makes the step filter
        keep &= (mass_before < top_p.float()[:, None]) | (top_p >= 1)[:, None]
    keep[:, 0] = True
    mask = torch.zeros_like(keep).scatter(1, order, keep)
    return x.masked_fill(~mask, float("-inf"))


def sample(
    logits: torch.Tensor,
    params: SamplingTensors,
    positions: torch.Tensor,
    logprobs_mode: str | torch.Tensor = "processed",
    token_logprobs: TokenLogprobs | None = None,
    batch_invariant: bool = False,
    penalties: Penalties | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row and return its logprob.

    Args:
        logits: [N, V] raw model logits for the next token.
        params: per-row sampling parameters.
        positions: int64 [N], the absolute position the sampled token will occupy (part of the
            randomness key).
        logprobs_mode: "processed" = logprob under the distribution actually sampled from
            (after temperature/top-k/top-p); "raw" = under the model's plain softmax; or a bool
            [N] tensor, True where a row wants "raw" (mixed batches of the engine).
        token_logprobs: the logprob op (None = ``torch.log_softmax``; see the module docstring).
        batch_invariant: top-k / top-p supports that depend on the row alone (``process_logits``).
        penalties: rows with penalties / logit biases (``process_logits``); "processed" logprobs
            include them, "raw" ones do not.

    Returns:
        (tokens int64 [N], logprobs [N] in the processed dtype).
    """
    need_k = bool((params.top_k > 0).any())
    need_p = bool((params.top_p < 1).any())
    mode = logprobs_mode
    if isinstance(logprobs_mode, torch.Tensor):
        raw_rows = logprobs_mode.to(torch.bool)
        mode = "processed" if not bool(raw_rows.any()) else "raw" if bool(raw_rows.all()) else raw_rows
    return sample_rows(logits, params, positions, mode, need_k, need_p, token_logprobs, batch_invariant, penalties)


def sample_rows(
    logits: torch.Tensor,
    params: SamplingTensors,
    positions: torch.Tensor,
    logprobs_mode: str | torch.Tensor,
    need_top_k: bool,
    need_top_p: bool,
    token_logprobs: TokenLogprobs | None = None,
    batch_invariant: bool = False,
    penalties: Penalties | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`sample` without device-to-host syncs (CUDA-graph capturable): the caller states
    on the host whether any row filters by top-k / top-p, and ``logprobs_mode`` is "processed",
    "raw" or a bool [N] tensor (True = raw) used as is (both logprobs computed, then selected).
    Same values as :func:`sample` for the same rows (it calls this). token_logprobs, batch_invariant,
    penalties: as :func:`sample` (a step with penalties runs outside the decode graphs)."""
    processed = process_logits(
        logits, params.temperature, params.top_k, params.top_p, need_top_k, need_top_p, batch_invariant, penalties
    )
    u = keyed_uniform(params.seeds, params.sample_ids, positions, processed.shape[-1])
    gumbel = -torch.log(-torch.log(u))
    tokens = torch.argmax(processed.double() + gumbel, dim=-1)
    if isinstance(logprobs_mode, torch.Tensor):
        raw_rows = logprobs_mode.to(torch.bool)
        lp_p = gather_logprobs(processed, tokens, token_logprobs)
        lp_r = gather_logprobs(logits.to(processed.dtype), tokens, token_logprobs)
        return tokens, torch.where(raw_rows.to(lp_p.device), lp_r, lp_p)
    base = processed if logprobs_mode == "processed" else logits.to(processed.dtype)
    return tokens, gather_logprobs(base, tokens, token_logprobs)


def gather_logprobs(
    base: torch.Tensor, tokens: torch.Tensor, token_logprobs: TokenLogprobs | None = None
) -> torch.Tensor:
    """log_softmax(base [N, V])[r, tokens[r]] -> [N] in base.dtype: ``torch.log_softmax`` or the
    given batch-invariant op (its fp32 result cast to base.dtype)."""
    if token_logprobs is None:
        return torch.log_softmax(base, dim=-1).gather(1, tokens[:, None]).squeeze(1)
    return token_logprobs(base, tokens).to(base.dtype)


def top_logprobs_rows(
    logits: torch.Tensor,
    params: SamplingTensors,
    raw: torch.Tensor,
    rows: torch.Tensor,
    k: int,
    need_top_k: bool,
    need_top_p: bool,
    batch_invariant: bool = False,
    penalties: Penalties | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` most likely tokens of the rows ``rows`` in the distribution their sampled logprob
    comes from (a request's ``top_logprobs``, computed at sampling time): ``log_softmax`` of the
    logits :func:`process_logits` makes of them (temperature, top-k, top-p: the processed
    distribution sampled from), or of the raw logits for a raw row. Runs on those rows alone,
    after the step's sampling (which it leaves as it was), so rows that do not ask pay nothing.

    Args:
        logits: [N, V] raw model logits (fp32 / fp64, the sampler's compute dtype).
        params: the step's per-row parameters [N]; raw: bool [N] (True = "raw" logprobs).
        rows: int64 [M] the rows that ask, on the logits' device. k: >= 1, the largest ask.
        need_top_k / need_top_p / batch_invariant: as :func:`process_logits` (for these rows).
        penalties: the step's penalties / logit biases (rows of the whole step, on the device), as
            the sampler applied them: in the processed distribution, not in a raw row's.

    Returns:
        (token ids int64 [M, min(k, V)], logprobs [M, min(k, V)] in the compute dtype), most
        likely first (ties: ``torch.topk``'s order); a token the filters removed has logprob -inf.
        Informational in batch-invariant mode: ``torch.log_softmax`` (not the fixed-order op), so
        the sampled token's entry may differ in the last bits from its sampled logprob.
    """
    x = logits.index_select(0, rows)
    pen = logits if penalties is None else apply_penalties(logits, penalties)
    processed = process_logits(
        pen.index_select(0, rows),
        params.temperature.index_select(0, rows),
        params.top_k.index_select(0, rows),
        params.top_p.index_select(0, rows),
        need_top_k,
        need_top_p,
        batch_invariant,
    )
    base = torch.where(raw.index_select(0, rows)[:, None], x.to(processed.dtype), processed)
    vals, ids = torch.log_softmax(base, dim=-1).topk(min(k, base.shape[-1]), dim=-1)
    return ids, vals


def position_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    k: int,
    temperature: float,
    top_k: int = -1,
    top_p: float = 1.0,
    batch_invariant: bool = False,
    token_logprobs: TokenLogprobs | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Scores of R positions of one request against given next tokens (prompt logprobs: the
    engine's prefill and ``score.top_logprobs``): the log-softmax of the logits
    :func:`process_logits` makes of them (/ ``temperature``, then the ``top_k`` / ``top_p``
    filters; no penalties) in the compute dtype.

    Args:
        logits: [R, V] raw model logits (model dtype). targets: int64 [R] each position's own token.
        k: >= 0 top tokens per position (above V: all of it). temperature, top_k, top_p: checked
            values (``SamplingParams``' rules). batch_invariant: the sampler's tie rule of that mode.
        token_logprobs: the sampler's logprob op (batch-invariant mode) for the targets' logprobs;
            None = ``torch.log_softmax``. The top lists always take ``torch.log_softmax``.

    Returns:
        (logprob [R] of each target in the processed distribution (-inf when filtered out), its
        1-based rank int64 [R] among the raw logits, ties counted before it (vLLM's rule), top ids
        int64 [R, min(k, V)] and their logprobs [R, min(k, V)], most likely first), on the logits' device.
    """
    r, v = logits.shape
    dtype = compute_dtype(logits.dtype)
    full = lambda x, dt: torch.full((r,), x, dtype=dt, device=logits.device)  # noqa: E731
    x = process_logits(
        logits,
        full(temperature, dtype),
        full(top_k, torch.int64),
        full(top_p, dtype),
        need_top_k=top_k > 0,
        need_top_p=top_p < 1,
        batch_invariant=batch_invariant,
    )
    logprobs = torch.log_softmax(x, dim=-1)  # [R, V]
    if token_logprobs is None:
        own = logprobs.gather(1, targets[:, None])[:, 0]  # [R]
    else:
        own = gather_logprobs(x, targets, token_logprobs)
    rank = (logits >= logits.gather(1, targets[:, None])).sum(dim=-1)  # the unfiltered order (temperature keeps it)
    vals, ids = logprobs.topk(min(k, v), dim=-1)
    return own, rank, ids, vals


# Packed per-row sampling parameters: one int64 [NUM_SAMPLING_FIELDS, N] array per step (floats
# stored as their float64 bit patterns), so a step moves them to the device in one copy. Rows are
# read and written by name through sampling_fields.
SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "seed", "sample_id", "position", "raw")
NUM_SAMPLING_FIELDS = len(SAMPLING_FIELDS)


class PackedSampling(NamedTuple):
    """Named row views of a packed int64 [NUM_SAMPLING_FIELDS, N] array (numpy or torch; no
    copies): temperature / top_p hold float64 bit patterns, raw is 0 / 1."""

    temperature: np.ndarray | torch.Tensor
    top_k: np.ndarray | torch.Tensor
    top_p: np.ndarray | torch.Tensor
    seed: np.ndarray | torch.Tensor
    sample_id: np.ndarray | torch.Tensor
    position: np.ndarray | torch.Tensor
    raw: np.ndarray | torch.Tensor


def sampling_fields(packed) -> PackedSampling:
    """The rows of ``packed`` (int64 [NUM_SAMPLING_FIELDS, N]) by name, in SAMPLING_FIELDS order."""
    return PackedSampling(*(packed[i] for i in range(NUM_SAMPLING_FIELDS)))


def pack_sampling(out: np.ndarray, temperature, top_k, top_p, seeds, sample_ids, positions, raw) -> None:
    """Fill ``out`` (int64 [NUM_SAMPLING_FIELDS, N], e.g. a view of pinned memory) from N-long
    host sequences: temperature / top_p floats (stored as float64 bits), the rest ints / bools."""
    f = sampling_fields(out)
    f.temperature.view(np.float64)[:] = temperature
    f.top_k[:] = top_k
    f.top_p.view(np.float64)[:] = top_p
    f.seed[:] = seeds
    f.sample_id[:] = sample_ids
    f.position[:] = positions
    f.raw[:] = raw


def unpack_sampling(packed: torch.Tensor) -> tuple[SamplingTensors, torch.Tensor, torch.Tensor]:
    """Device views of a packed int64 [NUM_SAMPLING_FIELDS, N] tensor: (params, positions int64 [N],
    raw bool [N]); temperature float64 and top_p float32 as :class:`SamplingTensors` expects."""
    f = sampling_fields(packed)
    params = SamplingTensors(
        temperature=f.temperature.view(torch.float64),
        top_k=f.top_k,
        top_p=f.top_p.view(torch.float64).float(),
        seeds=f.seed,
        sample_ids=f.sample_id,
    )
    return params, f.position, f.raw != 0

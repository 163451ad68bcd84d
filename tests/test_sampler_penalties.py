"""Presence / frequency / repetition penalties and logit_bias (vLLM's semantics) in the sampler
and the engine: the processed logits against a direct computation, rows without them keep their
bits, and the sync, async and staged-decode-graph engines agree."""

import dataclasses
import math
from collections import Counter

import pytest
import torch
from test_engine_async import _drive  # tests/ on sys.path: run requests to the end, pages freed
from test_engine_core import MODEL, V  # tests/ is on sys.path under pytest

from m3_rollout.engine.config import EngineConfig
from m3_rollout.engine.engine import LLMEngine
from m3_rollout.engine.interface import GenerationRequest, SamplingParams, min_temperature
from m3_rollout.engine.requests import check_request
from m3_rollout.engine.sampler import Penalties, process_logits

EOS = 3


def _direct(logits, params, prompt, output):
    """vLLM's order, one row in plain torch: + bias, repetition over prompt + output, - frequency *
    count, - presence * seen (output only), / temperature."""
    x = logits.clone()
    for t, b in params.logit_bias:
        x[t] += b
    counts = Counter(output)
    for t in set(prompt) | set(output):
        r = params.repetition_penalty
        x[t] = x[t] / r if x[t] > 0 else x[t] * r
    for t, c in counts.items():
        x[t] -= params.frequency_penalty * c + params.presence_penalty
    return x / params.temperature


ROWS = [
    SamplingParams(temperature=0.7, presence_penalty=1.5),
    SamplingParams(),  # no penalties: its bits are untouched
    SamplingParams(frequency_penalty=-0.75),
    SamplingParams(repetition_penalty=1.8, temperature=1.3),
    SamplingParams(logit_bias=((5, -100.0), (9, 37.5))),
    SamplingParams(presence_penalty=-1, frequency_penalty=2, repetition_penalty=0.6, logit_bias=((1, 3.0),)),
]


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(ROWS), V, generator=g) * 3
    prompts = [torch.randint(0, V, (9,), generator=g).tolist() for _ in ROWS]
    outputs = [torch.randint(0, 12, (k,), generator=g).tolist() for k in (7, 3, 11, 5, 0, 9)]
    return logits, prompts, outputs


def _process(logits, rows, prompts, outputs, batch_invariant=False):
    params = [ROWS[i] for i in rows]
    asks = [j for j, p in enumerate(params) if p.penalized]
    pen = Penalties.build(
        asks,
        [params[j] for j in asks],
        [outputs[i] for i in rows if ROWS[i].penalized],
        [prompts[i] for i in rows if ROWS[i].penalized],
        [-1] * len(asks),
    )
    temp = torch.tensor([p.temperature for p in params], dtype=torch.float64)
    k, p = torch.full((len(rows),), -1), torch.ones(len(rows))
    return process_logits(logits[rows], temp, k, p, batch_invariant=batch_invariant, penalties=pen)


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_processed_logits_equal_a_direct_computation_and_other_rows_keep_their_bits(batch_invariant):
    logits, prompts, outputs = _batch()
    rows = list(range(len(ROWS)))
    got = _process(logits, rows, prompts, outputs, batch_invariant)
    for i, p in enumerate(ROWS):
        want = _direct(logits[i].double(), p, prompts[i], outputs[i]).float()
        assert torch.allclose(got[i], want, atol=1e-5, rtol=1e-6), i
    plain = logits[1] / torch.tensor(1.0)
    assert torch.equal(got[1], plain)  # the row without penalties: exactly temperature only
    assert got[4, 5] < -90 and got[4, 9] > 30  # biases land on the raw logits
    # each row alone gives the same bits as in the batch (the penalty reads the row's own tokens)
    for i in rows:
        assert torch.equal(_process(logits, [i], prompts, outputs, batch_invariant)[0], got[i]), i
    # and in another order, with a pending token read from the device (async scheduling)
    last = torch.tensor([0, 4, outputs[0][-1]])
    pen = Penalties.build([0], [ROWS[0]], [outputs[0][:-1]], [prompts[0]], [2])
    pen = pen.to(torch.device("cpu"), last)
    one = process_logits(
        logits[:1], torch.tensor([0.7], dtype=torch.float64), torch.tensor([-1]), torch.ones(1), penalties=pen
    )
    assert torch.equal(one[0], got[0])


def _engine(**kw):
    kw.setdefault("max_model_len", 96)
    kw.setdefault("max_num_seqs", 16)
    kw.setdefault("eos_token_ids", (EOS,))
    return LLMEngine(MODEL, EngineConfig(**kw))


def _requests():
    g = torch.Generator().manual_seed(3)
    prompt = lambda n: torch.randint(4, V, (n,), generator=g).tolist()  # noqa: E731
    reqs = []
    for i, p in enumerate(ROWS):
        p = dataclasses.replace(p, n=2, seed=40 + i, max_new_tokens=14, stop_token_ids=())
        reqs.append(GenerationRequest(f"r{i}", prompt(6 + 5 * i), p, sample_index=3 * i))
    return reqs


def _processed_reference(o, params):
    """The processed logprob of each output token from a full forward + the direct computation."""
    ids = torch.tensor([o.prompt_ids + o.output_ids])
    with torch.no_grad():
        logits = MODEL(ids)[0, len(o.prompt_ids) - 1 : -1].double()
    want = []
    for j, t in enumerate(o.output_ids):
        x = _direct(logits[j], params, o.prompt_ids, o.output_ids[:j])
        want.append(float(torch.log_softmax(x, -1)[t]))
    return torch.tensor(want, dtype=torch.float64)


def test_engine_logprobs_follow_the_penalties_and_every_path_gives_the_same_tokens():
    reqs = _requests()
    sync = _drive(_engine(async_scheduling=False), reqs)
    for r in reqs:
        for j in range(2):
            o = sync[(r.request_id, r.sample_index + j)]
            want = _processed_reference(o, r.params)
            assert torch.allclose(torch.tensor(o.logprobs, dtype=torch.float64), want, atol=1e-4), r.request_id
    assert all(5 not in sync[("r4", 12 + j)].output_ids for j in range(2))  # bias -100
    # async scheduling (pending tokens read on the device) and the staged decode graphs agree
    for kw in ({"async_scheduling": True}, {"async_scheduling": True, "enable_cuda_graphs": "eager"}):
        eng = _engine(**kw)
        other = _drive(eng, reqs)
        assert {k: o.output_ids for k, o in other.items()} == {k: o.output_ids for k, o in sync.items()}, kw
        if "enable_cuda_graphs" in kw:
            assert eng.stats.graph_steps > 0


def test_rows_without_penalties_keep_their_bits_batched_with_rows_that_have_them():
    """The same batch with and without the other rows' (tiny) penalties: they move those rows'
    logprobs but not their tokens, so every forward is the same, and the row without penalties
    gets the same logprob bits (the sampler touches the rows that ask only; on the CPU the forward
    itself is not batch-invariant, so the others' tokens must not change)."""
    reqs = _requests()
    tiny = dict(presence_penalty=1e-3, frequency_penalty=1e-3, repetition_penalty=1.001, logit_bias=((7, 1e-3),))
    nudged = [
        dataclasses.replace(r, params=dataclasses.replace(r.params, **tiny)) if r.params.penalized else r for r in reqs
    ]
    off = dict(presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0, logit_bias=())
    neutral = [dataclasses.replace(r, params=dataclasses.replace(r.params, **off)) for r in reqs]
    for kw in ({}, {"enable_cuda_graphs": "eager"}):
        a = _drive(_engine(**kw), nudged)
        b = _drive(_engine(**kw), neutral)
        assert {k: o.output_ids for k, o in a.items()} == {k: o.output_ids for k, o in b.items()}
        for k in a:
            same = a[k].logprobs == b[k].logprobs
            assert same == (k[0] == "r1"), k  # the penalties moved every other row's logprobs


def test_penalties_change_the_tokens_and_raw_logprobs_ignore_them():
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(4, V, (10,), generator=g).tolist()
    base = SamplingParams(max_new_tokens=10, top_k=1, stop_token_ids=())
    plain = _drive(_engine(), [GenerationRequest("a", prompt, base)])[("a", 0)]
    forced = SamplingParams(max_new_tokens=10, top_k=1, logit_bias=((17, 100.0),), stop_token_ids=())
    out = _drive(_engine(), [GenerationRequest("b", prompt, forced)])[("b", 0)]
    assert out.output_ids == [17] * 10
    rep = dataclasses.replace(base, repetition_penalty=100.0)
    out = _drive(_engine(), [GenerationRequest("c", prompt, rep)])[("c", 0)]
    assert len(set(out.output_ids)) == len(out.output_ids) and out.output_ids != plain.output_ids
    raw = dataclasses.replace(base, top_k=-1, logprobs_mode="raw")
    a = _drive(_engine(), [GenerationRequest("d", prompt, raw)])[("d", 0)]
    b = _drive(_engine(), [GenerationRequest("e", prompt, dataclasses.replace(raw, presence_penalty=2.0))])[("e", 0)]
    # raw logprobs of the same tokens are the model's, penalties or not
    n = next((i for i, (x, y) in enumerate(zip(a.output_ids, b.output_ids, strict=True)) if x != y), len(a.output_ids))
    assert n > 0 and a.logprobs[:n] == b.logprobs[:n]


@pytest.mark.parametrize(
    "field, value",
    [
        ("presence_penalty", 2.5),
        ("frequency_penalty", -2.01),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", float("inf")),
        ("repetition_penalty", 1e-40),  # positive logits / it overflow fp32
        ("repetition_penalty", 1e39),  # inf in fp32
        ("logit_bias", ((5, 101.0),)),
        ("logit_bias", ((5, 1.0), (5, 2.0))),
        ("logit_bias", ((V, 1.0),)),
        ("logit_bias", ((-1, 1.0),)),
    ],
)
def test_bad_values_name_the_field(field, value):
    req = GenerationRequest("x", [5, 6], SamplingParams(**{field: value}))
    with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
        check_request(req, V, 96, torch.float32, False)


def test_repetition_penalty_the_sampler_would_overflow_is_refused_and_a_usable_one_is_finite():
    """A repetition penalty of 1e-40 (> 0, so accepted) made a repeated token's logit / penalty
    overflow fp32 to inf: NaN logprobs, which the server then failed to write as JSON (a 500).
    Below 1 it divides before the temperature does, so their product has the temperature's floor.
    Now: refused naming the smallest usable value; one just above the floor samples finite logprobs."""
    floor = min_temperature(torch.float32)
    prompt = [5, 6, 7, 5, 6]
    req = lambda r, t=1.0: GenerationRequest("x", prompt, SamplingParams(repetition_penalty=r, temperature=t))  # noqa: E731
    for r, t in ((1e-40, 1.0), (1e-20, 1e-20), (floor * 0.5, 1.0)):
        with pytest.raises(ValueError, match="SamplingParams.repetition_penalty.*smallest usable") as e:
            check_request(req(r, t), V, 96, torch.float32, False)
        assert f"{floor / t:.3g}" in str(e.value)
    check_request(req(1e-40), V, 96, torch.float64, False)  # fp64's range holds it
    check_request(req(1e-20, 1e-10), V, 96, torch.float32, False)
    usable = SamplingParams(repetition_penalty=floor * 4, max_new_tokens=4, stop_token_ids=(), top_logprobs=3)
    out = _drive(_engine(), [GenerationRequest("u", prompt, usable)])[("u", 0)]
    assert len(out.logprobs) == 4 and all(math.isfinite(v) for v in out.logprobs)
    assert all(math.isfinite(v) for row in out.top_logprobs for _, v in row)

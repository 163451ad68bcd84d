"""LLMEngine / NativeBackend end to end on a tiny fp32 M3 (page = block = 4 tokens, top-3 blocks,
so sequences beyond 12 tokens use sparse selection)."""

import asyncio
import dataclasses

import pytest
import torch

from m3_rollout.config import ConfigError, load_config
from m3_rollout.engine.config import EngineConfig
from m3_rollout.engine.engine import LLMEngine
from m3_rollout.engine.interface import GenerationRequest, SampleOutput, SamplingParams, StreamDelta
from m3_rollout.engine.native_backend import NativeBackend
from m3_rollout.model import M3ForCausalLM, tiny_config
from m3_rollout.model.loading import iter_released_tensors
from m3_rollout.weight_sync import LocalWeightSync
from m3_trainers.policy import token_logprobs

EOS = 3
V = 96


def _model(seed=0):
    torch.manual_seed(seed)
    cfg = tiny_config(vocab_size=V, max_position_embeddings=256, sparse_block_size=4, sparse_topk_blocks=3)
    m = M3ForCausalLM(cfg).float()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.15 if p.ndim >= 2 else 0.1)
    return m.eval()


MODEL = _model()


def _backend(**kw):
    kw.setdefault("max_model_len", 80)
    kw.setdefault("max_num_seqs", 16)
    backend = NativeBackend(MODEL, [EOS], **kw)
    backend.weight_sync = LocalWeightSync(backend.engine)
    return backend


def _req(rid, prompt, n=1, seed=1, sample_index=0, **kw):
    kw.setdefault("max_new_tokens", 30)
    return GenerationRequest(rid, list(prompt), SamplingParams(n=n, seed=seed, **kw), sample_index=sample_index)


def _prompt(n, seed):
    return torch.randint(4, V, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _plain_logprobs(o, temperature=1.0):
    ids = torch.tensor([o.prompt_ids + o.output_ids])
    return token_logprobs(MODEL, ids, temperature)[0, len(o.prompt_ids) :]


def test_group_prefill_computed_once_and_samples_differ():
    b = _backend()
    prompt = _prompt(13, 0)
    outs = b.generate([_req("g", prompt, n=8, stop_token_ids=())])
    m = b.metrics()
    assert m["prompt_tokens_computed"] == 13 and m["forks"] == 7
    assert [o.sample_index for o in outs] == list(range(8))
    assert len({tuple(o.output_ids) for o in outs}) == 8
    for o in outs:  # forked samples (shared pages + copied partial page) are exact
        assert torch.allclose(torch.tensor(o.logprobs), _plain_logprobs(o), atol=1e-5, rtol=0)


def test_same_seed_same_tokens_whatever_the_batch_and_chunking():
    a = _req("a", _prompt(9, 1), n=3, max_new_tokens=40)
    alone = _backend().generate([a])
    others = [_req(f"o{i}", _prompt(5 + 11 * i, 10 + i), n=2, seed=7 + i) for i in range(3)]
    crowded = _backend(max_num_batched_tokens=7).generate(others[:2] + [a] + others[2:])
    got = [o for o in crowded if o.request_id == "a"]
    for x, y in zip(alone, got):
        assert x.output_ids == y.output_ids and x.sample_index == y.sample_index
        assert max(abs(p - q) for p, q in zip(x.logprobs, y.logprobs)) < 1e-5
    # A continuation keyed as sample 2 equals sample 2; sample 0 of another index differs.
    single = _backend().generate([dataclasses.replace(a, params=dataclasses.replace(a.params, n=1), sample_index=2)])
    assert single[0].output_ids == alone[2].output_ids
    assert alone[0].output_ids != alone[2].output_ids
    assert max(len(o.prompt_ids) + len(o.output_ids) for o in alone) > 12  # sparse selection active


@pytest.mark.parametrize("temperature, top_k", [(0.7, -1), (1.3, 5)])
def test_processed_logprob_is_log_softmax_of_processed_logits(temperature, top_k):
    b = _backend()
    outs = b.generate([_req("t", _prompt(20, 2), n=3, temperature=temperature, top_k=top_k, stop_token_ids=())])
    for o in outs:
        ids = torch.tensor([o.prompt_ids + o.output_ids])
        with torch.no_grad():
            logits = MODEL(ids)[0, len(o.prompt_ids) - 1 : -1] / temperature  # [G, V]
        if top_k > 0:
            kth = logits.topk(top_k, dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        want = torch.log_softmax(logits, -1).gather(1, torch.tensor(o.output_ids)[:, None]).squeeze(1)
        assert torch.allclose(torch.tensor(o.logprobs), want, atol=1e-5, rtol=0)
    raw = b.generate([_req("r", _prompt(20, 2), temperature=temperature, logprobs_mode="raw")])[0]
    assert torch.allclose(torch.tensor(raw.logprobs), _plain_logprobs(raw), atol=1e-5, rtol=0)


def test_preemption_repeats_tokens_and_logprobs():
    reqs = [
        _req(f"p{i}", _prompt(10 + 3 * i, 20 + i), n=2, seed=i, max_new_tokens=45, stop_token_ids=()) for i in range(4)
    ]
    ample = _backend().generate(reqs)
    tight = _backend(num_pages=28)  # 8 samples x up to 15 pages each do not fit
    outs = tight.generate(reqs)
    assert tight.metrics()["num_preemptions"] > 0
    for x, y in zip(ample, outs):
        assert x.output_ids == y.output_ids
        assert max(abs(p - q) for p, q in zip(x.logprobs, y.logprobs)) < 1e-5
        assert torch.allclose(torch.tensor(y.logprobs), _plain_logprobs(y), atol=1e-5, rtol=0)


def test_multi_turn_continuation_hits_prefix_cache_and_weight_update_resets_it():
    b = _backend()
    first = b.generate([_req("t1", _prompt(14, 3), stop_token_ids=())])[0]
    ctx = first.prompt_ids + first.output_ids + [5, 6, 7]
    hits = b.metrics()["prefix_cache_hit_tokens"]
    second = b.generate([_req("t2", ctx, logprobs_mode="raw")])[0]
    # Turn 1's K/V covers all its tokens but the last sampled one: its full pages are reused.
    reuse = (len(first.prompt_ids) + len(first.output_ids) - 1) // 4 * 4
    assert reuse >= 12 and b.metrics()["prefix_cache_hit_tokens"] - hits == reuse
    assert b.metrics()["prompt_tokens_computed"] == 14 + len(ctx) - reuse
    assert torch.allclose(torch.tensor(second.logprobs), _plain_logprobs(second), atol=1e-5, rtol=0)
    b.update_weights(5, iter_released_tensors(MODEL))  # same values: version moves, cache dropped
    hits = b.metrics()["prefix_cache_hit_tokens"]
    again = b.generate([_req("t3", ctx, logprobs_mode="raw")])[0]
    assert b.metrics()["prefix_cache_hit_tokens"] == hits
    assert again.output_ids == second.output_ids and again.token_weight_versions == [5] * len(again.output_ids)


def test_bad_requests_fail_alone_with_the_field_named():
    b = _backend(max_model_len=40)
    outs = b.generate(
        [
            _req("oov", [1, 999]),
            _req("ok", [4, 5, 6]),
            _req("long", list(range(40))),
            _req("empty", []),
            _req("n0", [4], n=0),
            _req("m0", [4], max_new_tokens=0),
        ]
    )
    by = {o.request_id: o for o in outs}
    assert len(outs) == 6
    assert "prompt_ids" in by["oov"].error and "vocabulary" in by["oov"].error
    assert by["ok"].finish_reason in ("stop", "length") and by["ok"].output_ids
    assert "max_model_len" in by["long"].error and "empty" in by["empty"].error
    assert "n=0" in by["n0"].error and "max_new_tokens=0" in by["m0"].error
    with pytest.raises(ValueError, match="vocabulary"):
        asyncio.run(_collect(b.stream(_req("bad", [1, 999]))))


async def _collect(agen):
    return [x async for x in agen]


def test_async_callers_stream_and_match_sync():
    reqs = [_req(f"a{i}", _prompt(6 + 5 * i, 30 + i), n=2, seed=i) for i in range(3)]
    sync = _backend().generate(reqs)
    b = _backend()

    async def main():
        streamed = b.stream(reqs[0])
        return await asyncio.gather(_collect(streamed), _collect(b.generate_async(reqs[1:])))

    stream_out, rest = asyncio.run(main())
    deltas = [x for x in stream_out if isinstance(x, StreamDelta)]
    finals = sorted([x for x in stream_out if isinstance(x, SampleOutput)], key=lambda o: o.sample_index)
    for j, f in enumerate(finals):
        assert f.output_ids == sync[j].output_ids
        assert [t for d in deltas if d.sample_index == j for t in d.token_ids] == f.output_ids
    got = {(o.request_id, o.sample_index): o.output_ids for o in rest}
    assert got == {(o.request_id, o.sample_index): o.output_ids for o in sync[2:]}


def test_abort_pause_force_forward_and_abort_all():
    eng = LLMEngine(MODEL, EngineConfig(max_model_len=80, max_num_seqs=8, eos_token_ids=(EOS,)))
    eng.add_request(_req("x", _prompt(8, 4), n=2, stop_token_ids=(), max_new_tokens=40))
    eng.add_request(_req("y", _prompt(8, 5), stop_token_ids=(), max_new_tokens=40))
    for _ in range(3):
        eng.step()
    eng.abort("x")
    outs = eng.step()
    aborted = [o for o in outs if o.finish_reason == "abort"]
    assert len(aborted) == 2 and all(len(o.output_ids) >= 3 for o in aborted)
    assert eng.num_unfinished() == 1
    eng.pause()
    steps = eng.stats.steps
    assert eng.step() == [] and eng.stats.steps == steps
    eng.step(force_forward=True)  # empty forward while paused (EP lockstep)
    assert eng.stats.steps == steps + 1
    eng.resume()
    requeue = eng.abort_all()
    assert [(r.request_id, r.params.n) for r in requeue] == [("y", 1)] and not eng.has_unfinished()
    assert eng.metrics()["kv_pages_in_use"] == 0


def test_score_equals_trainer_logprobs_and_stop_strings():
    b = _backend()
    ids = _prompt(37, 6)
    want = token_logprobs(MODEL, torch.tensor([ids]), 0.9)[0]
    got = b.score(ids, temperature=0.9)
    assert torch.allclose(got, want, atol=1e-5, rtol=0)
    assert torch.allclose(
        b.score(ids, positions=[3, 30]), token_logprobs(MODEL, torch.tensor([ids]))[0, [3, 30]], atol=1e-5, rtol=0
    )
    out = b.generate([_req("s", ids[:9], stop_token_ids=(), max_new_tokens=30)])[0]
    target = out.output_ids[4]
    sb = _backend(detokenize=lambda toks: " ".join(map(str, toks)) + " ")
    stopped = sb.generate([_req("s", ids[:9], stop_token_ids=(), max_new_tokens=30, stop_strings=(f" {target} ",))])[0]
    first = next(i for i, t in enumerate(out.output_ids) if t == target)
    assert stopped.finish_reason == "stop" and stopped.output_ids == out.output_ids[: first + 1]
    assert _backend().generate([_req("s", [4], stop_strings=("x",))])[0].finish_reason == "error"


def test_generation_config_keys_validated():
    cfg = load_config(
        "configs/grpo_bf16_ep.yaml",
        [
            "policy.generation.max_num_batched_tokens=512",
            "policy.generation.enable_prefix_caching=false",
            "policy.generation.msa_prefill_scratch_mb=1040",
        ],
    )
    kw = cfg.policy.generation.engine_kwargs()
    assert kw["max_num_batched_tokens"] == 512 and kw["enable_prefix_caching"] is False
    assert kw["msa_prefill_scratch_mb"] == 1040
    assert load_config("configs/grpo_bf16_ep.yaml").policy.generation.engine_kwargs()["msa_prefill_scratch_mb"] is None
    for bad in (
        "policy.generation.kv_cache_memory_gb=-1",
        "policy.generation.msa_prefill_scratch_mb=-1",
        "policy.generation.max_num_batched_tokens=0",
        "policy.generation.kv_cache_memory_fraction=1.5",
    ):
        with pytest.raises(ConfigError, match=bad.split("=")[0].replace(".", r"\.")):
            load_config("configs/grpo_bf16_ep.yaml", [bad])
    with pytest.raises(ValueError, match="max_model_len"):
        LLMEngine(MODEL, EngineConfig(max_model_len=80, num_pages=3))


def test_async_callers_get_the_engine_error_instead_of_hanging():
    # Adversarial review: an exception inside the shared driver task (here the detokenize callback
    # of stop strings) used to kill the task silently and leave every awaiting caller hanging.
    def detok(ids):
        if len(ids) >= 3:
            raise RuntimeError("detokenizer failed")
        return "-"

    b = _backend(detokenize=detok)

    async def main():
        calls = [
            _collect(b.generate_async([_req("a", _prompt(5, 1), stop_strings=("zz",), stop_token_ids=())])),
            _collect(b.stream(_req("b", _prompt(7, 2), stop_token_ids=()))),
        ]
        return await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 30)

    results = asyncio.run(main())
    assert all(isinstance(r, RuntimeError) and "detokenizer failed" in str(r) for r in results), results


def test_score_rejects_non_positive_temperature():
    with pytest.raises(ValueError, match="temperature"):
        _backend().score(_prompt(6, 3), temperature=0.0)


def test_out_of_range_seed_or_sample_index_fails_alone():
    # Adversarial review: seed / sample index outside int64 used to raise inside the batched
    # sampler ("Overflow when unpacking long"), failing the step of every request in the batch.
    b = _backend()
    ok = _req("ok", _prompt(5, 1), stop_token_ids=())
    outs = b.generate([ok, _req("seed", _prompt(6, 2), seed=2**64), _req("idx", _prompt(6, 2), sample_index=2**63)])
    by = {o.request_id: o for o in outs}
    assert "SamplingParams.seed" in by["seed"].error and "sample_index" in by["idx"].error
    assert by["ok"].output_ids == _backend().generate([ok])[0].output_ids


def test_non_integer_token_ids_fail_alone_and_integer_likes_are_normalised():
    # Adversarial review: float ids were silently truncated in the forward, str ids raised out of
    # generate() (leaving the other requests behind in the engine), tensor ids came back as tensors.
    b = _backend()
    outs = b.generate(
        [
            _req("f", [5.5, 6]),
            _req("s", ["a", "b"]),
            _req("t", torch.tensor([5, 6, 7]), stop_token_ids=()),
            _req("ok", [5, 6, 7], stop_token_ids=()),
        ]
    )
    by = {o.request_id: o for o in outs}
    assert "prompt_ids" in by["f"].error and "integer" in by["f"].error and "prompt_ids" in by["s"].error
    assert by["t"].prompt_ids == [5, 6, 7] and all(type(t) is int for t in by["t"].prompt_ids)
    assert by["t"].output_ids == by["ok"].output_ids and not b.engine.has_unfinished()


# ---- sampling-parameter validation: a bad field fails its request alone -------------------------


def _with_params(rid, prompt, **fields):
    """A request whose SamplingParams hold exactly ``fields`` (bypassing _req's defaults)."""
    return GenerationRequest(rid, list(prompt), SamplingParams(**fields))


def test_sampling_params_of_the_wrong_type_or_range_fail_alone():
    # Issue: a non-integer n raised out of generate() (TypeError), losing every valid request of
    # the call; bools passed as ints and non-finite floats reached the sampler.
    prompt = _prompt(6, 4)
    bad = {
        "n_float": dict(n=2.5),
        "n_str": dict(n="2"),
        "n_bool": dict(n=True),
        "n_huge": dict(n=10**30),  # one error record, not one per sample (that exhausted the host's memory)
        "n_over_cap": dict(n=2**16 + 1),
        "t_huge_int": dict(temperature=10**400),  # raised OverflowError out of generate()
        "t_nan": dict(temperature=float("nan")),
        "t_inf": dict(temperature=float("inf")),
        "t_neg": dict(temperature=-1.0),
        "t_bool": dict(temperature=True),
        "p_nan": dict(top_p=float("nan")),
        "k_float": dict(top_k=2.0),
        "k_bool": dict(top_k=True),
        "m_float": dict(max_new_tokens=3.0),
        "seed_float": dict(seed=1.5),
        "seed_bool": dict(seed=False),
        "stop_float": dict(stop_token_ids=(3.0,)),
        "stop_bool": dict(stop_token_ids=(True,)),
        "stop_str": dict(stop_token_ids="3"),
    }
    ok = _req("ok", _prompt(5, 1), n=2, stop_token_ids=())
    b = _backend()
    no_params = GenerationRequest("no_params", prompt, None)  # raised AttributeError out of generate()
    outs = b.generate([_with_params(rid, prompt, **f) for rid, f in bad.items()] + [no_params, ok])
    by: dict[str, list[SampleOutput]] = {}
    for o in outs:
        by.setdefault(o.request_id, []).append(o)
    for rid, fields in bad.items():
        (name,) = fields
        assert len(by[rid]) == 1 and by[rid][0].finish_reason == "error", rid
        assert f"SamplingParams.{name}=" in by[rid][0].error, (rid, by[rid][0].error)
    assert len(by["no_params"]) == 1 and "GenerationRequest.params=None" in by["no_params"][0].error
    alone = _backend().generate([ok])
    assert [o.output_ids for o in by["ok"]] == [o.output_ids for o in alone] and not b.engine.has_unfinished()
    with pytest.raises(ValueError, match="SamplingParams.n"):
        asyncio.run(_collect(b.stream(_with_params("bad", prompt, n=2.5))))


def test_temperature_0_is_greedy_and_top_k_0_is_off_as_in_vllm():
    """vLLM's rules, which /generate and the OpenAI routes applied while the engine refused them
    ("must be > 0", "must be -1 (off) or >= 1"), so an in-process or EP request differed from a
    /generate one: temperature 0 is greedy (the argmax token, the model's own log-softmax as its
    logprob in either logprobs_mode, the seed irrelevant) and top_k 0 is off (as -1)."""
    assert SamplingParams(temperature=0, top_p=0.5, top_k=7).validate() == SamplingParams(
        temperature=1.0, top_k=1, top_p=1.0, logprobs_mode="raw"
    )
    assert SamplingParams(top_k=0).validate().top_k == -1
    assert SamplingParams(temperature=0).logprob_filters() == (1.0, -1, 1.0)
    b = _backend()
    prompt = _prompt(9, 6)
    kw = dict(max_new_tokens=8, stop_token_ids=(), top_logprobs=3)
    outs = b.generate(
        [
            _req("processed", prompt, temperature=0, top_p=0.5, seed=1, **kw),
            _req("raw", prompt, temperature=0, seed=2, logprobs_mode="raw", **kw),
            _req("off0", prompt, temperature=0.8, top_k=0, seed=3, **kw),
            _req("off1", prompt, temperature=0.8, top_k=-1, seed=3, **kw),
        ]
    )
    by = {o.request_id: o for o in outs}
    assert all(o.finish_reason == "length" for o in outs), [o.error for o in outs]
    g = by["processed"]
    ids = torch.tensor([g.prompt_ids + g.output_ids])
    with torch.no_grad():
        logits = MODEL(ids)[0, len(prompt) - 1 : -1]  # [8, V]: the logits each token was chosen from
    assert g.output_ids == logits.argmax(-1).tolist()
    want = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(g.output_ids)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(g.logprobs), want, atol=1e-5) and max(g.logprobs) < -1e-3  # not 0.0
    assert torch.allclose(torch.tensor(g.logprobs), _plain_logprobs(g), atol=1e-5)
    assert by["raw"].output_ids == g.output_ids and by["raw"].logprobs == g.logprobs
    for tops, tok, lp in zip(g.top_logprobs, g.output_ids, g.logprobs):
        assert len(tops) == 3 and tops[0] == (tok, pytest.approx(lp, abs=1e-6))  # the same distribution
    assert by["off0"].output_ids == by["off1"].output_ids and by["off0"].logprobs == by["off1"].logprobs


def test_bad_sample_index_type_fails_alone():
    b = _backend()
    ok = _req("ok", _prompt(5, 1), stop_token_ids=())
    outs = b.generate([_req("b", _prompt(5, 2), sample_index=True), _req("f", _prompt(5, 2), sample_index=1.0), ok])
    by = {o.request_id: o for o in outs}
    assert "sample_index" in by["b"].error and "sample_index" in by["f"].error
    assert by["ok"].output_ids == _backend().generate([ok])[0].output_ids


def _model64():
    return _model().double()


@pytest.mark.parametrize(
    ("dtype", "too_small", "usable"),
    [(torch.float32, 1e-40, 1e-30), (torch.float64, 1e-310, 1e-40)],
)
def test_temperature_below_the_sampler_dtype_floor_is_rejected(dtype, too_small, usable):
    # Issue: a temperature so small that logits / temperature overflowed the compute dtype sampled
    # padding (token 0, 1, ...) with NaN logprobs. Now: rejected, naming the smallest usable value.
    from m3_rollout.engine.interface import min_temperature

    model = MODEL if dtype == torch.float32 else _model64()
    b = NativeBackend(model, [EOS], max_model_len=80, max_num_seqs=16)
    prompt = _prompt(7, 5)
    ok = _req("ok", prompt, stop_token_ids=(), max_new_tokens=6)
    outs = b.generate(
        [
            _req("tiny", prompt, n=2, temperature=too_small, max_new_tokens=6),
            ok,
            _req("small", prompt, stop_token_ids=(), temperature=usable, max_new_tokens=6),
        ]
    )
    by: dict[str, list[SampleOutput]] = {}
    for o in outs:
        by.setdefault(o.request_id, []).append(o)
    floor = min_temperature(dtype)
    assert usable > floor > too_small
    assert [o.finish_reason for o in by["tiny"]] == ["error", "error"]
    err = by["tiny"][0].error
    assert "SamplingParams.temperature" in err and f"{floor:.3g}" in err and "greedy" in err
    assert by["ok"][0].output_ids == b.generate([ok])[0].output_ids
    # A usable tiny temperature samples the argmax token (logprob 0 under the sharpened softmax).
    small = by["small"][0]
    ids = torch.tensor([small.prompt_ids + small.output_ids])
    with torch.no_grad():
        logits = model(ids)[0, len(prompt) - 1 : -1]
    assert small.output_ids == logits.argmax(-1).tolist() and small.logprobs == [0.0] * 6


def test_score_temperature_must_be_finite_positive_and_usable():
    b = _backend()
    ids = _prompt(6, 3)
    for bad in (float("nan"), float("inf"), -1.0, 1e-40, True):
        with pytest.raises(ValueError, match="score temperature"):
            b.score(ids, temperature=bad)
    assert torch.equal(b.score(ids, temperature=2), b.score(ids, temperature=2.0))


def test_score_positions_must_be_integer_indices():
    # A float position was truncated (1.5 scored position 1), a bool taken as 1, a bare int or a
    # string failed inside torch ("'int' object is not iterable", "too many dimensions 'str'"), a
    # nested list gave a 2-D result: each is now a ValueError naming ``score positions``.
    b = _backend()
    ids = _prompt(6, 3)
    for bad in ([1.5], [True], 5, ["a"], [[1, 2]], [None]):
        with pytest.raises(ValueError, match="score positions"):
            b.score(ids, positions=bad)
    with pytest.raises(ValueError, match=r"score positions must be in \[0, 6\)"):
        b.score(ids, positions=[2**70])
    whole = b.score(ids)
    assert torch.equal(b.score(ids, positions=torch.tensor([4, 1])), whole[[4, 1]])  # integer tensors: fine
    assert b.score(ids, positions=[]).shape == (0,)


def test_n_larger_than_max_num_seqs_is_queued_in_groups_within_the_row_limit():
    # Known gap: a group of n > max_num_seqs was admitted whole when nothing else ran, then forked
    # into n running rows. vLLM queues a request's samples; here they run as groups of max_num_seqs.
    prompt = _prompt(9, 6)
    big = _req("big", prompt, n=10, stop_token_ids=(), max_new_tokens=12)
    ok = _req("ok", _prompt(5, 7), stop_token_ids=(), max_new_tokens=12)
    eng = LLMEngine(MODEL, EngineConfig(max_model_len=80, max_num_seqs=4, eos_token_ids=(EOS,)))
    eng.add_request(big)
    eng.add_request(ok)
    outs, most = [], 0
    while eng.has_unfinished():
        outs += [o for o in eng.step() if isinstance(o, SampleOutput)]
        most = max(most, len(eng.scheduler.running), eng.scheduler.num_rows())
    assert most == 4
    got = sorted((o for o in outs if o.request_id == "big"), key=lambda o: o.sample_index)
    ample = _backend().generate([big])  # max_num_seqs=16: one group
    assert [o.sample_index for o in got] == list(range(10)) and all(o.finish_reason == "length" for o in got)
    assert [o.output_ids for o in got] == [o.output_ids for o in ample]
    for x, y in zip(got, ample):
        assert max(abs(p - q) for p, q in zip(x.logprobs, y.logprobs)) < 1e-5
    assert [o.output_ids for o in outs if o.request_id == "ok"] == [o.output_ids for o in _backend().generate([ok])]
    assert eng.metrics()["prefix_cache_hit_tokens"] > 0  # later groups reuse the prompt's full pages


def test_validate_returns_plain_python_values():
    import numpy as np

    p = SamplingParams(n=np.int64(2), temperature=1, top_k=torch.tensor(5), stop_token_ids=[np.int64(3)]).validate()
    assert (p.n, p.temperature, p.top_k, p.stop_token_ids) == (2, 1.0, 5, (3,))
    assert type(p.n) is int and type(p.temperature) is float and type(p.top_k) is int
    assert type(p.stop_token_ids[0]) is int
    assert SamplingParams(n="2").num_outputs == 1 and SamplingParams(n=3).num_outputs == 3


def test_ignore_eos_runs_past_the_eos_token_but_not_past_the_requests_own_stops():
    # vLLM's ignore_eos: the engine's eos ids no longer end the sample; its own stop_token_ids do
    forced = dict(temperature=0, max_new_tokens=4, logit_bias=((EOS, 100.0),))
    prompt = _prompt(6, 5)
    stopped, ran, own = _backend().generate(
        [
            _req("a", prompt, **forced),
            _req("b", prompt, ignore_eos=True, **forced),
            _req("c", prompt, ignore_eos=True, stop_token_ids=(EOS,), **forced),
        ]
    )
    assert (stopped.finish_reason, stopped.output_ids) == ("stop", [EOS])
    assert (ran.finish_reason, ran.output_ids) == ("length", [EOS] * 4)
    assert (own.finish_reason, own.output_ids) == ("stop", [EOS])
    with pytest.raises(ValueError, match="SamplingParams.ignore_eos"):
        SamplingParams(ignore_eos=1).validate()

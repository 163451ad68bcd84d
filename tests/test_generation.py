"""NativeBackend (ported from the skeleton generator's tests): keyed sampling, logprobs the trainer
reproduces, limits, bad requests, in-place all-or-nothing refit."""

import pytest
import torch

from m3_rollout.engine.interface import GenerationRequest, SamplingParams
from m3_rollout.engine.native_backend import NativeBackend
from m3_rollout.model import M3ForCausalLM, tiny_config
from m3_rollout.model.loading import iter_released_tensors
from m3_rollout.weight_sync import LocalWeightSync
from m3_trainers.policy import token_logprobs

EOS = 3


def _model(dtype=torch.float64, seed=0):
    torch.manual_seed(seed)
    cfg = tiny_config(vocab_size=64, max_position_embeddings=256)
    m = M3ForCausalLM(cfg).to(dtype)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.3 if p.ndim >= 2 else 0.1)
    return m.eval()


def _req(rid, prompt, n=1, seed=1, sample_index=0, **kw):
    params = SamplingParams(n=n, seed=seed, max_new_tokens=kw.pop("max_new_tokens", 90), **kw)
    return GenerationRequest(rid, prompt, params, sample_index=sample_index)


def test_samples_independent_of_batch_and_reproducible():
    backend = NativeBackend(_model(), [EOS])
    a = _req("a", [5, 6, 7, 8, 9], n=3)
    b = _req("b", list(range(10, 40)), n=2, seed=9)
    together = backend.generate([a, b])
    alone = backend.generate([a])
    assert [o.output_ids for o in together[:3]] == [o.output_ids for o in alone]
    assert backend.generate([a, b])[3].output_ids == together[3].output_ids
    # The n samples of one request differ, and a continuation keyed as sample 2 equals sample 2.
    assert len({tuple(o.output_ids) for o in together[:3]}) == 3
    single = backend.generate([_req("a2", a.prompt_ids, n=1, sample_index=2)])[0]
    assert single.output_ids == together[2].output_ids and single.sample_index == 2
    # Outputs beyond 64 tokens of context exercise sparse selection (top_k * block = 64).
    assert max(len(o.prompt_ids) + len(o.output_ids) for o in together) > 64


def test_logprobs_match_trainer_recompute():
    model = _model()
    backend = NativeBackend(model, [EOS])
    outs = backend.generate([_req("a", [1, 2, 3, 4, 5, 6], n=4, temperature=0.8)])
    for o in outs:
        ids = torch.tensor([o.prompt_ids + o.output_ids])
        lp = token_logprobs(model, ids, temperature=0.8)[0, len(o.prompt_ids) :]
        assert torch.allclose(lp, torch.tensor(o.logprobs, dtype=lp.dtype), atol=1e-9, rtol=0)
        assert o.finish_reason in ("stop", "length")
        if o.finish_reason == "stop":
            assert o.output_ids[-1] == EOS


def test_stop_and_length_limits():
    backend = NativeBackend(_model(), [EOS], max_model_len=40)
    out = backend.generate([_req("a", list(range(4, 34)), max_new_tokens=50)])[0]
    assert len(out.prompt_ids) + len(out.output_ids) <= 40
    short = backend.generate([_req("b", [4, 5], max_new_tokens=3, stop_token_ids=())])[0]
    assert len(short.output_ids) <= 3
    assert short.finish_reason == ("stop" if EOS in short.output_ids else "length")


def test_bad_requests_fail_alone():
    backend = NativeBackend(_model(), [EOS], max_model_len=32)
    outs = backend.generate(
        [_req("bad", [1, 999]), _req("good", [1, 2, 3]), _req("long", list(range(40))), _req("empty", [])]
    )
    assert outs[0].finish_reason == "error" and "vocabulary" in outs[0].error
    assert outs[1].finish_reason in ("stop", "length") and outs[1].output_ids
    assert outs[2].finish_reason == "error" and "max_model_len" in outs[2].error
    assert outs[3].finish_reason == "error" and "empty" in outs[3].error
    # n < 1 and max_new_tokens < 1: one error record naming the field; the good request still runs.
    outs = backend.generate([_req("x", [1], n=0), _req("y", [1], max_new_tokens=0), _req("good", [1, 2])])
    assert [o.request_id for o in outs] == ["x", "y", "good"]
    assert outs[0].finish_reason == "error" and "n=0" in outs[0].error
    assert outs[1].finish_reason == "error" and "max_new_tokens=0" in outs[1].error
    assert outs[2].finish_reason in ("stop", "length")


def test_update_weights_in_place_and_all_or_nothing():
    gen = _model(torch.float32, seed=0)
    src = _model(torch.float32, seed=1)
    backend = NativeBackend(gen, [EOS])
    with pytest.raises(RuntimeError, match="no weight receiver attached"):
        backend.update_weights(1, iter_released_tensors(src))
    backend.weight_sync = LocalWeightSync(backend.engine)  # what the job's stack builder attaches
    ptrs = {n: t.data_ptr() for n, t in gen.state_dict().items()}
    named = list(iter_released_tensors(src))
    bad = [(n, t.clone()) for n, t in named]
    bad[3] = (bad[3][0], torch.full_like(bad[3][1], float("nan")))
    before = {n: t.clone() for n, t in gen.state_dict().items()}
    with pytest.raises(ValueError, match="non-finite"):
        backend.update_weights(1, bad)
    assert backend.weight_version == 0
    assert all(torch.equal(before[n], t) for n, t in gen.state_dict().items())
    with pytest.raises(ValueError, match="missing"):
        backend.update_weights(1, named[1:])
    backend.update_weights(7, named)
    assert backend.weight_version == 7
    for n, t in gen.state_dict().items():
        assert t.data_ptr() == ptrs[n], n
        assert torch.equal(t, src.state_dict()[n]), n
    assert backend.generate([_req("a", [1, 2])])[0].weight_version == 7
    with pytest.raises(ValueError, match="update version 7 refused: this engine holds version 7"):
        backend.update_weights(7, named)


def test_single_engine_refusals_name_no_rank():
    """The in-process engine is the one receiver of its updates: its refusals used to name
    "receiver 0" and "this rank" although there are no ranks."""
    backend = NativeBackend(_model(torch.float32, seed=0), [EOS])
    backend.weight_sync = LocalWeightSync(backend.engine)
    named = list(iter_released_tensors(_model(torch.float32, seed=1)))
    name, t = named[3]
    nan = named[:3] + [(name, torch.full_like(t, float("nan")))] + named[4:]
    short = named[:3] + [(name, t[:1])] + named[4:]
    for update, why in (
        (nan, f"non-finite values in {name}"),
        (short, f"shape of {name}: update [1, {t.shape[1]}], handshake [{t.shape[0]}, {t.shape[1]}]"),
    ):
        with pytest.raises(ValueError) as exc:
            backend.update_weights(1, update)
        assert str(exc.value) == f"weight update rejected (version 0): weight update 1 rejected:\n  {why}"
    backend.update_weights(2, named)
    with pytest.raises(ValueError) as exc:
        backend.update_weights(2, named)
    assert str(exc.value) == (
        "weight update rejected (version 2): weight update 2 rejected:\n  update version 2 refused: this engine "
        "holds version 2; versions only increase (an update that re-sends the version held must say replace=True)"
    )

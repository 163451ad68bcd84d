"""Weight sync in one process (colocated channel): manifest, buckets, atomic / non-atomic updates,
corrupted updates, prefix-cache reset and in-flight policies on the native engine.

The multi-process gloo broadcast path (EP=1 / EP=2 receivers, sender killed midway, group
rebuild) is tested in test_weight_sync_dist.py.
"""

from __future__ import annotations

import contextlib
import copy
from types import SimpleNamespace

import pytest
import torch

from m3_rollout.engine.config import EngineConfig
from m3_rollout.engine.engine import LLMEngine
from m3_rollout.engine.interface import GenerationRequest, SamplingParams
from m3_rollout.model import M3ForCausalLM, iter_released_tensors, tiny_config
from m3_rollout.parallel import shard_experts
from m3_rollout.weight_sync import (
    ColocatedChannel,
    HandshakeError,
    ReleasedTensors,
    WeightReceiver,
    WeightSender,
    WeightUpdateError,
    plan_buckets,
    receiver_layout,
)
from m3_rollout.weight_sync.buckets import checksum_ok, pack_bucket
from m3_rollout.weight_sync.receiver import UpdateResult
from m3_rollout.weight_sync.rollout_sync import RolloutWeightSync, engine_receiver

BUCKET_MB = 0.05  # ~52 KB: the tiny model (4.2 MB fp32) spans ~80 buckets, tensors split across them


def _model(seed: int) -> M3ForCausalLM:
    torch.manual_seed(seed)
    m = M3ForCausalLM(tiny_config()).float().eval()
    with torch.no_grad():
        for moe in m.moe_layers():
            moe.gate.weight.mul_(8.0)  # sharper routing so expert weights matter
            moe.e_score_correction_bias.normal_(0, 0.1)
    return m


def _params(m):
    return {n: p.detach().clone() for n, p in m.named_parameters()}


def _sender(trainer, receivers, dtype=None, fault=None, named=None):
    return WeightSender(
        named or (lambda: iter_released_tensors(trainer)), ColocatedChannel(receivers), BUCKET_MB, dtype, fault=fault
    )


def _logits(m, ids):
    with torch.no_grad():
        return m(ids).float()


IDS = torch.randint(0, 1024, (2, 37), generator=torch.Generator().manual_seed(5))


# ------------------------------------------------------------------------------ manifest / buckets
def test_manifest_matches_released_order_and_ep_views():
    full = _model(0)
    layout = list(receiver_layout(full))
    ref = list(iter_released_tensors(full))
    assert [(s.name, s.shape, s.dtype) for s, _ in layout] == [(n, tuple(t.shape), t.dtype) for n, t in ref]
    assert all(v.data_ptr() == t.data_ptr() for (_, v), (_, t) in zip(layout, ref))
    # EP=2, rank 1: same list, only experts [4, 8) resolve, to local rows 0..3 (gate rows before up)
    shard = copy.deepcopy(full)
    shard_experts(shard, 1, 2, None)
    ep = list(receiver_layout(shard))
    assert [s for s, _ in ep] == [s for s, _ in layout]
    w13 = shard.model.layers[1].block_sparse_moe.experts.w13
    inter = w13.shape[1] // 2
    views = {s.name: v for s, v in ep}
    base = "language_model.model.layers.1.block_sparse_moe.experts"
    assert views[f"{base}.3.w1.weight"] is None and views[f"{base}.0.w2.weight"] is None
    assert views[f"{base}.5.w1.weight"].data_ptr() == w13[1, :inter].data_ptr()
    assert views[f"{base}.5.w3.weight"].data_ptr() == w13[1, inter:].data_ptr()
    assert torch.equal(views[f"{base}.5.w3.weight"], full.model.layers[1].block_sparse_moe.experts.w13[5, inter:])


def test_bucket_plan_covers_every_element_once_per_dtype():
    m = _model(0).cast_for_inference(torch.bfloat16)
    named = list(iter_released_tensors(m))
    entries = [(tuple(t.shape), t.dtype) for _, t in named]
    cap = 3000
    plan = plan_buckets(entries, cap)
    seen = [torch.zeros(t.numel(), dtype=torch.int32) for _, t in named]
    for b in plan:
        assert b.data_bytes <= cap and b.wire_bytes % 8 == 0
        assert all(entries[s.entry][1] == b.dtype for s in b.segments)  # one dtype per bucket
        for s in b.segments:
            seen[s.entry][s.elem_start : s.elem_start + s.numel] += 1
    assert all(bool((x == 1).all()) for x in seen)
    assert {b.dtype for b in plan} == {torch.bfloat16, torch.float32}  # router stays fp32
    # pack + checksum round trip, and a flipped byte is caught
    buf = torch.empty(plan[0].wire_bytes, dtype=torch.uint8)
    pack_bucket(buf, plan[0], [t for _, t in named])
    assert checksum_ok(buf, plan[0])
    buf[3] ^= 1
    assert not checksum_ok(buf, plan[0])


# ------------------------------------------------------------------------------ updates
@pytest.mark.parametrize("atomic", [True, False])
@pytest.mark.parametrize("ep", [1, 2])
def test_update_bitwise_in_place_and_logits(atomic, ep):
    trainer = _model(1)
    full_rx = _model(0)
    rxs = []
    for r in range(ep):
        m = copy.deepcopy(full_rx)
        if ep > 1:
            shard_experts(m, r, ep, None)
        rxs.append((m, WeightReceiver(m, atomic=atomic)))
    ptrs = [[p.data_ptr() for p in m.parameters()] for m, _ in rxs]
    stats = _sender(trainer, [r for _, r in rxs]).update(7, include_frozen=True)
    assert stats["buckets"] > 10
    want = _params(trainer)
    for (m, rx), ptr in zip(rxs, ptrs):
        assert rx.version == 7 and rx.valid
        assert [p.data_ptr() for p in m.parameters()] == ptr
        for name, p in m.named_parameters():
            if name.endswith(("experts.w13", "experts.w2")):
                a, b = m.get_submodule(name.rsplit(".", 1)[0]).__dict__.get("expert_range", (0, 8))
                assert torch.equal(p, want[name][a:b]), name
            else:
                assert torch.equal(p, want[name]), name
    if ep == 1:
        assert (_logits(rxs[0][0], IDS) - _logits(trainer, IDS)).abs().max() <= 1e-5
    else:  # reassemble the two shards' experts into one unsharded model and compare logits
        whole = copy.deepcopy(full_rx)
        with torch.no_grad():
            for name, p in whole.named_parameters():
                if name.endswith(("experts.w13", "experts.w2")):
                    p.copy_(torch.cat([m.get_parameter(name) for m, _ in rxs]))
                else:
                    p.copy_(rxs[0][0].get_parameter(name))
        assert (_logits(whole, IDS) - _logits(trainer, IDS)).abs().max() <= 1e-5


def test_bf16_wire_keeps_router_fp32():
    trainer = _model(1)
    rx_model = _model(0).cast_for_inference(torch.bfloat16)
    rx = WeightReceiver(rx_model)
    _sender(trainer, [rx], dtype=torch.bfloat16).update(1, include_frozen=True)
    moe = rx_model.moe_layers()[0]
    assert moe.gate.weight.dtype == torch.float32
    assert torch.equal(moe.gate.weight, trainer.moe_layers()[0].gate.weight)  # fp32 bits, not rounded
    assert torch.equal(rx_model.lm_head.weight, trainer.lm_head.weight.to(torch.bfloat16))


def test_frozen_tensors_left_out_by_default():
    trainer, rx_model = _model(1), _model(0)
    bias_before = rx_model.moe_layers()[0].e_score_correction_bias.clone()
    idx_before = rx_model.model.layers[1].self_attn.index_q_proj.weight.clone()
    rx = WeightReceiver(rx_model)
    _sender(trainer, [rx]).update(1)
    assert torch.equal(rx_model.moe_layers()[0].e_score_correction_bias, bias_before)
    assert torch.equal(rx_model.model.layers[1].self_attn.index_q_proj.weight, idx_before)
    assert torch.equal(rx_model.lm_head.weight, trainer.lm_head.weight)


def test_handshake_lists_differences():
    trainer = M3ForCausalLM(tiny_config(intermediate_size=16))
    rx = WeightReceiver(_model(0))
    with pytest.raises(HandshakeError) as exc:
        _sender(trainer, [rx]).handshake()
    msg = str(exc.value)
    assert (
        "shape of language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight: trainer [16, 128], "
        "rollout [32, 128]" in msg
    )
    assert "experts.7.w2.weight" in msg


def _corrupt_cases(trainer):
    name_nan = "language_model.model.layers.2.block_sparse_moe.experts.3.w2.weight"
    name_shape = "language_model.model.layers.1.self_attn.o_proj.weight"
    name_missing = "language_model.model.layers.3.mlp.down_proj.weight"
    name_missing = "language_model.model.layers.3.block_sparse_moe.shared_experts.down_proj.weight"

    def with_nan():
        for n, t in iter_released_tensors(trainer):
            if n == name_nan:
                t = t.clone()
                t[1, 2] = float("nan")
            yield n, t

    def with_bad_shape():
        for n, t in iter_released_tensors(trainer):
            yield n, (t[:, :-1] if n == name_shape else t)

    def without_one():
        return ((n, t) for n, t in iter_released_tensors(trainer) if n != name_missing)

    def flip(k, buf):
        if k == 5:
            buf[10] ^= 0x40

    return [
        ("nan", with_nan, None, f"non-finite values in {name_nan}"),
        ("shape", with_bad_shape, None, f"shape of {name_shape}: update [128, 255], handshake [128, 256]"),
        ("missing", without_one, None, f"missing from update: {name_missing}"),
        (
            "checksum",
            None,
            flip,  # 0.05 MiB = 13107 fp32 elements per bucket: bucket 5 lies inside embed_tokens (131072 elements)
            "bucket 5 (torch.float32, 52428 bytes) checksum mismatch; holds language_model.model.embed_tokens.weight",
        ),
    ]


@pytest.mark.parametrize("case", ["nan", "shape", "missing", "checksum"])
def test_corrupted_update_leaves_atomic_receiver_on_old_version(case):
    trainer, rx_model = _model(1), _model(0)
    rx = WeightReceiver(rx_model, atomic=True, version=3)
    old = _params(rx_model)
    old_logits = _logits(rx_model, IDS)
    _, named, fault, msg = next(c for c in _corrupt_cases(trainer) if c[0] == case)
    sender = _sender(trainer, [rx], fault=fault)
    sender.handshake()  # with the good tensors; the update then carries the corruption
    if named is not None:
        sender.named_tensors = named
    with pytest.raises(WeightUpdateError) as exc:
        sender.update(4)
    assert msg in str(exc.value)
    assert rx.version == 3 and rx.valid
    assert all(torch.equal(p, old[n]) for n, p in rx_model.named_parameters())
    assert torch.equal(_logits(rx_model, IDS), old_logits)
    # the next good update goes through
    _sender(trainer, [rx]).update(5, include_frozen=True)
    assert rx.version == 5 and torch.equal(rx_model.lm_head.weight, trainer.lm_head.weight)


def test_non_atomic_failure_marks_rank_invalid_until_full_update():
    trainer, rx_model = _model(1), _model(0)
    rx = WeightReceiver(rx_model, atomic=False, version=3)
    old_embed = rx_model.model.embed_tokens.weight.clone()

    def flip(k, buf):
        if k == 40:
            buf[0] ^= 1

    with pytest.raises(WeightUpdateError, match="bucket 40 .* checksum mismatch"):
        _sender(trainer, [rx], fault=flip).update(4)
    assert not rx.valid and rx.version == 3
    assert torch.equal(rx_model.model.embed_tokens.weight, trainer.model.embed_tokens.weight)  # bucket 0 landed
    assert not torch.equal(old_embed, trainer.model.embed_tokens.weight)
    _sender(trainer, [rx]).update(5, include_frozen=True)
    assert rx.valid and rx.version == 5


# ------------------------------------------------------------------------------ engine integration
def _engine(model, num_pages=64):
    return LLMEngine(
        model, EngineConfig(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=512, num_pages=num_pages)
    )


def _run(engine, reqs):
    for r in reqs:
        engine.add_request(r)
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    return sorted(outs, key=lambda o: (o.request_id, o.sample_index))


def _colocated_update(engine, trainer, version, policy="abort", recompute_kv=False):
    """One bucketed colocated update through the engine's receiver (its in-flight policy)."""
    rx = engine_receiver(engine, atomic=True, in_flight=policy, recompute_kv_after_update=recompute_kv)
    WeightSender(lambda: iter_released_tensors(trainer), ColocatedChannel([rx]), BUCKET_MB).update(
        version, include_frozen=True
    )
    return rx.in_flight.last


def _req(rid, prompt, n=1, max_new=10, seed=3, sample_index=0):
    return GenerationRequest(rid, list(prompt), SamplingParams(n=n, max_new_tokens=max_new, seed=seed), sample_index)


PROMPT = torch.randint(0, 1024, (70,), generator=torch.Generator().manual_seed(9)).tolist()


def test_prefix_shared_with_pre_update_request_equals_fresh_engine():
    trainer = _model(1)
    follow = _req("b", PROMPT + [11, 12, 13], max_new=8)
    fresh = _run(_engine(copy.deepcopy(trainer)), [follow])

    eng = _engine(_model(0))
    _run(eng, [_req("a", PROMPT, max_new=4)])  # caches PROMPT's 4 full pages under the old weights
    out = _colocated_update(eng, trainer, 1, "abort")
    assert out.result.ok and eng.weight_version == 1
    got = _run(eng, [follow])
    assert got[0].output_ids == fresh[0].output_ids
    assert got[0].logprobs == pytest.approx(fresh[0].logprobs, abs=1e-6)
    assert got[0].token_weight_versions == [1] * len(got[0].output_ids)

    # control: swapping weights WITHOUT the prefix-cache reset reuses stale pages and differs
    stale = _engine(_model(0))
    _run(stale, [_req("a", PROMPT, max_new=4)])
    bare = WeightReceiver(stale.model)  # no in-flight policy: the engine is not told
    _sender(trainer, [bare]).update(1, include_frozen=True)
    bad = _run(stale, [follow])
    assert bad[0].logprobs != pytest.approx(fresh[0].logprobs, abs=1e-6)


def _start(engine, reqs, steps):
    for r in reqs:
        engine.add_request(r)
    outs = []
    for _ in range(steps):
        outs += engine.step()
    return outs


REQS = [_req("r0", PROMPT[:30], max_new=10, seed=1), _req("r1", PROMPT[5:50], n=2, max_new=10, seed=2)]


def test_in_flight_abort_requeues_from_prompt_on_new_weights():
    trainer = _model(1)
    fresh = _run(_engine(copy.deepcopy(trainer)), REQS)
    eng = _engine(_model(0))
    early = _start(eng, REQS, 4)
    out = _colocated_update(eng, trainer, 1, "abort")
    assert out.requeued == 3 and not early
    got = _run(eng, [])
    assert [o.output_ids for o in got] == [o.output_ids for o in fresh]
    assert all(o.token_weight_versions == [1] * len(o.output_ids) for o in got)


def test_in_flight_drain_finishes_on_old_weights():
    trainer, old = _model(1), _model(0)
    ref_old = _run(_engine(copy.deepcopy(old)), REQS)
    eng = _engine(old)
    early = _start(eng, REQS, 4)
    out = _colocated_update(eng, trainer, 1, "drain")
    got = sorted(early + out.outputs, key=lambda o: (o.request_id, o.sample_index))
    assert [o.output_ids for o in got] == [o.output_ids for o in ref_old]
    assert all(o.token_weight_versions == [0] * len(o.output_ids) for o in got)
    assert eng.weight_version == 1 and not eng.has_unfinished()
    assert torch.equal(eng.model.lm_head.weight, trainer.lm_head.weight)


@pytest.mark.parametrize("policy", ["continue", "abort", "drain"])
def test_an_engine_paused_before_an_update_stays_paused_and_a_drain_of_frozen_samples_is_refused(policy):
    """Breaker finding: every policy resumed the engine after the update, lifting its caller's
    pause (``NativeBackend.pause()``, the server's /pause mode=keep: its requests ran on), and
    ``drain`` of an engine paused with unfinished samples stepped forever (no forward runs while
    paused). The pause now holds; the drain is refused, naming the way out, nothing written."""
    trainer, old = _model(1), _model(0)
    eng = _engine(old)
    _start(eng, REQS, 4)
    eng.pause()
    if policy == "drain":
        with pytest.raises(
            WeightUpdateError, match=r"in_flight='drain' refused: the engine is paused with 3 unfinished"
        ):
            _colocated_update(eng, trainer, 1, policy)
        assert eng.weight_version == 0 and eng.weight_writes == 0 and eng.num_unfinished() == 3
        assert not torch.equal(eng.model.lm_head.weight, trainer.lm_head.weight)
    else:
        assert _colocated_update(eng, trainer, 1, policy).result.ok and eng.weight_version == 1
    assert eng.paused and not [o for o in eng.step() if o.finish_reason != "abort"]  # still frozen
    eng.resume()
    got = _run(eng, [])
    assert [(o.request_id, o.sample_index) for o in got] == [("r0", 0), ("r1", 0), ("r1", 1)]
    assert all(o.finish_reason in ("stop", "length") for o in got)


@pytest.mark.parametrize("recompute", [False, True])
def test_in_flight_continue_versions_per_token(recompute):
    trainer = _model(1)
    eng = _engine(_model(0))
    _start(eng, REQS, 4)  # prefill + 3 decode steps: 4 tokens each on version 0
    before = {(s.request_id, s.sample_index): list(s.output_ids) for v in eng._live.values() for s in v}
    out = _colocated_update(eng, trainer, 1, "continue", recompute_kv=recompute)
    assert out.result.ok and eng.weight_writes == 1
    got = _run(eng, [])
    for o in got:
        k = len(before[(o.request_id, o.sample_index)])
        assert k == 4
        assert o.output_ids[:k] == before[(o.request_id, o.sample_index)]
        assert o.token_weight_versions == [0] * k + [1] * (len(o.output_ids) - k)
        # write stamps: 0 before the update; after it 1 where the KV was recomputed under the new
        # weights, -1 where the old KV was kept (no single set of weights reproduces those tokens)
        assert o.token_weight_writes == [0] * k + [1 if recompute else -1] * (len(o.output_ids) - k)
    fresh = _run(eng, [_req("new", PROMPT[:20], max_new=3)])[0]  # admitted after the update: clean KV
    assert fresh.token_weight_writes == [1] * 3
    if recompute:  # KV recomputed under the new weights == a fresh new-weights engine continuing the text
        for o in got:
            cont = _req(
                "c",
                o.prompt_ids + o.output_ids[:4],
                max_new=6,
                seed=o.request_id == "r0" and 1 or 2,
                sample_index=o.sample_index,
            )
            ref = _run(_engine(copy.deepcopy(trainer)), [cont])[0]
            assert o.output_ids[4:] == ref.output_ids
            assert o.logprobs[4:] == pytest.approx(ref.logprobs, abs=1e-5)


def test_weight_writes_count_every_write_and_nothing_else():
    """The engine's weight-write count (stamped on every token) changes with every update that
    writes the weights, one that re-sends the version held (replace=True) included, and stays for
    updates that write nothing (refused, or rolled back byte for byte)."""
    trainer = _model(1)
    eng = _engine(_model(0))
    rx = engine_receiver(eng, atomic=True, in_flight="continue")
    sender = WeightSender(lambda: iter_released_tensors(trainer), ColocatedChannel([rx]), BUCKET_MB)
    assert eng.weight_writes == 0
    assert _run(eng, [_req("a", PROMPT[:20], max_new=3)])[0].token_weight_writes == [0] * 3
    sender.update(0, include_frozen=True)  # a fresh receiver's first update may carry its own version
    assert (eng.weight_version, eng.weight_writes) == (0, 1)
    sender.update(2)
    assert (eng.weight_version, eng.weight_writes) == (2, 2)
    with pytest.raises(WeightUpdateError, match="refused"):
        sender.update(2)  # the same version without replace: refused, nothing written
    assert (eng.weight_version, eng.weight_writes) == (2, 2)
    sender.update(2, replace=True)  # the same version number, written again
    assert (eng.weight_version, eng.weight_writes) == (2, 3)
    out = _run(eng, [_req("b", PROMPT[:20], max_new=3)])[0]
    assert out.token_weight_versions == [2] * 3 and out.token_weight_writes == [3] * 3

    def flip(k, buf):
        if k == 30:
            buf[0] ^= 1

    with pytest.raises(WeightUpdateError):  # atomic: a torn bucket is refused before any byte lands
        WeightSender(lambda: iter_released_tensors(trainer), ColocatedChannel([rx]), BUCKET_MB, fault=flip).update(3)
    assert (eng.weight_version, eng.weight_writes) == (2, 3)


def test_a_write_during_a_chunked_prefill_marks_the_group_and_its_forks():
    """A group leader whose prompt prefill spans a weight write holds KV of both weights: its
    tokens and those of the samples forked from it afterwards are stamped -1; a preemption
    (recompute) clears the mark; a request admitted after the write is clean."""
    eng = LLMEngine(_model(0), EngineConfig(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=16, num_pages=64))
    eng.add_request(_req("g", PROMPT[:40], n=2, max_new=4))
    eng.step()  # the first 16 prompt tokens: KV computed, nothing sampled yet
    eng.count_weight_write()
    outs = _run(eng, [_req("late", PROMPT[:10], max_new=3)])
    by_id = {(o.request_id, o.sample_index): o.token_weight_writes for o in outs}
    assert by_id == {("g", 0): [-1] * 4, ("g", 1): [-1] * 4, ("late", 0): [1] * 3}
    eng.add_request(_req("p", PROMPT[:40], max_new=6))
    for _ in range(4):
        eng.step()  # its prefill and a token or more
    k = len(eng.unfinished_samples("p")[0].output_ids)
    eng.count_weight_write()
    eng.preempt_all()  # KV recomputed under the weights now served: its later tokens are clean
    (out,) = _run(eng, [])
    assert 1 <= k < 6 and out.token_weight_writes == [1] * k + [2] * (6 - k)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_token_in_flight_when_its_sequence_is_preempted_keeps_its_stale_stamp(async_scheduling):
    """With async scheduling a sequence can be preempted (pages freed, ``kv_stale`` cleared) while
    the token it sampled on its stale KV is still on the device: that token must still be stamped
    -1 (it was sampled on KV of the old weights), as the synchronous engine stamps it. Seven pages
    force the preemption of "a" after an in_flight=continue update; a token stamped with the
    current count must be the new weights' own (its logprob is a fresh new-weights scoring's)."""
    trainer = _model(1)
    cfg = EngineConfig(max_model_len=112, max_num_seqs=8, num_pages=7, async_scheduling=async_scheduling)
    eng = LLMEngine(_model(0), cfg)
    eng.add_request(_req("b", PROMPT[:30], max_new=40, seed=1))
    eng.step()
    eng.step()
    eng.add_request(_req("a", PROMPT[30:60], max_new=40, seed=2))
    for _ in range(3):
        eng.step()
    assert _colocated_update(eng, trainer, 1, "continue").result.ok and eng.weight_writes == 1
    a = {o.request_id: o for o in _run(eng, [])}["a"]
    assert eng.scheduler.num_preemptions >= 1
    fresh = a.token_weight_writes.index(1)
    assert a.token_weight_writes == [0] * 3 + [-1] * (fresh - 3) + [1] * (40 - fresh)
    # "a" was preempted once, its KV recomputed under the new weights: from there on its tokens are
    # the new model's, and every token stamped 1 (none sampled on the old KV) is
    assert fresh == 19  # as the synchronous engine stamps them (async scheduling changes no token)
    ref = LLMEngine(copy.deepcopy(trainer), EngineConfig(max_model_len=112, num_pages=16)).score(
        a.prompt_ids + a.output_ids
    )
    p = len(a.prompt_ids)
    assert a.logprobs[fresh:] == pytest.approx(ref[p + fresh :].tolist(), abs=1e-5)


def test_invalid_rank_refuses_requests_until_full_update():
    trainer = _model(1)
    eng = _engine(_model(0))
    _start(eng, REQS, 2)
    rx = engine_receiver(eng, atomic=False, in_flight="continue")
    channel = ColocatedChannel([rx])

    def flip(k, buf):
        if k == 30:
            buf[0] ^= 1

    with pytest.raises(WeightUpdateError):
        WeightSender(lambda: iter_released_tensors(trainer), channel, BUCKET_MB, fault=flip).update(1)
    out = rx.in_flight.last
    assert not out.result.valid and len(out.handed_back) == 3 and not eng._live
    assert eng.weight_writes == 1  # bytes were written: whatever ran before is another model's
    refused = _run(eng, [_req("x", PROMPT[:20])])
    assert refused[0].finish_reason == "error" and "refuses requests" in refused[0].error

    WeightSender(lambda: iter_released_tensors(trainer), channel, BUCKET_MB).update(2, include_frozen=True)
    out = rx.in_flight.last
    assert out.result.valid and eng.weight_version == 2
    served = _run(eng, [_req("x", PROMPT[:20])])
    assert served[0].finish_reason in ("stop", "length") and served[0].token_weight_versions[0] == 2


def test_a_new_receiver_of_an_invalid_engine_keeps_it_refusing_until_an_accepted_update():
    """Breaker finding: after a failed non-atomic update left the engine invalid, a new receiver
    (the server's /init_weight_sync again, a new collective group) started valid, so the next
    REFUSED update cleared the refusal and the engine served the half-written weights."""
    trainer = _model(1)
    eng = _engine(_model(0))
    flip = _flip_on_receiver(30)
    rx = engine_receiver(eng, atomic=False, in_flight="continue")
    rx.fault = flip
    with pytest.raises(WeightUpdateError, match="checksum mismatch"):  # non-atomic: bytes written
        _sender(trainer, [rx]).update(1, include_frozen=True)
    assert eng.refuse_reason is not None and eng.weight_writes == 1
    rejoined = engine_receiver(eng, atomic=True, in_flight="continue")  # a new group: a new receiver
    rejoined.fault = flip
    with pytest.raises(WeightUpdateError, match="checksum mismatch"):  # refused: nothing written
        _sender(trainer, [rejoined]).update(1, include_frozen=True)
    refused = _run(eng, [_req("x", PROMPT[:20])])
    assert refused[0].finish_reason == "error" and "refuses requests" in refused[0].error  # was served
    rejoined.fault = None
    _sender(trainer, [rejoined]).update(1, include_frozen=True)  # accepted: repaired
    assert eng.refuse_reason is None and eng.weight_version == 1
    served = _run(eng, [_req("x", PROMPT[:20])])
    assert served[0].finish_reason in ("stop", "length") and served[0].token_weight_versions[0] == 1


def test_a_new_receiver_keeps_the_version_rule_after_an_accepted_update():
    """Fresh-user finding: a new weight-sync group (a new HTTPBackend, /init_weight_sync again) built
    a receiver that took the version the engine held as a loaded checkpoint's, so the version an
    earlier group had sent was accepted again without ``replace`` (and written)."""
    trainer = _model(1)
    eng = _engine(_model(0))
    fresh = engine_receiver(eng, atomic=True, in_flight="continue")
    _sender(trainer, [fresh]).update(0, include_frozen=True)  # the loaded checkpoint's version: allowed once
    _sender(trainer, [fresh]).update(1)
    assert eng.weight_version == 1 and eng.weight_writes == 2
    rejoined = engine_receiver(eng, atomic=True, in_flight="continue")  # a new group: a new receiver
    with pytest.raises(WeightUpdateError, match="update version 1 refused: .* holds version 1; versions only increase"):
        _sender(trainer, [rejoined]).update(1, include_frozen=True)
    assert eng.weight_writes == 2 and eng.weight_version == 1  # nothing written
    _sender(trainer, [rejoined]).update(1, include_frozen=True, replace=True)  # a re-send that says so
    assert eng.weight_writes == 3 and eng.weight_version == 1
    _sender(trainer, [rejoined]).update(2)
    assert eng.weight_version == 2


def test_build_weight_sender_colocated_follows_freeze_config():
    from m3_rollout.config import FreezeConfig, WeightSyncConfig
    from m3_trainers.policy import Policy
    from m3_trainers.weight_sender import build_weight_sender

    trainer, rx_model = _model(1), _model(0)
    bias_before = rx_model.moe_layers()[0].e_score_correction_bias.clone()
    rx = WeightReceiver(rx_model)
    cfg = WeightSyncConfig(method="colocated", bucket_size_mb=BUCKET_MB)
    sender = build_weight_sender(Policy(trainer, lr=1e-3), cfg, None, FreezeConfig(router_bias=True), receivers=[rx])
    sender.update(1)
    assert torch.equal(rx_model.moe_layers()[0].e_score_correction_bias, bias_before)  # frozen: not sent
    assert torch.equal(rx_model.lm_head.weight, trainer.lm_head.weight)
    with pytest.raises(ValueError, match="weight_sync.method=broadcast needs a WeightSyncGroup"):
        build_weight_sender(Policy(trainer, lr=1e-3), WeightSyncConfig(method="broadcast"), None)


# ------------------------------------------------------------------------------ bench, colocated mode
def _bench_module():
    from script_loader import load_script  # tests/ on sys.path

    return load_script("bench_weight_sync")


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    ints = {torch.bfloat16: torch.int16, torch.float32: torch.int32}
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(ints[a.dtype]), b.view(ints[b.dtype]))


def test_bench_colocated_update_bitwise_in_place_on_cpu():
    bench = _bench_module()
    cfg = tiny_config()
    master, cast = bench.trainer_pair(cfg, torch.bfloat16, "cpu")  # fp32 masters + bf16 copy (router fp32)
    trainer = cast.copy
    rollout = bench.build_model(0, torch.bfloat16, "cpu", cfg=cfg)
    ptrs = {n: p.data_ptr() for n, p in rollout.named_parameters()}
    bucket_mb = 0.25
    r = bench.run_colocated(cast, rollout, bucket_mb, repeats=1)

    for name, p in rollout.named_parameters():  # independent check of what run_colocated reports
        assert _bits_equal(p, dict(trainer.named_parameters())[name]), name
        assert _bits_equal(p, dict(master.named_parameters())[name].to(p.dtype)), name
        assert p.data_ptr() == ptrs[name], name
    n_params = len(ptrs)
    for mode in bench.DIRECT_MODES:
        c = r["checks"][mode]
        assert c["ok"] and c["mismatched"] == [] and c["moved"] == [] and c["mismatched_before"] == n_params
        assert c["verdict"] == ("attested" if mode.endswith("attested") else "checked")
    assert r["checks"]["cast"]["ok"]
    released = list(iter_released_tensors(trainer))
    assert r["tensors"] == len(released)
    assert r["bytes"] == sum(t.numel() * t.element_size() for _, t in released)
    cap = int(bucket_mb * 2**20)
    per_dtype: dict = {}
    for _, t in released:
        per_dtype[t.dtype] = per_dtype.get(t.dtype, 0) + t.numel() * t.element_size()
    assert set(per_dtype) == {torch.bfloat16, torch.float32}
    assert r["buckets"] == sum(-(-n // cap) for n in per_dtype.values())
    modes = bench.COLOCATED_MODES + bench.CAST_MODES
    assert all(len(r["all"][m]) == 1 and r["seconds"][m] > 0 for m in modes)
    assert set(r["host"]) == set(bench.DIRECT_MODES) and all(0 < r["host"][m] <= r["seconds"][m] for m in r["host"])

    # the bitwise check catches a sign-of-zero flip in one element (torch.equal on values would not)
    w = rollout.lm_head.weight
    with torch.no_grad():
        w.view(-1)[0] = 0.0
        trainer.lm_head.weight.view(-1)[0] = -0.0
    assert bench.sync_mismatches(trainer, rollout) == ["lm_head.weight"]


def test_bench_synthetic_config_scales_to_target_size():
    bench = _bench_module()
    default = bench.synthetic_config()
    assert (default.hidden_size, default.num_hidden_layers) == (1024, 5)
    cfg = bench.synthetic_config(0.05)
    with torch.device("meta"):
        m = M3ForCausalLM(cfg)
    m.cast_for_inference(torch.bfloat16)
    nbytes = sum(p.numel() * p.element_size() for p in m.parameters())
    assert abs(nbytes - 0.05e9) < 0.15 * 0.05e9
    assert cfg.moe_layer_freq[0] == 0 and all(cfg.moe_layer_freq[1:])  # dense layer 0, MoE after
    with pytest.raises(ValueError, match="--gb"):
        bench.synthetic_config(0)


def test_bench_real_shapes_plan_picks_the_largest_slice_that_fits():
    """--real-shapes (issue 25): M3's released layer shapes, the MoE-layer count from --gb or the
    largest whose model + wire buffers fit every GPU and whose pinned atomic stages fit the host."""
    bench = _bench_module()
    gib, bucket = 2**30, 64 * 2**20
    cfg = bench.real_shapes_config(1)
    assert (cfg.hidden_size, cfg.num_local_experts, cfg.num_experts_per_tok, cfg.intermediate_size) == (
        6144,
        128,
        4,
        3072,
    )
    assert cfg.moe_layer_freq == [0, 1] and cfg.num_attention_heads == 64 and cfg.num_key_value_heads == 4
    one, two = bench.rank_bytes(cfg), bench.rank_bytes(bench.real_shapes_config(2))
    experts = 128 * 3 * 6144 * 3072 * 2  # bf16 routed experts of one MoE layer: 14.5 GB
    assert experts < two - one < experts + 0.5e9
    assert bench.rank_bytes(cfg, 2) < one - experts // 2 + 1e6  # an EP=2 receiver holds half the experts
    # GPUs with room for two MoE layers (~31 GB) but not three (~46 GB): two, both ends planned
    plan = bench.real_shapes_plan(None, [40 * gib, 40 * gib], 500 * gib, 1, False, bucket)
    assert plan["moe_layers"] == 2 and plan["bytes"] == two
    assert plan["gpu_need"] == [two + 8 * bucket + bench.GPU_RESERVE] * 2 and plan["host_need"] == two
    # --gb: the count closest to it; the host's pinned stages bound it too
    assert bench.real_shapes_plan(10, [40 * gib] * 2, 500 * gib, 1, False, bucket)["moe_layers"] == 1
    with pytest.raises(SystemExit, match=r"2 MoE layer\(s\).*host: the 3 pinned atomic stage\(s\)"):
        bench.real_shapes_plan(31, [40 * gib] * 4, 80 * gib, 3, False, bucket)
    with pytest.raises(SystemExit, match=r"GPU 1: 10\.0 GiB free"):
        bench.real_shapes_plan(None, [40 * gib, 10 * gib], 500 * gib, 1, False, bucket)


# ------------------------------------------------------------------------------ versions, consistency, probe
def test_versions_only_increase_unless_the_update_replaces():
    trainer, rx_model = _model(1), _model(0)
    rx = WeightReceiver(rx_model, version=0)
    sender = _sender(trainer, [rx])
    sender.update(0, include_frozen=True)  # a fresh receiver's first update may carry its own version
    sender.update(5)
    for bad, why in ((5, "this engine holds version 5"), (4, "this engine holds version 5"), (-1, "versions are >= 0")):
        with pytest.raises(WeightUpdateError, match=f"update version {bad} refused: {why}"):
            sender.update(bad)
        assert rx.version == 5 and rx.valid
    sender.update(5, replace=True)  # explicitly re-sending the version held is allowed
    assert rx.version == 5
    for bad in (6.5, True, "7", 2**70):  # 6.5 became 6, True became 1, 2**70 locked later versions out
        with pytest.raises(WeightUpdateError, match=r"must be an integer below 2\*\*62"):
            sender.update(bad)
        assert rx.version == 5 and rx.valid


def test_a_non_float_trainer_tensor_is_refused_naming_it():
    """An int32 tensor used to be cast into the float parameter (truncated to zeros) and accepted."""
    trainer, rx_model = _model(1), _model(0)
    rx = WeightReceiver(rx_model, version=0)
    name = "language_model.model.layers.0.self_attn.v_proj.weight"
    tensors = dict(iter_released_tensors(trainer))
    sender = WeightSender(lambda: tensors.items(), ColocatedChannel([rx]), BUCKET_MB)
    sender.update(1, include_frozen=True)
    before = {n: t.clone() for n, t in iter_released_tensors(rx_model)}
    tensors[name] = (tensors[name] * 10).to(torch.int32)
    with pytest.raises(WeightUpdateError, match=f"trainer tensor {name.replace('.', '[.]')}: dtype torch.int32"):
        sender.update(2)
    assert rx.version == 1 and all(torch.equal(t, before[n]) for n, t in iter_released_tensors(rx_model))


@pytest.mark.parametrize("direct", [True, False])
def test_non_atomic_failure_on_one_rank_moves_no_rank(direct):
    """EP=2, non-atomic: the NaN sits in an expert only receiver 1 owns. Receiver 0 must not end on
    the new version while receiver 1 stays on the old one."""
    trainer = _model(1)
    ms, rxs = [], []
    for r in range(2):
        m = _model(0)
        shard_experts(m, r, 2, None)
        ms.append(m)
        rxs.append(WeightReceiver(m, atomic=False, version=1))
    name = "language_model.model.layers.2.block_sparse_moe.experts.6.w1.weight"

    def named():
        for n, t in iter_released_tensors(trainer):
            yield n, (t.clone().fill_(float("nan")) if n == name else t)

    sender = WeightSender(named, ColocatedChannel(rxs, direct=direct), BUCKET_MB)
    with pytest.raises(WeightUpdateError, match=f"receiver 1: non-finite values in {name.replace('.', '[.]')}"):
        sender.update(2, include_frozen=True)
    results = sender.channel.results
    assert [r.version for r in results] == [1, 1] and [rx.version for rx in rxs] == [1, 1]
    assert not any(r.ok for r in results)
    assert not rxs[0].valid  # it wrote the update's bytes: it refuses requests until a full update
    _sender(trainer, rxs).update(3, include_frozen=True)
    assert [rx.version for rx in rxs] == [3, 3] and all(rx.valid for rx in rxs)


def _permute_experts(rx) -> None:
    """A deliberately wrong expert layout: experts 2 / 5 of layer 1 and 0 / 7 of layer 2 land in
    each other's slots (every byte is intact, so checksums and finite checks pass). Twice = undone."""
    for layer, a, b in ((1, 2, 5), (2, 0, 7)):
        stem = f"language_model.model.layers.{layer}.block_sparse_moe.experts"
        for w in ("w1", "w2", "w3"):
            na, nb = f"{stem}.{a}.{w}.weight", f"{stem}.{b}.{w}.weight"
            rx.views[na], rx.views[nb] = rx.views[nb], rx.views[na]


@pytest.mark.parametrize("atomic", [True, False])
def test_probe_catches_a_permuted_expert(atomic):
    from m3_rollout.weight_sync import ProbeSettings, model_scorer

    trainer = _model(1)
    eng = _engine(_model(0))
    rx = engine_receiver(eng, atomic=atomic)
    probe = ProbeSettings(num_prompts=2, num_tokens=24, threshold=1e-3)
    sender = WeightSender(
        lambda: iter_released_tensors(trainer),
        ColocatedChannel([rx], direct=True),
        probe=probe,
        reference=model_scorer(trainer),
    )
    stats = sender.update(1, include_frozen=True)
    assert stats["probe_drift"] is not None and stats["probe_drift"] < 1e-5  # fp32 both ends
    assert rx.in_flight.last.result.probe_drift == stats["probe_drift"]
    good = _params(eng.model)
    # the next update is written with two expert pairs swapped
    with torch.no_grad():
        trainer.lm_head.weight.mul_(1.5)
    _permute_experts(rx)
    with pytest.raises(WeightUpdateError, match=r"probe drift .* > weight_sync.probe.threshold=0.001") as exc:
        sender.update(2)
    drift = float(str(exc.value).split("probe drift ")[1].split(" ")[0])
    assert drift > 1e-3
    if atomic:  # rolled back: the weights and version of update 1 (bitwise: no write counted)
        assert rx.version == 1 and rx.valid and eng.weight_version == 1 and eng.refuse_reason is None
        assert eng.weight_writes == 1
        assert all(torch.equal(p, good[n]) for n, p in eng.model.named_parameters())
    else:  # written in place: the rank is invalid and refuses requests
        assert rx.version == 1 and not rx.valid and eng.refuse_reason is not None
    _permute_experts(rx)  # the layout fixed, the update goes through
    stats = sender.update(3)
    assert rx.version == 3 and rx.valid and stats["probe_drift"] < 1e-5 and eng.refuse_reason is None


# ------------------------------------------------------------------------------ bucket pipeline
def test_packer_matches_reference_packing_and_follows_in_place_updates():
    """The fused packer (cached per bucket and buffer) writes the bytes the per-segment reference
    writes: fp32 sources cast to a bf16 wire, the router kept fp32, a non-contiguous source
    packed through the fallback; after the sources change in place, the cached passes see it."""
    from m3_rollout.weight_sync.buckets import BucketPacker

    m = _model(3)
    named = list(iter_released_tensors(m))
    wire = [torch.float32 if "gate.weight" in n or "correction_bias" in n else torch.bfloat16 for n, _ in named]
    sources = [t.detach() for _, t in named]
    k_t = next(i for i, (n, t) in enumerate(named) if t.ndim == 2 and t.shape[0] != t.shape[1])
    sources[k_t] = sources[k_t].t().contiguous().t()  # same values, column-major: not contiguous
    assert not sources[k_t].is_contiguous()
    plan = plan_buckets([(tuple(t.shape), dt) for t, dt in zip(sources, wire)], 20000)
    assert {b.dtype for b in plan} == {torch.bfloat16, torch.float32} and len(plan) > 20
    packer = BucketPacker(plan, sources)
    bufs = [torch.empty(max(b.wire_bytes for b in plan), dtype=torch.uint8) for _ in range(3)]
    ref = torch.empty_like(bufs[0])
    for step in range(2):
        for k, b in enumerate(plan):
            buf = bufs[k % 3][: b.wire_bytes]
            packer.pack(k, buf)
            pack_bucket(ref, b, sources)
            assert torch.equal(buf, ref[: b.wire_bytes]), (step, k)
            assert checksum_ok(buf, b)
        with torch.no_grad():
            for t in sources:
                t.mul_(-1.5)  # in place: the same storages, new values


def _flip_on_receiver(bucket: int, at: int = 10):
    def fault(k, buf):
        if k == bucket:
            buf[at] ^= 0x40

    return fault


@pytest.mark.parametrize("atomic", [True, False])
def test_receiver_side_corruption_fails_naming_the_tensor(atomic):
    """Bytes flipped after the bucket arrived (a receiver-side hook, past the sender's checksum):
    the device checksum comparison fails the update naming the bucket's tensor; atomic keeps the
    old weights and version, non-atomic turns invalid; the next good update repairs both."""
    trainer, rx_model = _model(1), _model(0)
    rx = WeightReceiver(rx_model, atomic=atomic, version=3)
    old = _params(rx_model)
    rx.fault = _flip_on_receiver(5)
    with pytest.raises(WeightUpdateError) as exc:
        _sender(trainer, [rx]).update(4)
    msg = "\n  bucket 5 (torch.float32, 52428 bytes) checksum mismatch; holds "  # one receiver: no label
    msg += "language_model.model.embed_tokens.weight"
    assert msg in str(exc.value) and "non-finite" not in str(exc.value)
    assert rx.version == 3
    if atomic:
        assert rx.valid and all(torch.equal(p, old[n]) for n, p in rx_model.named_parameters())
    else:
        assert not rx.valid
    rx.fault = None
    _sender(trainer, [rx]).update(5, include_frozen=True)
    assert rx.version == 5 and rx.valid
    assert all(torch.equal(p, trainer.get_parameter(n)) for n, p in rx_model.named_parameters())


@pytest.mark.parametrize("atomic", [True, False])
def test_nan_and_overflow_are_refused_naming_the_tensors(atomic):
    """A NaN in one tensor and an fp32 value that overflows the bf16 wire in another: both named;
    atomic keeps the old weights, non-atomic is invalid; the checksums pass (sent faithfully)."""
    trainer = _model(1)
    rx_model = _model(0).cast_for_inference(torch.bfloat16)  # router stays fp32
    rx = WeightReceiver(rx_model, atomic=atomic, version=1)
    old = _params(rx_model)
    nan_name = "language_model.model.layers.2.block_sparse_moe.experts.3.w2.weight"
    big_name = "language_model.model.layers.1.self_attn.o_proj.weight"

    def named():
        for n, t in iter_released_tensors(trainer):
            if n in (nan_name, big_name):
                t = t.clone()
                t.view(-1)[-1] = float("nan") if n == nan_name else 3.4e38  # finite fp32, +inf in bf16
            yield n, t

    sender = WeightSender(named, ColocatedChannel([rx]), BUCKET_MB, torch.bfloat16)
    with pytest.raises(WeightUpdateError) as exc:
        sender.update(2)
    msg = str(exc.value)
    assert f"non-finite values in {nan_name}" in msg and f"non-finite values in {big_name}" in msg
    assert "checksum" not in msg and msg.count("non-finite") == 2
    assert rx.version == 1 and rx.valid == atomic
    if atomic:
        assert all(torch.equal(p, old[n]) for n, p in rx_model.named_parameters())


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


@contextlib.contextmanager
def _no_host_reads():
    """Any tensor -> host read inside the block raises (item, tolist, bool, int, float, cpu, numpy)."""

    def refuse(*_a, **_k):
        raise AssertionError("host read of a tensor inside on_bucket")

    with pytest.MonkeyPatch.context() as mp:
        for name in ("item", "tolist", "__bool__", "__int__", "__float__", "cpu", "numpy"):
            mp.setattr(torch.Tensor, name, refuse)
        yield


@pytest.mark.parametrize("atomic", [True, False])
def test_bucket_update_reads_its_verdict_on_the_host_once(monkeypatch, atomic):
    """Whatever the number of buckets: no host read while buckets arrive (on_bucket), and one read
    of the accumulated verdict per update, a failed update included."""
    from m3_rollout.weight_sync import unpack

    reads = []
    real_read = unpack.read_verdict
    monkeypatch.setattr(unpack, "read_verdict", lambda t: reads.append(t.numel()) or real_read(t))
    real_on_bucket = WeightReceiver.on_bucket

    def strict_on_bucket(self, k, buf, ready=None):
        with _no_host_reads():
            real_on_bucket(self, k, buf, ready)

    monkeypatch.setattr(WeightReceiver, "on_bucket", strict_on_bucket)
    trainer, rx_model = _model(1), _model(0)
    rx = WeightReceiver(rx_model, atomic=atomic, version=0)
    buckets = []
    version = 0
    for bucket_mb in (BUCKET_MB, 1.0, BUCKET_MB):  # the first update builds the layout, the last reuses it
        version += 1
        reads.clear()
        sender = WeightSender(lambda: iter_released_tensors(trainer), ColocatedChannel([rx]), bucket_mb)
        stats = sender.update(version, include_frozen=True)
        assert len(reads) == 1 and rx.version == version
        buckets.append(stats["buckets"])
    assert buckets[0] > 50 and buckets[1] < 10
    assert all(torch.equal(p, trainer.get_parameter(n)) for n, p in rx_model.named_parameters())
    reads.clear()
    rx.fault = _flip_on_receiver(7)
    with pytest.raises(WeightUpdateError, match="bucket 7 .* checksum mismatch"):
        _sender(trainer, [rx]).update(version + 1)
    assert len(reads) == 1


def test_bucket_pack_and_unpack_through_the_copy_kernel_under_the_interpreter(monkeypatch):
    """The fused passes as they run on a GPU (copy_plan's Triton kernel, here under
    TRITON_INTERPRET=1 in fp32 / fp16): odd-sized tensors split across buckets at unaligned byte
    offsets, fp32 sources cast to an fp16 wire, partial ownership (an EP rank); the packed bytes
    equal the reference packing, the owned destinations equal the sources as cast, and a value
    that overflows fp16 is named."""
    import os

    from m3_rollout.weight_sync import copy_plan
    from m3_rollout.weight_sync.buckets import BucketPacker
    from m3_rollout.weight_sync.ring import BucketRing
    from m3_rollout.weight_sync.unpack import BucketUnpack

    if os.environ.get("TRITON_INTERPRET") != "1" or copy_plan.triton is None:
        pytest.skip("runs the Triton kernel under the interpreter (CPU machines)")
    kernel_plans = []
    monkeypatch.setattr(copy_plan, "_use_triton", lambda device: kernel_plans.append(device) or True)
    g = torch.Generator().manual_seed(0)
    sizes = [37, 5000, 3, 20001, 777]
    sources = [torch.randn(n, generator=g) for n in sizes]
    plan = plan_buckets([((n,), torch.float16) for n in sizes], 2 * 9001)  # 9001 fp16 elements per bucket
    assert len(plan) == 3 and any(s.byte_offset % 16 for b in plan for s in b.segments)
    ring = BucketRing("cpu", 3)
    ring.reserve(max(b.wire_bytes for b in plan))
    packer = BucketPacker(plan, sources)
    ref = torch.empty(max(b.wire_bytes for b in plan), dtype=torch.uint8)
    dests = [torch.zeros(n, dtype=torch.float16) if i != 2 else None for i, n in enumerate(sizes)]  # 2: not ours
    unpack = BucketUnpack(plan, dests, [f"t{i}" for i in range(len(sizes))], ring)
    for bad in (False, True):
        if bad:
            sources[3][12345] = 1e6  # finite in fp32, +inf in fp16
        unpack.start(atomic=False, stage=None)
        for k, b in enumerate(plan):
            buf = ring.buffer(k, b.wire_bytes)
            packer.pack(k, buf)
            pack_bucket(ref, b, sources)
            assert torch.equal(buf, ref[: b.wire_bytes].view(torch.uint8)), k
            unpack.receive(k, buf)
        bad_sums, names = unpack.verdict()
        assert bad_sums == [] and names == (["t3"] if bad else [])
        assert len(kernel_plans) == 2 * len(plan)  # one pack and one unpack pass per bucket, built once
        for i, d in enumerate(dests):
            if d is not None:
                assert torch.equal(d.view(torch.int16), sources[i].to(torch.float16).view(torch.int16)), i


# ------------------------------------------------------------------ the pipeline's CUDA branches, faked on a CPU
def _loopback(trainer, rx_model, atomic, bucket_mb, dtype=None, version=0):
    rx = WeightReceiver(rx_model, atomic=atomic, version=version)
    source = ReleasedTensors(trainer)
    sender = WeightSender(lambda: source, ColocatedChannel([rx]), bucket_mb, dtype)
    return rx, sender


@pytest.mark.parametrize("atomic", [True, False])
def test_cuda_branches_of_the_loopback_pipeline_bitwise_with_fixed_work_per_bucket(monkeypatch, atomic):
    """The pipeline as it runs on a GPU (side / transfer streams, one reusable event per slot, the
    copy kernel, here Triton's interpreter on fp32 -> fp16): the rollout equals the trainer's cast
    bitwise, twice (the second update on every cached pass); a steady update creates no event,
    synchronizes no stream, reads the verdict once, and its stream / event work grows by the same
    amount per bucket (nothing per update beyond a constant)."""
    import os

    from fake_cuda import fake_pipeline

    from m3_rollout.weight_sync import unpack

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs the copy kernel under Triton's interpreter (CPU machines)")
    fake = fake_pipeline(monkeypatch)
    reads = []
    real_read = unpack.read_verdict
    monkeypatch.setattr(unpack, "read_verdict", lambda t: reads.append(t.numel()) or real_read(t))
    trainer = _model(1)
    per_config = []
    for bucket_mb in (BUCKET_MB, 1.0):
        rx_model = _model(0).cast_for_inference(torch.float16)  # router stays fp32
        rx, sender = _loopback(trainer, rx_model, atomic, bucket_mb, torch.float16)
        for version in (1, 2):
            fake.calls.clear()
            reads.clear()
            stats = sender.update(version, include_frozen=True)
            assert rx.version == version and rx.valid and len(reads) == 1
            want = dict(trainer.named_parameters())
            for n, p in rx_model.named_parameters():
                assert torch.equal(_bits(p), _bits(want[n].to(p.dtype))), n
            with torch.no_grad():
                for p in trainer.parameters():
                    p.mul_(-0.5)
        assert fake.calls["event_created"] == 0 and fake.calls["stream_synchronize"] == 0
        per_config.append((stats["buckets"], dict(fake.calls)))
    (n1, c1), (n2, c2) = per_config
    assert n1 > 3 * n2 > 0
    for op in ("record", "wait_event", "switch"):
        per_bucket = (c1[op] - c2[op]) / (n1 - n2)
        assert per_bucket == int(per_bucket) and c1[op] - per_bucket * n1 < 12, (op, c1[op], c2[op])


_HOST_READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy", "nonzero")


@pytest.mark.parametrize("atomic", [True, False])
@pytest.mark.parametrize("pipeline", ["cuda branches", "host"])
def test_no_host_read_in_a_bucketed_update_but_the_verdict(monkeypatch, atomic, pipeline):
    """A guard for the one-sync rule: during a whole bucketed update (sender, loopback channel,
    receiver: every bucket, the status and the commit) no tensor is read on the host except by
    the verdict (``BucketUnpack.verdict``: its ``read_verdict``, then the host copy), for many
    buckets and few, on the host path and on the CUDA branches (faked streams, stub kernel).
    Any ``item`` / ``tolist`` / ``bool`` / ``cpu`` / ``nonzero`` / ``.to("cpu")`` elsewhere raises."""
    from fake_cuda import fake_pipeline

    from m3_rollout.weight_sync import unpack

    if pipeline == "cuda branches":
        fake_pipeline(monkeypatch, kernel="stub")
    allowed = {"depth": 0}
    reads = []
    real_read, real_verdict = unpack.read_verdict, unpack.BucketUnpack.verdict

    def verdict(self):
        allowed["depth"] += 1
        try:
            return real_verdict(self)
        finally:
            allowed["depth"] -= 1

    def counted_read(t):
        reads.append(t.numel())
        return real_read(t)

    monkeypatch.setattr(unpack.BucketUnpack, "verdict", verdict)
    monkeypatch.setattr(unpack, "read_verdict", counted_read)
    trainer, rx_model = _model(1), _model(0)
    rx = WeightReceiver(rx_model, atomic=atomic, version=0)
    source = ReleasedTensors(trainer)

    def guarded(name, real):
        def method(self, *args, **kwargs):
            if guard["on"] and not allowed["depth"]:
                raise AssertionError(f"host read Tensor.{name} during a bucketed update")
            return real(self, *args, **kwargs)

        return method

    def guarded_to(self, *args, **kwargs):
        target = kwargs.get("device", args[0] if args else None)
        if guard["on"] and not allowed["depth"] and str(target).startswith("cpu"):
            raise AssertionError("host read Tensor.to('cpu') during a bucketed update")
        return real_to(self, *args, **kwargs)

    guard = {"on": False}
    real_to = torch.Tensor.to
    for name in _HOST_READS:
        monkeypatch.setattr(torch.Tensor, name, guarded(name, getattr(torch.Tensor, name)))
    monkeypatch.setattr(torch.Tensor, "to", guarded_to)
    version, counts = 0, []
    for bucket_mb in (BUCKET_MB, 1.0, BUCKET_MB):
        sender = WeightSender(lambda: source, ColocatedChannel([rx]), bucket_mb)
        for _ in range(2):  # the first builds the layout (not guarded), the second is a steady update
            version += 1
            reads.clear()
            guard["on"] = _ == 1
            stats = sender.update(version, include_frozen=True)
            guard["on"] = False
            assert len(reads) == 1 and rx.version == version
        counts.append(stats["buckets"])
    assert counts[0] > 50 and counts[1] < 10


NAN_NAME = "language_model.model.layers.2.block_sparse_moe.experts.6.w3.weight"


@pytest.mark.parametrize("atomic", [True, False])
def test_one_host_sync_per_bucketed_update_whatever_the_outcome(monkeypatch, atomic):
    """The one-sync rule counted as a GPU would see it (``fake_cuda.HostSyncs``: the CPU tensors
    stand for device memory, the pinned stage for host memory), on the pipeline's CUDA branches
    (fake streams, the copy plans' torch path, real bytes): a steady update, an update with a
    non-finite value (named) and an update torn on the receiver (the bucket named) each
    synchronize the host exactly once, the verdict read, on either atomic setting. A failure is
    named from that same read (per-segment flags), not by a second look at the device: before,
    a non-atomic rank re-checked the parameters it had written (three more syncs)."""
    from fake_cuda import HostSyncs, fake_pipeline

    fake = fake_pipeline(monkeypatch, kernel="torch")
    syncs = HostSyncs(monkeypatch, fake)
    trainer, rx_model = _model(1), _model(0)
    rx, sender = _loopback(trainer, rx_model, atomic, BUCKET_MB)
    before = _params(rx_model)
    sender.update(1, include_frozen=True)  # builds the layout and the passes (not counted)
    with syncs:
        stats = sender.update(2, include_frozen=True)
    assert syncs.count == 1, syncs.sites
    assert stats["buckets"] > 50 and rx.version == 2 and rx.valid
    assert all(torch.equal(p, trainer.get_parameter(n)) for n, p in rx_model.named_parameters())
    assert not all(torch.equal(p, before[n]) for n, p in rx_model.named_parameters())

    target = dict(iter_released_tensors(trainer))[NAN_NAME]
    with torch.no_grad():
        target.view(-1)[3] = float("nan")  # in place: the sender's cached sources see it
    kept = _params(rx_model)
    with syncs, pytest.raises(WeightUpdateError) as exc:
        sender.update(3, include_frozen=True)
    assert syncs.count == 1, syncs.sites
    msg = str(exc.value)
    assert f"\n  non-finite values in {NAN_NAME}" in msg and msg.count("non-finite") == 1
    assert "checksum" not in msg
    assert rx.version == 2 and rx.valid == atomic
    if atomic:
        assert all(torch.equal(p, kept[n]) for n, p in rx_model.named_parameters())
    else:  # the bad bucket's bytes landed: this rank says so and refuses requests
        errors = sender.channel.results[0].errors
        assert "update 3 failed after weights were written: engine invalid" in errors
    with torch.no_grad():
        target.view(-1)[3] = 0.5

    rx.fault = lambda k, buf: buf[10:11].bitwise_xor_(0x40) if k == 7 else None
    with syncs, pytest.raises(WeightUpdateError, match="\n  bucket 7 .* checksum mismatch; holds "):
        sender.update(4, include_frozen=True)
    assert syncs.count == 1, syncs.sites
    assert rx.version == 2 and rx.valid == atomic
    rx.fault = None
    with syncs:
        sender.update(5, include_frozen=True)
    assert syncs.count == 1, syncs.sites
    assert rx.version == 5 and rx.valid
    assert all(torch.equal(p, trainer.get_parameter(n)) for n, p in rx_model.named_parameters())


class _HandshakeScript:
    """A receiver whose handshakes fail as scripted (True = differences); records its calls."""

    in_flight = SimpleNamespace(last=None)

    def __init__(self, fails: list[bool]):
        self.fails, self.calls = list(fails), []
        self.manifest, self.version, self.valid, self.rank_label = ["joined"], 3, True, "rank 1"

    def handshake(self, group):
        self.calls.append("handshake")
        if self.fails.pop(0):
            self.manifest = None
            raise HandshakeError("weight-sync handshake failed:\n  rank 1: unexpected from trainer: bogus.weight")
        self.manifest = ["joined"]

    def receive_update(self, group, bucket_bytes, expect_version=None):
        self.calls.append("receive")
        return UpdateResult(ok=True, version=4)

    refused, _named = WeightReceiver.refused, WeightReceiver._named


def test_a_handshake_that_finds_differences_after_a_rebuild_refuses_the_update_and_stays_in_step():
    """It raised HandshakeError out of RolloutWeightSync.update (a 500 from the server) and left the
    receiver without a manifest, so every later update failed. Now it refuses that update (the
    group is in step: no rebuild) and the next update runs the handshake again, as the sender does."""
    rebuilds = []
    sync = object.__new__(RolloutWeightSync)
    sync.group = SimpleNamespace(rebuild=lambda: rebuilds.append(1))
    sync.bucket_bytes, sync.last = 1 << 20, None
    sync.receiver = _HandshakeScript([True, False])
    sync.needs_rebuild = True  # a transport failure broke the group
    first = sync.update().result
    assert not first.ok and first.version == 3 and first.valid and not first.needs_rebuild
    assert "unexpected from trainer: bogus.weight" in first.errors[0] and "handshake again" in first.errors[0]
    assert rebuilds == [1] and not sync.needs_rebuild and sync.receiver.calls == ["handshake"]
    second = sync.update().result
    assert second.ok and second.version == 4
    assert rebuilds == [1] and sync.receiver.calls == ["handshake", "handshake", "receive"]
    third = sync.update().result  # joined: no handshake
    assert third.ok and sync.receiver.calls[-2:] == ["receive", "receive"]

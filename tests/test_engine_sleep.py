"""Engine sleep / wake-up on the CPU: the state machine over a counting fake allocator.

The fake allocator is the engine's injected resize function: it really resizes the storage (so
contents and views can be checked) and counts the net bytes it allocated, and it raises
torch.OutOfMemoryError once a budget would be exceeded (the fake out-of-memory at wake-up).
Model: the tiny fp32 M3 of test_engine_core (page = block = 4 tokens).
"""

import asyncio

import numpy as np
import pytest
import torch
from test_block_selection_record import plain_selection

from m3_rollout.engine.config import EngineConfig
from m3_rollout.engine.engine import LLMEngine
from m3_rollout.engine.interface import GenerationRequest, SampleOutput, SamplingParams
from m3_rollout.engine.native_backend import NativeBackend
from m3_rollout.engine.sleep import GIB, WakeUpError, unique_storages
from m3_rollout.model import M3ForCausalLM, tiny_config
from m3_rollout.model.fused import packed_ok
from m3_rollout.model.loading import iter_released_tensors
from m3_rollout.weight_sync import LocalWeightSync

EOS = 3
V = 96


class FakeAllocator:
    """resize(storage, nbytes) that counts net allocated bytes and fails past ``budget`` bytes."""

    def __init__(self):
        self.net = 0  # bytes allocated minus bytes freed through this allocator
        self.budget: int | None = None  # most net bytes it may hold (None = unlimited)
        self.calls = 0

    def __call__(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        self.calls += 1
        delta = nbytes - storage.nbytes()
        if delta > 0 and self.budget is not None and self.net + delta > self.budget:
            raise torch.OutOfMemoryError(f"fake allocator: {delta} bytes over the budget")
        storage.resize_(nbytes)
        self.net += delta


def _model(seed=0, packed=False):
    torch.manual_seed(seed)
    cfg = tiny_config(vocab_size=V, max_position_embeddings=256, sparse_block_size=4, sparse_topk_blocks=3)
    m = M3ForCausalLM(cfg).float()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.15 if p.ndim >= 2 else 0.1)
    if packed:
        m.pack_fused_weights()  # the parameters become views of one buffer per projection group
    return m.eval()


def _engine(model=None, **kw):
    kw.setdefault("max_model_len", 64)
    kw.setdefault("max_num_seqs", 8)
    kw.setdefault("num_pages", 40)
    alloc = FakeAllocator()
    eng = LLMEngine(model or _model(), EngineConfig(eos_token_ids=(EOS,), **kw), resize=alloc)
    return eng, alloc


def _prompt(n, seed):
    return torch.randint(4, V, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _requests(tag=""):
    return [
        GenerationRequest(f"a{tag}", _prompt(13, 0), SamplingParams(n=3, seed=5, max_new_tokens=12)),
        GenerationRequest(f"b{tag}", _prompt(9, 1), SamplingParams(n=2, seed=6, max_new_tokens=12)),
    ]


def _run(eng, reqs) -> dict:
    for r in reqs:
        eng.add_request(r)
    outs = {}
    while eng.has_unfinished():
        for o in eng.step():
            if isinstance(o, SampleOutput):
                outs[(o.request_id[:1], o.sample_index)] = (o.output_ids, o.logprobs)
    return outs


def _cache_bytes(eng) -> int:
    return sum(t.untyped_storage().nbytes() for t in (eng.kv.k_cache, eng.kv.v_cache, eng.kv.index_cache))


def _weight_bytes(model) -> int:
    return sum(s.nbytes() for s in unique_storages([*model.parameters(), *model.buffers()]))


def test_sleep_level1_frees_the_caches_and_wake_restores_them():
    eng, alloc = _engine()
    before = _run(eng, _requests())
    kv_bytes = _cache_bytes(eng)
    assert eng.block_manager.cached  # the prefix cache holds pages
    rec = eng.sleep(1)
    assert rec["level"] == 1 and rec["gb_freed"] == kv_bytes / GIB and rec["seconds"] >= 0
    assert alloc.net == -kv_bytes and _cache_bytes(eng) == 0
    assert eng.asleep and eng.metrics()["sleep_level"] == 1
    bm = eng.block_manager
    assert not bm.cached and bm.num_free_pages == bm.num_pages and list(bm.free) == list(range(bm.num_pages))
    weights = _weight_bytes(eng.model)
    assert weights > 0  # level 1 keeps the weights
    rec = eng.wake_up()
    assert rec == {**rec, "level": 1, "gb_restored": kv_bytes / GIB}
    assert alloc.net == 0 and _cache_bytes(eng) == kv_bytes and not eng.asleep
    assert not eng.kv.k_cache.any() and not eng.kv.index_cache.any()  # zeroed, like a fresh pool
    computed = eng.metrics()["prompt_tokens_computed"]
    assert _run(eng, _requests("2")) == before  # same seeds, same tokens and logprobs
    assert eng.metrics()["prompt_tokens_computed"] - computed == 13 + 9  # no prefix hit on dropped pages
    m = eng.metrics()
    assert m["sleep_gb_freed"] == kv_bytes / GIB and m["wake_gb_restored"] == kv_bytes / GIB


def test_sleep_level2_offloads_weights_keeping_identity_views_and_values():
    model = _model(packed=True)
    eng, alloc = _engine(model)
    before = _run(eng, _requests())
    attn = model.model.layers[0].self_attn
    linears = attn.projection_linears()
    params = {n: p for n, p in model.named_parameters()}
    values = {n: p.detach().clone() for n, p in params.items()}
    cached_view = linears[0].weight.detach()[0]  # a view taken earlier (as weight sync caches them)
    assert packed_ok(attn.packed_proj, linears)
    total = _cache_bytes(eng) + _weight_bytes(model)
    rec = eng.sleep(2)
    assert rec["level"] == 2 and rec["gb_freed"] == total / GIB and alloc.net == -total
    assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
    assert eng.weights_offloaded
    rec = eng.wake_up()
    assert rec["level"] == 2 and rec["gb_restored"] == total / GIB and alloc.net == 0
    assert {n: p for n, p in model.named_parameters()} == params  # the same Parameter objects
    for n, p in model.named_parameters():
        assert torch.equal(p, values[n]), n  # restored bitwise
    assert packed_ok(attn.packed_proj, linears)  # still views of the packed buffer
    with torch.no_grad():
        cached_view.fill_(0.25)  # the earlier view writes the parameter's new memory
    assert bool((linears[0].weight[0] == 0.25).all())
    with torch.no_grad():
        linears[0].weight[0].copy_(values[[n for n, p in params.items() if p is linears[0].weight][0]][0])
    assert _run(eng, _requests("2")) == before


def test_double_sleep_deepens_or_frees_nothing_and_wake_when_awake_is_a_noop():
    eng, alloc = _engine()
    kv, w = _cache_bytes(eng), _weight_bytes(eng.model)
    rec = eng.wake_up()
    assert rec["level"] == 0 and rec["gb_restored"] == 0.0 and alloc.calls == 0
    eng.sleep(1)
    assert eng.sleep(1)["gb_freed"] == 0.0 and alloc.net == -kv
    rec = eng.sleep(2)  # deepen: the weights go too
    assert rec["level"] == 2 and rec["gb_freed"] == w / GIB and alloc.net == -(kv + w)
    assert eng.sleep(1) == {**eng.memory.last_sleep, "level": 2, "gb_freed": 0.0}
    assert eng.wake_up()["gb_restored"] == (kv + w) / GIB and alloc.net == 0
    assert eng.wake_up()["level"] == 0
    with pytest.raises(ValueError, match="level must be 1"):
        eng.sleep(3)
    assert not eng.asleep and alloc.net == 0


def test_everything_that_touches_tensors_is_refused_while_asleep():
    model = _model()
    b = NativeBackend(model, [EOS], max_model_len=64, max_num_seqs=8, num_pages=40)
    b.weight_sync = LocalWeightSync(b.engine)
    req = GenerationRequest("r", _prompt(7, 2), SamplingParams(max_new_tokens=4))
    released = dict(iter_released_tensors(model))  # views: made while the weights have memory
    b.sleep(2)
    eng = b.engine
    for call in (
        lambda: b.generate([req]),
        lambda: eng.step(),
        lambda: eng.add_request(req),
        lambda: b.score(_prompt(7, 2)),
    ):
        with pytest.raises(RuntimeError, match=r"engine is asleep \(level 2\): call wake_up\(\)"):
            call()

    async def agen():
        return [o async for o in b.generate_async([req])]

    async def stream():
        return [o async for o in b.stream(req)]

    for fn in (agen, stream):
        with pytest.raises(RuntimeError, match="engine is asleep"):
            asyncio.run(fn())
    with pytest.raises(RuntimeError, match="call wake_up\\(\\) first"):
        b.update_weights(1, released.items())
    assert not eng.has_unfinished() and eng.weight_version == 0
    b.wake_up()
    # The same request after wake-up runs; a weight update lands bitwise.
    assert len(b.generate([req])[0].output_ids) == 4
    new = {n: (t + 0.01).clone() for n, t in released.items()}
    b.update_weights(1, new.items())
    got = dict(iter_released_tensors(model))
    assert all(torch.equal(got[n], new[n]) for n in new) and b.weight_version == 1


def test_sleep_with_samples_unfinished_is_refused_until_they_are_aborted():
    eng, alloc = _engine()
    eng.add_request(GenerationRequest("r", _prompt(9, 3), SamplingParams(n=2, max_new_tokens=20)))
    eng.step()
    with pytest.raises(RuntimeError, match="2 samples are unfinished"):
        eng.sleep(1)
    assert not eng.asleep and alloc.calls == 0
    requeue = eng.abort_all()
    assert len(requeue) == 2
    assert eng.sleep(1)["level"] == 1
    eng.wake_up()
    for r in requeue:
        eng.add_request(r)
    while eng.has_unfinished():
        eng.step()


def test_out_of_memory_at_wake_up_names_the_setting_and_stays_asleep():
    eng, alloc = _engine(kv_cache_memory_gb=0.0)
    before = _run(eng, _requests())
    kv, w = _cache_bytes(eng), _weight_bytes(eng.model)
    eng.sleep(2)
    alloc.budget = -1  # the weights fit back, the KV cache does not
    with pytest.raises(WakeUpError, match="lower policy.generation.kv_cache_memory_gb") as err:
        eng.wake_up()
    assert "re-allocating the KV cache" in str(err.value) and "level 2" in str(err.value)
    assert eng.memory.level == 2 and eng.weights_offloaded and alloc.net == -(kv + w)
    assert all(p.untyped_storage().nbytes() == 0 for p in eng.model.parameters())
    alloc.budget = -kv - w + 8  # not even the weights
    with pytest.raises(WakeUpError, match="re-allocating the weights"):
        eng.wake_up()
    assert eng.asleep and alloc.net == -(kv + w)
    with pytest.raises(RuntimeError, match="engine is asleep"):
        eng.step()
    alloc.budget = None  # memory is free again: the retry works and nothing was lost
    assert eng.wake_up()["gb_restored"] == (kv + w) / GIB and alloc.net == 0
    assert _run(eng, _requests("2")) == before


def test_decode_graph_path_is_recaptured_after_wake_up():
    eng, _ = _engine(enable_cuda_graphs="eager")
    before = _run(eng, _requests())
    graphs = eng.runner.graphs
    assert graphs.graphs and eng.metrics()["graph_steps"] > 0
    eng.sleep(1)
    assert not graphs.graphs  # dropped with the memory they replay
    rec = eng.wake_up()
    assert graphs.graphs and rec["graph_capture_seconds"] >= 0
    steps = eng.metrics()["graph_steps"]
    assert _run(eng, _requests("2")) == before
    assert eng.metrics()["graph_steps"] > steps


def test_routing_records_are_released_and_work_after_wake_up():
    eng, alloc = _engine(record_routing=True)
    table = eng.routing.table
    kv, table_bytes = _cache_bytes(eng), table.untyped_storage().nbytes()
    eng.sleep(1)
    assert table.untyped_storage().nbytes() == 0 and alloc.net == -(kv + table_bytes)
    eng.wake_up()
    assert table.untyped_storage().nbytes() == table_bytes and alloc.net == 0
    eng.add_request(GenerationRequest("r", _prompt(9, 4), SamplingParams(max_new_tokens=5)))
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    rec = outs[0].routed_experts
    assert rec.shape[0] == 9 + 5
    assert (rec[: 9 + 4] >= 0).all()  # every token run after wake-up recorded into the new memory


def test_block_selection_record_sleeps_after_steps_and_records_after_wake_up():
    # the CPU engine scattered each step's rows through a numpy view of the step buffer, which
    # made its storage non-resizable: sleep failed after the first step with the record on
    model = _model()
    eng, alloc = _engine(model, record_block_selection=True)
    buf = eng.selection.step_buffer
    buf_bytes = buf.untyped_storage().nbytes()
    for tag in ("1", "2"):
        eng.add_request(GenerationRequest("r" + tag, _prompt(9, int(tag)), SamplingParams(max_new_tokens=5)))
        outs = []
        while eng.has_unfinished():
            outs += eng.step()
        tokens = outs[0].prompt_ids + outs[0].output_ids
        rec = outs[0].block_selection
        assert rec.end == len(tokens) - 1
        np.testing.assert_array_equal(rec.dense(rec.end), plain_selection(model, tokens)[: rec.end])
        eng.sleep(1)
        assert buf.untyped_storage().nbytes() == 0
        eng.wake_up()
        assert buf.untyped_storage().nbytes() == buf_bytes and alloc.net == 0


def test_a_weight_receiver_refuses_to_write_into_offloaded_weights():
    """The receiver itself (not only NativeBackend) refuses an update at sleep level 2: the
    parameters' device memory is freed, and a copy into it used to crash the process."""
    model = _model()
    eng, _ = _engine(model)
    sync = LocalWeightSync(eng)
    released = {n: t.clone() for n, t in iter_released_tensors(model)}
    sync.update_weights(1, released.items())
    eng.sleep(2)
    with pytest.raises(ValueError, match=r"weights offloaded \(sleep level 2\): call wake_up\(\) first"):
        sync.update_weights(2, {n: t + 0.01 for n, t in released.items()}.items())
    eng.wake_up()
    assert eng.weight_version == 1 and all(torch.equal(t, released[n]) for n, t in iter_released_tensors(model))
    new = {n: t + 0.01 for n, t in released.items()}
    sync.update_weights(2, new.items())
    assert eng.weight_version == 2 and all(torch.equal(t, new[n]) for n, t in iter_released_tensors(model))


def test_a_cached_refit_plan_follows_the_weights_to_their_new_storage_after_wake_up(monkeypatch):
    """The copy plan's kernel tables hold raw addresses; a level-2 wake-up re-allocates every
    weight storage (``weight_storage_generation`` counts it) and the receiver re-derives the tables
    before its next copy (the Triton path under TRITON_INTERPRET=1, forced on for this CPU engine)."""
    import os

    from m3_rollout.weight_sync import ReleasedTensors
    from m3_rollout.weight_sync import copy_plan as copy_plan_module

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs TRITON_INTERPRET=1 (tests/conftest.py)")
    monkeypatch.setattr(copy_plan_module, "_use_triton", lambda device: True)
    model = _model()
    eng, _ = _engine(model)
    sync = LocalWeightSync(eng)
    trainer = _model(seed=1)
    source = ReleasedTensors(trainer)
    sync.update_weights(1, source)
    sync.update_weights(2, source)  # the first update sends the frozen tensors too: another plan
    plan = sync.receiver._plan_cache.plan
    assert plan.triton and eng.weight_storage_generation == 0
    calls = []
    relocate = plan.relocate
    monkeypatch.setattr(plan, "relocate", lambda: calls.append(1) or relocate())
    eng.sleep(1)
    eng.wake_up()  # caches only: the weights stayed where they were
    assert eng.weight_storage_generation == 0
    eng.sleep(2)
    eng.wake_up()
    assert eng.weight_storage_generation == 1
    with torch.no_grad():
        for p in trainer.parameters():
            p.mul_(-1.5)
    sync.update_weights(3, source)
    assert calls == [1] and sync.receiver._plan_cache.plan is plan  # same plan, tables re-derived once
    want = dict(iter_released_tensors(trainer))
    assert eng.weight_version == 3 and all(torch.equal(t, want[n]) for n, t in iter_released_tensors(model))
    sync.update_weights(4, source)
    assert calls == [1]


def test_sleep_after_abort_lands_the_step_in_flight():
    """Async scheduling: abort() of the last request while a launched step is unprocessed left
    sleep refusing with "0 samples are unfinished" (only abort_all landed the step). Now sleep
    lands it itself; the abort records come out of the first step after wake-up."""
    eng, alloc = _engine(async_scheduling=True, enable_cuda_graphs="eager", cuda_graph_batch_sizes=(2,))
    eng.add_request(GenerationRequest("r", _prompt(9, 3), SamplingParams(n=2, max_new_tokens=20)))
    while not eng.step_in_flight:
        eng.step()
    eng.abort("r")
    assert eng.num_unfinished() == 0 and eng.step_in_flight
    assert eng.sleep(1)["level"] == 1 and eng.asleep and alloc.calls > 0 and not eng.step_in_flight
    eng.wake_up()
    outs = [o for o in eng.step() if isinstance(o, SampleOutput)]
    assert sorted((o.request_id, o.finish_reason) for o in outs) == [("r", "abort"), ("r", "abort")]
    assert not eng.has_unfinished()

"""The engine's KV-major prefill scratch (``EngineConfig.msa_prefill_scratch_mb``) on the CPU: its size,
its place inside the cache budget, its binding into the attention ops, sleep / wake-up.

The CPU table's attention ops are the PyTorch references, which take no scratch; these tests wrap them
in a table that does (``takes_prefill_scratch``) and records the buffer each call gets, so the engine
allocates and binds one as it does for the Triton kernels on CUDA (whose use of the buffer is tested
in test_kernels_msa.py under the interpreter). Model: test_engine_sleep's tiny fp32 M3 (8 q heads,
d 32, top-3 blocks of 4 tokens: 8 * 3 * (32 * 4 + 4) = 3168 scratch bytes per prefill token).
"""

from __future__ import annotations

import pytest
import torch
from test_engine_sleep import EOS, FakeAllocator, _model, _prompt, _requests, _run  # tests/ is on sys.path

from m3_kernels.paged_layout import KV_CHUNK_MIN_TOKENS, KV_CHUNK_TOKENS, KV_MAJOR_MIN_TOKENS
from m3_rollout.engine.config import EngineConfig
from m3_rollout.engine.engine import LLMEngine
from m3_rollout.engine.interface import GenerationRequest, SamplingParams
from m3_rollout.engine.paged_cache import MIB, page_bytes, prefill_scratch_bytes
from m3_rollout.engine.reference_ops import msa_attention_ref, paged_attention_ref
from m3_rollout.engine.sleep import GIB
from m3_rollout.model import M3Config
from m3_rollout.model.paged_ops import PagedOps

TOKEN_BYTES = 8 * 3 * (32 * 4 + 4)
BUDGET_GB = 0.1  # kv_cache_memory_gb of the accounting tests


class ScratchOps:
    """A PagedOps table over the reference attention ops that takes a scratch; ``seen`` records the
    (op name, scratch) of every call."""

    def __init__(self):
        self.seen: list[tuple[str, torch.Tensor]] = []

        def paged(*args, scratch, **kw):
            self.seen.append(("paged_attention", scratch))
            return paged_attention_ref(*args, **kw)

        def msa(*args, scratch, **kw):
            self.seen.append(("msa_attention", scratch))
            return msa_attention_ref(*args, **kw)

        self.table = PagedOps(paged_attention=paged, msa_attention=msa, takes_prefill_scratch=True)


def _engine(scratch_mb=None, ops=None, resize=None, **kw):
    kw.setdefault("max_model_len", 64)
    kw.setdefault("max_num_seqs", 8)
    kw.setdefault("kv_cache_memory_gb", BUDGET_GB)
    kw.setdefault("max_num_batched_tokens", KV_MAJOR_MIN_TOKENS)
    cfg = EngineConfig(eos_token_ids=(EOS,), msa_prefill_scratch_mb=scratch_mb, **kw)
    extra = {} if resize is None else {"resize": resize}
    return LLMEngine(_model(), cfg, ops=ScratchOps().table if ops is None else ops, **extra)


def _pass_bytes(tokens: int) -> int:
    return tokens * TOKEN_BYTES


def test_default_scratch_is_one_16k_pass_4160_mib_at_m3_shapes():
    # The default (None) is the kernels' own pass of KV_CHUNK_TOKENS tokens: 4160 MiB at M3 shapes in bf16
    # (64 heads x top-16 x (128 x 2 + 4) bytes per token); 4160 MiB given explicitly is the same pass.
    m3 = M3Config()
    assert prefill_scratch_bytes(m3, torch.bfloat16, None, 16384) == 4160 * MIB == 16384 * 266240
    assert prefill_scratch_bytes(m3, torch.bfloat16, 4160, 32768) == 4160 * MIB
    assert prefill_scratch_bytes(m3, torch.bfloat16, 1040, 32768) == 4096 * 266240  # 4K-token passes
    assert prefill_scratch_bytes(m3, torch.bfloat16, 1e6, 20000) == 20000 * 266240  # at most one step's prefill
    # the path cannot run: a step's prefill below KV_MAJOR_MIN_TOKENS, the path off, no sparse layer
    assert prefill_scratch_bytes(m3, torch.bfloat16, None, 16383) == 0
    assert prefill_scratch_bytes(m3, torch.bfloat16, 0, 65536) == 0
    dense = M3Config(sparse_attention_freq=[0] * m3.num_hidden_layers)
    assert prefill_scratch_bytes(dense, torch.bfloat16, None, 65536) == 0


def test_pages_shrink_as_the_scratch_grows_at_the_same_memory_setting():
    # kv_cache_memory_gb covers pool + scratch: pages = (budget - scratch) // page bytes; metrics() reports both.
    per_page = page_bytes(_model().config, torch.float32)
    budget = int(BUDGET_GB * GIB)
    pages, scratch = [], []
    for mb, tokens in ((0, 0), (4, KV_CHUNK_MIN_TOKENS), (16, 5 * KV_CHUNK_MIN_TOKENS), (None, KV_CHUNK_TOKENS)):
        eng = _engine(mb)
        want = _pass_bytes(tokens)
        assert eng.prefill_scratch.numel() == eng.prefill_scratch_bytes == want, mb
        assert eng.block_manager.num_pages == (budget - want) // per_page, mb
        m = eng.metrics()
        assert m["msa_prefill_scratch_gb"] == want / GIB and m["kv_pages_total"] == eng.block_manager.num_pages
        assert m["kv_cache_gb"] == sum(t.numel() * t.element_size() for t in eng.kv.tensors()) / GIB
        assert m["kv_cache_gb"] * GIB + want <= budget + per_page  # the pool (+ its null page) and scratch fit
        pages.append(eng.block_manager.num_pages)
        scratch.append(want)
    assert pages == sorted(pages, reverse=True) and len(set(pages)) == 4 and scratch == sorted(scratch)
    # The PyTorch table takes no scratch: none is allocated, the pool gets the whole budget.
    ref = LLMEngine(
        _model(), EngineConfig(max_model_len=64, kv_cache_memory_gb=BUDGET_GB, max_num_batched_tokens=16384)
    )
    assert ref.prefill_scratch is None and ref.metrics()["msa_prefill_scratch_gb"] == 0.0
    assert ref.block_manager.num_pages == pages[0] == budget // per_page
    # A step budget below the KV-major path: an empty scratch is bound (the path stays off), nothing reserved.
    short = _engine(None, max_num_batched_tokens=KV_MAJOR_MIN_TOKENS - 1)
    assert short.prefill_scratch.numel() == 0 and short.block_manager.num_pages == pages[0]


def test_too_small_or_too_large_a_scratch_is_refused_naming_the_key():
    # Below one KV_CHUNK_MIN_TOKENS pass (3.09 MiB here): a clear error naming the key, the minimum and 0 (off).
    with pytest.raises(ValueError, match=r"msa_prefill_scratch_mb=3\.0 .*the minimum is 3\.09 MiB .*use 0 to turn"):
        _engine(3.0)
    with pytest.raises(ValueError, match="msa_prefill_scratch_mb=-1"):
        EngineConfig(max_model_len=64, msa_prefill_scratch_mb=-1).validate()
    # Not a number (a bool would pass as 1 MiB, a string failed with a bare TypeError): refused by name.
    for bad in (True, "64", float("nan"), float("inf")):
        with pytest.raises(ValueError, match="EngineConfig.msa_prefill_scratch_mb="):
            EngineConfig(max_model_len=64, msa_prefill_scratch_mb=bad).validate()
    with pytest.raises(ValueError, match="EngineConfig.batch_invariant='yes'"):
        EngineConfig(max_model_len=64, batch_invariant="yes").validate()
    # A finite bound too large to scale to bytes (x MIB = inf) is one step's prefill, like any large bound.
    m3 = M3Config()
    assert prefill_scratch_bytes(m3, torch.bfloat16, 1e308, 20000) == 20000 * 266240
    # A scratch that leaves the pool too few pages for one sequence: the page error names the scratch.
    tight = (_pass_bytes(KV_CHUNK_TOKENS) + 10 * page_bytes(_model().config, torch.float32)) / GIB  # 40 tokens left
    with pytest.raises(ValueError, match=r"10 pages x 4 tokens after the MSA prefill scratch of 49\.5 MiB"):
        _engine(None, kv_cache_memory_gb=tight)


def test_the_bound_scratch_reaches_the_attention_ops_and_sleeps_with_the_pool():
    # Every attention call (dense layer 0, sparse layers 1-3; prefill and decode steps) gets the engine's
    # buffer; tokens equal the plain reference engine's; sleep frees it with the pool, wake-up restores it.
    table = ScratchOps()
    alloc = FakeAllocator()
    eng = _engine(4, ops=table.table, resize=alloc)
    buf = eng.prefill_scratch
    assert buf.numel() == _pass_bytes(KV_CHUNK_MIN_TOKENS)
    plain = LLMEngine(_model(), EngineConfig(eos_token_ids=(EOS,), max_model_len=64, max_num_seqs=8, num_pages=40))
    want = _run(plain, _requests())
    assert _run(eng, _requests()) == want
    names = {name for name, _ in table.seen}
    assert names == {"paged_attention", "msa_attention"} and all(s is buf for _, s in table.seen)
    kv = sum(t.untyped_storage().nbytes() for t in eng.kv.tensors())
    rec = eng.sleep(1)
    assert rec["gb_freed"] == (kv + buf.numel()) / GIB and buf.untyped_storage().nbytes() == 0
    assert alloc.net == -(kv + buf.numel())
    rec = eng.wake_up()
    assert rec["gb_restored"] == (kv + buf.numel()) / GIB and alloc.net == 0
    assert eng.prefill_scratch is buf and buf.untyped_storage().nbytes() == buf.numel()
    table.seen.clear()
    req = GenerationRequest("again", _prompt(11, 4), SamplingParams(max_new_tokens=3))
    eng.add_request(req)
    while eng.has_unfinished():
        eng.step()
    assert table.seen and all(s is buf for _, s in table.seen)

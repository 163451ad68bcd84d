"""Routing record: SampleOutput.routed_experts covers every token (prompt included), equals the
router's choice of a plain full forward, and survives prefix-cache hits and group forks."""

from __future__ import annotations

import numpy as np
import torch

from m3_rollout.engine.interface import GenerationRequest, SamplingParams
from m3_rollout.engine.native_backend import NativeBackend
from m3_rollout.model import M3ForCausalLM, tiny_config
from m3_rollout.parallel.routing_record import RoutingCache


def _model() -> M3ForCausalLM:
    torch.manual_seed(1)
    model = M3ForCausalLM(tiny_config(vocab_size=256)).float().eval()
    with torch.no_grad():
        for moe in model.moe_layers():
            moe.gate.weight.mul_(8.0)
    return model


def _expected(model: M3ForCausalLM, tokens: list[int]) -> np.ndarray:
    """Router choice of every layer for tokens[:-1] by one plain (non-paged) forward; last row -1."""
    with torch.no_grad():
        model(torch.tensor([tokens[:-1]]))
    ids = torch.stack([m.last_topk_ids for m in model.moe_layers()], dim=1)  # [L-1, n_moe, K]
    out = np.full((len(tokens), ids.shape[1], ids.shape[2]), -1, dtype=np.int16)
    out[:-1] = ids.numpy()
    return out


def test_routing_record_covers_prompt_forks_and_prefix_hits():
    model = _model()
    backend = NativeBackend(
        model, (3,), max_model_len=128, max_num_seqs=8, num_pages=32, record_routing=True, max_num_batched_tokens=24
    )  # a 40-token prompt is prefilled in 2 chunks
    prompt = torch.randint(4, 256, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    outs = backend.generate([GenerationRequest("g", prompt, SamplingParams(n=3, max_new_tokens=6, seed=5))])
    for o in outs:  # samples 1, 2 were forked from the leader (shared pages + copied partial page)
        tokens = o.prompt_ids + o.output_ids
        assert o.routed_experts.dtype == np.int16 and o.routed_experts.shape == (len(tokens), 3, 2)
        np.testing.assert_array_equal(o.routed_experts, _expected(model, tokens))
    # the next turn of sample 0 reuses the cached pages of its context: its record still starts at token 0
    ctx = outs[0].prompt_ids + outs[0].output_ids + [7, 8, 9]
    hits_before = backend.metrics()["prefix_cache_hit_tokens"]
    nxt = backend.generate([GenerationRequest("t2", ctx, SamplingParams(n=1, max_new_tokens=4, seed=5))])[0]
    assert backend.metrics()["prefix_cache_hit_tokens"] - hits_before >= 32  # two full pages came from the cache
    np.testing.assert_array_equal(nxt.routed_experts, _expected(model, nxt.prompt_ids + nxt.output_ids))


def test_routing_cache_pages_copy_and_uncomputed_rows():
    model = _model()
    cache = RoutingCache.for_model(model, num_pages=4, page_size=2)
    with torch.no_grad():
        model(torch.tensor([[5, 6, 7]]))
    ids = torch.stack([m.last_topk_ids for m in model.moe_layers()], dim=1).numpy()  # [3, 3, 2]
    cache.record(torch.tensor([6, 7, 2]), model)  # tokens 0,1 -> page 3; token 2 -> page 1 offset 0
    got = cache.gather([3, 1], num_computed=3, length=4)
    np.testing.assert_array_equal(got[:3], ids)
    assert (got[3] == -1).all()  # token 3 was never run
    cache.copy_page(1, 0)  # a fork's partial-page copy
    np.testing.assert_array_equal(cache.gather([3, 0], num_computed=3, length=3), ids)

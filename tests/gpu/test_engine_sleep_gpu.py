"""Engine sleep / wake-up on a CUDA GPU (``engine/sleep.py``), with CUDA graphs and async scheduling
on and the fused bf16 path (packed projections). Skipped without CUDA.

Model: the bench config (configs/bench/m3_bench_300m.json: page = block 128) cut to 2 layers (one
dense-attention, one sparse), random weights, bf16. Stated tolerances: identical ids and logprobs
(after wake-up the re-captured graphs replay the same kernels on the same rows and the same
weights: nothing may differ), and a refit after wake-up equals, token for token and logprob for
logprob, the same refit on an engine that never slept.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("TRITON_INTERPRET=1 in this process; run tests/gpu alone", allow_module_level=True)

from m3_rollout.engine.interface import GenerationRequest, SamplingParams  # noqa: E402
from m3_rollout.engine.native_backend import NativeBackend  # noqa: E402
from m3_rollout.engine.sleep import GIB, WakeUpError, unique_storages  # noqa: E402
from m3_rollout.model import M3Config, M3ForCausalLM  # noqa: E402
from m3_rollout.model.fused import packed_ok  # noqa: E402
from m3_rollout.model.loading import iter_released_tensors  # noqa: E402
from m3_rollout.weight_sync import LocalWeightSync  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def _model(layers=2):
    raw = json.loads((ROOT / "configs/bench/m3_bench_300m.json").read_text())
    raw = {k: v for k, v in raw.items() if not k.startswith("_")}
    raw.update(
        num_hidden_layers=layers,
        layer_types=raw["layer_types"][:layers],
        mlp_layer_types=raw["mlp_layer_types"][:layers],
    )
    cfg = M3Config.from_dict(raw)
    torch.manual_seed(0)
    with torch.device("cuda"):
        m = M3ForCausalLM(cfg)
        with torch.no_grad():
            for p in m.parameters():
                p.normal_(0, 0.02) if p.ndim >= 2 else p.normal_(0, 0.05)
    return m.cast_for_inference(torch.bfloat16).eval()


def _backend(model):
    backend = NativeBackend(
        model,
        [],
        max_model_len=512,
        max_num_seqs=16,
        num_pages=256,
        enable_cuda_graphs=True,
        cuda_graph_batch_sizes=(8, 16),
        async_scheduling=True,
    )
    backend.weight_sync = LocalWeightSync(backend.engine)
    return backend


def _requests():
    """16 single-sample requests of 24 tokens (no stops): 16-row decode steps on the graphs."""
    g = torch.Generator().manual_seed(1)
    return [
        GenerationRequest(
            f"s{i}",
            torch.randint(3, 32000, (100 + 13 * i,), generator=g).tolist(),
            SamplingParams(seed=70 + i, max_new_tokens=24),
        )
        for i in range(16)
    ]


def _generate(b) -> dict:
    return {o.request_id: (o.output_ids, o.logprobs) for o in b.generate(_requests())}


def _sizes(b) -> tuple[int, int]:
    kv = b.engine.kv
    caches = sum(t.untyped_storage().nbytes() for t in (kv.k_cache, kv.v_cache, kv.index_cache))
    weights = sum(s.nbytes() for s in unique_storages([*b.model.parameters(), *b.model.buffers()]))
    return caches, weights


def test_sleep2_frees_memory_and_wake_up_replays_the_same_tokens_then_a_refit_lands():
    model = _model()
    b = _backend(model)
    eng = b.engine
    assert eng.runner.graphs is not None and eng.runner.graphs.graphs, "decode graphs were not captured"
    attn = model.model.layers[0].self_attn
    assert packed_ok(attn.packed_proj, attn.projection_linears())
    first = _generate(b)
    kv, weights = _sizes(b)
    old_k = eng.kv.k_cache.data_ptr()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    rec = b.sleep(2)
    freed = before - torch.cuda.memory_allocated()
    assert freed >= kv + weights, (freed, kv, weights)  # + the graphs' pool
    assert rec["level"] == 2 and abs(rec["gb_freed"] - (kv + weights) / GIB) < 1e-12
    # The trainer's phase: it takes the freed memory and fills it (stale pointers would read this).
    hog = torch.full((kv + weights,), 0xFF, dtype=torch.uint8, device="cuda")
    rec = b.wake_up()
    assert rec["level"] == 2 and abs(rec["gb_restored"] - (kv + weights) / GIB) < 1e-12
    assert rec["graph_capture_seconds"] > 0 and eng.runner.graphs.graphs
    print(
        f"sleep(2) freed {freed / GIB:.3f} GiB (KV {kv / GIB:.3f} + weights {weights / GIB:.3f} + graph pool); "
        f"wake_up {rec['seconds']:.3f} s of which graph re-capture {rec['graph_capture_seconds']:.3f} s; "
        f"KV address changed: {eng.kv.k_cache.data_ptr() != old_k}"
    )
    assert packed_ok(attn.packed_proj, attn.projection_linears())
    graph_steps = eng.stats.graph_steps
    assert _generate(b) == first  # same seeds: identical ids and logprobs
    assert eng.stats.graph_steps > graph_steps
    del hog

    # A weight update after wake-up lands bitwise and serves what a never-slept engine serves.
    g = torch.Generator(device="cuda").manual_seed(3)
    new = {
        n: (t.float() + 0.01 * torch.randn(t.shape, device="cuda", generator=g)).to(t.dtype)
        for n, t in iter_released_tensors(model)
    }
    b.update_weights(1, new.items())
    got = dict(iter_released_tensors(model))
    assert all(torch.equal(got[n], new[n]) for n in new)
    assert packed_ok(attn.packed_proj, attn.projection_linears())
    refit = _generate(b)
    assert refit != first
    fresh = _backend(_model())
    fresh.update_weights(1, new.items())
    assert _generate(fresh) == refit


def test_out_of_memory_at_wake_up_names_the_setting_and_a_retry_works():
    b = _backend(_model())
    first = _generate(b)
    kv, _ = _sizes(b)
    b.sleep(1)
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    hog = torch.empty(free - min(kv // 4, 64 * 2**20), dtype=torch.uint8, device="cuda")  # less than the KV
    with pytest.raises(WakeUpError, match="lower policy.generation.kv_cache_memory_gb"):
        b.wake_up()
    assert b.engine.asleep and b.engine.kv.k_cache.untyped_storage().nbytes() == 0
    with pytest.raises(RuntimeError, match="engine is asleep"):
        b.generate(_requests())
    del hog
    torch.cuda.empty_cache()
    assert b.wake_up()["level"] == 1
    assert _generate(b) == first

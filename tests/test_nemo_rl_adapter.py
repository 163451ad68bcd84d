"""NemoRLGeneration (m3_rollout/integrations/nemo_rl.py) driven the way NeMo RL's colocated GRPO loop
drives its generator: prepare_for_generation -> generate -> finish_generation (sleep) ->
prepare_for_generation (wake) -> prepare_refit_info -> update weights -> invalidate_kv_cache ->
generate again, whose logprobs are then the trainer's new ones. Also the collective refit over a
gloo weight-sync group, per-row streaming, and the refusals (bad padding, wrong refit names)."""

import asyncio
import collections
import copy
import traceback
import warnings

import pytest
import torch
import torch.multiprocessing as mp
from mp_results import get_results, put_result

from m3_rollout.engine.native_backend import NativeBackend
from m3_rollout.integrations import NemoRLGeneration, ReleasedNaming
from m3_rollout.model import M3ForCausalLM, tiny_config
from m3_rollout.model.loading import iter_released_tensors
from m3_rollout.parallel import free_port
from m3_rollout.weight_sync import BroadcastChannel, LocalWeightSync, WeightSender, WeightSyncGroup, WeightUpdateError
from m3_trainers.policy import token_logprobs

V, EOS, PAD = 96, 1, 0
CONFIG = {
    "max_new_tokens": 5,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": None,
    "stop_token_ids": None,
    "stop_strings": None,
    "_pad_token_id": PAD,
    "colocated": {"enabled": True},
}


def _model(seed=0) -> M3ForCausalLM:
    torch.manual_seed(seed)
    cfg = tiny_config(vocab_size=V, max_position_embeddings=64, sparse_block_size=4, sparse_topk_blocks=3)
    m = M3ForCausalLM(cfg).float()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.15 if p.ndim >= 2 else 0.1)
    return m.eval()


def _generation(model) -> NemoRLGeneration:
    backend = NativeBackend(copy.deepcopy(model), [EOS], max_model_len=48, max_num_seqs=8)
    backend.weight_sync = LocalWeightSync(backend.engine)
    return NemoRLGeneration(backend, CONFIG, seed=3)


def _batch(container=dict):
    """Three right-padded prompts of lengths 4, 7 and 2 (ids >= 2: neither pad nor EOS)."""
    rows = [[5, 9, 14, 3], [7, 7, 30, 41, 2, 60, 11], [88, 4]]
    ids = torch.full((3, 7), PAD, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
    return container({"input_ids": ids, "input_lengths": torch.tensor([len(r) for r in rows])})


def _transformers_named(model):
    """The trainer's in-memory tensors under transformers' VL names (fused experts)."""
    for name, p in model.named_parameters():
        name = name.replace("model.", "model.language_model.", 1) if name.startswith("model.") else name
        name = name.replace("block_sparse_moe.experts.w13", "mlp.experts.gate_up_proj")
        yield name.replace("block_sparse_moe.experts.w2", "mlp.experts.down_proj"), p.detach()


def _check_output(out, batch, model):
    """GenerationOutputSpec layout, and logprobs equal to ``model``'s; returns the max |diff|."""
    ids, lens = batch["input_ids"], batch["input_lengths"].tolist()
    assert out["output_ids"].dtype == torch.long and out["logprobs"].dtype == torch.float32
    assert out["generation_lengths"].dtype == torch.long and out["truncated"].dtype == torch.bool
    gen = out["generation_lengths"].tolist()
    assert out["output_ids"].shape == out["logprobs"].shape == (3, 7 + max(gen))
    assert out["unpadded_sequence_lengths"].tolist() == [n + g for n, g in zip(lens, gen)]
    worst = 0.0
    for i, (n, g) in enumerate(zip(lens, gen)):
        row, lp = out["output_ids"][i], out["logprobs"][i]
        assert torch.equal(row[:n], ids[i, :n])  # the prompt is included
        assert (row[n + g :] == PAD).all() and (lp[:n] == 0).all() and (lp[n + g :] == 0).all()
        generated = row[n : n + g].tolist()
        assert bool(out["truncated"][i]) == (g == CONFIG["max_new_tokens"] and EOS not in generated)
        with torch.no_grad():
            ref = token_logprobs(model, row[None, : n + g])[0, n : n + g]
        worst = max(worst, float((ref - lp[n : n + g]).abs().max()))
    return worst


def test_grpo_loop_order_refits_and_changes_logprobs():
    model = _model()
    gen = _generation(model)
    batch = _batch()
    assert gen.prepare_for_generation() is True
    first = gen.generate(batch)
    assert _check_output(first, batch, model) < 1e-4
    assert gen.finish_generation() is True and gen.backend.engine.asleep  # the trainer gets the memory
    trainer = copy.deepcopy(model)  # one "training step"
    with torch.no_grad():
        for p in trainer.parameters():
            p.add_(0.2 * torch.randn_like(p))
    assert gen.prepare_for_generation(tags=["weights"]) and not gen.backend.engine.asleep
    assert gen.prepare_for_generation(tags=["kv_cache"])  # idempotent
    assert set(gen.get_logger_metrics()) == {"sleep_seconds", "sleep_gb_freed", "wake_seconds", "wake_gb_restored"}
    gen.prepare_refit_info({n: (t.shape, t.dtype) for n, t in _transformers_named(trainer)})
    assert gen.update_weights_via_ipc(_transformers_named(trainer)) is True
    assert gen.invalidate_kv_cache() is True
    assert gen.backend.weight_version == 1
    second = gen.generate(batch)
    assert _check_output(second, batch, trainer) < 1e-4  # the new weights serve
    assert _check_output(second, batch, model) > 1e-2  # ... and differ from the old ones
    # the trainer's own in-memory names (stacked experts.w13 / w2) refit too
    gen.prepare_refit_info({n: (p.shape, p.dtype) for n, p in model.named_parameters()})
    gen.update_weights_via_ipc((n, p.detach()) for n, p in model.named_parameters())
    assert gen.backend.weight_version == 2
    assert _check_output(gen.generate(batch), batch, model) < 1e-4
    assert gen.shutdown() and gen.shutdown()


def test_greedy_takes_the_argmax_with_the_models_own_logprobs():
    """Breaker finding: greedy=True returned logprobs that were all 0 (the "processed" logprobs
    after its top-1 filter). vLLM's temperature 0 (NeMo RL's greedy) returns the model's log-softmax
    of the chosen token, unfiltered and untempered; its argmax tokens, whatever the config's
    temperature and top-p."""
    model = _model()
    backend = NativeBackend(copy.deepcopy(model), [EOS], max_model_len=48, max_num_seqs=8)
    gen = NemoRLGeneration(backend, {**CONFIG, "temperature": 0.5, "top_p": 0.9, "max_new_tokens": 6}, seed=3)
    batch = _batch()

    async def collect():
        return dict([item async for item in gen.generate_async(batch, greedy=True)])

    greedy, rows = gen.generate(batch, greedy=True), asyncio.run(collect())
    for i, n in enumerate(batch["input_lengths"].tolist()):
        g = int(greedy["generation_lengths"][i])
        row = greedy["output_ids"][i, : n + g]
        with torch.no_grad():
            logits = model(row[None, :-1])[0, n - 1 :].float()  # [g, V]: the logits each token was chosen from
        ref = torch.log_softmax(logits, dim=-1)
        assert g >= 1 and row[n:].tolist() == logits.argmax(-1).tolist()
        got = greedy["logprobs"][i, n : n + g]
        assert float((got - ref.gather(1, row[n:, None])[:, 0]).abs().max()) < 1e-4 and bool((got < -1e-3).all())
        assert torch.equal(rows[i]["output_ids"][0], row)  # per-row streaming alike
        assert torch.allclose(rows[i]["logprobs"][0, n:], got, atol=1e-5)  # (another batch: last bits)


def test_a_generation_config_at_temperature_0_is_greedy_as_greedy_true():
    """NeMo RL's policy.generation.temperature=0 (vLLM's greedy) was refused at construction (the
    engine's "must be > 0"); now it is the engine's greedy: every call gives what greedy=True gives
    (the argmax tokens with the model's own logprobs), whatever top-k / top-p say."""
    model = _model()
    config = {**CONFIG, "temperature": 0, "top_k": 0, "top_p": 0.5}
    gen = NemoRLGeneration(NativeBackend(copy.deepcopy(model), [EOS], max_model_len=48), config, seed=3)
    ref = _generation(model)
    batch = _batch()
    got, want = gen.generate(batch), ref.generate(batch, greedy=True)
    for key in ("output_ids", "logprobs", "generation_lengths"):
        assert torch.equal(got[key], want[key]), key
    assert bool((want["logprobs"] < 0).any())  # the model's own logprobs, not 0 after a top-1 filter


def _sampled_logprobs(model, out, batch, temperature=1.0, top_k=-1):
    """[row] -> (generated ids, their logprobs under ``model`` at ``temperature`` after a top-k filter)."""
    rows = []
    for i, n in enumerate(batch["input_lengths"].tolist()):
        g = int(out["generation_lengths"][i])
        row = out["output_ids"][i, : n + g]
        with torch.no_grad():
            logits = model(row[None, :-1])[0, n - 1 :].float() / temperature  # [g, V]
        if top_k > 0:
            logits = logits.masked_fill(logits < logits.topk(top_k, dim=-1).values[:, -1:], float("-inf"))
        rows.append(torch.log_softmax(logits, -1).gather(1, row[n:, None])[:, 0])
    return rows


def test_vllm_cfg_logprobs_mode_is_honoured_for_sampled_rows():
    """NeMo RL's policy.generation.vllm_cfg.logprobs_mode was ignored: sampled rows always got the
    "processed" logprobs (temperature 0.7, top-k 5 here), raw_logprobs included. Now raw_logprobs
    gives the model's own log-softmax of the same tokens, processed_logprobs (and no key, the
    default) the distribution sampled from; vLLM's logits modes and unknown values are refused."""
    model = _model()
    batch = _batch()

    def generate(vllm_cfg):
        backend = NativeBackend(copy.deepcopy(model), [EOS], max_model_len=48)
        config = {**CONFIG, "temperature": 0.7, "top_k": 5, "max_new_tokens": 6, "vllm_cfg": vllm_cfg}
        return NemoRLGeneration(backend, config, seed=5).generate(batch)

    default, processed = generate({}), generate({"logprobs_mode": "processed_logprobs"})
    raw = generate({"logprobs_mode": "raw_logprobs", "max_model_len": 48})
    assert torch.equal(default["output_ids"], raw["output_ids"]) and torch.equal(
        default["logprobs"], processed["logprobs"]
    )
    lens = batch["input_lengths"].tolist()
    for i, (want_p, want_r) in enumerate(
        zip(_sampled_logprobs(model, default, batch, 0.7, 5), _sampled_logprobs(model, raw, batch), strict=True)
    ):
        n, g = lens[i], len(want_p)
        assert g >= 1 and torch.allclose(default["logprobs"][i, n : n + g], want_p, atol=1e-5)
        assert torch.allclose(raw["logprobs"][i, n : n + g], want_r, atol=1e-5)
        assert not torch.allclose(want_p, want_r, atol=1e-3)  # the two modes differ here
    for bad, why in (
        ("raw_logits", "logits, not the logprobs"),
        ("processed", "must be one of"),
        (1, "must be one of"),
    ):
        with pytest.raises(ValueError, match=rf"vllm_cfg\.logprobs_mode={bad!r} ?.*{why}"):
            generate({"logprobs_mode": bad})


#: NeMo RL's policy.generation as its examples/configs/grpo_math_1B.yaml sets it (model max 48 tokens)
NEMO_GENERATION = {
    **CONFIG,
    "backend": "vllm",
    "model_name": "Qwen/Qwen2.5-1.5B",
    "vllm_cfg": {
        "async_engine": False,
        "precision": "float32",
        "tensor_parallel_size": 1,
        "pipeline_parallel_size": 1,
        "expert_parallel_size": 1,
        "gpu_memory_utilization": 0.6,
        "max_model_len": 48,
        "enforce_eager": False,
        "use_deep_gemm": False,
        "num_last_layers_in_bf16": 0,
        "num_first_layers_in_bf16": 0,
        "skip_tokenizer_init": True,
        "load_format": "dummy",
    },
    "vllm_kwargs": {},
    "colocated": {"enabled": True, "resources": {"gpus_per_node": None, "num_nodes": None}},
}


def test_nemo_keys_the_adapter_does_not_read_are_warned_about_or_refused():
    """NeMo RL's generation keys the adapter does not read were dropped without a word (a
    max_model_len the backend does not have, routed experts asked for, vLLM's memory fraction,
    tensor parallelism...). Now: NeMo RL's defaults pass, gpu_memory_utilization (never honoured)
    warns once; an ignored value warns naming the key and what happens instead; a value that
    changes the output and cannot be honoured is refused naming the key and what to do."""
    model = _model()

    def build(generation: dict) -> list[warnings.WarningMessage]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")  # every warning of this one construction, none deduplicated
            NemoRLGeneration(NativeBackend(copy.deepcopy(model), [EOS], max_model_len=48), generation)
        return caught

    assert [str(w.message) for w in build(NEMO_GENERATION)] == [
        "NemoRLGeneration: policy.generation.vllm_cfg.gpu_memory_utilization=0.6 is ignored: the KV cache was "
        "sized when the backend was built (EngineConfig kv_cache_memory_fraction, of the memory free after the "
        "weights load, or kv_cache_memory_gb)"
    ]
    odd = {**NEMO_GENERATION["vllm_cfg"], "tensor_parallel_size": 2, "precision": "bfloat16", "quant_cfg": "nvfp4"}
    caught = build({**NEMO_GENERATION, "vllm_cfg": odd, "vllm_kwargs": {"compilation_config": {"use_inductor": False}}})
    got = sorted(str(w.message) for w in caught)
    assert got == sorted(
        [
            "NemoRLGeneration: policy.generation.vllm_cfg.gpu_memory_utilization=0.6 is ignored: the KV cache was "
            "sized when the backend was built (EngineConfig kv_cache_memory_fraction, of the memory free after the "
            "weights load, or kv_cache_memory_gb)",
            "NemoRLGeneration: policy.generation.vllm_cfg.tensor_parallel_size=2 is ignored: the backend holds "
            "the whole model (EP shards only the experts)",
            "NemoRLGeneration: policy.generation.vllm_cfg.precision='bfloat16' is ignored: the backend serves its "
            "model in torch.float32",
            "NemoRLGeneration: policy.generation.vllm_cfg.quant_cfg='nvfp4' is ignored: this adapter does not read it",
            "NemoRLGeneration: policy.generation.vllm_kwargs={'compilation_config': {'use_inductor': False}} is "
            "ignored: vLLM's engine arguments; the backend's EngineConfig applies",
        ]
    )
    assert all(w.category is UserWarning and w.filename == __file__ for w in caught)  # at the caller's line
    with pytest.raises(ValueError) as exc:
        build({**NEMO_GENERATION, "vllm_cfg": {**NEMO_GENERATION["vllm_cfg"], "max_model_len": 64}})
    assert str(exc.value) == (
        "NemoRLGeneration: policy.generation.vllm_cfg.max_model_len=64: the backend's max_model_len is 48, so rows "
        "would end at 48 tokens, not 64: build the backend with max_model_len=64 (or set this key to 48)"
    )
    with pytest.raises(ValueError, match=r"vllm_cfg\.enable_return_routed_experts=True: .* set it false"):
        build({**NEMO_GENERATION, "vllm_cfg": {**NEMO_GENERATION["vllm_cfg"], "enable_return_routed_experts": True}})


#: The generation section of NeMo RL's current grpo_math_1B.yaml (Aug 2026), interpolations resolved
#: (max_total_sequence_length 48, precision float32), as GRPO's setup hands it over (model_name,
#: _pad_token_id, stop_token_ids, vllm_cfg.load_format added)
NEMO_GENERATION_2026 = {
    **CONFIG,
    "stop_token_ids": [EOS],
    "backend": "vllm",
    "model_name": "Qwen/Qwen2.5-1.5B",
    "_debug_payload_metrics": False,
    "port_range_low": 3000,
    "port_range_high": 4999,
    "val_temperature": 1.0,
    "val_top_p": 1.0,
    "val_top_k": None,
    "refit_transport": None,
    "real_quant_export_cpu_offload": True,
    "refit_cfg": {
        "nixl": {
            "update_weights_bucket_memory_ratio": 0.05,
            "device": "cuda",
            "backend_name": "UCX",
            "backend_init_params": None,
            "release_after_refit": False,
            "shard_expert_weights": False,
        }
    },
    "mcore_generation_config": {
        "max_model_len": 48,
        "cuda_graph_impl": "local",
        "inference_cuda_graph_scope": "block",
        "buffer_size_gb": 10,
        "num_cuda_graphs": 4,
        "block_size_tokens": 256,
        "use_cuda_graphs_for_non_decode_steps": True,
        "enable_chunked_prefill": True,
        "enable_prefix_caching": False,
        "max_tokens": 16384,
        "kv_cache_management_mode": "persist",
        "materialize_only_last_token_logits": True,
        "num_speculative_tokens": 0,
        "refit_backend": "nccl",
        "parsers": [],
        "expose_http_server": False,
    },
    "vllm_cfg": {
        "async_engine": False,
        "precision": "float32",
        "kv_cache_dtype": "auto",
        "logprobs_mode": "processed_logprobs",
        "tensor_parallel_size": 1,
        "pipeline_parallel_size": 1,
        "expert_parallel_size": 1,
        "gpu_memory_utilization": 0.6,
        "max_model_len": 48,
        "enforce_eager": False,
        "use_tqdm": True,
        "use_deep_gemm": False,
        "num_last_layers_in_bf16": 0,
        "num_first_layers_in_bf16": 0,
        "enable_vllm_metrics_logger": True,
        "vllm_metrics_logger_interval": 0.5,
        "http_refit_api_key_env_var": None,
        "reset_encoder_cache_after_weight_update": False,
        "http_refit_server_port": None,
        "zmq_refit_server_port": None,
        "load_format": "dummy",
    },
    "vllm_kwargs": {},
    "colocated": {"enabled": True, "resources": {"gpus_per_node": None, "num_nodes": None}},
}


def test_nemo_keys_of_the_current_grpo_math_1b_warn_only_about_gpu_memory_utilization():
    """NeMo RL's current grpo_math_1B sets ports, validation sampling, its refit transport, the
    megatron backend's section and vLLM's metrics logger: 22 warnings of "this adapter does not
    read it" came with the one that means something (gpu_memory_utilization). Those keys pass
    quietly now; validation sampling other than training's, or the megatron section when it is
    the backend that runs, still warns by name."""
    model = _model()

    def build(generation: dict) -> list[str]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            NemoRLGeneration(NativeBackend(copy.deepcopy(model), [EOS], max_model_len=48), generation)
        return [str(w.message) for w in caught]

    memory = (
        "NemoRLGeneration: policy.generation.vllm_cfg.gpu_memory_utilization=0.6 is ignored: the KV cache was "
        "sized when the backend was built (EngineConfig kv_cache_memory_fraction, of the memory free after the "
        "weights load, or kv_cache_memory_gb)"
    )
    assert build(NEMO_GENERATION_2026) == [memory]
    assert build({**NEMO_GENERATION_2026, "val_temperature": 0.6}) == [
        "NemoRLGeneration: policy.generation.val_temperature=0.6 is ignored: validation rows are sampled as every "
        "row is, with temperature=1.0",
        memory,
    ]
    megatron = build({**NEMO_GENERATION_2026, "backend": "megatron"})
    assert (
        "NemoRLGeneration: policy.generation.mcore_generation_config.buffer_size_gb=10 is ignored: this adapter "
        "does not read it" in megatron
    )


class FakeBatchedDataDict(collections.UserDict):
    """Stands in for nemo_rl's BatchedDataDict (a UserDict built from a dict)."""


def test_generate_async_rows_and_container_type():
    model = _model()
    gen = _generation(model)
    batch = _batch(FakeBatchedDataDict)
    whole = gen.generate(batch)
    assert isinstance(whole, FakeBatchedDataDict)

    async def collect():
        return [item async for item in gen.generate_async(batch)]

    rows = asyncio.run(collect())
    assert sorted(i for i, _ in rows) == [0, 1, 2]
    for i, one in rows:
        n, g = int(batch["input_lengths"][i]), int(one["generation_lengths"][0])
        assert isinstance(one, FakeBatchedDataDict) and one["output_ids"].shape == (1, n + g)
        assert int(one["unpadded_sequence_lengths"][0]) == n + g
        assert torch.equal(one["output_ids"][0, :n], batch["input_ids"][i, :n])
    empty = gen.generate({"input_ids": torch.zeros((0, 0), dtype=torch.long), "input_lengths": torch.zeros(0)})
    assert empty["output_ids"].shape == (0, 0) and empty["truncated"].shape == (0,)


def test_refusals_name_the_problem():
    model = _model()
    gen = _generation(model)
    bad = _batch()
    bad["input_ids"][2, 5] = 17  # a token after the row's length: not right-padded
    with pytest.raises(ValueError, match="row 2 is not right-padded"):
        gen.generate(bad)
    info = {n: (t.shape, t.dtype) for n, t in _transformers_named(model)}
    lost = next(n for n in info if n.endswith("layers.1.input_layernorm.weight"))
    del info[lost]
    with pytest.raises(ValueError, match=r"missing model\.layers\.1\.input_layernorm\.weight"):
        gen.prepare_refit_info(info)
    info[lost] = (torch.Size([3]), torch.float32)
    with pytest.raises(ValueError, match=r"shape \(3,\) != \(128,\)"):
        gen.prepare_refit_info(info)
    info[lost] = (torch.Size([128]), torch.float32)
    info["model.language_model.layers.0.mlp.experts.gate_up_proj"] = (torch.Size([8, 64, 128]), torch.float32)
    with pytest.raises(ValueError, match="gate_up_proj"):  # layer 0 is dense: no experts
        gen.prepare_refit_info(info)
    del info["model.language_model.layers.0.mlp.experts.gate_up_proj"]
    gen.prepare_refit_info(info)
    with pytest.raises(ValueError, match="names differ from prepare_refit_info"):
        gen.update_weights_via_ipc(iter_released_tensors(model, prefix=""))
    # a backend other than the in-process engine: the shapes come from the config (a meta-device copy)
    NemoRLGeneration(gen.backend, CONFIG, model_config=model.config).prepare_refit_info(info)
    with pytest.raises(ValueError, match="_pad_token_id"):
        NemoRLGeneration(gen.backend, {k: v for k, v in CONFIG.items() if k != "_pad_token_id"})


def test_collective_refit_over_a_weight_sync_group():
    model = _model()
    gen = _generation(model)
    trainer = copy.deepcopy(model)
    with torch.no_grad():
        for p in trainer.parameters():
            p.mul_(0.9)
    port = free_port()
    joined = gen.init_collective("127.0.0.1", port, 2, train_world_size=1, timeout_s=60.0, bucket_size_mb=0.25)
    group = WeightSyncGroup("127.0.0.1", port, 0, 2, "gloo", 60.0)
    try:
        sender = WeightSender(lambda: iter_released_tensors(trainer), BroadcastChannel(group), bucket_size_mb=0.25)
        sender.handshake()
        assert all(f.result(timeout=60) for f in joined)
        received = gen.update_weights_from_collective()
        sender.update(1, include_frozen=True)
        assert all(f.result(timeout=60) for f in received)
        assert gen.backend.weight_version == 1
        # the engine is the group's one generation rank: a refusal names no rank (it said "rank 1")
        refused = gen.update_weights_from_collective()
        with pytest.raises(WeightUpdateError, match="update version 1 refused: this engine holds version 1"):
            sender.update(1)
        with pytest.raises(ValueError) as exc:
            refused[0].result(timeout=60)
        assert str(exc.value).startswith(
            "weight update rejected (version 1): update version 1 refused: this engine holds version 1;"
        )
        gen.invalidate_kv_cache()
        assert _check_output(gen.generate(_batch()), _batch(), trainer) < 1e-4
    finally:
        gen.shutdown()
        group.close()
    with pytest.raises(ValueError, match=r"use world_size = train_world_size \+ 1"):
        _generation(model).init_collective("127.0.0.1", port, 4, train_world_size=2)


# ------------------------------------------------------------- a trainer of two ranks (NeMo RL's layout)
TRAIN_RANKS, GROUP_TIMEOUT_S, RESULT_TIMEOUT_S = 2, 60.0, 180.0


def _trained(seed=0) -> M3ForCausalLM:
    """The trainer's weights after "a training step": every process rebuilds them from the seed."""
    model = _model(seed)
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.mul_(0.9).add_(0.01 * (i % 7))
    return model


def _sharded_trainer_rank(rank: int, port: int, train_port: int, results) -> None:
    """Trainer rank ``rank`` of two: holds half of every tensor of its in-memory model under
    transformers' VL names (flattened, as an FSDP shard), gathers the full tensors with the other
    trainer rank inside ``named_tensors()`` (so rank 0 can only send while rank 1 refits with it),
    maps them to released names (``ReleasedNaming``) and joins the refit group at its own rank.
    Update 1 is good; in update 2 rank 1 disagrees on the version, which must fail it everywhere."""
    import torch.distributed as dist

    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{train_port}", rank=rank, world_size=TRAIN_RANKS)
        trained = _trained()
        naming = ReleasedNaming(trained.config)
        shards = []
        for name, t in _transformers_named(trained):
            flat = t.flatten()
            half = -(-flat.numel() // TRAIN_RANKS)
            padded = torch.cat([flat, flat.new_zeros(half * TRAIN_RANKS - flat.numel())])
            shards.append((name, tuple(t.shape), padded[rank * half : (rank + 1) * half].clone()))
        del trained
        gathers = []

        def named_tensors():
            for name, shape, shard in shards:
                parts = [torch.empty_like(shard) for _ in range(TRAIN_RANKS)]
                dist.all_gather(parts, shard)  # a collective of the trainer's ranks, like DTensor.full_tensor()
                gathers.append(name)
                yield name, torch.cat(parts)[: torch.Size(shape).numel()].view(shape)

        group = WeightSyncGroup("127.0.0.1", port, rank, TRAIN_RANKS + 1, "gloo", GROUP_TIMEOUT_S, None, TRAIN_RANKS)
        sender = WeightSender(lambda: naming(named_tensors()), BroadcastChannel(group), bucket_size_mb=0.25)
        sender.handshake()
        stats = sender.update(1, include_frozen=True)
        try:
            sender.update(2 if rank == 0 else 3, include_frozen=True)
            error = None
        except WeightUpdateError as exc:
            error = str(exc)
        group.close()
        put_result(results, {"rank": rank, "stats": stats, "mismatch_error": error, "gathers": len(gathers)})
    except Exception:  # noqa: BLE001
        put_result(results, {"rank": rank, "error": traceback.format_exc()})
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_collective_refit_from_a_trainer_of_two_ranks():
    """NeMo RL's refit group: trainer ranks 0 and 1 (separate processes, transformers' tensor names)
    and this engine as rank 2; rank 0 broadcasts every tensor, rank 1 takes part in each collective.
    The engine ends with the trainer's weights bitwise; a trainer rank that disagrees with rank 0
    fails the update everywhere and the engine keeps those weights."""
    model = _model()
    gen = _generation(model)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port, train_port = free_port(), free_port()
    procs = [ctx.Process(target=_sharded_trainer_rank, args=(r, port, train_port, results)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        joined = gen.init_collective(
            "127.0.0.1",
            port,
            TRAIN_RANKS + 1,
            train_world_size=TRAIN_RANKS,
            timeout_s=GROUP_TIMEOUT_S,
            bucket_size_mb=0.25,
        )
        assert all(f.result(timeout=RESULT_TIMEOUT_S) for f in joined)
        assert all(f.result(timeout=RESULT_TIMEOUT_S) for f in gen.update_weights_from_collective())
        refused = gen.update_weights_from_collective()
        with pytest.raises(ValueError, match="weight update rejected"):
            refused[0].result(timeout=RESULT_TIMEOUT_S)
        got = get_results(results, TRAIN_RANKS, RESULT_TIMEOUT_S, "rank")
    finally:
        for p in procs:
            p.join(timeout=RESULT_TIMEOUT_S)
            if p.is_alive():
                p.kill()
        gen.shutdown()
    trainer = _trained()
    pairs = list(zip(iter_released_tensors(gen.backend.model), iter_released_tensors(trainer)))
    assert len(pairs) == len(list(iter_released_tensors(model))) > 20
    for (name, served), (want_name, want) in pairs:
        assert name == want_name and torch.equal(served, want), name
    assert gen.backend.weight_version == 1  # the refused update changed nothing
    assert _check_output(gen.generate(_batch()), _batch(), trainer) < 1e-4
    for r in range(TRAIN_RANKS):
        n_hf = len(list(_transformers_named(trainer)))
        assert got[r]["stats"]["version"] == 1 and got[r]["gathers"] == 3 * n_hf  # handshake + 2 updates
        assert "trainer rank 1: its update (version 3" in got[r]["mismatch_error"]
        assert "differs from trainer rank 0's (version 2" in got[r]["mismatch_error"]


def test_odd_but_valid_batches_and_refusals_of_odd_ones():
    """Breaker findings: a plain list of input_lengths raised AttributeError, a stop_strings list
    shorter than the batch an IndexError, a row's plain string became one stop string per
    character, and an IPC refit while the weights were offloaded a storage error."""
    model = _model()
    batch = _batch()
    want = _generation(model).generate(batch)
    got = _generation(model).generate({**batch, "input_lengths": batch["input_lengths"].tolist()})
    assert torch.equal(got["output_ids"], want["output_ids"]) and torch.equal(got["logprobs"], want["logprobs"])
    with pytest.raises(ValueError, match="stop_strings has 1 entries for 3 rows of input_ids"):
        _generation(model).generate({**batch, "stop_strings": [["x"]]})
    gen = _generation(model)
    reqs = gen._requests({**batch, "stop_strings": ["ab", None, ["cd", "e"]]}, greedy=False)[2]
    assert [r.params.stop_strings for r in reqs] == [("ab",), (), ("cd", "e")]
    asleep = NemoRLGeneration(_generation(model).backend, CONFIG, seed=3, sleep_level=2)
    asleep.finish_generation()
    with pytest.raises(RuntimeError, match="weights are offloaded; call prepare_for_generation"):
        asleep.update_weights_via_ipc(iter_released_tensors(model, prefix=""))
    asleep.prepare_for_generation()


def test_a_row_with_no_room_under_max_model_len_generates_nothing_and_the_batch_goes_on():
    """Breaker finding: a row whose prompt filled max_model_len (a multi-turn conversation at the
    context limit) failed the whole batch with RuntimeError. NeMo RL's vLLM worker answers such a
    row with no generated tokens, not truncated; the other rows generate (one with 3 tokens of
    room stops there unless it stopped first)."""
    model = _model()
    gen = _generation(model)  # max_model_len=48, max_new_tokens=5
    lens = [48, 45, 3, 50]
    ids = torch.full((4, 50), PAD, dtype=torch.long)
    for i, n in enumerate(lens):
        ids[i, :n] = torch.arange(n) % 80 + 2  # neither pad nor EOS
    batch = {"input_ids": ids, "input_lengths": torch.tensor(lens)}
    out = gen.generate(batch)
    gen_lens = out["generation_lengths"].tolist()
    assert gen_lens[0] == gen_lens[3] == 0 and 1 <= gen_lens[1] <= 3 and gen_lens[2] >= 1
    assert out["output_ids"].shape == (4, 50 + max(gen_lens))
    assert out["unpadded_sequence_lengths"].tolist() == [n + g for n, g in zip(lens, gen_lens)]
    for i, (n, g) in enumerate(zip(lens, gen_lens)):
        row = out["output_ids"][i]
        assert torch.equal(row[:n], ids[i, :n]) and (row[n + g :] == PAD).all()
        assert bool(out["truncated"][i]) == (g > 0 and EOS not in row[n : n + g].tolist())
        if g:
            with torch.no_grad():
                ref = token_logprobs(model, row[None, : n + g])[0, n : n + g]
            assert float((ref - out["logprobs"][i, n : n + g]).abs().max()) < 1e-4
    assert (out["logprobs"][[0, 3]] == 0).all()

    async def collect():
        return {i: one async for i, one in gen.generate_async(batch)}

    rows = asyncio.run(collect())
    assert sorted(rows) == [0, 1, 2, 3]
    for i in (0, 3):
        assert torch.equal(rows[i]["output_ids"], ids[i : i + 1, : lens[i]])
        assert rows[i]["generation_lengths"].tolist() == [0] and rows[i]["truncated"].tolist() == [False]
        assert rows[i]["logprobs"].shape == (1, lens[i]) and rows[i]["unpadded_sequence_lengths"].tolist() == [lens[i]]

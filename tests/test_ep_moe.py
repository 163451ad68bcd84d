"""Expert parallelism: EP=2 / EP=4 logits equal EP=1 (fp32), gloo processes, sharded loading.

Each spawned rank builds the same seeded tiny M3, keeps an unsharded copy as the EP=1 reference
for its OWN inputs, shards the other copy and runs the EP forward together with its peers.
Scenarios: different batches per rank; a rank with no tokens (it runs the MoE layers on T = 0
rows, as ``step(force_forward=True)`` does); every token routed to the last rank's experts
(router bias), so the other ranks receive nothing.
"""

from __future__ import annotations

import copy
import traceback

import pytest
import torch
import torch.multiprocessing as mp
from mp_results import get_results, put_result

from m3_rollout.model import M3ForCausalLM, iter_released_tensors, save_checkpoint, tiny_config
from m3_rollout.parallel import (
    EPGroupSpec,
    destroy_ep_group,
    expert_range,
    free_port,
    init_ep_group,
    load_checkpoint_ep,
    shard_experts,
)

TIMEOUT_S = 90


def _model(seed: int = 0) -> M3ForCausalLM:
    torch.manual_seed(seed)
    model = M3ForCausalLM(tiny_config()).float().eval()
    with torch.no_grad():  # sharper routing than the default init, so the top-k choice matters
        for moe in model.moe_layers():
            moe.gate.weight.mul_(8.0)
    return model


def _ep_rank(rank: int, spec: EPGroupSpec, results) -> None:
    try:
        torch.set_num_threads(1)
        group = init_ep_group(spec, rank)
        p = spec.world_size
        ref = _model()
        ep = copy.deepcopy(ref)
        stats = shard_experts(ep, rank, p, group)
        cfg = ref.config
        out: dict = {"rank": rank, "range": ep.moe_layers()[0].experts.expert_range}
        gen = torch.Generator().manual_seed(100 + rank)

        def forward_pair(ids):
            with torch.no_grad():
                return ref(ids), ep(ids)

        # 1) a different batch on every rank
        ids = torch.randint(0, cfg.vocab_size, (2, 5 + 3 * rank), generator=gen)
        stats.reset()
        a, b = forward_pair(ids)
        out["diff_batches"] = float((a - b).abs().max())
        out["pairs_batches"] = stats.tokens_per_expert.sum(1).tolist()  # per MoE layer, received pairs
        out["sent_batches"] = int(stats.sent_per_rank.sum())
        out["ref_ids"] = [m.last_topk_ids.clone() for m in ep.moe_layers()]
        # 2) the last rank has no tokens: it runs each MoE layer on zero rows
        if rank == p - 1:
            with torch.no_grad():
                empty_out = [moe(torch.zeros(0, cfg.hidden_size)) for moe in ep.moe_layers()]
            out["empty_shapes"] = [tuple(t.shape) for t in empty_out]
        else:
            a, b = forward_pair(ids)
            out["diff_empty_peer"] = float((a - b).abs().max())
        # 3) very uneven: the router bias sends every token to the last two experts (last rank)
        for model in (ref, ep):
            for moe in model.moe_layers():
                moe.e_score_correction_bias.data[-2:] = 10.0
        stats.reset()
        a, b = forward_pair(ids)
        out["diff_uneven"] = float((a - b).abs().max())
        out["uneven_load"] = stats.tokens_per_expert.tolist()
        out["uneven_ids_max"] = min(int(m.last_topk_ids.min()) for m in ep.moe_layers())
        put_result(results, out)
    except Exception:  # noqa: BLE001 - report to the parent, which fails the test
        put_result(results, {"rank": rank, "error": traceback.format_exc()})
    finally:
        destroy_ep_group()


def _run_ranks(fn, world: int, *args) -> list[dict]:
    """Spawn `world` ranks of fn(rank, spec, results, *args); bounded by TIMEOUT_S; results by rank."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    spec = EPGroupSpec(world_size=world, addr="127.0.0.1", port=free_port(), backend="gloo", timeout_s=30)
    procs = [ctx.Process(target=fn, args=(r, spec, results, *args), daemon=True) for r in range(world)]
    for pr in procs:
        pr.start()
    try:
        got = get_results(results, world, TIMEOUT_S, "rank")
    finally:
        for pr in procs:
            pr.join(timeout=10)
            if pr.is_alive():
                pr.kill()
    return [got[r] for r in range(world)]


@pytest.mark.parametrize("world", [2, 4])
def test_ep_logits_equal_single_rank(world):
    outs = _run_ranks(_ep_rank, world)
    e, k = 8, 2
    n_moe = 3
    assert [o["range"] for o in outs] == [(r * e // world, (r + 1) * e // world) for r in range(world)]
    for o in outs:
        assert o["diff_batches"] < 1e-5, o
        assert o["diff_uneven"] < 1e-5, o
        if o["rank"] == world - 1:
            assert o["empty_shapes"] == [(0, 128)] * n_moe
        else:
            assert o["diff_empty_peer"] < 1e-5, o
    # load accounting: every (token, slot) pair of every rank is processed exactly once per layer
    tokens = [2 * (5 + 3 * r) for r in range(world)]
    assert [sum(o["pairs_batches"][layer] for o in outs) for layer in range(n_moe)] == [k * sum(tokens)] * n_moe
    assert [o["sent_batches"] for o in outs] == [n_moe * k * t for t in tokens]
    # uneven step: only the last rank's last two experts got work, T pairs each per layer
    tokens_uneven = sum(tokens)  # every rank's tokens, each sending both slots to the last rank
    for o in outs[:-1]:
        assert all(v == 0 for row in o["uneven_load"] for v in row)
    last = outs[-1]["uneven_load"]
    assert all(row[-2:] == [tokens_uneven, tokens_uneven] and sum(row[:-2]) == 0 for row in last)
    assert all(o["uneven_ids_max"] >= e - 2 for o in outs)


def test_expert_range_rejects_uneven_split():
    assert expert_range(8, 4, 3) == (6, 8)
    with pytest.raises(ValueError, match=r"expert_parallel_size=3.*\[1, 2, 4, 8\]"):
        expert_range(8, 3, 0)
    with pytest.raises(ValueError, match="EP rank 2"):
        expert_range(8, 2, 2)


def test_sharded_loader_reads_only_local_experts(tmp_path):
    full = _model(seed=3)
    save_checkpoint(full, full.config, tmp_path, max_shard_bytes=200_000)  # several shards
    full_named = dict(iter_released_tensors(full, prefix=""))
    total = sum(t.numel() * 4 for t in full_named.values())
    per_rank = []
    for rank in range(2):
        model, stats, rep = load_checkpoint_ep(tmp_path, rank, 2, group=None)
        a, b = rep.expert_range
        assert (a, b) == (4 * rank, 4 * rank + 4)
        foreign = sum(
            t.numel() * 4
            for n, t in full_named.items()
            if ".experts." in n and not a <= int(n.split(".experts.")[1].split(".")[0]) < b
        )
        assert rep.bytes_in_files == total
        assert rep.bytes_read == total - foreign
        named = dict(iter_released_tensors(model, prefix=""))  # global expert names, own range only
        assert set(named) == {
            n for n in full_named if ".experts." not in n or a <= int(n.split(".experts.")[1].split(".")[0]) < b
        }
        for n, t in named.items():
            assert torch.equal(t, full_named[n]), n
        assert model.moe_layers()[0].experts.w13.shape[0] == 4
        per_rank.append(rep.bytes_read)
    expert_bytes = sum(t.numel() * 4 for n, t in full_named.items() if ".experts." in n)
    assert per_rank[0] + per_rank[1] == 2 * total - expert_bytes  # the experts were read once in all


def test_sharded_loader_slices_fused_transformers_experts(tmp_path):
    from safetensors.torch import save_file

    full = _model(seed=4)
    cfg = full.config
    tensors = {}
    for n, t in iter_released_tensors(full, prefix="language_model."):
        if ".experts." not in n:
            tensors[n] = t.clone()
    for li in cfg.moe_layer_ids:
        ex = full.model.layers[li].block_sparse_moe.experts
        tensors[f"model.language_model.layers.{li}.mlp.experts.gate_up_proj"] = ex.w13.detach().clone()
        tensors[f"model.language_model.layers.{li}.mlp.experts.down_proj"] = ex.w2.detach().clone()
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(__import__("json").dumps(cfg.to_dict()))
    model, _, rep = load_checkpoint_ep(tmp_path, 1, 4, group=None)
    assert rep.expert_range == (2, 4)
    fused_bytes = sum(t.numel() * 4 for n, t in tensors.items() if "mlp.experts" in n)
    total = sum(t.numel() * 4 for t in tensors.values())
    assert rep.bytes_in_files == total and rep.bytes_read == total - fused_bytes * 3 // 4
    for li in cfg.moe_layer_ids:
        got = model.model.layers[li].block_sparse_moe.experts
        want = full.model.layers[li].block_sparse_moe.experts
        assert torch.equal(got.w13, want.w13[2:4]) and torch.equal(got.w2, want.w2[2:4])


def test_shard_without_group_refuses_to_run():
    model = _model()
    shard_experts(model, 0, 2, group=None)
    with pytest.raises(RuntimeError, match="needs a process group"):
        model(torch.zeros(1, 3, dtype=torch.long))


def test_config_cluster_keys_and_ep_default():
    from m3_rollout.config import ConfigError, load_config

    cfg = load_config("configs/grpo_bf16_ep.yaml")
    assert cfg.policy.generation.expert_parallel_size == 2 and cfg.cluster.launcher == "auto"
    with pytest.raises(ConfigError, match=r"cluster.launcher='slurm'"):
        load_config("configs/grpo_bf16_ep.yaml", ["cluster.launcher=slurm"])
    with pytest.raises(ConfigError, match=r"expert_parallel_size=4: needs one GPU per EP rank; the cluster has 2"):
        load_config(
            "configs/grpo_bf16_ep.yaml", ["policy.generation.expert_parallel_size=4", "cluster.gpus_per_node=2"]
        )
    with pytest.raises(ConfigError, match=r"expert_parallel_size=0"):
        load_config("configs/grpo_bf16_ep.yaml", ["policy.generation.expert_parallel_size=0"])


def test_factory_rejects_ep_size_that_does_not_divide_experts(tmp_path):
    from m3_rollout.config import load_config
    from m3_rollout.service.factory import build_rollout_service

    model = _model()
    save_checkpoint(model, model.config, tmp_path)
    cfg = load_config("configs/grpo_bf16_ep.yaml", ["policy.generation.expert_parallel_size=3"])
    with pytest.raises(ValueError, match=r"expert_parallel_size=3: the model has 8 routed experts"):
        build_rollout_service(cfg, tmp_path, [3], 64)
    assert (
        build_rollout_service(
            load_config("configs/grpo_bf16_ep.yaml", ["policy.generation.expert_parallel_size=1"]), tmp_path, [3], 64
        )
        is None
    )  # in-process engine


def test_factory_puts_the_trainers_end_of_the_nccl_refit_group_on_cluster_device(tmp_path, monkeypatch):
    """GPU workers (rank r on cuda:r) refit over NCCL: the trainer's end of the group binds to
    cluster.device (configs/grpo_h200_x2.yaml: cuda:2 beside workers on cuda:0-1), with an index;
    it used to be "cuda", which torch.cuda.set_device refuses (no index) and would be cuda:0, a
    worker's GPU, which NCCL refuses."""
    from m3_rollout.config import load_config
    from m3_rollout.service import factory
    from m3_rollout.service.service import trainer_group_device

    model = _model()
    save_checkpoint(model, model.config, tmp_path)
    seen = {}
    monkeypatch.setattr(factory, "RolloutService", lambda spec, **kw: seen.update(spec=spec, **kw) or "service")
    cfg = load_config("configs/grpo_h200_x2.yaml", ["policy.model_name=" + str(tmp_path)])
    assert factory.build_rollout_service(cfg, tmp_path, [3], 64) == "service"
    assert seen["trainer_device"] == "cuda:2" and seen["spec"].device == "cuda" and seen["refit"] == "broadcast"
    assert seen["spec"].group.world_size == 2 and seen["launcher"] == "mp" and seen["worker_gpus"] == 1.0
    assert seen["spec"].engine["enable_cuda_graphs"] is False
    assert trainer_group_device("nccl", "cuda:2") == "cuda:2"
    assert trainer_group_device("gloo", "cuda:2") == trainer_group_device("gloo", None) == "cpu"


def test_ep_size_one_counts_experts_on_the_device_without_host_syncs(monkeypatch):
    """The worker beside the trainer holds every expert (EP size 1). Its load counters used to copy
    a bincount to the host in every MoE forward, which made its CUDA-graph capture fail (the
    worker then decoded eagerly, ~8x slower on the H200, 2026-12-02). They now accumulate on the
    device: no host sync in the forward, and the snapshot still reports every pair."""
    from fake_cuda import HostSyncs

    from m3_rollout.parallel.ep_moe import EPExperts, EPStats

    cfg = tiny_config()
    e, k = cfg.num_local_experts, cfg.num_experts_per_tok
    stats = EPStats(n_moe_layers=2, num_local_experts=e, world_size=1)
    ex = EPExperts(cfg, (0, e), None, stats=stats, layer_slot=1).requires_grad_(False)
    g = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(9)])
    x, w = torch.randn(9, cfg.hidden_size, generator=g), torch.rand(9, k, generator=g)

    def fused(x, ids, weights, w13, w2, **kw):  # the engine's op, on the device: nothing to read back
        return torch.zeros_like(x)

    syncs = HostSyncs(monkeypatch)
    with syncs:
        ex(x, ids, w, fused)
        ex(x, ids[:4], w[:4], fused)
    assert syncs.count == 0, syncs.sites
    want = torch.bincount(ids.reshape(-1), minlength=e) + torch.bincount(ids[:4].reshape(-1), minlength=e)
    snap = stats.snapshot()
    assert snap["tokens_per_expert"] == [[0] * e, want.tolist()] and snap["moe_forwards"] == 2
    assert stats.snapshot()["tokens_per_expert"] == [[0] * e] * 2  # reset zeroed the device counter in place

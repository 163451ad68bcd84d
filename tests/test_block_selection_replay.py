"""Block-selection (index) replay, trainer side, and the selection-agreement metric.

- replaying the rollout engine's own record gives the logprobs (and gradients) of no replay;
- a replayed *different* selection changes the output exactly as attention over those blocks
  does (the layer's top-k patched to return them), gradients included; -1 rows keep the own choice;
  forced local / init blocks and causality hold whatever the record says;
- the unfrozen indexer gets no gradient and does not move; activation checkpointing replays too;
- an engineered disagreement (a bf16 generator whose near-tied block scores round differently)
  shows the agreement metric below 1, and replay lowers the mismatch.
CPU; fp32 unless stated.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import m3_rollout.model.attention as attention_mod
from m3_rollout.engine.interface import GenerationRequest, SamplingParams
from m3_rollout.engine.native_backend import NativeBackend
from m3_rollout.model import M3ForCausalLM, tiny_config
from m3_rollout.model.indexer import replayed_blocks, selection_agreement
from m3_trainers.batch import TrainBatch
from m3_trainers.loss import ClippedPGLossFn
from m3_trainers.policy import Policy, enable_activation_checkpointing, mismatch_metrics, token_logprobs
from m3_trainers.selection_replay import SelectionAgreement, replay_block_selection

PS, K = 4, 3


def _model(seed=0, scale=0.3) -> M3ForCausalLM:
    torch.manual_seed(seed)
    cfg = tiny_config(vocab_size=96, max_position_embeddings=512, sparse_block_size=PS, sparse_topk_blocks=K)
    m = M3ForCausalLM(cfg).float()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, scale if p.ndim >= 2 else 0.1)
    return m


def own_selection(model: M3ForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    """int16 [B, L, S, G, K]: the model's own block choice in one plain forward."""
    with torch.no_grad():
        model(ids)
    return torch.stack([a.last_selected_blocks.permute(0, 2, 1, 3) for a in model.sparse_attention_layers()], 2).to(
        torch.int16
    )


IDS = torch.randint(0, 95, (2, 40), generator=torch.Generator().manual_seed(4))


def test_replaying_the_engines_own_record_is_exact():
    m = _model().eval()
    be = NativeBackend(
        m, (95,), max_model_len=128, num_pages=32, max_num_batched_tokens=16, record_block_selection=True
    )
    out = be.generate([GenerationRequest("g", IDS[0, :30].tolist(), SamplingParams(max_new_tokens=10, seed=1))])[0]
    ids = torch.tensor([out.prompt_ids + out.output_ids])
    rec = torch.from_numpy(out.block_selection.dense(ids.shape[1]))[None]  # [1, L, S, G, K]; last row -1
    assert rec.shape == (1, 40, 3, 2, K) and (rec[0, -1] == -1).all() and (rec[0, :-1] >= -1).all()
    m.train()
    lp0 = token_logprobs(m, ids)
    lp0.sum().backward()
    g0 = [p.grad.clone() for p in m.parameters() if p.grad is not None]
    m.zero_grad()
    agree = SelectionAgreement(m, "cpu")
    lp1 = token_logprobs(m, ids, block_selection=rec, index_replay=True, agreement=agree)
    lp1.sum().backward()
    g1 = [p.grad.clone() for p in m.parameters() if p.grad is not None]
    assert torch.equal(lp0, lp1)
    assert all(torch.equal(a, b) for a, b in zip(g0, g1))
    met = agree.metrics()
    assert met["msa_selection_agreement"] == 1.0 and met["msa_selection_overlap"] == 1.0
    assert agree.stats[:, 0].tolist() == [39 * 2] * 3  # 39 recorded tokens x 2 KV heads per layer
    assert all(a.block_replay is None for a in m.sparse_attention_layers())  # cleared after the block


def _other_selection(own: torch.Tensor, seed: int) -> torch.Tensor:
    """A valid selection different from ``own``: per (token, head) K distinct causal blocks, the own
    (local) block included, the others random."""
    g = torch.Generator().manual_seed(seed)
    b, l = own.shape[:2]
    out = torch.full_like(own, -1)
    for t in range(l):
        n = t // PS + 1
        for idx in np.ndindex(b, *own.shape[2:4]):
            rest = torch.randperm(n - 1, generator=g)[: K - 1] if n > 1 else torch.zeros(0, dtype=torch.long)
            ids = torch.cat([torch.tensor([n - 1]), rest])
            out[idx[0], t, idx[1], idx[2], : len(ids)] = ids.to(out.dtype)
    return out


def test_a_different_selection_changes_the_output_as_attention_over_those_blocks(monkeypatch):
    m = _model(1).train()
    own = own_selection(m, IDS)
    given = _other_selection(own, 0)
    given[1, 20:23] = -1  # not recorded: those tokens keep the trainer's own choice
    assert not torch.equal(given, own)
    lp = token_logprobs(m, IDS, block_selection=given, index_replay=True)
    lp.sum().backward()
    grads = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
    m.zero_grad()
    with torch.no_grad():
        assert (lp - token_logprobs(m, IDS)).abs().max() > 1e-3  # the forward really changed
    # Reference: each layer's own top-k (computed live: unrecorded rows of later layers see the
    # replayed earlier layers) replaced by exactly the given blocks where recorded.
    real, calls, n_layers = attention_mod.select_blocks, [], len(m.sparse_attention_layers())

    def fixed(scores, q_pos, topk, block_size, init_blocks, local_blocks):
        j = len(calls) % n_layers
        calls.append(j)
        mine = real(scores, q_pos, topk, block_size, init_blocks, local_blocks)  # [B, G, L, K]
        g = given[:, :, j].permute(0, 2, 1, 3).long()
        return torch.where((g >= 0).any(-1, keepdim=True), g, mine)

    monkeypatch.setattr(attention_mod, "select_blocks", fixed)
    ref = token_logprobs(m, IDS)
    ref.sum().backward()
    torch.testing.assert_close(lp, ref, atol=1e-6, rtol=0)
    for n, p in m.named_parameters():
        if n in grads:
            torch.testing.assert_close(grads[n], p.grad, atol=1e-6, rtol=1e-5)


def test_replay_keeps_forced_blocks_and_causality():
    pos = torch.tensor([[9, 20]])  # blocks of size 4: query 9 in block 2, query 20 in block 5
    own = torch.tensor([[[[2, 0, 1], [5, 4, 1]]]])  # [B=1, G=1, Sq=2, K=3]
    rec = torch.tensor([[[[0, 7, -1], [-1, -1, -1]]]])  # block 7 is in query 9's future; local 2 missing
    got = replayed_blocks(own, rec, pos, PS, init_blocks=1, local_blocks=2)
    assert got.shape == (1, 1, 2, 3 + 3)
    assert sorted(x for x in got[0, 0, 0].tolist() if x >= 0) == [0, 0, 1, 2]  # 7 dropped; local 2, 1 + init 0
    assert got[0, 0, 1].tolist() == [5, 4, 1, -1, -1, -1]  # no record: own choice
    counts = selection_agreement(own, rec)
    assert counts.tolist() == [1.0, 0.0, 0.5]  # one recorded row, sets differ, {0} of {0, 7} shared


def test_unfrozen_indexer_gets_no_gradient_and_does_not_move():
    m = _model(2)
    given = _other_selection(own_selection(m, IDS), 1)
    mask = torch.zeros(2, 40)
    mask[:, 20:] = 1
    batch = TrainBatch(IDS, mask, torch.zeros(2, 40), torch.tensor([1.0, -1.0]), torch.full((2,), 40), None, given)
    policy = Policy(m, lr=1e-2, freeze_indexer=False, index_replay=True)
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    policy.train_step(batch, ClippedPGLossFn(), 1.0, 2)
    moved = {n for n, p in m.named_parameters() if not torch.equal(p, before[n])}
    assert moved and not any("index_" in n for n in moved)
    assert all(p.grad is None for n, p in m.named_parameters() if "index_" in n)


def test_activation_checkpointing_replays_in_the_recomputation():
    m = _model(3).train()
    given = _other_selection(own_selection(m, IDS), 2)
    lp = token_logprobs(m, IDS, block_selection=given, index_replay=True)
    lp.sum().backward()
    want = [None if p.grad is None else p.grad.clone() for p in m.parameters()]
    m.zero_grad()
    enable_activation_checkpointing(m)
    agree = SelectionAgreement(m, "cpu")
    lp2 = token_logprobs(m, IDS, block_selection=given, index_replay=True, agreement=agree)
    lp2.sum().backward()
    torch.testing.assert_close(lp2, lp, atol=0, rtol=0)
    for a, p in zip(want, m.parameters()):
        assert (a is None) == (p.grad is None)
        if a is not None:
            torch.testing.assert_close(p.grad, a, atol=1e-6, rtol=1e-5)
    assert agree.stats[:, 0].tolist() == [2 * 40 * 2] * 3  # counted once, not again in the recompute


def test_shape_errors_are_named():
    m = _model()
    with pytest.raises(ValueError, match=r"\[S, G, K\]"):
        with replay_block_selection(m, torch.zeros(1, 4, 2, 2, K, dtype=torch.int16), True):
            pass


def test_bf16_generator_disagrees_on_near_ties_and_replay_lowers_the_mismatch():
    """A bf16 "generator" and the fp32 trainer share weights; the index-query weights are shrunk
    so that block scores nearly tie and bf16 rounding flips some selections (the engineered
    disagreement). The trainer measures agreement < 1 and, replaying the generator's blocks, a
    smaller mismatch to the generator's logprobs."""
    trainer = _model(5, scale=0.3)
    with torch.no_grad():
        for a in trainer.sparse_attention_layers():
            a.index_q_proj.weight.mul_(0.02)
    gen = M3ForCausalLM(trainer.config)
    gen.load_state_dict(trainer.state_dict())
    gen = gen.cast_for_inference(torch.bfloat16).eval()
    ids = torch.randint(0, 95, (4, 64), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        logits = gen(ids).float()
    rec = own_selection(gen, ids)
    gen_lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    gen_lp = torch.cat([torch.zeros(4, 1), gen_lp], 1)
    mask = torch.zeros(4, 64)
    mask[:, 16:] = 1
    batch = TrainBatch(ids, mask, gen_lp * mask, torch.zeros(4), torch.full((4,), 64), None, rec)
    figures = {}
    for replay in (False, True):
        policy = Policy(trainer, lr=1e-3, index_replay=replay)
        agree = SelectionAgreement(trainer, "cpu")
        prev = policy.get_logprobs(batch, 1.0, 2, agreement=agree)
        figures[replay] = (mismatch_metrics(batch.rollout_logprobs, prev, mask), agree.metrics())
    agreement = figures[False][1]["msa_selection_agreement"]
    print(
        f"\nselection agreement bf16 vs fp32 {agreement:.4f} (inside a replaying forward "
        f"{figures[True][1]['msa_selection_agreement']:.4f}), "
        f"overlap {figures[False][1]['msa_selection_overlap']:.4f}; "
        f"gen_kl without replay {figures[False][0]['gen_kl_error']:.3e}, with {figures[True][0]['gen_kl_error']:.3e}"
    )
    assert 0.5 < agreement < 1.0
    # Measured inside a replaying forward, a layer's own top-k sees the replayed earlier layers, so
    # only its own disagreement is left (the GRPO step measures without replay: compounded).
    assert figures[True][1]["msa_selection_agreement"] > agreement
    assert figures[True][0]["gen_kl_error"] < figures[False][0]["gen_kl_error"]
    assert figures[True][0]["token_mult_prob_error"] < figures[False][0]["token_mult_prob_error"]


def test_grpo_step_logs_agreement_and_mismatch_with_and_without_replay():
    """train_step_on_groups (the live loop's and the dump replay's step) on trajectories of a bf16
    generator: coverage, per-layer agreement < 1, and replay's lower mismatch in one step's metrics."""
    from m3_rollout.config import load_config
    from m3_rollout.model.selection_record import SelectionRecord, SelectionSegment
    from m3_rollout.rollout.trajectory import Trajectory
    from m3_trainers.step import build_loss_fn, build_policy, train_step_on_groups

    trainer = _model(5, scale=0.3)
    with torch.no_grad():
        for a in trainer.sparse_attention_layers():
            a.index_q_proj.weight.mul_(0.02)
    gen = M3ForCausalLM(trainer.config)
    gen.load_state_dict(trainer.state_dict())
    gen = gen.cast_for_inference(torch.bfloat16).eval()
    ids = torch.randint(0, 95, (4, 64), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        logits = gen(ids).float()
    rec = own_selection(gen, ids)
    lps = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    trajs = []
    for i in range(4):
        t = Trajectory(i // 2, i % 2, ids[i, :16].tolist(), [0] * 16, [0.0] * 16, [-1] * 16, 16, reward=float(i % 2))
        t.append(ids[i, 16:].tolist(), True, lps[i, 15:].tolist(), 1)
        segs = [
            SelectionSegment.from_rows(0, rec[i, :16].numpy()),
            SelectionSegment.from_rows(16, rec[i, 16:63].numpy()),
        ]
        t.block_selection = SelectionRecord(segs)  # the last token was never run: no record
        trajs.append(t)
    cfg = load_config(
        "configs/grpo_smoke.yaml",
        [
            "policy.generation.record_block_selection=true",
            "policy.index_replay=true",
            "policy.train_global_batch_size=4",
            "policy.train_micro_batch_size=2",
        ],
    )
    policy = build_policy(cfg, trainer, 1)
    m = train_step_on_groups(policy, build_loss_fn(cfg.loss_fn), trajs, cfg, 1.0).metrics
    assert m["msa_selection_coverage"] == pytest.approx(63 / 64)
    assert 0.5 < m["msa_selection_agreement"] < 1.0 and m["msa_selection_overlap"] > m["msa_selection_agreement"]
    layers = [a.layer_idx for a in trainer.sparse_attention_layers()]
    per_layer = [m[f"msa_selection_agreement/layer_{i}"] for i in layers]
    assert m["msa_selection_agreement"] == pytest.approx(sum(per_layer) / len(per_layer))
    assert m["gen_kl_error"] < m["gen_kl_error_without_replay"]
    assert m["token_mult_prob_error"] < m["token_mult_prob_error_without_replay"]


def test_record_dump_replay_round_trip(tmp_path):
    """Engine record (a forked group) -> Trajectory -> rollout dump -> trajectories_from_rows ->
    TrainBatch -> replay: the shared prompt segment comes back shared, and replaying it gives the
    logprobs of the trainer's own choice bit for bit (CPU fp32: the engine's is the same)."""
    from m3_rollout.dump import RolloutDumpWriter, read_dump, trajectories_from_rows
    from m3_rollout.rollout.trajectory import Trajectory
    from m3_trainers.batch import batch_from_trajectories

    m = _model(7).eval()
    be = NativeBackend(
        m, (95,), max_model_len=128, num_pages=48, max_num_batched_tokens=16, record_block_selection=True
    )
    prompt = IDS[1, :26].tolist()
    outs = be.generate([GenerationRequest("g", prompt, SamplingParams(n=3, max_new_tokens=14, seed=4))])
    trajs = []
    for o in outs:
        t = Trajectory(0, o.sample_index, list(prompt), [0] * 26, [0.0] * 26, [-1] * 26, 26)
        t.append(list(o.output_ids), True, list(o.logprobs), 0)
        t.block_selection = o.block_selection
        trajs.append(t)
    RolloutDumpWriter(tmp_path, run_id="r").write_step(1, trajs, [0.0, 0.0, 0.0], {}, {})
    back = trajectories_from_rows(read_dump(tmp_path).table.to_pylist())
    assert back[0].block_selection.segments[0] is back[2].block_selection.segments[0]
    batch = batch_from_trajectories(back, torch.zeros(3), with_block_selection=True)
    assert (batch.block_selection[:, -1] == -1).all()  # the last token was never run
    with torch.no_grad():
        agree = SelectionAgreement(m, "cpu")
        replayed = token_logprobs(m, batch.token_ids, block_selection=batch.block_selection, index_replay=True)
        own = token_logprobs(m, batch.token_ids, block_selection=batch.block_selection, agreement=agree)
    assert torch.equal(replayed, own)
    assert agree.metrics()["msa_selection_agreement"] == 1.0
    torch.testing.assert_close(
        own[:, 26:], torch.tensor([o.logprobs for o in outs]), atol=1e-5, rtol=0
    )  # and both are the engine's logprobs

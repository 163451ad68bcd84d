"""Dump replay: re-scoring with the generating checkpoint reproduces the stored rollout logprobs;
offline GRPO steps from a dump; the GRPO loop's dump hook and the CLI end to end."""

from __future__ import annotations

import json
import os

import pytest
import torch

from m3_rollout.config import load_config
from m3_rollout.dump import RolloutDumpWriter, read_dump
from m3_rollout.dump.__main__ import main as dump_main
from m3_rollout.dump.replay import rescore
from m3_rollout.engine.interface import GenerationRequest, SamplingParams
from m3_rollout.engine.native_backend import NativeBackend
from m3_rollout.jobs.replay import ForwardScorer, make_scorer, train_offline
from m3_rollout.model import M3ForCausalLM, load_checkpoint, save_checkpoint, tiny_config
from m3_rollout.rollout.trajectory import Trajectory

TEMPERATURE = 0.7
EOS = 3


def _model(seed: int = 0) -> M3ForCausalLM:
    torch.manual_seed(seed)
    m = M3ForCausalLM(tiny_config(vocab_size=64, max_position_embeddings=256))
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.3 if p.ndim >= 2 else 0.1)
    return m.float().eval()


def _rollouts(model: M3ForCausalLM) -> list[Trajectory]:
    """2 prompts x 2 samples, two model turns each with a fixed 'tool' bridge between them."""
    backend = NativeBackend(model, [EOS], max_model_len=256)
    trajs = []
    for g, prompt in enumerate([[5, 9, 11, 40, 2, 7], [8, 1, 60, 33, 21, 17, 4, 9, 30]]):
        for j in range(2):
            t = Trajectory(g, j, [], [], [], [], prompt_len=len(prompt))
            t.append(prompt, generated=False)
            for turn in range(2):
                params = SamplingParams(n=1, temperature=TEMPERATURE, max_new_tokens=12, seed=10 * g + turn)
                out = backend.generate([GenerationRequest(f"{g}-{j}-{turn}", list(t.token_ids), params, j)])[0]
                t.append(out.output_ids, generated=True, logprobs=out.logprobs, version=out.weight_version)
                t.texts.append(f"turn {turn}")
                if turn == 0:
                    t.append([50, 51, 52 + j], generated=False)  # tool turn
            t.reward = float(j)
            t.finish_reason = "stop"
            trajs.append(t)
    return trajs


@pytest.fixture(scope="module")
def dump(tmp_path_factory):
    root = tmp_path_factory.mktemp("replay")
    model = _model()
    save_checkpoint(model, model.config, root / "ckpt")
    trajs = _rollouts(model)
    w = RolloutDumpWriter(root / "dump", run_id="r")
    w.write_step(1, trajs, [1.0, -1.0, 1.0, -1.0], {"temperature": TEMPERATURE})
    return root, trajs


def test_rescoring_with_generating_checkpoint_equals_stored_logprobs(dump):
    root, trajs = dump
    read = read_dump(root / "dump")
    model = load_checkpoint(root / "ckpt", dtype=torch.float32)
    scorer, why = make_scorer(model, max_model_len=256)
    for s in (scorer, ForwardScorer(model)):
        stats, scores = rescore(read, s)
        assert stats[0].rows == 4 and stats[0].tokens == sum(t.num_generated for t in trajs)
        assert stats[0].max_abs_diff < 1e-4, (s.name, why, stats)
        for t in trajs:
            got = scores[(1, t.group_index, t.sample_index)]
            for m, a, b in zip(t.loss_mask, t.rollout_logprobs, got):
                if m:
                    assert abs(a - b) < 1e-4
        assert abs(stats[0].token_mult_prob_error - 1.0) < 1e-4
    # Another checkpoint (or another temperature) does not reproduce them.
    other, _ = rescore(read, ForwardScorer(_model(seed=1)))
    assert other[0].mean_abs_diff > 1e-2


def test_offline_grpo_steps_from_dump(dump):
    from m3_trainers.loss import ClippedPGLossFn
    from m3_trainers.policy import Policy

    root, trajs = dump
    cfg = load_config(
        None,
        [
            "grpo.num_prompts_per_step=2",
            "grpo.num_generations_per_prompt=2",
            "policy.train_global_batch_size=2",
            "policy.train_micro_batch_size=2",
        ],
    )
    model = load_checkpoint(root / "ckpt", dtype=torch.float32)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    policy = Policy(model, lr=1e-3, freeze_indexer=True, freeze_router_bias=True)
    history = train_offline(read_dump(root / "dump"), cfg, policy, ClippedPGLossFn(0.2, 0.2, True))
    assert [h["step"] for h in history] == [1] and history[0]["rows"] == 4
    # Two optimizer steps (global batch 2 of 4); the first scores against the stored rollout
    # logprobs at the stored temperature: the generating checkpoint -> no mismatch.
    assert abs(history[0]["token_mult_prob_error"] - 1.0) < 1e-3
    changed = [n for n, p in model.named_parameters() if not torch.equal(p, before[n])]
    assert changed and not any("index_q_proj" in n for n in changed)


def test_offline_training_refuses_a_step_whose_every_row_failed_before_training(dump, tmp_path):
    """A `dump generate` dump keeps a step in which every sample failed to generate (the GRPO loop
    stops at such a step instead). `replay --train` crashed with a traceback at that step (the
    training step's ValueError), after training the steps before it without saving them; now the
    dump is refused before any step trains, naming the step and how to leave it out."""
    from m3_rollout.dump import DumpError
    from m3_trainers.loss import ClippedPGLossFn
    from m3_trainers.policy import Policy

    root, trajs = dump
    w = RolloutDumpWriter(tmp_path / "dump", run_id="r")
    w.write_step(1, trajs, [1.0, -1.0, 1.0, -1.0], {"temperature": TEMPERATURE})
    failed = []
    for g in range(2):
        for j in range(2):
            t = Trajectory(g, j, [], [], [], [], prompt_len=6)
            t.append([5, 9, 11, 40, 2, 7], generated=False)
            t.finish_reason, t.info["error"] = "error", "no room under max_model_len"
            failed.append(t)
    w.write_step(2, failed, [0.0] * 4, {"temperature": TEMPERATURE})
    cfg = load_config(None, ["policy.train_global_batch_size=4", "policy.train_micro_batch_size=4"])
    model = load_checkpoint(root / "ckpt", dtype=torch.float32)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    policy = Policy(model, lr=1e-3, freeze_indexer=True, freeze_router_bias=True)
    with pytest.raises(DumpError, match=r"step 2: all 4 rows failed to generate .*--steps 1"):
        train_offline(read_dump(tmp_path / "dump"), cfg, policy, ClippedPGLossFn(0.2, 0.2, True))
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())  # nothing trained
    history = train_offline(read_dump(tmp_path / "dump", steps=[1]), cfg, policy, ClippedPGLossFn(0.2, 0.2, True))
    assert [(h["step"], h["rows"]) for h in history] == [(1, 4)]


def test_offline_training_keeps_the_lr_schedule_on_dumped_steps(dump, tmp_path):
    """Dumped step 1 has 2 of its 4 rows failed (2 optimizer steps of 1 row instead of 4): the
    second replayed step still trains from schedule position 4 (it used to start at 2) and the
    schedule ends at min_lr_ratio x lr after the last step."""
    import copy

    from m3_trainers.loss import ClippedPGLossFn
    from m3_trainers.policy import Policy, lr_factor
    from m3_trainers.step import total_optimizer_steps

    root, trajs = dump
    short = copy.deepcopy(trajs)
    for t in short[2:]:
        t.finish_reason, t.info["error"] = "error", "no room under max_model_len"
    w = RolloutDumpWriter(tmp_path / "dump", run_id="r")
    w.write_step(1, short, [1.0, -1.0, 0.0, 0.0], {"temperature": TEMPERATURE})
    w.write_step(2, trajs, [1.0, -1.0, 1.0, -1.0], {"temperature": TEMPERATURE})
    overrides = ["grpo.num_prompts_per_step=2", "grpo.num_generations_per_prompt=2"]
    cfg = load_config(None, [*overrides, "policy.train_global_batch_size=1", "policy.train_micro_batch_size=1"])
    read = read_dump(tmp_path / "dump")
    total = total_optimizer_steps(cfg, len(read.shards))
    assert total == 8
    model = load_checkpoint(root / "ckpt", dtype=torch.float32)
    policy = Policy(model, lr=1e-3, warmup_steps=1, lr_schedule="linear", total_steps=total, min_lr_ratio=0.1)
    history = train_offline(read, cfg, policy, ClippedPGLossFn(0.2, 0.2, True))
    assert [(h["step"], h["rows"]) for h in history] == [(1, 4), (2, 4)]
    assert [h["lr"] for h in history] == [1e-3 * lr_factor(p, 1, "linear", 8, 0.1) for p in (0, 4)]
    assert policy.schedule_position == 8 and policy.lr == pytest.approx(1e-4, rel=1e-12)


def test_offline_training_trains_each_dumped_step_at_the_runs_lr(dump, tmp_path):
    """A 5-step run (linear schedule after 3 warmup positions, 2 optimizer steps per GRPO step)
    dumps steps 1, 2, 4 and 5 (no shard for step 3); replaying steps 2, 4 and 5 (``--steps``)
    trains each at the LR the run logged for it (``train/lr``). It used to train the i-th replayed
    step at GRPO step i (steps 2, 4, 5 at the LRs of steps 1, 2, 3). ``lr_steps="replayed"`` keeps
    that schedule on request; a step past ``grpo.max_num_steps`` is refused before training."""
    import copy

    from m3_trainers.step import build_loss_fn, build_policy, total_optimizer_steps, train_step_on_groups

    root, trajs = dump
    overrides = [
        "grpo.num_prompts_per_step=2",
        "grpo.num_generations_per_prompt=2",
        "grpo.max_num_steps=5",
        "policy.train_global_batch_size=2",
        "policy.train_micro_batch_size=2",
        "policy.optimizer.lr=1e-3",
        "policy.scheduler.name=linear",
        "policy.scheduler.warmup_steps=3",
        "policy.scheduler.min_lr_ratio=0.1",
    ]
    cfg = load_config(None, overrides)
    loss_fn = build_loss_fn(cfg.loss_fn)

    def policy(num_grpo_steps):
        model = load_checkpoint(root / "ckpt", dtype=torch.float32)
        return build_policy(cfg, model, total_optimizer_steps(cfg, num_grpo_steps))

    run, run_lr = policy(5), {}  # the GRPO loop's training: step k at grpo_step_index k - 1
    w = RolloutDumpWriter(tmp_path / "dump", run_id="r")
    for step in range(1, 6):
        res = train_step_on_groups(run, loss_fn, copy.deepcopy(trajs), cfg, TEMPERATURE, grpo_step_index=step - 1)
        run_lr[step] = res.metrics["lr"]
        if step != 3:
            w.write_step(step, trajs, [1.0, -1.0, 1.0, -1.0], {"temperature": TEMPERATURE}, {"lr": run_lr[step]})
    assert len(set(run_lr.values())) == 5  # every step at its own LR
    read = read_dump(tmp_path / "dump", steps=[2, 4, 5])

    history = train_offline(read, cfg, policy(5), loss_fn)
    assert [h["step"] for h in history] == [2, 4, 5]
    assert [h["lr"] for h in history] == [run_lr[2], run_lr[4], run_lr[5]]

    from m3_rollout.dump import DumpError
    from m3_rollout.jobs.replay import lr_differences, schedule_indices
    from m3_trainers.policy import lr_factor

    assert lr_differences(read, history) == []
    assert schedule_indices([5, 2, 4], cfg) == ({2: 1, 4: 3, 5: 4}, 5)
    # The replayed steps as a 3-step run of their own (the earlier schedule): not the run's LRs.
    index, n = schedule_indices([2, 4, 5], cfg, "replayed")
    assert (index, n) == ({2: 0, 4: 1, 5: 2}, 3)
    own = train_offline(read, cfg, policy(n), loss_fn, lr_steps="replayed")
    assert [h["lr"] for h in own] == [1e-3 * lr_factor(2 * i, 3, "linear", 6, 0.1) for i in range(3)]
    assert [h["lr"] for h in own] != [h["lr"] for h in history]
    assert [d.split(":")[0] for d in lr_differences(read, own)] == ["step 2", "step 4", "step 5"]
    # A config whose schedule ends before the dump's last step: refused before anything trains.
    short = load_config(None, [*overrides, "grpo.max_num_steps=4"])
    fresh = policy(4)
    before = [p.detach().clone() for p in fresh.model.parameters()]
    with pytest.raises(DumpError, match=r"step 5 of the dump is past the LR schedule of grpo.max_num_steps=4") as exc:
        train_offline(read, short, fresh, loss_fn)
    assert "at least 5" in str(exc.value) and "--lr-steps replayed" in str(exc.value)
    assert all(torch.equal(a, b) for a, b in zip(before, fresh.model.parameters()))


def test_grpo_loop_dumps_and_cli(tmp_path, monkeypatch, capsys):
    from m3_rollout.jobs.grpo import run

    monkeypatch.setenv("M3_ROLLOUT_CACHE", str(tmp_path / "cache"))
    d = tmp_path / "dumps"
    overrides = [
        "grpo.max_num_steps=2",
        "grpo.val_at_start=false",
        "grpo.val_at_end=false",
        "grpo.num_prompts_per_step=2",
        "policy.train_global_batch_size=8",
        "policy.scheduler.warmup_steps=2",  # step 1 trains at lr / 2, step 2 at lr
        f"logger.log_dir={tmp_path}/logs",
        "checkpointing.enabled=false",
        "rollout_dump.enabled=true",
        f"rollout_dump.dir={d}",
        "rollout_dump.every_n_steps=2",
    ]
    cfg = load_config("configs/grpo_smoke.yaml", overrides)
    run(cfg)
    read = read_dump(d)
    assert [s.step for s in read.shards] == [2] and read.table.num_rows == 8
    metrics = [json.loads(l) for l in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    logged = [m for m in metrics if m.get("step") == 2 and "train/token_mult_prob_error" in m][0]
    assert read.shards[0].step_metrics["token_mult_prob_error"] == logged["train/token_mult_prob_error"]
    rows = read.table.to_pylist()
    assert all(r["weight_versions"][r["prompt_len"]] == 1 for r in rows)  # step 2 samples from version 1
    assert {r["sampling_params"] for r in rows} == {rows[0]["sampling_params"]}
    capsys.readouterr()
    assert dump_main(["inspect", str(d), "--plain"]) == 0
    out = capsys.readouterr().out
    assert f"{logged['train/token_mult_prob_error']:.4f}" in out
    assert dump_main(["show", str(d), "--step", "2", "--group", "1", "--plain"]) == 0
    assert "── sample 3" in capsys.readouterr().out
    assert dump_main(["show", str(d), "--step", "5", "--group", "0"]) == 2
    assert "no shard for steps [5]" in capsys.readouterr().err
    assert dump_main(["inspect", str(tmp_path / "nothing")]) == 2
    assert "does not exist" in capsys.readouterr().err
    # replay --train: the dump's only step, 2, trains at the run's step-2 LR (it used to train at
    # step 1's, lr / 2, the first position of a 1-step schedule) and no LR warning follows.
    replay = ["replay", str(d), "--config", "configs/grpo_smoke.yaml", *overrides, "--plain"]
    assert dump_main([*replay, "--train", "--json", str(tmp_path / "replay.json")]) == 0
    (trained,) = json.loads((tmp_path / "replay.json").read_text())["train"]
    assert trained["step"] == 2 and trained["lr"] == logged["train/lr"] == cfg.policy.optimizer.lr
    assert "another LR" not in capsys.readouterr().err
    # A config whose schedule ends before step 2: refused before the re-scoring.
    assert dump_main([*replay, "grpo.max_num_steps=1", "--train"]) == 2
    out = capsys.readouterr()
    assert "re-scoring" not in out.out
    assert "error: step 2 of the dump is past the LR schedule of grpo.max_num_steps=1" in out.err


def test_groups_from_several_prompt_batches_get_distinct_group_ids(tmp_path, monkeypatch):
    # Dynamic sampling (and async GRPO) fill one step with groups of several prompt batches,
    # whose trajectories all count group_index from 0. The step must renumber them: the dump's
    # (step, group_id, sample_index) key and offline advantages depend on it.
    import m3_rollout.jobs.grpo as grpo

    monkeypatch.setenv("M3_ROLLOUT_CACHE", str(tmp_path / "cache"))
    real = grpo.run_group_rollouts

    def only_group_0_has_signal(*args, **kw):  # each prompt batch keeps exactly its group 0
        trajs, m = real(*args, **kw)
        for t in trajs:
            t.reward = float(t.sample_index % 2) if t.group_index == 0 else 0.0
        return trajs, m

    monkeypatch.setattr(grpo, "run_group_rollouts", only_group_0_has_signal)
    d = tmp_path / "dumps"
    cfg = load_config(
        "configs/grpo_smoke.yaml",
        [
            "grpo.max_num_steps=1",
            "grpo.val_at_start=false",
            "grpo.val_at_end=false",
            "grpo.num_prompts_per_step=2",
            "grpo.use_dynamic_sampling=true",
            "grpo.dynamic_sampling_max_gen_batches=2",
            "policy.train_global_batch_size=8",
            f"logger.log_dir={tmp_path}/logs",
            "checkpointing.enabled=false",
            "rollout_dump.enabled=true",
            f"rollout_dump.dir={d}",
        ],
    )
    grpo.run(cfg)
    rows = read_dump(d).table.to_pylist()
    assert sorted((r["group_id"], r["sample_index"]) for r in rows) == [(g, j) for g in (0, 1) for j in range(4)]
    for r in rows:  # both kept groups have rewards 0, 1, 0, 1 -> advantages of alternating sign
        assert (r["advantage"] > 0) == (r["sample_index"] % 2 == 1)


def test_replay_overrides_may_follow_the_options():
    """`replay DIR --config CFG grpo.max_num_steps=2` (the usage's order) stopped with
    "unrecognized arguments: grpo.max_num_steps=2"."""
    from m3_rollout.jobs.dump_cli import parse_args

    a = parse_args(["replay", "d", "--config", "c.yaml", "grpo.max_num_steps=2", "--train", "x=1"])
    assert (a.dir, a.config, a.train, a.overrides) == ("d", "c.yaml", True, ["grpo.max_num_steps=2", "x=1"])
    b = parse_args(["replay", "d", "k=1", "--config", "c.yaml"])
    assert b.overrides == ["k=1"]
    with pytest.raises(SystemExit):
        parse_args(["replay", "d", "--config", "c.yaml", "stray"])
    with pytest.raises(SystemExit):
        parse_args(["inspect", "d", "k=1"])


def test_ctrl_c_during_replay_exits_130_saying_nothing_was_written(dump, monkeypatch, capsys):
    """A Ctrl-C while replay re-scored was a traceback; it writes --save and --json only at the end
    (each whole or not at all), and the one line says none of them was written."""
    from test_grpo_robustness import exit_status

    root, _ = dump

    def interrupted(read, scorer):
        raise KeyboardInterrupt

    monkeypatch.setattr("m3_rollout.dump.replay.rescore", interrupted)
    out, js = root / "trained", root / "replay.json"
    args = ["replay", str(root / "dump"), "--checkpoint", str(root / "ckpt"), "--plain"]
    assert exit_status(lambda: dump_main([*args, "--train", "--save", str(out), "--json", str(js)])) == 130
    err = capsys.readouterr().err
    assert err.splitlines() == [
        f"interrupted: the dump command stopped (Ctrl-C); nothing was written (--save {out} and --json {js}: "
        "written only at the end)"
    ], err
    assert not out.exists() and not js.exists()


def test_replay_json_is_written_whole_and_fsynced_through_write_atomic(dump, monkeypatch, capsys):
    """--json was a hand-written temporary file and rename, unsynced: after a power cut the JSON
    could be empty. It goes through atomic_file.write_atomic now: the file is fsynced before the
    rename and no temporary file is left beside it."""
    from durability import record_fsyncs  # tests/ on sys.path

    root, _ = dump
    synced = record_fsyncs(monkeypatch)
    out = root / "out"
    out.mkdir()
    (out / "replay.json").write_text("old")
    args = ["replay", str(root / "dump"), "--checkpoint", str(root / "ckpt"), "--plain"]
    assert dump_main([*args, "--json", str(out / "replay.json")]) == 0
    result = json.loads((out / "replay.json").read_text())
    assert result["checkpoint"] == str(root / "ckpt") and [s["step"] for s in result["rescore"]] == [1]
    st = os.stat(out / "replay.json")
    assert synced == [(st.st_dev, st.st_ino)] and os.listdir(out) == ["replay.json"]


@pytest.mark.parametrize("mbs", [2, 4])
def test_first_optimizer_steps_ratio_numerator_is_the_prev_logprobs_bitwise(dump, mbs):
    """The first optimizer step of a split GRPO step (global batch 2 of 4 rows) trains on the
    weights the prev logprobs were scored on: the training forward's logprobs (the ratio's
    numerator) equal them bit for bit, so every ratio is exactly 1. Review finding: with
    policy.train_micro_batch_size (4) above the global batch, the scoring pass ran 4 rows per
    forward (the whole batch's width) and the optimizer steps 2: other shapes, other bits."""
    import copy

    from m3_trainers.step import build_loss_fn, build_policy, train_step_on_groups

    root, trajs = dump
    overrides = ["grpo.num_prompts_per_step=2", "grpo.num_generations_per_prompt=2"]
    batch = ["policy.train_global_batch_size=2", f"policy.train_micro_batch_size={mbs}"]
    cfg = load_config(None, [*overrides, *batch])
    policy = build_policy(cfg, load_checkpoint(root / "ckpt", dtype=torch.float32), 2)
    loss_fn = build_loss_fn(cfg.loss_fn)
    pairs, real = [], loss_fn.loss_and_stats

    def recording(lp, prev, *args, **kwargs):
        pairs.append((lp.detach().clone(), prev.clone()))
        return real(lp, prev, *args, **kwargs)

    loss_fn.loss_and_stats = recording
    seen, step = [], policy.train_step

    def train_step(mb, *args, **kwargs):
        seen.append(mb.token_ids.shape[0])
        return step(mb, *args, **kwargs)

    policy.train_step = train_step
    train_step_on_groups(policy, loss_fn, copy.deepcopy(trajs), cfg, TEMPERATURE)
    assert seen == [2, 2] and len(pairs) == 2  # two optimizer steps of one 2-row micro batch each
    assert len(trajs[0].token_ids) < max(len(t.token_ids) for t in trajs)  # the batch is wider than step 1's rows
    lp, prev = pairs[0]
    assert torch.equal(lp, prev)  # the first step: the very bits scored before the update
    assert not torch.equal(*pairs[1])  # the second runs on updated weights

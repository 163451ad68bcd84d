"""Training checkpoints: released layout loadable by our loader and by transformers (same logits),
keep_top_k retention, and resume == uninterrupted run (CPU, fp32, sync)."""

import json
import sys
import types
from pathlib import Path

import pytest
import torch
from durability import assert_durably_renamed, record_fsyncs_and_renames  # tests/ on sys.path

from m3_rollout.model import M3ForCausalLM, load_checkpoint, tiny_config
from m3_trainers.batch import TrainBatch
from m3_trainers.checkpoint import CheckpointManager
from m3_trainers.loss import ClippedPGLossFn
from m3_trainers.policy import Policy


def _policy(seed=0):
    torch.manual_seed(seed)
    m = M3ForCausalLM(tiny_config(vocab_size=64, max_position_embeddings=128))
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.1 if p.ndim >= 2 else 0.05)
    return Policy(m, lr=1e-2, warmup_steps=3)


def _step(policy):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 64, (2, 12), generator=g)
    mask = torch.zeros(2, 12)
    mask[:, 6:] = 1
    batch = TrainBatch(ids, mask, torch.zeros(2, 12), torch.tensor([1.0, -1.0]), torch.full((2,), 12))
    return policy.train_step(batch, ClippedPGLossFn(), 1.0, 2)


def test_layout_and_loaders_agree(tmp_path):
    policy = _policy()
    _step(policy)
    path = CheckpointManager(tmp_path).save(1, policy, None, {"next_batch": 2}, {"validation/accuracy": 0.5})
    assert sorted(p.name for p in path.iterdir()) == [
        "optimizer.pt",
        "policy",
        "training_info.json",
        "training_state.pt",
    ]
    cfg = json.loads((path / "policy" / "config.json").read_text())
    assert cfg["model_type"] == "minimax_m3_vl" and "text_config" in cfg
    ids = torch.randint(0, 64, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = policy.model.eval()(ids)
        ours = load_checkpoint(path / "policy")(ids)
    assert torch.equal(ours, want)
    # transformers' VL class converts the released names itself (its conversion mapping).
    hfm = pytest.importorskip("transformers.models.minimax_m3_vl.modeling_minimax_m3_vl")
    from transformers.models.minimax_m3_vl.configuration_minimax_m3_vl import MiniMaxM3VLConfig

    hc = MiniMaxM3VLConfig.from_pretrained(path / "policy")
    # NOTE: our checkpoint has no vision tower; shrink the default one (only built, never run).
    hc.vision_config.update(dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2))
    hc.projector_hidden_size = 32
    hf = hfm.MiniMaxM3SparseForConditionalGeneration.from_pretrained(
        path / "policy", config=hc, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        theirs = hf(input_ids=ids).logits
    assert (theirs - want).abs().max().item() < 1e-4


def test_a_saved_checkpoint_is_on_the_disk_when_save_returns(tmp_path, monkeypatch):
    # The save renamed its temporary directory into place unsynced (the optimizer state, the
    # training state and training_info.json never fsynced): a power cut could leave a step_N
    # that looks complete but is not. Now the whole tree is fsynced before the rename, the parent
    # directory after it.
    policy = _policy()
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    (tok_dir / "tokenizer.json").write_text("{}")
    events = record_fsyncs_and_renames(monkeypatch)
    path = CheckpointManager(tmp_path / "ckpt").save(2, policy, tok_dir, {"next_batch": 3}, {"reward": 0.5})
    assert path.name == "step_2" and (path / "policy" / "tokenizer.json").is_file()
    assert {p.name for p in path.iterdir()} >= {"policy", "optimizer.pt", "training_state.pt", "training_info.json"}
    assert_durably_renamed(events, path)


def test_optimizer_and_rng_state_round_trip(tmp_path):
    a = _policy()
    _step(a)
    torch.manual_seed(123)
    mgr = CheckpointManager(tmp_path)
    path = mgr.save(1, a, None, {"next_batch": 2}, {})
    expected_rand = torch.rand(3)
    b = _policy(seed=5)  # different weights, fresh optimizer
    state = CheckpointManager.load(path, b)
    assert state == {"step": 1, "data": {"next_batch": 2}}
    assert torch.equal(torch.rand(3), expected_rand)
    for (n, p), q in zip(a.model.named_parameters(), b.model.parameters()):
        assert torch.equal(p, q), n
    assert b.lr == a.lr and b.scheduler.last_epoch == 1
    ma, mb = _step(a), _step(b)  # identical continuation
    assert ma["loss"] == mb["loss"] and ma["lr"] == mb["lr"]
    for p, q in zip(a.model.parameters(), b.model.parameters()):
        assert torch.equal(p, q)
    with pytest.raises(FileNotFoundError, match="optimizer.pt"):
        (path / "optimizer.pt").unlink()
        CheckpointManager.load(path, b)


@pytest.mark.parametrize("higher, kept", [(True, [1, 2, 4]), (False, [3, 4])])
def test_keep_top_k(tmp_path, higher, kept):
    policy = _policy()
    mgr = CheckpointManager(tmp_path, keep_top_k=2, higher_is_better=higher)
    for step, acc in [(1, 0.5), (2, 0.9), (3, 0.1), (4, 0.3)]:
        mgr.save(step, policy, None, {}, {"validation/accuracy": acc})
    # best two by the metric + the newest (resume point)
    assert mgr.steps() == kept
    assert not any(p.name.startswith("step_1.tmp") for p in tmp_path.iterdir())


def test_keep_top_k_without_a_metric_keeps_the_newest(tmp_path):
    """checkpointing.metric_name: null (NeMo RL's setting): keep_top_k keeps the newest checkpoints."""
    policy = _policy()
    mgr = CheckpointManager(tmp_path, keep_top_k=2, metric_name=None)
    for step, acc in [(1, 0.5), (2, 0.9), (3, 0.1), (4, 0.3)]:
        mgr.save(step, policy, None, {}, {"validation/accuracy": acc})
    assert mgr.steps() == [3, 4]


class _ParityReward:
    """Wraps the environment: reward = parity of the answer's length, so a random-weight model
    earns rewards and GRPO steps have non-zero gradients."""

    def __init__(self, base):
        self.base = base

    def __getattr__(self, name):
        return getattr(self.base, name)

    def step(self, state, turn):
        r = self.base.step(state, turn)
        r.reward = float(len(turn.content or "") % 2)
        return r


def test_resume_equals_uninterrupted_run(tmp_path, monkeypatch):
    monkeypatch.setenv("M3_ROLLOUT_CACHE", str(tmp_path / "cache"))
    import m3_rollout.jobs.grpo as grpo
    import m3_rollout.rollout.environments as environments  # build_rollout_stack looks it up there
    from m3_rollout.config import load_config

    orig = environments.build_environment
    monkeypatch.setattr(environments, "build_environment", lambda cfg: _ParityReward(orig(cfg)))
    common = [
        "policy.generation.dtype=float32",
        "grpo.val_period=100",
        "logger.print_sample_every=0",
        "grpo.num_val_prompts=4",
        "policy.optimizer.lr=1e-2",
        "policy.scheduler.warmup_steps=2",
    ]

    inits = []  # wandb.init calls, through a stand-in wandb module

    class FakeRun:
        def __init__(self, **kwargs):
            inits.append(kwargs)
            self.id = kwargs.get("id", f"run{len(inits)}")

        def log(self, metrics, step):
            pass

        def finish(self):
            pass

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=lambda **kw: FakeRun(**kw)))

    def run(name, steps, resume=False):
        wandb = ["logger.wandb.mode=offline", "logger.wandb.entity=team", "logger.wandb.tags=[m3,ci]"]
        cfg = load_config(
            "configs/grpo_smoke.yaml",
            common
            + (wandb if name == "split" else [])
            + [
                f"grpo.max_num_steps={steps}",
                f"logger.log_dir={tmp_path}/{name}/logs",
                f"checkpointing.checkpoint_dir={tmp_path}/{name}/ckpt",
                f"checkpointing.resume={resume}",
            ],
        )
        summary = grpo.run(cfg)
        rows = [json.loads(l) for l in (tmp_path / name / "logs" / "metrics.jsonl").read_text().splitlines()]
        return summary, {r["step"]: r for r in rows if "train/loss" in r}

    full, full_rows = run("full", 4)
    run("split", 2)
    resumed, split_rows = run("split", 4, resume=True)
    assert sorted(split_rows) == [1, 2, 3, 4] and sorted(full_rows) == [1, 2, 3, 4]
    assert any(full_rows[s]["train/grad_norm"] > 0 for s in (3, 4)), "the test needs real gradients"
    for s in (3, 4):
        for key in ("train/loss", "train/reward", "train/token_mult_prob_error", "train/grad_norm", "train/lr"):
            assert split_rows[s][key] == full_rows[s][key], (s, key)
    a = load_checkpoint(full["final_checkpoint"]).state_dict()
    b = load_checkpoint(resumed["final_checkpoint"]).state_dict()
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert [s for s, _ in resumed["val_history"]] == [0, 2, 4]
    # the resumed run continued the wandb run its checkpoint recorded
    first, second = inits
    assert first["entity"] == "team" and first["tags"] == ["m3", "ci"] and "id" not in first
    assert second["id"] == "run1" and second["resume"] == "allow"
    state = torch.load(tmp_path / "split" / "ckpt" / "step_4" / "training_state.pt", weights_only=False)
    assert state["data"]["wandb_run_id"] == "run1"


def test_resume_past_the_last_step_stops_at_start(tmp_path, capsys):
    """Resuming from a checkpoint at or past grpo.max_num_steps has nothing to train: the job stops
    before building anything, naming both keys (it used to validate the loaded weights and save them
    as a smaller step, reporting a gain it had not trained)."""
    from m3_rollout.config import ConfigError, load_config
    from m3_rollout.jobs.grpo import check_resume

    (tmp_path / "step_5").mkdir()

    def cfg(resume: bool, steps: int):
        over = [f"checkpointing.checkpoint_dir={tmp_path}", f"checkpointing.resume={resume}"]
        over.append(f"grpo.max_num_steps={steps}")
        return load_config("configs/grpo_bf16_ep.yaml", over)

    with pytest.raises(ConfigError, match=r"step 5.*grpo.max_num_steps=3"):
        check_resume(cfg(True, 3))
    with pytest.raises(ConfigError, match="step 5"):  # equal to the last step: nothing left either
        check_resume(cfg(True, 5))
    check_resume(cfg(True, 6))  # steps left: resumes
    assert "[warn]" not in capsys.readouterr().err
    check_resume(cfg(False, 3))  # a new run beside an earlier run's checkpoints: a warning naming the key
    assert "checkpointing.checkpoint_dir" in capsys.readouterr().err


def test_resume_without_a_checkpoint_says_so_and_starts_from_step_0(tmp_path, monkeypatch, capsys):
    """checkpointing.resume=true with nothing in checkpointing.checkpoint_dir started from step 0
    without a word (a mistyped directory went unnoticed); one line now names the absolute directory."""
    from m3_rollout.config import load_config
    from m3_rollout.jobs.grpo import check_resume

    monkeypatch.chdir(tmp_path)
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "step_3.tmp-1").mkdir()  # an unfinished save is no checkpoint

    def cfg(*over: str):
        return load_config(Path(__file__).parents[1] / "configs/grpo_bf16_ep.yaml", list(over))

    for enabled in ("true", "false"):  # a resume reads the directory even when this run saves nothing
        for where in ("ckpt", "chekpoints"):  # empty, and a typo that does not exist
            check_resume(
                cfg(
                    f"checkpointing.checkpoint_dir={where}",
                    "checkpointing.resume=true",
                    f"checkpointing.enabled={enabled}",
                )
            )
            out = capsys.readouterr().out.splitlines()
            assert out == [
                f"checkpointing.resume=true: no checkpoint (step_N directory) found in {tmp_path / where}; "
                "the run starts from step 0"
            ]
    check_resume(cfg("checkpointing.checkpoint_dir=ckpt"))  # resume=false: nothing to say
    assert capsys.readouterr().out == ""
    (tmp_path / "ckpt" / "step_2").mkdir()
    check_resume(cfg("checkpointing.checkpoint_dir=ckpt", "checkpointing.resume=true"))  # resumes: no line
    assert capsys.readouterr().out == ""


def test_a_resumed_run_cuts_metrics_jsonl_back_to_its_checkpoint(tmp_path):
    """A run interrupted after its step-1 checkpoint logged steps 2-3; resumed, it logged them again
    and metrics.jsonl read 0,1,2,3,2,3 (plots and the dump's mismatch lookup saw two of each)."""
    from m3_rollout.config import LoggerConfig
    from m3_rollout.jobs.metrics_logger import MetricsLogger

    path = tmp_path / "metrics.jsonl"
    rows = [{"step": 0, "validation/accuracy": 0.1}, {"step": 1, "train/loss": 1.0}, {"note": "no step"}]
    rows += [{"step": 2, "train/loss": 2.0}, {"step": 3, "train/loss": 3.0}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "not json\n")
    cfg = LoggerConfig(log_dir=str(tmp_path), wandb_enabled=False)
    logger = MetricsLogger(cfg, {"checkpointing": {"resume": True}}, write=lambda s: None, resume_step=1)
    logger.log({"loss": 2.5}, step=2, prefix="train/")
    logger.close()
    got = [json.loads(l) if l.startswith("{") else l for l in path.read_text().splitlines()]
    assert [g.get("step") if isinstance(g, dict) else g for g in got] == [0, 1, None, "not json", 2]
    assert got[-1]["train/loss"] == 2.5
    fresh = MetricsLogger(cfg, {"checkpointing": {"resume": False}}, write=lambda s: None)
    fresh.close()
    assert path.read_text() == ""  # a fresh run starts a fresh log, as before


def test_resume_with_other_trainable_tensors_is_refused_naming_them(tmp_path):
    """AdamW's state is matched by position: with another policy.freeze.patterns on resume, the
    moments of k_proj landed on v_proj without a word."""
    torch.manual_seed(0)
    m = M3ForCausalLM(tiny_config(vocab_size=64))
    policy = Policy(m, lr=1e-2, freeze_patterns=[r"layers\.0\.self_attn\.v_proj"])
    _step(policy)
    path = CheckpointManager(tmp_path).save(1, policy, None, {"next_batch": 2}, {})
    other = Policy(
        M3ForCausalLM(tiny_config(vocab_size=64)), lr=1e-2, freeze_patterns=[r"layers\.0\.self_attn\.k_proj"]
    )
    with pytest.raises(
        ValueError, match=r"optimizer trains other tensors than the run that saved it .*k_proj.*policy\.freeze"
    ):
        CheckpointManager.load(path, other)
    same = Policy(M3ForCausalLM(tiny_config(vocab_size=64)), lr=1e-2, freeze_patterns=[r"layers\.0\.self_attn\.v_proj"])
    assert CheckpointManager.load(path, same)["step"] == 1

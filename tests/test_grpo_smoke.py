"""End to end: the smoke config runs GRPO on a random-weight tiny M3 and saves a checkpoint."""

import dataclasses
import json

import pytest
import torch

from m3_rollout.config import load_config
from m3_rollout.jobs import builtin
from m3_rollout.jobs.grpo import main, run
from m3_rollout.jobs.step_metrics import logged_metric_names
from m3_rollout.model import load_checkpoint


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("M3_ROLLOUT_CACHE", str(tmp_path / "cache"))
    return tmp_path


def test_smoke_run(cache, capsys):
    out = cache / "run"
    cfg = load_config(
        "configs/grpo_smoke.yaml", [f"logger.log_dir={out}/logs", f"checkpointing.checkpoint_dir={out}/ckpt"]
    )
    summary = run(cfg)
    assert f"logs in {out}/logs (metrics.jsonl, summary.json" in capsys.readouterr().out  # where results went
    assert summary["built_now"] is True
    assert [s for s, _ in summary["val_history"]] == [0, 2, 3]
    assert all(0.0 <= a <= 1.0 for _, a in summary["val_history"])
    rows = [json.loads(l) for l in (out / "logs" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "train/loss" in r]
    assert [r["step"] for r in train] == [1, 2, 3]
    for r in train:
        # bf16 generator vs fp32 trainer: close but not identical.
        assert 1.0 <= r["train/token_mult_prob_error"] < 1.5
        # Random weights never earn a reward, so advantages (and gradients) are 0 here;
        # tests/test_policy.py checks learning with non-zero advantages.
        assert r["train/num_tokens"] > 0 and r["train/grad_norm"] >= 0
        assert r["train/advantages/min"] <= r["train/advantages/mean"] <= r["train/advantages/max"]
        assert r["timing/train/total_step_time"] >= r["timing/train/generation"] > 0
    # the names the loop logs are the ones step_metrics promises (checkpointing.metric_name is checked
    # against that list at start), NeMo RL's among them
    logged = {k for r in rows for k in r if k != "step"}
    assert logged == logged_metric_names(cfg), logged ^ logged_metric_names(cfg)
    assert {"train/reward", "validation/accuracy", "train/policy_kl_error", "train/js_divergence_error"} <= logged
    ckpt = load_checkpoint(summary["final_checkpoint"])
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(summary["final_checkpoint"])
    assert len(tok) == ckpt.config.vocab_size
    # The saved weights are the trained ones (AdamW's decoupled weight decay moves them even at zero
    # gradient), frozen ones untouched.
    start = load_checkpoint(summary["model_dir"])
    changed = [n for n, p in ckpt.state_dict().items() if not torch.equal(p, start.state_dict()[n])]
    assert changed and not any("index_q_proj" in n or "e_score_correction_bias" in n for n in changed)
    # Second resolve hits the cache.
    path, info = builtin.resolve_model("builtin:tiny-random")
    assert str(path) == summary["model_dir"] and info["built"] is False


def test_cli_rejects_unknown_key(cache, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--config", "configs/grpo_smoke.yaml", "grpo.no_such_key=1"])
    assert exc.value.code == 2
    assert "grpo.no_such_key" in capsys.readouterr().err


def test_help_is_a_short_usage_with_an_example(capsys):
    # --help printed the module's developer docstring (design.md sections, internal function names).
    with pytest.raises(SystemExit) as exc:
        main(["--help"], prog="python -m m3_rollout.grpo")
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m m3_rollout.grpo [--config YAML] [key=value ...]\n")
    assert "  python -m m3_rollout.grpo --config configs/grpo_smoke.yaml grpo.max_num_steps=10\n" in out
    assert "documented in m3_rollout/config.py" in out and "--config YAML" in out
    assert "design.md" not in out and "train_step_on_groups" not in out
    assert len(out.splitlines()) < 40


def test_unknown_model_names(tmp_path):
    with pytest.raises(ValueError, match="builtin:tiny-calculator"):
        builtin.resolve_model("builtin:nope")
    accepted = "give a checkpoint directory (one holding config.json) or one of builtin:tiny-calculator, "
    # A path that does not exist says so (it used to say "no config.json there").
    with pytest.raises(FileNotFoundError) as exc:
        builtin.resolve_model("/nonexistent/dir")
    assert str(exc.value).startswith("/nonexistent/dir does not exist; " + accepted)
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError) as exc:
        builtin.resolve_model(str(tmp_path / "weights.bin"))
    assert str(exc.value).startswith(f"{tmp_path / 'weights.bin'} is a file, not a checkpoint directory; {accepted}")
    with pytest.raises(FileNotFoundError) as exc:
        builtin.resolve_model(str(tmp_path))
    assert str(exc.value).startswith(f"{tmp_path}: the directory has no config.json; {accepted}")
    step = tmp_path / "checkpoints" / "step_3"  # a GRPO checkpoint: the model is in policy/
    (step / "policy").mkdir(parents=True)
    (step / "policy" / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=f"model is its policy/ folder: give {step / 'policy'}$"):
        builtin.resolve_model(str(step))


def test_spec_key_changes_with_spec():
    a = builtin.TinyCheckpointSpec()
    b = builtin.TinyCheckpointSpec(tokenizer_vocab_size=512)
    assert a.key() == builtin.TinyCheckpointSpec().key() != b.key()


def test_warm_start_outside_window_warns_with_rebuild_hint(tmp_path):
    # a build that hit its step/time cap outside the accuracy window is flagged on every use
    spec = builtin.TinyCheckpointSpec()
    report = {
        "in_window": False,
        "warm_start_steps": 200,
        "build_seconds": 255.7,
        "heldout_accuracy": 0.16,
        "spec": dataclasses.asdict(spec),
        "history": [(0, 0.0), (100, 0.05), (200, 0.16), (250, 0.12)],
    }
    msg = builtin.warm_start_warning(tmp_path, report)
    assert msg is not None and "0.160" in msg and "[0.25, 0.45]" in msg and str(tmp_path) in msg
    # the last step trained and the snapshot kept (the closest to the window) are both named
    assert "ran 250 steps" in msg and "kept step 200" in msg
    assert builtin.warm_start_warning(tmp_path, dict(report, in_window=True)) is None
    assert builtin.warm_start_warning(tmp_path, {"built": False}) is None  # a user checkpoint directory
    assert "step cap was reached" in msg and f"delete {tmp_path} and run again." in msg
    capped = builtin.warm_start_warning(tmp_path, dict(report, time_capped=True))
    # the cap is a preset value, not a config key
    cap = f"({spec.warm_start.max_seconds:.0f} s, part of the builtin preset)"
    assert cap in capped and "max_seconds=" not in capped and "step cap" not in capped
    assert f"delete {tmp_path} and run again on a less loaded machine." in capped
    # an older or partial report: missing fields read "?" instead of failing
    odd = builtin.warm_start_warning(tmp_path, {"in_window": False, "spec": None, "build_seconds": None})
    assert odd.startswith("WARNING: the checkpoint's warm start ran ? steps in ? s and kept step ?")

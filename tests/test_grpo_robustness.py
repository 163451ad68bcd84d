"""The GRPO job's failure modes: non-finite steps, broken reward functions, unwritable outputs,
config errors found at start (exit 2 naming the key), overlong filtering's token counts, the
truncated-turn reward and the warning for truncated-sampling logprobs."""

import json
import os
import subprocess
import sys

import pytest
import torch
from test_rollout_multiturn import CALL, REC, ScriptedBackend, settings, tok  # noqa: F401 (fixture reuse)

import m3_rollout.jobs.grpo as grpo
from m3_rollout.config import load_config
from m3_rollout.jobs.dump_cli import main as dump_main
from m3_rollout.rollout.environments.calculator import CalculatorEnvironment
from m3_rollout.rollout.group_rollout import run_group_rollouts
from m3_trainers.loss import ClippedPGLossFn
from m3_trainers.step import truncated_sampling_warning

SMOKE = "configs/grpo_smoke.yaml"


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("M3_ROLLOUT_CACHE", str(tmp_path / "cache"))
    return tmp_path


def _args(tmp_path, *extra):
    """Smoke job, in-process engine (no worker processes), no validation or checkpoints."""
    return [
        "--config",
        SMOKE,
        "policy.generation.expert_parallel_size=1",
        "cluster.launcher=auto",
        "grpo.val_at_start=false",
        "grpo.val_at_end=false",
        "grpo.val_period=100",
        "logger.print_sample_every=0",
        "checkpointing.enabled=false",
        f"logger.log_dir={tmp_path}/logs",
        *extra,
    ]


def _metrics(tmp_path):
    rows = [json.loads(l) for l in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "train/loss" in r]


class _NaNLoss(ClippedPGLossFn):
    def loss_and_stats(self, *args, **kw):
        loss, m = super().loss_and_stats(*args, **kw)
        return loss * float("nan"), m


def test_non_finite_steps_are_reported_and_an_all_skipped_run_exits_1(cache, monkeypatch, capsys):
    monkeypatch.setattr(grpo, "build_loss_fn", lambda lf: _NaNLoss())
    with pytest.raises(SystemExit) as exc:
        grpo.main(_args(cache, "grpo.max_num_steps=2"))
    assert exc.value.code == 1
    out = capsys.readouterr()
    assert out.out.count("is not finite; the optimizer update was skipped") == 2
    assert "every one of the 2 GRPO steps skipped its update" in out.err
    train = _metrics(cache)
    assert [r["train/skipped_step"] for r in train] == [True, True]
    assert train[-1]["train/skipped_steps_total"] == 2
    assert json.loads((cache / "logs" / "summary.json").read_text())["skipped_steps"] == 2


def test_reward_errors_are_counted_and_a_step_where_all_failed_stops_the_run(cache, monkeypatch, capsys):
    real = grpo.run_group_rollouts

    def failing_rewards(backend, chat, env, records, settings):
        trajs, m = real(backend, chat, env, records, settings)
        step = settings.seed % 100_003  # the batch index (jobs.stack.batch_seed)
        for t in trajs:
            if step == 2 or t.sample_index == 0:
                t.reward, t.info["reward_error"] = 0.0, "ZeroDivisionError: division by zero"
        return trajs, m

    monkeypatch.setattr(grpo, "run_group_rollouts", failing_rewards)
    with pytest.raises(SystemExit) as exc:
        grpo.main(_args(cache, "grpo.max_num_steps=3"))
    assert exc.value.code == 1
    out = capsys.readouterr()
    assert "[warn] step 1: 4 of 16 rewards failed and were scored 0; first: ZeroDivisionError" in out.out
    assert "step 2: every reward failed (ZeroDivisionError: division by zero)" in out.err
    assert [(r["step"], r["train/reward_errors"]) for r in _metrics(cache)] == [(1, 4)]  # step 2 never trained


def test_unwritable_output_directory_is_found_at_start(cache, capsys):
    (cache / "afile").write_text("x")
    with pytest.raises(SystemExit) as exc:
        grpo.main(_args(cache, "checkpointing.enabled=true", f"checkpointing.checkpoint_dir={cache}/afile/ckpt"))
    assert exc.value.code == 2
    assert "checkpointing.checkpoint_dir=" in capsys.readouterr().err
    assert not (cache / "logs" / "metrics.jsonl").exists()  # before the first step
    assert not (cache / "cache").exists()  # before the checkpoint is even built


def test_a_fresh_run_refuses_a_dump_directory_holding_an_earlier_runs_shards(cache, capsys):
    d = cache / "dumps"
    d.mkdir()
    (d / "step_00000001.parquet").write_bytes(b"an earlier run's shard")
    with pytest.raises(SystemExit) as exc:
        grpo.main(_args(cache, "rollout_dump.enabled=true", f"rollout_dump.dir={d}"))
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"rollout_dump.dir={str(d)!r} already holds 1 step shards" in err and "checkpointing.resume=true" in err
    assert (d / "step_00000001.parquet").read_bytes() == b"an earlier run's shard"
    assert not (cache / "cache").exists()  # found before the checkpoint is built


def test_dump_generate_refuses_a_non_empty_directory(cache, capsys):
    d = cache / "dumps"
    d.mkdir()
    (d / "notes.txt").write_text("keep me")
    assert dump_main(["generate", "--config", SMOKE, "--dir", str(d), "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "--dir=" in err and "not empty" in err
    assert [p.name for p in d.iterdir()] == ["notes.txt"]
    assert not (cache / "cache").exists()  # nothing was built or generated


def _jsonl(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize(
    "case, key",
    [
        ("ep", "policy.generation.expert_parallel_size"),
        ("missing_data", "data.path"),
        ("bad_record", "bad.jsonl:2"),
        ("reward_fn", "env.jsonl.reward_fn"),
        ("tool", "env.jsonl.tools"),
    ],
)
def test_config_errors_found_when_building_exit_2_naming_the_key(cache, capsys, case, key):
    good = _jsonl(cache / "d.jsonl", [json.dumps({"prompt": f"{i}+1", "answer": str(i + 1)}) for i in range(20)])
    bad = _jsonl(cache / "bad.jsonl", [json.dumps({"prompt": "1+1", "answer": "2"}), json.dumps({"prompt": "2+2"})])
    jsonl = ["env.name=jsonl", "data.source=jsonl", "grpo.num_val_prompts=4"]
    extra = {
        "ep": ["policy.generation.expert_parallel_size=3", "cluster.launcher=mp"],
        "missing_data": [*jsonl, f"data.path={cache}/nope.jsonl"],
        "bad_record": [*jsonl, f"data.path={bad}"],
        "reward_fn": [*jsonl, f"data.path={good}", "env.jsonl.reward_fn=no_such_pkg.score"],
        "tool": [*jsonl, f"data.path={good}", "env.jsonl.tools=[calculator,shell]"],
    }[case]
    with pytest.raises(SystemExit) as exc:
        grpo.main(_args(cache, *extra))
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and key in err and "Traceback" not in err


def test_a_missing_model_path_exits_2_saying_it_does_not_exist(cache, capsys):
    with pytest.raises(SystemExit) as exc:
        grpo.main(_args(cache, f"policy.model_name={cache}/nonexistent"))
    assert exc.value.code == 2
    err = capsys.readouterr().err
    missing = f"{cache}/nonexistent"
    assert err.startswith(f"error: policy.model_name='{missing}': {missing} does not exist; ")
    assert "builtin:tiny-calculator" in err and "config.json" in err and "Traceback" not in err


def test_a_config_file_given_without_config_says_to_use_the_flag(cache, capsys):
    with pytest.raises(SystemExit) as exc:
        grpo.main([SMOKE, "grpo.max_num_steps=1"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err == f"error: {SMOKE!r} is not a key=value override; give a config file as --config {SMOKE}\n"


def test_weights_that_do_not_fit_config_json_exit_2_naming_the_checkpoint(cache, capsys):
    # A checkpoint whose config.json disagrees with its tensors (vocab_size edited): one error line
    # naming the directory (load_checkpoint's CheckpointError), exit 2, not a ValueError traceback.
    import shutil

    from m3_rollout.jobs.builtin import resolve_model

    src, _ = resolve_model("builtin:tiny-random")
    bad = cache / "bad_ckpt"
    shutil.copytree(src, bad)
    config = json.loads((bad / "config.json").read_text())
    config["text_config"]["vocab_size"] = 100  # the released (VL) layout nests the text model's keys
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(SystemExit) as exc:
        grpo.main(_args(cache, f"policy.model_name={bad}"))
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"\nerror: {bad}: the weights do not match its config.json: checkpoint does not match the model:\n" in err
    assert "mis-shaped" in err and "Traceback" not in err


def test_ctrl_c_before_the_first_step_names_no_metrics_file(cache, capsys, monkeypatch):
    # Interrupted while the rollout backend starts: the metrics logger has not created
    # metrics.jsonl yet, so the line must not point at it.
    def interrupted(*args, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(grpo, "build_generation_backend", interrupted)
    with pytest.raises(SystemExit) as exc:
        grpo.main(_args(cache))
    assert exc.value.code == 130
    (line,) = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("interrupted:")]
    assert "no metrics were written yet" in line and "metrics.jsonl" not in line
    assert not (cache / "logs" / "metrics.jsonl").exists()


def test_ctrl_c_during_a_builtin_build_exits_130_with_one_line(cache, capsys, monkeypatch):
    # KeyboardInterrupt where the build begins (training its tokenizer), as a Ctrl-C would raise it.
    from m3_rollout.jobs import builtin

    def interrupted(*args, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(builtin, "train_tokenizer", interrupted)
    with pytest.raises(SystemExit) as exc:
        grpo.main(_args(cache))
    assert exc.value.code == 130
    err = capsys.readouterr().err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    (line,) = [ln for ln in err.splitlines() if ln.startswith("interrupted:")]
    assert line == (
        "interrupted: the build of builtin:tiny-random stopped (Ctrl-C) and nothing of it was kept; "
        "rerunning starts the build again from the beginning"
    )
    # No checkpoint or saved progress left behind (a build stopped before its first save keeps
    # nothing); only the build lock's file, released.
    (lock,) = (cache / "cache").iterdir()
    assert lock.name.startswith("tiny-random-") and lock.suffix == ".lock" and lock.read_text() == ""


def test_ctrl_c_during_grpo_exits_130_naming_the_checkpoint_to_resume_from(cache, capsys, monkeypatch):
    # KeyboardInterrupt in the second step's training (as a Ctrl-C would raise it), after step 1 saved
    # its checkpoint: one line naming that checkpoint and the resume key, exit 130, no traceback.
    real = grpo.train_step_on_groups
    calls = []

    def interrupted_on_step_2(*args, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kw)

    monkeypatch.setattr(grpo, "train_step_on_groups", interrupted_on_step_2)
    ckpt = cache / "ckpt"
    args = _args(cache, "grpo.max_num_steps=3", "checkpointing.enabled=true", "checkpointing.save_period=1")
    with pytest.raises(SystemExit) as exc:
        grpo.main([*args, f"checkpointing.checkpoint_dir={ckpt}"])
    assert exc.value.code == 130
    err = capsys.readouterr().err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    (line,) = [ln for ln in err.splitlines() if ln.startswith("interrupted:")]
    assert f"metrics so far are in {cache}/logs/metrics.jsonl" in line
    assert f"the latest checkpoint in {ckpt} is step 1: add checkpointing.resume=true" in line
    assert (ckpt / "step_1").is_dir() and not (ckpt / "step_2").exists()
    assert len(_metrics(cache)) == 1  # step 1's row was written before the interrupt


def _interrupted_while_loading(module: str, run: str) -> subprocess.CompletedProcess:
    """Run ``run`` (Python lines) in a child whose import hook raises KeyboardInterrupt when
    ``module`` is imported, as a Ctrl-C during the entry's imports would."""
    code = (
        "import runpy, sys\n"
        "class Stop:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        f"        if name == {module!r}:\n"
        "            raise KeyboardInterrupt\n"
        "sys.meta_path.insert(0, Stop())\n" + run
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


def test_ctrl_c_while_the_job_module_loads_exits_130_with_one_line():
    # A Ctrl-C during ``python -m m3_rollout.grpo``'s imports (torch, triton: seconds on a busy
    # machine) must not print a traceback: one line, exit 130.
    proc = _interrupted_while_loading(
        "m3_rollout.jobs.grpo", "runpy.run_module('m3_rollout.grpo', run_name='__main__')\n"
    )
    assert proc.returncode == 130, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines == ["interrupted: the GRPO job stopped (Ctrl-C) while loading; nothing was started"], proc.stderr
    assert proc.stdout == ""


@pytest.mark.parametrize(
    "command,module",
    [("grpo", "m3_rollout.jobs.grpo"), ("export", "m3_rollout.jobs.export"), ("dump", "m3_rollout.dump.reader")],
)
def test_ctrl_c_while_the_console_command_loads_exits_130_with_one_line(command, module):
    # The same for the ``m3-rollout`` console command, which imports the job inside its main().
    proc = _interrupted_while_loading(
        module, f"from m3_rollout.cli import main\nsys.exit(main([{command!r}, '--help']))\n"
    )
    assert proc.returncode == 130, proc.stderr
    want = f"interrupted: m3-rollout {command} stopped (Ctrl-C) while loading; nothing was started"
    assert proc.stderr.strip().splitlines() == [want], proc.stderr
    assert proc.stdout == ""


@pytest.mark.parametrize(
    "entry, loader, what",
    [
        ("m3_rollout.export", "m3_rollout.cli._import_entry", "the export"),
        ("m3_rollout.dump.__main__", "m3_rollout.jobs.dump_cli._load", "the dump command"),
        ("m3_rollout.jobs.dump_cli", "m3_rollout.jobs.dump_cli._load", "m3-rollout dump"),
    ],
)
def test_ctrl_c_while_export_or_dump_main_loads_exits_130_with_one_line(monkeypatch, capsys, entry, loader, what):
    # Their main() was the job module's own, imported with the module (outside load_entry): a
    # Ctrl-C while it loaded was a traceback. The loader raises as a Ctrl-C during its imports would.
    import importlib

    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(loader, interrupted)
    with pytest.raises(SystemExit) as exc:
        importlib.import_module(entry).main(["--help"])
    assert exc.value.code == 130
    err = capsys.readouterr().err
    assert err.splitlines() == [f"interrupted: {what} stopped (Ctrl-C) while loading; nothing was started"], err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err


@pytest.mark.parametrize(
    "entry, module, what",
    [
        ("m3_rollout.export", "torch", "the export"),
        ("m3_rollout.dump", "pyarrow", "the dump command"),
        ("m3_rollout.jobs.dump_cli", "pyarrow", "the dump command"),
    ],
)
def test_ctrl_c_while_python_m_export_or_dump_loads_exits_130_with_one_line(entry, module, what):
    # The same through ``python -m``: m3_rollout.dump's package __init__ (which runs before its
    # __main__) imported pyarrow and torch itself, outside any handler; m3_rollout.jobs.dump_cli
    # imported pyarrow with the module and had no handler at all.
    proc = _interrupted_while_loading(module, f"runpy.run_module({entry!r}, run_name='__main__')\n")
    assert proc.returncode == 130, proc.stderr
    want = f"interrupted: {what} stopped (Ctrl-C) while loading; nothing was started"
    assert proc.stderr.strip().splitlines() == [want], proc.stderr
    assert proc.stdout == ""


@pytest.mark.parametrize(
    "how, what",
    [
        ("m3-rollout dump", "m3-rollout dump"),
        ("python -m m3_rollout.dump", "the dump command"),
        ("python -m m3_rollout.jobs.dump_cli", "the dump command"),
    ],
)
def test_ctrl_c_while_the_dump_command_works_exits_130_under_each_name(tmp_path, monkeypatch, capsys, how, what):
    # ``python -m m3_rollout.jobs.dump_cli`` ran the command line without the Ctrl-C handling the
    # other names had: a Ctrl-C while it worked was a traceback. runpy runs the module's __main__
    # block as ``python -m`` does, in this process.
    import runpy
    import warnings

    from m3_rollout import cli

    def interrupted(path):
        raise KeyboardInterrupt

    monkeypatch.setattr("m3_rollout.dump.report.inspect_lines", interrupted)
    argv = ["inspect", str(tmp_path)]
    if how == "m3-rollout dump":
        run = lambda: cli.main(["dump", *argv])  # noqa: E731
    else:
        monkeypatch.setattr(sys, "argv", [how.split()[-1], *argv])
        run = lambda: runpy.run_module(how.split()[-1], run_name="__main__")  # noqa: E731
    with warnings.catch_warnings():  # runpy: the module was imported before (by an earlier test)
        warnings.simplefilter("ignore", RuntimeWarning)
        assert exit_status(run) == 130
    err = capsys.readouterr().err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert err.splitlines() == [f"interrupted: {what} stopped (Ctrl-C)"], err


def _tiny_checkpoint(path):
    from m3_rollout.model import M3ForCausalLM, save_checkpoint, tiny_config

    model = M3ForCausalLM(tiny_config(bos_token_id=None, eos_token_id=None))
    save_checkpoint(model, model.config, path)
    return path


def _ctrl_c_after_files(monkeypatch, n: int) -> None:
    """The checkpoint writer writes ``n`` files whole, then a Ctrl-C lands (before the next one)."""
    from m3_rollout.model import loading

    real, done = loading.write_atomic, []

    def atomic(path, write, **kw):
        if len(done) == n:
            raise KeyboardInterrupt
        done.append(path)
        real(path, write, **kw)

    monkeypatch.setattr(loading, "write_atomic", atomic)


def exit_status(call) -> int | str | None:
    """The SystemExit code ``call()`` raises; a KeyboardInterrupt escaping it (what a user saw as a
    traceback) fails the test instead of stopping the test session."""
    try:
        call()
    except SystemExit as exc:
        return exc.code
    except KeyboardInterrupt:
        pytest.fail("the Ctrl-C escaped as a KeyboardInterrupt: a traceback for the user")
    pytest.fail("no SystemExit")


def _one_interrupted_line(capsys, what: str, err: str | None = None) -> str:
    err = capsys.readouterr().err if err is None else err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    (line,) = err.splitlines()
    prefix = f"interrupted: {what} stopped (Ctrl-C); "
    assert line.startswith(prefix), line
    return line[len(prefix) :]


def _contents(path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in path.iterdir()}


def test_ctrl_c_during_an_export_exits_130_and_keeps_no_partial_export(tmp_path, monkeypatch, capsys):
    # A Ctrl-C while the export wrote its files was a traceback, and left a directory holding the
    # weights without config.json (or, over an earlier export, new weights beside the old config).
    from m3_rollout.export import main as export_main

    src = _tiny_checkpoint(tmp_path / "src")
    out = tmp_path / "new" / "out"
    _ctrl_c_after_files(monkeypatch, 1)  # the weights are written, config.json is not
    assert exit_status(lambda: export_main(["--model", str(src), "--out", str(out)])) == 130
    left = _one_interrupted_line(capsys, "the export")
    assert left == f"nothing was written (--out {out} was not created)"
    assert not out.exists() and list(out.parent.iterdir()) == []  # no staging directory left beside it
    # over an earlier, complete export: the export is written beside it and renamed in only at the
    # end, so a Ctrl-C mid-write leaves the earlier export as it was (it mixed the two before)
    monkeypatch.undo()
    assert export_main(["--model", str(src), "--out", str(out)]) == 0
    capsys.readouterr()
    old = _contents(out)
    _ctrl_c_after_files(monkeypatch, 1)
    assert exit_status(lambda: export_main(["--model", str(src), "--out", str(out), "--dtype", "bfloat16"])) == 130
    assert _one_interrupted_line(capsys, "the export") == f"--out {out} was not changed"
    assert _contents(out) == old and [p.name for p in out.parent.iterdir()] == ["out"]
    # stopped before writing (while the source loads): the directory is untouched, and says so
    monkeypatch.setattr(
        "m3_rollout.jobs.export.load_checkpoint", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt)
    )
    assert exit_status(lambda: export_main(["--model", str(src), "--out", str(out)])) == 130
    assert _one_interrupted_line(capsys, "the export") == f"--out {out} was not changed"
    assert _contents(out) == old


def test_a_failed_export_over_an_earlier_one_leaves_it_whole_and_a_finished_one_replaces_it(
    tmp_path, monkeypatch, capsys
):
    # An error mid-write (a full disk: the second file fails) over an earlier export left the new
    # weights beside the old config.json; now the earlier export stays whole and nothing is left
    # beside it. A finished export replaces the directory whole: no file of the earlier one (a
    # tokenizer the new source does not have) stays beside it.
    from m3_rollout.jobs.export import main as export_main
    from m3_rollout.model import loading

    src = _tiny_checkpoint(tmp_path / "src")
    out = tmp_path / "out"
    assert export_main(["--model", str(src), "--out", str(out)]) == 0
    (out / "tokenizer.json").write_text("{}")  # as an export of a source with a tokenizer leaves it
    old = _contents(out)
    real, done = loading.write_atomic, []

    def disk_full_on_the_second_file(path, write, **kw):
        if done:
            raise OSError(28, "No space left on device")
        done.append(path)
        real(path, write, **kw)

    monkeypatch.setattr(loading, "write_atomic", disk_full_on_the_second_file)
    with pytest.raises(OSError, match="No space left"):
        export_main(["--model", str(src), "--out", str(out), "--dtype", "bfloat16"])
    assert done and _contents(out) == old
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "src"]  # no staging directory left
    monkeypatch.undo()
    capsys.readouterr()
    assert export_main(["--model", str(src), "--out", str(out), "--dtype", "bfloat16"]) == 0
    assert sorted(_contents(out)) == sorted(_contents(src))  # the earlier tokenizer.json is gone with it
    assert _contents(out)["model.safetensors"] != old["model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "src"]


def test_the_export_is_written_in_a_mkdtemp_directory_beside_out_and_renamed_in_0755(tmp_path, monkeypatch):
    # The staging directory is tempfile's (a unique name made in one call, no hand-made name), hidden
    # and beside --out so the swap is a rename; a new export directory is 0755 (mkdtemp makes 0700)
    # and an existing one keeps its mode.
    import tempfile

    from m3_rollout.jobs import export

    src = _tiny_checkpoint(tmp_path / "src")
    out = tmp_path / "new" / "out"
    made, real = [], tempfile.mkdtemp

    def mkdtemp(**kw):
        made.append(real(**kw))
        return made[-1]

    monkeypatch.setattr(export.tempfile, "mkdtemp", mkdtemp)
    assert export.export_checkpoint(src, out) == ["config.json", "model.safetensors"]
    (staging,) = made
    assert os.path.dirname(staging) == str(out.parent) and os.path.basename(staging).startswith(".out.export-")
    assert out.stat().st_mode & 0o777 == 0o755 and os.listdir(out.parent) == ["out"]
    out.chmod(0o750)
    export.export_checkpoint(src, out)
    assert len(made) == 2 and out.stat().st_mode & 0o777 == 0o750 and os.listdir(out.parent) == ["out"]


def test_export_refuses_an_out_directory_holding_files_it_does_not_write(tmp_path, capsys):
    # The export replaces --out whole, so a directory holding anything else (notes, another
    # checkpoint) is refused before the source is loaded, and left as it was.
    from m3_rollout.jobs.export import main as export_main

    src = _tiny_checkpoint(tmp_path / "src")
    out = tmp_path / "out"
    (out / "other_run").mkdir(parents=True)
    (out / "config.json").write_text("{}")
    (out / "notes.txt").write_text("keep me")
    assert export_main(["--model", str(src), "--out", str(out)]) == 2
    assert capsys.readouterr().err == (
        f"error: --out={str(out)!r}: holds notes.txt, other_run, which an export does not write; the export "
        "replaces the whole directory, so give a new or empty directory, or an earlier export's\n"
    )
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "notes.txt", "other_run"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "src"]


def test_ctrl_c_during_dump_generate_exits_130_naming_the_whole_shards_it_kept(tmp_path, monkeypatch, capsys):
    # A Ctrl-C during generate was a traceback; the shards written before it are whole (each is
    # renamed into place), and the line says how many of the steps asked for they are.
    from types import SimpleNamespace

    from m3_rollout.dump import read_dump
    from m3_rollout.dump.__main__ import main as dump_entry
    from m3_rollout.rollout.group_rollout import RolloutSettings
    from m3_rollout.rollout.trajectory import Trajectory

    settings = RolloutSettings(n=2, max_turns=1, max_total_len=16, max_new_tokens=4)
    stack = SimpleNamespace(
        model_dir=_tiny_checkpoint(tmp_path / "ckpt"),
        chat=SimpleNamespace(decode=lambda ids: " ".join(map(str, ids))),
        backend=SimpleNamespace(shutdown=lambda: None),
        env=SimpleNamespace(close=lambda: None),
        source=SimpleNamespace(train_batch=lambda step, n: [{}]),
        settings=settings,
        settings_for=lambda cfg, step: settings,
    )

    def rollouts(backend, chat, env, records, settings):
        if rollouts.steps == 2:
            raise KeyboardInterrupt  # during step 3's generation
        rollouts.steps += 1
        trajs = []
        for j in range(2):
            t = Trajectory(0, j, [], [], [], [], prompt_len=3)
            t.append([5, 6, 7], generated=False)
            t.append([8, 9], generated=True, logprobs=[-0.5, -0.25], version=0)
            t.reward, t.finish_reason = float(j), "stop"
            trajs.append(t)
        return trajs, {"rollout_seconds": 0.1, "generation_tokens_per_s": 40.0}

    rollouts.steps = 0
    monkeypatch.setattr("m3_rollout.jobs.dump_generate.build_rollout_stack", lambda cfg: stack)
    monkeypatch.setattr("m3_rollout.jobs.dump_generate.run_group_rollouts", rollouts)
    d = tmp_path / "dumps"
    assert exit_status(lambda: dump_entry(["generate", "--config", SMOKE, "--dir", str(d), "--steps", "5"])) == 130
    printed = capsys.readouterr()
    assert [ln.split(":")[0] for ln in printed.out.splitlines()] == ["step 1", "step 2"]
    left = _one_interrupted_line(capsys, "the dump command", printed.err)
    assert left == (
        f"2 of the 5 steps were dumped to {d} (step_00000001.parquet, step_00000002.parquet): each shard is whole "
        "and readable, the step in progress was not written; a new generate needs an empty --dir"
    )
    read = read_dump(d)
    assert [s.step for s in read.shards] == [1, 2] and read.table.num_rows == 4 and not read.errors
    assert sorted(p.name for p in d.iterdir()) == ["step_00000001.parquet", "step_00000002.parquet"]


def test_save_final_stopped_by_ctrl_c_leaves_no_temporary_directory(tmp_path, monkeypatch):
    # save_final writes a temporary directory and renames it; a Ctrl-C in between left the
    # half-written step_N.tmp-* directory beside the checkpoints.
    from types import SimpleNamespace

    from m3_rollout.model import M3ForCausalLM, tiny_config

    model = M3ForCausalLM(tiny_config())
    _ctrl_c_after_files(monkeypatch, 1)
    with pytest.raises(KeyboardInterrupt):
        grpo.save_final(SimpleNamespace(model=model), tmp_path / "src", tmp_path / "out", 3)
    assert list((tmp_path / "out").iterdir()) == []


def test_save_final_and_the_export_are_on_the_disk_when_they_return(tmp_path, monkeypatch):
    # Both wrote a temporary directory and renamed it into place unsynced: a power cut could leave
    # a step_N / --out directory that looks complete but is not (the tokenizer files copied in,
    # never fsynced). Now the whole tree is fsynced before the rename, the parent after it.
    from types import SimpleNamespace

    from durability import assert_durably_renamed, record_fsyncs_and_renames  # tests/ on sys.path

    from m3_rollout.jobs import export
    from m3_rollout.model import M3ForCausalLM, tiny_config

    src = _tiny_checkpoint(tmp_path / "src")
    (src / "tokenizer.json").write_text("{}")
    events = record_fsyncs_and_renames(monkeypatch)
    final = grpo.save_final(SimpleNamespace(model=M3ForCausalLM(tiny_config())), src, tmp_path / "out", 3)
    assert (final / "tokenizer.json").is_file()
    assert_durably_renamed(events, final)
    out = tmp_path / "exported" / "out"
    for _ in range(2):  # a new --out, then over the earlier export
        events.clear()
        export.export_checkpoint(src, out)
        assert (out / "tokenizer.json").is_file()
        assert_durably_renamed(events, out)


def test_a_refit_the_rollout_rejects_ends_the_run_with_exit_1_and_no_traceback(cache, capsys):
    # A probe threshold no real update meets: the first refit (the trainer's step-0 weights) is
    # rejected. The job used to die with the backend's ValueError traceback; now one error naming
    # the check and the refused version, exit 1 (TrainingError), and no step runs.
    args = _args(cache, "grpo.max_num_steps=2", "weight_sync.probe.enabled=true", "weight_sync.probe.threshold=1e-30")
    with pytest.raises(SystemExit) as exc:
        grpo.main(args)
    assert exc.value.code == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert "probe drift" in err and "> weight_sync.probe.threshold=1e-30 after update 0" in err
    assert "the rollout refused weight version 0, so it cannot serve the trainer's weights; the run stops" in err
    assert not (cache / "logs" / "metrics.jsonl").exists() or not _metrics(cache)


def test_overlong_filtering_token_counts_agree_with_the_batch(cache):
    # Random weights rarely sample eos within 24 tokens: most trajectories are cut ("length").
    summary = grpo.main(_args(cache, "grpo.max_num_steps=1", "grpo.overlong_filtering=true"))
    assert summary["trained_steps"] == 1
    (r,) = _metrics(cache)
    assert r["train/overlong_filtered"] > 0
    n = 16  # num_prompts_per_step * num_generations_per_prompt
    assert r["train/mean_gen_tokens_per_sample"] * n == pytest.approx(r["train/num_tokens"])


@pytest.mark.parametrize("reward", [None, -1.0])
def test_truncated_turn_reward_is_a_config_choice(tok, reward):  # noqa: F811
    from m3_rollout.chat.template import ChatFormat

    chat = ChatFormat(tok, "disabled")
    backend = ScriptedBackend({0: [(chat.assistant_ids("The answer is 408"), "length")]})
    (t,), _ = run_group_rollouts(backend, chat, CalculatorEnvironment(), [REC], settings(truncated_turn_reward=reward))
    assert t.finish_reason == "length"
    assert t.reward == (1.0 if reward is None else reward)  # None: the env scores what the cut turn said
    cfg = load_config(SMOKE, [] if reward is None else [f"env.truncated_turn_reward={reward}"])
    assert cfg.env.truncated_turn_reward == reward


def test_truncated_sampling_logprobs_get_a_warning_naming_the_keys():
    assert truncated_sampling_warning(load_config(SMOKE)) is None
    w = truncated_sampling_warning(load_config(SMOKE, ["policy.generation.top_p=0.9", "policy.generation.top_k=20"]))
    assert "policy.generation.top_p=0.9" in w and "policy.generation.top_k=20" in w
    assert "loss_fn.use_importance_sampling_correction=False" in w


def test_offline_replay_combines_every_optimizer_step(cache):
    # dump replay --train and the live loop share one step: its metrics cover the whole batch, not
    # the last optimizer step's slice.
    from m3_rollout.jobs.replay import train_offline
    from m3_rollout.model import load_checkpoint
    from m3_trainers.step import build_loss_fn, build_policy

    d = cache / "dumps"
    args = [*_args(cache)[2:], "grpo.max_num_steps=1", "rollout_dump.enabled=true", f"rollout_dump.dir={d}"]
    summary = grpo.run(load_config(SMOKE, args))
    from m3_rollout.dump import read_dump

    read = read_dump(d)
    cfg = load_config(SMOKE, ["policy.train_global_batch_size=4"])
    policy = build_policy(cfg, load_checkpoint(summary["model_dir"], dtype=torch.float32), 4)
    (h,) = train_offline(read, cfg, policy, build_loss_fn(cfg.loss_fn))
    sampled = sum(sum(m) for m in read.table.column("loss_mask").to_pylist())
    assert h["rows"] == 16 and h["num_tokens"] == sampled


def test_generation_errors_are_counted_and_a_step_where_all_failed_stops_the_run(cache, monkeypatch, capsys):
    """A prompt with no room under max_model_len made every sample of its group an error record:
    reward 0, loss 0, a checkpoint saved and exit 0, with no word about it."""
    real = grpo.run_group_rollouts

    def some_too_long(backend, chat, env, records, settings):
        step = settings.seed % 100_003  # the batch index (jobs.stack.batch_seed)
        long = [dict(r, messages=[{"role": "user", "content": "pad " * 400}]) for r in records]
        return real(backend, chat, env, long if step == 2 else long[:1] + records[1:], settings)

    monkeypatch.setattr(grpo, "run_group_rollouts", some_too_long)
    with pytest.raises(SystemExit) as exc:
        grpo.main(_args(cache, "grpo.max_num_steps=3"))
    assert exc.value.code == 1
    out = capsys.readouterr()
    assert (
        "[warn] step 1: 4 of 16 samples failed to generate (advantage 0, left out of their groups' baselines "
        "and of train/reward; nothing trained); first: "
    ) in out.out
    assert "leaves no room under max_model_len" in out.out
    assert "step 2: every sample failed to generate (" in out.err
    assert [(r["step"], r["train/generation_errors"]) for r in _metrics(cache)] == [(1, 4)]  # one group of 4


def test_a_failed_sample_is_left_out_of_its_groups_advantages_and_trains_nothing(tok):  # noqa: F811
    """A group of 5 where sample 3's second turn and sample 4's first were refused: the step's
    advantages are those of the 3 generated samples alone (the placeholder rewards 0 used to
    lower their baseline), the failed ones get 0 and no trained token (sample 3's first turn
    included), and train/reward is over the generated samples."""
    from m3_rollout.chat.template import ChatFormat
    from m3_rollout.jobs.step_metrics import advantage_metrics, generation_errors, rollout_metrics
    from m3_rollout.model import M3ForCausalLM, tiny_config
    from m3_trainers.advantages import group_advantages
    from m3_trainers.step import build_loss_fn, build_policy, train_step_on_groups

    chat = ChatFormat(tok, "disabled")
    backend = ScriptedBackend(
        {
            0: [(chat.assistant_ids("408"), "stop")],
            1: [(chat.assistant_ids("7"), "stop")],
            2: [(chat.assistant_ids("408"), "stop")],
            3: [(chat.assistant_ids("Let me compute.", [CALL]), "stop"), ([], "error")],
            4: [([], "error")],
        }
    )
    trajs, _ = run_group_rollouts(backend, chat, CalculatorEnvironment(), [REC], settings(n=5))
    assert [t.finish_reason for t in trajs] == ["stop", "stop", "stop", "error", "error"]
    assert [t.reward for t in trajs] == [1.0, 0.0, 1.0, 0.0, 0.0]
    assert len(generation_errors(trajs)) == 2
    assert sum(trajs[3].loss_mask) > 0  # its first turn was sampled before the second was refused
    cfg = load_config(SMOKE)
    torch.manual_seed(0)
    model = M3ForCausalLM(tiny_config(vocab_size=len(tok), max_position_embeddings=512)).float()
    res = train_step_on_groups(build_policy(cfg, model, 1), build_loss_fn(cfg.loss_fn), trajs, cfg, 1.0)
    alone = group_advantages(torch.tensor([1.0, 0.0, 1.0]), torch.zeros(3, dtype=torch.long))
    assert torch.equal(res.advantages[:3], alone) and res.advantages[3:].tolist() == [0.0, 0.0]
    assert res.advantages[0].item() == pytest.approx(1 / 3 / ((1 / 3) ** 0.5 + 1e-6), rel=1e-6)  # not 1.095
    # the failed rows are not in the trained batch (a refused over-long prompt would set its width)
    assert res.batch.token_ids.shape[0] == 3 and torch.equal(res.batch.advantages, alone)
    assert res.batch.token_ids.shape[1] == max(len(t.token_ids) for t in trajs[:3])
    assert sum(trajs[3].loss_mask) == 0 and all(r.masked for r in trajs[3].turns)
    assert res.metrics["num_tokens"] == sum(sum(t.loss_mask) for t in trajs[:3]) > 0
    rewards = torch.tensor([t.reward for t in trajs])
    m = rollout_metrics(trajs, rewards)
    assert (m["reward"], m["accuracy"], m["generation_errors"]) == (pytest.approx(2 / 3), pytest.approx(2 / 3), 2)
    assert advantage_metrics(res.batch.advantages, res.batch.loss_mask)["advantages/min"] < 0  # sample 1's, not a 0


def test_resume_from_a_partial_checkpoint_is_one_error_line_and_exit_2(cache, capsys):
    """A step directory without optimizer.pt (or with a truncated file) was a traceback, exit 1."""
    step = cache / "ckpt" / "step_1"
    (step / "policy").mkdir(parents=True)
    args = _args(
        cache, "grpo.max_num_steps=2", "checkpointing.enabled=true", f"checkpointing.checkpoint_dir={cache}/ckpt"
    )
    with pytest.raises(SystemExit) as exc:
        grpo.main([*args, "checkpointing.resume=true"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"error: checkpointing.resume=true: {step} cannot be resumed from: FileNotFoundError:")
    assert "lacks optimizer.pt" in err and "delete that step directory" in err


def test_lr_schedule_follows_grpo_steps_when_samples_fail(cache, monkeypatch):
    """Step 1 loses a group of 4 to generation errors: 12 of 16 rows, 3 optimizer steps of 4 rows
    instead of 4. Step 2 still trains from schedule position 4 (it used to start at 3) and the run
    ends at min_lr_ratio x lr (it used to stop one position short)."""
    from m3_trainers.policy import lr_factor

    real_rollouts, real_build = grpo.run_group_rollouts, grpo.build_policy
    policies = []

    def first_group_too_long_at_step_1(backend, chat, env, records, settings):
        step = settings.seed % 100_003  # the batch index (jobs.stack.batch_seed)
        long = [dict(r, messages=[{"role": "user", "content": "pad " * 400}]) for r in records[:1]]
        return real_rollouts(backend, chat, env, long + records[1:] if step == 1 else records, settings)

    def build_policy(*args):
        policies.append(real_build(*args))
        return policies[-1]

    monkeypatch.setattr(grpo, "run_group_rollouts", first_group_too_long_at_step_1)
    monkeypatch.setattr(grpo, "build_policy", build_policy)
    sched = ["policy.scheduler.name=linear", "policy.scheduler.warmup_steps=2", "policy.scheduler.min_lr_ratio=0.1"]
    batch = ["policy.train_global_batch_size=4", "policy.train_micro_batch_size=4"]
    grpo.main(_args(cache, "grpo.max_num_steps=2", *batch, *sched))
    lr = load_config(SMOKE).policy.optimizer.lr
    rows = _metrics(cache)
    assert [r["train/generation_errors"] for r in rows] == [4, 0]
    assert [r["train/lr"] for r in rows] == [lr * lr_factor(p, 2, "linear", 8, 0.1) for p in (0, 4)]
    (policy,) = policies
    assert policy.schedule_position == 8 and policy.lr == pytest.approx(0.1 * lr, rel=1e-12)


def test_the_checkpoint_line_of_a_cached_build_shows_its_held_out_accuracy():
    """Fresh-user finding: a cached build's line showed only its build time, so README's "check the
    build line" (held-out accuracy) had nothing to check after the first run."""
    fresh = grpo.checkpoint_line("/c/m", {"built": True, "build_seconds": 12.34, "heldout_accuracy": 0.3125})
    assert fresh == "built checkpoint /c/m in 12.3 s (held-out accuracy 0.312)"
    cached = grpo.checkpoint_line("/c/m", {"built": False, "build_seconds": 411.9, "heldout_accuracy": 0.0})
    assert cached == "using checkpoint /c/m (cached build of 411.9 s, held-out accuracy 0.000)"
    assert grpo.checkpoint_line("/own", {"built": False}) == "using checkpoint /own"  # a user's checkpoint

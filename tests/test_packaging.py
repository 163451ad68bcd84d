"""The package as a user installs it: pyproject.toml's package list covers the tree, the wheel
installs no top-level `kernels` or `trainers`, ships the configs and chat templates with the
`m3-rollout` command, and an installed copy finds the configs by name (with `defaults:`) from a
directory that is not a clone."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import warnings
import zipfile
from pathlib import Path

import pytest
import tomllib

from m3_rollout.config import load_config, packaged_configs_dir, resolve_config_path

ROOT = Path(__file__).resolve().parents[1]
DATA_PACKAGES = {"m3_rollout.configs"}  # folders of data only (no __init__.py), mapped by package-dir


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_every_package_folder_is_listed():
    st = _pyproject()["tool"]["setuptools"]
    listed = set(st["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "m3_rollout").rglob("__init__.py")}
    assert found - listed == set(), f"add these packages to pyproject.toml: {sorted(found - listed)}"
    extra = listed - found - {"m3_kernels", "m3_trainers"} - DATA_PACKAGES
    assert extra == set(), f"pyproject.toml lists packages that do not exist: {sorted(extra)}"
    for name, folder in st["package-dir"].items():
        marker = "grpo_bf16_ep.yaml" if name in DATA_PACKAGES else "__init__.py"
        assert (ROOT / folder / marker).is_file(), (name, folder)


def test_no_colliding_top_level_names():
    st = _pyproject()["tool"]["setuptools"]
    tops = {p.split(".")[0] for p in st["packages"]}
    assert tops == {"m3_rollout", "m3_kernels", "m3_trainers"}, tops
    assert st["package-dir"] == {"m3_kernels": "kernels", "m3_trainers": "trainers", "m3_rollout.configs": "configs"}


def test_no_exact_pins_of_shared_gpu_packages():
    """transformers / triton / torch are shared with vLLM or NeMo RL in a GPU environment: ranges only."""
    project = _pyproject()["project"]
    reqs = project["dependencies"] + [r for extra in project["optional-dependencies"].values() for r in extra]
    for name in ("torch", "transformers", "triton"):
        specs = [r for r in reqs if r.split(">")[0].split("=")[0].split("<")[0].strip() == name]
        assert specs, name
        assert not any("==" in r for r in specs), specs


# ---------------------------------------------------------------------------- config lookup
def test_config_found_by_name_outside_a_clone(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no configs/ here
    shipped = packaged_configs_dir() / "grpo_smoke.yaml"
    for name in ("configs/grpo_smoke.yaml", "grpo_smoke.yaml", "grpo_smoke"):
        assert resolve_config_path(name) == shipped
    # defaults: inheritance resolves next to the packaged file
    cfg = load_config("configs/grpo_async.yaml")
    assert cfg.grpo.async_grpo.enabled is True and cfg.logger.log_dir == "outputs/async/logs"
    assert cfg.grpo.num_prompts_per_step == 16  # from grpo_bf16_ep.yaml


def test_local_config_file_wins_and_unknown_names_list_the_shipped_ones(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "grpo_smoke.yaml").write_text("grpo:\n  max_num_steps: 7\n")
    assert resolve_config_path("configs/grpo_smoke.yaml") == Path("configs/grpo_smoke.yaml")
    assert load_config("configs/grpo_smoke.yaml").grpo.max_num_steps == 7
    with pytest.raises(FileNotFoundError, match=r"grpo_nope\.yaml.*grpo_bf16_ep\.yaml, grpo_h200\.yaml"):
        resolve_config_path("configs/grpo_nope.yaml")
    with pytest.raises(FileNotFoundError, match="packaged configs"):
        resolve_config_path(tmp_path / "absent.yaml")  # an absolute path is never looked up by name


# ---------------------------------------------------------------------------- the built wheel
@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel setuptools builds from a copy of the source (the checkout stays clean)."""
    build_meta = pytest.importorskip("setuptools.build_meta")
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    skip = shutil.ignore_patterns("__pycache__", "*.pyc")
    for folder in ("m3_rollout", "kernels", "trainers", "configs"):
        shutil.copytree(ROOT / folder, src / folder, ignore=skip)
    out = tmp_path_factory.mktemp("dist")
    cwd = os.getcwd()
    os.chdir(src)
    try:
        with warnings.catch_warnings():  # data folders (templates/, bench/) that setuptools calls packages
            warnings.filterwarnings("ignore", message="Package .* is absent from the `packages` configuration")
            name = build_meta.build_wheel(str(out))
    finally:
        os.chdir(cwd)
    return out / name


def test_wheel_ships_configs_templates_and_the_command(wheel):
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        entry_points = next(zf.read(n).decode() for n in names if n.endswith(".dist-info/entry_points.txt"))
    configs = [p for p in (ROOT / "configs").rglob("*") if p.suffix in (".yaml", ".json")]
    shipped = {f"m3_rollout/configs/{p.relative_to(ROOT / 'configs').as_posix()}" for p in configs}
    assert shipped and shipped <= names, sorted(shipped - names)
    assert {"m3_rollout/chat/templates/m3_full.jinja", "m3_rollout/chat/templates/m3_short.jinja"} <= names
    assert "m3-rollout = m3_rollout.cli:main" in entry_points
    tops = {n.split("/")[0] for n in names if not n.startswith("m3_rollout-")}  # not the .dist-info folder
    assert tops == {"m3_rollout", "m3_kernels", "m3_trainers"}


def test_installed_wheel_runs_configs_by_name(wheel, tmp_path):
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(site)
    work = tmp_path / "work"
    work.mkdir()
    code = (
        f"import sys; sys.path.insert(0, {str(site)!r})\n"
        "import m3_rollout, m3_rollout.cli\n"
        f"assert m3_rollout.__file__.startswith({str(site)!r}), m3_rollout.__file__\n"
        "from m3_rollout.config import load_config\n"
        "cfg = load_config('configs/grpo_async.yaml', ['grpo.max_num_steps=3'])\n"
        "print(cfg.grpo.async_grpo.enabled, cfg.grpo.num_prompts_per_step, cfg.grpo.max_num_steps)\n"
        "print(load_config('configs/grpo_bf16_ep.yaml').policy.model_name)\n"
        "sys.exit(m3_rollout.cli.main(['--help']))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    res = subprocess.run([sys.executable, "-c", code], cwd=work, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[:2] == ["True 16 3", "builtin:tiny-calculator"]
    assert "grpo" in lines[2] and "export" in lines[2]


def test_console_command_hands_over_to_each_entry(capsys):
    from m3_rollout import cli

    with pytest.raises(SystemExit) as exc:
        cli.main(["grpo", "--config", "grpo_smoke", "grpo.no_such_key=1"])  # a packaged config by name
    assert exc.value.code == 2 and "grpo.no_such_key" in capsys.readouterr().err
    for command, option in (
        ("grpo", "--config"),
        ("serve", "--expert-parallel-size"),
        ("dump", "replay"),
        ("export", "transformers-text"),
    ):
        with pytest.raises(SystemExit) as exc:
            cli.main([command, "--help"])
        out = capsys.readouterr().out
        assert exc.value.code == 0 and option in out, command
        assert out.startswith(f"usage: m3-rollout {command} "), out[:80]  # the usage line runs as printed
    assert cli.main([]) == 2 and "usage: m3-rollout" in capsys.readouterr().err


def test_module_entry_help_names_the_module_command():
    run = subprocess.run(
        [sys.executable, "-m", "m3_rollout.grpo", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.startswith("usage: python -m m3_rollout.grpo "), run.stdout[:80]


@pytest.mark.parametrize(
    "module, argv, usage",
    [
        ("m3_rollout.serve", ["--help"], "usage: python -m m3_rollout.serve [-h] --model MODEL"),
        ("m3_rollout.grpo", ["--help"], "usage: python -m m3_rollout.grpo [--config YAML]"),
        ("m3_rollout.export", ["--help"], "usage: python -m m3_rollout.export [-h] --model MODEL"),
        ("m3_rollout.dump", ["--help"], "usage: python -m m3_rollout.dump [-h] {generate,"),
        ("m3_rollout.dump", ["replay", "--help"], "usage: python -m m3_rollout.dump replay [-h]"),
        ("m3_rollout.cli", ["--help"], "usage: python -m m3_rollout.cli {grpo,serve,dump,export}"),
        ("m3_rollout.cli", ["serve", "--help"], "usage: python -m m3_rollout.cli serve [-h] --model MODEL"),
        ("m3_rollout.cli", ["export", "--help"], "usage: python -m m3_rollout.cli export [-h]"),
        ("m3_rollout.cli", ["dump", "show", "--help"], "usage: python -m m3_rollout.cli dump show [-h]"),
        ("m3_rollout.cli", ["grpo", "--help"], "usage: python -m m3_rollout.cli grpo [--config YAML]"),
        ("m3_rollout.jobs.grpo", ["--help"], "usage: python -m m3_rollout.jobs.grpo [--config YAML]"),
        ("m3_rollout.jobs.dump_cli", ["--help"], "usage: python -m m3_rollout.jobs.dump_cli [-h]"),
    ],
)
def test_each_module_entry_names_the_command_typed(monkeypatch, capsys, module, argv, usage):
    """``python -m m3_rollout.serve --help`` printed ``usage: m3-rollout serve`` (export and dump
    likewise): a usage line must run as printed. runpy runs the module's ``__main__`` block as
    ``python -m`` does, in this process."""
    import runpy

    monkeypatch.setattr(sys, "argv", [module, *argv])
    with warnings.catch_warnings():  # runpy: the module was imported before (by an earlier test)
        warnings.simplefilter("ignore", RuntimeWarning)
        with pytest.raises(SystemExit) as exc:
            runpy.run_module(module, run_name="__main__")
    assert exc.value.code in (0, None)
    out = capsys.readouterr().out
    assert " ".join(out.split()).startswith(usage), out[:200]


def test_console_scripts_name_themselves(capsys):
    """``m3-rollout-serve`` (pyproject's console script: ``serve.main()`` with no arguments from
    the command line) and ``m3-rollout SUBCOMMAND`` name the command typed."""
    from m3_rollout import cli, serve

    scripts = _pyproject()["project"]["scripts"]
    assert scripts == {"m3-rollout": "m3_rollout.cli:main", "m3-rollout-serve": "m3_rollout.serve:main"}
    with pytest.raises(SystemExit) as exc:
        serve.main(["--help"])
    assert exc.value.code == 0 and capsys.readouterr().out.startswith("usage: m3-rollout-serve [-h] --model")
    with pytest.raises(SystemExit) as exc:
        serve.main(["--port", "0"])  # an argparse error names the command too
    assert exc.value.code == 2 and capsys.readouterr().err.startswith("usage: m3-rollout-serve [-h]")
    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    assert capsys.readouterr().out.startswith("usage: m3-rollout serve [-h] --model")

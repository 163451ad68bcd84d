"""pyproject.toml's package list covers the tree, and the wheel installs no top-level `kernels` or `trainers`."""

from __future__ import annotations

from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_every_package_folder_is_listed():
    st = _pyproject()["tool"]["setuptools"]
    listed = set(st["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "m3_rollout").rglob("__init__.py")}
    assert found - listed == set(), f"add these packages to pyproject.toml: {sorted(found - listed)}"
    assert listed - found - {"m3_kernels", "m3_trainers"} == set(), "pyproject.toml lists packages that do not exist"
    for name, folder in st["package-dir"].items():
        assert (ROOT / folder / "__init__.py").is_file(), (name, folder)


def test_no_colliding_top_level_names():
    st = _pyproject()["tool"]["setuptools"]
    tops = {p.split(".")[0] for p in st["packages"]}
    assert tops == {"m3_rollout", "m3_kernels", "m3_trainers"}, tops
    assert st["package-dir"] == {"m3_kernels": "kernels", "m3_trainers": "trainers"}

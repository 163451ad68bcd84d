"""Run the tests that depend on a package at a bound of the range pyproject.toml declares for it.

    python scripts/check_dependency_bounds.py                      # transformers, lower bound (CI)
    python scripts/check_dependency_bounds.py transformers:upper   # the newest release in the range
    python scripts/check_dependency_bounds.py triton:upper         # by hand: a large download
    python scripts/check_dependency_bounds.py triton:3.8.0         # one given release

For each PACKAGE:BOUND the script installs that release with `pip install --no-deps --target` into a
throwaway directory, adds the requirements of it that the current environment does not satisfy
(e.g. transformers 5.17 wants huggingface-hub < 2), and runs the package's tests with that
directory first on PYTHONPATH, so the environment itself is not changed. The lower bound is the
`>=` of the declared range; the upper one is the newest release pip finds inside the range.
Exit status: 0 when every run passes, 1 when one fails, 2 for a bad argument.

CI (.ci/run) runs the default, transformers' lower bound (a 12 MB download, under a minute of
tests). The triton runs are not in CI: the wheel is large and the kernel tests take minutes in the
interpreter (`--tests` picks fewer files).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path

import tomllib
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
TESTS = {
    "transformers": [
        "tests/test_export.py",
        "tests/test_model_parity.py",
        "tests/test_chat_templates.py",
        "tests/test_chat_tool_call_arguments.py",
    ],
    "triton": [
        "tests/test_kernels_msa.py",
        "tests/test_kernels_msa_decode.py",
        "tests/test_kernels_moe.py",
        "tests/test_kernels_fused_layers.py",
        "tests/test_kernels_smem.py",
    ],
}


def declared(package: str) -> Requirement:
    """The requirement pyproject.toml declares for `package` (dependencies or an extra)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = project["dependencies"] + [r for extra in project["optional-dependencies"].values() for r in extra]
    for text in reqs:
        req = Requirement(text)
        if req.name == package:
            return req
    raise SystemExit(f"error: pyproject.toml declares no requirement for {package!r}")


def pip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True)


def bound_version(req: Requirement, bound: str) -> str:
    """The release at `bound` ("lower" or "upper") of `req`'s range, or `bound` itself when it is a
    version (to try one release, e.g. ``triton:3.8.0``)."""
    if bound not in ("lower", "upper"):
        return bound
    if bound == "lower":
        lows = [s.version for s in req.specifier if s.operator == ">="]
        if not lows:
            raise SystemExit(f"error: {req} has no >= lower bound")
        return lows[0]
    res = pip("index", "versions", req.name)
    line = next((ln for ln in res.stdout.splitlines() if ln.startswith("Available versions:")), None)
    if line is None:
        raise SystemExit(f"error: pip index versions {req.name} listed nothing:\n{res.stderr}")
    found = [Version(v.strip()) for v in line.split(":", 1)[1].split(",")]
    inside = sorted(v for v in found if not v.is_prerelease and req.specifier.contains(v))
    if not inside:
        raise SystemExit(f"error: no release of {req.name} inside {req.specifier}")
    return str(inside[-1])


def unmet_requirements(target: Path, package: str) -> list[str]:
    """Requirements of the release installed in `target` that the current environment does not meet."""
    dist = next(metadata.distributions(path=[str(target)], name=package))
    unmet = []
    for text in dist.requires or []:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue  # an optional extra's requirement
        try:
            have = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            unmet.append(str(req))
            continue
        if not req.specifier.contains(have, prereleases=True):
            unmet.append(str(req))
    return unmet


def check(package: str, bound: str, tests: list[str]) -> bool:
    req = declared(package)
    version = bound_version(req, bound)
    print(f"== {package} {version} ({bound}; pyproject.toml declares {req.specifier})", flush=True)
    with tempfile.TemporaryDirectory(prefix=f"bounds-{package}-") as tmp:
        target = Path(tmp) / "site"
        res = pip("install", "-q", "--no-deps", "--target", str(target), f"{package}=={version}")
        if res.returncode != 0:
            print(res.stdout + res.stderr)
            return False
        extra = unmet_requirements(target, package)
        if extra:
            print(f"   with {', '.join(extra)} (the environment's versions do not satisfy {package} {version})")
            res = pip("install", "-q", "--no-deps", "--target", str(target), *extra)
            if res.returncode != 0:
                print(res.stdout + res.stderr)
                return False
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(target), os.environ.get("PYTHONPATH", "")]))
        shown = subprocess.run(
            [sys.executable, "-c", f"import {package}; print({package}.__version__, {package}.__file__)"],
            env=env,
            capture_output=True,
            text=True,
        )
        print(f"   imports {shown.stdout.strip() or shown.stderr.strip()}", flush=True)
        if not shown.stdout.startswith(version):
            return False
        run = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests], cwd=ROOT, env=env
        )
        return run.returncode == 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checks", nargs="*", default=["transformers:lower"], help="PACKAGE:lower|upper|VERSION")
    p.add_argument("--tests", nargs="+", default=None, help="test files to run instead of the package's list")
    args = p.parse_args(argv)
    runs = []
    for item in args.checks:
        package, _, bound = item.partition(":")
        if package not in TESTS or not (bound in ("lower", "upper") or bound[:1].isdigit()):
            print(
                f"error: {item!r}: expected PACKAGE:lower|upper|VERSION with PACKAGE one of {sorted(TESTS)}",
                file=sys.stderr,
            )
            return 2
        runs.append((item, check(package, bound, args.tests or TESTS[package])))
    for item, ok in runs:
        print(f"{item}: {'passed' if ok else 'FAILED'}")
    return 0 if all(ok for _, ok in runs) else 1


if __name__ == "__main__":
    sys.exit(main())

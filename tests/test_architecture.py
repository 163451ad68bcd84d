"""The import rule of docs/architecture.md, checked on the source tree (ast only: nothing is imported or run).

Every module of the three packages belongs to one layer; a module may import (at module level or
lazily inside a function, ``TYPE_CHECKING`` blocks included) only the project modules its layer
allows. A private name (one leading underscore) never crosses a file boundary. A failure names
the importing file, the line, the imported module and the rule it breaks.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIRS = {"m3_rollout": "m3_rollout", "m3_kernels": "kernels", "m3_trainers": "trainers"}

# Layer -> module prefixes it may import (its own prefix always included). Order of LAYERS is the
# lookup order: the first (most specific) prefix that matches a module decides its layer.
LAYERS: list[tuple[str, str, tuple[str, ...]]] = [
    # (layer name, module prefix, allowed project imports)
    ("jobs", "m3_rollout.jobs", ("*",)),
    ("entry", "m3_rollout.grpo", ("*",)),
    ("entry", "m3_rollout.serve", ("*",)),
    # the dump package's ``python -m`` shim: its one import is the job-layer dump command line
    ("entry", "m3_rollout.dump.__main__", ("m3_rollout.jobs.dump_cli",)),
    ("entry", "m3_rollout.export", ("*",)),
    ("entry", "m3_rollout.cli", ("*",)),
    ("kernels", "m3_kernels", ()),
    ("config", "m3_rollout.config", ()),
    ("chat", "m3_rollout.chat", ()),
    ("model", "m3_rollout.model", ()),
    ("engine", "m3_rollout.engine", ("m3_rollout.model", "m3_kernels", "m3_rollout.chat", "m3_rollout.parallel")),
    ("parallel", "m3_rollout.parallel", ("m3_rollout.model", "m3_kernels")),
    ("weight_sync", "m3_rollout.weight_sync", ("m3_rollout.model", "m3_rollout.parallel.process_group")),
    (
        "service",
        "m3_rollout.service",
        ("m3_rollout.engine", "m3_rollout.parallel", "m3_rollout.weight_sync", "m3_rollout.model", "m3_rollout.chat"),
    ),
    ("rollout", "m3_rollout.rollout", ("m3_rollout.chat", "m3_rollout.engine.interface", "m3_rollout.model")),
    (
        "dump",
        "m3_rollout.dump",
        (
            "m3_rollout.rollout",
            "m3_rollout.chat",
            "m3_rollout.config",
            "m3_rollout.model.selection_record",
            "m3_rollout.model.atomic_file",  # the durable file write; it imports nothing of the project
        ),
    ),
    (
        "server",
        "m3_rollout.server",
        (
            "m3_rollout.engine",
            "m3_rollout.service",
            "m3_rollout.weight_sync",
            "m3_rollout.parallel",
            "m3_rollout.chat",
            "m3_rollout.rollout",
            "m3_rollout.model",
            "m3_rollout.config",
        ),
    ),
    (
        "integrations",
        "m3_rollout.integrations",
        (
            "m3_rollout.engine",
            "m3_rollout.service",
            "m3_rollout.weight_sync",
            "m3_rollout.parallel",
            "m3_rollout.model",
        ),
    ),
    (
        "trainers",
        "m3_trainers",
        (
            "m3_rollout.model",
            "m3_rollout.rollout",
            "m3_rollout.chat",
            "m3_rollout.weight_sync",
            "m3_rollout.config",
            "m3_rollout.dump",
        ),
    ),
    ("package", "m3_rollout", ()),
]


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT)
    for name, folder in PACKAGE_DIRS.items():
        if rel.parts[0] == folder:
            parts = [name, *rel.parts[1:]]
            break
    else:
        raise AssertionError(path)
    parts[-1] = parts[-1][:-3]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _source_files() -> list[Path]:
    files = []
    for folder in PACKAGE_DIRS.values():
        files += sorted((ROOT / folder).rglob("*.py"))
    return files


def _matches(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def layer_of(module: str) -> tuple[str, str, tuple[str, ...]]:
    for layer in LAYERS:
        if _matches(module, layer[1]):
            return layer
    raise AssertionError(f"{module} belongs to no layer: add it to LAYERS and docs/architecture.md")


def _is_project(module: str) -> bool:
    return module.split(".")[0] in PACKAGE_DIRS


def _resolve(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def project_imports(path: Path) -> list[tuple[int, str, list[str]]]:
    """(line, imported module, names taken from it) for every project import of one file."""
    module = _module_name(path)
    is_package = path.name == "__init__.py"
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name, []) for a in node.names if _is_project(a.name)]
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(node, module, is_package)
            if _is_project(target):
                names = [a.name for a in node.names]
                # `from pkg import submodule` imports the submodule
                out.append((node.lineno, target, names))
    return out


def _allowed(importer: str, target: str) -> bool:
    _, own, allowed = layer_of(importer)
    return "*" in allowed or _matches(target, own) or any(_matches(target, a) for a in allowed)


def violations() -> list[str]:
    bad = []
    for path in _source_files():
        importer = _module_name(path)
        for line, target, names in project_imports(path):
            # `from pkg import submodule` is an import of pkg.submodule; anything else imports target
            subs = [f"{target}.{n}" for n in names if _is_submodule(f"{target}.{n}")]
            for t in subs if subs and len(subs) == len(names) else [target]:
                if not _allowed(importer, t):
                    layer = layer_of(importer)
                    bad.append(
                        f"{path.relative_to(ROOT)}:{line}: {importer} (layer {layer[0]}) imports {t}; "
                        f"layer {layer[0]} may import only {', '.join(layer[2]) or 'itself'}"
                    )
    return bad


def _is_submodule(module: str) -> bool:
    parts = module.split(".")
    folder = ROOT / PACKAGE_DIRS[parts[0]] / Path(*parts[1:]) if len(parts) > 1 else None
    return folder is not None and (folder.with_suffix(".py").is_file() or (folder / "__init__.py").is_file())


def private_crossings() -> list[str]:
    bad = []
    for path in _source_files():
        for line, target, names in project_imports(path):
            for n in names:
                if n.startswith("_") and not n.startswith("__"):
                    bad.append(f"{path.relative_to(ROOT)}:{line}: imports private {target}.{n}")
        tree = ast.parse(path.read_text(), str(path))
        aliases = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if _is_project(a.name) and a.asname:
                        aliases[a.asname] = a.name
            elif isinstance(node, ast.ImportFrom):
                target = _resolve(node, _module_name(path), path.name == "__init__.py")
                for a in node.names:
                    if _is_project(target) and _is_submodule(f"{target}.{a.name}"):
                        aliases[a.asname or a.name] = f"{target}.{a.name}"
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in aliases
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
            ):
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: uses private {aliases[node.value.id]}.{node.attr}")
    return bad


def test_every_module_has_a_layer():
    for path in _source_files():
        layer_of(_module_name(path))


def test_imports_follow_the_layers():
    bad = violations()
    assert not bad, "imports against docs/architecture.md:\n" + "\n".join(bad)


def test_no_private_name_crosses_a_file():
    bad = private_crossings()
    assert not bad, "private names used across files (make them public or move the caller):\n" + "\n".join(bad)


def test_model_is_plain_pytorch():
    for path in (ROOT / "m3_rollout" / "model").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                assert not any(m.split(".")[0] in ("triton", "m3_kernels") for m in mods), (path, node.lineno)


def test_the_model_modules_dump_may_import_import_nothing_of_the_project():
    """dump may import these model modules only because they stand alone: one that imported the
    rest of the model layer would bring it into dump."""
    (dump_layer,) = [layer for layer in LAYERS if layer[0] == "dump"]
    for module in (m for m in dump_layer[2] if _matches(m, "m3_rollout.model")):
        path = ROOT / PACKAGE_DIRS["m3_rollout"] / Path(*module.split(".")[1:]).with_suffix(".py")
        assert project_imports(path) == [], module


@pytest.mark.parametrize(
    "importer, target, ok",
    [
        ("m3_kernels.msa_fused_decode", "m3_rollout.model.indexer", False),
        ("m3_rollout.model.attention", "m3_kernels.fused_layers", False),
        ("m3_rollout.engine.ops", "m3_kernels.fused_layers", True),
        ("m3_rollout.engine.ops", "m3_rollout.service", False),
        ("m3_trainers.policy", "m3_rollout.engine.engine", False),
        ("m3_rollout.rollout.group_rollout", "m3_rollout.engine.interface", True),
        ("m3_rollout.rollout.group_rollout", "m3_rollout.engine.engine", False),
        ("m3_rollout.jobs.grpo", "m3_trainers.policy", True),
        ("m3_rollout.dump.writer", "m3_trainers.advantages", False),
        ("m3_rollout.dump.writer", "m3_rollout.model.atomic_file", True),
        ("m3_rollout.dump.writer", "m3_rollout.model.loading", False),
    ],
)
def test_the_rule_itself(importer, target, ok):
    """The checker says no where the rule says no (a checker that allowed everything would pass the tree)."""
    assert _allowed(importer, target) is ok

"""Load a benchmark script of ``scripts/`` as a module, for the tests that drive it on the CPU."""

from __future__ import annotations

import importlib.util
import sys
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def load_script(name: str) -> ModuleType:
    """``scripts/<name>.py`` loaded as module ``name`` (its imports must resolve as they are)."""
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextmanager
def script_module(name: str):
    """Yields :func:`load_script` (name), with ``scripts/`` on ``sys.path`` meanwhile (most
    scripts import ``benchlib`` from beside them)."""
    sys.path.insert(0, str(SCRIPTS))
    try:
        yield load_script(name)
    finally:
        sys.path.remove(str(SCRIPTS))

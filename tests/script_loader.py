"""Load a benchmark script of ``scripts/`` as a module, for the tests that drive it on the CPU."""

from __future__ import annotations

import importlib.util
import sys
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


@contextmanager
def script_module(name: str):
    """Yields ``scripts/<name>.py`` loaded as module ``name``, with ``scripts/`` on ``sys.path``
    meanwhile (the scripts import ``benchlib`` from beside them)."""
    sys.path.insert(0, str(SCRIPTS))
    try:
        spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
        module: ModuleType = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(SCRIPTS))

"""Ctrl-C at the command line: one ``interrupted:`` line on stderr and exit status 130, never a traceback.

Governing idea: an entry is run in two phases, loading (its imports: torch, triton, pyarrow, seconds
on a busy machine) and working, and a Ctrl-C in either ends the same way. Every command goes
through :func:`run_entry`: the ``m3-rollout`` console command and ``python -m m3_rollout.grpo`` /
``.export`` (``m3_rollout.cli.load_entry``), and the dump command line under each of its names
(``m3_rollout.jobs.dump_cli.main``). This module imports nothing heavy, so that an entry can import
it before anything that takes time to load.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import NoReturn


def run_entry(load: Callable[[], Callable], what: str) -> Callable:
    """``load()`` (the entry's imports; returns its entry function), and that function wrapped so
    that a Ctrl-C while it works exits 130 too. ``what`` names the command in the line
    (``interrupted: WHAT stopped (Ctrl-C)...``). A job that catches the Ctrl-C to clean up
    re-raises it as ``KeyboardInterrupt(left)``, ``left`` a sentence saying what it left behind (a
    partial output removed, or what of it is whole), which ends the line. Entries that handle Ctrl-C
    themselves (grpo, serve: their own line and ``SystemExit(130)``) are unchanged by the wrapper.

    Raises:
        SystemExit(130): interrupted while loading (then nothing was started) or while working.
    """
    try:
        entry = load()
    except KeyboardInterrupt:
        exit_interrupted(what, " while loading; nothing was started")

    @functools.wraps(entry)
    def run(*args, **kwargs):
        try:
            return entry(*args, **kwargs)
        except KeyboardInterrupt as exc:
            exit_interrupted(what, f"; {exc}" if str(exc) else "")

    return run


def exit_interrupted(what: str, tail: str) -> NoReturn:
    """Print ``interrupted: WHAT stopped (Ctrl-C)TAIL`` on stderr and exit 130 (no traceback).

    Raises:
        SystemExit(130): always.
    """
    print(f"interrupted: {what} stopped (Ctrl-C){tail}", file=sys.stderr, flush=True)
    raise SystemExit(130) from None

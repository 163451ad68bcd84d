"""``python -m m3_rollout.serve --model DIR|builtin:NAME [...]``: the rollout server's entry point.

Thin: binds the address, resolves ``builtin:NAME`` to the embedded checkpoint (built on first use)
and hands over to ``m3_rollout.server.cli``; run with ``--help`` for the options. Exit status 2
with one ``error: ...`` line for a bad flag or an unusable checkpoint / tokenizer / template file
(named, as ``m3-rollout export`` says them), 3 when the address cannot be bound (naming ``--port``
or ``--host``; uvicorn's status for a server that could not start), 130 with one ``interrupted:``
line for a Ctrl-C before it serves (imports, checkpoint load, EP workers starting), 143 with one for
a SIGTERM then (its EP workers stopped as a Ctrl-C stops them); once it serves,
SIGTERM or SIGINT (Ctrl-C) is a graceful shutdown with one line naming it, exit 0
(``server.cli.run_server``; a paused server's held or frozen requests end with finish reason abort;
requests still in flight after ``--graceful-shutdown-timeout`` seconds, or at a second Ctrl-C, are
cut off with one more line, and the engine still stops).
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Sequence

STARTUP_INTERRUPTED = "interrupted: the server stopped ({}) while starting; nothing was served"


class StartupTerminated(KeyboardInterrupt):
    """SIGTERM while the server starts: raised where it lands, as Ctrl-C raises KeyboardInterrupt,
    so that the same clean-ups run (EP workers stopped, the bound socket closed)."""


def _terminated(signum, frame) -> None:
    raise StartupTerminated()


def main(argv: Sequence[str] | None = None, prog: str = "m3-rollout-serve") -> int:
    """Serve until stopped; returns the exit status (see the module docstring). prog: the command
    ``--help`` and errors name (default: the ``m3-rollout-serve`` console script, which calls this
    without arguments; ``m3-rollout serve`` and ``python -m m3_rollout.serve`` pass their own).

    NOTE: at Python's default a SIGTERM while starting (a checkpoint load takes minutes) killed the
    process on the spot, with no line, and its EP workers went on loading the model until they found
    the driver gone. While starting, SIGTERM is a stop as Ctrl-C is (:class:`StartupTerminated`);
    once it serves, ``run_server`` installs the server's own handlers."""
    main_thread = threading.current_thread() is threading.main_thread()  # only it may set handlers
    previous = signal.signal(signal.SIGTERM, _terminated) if main_thread else None
    try:
        try:
            started = _start(argv, prog)
        except KeyboardInterrupt as exc:  # a builtin build says its own line and exits 130 itself
            sigterm = isinstance(exc, StartupTerminated)
            print(STARTUP_INTERRUPTED.format("SIGTERM" if sigterm else "Ctrl-C"), file=sys.stderr, flush=True)
            return 128 + int(signal.SIGTERM) if sigterm else 130
        if isinstance(started, int):
            return started
        from m3_rollout.server.cli import run_server

        args, app, served, sock = started
        with sock:
            run_server(args, app, served, sock)
        return 0
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _start(argv: Sequence[str] | None, prog: str):
    """Everything before serving: the exit status of a bad flag / model / address, or
    ``(args, app, served, sock)`` with ``sock`` bound (closed here on any error)."""
    from m3_rollout.jobs.builtin import BUILTIN_PREFIX, resolve_model
    from m3_rollout.server.cli import (
        BindError,
        bind_socket,
        build_server,
        default_template_kwargs,
        parse_args,
    )

    args = parse_args(argv, prog)
    try:  # the flag first: a bad value stops before a builtin build
        default_template_kwargs(args.default_chat_template_kwargs)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:  # the address next: a port in use stops before a build or a checkpoint load
        sock = bind_socket(args.host, args.port)
    except BindError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 3
    serving = False
    try:
        try:
            model_dir, _ = resolve_model(args.model)
        except (FileNotFoundError, ValueError) as exc:  # a CheckpointError (config.json) is a ValueError
            print(f"error: --model: {exc}", file=sys.stderr)
            return 2
        try:
            builtin = args.model.startswith(BUILTIN_PREFIX)
            kwargs = default_template_kwargs(args.default_chat_template_kwargs, builtin, model_dir)
            app, served = build_server(args, model_dir, kwargs)
        except (FileNotFoundError, ValueError) as exc:  # CheckpointError / ChatFileError are ValueErrors
            print(f"error: {exc}", file=sys.stderr)
            return 2
        serving = True
        return args, app, served, sock
    finally:
        if not serving:
            sock.close()


if __name__ == "__main__":
    sys.exit(main(prog="python -m m3_rollout.serve"))

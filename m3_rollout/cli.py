"""``m3-rollout {grpo,serve,dump,export} ...``: the console command of an installed package.

Each subcommand hands the rest of the command line to the job-layer entry it names, the same code
as ``python -m m3_rollout.grpo`` / ``.serve`` / ``.dump`` / ``.export``; ``m3-rollout SUBCOMMAND
--help`` lists its options. ``--config`` finds the packaged configs by name when the working
directory has no such file (``m3_rollout.config.resolve_config_path``), so an installed package
runs the main job without a clone: ``m3-rollout grpo --config configs/grpo_bf16_ep.yaml``.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Sequence

from m3_rollout.jobs.interrupt import run_entry

SUBCOMMANDS = {
    "grpo": "GRPO job: --config YAML [key=value ...] (python -m m3_rollout.grpo)",
    "serve": "rollout server: --model DIR|builtin:NAME [...] (python -m m3_rollout.serve)",
    "dump": "rollout dumps: {generate,inspect,show,replay} (python -m m3_rollout.dump)",
    "export": "checkpoint export: --model ... --out DIR [--format transformers-text] (python -m m3_rollout.export)",
}


def usage(prog: str = "m3-rollout") -> str:
    """The usage text ``--help`` prints; prog: the command the user typed."""
    lines = [f"usage: {prog} {{" + ",".join(SUBCOMMANDS) + "} [args ...]", "", "subcommands:"]
    lines += [f"  {name:<8} {text}" for name, text in SUBCOMMANDS.items()]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None, prog: str = "m3-rollout") -> int:
    """Run one subcommand; returns its exit status (2 with the usage for an unknown one). prog: the
    command the user typed (``python -m m3_rollout.cli`` passes its own); a subcommand's ``--help``
    and errors name ``PROG SUBCOMMAND``.

    Raises:
        SystemExit: as the subcommand raises it (``grpo``: 2 for a config error, 1 for a training
            error; argparse's own exits for ``--help`` and bad options); 130 for a Ctrl-C while the
            subcommand loads or works (``load_entry``).
    """
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(usage(prog), file=sys.stdout if args else sys.stderr)
        return 0 if args else 2
    command, rest = args[0], args[1:]
    if command not in SUBCOMMANDS:
        print(f"error: unknown subcommand {command!r}\n{usage(prog)}", file=sys.stderr)
        return 2
    entry = load_entry(command, f"{prog} {command}")
    if command == "grpo":
        entry(rest, prog=f"{prog} {command}")  # returns the run summary; failures exit through SystemExit
        return 0
    return entry(rest, prog=f"{prog} {command}")


def load_entry(command: str, what: str | None = None):
    """The job-layer entry function of ``command``, imported here (it loads torch, triton; seconds
    on a busy machine) and wrapped by ``m3_rollout.jobs.interrupt.run_entry``: a Ctrl-C while it
    loads or works exits 130 after one line naming ``what`` (default ``m3-rollout COMMAND``)
    instead of a traceback.

    Raises:
        SystemExit(130): interrupted while loading or working.
    """
    return run_entry(functools.partial(_import_entry, command), what or f"m3-rollout {command}")


def _import_entry(command: str):
    if command == "grpo":
        from m3_rollout.jobs.grpo import main
    elif command == "serve":
        from m3_rollout.serve import main
    elif command == "dump":
        from m3_rollout.jobs.dump_cli import main
    else:
        from m3_rollout.jobs.export import main
    return main


if __name__ == "__main__":
    sys.exit(main(prog="python -m m3_rollout.cli"))

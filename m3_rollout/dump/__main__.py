"""``python -m m3_rollout.dump {generate,inspect,show,replay}``: entry point of the dump command
line, ``m3_rollout.jobs.dump_cli`` (``--help`` lists the subcommands). A Ctrl-C while its imports
load or while it works exits 130 with one line (``m3_rollout.cli.load_entry``)."""

from collections.abc import Sequence

from m3_rollout.cli import load_entry


def main(argv: Sequence[str] | None = None, prog: str = "python -m m3_rollout.dump") -> int:
    """Load the dump command line and run it; returns its exit status.

    Raises:
        SystemExit(130): Ctrl-C while it loads or works, after one ``interrupted:`` line on stderr
            (while it works, the line says what was left behind).
    """
    return load_entry("dump", "the dump command")(argv, prog=prog)


if __name__ == "__main__":
    raise SystemExit(main())

"""``python -m m3_rollout.dump {generate,inspect,show,replay}``: the dump command line, which is
job-layer code (``m3_rollout.jobs.dump_cli``, ``--help`` lists the subcommands). A Ctrl-C while it
loads or works exits 130 with one line (its ``main`` handles it)."""

from collections.abc import Sequence

from m3_rollout.jobs.dump_cli import main as dump_cli_main


def main(argv: Sequence[str] | None = None, prog: str = "python -m m3_rollout.dump") -> int:
    """``m3_rollout.jobs.dump_cli.main`` under this command's name; returns its exit status.

    Raises:
        SystemExit(130): Ctrl-C while it loads or works, after one ``interrupted: the dump command
            stopped`` line on stderr.
    """
    return dump_cli_main(argv, prog, what="the dump command")


if __name__ == "__main__":
    raise SystemExit(main())

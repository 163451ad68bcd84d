"""``python -m m3_rollout.export --model DIR|builtin:NAME --out DIR [--format transformers-text]``:
entry point of the checkpoint export, ``m3_rollout.jobs.export`` (``--help`` lists the options). A
Ctrl-C while its imports load or while it works exits 130 with one line (``m3_rollout.cli.load_entry``)."""

import sys
from collections.abc import Sequence

from m3_rollout.cli import load_entry


def main(argv: Sequence[str] | None = None, prog: str = "python -m m3_rollout.export") -> int:
    """Load the export's command line and run it; returns its exit status.

    Raises:
        SystemExit(130): Ctrl-C while it loads or works, after one ``interrupted:`` line on stderr
            (while it works, the line says what was left behind).
    """
    return load_entry("export", "the export")(argv, prog=prog)


if __name__ == "__main__":
    sys.exit(main())

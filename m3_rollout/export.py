"""``python -m m3_rollout.export --model DIR|builtin:NAME --out DIR [--format transformers-text]``:
entry point of the checkpoint export, ``m3_rollout.jobs.export`` (``--help`` lists the options)."""

import sys

from m3_rollout.jobs.export import main

if __name__ == "__main__":
    sys.exit(main(prog="python -m m3_rollout.export"))

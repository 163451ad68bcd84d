"""``python -m m3_rollout.dump {generate,inspect,show,replay}``: entry point of the dump command
line, ``m3_rollout.jobs.dump_cli`` (``--help`` lists the subcommands)."""

from m3_rollout.jobs.dump_cli import main

if __name__ == "__main__":
    raise SystemExit(main(prog="python -m m3_rollout.dump"))

"""``python -m m3_rollout.grpo --config configs/grpo_bf16_ep.yaml [key=value ...]``

Entry point of the GRPO job; the loop is ``m3_rollout.jobs.grpo``. A Ctrl-C while its imports
load exits 130 with one line (``m3_rollout.cli.load_entry``); after that the job's ``main``
handles it.
"""

if __name__ == "__main__":
    from m3_rollout.cli import load_entry

    load_entry("grpo", "the GRPO job")(prog="python -m m3_rollout.grpo")

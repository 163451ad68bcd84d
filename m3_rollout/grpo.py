"""``python -m m3_rollout.grpo --config configs/grpo_bf16_ep.yaml [key=value ...]``

Entry point of the GRPO job; the loop is ``m3_rollout.jobs.grpo``.
"""

from m3_rollout.jobs.grpo import main

if __name__ == "__main__":
    main(prog="python -m m3_rollout.grpo")

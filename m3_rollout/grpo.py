"""``python -m m3_rollout.grpo --config configs/grpo_bf16_ep.yaml [key=value ...]``

Entry point of the GRPO job; the loop is ``m3_rollout.jobs.grpo``. A Ctrl-C while its imports
load (torch, triton: seconds on a busy machine) exits 130 with one line instead of a traceback;
after that the job's ``main`` handles it.
"""

import sys

if __name__ == "__main__":
    try:
        from m3_rollout.jobs.grpo import main
    except KeyboardInterrupt:
        print("interrupted: the GRPO job stopped (Ctrl-C) while loading; nothing was started", file=sys.stderr)
        raise SystemExit(130) from None
    main(prog="python -m m3_rollout.grpo")

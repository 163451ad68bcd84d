#!/usr/bin/env bash
# The README's main-job command: install, then run GRPO with the main config (extra args are
# key=value overrides).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
.venv/bin/python -m m3_rollout.grpo --config configs/grpo_bf16_ep.yaml "$@"

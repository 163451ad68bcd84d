#!/usr/bin/env bash
# The README's test command: install, lint and format check (ruff), then the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check --quiet .
.venv/bin/python -m pytest -q tests "$@"

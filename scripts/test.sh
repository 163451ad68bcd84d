#!/usr/bin/env bash
# The README's test command: install, lint and format check (ruff), then the whole test suite in two
# pytest-xdist workers, each file on one worker (tests/conftest.py's scheduler); arguments after it
# go to pytest, e.g. `-n 0` for one process, `-k fp8`.
# One torch / OpenBLAS thread per test process (inherited by the processes tests start): the tests'
# tensors are small, and a pool of two OpenMP threads on a two-core machine that is busy makes every
# parallel region wait for the thread the OS has parked (a tiny warm-start run: 2.5 s with two
# threads, 0.8 s with one, while another process held one core; AMD EPYC, 2026-12-07).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check --quiet .
OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} .venv/bin/python -m pytest -q -n 2 tests "$@"

#!/usr/bin/env bash
# Create .venv (if missing) and install the project with CPU torch; skipped when .venv already holds
# this pyproject.toml's install (the project is installed editable, so code changes need no reinstall).
# CPU torch first: a bare `torch` requirement would pull a multi-GB CUDA build. Where pip's index
# serves the CUDA build for torch==2.13.0, set TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu.
# pip's own output goes to .venv/pip.log (shown if a step fails); each long step says what it does first.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "install: creating .venv with $PY ..."
  if ! "$PY" -m venv .venv || ! .venv/bin/python -m pip --version > /dev/null 2>&1; then
    rm -rf .venv  # a half-made .venv would be taken as made by the next run
    echo "install failed: '$PY -m venv .venv' made no environment with pip (Debian / Ubuntu: install python3-venv; or set PYTHON to another Python >= 3.10)" >&2
    exit 1
  fi
fi
stamp=$(.venv/bin/python -c 'import hashlib; print(hashlib.sha256(open("pyproject.toml", "rb").read()).hexdigest()[:16])')
if [ "$(cat .venv/.m3_rollout_installed 2>/dev/null)" = "$stamp" ]; then
  exit 0
fi
pipi() {
  if ! .venv/bin/python -m pip install -q "$@" > .venv/pip.log 2>&1; then
    cat .venv/pip.log; echo "install failed: pip install $*" >&2; exit 1
  fi
}
echo "install: torch 2.13.0 (CPU build${TORCH_INDEX_URL:+ from $TORCH_INDEX_URL}; a large download, a minute or more) ... log: .venv/pip.log"
pipi "torch==2.13.0" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
# The package declares ranges (pyproject.toml); CI installs the one set it is tested with.
echo "install: the project (editable) with transformers 5.24.0, triton 3.6.0 and the test tools ... log: .venv/pip.log"
pipi -e ".[test,kernels,plot]" "transformers==5.24.0" "triton==3.6.0"
.venv/bin/python -c "import torch, transformers, triton; print(f'installed torch {torch.__version__}, transformers {transformers.__version__}, triton {triton.__version__}')"
echo "$stamp" > .venv/.m3_rollout_installed

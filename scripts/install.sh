#!/usr/bin/env bash
# Create .venv (if missing) and install the project with CPU torch.
# CPU torch first: a bare `torch` requirement would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
pipi() {
  if ! .venv/bin/python -m pip install -q "$@" > .venv/pip.log 2>&1; then
    cat .venv/pip.log; echo "install failed: pip install $*" >&2; exit 1
  fi
}
pipi "torch==2.13.0"
pipi -e ".[test,kernels,plot]"
.venv/bin/python -c "import torch, transformers, triton; print(f'torch {torch.__version__}, transformers {transformers.__version__}, triton {triton.__version__}')"

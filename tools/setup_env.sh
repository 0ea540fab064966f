#!/usr/bin/env bash
# Idempotent set-up: a virtual environment in .venv with a CPU torch (unless a torch is
# already importable there) and an editable install of dept_mega with its test extras.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
VPY=.venv/bin/python
if ! "$VPY" -c "import torch" >/dev/null 2>&1; then
  # torch==2.13.0 resolves to the CPU build that lies on these machines' disk; an
  # unpinned torch would pull a multi-GB CUDA build.
  "$VPY" -m pip install -q --upgrade pip
  "$VPY" -m pip install -q torch==2.13.0
fi
stamp=.venv/.dept_mega_installed
if [ ! -f "$stamp" ] || [ setup.py -nt "$stamp" ] || [ -n "$(find csrc -newer "$stamp" -type f 2>/dev/null | head -1)" ]; then
  "$VPY" -m pip install -q --no-build-isolation -e ".[test]"
  touch "$stamp"
fi

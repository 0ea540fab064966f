#!/usr/bin/env bash
# Idempotent set-up: a virtual environment in .venv with torch (unless one is already
# importable there) and an editable install of dept_mega with the extras the test suite uses,
# building the custom ops against that torch (--no-build-isolation).
#
#   PYTHON=python3.12 bash tools/setup_env.sh     # the interpreter for a new .venv (default python3)
#   TORCH_INDEX=https://download.pytorch.org/whl/cpu bash tools/setup_env.sh   # where torch comes from
#
# torch (TORCH_SPEC, default torch==2.13.0): from the default index when that gives a CPU
# build (a local wheel on the project's machines), else from PyTorch's CPU index (PyPI's Linux
# wheel is a multi-GB CUDA build). TORCH_INDEX forces an index.
set -euo pipefail
cd "$(dirname "$0")/.."
installed=
PY=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
CPU_INDEX=https://download.pytorch.org/whl/cpu
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
VPY=.venv/bin/python
# Python 3.12+ venvs come without setuptools; the build needs it (and wheel) in the venv
# because it runs without build isolation.
if ! "$VPY" -c "import setuptools, wheel" >/dev/null 2>&1; then
  "$VPY" -m pip install -q --upgrade pip
  "$VPY" -m pip install -q "setuptools>=64" wheel
fi
if ! "$VPY" -c "import torch" >/dev/null 2>&1; then
  "$VPY" -m pip install -q --upgrade pip
  if [ -z "${TORCH_INDEX:-}" ]; then
    # what the default index would give, without installing it: a CPU build (here: the local
    # file) is taken; anything else (PyPI's Linux wheel is a multi-GB CUDA build) is not
    plan=$("$VPY" -m pip install "$TORCH_SPEC" --no-deps --dry-run -q --report - 2>/dev/null || true)
    if ! grep -q '"version": "[0-9.]*+cpu"' <<<"$plan"; then
      TORCH_INDEX=$CPU_INDEX
      echo "setup_env: $TORCH_SPEC from the default index is not a CPU build; using $TORCH_INDEX" >&2
    fi
  fi
  "$VPY" -m pip install -q --no-compile "$TORCH_SPEC" ${TORCH_INDEX:+--index-url "$TORCH_INDEX"}
  installed=1
fi
stamp=.venv/.dept_mega_installed
if [ ! -f "$stamp" ] || [ setup.py -nt "$stamp" ] || [ pyproject.toml -nt "$stamp" ] \
   || [ -n "$(find csrc -newer "$stamp" -type f 2>/dev/null | head -1)" ]; then
  "$VPY" -m pip install -q --no-compile --no-build-isolation -e ".[test,study,benchmark,federation]"
  touch "$stamp"
  installed=1
fi
# --no-compile above: pip compiles every module of what it installs (torch, transformers, ...:
# about 70 s of one core), most of which no process here imports. Instead the modules a
# training process imports are compiled once now (bytecode written even where
# PYTHONDONTWRITEBYTECODE is set); the others are compiled when first imported.
if [ -n "${installed:-}" ]; then
  env -u PYTHONDONTWRITEBYTECODE "$VPY" -c "import torch, torch._dynamo, dept_mega.train, dept_mega.data.preprocess"
fi

#!/usr/bin/env bash
# The test suite under another torch release, by default 2.11.0 (what the GPU machines run;
# tools/test.sh uses the CPU build of 2.13.0). Catches what a torch version changes before a
# GPU session finds it: a private API that moved, a build step that behaves differently.
#
#   bash tools/test_torch.sh [VERSION] [pytest arguments]      # e.g. 2.11.0 -x -k fp8
#
# The venv (DEPT_MEGA_TORCH_VENV, default ~/.cache/dept_mega/venv-torch-VERSION) gets
# torch==VERSION from the default index (on Linux PyPI's CUDA build: about 5 GB with its CUDA
# libraries, and it runs on a machine without a GPU) and numpy < 2.4 (Triton 3.6's interpreter,
# which the FP8 cast tests use, cannot run loops under numpy 2.4). The suite runs in a copy of
# this working tree (DEPT_MEGA_TORCH_COPY, default a new temporary folder): the custom ops
# build in place, and that build must not replace the one .venv uses. The CUDA kernels are
# built too when CUDA_HOME names a toolkit of torch's CUDA major version (see setup.py).
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=${1:-2.11.0}
[ $# -gt 0 ] && shift
VENV=${DEPT_MEGA_TORCH_VENV:-$HOME/.cache/dept_mega/venv-torch-$VERSION}
COPY=${DEPT_MEGA_TORCH_COPY:-$(mktemp -d)/dept_mega}
PY=${PYTHON:-python3}

if ! "$VENV/bin/python" -c "import sys, torch; sys.exit(torch.__version__.split('+')[0] != '$VERSION')" 2>/dev/null; then
  echo "test_torch: torch==$VERSION into $VENV" >&2
  "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip "setuptools>=64" wheel
  "$VENV/bin/python" -m pip install -q "torch==$VERSION" "numpy<2.4"
fi
"$VENV/bin/python" -c "import torch; print(f'test_torch: torch {torch.__version__} (CUDA {torch.version.cuda})')"

# tracked and untracked files, not what .gitignore leaves out (the venv, builds, runs)
mkdir -p "$COPY"
git ls-files -z -co --exclude-standard | tar --null --ignore-failed-read -T - -cf - 2>/dev/null | tar -xf - -C "$COPY"
ln -sfn "$VENV" "$COPY/.venv"
rm -f "$VENV/.dept_mega_installed"  # a new copy: install and build the extension there
echo "test_torch: running the suite in $COPY" >&2
cd "$COPY"
exec bash tools/test.sh "$@"

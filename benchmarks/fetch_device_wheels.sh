#!/usr/bin/env bash
# Download the wheels the GPU machine lacks into .whl/ (ignored by git: .gitignore), to copy to a
# GPU machine without network together with the checkout.
# The machine runs Python 3.12 on x86-64 with torch 2.11 and no network (see docs/performance.md).
#
#   bash benchmarks/fetch_device_wheels.sh [NAME==VERSION ...]
#   # default: megatron-core==0.16.1 torchao==0.17.0
#
# megatron-core 0.16.1 (benchmarks/vs_megatron.py) needs torch>=2.6, numpy and packaging (all on
# the machine); its wheel is about 2.6 MB. torchao 0.17.0 (benchmarks/vs_torchao.py) is the
# release built against torch 2.11, the machine's (its C++ extensions load there; its float8
# training is pure Python and also runs under other torch versions); it requires nothing; its
# wheel is about 3.2 MB. benchmarks/gpu_check.sh installs whatever lies in .whl/ with --no-deps;
# the two wheels are about 6 MB, small enough to copy with the checkout.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] && PY=.venv/bin/python
pkgs=("$@")
[ ${#pkgs[@]} -eq 0 ] && pkgs=("megatron-core==0.16.1" "torchao==0.17.0")
mkdir -p .whl
for p in "${pkgs[@]}"; do
  "$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
    --platform any -d .whl "$p"
done
ls -la .whl

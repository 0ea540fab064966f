#!/usr/bin/env bash
# The test command: set up (idempotent), then run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup_env.sh
# the 30 slowest tests are listed at the end: the suite (with setup) has a 15-minute budget on 2 cores
# DEPT_MEGA_TEST_WORKERS=N runs it in N pytest-xdist workers, a test file per worker at a time
workers=()
if [ -n "${DEPT_MEGA_TEST_WORKERS:-}" ]; then workers=(-n "$DEPT_MEGA_TEST_WORKERS" --dist loadfile); fi
exec .venv/bin/python -m pytest -q --durations=30 ${workers[@]+"${workers[@]}"} tests "$@"

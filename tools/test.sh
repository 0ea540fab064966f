#!/usr/bin/env bash
# The test command: set up (idempotent), then run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
# The suite (with set-up) has a 15-minute budget on 2 cores; the 30 slowest tests are listed at
# the end. It runs in DEPT_MEGA_TEST_WORKERS pytest-xdist workers (default 2), a test file per
# worker at a time (module fixtures stay in one worker; tests/mp_utils.py gives each worker its
# own ports). Many tests wait on child processes, so two workers on two cores finish sooner
# than one. DEPT_MEGA_TEST_WORKERS=1 runs it in this process, without xdist.
workers_n="${DEPT_MEGA_TEST_WORKERS:-2}"
case "$workers_n" in
  ''|*[!0-9]*|0) echo "tools/test.sh: DEPT_MEGA_TEST_WORKERS must be a positive integer, got '$workers_n'" >&2; exit 2 ;;
esac
bash tools/setup_env.sh
# The suite starts a few hundred Python processes (ranks, tools, jobs); with
# PYTHONDONTWRITEBYTECODE set (some images set it) each would compile dept_mega's sources and
# pytest would rewrite the test modules' asserts again in every process. Let them be cached
# (in __pycache__ folders, ignored by git).
unset PYTHONDONTWRITEBYTECODE
workers=()
# --no-loadscope-reorder: the files in collection order, the long ones first (tests/conftest.py)
if [ "$workers_n" -gt 1 ]; then workers=(-n "$workers_n" --dist loadfile --no-loadscope-reorder); fi
exec .venv/bin/python -m pytest -q --durations=30 ${workers[@]+"${workers[@]}"} tests "$@"

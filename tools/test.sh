#!/usr/bin/env bash
# The test command: set up (idempotent), then run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup_env.sh
# the 30 slowest tests are listed at the end: the suite has a 20-minute budget on 2 cores
exec .venv/bin/python -m pytest -q --durations=30 tests "$@"

#!/usr/bin/env bash
# The test command: set up (idempotent), then run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup_env.sh
exec .venv/bin/python -m pytest -q tests "$@"

#!/usr/bin/env bash
# Set up .venv with the test extras, then run the whole test suite (CPU, gloo for multi-process tests).
#   bash scripts/test.sh [pytest args ...]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh test
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}"
exec .venv/bin/python -m pytest -q "$@"

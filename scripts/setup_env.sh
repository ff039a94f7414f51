#!/usr/bin/env bash
# Create (or reuse) .venv and install titanlite in editable mode.
# Usage: bash scripts/setup_env.sh [EXTRAS]   e.g. EXTRAS=test
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
spec="."
[ -n "$extras" ] && spec=".[$extras]"
stamp=".venv/.titanlite-installed-${extras:-base}"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ constraints.txt -nt "$stamp" ]; then
  # torch first, from the pinned version, so no resolver ever picks a CUDA build.
  .venv/bin/python -m pip install -q -c constraints.txt "torch==2.13.0"
  .venv/bin/python -m pip install -q -c constraints.txt -e "$spec"
  touch "$stamp"
fi

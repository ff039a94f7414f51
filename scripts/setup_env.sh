#!/usr/bin/env bash
# Create (or reuse) .venv and install titanlite in editable mode.
# Usage: bash scripts/setup_env.sh [EXTRAS]   e.g. EXTRAS=test
#
# The packages are installed by uv (itself pip-installed into .venv): on the 2-core machine a fresh .venv with the
# test extras took 37 s this way against 90 s with pip. uv does not read pip's configuration, so a local wheel
# folder that pip would use (PIP_FIND_LINKS or pip's global.find-links, where the CPU torch wheel may lie) is passed
# on. Byte-code is compiled at install time: with PYTHONDONTWRITEBYTECODE set, as on CI, every process would
# otherwise compile torch's sources again on import (2.5 s -> 4.5 s for `import torch`).
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
  [ -x .venv/bin/uv ] || .venv/bin/python -m pip install -q uv
  links="${PIP_FIND_LINKS:-$(.venv/bin/python -m pip config get global.find-links 2>/dev/null || true)}"
  # torch pinned in the same resolution, so no resolver ever picks a CUDA build on a CPU machine
  .venv/bin/uv pip install -q --python .venv/bin/python --compile-bytecode ${links:+--find-links "$links"} \
    -c constraints.txt "torch==2.13.0" -e "$spec"
  touch "$stamp"
fi

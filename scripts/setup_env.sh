#!/usr/bin/env bash
# Create (or reuse) .venv and install titanlite in editable mode.
# Usage: bash scripts/setup_env.sh [EXTRAS]   e.g. EXTRAS=test
#
# The packages are installed by uv (pip-installs it into .venv, at the version constraints.txt pins): it installs a
# fresh .venv in well under half of pip's time. uv does not read pip's configuration, so the wheel folders pip would
# search (PIP_FIND_LINKS or pip's global.find-links, where the CPU torch wheel may lie) are passed on. Byte-code is
# compiled at install time: where PYTHONDONTWRITEBYTECODE is set, as on CI, every process would otherwise compile
# the imported sources again.
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
  [ -x .venv/bin/uv ] || .venv/bin/python -m pip install -q -c constraints.txt uv
  read -ra links <<< "${PIP_FIND_LINKS:-$(.venv/bin/python -m pip config get global.find-links 2>/dev/null || true)}"
  # torch pinned in the same resolution, so no resolver ever picks a CUDA build on a CPU machine
  .venv/bin/uv pip install -q --python .venv/bin/python --compile-bytecode "${links[@]/#/--find-links=}" \
    -c constraints.txt "torch==2.13.0" -e "$spec"
  touch "$stamp"
fi

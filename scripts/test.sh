#!/usr/bin/env bash
# Set up .venv with the test extras, check formatting and lint (ruff), then run the whole test suite
# (CPU, gloo for multi-process tests).
#   bash scripts/test.sh [pytest args ...]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh test
# one intra-op thread per process: the pytest workers and the processes they start share the cores, and OpenMP
# threads spin-waiting for a descheduled peer made a tiny model's steps up to 15x slower (a 50-step test: 55 s with
# 2 threads, 3.8 s with 1, beside two busy processes on this 2-core machine)
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"  # a process asking for more threads: they sleep, not spin
# inductor compiles in this process: its default pool of compile workers (fresh interpreters importing torch) costs
# more CPU than it saves when the two pytest workers keep both cores busy
export TORCHINDUCTOR_COMPILE_THREADS="${TORCHINDUCTOR_COMPILE_THREADS:-1}"
# the checkout's own sources compiled once: where PYTHONDONTWRITEBYTECODE is set, as on CI, every process of the
# suite (pytest workers, ranks, torchrun, CLI runs) would otherwise compile each titanlite module it imports again
.venv/bin/python -m compileall -q -j 2 titanlite torchtitan_ext tests
.venv/bin/ruff format --check --quiet . || { echo "ruff format: files above need formatting (.venv/bin/ruff format .)"; exit 1; }
.venv/bin/ruff check --quiet .
# two pytest workers (pytest-xdist), each given whole files (--dist loadfile: a module's fixtures, e.g. a trained
# checkpoint, are built once, not once per worker) in the order tests/conftest.py sets (the longest files first)
exec .venv/bin/python -m pytest -q -n "${TITANLITE_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder "$@"

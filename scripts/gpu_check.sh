#!/usr/bin/env bash
# titanlite's check on the GPU machine, in one device call (docs/benchmarks.md): each part is a script of its own
# with its own time budget and results under $OUT. The training part is scripts/gpu_check_train.sh (issue 26);
# the generation and scoring part (issue 25) is added here as another independent step.
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT to the folder for the results}"
bash scripts/gpu_check_train.sh

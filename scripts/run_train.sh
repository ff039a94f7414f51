#!/usr/bin/env bash
# Set up .venv if needed, then train with a config:
#   bash scripts/run_train.sh train_configs/debug_model.toml [--section.key value ...]
# NGPU / NPROC > 1 launches through torchrun on this machine (gloo on CPU, NCCL on GPUs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
config="${1:-train_configs/debug_model.toml}"
shift || true
nproc="${NPROC:-${NGPU:-1}}"
if [ "$nproc" -gt 1 ]; then
  exec .venv/bin/torchrun --standalone --nproc-per-node "$nproc" -m titanlite.train --config "$config" "$@"
fi
exec .venv/bin/python -m titanlite.train --config "$config" "$@"

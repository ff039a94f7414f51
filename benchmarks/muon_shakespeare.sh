#!/usr/bin/env bash
# Muon against AdamW on nanoGPT's character-level Shakespeare recipe, shrunk for a CPU (docs/muon.md): 4 layers,
# dim 128, seq 64, 12 sequences, byte-level tokens (tiny Shakespeare is ASCII: one token per character).
# usage: benchmarks/muon_shakespeare.sh OUT_DIR NAME STEPS OPTIMIZER LR [extra config flags...]
# The data: titanlite prepare --input tinyshakespeare.txt --output OUT_DIR/shakespeare --val-fraction 0.1
#   --txt-split paragraphs
set -euo pipefail
out=$1 name=$2 steps=$3 optimizer=$4 lr=$5
shift 5
exec python -m titanlite.train --model.dim 128 --model.n_layers 4 --model.n_heads 4 --model.n_kv_heads 4 \
  --training.dataset shards --training.dataset_path "$out/shakespeare" --training.seq_len 64 \
  --training.local_batch_size 12 --training.steps "$steps" --training.max_norm 1.0 --training.seed 1 \
  --optimizer.name "$optimizer" --optimizer.lr "$lr" --optimizer.beta2 0.99 --optimizer.weight_decay 0.1 \
  --lr_scheduler.warmup_steps 100 --lr_scheduler.decay_type cosine --lr_scheduler.min_lr_factor 0.1 \
  --validation.enable true --validation.freq 100 --validation.steps 20 --metrics.log_freq 50 \
  --checkpoint.enable false --job.dump_folder "$out/$name" "$@"

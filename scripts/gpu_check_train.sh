#!/usr/bin/env bash
# The training part of scripts/gpu_check.sh: issue 26's side-by-side benchmark on one GPU (an H100), in one call.
#
#   OUT=/results/folder bash scripts/gpu_check_train.sh
#
# Rows, most telling first, each its own process under `timeout` (the smaller of its cap and the time left of
# TRAIN_BUDGET_S, default 480 s; a row that does not fit is recorded as skipped): titanlite's scripts/bench.py
# at seq_len 2048 in bf16 (1B batch 4 compiled, the transformers loop compiled, 1B batch 8 compiled, 8B layer
# shapes with 4 layers bf16 and float8, the optimizer step alone at both shapes (scripts/bench_optimizer.py: the
# clip as it was, as it is, and no clip, against the bandwidth floor), 1B batch 4 eager, transformers eager, 1B
# float8, a profiled 8B-shape float8 step, 1B float8 rowwise). Every result is appended to $OUT as soon as it exists, so a timeout keeps the
# rows before it. Files under $OUT (5 of the 8 allowed):
#   train.jsonl               one JSON line per row (bench.py's or bench_hf_baseline.py's, plus "row")
#   train_table.md            the table (scripts/bench_table.py, docs/benchmarks.md's format)
#   train.log                 every row's output, with its exit status and seconds
#   profile_8b_float8.md      where the profiled 8B-shape float8 step's GPU time goes (scripts/trace_summary.py)
#   trace_8b_float8.json.gz   that step's torch.profiler trace (open it in https://ui.perfetto.dev)
# The torchdata wheel must be importable: a ./.whl/torchdata-*.whl carried along is put on PYTHONPATH
# (/work/shared/GPU.md). Read docs/benchmarks.md for how to run it with the device tool.
# TRAIN_CHECK_SMOKE=1 runs the same rows at the debug model's size with 1 + 2 steps (to check the script on a CPU).
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT to the folder for the results}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
BUDGET_S="${TRAIN_BUDGET_S:-480}"
START=$(date +%s)
WORK="$(mktemp -d /tmp/gpu_check_train.XXXXXX)"  # per-row JSON, dump folders, the raw trace: not under $OUT
RESULTS="$OUT/train.jsonl"
LOG="$OUT/train.log"
export PYTHONPATH="$PWD:${PYTHONPATH:-}"
if ! "$PY" -c "import torchdata" 2>/dev/null; then
  WHEEL=$(ls "$PWD"/.whl/torchdata-*.whl 2>/dev/null | head -1)
  if [ -z "$WHEEL" ]; then
    echo "error: torchdata is not importable and no .whl/torchdata-*.whl was carried (see /work/shared/GPU.md)" | tee -a "$LOG"
    exit 2
  fi
  export PYTHONPATH="$WHEEL:$PYTHONPATH"
fi
"$PY" -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')" >> "$LOG" 2>&1

failed() {  # failed NAME WHY: the row's line in the results
  echo "{\"row\": \"$1\", \"error\": \"$2\"}" >> "$RESULTS"
}

step() {  # step NAME CAP_S COMMAND...: COMMAND under timeout; returns 3 when the budget left is too small
  local name=$1 cap=$2
  shift 2
  [ "${TRAIN_CHECK_SMOKE:-0}" = 1 ] && cap=$((cap * 4))  # a CPU compiles slowly
  local left=$((BUDGET_S - ($(date +%s) - START)))
  if ((left < 45)); then
    echo "### $name: skipped, ${left}s of the ${BUDGET_S}s budget left" >> "$LOG"
    return 3
  fi
  local limit=$((cap < left ? cap : left)) t0
  t0=$(date +%s)
  echo "### $name: timeout ${limit}s, at $((t0 - START))s" >> "$LOG"
  timeout -k 10 "$limit" "$@" >> "$LOG" 2>&1
  local rc=$?
  echo "### $name: exit status $rc after $(($(date +%s) - t0))s" >> "$LOG"
  return $rc
}

row() {  # row NAME CAP_S SCRIPT ARGS...: a benchmark whose --json-out line goes to the results with its row name
  local name=$1 cap=$2 script=$3
  shift 3
  local json
  json="$WORK/$(echo "$name" | tr -c 'A-Za-z0-9' _).json"
  step "$name" "$cap" "$PY" "$script" --json-out "$json" "$@"
  local rc=$?
  if ((rc == 0)) && [ -s "$json" ]; then
    "$PY" -c 'import json, sys; print(json.dumps({"row": sys.argv[1], **json.load(open(sys.argv[2]))}))' \
      "$name" "$json" >> "$RESULTS"
  elif ((rc == 3)); then
    failed "$name" "skipped: time budget spent"
  elif ((rc == 124 || rc == 137)); then
    failed "$name" "timed out"
  else
    failed "$name" "failed, exit status $rc (train.log)"
  fi
}

# the shapes: Llama 3.2 1B, and Llama 3.1 8B's layers (4 of them), at seq_len 2048 with Llama 3's vocabulary
FLAVOR_1B=1B FLAVOR_8B=8B SEQ=2048 VOCAB=128256 WARMUP=5 STEPS=20 DTYPE=bfloat16
if [ "${TRAIN_CHECK_SMOKE:-0}" = 1 ]; then
  FLAVOR_1B=debugmodel FLAVOR_8B=debugmodel SEQ=128 VOCAB=512 WARMUP=1 STEPS=2 DTYPE=float32
fi
SHAPE=(--config train_configs/debug_model.toml --model.vocab_size "$VOCAB" --training.seq_len "$SEQ"
  --training.global_batch_size -1 --training.mixed_precision_param "$DTYPE" --metrics.enable_tensorboard false
  --checkpoint.enable false --validation.enable false)

bench() {  # bench NAME CAP_S ARGS...: scripts/bench.py at the common shape (5 + 20 steps)
  local name=$1 cap=$2
  shift 2
  row "$name" "$cap" scripts/bench.py "${SHAPE[@]}" --metrics.log_freq 1000 --warmup "$WARMUP" --steps "$STEPS" \
    --job.dump_folder "$WORK/$(echo "$name" | tr -c 'A-Za-z0-9' _)" "$@"
}

hf() {  # hf NAME CAP_S ARGS...: the transformers loop at the 1B shape
  local name=$1 cap=$2
  shift 2
  row "$name" "$cap" scripts/bench_hf_baseline.py --flavor "$FLAVOR_1B" --vocab-size "$VOCAB" --seq-len "$SEQ" \
    --dtype "$DTYPE" --warmup "$WARMUP" --steps "$STEPS" "$@"
}

F8=(--quantize.linear.float8.enable true)
B1=(--model.flavor "$FLAVOR_1B")
B8=(--model.flavor "$FLAVOR_8B" --model.n_layers 4 --training.local_batch_size 4 --compile.enable true)

bench "1B, batch 4, compiled" 150 "${B1[@]}" --training.local_batch_size 4 --compile.enable true
hf "transformers 1B, batch 4, compiled" 240 --batch 4 --compile
bench "1B, batch 8, compiled" 150 "${B1[@]}" --training.local_batch_size 8 --compile.enable true
bench "8B shapes (4 layers), batch 4, compiled" 150 "${B8[@]}"
bench "8B shapes (4 layers), batch 4, compiled, float8" 150 "${B8[@]}" "${F8[@]}"
row "optimizer step alone, 1B" 60 scripts/bench_optimizer.py --flavor "$FLAVOR_1B" --vocab-size "$VOCAB"
row "optimizer step alone, 8B shapes (4 layers)" 60 scripts/bench_optimizer.py --flavor "$FLAVOR_8B" --n-layers 4 \
  --vocab-size "$VOCAB"
bench "1B, batch 4, eager" 90 "${B1[@]}" --training.local_batch_size 4 --compile.enable false
hf "transformers 1B, batch 4, eager" 90 --batch 4
bench "1B, batch 4, compiled, float8" 150 "${B1[@]}" --training.local_batch_size 4 --compile.enable true "${F8[@]}"

# the profiled step: 8B shapes, float8 (the compile cache is warm from its row); trace of step 5
PROFILE="$WORK/profile"
if step "profile: 8B shapes, float8" 120 "$PY" scripts/bench.py "${SHAPE[@]}" "${B8[@]}" "${F8[@]}" \
  --warmup 3 --steps 2 --no-bandwidth --no-split \
  --profiling.enable_profiling true --profiling.profile_freq 5 --profiling.profiler_warmup 1 \
  --profiling.profiler_active 1 --job.dump_folder "$PROFILE"; then
  TRACE=$(ls "$PROFILE"/profile_traces/iteration_5/*.json 2>/dev/null | head -1)
  if [ -n "$TRACE" ]; then
    "$PY" scripts/trace_summary.py "$TRACE" > "$OUT/profile_8b_float8.md" 2>> "$LOG"
    gzip -c "$TRACE" > "$OUT/trace_8b_float8.json.gz"
  fi
fi

bench "1B, batch 4, compiled, float8 rowwise" 120 "${B1[@]}" --training.local_batch_size 4 --compile.enable true \
  "${F8[@]}" --quantize.linear.float8.recipe_name rowwise

"$PY" scripts/bench_table.py "$RESULTS" > "$OUT/train_table.md" 2>> "$LOG"
echo "### done after $(($(date +%s) - START))s" >> "$LOG"
cat "$OUT/train_table.md"

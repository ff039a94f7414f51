#!/usr/bin/env bash
# Every GPU figure docs/benchmarks.md reports, in ONE call of the device tool (at most 9 minutes on one H200 / H100;
# the image's torch, no torchdata, no network: see docs/benchmarks.md "Running scripts/gpu_check.sh").
#
#   bash scripts/gpu_check.sh           # on the GPU machine; results under $OUT (default ./gpu_check_out)
#   bash scripts/gpu_check.sh --cpu     # the same steps at the debug model's size on CPU: checks the script itself
#
# Steps run in priority order, each under `timeout` (the smaller of its cap and what is left of GPU_BUDGET_S,
# default 520 s; a step that no longer fits is recorded as skipped, in steps.jsonl and as a row), and every result
# is appended as soon as it exists. To fit the budget: training rows of one kind share a process
# (`titanlite bench rows`: one torch import and CUDA start; the profiled 1B step reuses row 1's compiled graphs),
# every process shares one inductor cache folder, 2 warm-up and 8 timed steps per row. The steps:
#   1. 1B bf16 compiled, seq 2048: batch 4; batch 8; batch 4 with cuDNN attention first ([training] sdpa_kernel);
#      the batch-4 step profiled, its parts against their floors                   (titanlite.bench.rows)
#   2. the compiled transformers loop at batch 4                                    (titanlite.bench.hf_baseline)
#   3. decode, 1B bf16, 128-token prompts, 256 new tokens, batch 1 and 8, compiled  (titanlite.bench.generate)
#   4. the optimizer step alone (1B); 5. Llama 3.1 8B's layers (4 of them): bf16, float8 tensorwise, rowwise
#   6. the MoE layer, and qwen3_moe 30B-A3B with 4 blocks: grouped GEMM against the per-expert loop
#   7. scoring the 1B model at batch 16, compiled (titanlite.bench.eval); 8. 1B float8 tensorwise, batch 4 and 8
#   9. 1B batch 4 with CUDA graphs ([compile] mode reduce-overhead); the transformers loop at batch 8; eager rows
# Files under $OUT (at most 8): results.jsonl (generation, scoring, MoE layer), train.jsonl (training rows, each
# with its "row" name), steps.jsonl (each step's exit status and seconds), log.txt (every step's output),
# table.md (the summary, also printed), profile_1b.md (the profiled step's parts against their floors) and
# trace_1b.json.gz. The carried torchdata wheel (.whl/torchdata-*.whl) is imported from the zip; the eval data comes
# from an ignored folder of the checkout (outputs/gpu_eval, a copy of ../shared/data/eval/hellaswag) carried along.
set -u
cd "$(dirname "$0")/.."

MODE=gpu
[ "${1:-}" = "--cpu" ] && MODE=cpu
OUT=${OUT:-$PWD/gpu_check_out}
mkdir -p "$OUT"
RESULTS=$OUT/results.jsonl TRAIN=$OUT/train.jsonl STEPS=$OUT/steps.jsonl LOG=$OUT/log.txt TABLE=$OUT/table.md
BUDGET_S=${GPU_BUDGET_S:-520}
CAP_SCALE=1
[ "$MODE" = cpu ] && BUDGET_S=${GPU_BUDGET_S:-3000} CAP_SCALE=2  # a CPU compiles slowly: twice each step's cap
START=$(date +%s)
WORK=$(mktemp -d /tmp/gpu_check.XXXXXX)  # dump folders, per-row JSON, the raw trace: not under $OUT
EVAL_DATA=${EVAL_DATA:-$PWD/outputs/gpu_eval}
[ -d "$EVAL_DATA" ] || EVAL_DATA=$PWD/../shared/data/eval
PY=${PYTHON:-python3}
[ "$MODE" = cpu ] && [ -x .venv/bin/python ] && PY=.venv/bin/python

export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # titanlite is pure Python: the checkout itself
if ! "$PY" -c "import torchdata" 2>/dev/null; then
  for wheel in "$PWD"/.whl/torchdata-*.whl; do [ -f "$wheel" ] && export PYTHONPATH="$wheel:$PYTHONPATH"; done
fi
export PYTHONUNBUFFERED=1
export TORCHINDUCTOR_CACHE_DIR=$WORK/inductor  # one compile cache for every step: a graph compiled once is loaded
[ "$MODE" = cpu ] && export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}

step() {  # step NAME CAP_S command...: returns the command's status, 3 when skipped
  local name=$1 cap=$(($2 * CAP_SCALE)) left limit t0 rc
  shift 2
  left=$((BUDGET_S - ($(date +%s) - START)))
  if ((left < 40)); then
    echo "=== $name: skipped, ${left}s of ${BUDGET_S}s left" >>"$LOG"
    echo "{\"step\": \"$name\", \"status\": \"skipped\", \"seconds\": 0}" >>"$STEPS"
    return 3
  fi
  limit=$((cap < left - 10 ? cap : left - 10))
  t0=$(date +%s)
  echo "=== $name (timeout ${limit}s, at $((t0 - START))s): $*" >>"$LOG"
  timeout --kill-after=10 "$limit" "$@" >>"$LOG" 2>&1
  rc=$?
  echo "{\"step\": \"$name\", \"status\": $rc, \"timed_out\": $([ $rc = 124 ] || [ $rc = 137 ] && echo true || echo false), \"seconds\": $(($(date +%s) - t0))}" >>"$STEPS"
  echo "$name: exit $rc after $(($(date +%s) - t0)) s (at $(($(date +%s) - START)) s)" >&2
  return $rc
}

failed() {  # failed NAME RC: the train.jsonl line of a step that gave no result
  local why="failed, exit status $2 (log.txt)"
  (($2 == 3)) && why="skipped: time budget spent"
  (($2 == 124 || $2 == 137)) && why="timed out"
  echo "{\"row\": \"$1\", \"error\": \"$why\"}" >>"$TRAIN"
}

row() {  # row NAME CAP_S MODULE ARGS...: a training benchmark whose --json-out goes to train.jsonl with "row"
  local name=$1 cap=$2 module=$3 json rc
  shift 3
  json="$WORK/$(echo "$name" | tr -c 'A-Za-z0-9' _).json"
  step "$name" "$cap" "$PY" -m "$module" --json-out "$json" "$@"
  rc=$?
  if ((rc == 0)) && [ -s "$json" ]; then
    "$PY" -c 'import json, sys; print(json.dumps({"row": sys.argv[1], **json.load(open(sys.argv[2]))}))' \
      "$name" "$json" >>"$TRAIN"
  else
    failed "$name" $rc
  fi
}

rows() {  # rows NAME CAP_S [--common ARGS...] --row ROW ARGS...: bench train rows in one process (bench rows)
  local name=$1 cap=$2 rc
  shift 2
  step "$name" "$cap" "$PY" -m titanlite.bench.rows --jsonl "$TRAIN" "$@"
  rc=$?
  ((rc != 0)) && failed "$name (its rows not in the table above)" $rc
  return $rc
}

step env 60 "$PY" -c "
import json, torch
cuda = torch.cuda.is_available()
row = {'bench': 'env', 'torch': torch.__version__, 'cuda': cuda, 'device': torch.cuda.get_device_name() if cuda else 'cpu'}
open('$RESULTS', 'a').write(json.dumps(row) + '\n')
import torchdata, titanlite
print(row, 'torchdata', torchdata.__file__, 'titanlite', titanlite.__file__)
"

# ---- the shapes
if [ "$MODE" = gpu ]; then
  FLAVOR_1B=1B FLAVOR_8B=8B SEQ=2048 VOCAB=128256 WARMUP=2 STEPS_T=8 DTYPE=bfloat16
  GEN=(--flavors 1B --dtype bfloat16 --batch-sizes 1,8 --prompt-len 128 --new-tokens 256 --repeats 1)
  BIG_EVAL=(--tasks "" --big-flavor 1B --big-task hellaswag --big-limit 64 --batch-sizes 16 --dtype bfloat16)
else
  FLAVOR_1B=debugmodel FLAVOR_8B=debugmodel SEQ=128 VOCAB=512 WARMUP=1 STEPS_T=2 DTYPE=float32
  GEN=(--flavors debugmodel --batch-sizes 1 --prompt-len 32 --new-tokens 8 --repeats 1)
  BIG_EVAL=(--tasks "" --big-flavor debugmodel --big-task hellaswag --big-limit 4 --batch-sizes 4)
fi
SHAPE=(--config train_configs/debug_model.toml --model.vocab_size "$VOCAB" --training.seq_len "$SEQ"
  --training.global_batch_size -1 --training.mixed_precision_param "$DTYPE" --metrics.enable_tensorboard false
  --metrics.log_freq 1000 --checkpoint.enable false --validation.enable false --warmup "$WARMUP" --steps "$STEPS_T")
B1=(--common "${SHAPE[@]}" --model.flavor "$FLAVOR_1B" --compile.enable true)
B8=(--common "${SHAPE[@]}" --model.flavor "$FLAVOR_8B" --model.n_layers 4 --training.local_batch_size 4
  --compile.enable true)
F8=(--quantize.linear.float8.enable true)
dump() { echo "--job.dump_folder=$WORK/$1"; }  # each row's own run folder
hf() {  # hf NAME CAP_S ARGS...: the transformers loop at the 1B shape
  local name=$1 cap=$2
  shift 2
  row "$name" "$cap" titanlite.bench.hf_baseline --flavor "$FLAVOR_1B" --vocab-size "$VOCAB" --seq-len "$SEQ" \
    --dtype "$DTYPE" --warmup "$WARMUP" --steps "$STEPS_T" "$@"
}
# the profiled 1B step (row 1's shape: its graphs come from the cache): profiler warm-up at step WARMUP + 1, trace at
# step WARMUP + 2; no per-region syncs; its JSON (with the floors) is read by trace-summary below
PROFILE=(--warmup "$WARMUP" --steps 2 --no-split --json-out "$WORK/profile_1b.json" --training.local_batch_size 4
  --profiling.enable_profiling true --profiling.profile_freq $((WARMUP + 2)) --profiling.profiler_warmup 1
  --profiling.profiler_active 1 "$(dump profile)")

# ---- in priority order
rows "1B bf16 compiled: batch 4, batch 8, cuDNN attention, profiled" 210 "${B1[@]}" \
  --row "1B, batch 4, compiled" --training.local_batch_size 4 "$(dump b4)" \
  --row "1B, batch 8, compiled" --training.local_batch_size 8 "$(dump b8)" \
  --row "1B, batch 4, compiled, cuDNN attention first" --training.local_batch_size 4 --training.sdpa_kernel cudnn \
  "$(dump cudnn)" \
  --row "1B, batch 4, compiled (profiled step)" "${PROFILE[@]}"
# the profiled step's parts against their floors, and its trace (under the budget: a 1B trace is large)
step "profile summary" 60 bash -c 't=$(ls "$1"/profile/profile_traces/iteration_"$2"/*.json 2>/dev/null | head -1)
  [ -n "$t" ] && [ -s "$1/profile_1b.json" ] && "$3" -m titanlite.bench.trace_summary "$t" --floors \
  "$1/profile_1b.json" >"$4/profile_1b.md" && gzip -c "$t" >"$4/trace_1b.json.gz"' _ "$WORK" $((WARMUP + 2)) "$PY" "$OUT"
hf "transformers 1B, batch 4, compiled" 150 --batch 4 --compile
step generate_compiled 120 "$PY" -m titanlite.bench.generate "${GEN[@]}" --modes compiled --jsonl "$RESULTS"
row "optimizer step alone, 1B" 45 titanlite.bench.optimizer --flavor "$FLAVOR_1B" --vocab-size "$VOCAB"
rows "8B shapes (4 layers), batch 4, compiled: bf16, float8 tensorwise, float8 rowwise" 150 "${B8[@]}" \
  --row "8B shapes (4 layers), batch 4, compiled" "$(dump b8_bf16)" \
  --row "8B shapes (4 layers), batch 4, compiled, float8" "${F8[@]}" "$(dump b8_f8)" \
  --row "8B shapes (4 layers), batch 4, compiled, float8 rowwise" "${F8[@]}" \
  --quantize.linear.float8.recipe_name rowwise "$(dump b8_f8_row)"
if [ "$MODE" = gpu ]; then  # the MoE layer (debug MoE's experts, 16k tokens, bf16): grouped GEMM against the loop
  step moe_layer 60 "$PY" -m titanlite.bench.moe --training.mixed_precision_param bfloat16 \
    --training.local_batch_size 8 --training.seq_len 2048 --steps 10 --json-out "$WORK/moe_layer.json" &&
    "$PY" -c 'import json, sys; print(json.dumps({"bench": "moe_layer", **json.load(open(sys.argv[1]))}))' \
      "$WORK/moe_layer.json" >>"$RESULTS"
fi
# qwen3_moe 30B-A3B with 4 blocks (128 experts, top-8, the real vocabulary), full AC: MFU on active parameters
MOE=(--common --config train_configs/qwen3_30b_a3b.toml --job.world_size 1 --parallelism.expert_parallel_degree 1
  --parallelism.data_parallel_shard_degree 1 --model.n_layers 4 --model.tokenizer_path "" --training.dataset embedded
  --training.dataset_path "" --validation.enable false --training.local_batch_size 2 --training.seq_len "$SEQ"
  --training.global_batch_size -1 --training.mixed_precision_param "$DTYPE" --checkpoint.enable false
  --compile.enable false --activation_checkpoint.mode full --metrics.enable_tensorboard false --warmup "$WARMUP"
  --steps "$STEPS_T")
[ "$MODE" = gpu ] && MOE+=(--model.vocab_size 151936) || MOE+=(--model.flavor debugmodel)
rows "qwen3_moe 30B-A3B x4 blocks: grouped GEMM, expert loop" 120 "${MOE[@]}" \
  --row "qwen3_moe 30B-A3B x4 blocks, grouped GEMM" "$(dump moe_g)" \
  --row "qwen3_moe 30B-A3B x4 blocks, expert loop" --model.moe_grouped_mm false "$(dump moe_l)"
step eval_big 120 "$PY" -m titanlite.bench.eval --data-dir "$EVAL_DATA" "${BIG_EVAL[@]}" --repeats 1 \
  --modes compiled --jsonl "$RESULTS"
rows "1B float8 compiled: batch 4, batch 8" 120 "${B1[@]}" "${F8[@]}" \
  --row "1B, batch 4, compiled, float8" --training.local_batch_size 4 "$(dump f8_b4)" \
  --row "1B, batch 8, compiled, float8" --training.local_batch_size 8 "$(dump f8_b8)"
rows "1B, batch 4, CUDA graphs" 90 "${B1[@]}" --row "1B, batch 4, compiled, CUDA graphs (reduce-overhead)" \
  --training.local_batch_size 4 --compile.mode reduce-overhead "$(dump cudagraphs)"
hf "transformers 1B, batch 8, compiled" 120 --batch 8 --compile
rows "1B, batch 4, eager" 60 --common "${SHAPE[@]}" --model.flavor "$FLAVOR_1B" \
  --row "1B, batch 4, eager" --training.local_batch_size 4 "$(dump eager)"
hf "transformers 1B, batch 4, eager" 60 --batch 4

# ---- the table
{
  "$PY" -m titanlite.bench.table "$TRAIN" 2>>"$LOG"
  echo
  "$PY" - "$RESULTS" <<'EOF'
import json, sys

rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
for r in rows:
    if r.get("bench") == "env":
        print(f"device: {r['device']}, torch {r['torch']}\n")


def merged(kind, key):
    """Rows of one bench kind, those of the same setup (from separate steps) merged into one."""
    out = {}
    for r in rows:
        if r.get("bench") == kind:
            out.setdefault(tuple(r.get(k) for k in key), {}).update(r)
    return list(out.values())


gen = merged("generate", ("flavor", "dtype", "batch", "prompt_len", "new"))
if gen:
    modes = [m for m in ("compiled", "eager", "recompute", "baseline") if any(f"{m}_tok_s" in r for r in gen)]
    print("| model | dtype | batch | new | " + " | ".join(f"{m} tok/s" for m in modes) + " | cache / recompute | % floor |")
    print("|---|---|---:|---:|" + "---:|" * (len(modes) + 2))
    for r in gen:
        best = next((m for m in ("compiled", "eager") if f"{m}_tok_s" in r), None)
        ratio = f'{r[f"{best}_tok_s"] / r["recompute_tok_s"]:.1f}x' if best and "recompute_tok_s" in r else "-"
        floor = f"{100 * r[best + '_floor_fraction']:.1f}% ({best})" if best else "-"
        cells = " | ".join(f"{r[m + '_tok_s']:,.1f}" if m + "_tok_s" in r else "-" for m in modes)
        print(f"| {r['flavor']} | {r['dtype']} | {r['batch']} | {r['new']} | {cells} | {ratio} | {floor} |")
    print()
ev = merged("eval", ("model", "task", "batch_size", "dtype"))
if ev:
    print("| model | task | batch | tokens | eager tokens/s | compiled tokens/s | eager MFU | compiled MFU |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for r in ev:
        cell = lambda k, f: format(r[k], f) if r.get(k) is not None else "-"  # noqa: E731
        print(f"| {r['model']} | {r['task']} | {r['batch_size']} | {r['tokens']:,} | {cell('eager_tok_s', ',.0f')} | "
              f"{cell('compiled_tok_s', ',.0f')} | {cell('eager_mfu', '.1%')} | {cell('compiled_mfu', '.1%')} |")
    print()
for r in rows:
    if r.get("bench") not in ("env", "generate", "eval"):
        print(json.dumps(r))
EOF
  [ -s "$OUT/profile_1b.md" ] && printf '\n## The profiled 1B step (batch 4, compiled)\n\n' && cat "$OUT/profile_1b.md"
} >"$TABLE"
echo "done after $(($(date +%s) - START)) s" >>"$LOG"
cat "$TABLE"
echo
cat "$STEPS"

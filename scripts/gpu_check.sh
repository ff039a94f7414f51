#!/usr/bin/env bash
# Every GPU figure docs/benchmarks.md reports, in one call of at most 9 minutes on one GPU (torch 2.11 image,
# no torchdata, no network: docs/benchmarks.md "Running scripts/gpu_check.sh"). Steps are independent and
# each bounded by `timeout`: a step that fails or runs out of time is recorded and the next one runs.
#
#   bash scripts/gpu_check.sh            # on the GPU machine; results under $OUT (default ./gpu_check_out)
#   bash scripts/gpu_check.sh --cpu      # the same steps, tiny, on CPU: checks the script itself (~5 min)
#
# Files under $OUT (at most 8): results.jsonl (one JSON object per measurement, appended as each finishes,
# so a timeout keeps what came before), steps.jsonl (each step's name, exit status and seconds), log.txt
# (every step's output) and table.md (the summary printed at the end).
#
# Adding a step: `step NAME SECONDS command ...`; the command appends its rows to "$RESULTS" (the bench
# scripts' --jsonl) and may print anything (it goes to log.txt).
set -u
cd "$(dirname "$0")/.."

MODE=gpu
[ "${1:-}" = "--cpu" ] && MODE=cpu
OUT=${OUT:-$PWD/gpu_check_out}
mkdir -p "$OUT"
RESULTS=$OUT/results.jsonl STEPS=$OUT/steps.jsonl LOG=$OUT/log.txt TABLE=$OUT/table.md
EVAL_DATA=${EVAL_DATA:-$PWD/outputs/gpu_eval}  # an ignored folder of the checkout (carried to the GPU machine)
[ -d "$EVAL_DATA" ] || EVAL_DATA=$PWD/../shared/data/eval
PY=${PYTHON:-python}
[ -x .venv/bin/python ] && [ "$MODE" = cpu ] && PY=.venv/bin/python

# torch 2.11 image: titanlite is pure Python (the checkout on PYTHONPATH); torchdata from the carried wheel,
# imported from the zip (nothing installed, torch untouched)
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if ! "$PY" -c "import torchdata" 2>/dev/null; then
  for wheel in .whl/torchdata-*.whl; do [ -f "$wheel" ] && export PYTHONPATH="$PWD/$wheel:$PYTHONPATH"; done
fi
export PYTHONUNBUFFERED=1

step() {  # step NAME SECONDS command...
  local name=$1 limit=$2 start rc
  shift 2
  start=$(date +%s)
  echo "=== $name (timeout ${limit}s): $*" >>"$LOG"
  timeout --kill-after=10 "$limit" "$@" >>"$LOG" 2>&1
  rc=$?
  echo "{\"step\": \"$name\", \"status\": $rc, \"timed_out\": $([ $rc = 124 ] || [ $rc = 137 ] && echo true || echo false), \"seconds\": $(($(date +%s) - start))}" >>"$STEPS"
  echo "$name: exit $rc after $(($(date +%s) - start)) s" >&2
}

step env 60 "$PY" -c "
import json, torch
cuda = torch.cuda.is_available()
row = {'bench': 'env', 'torch': torch.__version__, 'cuda': cuda, 'device': torch.cuda.get_device_name() if cuda else 'cpu'}
open('$RESULTS', 'a').write(json.dumps(row) + '\n')
print(row)
import torchdata, titanlite
print('torchdata', torchdata.__file__, 'titanlite', titanlite.__file__)
"

# ---- training rows (bench.py 1B bf16 / float8, transformers baseline): added by the training benchmarks' change

# ---- generation: Llama 3.2 1B shape, bf16, 128-token prompts, 256 new tokens, batch 1 and 8: the KV cache
# eager and compiled, and recomputing the prefix (the table merges the two steps' rows)
if [ "$MODE" = gpu ]; then
  GEN=(--flavors 1B --dtype bfloat16 --batch-sizes 1,8 --prompt-len 128 --new-tokens 256 --repeats 1)
  DEBUG_EVAL=(--tasks hellaswag,arc_easy --limit 200 --skip-big)
  BIG_EVAL=(--tasks "" --big-flavor 1B --big-task hellaswag --big-limit 64)
  EVAL=(--batch-sizes 16 --dtype bfloat16 --repeats 2)
else
  GEN=(--flavors debugmodel --batch-sizes 1 --prompt-len 32 --new-tokens 8 --repeats 1)
  DEBUG_EVAL=(--tasks arc_easy --limit 4 --skip-big)
  BIG_EVAL=(--tasks "" --big-flavor debugmodel --big-task lambada_openai --big-limit 4)
  EVAL=(--batch-sizes 4 --repeats 1)
  export OMP_NUM_THREADS=1  # tiny models on a shared CPU: one thread (two fight over the cores)
fi
DEBUG_MODES=eager,compiled
[ "$MODE" = cpu ] && DEBUG_MODES=eager  # compiled scoring is checked by eval_big_compiled
# Time budget of these steps (their timeouts): 10 + 120 + 180 + 60 + 100 s = 7.8 min at most; the debug
# model's scoring (GPU_CHECK_DEBUG_EVAL=1) adds 90 s. Expected on an H100: ~1 + 1 + 2-3 + 0.5 + 1.5 min.
step generate_eager 120 "$PY" scripts/bench_generate.py "${GEN[@]}" --modes eager,recompute --jsonl "$RESULTS"
step generate_compiled 180 "$PY" scripts/bench_generate.py "${GEN[@]}" --modes compiled --jsonl "$RESULTS"

# ---- scoring at batch 16, bf16: the 1B shape (MFU), eager then compiled; optionally the debug model
step eval_big_eager 60 "$PY" scripts/bench_eval.py --data-dir "$EVAL_DATA" "${BIG_EVAL[@]}" "${EVAL[@]}" \
  --modes eager --jsonl "$RESULTS"
step eval_big_compiled 100 "$PY" scripts/bench_eval.py --data-dir "$EVAL_DATA" "${BIG_EVAL[@]}" "${EVAL[@]}" \
  --modes compiled --jsonl "$RESULTS"
if [ "$MODE" = cpu ] || [ "${GPU_CHECK_DEBUG_EVAL:-0}" = 1 ]; then
  step eval_debug 90 "$PY" scripts/bench_eval.py --data-dir "$EVAL_DATA" "${DEBUG_EVAL[@]}" "${EVAL[@]}" \
    --modes "$DEBUG_MODES" --jsonl "$RESULTS"
fi

# ---- the table
"$PY" - "$RESULTS" >"$TABLE" <<'EOF'
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
        ratio = r[f"{best}_tok_s"] / r["recompute_tok_s"] if best and "recompute_tok_s" in r else float("nan")
        floor = f"{100 * r[best + '_floor_fraction']:.1f}% ({best})" if best else "-"
        cells = " | ".join(f"{r[m + '_tok_s']:,.1f}" if m + "_tok_s" in r else "-" for m in modes)
        print(f"| {r['flavor']} | {r['dtype']} | {r['batch']} | {r['new']} | {cells} | {ratio:.1f}x | {floor} |")
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
other = [r for r in rows if r.get("bench") not in ("env", "generate", "eval")]
for r in other:  # e.g. training rows: shown as they are
    print(json.dumps(r))
EOF
cat "$TABLE"
echo
cat "$STEPS"

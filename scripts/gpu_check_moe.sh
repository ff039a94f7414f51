#!/usr/bin/env bash
# MoE checks on one GPU (issue 30; to be merged into scripts/gpu_check.sh). Run from the repository root on
# the GPU image (torch 2.11, no torchdata: see /work/shared/GPU.md), with $OUT set to a results folder:
#   OUT=/tmp/out bash scripts/gpu_check_moe.sh
# Each step has its own timeout and appends to $OUT/moe.jsonl as it finishes, so a timeout keeps the rest.
#
# 1. correctness on CUDA: the MoE layer's grouped GEMM (torch._grouped_mm, bf16) against the per-expert loop,
#    forward and gradients (bf16 tolerance), and torch.compile of a MoE block (fullgraph) against eager;
# 2. qwen3_moe 30B-A3B with 4 blocks (3.1 B parameters, 128 experts top-8 per block, the real 151,936
#    vocabulary) on one GPU, bf16 autocast, full AC: tokens/s and MFU on active parameters (recompute not counted) with
#    the grouped GEMM, then with the per-expert loop (model.moe_grouped_mm = false); last, grouped + compile;
# 3. the debug MoE against the dense debug model (scripts/bench.py --compare-moe), for the ratio on a GPU.
set -uo pipefail
OUT="${OUT:-./gpu_out}"
mkdir -p "$OUT"
[ -d .whl ] && export PYTHONPATH="$PWD/.whl/torchdata-0.11.0-py3-none-any.whl:${PYTHONPATH:-}"
export PYTHONPATH="$PWD:${PYTHONPATH:-}"
PY="${PYTHON:-python3}"
LOG="$OUT/moe.log"
echo "gpu_check_moe: $(date)" >> "$LOG"

timeout 120 "$PY" - >> "$OUT/moe.jsonl" 2>> "$LOG" <<'PYEOF'
import copy, json, time, torch
from titanlite.models.llama3.model import FeedForward
from titanlite.models.moe import MoE, MoEConfig
torch.manual_seed(0)
dev = "cuda"
moe = MoE(2048, MoEConfig(num_experts=128, top_k=8, hidden_dim=768, aux_loss_coef=1e-3), FeedForward)
moe.init_weights(0.02)
moe = moe.to(dev, torch.bfloat16).train()
loop = copy.deepcopy(moe)
loop.experts.grouped_mm = False
x = torch.randn(4, 2048, 2048, device=dev, dtype=torch.bfloat16)
out = {"check": "moe_grouped_vs_loop_cuda_bf16"}
ys, grads = [], []
for m in (moe, loop):
    xi = x.clone().requires_grad_()
    y = m(xi)
    y.float().pow(2).mean().backward()
    ys.append(y.float()); grads.append(m.experts.w1.grad.float())
out["max_abs_out_diff"] = (ys[0] - ys[1]).abs().max().item()
out["w1_grad_rel_diff"] = ((grads[0] - grads[1]).norm() / grads[1].norm()).item()
out["ok"] = out["max_abs_out_diff"] < 5e-2 and out["w1_grad_rel_diff"] < 2e-2
for name, m in (("grouped", moe), ("loop", loop)):
    for _ in range(3):
        m(x).float().mean().backward()
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(10):
        m(x).float().mean().backward()
    torch.cuda.synchronize()
    out[f"{name}_layer_fwd_bwd_ms"] = (time.perf_counter() - t) / 10 * 1e3
out["grouped_speedup"] = out["loop_layer_fwd_bwd_ms"] / out["grouped_layer_fwd_bwd_ms"]
print(json.dumps(out), flush=True)
# torch.compile (fullgraph) of the same layer, bf16 grouped GEMM inside
compiled = torch.compile(moe.forward, fullgraph=True)
y = compiled(x)
out2 = {"check": "moe_compile_fullgraph_cuda", "max_abs_diff_vs_eager": (y.float() - moe(x).float()).abs().max().item()}
print(json.dumps(out2), flush=True)
PYEOF
echo "step 1 exit $?" >> "$LOG"

COMMON=(--config train_configs/qwen3_30b_a3b.toml --job.world_size 1 --parallelism.expert_parallel_degree 1
  --model.n_layers 4 --model.vocab_size 151936 --model.tokenizer_path "" --training.dataset embedded
  --training.dataset_path "" --validation.enable false
  --training.local_batch_size 2 --training.seq_len 2048 --training.global_batch_size -1
  --training.mixed_precision_param bfloat16 --checkpoint.enable false --compile.enable false
  --activation_checkpoint.mode full --warmup 3 --steps 10)
for variant in grouped loop; do
  extra=()
  [ "$variant" = loop ] && extra=(--model.moe_grouped_mm false)
  timeout 120 "$PY" scripts/bench.py "${COMMON[@]}" "${extra[@]}" --json-out "$OUT/qwen3_moe_$variant.json" \
    >> "$LOG" 2>&1
  echo "qwen3_moe 30B-A3B x4 blocks $variant exit $?" >> "$LOG"
  [ -f "$OUT/qwen3_moe_$variant.json" ] && "$PY" -c "import json,sys; r=json.load(open(sys.argv[1])); \
print(json.dumps({'check': 'qwen3_moe_30b_a3b_4_blocks', 'variant': sys.argv[2], \
**{k: r[k] for k in ('params', 'flops_per_token', 'tokens_per_s_per_device', 'mfu', 'peak_memory_gib', 'step_time_s')}}))" \
    "$OUT/qwen3_moe_$variant.json" "$variant" >> "$OUT/moe.jsonl"
done

timeout 150 "$PY" scripts/bench.py --compare-moe --warmup 3 --steps 10 --training.mixed_precision_param bfloat16 \
  --json-out "$OUT/compare_moe.json" >> "$LOG" 2>&1
echo "compare-moe exit $?" >> "$LOG"

# last (it may be cut by the call's limit): the grouped variant compiled per block
timeout 200 "$PY" scripts/bench.py "${COMMON[@]}" --compile.enable true --warmup 5 \
  --json-out "$OUT/qwen3_moe_compiled.json" >> "$LOG" 2>&1
echo "qwen3_moe 30B-A3B x4 blocks compiled exit $?" >> "$LOG"

"""Plan a training run before paying for it: parameters, FLOPs, steps, wall time, cost, memory.

The model, parallelism, batch, seq_len, activation checkpointing, dtypes and float8 come from the same config and
overrides as ``python -m titanlite.train`` (the vocabulary is the flavor's unless ``model.vocab_size`` is set).
The memory model and its assumptions: docs/memory_model.md.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys

import torch

from titanlite.config import ConfigError
from titanlite.errors import UserError
from titanlite.models import get_model_spec, load_config, make_model_args
from titanlite.models.flops import ModelShape, param_count
from titanlite.models.registry import model_counts
from titanlite.parallel.pipeline import PipelinePlan
from titanlite.plan.planner import (
    CHINCHILLA_TOKENS_PER_PARAM,
    FRAGMENTATION,
    RESERVE_BYTES,
    RunSetup,
    estimate_run,
    usable_memory,
)
from titanlite.plan.planner_moe import all_to_all_seconds
from titanlite.plan.run_plan import plan_steps
from titanlite.trainer.metrics import format_duration
from titanlite.trainer.peaks import gpu_memory_bytes, matmul_dtype, peak_flops_for_name
from titanlite.utils.argtypes import OneLineParser, number


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p = OneLineParser(
        prog="titanlite estimate",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Any other argument (--config FILE, --model.flavor 1B, --training.seq_len 2048, "
        "...) is a titanlite config override.",
    )
    p.add_argument("--gpu", required=True, help="GPU model, e.g. H100, 'H100 PCIe', H200, A100, L40S, B200, MI300X")
    p.add_argument("--num-gpus", type=number(int, at_least=1), required=True, help="number of GPUs")
    mfu = number(above=0, at_most=1)
    p.add_argument("--mfu", type=mfu, default=0.4, help="assumed model FLOPs utilization, 0 < u <= 1 (default 0.4)")
    price = number(at_least=0)
    p.add_argument("--price-per-gpu-hour", type=price, default=None, help="price of one GPU-hour (any currency)")
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--tokens", type=number(above=0), help="training tokens, e.g. 20e9")
    target.add_argument(
        "--chinchilla",
        action="store_true",
        help=f"{CHINCHILLA_TOKENS_PER_PARAM} tokens per parameter (Hoffmann et al. 2022)",
    )
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    return p.parse_known_args(argv)


def build(args: argparse.Namespace, rest: list[str]):
    cfg = load_config(rest)
    spec = get_model_spec(cfg.model.name)
    model_args = make_model_args(cfg.model.name, cfg.model.flavor, **cfg.model.overrides)
    params, flops = model_counts(spec, model_args, cfg.training.seq_len)  # the family's own counts
    shape = ModelShape.from_args(model_args, num_params=params)
    par, t = cfg.parallelism, cfg.training
    stage_sizes = ()
    if par.pipeline_parallel_degree > 1:  # the trainer's own split (and its checks of the schedule)
        stage_sizes = PipelinePlan.from_config(par, model_args.n_layers, t.local_batch_size).stage_sizes
    setup = RunSetup.from_config(cfg, args.num_gpus, stage_sizes)
    if par.data_parallel_shard_degree not in (-1, setup.dp_shard):
        raise ConfigError(
            f"parallelism.data_parallel_shard_degree={par.data_parallel_shard_degree} does not fit "
            f"{args.num_gpus} GPUs with tp={setup.tp}, pp={setup.pp} and replicate={setup.dp_replicate} "
            f"(it would be {setup.dp_shard}; -1 derives it)"
        )
    dtype = matmul_dtype(t.mixed_precision_param, setup.float8, torch.device("cuda"))
    tokens = CHINCHILLA_TOKENS_PER_PARAM * param_count(shape) if args.chinchilla else args.tokens
    kw = dict(mfu=args.mfu, peak_flops=peak_flops_for_name(args.gpu, dtype), matmul_dtype=dtype)
    kw.update(gpu_memory=gpu_memory_bytes(args.gpu), price_per_gpu_hour=args.price_per_gpu_hour)
    return cfg, shape, setup, estimate_run(shape, setup, tokens=tokens, flops_per_token_=flops, **kw)


def stage_plans(args, cfg, shape: ModelShape, setup: RunSetup, plan) -> list[tuple]:
    """With ``[training] seq_len_schedule``: each stage's (stage, planner plan), planned at its own seq_len,
    micro-batch and share of the tokens (``plan.tokens``), with the family's FLOPs per token at that length."""
    t = cfg.training
    kw = dict(seq_len=t.seq_len, local_batch_size=t.local_batch_size, grad_accum_steps=setup.grad_accum)
    stages = plan_steps(steps=1, tokens=int(plan.tokens), dp_degree=setup.dp_degree, schedule=t.seq_len_schedule, **kw)
    args_ = make_model_args(cfg.model.name, cfg.model.flavor, **cfg.model.overrides)
    out = []
    for st in stages.stages:
        c = copy.deepcopy(cfg)
        c.training.seq_len, c.training.local_batch_size = st.seq_len, st.local_batch_size
        c.training.global_batch_size = st.local_batch_size * setup.dp_degree * st.grad_accum_steps
        s_setup = RunSetup.from_config(c, setup.num_gpus, setup.pp_stage_sizes)
        fpt = model_counts(get_model_spec(cfg.model.name), args_, st.seq_len)[1]
        kw = dict(mfu=plan.mfu, peak_flops=plan.peak_flops, matmul_dtype=plan.matmul_dtype, flops_per_token_=fpt)
        kw.update(gpu_memory=plan.gpu_memory, price_per_gpu_hour=args.price_per_gpu_hour)
        out.append((st, estimate_run(shape, s_setup, tokens=st.steps * st.tokens_per_step, **kw)))
    return out


def stages_report(stages: list[tuple]) -> str:
    """One line per stage, then the run: the stages' times added, the largest memory peak."""
    lines = ["stages     (training.seq_len_schedule; each planned at its own seq_len and micro-batch)"]
    for i, (st, p) in enumerate(stages):
        wall = "time unknown" if p.wall_s is None else format_duration(p.wall_s)
        lines.append(
            f"  {i + 1}. seq_len {st.seq_len}: {p.steps:,} steps x {st.tokens_per_step:,} tokens, "
            f"{p.flops_per_token:.4g} FLOPs/token, {wall}, memory peak {p.memory['total'] / 1e9:.2f} GB"
        )
    walls = [p.wall_s for _, p in stages]
    worst = max(p.memory["total"] for _, p in stages)
    total = "unknown" if None in walls else format_duration(sum(walls))
    fits = all(p.fits for _, p in stages) if all(p.fits is not None for _, p in stages) else None
    verdict = "" if fits is None else f"; {'FITS' if fits else 'DOES NOT FIT'} at every stage"
    lines.append(f"  run: {total} in all, largest memory peak {worst / 1e9:.2f} GB{verdict}")
    return "\n".join(lines)


def report(args, cfg, shape: ModelShape, setup: RunSetup, plan) -> str:
    gb = 1e9
    lines = [
        f"model      {cfg.model.name}/{cfg.model.flavor}: {plan.params:,} parameters ({plan.params / 1e9:.3f} B); "
        f"dim {shape.dim}, {shape.n_layers} layers, {shape.n_heads} heads ({shape.kv_heads} kv), "
        f"ffn {shape.ffn_hidden_dim}, "
        f"vocab {shape.vocab_size:,}{', tied embeddings' if shape.tie_word_embeddings else ''}",
        f"layout     {setup.num_gpus} x {args.gpu}: dp {setup.dp_degree} (shard {setup.dp_shard} x replicate "
        f"{setup.dp_replicate}{', FSDP' if setup.fsdp else ''}), tp {setup.tp}"
        f"{f', cp {setup.cp} (FSDP over dp_shard x cp, activations / cp)' if setup.cp > 1 else ''}"
        f"{f', ep {setup.ep} (experts over dp_shard)' if setup.ep > 1 else ''}"
        f"{f', pp {setup.pp} ({setup.pp_schedule}, {setup.n_microbatches} microbatches)' if setup.pp > 1 else ''}; "
        f"{setup.compute_dtype}"
        f"{' + float8' if setup.float8 else ''}; activation checkpointing {setup.ac_mode}"
        f"{' (' + setup.ac_option + ')' if setup.ac_mode == 'selective' else ''}",
        f"batch      {setup.global_batch} sequences x {setup.seq_len} tokens = {setup.tokens_per_step:,} tokens/step "
        f"(local {setup.local_batch_size} x dp {setup.dp_degree} x accumulation {setup.grad_accum})",
        f"FLOPs      {plan.flops_per_token:.4g} per token (6 N + attention"
        f"{', N = the active parameters' if plan.active_params != plan.params else ''}); "
        f"{plan.total_flops:.4g} in total",
        f"tokens     {plan.tokens:,.0f} in {plan.steps:,} optimizer steps"
        + (f" ({CHINCHILLA_TOKENS_PER_PARAM} tokens/parameter)" if args.chinchilla else ""),
    ]
    if plan.active_params != plan.params:
        lines.insert(
            1,
            f"active     {plan.active_params:,} parameters per token ({plan.active_params / 1e9:.3f} B: the routed top-"
            f"{shape.moe.top_k} of {shape.moe.num_experts} experts and shared ones in {shape.moe.n_moe} MoE blocks)",
        )
    if plan.all_to_all_bytes:
        seconds, link = all_to_all_seconds(plan.all_to_all_bytes, setup.ep)
        share = "" if plan.wall_s is None else f" = {seconds * plan.steps / plan.wall_s:.0%} of the estimated step time"
        lines.append(
            f"all2all    {plan.all_to_all_bytes / 1e9:.2f} GB sent per GPU per optimizer step (expert parallelism "
            f"{setup.ep}: each token's top-{shape.moe.top_k} copies to their experts and back, forward and backward); "
            f"{seconds:.2f} s at {link}{share} unless overlapped"
        )
    if plan.peak_flops is None:
        lines.append(
            f"time       unknown: no {plan.matmul_dtype} peak for GPU '{args.gpu}' in the table "
            "(titanlite.trainer.peaks.PEAK_TFLOPS)"
        )
    else:
        tps = setup.num_gpus * plan.peak_flops * plan.mfu * (1 - plan.bubble) / plan.flops_per_token
        bubble = f" and a {plan.bubble:.1%} pipeline bubble" if setup.pp > 1 else ""
        lines.append(
            f"time       {format_duration(plan.wall_s)} ({plan.wall_s / 3600:,.1f} h) at MFU "
            f"{plan.mfu:.0%} of {plan.peak_flops / 1e12:,.1f} TFLOP/s dense {plan.matmul_dtype} per GPU{bubble}: "
            f"{tps:,.0f} tokens/s, "
            f"{tps / setup.num_gpus:,.0f} per GPU, {plan.steps / plan.wall_s:.2f} steps/s"
        )
        if plan.cost is not None:
            lines.append(
                f"cost       {plan.cost:,.2f} ({plan.wall_s / 3600 * setup.num_gpus:,.1f} GPU-hours x "
                f"{args.price_per_gpu_hour:g})"
            )
    m = plan.memory
    lines.append("memory     per GPU (GB = 1e9 bytes):")
    labels = {"optimizer": "optimizer state", "optimizer_scratch": "optimizer step scratch"}
    for key in ("parameters", "gradients", "optimizer", "activations", "logits", "optimizer_scratch"):
        lines.append(f"             {labels.get(key, key):<24}{m[key] / gb:9.2f}")
    if setup.pp > 1:
        lines.append(f"             {'unsharded stage (PP)':<24}{m['pipeline_fsdp_buffers'] / gb:9.2f}")
    worst = f" (pp rank {m['pp_rank']}, the worst stage)" if setup.pp > 1 else ""
    lines.append(f"             {'total (modelled peak)':<24}{m['total'] / gb:9.2f}   at the {m['peak_at']}{worst}")
    if plan.gpu_memory is None:
        lines.append(f"verdict    unknown: memory of GPU '{args.gpu}' not in the table")
    else:
        usable = usable_memory(plan.gpu_memory)
        verdict = "FITS" if plan.fits else "DOES NOT FIT"
        lines.append(
            f"verdict    {verdict}: {m['total'] / gb:.1f} GB of {usable / gb:.1f} GB usable "
            f"({plan.gpu_memory / gb:.0f} GB minus {FRAGMENTATION:.0%} fragmentation and "
            f"{RESERVE_BYTES / gb:.0f} GB for CUDA context and communication buffers)"
        )
        if not plan.fits:
            lines.append(
                "           try: activation_checkpoint.mode = selective or full, a smaller "
                "training.local_batch_size (with global_batch_size kept by accumulation), more GPUs, "
                "or tensor parallelism"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args, rest = parse(sys.argv[1:] if argv is None else argv)
    try:
        cfg, shape, setup, plan = build(args, rest)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    if args.json:
        out = {k: v for k, v in vars(plan).items()}
        out["num_gpus"], out["gpu"] = setup.num_gpus, args.gpu
        print(json.dumps(out, indent=1, default=lambda v: None if isinstance(v, float) and math.isnan(v) else v))
    else:
        print(report(args, cfg, shape, setup, plan))
        if cfg.training.seq_len_schedule:
            try:
                print(stages_report(stage_plans(args, cfg, shape, setup, plan)))
            except UserError as e:
                print(f"error: {e}", file=sys.stderr)
                return e.exit_code
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

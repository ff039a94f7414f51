"""``bench train --compare-pp`` and ``--compare-moe``: two setups' ``bench train`` runs in fresh processes, one
after the other and alternating the order over ``--compare-repeats`` (a shared machine's speed drifts), and the
median tokens/s of each with their ratio (see :mod:`titanlite.bench.train` and :mod:`titanlite.bench.moe`)."""

from __future__ import annotations

import statistics
import sys
from collections.abc import Callable
from pathlib import Path

from titanlite.bench.common import REPO, alternating, run_bench_train
from titanlite.bench.moe import SPARSE, layer_bench
from titanlite.config import exit_with_error, parse_args_or_exit
from titanlite.errors import UserError
from titanlite.models import make_model_args, model_schema
from titanlite.parallel.parallel_dims import ParallelDims
from titanlite.parallel.pipeline import PipelinePlan
from titanlite.trainer.step import grad_accum_steps


def side_by_side(names: list[str], repeats: int, run: Callable[[str, int], dict]):
    """``run(name, repeat)`` for each name, alternating (:func:`~titanlite.bench.common.alternating`), each run's
    tokens/s on stderr; returns the results per name and the median tokens/s per name."""
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for i, name in alternating(names, repeats):
        runs[name].append(result := run(name, i))
        print(f"{name} run {i + 1}: {result['tokens_per_s_global']:,.0f} tokens/s", file=sys.stderr, flush=True)
    return runs, {name: statistics.median(r["tokens_per_s_global"] for r in rs) for name, rs in runs.items()}


# ---- --compare-pp: PP 2 against FSDP 2 (2 processes each) at the same global batch

COMPARE_LAYOUTS = {
    "pp2": ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1"],
    "fsdp2": ["--parallelism.data_parallel_shard_degree", "2", "--parallelism.pipeline_parallel_degree", "1"],
}


def compare_config(rest: list[str]) -> tuple[list[str], Path]:
    """The overrides both layouts share (the common global batch) and the dump folder they go under;
    exits 2 with one line when the config cannot run both layouts."""
    prog = "titanlite bench train --compare-pp"
    cfg = parse_args_or_exit(rest, prog=prog, model_schema=model_schema)
    p, t = cfg.parallelism, cfg.training
    chosen = {
        "pipeline_parallel_degree": (p.pipeline_parallel_degree, 1),
        "data_parallel_shard_degree": (p.data_parallel_shard_degree, -1),
        "data_parallel_replicate_degree": (p.data_parallel_replicate_degree, 1),
        "tensor_parallel_degree": (p.tensor_parallel_degree, 1),
    }
    for key, (value, default) in chosen.items():
        if value != default:
            exit_with_error(
                f"parallelism.{key}={value}: --compare-pp sets the layouts itself (pipeline degree 2, then FSDP "
                f"degree 2); leave the parallel degrees unset"
            )
    global_batch = t.global_batch_size if t.global_batch_size != -1 else 2 * t.local_batch_size
    try:
        grad_accum_steps(global_batch, t.local_batch_size, 2)
    except UserError as e:
        exit_with_error(f"{e} (--compare-pp runs FSDP over 2 data-parallel ranks)", e.exit_code)
    try:
        pp = parse_args_or_exit(rest + COMPARE_LAYOUTS["pp2"], prog=prog, model_schema=model_schema)
        ParallelDims.from_config(pp.parallelism, 2)
        model_args = make_model_args(cfg.model.name, cfg.model.flavor, **cfg.model.overrides)
        PipelinePlan.from_config(pp.parallelism, model_args.n_layers, t.local_batch_size)  # the split suits the model
    except UserError as e:
        exit_with_error(e)
    return ["--training.global_batch_size", str(global_batch)], Path(cfg.job.dump_folder)


def compare_pp(args, rest: list[str]) -> dict:
    """PP 2 and FSDP 2, FSDP first; each run's output in ``<job.dump_folder>/compare_<layout>_<repeat>.log`` and its
    JSON line next to it, its training folder ``<job.dump_folder>/compare_<layout>``."""
    shared, dump_folder = compare_config(rest)

    def run(name: str, i: int) -> dict:
        argv = ["--warmup", str(args.warmup), "--steps", str(args.steps), *(["--no-split"] if args.no_split else [])]
        argv += [*rest, *shared, *COMPARE_LAYOUTS[name], "--job.dump_folder", str(dump_folder / f"compare_{name}")]
        out, log = (dump_folder / f"compare_{name}_{i}.{ext}" for ext in ("json", "log"))
        return run_bench_train(argv, out, args.compare_timeout, f"--compare-pp: the {name} run", nproc=2, log=log)

    runs, median = side_by_side(["fsdp2", "pp2"], args.compare_repeats, run)
    last_pp = runs["pp2"][-1]
    return {
        "compare": "pp2_vs_fsdp2",
        "model": last_pp["model"],
        "device": last_pp["device"],
        "processes": 2,
        "global_batch_size": last_pp["global_batch_size"],
        "seq_len": last_pp["seq_len"],
        "repeats": args.compare_repeats,
        "tokens_per_s_global": median,
        "ratio_pp2_over_fsdp2": median["pp2"] / median["fsdp2"],
        "pipeline": last_pp["pipeline"],
        "runs": runs,
    }


# ---- --compare-moe: the debug MoE against the dense debug model of the same active size

DENSE = "train_configs/debug_model.toml"


def compare_moe(args, rest: list[str]) -> dict:
    """Dense and MoE debug models (runs under ``./outputs/bench_moe``), then the MoE layer split."""
    rest = ["--training.global_batch_size", "-1", *rest]  # the same batch for both (no accumulation unless asked)
    dump = Path("./outputs/bench_moe")

    def run(name: str, i: int) -> dict:
        config = {"dense": DENSE, "moe": SPARSE}[name]
        argv = ["--config", str(REPO / config), "--warmup", str(args.warmup), "--steps", str(args.steps), *rest]
        argv += ["--checkpoint.enable", "false", "--job.dump_folder", str(dump / f"{name}_{i}")]
        out, log = dump / f"{name}_{i}.json", dump / f"{name}_{i}.log"
        return run_bench_train(argv, out, args.compare_timeout, f"--compare-moe: {config}", log=log)

    runs, median = side_by_side(["dense", "moe"], args.compare_repeats, run)
    keys = ("params", "flops_per_token", "step_time_s", "time_split_frac", "mfu", "loss_first", "loss_last")
    return {
        "compare": "debug_moe_vs_dense",
        "device": runs["moe"][-1]["device"],
        "tokens_per_step": runs["moe"][-1]["tokens_per_step"],
        "tokens_per_s_global": median,
        "ratio_moe_over_dense": median["moe"] / median["dense"],
        "dense": {k: runs["dense"][-1].get(k) for k in keys},
        "moe": {k: runs["moe"][-1].get(k) for k in keys},
        "moe_layer": layer_bench(rest, args.steps),
        "runs": runs,
    }

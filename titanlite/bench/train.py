"""Training throughput benchmark: a config for N steps after warm-up, one JSON line of results.

    titanlite bench train --config train_configs/debug_model.toml [--warmup 3] [--steps 10] \
        [--json-out FILE] [--section.key value ...]
    titanlite bench train --checkpoint-modes disabled,async,async_with_pinned_mem [--steps 40] [config ...]
    torchrun --nproc-per-node 8 -m titanlite.bench.train --config ... --parallelism.data_parallel_shard_degree 8
    torchrun --nproc-per-node 2 -m titanlite.bench.train --config ... --parallelism.pipeline_parallel_degree 2
    titanlite bench train --compare-pp [--compare-repeats 2] --config ...   # PP 2 vs FSDP 2, side by side
    titanlite bench train --compare-moe [--compare-repeats 2] [overrides]  # debug MoE vs dense (bench moe)

Everything after the bench options is the usual config (file + ``--section.key`` overrides), so
any parallelism / float8 / compile / AC combination is benchmarked through the real Trainer. The
timed steps run the Trainer's own loop (``training.steps`` = warm-up + timed steps; validation is
turned off); warm-up steps (compilation, allocator growth) are excluded.

Reported (rank 0 prints; values are rank 0's, the data-parallel ranks do identical work):

- ``tokens_per_s_per_device`` (and global): tokens of the timed steps / their wall time;
- ``mfu``: ``tokens/s/device * FLOPs/token / peak``. The peak is that of the dtype the matmuls run
  in (bf16, float8 with float8 linears on CUDA, fp32/TF32) from the table in
  ``titanlite.trainer.metrics`` (H100 SXM / H200 bf16 989.5 dense TFLOP/s, A100 312, float8 twice bf16);
  an unknown GPU gets no guessed peak (``mfu`` null). On CPU the peak is this machine's measured
  matmul rate, reported as ``peak_tflops``/``peak_source``. With float8 ``mfu_vs_bf16_peak`` is
  also given (the usual way float8 runs are compared);
- ``peak_memory_gib``: CUDA peak allocated (per device), or peak RSS of the process on CPU;
- ``time_split_s`` per step: data wait, forward+backward (micro-batches), optimizer (clipping +
  update), checkpoint (saves, when ``[checkpoint]`` is on) and other (logging, the guard's
  device->host sync). Each region ends with a device synchronize on CUDA so that time lands where
  it is spent, which also stops the CPU from queueing the next region early: throughput with the
  split off (``--no-split``) can be slightly higher.
- ``optimizer`` (``--bandwidth``, default on): the optimizer step against its memory-bandwidth floor
  (:mod:`titanlite.optim.bandwidth`): ``update_bytes`` per step (params read + written, grads read, Adam's
  moments read + written: 28 bytes per fp32 parameter, this device's shards), the device's measured
  ``copy_bandwidth_gb_s`` (a large ``copy_`` after the timed steps), ``floor_s`` = bytes / bandwidth,
  ``optimizer_s`` (the split's optimizer region: norm, clip and update), ``floor_ratio`` and ``share`` of the
  step; ``update_ratio_cost``: seconds per log step of ``[metrics] log_update_ratio`` (its parameter copy and
  norms; measured on log steps only, in the split as ``update_ratio``);
- ``pipeline`` (with ``pipeline_parallel_degree > 1``; gathered from every rank): per stage, the
  measured bubble next to the planner's prediction (``PipelinePlan.bubble_fraction()``):
  ``bubble_measured`` is the fraction of the timed steps' wall time in which the stage's pp rank
  computed none of its stages (so optimizer, data and logging time count as idle), and
  ``bubble_measured_in_schedule`` the same fraction of the time spent inside the schedule's runs
  (the quantity the planner predicts; needs the time split; the last rank's schedule returns before
  the first rank's last backward ends, so its drain shows in ``bubble_measured`` only). Compute time
  comes from hooks (:class:`StageActivity`), not from a profiler: forward pre/post hooks on each
  stage module, and pre-hooks on the stage's autograd nodes closed by the engine's end-of-pass
  callback for the backward.

``--compare-pp`` runs the config twice under ``torchrun`` (2 processes each, one after the other,
alternating the order with ``--compare-repeats``): pipeline parallel degree 2 against FSDP degree 2
at the same global batch (``training.global_batch_size``, or 2 x ``local_batch_size`` when unset),
and prints tokens/s of both (the median over repeats) and their ratio, with every run's full result
and the last PP run's bubble figures. Each run's output is kept in
``<job.dump_folder>/compare_<layout>_<repeat>.log``. Ratios are only meaningful measured side by side
like this: a shared machine's speed drifts between runs.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist

from titanlite.config import exit_with_error, parse_args_or_exit
from titanlite.models import get_model_spec, model_schema
from titanlite.optim.bandwidth import measure_copy_bandwidth, optimizer_floor
from titanlite.parallel.distributed import main_then_exit, world_from_env
from titanlite.parallel.parallel_dims import ParallelDims
from titanlite.parallel.pipeline import PipelinePlan
from titanlite.train import setup_logging
from titanlite.trainer import Trainer
from titanlite.trainer.metrics import MetricsHook
from titanlite.trainer.peaks import memory_stats, peak_flops
from titanlite.trainer.step import TrainStep, grad_accum_steps


class StepTimer:
    """Accumulates named regions of the timed steps (after ``warmup`` steps)."""

    def __init__(self, device: torch.device, warmup: int, split: bool = True):
        self.device, self.warmup, self.split = device, warmup, split
        self.step = 0
        self.totals: dict[str, float] = defaultdict(float)
        self.start = None  # wall clock at the start of the first timed step

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @property
    def timing(self) -> bool:
        return self.step > self.warmup

    def begin_step(self) -> None:
        self.step += 1
        if self.step == self.warmup + 1:
            self._sync()
            if self.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(self.device)
            self.start = time.perf_counter()

    @contextlib.contextmanager
    def region(self, name: str):
        if not (self.timing and self.split):
            yield
            return
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            self.totals[name] += time.perf_counter() - t0

    def add(self, name: str, seconds: float) -> None:
        if self.timing:
            self.totals[name] += seconds

    def elapsed(self) -> float:
        self._sync()
        return time.perf_counter() - self.start


class TimedTrainStep(TrainStep):
    """The train step with its regions timed (``timer`` set after construction)."""

    timer: StepTimer
    losses: list[float]

    def __call__(self, batches, before_update=None, step=None):
        self.timer.begin_step()
        result = super().__call__(batches, before_update, step)
        self.timer.add("data", result.data_s)
        self.losses.append(result.loss_value)  # fetched by the guard's check already: no extra sync
        return result

    def forward_backward(self, batch, tokens):
        with self.timer.region("forward_backward"):
            return super().forward_backward(batch, tokens)

    def reduce_step(self, loss_sum):
        with self.timer.region("optimizer"):  # the gradient norm (with the loss and the stop flag: one collective)
            return super().reduce_step(loss_sum)

    def update(self, lr_scale=1.0, grad_norm=None):
        with self.timer.region("optimizer"):
            return super().update(lr_scale, grad_norm)


def busy_seconds(intervals: list[tuple[float, float]], start: float, end: float) -> float:
    """Length of the union of ``(begin, end)`` intervals, clipped to ``[start, end]`` (overlaps counted once)."""
    total, reach = 0.0, start
    for a, b in sorted(intervals):
        a, b = max(a, reach), min(b, end)
        if b > a:
            total, reach = total + b - a, b
    return total


def _tensors(output) -> list[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return [output]
    values = output.values() if isinstance(output, dict) else output if isinstance(output, (tuple, list)) else ()
    return [t for v in values for t in _tensors(v)]


class StageActivity:
    """When this rank's pipeline stages compute: ``(stage, kind, begin, end)`` intervals of ``time.perf_counter``.

    The stage modules are all a rank computes in a pipeline step, so the rest of the step is its bubble.
    Hooks rather than ``torch.profiler``: they cost a graph walk per forward and a Python call per
    autograd node, where profiling every op would slow the CPU steps it measures more. The walks are
    recorded too (``hooks``): counted as busy, so the bench's own overhead does not inflate the bubble.

    - ``forward``: a forward pre-hook and a forward hook on each stage module;
    - ``loss`` (last stage): the schedule's loss function, wrapped (:meth:`wrap_loss`);
    - ``backward``: after each forward, a pre-hook on every autograd node of the stage's graph (the walk
      stops at the stage's inputs, which the schedule detaches); the first node of a backward pass to run
      opens the interval and the autograd engine's end-of-pass callback closes it. Node hooks rather than
      gradient hooks on the outputs because the zero-bubble schedules' weight-gradient passes start
      inside the graph (one pass per parameter group), where no output hook would see them start.

    On CUDA every boundary synchronizes the device so that intervals are the kernels' time (at some
    cost to overlap); on CPU autograd runs in the calling thread and nothing is synchronized.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.intervals: list[tuple[int, str, float, float]] = []
        self._forward_begin: dict[int, float] = {}
        self._backward: tuple[int, float] | None = None  # (stage, begin) of the backward pass in progress

    def attach(self, stage: int, module: torch.nn.Module) -> None:
        """Record ``module``'s forward and backward passes as stage ``stage``."""
        module.register_forward_pre_hook(functools.partial(self._forward_pre, stage))
        module.register_forward_hook(functools.partial(self._forward_post, stage))

    def wrap_loss(self, loss_fn, stage: int):
        """``loss_fn`` recorded as stage ``stage``'s work (its forward, and the start of the backward)."""

        def timed_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            begin = self._now()
            loss = loss_fn(logits, labels)
            self._add(stage, "loss", begin)
            if loss.grad_fn is not None:  # the loss's backward is the first of the stage's pass
                loss.grad_fn.register_prehook(functools.partial(self._backward_node, stage))
            return loss

        return timed_loss

    def busy(self, start: float, end: float, stage: int | None = None, kinds: tuple[str, ...] = ()) -> float:
        """Seconds within ``[start, end]`` in which the stage (any stage without ``stage``) computed."""
        spans = [(a, b) for s, k, a, b in self.intervals if stage in (None, s) and (not kinds or k in kinds)]
        return busy_seconds(spans, start, end)

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _add(self, stage: int, kind: str, begin: float) -> None:
        self.intervals.append((stage, kind, begin, self._now()))

    def _forward_pre(self, stage: int, module, args) -> None:
        self._forward_begin[stage] = self._now()

    def _forward_post(self, stage: int, module, args, output) -> None:
        self._add(stage, "forward", self._forward_begin.pop(stage))
        self._watch_graph(stage, output)

    def _watch_graph(self, stage: int, output) -> None:
        """A pre-hook on every autograd node behind ``output`` (none without autograd, e.g. in evaluation)."""
        begin, hook = self._now(), functools.partial(self._backward_node, stage)
        todo = [t.grad_fn for t in _tensors(output) if t.grad_fn is not None]
        seen = set(todo)
        while todo:
            node = todo.pop()
            node.register_prehook(hook)
            for child, _ in node.next_functions:
                if child is not None and child not in seen:
                    seen.add(child)
                    todo.append(child)
        self._add(stage, "hooks", begin)

    def _backward_node(self, stage: int, grad_outputs) -> None:
        """A node of the stage's graph is about to run: the first of a backward pass opens its interval."""
        if self._backward is None:
            self._backward = (stage, self._now())
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)

    def _backward_done(self) -> None:
        stage, begin = self._backward
        self._backward = None
        self._add(stage, "backward", begin)


class BenchTrainer(Trainer):
    """The Trainer with its step regions timed (and, pipelined, its stages' compute recorded)."""

    def __init__(self, cfg, timer_args):
        self.timer_args = timer_args
        self.stage_activity: StageActivity | None = None
        self.update_ratio_calls = 0  # timed steps that measured the update ratio (log steps)
        super().__init__(cfg)
        save = self.checkpointer.save

        def timed_save(step, **kw):
            with self.train_step.timer.region("checkpoint"):
                return save(step, **kw)

        self.checkpointer.save = timed_save
        metrics = next(h for h in self.hooks if isinstance(h, MetricsHook))
        if (ratio := metrics.update_ratio) is not None:  # [metrics] log_update_ratio, on log steps only
            for name in ("before_step", "after_step"):
                setattr(ratio, name, self.timed_update_ratio(getattr(ratio, name), count=name == "after_step"))

    def timed_update_ratio(self, fn, count: bool):
        timer = self.train_step.timer

        def timed_fn(*args, **kwargs):
            self.update_ratio_calls += count and timer.timing
            with timer.region("update_ratio"):
                return fn(*args, **kwargs)

        return timed_fn

    def build_train_step(self) -> TimedTrainStep:
        step = super().build_train_step()
        step.__class__ = TimedTrainStep  # the same object, with the timed methods
        step.timer, step.losses = StepTimer(self.device, *self.timer_args), []
        if step.pipeline is not None:
            self.stage_activity = activity = StageActivity(self.device)
            for stage, module in zip(self.model.stage_ids, self.model.stages):
                activity.attach(stage, module)
            if (last := self.pipeline_plan.num_stages - 1) in self.model.stage_ids:
                step.pipeline.loss_fn = activity.wrap_loss(step.pipeline.loss_fn, last)
        return step


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(prog="titanlite bench train", description=__doc__.split("\n")[0], add_help=True)
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation, allocator)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps")
    parser.add_argument("--json-out", default="", help="also write the JSON result to this file")
    parser.add_argument("--no-split", action="store_true", help="no per-region syncs / time split")
    parser.add_argument(
        "--bandwidth",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="measure the copy bandwidth and report the optimizer step against its floor (default on)",
    )
    parser.add_argument(
        "--checkpoint-modes",
        default="",
        help=(
            "instead: how long a save blocks the loop, per [checkpoint] async_mode (comma-separated, e.g. "
            "disabled,async,async_with_pinned_mem; see titanlite.bench.checkpoint)"
        ),
    )
    parser.add_argument(
        "--compare-pp",
        action="store_true",
        help="instead: pipeline parallel degree 2 vs FSDP degree 2 (2 processes each) at the same global batch",
    )
    parser.add_argument(
        "--compare-moe",
        action="store_true",
        help="instead: debug MoE vs the dense debug model of the same active size, and the MoE layer's time split",
    )
    parser.add_argument("--compare-repeats", type=int, default=1, help="runs of each layout, alternating order")
    parser.add_argument("--compare-timeout", type=float, default=900.0, help="seconds allowed per torchrun run")
    args, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    if args.checkpoint_modes and args.compare_pp:
        parser.error("--checkpoint-modes and --compare-pp are separate benchmarks: give one")
    if args.checkpoint_modes:  # a separate benchmark, kept in its own script
        from titanlite.bench.checkpoint import run as bench_checkpoint

        return bench_checkpoint(
            rest,
            args.checkpoint_modes.split(","),
            steps=max(args.steps, 20),
            interval=max(args.steps, 20) // 4,
            json_out=args.json_out or None,
        )
    if args.warmup < 0 or args.steps < 1:
        parser.error("--warmup must be >= 0 and --steps >= 1")
    if args.compare_moe:  # a separate benchmark, kept in its own script
        from titanlite.bench.moe import compare_moe

        return emit(compare_moe(args, rest), args.json_out)
    if args.compare_pp:
        if args.compare_repeats < 1 or args.compare_timeout <= 0:
            parser.error("--compare-repeats must be >= 1 and --compare-timeout > 0")
        return emit(compare_pp(args, rest), args.json_out)
    total = args.warmup + args.steps
    base = parse_args_or_exit(
        rest, prog="titanlite bench train", model_schema=model_schema
    )  # the config as given, to read its LR warmup
    rest += [
        "--training.steps",
        str(total),
        "--validation.enable",
        "false",
        "--lr_scheduler.warmup_steps",
        str(min(base.lr_scheduler.warmup_steps, total)),
    ]
    cfg = parse_args_or_exit(rest, prog="titanlite bench train", model_schema=model_schema)
    world = world_from_env()
    setup_logging(world.rank)
    try:
        trainer = BenchTrainer(cfg, (args.warmup, not args.no_split))
    except (ValueError, KeyError, FileNotFoundError) as e:
        exit_with_error(e, every_rank=True)
    trainer.train()
    elapsed = trainer.train_step.timer.elapsed()
    result = summarize(trainer, cfg, args, elapsed)  # every rank: the pipeline figures are gathered
    return emit(result, args.json_out) if world.is_main else result


def emit(result: dict, json_out: str) -> dict:
    """Print ``result`` as one JSON line (and write it to ``json_out`` when given)."""
    line = json.dumps(result)
    print(line, flush=True)
    if json_out:
        Path(json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(json_out).write_text(line + "\n")
    return result


def summarize(trainer: BenchTrainer, cfg, args, elapsed: float) -> dict:
    device, dims = trainer.device, trainer.parallel_dims
    steps = args.steps
    tokens_per_step = trainer.global_batch * cfg.training.seq_len
    tps = tokens_per_step / trainer.world.world_size * steps / elapsed
    metrics = next(h for h in trainer.hooks if isinstance(h, MetricsHook))
    peak = metrics.peak_flops
    float8 = cfg.quantize_linear_float8.enable
    result = {
        "model": f"{cfg.model.name}/{cfg.model.flavor}",
        "params": trainer.n_params,
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else f"cpu ({torch.get_num_threads()} threads)",
        "world_size": trainer.world.world_size,
        "parallelism": {"pp": dims.pp, "dp_replicate": dims.dp_replicate, "dp_shard": dims.dp_shard, "tp": dims.tp},
        "mixed_precision_param": cfg.training.mixed_precision_param,
        "float8": float8,
        "compile": cfg.compile.enable,
        "activation_checkpoint": cfg.activation_checkpoint.mode,
        "seq_len": cfg.training.seq_len,
        "local_batch_size": cfg.training.local_batch_size,
        "global_batch_size": trainer.global_batch,
        "tokens_per_step": tokens_per_step,
        "warmup_steps": args.warmup,
        "timed_steps": steps,
        "step_time_s": elapsed / steps,
        "tokens_per_s_per_device": tps,
        "tokens_per_s_global": tps * trainer.world.world_size,
        "flops_per_token": trainer.flops_per_token,
        "matmul_dtype": metrics.matmul_dtype,
        "peak_tflops": None if peak is None else peak / 1e12,
        "peak_source": "measured matmul rate of this CPU"
        if device.type == "cpu"
        else ("datasheet dense peak" if peak is not None else "unknown GPU: no peak, no MFU"),
        "mfu": None if peak is None else tps * trainer.flops_per_token / peak,
    }
    if float8 and device.type == "cuda":
        bf16 = peak_flops(device, "bfloat16")
        result["mfu_vs_bf16_peak"] = None if bf16 is None else tps * trainer.flops_per_token / bf16
    mem = memory_stats(device)
    result["peak_memory_gib"] = mem.get("mem_peak_gib", mem.get("mem_peak_rss_gib"))
    if not args.no_split:
        split = {k: v / steps for k, v in trainer.train_step.timer.totals.items()}
        for key in ("data", "forward_backward", "optimizer", "checkpoint"):
            split.setdefault(key, 0.0)
        split["other"] = max(0.0, elapsed / steps - sum(split.values()))
        result["time_split_s"] = split
        result["time_split_frac"] = {k: v / (elapsed / steps) for k, v in split.items()}
        if trainer.update_ratio_calls:  # its cost on the log steps that measure it
            per_call = trainer.train_step.timer.totals["update_ratio"] / trainer.update_ratio_calls
            result["update_ratio_cost"] = {"log_steps": trainer.update_ratio_calls, "s_per_log_step": per_call}
    if args.bandwidth:  # the optimizer against its memory-bandwidth floor (measured copy rate of this device)
        optimizer_s = result.get("time_split_s", {}).get("optimizer")
        bandwidth = measure_copy_bandwidth(device)
        result["optimizer"] = optimizer_floor(trainer.optimizer, optimizer_s, bandwidth, elapsed / steps)
    losses = trainer.train_step.losses
    result["loss_first"], result["loss_last"] = (losses[0], losses[-1]) if losses else (None, None)
    if trainer.pipeline_plan is not None:
        result["pipeline"] = pipeline_report(trainer, elapsed, steps, result["peak_memory_gib"])
    return result


def stage_record(trainer: BenchTrainer, elapsed: float, steps: int, peak_memory_gib) -> dict:
    """This rank's compute over the timed steps, per step (seconds): what :func:`pipeline_report` gathers."""
    timer, activity = trainer.train_step.timer, trainer.stage_activity
    start, end = timer.start, timer.start + elapsed
    schedule = timer.totals["forward_backward"] if timer.split else None
    stages = {
        s: {
            "forward_s_per_step": activity.busy(start, end, s, ("forward", "loss")) / steps,
            "backward_s_per_step": activity.busy(start, end, s, ("backward",)) / steps,
            "hooks_s_per_step": activity.busy(start, end, s, ("hooks",)) / steps,
        }
        for s in trainer.model.stage_ids
    }
    return {
        "pp_rank": trainer.parallel_dims.pp_rank,
        "busy_s": activity.busy(start, end),
        "wall_s": elapsed,
        "schedule_s": schedule,
        "peak_memory_gib": peak_memory_gib,
        "stages": stages,
    }


def gather(obj) -> list:
    """``obj`` from every rank (a list of one without a process group)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _mean(values: list) -> float | None:
    return None if any(v is None for v in values) else statistics.fmean(values)


def pipeline_report(trainer: BenchTrainer, elapsed: float, steps: int, peak_memory_gib) -> dict:
    """The plan, and per stage the measured bubble next to the predicted one (see the module docstring).
    Ranks that hold the same stages (data / tensor parallel replicas) are averaged."""
    plan: PipelinePlan = trainer.pipeline_plan
    records = gather(stage_record(trainer, elapsed, steps, peak_memory_gib))
    predicted = plan.bubble_fraction()
    stages, per_rank = [], []
    for r in range(plan.degree):
        mine = [rec for rec in records if rec["pp_rank"] == r]
        busy, wall = _mean([m["busy_s"] for m in mine]), _mean([m["wall_s"] for m in mine])
        schedule = _mean([m["schedule_s"] for m in mine])
        rank = {
            "pp_rank": r,
            "bubble_measured": max(0.0, 1 - busy / wall),
            "bubble_measured_in_schedule": None if not schedule else max(0.0, 1 - busy / schedule),
            "wall_s_per_step": wall / steps,  # the window the bubble is a fraction of
            "peak_memory_gib": _mean([m["peak_memory_gib"] for m in mine]),
        }
        per_rank.append(rank)
        for s in plan.stage_ids(r):
            times = {k: _mean([m["stages"][s][k] for m in mine]) for k in mine[0]["stages"][s]}
            stages.append({"stage": s, "layers": plan.stage_sizes[s], **rank, **times, "bubble_predicted": predicted})
    stages.sort(key=lambda st: st["stage"])
    in_schedule = [r["bubble_measured_in_schedule"] for r in per_rank]
    return {
        "schedule": plan.schedule,
        "degree": plan.degree,
        "num_stages": plan.num_stages,
        "stages_per_rank": plan.stages_per_rank,
        "n_microbatches": plan.n_microbatches,
        "stage_sizes": list(plan.stage_sizes),
        "bubble_predicted": predicted,
        "bubble_measured_mean": statistics.fmean(r["bubble_measured"] for r in per_rank),
        "bubble_measured_in_schedule_mean": _mean(in_schedule),
        "stages": stages,
    }


# ---- --compare-pp: PP 2 against FSDP 2, side by side ----

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
    except ValueError as e:
        exit_with_error(f"{e} (--compare-pp runs FSDP over 2 data-parallel ranks)")
    try:
        pp = parse_args_or_exit(rest + COMPARE_LAYOUTS["pp2"], prog=prog, model_schema=model_schema)
        ParallelDims.from_config(pp.parallelism, 2)
        if (n_layers := config_layers(cfg)) is not None:  # the split and schedule suit the model
            PipelinePlan.from_config(pp.parallelism, n_layers, t.local_batch_size)
    except (ValueError, KeyError) as e:
        exit_with_error(e)
    return ["--training.global_batch_size", str(global_batch)], Path(cfg.job.dump_folder)


def config_layers(cfg) -> int | None:
    """``n_layers`` of the configured flavor (with ``[model]`` overrides), before any model is built."""
    flavor = get_model_spec(cfg.model.name).flavors.get(cfg.model.flavor)
    return cfg.model.overrides.get("n_layers", getattr(flavor, "n_layers", None))


def run_layout(name: str, run: int, args, rest: list[str], dump_folder: Path) -> dict:
    """One ``torchrun --nproc-per-node 2`` bench run of layout ``name``: its result. Its output goes to
    ``<dump_folder>/compare_<name>_<run>.log`` and its JSON line next to it, the training run's folder is
    ``<dump_folder>/compare_<name>``."""
    log, out = (dump_folder / f"compare_{name}_{run}.{ext}" for ext in ("log", "json"))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "titanlite.bench.train",
    ]
    cmd += ["--warmup", str(args.warmup), "--steps", str(args.steps), "--json-out", str(out)]
    cmd += ["--no-split"] if args.no_split else []
    cmd += [*rest, *COMPARE_LAYOUTS[name], "--job.dump_folder", str(dump_folder / f"compare_{name}")]
    threads = max(1, len(os.sched_getaffinity(0)) // 2 if hasattr(os, "sched_getaffinity") else 1)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))  # the two processes share the cores
    dump_folder.mkdir(parents=True, exist_ok=True)
    out.unlink(missing_ok=True)
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            code = proc.wait(timeout=args.compare_timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # torchrun and its workers lead no other session
            proc.wait()
            exit_with_error(f"--compare-pp: the {name} run took more than {args.compare_timeout:g} s; log: {log}", 1)
    if code != 0 or not out.exists():
        exit_with_error(f"--compare-pp: the {name} run failed (torchrun exit status {code}); log: {log}", 1)
    result = json.loads(out.read_text())
    print(f"{name} run {run + 1}: {result['tokens_per_s_global']:,.0f} tokens/s ({log})", file=sys.stderr, flush=True)
    return result


def compare_pp(args, rest: list[str]) -> dict:
    """PP 2 and FSDP 2 one after the other (alternating the order over repeats); median tokens/s and their ratio."""
    shared, dump_folder = compare_config(rest)
    runs: dict[str, list[dict]] = {name: [] for name in COMPARE_LAYOUTS}
    order = list(COMPARE_LAYOUTS)[::-1]  # FSDP first, then PP; reversed on every other repeat
    for i in range(args.compare_repeats):
        for name in order if i % 2 == 0 else order[::-1]:
            runs[name].append(run_layout(name, i, args, rest + shared, dump_folder))
    median = {name: statistics.median(r["tokens_per_s_global"] for r in rs) for name, rs in runs.items()}
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


if __name__ == "__main__":
    main_then_exit(main)  # under torchrun: no interpreter finalization once the result is written (see there)

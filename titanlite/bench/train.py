"""Training throughput benchmark: a config for N steps after warm-up, one JSON line of results.

Everything after the bench options is the usual config (file + ``--section.key`` overrides, ``torchrun`` for
several processes), so any parallelism / float8 / compile / AC combination runs through the real Trainer
(``training.steps`` = warm-up + timed steps; validation off); rank 0 prints the fields of docs/benchmarks.md. Each
region of ``time_split_s`` ends with a device synchronize on CUDA, so time lands where it is spent (``--no-split``
may be slightly faster). ``--compare-pp`` (PP 2 vs FSDP 2), ``--compare-moe`` and ``--checkpoint-modes`` run side
by side in fresh processes (:mod:`titanlite.bench.compare`).
"""

from __future__ import annotations

import argparse
import sys

from titanlite.bench.bubble import StageActivity, pipeline_report
from titanlite.bench.common import StepTimer, device_name, emit, peak_memory_gib
from titanlite.bench.step_floors import measure_gemm_rate, step_floors
from titanlite.config import exit_with_error, parse_args_or_exit
from titanlite.errors import UserError
from titanlite.models import model_schema
from titanlite.models.flops import ModelShape
from titanlite.optim.bandwidth import measure_copy_bandwidth, optimizer_floor
from titanlite.parallel.distributed import main_then_exit, world_from_env
from titanlite.train import setup_logging
from titanlite.trainer import Trainer
from titanlite.trainer.metrics import MetricsHook
from titanlite.trainer.peaks import peak_flops
from titanlite.trainer.step import TrainStep


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

    def build_train_step(self, model, *args, **options) -> TimedTrainStep:
        step = super().build_train_step(model, *args, **options)
        step.__class__ = TimedTrainStep  # the same object, with the timed methods
        step.timer, step.losses = StepTimer(self.device, *self.timer_args), []
        if step.pipeline is not None:
            self.stage_activity = activity = StageActivity(self.device)
            for stage, module in zip(model.stage_ids, model.stages):
                activity.attach(stage, module)
            if (last := self.pipeline_plan.num_stages - 1) in model.stage_ids:
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
        help="measure the copy bandwidth and the GEMM rate: the optimizer and each part of the step against its floor",
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
    if args.compare_moe or args.compare_pp:  # runs of this benchmark side by side, in fresh processes
        if args.compare_repeats < 1 or args.compare_timeout <= 0:
            parser.error("--compare-repeats must be >= 1 and --compare-timeout > 0")
        from titanlite.bench.compare import compare_moe, compare_pp

        return emit((compare_moe if args.compare_moe else compare_pp)(args, rest), args.json_out)
    total = args.warmup + args.steps
    base = parse_args_or_exit(rest, prog="titanlite bench train", model_schema=model_schema)  # for its LR warmup
    warmup_steps = min(base.lr_scheduler.warmup_steps, total)
    rest += ["--training.steps", str(total), "--validation.enable", "false"]
    rest += ["--lr_scheduler.warmup_steps", str(warmup_steps)]
    cfg = parse_args_or_exit(rest, prog="titanlite bench train", model_schema=model_schema)
    world = world_from_env()
    setup_logging(world.rank)
    try:
        trainer = BenchTrainer(cfg, (args.warmup, not args.no_split))
    except UserError as e:
        exit_with_error(e, every_rank=True)
    trainer.train()
    elapsed = trainer.train_step.timer.elapsed()
    result = summarize(trainer, cfg, args, elapsed)  # every rank: the pipeline figures are gathered
    return emit(result, args.json_out) if world.is_main else result


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
        "device": device_name(device),
        "world_size": trainer.world.world_size,
        "parallelism": {"pp": dims.pp, "dp_replicate": dims.dp_replicate, "dp_shard": dims.dp_shard, "tp": dims.tp},
        "mixed_precision_param": cfg.training.mixed_precision_param,
        "float8": float8,
        "compile": cfg.compile.enable,
        "compile_mode": cfg.compile.mode,
        "sdpa_kernel": cfg.training.sdpa_kernel,
        "profiled": cfg.profiling.enable_profiling,
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
    result["peak_memory_gib"] = peak_memory_gib(device)
    if not args.no_split:
        keys = ("data", "forward_backward", "optimizer", "checkpoint")
        result.update(trainer.train_step.timer.split_report(steps, elapsed / steps, keys))
        if trainer.update_ratio_calls:  # its cost on the log steps that measure it
            per_call = trainer.train_step.timer.totals["update_ratio"] / trainer.update_ratio_calls
            result["update_ratio_cost"] = {"log_steps": trainer.update_ratio_calls, "s_per_log_step": per_call}
    if args.bandwidth:  # the optimizer against its memory-bandwidth floor (measured copy rate of this device)
        optimizer_s = result.get("time_split_s", {}).get("optimizer")
        bandwidth = measure_copy_bandwidth(device)
        result["optimizer"] = optimizer_floor(trainer.optimizer, optimizer_s, bandwidth, elapsed / steps)
        result["floors"] = floors(trainer, cfg, metrics.matmul_dtype, bandwidth, result["optimizer"]["update_bytes"])
    losses = trainer.train_step.losses
    result["loss_first"], result["loss_last"] = (losses[0], losses[-1]) if losses else (None, None)
    if trainer.pipeline_plan is not None:
        result["pipeline"] = pipeline_report(trainer, elapsed, steps, result["peak_memory_gib"])
    return result


LLAMA_SHAPE = ("dim", "n_layers", "n_heads", "ffn_hidden_dim", "vocab_size", "tie_word_embeddings")


def floors(trainer: BenchTrainer, cfg, matmul_dtype: str, bandwidth: float, update_bytes: float) -> dict | None:
    """The measured GEMM rates (the compute dtype's; float8's too with float8 linears) and each part's floor per step
    on one device (:mod:`titanlite.bench.step_floors`; ``titanlite bench trace-summary --floors`` sets a profile
    beside them); None for a family whose model args are not a Llama-style decoder's (:data:`LLAMA_SHAPE`)."""
    if not all(hasattr(trainer.model_args, name) for name in LLAMA_SHAPE):
        return None
    compute = {"tfloat32": "float32", "float8": cfg.training.mixed_precision_param}.get(matmul_dtype, matmul_dtype)
    gemm = measure_gemm_rate(trainer.device, compute)
    float8 = measure_gemm_rate(trainer.device, "float8") if matmul_dtype == "float8" else None
    tokens = trainer.global_batch * cfg.training.seq_len // trainer.world.world_size
    per_step = step_floors(
        ModelShape.from_args(trainer.model_args), tokens, cfg.training.seq_len, gemm_flops_per_s=gemm,
        bytes_per_s=bandwidth, update_bytes=update_bytes, float8_flops_per_s=float8,
        act_bytes=2 if cfg.training.mixed_precision_param == "bfloat16" else 4,
        recompute_forward=cfg.activation_checkpoint.mode == "full",
    )  # fmt: skip
    rates = {"gemm_tflops": gemm / 1e12, "gemm_dtype": compute, "float8_gemm_tflops": float8 and float8 / 1e12}
    return {**rates, "tokens_per_device": tokens, "step_s": per_step}


if __name__ == "__main__":
    main_then_exit(main)  # under torchrun: no interpreter finalization once the result is written (see there)

"""Training throughput benchmark: a config for N steps after warm-up, one JSON line of results.

    python scripts/bench.py --config train_configs/debug_model.toml [--warmup 3] [--steps 10] \
        [--json-out FILE] [--section.key value ...]
    python scripts/bench.py --checkpoint-modes disabled,async,async_with_pinned_mem [--steps 40] [config ...]
    torchrun --nproc-per-node 8 scripts/bench.py --config ... --parallelism.data_parallel_shard_degree 8

Everything after the bench options is the usual config (file + ``--section.key`` overrides), so
any parallelism / float8 / compile / AC combination is benchmarked through the real Trainer. The
timed steps run the Trainer's own loop (``training.steps`` = warm-up + timed steps; validation is
turned off); warm-up steps (compilation, allocator growth) are excluded.

Reported (rank 0 prints; values are rank 0's, the ranks do identical work):

- ``tokens_per_s_per_device`` (and global): tokens of the timed steps / their wall time;
- ``mfu``: ``tokens/s/device * FLOPs/token / peak``. The peak is that of the dtype the matmuls run
  in (bf16, float8 with float8 linears on CUDA, fp32/TF32) from the table in
  ``titanlite.metrics`` (H100 SXM / H200 bf16 989.5 dense TFLOP/s, A100 312, float8 twice bf16);
  an unknown GPU gets no guessed peak (``mfu`` null). On CPU the peak is this machine's measured
  matmul rate, reported as ``peak_tflops``/``peak_source``. With float8 ``mfu_vs_bf16_peak`` is
  also given (the usual way float8 runs are compared);
- ``peak_memory_gib``: CUDA peak allocated (per device), or peak RSS of the process on CPU;
- ``time_split_s`` per step: data wait, forward+backward (micro-batches), optimizer (clipping +
  update), checkpoint (saves, when ``[checkpoint]`` is on) and other (logging, the guard's
  device->host sync). Each region ends with a device synchronize on CUDA so that time lands where
  it is spent, which also stops the CPU from queueing the next region early: throughput with the
  split off (``--no-split``) can be slightly higher.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from titanlite.config import exit_with_error, parse_args_or_exit  # noqa: E402
from titanlite.metrics import MetricsHook, memory_stats, peak_flops  # noqa: E402
from titanlite.models import model_schema  # noqa: E402
from titanlite.parallel.distributed import world_from_env  # noqa: E402
from titanlite.train import Trainer, setup_logging  # noqa: E402
from titanlite.train_step import TrainStep  # noqa: E402


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

    def clip_grad_norm(self):
        with self.timer.region("optimizer"):
            return super().clip_grad_norm()

    def update(self, lr_scale=1.0):
        with self.timer.region("optimizer"):
            return super().update(lr_scale)


class BenchTrainer(Trainer):
    """The Trainer with its step regions timed."""

    def __init__(self, cfg, timer_args):
        self.timer_args = timer_args
        super().__init__(cfg)
        save = self.checkpointer.save

        def timed_save(step, **kw):
            with self.train_step.timer.region("checkpoint"):
                return save(step, **kw)

        self.checkpointer.save = timed_save

    def build_train_step(self) -> TimedTrainStep:
        step = super().build_train_step()
        step.__class__ = TimedTrainStep  # the same object, with the timed methods
        step.timer, step.losses = StepTimer(self.device, *self.timer_args), []
        return step


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], add_help=True)
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation, allocator)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps")
    parser.add_argument("--json-out", default="", help="also write the JSON result to this file")
    parser.add_argument("--no-split", action="store_true", help="no per-region syncs / time split")
    parser.add_argument(
        "--checkpoint-modes",
        default="",
        help=(
            "instead: how long a save blocks the loop, per [checkpoint] async_mode (comma-separated, e.g. "
            "disabled,async,async_with_pinned_mem; see scripts/bench_checkpoint.py)"
        ),
    )
    args, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    if args.checkpoint_modes:  # a separate benchmark, kept in its own script
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from bench_checkpoint import run as bench_checkpoint

        return bench_checkpoint(
            rest,
            args.checkpoint_modes.split(","),
            steps=max(args.steps, 20),
            interval=max(args.steps, 20) // 4,
            json_out=args.json_out or None,
        )
    if args.warmup < 0 or args.steps < 1:
        parser.error("--warmup must be >= 0 and --steps >= 1")
    total = args.warmup + args.steps
    base = parse_args_or_exit(
        rest, prog="scripts/bench.py", model_schema=model_schema
    )  # the config as given, to read its LR warmup
    rest += [
        "--training.steps",
        str(total),
        "--validation.enable",
        "false",
        "--lr_scheduler.warmup_steps",
        str(min(base.lr_scheduler.warmup_steps, total)),
    ]
    cfg = parse_args_or_exit(rest, prog="scripts/bench.py", model_schema=model_schema)
    world = world_from_env()
    setup_logging(world.rank)
    try:
        trainer = BenchTrainer(cfg, (args.warmup, not args.no_split))
    except (ValueError, KeyError, FileNotFoundError) as e:
        exit_with_error(e, every_rank=True)
    trainer.train()
    elapsed = trainer.train_step.timer.elapsed()
    result = summarize(trainer, cfg, args, elapsed)
    if world.is_main:
        line = json.dumps(result)
        print(line, flush=True)
        if args.json_out:
            Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json_out).write_text(line + "\n")
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
        "parallelism": {"dp_replicate": dims.dp_replicate, "dp_shard": dims.dp_shard, "tp": dims.tp},
        "mixed_precision_param": cfg.training.mixed_precision_param,
        "float8": float8,
        "compile": cfg.compile.enable,
        "activation_checkpoint": cfg.activation_checkpoint.mode,
        "seq_len": cfg.training.seq_len,
        "local_batch_size": cfg.training.local_batch_size,
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
    losses = trainer.train_step.losses
    result["loss_first"], result["loss_last"] = (losses[0], losses[-1]) if losses else (None, None)
    return result


if __name__ == "__main__":
    main()

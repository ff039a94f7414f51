"""The training job: ``python -m titanlite.train --config FILE`` or ``torchrun ... -m titanlite.train``.

:class:`Trainer` wires the public building blocks together; every ``build_*`` method can be
overridden in a subclass, and each block is also usable on its own from a foreign training loop
(see README, "Use titanlite as a library").

One optimizer step = ``grad_accum_steps`` micro-batches of ``local_batch_size`` sequences on each of
the data-parallel ranks, where ``grad_accum_steps = global_batch_size / (local_batch_size * dp)``.
Each micro-batch's loss is a token *sum* divided by the step's global token count, so the gradient
is exactly that of one batch of ``global_batch_size`` sequences.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import json
import logging
import math
import os
import random
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Iterator, Optional

import torch
from torch import nn

from titanlite.checkpoint import AttrState, CheckpointManager
from titanlite.config import JobConfig, dump_config, exit_with_error, parse_args_or_exit
from titanlite.data.loader import build_dataloader, load_token_store
from titanlite.loss import cross_entropy_sum
from titanlite.guard import StepCheck, StepGuard, TrainingDivergedError, rollback
from titanlite.metrics import (MetricsLogger, RunProgress, UpdateRatio, flops_per_token, format_duration,
                               format_summary, matmul_dtype, memory_stats, num_params, peak_flops)
from titanlite.models import get_model_spec, make_model_args, model_schema
from titanlite.optim import build_lr_scheduler, build_optimizer
from titanlite.parallel.compile import CompilePolicy
from titanlite.parallel.distributed import (WorldInfo, all_reduce_sum, init_distributed, set_collective_timeout,
                                            world_from_env)
from titanlite.parallel.float8 import float8_disabled, float8_modules
from titanlite.parallel.fsdp import DTYPES, is_fsdp
from titanlite.parallel.grad_clip import clip_grad_norm_
from titanlite.parallel.parallel_dims import ParallelDims
from titanlite.parallel.state_dict import load_full_state_dict
from titanlite.parallel.tensor_parallel import loss_parallel_context, to_local_value
from titanlite.parallel.weight_init import reference_state_dict, resolve_weight_init
from titanlite.preemption import PreemptionHandler, save_now
from titanlite.profiling import build_profiler

logger = logging.getLogger("titanlite")



def set_seed(seed: int, deterministic: bool = False) -> None:
    """Seed python, torch (CPU and CUDA); optionally force deterministic kernels."""
    random.seed(seed)
    torch.manual_seed(seed)
    if deterministic:
        # cuBLAS is deterministic only with a fixed workspace; torch raises at the first CUDA matmul
        # without it. Read once, at cuBLAS's first use, so it must be set before any matmul.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=False)
        torch.backends.cudnn.benchmark = False


def grad_accum_steps(global_batch_size: int, local_batch_size: int, dp_degree: int) -> int:
    """Micro-batches per optimizer step; ``global_batch_size == -1`` means no accumulation."""
    per_pass = local_batch_size * dp_degree
    if global_batch_size == -1:
        return 1
    if global_batch_size % per_pass:
        raise ValueError(
            f"training.global_batch_size={global_batch_size} must be a multiple of local_batch_size "
            f"({local_batch_size}) x data-parallel degree ({dp_degree}) = {per_pass}")
    return global_batch_size // per_pass


def build_model_args(cfg: JobConfig, vocab_size: int) -> Any:
    """The family's args: flavor, then ``[model]`` overrides; vocab follows the tokenizer unless set."""
    overrides = dict(cfg.model.overrides)
    if "vocab_size" not in overrides:
        overrides["vocab_size"] = vocab_size
    elif overrides["vocab_size"] < vocab_size:
        raise ValueError(f"model.vocab_size={overrides['vocab_size']} is smaller than the tokenizer's "
                         f"vocabulary ({vocab_size})")
    try:
        return make_model_args(cfg.model.name, cfg.model.flavor, **overrides)
    except ValueError as e:
        given = ", ".join(f"model.{k}={v}" for k, v in cfg.model.overrides.items())
        raise ValueError(f"invalid [model] {cfg.model.name}/{cfg.model.flavor}"
                         f"{' with ' + given if given else ''}: {e}") from None


class Trainer:
    """Builds every piece from a :class:`JobConfig` and runs the training loop."""

    def __init__(self, cfg: JobConfig, world: Optional[WorldInfo] = None):
        self.cfg = cfg
        self.world = world or world_from_env()
        self.device = self.world.device
        self.parallel_dims = self.build_parallel_dims()
        tcfg = cfg.training
        self.accum = grad_accum_steps(tcfg.global_batch_size, tcfg.local_batch_size, self.parallel_dims.dp_degree)
        self.global_batch = tcfg.local_batch_size * self.parallel_dims.dp_degree * self.accum
        self.tokens_per_step = self.global_batch * tcfg.seq_len
        self.compute_dtype = DTYPES[tcfg.mixed_precision_param]

        set_seed(tcfg.seed, tcfg.deterministic)
        self.spec = get_model_spec(cfg.model.name)
        self.tokenizer = self.build_tokenizer()
        self.model_args = build_model_args(cfg, self.tokenizer.vocab_size)
        self.model = self.build_model()
        self.optimizer = self.build_optimizer()
        self.lr_scheduler = self.build_lr_scheduler()
        self.train_loader = self.build_dataloader("train")
        self.val_loader = self.build_dataloader("val") if cfg.validation.enable else None
        self.metrics = MetricsLogger(cfg.job.dump_folder, self.world.rank, cfg.metrics.enable_tensorboard,
                                     cfg.metrics.save_tb_folder)
        self.step = 0
        self.tokens_seen = 0
        self.n_params = num_params(self.model)
        self.flops_per_token = flops_per_token(self.model_args, self.n_params, tcfg.seq_len)
        float8 = any(True for _ in float8_modules(self.model))  # enabled but every linear skipped: no fp8 peak
        self.matmul_dtype = matmul_dtype(tcfg.mixed_precision_param, float8, self.device)
        self.peak_flops = peak_flops(self.device, self.matmul_dtype)  # None (MFU unknown) for an unknown GPU
        self.guard = StepGuard(cfg.guard, self.device)
        self.update_ratio = (UpdateRatio(self.model, cfg.metrics.update_ratio_per_layer)
                             if cfg.metrics.log_update_ratio else None)  # measured on logging steps only
        self.preemption = PreemptionHandler()
        self.checkpointer = self.build_checkpointer()  # last: it checks what to resume against the model

    # ---- builders (override in a subclass to swap a piece) ----
    def build_parallel_dims(self) -> ParallelDims:
        """Degrees from ``[parallelism]`` (checked before any communication), then the process group
        (``[comm] init_timeout_seconds``) and the named device mesh."""
        dims = ParallelDims.from_config(self.cfg.parallelism, self.world.world_size)
        init_distributed(self.world, self.cfg.comm.init_timeout_seconds)
        dims.build_mesh(self.device.type)
        return dims

    def build_tokenizer(self):
        return self.spec.tokenizer_builder(self.cfg.model.tokenizer_path)

    def build_model(self) -> nn.Module:
        """Meta-device build, parallelize (float8, TP, AC, compile, FSDP), then materialize each rank's
        shards and initialize them; the full model is never allocated on a device. With
        ``weight_init`` = rank0 (the default off CUDA) the weights equal a one-process run's
        (see :mod:`titanlite.parallel.weight_init`)."""
        mode = resolve_weight_init(self.cfg.parallelism.weight_init, self.world.world_size > 1, self.device.type)
        reference = None
        if mode == "rank0" and self.world.is_main:  # first, from the same RNG state as a single process
            reference = reference_state_dict(self.spec.model_cls, self.model_args)
        with torch.device("meta"):
            model = self.spec.model_cls(self.model_args)
        if self.spec.parallelize_fn is not None:
            model = self.spec.parallelize_fn(model, self.parallel_dims, self.cfg)
        model.to_empty(device=self.device)
        with torch.no_grad(), warnings.catch_warnings():
            if mode == "rank0":  # these random values are overwritten below: no CPU-RNG warning for them
                warnings.filterwarnings("ignore", message="DTensor random operators may not have complete support")
            model.init_weights()  # also computes the non-persistent buffers (RoPE table)
        if mode == "rank0":
            load_full_state_dict(model, reference)
            del reference
        model.train()
        return model

    def build_optimizer(self) -> torch.optim.Optimizer:
        return build_optimizer(self.model, self.cfg.optimizer)

    def build_lr_scheduler(self):
        return build_lr_scheduler(self.optimizer, self.cfg.lr_scheduler, self.cfg.training.steps)

    def build_dataloader(self, split: str):
        section = self.cfg.training if split == "train" else self.cfg.validation
        store = load_token_store(section.dataset, section.dataset_path, split, self.tokenizer)
        return build_dataloader(
            store, seq_len=self.cfg.training.seq_len, batch_size=self.cfg.training.local_batch_size,
            dp_rank=self.dp_rank, dp_world=self.parallel_dims.dp_degree, seed=self.cfg.training.seed,
            train=split == "train", eos_id=self.tokenizer.eos_id if self._needs_document_ids else None, name=split)

    @property
    def dp_rank(self) -> int:
        """Index among the data-parallel ranks; the TP ranks of one DP rank share it (same batches)."""
        return self.parallel_dims.dp_rank(self.world.rank)

    def dp_sum(self, t: torch.Tensor) -> torch.Tensor:
        """Sum of ``t`` over the data-parallel ranks only (TP ranks already hold the same value)."""
        group = self.parallel_dims.dp_group
        return t if group is None else all_reduce_sum(t, group)

    @functools.cached_property
    def _loss_impl(self):
        return CompilePolicy.from_config(self.cfg.compile, self.parallel_dims.tp_enabled).compile_loss(cross_entropy_sum)

    @property
    def _needs_document_ids(self) -> bool:
        return getattr(self.model_args, "attn_mask_type", "causal") != "causal"

    def model_inputs(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Extra forward arguments: document ids when attention is masked per document."""
        if not self._needs_document_ids:
            return {}
        return {"document_ids": batch["document_ids"].to(self.device, non_blocking=True)}

    def loss_fn(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self._loss_impl(logits, labels)  # cross_entropy_sum, compiled with [compile] components "loss"

    def autocast(self):
        """bf16 autocast for models that keep fp32 parameters: when FSDP is applied its
        MixedPrecisionPolicy (param_dtype/reduce_dtype) does the casting instead.

        With one data-parallel rank (one process, or TP only) there is no FSDP and this autocast is
        the mixed-precision path: matmuls in bf16 from fp32 master weights, and nothing to reduce.
        The alternative, FSDP at degree 1 with the same policy, was measured equal within noise
        (debug model, bf16, 8 x 256 tokens, 2 CPU threads: 2.35-2.59 s/step autocast vs 2.39-2.61
        s/step) while needing a process group and DTensor parameters even for one process."""
        if self.compute_dtype == torch.float32 or is_fsdp(self.model):
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.compute_dtype)

    # ---- the step ----
    def forward_backward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """One micro-batch: returns the detached token-sum loss; gradients are accumulated."""
        inputs = batch["input_ids"].to(self.device, non_blocking=True)
        labels = batch["labels"].to(self.device, non_blocking=True)
        with loss_parallel_context(self.parallel_dims.loss_parallel_enabled):  # vocab-sharded logits under TP
            with self.autocast():
                logits = self.model(inputs, **self.model_inputs(batch))
            loss = self.loss_fn(logits, labels)
            (loss / self.tokens_per_step).backward()
        return to_local_value(loss.detach())

    def clip_grad_norm(self) -> torch.Tensor:
        """Pre-clip total gradient norm (exact over FSDP shards and TP ranks); clips to ``max_norm``
        when it is positive."""
        return clip_grad_norm_(self.model.parameters(), self.cfg.training.max_norm)

    def train_step(self, data_iter: Iterator) -> dict[str, float]:
        timings = {"data_s": 0.0}
        loss_sum = torch.zeros((), device=self.device)
        for _ in range(self.accum):
            t0 = time.perf_counter()
            batch = next(data_iter)
            timings["data_s"] += time.perf_counter() - t0
            loss_sum += self.forward_backward(batch)
        step = self.step + 1
        loss_sum = self.guard.maybe_inject_nan(step, self.model, loss_sum)  # [guard] testing knob, off by default
        grad_norm = self.clip_grad_norm()
        grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
        loss = self.dp_sum(loss_sum) / self.tokens_per_step  # global mean over the data-parallel ranks
        # The step's single device->host sync: loss, grad norm and the NaN-guard / preemption verdict,
        # agreed by all ranks BEFORE the update (titanlite.guard). Raises under [guard] policy = raise.
        self.last_check = check = self.guard.check(step, loss, grad_norm, self.preemption.requested)
        lr = self.optimizer.param_groups[0]["lr"] * self.guard.lr_scale(step)
        extra = self.optimizer_step(step) if check.action == "update" else {}  # skip/rollback: no update
        self.optimizer.zero_grad(set_to_none=True)
        self.step = step
        if not getattr(self, "_train_timeout_set", False):  # first step of this run (or resume) done:
            # start-up and compilation are over, the shorter [comm] train timeout from now on
            set_collective_timeout(self.cfg.comm.train_timeout_seconds, self.parallel_dims.all_groups())
            self._train_timeout_set = True
        self.tokens_seen += self.tokens_per_step
        return {"loss": check.loss, "grad_norm": check.grad_norm, "lr": lr, **timings, **extra}

    def optimizer_step(self, step: int) -> dict[str, float]:
        """Apply the update: LR scaled by the guard after a rollback, update/parameter norm ratio
        measured on logging steps only (returned as ``update_ratio*`` entries)."""
        groups = self.optimizer.param_groups
        lrs = [g["lr"] for g in groups]
        scale = self.guard.lr_scale(step)
        if scale != 1.0:
            for g in groups:
                g["lr"] = g["lr"] * scale
        track = self.update_ratio is not None and self.is_log_step(step)
        if track:
            self.update_ratio.before_step()
        self.checkpointer.wait_for_staging()  # an async save must have copied the weights first
        self.optimizer.step()
        for g, lr in zip(groups, lrs):
            g["lr"] = lr
        self.lr_scheduler.step()
        return self.update_ratio.after_step() if track else {}

    def is_log_step(self, step: int) -> bool:
        return step == 1 or step % self.cfg.metrics.log_freq == 0 or step == self.cfg.training.steps

    @torch.no_grad()
    def validate(self) -> dict[str, float]:
        """Mean token loss over ``validation.steps`` global batches (``training.global_batch_size``
        sequences each: ``grad_accum_steps`` local batches on every data-parallel rank), so the
        validation set, and the loss, do not depend on the parallel layout."""
        self.model.eval()
        steps = self.cfg.validation.steps
        # islice stops without pulling one batch too many: every layout consumes the same windows
        batches = self.val_loader if steps == -1 else itertools.islice(self.val_loader, steps * self.accum)
        loss_sum = torch.zeros((), device=self.device)
        tokens = torch.zeros((), device=self.device)
        for batch in batches:
            labels = batch["labels"].to(self.device)
            with loss_parallel_context(self.parallel_dims.loss_parallel_enabled), float8_disabled(self.model):
                with self.autocast():
                    logits = self.model(batch["input_ids"].to(self.device), **self.model_inputs(batch))
                loss_sum += to_local_value(self.loss_fn(logits, labels))
            tokens += labels.numel()
        self.model.train()
        val_loss = (self.dp_sum(loss_sum) / self.dp_sum(tokens)).item()
        return {"val_loss": val_loss, "val_perplexity": math.exp(min(val_loss, 80.0))}

    def build_checkpointer(self) -> CheckpointManager:
        """``[checkpoint]``: saves, and decides now what :meth:`train` resumes from (user errors
        such as a missing ``load_step`` are raised here)."""
        model_info = {
            "model": {"name": self.cfg.model.name, "flavor": self.cfg.model.flavor,
                      "args": dataclasses.asdict(self.model_args)},
            "extensions": list(self.cfg.job.extensions),  # what converters import to know the family
            "tokenizer": {"path": self.cfg.model.tokenizer_path, "bos_id": getattr(self.tokenizer, "bos_id", None),
                          "eos_id": getattr(self.tokenizer, "eos_id", None)},
        }
        return CheckpointManager(
            self.cfg, model=self.model, optimizer=self.optimizer, lr_scheduler=self.lr_scheduler,
            dataloader=self.train_loader, train_state=AttrState(self, ("step", "tokens_seen")),
            device=self.device, dp_rank=self.dp_rank, model_info=model_info, metrics_path=str(self.metrics.path))

    def train(self) -> list[dict[str, Any]]:
        """Run ``training.steps`` optimizer steps (resuming from a checkpoint when there is one);
        returns the logged records."""
        cfg = self.cfg
        self.log_start()
        self.checkpointer.load()  # before the data iterator exists: it restores the data position
        records: list[dict[str, Any]] = []
        data_iter = iter(self.train_loader)
        self.progress = RunProgress(cfg.training.steps, self.step)
        profiler = build_profiler(cfg.profiling, cfg.job.dump_folder, self.world.rank, self.device, self.step)
        window_start, window_steps, window_data = time.perf_counter(), 0, 0.0
        while self.step < cfg.training.steps:
            self.last_check = None
            out = self.train_step(data_iter)
            # the guard's verdict (titanlite.guard); a train_step override that skips the guard means "update"
            check = self.last_check or StepCheck(out["loss"], out["grad_norm"], self.preemption.requested)
            if check.event is not None:  # [guard]: a skipped step or a rollback (raise has raised)
                if check.action == "rollback":
                    step, data_iter = rollback(self.guard, check.event, self.checkpointer, self.train_loader,
                                               self.accum)
                    records = [r for r in records if r["step"] <= step]  # as metrics.jsonl, rewound by the load
                    self.progress.restart(step)
                    window_start, window_steps, window_data = time.perf_counter(), 0, 0.0
                event = check.event.record(self.guard.counters())
                self.metrics.log(event)
                records.append(event)
                if check.action == "rollback":
                    continue
            self.progress.step_done(self.step)
            if profiler is not None:
                profiler.step(self.step)
            window_steps += 1
            window_data += out["data_s"]
            last = self.step == cfg.training.steps
            if self.is_log_step(self.step):
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                elapsed = time.perf_counter() - window_start
                record = self.step_record(out, elapsed, window_steps, window_data)
                self.progress.record(record, elapsed, window_steps)
                self.metrics.log(record)
                records.append(record)
                self.log_step(record)
                window_start, window_steps, window_data = time.perf_counter(), 0, 0.0
            if self.val_loader is not None and (self.step % cfg.validation.freq == 0 or last):
                val = {"step": self.step, **self.validate()}
                self.metrics.log(val)
                records.append(val)
                self.progress.validation(val["val_loss"])
                logger.info("step %d | validation loss %.4f | perplexity %.2f", self.step, val["val_loss"],
                            val["val_perplexity"])
            saved = self.checkpointer.save(self.step, last=last)
            if check.stop_requested and not last:  # SIGTERM/SIGINT on some rank: all stop after this step
                self.stop_on_signal(saved)
                break
        if profiler is not None:
            profiler.close()
        self.checkpointer.close()  # waits for the last (possibly asynchronous) save
        self.log_summary()
        self.metrics.close()
        return records

    def stop_on_signal(self, saved: bool) -> None:
        """Preemption (titanlite.preemption): a full checkpoint of this step unless one was just saved."""
        if not saved:
            saved = save_now(self.checkpointer, self.step)
        self.checkpointer.wait()
        what = (f"checkpoint of step {self.step} saved; rerun the same command to resume" if saved else
                "checkpointing is off ([checkpoint] enable = false): nothing was saved")
        logger.warning("preemption: stopped after step %d of %d on %s; %s", self.step, self.cfg.training.steps,
                       self.preemption.signal_name or "a signal on another rank", what)

    def log_summary(self) -> None:
        summary = self.progress.summary()
        logger.info(format_summary(summary))
        if self.world.is_main:
            path = Path(self.cfg.job.dump_folder) / "summary.json"
            path.write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")

    # ---- logging ----
    def step_record(self, out: dict[str, float], elapsed: float, steps: int, data_s: float) -> dict[str, Any]:
        local_tokens = self.tokens_per_step // self.world.world_size * steps
        tps = local_tokens / elapsed
        mfu = None if self.peak_flops is None else tps * self.flops_per_token / self.peak_flops
        return {"step": self.step, "loss": out["loss"], "grad_norm": out["grad_norm"], "lr": out["lr"],
                "tokens_per_s": tps, "tokens_per_s_global": tps * self.world.world_size, "mfu": mfu,
                "tokens_seen": self.tokens_seen, "data_wait_frac": data_s / elapsed,
                "eta_s": self.progress.eta_seconds(), **memory_stats(self.device), **self.guard.counters(),
                **{k: v for k, v in out.items() if k.startswith("update_ratio")}}

    def log_start(self) -> None:
        t = self.cfg.training
        logger.info("model %s/%s: %s parameters, %.3g FLOPs/token | world %d (dp %d) | device %s",
                    self.cfg.model.name, self.cfg.model.flavor, f"{self.n_params:,}", self.flops_per_token,
                    self.world.world_size, self.parallel_dims.dp_degree, self.device)
        logger.info("batch: %d sequences x %d tokens = %s tokens per optimizer step "
                    "(local batch %d x dp %d x grad accumulation %d)", self.global_batch, t.seq_len,
                    f"{self.tokens_per_step:,}", t.local_batch_size, self.parallel_dims.dp_degree, self.accum)
        if self.peak_flops is not None and self.device.type == "cpu":
            logger.info("MFU is against this CPU's measured matmul peak: %.1f GFLOP/s", self.peak_flops / 1e9)

    def log_step(self, r: dict[str, Any]) -> None:
        mfu = "unknown" if r["mfu"] is None else f"{100 * r['mfu']:.2f}%"
        mem = r.get("mem_peak_gib", r.get("mem_rss_gib", 0.0))
        upd = f" | upd/param {r['update_ratio']:.1e}" if "update_ratio" in r else ""
        total = self.cfg.training.steps
        logger.info("step %4d/%d (%.0f%%) | loss %.4f | grad_norm %.3f | lr %.2e | tok/s %s (global %s) | mfu %s | "
                    "mem %.2f GiB | data %.0f%%%s | eta %s", r["step"], total, 100 * r["step"] / total, r["loss"],
                    r["grad_norm"], r["lr"], f"{r['tokens_per_s']:,.0f}", f"{r['tokens_per_s_global']:,.0f}", mfu, mem,
                    100 * r["data_wait_frac"], upd, format_duration(r.get("eta_s")))


def setup_logging(rank: int) -> None:
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stdout)


def main(argv: Optional[list[str]] = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    cfg = parse_args_or_exit(argv, model_schema=model_schema)
    if cfg.job.dry_run:  # check the layout at its stated scale with a fake process group, then exit
        from titanlite.dry_run import dry_run

        try:
            dry_run(cfg)
        except (ValueError, KeyError) as e:
            exit_with_error(e)
        return
    world = world_from_env()
    setup_logging(world.rank)
    if cfg.job.world_size > 0 and world.world_size != cfg.job.world_size:
        logger.warning("this config is tuned for %d processes (job.world_size) but runs on %d", cfg.job.world_size,
                       world.world_size)
    if world.is_main:
        Path(cfg.job.dump_folder).mkdir(parents=True, exist_ok=True)
        dump_config(cfg, Path(cfg.job.dump_folder) / "config.toml")
    try:
        trainer = Trainer(cfg, world)
    except (ValueError, KeyError, FileNotFoundError) as e:
        exit_with_error(e, every_rank=True)
    with trainer.preemption:  # SIGTERM/SIGINT: finish the step, checkpoint, exit 0 (titanlite.preemption)
        try:
            trainer.train()
        except TrainingDivergedError as e:  # [guard] policy = raise, or too many skips / rollbacks
            logger.error("training stopped: %s", e)
            raise SystemExit(1)


if __name__ == "__main__":
    main()

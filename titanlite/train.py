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
import logging
import math
import random
import sys
import time
from pathlib import Path
from typing import Any, Iterator, Optional

import torch
from torch import nn

from titanlite.config import JobConfig, dump_config, parse_args_or_exit
from titanlite.data.loader import build_dataloader, load_token_store
from titanlite.loss import cross_entropy_sum
from titanlite.metrics import MetricsLogger, flops_per_token, memory_stats, num_params, peak_flops
from titanlite.models import get_model_spec, make_model_args
from titanlite.optim import build_lr_scheduler, build_optimizer
from titanlite.parallel.distributed import WorldInfo, all_reduce_sum, init_distributed, world_from_env
from titanlite.parallel.parallel_dims import ParallelDims

logger = logging.getLogger("titanlite")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def set_seed(seed: int, deterministic: bool = False) -> None:
    """Seed python, torch (CPU and CUDA); optionally force deterministic kernels."""
    random.seed(seed)
    torch.manual_seed(seed)
    if deterministic:
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
    return make_model_args(cfg.model.name, cfg.model.flavor, **overrides)


class Trainer:
    """Builds every piece from a :class:`JobConfig` and runs the training loop."""

    def __init__(self, cfg: JobConfig, world: Optional[WorldInfo] = None):
        self.cfg = cfg
        self.world = world or world_from_env()
        self.device = self.world.device
        init_distributed(self.world)
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
        self.lr_scheduler = build_lr_scheduler(self.optimizer, cfg.lr_scheduler, tcfg.steps)
        self.train_loader = self.build_dataloader("train")
        self.val_loader = self.build_dataloader("val") if cfg.validation.enable else None
        self.metrics = MetricsLogger(cfg.job.dump_folder, self.world.rank, cfg.metrics.enable_tensorboard,
                                     cfg.metrics.save_tb_folder)
        self.step = 0
        self.tokens_seen = 0
        self.n_params = num_params(self.model)
        self.flops_per_token = flops_per_token(self.model_args, self.n_params, tcfg.seq_len)
        self.peak_flops = peak_flops(self.device, tcfg.mixed_precision_param)

    # ---- builders (override in a subclass to swap a piece) ----
    def build_parallel_dims(self) -> ParallelDims:
        return ParallelDims(world_size=self.world.world_size)

    def build_tokenizer(self):
        return self.spec.tokenizer_builder(self.cfg.model.tokenizer_path)

    def build_model(self) -> nn.Module:
        """Meta-device build, parallelize, then materialize and initialize (never fully allocated)."""
        with torch.device("meta"):
            model = self.spec.model_cls(self.model_args)
        if self.spec.parallelize_fn is not None:
            model = self.spec.parallelize_fn(model, self.parallel_dims, self.cfg)
        model.to_empty(device=self.device)
        with torch.no_grad():
            model.init_weights()
        model.train()
        return model

    def build_optimizer(self) -> torch.optim.Optimizer:
        return build_optimizer(self.model, self.cfg.optimizer)

    def build_dataloader(self, split: str):
        section = self.cfg.training if split == "train" else self.cfg.validation
        store = load_token_store(section.dataset, section.dataset_path, split, self.tokenizer)
        return build_dataloader(
            store, seq_len=self.cfg.training.seq_len, batch_size=self.cfg.training.local_batch_size,
            dp_rank=self.dp_rank, dp_world=self.parallel_dims.dp_degree, seed=self.cfg.training.seed,
            train=split == "train", name=split)

    @property
    def dp_rank(self) -> int:
        return self.world.rank // self.parallel_dims.tp  # tp is the innermost mesh dimension

    def loss_fn(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return cross_entropy_sum(logits, labels)

    def autocast(self):
        """bf16 autocast for models that keep fp32 parameters (no FSDP mixed-precision policy)."""
        if self.compute_dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.compute_dtype)

    # ---- the step ----
    def forward_backward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """One micro-batch: returns the detached token-sum loss; gradients are accumulated."""
        inputs = batch["input_ids"].to(self.device, non_blocking=True)
        labels = batch["labels"].to(self.device, non_blocking=True)
        with self.autocast():
            logits = self.model(inputs)
        loss = self.loss_fn(logits, labels)
        (loss / self.tokens_per_step).backward()
        return loss.detach()

    def clip_grad_norm(self) -> torch.Tensor:
        """Pre-clip total gradient norm; clips to ``max_norm`` when it is positive."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        max_norm = self.cfg.training.max_norm
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)
        if max_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm, foreach=True)
        return norm

    def train_step(self, data_iter: Iterator) -> dict[str, float]:
        timings = {"data_s": 0.0}
        loss_sum = torch.zeros((), device=self.device)
        for _ in range(self.accum):
            t0 = time.perf_counter()
            batch = next(data_iter)
            timings["data_s"] += time.perf_counter() - t0
            loss_sum += self.forward_backward(batch)
        grad_norm = self.clip_grad_norm()
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        loss = all_reduce_sum(loss_sum) / self.tokens_per_step
        self.step += 1
        self.tokens_seen += self.tokens_per_step
        return {"loss": loss.item(), "grad_norm": float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm), "lr": lr, **timings}

    @torch.no_grad()
    def validate(self) -> dict[str, float]:
        self.model.eval()
        steps = self.cfg.validation.steps
        loss_sum = torch.zeros((), device=self.device)
        tokens = torch.zeros((), device=self.device)
        for i, batch in enumerate(self.val_loader):
            if steps != -1 and i >= steps:
                break
            labels = batch["labels"].to(self.device)
            with self.autocast():
                logits = self.model(batch["input_ids"].to(self.device))
            loss_sum += self.loss_fn(logits, labels)
            tokens += labels.numel()
        self.model.train()
        val_loss = (all_reduce_sum(loss_sum) / all_reduce_sum(tokens)).item()
        return {"val_loss": val_loss, "val_perplexity": math.exp(min(val_loss, 80.0))}

    def train(self) -> list[dict[str, Any]]:
        """Run ``training.steps`` optimizer steps; returns the logged records."""
        cfg = self.cfg
        self.log_start()
        records: list[dict[str, Any]] = []
        data_iter = iter(self.train_loader)
        window_start, window_steps, window_data = time.perf_counter(), 0, 0.0
        while self.step < cfg.training.steps:
            out = self.train_step(data_iter)
            window_steps += 1
            window_data += out["data_s"]
            last = self.step == cfg.training.steps
            if self.step == 1 or self.step % cfg.metrics.log_freq == 0 or last:
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                elapsed = time.perf_counter() - window_start
                record = self.step_record(out, elapsed, window_steps, window_data)
                self.metrics.log(record)
                records.append(record)
                self.log_step(record)
                window_start, window_steps, window_data = time.perf_counter(), 0, 0.0
            if self.val_loader is not None and (self.step % cfg.validation.freq == 0 or last):
                val = {"step": self.step, **self.validate()}
                self.metrics.log(val)
                records.append(val)
                logger.info("step %d | validation loss %.4f | perplexity %.2f", self.step, val["val_loss"],
                            val["val_perplexity"])
        self.metrics.close()
        return records

    # ---- logging ----
    def step_record(self, out: dict[str, float], elapsed: float, steps: int, data_s: float) -> dict[str, Any]:
        local_tokens = self.tokens_per_step // self.world.world_size * steps
        tps = local_tokens / elapsed
        mfu = None if self.peak_flops is None else tps * self.flops_per_token / self.peak_flops
        return {"step": self.step, "loss": out["loss"], "grad_norm": out["grad_norm"], "lr": out["lr"],
                "tokens_per_s": tps, "tokens_per_s_global": tps * self.world.world_size, "mfu": mfu,
                "tokens_seen": self.tokens_seen, "data_wait_frac": data_s / elapsed,
                **memory_stats(self.device)}

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
        mfu = "n/a" if r["mfu"] is None else f"{100 * r['mfu']:.2f}%"
        mem = r.get("mem_peak_gib", r.get("mem_rss_gib", 0.0))
        logger.info("step %4d | loss %.4f | grad_norm %.3f | lr %.2e | tok/s %s | mfu %s | mem %.2f GiB",
                    r["step"], r["loss"], r["grad_norm"], r["lr"], f"{r['tokens_per_s']:,.0f}", mfu, mem)


def setup_logging(rank: int) -> None:
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stdout)


def main(argv: Optional[list[str]] = None) -> None:
    cfg = parse_args_or_exit(sys.argv[1:] if argv is None else argv)
    world = world_from_env()
    setup_logging(world.rank)
    if world.is_main:
        Path(cfg.job.dump_folder).mkdir(parents=True, exist_ok=True)
        dump_config(cfg, Path(cfg.job.dump_folder) / "config.toml")
    try:
        trainer = Trainer(cfg, world)
    except (ValueError, KeyError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2)
    trainer.train()


if __name__ == "__main__":
    main()

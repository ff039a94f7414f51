"""The training job: ``python -m titanlite.train --config FILE`` or ``torchrun ... -m titanlite.train``.

:class:`Trainer` builds every piece from its own config section and runs the loop: one
:class:`~titanlite.trainer.step.TrainStep` call per optimizer step, and hooks (:mod:`titanlite.trainer.hooks`) for
metrics, the guard, the profiler, validation, checkpoints, preemption and collective timeouts. To swap a piece,
override its ``build_*`` method in a subclass registered as a ``"trainer"`` component and named in ``[job]
trainer`` (docs/library.md, "Swapping one piece of the stock job"); every piece also works in a foreign loop.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import random
from pathlib import Path
from typing import Any

import torch

from titanlite.checkpoint import CheckpointManager, layout
from titanlite.checkpoint.hf_tokenizer_files import tokenizer_record
from titanlite.checkpoint.seed_args import model_args_from_seed
from titanlite.config import JobConfig, config_to_toml, dump_config
from titanlite.errors import CheckpointError, ConfigError, UserError
from titanlite.eval import evaluate, get_task
from titanlite.models import get_model_spec
from titanlite.models.flops import ModelShape, num_params
from titanlite.models.registry import active_params, check_seq_len, model_args_for, model_counts
from titanlite.parallel.distributed import WorldInfo, init_distributed, run_on_rank0, world_from_env
from titanlite.parallel.float8 import float8_disabled, float8_modules
from titanlite.parallel.fsdp import quiet_view_warning
from titanlite.parallel.parallel_dims import ParallelDims
from titanlite.parallel.pipeline import PipelinePlan
from titanlite.plan.planner import RunSetup, check_absurd_size
from titanlite.plan.run_plan import RunPlan
from titanlite.tokenizer import token_byte_lengths
from titanlite.trainer.assemble import (
    RunFacts,
    TrainingBuilder,
    build_training,
    config_grad_accum_steps,
    config_pipeline_plan,
    config_run_plan,
)
from titanlite.trainer.checkpoint_hook import CheckpointHook
from titanlite.trainer.collective_timeout import CollectiveTimeoutHook
from titanlite.trainer.eval_hook import EvalHook
from titanlite.trainer.guard import GuardHook, StepGuard
from titanlite.trainer.hooks import Hook, LoopState, call_hooks, run_steps
from titanlite.trainer.metrics import MetricsHook
from titanlite.trainer.metrics_log import MetricsLogger
from titanlite.trainer.peaks import device_memory_bytes, matmul_dtype
from titanlite.trainer.preemption import PreemptionHandler, PreemptionHook
from titanlite.trainer.profiling import ProfilerHook
from titanlite.trainer.sampling import SamplingHook
from titanlite.trainer.stages import StageHook
from titanlite.trainer.trainer_data import TrainerData
from titanlite.trainer.validation import ValidationHook, combine_validation, validation_loss
from titanlite.trainer.wandb_logger import import_wandb
from titanlite.utils.run_lock import RunLock

logger = logging.getLogger("titanlite")


class ResumeError(CheckpointError):
    """The checkpoint cannot resume this run (e.g. the data or its windowing changed): one line at the
    command line, raised before anything (metrics, checkpoints) is touched."""


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


class Trainer(TrainerData, TrainingBuilder):
    """Builds every piece from a :class:`JobConfig` (each from its own section) and runs the loop. The training
    parts come from :func:`~titanlite.trainer.assemble.build_training`, this trainer as their builder (its
    :class:`~titanlite.trainer.assemble.TrainingBuilder` methods), as a foreign loop gets them."""

    def __init__(self, cfg: JobConfig, world: WorldInfo | None = None):
        t = cfg.training
        self.cfg = cfg
        if cfg.metrics.enable_wandb:
            import_wandb()  # a missing optional extra stops every rank before anything is written
        self.world = world or world_from_env()
        self.device = self.world.device
        self.parallel_dims = self.build_parallel_dims()
        layout.refuse_inside_step_folder(cfg.job.dump_folder, f"job.dump_folder={cfg.job.dump_folder}")
        self.run_lock = RunLock(cfg.job.dump_folder)  # rank 0 holds it: one run per dump folder
        run_on_rank0(lambda: self.run_lock.acquire() and None)
        self.grad_accum_steps = config_grad_accum_steps(cfg, self.parallel_dims)
        self.global_batch = t.local_batch_size * self.parallel_dims.dp_degree * self.grad_accum_steps
        self.run_plan = self.build_run_plan()  # the token budget and the seq_len stages, checked before building
        self.total_steps = self.run_plan.total_steps
        set_seed(t.seed, t.deterministic)
        self.spec = get_model_spec(cfg.model.name)
        self.tokenizer = self.build_tokenizer()
        if cfg.eval.enable:  # unknown task names, then bad data files: stop now, not at the first evaluation
            for task in [get_task(name) for name in cfg.eval.tasks]:
                task.items(cfg.eval.data_dir)
        self.model_args = model_args_for(cfg.model, self.tokenizer.vocab_size)
        if source := layout.model_args_source(cfg.checkpoint, cfg.job.dump_folder):  # RoPE, norm eps ... unless set
            try:
                self.model_args = model_args_from_seed(self.spec, self.model_args, cfg.model.overrides, *source)
            except UserError as e:
                if source[1] != layout.RESUMED:
                    raise
                raise ConfigError(f"{e}; or start a new run in another --job.dump_folder") from None
        check_seq_len(self.model_args, max(t.seq_len, self.run_plan.max_seq_len))
        self.pipeline_plan = self.build_pipeline_plan()
        self.check_absurd_size()
        self.count_unmasked = any(data.chat for data, _ in self.train_sources)  # masks or packing padding
        stop = lambda: self.preemption.requested  # noqa: E731 - agreed in the step's reduction (the guard reads it)
        facts = RunFacts(self.model_args, self.run_plan, self.pipeline_plan, self.count_unmasked, stop)
        parts = build_training(cfg, self.parallel_dims, self.device, facts=facts, builder=self)
        self.model, self.optimizer, self.lr_scheduler = parts.model, parts.optimizer, parts.lr_scheduler
        self.train_step, self.runtime = parts.train_step, parts.runtime
        n_params, self.flops_per_token = model_counts(self.spec, self.model_args, t.seq_len)
        self.stage_flops = [model_counts(self.spec, self.model_args, s.seq_len)[1] for s in self.run_plan.stages]
        self.n_params = n_params if self.pipeline_plan else num_params(self.model)  # a stage holds a part
        self.train_loader = self.build_train_loader()
        self.val_loaders = self.build_val_loaders() if cfg.validation.enable else {}
        self.state = LoopState(total_steps=self.total_steps)
        self.preemption = PreemptionHandler()
        self.guard = StepGuard(cfg.guard, self.device)
        self.checkpointer = self.build_checkpointer()  # it checks what to resume against the model
        self.complete = self.checkpointer.plan.kind == "complete"  # a rerun of a finished run: nothing to do
        self.hooks = [] if self.complete else self.build_hooks()

    # ---- builders (override in a subclass to swap a piece) ----
    def build_parallel_dims(self) -> ParallelDims:
        """Degrees from ``[parallelism]`` (checked before any communication), then the process group
        (``[comm] init_timeout_seconds``) and the named device mesh."""
        dims = ParallelDims.from_config(self.cfg.parallelism, self.world.world_size)
        dims.check_tp_divides(**{"training.seq_len (sequence parallelism)": self.cfg.training.seq_len})
        if dims.pp_enabled and (n_layers := self.model_layers()):  # the split and schedule, before communicating
            PipelinePlan.from_config(self.cfg.parallelism, n_layers, self.cfg.training.local_batch_size)
        init_distributed(self.world, self.cfg.comm.init_timeout_seconds)
        dims.build_mesh(self.device.type)
        return dims

    def model_layers(self) -> int | None:
        """``n_layers`` of the configured flavor (with ``[model]`` overrides), for checks before the model exists."""
        m = self.cfg.model
        return m.overrides.get("n_layers", getattr(get_model_spec(m.name).flavors.get(m.flavor), "n_layers", None))

    def build_pipeline_plan(self) -> PipelinePlan | None:
        """``[parallelism] pipeline_parallel_*``: the stages and the microbatches, or None without pipelining."""
        return config_pipeline_plan(self.cfg, self.parallel_dims, self.model_args)

    def check_absurd_size(self) -> None:
        """Refuse, before anything is allocated, a run whose modelled memory per device is far beyond the device's
        (:func:`titanlite.plan.planner.check_absurd_size`); families without the planner's sizes are not checked."""
        device_bytes = device_memory_bytes(self.device)
        try:
            shape = ModelShape.from_args(self.model_args)
        except (AttributeError, TypeError, ZeroDivisionError):
            return
        if device_bytes is None:
            return
        sizes = self.pipeline_plan.stage_sizes if self.pipeline_plan is not None else ()
        check_absurd_size(
            shape, RunSetup.from_config(self.cfg, self.world.world_size, sizes), device_bytes, self.device.type
        )

    def build_tokenizer(self):
        return self.spec.tokenizer_builder(self.cfg.model.tokenizer_path)

    def build_run_plan(self) -> RunPlan:
        """``[training] steps | tokens`` and ``seq_len_schedule`` as stages (:mod:`titanlite.plan.run_plan`); under a
        token budget from where the run resumes, and the warm-up is checked here, once the steps are known."""
        resumed = self.resume_point() if self.cfg.training.tokens > 0 else None
        return config_run_plan(self.cfg, self.parallel_dims, resumed)

    def build_checkpointer(self) -> CheckpointManager:
        """``[checkpoint]``: what is saved, and what :meth:`resume` will load (user errors such as a
        missing ``load_step`` are raised here)."""
        c, tok = self.cfg, self.tokenizer
        info = {
            "model": {"name": c.model.name, "flavor": c.model.flavor, "args": dataclasses.asdict(self.model_args)},
            "extensions": list(c.job.extensions),  # what converters import to know the family
            "tokenizer": {
                **tokenizer_record(c.model.tokenizer_path),
                **{k: getattr(tok, k, None) for k in ("bos_id", "eos_id")},
            },
        }
        states = {"model": self.model, "optimizer": self.optimizer, "lr_scheduler": self.lr_scheduler}
        states.update(dataloader=self.train_loader, train_state=self.state, guard=self.guard)
        folder = Path(c.job.dump_folder) / c.checkpoint.folder
        toml = config_to_toml(c)
        return CheckpointManager(
            c.checkpoint, folder, states, dp_rank=self.dp_rank, device=self.device, info=info, config_toml=toml,
            final_step=self.total_steps,
        )  # fmt: skip

    def build_hooks(self) -> list[Hook]:
        """The loop's hooks, in calling order (see :mod:`titanlite.trainer.hooks`)."""
        c, rank, main = self.cfg, self.world.rank, self.world.is_main
        float8 = any(True for _ in float8_modules(self.model))  # enabled but every linear skipped: no fp8 peak
        sampling = SamplingHook(c.sampling, self.model, self.tokenizer, self.runtime) if c.sampling.enable else None
        log = MetricsLogger(c.metrics, c.job.dump_folder, rank, run_config=dataclasses.asdict(c))
        metrics = MetricsHook(
            c.metrics,
            log,
            device=self.device,
            world_size=self.world.world_size,
            model=self.model,
            flops_per_token=self.stage_flops[self.run_plan.stage_index(self.state.step + 1)],
            matmul_dtype=matmul_dtype(c.training.mixed_precision_param, float8, self.device),
            summary_path=Path(c.job.dump_folder) / "summary.json" if main else None,
            pp_group=self.parallel_dims.pp_group,
        )
        stop = lambda: self.preemption.requested  # noqa: E731 - agreed across ranks by the guard's check
        kw = dict(checkpointer=self.checkpointer, loader=self.train_loader, grad_accum_steps=self.grad_accum_steps)
        guard = GuardHook(self.guard, stop_requested=stop, **kw)
        hooks: list[Hook] = [metrics, guard, ProfilerHook(c.profiling, c.job.dump_folder, rank, self.device)]
        if self.val_loaders:
            hooks.append(ValidationHook(c.validation, self.validate))
        if sampling is not None:
            hooks.append(sampling)
        if c.eval.enable:
            hooks.append(EvalHook(c.eval, self.evaluate_tasks))
        hooks += [CheckpointHook(self.checkpointer), PreemptionHook(self.preemption, self.checkpointer)]
        if self.world.world_size > 1:
            hooks.append(CollectiveTimeoutHook(c.comm.train_timeout_seconds, self.parallel_dims.all_groups()))
        if c.training.seq_len_schedule:  # last: a step is saved and logged on its own stage
            hooks.append(StageHook(self.run_plan, self.train_loader, self.train_step, metrics, self.stage_flops))
        return hooks

    def resume_point(self) -> tuple[int, int] | None:
        """``(step, tokens seen)`` of the run so far, as its newest checkpoint records them (a model-only last save
        too: the run may be finished), or a full ``initial_load_path``'s; None for a fresh start. A token budget
        plans the remaining steps from the remaining tokens."""
        found = layout.recorded_checkpoint(self.cfg.checkpoint, self.cfg.job.dump_folder, lambda info: True)
        c = self.cfg.checkpoint
        if found is None or found[1] != layout.RESUMED and c.initial_load_model_only:
            return None
        info = found[2]
        if isinstance(info.get("step"), int) and isinstance(info.get("tokens_seen"), int):
            return info["step"], info["tokens_seen"]
        return None

    @property
    def active_note(self) -> str:
        """`` (N active per token)`` for a mixture-of-experts model, else ""."""
        total = model_counts(self.spec, self.model_args, self.cfg.training.seq_len)[0]
        active = active_params(self.spec, self.model_args, total)
        return f" ({active:,} active per token)" if active != total else ""

    @property
    def dp_rank(self) -> int:
        """Index among the data-parallel ranks; the TP ranks of one DP rank share it (same batches)."""
        return self.parallel_dims.dp_rank(self.world.rank)

    # ---- the loop ----
    def train(self) -> list[dict[str, Any]]:
        """Run to ``training.steps`` (resuming first when there is a checkpoint); returns the logged records."""
        state, hooks = self.state, self.hooks
        if self.complete:
            path = self.checkpointer.plan.paths[0]
            logger.info(f"the run is complete ({path} exists, training.steps = {state.total_steps}); nothing to do")
            logger.info(
                "to train further, raise training.steps and rerun; to train anew, choose another --job.dump_folder"
            )
            self.checkpointer.close()  # its folder's lock
            self.run_lock.release()
            return state.records
        self.log_start()
        try:  # before the data iterator exists: the checkpoint restores the data position
            self.resume()
            self.check_budget_progress()
            state.data_iter = iter(self.train_loader)  # the data position is checked here
        except UserError as e:  # bad input found while resuming: any other exception is a bug, with its traceback
            raise ResumeError(str(e)) from e
        self.checkpointer.commit_resume()  # a good resume: an abandoned newer lineage is moved aside now
        if self.world.is_main:  # the config this run trains with (not written by a run that failed to resume)
            dump_config(self.cfg, Path(self.cfg.job.dump_folder) / "config.toml")
        call_hooks(hooks, "on_train_start", state)
        sources = [data.name for data, _ in self.train_sources]
        step = lambda before_update: self.train_step(state.data_iter, before_update, step=state.step + 1)  # noqa: E731
        try:
            with quiet_view_warning():
                run_steps(hooks, state, step, sources)
        finally:
            self.run_lock.release()
        return state.records

    def resume(self) -> int | None:
        """Load what the checkpoint manager planned (a resume, or ``initial_load_path``)."""
        return self.checkpointer.load()

    def check_budget_progress(self) -> None:
        """Under a token budget, the resumed tokens must be the ones the run plan was made from (it was made from
        the newest checkpoint's ``checkpoint.json``: a fallback to an older one, after the batch changed, is not)."""
        budget, state = self.cfg.training.tokens, self.state
        if budget > 0 and state.tokens_seen != (expected := self.run_plan.tokens_through(state.step)):
            raise ConfigError(
                f"training.tokens = {budget:,}: the checkpoint resumed at step {state.step:,} has seen "
                f"{state.tokens_seen:,} tokens, but the run was planned for {expected:,} by then (the batch changed "
                "and an older checkpoint was loaded): resume with the batch it was trained with"
            )

    def validate(self) -> dict[str, float]:
        """Mean token loss over ``validation.steps`` global batches (``training.global_batch_size``
        sequences each), so the validation set, and the loss, do not depend on the parallel layout."""
        steps = self.cfg.validation.steps
        batches = None if steps == -1 else steps * self.grad_accum_steps
        loss = functools.partial(
            validation_loss, runtime=self.runtime, max_batches=batches, token_bytes=self.token_bytes
        )
        results = {name: (w, loss(self.model, loader)) for name, (w, loader) in self.val_loaders.items()}
        if not self.cfg.validation.mixture:
            return next(iter(results.values()))[1]
        return combine_validation(results)

    def evaluate_tasks(self) -> dict[str, dict]:
        """``[eval]``: each task's scores (:func:`titanlite.eval.evaluate`); every rank takes part, each
        data-parallel rank scoring its share of the items, float8 linears in high precision, compiled
        blocks run eagerly (the items' lengths vary: no recompilation per length)."""
        e = self.cfg.eval
        max_len = self.model_args.max_seq_len
        kw = dict(limit=None if e.limit == -1 else e.limit, batch_size=e.batch_size, max_seq_len=max_len)
        with float8_disabled(self.model), torch.compiler.set_stance("force_eager"):
            return evaluate(self.model, self.tokenizer, e.tasks, e.data_dir, runtime=self.runtime, **kw)

    @functools.cached_property
    def token_bytes(self) -> torch.Tensor | None:
        """Bytes of text per token id, for bits per byte (None for a tokenizer that is not tiktoken-based)."""
        if getattr(self.tokenizer, "encoding", None) is None:
            return None
        return torch.tensor(token_byte_lengths(self.tokenizer, self.model_args.vocab_size), device=self.device)

    def log_start(self) -> None:
        t, c, dp, accum = self.cfg.training, self.cfg, self.parallel_dims.dp_degree, self.grad_accum_steps
        logger.info(
            f"model {c.model.name}/{c.model.flavor}: {self.n_params:,} parameters{self.active_note}, "
            f"{self.flops_per_token:.3g} "
            f"FLOPs/token | world {self.world.world_size} (dp {dp}) | device {self.device}"
        )
        logger.info(
            f"batch: {self.global_batch} sequences x {t.seq_len} tokens = {self.global_batch * t.seq_len:,} tokens "
            f"per optimizer step (local batch {t.local_batch_size} x dp {dp} x grad accumulation {accum})"
        )
        if t.tokens > 0 or t.seq_len_schedule:
            for line in self.run_plan.log_lines:
                logger.info(line)
        if (plan := self.pipeline_plan) is not None:
            logger.info(
                f"pipeline: {plan.schedule} over {plan.degree} ranks, {plan.num_stages} stages of "
                f"{list(plan.stage_sizes)} blocks, {plan.n_microbatches} microbatches per local batch "
                f"(expected bubble {100 * plan.bubble_fraction():.0f}%); this rank runs stages {self.model.stage_ids}"
            )

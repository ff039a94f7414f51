"""Where moved modules and renamed names went, so an old import fails with a one-line error naming the new place.
Add a row when you move a module or rename a public name; a module that lost a name sets
``__getattr__ = moved_names(__name__)``. tests/test_moved.py imports every row and every module a row names."""

from __future__ import annotations

import importlib.abc
import sys

T, P = "titanlite.trainer", "titanlite.plan"
MOVED_MODULES: dict[str, str] = {  # old module -> where it went (every titanlite.* module named must import)
    **{f"titanlite.{m}": f"{T}.{m}" for m in ("guard", "preemption", "profiling", "validation", "sampling")},
    **{f"titanlite.{m}": f"{T}.{m}" for m in ("wandb_logger", "assemble")},
    "titanlite.train_step": f"{T}.step",
    "titanlite.metrics": f"{T}.metrics (MetricsHook, UpdateRatio, RunProgress), {T}.peaks (peak FLOP/s, matmul_dtype, "
    f"the CPU probe, memory), {T}.metrics_log (MetricsLogger, rewind_metrics_log, DiskFullError) and "
    "titanlite.models.flops (num_params)",
    "titanlite.planner": f"{P}.planner (plan_run is now estimate_run), titanlite.models.flops (ModelShape, parameter "
    "and FLOP counts) and titanlite.parallel.pipeline_schedules (schedules, bubble, microbatches in flight)",
    "titanlite.planner_moe": f"{P}.planner_moe and titanlite.models.flops (MoEShape)",
    "titanlite.run_plan": f"{P}.run_plan (plan_run is now plan_steps)",
    "titanlite.dry_run": f"{P}.dry_run",
}
C = "titanlite.checkpoint"
HF = f"{C}.hf"
PLANNER_MEMORY = ("StageShare", "stage_params", "stage_memory_breakdown", "pipeline_receive_buffers", "pipeline_memory")
PLANNER_MEMORY += ("activation_bytes_per_token_layer",)
HF_IMPORT = ("read_hf_config", "hf_seed", "hf_state_dict", "INDEX_FILE", "SINGLE_FILE", "Progress")
TORCHTITAN_FORMAT = ("torchtitan_version", "torchtitan_name", "torchtitan_model_args", "TORCHTITAN_QKV")
TORCHTITAN_FORMAT += ("TORCHTITAN_LLAMA3_HEADS", "TORCHTITAN_LLAMA3_KEYS")
TP_DECODER = "titanlite.parallel.tensor_parallel.parallelize_decoder"
MOVED_NAMES: dict[tuple[str, str], str] = {  # (module, old name) -> the new full name
    (f"{P}.planner", "plan_run"): f"{P}.planner.estimate_run",
    (f"{P}.run_plan", "plan_run"): f"{P}.run_plan.plan_steps",
    **{(f"{P}.planner", n): f"{P}.memory.{n}" for n in PLANNER_MEMORY},
    ("titanlite.generate", "draw"): "titanlite.token_sampling.draw",
    ("titanlite.train", "set_seed"): f"{T}.trainer.set_seed",
    ("titanlite.train", "grad_accum_steps"): f"{T}.step.grad_accum_steps",
    ("titanlite.train", "REMOVED_METHODS"): f"{T}.trainer.REMOVED_METHODS",
    ("titanlite.train", "RESUMED"): "titanlite.checkpoint.layout.RESUMED",
    **{(HF, n): f"titanlite.checkpoint.hf_import.{n}" for n in HF_IMPORT},
    **{(HF, n): f"torchtitan_ext.compat.format.{n}" for n in TORCHTITAN_FORMAT},
    (HF, "model_args_from_seed"): "titanlite.checkpoint.seed_args.model_args_from_seed",
    (HF, "model_from_info"): "titanlite.checkpoint.hf_export.model_from_info",
    ("titanlite.parallel.tensor_parallel", "parallelize_decoder_ends"): TP_DECODER,
    **{
        (f"{m}.parallelize", "apply_tensor_parallel"): TP_DECODER
        for m in ("titanlite.models.llama3", "titanlite.models.moe")
    },
    ("torchtitan_ext.qwen3.parallelize", "apply_tensor_parallel"): TP_DECODER,
    **{(f"{C}.manager", n): f"{C}.state.{n}" for n in ("ModelState", "OptimizerState", "all_ranks_param_groups")},
    **{
        ("titanlite.data.prepare", n): f"titanlite.data.prepare_folder.{n}"
        for n in ("STATE", "JOURNAL", "shard_name", "mask_name")
    },
}

# Trainer methods of earlier versions and where their work went: titanlite.trainer.Trainer refuses a subclass
# that defines one (it would never be called)
REMOVED_METHODS = {
    "loss_fn": "build_loss() (it returns the token-sum loss function)",
    "forward_backward": "build_train_step() (a TrainStep: TrainStep.forward_backward)",
    "train_step": "build_train_step() (self.train_step is the TrainStep it returns)",
    "clip_grad_norm": "build_train_step() (TrainStep.reduce_step gives the norm, TrainStep.update clips)",
    "optimizer_step": "build_train_step() (TrainStep.update)",
    "model_inputs": "build_train_step() (titanlite.trainer.step.batch_to_device)",
    "autocast": "build_train_step() (TrainStep.autocast)",
    "dp_sum": "build_train_step() (TrainStep.dp_sum)",
    "step_record": "build_hooks() (titanlite.trainer.metrics.MetricsHook)",
    "log_step": "build_hooks() (titanlite.trainer.metrics.MetricsHook)",
    "is_log_step": "build_hooks() (titanlite.trainer.metrics.MetricsHook)",
    "log_summary": "build_hooks() (titanlite.trainer.metrics.MetricsHook)",
    "stop_on_signal": "build_hooks() (titanlite.trainer.preemption.PreemptionHook)",
    "build_dataloader": "build_train_dataloader(stage) (validation: build_val_loaders)",
    "enter_stage": "build_hooks() (titanlite.trainer.stages.StageHook)",
    "load_sources": "train_sources or build_val_loaders() (titanlite.data.recipe.load_sources)",
    "model_args_source": "__init__ (titanlite.checkpoint.layout.model_args_source)",
    "recorded_checkpoint": "resume_point() (titanlite.checkpoint.layout.recorded_checkpoint)",
}


def moved_message(old: str) -> str:
    return f"{old} has moved to {MOVED_MODULES[old]}"


class MovedModuleFinder(importlib.abc.MetaPathFinder):
    """First on ``sys.meta_path`` (no stale copy elsewhere answers for a moved module): a moved module is a
    ModuleNotFoundError naming its new place; any other is left to the next finder."""

    def find_spec(self, fullname, path, target=None):
        if fullname in MOVED_MODULES:
            raise ModuleNotFoundError(moved_message(fullname), name=fullname)
        return None


def install() -> None:
    if not any(isinstance(f, MovedModuleFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, MovedModuleFinder())


def moved_names(module: str):
    """A module ``__getattr__``: an old name raises ImportError naming the new one (``from m import old`` too)."""

    def __getattr__(name: str):
        if (new := MOVED_NAMES.get((module, name))) is not None:
            raise ImportError(f"{module}.{name} has moved: use {new}", name=module)
        if f"{module}.{name}" in MOVED_MODULES:  # from titanlite import metrics
            raise ModuleNotFoundError(moved_message(f"{module}.{name}"), name=f"{module}.{name}")
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__

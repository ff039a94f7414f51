"""Translate a torchtitan classic (v0.2.0 - v0.2.2) TOML train config into a titanlite config.

:func:`translate` reads the torchtitan file (plus ``--section.key value`` overrides in torchtitan's
vocabulary), starts from torchtitan's own defaults for everything the file leaves out (so an
omitted key means what it means in torchtitan, e.g. bf16 mixed precision and selective AC every 2nd
block), and produces the equivalent titanlite TOML tables plus the settings only the compat
trainer uses (where torchtitan checkpoints live, how to resume from them).

Three outcomes per key (the full table is in ``torchtitan_ext/compat/README.md``):

- **mapped**: same meaning in titanlite (renamed or moved where torchtitan renamed or moved it:
  ``[training] batch_size`` -> ``local_batch_size``, ``[training] tensor_parallel_degree`` ->
  ``[parallelism]``, ``[float8]`` -> ``[quantize.linear.float8]``, v0.2.1's ``[debug] seed`` ->
  ``[training] seed``, the pipeline-parallel degree, schedule, microbatch size and split ...);
- **ignored with one warning**: a feature titanlite lacks that does not change the math (a logger,
  a communication optimization, a debugging aid). Warned once per key, and only when the config
  actually asks for it (a value other than torchtitan's default);
- **refused** (:class:`CompatError`): a feature whose absence would train a different model or
  with different numerics: context / expert parallelism, MoE and other model families,
  rowwise float8 and MX converters, fault tolerance, optimizer-in-backward, plug-in code
  (``[experimental] custom_import``), loading HF weights, creating a seed checkpoint, bf16 training
  without float32 master weights (``[training] dtype``).

Keys that are not torchtitan's but are titanlite's (``[guard]``, ``[validation] dataset`` kinds,
``[job] dry_run`` ...) pass through unchanged, so one command line can mix both.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from titanlite.config import ConfigError, read_toml, sections, toml_value
from titanlite.errors import UserError

logger = logging.getLogger("torchtitan_ext.compat")

TITANLITE_SUBFOLDER = "titanlite"  # titanlite's own checkpoints go to <checkpoint.folder>/titanlite


class CompatError(UserError, ValueError):
    """A torchtitan setting titanlite cannot honor without changing the result (one-line message)."""


# --------------------------------------------------------------------------- torchtitan's defaults
# torchtitan's JobConfig defaults (torchtitan/config/job_config.py) for every key v0.2.0, v0.2.1 and v0.2.2
# document (a key one version dropped or added included), plus the older keys compat still reads. Where the
# versions disagree the v0.2.0 value is here and the later one in _ALSO_DEFAULT.
DEFAULTS: dict[str, dict[str, Any]] = {
    "job": {
        "config_file": None,
        "dump_folder": "./torchtitan/outputs",
        "description": "default job",
        "use_for_integration_test": False,
        "print_config": False,
        "save_config_file": None,
        "custom_config_module": "",
    },
    "profiling": {
        "enable_profiling": False,
        "save_traces_folder": "profile_traces",
        "profile_freq": 10,
        "profiler_active": 1,
        "profiler_warmup": 3,
        "enable_memory_snapshot": False,
        "save_memory_snapshot_folder": "memory_snapshot",
    },
    "metrics": {
        "log_freq": 10,
        "enable_tensorboard": False,
        "disable_color_printing": False,
        "save_tb_folder": "tb",
        "save_for_all_ranks": False,
        "enable_wandb": False,
    },
    "model": {
        "name": "llama3",
        "flavor": "debugmodel",
        "tokenizer_path": None,
        "hf_assets_path": None,  # torchtitan's is its repo's tests/assets/tokenizer: no file here, so ask for one
        "converters": [],
        "print_after_conversion": False,
    },
    "optimizer": {
        "name": "AdamW",
        "lr": 8e-4,
        "beta1": 0.9,
        "beta2": 0.95,
        "eps": 1e-8,
        "weight_decay": 0.1,
        "implementation": "fused",
        "early_step_in_backward": False,
    },
    "lr_scheduler": {
        "warmup_steps": 200,
        "total_steps": None,
        "decay_ratio": None,
        "decay_type": "linear",
        "min_lr_factor": 0.0,
    },
    "training": {
        "dataset": "c4_test",
        "dataset_path": None,
        "local_batch_size": 8,
        "global_batch_size": -1,
        "seq_len": 2048,
        "max_norm": 1.0,
        "steps": 10000,
        "enable_cpu_offload": False,
        "dtype": "float32",
        "mixed_precision_param": "bfloat16",
        "mixed_precision_reduce": "float32",
        "gc_freq": 50,
        "gc_debug": False,
        "seed": None,
        "deterministic": False,
    },
    "training.dataloader": {
        "num_workers": 0,
        "persistent_workers": False,
        "pin_memory": False,
        "prefetch_factor": None,
    },
    "parallelism": {
        "data_parallel_replicate_degree": 1,
        "enable_compiled_autograd": False,
        "data_parallel_shard_degree": -1,
        "fsdp_reshard_after_forward": "default",
        "tensor_parallel_degree": 1,
        "disable_loss_parallel": False,
        "enable_async_tensor_parallel": False,
        "pipeline_parallel_degree": 1,
        "module_fqns_per_model_part": None,
        "pipeline_parallel_first_stage_less_layers": 1,
        "pipeline_parallel_last_stage_less_layers": 1,
        "pipeline_parallel_split_points": [],
        "pipeline_parallel_layers_per_stage": None,
        "pipeline_parallel_schedule": "1F1B",
        "pipeline_parallel_schedule_csv": "",
        "pipeline_parallel_microbatch_size": 1,
        "pipeline_parallel_expert_parallel_overlap": True,
        "context_parallel_degree": 1,
        "context_parallel_load_balancer": "headtail",
        "context_parallel_rotate_method": "allgather",
        "expert_parallel_degree": 1,
        "expert_tensor_parallel_degree": 1,
        "expert_parallel_comm_backend": "standard",
    },
    "checkpoint": {
        "enable_checkpoint": False,
        "folder": "checkpoint",
        "initial_load_path": None,
        "initial_load_model_only": True,
        "initial_load_in_hf": False,
        "initial_load_in_hf_quantized": False,
        "enable_ft_dataloader_checkpoints": True,
        "load_only": False,
        "interval": 500,
        "last_save_model_only": True,
        "export_dtype": "float32",
        "create_seed_checkpoint": False,
        "async_mode": "disabled",
        "keep_latest_k": 10,
        "load_step": -1,
        "exclude_from_loading": [],
        "enable_first_step_checkpoint": False,
        "last_save_in_hf": False,
    },
    "activation_checkpoint": {
        "mode": "selective",
        "selective_ac_option": "2",
        "per_op_sac_force_recompute_mm_shapes_by_fqns": ["moe.router.gate"],
        "early_stop": False,
        "memory_budget": 0.5,
        "visualize_memory_budget_pareto": False,
        "preserve_rng_state": False,
        "determinism_check": "default",
        "debug": False,
    },
    "compile": {"enable": False, "components": ["model", "loss"], "backend": "inductor"},
    "quantize.linear.float8": {
        "enable_fsdp_float8_all_gather": False,
        "precompute_float8_dynamic_scale_for_fsdp": False,
        "force_recompute_fp8_weight_in_bwd": False,
        "recipe_name": None,
        "filter_fqns": [],  # v0.2.0 - v0.2.2 filter nothing by default (older torchtitan: ["output"])
        "emulate": False,
        "moe_fqns_prototype": [],
    },
    "quantize.linear.mx": {
        "mxfp8_dim1_cast_kernel_choice": "triton",
        "recipe_name": "mxfp8_cublas",
        "filter_fqns": ["output"],
    },
    "quantize.grouped_mm.float8": {"fqns": []},
    "quantize.grouped_mm.mx": {"recipe_name": "mxfp8", "fqns": []},
    "comm": {
        "init_timeout_seconds": 300,
        "train_timeout_seconds": 100,
        "trace_buf_size": 20000,
        "save_traces_folder": "comm_traces",
        "save_traces_file_prefix": "rank_",
        "mode": "default",
    },
    "memory_estimation": {"enable": False, "disable_fake_mode": False},
    "fault_tolerance": {
        "enable": False,
        "process_group": "gloo",
        "process_group_timeout_ms": 10000,
        "replica_id": 0,
        "group_size": 0,
        "min_replica_size": 1,
        "semi_sync_method": None,
        "sync_steps": 5,
        "should_quantize": False,
        "fragment_sync_delay": 0,
        "fragment_update_alpha": 0.0,
    },
    "experimental": {"custom_import": "", "custom_args_module": ""},
    "validation": {
        "enable": False,
        "dataset": "c4_validation",
        "dataset_path": None,
        "local_batch_size": 8,
        "seq_len": 2048,
        "freq": 10,
        "steps": -1,
    },
    "validation.dataloader": {
        "num_workers": 0,
        "persistent_workers": False,
        "pin_memory": False,
        "prefetch_factor": None,
    },
    "debug": {"deterministic_warn_only": False, "moe_force_load_balance": False},
}
# Defaults a later version changed: either value is "the default" (no warning).
_ALSO_DEFAULT = {
    ("job", "dump_folder"): "./outputs",  # v0.2.1+
    ("activation_checkpoint", "preserve_rng_state"): True,  # v0.2.2
}
# Types of the keys whose default is None (for command-line strings).
_NONE_TYPES = {
    ("lr_scheduler", "decay_ratio"): float,
    ("training", "seed"): int,
    ("parallelism", "pipeline_parallel_layers_per_stage"): int,
    ("lr_scheduler", "total_steps"): int,
    ("training.dataloader", "prefetch_factor"): int,
    ("validation.dataloader", "prefetch_factor"): int,
}
# None-default keys where an empty command-line value means the empty string, not None:
# ``--model.tokenizer_path ''`` asks for the built-in byte tokenizer.
_EMPTY_IS_EMPTY = {("model", "tokenizer_path"), ("model", "hf_assets_path")}

# Other spellings and locations -> the one compat reads: older ones (torchtitan moved or renamed them on the
# way to v0.2), and v0.2.1's [debug] section, which took seed and deterministic over from [training].
LEGACY: dict[tuple[str, str], tuple[str, str]] = {
    ("debug", "seed"): ("training", "seed"),
    ("debug", "deterministic"): ("training", "deterministic"),
    ("training", "debug_moe_force_load_balance"): ("debug", "moe_force_load_balance"),
    ("job", "print_args"): ("job", "print_config"),
    ("memory_estimation", "enabled"): ("memory_estimation", "enable"),
    ("training", "batch_size"): ("training", "local_batch_size"),
    ("training", "warmup_steps"): ("lr_scheduler", "warmup_steps"),
    ("training", "compile"): ("compile", "enable"),
    ("training", "data_parallel_replicate_degree"): ("parallelism", "data_parallel_replicate_degree"),
    ("training", "data_parallel_shard_degree"): ("parallelism", "data_parallel_shard_degree"),
    ("training", "tensor_parallel_degree"): ("parallelism", "tensor_parallel_degree"),
    ("training", "pipeline_parallel_degree"): ("parallelism", "pipeline_parallel_degree"),
    ("training", "context_parallel_degree"): ("parallelism", "context_parallel_degree"),
    ("experimental", "pipeline_parallel_degree"): ("parallelism", "pipeline_parallel_degree"),
    ("experimental", "context_parallel_degree"): ("parallelism", "context_parallel_degree"),
    ("training", "enable_async_tensor_parallel"): ("parallelism", "enable_async_tensor_parallel"),
    ("training", "enable_compiled_autograd"): ("parallelism", "enable_compiled_autograd"),
    ("lr_scheduler", "lr_min"): ("lr_scheduler", "min_lr_factor"),
    ("checkpoint", "enable"): ("checkpoint", "enable_checkpoint"),
    ("checkpoint", "model_weights_only"): ("checkpoint", "last_save_model_only"),
    ("validation", "enabled"): ("validation", "enable"),
}
_LEGACY_SECTIONS = {"float8": "quantize.linear.float8", "mx": "quantize.linear.mx"}
# Legacy keys with their own meaning (not a rename), with their old defaults.
_LEGACY_DEFAULTS = {
    ("training", "enable_loss_parallel"): True,
    ("quantize.linear.float8", "enable_float8_linear"): False,
    ("checkpoint", "interval_type"): "steps",
    ("metrics", "rank_0_only"): True,
}
for (_section, _key), _value in _LEGACY_DEFAULTS.items():
    DEFAULTS[_section][_key] = _value

# Keys that are silently dropped (cosmetic or bookkeeping, nothing to warn about).
SILENT = {
    ("job", "config_file"),
    ("job", "use_for_integration_test"),
    ("metrics", "disable_color_printing"),
    ("model", "print_after_conversion"),
    ("training", "gc_freq"),
    ("training", "gc_debug"),
    ("training", "enable_loss_parallel"),
    ("quantize.linear.float8", "enable_float8_linear"),
}

# Keys titanlite lacks, ignored with one warning when set to something other than the default.
IGNORED: dict[tuple[str, str], str] = {
    ("metrics", "enable_wandb"): "titanlite logs to TensorBoard and metrics.jsonl only",
    ("metrics", "save_for_all_ranks"): "titanlite logs rank 0 (every rank logs the same global values)",
    ("training", "enable_cpu_offload"): "no FSDP CPU offload in titanlite (memory only, same math)",
    ("parallelism", "enable_async_tensor_parallel"): "no async TP (a communication overlap, same math)",
    ("parallelism", "enable_compiled_autograd"): "no compiled autograd (speed only, same math)",
    ("parallelism", "context_parallel_rotate_method"): "no context parallelism",
    ("checkpoint", "interval_type"): "titanlite checkpoints every checkpoint.interval steps",
    ("metrics", "rank_0_only"): "titanlite logs rank 0",
    ("checkpoint", "enable_first_step_checkpoint"): "titanlite saves on the interval and at the last step",
    ("checkpoint", "last_save_in_hf"): "convert the last save with titanlite convert dcp-to-hf",
    ("checkpoint", "export_dtype"): "float16 exports are not supported; the export stays float32",
    ("activation_checkpoint", "per_op_sac_force_recompute_mm_shapes_by_fqns"): "a memory/speed knob (MoE routers)",
    ("activation_checkpoint", "early_stop"): "a recomputation speed knob, same math",
    ("quantize.linear.float8", "enable_fsdp_float8_all_gather"): "float8 all-gather saves bandwidth only: titanlite "
    "casts after the all-gather, same tensorwise scales",
    ("quantize.linear.float8", "precompute_float8_dynamic_scale_for_fsdp"): "a speed knob of float8 all-gather",
    ("quantize.linear.float8", "force_recompute_fp8_weight_in_bwd"): "a memory knob of float8 all-gather",
    ("quantize.linear.float8", "emulate"): "titanlite's float8 needs hardware float8 (or runs its own CPU path)",
    ("comm", "trace_buf_size"): "no NCCL flight recorder set-up in titanlite (set TORCH_NCCL_TRACE_BUFFER_SIZE)",
    ("comm", "save_traces_folder"): "no NCCL flight recorder set-up in titanlite",
    ("memory_estimation", "enable"): "torchtitan's estimation script reads it, its trainer does not: for a memory "
    "estimate run titanlite's dry run, --job.dry_run true (or titanlite estimate)",
    ("memory_estimation", "disable_fake_mode"): "use titanlite's dry run (--job.dry_run true)",
    ("validation", "local_batch_size"): "titanlite validates with training.local_batch_size (same per-token loss)",
    ("validation", "seq_len"): "titanlite validates with training.seq_len",
    # v0.2.0 - v0.2.2 keys
    ("job", "save_config_file"): "titanlite writes the config it runs to <dump_folder>/config.toml",
    ("debug", "deterministic_warn_only"): "titanlite's deterministic mode raises on an op without a deterministic "
    "kernel (torch.use_deterministic_algorithms(True)); the math is the same",
    ("debug", "moe_force_load_balance"): "an MoE routing aid; llama3 is dense, so it changes nothing",
    ("parallelism", "pipeline_parallel_expert_parallel_overlap"): "only used with pipeline and expert parallelism "
    "together (expert parallelism is refused)",
    ("parallelism", "expert_parallel_comm_backend"): "only used with expert parallelism (refused when on)",
    ("parallelism", "context_parallel_load_balancer"): "only used with context parallelism (refused when on)",
    ("checkpoint", "enable_ft_dataloader_checkpoints"): "only used with fault tolerance (refused when on)",
    ("checkpoint", "initial_load_in_hf_quantized"): "only used with initial_load_in_hf (refused when on)",
    ("checkpoint", "load_only"): "titanlite still saves its own checkpoints (under <checkpoint.folder>/titanlite, "
    "torchtitan's step folders stay untouched)",
    ("activation_checkpoint", "memory_budget"): "only used with mode = memory_budget",
    ("activation_checkpoint", "visualize_memory_budget_pareto"): "only used with mode = memory_budget",
    ("activation_checkpoint", "preserve_rng_state"): "llama3's forward draws no random numbers, so recomputation "
    "matches either way",
    ("activation_checkpoint", "determinism_check"): "an activation-checkpoint debugging aid",
    ("activation_checkpoint", "debug"): "an activation-checkpoint debugging aid",
    ("quantize.grouped_mm.float8", "fqns"): "MoE grouped GEMMs only (MoE models are refused)",
    ("quantize.grouped_mm.mx", "recipe_name"): "MoE grouped GEMMs only (MoE models are refused)",
    ("quantize.grouped_mm.mx", "fqns"): "MoE grouped GEMMs only (MoE models are refused)",
    ("quantize.linear.mx", "recipe_name"): "only used with the MX converter (refused)",
    ("quantize.linear.mx", "filter_fqns"): "only used with the MX converter (refused)",
    ("quantize.linear.mx", "mxfp8_dim1_cast_kernel_choice"): "only used with the MX converter (refused)",
    ("comm", "save_traces_file_prefix"): "no NCCL flight recorder set-up in titanlite",
    ("comm", "mode"): "titanlite has no LocalTensor simulation; it runs on the real ranks, with the same math",
}
for _section in ("training.dataloader", "validation.dataloader"):
    for _key in DEFAULTS[_section]:
        IGNORED[(_section, _key)] = "titanlite's own data loader (worker settings change speed, not the batches)"

# torchtitan's pipeline schedule names (torch's get_schedule_class, case-insensitive) titanlite runs, as it spells them.
PIPELINE_SCHEDULES = {name.lower(): name for name in sections.PIPELINE_SCHEDULES}  # torchtitan matches any case

# Unknown keys whose name says they touch the objective or the experts are refused, not ignored.
_MATH_WORDS = re.compile(r"loss|label_smoothing|z_loss|moe|expert|router|routing", re.IGNORECASE)

MOE_MODELS = {"deepseek_v3", "llama4", "qwen3_moe", "gpt_oss", "moe", "dsv3"}

# torchtitan llama3 flavors (torchtitan/models/llama3/__init__.py, v0.2.0 - v0.2.2) as titanlite llama3 flavors +
# overrides. v0.2 applies Llama 3.1 RoPE scaling (factor 8, low 1, high 4, original 8192) to every flavor. The
# vocabulary is the flavor's (torchtitan never resizes it to the tokenizer), so a torchtitan checkpoint's
# embedding fits. Flex (attn_type "flex") and varlen (attn_type "varlen", packed documents) attention with
# block-causal masks are both "attend within the token's own document": titanlite's block_causal mask, with
# its own kernel choice (flex on CUDA, SDPA + a boolean mask on CPU), the same math.
_ROPE31 = {
    "rope_theta": 500000.0,
    "rope_scaling_factor": 8.0,
    "rope_low_freq_factor": 1.0,
    "rope_high_freq_factor": 4.0,
    "rope_original_max_position": 8192,
}
_DEBUG = {
    "vocab_size": 2048,
    "dim": 256,
    "n_layers": 6,
    "n_heads": 16,
    "n_kv_heads": None,
    "multiple_of": 256,
    "ffn_dim_multiplier": None,
    "tie_word_embeddings": False,
    **_ROPE31,
}
_LLAMA31 = {"vocab_size": 128256}
_DOCUMENTS = {"attn_mask_type": "block_causal"}
LLAMA3_FLAVORS: dict[str, tuple[str, dict[str, Any]]] = {
    "debugmodel": ("debugmodel", dict(_DEBUG)),
    "debugmodel_flex_attn": ("debugmodel", {**_DEBUG, **_DOCUMENTS}),
    "debugmodel_varlen_attn": ("debugmodel", {**_DEBUG, **_DOCUMENTS}),  # v0.2.1+
    "8B": ("8B", dict(_LLAMA31)),
    "8B_flex": ("8B", {**_LLAMA31, **_DOCUMENTS}),  # v0.2.1+
    "8B_varlen": ("8B", {**_LLAMA31, **_DOCUMENTS}),  # v0.2.1+
    "70B": ("70B", dict(_LLAMA31)),
    "405B": ("405B", dict(_LLAMA31)),
}


@dataclasses.dataclass
class CompatSettings:
    """What the compat trainer needs beyond the titanlite config."""

    torchtitan_folder: str = ""  # <dump_folder>/<checkpoint.folder>: torchtitan's step-N folders ("" = off)
    load_step: int = -1  # torchtitan's checkpoint.load_step
    initial_load_path: str = ""  # a torchtitan-layout DCP folder to start from ("" = none)
    initial_load_model_only: bool = True
    exclude_from_loading: list[str] = dataclasses.field(default_factory=list)
    lr_total_steps: int | None = None  # torchtitan's lr_scheduler.total_steps (v0.2.2): None = training.steps
    warnings: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Translation:
    titanlite: dict[str, dict[str, Any]]  # titanlite TOML tables
    cli: list[str]  # titanlite-only command-line options, passed through verbatim
    settings: CompatSettings

    def toml(self) -> str:
        return to_toml(self.titanlite)


# --------------------------------------------------------------------------- reading


def titanlite_keys() -> dict[str, set[str]]:
    """titanlite's TOML sections and their keys, from the public ``JobConfig`` dataclasses."""
    from titanlite.config import JobConfig

    out = {}
    for f in dataclasses.fields(JobConfig):
        section = f.default_factory()
        name = f.metadata.get("toml") or f.name
        out[name] = {g.name for g in dataclasses.fields(section) if g.name != "overrides"}
    return out


def read_torchtitan_toml(path: str) -> dict[str, Any]:
    try:
        return read_toml(path)
    except ConfigError as e:
        raise CompatError(str(e).replace("config file", "torchtitan config", 1)) from None


def _flatten(table: dict[str, Any], prefix: str = "") -> dict[tuple[str, str], Any]:
    out: dict[tuple[str, str], Any] = {}
    for k, v in table.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else k))
        elif not prefix:
            out[("", k)] = v
        else:
            out[(prefix, k)] = v
    return out


def _split_cli(argv: Sequence[str]) -> list[tuple[str, Any]]:
    """``--name value`` / ``--name=value`` / bare ``--name`` (value True) as ``(name, value)`` pairs. A token that
    does not start with ``--`` is a value (so ``--x.y -1`` works); a value starting with ``--`` needs ``=``."""
    pairs: list[tuple[str, Any]] = []
    tokens = list(argv)
    while tokens:
        token = tokens.pop(0)
        if not token.startswith("--") or token == "--":
            raise CompatError(f"unexpected argument {token!r}; options look like --section.key value")
        name, eq, value = token[2:].partition("=")
        if eq:
            pairs.append((name, value))
        elif tokens and not tokens[0].startswith("--"):
            pairs.append((name, tokens.pop(0)))
        else:
            pairs.append((name, True))
    return pairs


def parse_cli(argv: Sequence[str]) -> tuple[str | None, list[tuple[str, str, Any]]]:
    """``--config PATH`` and ``--section.key value`` / ``--section.key=value`` / bare ``--section.flag``
    / ``--section.no_flag`` (torchtitan's spelling of false). Values stay strings (``True`` for bare)."""
    path, items = None, []
    for name, value in _split_cli(argv):
        if name == "config":
            path = value
            continue
        section, _, key = name.rpartition(".")
        if not section:
            raise CompatError(f"unknown option --{name}; options look like --section.key value")
        if key.startswith("no_") and value is True:
            key, value = key[3:], False
        items.append((section, key, value))
    return path, items


def _convert_cli(section: str, key: str, value: Any) -> Any:
    """A command-line string as the type of torchtitan's default for that key."""
    if not isinstance(value, str):
        return value
    default = DEFAULTS.get(section, {}).get(key)
    low = value.strip().lower()
    if default is None:
        if low in ("none", "null") or (low == "" and (section, key) not in _EMPTY_IS_EMPTY):
            return None
        tp = _NONE_TYPES.get((section, key), str)
        return tp(value)
    if isinstance(default, bool):
        if low in ("true", "1", "yes", "on"):
            return True
        if low in ("false", "0", "no", "off"):
            return False
        raise CompatError(f"--{section}.{key}: expected true or false, got {value!r}")
    if isinstance(default, int):
        return int(float(value)) if "e" in low or "." in low else int(value)
    if isinstance(default, float):
        return float(value)
    if isinstance(default, list):
        return [s.strip() for s in value.split(",") if s.strip()]
    return value


# --------------------------------------------------------------------------- translating


class _Warner:
    def __init__(self):
        self.seen: set[str] = set()
        self.messages: list[str] = []

    def __call__(self, key: str, msg: str) -> None:
        if key in self.seen:
            return
        self.seen.add(key)
        text = f"torchtitan compat: {key}: {msg}"
        self.messages.append(text)
        logger.warning(text)


def translate(path: str | None, argv: Sequence[str] = (), translate_only: bool = False) -> Translation:
    """Translate torchtitan file ``path`` plus torchtitan-style overrides ``argv`` (see module docstring).
    ``translate_only``: for printing only, so a tokenizer or dataset not found here is warned about, not refused."""
    raw = _flatten(read_torchtitan_toml(path)) if path else {}
    _, cli = parse_cli(argv)
    warn = _Warner()
    given: dict[tuple[str, str], Any] = {}
    passthrough_file: dict[tuple[str, str], Any] = {}
    passthrough_cli: list[str] = []
    tl_sections = titanlite_keys()

    spelled: dict[tuple[str, str, bool], tuple[str, Any]] = {}  # (section, key, from_cli) -> (as written, value)

    def accept(section: str, key: str, value: Any, from_cli: bool) -> None:
        written = f"{section}.{key}"
        section = _LEGACY_SECTIONS.get(section, section)
        if (section, key) in LEGACY:
            section, key = LEGACY[(section, key)]
        if from_cli:
            if section in DEFAULTS and key in DEFAULTS[section]:
                value = _convert_cli(section, key, value)
            elif section in tl_sections and (key in tl_sections[section] or section == "model"):
                passthrough_cli.extend([f"--{section}.{key}", "true" if value is True else str(value)])
                return
        if section in DEFAULTS and key in DEFAULTS[section]:
            _check_spellings(spelled, section, key, from_cli, written, value)
            given[(section, key)] = value
        elif section in tl_sections and key in tl_sections[section]:
            passthrough_file[(section, key)] = value  # a titanlite key: used as is
        elif _MATH_WORDS.search(f"{section}.{key}"):
            raise CompatError(
                f"{section}.{key}: an unknown setting of the loss / experts / routing; titanlite cannot "
                "tell whether ignoring it changes the math, so it refuses the config"
            )
        else:
            warn(f"{section}.{key}" if section else key, "not a torchtitan v0.2 key titanlite knows; ignored")

    for (section, key), value in raw.items():
        if section == "":
            warn(key, "top-level key outside any section; ignored")
            continue
        accept(section, key, value, False)
    for section, key, value in cli:
        accept(section, key, value, True)

    tt = copy.deepcopy(DEFAULTS)
    for (section, key), value in given.items():
        tt.setdefault(section, {})[key] = value
    if ("training", "enable_loss_parallel") in given:
        tt["parallelism"]["disable_loss_parallel"] = not given[("training", "enable_loss_parallel")]
    if given.get(("quantize.linear.float8", "enable_float8_linear")):
        tt["model"]["converters"] = list(tt["model"]["converters"]) + ["float8"]
    _refuse(tt, given)
    for section, key in given:
        if (section, key) in SILENT:
            continue
        reason = IGNORED.get((section, key))
        if reason is None:
            continue
        default = DEFAULTS.get(section, {}).get(key)
        value = tt[section][key]
        if key == "export_dtype" and value in ("float32", "bfloat16"):
            continue
        if (section, key) == ("comm", "mode") and value == "fake_backend":
            continue  # a dry run: mapped in _build
        if (section, key) in _ALSO_DEFAULT and value == _ALSO_DEFAULT[(section, key)]:
            continue
        if value != default and not (section == "validation" and _same_as_training(tt, key, value)):
            warn(f"{section}.{key}", f"ignored ({reason})")

    cli_model_keys = {arg[len("--model.") :] for arg in passthrough_cli[::2] if arg.startswith("--model.")}
    out, settings = _build(tt, warn, cli_model_keys, translate_only)
    for (section, key), value in passthrough_file.items():
        out.setdefault(section, {})[key] = value
    settings.warnings = warn.messages
    return Translation(out, passthrough_cli, settings)


def _check_spellings(spelled: dict, section: str, key: str, from_cli: bool, written: str, value: Any) -> None:
    """Two spellings of one setting (``[training] seed`` and ``[debug] seed``) in the same place must agree:
    which one torchtitan reads depends on its version, so a disagreement has no one meaning."""
    earlier = spelled.setdefault((section, key, from_cli), (written, value))
    if earlier[0] != written and earlier[1] != value:
        where = "on the command line" if from_cli else "in the file"
        raise CompatError(
            f"{earlier[0]}={earlier[1]!r} and {written}={value!r} {where} are the same setting "
            "(another torchtitan version's spelling) with different values; keep one"
        )


def _same_as_training(tt, key: str, value: Any) -> bool:
    return value == tt["training"].get(key)


def _refuse(tt: dict[str, dict[str, Any]], given) -> None:
    par, model = tt["parallelism"], tt["model"]
    name = str(model["name"])
    if name in MOE_MODELS or "moe" in name.lower():
        raise CompatError(
            f"model.name={name!r}: compat does not map torchtitan's mixture-of-experts models (their routing, "
            "expert parallelism and load balancing differ from titanlite's llama3_moe / qwen3_moe, which take "
            "titanlite configs); refused"
        )
    if name != "llama3":
        raise CompatError(
            f"model.name={name!r}: compat maps torchtitan's llama3 only (titanlite families: "
            "llama3 in core, qwen3 from torchtitan_ext.qwen3 with titanlite configs); refused"
        )
    for key, what in (
        ("context_parallel_degree", "context parallelism"),
        ("expert_parallel_degree", "expert parallelism"),
        ("expert_tensor_parallel_degree", "expert tensor parallelism"),
    ):
        if par.get(key, 1) > 1:
            why = (
                "titanlite has no context parallelism"
                if key.startswith("context")
                else "compat maps torchtitan's dense llama3, which has no experts (titanlite's MoE families take "
                "titanlite configs)"
            )
            raise CompatError(
                f"parallelism.{key}={par[key]}: {why}; running without {what} would need another layout (and batch "
                "or schedule) than the config states; refused"
            )
    converters = [str(c) for c in model.get("converters") or []]
    for c in converters:
        if c not in ("float8", "quantize.linear.float8"):
            raise CompatError(
                f"model.converters contains {c!r}: titanlite only has tensorwise float8 linears; "
                "running without this converter would change the numerics; refused"
            )
    f8 = tt["quantize.linear.float8"]
    if converters and f8.get("recipe_name") not in (None, "tensorwise"):
        raise CompatError(
            f"float8 recipe_name={f8['recipe_name']!r}: titanlite implements tensorwise scaling only "
            "(rowwise scales give different numerics); refused"
        )
    if f8.get("moe_fqns_prototype"):
        raise CompatError("quantize.linear.float8.moe_fqns_prototype: MoE float8 is not supported; refused")
    if tt["fault_tolerance"].get("enable"):
        raise CompatError(
            "fault_tolerance.enable=true: TorchFT replica groups (and semi-sync training) change how "
            "and when gradients are combined; refused"
        )
    if tt["optimizer"].get("early_step_in_backward"):
        raise CompatError(
            "optimizer.early_step_in_backward=true: steps each parameter during backward, without the "
            "global gradient clipping titanlite applies; refused"
        )
    if tt["optimizer"]["name"] not in ("AdamW", "Adam"):
        raise CompatError(f"optimizer.name={tt['optimizer']['name']!r}: only AdamW and Adam are supported; refused")
    for section, key in (
        ("experimental", "custom_import"),
        ("experimental", "custom_args_module"),
        ("job", "custom_config_module"),
    ):
        if tt[section].get(key):
            raise CompatError(
                f"{section}.{key}={tt[section][key]!r}: torchtitan plug-in code cannot run in "
                "titanlite (port it as a titanlite extension, [job] extensions); refused"
            )
    if tt["training"].get("dtype", "float32") != "float32":
        raise CompatError(
            f"training.dtype={tt['training']['dtype']!r}: torchtitan then keeps parameters, gradients and "
            "optimizer states in that dtype with no float32 master copy; titanlite always keeps float32 "
            "master weights (use training.mixed_precision_param for bf16 compute); refused"
        )
    ck = tt["checkpoint"]
    if ck.get("initial_load_in_hf"):
        raise CompatError(
            "checkpoint.initial_load_in_hf=true: convert the Hugging Face folder first "
            "(titanlite convert hf-to-dcp) and give the result as checkpoint.initial_load_path"
        )
    if ck.get("create_seed_checkpoint"):
        raise CompatError(
            "checkpoint.create_seed_checkpoint=true: titanlite needs no seed checkpoint (it initializes "
            "sharded models directly, see parallelism.weight_init); run the training without it"
        )
    if tt["training"].get("mixed_precision_reduce") not in ("float32", "bfloat16"):
        raise CompatError(f"training.mixed_precision_reduce={tt['training']['mixed_precision_reduce']!r}: unsupported")
    if tt["activation_checkpoint"]["mode"] not in ("none", "full", "selective", "memory_budget"):
        raise CompatError(f"activation_checkpoint.mode={tt['activation_checkpoint']['mode']!r}: unknown mode")


def _pipeline(par: dict[str, Any]) -> dict[str, Any]:
    """torchtitan's pipeline-parallel keys as titanlite's, or CompatError for what titanlite cannot split or schedule
    the same way. Without layers_per_stage or split points, titanlite splits the blocks evenly where torchtitan
    also weighs the embedding and output as a layer each: the end stages may hold one block more (where the work
    runs, not the math). With a degree of 1 torchtitan ignores the keys, and so does compat."""
    degree = int(par["pipeline_parallel_degree"])
    if degree <= 1:
        return {}
    key = "parallelism.pipeline_parallel"
    schedule = str(par["pipeline_parallel_schedule"])
    if par["pipeline_parallel_schedule_csv"]:
        raise CompatError(
            f"{key}_schedule_csv={par['pipeline_parallel_schedule_csv']!r}: titanlite runs torch's built-in "
            f"schedules only ({', '.join(PIPELINE_SCHEDULES.values())}), not a schedule read from a CSV file; refused"
        )
    if schedule.lower() not in PIPELINE_SCHEDULES:
        raise CompatError(
            f"{key}_schedule={schedule!r}: titanlite runs {', '.join(PIPELINE_SCHEDULES.values())}; refused"
        )
    for end in ("first", "last"):
        if par[f"pipeline_parallel_{end}_stage_less_layers"] != 1:
            raise CompatError(
                f"{key}_{end}_stage_less_layers={par[f'pipeline_parallel_{end}_stage_less_layers']}: titanlite has "
                f"no stage weighting; give the split as {key}_split_points (or _layers_per_stage) instead; refused"
            )
    if par.get("module_fqns_per_model_part"):
        raise CompatError(
            "parallelism.module_fqns_per_model_part: titanlite cuts stages at block boundaries only; give the "
            f"split as {key}_split_points (e.g. ['layers.4']) instead; refused"
        )
    if (layers := par["pipeline_parallel_layers_per_stage"]) is not None:
        raise CompatError(
            f"{key}_layers_per_stage={layers}: torchtitan counts the embedding and the output as one layer each in "
            f"it (first/last_stage_less_layers) and titanlite counts blocks only, so the stages would differ; give "
            f"the split as {key}_split_points instead; refused"
        )
    return {
        "pipeline_parallel_degree": degree,
        "pipeline_parallel_schedule": PIPELINE_SCHEDULES[schedule.lower()],
        "pipeline_parallel_microbatch_size": int(par["pipeline_parallel_microbatch_size"]),
        "pipeline_parallel_split_points": [str(p) for p in par["pipeline_parallel_split_points"]],
    }


def _dataset(section: str, tt_section: dict[str, Any], warn: _Warner | None = None) -> tuple[str, str]:
    """(titanlite dataset kind, path) for a torchtitan [training] / [validation] dataset. With ``warn`` (a
    translation only: nothing is read), a Hugging Face dataset without a local path is warned about and
    left as a placeholder path to fill in, instead of refused."""
    name, path = str(tt_section["dataset"]), tt_section.get("dataset_path") or ""
    if name in ("embedded", "shards", "text"):  # already a titanlite kind (e.g. from the command line)
        return name, path
    if path:
        if os.path.isfile(os.path.join(path, "manifest.json")):
            return "shards", path
        return "text", path
    how = (
        f"give --{section}.dataset_path (a local copy: JSON lines with a 'text' field, "
        f"text or Parquet files), or prepare shards with titanlite prepare and pass "
        f"--{section}.dataset shards --{section}.dataset_path DIR (or --{section}.dataset embedded for a "
        "smoke test)"
    )
    if warn is not None:
        warn(f"{section}.dataset", f"{name!r} is a Hugging Face dataset torchtitan downloads; before training, {how}")
        return "shards", f"<shards prepared from {name}>"
    raise CompatError(
        f"{section}.dataset={name!r} is a Hugging Face dataset torchtitan downloads; titanlite reads "
        f"local files only: {how}"
    )


def _tokenizer(model: dict[str, Any], warn: _Warner | None = None) -> str:
    """The tokenizer for titanlite from torchtitan's tokenizer_path / hf_assets_path: a tiktoken file, a
    tokenizer.json, or an HF folder holding ``original/tokenizer.model``, ``tokenizer.model`` or
    ``tokenizer.json``. With ``warn`` (a translation only), one not found here is kept as written, warned."""
    from titanlite.tokenizer.hf import resolve_tokenizer_file

    for key in ("tokenizer_path", "hf_assets_path"):
        path = model.get(key)
        if path is None:
            continue
        if path == "":
            return ""  # titanlite's built-in byte-level tokenizer (asked for explicitly)
        p = Path(path)
        if p.is_file():
            return str(p)
        for candidate in (p / "original" / "tokenizer.model", p / "tokenizer.model"):
            if candidate.is_file():
                return str(candidate)
        if p.is_dir() and (p / "tokenizer.json").is_file():
            return resolve_tokenizer_file(str(p))
        if warn is not None:
            warn(f"model.{key}", f"{path}: no tokenizer file there on this machine; kept as written")
            return str(p)
        raise CompatError(
            f"model.{key}={path}: no tokenizer there (titanlite reads a tiktoken file, a tokenizer.json, or an HF "
            "folder holding original/tokenizer.model, tokenizer.model or tokenizer.json); give "
            "--model.tokenizer_path FILE, or --model.tokenizer_path '' for the built-in byte tokenizer"
        )
    if warn is not None:
        warn("model.tokenizer_path", "the config names no tokenizer; the translation uses the built-in byte tokenizer")
        return ""
    raise CompatError(
        "the config names no tokenizer (model.hf_assets_path or model.tokenizer_path); give "
        "--model.tokenizer_path FILE, or --model.tokenizer_path '' for the built-in byte tokenizer"
    )


def _ac_mode(ac: dict[str, Any], warn: _Warner) -> str:
    """torchtitan's AC mode as titanlite's: ``memory_budget`` (a compiler-chosen subset of activations is
    recomputed) becomes ``full``; recomputing more costs time and recomputes the same values."""
    if ac["mode"] != "memory_budget":
        return ac["mode"]
    warn(
        "activation_checkpoint.mode",
        "'memory_budget' is not in titanlite; using 'full' (more recomputation, same math)",
    )
    return "full"


def _check_vocab(
    flavor: str, vocab: int, tokenizer: str, cli_model_keys: set[str], warn: _Warner, translate_only: bool = False
) -> None:
    """The torchtitan flavor fixes the vocabulary; say so when the tokenizer's differs (refuse a larger one:
    its ids would index past the embedding, in torchtitan too). ``--model.vocab_size`` decides instead."""
    if "vocab_size" in cli_model_keys:
        return
    from titanlite.tokenizer import build_tokenizer

    try:
        size = build_tokenizer(tokenizer).vocab_size
    except (OSError, ValueError) as e:
        if translate_only:  # nothing is read for a translation: the run checks it
            warn("model.tokenizer_path", f"{e}; its vocabulary is checked when the run starts")
            return
        raise CompatError(f"model.tokenizer_path: {e}") from None
    name = tokenizer or "the built-in byte tokenizer"
    if size > vocab:
        raise CompatError(
            f"model.flavor={flavor!r} has torchtitan's vocab_size {vocab:,} but {name} has {size:,} tokens; "
            f"give a tokenizer of at most {vocab:,} tokens, or --model.vocab_size {size} (not torchtitan's model)"
        )
    if size != vocab:
        warn(
            "model.vocab_size",
            f"kept torchtitan's {vocab:,} for flavor {flavor!r} ({name} has {size:,} tokens; the other rows "
            "are never used), so torchtitan checkpoints load; --model.vocab_size N to choose another",
        )


def _build(
    tt: dict[str, dict[str, Any]], warn: _Warner, cli_model_keys: set[str] = frozenset(), translate_only: bool = False
) -> tuple[dict[str, dict[str, Any]], CompatSettings]:
    job, model, opt, sched = tt["job"], tt["model"], tt["optimizer"], tt["lr_scheduler"]
    t, par, ck, ac, comp = (
        tt["training"],
        tt["parallelism"],
        tt["checkpoint"],
        tt["activation_checkpoint"],
        tt["compile"],
    )
    val, f8, prof, met, comm = (
        tt["validation"],
        tt["quantize.linear.float8"],
        tt["profiling"],
        tt["metrics"],
        tt["comm"],
    )

    flavor = str(model["flavor"])
    if flavor in LLAMA3_FLAVORS:
        tl_flavor, overrides = LLAMA3_FLAVORS[flavor]
        overrides = dict(overrides)
    else:
        from titanlite.models import get_model_spec

        if flavor not in get_model_spec("llama3").flavors:
            raise CompatError(
                f"model.flavor={flavor!r}: not a torchtitan llama3 flavor ({', '.join(LLAMA3_FLAVORS)}) "
                "nor a titanlite one"
            )
        warn("model.flavor", f"{flavor!r} is not a torchtitan llama3 flavor; using titanlite's llama3/{flavor}")
        tl_flavor, overrides = flavor, {}
    from titanlite.models import get_model_spec

    flavor_max = get_model_spec("llama3").flavors[tl_flavor].max_seq_len
    if t["seq_len"] > flavor_max:
        overrides["max_seq_len"] = int(t["seq_len"])
    lenient = warn if translate_only else None  # a translation reads no tokenizer or data
    tokenizer = _tokenizer(model, lenient)
    if "vocab_size" in overrides:
        _check_vocab(flavor, overrides["vocab_size"], tokenizer, cli_model_keys, warn, translate_only)
    steps = int(t["steps"])
    total = steps if sched["total_steps"] is None else int(sched["total_steps"])
    warmup = int(sched["warmup_steps"])
    if warmup > total:
        what = "training.steps" if sched["total_steps"] is None else "lr_scheduler.total_steps"
        warn("lr_scheduler.warmup_steps", f"{warmup} > {what} {total}: clamped to {total} (as torchtitan does)")
        warmup = total
    decay_ratio = sched["decay_ratio"]
    ddp_only = par["data_parallel_replicate_degree"] > 1 and par["data_parallel_shard_degree"] == 1
    float8 = any(str(c) in ("float8", "quantize.linear.float8") for c in model.get("converters") or [])
    export = ck["export_dtype"] if ck["export_dtype"] in ("float32", "bfloat16") else "float32"

    out: dict[str, dict[str, Any]] = {
        "job": {
            "dump_folder": job["dump_folder"],
            "description": job["description"],
            "print_config": job["print_config"],
        },
        "model": {
            "name": "llama3",
            "flavor": tl_flavor,
            "tokenizer_path": tokenizer,
            **{k: ("none" if v is None else v) for k, v in overrides.items()},
        },
        "optimizer": {
            "name": opt["name"],
            "lr": float(opt["lr"]),
            "eps": float(opt["eps"]),
            "beta1": float(opt["beta1"]),
            "beta2": float(opt["beta2"]),
            "weight_decay": float(opt["weight_decay"]),
            "implementation": opt["implementation"],
        },
        "lr_scheduler": {
            "warmup_steps": warmup,
            "decay_ratio": -1.0 if decay_ratio is None else float(decay_ratio),
            "decay_type": sched["decay_type"],
            "min_lr_factor": float(sched["min_lr_factor"]),
        },
        "training": {
            "local_batch_size": int(t["local_batch_size"]),
            "global_batch_size": int(t["global_batch_size"]),
            "seq_len": int(t["seq_len"]),
            "steps": steps,
            "max_norm": float(t["max_norm"]),
            "seed": 0 if t["seed"] is None else int(t["seed"]),
            "deterministic": bool(t["deterministic"]),
            "mixed_precision_param": t["mixed_precision_param"],
            "mixed_precision_reduce": t["mixed_precision_reduce"],
        },
        "metrics": {
            "log_freq": int(met["log_freq"]),
            "enable_tensorboard": bool(met["enable_tensorboard"]),
            "save_tb_folder": met["save_tb_folder"],
        },
        "profiling": {
            k: prof[k]
            for k in (
                "enable_profiling",
                "save_traces_folder",
                "profile_freq",
                "profiler_warmup",
                "profiler_active",
                "enable_memory_snapshot",
                "save_memory_snapshot_folder",
            )
        },
        "parallelism": {
            "data_parallel_replicate_degree": int(par["data_parallel_replicate_degree"]),
            "data_parallel_shard_degree": int(par["data_parallel_shard_degree"]),
            "tensor_parallel_degree": int(par["tensor_parallel_degree"]),
            "enable_loss_parallel": not par["disable_loss_parallel"],
            "fsdp_reshard_after_forward": par["fsdp_reshard_after_forward"],
            **_pipeline(par),
        },
        "comm": {
            "init_timeout_seconds": int(comm["init_timeout_seconds"]),
            "train_timeout_seconds": int(comm["train_timeout_seconds"]),
        },
        "activation_checkpoint": {"mode": _ac_mode(ac, warn), "selective_ac_option": str(ac["selective_ac_option"])},
        "compile": {"enable": bool(comp["enable"]), "components": list(comp["components"]), "backend": comp["backend"]},
        "quantize.linear.float8": {"enable": float8, "filter_fqns": list(f8["filter_fqns"])},
    }
    kind, path = _dataset("training", t, lenient)
    out["training"].update({"dataset": kind, "dataset_path": path})
    if val["enable"]:
        vkind, vpath = _dataset("validation", val, lenient)
        out["validation"] = {
            "enable": True,
            "dataset": vkind,
            "dataset_path": vpath,
            "freq": int(val["freq"]),
            "steps": int(val["steps"]),
        }
    else:
        out["validation"] = {"enable": False}
    if ddp_only:
        warn(
            "parallelism.data_parallel_replicate_degree",
            "DDP (replicate > 1, shard 1) runs as HSDP with a shard "
            "degree of 1 in titanlite: replicated parameters, all-reduced gradients, the same math",
        )

    if comm["mode"] == "fake_backend":
        warn("comm.mode", "'fake_backend' is torchtitan's dry run: mapped to titanlite's (job.dry_run = true)")
        out["job"]["dry_run"] = True
    settings = CompatSettings(
        exclude_from_loading=[str(x) for x in ck["exclude_from_loading"]],
        initial_load_model_only=bool(ck["initial_load_model_only"]),
        load_step=int(ck["load_step"]),
        lr_total_steps=None if sched["total_steps"] is None else total,
    )
    folder = os.path.join(job["dump_folder"], ck["folder"])
    own = os.path.join(folder, TITANLITE_SUBFOLDER)
    own_step = os.path.isdir(os.path.join(own, f"step-{ck['load_step']}"))
    out["checkpoint"] = {
        "enable": bool(ck["enable_checkpoint"]),
        "folder": os.path.join(ck["folder"], TITANLITE_SUBFOLDER),
        "interval": int(ck["interval"]),
        "async_mode": ck["async_mode"],
        "keep_latest_k": int(ck["keep_latest_k"]),
        "last_save_model_only": bool(ck["last_save_model_only"]),
        "export_dtype": export,
        "load_step": int(ck["load_step"]) if own_step else -1,
    }
    if ck["enable_checkpoint"]:
        settings.torchtitan_folder = folder
    init = ck["initial_load_path"]
    if init and not ck["enable_checkpoint"]:
        warn("checkpoint.initial_load_path", "ignored because checkpoint.enable_checkpoint is false (as in torchtitan)")
    elif init:
        if os.path.isfile(os.path.join(init, "checkpoint.json")):  # a titanlite checkpoint: titanlite loads it
            out["checkpoint"].update(
                {"initial_load_path": init, "initial_load_model_only": bool(ck["initial_load_model_only"])}
            )
        else:
            settings.initial_load_path = init
    return out, settings


# --------------------------------------------------------------------------- writing


def to_toml(tables: dict[str, dict[str, Any]]) -> str:
    lines = ["# titanlite config translated from a torchtitan config by torchtitan_ext.compat"]
    for name, table in tables.items():
        lines += ["", f"[{name}]"]
        lines += [f"{k} = {toml_value(v)}" for k, v in table.items() if v is not None]
    return "\n".join(lines) + "\n"


def load_translated(translation: Translation):
    """The titanlite :class:`~titanlite.config.JobConfig` of a translation, validated by titanlite's own loader
    (the translated tables, then the titanlite-only command-line options; no file is written)."""
    from titanlite.models import load_config

    tables = {name: {k: v for k, v in table.items() if v is not None} for name, table in translation.titanlite.items()}
    return load_config(translation.cli, tables=tables, tables_source="the translated torchtitan config")

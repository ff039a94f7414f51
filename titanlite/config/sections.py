"""One dataclass per TOML section.

Each field's ``metadata`` carries its one-line ``help`` and optional validation hints:
``choices`` (allowed values), ``min``/``max`` (inclusive numeric bounds) and ``gt`` (strict lower
bound). The parser (``titanlite.config.parser``) reads them for ``--help`` and for validation, so a
new key is added here and nowhere else. Names follow torchtitan's classic (v0.2) TOML layout.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


def opt(default: Any, help: str, **checks: Any) -> Any:
    """A dataclass field with a one-line help text and validation hints."""
    meta = {"help": help, **checks}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata=meta)
    return field(default=default, metadata=meta)


def section(cls: type, toml_name: str | None = None) -> Any:
    """A ``JobConfig`` attribute holding one section.

    The TOML table name is the attribute name unless ``toml_name`` is given; a dotted name declares
    a nested table, e.g. ``quantize_linear_float8: QuantizeLinearFloat8 = section(QuantizeLinearFloat8,
    "quantize.linear.float8")`` is read from ``[quantize.linear.float8]`` and set on the command line
    with ``--quantize.linear.float8.<key>``. A plain ``field(default_factory=cls)`` also works (TOML
    name = attribute name).
    """
    return field(default_factory=cls, metadata={"toml": toml_name} if toml_name else {})


@dataclass
class Job:
    dump_folder: str = opt("./outputs", "Folder for config.toml, metrics.jsonl, TensorBoard events and checkpoints.")
    description: str = opt("", "Free text describing the run; written to the log and config.toml.")
    print_config: bool = opt(False, "Log the fully resolved config at start.")


@dataclass
class Model:
    name: str = opt("llama3", "Model family, as registered in titanlite.models.")
    flavor: str = opt("debugmodel", "Size preset of the family (debugmodel, 1B, 3B, 8B, 70B, 405B for llama3).")
    tokenizer_path: str = opt("", "Tokenizer file; empty selects the built-in byte-level tokenizer.")
    # Any field of the family's model-args dataclass may also appear in [model] (or as
    # --model.<field>) and overrides the flavor; the parser validates those against the family.
    overrides: dict = opt({}, "Model-args fields that override the flavor (filled from extra [model] keys).")


@dataclass
class Optimizer:
    name: str = opt("AdamW", "Optimizer.", choices=["AdamW", "Adam"])
    lr: float = opt(8e-4, "Peak learning rate.", gt=0.0)
    eps: float = opt(1e-8, "Adam epsilon.", gt=0.0)
    beta1: float = opt(0.9, "Adam beta1.", min=0.0, max=1.0)
    beta2: float = opt(0.95, "Adam beta2.", min=0.0, max=1.0)
    weight_decay: float = opt(0.1, "Decoupled weight decay for matrices (embeddings, norms and biases get none).", min=0.0)
    implementation: str = opt("auto", "AdamW kernel: auto (fused on CUDA, foreach elsewhere), fused, foreach or for-loop.",
                              choices=["auto", "fused", "foreach", "for-loop"])


@dataclass
class LRScheduler:
    warmup_steps: int = opt(2, "Linear warmup steps from lr/(warmup_steps+1) to lr.", min=0)
    decay_ratio: float = opt(-1.0, "Fraction of the steps spent decaying at the end (WSD); -1 = all steps after warmup.")
    decay_type: str = opt("linear", "Shape of the decay.", choices=["linear", "cosine", "sqrt"])
    min_lr_factor: float = opt(0.0, "Final learning rate as a fraction of the peak.", min=0.0, max=1.0)


@dataclass
class Training:
    dataset: str = opt("embedded", "Training data: 'embedded' (built-in stdlib text), 'shards' (prepared by scripts/prepare_data.py) or 'text' (raw files, tokenized on the fly).")
    dataset_path: str = opt("", "Path for the dataset (shard folder, or text/JSONL file or folder).")
    local_batch_size: int = opt(8, "Sequences per micro-batch on each data-parallel rank.", min=1)
    global_batch_size: int = opt(-1, "Sequences per optimizer step over all ranks; -1 = local_batch_size x data-parallel degree (no accumulation).")
    seq_len: int = opt(256, "Tokens per training sequence.", min=1)
    steps: int = opt(50, "Optimizer steps to train.", min=1)
    max_norm: float = opt(1.0, "Gradient clipping max total norm; 0 disables clipping.", min=0.0)
    seed: int = opt(0, "Seed for weight init, data order and dropout-free randomness.", min=0)
    deterministic: bool = opt(False, "Use deterministic algorithms (slower on GPU).")
    mixed_precision_param: str = opt("float32", "Dtype for compute (autocast / FSDP param dtype).", choices=["float32", "bfloat16"])
    mixed_precision_reduce: str = opt("float32", "Dtype for gradient reduction.", choices=["float32", "bfloat16"])


@dataclass
class Metrics:
    log_freq: int = opt(10, "Log every N steps (and always at the first and last step).", min=1)
    enable_tensorboard: bool = opt(False, "Write TensorBoard event files.")
    save_tb_folder: str = opt("tb", "TensorBoard folder, relative to dump_folder.")


@dataclass
class Validation:
    enable: bool = opt(False, "Run validation during training.")
    dataset: str = opt("embedded", "Validation data, same choices as [training] dataset.")
    dataset_path: str = opt("", "Path for the validation dataset.")
    freq: int = opt(50, "Validate every N steps (and at the last step).", min=1)
    steps: int = opt(4, "Batches per validation; -1 = the whole held-out split.")


@dataclass
class JobConfig:
    """The whole run configuration: one attribute per TOML section, in TOML order.

    Later features add their section here (a dataclass above plus one line below). The TOML table
    name is the attribute name; declare a different (e.g. dotted, nested) one with
    ``section(cls, "a.b.c")``.
    """

    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    training: Training = field(default_factory=Training)
    metrics: Metrics = field(default_factory=Metrics)
    validation: Validation = field(default_factory=Validation)

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
    extensions: list[str] = opt([], "Python modules imported before the config's model is looked up, e.g. [\"torchtitan_ext.qwen3\"] (they register model families and other plug-ins).")
    world_size: int = opt(-1, "Number of processes (GPUs) this config is tuned for: the dry run's default and a start-up warning when the job runs on another count; -1 = not stated.", min=-1)
    dry_run: bool = opt(False, "Check the config at scale without GPUs: build the mesh with a fake process group, parallelize the model on the meta device, print per-rank parameters, sharding and the memory estimate, then exit.")
    dry_run_world_size: int = opt(-1, "World size simulated by dry_run; -1 = job.world_size, else the product of the explicit parallel degrees.", min=-1)
    dry_run_gpu: str = opt("H100", "GPU model the dry run compares its per-GPU memory estimate with (a name known to titanlite.metrics, e.g. H100, H200, A100 80GB).")


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
    log_update_ratio: bool = opt(True, "On logging steps, log ||update|| / ||parameters|| of the optimizer step (costs one parameter copy on those steps only).")
    update_ratio_per_layer: bool = opt(False, "Also log the update/parameter norm ratio of every transformer block and top-level module.")


@dataclass
class Profiling:
    enable_profiling: bool = opt(False, "Record torch.profiler traces (TensorBoard trace viewer / Perfetto) of chosen steps; nothing runs when false.")
    profile_freq: int = opt(10, "Trace the step at every multiple of this many steps (after profiler_warmup warm-up steps).", min=1)
    profiler_warmup: int = opt(3, "Steps the profiler runs without recording before each traced window.", min=0)
    profiler_active: int = opt(1, "Steps recorded in each traced window (the window ends at a multiple of profile_freq).", min=1)
    save_traces_folder: str = opt("profile_traces", "Trace folder, relative to dump_folder: iteration_<step>/rank<r>.pt.trace.json.")
    enable_memory_snapshot: bool = opt(False, "Record CUDA allocator history and dump a memory snapshot (open at pytorch.org/memory_viz) at the same steps; CUDA only.")
    save_memory_snapshot_folder: str = opt("memory_snapshot", "Memory-snapshot folder, relative to dump_folder: iteration_<step>/rank<r>_memory_snapshot.pickle.")


@dataclass
class Guard:
    policy: str = opt("raise", "On a non-finite loss or grad norm, or a loss spike: raise (stop with the step, loss and grad norm), skip_step (drop that optimizer update) or rollback (reload the last complete checkpoint and skip the offending batches).",
                      choices=["raise", "skip_step", "rollback"])
    spike_factor: float = opt(0.0, "A loss above spike_factor x its rolling mean is a spike (handled by policy); 0 disables spike detection (non-finite values are always checked).", min=0.0)
    spike_window: int = opt(50, "Number of recent accepted losses in the rolling mean.", min=1)
    spike_min_history: int = opt(20, "Spikes are only detected once this many losses are in the rolling window (early training falls fast).", min=1)
    max_consecutive_skips: int = opt(5, "skip_step: more consecutive skipped steps than this stops the run (it is diverging, not hiccuping).", min=0)
    max_rollbacks: int = opt(3, "rollback: more rollbacks than this in one run stops the run.", min=0)
    rollback_lr_factor: float = opt(1.0, "rollback: multiply the learning rate by this for rollback_lr_steps steps after a rollback.", gt=0.0)
    rollback_lr_steps: int = opt(0, "rollback: number of steps the learning-rate factor applies to.", min=0)
    rollback_skip_data: bool = opt(True, "rollback: skip the batches between the checkpoint and the offending step (inclusive) instead of replaying them.")
    debug_inject_nan_at_step: int = opt(-1, "TESTING ONLY: make step N's loss and one gradient NaN, once per process, to exercise the policy; -1 = off.", min=-1)


@dataclass
class Validation:
    enable: bool = opt(False, "Run validation during training.")
    dataset: str = opt("embedded", "Validation data, same choices as [training] dataset.")
    dataset_path: str = opt("", "Path for the validation dataset.")
    freq: int = opt(50, "Validate every N steps (and at the last step).", min=1)
    steps: int = opt(4, "Global batches (training.global_batch_size sequences) per validation; -1 = the whole held-out split.")


@dataclass
class Parallelism:
    data_parallel_replicate_degree: int = opt(1, "HSDP replicas: the model is fully replicated across this many groups (gradients all-reduced between them).", min=1)
    data_parallel_shard_degree: int = opt(-1, "FSDP degree: parameters, gradients and optimizer state are sharded over this many ranks; -1 = the ranks left over after the other degrees.", min=-1)
    tensor_parallel_degree: int = opt(1, "Tensor (+ sequence) parallel degree; ranks of one TP group are adjacent (same node).", min=1)
    enable_loss_parallel: bool = opt(True, "With TP: compute the cross-entropy on vocabulary-sharded logits (never gathers the full logits).")
    fsdp_reshard_after_forward: str = opt("default", "Free gathered parameters after forward: default (every group but the last, which backward needs first), always or never (more memory, fewer all-gathers).",
                                          choices=["default", "always", "never"])
    weight_init: str = opt("auto", "How sharded weights are initialized: sharded (init_weights on each shard; needs DTensor random support, i.e. CUDA), rank0 (rank 0 initializes a full CPU copy exactly like a single CPU process and broadcasts it; same weights as a one-process CPU run), auto (sharded on CUDA, rank0 elsewhere).",
                           choices=["auto", "sharded", "rank0"])


@dataclass
class Comm:
    init_timeout_seconds: int = opt(300, "Timeout for the process-group start-up and the first training step (compilation included).", min=1)
    train_timeout_seconds: int = opt(100, "Timeout of any collective after the first step: a hung rank fails the job with an error instead of hanging.", min=1)


@dataclass
class ActivationCheckpoint:
    mode: str = opt("none", "Recompute activations in backward to save memory: none, full (whole blocks) or selective.",
                    choices=["none", "full", "selective"])
    selective_ac_option: str = opt("op", "For mode = selective: 'op' (save matmul/attention outputs, recompute the rest) or an integer N as a string (checkpoint every N-th block).")


@dataclass
class Compile:
    enable: bool = opt(False, "torch.compile the components below (each transformer block separately).")
    components: list[str] = opt(["model", "loss"], "What to compile when enabled.", choices=["model", "loss"])


@dataclass
class QuantizeLinearFloat8:
    enable: bool = opt(False, "Swap eligible nn.Linear layers for float8 (tensorwise scaling: e4m3 weights/activations, e5m2 gradients).")
    filter_fqns: list[str] = opt(["output"], "Linears whose qualified name contains any of these strings stay in high precision.")


@dataclass
class Checkpoint:
    enable: bool = opt(False, "Save checkpoints, and resume from the newest complete one in the folder at start.")
    folder: str = opt("checkpoint", "Checkpoint folder, relative to dump_folder; each save is a step-N sub-folder.")
    interval: int = opt(500, "Save every N steps (and always at the last step).", min=1)
    async_mode: str = opt("disabled", "disabled: the loop waits for the whole save; async: the state is copied to fresh CPU memory while the next step computes (waited for before its optimizer step) and written in the background; async_with_pinned_mem: the same into CPU buffers kept for the run (page-locked on CUDA).",
                          choices=["disabled", "async", "async_with_pinned_mem"])
    keep_latest_k: int = opt(10, "Keep the newest K complete checkpoints (older ones are deleted once a newer one is complete; the newest resumable one is always kept); 0 keeps all.", min=0)
    last_save_model_only: bool = opt(True, "The save at the last step holds the model weights only (in export_dtype), for export and conversion.")
    export_dtype: str = opt("float32", "Dtype of the weights in a model-only last save.", choices=["float32", "bfloat16"])
    load_step: int = opt(-1, "Resume from this step's checkpoint (an error if it does not exist); -1 = the newest complete one.", min=-1)
    initial_load_path: str = opt("", "A checkpoint step folder (e.g. from scripts/convert_hf_to_dcp.py) loaded when there is nothing to resume.")
    initial_load_model_only: bool = opt(True, "Load only the model weights from initial_load_path (false: also optimizer, LR schedule, data position and step).")


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
    profiling: Profiling = field(default_factory=Profiling)
    guard: Guard = field(default_factory=Guard)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    parallelism: Parallelism = field(default_factory=Parallelism)
    comm: Comm = field(default_factory=Comm)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: Compile = field(default_factory=Compile)
    quantize_linear_float8: QuantizeLinearFloat8 = section(QuantizeLinearFloat8, "quantize.linear.float8")

"""One dataclass per TOML section (torchtitan's classic names), with its cross-field rules in ``validate()``.

A field's metadata holds its ``help`` and checks (``choices``, inclusive ``min``/``max``, strict ``gt``) that the
parser applies and lists in ``--help``: a new key is added here only. The README explains the keys at length."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from titanlite.config.data_tables import STAGE_KEYS, check_dataset, check_mixture, check_tables
from titanlite.errors import ConfigError

# torch.distributed.pipelining schedules by their torchtitan names (titanlite.parallel.pipeline)
PIPELINE_SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")


def opt(default: Any, help: str, **checks: Any) -> Any:
    """A dataclass field with a one-line help text and checks (``choices``, ``min``, ``max``, ``gt``); ``path=True``:
    a file or folder path, whose leading ``~`` the loader expands to the home folder."""
    meta = {"help": help, **checks}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata=meta)
    return field(default=default, metadata=meta)


def section(cls: type, toml_name: str | None = None) -> Any:
    """A ``JobConfig`` section read from ``[toml_name]`` (default: the attribute name; dotted = nested tables)."""
    return field(default_factory=cls, metadata={"toml": toml_name} if toml_name else {})


@dataclass
class Job:
    dump_folder: str = opt(
        "./outputs", "Folder for config.toml, metrics, TensorBoard events and checkpoints.", path=True
    )
    description: str = opt("", "Free text describing the run (logged and written to config.toml).")
    print_config: bool = opt(False, "Log the fully resolved config at start.")
    extensions: list[str] = opt([], "Modules imported before [model] is checked; they register models and plug-ins.")
    trainer: str = opt("default", "Trainer class by registered name (an extension may register a subclass).")
    world_size: int = opt(-1, "Process count the config is for (dry-run default; warned if not); -1 = unset.", min=-1)
    dry_run: bool = opt(False, "Check the layout and memory at scale on a fake process group (no GPUs), then exit.")
    dry_run_world_size: int = opt(-1, "World size of the dry run; -1 = world_size, else the parallel degrees.", min=-1)
    dry_run_gpu: str = opt("H100", "GPU whose memory the dry run compares with (H100, H200, A100 80GB, ...).")


@dataclass
class Model:
    name: str = opt("llama3", "Model family, as registered in titanlite.models.")
    flavor: str = opt("debugmodel", "Size preset of the family (llama3: debugmodel, 1B, 3B, 8B, 70B, 405B).")
    tokenizer_path: str = opt("", "Tokenizer file; empty = the built-in byte-level tokenizer.", path=True)
    overrides: dict = opt({}, "Model-args fields overriding the flavor: the extra [model] keys, never set directly.")


@dataclass
class Optimizer:
    name: str = opt("AdamW", "Optimizer by registered name: AdamW, Adam and muon built in, extensions may add more.")
    lr: float = opt(8e-4, "Peak learning rate.", gt=0.0)
    eps: float = opt(1e-8, "Adam epsilon.", gt=0.0)
    beta1: float = opt(0.9, "Adam beta1.", min=0.0, max=1.0)
    beta2: float = opt(0.95, "Adam beta2.", min=0.0, max=1.0)
    weight_decay: float = opt(0.1, "Decoupled weight decay of matrices (not embeddings, norms, biases).", min=0.0)
    implementation: str = opt("auto", "Kernel (auto: fused on CUDA).", choices=["auto", "fused", "foreach", "for-loop"])
    # name = "muon": Muon for the hidden matrices, AdamW (the keys above) for the rest (docs/muon.md)
    muon_lr: float = opt(-1.0, "Muon's peak learning rate; -1 = lr (with adjust_lr_fn match_rms_adamw).")
    momentum: float = opt(0.95, "Muon momentum.", min=0.0, max=1.0)
    nesterov: bool = opt(True, "Muon: Nesterov momentum.")
    ns_steps: int = opt(5, "Muon: Newton-Schulz iterations.", min=1, max=99)
    ns_coefficients: list[float] = opt([3.4445, -4.775, 2.0315], "Muon: the quintic's (a, b, c).")
    ns_dtype: str = opt(
        "auto", "Muon: Newton-Schulz dtype (auto: bf16 on GPU).", choices=["auto", "bfloat16", "float32"]
    )
    adjust_lr_fn: str = opt(
        "match_rms_adamw", "Muon update scale: 0.2*sqrt(max(m,n)) or sqrt(max(1,m/n)).",
        choices=["match_rms_adamw", "original"],
    )  # fmt: skip
    muon_params: list[str] = opt([], "Muon: name patterns (fnmatch) of matrices moved to Muon.")
    adamw_params: list[str] = opt([], "Muon: name patterns (fnmatch) of parameters moved to AdamW.")

    def validate(self) -> None:
        if len(self.ns_coefficients) != 3:
            raise ConfigError(f"optimizer.ns_coefficients must be 3 numbers (a, b, c), got {self.ns_coefficients}")


@dataclass
class LRScheduler:
    name: str = opt("warmup_stable_decay", "LR schedule by registered name.")
    warmup_steps: int = opt(2, "Linear warmup steps from lr/(warmup_steps+1) to lr.", min=0)
    decay_ratio: float = opt(-1.0, "Fraction of the steps decaying at the end; -1 = all steps after warmup.")
    decay_type: str = opt("linear", "Shape of the decay.", choices=["linear", "cosine", "sqrt"])
    min_lr_factor: float = opt(0.0, "Final learning rate as a fraction of the peak.", min=0.0, max=1.0)

    def validate(self) -> None:
        if self.decay_ratio != -1 and not 0.0 <= self.decay_ratio <= 1.0:
            raise ConfigError(f"lr_scheduler.decay_ratio ({self.decay_ratio}) must be -1 or in [0, 1]")


@dataclass
class Training:
    dataset: str = opt("embedded", "embedded (built-in text), shards (titanlite prepare) or text (raw files).")
    dataset_path: str = opt("", "Shard folder, or text/JSONL file or folder.", path=True)
    loss: str = opt("cross_entropy", "Loss by registered name: a token-sum fn (logits, labels) -> loss.")
    loss_chunks: int = opt(8, "Output layer + loss in this many pieces of tokens, no full logits; 0 = off.", min=0)
    local_batch_size: int = opt(8, "Sequences per micro-batch on each data-parallel rank.", min=1)
    global_batch_size: int = opt(-1, "Sequences per optimizer step, all ranks; -1 = no accumulation.")
    mixture: list[dict] = opt(
        [], "Weighted sources [{path, weight[, name, dataset]}, ...] instead of dataset/dataset_path (TOML only)."
    )
    mixture_on_exhausted: str = opt("wrap", "A mixture source read to its end.", choices=["wrap", "stop"])
    loss_mask: str = opt("none", "assistant: loss on chat data's assistant tokens only.", choices=["none", "assistant"])
    seq_len: int = opt(256, "Tokens per training sequence.", min=1)
    seq_len_schedule: list[dict] = opt(
        [], "Stages [{seq_len, fraction | steps[, global_batch_size]}, ...] (TOML only); [] = seq_len throughout."
    )
    steps: int = opt(50, "Optimizer steps to train (unless tokens is set).", min=1)
    tokens: int = opt(-1, "Token budget: train this many tokens instead of steps; -1 = use steps.", min=-1)
    max_norm: float = opt(1.0, "Gradient clipping max total norm; 0 disables clipping.", min=0.0)
    seed: int = opt(0, "Seed for weight init and data order.", min=0, max=2**32 - 1)
    deterministic: bool = opt(False, "Use deterministic algorithms (slower on GPU).")
    mixed_precision_param: str = opt("float32", "Compute dtype (autocast / FSDP).", choices=["float32", "bfloat16"])
    sdpa_kernel: str = opt(
        "auto",
        "SDPA kernel tried first on CUDA (auto: torch's order); the others follow in torch's order. CPU: torch's pick.",
        choices=["auto", "cudnn", "flash", "efficient", "math"],
    )
    mixed_precision_reduce: str = opt("float32", "Gradient-reduction dtype.", choices=["float32", "bfloat16"])

    def validate(self) -> None:
        g, b = self.global_batch_size, self.local_batch_size
        if g != -1 and (g <= 0 or g % b):
            raise ConfigError(f"training.global_batch_size ({g}) must be -1 or a multiple of local_batch_size ({b})")
        if self.tokens == 0:
            raise ConfigError("invalid value 0 for 'training.tokens': must be -1 (use training.steps) or >= 1")
        if self.mixture:
            check_mixture("training.mixture", self.mixture)
            if self.dataset != "embedded" or self.dataset_path:
                raise ConfigError("set training.mixture or training.dataset/dataset_path, not both")
        else:
            check_dataset("training", self.dataset, self.dataset_path)
        check_tables("training.seq_len_schedule", self.seq_len_schedule, STAGE_KEYS, ("seq_len",))


@dataclass
class Metrics:
    log_freq: int = opt(10, "Log every N steps (and at the first and last step).", min=1)
    enable_tensorboard: bool = opt(False, "Write TensorBoard event files.")
    save_tb_folder: str = opt("tb", "TensorBoard folder, relative to dump_folder.")
    log_update_ratio: bool = opt(True, "Log ||update|| / ||params|| on logging steps (one parameter copy).")
    update_ratio_per_layer: bool = opt(False, "Also log that ratio per transformer block and top-level module.")
    enable_wandb: bool = opt(False, "Also log to Weights & Biases (rank 0; needs pip install 'titanlite[wandb]').")
    wandb_project: str = opt("titanlite", "W&B project.")
    wandb_run_name: str = opt("", "W&B run name; empty = W&B's own. A resumed run continues its W&B run.")
    wandb_mode: str = opt("online", "W&B mode.", choices=["online", "offline", "disabled"])


@dataclass
class Profiling:
    enable_profiling: bool = opt(False, "Record torch.profiler traces of chosen steps.")
    profile_freq: int = opt(10, "Trace the step at every multiple of N steps.", min=1)
    profiler_warmup: int = opt(3, "Profiler steps without recording before each traced window.", min=0)
    profiler_active: int = opt(1, "Steps recorded per traced window.", min=1)
    save_traces_folder: str = opt("profile_traces", "Trace folder, relative to dump_folder.")
    enable_memory_snapshot: bool = opt(False, "Dump a CUDA memory snapshot at the same steps (CUDA only).")
    save_memory_snapshot_folder: str = opt("memory_snapshot", "Memory-snapshot folder, relative to dump_folder.")


@dataclass
class Guard:
    policy: str = opt("raise", "On a non-finite or spiking loss.", choices=["raise", "skip_step", "rollback"])
    spike_factor: float = opt(0.0, "Loss > factor x rolling mean is a spike; 0 = no spike detection.", min=0.0)
    spike_window: int = opt(50, "Recent accepted losses in the rolling mean.", min=1)
    spike_min_history: int = opt(20, "Losses in the window before spikes are detected.", min=1)
    max_consecutive_skips: int = opt(5, "skip_step: more consecutive skips than this stop the run.", min=0)
    max_rollbacks: int = opt(3, "rollback: more rollbacks than this stop the run.", min=0)
    rollback_lr_factor: float = opt(1.0, "rollback: LR factor for rollback_lr_steps steps after a rollback.", gt=0.0)
    rollback_lr_steps: int = opt(0, "rollback: steps the LR factor applies to.", min=0)
    rollback_skip_data: bool = opt(True, "rollback: skip the batches up to the offending step instead of replaying.")
    debug_inject_nan_at_step: int = opt(-1, "TESTING ONLY: make step N's loss NaN once; -1 = off.", min=-1)


@dataclass
class Validation:
    enable: bool = opt(False, "Run validation during training.")
    dataset: str = opt("", "Validation data, kinds as [training]; empty = the training data's held-out split.")
    dataset_path: str = opt("", "Path for the validation dataset.", path=True)
    mixture: list[dict] = opt([], "Sources [{path, weight[, name, dataset]}]: a loss each, val_loss weighted (TOML).")
    freq: int = opt(50, "Validate every N steps (and at the last step).", min=1)
    steps: int = opt(4, "Global batches per validation; -1 = the whole held-out split.")

    def validate(self) -> None:
        if self.steps != -1 and self.steps < 1:
            raise ConfigError(f"invalid value {self.steps} for 'validation.steps': must be -1 (whole split) or >= 1")
        if self.mixture:
            check_mixture("validation.mixture", self.mixture)
            if self.dataset not in ("", "embedded") or self.dataset_path:
                raise ConfigError("set validation.mixture or validation.dataset/dataset_path, not both")
        elif not self.dataset and self.dataset_path:  # the path would be ignored, as with "embedded"
            raise ConfigError(
                f"validation.dataset_path = {self.dataset_path!r} is ignored by validation.dataset = '' (the training "
                "data's held-out split): set validation.dataset = 'shards' or 'text' to use it, or leave "
                "validation.dataset_path empty"
            )
        elif self.dataset:  # empty: the training data's held-out split
            check_dataset("validation", self.dataset, self.dataset_path)


@dataclass
class Sampling:
    enable: bool = opt(False, "Complete fixed prompts during training; rank 0 logs the text (titanlite.generate).")
    prompts: list[str] = opt(["The meaning of life is", "Once upon a time"], "Prompts completed every freq steps.")
    freq: int = opt(100, "Sample every N steps (and at the last step).", min=1)
    max_new_tokens: int = opt(32, "Tokens generated per prompt (fewer if EOS comes first).", min=1)
    temperature: float = opt(0.0, "Sampling temperature; 0 = greedy.", min=0.0)
    top_k: int = opt(0, "Sample among the k likeliest tokens; 0 = all.", min=0)
    top_p: float = opt(1.0, "Sample among the likeliest tokens holding this probability; 1 = all.", gt=0.0, max=1.0)
    seed: int = opt(0, "Seed of the sampler's own generator (the training RNG is never touched).", min=0, max=2**32 - 1)
    chat: bool = opt(False, "Prompt as a user turn of the Llama 3 chat template; the reply ends at <|eot_id|>.")
    compile: bool = opt(False, "Compile the one-token decode step (CUDA graphs on CUDA): once, then every sample.")


EVAL_TASKS = ["hellaswag", "arc_easy", "arc_challenge", "piqa", "lambada_openai"]


@dataclass
class Eval:
    enable: bool = opt(False, "Score downstream tasks during training (titanlite.eval).")
    tasks: list[str] = opt(list(EVAL_TASKS), "Tasks by registered name.")
    data_dir: str = opt("", "Folder with the tasks' data files (hellaswag/, arc/, piqa/, lambada/).", path=True)
    freq: int = opt(500, "Evaluate every N steps (and at the last step).", min=1)
    limit: int = opt(-1, "First N items of each task; -1 = all.", min=-1)
    batch_size: int = opt(16, "Sequences per scoring forward pass on each data-parallel rank.", min=1)

    def validate(self) -> None:
        if self.enable and not self.data_dir:
            raise ConfigError("eval.data_dir must name the folder holding the tasks' data when eval.enable = true")
        if self.enable and not self.tasks:
            raise ConfigError("eval.tasks is empty: name at least one task, or set eval.enable = false")
        if repeated := sorted({t for t in self.tasks if self.tasks.count(t) > 1}):
            raise ConfigError(f"eval.tasks names {repeated[0]!r} more than once: name each task once")
        if self.limit == 0:
            raise ConfigError("invalid value 0 for 'eval.limit': must be -1 (every item) or >= 1")


@dataclass
class Parallelism:
    data_parallel_replicate_degree: int = opt(1, "HSDP replica groups (gradients all-reduced).", min=1)
    data_parallel_shard_degree: int = opt(-1, "FSDP degree; -1 = the ranks left by the other degrees.", min=-1)
    tensor_parallel_degree: int = opt(1, "Tensor (+ sequence) parallel degree.", min=1)
    context_parallel_degree: int = opt(1, "Ranks splitting each sequence (K/V all-gathered); FSDP spans them.", min=1)
    enable_loss_parallel: bool = opt(True, "With TP: cross-entropy on vocabulary-sharded logits.")
    fsdp_reshard_after_forward: str = opt(
        "default",
        "Reshard after forward (default: all but the last group; none with PP).",
        choices=["default", "always", "never"],
    )
    weight_init: str = opt("auto", "auto = sharded on CUDA, rank0 elsewhere.", choices=["auto", "sharded", "rank0"])
    pipeline_parallel_degree: int = opt(1, "Pipeline stages' ranks (torch.distributed.pipelining); outermost.", min=1)
    pipeline_parallel_schedule: str = opt("1F1B", "Pipeline schedule.", choices=list(PIPELINE_SCHEDULES))
    pipeline_parallel_microbatch_size: int = opt(1, "Sequences per pipeline microbatch.", min=1)
    pipeline_parallel_layers_per_stage: int = opt(-1, "Transformer blocks per stage; -1 = split evenly.", min=-1)
    pipeline_parallel_split_points: list[str] = opt([], "Modules that start a new stage, e.g. ['layers.4'].")
    expert_parallel_degree: int = opt(1, "MoE experts sharded over this factor of data_parallel_shard_degree.", min=1)
    expert_tensor_parallel_degree: int = opt(1, "Tensor parallelism inside experts: not built, must be 1.", min=1)

    def validate(self) -> None:
        if self.expert_tensor_parallel_degree != 1:
            raise ConfigError(
                f"parallelism.expert_tensor_parallel_degree={self.expert_tensor_parallel_degree} is not supported: "
                "titanlite does not shard experts with tensor parallelism (set it to 1; use expert_parallel_degree)"
            )
        if self.pipeline_parallel_layers_per_stage == 0:
            raise ConfigError("parallelism.pipeline_parallel_layers_per_stage must be -1 (split evenly) or >= 1")
        if self.pipeline_parallel_split_points and self.pipeline_parallel_layers_per_stage != -1:
            raise ConfigError(
                "set one of parallelism.pipeline_parallel_split_points and pipeline_parallel_layers_per_stage, not both"
            )


@dataclass
class Comm:
    init_timeout_seconds: int = opt(300, "Timeout of the start-up and the first step (compilation included).", min=1)
    train_timeout_seconds: int = opt(100, "Timeout of any later collective (a hung rank fails the job).", min=1)


@dataclass
class ActivationCheckpoint:
    mode: str = opt("none", "Recompute activations in backward.", choices=["none", "full", "selective"])
    selective_ac_option: str = opt("op", "selective: 'op' (save matmuls/attention) or N (every N-th block).")


@dataclass
class Compile:
    enable: bool = opt(False, "torch.compile the components below (each block separately).")
    components: list[str] = opt(["model", "loss"], "What to compile.", choices=["model", "loss"])
    backend: str = opt(
        "inductor",
        "torch.compile backend: inductor (generated kernels), aot_eager (traced graphs, eager kernels), eager.",
        choices=["inductor", "aot_eager", "eager"],
    )
    mode: str = opt(
        "default",
        "Inductor's mode; reduce-overhead replays each compiled region as a CUDA graph (on CUDA only).",
        choices=["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"],
    )

    def validate(self) -> None:
        if self.mode != "default" and self.backend != "inductor":
            raise ConfigError(
                f"compile.mode = {self.mode!r} needs compile.backend = 'inductor' (got {self.backend!r}): "
                "the modes are inductor's"
            )


@dataclass
class QuantizeLinearFloat8:
    enable: bool = opt(False, "Float8 nn.Linear layers (torch._scaled_mm).")
    filter_fqns: list[str] = opt(["output"], "Linears whose name contains any of these stay in high precision.")
    recipe_name: str = opt(
        "tensorwise", "Scales: per tensor, or per row (all e4m3).", choices=["tensorwise", "rowwise"]
    )
    enable_fsdp_float8_all_gather: bool = opt(False, "FSDP all-gathers float8 weights (tensorwise only).")

    def validate(self) -> None:
        if self.enable_fsdp_float8_all_gather and self.recipe_name != "tensorwise":
            raise ConfigError(
                f"quantize.linear.float8.enable_fsdp_float8_all_gather needs recipe_name = 'tensorwise' (got "
                f"{self.recipe_name!r}): a rowwise weight is cast again along its other dimension in backward, "
                "which needs the high-precision weight"
            )


@dataclass
class Checkpoint:
    enable: bool = opt(False, "Save checkpoints; resume from the newest complete one at start.")
    folder: str = opt("checkpoint", "Checkpoint folder (step-N sub-folders), relative to dump_folder.", path=True)
    interval: int = opt(500, "Save every N steps (and at the last step).", min=1)
    async_mode: str = opt("disabled", "Save in the background.", choices=["disabled", "async", "async_with_pinned_mem"])
    keep_latest_k: int = opt(10, "Keep the newest K complete checkpoints; 0 = keep all.", min=0)
    last_save_model_only: bool = opt(True, "The last step saves model weights only (in export_dtype).")
    export_dtype: str = opt("float32", "Weight dtype of a model-only last save.", choices=["float32", "bfloat16"])
    load_step: int = opt(-1, "Resume from this step (an error if missing); -1 = the newest.", min=-1)
    initial_load_path: str = opt(
        "", "Step folder (or HF model folder) loaded when there is nothing to resume.", path=True
    )
    initial_load_model_only: bool = opt(True, "Load only the weights from initial_load_path.")


@dataclass
class JobConfig:
    """The whole run configuration: one attribute per TOML section (a new one: a dataclass above, a line here)."""

    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    training: Training = field(default_factory=Training)
    metrics: Metrics = field(default_factory=Metrics)
    validation: Validation = field(default_factory=Validation)
    sampling: Sampling = field(default_factory=Sampling)
    eval: Eval = field(default_factory=Eval)
    profiling: Profiling = field(default_factory=Profiling)
    guard: Guard = field(default_factory=Guard)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    parallelism: Parallelism = field(default_factory=Parallelism)
    comm: Comm = field(default_factory=Comm)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: Compile = field(default_factory=Compile)
    quantize_linear_float8: QuantizeLinearFloat8 = section(QuantizeLinearFloat8, "quantize.linear.float8")

    def validate(self) -> None:
        """Each section's own rules, then the rules across sections; ConfigError on the first broken one."""
        for f in fields(self):
            getattr(getattr(self, f.name), "validate", lambda: None)()
        t, warmup = self.training, self.lr_scheduler.warmup_steps
        if warmup > t.steps and t.tokens == -1:  # with a token budget the trainer checks it once steps are known
            raise ConfigError(f"lr_scheduler.warmup_steps ({warmup}) must be <= training.steps ({t.steps})")
        p = self.parallelism
        if p.pipeline_parallel_degree > 1 and t.local_batch_size % p.pipeline_parallel_microbatch_size:
            raise ConfigError(
                f"training.local_batch_size ({t.local_batch_size}) must be a multiple of "
                f"parallelism.pipeline_parallel_microbatch_size ({p.pipeline_parallel_microbatch_size}): "
                "each pipeline step splits the local batch into microbatches of that size"
            )
        if t.seq_len_schedule:
            self.validate_seq_len_schedule()
        if p.context_parallel_degree > 1:
            self.validate_context_parallel()
        if self.optimizer.name == "muon" and p.pipeline_parallel_degree > 1:
            raise ConfigError(
                f"optimizer.name = 'muon' does not run with parallelism.pipeline_parallel_degree = "
                f"{p.pipeline_parallel_degree}: its exchange of sharded matrices spans every rank, and each stage "
                "holds other matrices (use AdamW, or Muon without pipeline parallelism)"
            )
        for key in ("sampling", "eval"):
            if getattr(self, key).enable and p.pipeline_parallel_degree > 1:
                raise ConfigError(
                    f"{key}.enable is not supported with pipeline parallelism (parallelism.pipeline_parallel_degree"
                    f" = {p.pipeline_parallel_degree}): evaluate the checkpoints with python -m titanlite.eval --watch"
                )
        batch, name = t.local_batch_size, "training.local_batch_size"
        if p.pipeline_parallel_degree > 1:
            batch, name = p.pipeline_parallel_microbatch_size, "parallelism.pipeline_parallel_microbatch_size"
        tokens = batch * t.seq_len
        if self.quantize_linear_float8.enable and tokens % 16:
            raise ConfigError(
                f"quantize.linear.float8.enable needs {name} x training.seq_len "
                f"({batch} x {t.seq_len} = {tokens} tokens per micro-batch) to be a multiple of 16: "
                "float8 matmuls (torch._scaled_mm) need every matrix dimension divisible by 16"
            )

    def validate_context_parallel(self) -> None:
        """``[parallelism] context_parallel_degree`` against the other sections: each sequence is cut into
        ``2 x cp`` equal chunks (titanlite.parallel.context_parallel), and a rank's share, under TP, into ``tp``."""
        p, t = self.parallelism, self.training
        cp, tp = p.context_parallel_degree, p.tensor_parallel_degree
        lengths = [("training.seq_len", t.seq_len)] + [
            (f"training.seq_len_schedule[{i}].seq_len", s["seq_len"])
            for i, s in enumerate(t.seq_len_schedule)
            if isinstance(s, dict) and isinstance(s.get("seq_len"), int)
        ]
        for key, n in lengths:
            if n % (2 * cp * tp):
                raise ConfigError(
                    f"{key} ({n}) must be a multiple of 2 x parallelism.context_parallel_degree ({cp})"
                    + (f" x tensor_parallel_degree ({tp})" if tp > 1 else "")
                    + ": each sequence is cut into 2 x cp load-balanced chunks"
                )

    def validate_seq_len_schedule(self) -> None:
        """``[training] seq_len_schedule`` against the other sections (its own entries: titanlite.plan.run_plan)."""
        p, g = self.parallelism, self.guard
        if p.pipeline_parallel_degree > 1:
            raise ConfigError("training.seq_len_schedule is not supported with pipeline parallelism")
        if g.policy == "rollback" and g.rollback_skip_data:
            raise ConfigError(
                "guard.policy = 'rollback' with guard.rollback_skip_data is not supported with "
                "training.seq_len_schedule (the skipped batches may span stages): set rollback_skip_data = false"
            )
        tp = p.tensor_parallel_degree
        for i, spec in enumerate(self.training.seq_len_schedule):
            n = spec.get("seq_len") if isinstance(spec, dict) else None
            if tp > 1 and isinstance(n, int) and n % tp:
                raise ConfigError(
                    f"parallelism.tensor_parallel_degree={tp} must divide training.seq_len_schedule[{i}].seq_len ({n})"
                )

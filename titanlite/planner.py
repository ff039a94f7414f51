"""Run planner: parameters, FLOPs, steps, time, cost and per-GPU memory of a training run.

Pure functions of the model shape and the run's settings (no torch, no GPU); ``scripts/estimate.py``
is the command-line front end. Memory is modelled for the way titanlite trains (eager mode; AdamW;
fp32 master weights; FSDP2 over the data-parallel ranks when there is more than one, bf16 autocast
otherwise), component by component:

========================  =====================================================================
parameters                fp32 master weights, sharded over ``dp_shard x tp``; plus, in bf16,
                          the compute copies: FSDP keeps ~2 blocks gathered (current + prefetch)
                          and the last group (final norm + output), autocast keeps a bf16 copy of
                          every matmul weight for backward
gradients                 fp32, sharded like the parameters; they exist from the backward on
                          (and through the next micro-batch's forward under gradient accumulation)
optimizer state           AdamW first and second moments, fp32, sharded like the parameters
activations               what autograd keeps for backward, per token per block (formula below)
                          times ``n_layers x local_batch_size x seq_len``, divided by ``tp``
logits                    per token: the output matmul's logits (compute dtype) + fp32 log-softmax
                          output, its gradient and the logits' gradient (3 x 4 bytes) / ``tp``
optimizer step scratch    foreach AdamW allocates one fp32 parameter-sized buffer during the step
                          (fused: none)
========================  =====================================================================

The modelled peak (``total``) is parameters + optimizer state + the largest of three moments: the
start of backward (activations + logits, plus the gradients when they accumulate over several
micro-batches), the end of backward (gradients + the block being recomputed under activation
checkpointing) and the optimizer step (gradients + scratch).

Activation bytes per token per transformer block without activation checkpointing, with ``d =
dim``, ``q = n_heads x head_dim`` (``= d`` for Llama), ``F = ffn hidden``, ``h = n_heads``, ``c`` =
compute-dtype bytes, ``r`` = residual-stream bytes (fp32 under autocast, else ``c``), ``l`` = bytes
of saved matmul inputs (``c``, or 1 for float8 linears), as counted with
``torch.autograd.graph.saved_tensors_hooks`` on titanlite's Llama 3 block (exact for fp32 and bf16
autocast, see tests/test_planner.py)::

    2 RMSNorms (eager)    2 x 2 r d          input and normalized input of each norm
    matmul inputs         l d x (k_attn + k_ffn)   k = 1 when wq/wk/wv (w1/w3) share one saved input,
                                            3 (2) under autocast or float8 (each casts its own)
    attention             3 c q + c q + 4 h  q, and k, v repeated to h heads; output (also the wo
                                            input, plus an l-byte copy with float8); log-sum-exp
    SwiGLU                3 c F + l F       w1 out, w3 out, silu out; the w2 input
    norm statistics       8

With float8 linears each block also keeps a 1-byte copy of its matmul weights for backward (under
FSDP the gathered bf16 weights are freed after forward, these copies are not), counted with the
activations: for large models this can outweigh the saving on the 1-byte matmul inputs.

Activation checkpointing: ``full`` keeps each block's input (``r d``) plus, during backward, one
block's activations while it is recomputed; ``selective`` ``op`` keeps the block input and the
outputs of the matmuls and attention (``r d + c (q + 2 d_kv) + c q + 4 h + c d + 2 c F + c d``)
plus one block's recomputed remainder; ``selective`` ``N`` applies full AC to every N-th block.

Other families are modelled as that block with their own sizes: parameters and FLOPs stay exact
(``head_dim``, QK-norm weights), activations are a lower bound where a block keeps more (Qwen3's
QK-norm and fp32 half-split RoPE keep ~2x as much per token under bf16 autocast).

Not modelled: the CUDA context and communication buffers and allocator fragmentation (the verdict
keeps a reserve for them, :data:`RESERVE_BYTES` and :data:`FRAGMENTATION`), torch.compile's fusions
(which save less), pipeline parallelism.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from titanlite.dtypes import DTYPES

RESERVE_BYTES = 2.0e9  # CUDA context, NCCL buffers, cuBLAS workspaces
FRAGMENTATION = 0.05  # share of the GPU memory assumed lost to the caching allocator's fragmentation
CHINCHILLA_TOKENS_PER_PARAM = 20


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """The sizes that determine parameters, FLOPs and activations (Llama-style decoder; names as in the
    Llama 3 model args). Families with their own ``head_dim`` and query/key RMSNorm weights (``qk_norm``,
    Qwen3) are counted exactly too. ``num_params``: the family's exact count when its blocks are not Llama
    blocks (0: the formula of :func:`param_count`)."""

    dim: int
    n_layers: int
    n_heads: int
    kv_heads: int
    ffn_hidden_dim: int
    vocab_size: int
    tie_word_embeddings: bool = False
    head_dim: int = 0  # 0: dim // n_heads, filled in by __post_init__
    qk_norm: bool = False
    num_params: int = 0

    def __post_init__(self) -> None:
        if not self.head_dim:
            object.__setattr__(self, "head_dim", self.dim // self.n_heads)

    @classmethod
    def from_args(cls, args: Any, num_params: int = 0) -> ModelShape:
        kv = getattr(args, "kv_heads", None) or getattr(args, "n_kv_heads", None) or args.n_heads
        sizes = (args.dim, args.n_layers, args.n_heads, kv, args.ffn_hidden_dim, args.vocab_size)
        tied, head_dim, qk_norm = (getattr(args, k, None) for k in ("tie_word_embeddings", "head_dim", "qk_norm"))
        return cls(*sizes, bool(tied), int(head_dim or 0), bool(qk_norm), num_params)

    @property
    def q_dim(self) -> int:
        """Width of the concatenated query heads (``wq`` output, ``wo`` input); ``dim`` for Llama."""
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim


def _block_matmul_params(s: ModelShape) -> int:
    """The linear weights of one block: wq, wo; wk, wv; w1, w2, w3."""
    return 2 * s.dim * s.q_dim + 2 * s.dim * s.kv_dim + 3 * s.dim * s.ffn_hidden_dim


def block_params(s: ModelShape) -> int:
    """Parameters of one block: its linears, two RMSNorm weights and, with ``qk_norm``, the query/key ones."""
    return _block_matmul_params(s) + 2 * s.dim + (2 * s.head_dim if s.qk_norm else 0)


def param_count(s: ModelShape) -> int:
    """All parameters, a tied embedding/output counted once."""
    if s.num_params:
        return s.num_params
    embed = s.vocab_size * s.dim
    output = 0 if s.tie_word_embeddings else embed
    return embed + s.n_layers * block_params(s) + s.dim + output


def matmul_param_count(s: ModelShape) -> int:
    """Parameters used in matmuls: the blocks' linear weights and the output projection."""
    return s.n_layers * _block_matmul_params(s) + s.vocab_size * s.dim


def palm_flops_per_token(matmul_params: int, n_layers: int, n_heads: int, head_dim: int, seq_len: int) -> int:
    """Training FLOPs per token (PaLM, Chowdhery et al. 2022, appendix B): a forward+backward pass
    costs 6 FLOPs per parameter that takes part in a matmul, plus 12 x n_layers x n_heads x head_dim
    x seq_len for the attention scores and weighted sum (2 matmuls of 2 FLOPs, x3 for backward)."""
    return 6 * matmul_params + 12 * n_layers * n_heads * head_dim * seq_len


def flops_per_token(s: ModelShape, seq_len: int) -> int:
    """:func:`palm_flops_per_token` of the shape: every parameter but the input embedding table is a
    matmul parameter (a tied table is the output projection, so it counts)."""
    embed = 0 if s.tie_word_embeddings else s.vocab_size * s.dim
    return palm_flops_per_token(param_count(s) - embed, s.n_layers, s.n_heads, s.head_dim, seq_len)


def params_of(args: Any) -> int:
    """Exact parameters of a Llama-style family's model args (a ``ModelSpec.num_params``)."""
    return param_count(ModelShape.from_args(args))


def flops_of(args: Any, seq_len: int) -> int:
    """Training FLOPs per token of a Llama-style family's model args (a ``ModelSpec.flops_per_token``)."""
    return flops_per_token(ModelShape.from_args(args), seq_len)


@dataclasses.dataclass(frozen=True)
class RunSetup:
    """How the run is laid out on the GPUs (from the job config and the command line)."""

    num_gpus: int
    tp: int = 1
    dp_replicate: int = 1
    local_batch_size: int = 8
    seq_len: int = 2048
    global_batch_size: int = -1  # -1: local_batch_size x data-parallel degree
    ac_mode: str = "none"
    ac_option: str = "op"
    compute_dtype: str = "bfloat16"
    float8: bool = False
    optimizer_impl: str = "fused"  # fused | foreach | for-loop

    def __post_init__(self) -> None:
        if self.num_gpus < 1 or self.num_gpus % (self.tp * self.dp_replicate):
            raise ValueError(
                f"{self.num_gpus} GPUs are not divisible by tensor_parallel_degree ({self.tp}) x "
                f"data_parallel_replicate_degree ({self.dp_replicate})"
            )
        if self.global_batch_size != -1 and self.global_batch_size % (self.local_batch_size * self.dp_degree):
            raise ValueError(
                f"global_batch_size {self.global_batch_size} is not a multiple of local_batch_size "
                f"({self.local_batch_size}) x data-parallel degree ({self.dp_degree})"
            )
        if self.ac_mode not in ("none", "full", "selective"):
            raise ValueError(f"unknown activation checkpointing mode {self.ac_mode!r}")
        if self.compute_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"compute dtype must be float32 or bfloat16, got {self.compute_dtype!r}")

    @property
    def dp_degree(self) -> int:
        return self.num_gpus // self.tp

    @property
    def dp_shard(self) -> int:
        return self.dp_degree // self.dp_replicate

    @property
    def fsdp(self) -> bool:
        """titanlite applies FSDP whenever there is more than one data-parallel rank."""
        return self.dp_degree > 1

    @property
    def autocast(self) -> bool:
        return not self.fsdp and self.compute_dtype == "bfloat16"

    @property
    def global_batch(self) -> int:
        return self.local_batch_size * self.dp_degree if self.global_batch_size == -1 else self.global_batch_size

    @property
    def grad_accum(self) -> int:
        return self.global_batch // (self.local_batch_size * self.dp_degree)

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len

    @property
    def micro_batch_tokens(self) -> int:
        return self.local_batch_size * self.seq_len


def _bytes(setup: RunSetup) -> tuple[int, int, int]:
    """(compute c, residual r, saved-matmul-input l) bytes, see the module docstring."""
    c = DTYPES[setup.compute_dtype].itemsize
    r = 4 if (setup.autocast or c == 4) else c
    lin = 1 if setup.float8 else c
    return c, r, lin


def activation_bytes_per_token_layer(s: ModelShape, setup: RunSetup) -> float:
    """Bytes autograd keeps per token per block without activation checkpointing (before ``/ tp``)."""
    c, r, lin = _bytes(setup)
    d, q, f = s.dim, s.q_dim, s.ffn_hidden_dim
    k_attn, k_ffn = (3, 2) if setup.autocast or setup.float8 else (1, 1)  # each linear saves its own cast input
    norms = 2 * 2 * r * d
    matmul_inputs = lin * d * (k_attn + k_ffn)
    attention = 3 * c * q + c * q + 4 * s.n_heads + (lin * q if setup.float8 else 0)
    ffn = 3 * c * f + lin * f
    return norms + matmul_inputs + attention + ffn + 8


def activation_bytes(s: ModelShape, setup: RunSetup) -> float:
    """Activation memory of one micro-batch on one GPU, by activation-checkpointing mode."""
    tokens = setup.micro_batch_tokens / setup.tp
    c, r, lin = _bytes(setup)
    d, q = s.dim, s.q_dim
    layer = activation_bytes_per_token_layer(s, setup)
    keep_input = r * d
    final_norm = 2 * r * d + lin * d
    if setup.ac_mode == "none":
        per_token = s.n_layers * layer
    elif setup.ac_mode == "full":
        per_token = s.n_layers * keep_input + layer  # + one block recomputed in backward
    elif setup.ac_option.strip() == "op":  # the block input and the matmul/attention outputs are kept
        kept = r * d + c * (q + 2 * s.kv_dim) + c * q + 4 * s.n_heads + c * d + 2 * c * s.ffn_hidden_dim + c * d
        per_token = s.n_layers * kept + (layer - kept)
    else:
        n_ac = s.n_layers // int(setup.ac_option)  # full AC on every N-th block
        per_token = n_ac * keep_input + (s.n_layers - n_ac) * layer + (layer if n_ac else 0)
    return tokens * (per_token + final_norm)


def memory_breakdown(s: ModelShape, setup: RunSetup) -> dict[str, Any]:
    """Per-GPU bytes by component (see the module docstring); ``total`` is the modelled peak, reached
    at ``peak_at`` (start of backward, end of backward or optimizer step)."""
    local = param_count(s) / (setup.tp * (setup.dp_shard if setup.fsdp else 1))
    c = _bytes(setup)[0]
    params = 4 * local
    if setup.fsdp and c != 4:  # gathered compute-dtype copies: ~2 blocks + the last group (norm + output)
        params += c * (2 * block_params(s) + s.vocab_size * s.dim) / setup.tp
    elif setup.autocast:  # autocast caches a bf16 copy of every matmul weight for backward
        params += c * matmul_param_count(s) / setup.tp
    grads, optimizer = 4 * local, 8 * local  # fp32 gradients; AdamW's two fp32 moments
    activations = activation_bytes(s, setup)
    if setup.float8:  # float8 copies of the (converted) block weights, saved for backward
        activations += s.n_layers * _block_matmul_params(s) / setup.tp
    logits = setup.micro_batch_tokens * s.vocab_size / setup.tp * (c + 12)
    scratch = 4 * local if setup.optimizer_impl == "foreach" else 0.0
    layer = setup.micro_batch_tokens / setup.tp * activation_bytes_per_token_layer(s, setup)
    recomputed = 0.0 if setup.ac_mode == "none" else layer
    moments = {
        "start of backward": (grads if setup.grad_accum > 1 else 0.0) + activations + logits,
        "end of backward": grads + recomputed,
        "optimizer step": grads + scratch,
    }
    peak_at = max(moments, key=moments.get)
    return {
        "parameters": params,
        "gradients": grads,
        "optimizer": optimizer,
        "activations": activations,
        "logits": logits,
        "optimizer_scratch": scratch,
        "total": params + optimizer + moments[peak_at],
        "peak_at": peak_at,
    }


def usable_memory(gpu_bytes: float) -> float:
    """GPU memory a run may plan to use: minus fragmentation and the fixed reserve."""
    return gpu_bytes * (1 - FRAGMENTATION) - RESERVE_BYTES


@dataclasses.dataclass
class Plan:
    params: int
    flops_per_token: int
    tokens: float  # trained tokens (whole optimizer steps)
    steps: int
    total_flops: float
    peak_flops: float | None  # per GPU, in the matmul dtype
    matmul_dtype: str
    mfu: float
    wall_s: float | None
    cost: float | None
    memory: dict[str, float]
    gpu_memory: float | None
    fits: bool | None


def plan_run(
    s: ModelShape,
    setup: RunSetup,
    *,
    tokens: float,
    mfu: float,
    peak_flops: float | None,
    matmul_dtype: str,
    gpu_memory: float | None = None,
    price_per_gpu_hour: float | None = None,
    flops_per_token_: int | None = None,
) -> Plan:
    """Steps, FLOPs, wall time, cost and memory of training on ``tokens`` tokens at ``mfu``
    (``flops_per_token_``: the family's own count, default :func:`flops_per_token` of the shape)."""
    if tokens <= 0:
        raise ValueError(f"token target must be positive, got {tokens}")
    if not 0 < mfu <= 1:
        raise ValueError(f"MFU must be in (0, 1], got {mfu}")
    fpt = flops_per_token_ or flops_per_token(s, setup.seq_len)
    steps = math.ceil(tokens / setup.tokens_per_step)
    trained = steps * setup.tokens_per_step
    total = fpt * trained
    wall = None if peak_flops is None else total / (setup.num_gpus * peak_flops * mfu)
    cost = None if wall is None or price_per_gpu_hour is None else wall / 3600 * setup.num_gpus * price_per_gpu_hour
    mem = memory_breakdown(s, setup)
    fits = None if gpu_memory is None else mem["total"] <= usable_memory(gpu_memory)
    return Plan(
        param_count(s), fpt, trained, steps, total, peak_flops, matmul_dtype, mfu, wall, cost, mem, gpu_memory, fits
    )

"""The physical floor of each part of one training step, from the model's shape and two measured device rates.

A profiled step's GPU time splits into matmuls, attention, element-wise and norm kernels, the optimizer,
communication and idle time (:mod:`titanlite.bench.trace_summary`). Each part has a floor:

- **matmuls**: their FLOPs (6 per matmul parameter per token; a forward more per token under full activation
  checkpointing) at the **measured** GEMM rate of the device (:func:`measure_gemm_rate`), not the datasheet's, so the
  gap left is the kernels' and the step's, not the clock's; with float8 linears the blocks' matmuls at the float8
  rate and the output layer, which stays in bf16, at the bf16 rate;
- **attention**: the causal scores and weighted sums, half of PaLM's ``12 x layers x heads x head_dim x seq_len``
  per token (a causal kernel skips the masked half), at the bf16 (compute dtype) rate;
- **element-wise and norms**: the bytes the non-matmul work must move if everything around the GEMMs were fused
  (:func:`elementwise_bytes_per_token`), at the measured copy bandwidth;
- **optimizer**: its update traffic (:func:`titanlite.optim.bandwidth.update_bytes`) at that bandwidth;
- **communication** and **idle**: zero on one device (the floor a step can reach), so their whole time is gap.
"""

from __future__ import annotations

from typing import Any

import torch

from titanlite.bench.common import seconds
from titanlite.models.flops import ModelShape, active_param_count

FLOAT8 = torch.float8_e4m3fn


def matmul_flops_per_token(shape: ModelShape, recompute_forward: bool = False) -> float:
    """Forward and backward FLOPs per token of every matmul with a weight (6 per active matmul parameter: not the
    norms' weights, nor the input embedding, a lookup; a tied table counts as the output layer);
    ``recompute_forward``: full activation checkpointing runs each block's forward twice (2 FLOPs more per block
    matmul parameter)."""
    embed = 0 if shape.tie_word_embeddings else shape.vocab_size * shape.dim
    norms = shape.n_layers * (2 * shape.dim + (2 * shape.head_dim if shape.qk_norm else 0)) + shape.dim
    matmul = active_param_count(shape) - embed - norms
    blocks = matmul - shape.vocab_size * shape.dim  # the output layer is not in a block: not recomputed
    return 6 * matmul + (2 * blocks if recompute_forward else 0)


def output_flops_per_token(shape: ModelShape) -> float:
    """The output layer's forward and backward FLOPs per token (never recomputed by activation checkpointing, never
    float8)."""
    return 6 * shape.vocab_size * shape.dim


def attention_flops_per_token(shape: ModelShape, seq_len: int, recompute_forward: bool = False) -> float:
    """Causal attention's FLOPs per token, forward and backward: the scores and the weighted sum, 2 matmuls of
    2 FLOPs per multiply-add over on average ``seq_len / 2`` keys, three times (forward, two backward matmuls per
    forward one); a fourth forward under full activation checkpointing."""
    passes = 4 if recompute_forward else 3
    return passes * 2 * 2 * shape.n_layers * shape.n_heads * shape.head_dim * seq_len / 2


def elementwise_bytes_per_token(shape: ModelShape, act_bytes: int, recompute_forward: bool = False) -> float:
    """Bytes per token the non-matmul work of a step must move at the least, each op fused with its neighbours.

    Per block forward, in elements of ``act_bytes``: each of the two residual adds fused with the next RMSNorm reads
    the residual and the branch output and writes the sum and its norm (4 x dim, twice); RoPE reads and writes the
    queries and keys (2 x (q_dim + kv_dim)); SwiGLU reads the two projections and writes their product (3 x the
    active hidden width). Backward moves twice the forward's bytes (each op reads its output's gradient and its saved
    inputs and writes its inputs' gradients); full activation checkpointing adds a forward. The output loss reads the
    logits and writes their gradient (2 x vocab). A floor under a model of the step, not a measurement."""
    block = 8 * shape.dim + 2 * (shape.q_dim + shape.kv_dim) + 3 * shape.active_ffn_hidden
    passes = 4 if recompute_forward else 3
    return (shape.n_layers * block * passes + 2 * shape.vocab_size) * act_bytes


def step_floors(
    shape: ModelShape,
    tokens: int,
    seq_len: int,
    *,
    gemm_flops_per_s: float,
    bytes_per_s: float,
    update_bytes: float,
    act_bytes: int = 2,
    recompute_forward: bool = False,
    float8_flops_per_s: float | None = None,
) -> dict[str, float]:
    """Seconds per step each part of a step cannot go below on one device (see the module docstring), for
    ``tokens`` tokens per step (per device) of sequences of ``seq_len``: ``gemm_flops_per_s`` in the compute dtype;
    with float8 linears, ``float8_flops_per_s`` for the blocks' matmuls."""
    output = output_flops_per_token(shape)
    blocks = matmul_flops_per_token(shape, recompute_forward) - output
    matmul_s = tokens * (blocks / (float8_flops_per_s or gemm_flops_per_s) + output / gemm_flops_per_s)
    return {
        "matmul": matmul_s,
        "attention": tokens * attention_flops_per_token(shape, seq_len, recompute_forward) / gemm_flops_per_s,
        "elementwise / norm": tokens * elementwise_bytes_per_token(shape, act_bytes, recompute_forward) / bytes_per_s,
        "optimizer": update_bytes / bytes_per_s,
        "communication": 0.0,
        "idle (host-bound)": 0.0,
    }


def measure_gemm_rate(device: torch.device, dtype: str = "bfloat16", n: int = 8192, trials: int = 5) -> float:
    """FLOP/s of one square ``n x n x n`` matmul on a CUDA device in ``dtype`` (``float8``: ``torch._scaled_mm`` of
    e4m3 operands, tensorwise scales, bf16 output), the best of ``trials`` timings of a few calls: the rate the
    step's GEMMs could reach at best. On CPU: :func:`titanlite.trainer.peaks.measure_cpu_matmul_peak`."""
    if device.type != "cuda":
        from titanlite.trainer.peaks import measure_cpu_matmul_peak

        return measure_cpu_matmul_peak("float32" if dtype == "float8" else dtype, threads=torch.get_num_threads())
    matmul, calls = _gemm(device, dtype, n), 10
    matmul()  # kernel selection, warm-up
    fastest = min(seconds(lambda: [matmul() for _ in range(calls)], device) for _ in range(trials))
    return 2 * n**3 * calls / fastest


def _gemm(device: torch.device, dtype: str, n: int) -> Any:
    g = torch.Generator(device=device).manual_seed(0)
    if dtype != "float8":
        dt = getattr(torch, dtype)
        a, b = (torch.randn(n, n, generator=g, device=device, dtype=dt) for _ in range(2))
        return lambda: a @ b
    a = torch.randn(n, n, generator=g, device=device).to(FLOAT8)
    b = torch.randn(n, n, generator=g, device=device).to(FLOAT8).t()  # column-major, as _scaled_mm wants
    one = torch.ones((), device=device)
    return lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)

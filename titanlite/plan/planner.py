"""Run planner: parameters, FLOPs, steps, time, cost and whether the run fits the GPUs' memory.

Pure functions of the model shape and the run's settings (no torch, no GPU); ``titanlite estimate`` is the
command-line front end. The layout and the per-GPU memory model: :mod:`titanlite.plan.memory`; the formulas:
docs/memory_model.md.
"""

from __future__ import annotations

import dataclasses
import math

from titanlite.errors import ConfigError
from titanlite.models.flops import ModelShape, active_param_count, flops_per_token, param_count
from titanlite.parallel.pipeline_schedules import pipeline_bubble_fraction
from titanlite.plan.memory import RunSetup, memory_breakdown, stage_shares
from titanlite.plan.planner_moe import all_to_all_bytes
from titanlite.utils.dtypes import DTYPES

RESERVE_BYTES = 2.0e9  # CUDA context, NCCL buffers, cuBLAS workspaces
FRAGMENTATION = 0.05  # share of the GPU memory assumed lost to the caching allocator's fragmentation
CHINCHILLA_TOKENS_PER_PARAM = 20


def all_to_all_volume(s: ModelShape, setup: RunSetup) -> float:
    """Bytes each GPU sends by all-to-all per optimizer step under expert parallelism (0 without EP or MoE):
    every micro-batch's tokens (``local_batch_size x seq_len / cp``: a CP rank's share, all of it on every TP rank)
    through the MoE blocks of the busiest pipeline rank (:func:`titanlite.plan.planner_moe.all_to_all_bytes`)."""
    if s.moe is None or setup.ep <= 1:
        return 0.0
    blocks = max(share.n_layers for share in stage_shares(s, setup)) * s.moe_fraction
    tokens = setup.local_batch_size * setup.rank_seq_len * setup.grad_accum
    c = DTYPES[setup.compute_dtype].itemsize
    return all_to_all_bytes(s.moe, s.dim, tokens, setup.ep, blocks, c, recompute=setup.ac_mode == "full")


def usable_memory(gpu_bytes: float) -> float:
    """GPU memory a run may plan to use: minus fragmentation and the fixed reserve."""
    return gpu_bytes * (1 - FRAGMENTATION) - RESERVE_BYTES


ABSURD_FACTOR = 2.0  # a modelled peak above this many times the device's memory cannot be an estimate's error


def check_absurd_size(s: ModelShape, setup: RunSetup, device_bytes: float, device: str) -> None:
    """ValueError (one line) when the modelled per-device peak (:func:`memory_breakdown`) is more than
    :data:`ABSURD_FACTOR` times ``device_bytes``: a size the run could never allocate (``local_batch_size =
    2**63 - 1`` grew the process until the kernel killed it; ``vocab_size = 1e11`` failed in an allocation),
    refused before anything is built. Runs near the limit are left to the dry run's verdict."""
    mem = memory_breakdown(s, setup)
    if mem["total"] <= ABSURD_FACTOR * device_bytes:
        return
    weights = mem["parameters"] + mem["gradients"] + mem["optimizer"]
    raise ConfigError(
        f"this run needs about {mem['total'] / 1e9:,.4g} GB per {device} device (planner estimate: parameters, "
        f"gradients and optimizer {weights / 1e9:,.4g} GB, activations {mem['activations'] / 1e9:,.4g} GB, logits "
        f"{mem['logits'] / 1e9:,.4g} GB), more than {ABSURD_FACTOR:g} x its {device_bytes / 1e9:,.1f} GB: check the "
        f"model's size ({param_count(s):,} parameters, {s.n_layers:,} layers, vocabulary {s.vocab_size:,}) and "
        f"training.local_batch_size x training.seq_len ({setup.local_batch_size:,} x {setup.seq_len:,})"
    )


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
    bubble: float = 0.0  # pipeline bubble fraction (idle share of each rank's time)
    active_params: int = 0  # parameters used per token (MoE: the active experts'); = params when dense
    all_to_all_bytes: float = 0.0  # sent per GPU per optimizer step under expert parallelism


def estimate_run(
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
    (``flops_per_token_``: the family's own count, default :func:`flops_per_token` of the shape).

    ``mfu`` is the utilization while a GPU computes; with pipelining each rank also idles for the schedule's
    bubble (:func:`pipeline_bubble_fraction`), so the wall time is the compute time / (1 - bubble) and the
    run's overall MFU is ``mfu x (1 - bubble)``. The memory is the worst pipeline rank's."""
    if tokens <= 0:
        raise ConfigError(f"token target must be positive, got {tokens}")
    if not 0 < mfu <= 1:
        raise ConfigError(f"MFU must be in (0, 1], got {mfu}")
    fpt = flops_per_token_ or flops_per_token(s, setup.seq_len)
    steps = math.ceil(tokens / setup.tokens_per_step)
    trained = steps * setup.tokens_per_step
    total = fpt * trained
    v = len(setup.stage_sizes(s.n_layers)) // setup.pp
    bubble = pipeline_bubble_fraction(setup.pp_schedule, setup.pp, setup.n_microbatches, v)
    wall = None if peak_flops is None else total / (setup.num_gpus * peak_flops * mfu) / (1 - bubble)
    cost = None if wall is None or price_per_gpu_hour is None else wall / 3600 * setup.num_gpus * price_per_gpu_hour
    mem = memory_breakdown(s, setup)
    fits = None if gpu_memory is None else mem["total"] <= usable_memory(gpu_memory)
    return Plan(
        param_count(s),
        fpt,
        trained,
        steps,
        total,
        peak_flops,
        matmul_dtype,
        mfu,
        wall,
        cost,
        mem,
        gpu_memory,
        fits,
        bubble,
        active_param_count(s),
        all_to_all_volume(s, setup),
    )

"""How a run is laid out on the GPUs (:class:`RunSetup`) and the memory each GPU needs: pure functions of the model
shape and the layout (no torch), per pipeline rank. The model, component by component, with its formulas:
docs/memory_model.md; :mod:`titanlite.plan.planner` turns it into the run's estimate and verdict.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from titanlite.errors import ConfigError
from titanlite.models.flops import ModelShape, block_matmul_params, block_params, param_count
from titanlite.parallel.pipeline_schedules import (
    MULTI_STAGE_SCHEDULES,
    check_pipeline,
    microbatches_in_flight,
    pipeline_rank_stages,
    split_evenly,
)
from titanlite.utils.dtypes import DTYPES


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
    pp: int = 1  # pipeline-parallel degree
    pp_schedule: str = "1F1B"
    pp_microbatch_size: int = 1  # sequences per pipeline microbatch
    pp_stage_sizes: tuple[int, ...] = ()  # blocks per stage (a PipelinePlan's); () = as even as possible
    reduce_dtype: str = "float32"  # FSDP's gradient dtype (mixed_precision_reduce)
    fsdp_reshard_after_forward: str = "default"  # default | always | never
    ep: int = 1  # expert-parallel degree (MoE): a factor of dp_shard
    loss_chunks: int = 0  # [training] loss_chunks: the output layer + loss over pieces of the tokens (0: at once)
    optimizer: str = "AdamW"  # [optimizer] name; "muon": one state buffer for the blocks' matrices, not two
    cp: int = 1  # context-parallel degree: each sequence split over cp ranks (FSDP shards over dp_shard x cp)

    @classmethod
    def from_config(cls, cfg: Any, num_gpus: int, pp_stage_sizes: tuple[int, ...] = ()) -> RunSetup:
        """From a job config's sections (a :class:`titanlite.config.JobConfig`), on ``num_gpus`` GPUs."""
        par, t, ac = cfg.parallelism, cfg.training, cfg.activation_checkpoint
        impl = cfg.optimizer.implementation
        return cls(
            num_gpus=num_gpus,
            tp=par.tensor_parallel_degree,
            dp_replicate=par.data_parallel_replicate_degree,
            local_batch_size=t.local_batch_size,
            seq_len=t.seq_len,
            global_batch_size=t.global_batch_size,
            ac_mode=ac.mode,
            ac_option=ac.selective_ac_option,
            compute_dtype=t.mixed_precision_param,
            float8=cfg.quantize_linear_float8.enable,
            optimizer_impl="fused" if impl == "auto" else impl,
            pp=par.pipeline_parallel_degree,
            pp_schedule=par.pipeline_parallel_schedule,
            pp_microbatch_size=par.pipeline_parallel_microbatch_size,
            pp_stage_sizes=pp_stage_sizes,
            reduce_dtype=t.mixed_precision_reduce,
            fsdp_reshard_after_forward=par.fsdp_reshard_after_forward,
            ep=getattr(par, "expert_parallel_degree", 1),
            loss_chunks=t.loss_chunks,
            optimizer=cfg.optimizer.name,
            cp=getattr(par, "context_parallel_degree", 1),
        )

    def __post_init__(self) -> None:
        if self.num_gpus < 1 or self.num_gpus % (self.tp * self.dp_replicate * self.pp * self.cp):
            raise ConfigError(
                f"{self.num_gpus} GPUs are not divisible by tensor_parallel_degree ({self.tp}) x "
                f"data_parallel_replicate_degree ({self.dp_replicate}) x pipeline_parallel_degree ({self.pp})"
                + (f" x context_parallel_degree ({self.cp})" if self.cp > 1 else "")
            )
        if self.pp > 1:
            check_pipeline(self.pp_schedule, self.local_batch_size, self.pp_microbatch_size, self.pp_stage_sizes)
        if self.global_batch_size != -1 and self.global_batch_size % (self.local_batch_size * self.dp_degree):
            raise ConfigError(
                f"global_batch_size {self.global_batch_size} is not a multiple of local_batch_size "
                f"({self.local_batch_size}) x data-parallel degree ({self.dp_degree})"
            )
        if self.ep < 1 or (self.dp_shard * self.cp) % self.ep:
            raise ConfigError(
                f"expert_parallel_degree ({self.ep}) must divide the data-parallel shard degree ({self.dp_shard})"
                + (f" x context_parallel_degree ({self.cp})" if self.cp > 1 else "")
            )
        if self.ac_mode not in ("none", "full", "selective"):
            raise ConfigError(f"unknown activation checkpointing mode {self.ac_mode!r}")
        if self.compute_dtype not in ("float32", "bfloat16"):
            raise ConfigError(f"compute dtype must be float32 or bfloat16, got {self.compute_dtype!r}")

    @property
    def dp_degree(self) -> int:
        return self.num_gpus // (self.tp * self.pp * self.cp)

    @property
    def dp_shard(self) -> int:
        return self.dp_degree // self.dp_replicate

    @property
    def fsdp(self) -> bool:
        """titanlite applies FSDP whenever there is more than one data- or context-parallel rank."""
        return self.dp_degree * self.cp > 1

    @property
    def fsdp_shards(self) -> int:
        """Ranks each parameter is sharded over by FSDP: ``dp_shard x cp`` (1 without FSDP)."""
        return self.dp_shard * self.cp if self.fsdp else 1

    @property
    def rank_seq_len(self) -> int:
        """Tokens of each sequence on one rank's activations: ``seq_len / cp`` (before sequence parallelism)."""
        return self.seq_len // self.cp

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

    @property
    def n_microbatches(self) -> int:
        """Pipeline microbatches per schedule run (one local batch); 1 without pipelining."""
        return self.local_batch_size // self.pp_microbatch_size if self.pp > 1 else 1

    def stage_sizes(self, n_layers: int) -> tuple[int, ...]:
        """Blocks per pipeline stage: ``pp_stage_sizes``, else ``n_layers`` cut as evenly as possible into the
        schedule's stages (``pp``, or ``2 pp`` for the multi-stage schedules) by :func:`split_evenly`."""
        if self.pp_stage_sizes:
            return self.pp_stage_sizes
        if self.pp == 1:
            return (n_layers,)
        return tuple(split_evenly(n_layers, self.pp * (2 if self.pp_schedule in MULTI_STAGE_SCHEDULES else 1)))


def _bytes(setup: RunSetup) -> tuple[int, int, int]:
    """(compute c, residual r, saved-matmul-input l) bytes, see docs/memory_model.md."""
    c = DTYPES[setup.compute_dtype].itemsize
    r = 4 if (setup.autocast or c == 4) else c
    lin = 1 if setup.float8 else c
    return c, r, lin


def activation_bytes_per_token_layer(s: ModelShape, setup: RunSetup) -> float:
    """Bytes autograd keeps per token per block without activation checkpointing (before ``/ tp``)."""
    c, r, lin = _bytes(setup)
    d, q, f = s.dim, s.q_dim, s.active_ffn_hidden
    k_attn, k_ffn = (3, 2) if setup.autocast or setup.float8 else (1, 1)  # each linear saves its own cast input
    norms = 2 * 2 * r * d
    matmul_inputs = lin * d * (k_attn + k_ffn)
    attention = 3 * c * q + c * q + 4 * s.n_heads + (lin * q if setup.float8 else 0)
    ffn = 3 * c * f + lin * f
    moe = s.moe.extra_activation_bytes(d, c, lin) * s.moe_fraction if s.moe else 0.0
    return norms + matmul_inputs + attention + ffn + moe + 8


def _activation_per_token(s: ModelShape, setup: RunSetup, n_layers: float) -> tuple[float, float]:
    """``(kept, recomputed)`` bytes per token for ``n_layers`` blocks: what stays saved from forward to backward,
    and what activation checkpointing adds while one block is recomputed in backward."""
    c, r, _ = _bytes(setup)
    d, q = s.dim, s.q_dim
    layer = activation_bytes_per_token_layer(s, setup)
    keep_input = r * d
    if setup.ac_mode == "none":
        return n_layers * layer, 0.0
    if setup.ac_mode == "full":
        return n_layers * keep_input, layer
    if setup.ac_option.strip() == "op":  # the block input and the matmul/attention outputs are kept
        kept = r * d + c * (q + 2 * s.kv_dim) + c * q + 4 * s.n_heads + c * d + 2 * c * s.active_ffn_hidden + c * d
        return n_layers * kept, layer - kept
    n_ac = int(n_layers) // int(setup.ac_option)  # full AC on every N-th block
    return n_ac * keep_input + (n_layers - n_ac) * layer, (layer if n_ac else 0.0)


def gathered_kv_bytes(s: ModelShape, setup: RunSetup, n_layers: float) -> tuple[float, float]:
    """``(kept, recomputed)`` bytes per sequence of the whole sequence's keys and values that context parallelism
    gathers in each block (``2 x seq_len x kv_dim / tp``, and their copies repeated to the query heads under
    grouped-query attention): saved for backward by every block that keeps its attention inputs, or held while
    one block is recomputed under full activation checkpointing. 0 without context parallelism."""
    if setup.cp == 1:
        return 0.0, 0.0
    width = s.kv_dim + (s.q_dim if s.kv_heads != s.n_heads else 0)
    layer = 2 * _bytes(setup)[0] * setup.seq_len / setup.tp * width
    if setup.ac_mode == "full":
        return 0.0, layer
    if setup.ac_mode == "none" or setup.ac_option.strip() == "op":
        return n_layers * layer, 0.0
    n_ac = int(n_layers) // int(setup.ac_option)
    return (n_layers - n_ac) * layer, (layer if n_ac else 0.0)


def _float8_saved_blocks(setup: RunSetup, n_layers: float) -> tuple[float, float]:
    """``(kept, recomputed)`` blocks whose float8 weight copies autograd holds: a block under full AC saves
    nothing from its forward (its casts run again when it is recomputed)."""
    if setup.ac_mode == "none" or (setup.ac_mode == "selective" and setup.ac_option.strip() == "op"):
        return n_layers, 0.0
    if setup.ac_mode == "full":
        return 0.0, 1.0
    n_ac = int(n_layers) // int(setup.ac_option)
    return n_layers - n_ac, (1.0 if n_ac else 0.0)


def _final_norm_per_token(setup: RunSetup, s: ModelShape) -> float:
    _, r, lin = _bytes(setup)
    return 2 * r * s.dim + lin * s.dim


@dataclasses.dataclass(frozen=True)
class StageShare:
    """What one pipeline rank holds: its stages, blocks, whether it has the embedding (first stage) and the
    final norm and output (last stage), and the microbatches in flight (:func:`microbatches_in_flight`)."""

    pp_rank: int
    stages: tuple[int, ...]
    layers: tuple[int, ...]  # the block indices, in order
    first: bool
    last: bool
    in_flight: int  # (microbatch, local stage) activations held at once
    last_in_flight: int  # of those, on the last stage (logits, final norm): m for GPipe, else 1

    @property
    def n_layers(self) -> int:
        return len(self.layers)


def stage_shares(s: ModelShape, setup: RunSetup) -> list[StageShare]:
    """Each pipeline rank's share of the model and of the schedule (one share, everything, without pipelining)."""
    sizes = setup.stage_sizes(s.n_layers)
    if sum(sizes) != s.n_layers:
        raise ConfigError(f"pipeline stage sizes {list(sizes)} do not add up to n_layers ({s.n_layers})")
    if len(sizes) % setup.pp:
        raise ConfigError(f"{len(sizes)} pipeline stages are not a multiple of pipeline_parallel_degree ({setup.pp})")
    p, m, v = setup.pp, setup.n_microbatches, len(sizes) // setup.pp
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    shares = []
    for rank in range(p):
        ids = pipeline_rank_stages(setup.pp_schedule, p, len(sizes), rank) if p > 1 else [0]
        layers = tuple(i for st in ids for i in range(starts[st], starts[st] + sizes[st]))
        last = len(sizes) - 1 in ids
        in_flight = microbatches_in_flight(setup.pp_schedule, p, m, v, rank) if p > 1 else 1
        last_in_flight = (m if setup.pp_schedule == "GPipe" else 1) if last else 0
        shares.append(StageShare(rank, tuple(ids), layers, 0 in ids, last, in_flight, last_in_flight))
    return shares


def stage_params(s: ModelShape, share: StageShare) -> int:
    """Parameters a pipeline rank holds: its blocks, plus the embedding on the first stage and the final norm
    and output on the last (all of :func:`param_count` without pipelining)."""
    if share.first and share.last:
        return param_count(s)
    embed = s.vocab_size * s.dim
    return share.n_layers * block_params(s) + (embed if share.first else 0) + ((s.dim + embed) if share.last else 0)


def stage_memory_breakdown(s: ModelShape, setup: RunSetup, share: StageShare) -> dict[str, Any]:
    """Per-GPU bytes of one pipeline rank (``share``) by component, as :func:`memory_breakdown` (the module
    docstring) with the rank's blocks only and its schedule's microbatches in flight:

    - parameters, gradients and optimizer state: the rank's blocks (+ embedding on the first stage, final
      norm and output on the last), sharded over ``dp_shard x tp``; the bf16 gathered copies are ~2 blocks,
      plus the output on the last stage;
    - activations: ``in_flight x`` one microbatch's (``pp_microbatch_size x seq_len`` tokens) kept bytes for
      ``n_layers / v`` blocks (a local stage, ``v`` stages per rank), plus the block being recomputed under
      AC, plus the final norm for the last stage's microbatches in flight; float8 weight copies are saved by
      every forward of a block outside full AC, so they count ``in_flight`` times too;
    - logits (last stage only): logits and fp32 log-softmax (``c + 4`` bytes per vocabulary entry) for each
      microbatch in flight on the last stage (all ``m`` under GPipe, else 1), plus the two fp32 gradients
      (8 bytes) of the one in backward;
    - at the start of backward the gradients count when they accumulate over several micro-batches, or when
      the schedule's steady state (a backward before each forward) reaches the same microbatches in flight;
    - with FSDP, torch's pipeline stages keep every microbatch's backward from resharding and from reducing
      (``set_reshard_after_backward(False)``, ``set_requires_gradient_sync(False)``) until the last one: from
      the first backward on, the stage's gathered weights (``c`` bytes per parameter / ``tp``; from the first
      forward with ``fsdp_reshard_after_forward = "never"``) and its unsharded gradients, accumulated in the
      reduce dtype (4 bytes for fp32), are alive (``pipeline_fsdp_buffers``); they count at the start of
      backward in the steady state, and always at the end of backward.

    Without pipelining this is exactly the single-stage model (one share, one microbatch of
    ``local_batch_size`` sequences in flight)."""
    p = setup.pp
    v = len(setup.stage_sizes(s.n_layers)) // p
    shards = setup.fsdp_shards
    local = stage_params(s, share) / (setup.tp * shards)
    experts = share.n_layers * s.moe_fraction * s.moe.expert_params(s.dim) if s.moe else 0.0
    local += experts / shards * (1 - 1 / setup.tp)  # experts are replicated over the TP ranks
    c = _bytes(setup)[0]
    matmul = share.n_layers * block_matmul_params(s) + (s.vocab_size * s.dim if share.last else 0)
    params = 4 * local
    if setup.fsdp and c != 4:  # gathered compute-dtype copies: ~2 blocks + the last group (norm + output)
        block = block_params(s) / setup.tp
        if s.moe:  # a gathered MoE block holds its rank's E / ep experts, not sharded over TP
            block += s.moe_fraction * s.moe.expert_params(s.dim) * (1 / setup.ep - 1 / setup.tp)
        params += c * (2 * block + (s.vocab_size * s.dim / setup.tp if share.last else 0))
    elif setup.autocast:  # autocast caches a bf16 copy of every matmul weight for backward
        params += c * matmul / setup.tp
    grads, optimizer = 4 * local, 8 * local  # fp32 gradients; AdamW's two fp32 moments
    muon_scratch = 0.0
    if setup.optimizer == "muon":  # Muon: one fp32 momentum buffer for the blocks' matrices
        muon_local = share.n_layers * block_matmul_params(s) / (setup.tp * shards)
        optimizer -= 4 * muon_local
        muon_scratch = 4 * c * muon_local  # step: send + receive buffers, an owner's gathered matrices + results
    sequences = setup.pp_microbatch_size if p > 1 else setup.local_batch_size
    tokens = sequences * setup.rank_seq_len / setup.tp
    kept, recomputed_per_token = _activation_per_token(s, setup, share.n_layers / v)
    final_norm = share.last_in_flight * _final_norm_per_token(setup, s)
    activations = tokens * (share.in_flight * kept + recomputed_per_token + final_norm)
    kv_kept, kv_recomputed = gathered_kv_bytes(s, setup, share.n_layers / v)
    activations += sequences * (share.in_flight * kv_kept + kv_recomputed)
    if setup.float8:  # float8 copies of the block weights, saved for backward by every forward outside AC
        kept_blocks, recomputed_blocks = _float8_saved_blocks(setup, share.n_layers / v)
        activations += (share.in_flight * kept_blocks + recomputed_blocks) * block_matmul_params(s) / setup.tp
    logits = _logits_bytes(s, setup, share, sequences * setup.rank_seq_len, c)
    scratch = (4 * local if setup.optimizer_impl == "foreach" else 0.0) + muon_scratch
    recomputed = 0.0 if setup.ac_mode == "none" else tokens * activation_bytes_per_token_layer(s, setup)
    steady = p > 1 and setup.pp_schedule != "GPipe" and setup.n_microbatches * v > share.in_flight
    unsharded_params = unsharded_grads = 0.0
    if p > 1 and setup.fsdp:  # torch's stages keep FSDP's gathered weights and unsharded gradients to the last backward
        unsharded = stage_params(s, share) / setup.tp + experts * (1 / setup.ep - 1 / setup.tp)  # E / ep experts
        unsharded_params = c * unsharded
        unsharded_grads = DTYPES[setup.reduce_dtype].itemsize * unsharded
    params_at_peak = unsharded_params if steady or setup.fsdp_reshard_after_forward == "never" else 0.0
    moments = {
        "start of backward": (grads if setup.grad_accum > 1 or steady else 0.0)
        + activations
        + logits
        + params_at_peak
        + (unsharded_grads if steady else 0.0),
        "end of backward": grads + recomputed + unsharded_params + unsharded_grads,
        "optimizer step": grads + scratch,
    }
    peak_at = max(moments, key=moments.get)
    p2p = pipeline_receive_buffers(s, setup, share)
    return {
        "pp_rank": share.pp_rank,
        "stages": list(share.stages),
        "params": stage_params(s, share),
        "in_flight": share.in_flight,
        "parameters": params,
        "gradients": grads,
        "optimizer": optimizer,
        "activations": activations,
        "logits": logits,
        "optimizer_scratch": scratch,
        "pipeline_fsdp_buffers": unsharded_params + unsharded_grads,
        "pipeline_receive_buffers": p2p,
        "total": params + optimizer + p2p + moments[peak_at],
        "peak_at": peak_at,
    }


def _logits_bytes(s: ModelShape, setup: RunSetup, share: StageShare, tokens: int, c: int) -> float:
    """The output layer's and loss's bytes (:func:`stage_memory_breakdown`) for ``tokens`` per microbatch: the
    logits (``c``) and fp32 log-softmax of each microbatch in flight on the last stage, plus the two fp32
    gradients of the one in backward; with ``loss_chunks``, all four of one piece of the tokens only, plus an
    fp32 ``[vocab, dim]`` weight gradient per microbatch in flight (held from its loss to its backward)."""
    vocab = s.vocab_size / setup.tp
    if not share.last:
        return 0.0
    if setup.loss_chunks:
        piece = -(-tokens // min(setup.loss_chunks, tokens))
        return piece * vocab * (c + 4 + 8) + share.last_in_flight * 4 * vocab * s.dim
    return tokens * vocab * ((c + 4) * share.last_in_flight + 8)


def pipeline_receive_buffers(s: ModelShape, setup: RunSetup, share: StageShare) -> float:
    """Bytes of the receive buffers torch's pipeline stages keep for the whole run: one per microbatch for the
    hidden states each stage but the first receives, and one per microbatch for the gradients each stage but
    the last receives (``pp_microbatch_size x seq_len / tp`` tokens of ``dim`` values, in the compute dtype
    with FSDP, else fp32: the residual stream stays fp32 under autocast)."""
    if setup.pp == 1:
        return 0.0
    num_stages = len(setup.stage_sizes(s.n_layers))
    hidden = setup.pp_microbatch_size * setup.rank_seq_len / setup.tp * s.dim * (_bytes(setup)[0] if setup.fsdp else 4)
    buffers = sum((stage > 0) + (stage < num_stages - 1) for stage in share.stages)
    return buffers * setup.n_microbatches * hidden


def pipeline_memory(s: ModelShape, setup: RunSetup) -> list[dict[str, Any]]:
    """:func:`stage_memory_breakdown` of every pipeline rank, in pp-rank order."""
    return [stage_memory_breakdown(s, setup, share) for share in stage_shares(s, setup)]


def memory_breakdown(s: ModelShape, setup: RunSetup) -> dict[str, Any]:
    """Per-GPU bytes by component (docs/memory_model.md); ``total`` is the modelled peak, reached
    at ``peak_at`` (start of backward, end of backward or optimizer step). With pipelining, the breakdown of
    the pipeline rank with the largest total (it decides whether the run fits; ``pp_rank`` says which)."""
    return max(pipeline_memory(s, setup), key=lambda m: m["total"])

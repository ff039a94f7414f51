"""Parallelism and training wrappers for a Llama 3 model (``parallelize_llama``), applied by
:func:`titanlite.parallel.build.build_parallel_model` on the *meta* device, before each rank allocates and
initializes its shards, so the full parameters never exist on one device. The order matters:

1. **Float8** swaps eligible linears first, on the plain module tree: every later step must see the final modules
   (a Float8Linear is an ``nn.Linear``, so the TP plan applies unchanged).
2. **Tensor parallel** (Megatron-style with sequence parallelism: :func:`block_tp_plan`,
   :func:`~titanlite.parallel.tensor_parallel.parallelize_decoder`) comes before AC and compile, so that the
   recomputed and compiled code include its collectives, and before FSDP, which shards the TP shards again.
3. **Activation checkpointing**, per block, before compile so the checkpoint is traced into the graph, and before
   FSDP so FSDP's all-gather/free hooks stay outside the checkpointed region.
4. **torch.compile**, per block (and the embedding and final norm), on the final block code, before FSDP, whose
   hooks must stay outside the compiled graph.
5. **FSDP2** last, as it wraps everything (:func:`apply_fsdp`): gradients are *summed* over data-parallel ranks;
   with one data-parallel rank it is not applied and the Trainer uses bf16 autocast (``Trainer.autocast``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

from titanlite.parallel.fsdp import FSDPPolicy
from titanlite.parallel.tensor_parallel import parallelize_decoder

logger = logging.getLogger(__name__)


def parallelize_llama(
    model: nn.Module, parallel_dims, policies, block_plan: Callable[[], dict] | None = None
) -> nn.Module:
    """Float8 -> TP -> AC -> compile -> FSDP on a meta-device Llama 3 model (see module docstring). ``block_plan()``:
    a block's TP plan, for a family with Llama's modules but another attention (default :func:`block_tp_plan`)."""
    check_llama_parallelism(model.args, parallel_dims)
    policies.float8.apply(model, parallel_dims.tp)
    if parallel_dims.tp_enabled:
        loss_parallel, plan = parallel_dims.loss_parallel_enabled, block_plan or block_tp_plan
        parallelize_decoder(model, parallel_dims.tp_mesh, loss_parallel, lambda block: plan())
        logger.info("tensor parallel over %d ranks (loss parallel: %s)", parallel_dims.tp, loss_parallel)
    if checkpointed := policies.activation_checkpoint.apply(model):
        logger.info("activation checkpointing %s on blocks %s", policies.activation_checkpoint, ",".join(checkpointed))
    if policies.compile.apply(model):
        logger.info("compiled each transformer block, the embedding and the final norm (fullgraph)")
    if (fsdp := policies.fsdp(parallel_dims)) is not None:
        apply_fsdp(model, fsdp)
        kind, dtypes = "HSDP" if parallel_dims.hsdp_enabled else "FSDP", (policies.param_dtype, policies.reduce_dtype)
        logger.info("%s over %d ranks (param %s, reduce %s, gradients summed)", kind, parallel_dims.dp_degree, *dtypes)
    return model


def check_llama_parallelism(args, parallel_dims) -> None:
    """One-line ``ValueError`` for a model that cannot be split ``parallel_dims``' way."""
    parallel_dims.check_tp_divides(
        **{
            "model.n_heads": args.n_heads,
            "model.n_kv_heads": args.kv_heads,
            # a field of some families' args, computed from others in Llama 3's
            "model.ffn_hidden_dim" if "ffn_hidden_dim" in vars(args) else "the SwiGLU hidden size": args.ffn_hidden_dim,
            "model.vocab_size": args.vocab_size,
        }
    )


def block_tp_plan() -> dict:
    """The TP + sequence-parallel plan of one Llama block, by submodule name: the norms sequence-parallel, the
    attention and feed-forward inputs gathered along the sequence, ``wq wk wv w1 w3`` column-wise (each rank a
    subset of heads / hidden units), ``wo w2`` row-wise with a reduce-scatter back to sequence shards."""
    return {
        "attention_norm": SequenceParallel(),
        # (x, rope_cache, attn_mask): gather x along the sequence; the rope table and mask are plain tensors
        "attention": PrepareModuleInput(
            input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None)
        ),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
        "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        "feed_forward.w3": ColwiseParallel(),
    }


def apply_fsdp(model: nn.Module, policy: FSDPPolicy) -> None:
    """FSDP groups bottom-up: one per block, ``tok_embeddings`` alone, ``output`` alone (the last group, so the
    chunked loss can run as its forward), the root with the final norm; a tied embedding/output is the root's."""
    tied = model.args.tie_word_embeddings
    if not tied and model.tok_embeddings is not None:  # None: a later pipeline stage
        policy.shard(model.tok_embeddings)
    for block in model.layers.values():
        policy.shard(block)
    if not tied and model.output is not None:  # None: an earlier pipeline stage
        policy.shard(model.output, last=True)  # the norm goes to the root group
    policy.finish(model)

"""Applying parallelism and training wrappers to a Llama 3 model: ``parallelize_llama``.

Called by :func:`titanlite.parallel.build.build_parallel_model` on the model built on the *meta*
device (no memory), before it is materialized; each rank's shards are then allocated (``to_empty``)
and initialized, so the full parameters never exist on one device. ``policies`` (a
:class:`~titanlite.parallel.policies.Policies`) carries the float8, AC, compile and FSDP settings.
The steps run in this order, and the order matters:

1. **Float8** (``[quantize.linear.float8]``): eligible ``nn.Linear`` modules are swapped for
   :class:`~titanlite.parallel.float8.Float8Linear` first, while the model is a plain module tree:
   module swaps are simple on meta, and every later step must see the final modules (TP shards
   the Float8Linear's weight like any linear; compile traces the float8 casts; FSDP groups its
   parameters). Float8Linear subclasses ``nn.Linear``, so the TP plan below applies unchanged.
2. **Tensor parallel** (``[parallelism] tensor_parallel_degree``): turns parameters into DTensors on
   the ``tp`` mesh and adds the input/output redistribution hooks. It must come before AC and
   compile, so that the recomputed and the compiled code include the DTensor collectives, and
   before FSDP, which shards the TP shards again along the data-parallel mesh (2-D parameters).
   Plan (Megatron-style, with sequence parallelism):

   - ``tok_embeddings``: row-wise (vocabulary-sharded table), output sharded along the sequence
     (reduce-scattered synchronously, see ``SyncRowwiseParallel``);
   - ``attention_norm`` / ``ffn_norm`` / ``norm``: sequence parallel (each rank normalizes its part
     of the sequence, so activations between blocks are never replicated);
   - ``attention`` / ``feed_forward`` inputs: all-gathered along the sequence; ``wq, wk, wv, w1,
     w3`` column-wise (each rank computes a subset of heads / hidden units), ``wo, w2`` row-wise
     with a reduce-scatter back to sequence shards;
   - ``output``: column-wise; with ``enable_loss_parallel`` the logits stay sharded over the
     vocabulary (the loss is computed from the shards, see ``titanlite.parallel.tensor_parallel``),
     otherwise they are all-gathered.

   The attention code infers the local head count from the projections, so it needs no change.
   A tied output shares the embedding's DTensor (both are ``Shard(0)`` over the vocabulary).
3. **Activation checkpointing** (``[activation_checkpoint]``): per block, after TP so recomputation
   includes the TP communication, before compile so the checkpoint is traced into the graph, and
   before FSDP so FSDP's all-gather/free hooks stay outside the checkpointed region.
4. **torch.compile** (``[compile]``): per block (and the embedding and final norm), on the final
   block code (float8 + TP + AC), and before FSDP, whose hooks must stay outside the compiled graph.
5. **FSDP2** (``data_parallel_shard_degree`` / ``_replicate_degree``): ``fully_shard`` bottom-up,
   one group per block, ``tok_embeddings`` alone, ``output`` alone (the last group, not resharded
   after forward by default since backward needs it first; alone so that the chunked loss can run as
   its forward, see ``titanlite.trainer.output_loss``), then the root with the final norm. A tied
   embedding/output is one tensor, so then embedding, norm and output form the root's group. HSDP
   when the replicate degree is above 1. Gradients are *summed* over data-parallel ranks
   (see ``titanlite.parallel.fsdp``). Last, because it wraps everything above.

With a single data-parallel rank FSDP is not applied and the Trainer uses bf16 autocast when
``mixed_precision_param = "bfloat16"`` (see ``Trainer.autocast`` for the measurement behind this).
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
    """The TP + sequence-parallel plan of one Llama block (module docstring, step 2), by submodule name."""
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
    """FSDP groups bottom-up (module docstring, step 5)."""
    tied = model.args.tie_word_embeddings
    if not tied and model.tok_embeddings is not None:  # None: a later pipeline stage
        policy.shard(model.tok_embeddings)
    for block in model.layers.values():
        policy.shard(block)
    if not tied and model.output is not None:  # None: an earlier pipeline stage
        policy.shard(model.output, last=True)  # the norm goes to the root group
    policy.finish(model)

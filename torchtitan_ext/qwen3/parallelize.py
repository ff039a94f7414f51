"""``parallelize_qwen3``: float8 -> tensor parallel -> activation checkpointing -> compile -> FSDP2.

Built from titanlite's public parallel building blocks (``titanlite.parallel``: the AC and compile
policies, the FSDP policy, :class:`~titanlite.parallel.tensor_parallel.SyncRowwiseParallel`, the
float8 swap) in the same order, and for the same reasons, as titanlite's Llama 3 plan (see
``titanlite/models/llama3/parallelize.py``), whose FSDP grouping it reuses. Only the tensor-parallel
plan differs, for QK-norm:

- ``wq`` and ``wk`` keep their output as a DTensor sharded over the heads (``use_local_output=
  False``), so that ``.view(B, S, -1, head_dim)`` yields a DTensor sharded on dimension 2 (heads);
- ``q_norm`` / ``k_norm`` are ``SequenceParallel(sequence_dim=2)``: their ``head_dim``-sized gains
  are replicated over the TP ranks, each rank normalizes its own heads, and because the gain is a
  replicated DTensor, its gradient (a sum over every head) is all-reduced over the TP group by
  DTensor. Keeping the gains as plain tensors would silently train each TP rank's copy on its own
  heads only. Their outputs are plain local tensors again (``use_local_output=True``), so RoPE and
  SDPA run on the local heads exactly as without TP.

Everything else (sequence-parallel norms, all-gathered block inputs, column-wise ``wq/wk/wv/w1/w3``,
row-wise ``wo/w2`` reduce-scattered back to sequence shards, vocabulary-parallel embedding and
output with loss parallel) is the Llama plan.
"""

from __future__ import annotations

import logging

from torch import nn
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from titanlite.models.llama3.parallelize import apply_fsdp  # same groups: embedding, blocks, output, root
from titanlite.models.llama3.parallelize import block_tp_plan as llama_block_tp_plan
from titanlite.parallel.tensor_parallel import parallelize_decoder_ends

logger = logging.getLogger(__name__)


def parallelize_qwen3(model: nn.Module, parallel_dims, policies) -> nn.Module:
    """Apply ``policies`` (float8, TP, AC, compile, FSDP) to a meta-device :class:`Qwen3Model` in place."""
    args = model.args
    parallel_dims.check_tp_divides(
        **{
            "model.n_heads": args.n_heads,
            "model.n_kv_heads": args.kv_heads,
            "model.ffn_hidden_dim": args.ffn_hidden_dim,
            "model.vocab_size": args.vocab_size,
        }
    )
    policies.float8.apply(model, parallel_dims.tp)
    if parallel_dims.tp_enabled:
        apply_tensor_parallel(model, parallel_dims.tp_mesh, parallel_dims.loss_parallel_enabled)
        logger.info("qwen3: tensor parallel over %d ranks", parallel_dims.tp)
    if checkpointed := policies.activation_checkpoint.apply(model):
        ac = policies.activation_checkpoint
        logger.info("qwen3: activation checkpointing %s on %d blocks", ac, len(checkpointed))
    policies.compile.apply(model)
    if (fsdp := policies.fsdp(parallel_dims)) is not None:
        apply_fsdp(model, fsdp)
        logger.info(
            "qwen3: %s over %d ranks", "HSDP" if parallel_dims.hsdp_enabled else "FSDP", parallel_dims.dp_degree
        )
    return model


def block_tp_plan(qk_norm: bool) -> dict:
    """The TP plan of one Qwen3 block (module docstring), by submodule name: Llama's, with QK-norm."""
    plan = llama_block_tp_plan()
    if qk_norm:
        plan["attention.wq"] = ColwiseParallel(use_local_output=False)
        plan["attention.wk"] = ColwiseParallel(use_local_output=False)
        plan["attention.q_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        plan["attention.k_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
    return plan


def apply_tensor_parallel(model: nn.Module, tp_mesh, loss_parallel: bool) -> None:
    parallelize_decoder_ends(model, tp_mesh, loss_parallel)
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, block_tp_plan(model.args.qk_norm))
    if (
        model.args.tie_word_embeddings and model.output is not None
    ):  # both were replaced by DTensors: share the embedding's again
        model.output.weight = model.tok_embeddings.weight

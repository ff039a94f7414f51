"""``parallelize_qwen3``: float8 -> tensor parallel -> activation checkpointing -> compile -> FSDP2.

Titanlite's Llama 3 plan (``titanlite/models/llama3/parallelize.py``: the same steps, order and FSDP
groups); only the tensor-parallel plan of a block differs, for QK-norm:

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

from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, SequenceParallel

from titanlite.models.llama3.parallelize import block_tp_plan as llama_block_tp_plan
from titanlite.models.llama3.parallelize import parallelize_llama


def parallelize_qwen3(model: nn.Module, parallel_dims, policies) -> nn.Module:
    """Apply ``policies`` (float8, TP, AC, compile, FSDP) to a meta-device :class:`Qwen3Model` in place: Llama's
    steps (:func:`titanlite.models.llama3.parallelize.parallelize_llama`) with Qwen3's block plan."""
    return parallelize_llama(model, parallel_dims, policies, lambda: block_tp_plan(model.args.qk_norm))


def block_tp_plan(qk_norm: bool) -> dict:
    """The TP plan of one Qwen3 block (module docstring), by submodule name: Llama's, with QK-norm."""
    plan = llama_block_tp_plan()
    if qk_norm:
        plan["attention.wq"] = ColwiseParallel(use_local_output=False)
        plan["attention.wk"] = ColwiseParallel(use_local_output=False)
        plan["attention.q_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        plan["attention.k_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
    return plan

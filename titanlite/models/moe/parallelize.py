"""The parallelize plan of a decoder whose blocks' ``feed_forward`` may be an :class:`~titanlite.models.moe.MoE`:
:func:`parallelize_moe_decoder` is the Llama plan (:mod:`titanlite.models.llama3.parallelize`, same order, same
reasons) with what MoE blocks need:

- **float8**: routers stay in high precision, and the stacked experts (no ``nn.Linear``) run their grouped GEMMs
  in the compute dtype.
- **TP** (attention and norms only): a MoE ``feed_forward`` takes the whole sequence and runs replicated on the TP
  ranks, so router and expert gradients are complete on every TP rank (``expert_tensor_parallel_degree`` = 1).
- **EP** (``ep > 1``): the stacked expert weights become ``Shard(0)`` DTensors over the ``ep`` mesh and tokens
  travel by all-to-all (:mod:`~titanlite.models.moe.expert_parallel`).
- **load groups**: a batch-level aux loss counts the micro-batch of every data-parallel rank (and CP rank) together;
  a sequence-level one counts each sequence's tokens over its CP ranks.
- **compile**: per block; fullgraph unless the block has the expert-parallel exchange (host split sizes) or the
  per-expert loop.
- **FSDP**: each MoE layer's experts form their own group first, over ``expert_fsdp_mesh`` under EP (the ranks
  that hold the same experts; dimension 1 sharded when there are fewer local experts than ranks), then the usual
  groups.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import PrepareModuleInputOutput

from titanlite.errors import ConfigError
from titanlite.models.llama3.parallelize import apply_fsdp
from titanlite.models.moe.expert_parallel import shard_experts
from titanlite.models.moe.layer import MoE
from titanlite.parallel.compile import CompilePolicy
from titanlite.parallel.tensor_parallel import parallelize_decoder

logger = logging.getLogger(__name__)

# the whole sequence in, replicated on the TP ranks, as local tensors; a sequence shard out
MOE_TP_PLAN = PrepareModuleInputOutput(
    input_layouts=(Shard(1),),
    desired_input_layouts=(Replicate(),),
    use_local_input=True,
    output_layouts=(Replicate(),),
    desired_output_layouts=(Shard(1),),
    use_local_output=True,
)


def moe_layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def check_moe_parallelism(model: nn.Module, parallel_dims) -> None:
    """One-line ``ValueError`` when the experts cannot be split ``parallel_dims``' way."""
    e = getattr(model.args, "moe_num_experts", 0)
    if e:
        if parallel_dims.ep > 1 and e % parallel_dims.ep:
            raise ConfigError(
                f"model.moe_num_experts ({e}) must be divisible by parallelism.expert_parallel_degree "
                f"({parallel_dims.ep}): each expert-parallel rank holds the same number of experts"
            )
    if parallel_dims.ep > 1 and not getattr(model.args, "n_moe_layers", 0):  # a pipeline stage may hold none
        raise ConfigError("parallelism.expert_parallel_degree > 1 needs a mixture-of-experts model")


def parallelize_moe_decoder(
    model: nn.Module, parallel_dims, policies, block_tp_plan: Callable[[], dict], tp_sizes: dict[str, int] | None = None
) -> nn.Module:
    """float8 -> TP -> EP -> AC -> compile -> FSDP on a meta-device decoder with MoE blocks (module docstring).
    ``block_tp_plan()``: the family's TP plan of a dense block; ``tp_sizes``: sizes TP must divide (named; default:
    the heads, the vocabulary and, with dense blocks, ``model.ffn_hidden_dim``)."""
    check_moe_parallelism(model, parallel_dims)
    if tp_sizes is None:
        a = model.args
        tp_sizes = {"model.n_heads": a.n_heads, "model.n_kv_heads": a.kv_heads, "model.vocab_size": a.vocab_size}
        if any(not a.is_moe_layer(i) for i in range(a.n_layers)):
            tp_sizes["model.ffn_hidden_dim"] = a.ffn_hidden_dim
    parallel_dims.check_tp_divides(**tp_sizes)
    moes = moe_layers(model)
    float8 = policies.float8
    if float8.enable:
        float8 = dataclasses.replace(float8, filter_fqns=(*float8.filter_fqns, "router"))
        if moes:
            logger.info("float8: routers stay in high precision; the stacked experts run their grouped GEMMs in bf16")
    float8.apply(model, parallel_dims.tp)
    if parallel_dims.tp_enabled:
        plan, lp = (lambda block: moe_block_plan(block, block_tp_plan())), parallel_dims.loss_parallel_enabled
        parallelize_decoder(model, parallel_dims.tp_mesh, lp, plan)
        logger.info("tensor parallel over %d ranks (MoE layers replicated over them)", parallel_dims.tp)
    for moe in moes:  # a batch is cut over the data-parallel ranks and, along the sequence, their CP ranks
        moe.load_group, moe.seq_group = parallel_dims.batch_group, parallel_dims.cp_group
        if parallel_dims.ep_enabled:
            shard_experts(moe.experts, parallel_dims.ep_mesh)
            moe.ep_group = parallel_dims.ep_mesh.get_group()
    if moes and parallel_dims.ep_enabled:
        e = moes[0].cfg.num_experts
        logger.info("expert parallel over %d ranks: %d experts per rank", parallel_dims.ep, e // parallel_dims.ep)
    if checkpointed := policies.activation_checkpoint.apply(model):
        logger.info("activation checkpointing %s on blocks %s", policies.activation_checkpoint, ",".join(checkpointed))
    if policies.compile.model:
        apply_compile(model, parallel_dims.tp_enabled, policies.compile)
    if (fsdp := policies.fsdp(parallel_dims)) is not None:
        mesh = parallel_dims.expert_fsdp_mesh if parallel_dims.ep_enabled else fsdp.mesh
        for moe in moes:  # fewer local experts than ranks: shard the experts' rows instead
            dim = 1 if moe.cfg.num_experts // parallel_dims.ep < mesh.size() else 0
            fsdp.shard(moe.experts, mesh=mesh, dim=dim)
        apply_fsdp(model, fsdp)
        kind = "HSDP" if parallel_dims.hsdp_enabled else "FSDP"
        logger.info("%s over %d ranks (experts: their own groups), gradients summed", kind, parallel_dims.fsdp_degree)
    return model


def moe_block_plan(block: nn.Module, dense_plan: dict) -> dict:
    """A block's TP plan: the family's dense one, with :data:`MOE_TP_PLAN` for a MoE ``feed_forward``."""
    if not isinstance(block.feed_forward, MoE):
        return dense_plan
    return {**{k: v for k, v in dense_plan.items() if not k.startswith("feed_forward")}, "feed_forward": MOE_TP_PLAN}


def apply_compile(model: nn.Module, on_dtensors: bool, policy: CompilePolicy) -> None:
    """Each block compiled separately by ``policy``; fullgraph unless its MoE layer leaves the graph (expert parallel
    exchange, per-expert loop) or the policy's ``fullgraph`` is off (context parallelism's attention)."""
    for block in model.layers.values():
        ff = block.feed_forward
        breaks = isinstance(ff, MoE) and (ff.ep_group is not None or not ff.experts.grouped_mm)
        block.forward = policy.compile(block.forward, on_dtensors, fullgraph=policy.fullgraph and not breaks)
    logger.info("compiled each transformer block")

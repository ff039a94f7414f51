"""Qwen3-MoE for titanlite, registered as ``qwen3_moe`` on import (``[job] extensions =
["torchtitan_ext.qwen3_moe"]``). Qwen3's attention (torchtitan_ext.qwen3) with titanlite's MoE layer,
expert parallelism and load balancing (titanlite.models.moe), and an HF adapter both ways to
``Qwen3MoeForCausalLM`` (per-expert HF tensors <-> stacked DCP tensors). Plugs in through
``titanlite.models.register_model`` only.
"""

from titanlite.models import ModelSpec, register_model
from titanlite.models.flops import active_params_of, flops_of, params_of
from titanlite.models.moe import MOE_RUN_ARGS
from titanlite.models.moe.parallelize import parallelize_moe_decoder
from titanlite.models.registry import RUN_ARGS
from titanlite.parallel.pipeline import pipeline_decoder
from titanlite.tokenizer import build_tokenizer
from torchtitan_ext.qwen3.parallelize import block_tp_plan
from torchtitan_ext.qwen3_moe.args import QWEN3_MOE_FLAVORS, Qwen3MoEArgs
from torchtitan_ext.qwen3_moe.hf_adapter import Qwen3MoEHFAdapter
from torchtitan_ext.qwen3_moe.model import Qwen3MoEModel


def parallelize_qwen3_moe(model, parallel_dims, policies):
    """Qwen3's TP plan (QK-norm) with MoE blocks (:func:`titanlite.models.moe.parallelize.parallelize_moe_decoder`)."""
    return parallelize_moe_decoder(model, parallel_dims, policies, lambda: block_tp_plan(model.args.qk_norm))


SPEC = register_model(
    ModelSpec(
        name="qwen3_moe",
        args_cls=Qwen3MoEArgs,
        flavors=QWEN3_MOE_FLAVORS,
        model_cls=Qwen3MoEModel,
        parallelize_fn=parallelize_qwen3_moe,
        pipeline_fn=pipeline_decoder,
        hf_adapter=Qwen3MoEHFAdapter,
        tokenizer_builder=build_tokenizer,
        num_params=params_of,
        flops_per_token=flops_of,
        active_params=active_params_of,
        run_args=RUN_ARGS + MOE_RUN_ARGS,
    )
)

__all__ = ["QWEN3_MOE_FLAVORS", "Qwen3MoEArgs", "Qwen3MoEHFAdapter", "Qwen3MoEModel", "SPEC", "parallelize_qwen3_moe"]

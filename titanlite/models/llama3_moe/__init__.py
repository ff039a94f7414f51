"""``llama3_moe``: a Llama 3 decoder with MoE feed-forward layers (core's MoE model): its :class:`ModelSpec`, which the
registry finds by name (``BUILTIN_FAMILIES``)."""

from titanlite.models.flops import active_params_of, flops_of, params_of
from titanlite.models.llama3.parallelize import block_tp_plan
from titanlite.models.llama3_moe.args import LLAMA3_MOE_FLAVORS, Llama3MoEArgs
from titanlite.models.llama3_moe.model import Llama3MoE
from titanlite.models.moe import MOE_RUN_ARGS
from titanlite.models.moe.parallelize import parallelize_moe_decoder
from titanlite.models.registry import RUN_ARGS, ModelSpec
from titanlite.parallel.pipeline import pipeline_decoder
from titanlite.tokenizer import build_tokenizer


def parallelize_llama3_moe(model, parallel_dims, policies):
    """Llama's plan with MoE blocks (:func:`titanlite.models.moe.parallelize.parallelize_moe_decoder`)."""
    return parallelize_moe_decoder(model, parallel_dims, policies, block_tp_plan)


LLAMA3_MOE_SPEC = ModelSpec(
    name="llama3_moe",
    args_cls=Llama3MoEArgs,
    flavors=LLAMA3_MOE_FLAVORS,
    model_cls=Llama3MoE,
    parallelize_fn=parallelize_llama3_moe,
    pipeline_fn=pipeline_decoder,
    tokenizer_builder=build_tokenizer,
    num_params=params_of,
    flops_per_token=flops_of,
    active_params=active_params_of,
    run_args=RUN_ARGS + MOE_RUN_ARGS,
)

__all__ = ["LLAMA3_MOE_FLAVORS", "LLAMA3_MOE_SPEC", "Llama3MoE", "Llama3MoEArgs", "parallelize_llama3_moe"]

"""Llama 3 family: its :class:`ModelSpec`, which the registry finds by name (``BUILTIN_FAMILIES``)."""

from titanlite.models.flops import flops_of, params_of
from titanlite.models.llama3.args import LLAMA3_FLAVORS, Llama3ModelArgs
from titanlite.models.llama3.hf_adapter import Llama3HFAdapter
from titanlite.models.llama3.model import Transformer
from titanlite.models.llama3.parallelize import parallelize_llama
from titanlite.models.registry import ModelSpec
from titanlite.parallel.pipeline import pipeline_decoder
from titanlite.tokenizer import build_tokenizer

LLAMA3_SPEC = ModelSpec(
    name="llama3",
    args_cls=Llama3ModelArgs,
    flavors=LLAMA3_FLAVORS,
    model_cls=Transformer,
    parallelize_fn=parallelize_llama,
    pipeline_fn=pipeline_decoder,
    hf_adapter=Llama3HFAdapter,
    tokenizer_builder=build_tokenizer,
    num_params=params_of,
    flops_per_token=flops_of,
)

__all__ = ["LLAMA3_SPEC", "Llama3HFAdapter", "Llama3ModelArgs", "LLAMA3_FLAVORS", "Transformer", "parallelize_llama"]

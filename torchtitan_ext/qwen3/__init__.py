"""Qwen3-style dense decoder family for titanlite, registered as ``qwen3`` on import.

Activate it with ``[job] extensions = ["torchtitan_ext.qwen3"]`` in a train config (or
``--job.extensions torchtitan_ext.qwen3``), then ``[model] name = "qwen3"``; from Python, just
``import torchtitan_ext.qwen3``. It plugs in through ``titanlite.models.register_model`` only.
"""

from titanlite.models import ModelSpec, register_model
from titanlite.models.flops import flops_of
from titanlite.parallel.pipeline import pipeline_decoder
from titanlite.tokenizer import build_tokenizer
from torchtitan_ext.qwen3.args import QWEN3_FLAVORS, Qwen3ModelArgs, num_params_from_args
from torchtitan_ext.qwen3.hf_adapter import Qwen3HFAdapter
from torchtitan_ext.qwen3.model import Qwen3Model
from torchtitan_ext.qwen3.parallelize import parallelize_qwen3

SPEC = register_model(
    ModelSpec(
        name="qwen3",
        args_cls=Qwen3ModelArgs,
        flavors=QWEN3_FLAVORS,
        model_cls=Qwen3Model,
        parallelize_fn=parallelize_qwen3,
        pipeline_fn=pipeline_decoder,
        hf_adapter=Qwen3HFAdapter,
        tokenizer_builder=build_tokenizer,  # tokenizer.json (Qwen3 ships only that), tiktoken, HF folder or bytes
        num_params=num_params_from_args,
        flops_per_token=flops_of,
    )
)

__all__ = [
    "QWEN3_FLAVORS",
    "Qwen3HFAdapter",
    "Qwen3Model",
    "Qwen3ModelArgs",
    "SPEC",
    "num_params_from_args",
    "parallelize_qwen3",
]

"""Model families and their registry (core's families, llama3 and llama3_moe, are found by name on their first
lookup); ``load_config`` is the config loader that knows the families, and :mod:`titanlite.models.protocol` the
contract every family keeps."""

from titanlite.models.registry import (
    ModelSpec,
    build_model,
    get_model_spec,
    load_config,
    make_model_args,
    model_names,
    model_schema,
    register_model,
)

__all__ = [
    "ModelSpec",
    "build_model",
    "get_model_spec",
    "load_config",
    "make_model_args",
    "model_names",
    "model_schema",
    "register_model",
]

"""Model families and their registry; ``load_config`` is the config loader that knows them."""

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

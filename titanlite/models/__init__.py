"""Model families and their registry; importing it registers the built-in family (llama3, llama3_moe), and
``load_config`` is the config loader that knows the families."""

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

import titanlite.models.llama3  # noqa: E402, F401  (registers itself)
import titanlite.models.llama3_moe  # noqa: E402, F401  (registers itself)

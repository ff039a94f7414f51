"""Model families and their registry."""
from titanlite.models.registry import (
    ModelSpec,
    build_model,
    get_model_spec,
    make_model_args,
    model_names,
    register_model,
)

__all__ = ["ModelSpec", "build_model", "get_model_spec", "make_model_args", "model_names", "register_model"]

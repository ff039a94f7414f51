"""DCP <-> Hugging Face: :func:`dcp_to_hf` (:mod:`~titanlite.checkpoint.hf_export`), :func:`hf_to_dcp`
(:mod:`~titanlite.checkpoint.hf_import`). The other names it held moved: importing one names the new module."""

from titanlite.checkpoint.hf_export import dcp_to_hf
from titanlite.checkpoint.hf_import import hf_to_dcp

__all__ = ["dcp_to_hf", "hf_to_dcp"]
_MOVED = {  # new module: the names that moved there
    "titanlite.checkpoint.seed_args": "model_args_from_seed",
    "titanlite.checkpoint.hf_export": "model_from_info",
    "titanlite.checkpoint.hf_import": "read_hf_config hf_seed hf_state_dict INDEX_FILE SINGLE_FILE Progress",
    "torchtitan_ext.compat.format": "torchtitan_version torchtitan_name torchtitan_model_args TORCHTITAN_QKV "
    "TORCHTITAN_LLAMA3_HEADS TORCHTITAN_LLAMA3_KEYS",
}


def __getattr__(name: str):
    if where := next((module for module, names in _MOVED.items() if name in names.split()), None):
        raise ImportError(f"titanlite.checkpoint.hf.{name} moved to {where}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

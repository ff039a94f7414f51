"""Conversion between titanlite DCP step folders and Hugging Face model folders: :func:`dcp_to_hf`
(:mod:`~titanlite.checkpoint.hf_export`) and :func:`hf_to_dcp` (:mod:`~titanlite.checkpoint.hf_import`).
The other names this module held moved; importing one is an ImportError naming its new module."""

from titanlite.checkpoint.hf_export import dcp_to_hf
from titanlite.checkpoint.hf_import import hf_to_dcp

__all__ = ["dcp_to_hf", "hf_to_dcp"]

_MOVED = {
    **dict.fromkeys(["model_args_from_seed"], "titanlite.checkpoint.seed_args"),
    **dict.fromkeys(["model_from_info"], "titanlite.checkpoint.hf_export"),
    **dict.fromkeys(
        ["read_hf_config", "hf_seed", "hf_state_dict", "INDEX_FILE", "SINGLE_FILE", "Progress"],
        "titanlite.checkpoint.hf_import",
    ),
    **dict.fromkeys(
        ["torchtitan_version", "torchtitan_name", "torchtitan_model_args", "TORCHTITAN_QKV"]
        + ["TORCHTITAN_LLAMA3_HEADS", "TORCHTITAN_LLAMA3_KEYS"],
        "torchtitan_ext.compat.format",
    ),
}


def __getattr__(name: str):
    if name in _MOVED:
        raise ImportError(f"titanlite.checkpoint.hf.{name} moved to {_MOVED[name]}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

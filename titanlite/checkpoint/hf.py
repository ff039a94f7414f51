"""DCP <-> Hugging Face: :func:`dcp_to_hf` (:mod:`~titanlite.checkpoint.hf_export`), :func:`hf_to_dcp`
(:mod:`~titanlite.checkpoint.hf_import`). The other names it held moved (``titanlite._moved``): importing one names
the new module."""

from titanlite._moved import moved_names
from titanlite.checkpoint.hf_export import dcp_to_hf
from titanlite.checkpoint.hf_import import hf_to_dcp

__all__ = ["dcp_to_hf", "hf_to_dcp"]
__getattr__ = moved_names(__name__)

"""The one table of dtype names used in configs, checkpoints and conversions: ``DTYPES[name]``."""

import contextlib

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def autocast(device_type: str, dtype: torch.dtype | None):
    """``torch.autocast`` to ``dtype`` on ``device_type``, or a no-op context when ``dtype`` is None (fp32)."""
    return contextlib.nullcontext() if dtype is None else torch.autocast(device_type, dtype=dtype)

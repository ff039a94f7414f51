"""Non-tensor checkpoint state as tensors and JSON, so loading a checkpoint never unpickles anything (DCP would
``torch.load(weights_only=False)`` what ``torch.save`` stored). :func:`encode` turns a state dict into the structure
as UTF-8 JSON in a ``uint8`` tensor (``"json"``) plus each tensor found inside it (``"tensor_<i>"``);
:func:`decode` rebuilds it. Floats round-trip, ``inf``/``nan`` are ``Infinity``/``NaN``, tuples and non-string
keys are tagged; anything else (bytes, arbitrary objects) is refused at save with the path to the value.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from titanlite.errors import CheckpointError

JSON_KEY = "json"
_TAG = "__titanlite__"


def encode(obj: Any, what: str = "state") -> dict[str, torch.Tensor]:
    """``{"json": uint8 tensor, "tensor_0": ..., ...}`` holding ``obj`` (see the module docstring)."""
    tensors: list[torch.Tensor] = []

    def walk(v: Any, path: str) -> Any:
        if v is None or isinstance(v, (bool, int, float, str)):
            return v
        if type(v).__module__ == "numpy" and hasattr(v, "item") and getattr(v, "ndim", 1) == 0:
            return walk(v.item(), path)  # a numpy scalar: its Python value
        if isinstance(v, torch.Tensor):
            tensors.append(v.detach().cpu())
            return {_TAG: "tensor", "i": len(tensors) - 1}
        if isinstance(v, tuple):
            return {_TAG: "tuple", "items": [walk(x, f"{path}[{i}]") for i, x in enumerate(v)]}
        if isinstance(v, list):
            return [walk(x, f"{path}[{i}]") for i, x in enumerate(v)]
        if isinstance(v, dict):
            if all(isinstance(k, str) for k in v) and _TAG not in v:
                return {k: walk(x, f"{path}.{k}") for k, x in v.items()}
            return {_TAG: "dict", "items": [[walk(k, path), walk(x, f"{path}[{k!r}]")] for k, x in v.items()]}
        raise TypeError(f"{what}: cannot store {path} ({type(v).__name__}) in a checkpoint without pickling")

    text = json.dumps(walk(obj, what), separators=(",", ":"), allow_nan=True)
    out = {JSON_KEY: torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8)}
    out.update({f"tensor_{i}": t for i, t in enumerate(tensors)})
    return out


def decode(entries: dict[str, torch.Tensor]) -> Any:
    """The value :func:`encode` stored; ValueError when the JSON is not readable."""
    try:
        tree = json.loads(bytes(entries[JSON_KEY].cpu().numpy()).decode("utf-8"))
    except (KeyError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"unreadable checkpoint state ({type(e).__name__}: {e})") from None

    def build(v: Any) -> Any:
        if isinstance(v, list):
            return [build(x) for x in v]
        if not isinstance(v, dict):
            return v
        tag = v.get(_TAG)
        if tag == "tensor":
            return entries[f"tensor_{v['i']}"]
        if tag == "tuple":
            return tuple(build(x) for x in v["items"])
        if tag == "dict":
            return {_key(build(k)): build(x) for k, x in v["items"]}
        return {k: build(x) for k, x in v.items()}

    return build(tree)


def _key(k: Any) -> Any:
    return tuple(k) if isinstance(k, list) else k


def placeholders(shapes: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> dict[str, torch.Tensor]:
    """Empty tensors for DCP to load into, from the stored ``{entry: (shape, dtype)}``."""
    return {k: torch.empty(shape, dtype=dtype) for k, (shape, dtype) in shapes.items()}

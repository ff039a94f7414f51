"""Parameter-name mapping between titanlite and Hugging Face decoder checkpoints.

Decoder families share one layout: a few top-level tensors (embedding, final norm, output) and
``layers.<i>.<suffix>`` blocks, which Hugging Face stores as ``model.layers.<i>.<hf suffix>``. A
family's HF adapter subclasses :class:`HFNameMap` and fills the two tables; it adds the tensor
layout changes (if any) and the config.json translation itself.
"""
from __future__ import annotations

import re
from typing import Optional

_NATIVE_BLOCK_RE = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_BLOCK_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# HF keys that carry no weights (older exports store the rotary inverse frequencies)
_HF_IGNORED_RE = re.compile(r"(^|\.)rotary_emb\.inv_freq$")


class HFNameMap:
    """Native <-> HF names from two tables: ``TOP`` (whole names) and ``BLOCK`` (suffixes in a block)."""

    architecture = "?"
    TOP: dict[str, str] = {}
    BLOCK: dict[str, str] = {}

    def to_hf_name(self, name: str) -> str:
        if name in self.TOP:
            return self.TOP[name]
        m = _NATIVE_BLOCK_RE.match(name)
        if m and m.group(2) in self.BLOCK:
            return f"model.layers.{m.group(1)}.{self.BLOCK[m.group(2)]}"
        raise KeyError(f"no Hugging Face name for parameter {name!r}")

    def from_hf_name(self, hf_name: str) -> Optional[str]:
        """The native name of an HF tensor; None for tensors that hold no weights (rotary tables)."""
        if _HF_IGNORED_RE.search(hf_name):
            return None
        for native, hf in self.TOP.items():
            if hf == hf_name:
                return native
        m = _HF_BLOCK_RE.match(hf_name)
        if m:
            for native, hf in self.BLOCK.items():
                if hf == m.group(2):
                    return f"layers.{m.group(1)}.{native}"
        raise KeyError(f"unexpected tensor {hf_name!r} for a {self.architecture}")

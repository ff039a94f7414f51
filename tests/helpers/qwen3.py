"""Tiny Qwen3 models with non-trivial norms and their model-only step folders (tests/ext, tests/eval)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from titanlite.checkpoint import layout
from torchtitan_ext.qwen3 import Qwen3Model, Qwen3ModelArgs


def tiny_args(**kw) -> Qwen3ModelArgs:
    base = dict(
        dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, ffn_hidden_dim=96, vocab_size=512, max_seq_len=128
    )
    return Qwen3ModelArgs(**{**base, **kw})


def qwen3_model(args: Qwen3ModelArgs) -> Qwen3Model:
    torch.manual_seed(0)
    model = Qwen3Model(args)
    model.init_weights()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # break the all-ones init so every norm (QK-norm included) matters
                p.uniform_(0.5, 1.5)
    return model.eval()


def save_step_folder(model: Qwen3Model, path: Path) -> Path:
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(path), no_dist=True)
    layout.write_info(
        path,
        {
            "step": 3,
            "model_only": True,
            "dtype": "float32",
            "model": {"name": "qwen3", "flavor": None, "args": dataclasses.asdict(model.args)},
            "tokenizer": {"bos_id": 256, "eos_id": 257},  # the byte tokenizer's, which the tests load it with
        },
    )
    return path

"""Tiny Llama 3 models with non-trivial norms, their model-only step folders, and the conversion command.

The DCP <-> Hugging Face, export, generation and scoring tests build the same small model from these.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from tests.helpers.launch import run_python
from titanlite.checkpoint import layout
from titanlite.models.llama3 import Llama3ModelArgs, Transformer

REPO = Path(__file__).resolve().parents[2]


def tiny_args(**overrides) -> Llama3ModelArgs:
    base = dict(
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        vocab_size=512,
        multiple_of=256,
        rope_theta=500000.0,
        max_seq_len=128,
    )
    return Llama3ModelArgs(**{**base, **overrides})


def titanlite_model(args: Llama3ModelArgs, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(args)
    model.init_weights()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # break the all-ones init so the norms are exercised
                p.uniform_(0.5, 1.5)
    return model.eval()


def save_step_folder(model: Transformer, path: Path) -> Path:
    """What a model-only titanlite checkpoint looks like (DCP + checkpoint.json)."""
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(path), no_dist=True)
    layout.write_info(
        path,
        {
            "step": 7,
            "model_only": True,
            "dtype": "float32",
            "model": {"name": "llama3", "flavor": None, "args": dataclasses.asdict(model.args)},
            "tokenizer": {"bos_id": 256, "eos_id": 257},  # the built-in byte tokenizer's ids
        },
    )
    return path


def tokens(vocab: int = 512) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 48), generator=torch.Generator().manual_seed(1))


def run_cli(script: str, *args: str) -> subprocess.CompletedProcess:
    return run_python(
        [sys.executable, "-m", "titanlite", "convert", script, *args],
        cwd=REPO,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )

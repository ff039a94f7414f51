"""The tiny Qwen3-MoE model and step folder that the Qwen3-MoE and the HF weight-check tests share."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

import torchtitan_ext.qwen3_moe  # noqa: F401  (registers "qwen3_moe")
from titanlite.checkpoint import layout
from torchtitan_ext.qwen3_moe import Qwen3MoEArgs, Qwen3MoEModel


def tiny_args(**kw) -> Qwen3MoEArgs:
    base = dict(
        dim=64,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        head_dim=32,
        ffn_hidden_dim=96,
        vocab_size=512,
        max_seq_len=128,
        mlp_only_layers=[0],
        moe_num_experts=4,
        moe_top_k=2,
        moe_hidden_dim=32,
        moe_norm_topk_prob=True,
    )
    return Qwen3MoEArgs(**{**base, **kw})


def moe_model(args: Qwen3MoEArgs) -> Qwen3MoEModel:
    torch.manual_seed(0)
    model = Qwen3MoEModel(args)
    model.init_weights()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # break the all-ones init so every norm matters
                p.uniform_(0.5, 1.5)
            elif "router" in name:  # routing far from uniform: the top-k choice matters
                p.normal_(0, 0.5)
    return model.eval()


def save_step_folder(model: Qwen3MoEModel, path: Path) -> Path:
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(path), no_dist=True)
    info = {"step": 3, "model_only": True, "dtype": "float32", "tokenizer": {"bos_id": 1, "eos_id": 2}}
    info["model"] = {"name": "qwen3_moe", "flavor": None, "args": dataclasses.asdict(model.args)}
    layout.write_info(path, info)
    return path

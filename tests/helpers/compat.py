"""A torchtitan v0.2-style debug config and checkpoint, and the compat trainer stepped by hand (tests/ext)."""

from __future__ import annotations

import io
import json
import pickle
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

from torchtitan_ext.compat import load_translated, translate
from torchtitan_ext.compat.train import CompatTrainer

FLAT = StateDictOptions(flatten_optimizer_state_dict=True)
TINY = ["--model.dim", "64", "--model.n_layers", "2", "--model.n_heads", "4"]  # titanlite overrides, passed through


def write_data(folder: Path) -> Path:
    """A local stand-in for torchtitan's c4_test: JSON lines with a "text" field."""
    path = folder / "c4_test.json"
    with open(path, "w") as f:
        for i in range(200):
            f.write(
                json.dumps({"text": f"Document {i}. " + "The quick brown fox jumps over the lazy dog. " * 6}) + "\n"
            )
    return path


def torchtitan_toml(folder: Path, body: str = "", steps: int = 6, ckpt: bool = True) -> Path:
    """A torchtitan v0.2-style llama3 debug config (the layout of torchtitan's debug_model.toml)."""
    data = write_data(folder)
    text = (
        f"""
[job]
dump_folder = "{folder / "out"}"
description = "Llama 3 debug training"
print_args = false
use_for_integration_test = true

[metrics]
log_freq = 1
disable_color_printing = false
enable_tensorboard = false
enable_wandb = false

[model]
name = "llama3"
flavor = "debugmodel"
tokenizer_path = ""
converters = []

[optimizer]
name = "AdamW"
lr = 3e-3
eps = 1e-8

[lr_scheduler]
warmup_steps = 2
decay_ratio = 0.8
decay_type = "linear"
min_lr_factor = 0.0

[training]
local_batch_size = 2
seq_len = 32
max_norm = 1.0
steps = {steps}
dataset = "c4_test"
dataset_path = "{data}"
mixed_precision_param = "float32"

[parallelism]
data_parallel_replicate_degree = 1
data_parallel_shard_degree = -1
fsdp_reshard_after_forward = "default"
tensor_parallel_degree = 1
pipeline_parallel_degree = 1
context_parallel_degree = 1

[checkpoint]
enable_checkpoint = {"true" if ckpt else "false"}
folder = "checkpoint"
interval = 100
last_save_model_only = false
async_mode = "disabled"

[activation_checkpoint]
mode = "none"

[compile]
enable = false
components = ["model", "loss"]
"""
        + body
    )
    path = folder / "torchtitan.toml"
    path.write_text(text)
    return path


def write_torchtitan_checkpoint(path: Path, trainer, legacy: bool = False) -> None:
    """A DCP folder exactly as torchtitan's CheckpointManager lays it out (v0.2, or before flattening)."""
    model_sd = get_model_state_dict(trainer.model)
    optim_sd = get_optimizer_state_dict(trainer.model, trainer.optimizer, options=FLAT)
    loader = {"world_size": 1, "dp_rank_0": pickle.dumps({"sample_idx": 123})}
    if legacy:  # model under "model.", TrainState with a tensor step and BytesIO loss histories
        hist = io.BytesIO()
        torch.save([], hist)
        states = {
            "model": model_sd,
            "train_state": {
                "step": torch.tensor(trainer.state.step, dtype=torch.int32),
                "global_avg_losses": hist,
                "global_max_losses": io.BytesIO(hist.getvalue()),
                "log_steps": io.BytesIO(hist.getvalue()),
            },
        }
    else:
        states = {**model_sd, "train_state": {"step": trainer.state.step, "ntokens_seen": trainer.state.tokens_seen}}
    states.update({"optimizer": optim_sd, "lr_scheduler": trainer.lr_scheduler.state_dict(), "dataloader": loader})
    dcp.save(states, checkpoint_id=str(path), no_dist=True)


def compat_trainer(toml: Path, extra=()) -> CompatTrainer:
    tr = translate(str(toml), [*TINY, *extra])
    return CompatTrainer(load_translated(tr), settings=tr.settings)


def take_steps(trainer: CompatTrainer, data, n: int = 1) -> None:
    """``n`` optimizer steps through the trainer's TrainStep, counted in its loop state."""
    for _ in range(n):
        result = trainer.train_step(data)
        trainer.state.step += 1
        trainer.state.tokens_seen += result.tokens

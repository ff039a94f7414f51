"""A run resumed with the other optimizer (AdamW -> Muon, Muon -> AdamW): the checkpoint's optimizer state is
dropped with a warning, the new optimizer starts empty, and the LR schedule keeps its position with the new
optimizer's groups (Muon's group has its own lr, which the schedule must move too)."""

from __future__ import annotations

import logging

import pytest

from tests.helpers.dist import cache_token_stores
from tests.helpers.tiny import TINY_MODEL
from titanlite.models import load_config
from titanlite.optim.lr_scheduler import lr_factor
from titanlite.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")


def config(dump, name: str, steps: int):
    ckpt = ["--checkpoint.enable", "--checkpoint.interval", "2", "--checkpoint.last_save_model_only", "false"]
    return load_config(
        [
            *TINY_MODEL,
            "--training.seq_len",
            "16",
            "--training.local_batch_size",
            "2",
            "--lr_scheduler.warmup_steps",
            "1",
        ]
        + ["--training.steps", str(steps), "--optimizer.name", name, "--optimizer.muon_lr", "0.02", *ckpt]
        + ["--metrics.log_freq", "1", "--job.dump_folder", str(dump)]
    )


@pytest.mark.parametrize("first, then", [("AdamW", "muon"), ("muon", "AdamW")])
def test_checkpoint_continues_with_the_other_optimizer(first, then, tmp_path, caplog):
    cache_token_stores()  # the built-in corpus tokenized once for both trainers
    Trainer(config(tmp_path, first, 2)).train()
    trainer = Trainer(config(tmp_path, then, 4))
    with caplog.at_level(logging.WARNING, logger="titanlite.checkpoint"):
        records = [r for r in trainer.train() if "loss" in r]
    assert [r["step"] for r in records] == [3, 4]  # resumed at step 2
    assert "written by another optimizer" in caplog.text and "starts with an empty state" in caplog.text
    kinds = {frozenset(s) for s in trainer.optimizer.state.values()}
    want = {frozenset({"step", "exp_avg", "exp_avg_sq"})} | (
        {frozenset({"momentum_buffer"})} if then == "muon" else set()
    )
    assert kinds == want
    lrs = sorted({g["initial_lr"] for g in trainer.optimizer.param_groups})
    assert lrs == ([8e-4, 0.02] if then == "muon" else [8e-4])
    factor = lr_factor(4, total_steps=4, warmup_steps=1)  # after the last step the schedule stays at its end
    for g in trainer.optimizer.param_groups:
        assert g["lr"] == pytest.approx(g["initial_lr"] * factor)
    assert len(trainer.lr_scheduler.base_lrs) == len(trainer.optimizer.param_groups)

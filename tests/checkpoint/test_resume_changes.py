"""A resume that changes a setting the weights' meaning does not depend on (float8 on or off, an MoE balancing
coefficient) goes ahead with one log line per change naming the key, its old and its new value."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from tests.helpers.dist import cache_token_stores
from tests.helpers.tiny import TINY_MODEL
from titanlite.models import load_config
from titanlite.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")

MOE = [
    *TINY_MODEL,
    "--model.name",
    "llama3_moe",
    "--model.moe_num_experts",
    "4",
    "--model.moe_hidden_dim",
    "32",
    "--training.seq_len",
    "32",
    "--training.local_batch_size",
    "2",
    "--checkpoint.enable",
    "--checkpoint.interval",
    "2",
    "--checkpoint.last_save_model_only",
    "false",
    "--validation.enable",
    "false",
]


def train(dump: Path, *extra: str) -> None:
    cache_token_stores()
    Trainer(load_config([*MOE, "--job.dump_folder", str(dump), *extra])).train()


def test_float8_off_and_a_new_balancing_coefficient_are_logged_on_resume(tmp_path, caplog):
    dump = tmp_path / "run"
    train(dump, "--training.steps", "2", "--quantize.linear.float8.enable", "true")
    with caplog.at_level(logging.INFO, logger="titanlite"):
        train(dump, "--training.steps", "3", "--model.moe_aux_loss_coef", "0.05")
    assert "RESUMED from" in caplog.text
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("resume: ")]
    assert lines == [
        "resume: model.moe_aux_loss_coef changed from 0.001 (step-2) to 0.05",
        "resume: quantize.linear.float8.enable changed from True (step-2) to False",
        "resume: training.steps changed from 2 (step-2) to 3",
    ]

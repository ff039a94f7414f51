"""The tokenizer a checkpoint was trained with is recorded by absolute path and SHA-256: ``load_model`` (eval,
generate, the watcher) and ``dcp_to_hf`` find it from any folder, refuse a changed or missing file in one line,
and an export never silently lacks it (``no_tokenizer`` asks for that); an older record without a hash is used
as recorded, with a warning that it is unverified."""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from pathlib import Path

import pytest

from tests.helpers.dist import cache_token_stores
from tests.helpers.shared_data import shared_file
from tests.helpers.tiny import TINY_MODEL
from titanlite.checkpoint import layout
from titanlite.checkpoint.hf_export import dcp_to_hf
from titanlite.checkpoint.load_model import load_model
from titanlite.models import load_config
from titanlite.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")
RUN = [
    *TINY_MODEL,
    "--model.tokenizer_path",
    "assets/tok.model",  # relative to the training folder, as typed
    "--training.steps",
    "1",
    "--lr_scheduler.warmup_steps",
    "0",
    "--training.seq_len",
    "32",
    "--training.local_batch_size",
    "2",
    "--checkpoint.enable",
    "--checkpoint.interval",
    "1",
    "--validation.enable",
    "false",
]


def tokenizer_copy(folder: Path, extra: bytes = b"") -> Path:
    """``folder/assets/tok.model``: the shared tiktoken file (``extra`` appended: another file, the same ids)."""
    (folder / "assets").mkdir(parents=True)
    file = folder / "assets" / "tok.model"
    file.write_bytes(shared_file("tokenizers/test_tiktoken.model").read_bytes() + extra)
    return file


@pytest.fixture
def trained(tmp_path, monkeypatch) -> tuple[Path, Path]:
    """(the step folder of a run trained in ``tmp_path/train`` with a relative tokenizer path, that tokenizer)."""
    train = tmp_path / "train"
    tok = tokenizer_copy(train)
    monkeypatch.chdir(train)
    cache_token_stores()
    Trainer(load_config([*RUN, "--job.dump_folder", "dump"])).train()
    elsewhere = tmp_path / "elsewhere"  # the tools run from another folder, with a tokenizer of its own there
    tokenizer_copy(elsewhere, b"\n")
    monkeypatch.chdir(elsewhere)
    return train / "dump" / "checkpoint" / "step-1", tok


def test_recorded_by_absolute_path_and_hash_and_found_from_another_folder(trained, tmp_path):
    step, tok = trained
    recorded = layout.read_info(step)["tokenizer"]
    assert recorded["path"] == str(tok) and recorded["sha256"] == hashlib.sha256(tok.read_bytes()).hexdigest()
    assert load_model(step).tokenizer.path == str(tok)  # not ./assets/tok.model of this folder
    out = dcp_to_hf(step, tmp_path / "hf")
    assert (out / "tokenizer.json").is_file()


def test_a_changed_or_missing_tokenizer_is_refused(trained, tmp_path):
    step, tok = trained
    tok.write_bytes(tok.read_bytes() + b"\n")  # the same size of vocabulary, another file
    info = step / layout.INFO_FILE
    for call in (lambda: load_model(step), lambda: dcp_to_hf(step, tmp_path / "hf")):
        with pytest.raises(ValueError) as e:
            call()
        assert str(e.value).startswith(f"{info}: tokenizer {tok} has sha256 ") and "\n" not in str(e.value)
    tok.unlink()
    for call in (lambda: load_model(step), lambda: dcp_to_hf(step, tmp_path / "hf")):
        with pytest.raises(ValueError, match=f"^{info}: the tokenizer it was trained with, {tok}, is not found"):
            call()
    assert not (tmp_path / "hf").exists()
    out = dcp_to_hf(step, tmp_path / "hf", no_tokenizer=True)  # asked for: an export without tokenizer files
    assert (out / "config.json").is_file() and not (out / "tokenizer.json").exists()


def test_an_older_record_without_hash_is_used_unverified(trained, caplog):
    step, tok = trained
    info = layout.read_info(step)
    del info["tokenizer"]["sha256"]
    info.pop(layout.DIGEST_KEY, None)
    layout.write_info(step, info)
    shutil.copy(tok, tok.with_suffix(".keep"))
    with caplog.at_level(logging.WARNING, logger="titanlite"):
        loaded = load_model(step)
    assert loaded.tokenizer.path == str(tok)
    assert f"records tokenizer {tok} without its sha256 (an older checkpoint): unverified" in caplog.text
    assert json.loads((step / layout.INFO_FILE).read_text())["tokenizer"]["path"] == str(tok)

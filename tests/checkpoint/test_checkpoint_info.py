"""checkpoint.json is covered by a checksum of its own: an edit of its model args would change a resumed run's
computation silently, and an edit of its ``files`` key would turn the file checks off. A checkpoint whose
description records no file checksums (or not all of its DCP files) is refused, never "nothing to verify"."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import pytest

from tests.helpers.checkpoint_runs import run_trainer
from tests.helpers.llama import save_step_folder, tiny_args, titanlite_model
from titanlite.checkpoint import layout
from titanlite.checkpoint.load_model import load_model

pytestmark = pytest.mark.usefixtures("one_thread")


def edit_by_hand(folder: Path, change) -> None:
    """What a user with an editor (or a tool that knows nothing of the checksum) does to checkpoint.json."""
    info = json.loads((folder / layout.INFO_FILE).read_text())
    change(info)
    (folder / layout.INFO_FILE).write_text(json.dumps(info, indent=2))


def flip_a_data_byte(folder: Path) -> None:
    """Damage inside the tensor bytes (sizes intact): DCP reads it without complaint, only a checksum sees it."""
    data = folder / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    data.write_bytes(bytes(raw))


@pytest.fixture()
def step(tmp_path) -> Path:
    return save_step_folder(titanlite_model(tiny_args()), tmp_path / "step-7")


def test_the_description_carries_the_sha256_of_its_content(step):
    info = json.loads((step / layout.INFO_FILE).read_text())
    body = {k: v for k, v in info.items() if k != "sha256"}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    assert info["sha256"] == hashlib.sha256(canonical).hexdigest() and info["version"] == 2
    assert set(info["files"]) == {".metadata", "__0_0.distcp"}  # the DCP files, recorded by write_info itself
    assert load_model(step, tokenizer_path="bytes").step == 7


@pytest.mark.parametrize(
    "edit",
    [
        lambda j: j["model"]["args"].update(rope_theta=10000.0),
        lambda j: j["model"]["args"].update(norm_eps=1e-3),
        lambda j: j.update(filez=j.pop("files")),  # renamed: the file checks used to be skipped
    ],
    ids=["rope_theta", "norm_eps", "files_renamed"],
)
def test_an_edited_description_is_refused_everywhere(step, edit):
    flip_a_data_byte(step)
    edit_by_hand(step, edit)
    assert "fails its checksum (sha256)" in layout.problem_with(step, verify=True)
    assert "fails its checksum" in layout.problem_with(step, require_info=False, verify=True)  # initial_load_path
    with pytest.raises(ValueError, match="checkpoint.json fails its checksum"):
        load_model(step, tokenizer_path="bytes")


def test_missing_verification_data_is_an_error_not_a_skip(step):
    """A consistent (sealed) description without file checksums, or one that leaves a DCP file out."""
    flip_a_data_byte(step)
    info = layout.read_info(step)
    layout.write_info(step, {**info, "files": {}})
    assert (
        layout.problem_with(step, verify=True)
        == "checkpoint.json records no checksums of its files, so they cannot be verified"
    )
    layout.write_info(step, {**info, "files": {k: v for k, v in info["files"].items() if k != "__0_0.distcp"}})
    assert layout.problem_with(step, verify=True) == "__0_0.distcp is not covered by the checksums in checkpoint.json"
    with pytest.raises(ValueError, match="is damaged: __0_0.distcp is not covered"):
        load_model(step, tokenizer_path="bytes")


def test_a_step_folder_that_lost_its_description_is_not_taken_for_a_foreign_one(tmp_path):
    dump = tmp_path / "run"
    run_trainer(dump, "--training.steps", "5")
    step = dump / "checkpoint" / "step-5"
    (step / layout.INFO_FILE).unlink()  # config.toml is still there: titanlite wrote this folder
    assert "has titanlite's config.toml but no checkpoint.json" in layout.problem_with(step, require_info=False)


def test_a_resume_never_takes_edited_model_args(tmp_path, caplog):
    """The run's newest checkpoint.json with another rope_theta: reported in one line, the previous checkpoint is
    resumed with its own args (the edit used to be taken and logged as the seed checkpoint's)."""
    dump = tmp_path / "run"
    run_trainer(dump, "--training.steps", "10")
    edit_by_hand(dump / "checkpoint" / "step-10", lambda j: j["model"]["args"].update(rope_theta=1234.0))
    with caplog.at_level(logging.INFO, logger="titanlite"):
        trainer = run_trainer(dump, "--training.steps", "12")
    assert "step-10 is damaged" in caplog.text and "checkpoint.json fails its checksum" in caplog.text
    assert "RESUMED from" in caplog.text and "step 5," in caplog.text
    assert trainer.model_args.rope_theta == 500000.0  # the flavor's, which step-5 recorded
    assert not [r for r in caplog.records if r.name.startswith("titanlite") and "rope_theta" in r.getMessage()]


def test_another_format_version_is_refused_in_one_line(step):
    edit_by_hand(step, lambda j: (j.pop("sha256"), j.update(version=1)))
    with pytest.raises(ValueError) as e:
        load_model(step, tokenizer_path="bytes")
    msg = str(e.value)
    assert "checkpoint.json has format version 1; this titanlite reads version 2" in msg and "\n" not in msg

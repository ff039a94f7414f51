"""``titanlite.checkpoint.load_model``: a step folder and its HF export load the same weights; bad folders are
one-line errors naming the file; loading leaves the caller's random stream alone."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tests.helpers.tiny import TINY_MODEL
from titanlite.checkpoint import layout
from titanlite.checkpoint.hf_export import dcp_to_hf
from titanlite.checkpoint.load_model import load_model
from titanlite.models import load_config
from titanlite.trainer import Trainer


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    dump = tmp_path_factory.mktemp("run")
    args = [*TINY_MODEL, "--training.seq_len", "64", "--training.steps", "2", "--job.dump_folder", str(dump)]
    trainer = Trainer(load_config([*args, "--checkpoint.enable", "--checkpoint.interval", "2"]))
    trainer.train()
    step = dump / "checkpoint" / "step-2"
    hf = dcp_to_hf(step, dump / "hf")
    return step, hf, {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def test_a_step_folder_and_its_hf_export_load_the_trained_weights(folders):
    step, hf, trained = folders
    a, b = load_model(step), load_model(hf, tokenizer_path="bytes")
    assert (a.step, b.step) == (2, None)
    for name, tensor in trained.items():
        assert torch.equal(a.model.state_dict()[name], tensor), name
        assert torch.equal(b.model.state_dict()[name], tensor), name
    assert not a.model.training and a.eos_ids == (a.tokenizer.eos_id,)
    half = load_model(step, dtype=torch.bfloat16)
    assert half.model.output.weight.dtype == torch.bfloat16


def test_loading_leaves_the_global_random_stream_alone(folders):
    torch.manual_seed(3)
    expected = torch.rand(4)
    torch.manual_seed(3)
    load_model(folders[0])  # init_weights draws (for the buffers), under a forked RNG
    assert torch.equal(torch.rand(4), expected)


def test_bad_folders_are_one_line_errors(folders, tmp_path):
    step, hf, _ = folders
    with pytest.raises(FileNotFoundError, match="no such folder"):
        load_model(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="neither a titanlite checkpoint step folder nor a Hugging Face"):
        load_model(tmp_path)
    bare = shutil.copytree(hf, tmp_path / "bare")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (bare / name).unlink()  # an export carries them: an HF folder without any
    with pytest.raises(ValueError, match="has no tokenizer files: pass a tokenizer path"):
        load_model(bare)
    assert load_model(hf).tokenizer.vocab_size == 512  # the export's own (byte) tokenizer

    damaged = shutil.copytree(step, tmp_path / "damaged")
    data = next(p for p in damaged.iterdir() if p.suffix == ".distcp")
    data.write_bytes(data.read_bytes()[:-10])
    with pytest.raises(ValueError, match="is damaged"):
        load_model(damaged)

    lost = shutil.copytree(step, tmp_path / "lost")
    info = json.loads((lost / "checkpoint.json").read_text())
    info["tokenizer"]["path"] = str(tmp_path / "gone.model")
    layout.write_info(lost, info)  # sealed again, as a tool that moved the tokenizer would
    with pytest.raises(ValueError, match="recorded in .* cannot be read"):
        load_model(lost)
    assert load_model(lost, tokenizer_path="bytes").step == 2  # an override stands in for it

    wrong = shutil.copytree(hf, tmp_path / "wrong")
    config = json.loads((wrong / "config.json").read_text())
    config["num_hidden_layers"] += 1  # config.json says 3 layers, the weights hold 2
    (wrong / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="lacks layers.2"):
        load_model(wrong, tokenizer_path="bytes")

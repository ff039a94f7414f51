"""Small but visible input handling (issue 27, "cosmetic but visible"): non-UTF-8 bytes are named by file and line,
``dataset = "chat"`` on a shard folder says so, ``~`` in paths is the home folder, an HF export's weights get the
permissions of their siblings, a TOML file with a byte-order mark is read, and the errors a rerun of the README's
override example meets point to ``--job.dump_folder`` (which the example now passes)."""

from __future__ import annotations

import logging
import os
import re
import stat
from pathlib import Path

import pytest

from tests.helpers.checkpoint_runs import TINY, run_trainer
from titanlite.config import ConfigError, parse_config
from titanlite.data import prepare as prep
from titanlite.data.recipe import load_source, mixture_entries
from titanlite.data.sources import iter_documents
from titanlite.tokenizer import build_tokenizer

REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- non-UTF-8 bytes: the file and the line
def test_non_utf8_text_names_the_file_and_line(tmp_path):
    text = tmp_path / "doc.txt"
    text.write_bytes(b"first line\nsecond\nab\xffc\n")
    with pytest.raises(ValueError, match=rf"^{re.escape(str(text))}:3: not valid UTF-8 \(byte 3 of the line\)$"):
        list(iter_documents(text))
    array = tmp_path / "docs.json"
    array.write_bytes(b'[\n"one",\n"tw\xfeo"\n]')
    with pytest.raises(ValueError, match=rf"^{re.escape(str(array))}:3: not valid UTF-8 \(byte 4 of the line\)$"):
        list(iter_documents(array))


def test_non_utf8_chat_names_the_file_and_line(tmp_path):
    chat = tmp_path / "chat.jsonl"
    good = b'{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n'
    chat.write_bytes(good + good.replace(b"yo", b"y\xffo"))
    with pytest.raises(ValueError, match=rf"^{re.escape(str(chat))}:2: not valid UTF-8 \(byte \d+ of the line\)$"):
        load_source("data", "chat", str(chat), "train", build_tokenizer(""))


def test_non_utf8_config_names_the_file_and_line(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_bytes(b'[job]\ndescription = "caf\xe9"\n')
    with pytest.raises(ConfigError, match=rf"^config file {re.escape(str(toml))}:2: not valid UTF-8 \(byte 19 of"):
        parse_config(["--config", str(toml)])


def test_a_toml_file_with_a_byte_order_mark_is_read(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_bytes(b"\xef\xbb\xbf[training]\nsteps = 7\n")  # what Notepad writes
    assert parse_config(["--config", str(toml)]).training.steps == 7


# ---------------------------------------------------------------- dataset = "chat" on a shard folder
def test_chat_dataset_on_a_shard_folder_says_so(tmp_path):
    src = tmp_path / "in.txt"
    src.write_text("some text to prepare\n")
    shards = tmp_path / "shards"
    prep.prepare(src, shards, "bytes", log=None)
    with pytest.raises(
        ValueError, match=rf"^{re.escape(str(shards))} is a shard folder \(prepare_data\), not raw chat"
    ):
        load_source("data", "chat", str(shards), "train", build_tokenizer(""))


# ---------------------------------------------------------------- ~ is the home folder
def test_a_leading_tilde_is_the_home_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    toml = tmp_path / "c.toml"
    toml.write_text(
        '[job]\ndump_folder = "~/runs/a"\n[model]\ntokenizer_path = "~/tok.model"\n'
        '[training]\nmixture = [{path = "~/corpus.txt", weight = 1.0}]\n[checkpoint]\ninitial_load_path = "~/seed"\n'
    )
    cfg = parse_config(["--config", str(toml), "--eval.data_dir=~/eval"])
    assert cfg.job.dump_folder == str(tmp_path / "runs" / "a")
    assert cfg.model.tokenizer_path == str(tmp_path / "tok.model")
    assert cfg.checkpoint.initial_load_path == str(tmp_path / "seed") and cfg.eval.data_dir == str(tmp_path / "eval")
    assert mixture_entries(cfg.training)[0]["path"] == str(tmp_path / "corpus.txt")
    (tmp_path / "in.txt").write_text("a document\n")
    prep.prepare("~/in.txt", "~/shards", "bytes", log=None)
    assert (tmp_path / "shards" / "manifest.json").is_file() and not Path("~").exists()


# ---------------------------------------------------------------- model.safetensors permissions
def test_the_hf_export_weights_get_the_permissions_of_their_siblings(tmp_path):
    from tests.helpers.llama import save_step_folder, tiny_args, titanlite_model
    from titanlite.checkpoint.hf_export import dcp_to_hf

    step = save_step_folder(titanlite_model(tiny_args()), tmp_path / "step-7")
    old = os.umask(0o022)
    try:
        out = dcp_to_hf(step, tmp_path / "hf")
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()}
    assert modes["model.safetensors"] == modes["config.json"] == 0o644, modes


# ---------------------------------------------------------------- the README's override example, after command 1
def test_the_readme_override_example_uses_its_own_dump_folder():
    readme = (REPO / "README.md").read_text()
    block = readme[readme.index("Any config key can be overridden on the command line") :].split("```")[1]
    command = " ".join(block.replace("\\\n", " ").splitlines()[1:2])
    assert "train_configs/debug_model.toml" in command and "--model.n_layers 2" in command
    dump = re.search(r"--job.dump_folder[ =](\S+)", command)
    assert dump and Path(dump.group(1)) != Path("outputs/debug_model")  # command 1's folder (debug_model.toml)


@pytest.mark.usefixtures("one_thread")
def test_a_rerun_with_other_settings_in_a_trained_folder_points_to_another_dump_folder(tmp_path, capsys, caplog):
    from titanlite.train import main

    dump = tmp_path / "run"
    run_trainer(dump, "--training.steps", "5")  # "command 1": a finished run with checkpoints
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:  # another n_layers in the same folder
        main(TINY + ["--job.dump_folder", str(dump), "--training.steps", "3", "--model.n_layers", "1"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model.n_layers=1 is set in the config but the checkpoint" in err[0], err
    assert err[0].endswith("or start a new run in another --job.dump_folder")
    with caplog.at_level(logging.INFO, logger="titanlite"):  # fewer steps: already trained
        main(TINY + ["--job.dump_folder", str(dump), "--training.steps", "3"])
    assert "the run is complete" in caplog.text and "to train anew, choose another --job.dump_folder" in caplog.text

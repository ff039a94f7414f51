"""Deeply nested JSON and TOML: each reader that parses a user's file refuses one nested 100,000 levels deep in
one line naming the file (a RecursionError traceback before, in nine places), through one shared guard
(:mod:`titanlite.utils.nesting`), and keeps reading what is nested as deep as real files are."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from titanlite.utils.nesting import MAX_DEPTH, JSONNestingError, loads_json, loads_toml, too_deep

DEEP = 100_000
WHY = f"nested more than {MAX_DEPTH} levels deep"
DEEP_ARRAY = "[" * DEEP + "]" * DEEP


def one_error_line(capsys) -> str:
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


def test_the_guard_bounds_the_depth_without_recursing():
    assert loads_json("[" * MAX_DEPTH + "]" * MAX_DEPTH) is not None
    for text in ("[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1), DEEP_ARRAY, '{"a":' * DEEP + "1" + "}" * DEEP):
        with pytest.raises(JSONNestingError, match=WHY):
            loads_json(text)
    with pytest.raises(ValueError, match=WHY):
        loads_toml("a = " + DEEP_ARRAY)
    deep = []
    for _ in range(DEEP):  # built, not parsed: the walk itself must not recurse
        deep = [deep]
    assert too_deep(deep) and not too_deep({"a": [1, {"b": "x"}]}, limit=3) and too_deep([[[[]]]], limit=3)


def test_chat_data_for_training_and_for_prepare(tmp_path):
    from titanlite.data.chat import encode_conversations
    from titanlite.data.prepare import prepare
    from titanlite.tokenizer import build_byte_tokenizer

    data = tmp_path / "chat.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n{"messages": ' + DEEP_ARRAY + "}\n")
    with pytest.raises(ValueError, match=f"^{data}:2: not JSON \\({WHY}\\)$"):
        encode_conversations(build_byte_tokenizer(), data)
    with pytest.raises(ValueError, match=f"{data}:2: not JSON \\({WHY}\\)"):
        prepare(data, tmp_path / "shards", "", file_format="chat", log=None)


def test_text_jsonl_and_json_array_sources(tmp_path):
    from titanlite.data.sources import iter_documents

    for name, text in (("d.jsonl", '{"text": ' + DEEP_ARRAY + "}\n"), ("d.json", DEEP_ARRAY)):
        (tmp_path / name).write_text(text)
        with pytest.raises(ValueError, match=f"{tmp_path / name}.*{WHY}"):
            list(iter_documents(tmp_path / name))


def test_eval_task_files_in_the_loop(tmp_path):
    from titanlite.eval import get_task

    (tmp_path / "hellaswag").mkdir()
    (tmp_path / "hellaswag" / "hellaswag_val.jsonl").write_text('{"ctx": ' + DEEP_ARRAY + "}\n")
    with pytest.raises(ValueError, match=f"hellaswag_val.jsonl:1: .*{WHY}"):
        get_task("hellaswag").items(tmp_path)


def test_config_toml_file_and_command_line_literal(tmp_path):
    from titanlite.config import ConfigError, parse_config

    toml = tmp_path / "c.toml"
    toml.write_text("[training]\nmixture = " + DEEP_ARRAY + "\n")
    with pytest.raises(ConfigError, match=f"config file {toml}: {WHY}"):
        parse_config(["--config", str(toml)])
    with pytest.raises(ConfigError, match=f"'training.mixture'.*{WHY}"):
        parse_config(["--training.mixture", DEEP_ARRAY])


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory) -> Path:
    """A tiny Hugging Face Llama folder (weights + config.json) that the CLIs load."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=512,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
        bos_token_id=256,
        eos_token_id=257,
    )
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("hf")
    transformers.LlamaForCausalLM(config).save_pretrained(str(folder))
    return folder


def test_hf_config_json_in_the_converter_and_generate(tmp_path, capsys, hf_folder):
    import shutil

    from titanlite.checkpoint.convert_cli import main_hf_to_dcp
    from titanlite.generate.cli import main as generate

    folder = tmp_path / "hf"
    shutil.copytree(hf_folder, folder)
    (folder / "config.json").write_text(DEEP_ARRAY)
    capsys.readouterr()
    assert main_hf_to_dcp(["-q", str(folder), str(tmp_path / "out")]) == 2
    assert f"{folder / 'config.json'} is unreadable: {WHY}" in one_error_line(capsys)
    assert generate(["--checkpoint", str(folder), "--prompt", "x", "--tokenizer", "bytes", "--device", "cpu"]) == 2
    assert f"{folder / 'config.json'} is unreadable: {WHY}" in one_error_line(capsys)
    assert not (tmp_path / "out").exists()


def test_eval_task_files_in_the_cli(tmp_path, capsys, hf_folder):
    from titanlite.eval.cli import main

    (tmp_path / "arc").mkdir()
    (tmp_path / "arc" / "ARC-Easy-Test.jsonl").write_text('{"question": ' + DEEP_ARRAY + "}\n")
    capsys.readouterr()
    argv = ["--checkpoint", str(hf_folder), "--tasks", "arc_easy", "--data-dir", str(tmp_path), "--tokenizer", "bytes"]
    assert main(argv) == 2
    assert "ARC-Easy-Test.jsonl:1: " in (line := one_error_line(capsys)) and WHY in line


def test_tokenizer_json_and_checkpoint_json(tmp_path):
    from titanlite.checkpoint import layout
    from titanlite.tokenizer import build_tokenizer

    tok = tmp_path / "tokenizer.json"
    tok.write_text('{"model": ' + DEEP_ARRAY + "}")
    with pytest.raises(ValueError, match=f"^{tok}: not valid JSON .*{WHY}"):
        build_tokenizer(str(tok))
    (tmp_path / layout.INFO_FILE).write_text(json.dumps({"format": "x"})[:-1] + ', "a": ' + DEEP_ARRAY + "}")
    with pytest.raises(ValueError, match=f"{tmp_path / layout.INFO_FILE} is unreadable: {WHY}"):
        layout.read_info(tmp_path)

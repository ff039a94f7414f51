"""HF exports and seeds: flavors recorded on conversion, config.json files transformers reads without
warnings (RoPE scaling with a short training context), and exports that load whole: transformers'
AutoTokenizer on the export gives titanlite's ids (byte tokenizer, a tiktoken file, a tokenizer.json),
AutoModelForCausalLM + AutoTokenizer + generate give titanlite.generate's tokens, the chat template
renders as titanlite.data.chat; HF -> DCP records the folder's tokenizer and refuses one that is not
the model's."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.helpers.hf_tokenizers import convert, corpora
from tests.helpers.llama import run_cli, save_step_folder, tiny_args, titanlite_model, tokens
from tests.helpers.shared_data import shared_file
from titanlite.checkpoint import layout
from titanlite.checkpoint.hf_export import dcp_to_hf
from titanlite.checkpoint.hf_import import hf_to_dcp
from titanlite.checkpoint.load_model import load_model
from titanlite.data.chat import render_conversation
from titanlite.generate import generate
from titanlite.models.registry import get_model_spec, make_model_args, matching_flavor
from titanlite.tokenizer import build_tokenizer, tokenizer_fingerprint

transformers = pytest.importorskip("transformers")


def test_a_converted_seed_records_its_flavor_and_its_checksums(tmp_path):
    """debugmodel -> HF -> DCP: the seed's checkpoint.json names the flavor whose args it has (run
    args such as max_seq_len aside), and its files verify."""
    args = make_model_args("llama3", "debugmodel")
    hf = dcp_to_hf(save_step_folder(titanlite_model(args), tmp_path / "step"), tmp_path / "hf")
    seed = hf_to_dcp(hf, tmp_path / "seed")
    info = layout.read_info(seed)
    assert info["model"]["flavor"] == "debugmodel"
    assert layout.problem_with(seed, verify=True) is None and set(info["files"]) >= {".metadata"}
    spec = get_model_spec("llama3")
    assert matching_flavor(spec, dataclasses.replace(args, dim=128)) is None  # not a preset


def test_rope_scaled_export_loads_in_transformers_without_warnings(tmp_path, capfd):
    """A Llama 3.2-style model (RoPE scaling, original context 8192) trained at 2048 tokens: the
    exported max_position_embeddings is above RoPE's original one, as transformers requires, and
    the logits still equal titanlite's."""
    args = make_model_args("llama3", "debugmodel", rope_scaling_factor=8.0, rope_original_max_position=8192)
    assert args.max_seq_len == 2048
    model = titanlite_model(args)
    hf = dcp_to_hf(save_step_folder(model, tmp_path / "step"), tmp_path / "hf")
    capfd.readouterr()
    config = transformers.AutoConfig.from_pretrained(str(hf))
    out = transformers.LlamaForCausalLM.from_pretrained(str(hf), attn_implementation="eager").eval()
    captured = capfd.readouterr()
    assert "must be less than" not in captured.out + captured.err, captured
    assert config.max_position_embeddings > 8192
    x = tokens(args.vocab_size)
    with torch.no_grad():
        assert torch.allclose(out(x).logits, model(x), atol=1e-4, rtol=0)


def test_an_extension_family_without_extensions_names_the_one_to_pass(tmp_path):
    """A Qwen3 HF folder converted without ``--extensions``: one line naming the extension (found in
    the installed package's entry points, not imported), and nothing written."""
    cfg = transformers.Qwen3Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2
    )
    transformers.Qwen3ForCausalLM(cfg).save_pretrained(str(tmp_path / "hf"))
    proc = run_cli("hf-to-dcp", str(tmp_path / "hf"), str(tmp_path / "out"))
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(err) == 1, proc.stderr
    assert "is converted by the extension torchtitan_ext.qwen3: pass --extensions torchtitan_ext.qwen3" in err[0]
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- exports that load whole


def export_with_tokenizer(tmp_path: Path, tokenizer_path: str, vocab_size: int = 512, **args) -> tuple[Path, object]:
    """A tiny random model's step folder whose checkpoint.json records ``tokenizer_path`` as training does,
    exported to HF; returns the export and titanlite's tokenizer."""
    tok = build_tokenizer(tokenizer_path)
    model = titanlite_model(tiny_args(vocab_size=vocab_size, **args))
    step = save_step_folder(model, tmp_path / "step")
    info = layout.read_info(step)
    info["tokenizer"] = {"path": tokenizer_path, "bos_id": tok.bos_id, "eos_id": tok.eos_id}
    layout.write_info(step, info)
    return dcp_to_hf(step, tmp_path / "hf"), tok


def tokenizer_sources(tmp_path: Path) -> dict[str, tuple[str, int]]:
    tiktoken_file = shared_file("tokenizers/test_tiktoken.model")
    json_file = convert(tiktoken_file, tmp_path / "json")
    return {"bytes": ("", 512), "tiktoken": (str(tiktoken_file), 2304), "tokenizer_json": (str(json_file), 2304)}


@pytest.mark.parametrize("kind", ["bytes", "tiktoken", "tokenizer_json"])
def test_auto_tokenizer_on_the_export_gives_titanlites_ids(tmp_path, kind):
    path, vocab = tokenizer_sources(tmp_path)[kind]
    hf, tok = export_with_tokenizer(tmp_path, path, vocab)
    names = {p.name for p in hf.iterdir()}
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= names
    auto = transformers.AutoTokenizer.from_pretrained(str(hf))
    assert (auto.bos_token_id, auto.eos_token_id) == (tok.bos_id, tok.eos_id)
    texts = corpora()
    want = tok.encode_batch(texts, num_threads=1)
    # titanlite reads special-token text in documents as text: HF's split_special_tokens
    got = auto(texts, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    assert [i for i, (g, w) in enumerate(zip(got, want)) if g != w] == []
    if kind != "tokenizer_json":  # a copied tokenizer.json decides itself whether BOS comes first
        assert auto("hello world")["input_ids"] == tok.encode("hello world", bos=True)  # as Llama 3's does
    assert auto.decode(want[0]) == tok.decode(want[0]) == texts[0]
    # and titanlite reads the export back as the same tokenizer (ids of the same meaning)
    assert tokenizer_fingerprint(build_tokenizer(str(hf))) == tokenizer_fingerprint(tok)


def test_auto_model_and_tokenizer_generate_like_titanlite(tmp_path):
    hf, tok = export_with_tokenizer(tmp_path, "")
    loaded = load_model(hf)  # the export's own tokenizer files, no --tokenizer needed
    assert tokenizer_fingerprint(loaded.tokenizer) == tokenizer_fingerprint(tok)
    auto_tok = transformers.AutoTokenizer.from_pretrained(str(hf))
    auto_model = transformers.AutoModelForCausalLM.from_pretrained(str(hf), attn_implementation="eager").eval()
    texts = ["def main(", "The meaning of life is", "x"]
    prompts = [tok.encode(t, bos=True) for t in texts]
    ours = generate(loaded.model, prompts, max_new_tokens=12, eos_ids=loaded.eos_ids)
    assert len({t for o in ours for t in o}) > 5  # varied tokens: a comparison that can fail
    for text, prompt, completion in zip(texts, prompts, ours):
        ids = auto_tok(text, return_tensors="pt")["input_ids"]
        assert ids[0].tolist() == prompt
        with torch.no_grad():
            out = auto_model.generate(ids, max_new_tokens=12, do_sample=False)
        assert out[0, len(prompt) :].tolist() == completion
        assert auto_tok.decode(out[0, len(prompt) :]) == tok.decode(completion)


def test_the_chat_template_renders_like_titanlite_chat(tmp_path):
    hf, tok = export_with_tokenizer(tmp_path, "")
    auto = transformers.AutoTokenizer.from_pretrained(str(hf))
    conversations = [
        [{"role": "user", "content": "  Uppercase: star ship \n"}],
        [
            {"role": "system", "content": "Be terse."},
            {"role": "user", "content": "What is 2 + 2?"},
            {"role": "assistant", "content": "4"},
            {"role": "user", "content": "and 3 + 3?"},
        ],
    ]
    for messages in conversations:
        for prompt in (False, True):
            ids = auto.apply_chat_template(messages, tokenize=True, add_generation_prompt=prompt)
            ids = ids["input_ids"] if not isinstance(ids, list) else ids
            assert list(ids) == render_conversation(tok, messages, add_generation_prompt=prompt)[0]


def test_hf_to_dcp_records_the_folders_tokenizer_and_refuses_one_that_is_not_the_models(tmp_path):
    """A converted seed names the HF folder's tokenizer in checkpoint.json (it used to record none, and
    evaluation then silently used the byte tokenizer); a tokenizer whose BOS or size is not the model's
    is refused, at conversion and at load."""
    path, vocab = tokenizer_sources(tmp_path)["tiktoken"]
    hf, tok = export_with_tokenizer(tmp_path, path, vocab)
    seed = hf_to_dcp(hf, tmp_path / "seed")
    recorded = layout.read_info(seed)["tokenizer"]
    sha256 = hashlib.sha256((hf / "tokenizer.json").read_bytes()).hexdigest()  # the file the folder path names
    assert recorded == {"path": str(hf.resolve()), "sha256": sha256, "bos_id": tok.bos_id, "eos_id": tok.eos_id}
    loaded = load_model(seed)
    assert tokenizer_fingerprint(loaded.tokenizer) == tokenizer_fingerprint(tok)
    with pytest.raises(ValueError, match=r"the tokenizer given has BOS id 256 but .*checkpoint.json records 2000"):
        load_model(seed, tokenizer_path="bytes")

    wrong_bos = shutil.copytree(hf, tmp_path / "wrong_bos")
    config = json.loads((wrong_bos / "config.json").read_text())
    (wrong_bos / "config.json").write_text(json.dumps({**config, "bos_token_id": 7}))
    with pytest.raises(ValueError, match=r"the tokenizer of .*wrong_bos has BOS id 2000 but .*config.json records 7"):
        hf_to_dcp(wrong_bos, tmp_path / "seed2")
    assert not (tmp_path / "seed2").exists()

    small = shutil.copytree(export_with_tokenizer(tmp_path / "small", "")[0], tmp_path / "small_vocab")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(hf / name, small / name)  # a 2,256-token tokenizer beside a 512-token model
    with pytest.raises(ValueError, match=r"has 2256 tokens but .*config.json gives the model a vocabulary of 512"):
        hf_to_dcp(small, tmp_path / "seed3")

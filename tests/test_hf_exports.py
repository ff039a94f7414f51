"""HF exports and seeds: flavors recorded on conversion, config.json files transformers reads without
warnings (RoPE scaling with a short training context)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_hf_conversion import run_cli, save_step_folder, titanlite_model, tokens

from titanlite.checkpoint import layout
from titanlite.checkpoint.hf import dcp_to_hf, hf_to_dcp
from titanlite.models.registry import get_model_spec, make_model_args, matching_flavor

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
    proc = run_cli("convert_hf_to_dcp.py", str(tmp_path / "hf"), str(tmp_path / "out"))
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(err) == 1, proc.stderr
    assert "is converted by the extension torchtitan_ext.qwen3: pass --extensions torchtitan_ext.qwen3" in err[0]
    assert not (tmp_path / "out").exists()

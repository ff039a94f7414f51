"""Weights that cannot be right are refused when an HF folder is read: integer tensors and NaN/inf values (one
line naming the file and the tensor), by ``hf_to_dcp``, ``load_model`` and ``load_hf_weights`` alike; stacked
experts keep each expert's precision; an eval whose log-likelihoods are not finite is an error."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file

import torchtitan_ext.qwen3_moe  # noqa: F401  (registers "qwen3_moe")
from tests.helpers.llama import save_step_folder, tiny_args, titanlite_model
from tests.helpers.qwen3_moe import moe_model
from tests.helpers.qwen3_moe import save_step_folder as save_moe_step_folder
from tests.helpers.qwen3_moe import tiny_args as moe_args
from tests.helpers.shared_data import shared_file
from titanlite.checkpoint import layout
from titanlite.checkpoint.hf_export import dcp_to_hf
from titanlite.checkpoint.hf_import import hf_to_dcp, load_hf_weights
from titanlite.checkpoint.load_model import load_model
from titanlite.eval import evaluate
from titanlite.models.llama3 import Transformer
from titanlite.tokenizer import build_tokenizer


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("hf")
    return dcp_to_hf(save_step_folder(titanlite_model(tiny_args()), tmp / "step-7"), tmp / "hf")


def edited_copy(src: Path, dst: Path, edit) -> Path:
    """``src`` with its weights file rewritten after ``edit(tensors)``."""
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(dst / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def refusals(folder: Path, tmp_path: Path) -> list[str]:
    """The error of each way of reading ``folder`` (each must refuse, writing nothing)."""
    messages = []
    for read in (
        lambda: hf_to_dcp(folder, tmp_path / "dcp"),
        lambda: load_model(folder, tokenizer_path="bytes"),
        lambda: load_hf_weights(folder, Transformer(tiny_args())),
    ):
        with pytest.raises(ValueError) as e:
            read()
        messages.append(str(e.value))
    assert not (tmp_path / "dcp").exists()
    return messages


def test_integer_weights_are_refused(hf_folder, tmp_path):
    folder = edited_copy(hf_folder, tmp_path / "int", lambda t: t.update({"model.norm.weight": torch.ones(64).int()}))
    for msg in refusals(folder, tmp_path):
        assert msg == (
            f"{folder / 'model.safetensors'}: tensor model.norm.weight has dtype int32; expected floating-point "
            "weights (float32, bfloat16, float16, ...)"
        )


@pytest.mark.parametrize("name", ["model.layers.1.self_attn.o_proj.weight", "model.layers.0.self_attn.q_proj.weight"])
def test_non_finite_weights_are_refused(hf_folder, tmp_path, name):
    def poison(tensors):
        tensors[name][3, 5] = float("nan") if "o_proj" in name else float("inf")

    folder = edited_copy(hf_folder, tmp_path / "nan", poison)
    for msg in refusals(folder, tmp_path):
        assert "holds NaN or infinite values; expected finite weights" in msg and "\n" not in msg
        assert name in msg or "layers.0.attention.wq.weight" in msg  # q rows are read by rows: the native name


def test_stacked_experts_keep_each_experts_precision(tmp_path):
    model = moe_model(moe_args())
    hf = dcp_to_hf(save_moe_step_folder(model, tmp_path / "step-3"), tmp_path / "hf")
    name = "model.layers.1.mlp.experts.{}.down_proj.weight"
    tensors = load_file(str(hf / "model.safetensors"))
    tensors[name.format(0)] = tensors[name.format(0)].bfloat16()  # expert 0 in bf16, the others fp32
    save_file(tensors, str(hf / "model.safetensors"), metadata={"format": "pt"})
    hf_to_dcp(hf, tmp_path / "dcp")
    stored = {k: torch.empty_like(v) for k, v in model.state_dict().items()}
    dcp.load({"model": stored}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    stacked = stored["layers.1.feed_forward.experts.w2"]
    assert torch.equal(stacked[1], tensors[name.format(1)]) and torch.equal(stacked[3], tensors[name.format(3)])
    assert torch.equal(stacked[0], tensors[name.format(0)].float())
    assert layout.stored_entries(tmp_path / "dcp")["model.layers.1.feed_forward.experts.w2"][1] == torch.float32


def test_eval_with_non_finite_log_likelihoods_is_an_error():
    model = titanlite_model(tiny_args())
    with torch.no_grad():
        model.output.weight[7, 0] = float("nan")  # every log-softmax over the vocabulary becomes NaN
    data = shared_file("eval/README.md").parent
    with pytest.raises(ValueError, match=r"^arc_easy: item 0 has a non-finite log-likelihood \(\[nan"):
        evaluate(model, build_tokenizer(""), ["arc_easy"], data, limit=2)

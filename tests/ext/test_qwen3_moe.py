"""The Qwen3-MoE family from ``torchtitan_ext.qwen3_moe``: sizes and Hugging Face interop.

- Sizes: every flavor's planner counts (total, active) equal the meta-built model's; ``30B-A3B`` and
  ``235B-A22B`` have the published 30.5 B / 3.3 B and 235 B / 22 B parameters.
- Hugging Face: titanlite model -> DCP step folder -> ``dcp_to_hf`` (per-expert tensors) -> a folder
  ``transformers.Qwen3MoeForCausalLM.from_pretrained`` loads (transformers fuses the experts on load: an
  independent reading of the per-expert layout) with the same logits (fp32, within 1e-5), for the debug
  placement (block 0 dense), every block sparse, and ``decoder_sparse_step = 2``; -> ``hf_to_dcp`` gives
  back every tensor bit for bit (DCP -> HF -> DCP), the zero routing bias included.
- A moved aux-loss-free bias, and routing Qwen3-MoE cannot express, are refused at export (one line).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import torchtitan_ext.qwen3_moe  # noqa: F401  (registers "qwen3_moe")
from tests.helpers.qwen3_moe import moe_model, save_step_folder, tiny_args
from titanlite.checkpoint import layout
from titanlite.checkpoint.hf_export import dcp_to_hf
from titanlite.checkpoint.hf_import import hf_to_dcp
from titanlite.models import build_model, get_model_spec
from titanlite.models.flops import ModelShape, active_param_count, param_count
from torchtitan_ext.qwen3_moe import QWEN3_MOE_FLAVORS, Qwen3MoEArgs, Qwen3MoEHFAdapter, Qwen3MoEModel

ATOL = 1e-5
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("flavor", list(QWEN3_MOE_FLAVORS))
def test_planner_counts_equal_the_meta_built_model(flavor):
    args = QWEN3_MOE_FLAVORS[flavor]
    model = build_model("qwen3_moe", flavor)  # meta
    total = sum(p.numel() for p in model.parameters())
    routed = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    active = total - routed + routed * args.moe_top_k // args.moe_num_experts
    shape = ModelShape.from_args(args)
    spec = get_model_spec("qwen3_moe")
    assert param_count(shape) == spec.num_params(args) == total
    assert active_param_count(shape) == spec.active_params(args) == active


def test_published_sizes():
    """Qwen3-30B-A3B: 30.5 B parameters, 3.3 B activated; Qwen3-235B-A22B: 235 B, 22 B (the model cards, which
    round down: 3.353 B and 22.19 B activated here, both embeddings counted)."""
    spec = get_model_spec("qwen3_moe")
    for flavor, total, active in (("30B-A3B", 30.5e9, 3.3e9), ("235B-A22B", 235e9, 22e9)):
        args = QWEN3_MOE_FLAVORS[flavor]
        assert spec.num_params(args) == pytest.approx(total, rel=0.005)
        assert spec.active_params(args) == pytest.approx(active, rel=0.02)


# ----------------------------------------------------------------------------- Hugging Face

CASES = {
    "debug_placement": {},  # block 0 dense (mlp_only_layers), the others sparse
    "all_sparse": {"mlp_only_layers": []},
    "sparse_step_2": {"mlp_only_layers": [], "decoder_sparse_step": 2},  # blocks 1 and 3 sparse
}


def tokens() -> torch.Tensor:
    return torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(1))


def read_dcp(path: Path, model: Qwen3MoEModel) -> dict[str, torch.Tensor]:
    state = {k: torch.empty_like(v) for k, v in model.state_dict().items()}
    dcp.load({"model": state}, checkpoint_id=str(path), no_dist=True)
    return state


@pytest.fixture(scope="module")
def transformers():
    return pytest.importorskip("transformers")


@pytest.mark.parametrize("case", list(CASES))
def test_dcp_to_hf_matches_transformers_and_converts_back_bitwise(case, tmp_path, transformers):
    args = tiny_args(**CASES[case])
    model = moe_model(args)
    step = save_step_folder(model, tmp_path / "step-3")
    dcp_to_hf(step, tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3MoeForCausalLM"] and config["num_experts"] == 4
    from safetensors import safe_open

    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    sparse = [i for i in range(4) if args.is_moe_layer(i)]
    assert {f"model.layers.{i}.mlp.experts.3.down_proj.weight" for i in sparse} <= names
    assert not any("expert_bias" in n or f"layers.{i}.mlp.gate_proj" in n for n in names for i in sparse)
    hf = transformers.Qwen3MoeForCausalLM.from_pretrained(
        str(tmp_path / "hf"), dtype=torch.float32, attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        diff = (hf(tokens()).logits - model(tokens())).abs().max().item()
    print(f"{case}: max |logits diff| {diff:.2e}")
    assert diff < ATOL
    hf_to_dcp(tmp_path / "hf", tmp_path / "dcp")
    back = read_dcp(tmp_path / "dcp", model)
    for k, v in model.state_dict().items():
        assert torch.equal(back[k], v), k
    assert Qwen3MoEArgs(**layout.read_info(tmp_path / "dcp")["model"]["args"]) == args


def test_a_moved_bias_or_foreign_routing_is_refused_at_export(tmp_path):
    model = moe_model(tiny_args())
    with torch.no_grad():
        model.layers["1"].feed_forward.router.expert_bias[0] = 0.01
    with pytest.raises(ValueError, match="expert_bias is not zero") as e:
        dcp_to_hf(save_step_folder(model, tmp_path / "step-3"), tmp_path / "hf")
    assert "\n" not in str(e.value) and not (tmp_path / "hf").exists()
    for kw in ({"moe_score_func": "sigmoid"}, {"moe_num_shared_experts": 1}, {"moe_route_scale": 2.0}):
        with pytest.raises(ValueError, match="Qwen3MoeForCausalLM cannot express model.moe_"):
            Qwen3MoEHFAdapter(tiny_args(**kw)).hf_config(dtype=torch.float32)


def hf_config_folder(folder: Path, **changes) -> Path:
    """An HF Qwen3-MoE folder's config.json (tiny_args exported) with ``changes`` applied (None: key removed)."""
    config = Qwen3MoEHFAdapter(tiny_args()).hf_config(dtype=torch.float32)
    config.update(changes)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    return folder


@pytest.mark.parametrize(
    "key, value",
    [("num_experts", 4.7), ("num_experts", 4.0), ("num_experts", True), ("num_experts", 0), ("num_experts", "4")]
    + [("num_experts_per_tok", 2.5), ("moe_intermediate_size", 32.9), ("decoder_sparse_step", 1.5)],
)
def test_moe_sizes_in_config_json_must_be_integers(key, value, tmp_path):
    """``num_experts: 4.7`` was read as 4 experts (int() truncates); every MoE size must be an integer >= 1, as
    the dense sizes are. The same check serves a seed folder (model_args_from_seed) and hf-to-dcp."""
    from titanlite.checkpoint.hf_import import hf_seed

    folder = hf_config_folder(tmp_path / "hf", **{key: value})
    with pytest.raises(ValueError) as e:
        hf_seed(folder)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(str(folder / "config.json")), msg
    assert f"{key} = {value!r} must be an integer in [1, " in msg, msg
    spec, args = hf_seed(hf_config_folder(tmp_path / "ok"))  # the untouched export reads back as its args
    assert spec.name == "qwen3_moe" and args == tiny_args()


def test_a_folder_saved_by_transformers_converts_and_gives_its_logits(tmp_path, transformers):
    """transformers 5's ``save_pretrained`` writes ``num_local_experts`` and no ``num_experts`` (it was refused:
    "KeyError: 'num_experts'"). A random Qwen3MoeForCausalLM saved by transformers converts with hf-to-dcp, and
    titanlite's model on the converted weights gives transformers' logits; the experts are that folder's own
    tensors, bit for bit. Both names with different values are refused."""
    config = transformers.Qwen3MoeConfig(
        **{k: v for k, v in Qwen3MoEHFAdapter(tiny_args()).hf_config(dtype=torch.float32).items() if k != "dtype"}
    )
    torch.manual_seed(0)
    hf = transformers.Qwen3MoeForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name or "mlp.gate." in name:  # not the all-ones / near-uniform init
                p.copy_(torch.randn_like(p) * 0.5 + ("norm" in name))
    hf.save_pretrained(tmp_path / "hf")
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    if "num_local_experts" not in written:  # a transformers 4.x install: write what 5.x writes
        written["num_local_experts"] = written.pop("num_experts")
        (tmp_path / "hf" / "config.json").write_text(json.dumps(written))
    assert "num_experts" not in written and written["num_local_experts"] == 4
    hf_to_dcp(tmp_path / "hf", tmp_path / "dcp")
    args = Qwen3MoEArgs(**layout.read_info(tmp_path / "dcp")["model"]["args"])
    assert args == tiny_args(max_seq_len=args.max_seq_len, moe_aux_loss_coef=args.moe_aux_loss_coef)
    model = Qwen3MoEModel(args)
    model.load_state_dict(read_dcp(tmp_path / "dcp", model))
    from safetensors.torch import load_file

    saved = load_file(str(tmp_path / "hf" / "model.safetensors"))
    for j in range(4):  # block 1 is sparse: expert j's projections are slice j of the stacked tensors
        for w, proj in (("w1", "gate_proj"), ("w2", "down_proj"), ("w3", "up_proj")):
            stacked = model.state_dict()[f"layers.1.feed_forward.experts.{w}"]
            assert torch.equal(stacked[j], saved[f"model.layers.1.mlp.experts.{j}.{proj}.weight"])
    with torch.no_grad():
        diff = (hf(tokens()).logits - model.eval()(tokens())).abs().max().item()
    assert diff < ATOL
    written["num_experts"] = 8
    (tmp_path / "hf" / "config.json").write_text(json.dumps(written))
    with pytest.raises(ValueError, match="num_experts = 8 but num_local_experts = 4"):
        hf_to_dcp(tmp_path / "hf", tmp_path / "dcp2")
    assert not (tmp_path / "dcp2").exists()


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> Path:
    """tiny_args' model exported to an HF folder: 4 blocks, block 0 dense (mlp_only_layers = [0]), 4 experts."""
    root = tmp_path_factory.mktemp("exported")
    return dcp_to_hf(save_step_folder(moe_model(tiny_args()), root / "step-3"), root / "hf")


def with_extra_expert(folder: Path) -> None:
    """Add expert 4 of block 1 (a copy of expert 0) to the folder's weights."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(folder / "model.safetensors"))
    for proj in ("gate_proj", "up_proj", "down_proj"):
        tensors[f"model.layers.1.mlp.experts.4.{proj}.weight"] = tensors[
            f"model.layers.1.mlp.experts.0.{proj}.weight"
        ].clone()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize(
    "change, cause",
    [
        (
            {"num_experts": 2},
            "model.layers.1.mlp.experts.2.down_proj.weight is expert 2, but config.json has "
            "num_experts = 2 (experts 0 to 1)",
        ),
        (
            "extra expert",
            "model.layers.1.mlp.experts.4.down_proj.weight is expert 4, but config.json has "
            "num_experts = 4 (experts 0 to 3)",
        ),
        (
            {"mlp_only_layers": [0, 2]},
            "model.layers.2.mlp.experts.0.down_proj.weight is a MoE tensor, but "
            "config.json makes block 2 a dense MLP (mlp_only_layers = [0, 2], decoder_sparse_step = 1)",
        ),
        (
            {"mlp_only_layers": []},
            "model.layers.0.mlp.down_proj.weight is a dense MLP tensor, but config.json makes "
            "block 0 a MoE block (mlp_only_layers = [], decoder_sparse_step = 1)",
        ),
        (
            {"decoder_sparse_step": 2},
            "model.layers.2.mlp.experts.0.down_proj.weight is a MoE tensor, but config.json makes block 2 a dense MLP "
            "(mlp_only_layers = [0], decoder_sparse_step = 2)",
        ),
        (
            {"num_hidden_layers": 3},
            "model.layers.3.input_layernorm.weight does not belong to a model with 3 "
            "layers (config.json num_hidden_layers)",
        ),
    ],
)
def test_a_tensor_config_json_has_no_place_for_is_refused_naming_the_cause(change, cause, exported, tmp_path):
    """The message said "does not belong to a model with 4 layers" for an expert index past num_experts or a MoE
    tensor in a block config.json makes dense: it names the real cause now; nothing is written."""
    folder = tmp_path / "hf"
    shutil.copytree(exported, folder)
    if change == "extra expert":
        with_extra_expert(folder)
    else:
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ValueError) as e:
        hf_to_dcp(folder, tmp_path / "out")
    assert str(e.value) == f"{folder}: tensor {cause}"
    assert "\n" not in str(e.value) and not (tmp_path / "out").exists() and not list(tmp_path.glob("out.partial-*"))

"""The Qwen3 family from ``torchtitan_ext.qwen3``: sizes, Hugging Face parity, training parity.

- Parameter counts: the 0.6B flavor has exactly the count the published ``config.json`` gives by
  hand arithmetic (596,049,920), and the other flavors round to the published model-card figures.
- Hugging Face: titanlite -> DCP step folder -> ``titanlite.checkpoint.hf_export.dcp_to_hf`` -> folder
  that ``transformers.Qwen3ForCausalLM.from_pretrained`` loads with the same logits (fp32, atol
  1e-4; measured ~1e-6), for tied/untied, GQA/MHA and head_dim != dim / n_heads; and back
  (``hf_to_dcp``), with every tensor bit-identical after HF -> DCP -> HF.
- Training parity: FSDP 2 and TP 2 (loss parallel, QK-norm gains replicated over TP) against one
  process, with the parity harness of ``tests/parallel/test_parallel_parity.py`` (same seed weights, same
  data, same tolerances: loss / grad norm / validation loss within RTOL = 2e-5 relative); the final
  weights must also agree (1e-4 absolute; QK-norm gains 1e-5), which a QK-norm gain whose gradient
  is not summed over the TP ranks would break (it drifts by ~lr = 3e-3 per step).
- Extension mechanics: core titanlite never imports ``torchtitan_ext``; ``titanlite.models.load_config`` imports
  ``[job] extensions`` (file or command line) before it checks ``[model]``, so
  ``titanlite estimate`` sees the family in a fresh interpreter, and ``titanlite.train.main``
  trains the shipped debug config through it (2 steps); its checkpoint records the extension, so
  the converter scripts (fresh interpreters) turn it into an HF folder and back (``--extensions``).
  The same hook, in a fresh process, runs under the
  shipped-config dry runs of tests/config/test_train_configs.py.
"""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import torchtitan_ext.qwen3  # noqa: F401  (registers "qwen3")
from tests.helpers.dist import REPO, cache_token_stores, run_workers
from tests.helpers.launch import run_python
from tests.helpers.parity import RTOL, RecordingTrainer, check, check_data, make_config
from tests.helpers.peaks import skip_peak_measurement
from tests.helpers.qwen3 import qwen3_model, save_step_folder, tiny_args
from titanlite.checkpoint import layout
from titanlite.checkpoint.hf_export import dcp_to_hf
from titanlite.checkpoint.hf_import import hf_to_dcp
from titanlite.models import build_model, get_model_spec
from torchtitan_ext.qwen3 import QWEN3_FLAVORS, Qwen3HFAdapter, Qwen3Model, Qwen3ModelArgs, num_params_from_args

ATOL = 1e-4
# Final weights after the parity steps (lr 3e-3): AdamW divides each update by sqrt(v), which turns
# fp32 summation-order noise in near-zero gradient coordinates into ~1e-5 absolute differences
# (measured: 1.3e-5 worst, in a w2 under TP; QK-norm gains < 1e-6). A QK-norm gain whose gradient
# were not summed over the TP ranks would get a different update from step 1 on: ~lr = 3e-3.
WEIGHT_ATOL = 1e-4
QK_ATOL = 1e-5
QWEN3 = [
    "--model.name",
    "qwen3",
    "--model.flavor",
    "debugmodel",
    "--model.head_dim",
    "32",
    "--model.ffn_hidden_dim",
    "128",
]  # + the harness' TINY: dim 64, 2 layers, 4 heads / 2 kv heads
CONFIGS = {
    "qwen3_fsdp2": (2, ["--parallelism.data_parallel_shard_degree", "2"]),
    "qwen3_tp2": (1, ["--parallelism.tensor_parallel_degree", "2"]),
}


# ----------------------------------------------------------------------------- sizes


def test_0_6b_parameter_count_matches_the_published_config():
    # Qwen3-0.6B config.json: hidden 1024, intermediate 3072, 28 layers, 16 heads / 8 kv heads of 128,
    # vocab 151936, tied embeddings.
    attention = 1024 * 16 * 128 + 2 * 1024 * 8 * 128 + 16 * 128 * 1024  # wq, wk + wv, wo
    mlp = 3 * 1024 * 3072
    norms = 2 * 1024 + 2 * 128  # input/post-attention norms, q_norm/k_norm
    expected = 151936 * 1024 + 28 * (attention + mlp + norms) + 1024  # embedding (tied), blocks, final norm
    assert expected == 596_049_920
    assert num_params_from_args(QWEN3_FLAVORS["0.6B"]) == expected
    model = build_model("qwen3", "0.6B")  # meta device: nothing allocated
    assert sum(p.numel() for p in model.parameters()) == expected
    assert model.output.weight is model.tok_embeddings.weight


@pytest.mark.parametrize("flavor,total_b,non_embedding_b", [("1.7B", 1.7, 1.4), ("4B", 4.0, 3.6), ("8B", 8.2, 6.95)])
def test_flavors_match_the_model_cards(flavor, total_b, non_embedding_b):
    args = QWEN3_FLAVORS[flavor]
    total = num_params_from_args(args)
    assert round(total / 1e9, 1) == total_b
    assert (
        abs((total - args.vocab_size * args.dim * (1 if args.tie_word_embeddings else 2)) / 1e9 - non_embedding_b)
        < 0.05
    )


# ----------------------------------------------------------------------------- Hugging Face

HF_CASES = {
    "gqa_tied": dict(tie_word_embeddings=True),
    "gqa_untied": dict(tie_word_embeddings=False),
    "mha_untied": dict(tie_word_embeddings=False, n_kv_heads=None),
}


def tokens() -> torch.Tensor:
    return torch.randint(0, 512, (2, 48), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def transformers():
    return pytest.importorskip("transformers")  # imported here only: workers and other tests skip its import


def hf_logits(transformers, folder: Path) -> torch.Tensor:
    hf = transformers.Qwen3ForCausalLM.from_pretrained(
        str(folder), dtype=torch.float32, attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        return hf(tokens()).logits


@pytest.mark.parametrize("case", list(HF_CASES))
def test_dcp_to_hf_loads_in_transformers_with_matching_logits(case, tmp_path, transformers):
    model = qwen3_model(tiny_args(**HF_CASES[case]))
    dcp_to_hf(save_step_folder(model, tmp_path / "step-3"), tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["head_dim"] == 32
    with torch.no_grad():
        ours = model(tokens())
    diff = (hf_logits(transformers, tmp_path / "hf") - ours).abs().max().item()
    print(f"{case}: max |logits diff| {diff:.2e}")
    assert diff < ATOL


@pytest.mark.parametrize("case", ["gqa_tied", "gqa_untied"])
def test_hf_to_dcp_round_trip(case, tmp_path, transformers):
    """A transformers-written Qwen3 folder -> DCP -> titanlite gives HF's logits; -> HF is bitwise."""
    args = tiny_args(**HF_CASES[case])
    config = Qwen3HFAdapter(args).hf_config(dtype=torch.float32)
    hf_cfg = transformers.Qwen3Config(**{k: v for k, v in config.items() if k not in ("architectures", "torch_dtype")})
    torch.manual_seed(5)
    hf = transformers.Qwen3ForCausalLM(hf_cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    hf.save_pretrained(str(tmp_path / "hf_in"))
    hf_to_dcp(tmp_path / "hf_in", tmp_path / "dcp")
    info = layout.read_info(tmp_path / "dcp")
    assert info["model"]["name"] == "qwen3"
    loaded = Qwen3ModelArgs(**info["model"]["args"])
    assert (loaded.head_dim, loaded.tie_word_embeddings) == (32, args.tie_word_embeddings)
    model = Qwen3Model(loaded)
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    model.load_state_dict(state["model"])
    with torch.no_grad():
        diff = (model.eval()(tokens()) - hf(tokens()).logits).abs().max().item()
    assert diff < ATOL
    dcp_to_hf(tmp_path / "dcp", tmp_path / "hf_out")
    from safetensors.torch import load_file

    a = {k: v for f in sorted((tmp_path / "hf_in").glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    b = {k: v for f in sorted((tmp_path / "hf_out").glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    extra = set(b) - set(a)  # transformers omits a tied lm_head; titanlite's converter writes it
    assert set(a) <= set(b) and extra <= ({"lm_head.weight"} if args.tie_word_embeddings else set())
    for k in a:
        assert torch.equal(a[k], b[k]), k
    if extra:
        assert torch.equal(b["lm_head.weight"], a["model.embed_tokens.weight"])


def test_args_from_hf_config_refuses_what_it_cannot_express():
    config = Qwen3HFAdapter(tiny_args()).hf_config(dtype=torch.float32)
    for key, value in (
        ("use_sliding_window", True),
        ("attention_bias", True),
        ("hidden_act", "gelu"),
        ("rope_scaling", {"rope_type": "yarn", "factor": 4.0}),
    ):
        with pytest.raises(ValueError, match=key.split("_")[0] if key != "rope_scaling" else "rope_type"):
            Qwen3HFAdapter.args_from_hf_config({**config, key: value})


# ----------------------------------------------------------------------------- training parity


def qwen3_config(dump: str, dp: int, extra: list[str]):
    return make_config(dump, dp, QWEN3 + extra)


def run_config(cfg, seed_state, trainer=None) -> dict:
    from titanlite.parallel.state_dict import load_full_state_dict

    if trainer is None:
        trainer = RecordingTrainer(cfg)
        load_full_state_dict(trainer.model, seed_state)
    records = trainer.train()
    full = {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu()
        for k, v in trainer.model.state_dict().items()
    }
    losses = [r for r in records if "loss" in r]
    return {
        "loss": [r["loss"] for r in losses],
        "grad_norm": [r["grad_norm"] for r in losses],
        "val_loss": [r["val_loss"] for r in records if "val_loss" in r],
        "inputs": torch.cat(trainer.first_step_inputs),
        "dp_rank": trainer.dp_rank,
        "compiled_graphs": 0,
        "final": full,
    }


def qwen3_worker(args: dict) -> dict:
    import tempfile

    cache_token_stores()
    skip_peak_measurement()
    out = {}
    for name, (dp, extra) in args["configs"].items():
        with tempfile.TemporaryDirectory() as dump:
            out[name] = run_config(qwen3_config(dump, dp, extra), args["seed"])
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    cache_token_stores()
    with pytest.MonkeyPatch.context() as mp:
        skip_peak_measurement(mp)
        single = RecordingTrainer(qwen3_config(str(tmp_path_factory.mktemp("q3ref")), 1, []))
        assert single.model_args.head_dim == 32 and single.model_args.q_dim == 128 != single.model_args.dim
        seed = copy.deepcopy(single.model.state_dict())
        return {"seed": seed, **run_config(single.cfg, seed, trainer=single)}


@pytest.mark.multiprocess
def test_qwen3_trains_under_fsdp2_and_tp2_like_one_process(reference):
    results = run_workers(qwen3_worker, 2, {"configs": CONFIGS, "seed": reference["seed"]}, timeout=240)
    report = []
    for name, (dp, _) in CONFIGS.items():
        assert results[1][name]["loss"] == results[0][name]["loss"], f"{name}: ranks disagree"
        got_val, ref_val = results[0][name]["val_loss"], reference["val_loss"]
        assert len(got_val) == len(ref_val) >= 1, f"{name}: validation records {got_val} vs one process {ref_val}"
        check(name, results[0][name], reference, {"loss": RTOL, "grad_norm": RTOL, "val_loss": RTOL}, report)
        check_data(name, results, 2 // dp, reference["inputs"])
        diffs = {k: (results[0][name]["final"][k] - v).abs().max().item() for k, v in reference["final"].items()}
        worst = max(diffs.values())
        report.append(f"{name:22s} final weights max abs diff {worst:.1e} ({max(diffs, key=diffs.get)})")
        qk = max(v for k, v in diffs.items() if "q_norm" in k or "k_norm" in k)
        report.append(f"{name:22s} final QK-norm gains max abs diff {qk:.1e}")
        assert worst < WEIGHT_ATOL, f"{name}: final weights differ by {worst}"
        assert qk < QK_ATOL, f"{name}: QK-norm gains differ by {qk}"
        for k in ("layers.0.attention.q_norm.weight", "layers.1.attention.k_norm.weight"):  # QK-norm gains trained
            assert not torch.equal(reference["final"][k], torch.ones_like(reference["final"][k]))
    print("\n".join(report))


# ----------------------------------------------------------------------------- extension mechanics


def test_core_never_imports_torchtitan_ext():
    """Static check: no module of titanlite imports torchtitan_ext (only its docs mention it)."""
    offenders = []
    for path in (REPO / "titanlite").rglob("*.py"):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if re.match(r"\s*(import|from)\s+torchtitan_ext\b", line) or 'import_module("torchtitan_ext' in line:
                offenders.append(f"{path.relative_to(REPO)}:{n}: {line.strip()}")
    assert not offenders, offenders


def test_load_config_imports_the_extensions_from_the_file_and_the_command_line(tmp_path):
    """``load_config`` imports ``[job] extensions`` before it looks up ``[model] name``, so any script
    that loads a config sees the families they register; a command-line value replaces the file's."""
    from titanlite.config import ConfigError
    from titanlite.models import load_config

    # an extension module registers a family on import
    (tmp_path / "toy_ext_for_test.py").write_text(
        "from titanlite.models import ModelSpec, register_model\n"
        "from torchtitan_ext.qwen3 import QWEN3_FLAVORS, Qwen3Model, Qwen3ModelArgs\n"
        "register_model(ModelSpec(name='toy_ext_family', args_cls=Qwen3ModelArgs, flavors=QWEN3_FLAVORS,\n"
        "                         model_cls=Qwen3Model))\n"
    )
    run = tmp_path / "run.toml"
    run.write_text('[job]\nextensions = ["toy_ext_for_test"]\n[model]\nname = "toy_ext_family"\nhead_dim = 16\n')
    sys.path.insert(0, str(tmp_path))
    try:
        with pytest.raises(ConfigError, match="unknown model family 'toy_ext_family'"):
            load_config(["--config", str(run), "--job.extensions="])  # the override removes the extension
        assert "toy_ext_for_test" not in sys.modules
        cfg = load_config(["--config", str(run)])
        assert "toy_ext_for_test" in sys.modules and cfg.job.extensions == ["toy_ext_for_test"]
        assert get_model_spec("toy_ext_family").model_cls is Qwen3Model
        assert cfg.model.overrides == {"head_dim": 16}  # checked against the extension family's args
        with pytest.raises(ConfigError, match=r"^job.extensions: cannot import 'torchtitan_ext.nope' \(Module"):
            load_config(["--config", str(run), "--job.extensions", "toy_ext_for_test,torchtitan_ext.nope"])
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("toy_ext_for_test", None)


def test_estimate_script_sees_the_extension_family():
    """``titanlite estimate`` on the qwen3 debug config in a process that has not imported the extension (forked
    from the fork server, tests/helpers/launch.py), and the planner's parameter count is the model's exact one."""
    out = run_python(
        [
            sys.executable,
            "-m",
            "titanlite",
            "estimate",
            "--config",
            str(REPO / "torchtitan_ext" / "configs" / "qwen3_debug.toml"),
            "--gpu",
            "H100",
            "--num-gpus",
            "1",
            "--tokens",
            "1e9",
        ],
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    expected = sum(p.numel() for p in build_model("qwen3", "debugmodel").parameters())  # meta device
    assert f"qwen3/debugmodel: {expected:,} parameters" in out.stdout, out.stdout


def test_debug_config_trains_through_the_trainer_entry_point(tmp_path, capsys, monkeypatch):
    """``titanlite.train.main`` with the shipped qwen3 debug config (its [job] extensions hook) trains."""
    import titanlite.train as train

    skip_peak_measurement(monkeypatch)
    data = tmp_path / "corpus.txt"
    data.write_text("The quick brown fox jumps over the lazy dog. " * 400)
    argv = [
        "--config",
        str(REPO / "torchtitan_ext/configs/qwen3_debug.toml"),
        "--job.dump_folder",
        str(tmp_path / "out"),
        "--training.steps",
        "2",
        "--training.seq_len",
        "64",
        "--training.local_batch_size",
        "2",
        "--training.global_batch_size",
        "2",
        "--lr_scheduler.warmup_steps",
        "1",
        "--validation.enable",
        "false",
        "--metrics.log_freq",
        "1",
        "--training.dataset",
        "text",
        "--training.dataset_path",
        str(data),
        "--model.n_layers",
        "2",
    ]
    train.main(argv + ["--checkpoint.enable", "--checkpoint.interval", "2"])
    records = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2]

    # the converters, each in a process that has not imported the extension (tests/helpers/launch.py): both need
    # --extensions (a checkpoint's recorded extensions are never imported on its word alone); HF -> DCP records it
    # for the way back
    def convert(script: str, *args: str) -> subprocess.CompletedProcess:
        return run_python([sys.executable, "-m", "titanlite", "convert", script, "--quiet", *args], cwd=tmp_path)

    step = tmp_path / "out" / "checkpoint" / "step-2"
    assert layout.read_info(step)["extensions"] == ["torchtitan_ext.qwen3"]
    out = convert("dcp-to-hf", "--extensions", "torchtitan_ext.qwen3", str(step), "hf")
    assert out.returncode == 0, out.stderr
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"] == ["Qwen3ForCausalLM"]
    out = convert("hf-to-dcp", "hf", "dcp")
    assert out.returncode == 2 and out.stderr.startswith("error: model_type='qwen3'")
    assert "pass --extensions torchtitan_ext.qwen3" in out.stderr
    assert not (tmp_path / "dcp").exists()
    out = convert("hf-to-dcp", "--extensions", "torchtitan_ext.qwen3", "hf", "dcp")
    assert out.returncode == 0, out.stderr
    assert layout.read_info(tmp_path / "dcp")["extensions"] == ["torchtitan_ext.qwen3"]
    with pytest.raises(SystemExit) as e:
        train.main(argv + ["--job.extensions", "torchtitan_ext.nope"])
    assert e.value.code == 2 and "cannot import 'torchtitan_ext.nope'" in capsys.readouterr().err

"""DCP <-> Hugging Face conversion against ``transformers``' ``LlamaForCausalLM`` (fp32, CPU).

Debug-size configs with grouped-query attention, tied and untied embeddings, and Llama 3.1 RoPE
scaling:

- titanlite -> DCP -> HF: ``from_pretrained`` on the converted folder gives titanlite's logits
  (within 1e-4), including a trainer-written bf16 model-only export;
- HF -> DCP -> titanlite: a model built from the converted checkpoint gives HF's logits, also when
  the checkpoint seeds a training run through ``[checkpoint] initial_load_path``;
- HF -> DCP -> HF: every tensor comes back bit for bit (sharded output with an index included);
- wrong inputs: one ``error:`` line, exit status 2, nothing written or overwritten.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from tests.helpers.llama import run_cli, save_step_folder, tiny_args, titanlite_model, tokens
from tests.helpers.tiny import TINY_MODEL
from titanlite.checkpoint import layout
from titanlite.checkpoint.convert_cli import main_dcp_to_hf, main_hf_to_dcp
from titanlite.checkpoint.hf_export import dcp_to_hf
from titanlite.checkpoint.hf_import import hf_to_dcp
from titanlite.models.llama3 import Llama3HFAdapter, Llama3ModelArgs, Transformer

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
ATOL = 1e-4
CASES = {
    "gqa_untied": dict(tie_word_embeddings=False),
    "gqa_tied_rope_scaling": dict(tie_word_embeddings=True, rope_scaling_factor=8.0, rope_original_max_position=64),
    "mha_tied": dict(tie_word_embeddings=True, n_kv_heads=None),
}


pytestmark = pytest.mark.usefixtures("one_thread")


def hf_files(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def hf_logits(folder: Path, dtype=torch.float32) -> torch.Tensor:
    hf = transformers.LlamaForCausalLM.from_pretrained(str(folder), dtype=dtype, attn_implementation="eager").eval()
    with torch.no_grad():
        return hf(tokens()).logits


# ----------------------------------------------------------------------------- titanlite -> HF


def seeded_run(seed, dump, *extra: str) -> list[str]:
    """Arguments of a one-step tiny run in ``dump`` starting from the seed checkpoint ``seed``."""
    run = ["--training.seq_len", "32", "--training.steps", "1", "--lr_scheduler.warmup_steps", "0"]
    return [*TINY_MODEL, *extra, *run, "--job.dump_folder", str(dump), "--checkpoint.initial_load_path", str(seed)]


@pytest.mark.parametrize("case", list(CASES))
def test_dcp_to_hf_loads_in_transformers_with_matching_logits(case, tmp_path):
    args = tiny_args(**CASES[case])
    model = titanlite_model(args)
    step = save_step_folder(model, tmp_path / "step-7")
    out = tmp_path / "hf"
    if case == "gqa_untied":  # once through the command line, with a small shard size
        proc = run_cli("dcp-to-hf", str(step), str(out), "--max-shard-size", "100KB")
        assert proc.returncode == 0, proc.stderr
        assert "[21/21] lm_head.weight" in proc.stdout
        index = json.loads((out / "model.safetensors.index.json").read_text())
        shards = sorted(p.name for p in out.glob("*.safetensors"))
        n = len(shards)
        assert n > 1 and shards == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
        assert set(index["weight_map"].values()) == set(shards)
        for shard in shards:  # at most 100 KB of tensors per file, unless one tensor is larger on its own
            part = load_file(str(out / shard))
            assert len(part) == 1 or sum(t.numel() * 4 for t in part.values()) <= 100_000
            assert all(index["weight_map"][name] == shard for name in part)
        assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in hf_files(out).values())
    else:
        dcp_to_hf(step, out)
        assert (out / "model.safetensors").is_file() and not (out / "model.safetensors.index.json").exists()
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["torch_dtype"] == "float32"
    assert config["tie_word_embeddings"] == args.tie_word_embeddings and config["rope_theta"] == args.rope_theta
    assert (config["bos_token_id"], config["eos_token_id"]) == (256, 257)
    assert config["num_key_value_heads"] == args.kv_heads and config["intermediate_size"] == args.ffn_hidden_dim
    if args.rope_scaling_factor:
        assert config["rope_scaling"]["rope_type"] == "llama3" and config["rope_scaling"]["factor"] == 8.0
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 257
    weights = hf_files(out)
    assert "lm_head.weight" in weights  # written for tied models too
    with torch.no_grad():
        expected = model(tokens())
    torch.testing.assert_close(hf_logits(out), expected, rtol=0, atol=ATOL)


def test_trainer_bf16_export_converts(tmp_path):
    from titanlite.models import load_config
    from titanlite.trainer import Trainer

    dump = tmp_path / "run"
    cfg = load_config(
        [
            *TINY_MODEL,
            "--model.tie_word_embeddings",
            "true",
            "--training.seq_len",
            "32",
            "--training.local_batch_size",
            "2",
            "--training.steps",
            "2",
            "--lr_scheduler.warmup_steps",
            "0",
            "--job.dump_folder",
            str(dump),
            "--checkpoint.enable",
            "--checkpoint.export_dtype",
            "bfloat16",
        ]
    )
    trainer = Trainer(cfg)
    trainer.train()
    out = tmp_path / "hf"
    dcp_to_hf(dump / "checkpoint" / "step-2", out)
    config = json.loads((out / "config.json").read_text())
    assert config["torch_dtype"] == "bfloat16" and config["tie_word_embeddings"] is True
    assert (config["bos_token_id"], config["eos_token_id"]) == (trainer.tokenizer.bos_id, trainer.tokenizer.eos_id)
    assert {t.dtype for t in hf_files(out).values()} == {torch.bfloat16}
    # the same bf16-rounded weights in both models, computed in fp32
    model = trainer.model
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
        expected = model.eval()(tokens())
    torch.testing.assert_close(hf_logits(out, torch.float32), expected, rtol=0, atol=ATOL)


# ----------------------------------------------------------------------------- HF -> titanlite


def hf_model_folder(tmp_path: Path, **case) -> Path:
    args = tiny_args(**case)
    rope = {"rope_type": "default", "rope_theta": args.rope_theta}
    if args.rope_scaling_factor:
        rope = {
            "rope_type": "llama3",
            "rope_theta": args.rope_theta,
            "factor": args.rope_scaling_factor,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": args.rope_original_max_position,
        }
    config = transformers.LlamaConfig(
        vocab_size=args.vocab_size,
        hidden_size=args.dim,
        intermediate_size=args.ffn_hidden_dim,
        num_hidden_layers=args.n_layers,
        num_attention_heads=args.n_heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.max_seq_len,
        rms_norm_eps=args.norm_eps,
        rope_parameters=rope,
        tie_word_embeddings=args.tie_word_embeddings,
        bos_token_id=256,
        eos_token_id=257,
    )
    torch.manual_seed(3)
    hf = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    folder = tmp_path / "hf_src"
    hf.save_pretrained(str(folder))
    return folder


def load_titanlite_from_step(step: Path) -> Transformer:
    info = layout.read_info(step)
    model = Transformer(Llama3ModelArgs(**info["model"]["args"]))
    model.init_weights()
    dcp.load({"model": model.state_dict()}, checkpoint_id=str(step), no_dist=True)
    return model.eval()


@pytest.mark.parametrize("case", list(CASES))
def test_hf_to_dcp_gives_titanlite_the_same_logits(case, tmp_path):
    src = hf_model_folder(tmp_path, **CASES[case])
    step = hf_to_dcp(src, tmp_path / "dcp")
    info = layout.read_info(step)
    assert info["model_only"] and info["tokenizer"] == {"path": "", "bos_id": 256, "eos_id": 257}
    args = Llama3ModelArgs(**info["model"]["args"])
    expected_args = tiny_args(**CASES[case])
    assert args.ffn_hidden_dim == expected_args.ffn_hidden_dim and args.kv_heads == expected_args.kv_heads
    assert args.tie_word_embeddings == expected_args.tie_word_embeddings
    assert args.rope_scaling_factor == expected_args.rope_scaling_factor
    model = load_titanlite_from_step(step)
    with torch.no_grad():
        got = model(tokens())
    torch.testing.assert_close(got, hf_logits(src), rtol=0, atol=ATOL)


def test_hf_checkpoint_seeds_a_training_run(tmp_path, caplog):
    """HF -> DCP -> ``initial_load_path``: the trainer starts from exactly the HF weights."""
    from titanlite.models import load_config
    from titanlite.trainer import Trainer

    src = hf_model_folder(tmp_path, tie_word_embeddings=False)
    proc = run_cli("hf-to-dcp", str(src), str(tmp_path / "dcp"))
    assert proc.returncode == 0, proc.stderr
    assert "initial_load_path" in proc.stdout.strip().splitlines()[-1]
    cfg = load_config(seeded_run(tmp_path / "dcp", tmp_path / "run", "--model.max_seq_len", "128"))
    trainer = Trainer(cfg)
    with caplog.at_level("INFO", logger="titanlite"):
        trainer.checkpointer.load()
    assert "loaded model weights only from initial_load_path" in caplog.text
    with torch.no_grad():
        got = trainer.model.eval()(tokens())
    torch.testing.assert_close(got, hf_logits(src), rtol=0, atol=ATOL)


@pytest.mark.parametrize("case", ["gqa_untied", "gqa_tied_rope_scaling"])
def test_hf_dcp_hf_round_trip_is_bitwise(case, tmp_path):
    src = hf_model_folder(tmp_path, **CASES[case])
    step = hf_to_dcp(src, tmp_path / "dcp")
    out = dcp_to_hf(step, tmp_path / "hf_out", max_shard_bytes=200_000)
    a, b = hf_files(src), hf_files(out)
    assert set(a) <= set(b) and set(b) - set(a) <= {"lm_head.weight"}
    for name, t in a.items():
        assert t.dtype == b[name].dtype and torch.equal(t, b[name]), name
    if "lm_head.weight" not in a:  # a tied model's lm_head is the embedding
        assert torch.equal(b["lm_head.weight"], a["model.embed_tokens.weight"])
    src_cfg, out_cfg = (json.loads((d / "config.json").read_text()) for d in (src, out))
    for key in (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "vocab_size",
        "max_position_embeddings",
        "rms_norm_eps",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
    ):
        assert out_cfg[key] == src_cfg[key], key


def test_adapter_permutation_round_trip():
    args = tiny_args()
    adapter = Llama3HFAdapter(args)
    w = torch.randn(args.n_heads * args.head_dim, args.dim)
    name, hf_w = adapter.to_hf("layers.1.attention.wq.weight", w)
    assert name == "model.layers.1.self_attn.q_proj.weight" and not torch.equal(hf_w, w)
    assert torch.equal(adapter.from_hf(name, hf_w)[1], w)
    # HF row j of a head is native row 2j; HF row j + head_dim/2 is native row 2j + 1
    hd = args.head_dim
    assert torch.equal(hf_w[hd + 1], w[hd + 2]) and torch.equal(hf_w[hd + hd // 2 + 1], w[hd + 3])
    assert adapter.from_hf("model.layers.0.self_attn.rotary_emb.inv_freq", torch.ones(2)) is None


# ----------------------------------------------------------------------------- wrong inputs


def test_errors_are_one_line_and_write_nothing(tmp_path):
    model = titanlite_model(tiny_args())
    step = save_step_folder(model, tmp_path / "step-7")
    empty = tmp_path / "empty"
    empty.mkdir()

    def cli_fails(script, *args, expect):
        proc = run_cli(script, *args)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
        assert expect in lines[0], lines[0]

    def fails(fn, *args, expect):
        with pytest.raises((ValueError, FileNotFoundError)) as e:
            fn(*args)
        assert expect in str(e.value) and "\n" not in str(e.value), str(e.value)

    # command lines: one line on stderr, exit status 2
    cli_fails("dcp-to-hf", str(empty), str(tmp_path / "o1"), expect="is not a DCP checkpoint folder")
    cli_fails("hf-to-dcp", str(empty), str(tmp_path / "d1"), expect="not a Hugging Face model folder")
    assert not (tmp_path / "o1").exists() and not (tmp_path / "d1").exists()

    fails(dcp_to_hf, tmp_path / "nope", tmp_path / "o1", expect="no such folder")
    # an existing non-empty output is never overwritten
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "keep.txt").write_text("x")
    fails(dcp_to_hf, step, tmp_path / "busy", expect="already exists and is not empty")
    assert [p.name for p in (tmp_path / "busy").iterdir()] == ["keep.txt"]
    # checkpoint.json args that do not match the stored tensors
    edit_json(step / "checkpoint.json", lambda info: info["model"]["args"].update(dim=128))
    fails(dcp_to_hf, step, tmp_path / "o2", expect="model.tok_embeddings.weight has shape [512, 64]")
    (step / "checkpoint.json").unlink()
    fails(dcp_to_hf, step, tmp_path / "o2", expect="has no checkpoint.json")
    assert not (tmp_path / "o2").exists() and not list(tmp_path.glob("o2.partial-*"))

    # HF side: not a Llama, a tensor whose shape disagrees with config.json, a missing tensor
    gpt = tmp_path / "gpt"
    gpt.mkdir()
    (gpt / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    fails(hf_to_dcp, gpt, tmp_path / "d1", expect="unsupported Hugging Face model (model_type='gpt2'")
    src = hf_model_folder(tmp_path, tie_word_embeddings=False)
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 512}))
    fails(hf_to_dcp, src, tmp_path / "d1", expect="but config.json implies [")
    (src / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 3}))
    fails(hf_to_dcp, src, tmp_path / "d1", expect="lacks model.layers.2.")
    assert not (tmp_path / "d1").exists() and not list(tmp_path.glob("d1.partial-*"))


def test_llama_args_from_hf_config_round_trip_and_refusals():
    """config.json written for a model maps back to the same args (3.1 RoPE scaling included); what
    titanlite's Llama cannot express is a one-line ValueError naming the key."""
    args = tiny_args(rope_scaling_factor=8.0)
    config = Llama3HFAdapter(args).hf_config(dtype=torch.bfloat16, bos_token_id=1, eos_token_id=2)
    assert config["torch_dtype"] == "bfloat16" and config["rope_scaling"]["rope_type"] == "llama3"
    back = Llama3HFAdapter.args_from_hf_config(config)  # max_seq_len: the scaled context (above RoPE's original)
    assert config["max_position_embeddings"] > 8192 and back.max_seq_len == config["max_position_embeddings"]
    assert dataclasses.replace(back, max_seq_len=args.max_seq_len) == args
    v5 = {k: v for k, v in config.items() if k not in ("rope_theta", "rope_scaling")}  # transformers 5 layout
    v5["rope_parameters"] = {**config["rope_scaling"], "rope_theta": args.rope_theta}
    assert Llama3HFAdapter.args_from_hf_config(v5) == back
    for change, message in (
        ({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}, "not a Llama config"),
        ({"hidden_size": None}, "lacks an integer 'hidden_size'"),
        ({"hidden_act": "gelu"}, "unsupported hidden_act 'gelu'"),
        ({"attention_bias": True}, "unsupported attention_bias=true"),
        ({"mlp_bias": True}, "unsupported mlp_bias=true"),
        ({"head_dim": 2 * args.head_dim}, "unsupported head_dim="),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "unsupported rope_type 'yarn'"),
    ):
        with pytest.raises(ValueError, match=message):
            Llama3HFAdapter.args_from_hf_config({**config, **change})


# ----------------------------------------------------------------------------- damaged and crafted inputs


class RunsCode:
    """Unpickling this object calls ``open(marker, "w")``: a file appears when the pickle is executed."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def one_line_error(proc: subprocess.CompletedProcess) -> str:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    return lines[0]


def truncate(file: Path) -> None:
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])


def garble(file: Path) -> None:
    file.write_bytes(os.urandom(file.stat().st_size))


def edit_json(file: Path, change) -> None:
    """Change a JSON file; a checkpoint.json is sealed again (its own checksum, as a tool that writes one would)."""
    data = json.loads(file.read_text())
    change(data)
    if file.name == layout.INFO_FILE:
        layout.write_info(file.parent, data)
    else:
        file.write_text(json.dumps(data))


DCP_DAMAGE = {  # what is done to the step folder, the file the error must name
    "metadata_random": (lambda d: garble(d / ".metadata"), ".metadata"),
    "distcp_truncated": (lambda d: truncate(d / "__0_0.distcp"), "__0_0.distcp"),
    "distcp_random": (lambda d: garble(d / "__0_0.distcp"), "__0_0.distcp"),
    "info_random": (lambda d: garble(d / "checkpoint.json"), "checkpoint.json"),
    "info_not_a_model": (
        lambda d: edit_json(d / "checkpoint.json", lambda j: j.update(model="llama3")),
        "checkpoint.json",
    ),
    "info_bad_arg": (
        lambda d: edit_json(d / "checkpoint.json", lambda j: j["model"]["args"].update(norm_eps="tiny")),
        "checkpoint.json",
    ),
}
HF_DAMAGE = {
    "safetensors_truncated": (lambda d: truncate(d / "model.safetensors"), "model.safetensors"),
    "safetensors_random": (lambda d: garble(d / "model.safetensors"), "model.safetensors"),
    "config_random": (lambda d: garble(d / "config.json"), "config.json"),
    "config_bad_value": (
        lambda d: edit_json(d / "config.json", lambda j: j.update(num_attention_heads="4")),
        "config.json",
    ),
}


def in_process(capsys, script: str, *args: str) -> subprocess.CompletedProcess:
    """What ``titanlite convert <script>`` does (it only calls this ``main``), without an interpreter start."""
    main = {"dcp-to-hf": main_dcp_to_hf, "hf-to-dcp": main_hf_to_dcp}[script]
    capsys.readouterr()
    code = main(["--quiet", *args])
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess([script, *args], code, out, err)


# damages also run through the command line in a process of its own (the others run its main in-process: the
# commands are main() alone)
IN_SUBPROCESS = {"distcp_random", "safetensors_truncated"}


def test_damaged_inputs_are_one_line_errors_and_write_nothing(tmp_path, capsys):
    """Each damage: exit status 2, one ``error:`` line naming the damaged file, and no output: not
    the output folder, not its missing parents, no ``.partial`` folder; an existing empty output
    folder stays as it was. A ``.metadata`` whose pickle would run code is refused without running
    it (torch's own reader runs it: the marker file proves the payload)."""
    model = titanlite_model(tiny_args())
    cases = []  # (case, file the error must name, output folder, script call)
    for case, (damage, file) in DCP_DAMAGE.items():
        step = save_step_folder(model, tmp_path / case / "step-7")
        damage(step)
        out = tmp_path / case / "new" / "hf"
        cases.append((case, file, out, ("dcp-to-hf", str(step), str(out))))
    src = hf_model_folder(tmp_path, tie_word_embeddings=False)
    for case, (damage, file) in HF_DAMAGE.items():
        folder = tmp_path / case
        shutil.copytree(src, folder)
        damage(folder)
        out = tmp_path / f"{case}_out"
        out.mkdir()  # an existing empty output folder: left as it is
        cases.append((case, file, out, ("hf-to-dcp", str(folder), str(out))))
    marker = tmp_path / "marker"
    crafted = save_step_folder(model, tmp_path / "crafted" / "step-7")
    (crafted / ".metadata").write_bytes(pickle.dumps(RunsCode(marker)))
    crafted_call = ("dcp-to-hf", str(crafted), str(tmp_path / "crafted_out"))

    calls = [call for case, _, _, call in cases if case in IN_SUBPROCESS] + [crafted_call]
    *spawned, refused = [run_cli(script, "--quiet", *args) for script, *args in calls]
    spawned = iter(spawned)
    for case, file, out, call in cases:
        proc = next(spawned) if case in IN_SUBPROCESS else in_process(capsys, *call)
        line = one_line_error(proc)
        assert file in line and "Traceback" not in proc.stderr, (case, line)
        if out.name == "hf":  # created by nobody: neither it nor its parent
            assert not out.parent.exists(), case
        else:
            assert out.is_dir() and not any(out.iterdir()), case
        assert not list(out.parent.glob(f"{out.name}.partial-*")), case
    for proc in (refused, in_process(capsys, *crafted_call)):
        assert ".metadata: refused to load global io.open" in one_line_error(proc), proc.stderr
    assert not marker.exists() and not (tmp_path / "crafted_out").exists()
    FileSystemReader(str(crafted)).read_metadata()
    assert marker.exists()  # the payload was real


def test_extensions_recorded_in_a_checkpoint_are_not_imported(tmp_path, capsys, monkeypatch):
    """checkpoint.json names extension modules; the converter imports only those also given with
    --extensions. The module here leaves a marker file when imported."""
    marker = tmp_path / "imported"
    (tmp_path / "marker_ext_12.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    model = titanlite_model(tiny_args())
    known = save_step_folder(model, tmp_path / "known")  # llama3: core knows it, the extension is not needed
    edit_json(known / "checkpoint.json", lambda j: j.update(extensions=["marker_ext_12"]))
    unknown = save_step_folder(model, tmp_path / "unknown")  # a family only the extension would register
    edit_json(
        unknown / "checkpoint.json",
        lambda j: (j.update(extensions=["marker_ext_12"]), j["model"].update(name="mystery")),
    )
    ok = in_process(capsys, "dcp-to-hf", str(known), str(tmp_path / "hf_known"))
    assert ok.returncode == 0, ok.stderr
    refused = in_process(capsys, "dcp-to-hf", str(unknown), str(tmp_path / "hf_unknown"))
    line = one_line_error(refused)
    assert "extension marker_ext_12" in line and "pass --extensions marker_ext_12" in line, line
    assert not marker.exists() and not (tmp_path / "hf_unknown").exists()
    # named on the command line, it is imported (the marker proves the module would have run)
    args = ("--extensions", "marker_ext_12", str(unknown), str(tmp_path / "hf_unknown"))
    assert "unknown model family 'mystery'" in one_line_error(in_process(capsys, "dcp-to-hf", *args))
    assert marker.exists()


# ----------------------------------------------------------------------------- seed model args


def test_a_seed_trains_with_its_own_rope_and_norm_eps(tmp_path, caplog, capsys):
    """An HF Llama with Llama 3.1 RoPE scaling, theta 1e4 and eps 1e-6, converted and used as
    ``initial_load_path`` under a config without any of them (debugmodel: no scaling, theta 5e5,
    eps 1e-5): the trainer takes the seed's values and gives transformers' logits; with the
    config's own args the same weights are off by about 1e-2. Setting one of them explicitly to
    another value is a one-line error."""
    from titanlite.models import load_config
    from titanlite.models.registry import RUN_ARGS, model_args_for
    from titanlite.train import main
    from titanlite.trainer import Trainer

    src = hf_model_folder(
        tmp_path,
        tie_word_embeddings=False,
        rope_scaling_factor=8.0,
        rope_original_max_position=64,
        rope_theta=1e4,
        norm_eps=1e-6,
    )
    seed = hf_to_dcp(src, tmp_path / "dcp")
    argv = seeded_run(seed, tmp_path / "run")
    cfg = load_config(argv)
    with caplog.at_level("INFO", logger="titanlite"):
        trainer = Trainer(cfg)
        trainer.checkpointer.load()
    seed_args = layout.read_info(seed)["model"]["args"]
    assert {k: getattr(trainer.model_args, k) for k in seed_args if k not in RUN_ARGS} == {
        k: v for k, v in seed_args.items() if k not in RUN_ARGS
    }
    for key in ("rope_theta", "norm_eps", "rope_scaling_factor", "rope_original_max_position"):
        assert f"model.{key} = " in caplog.text, key
    with torch.no_grad():
        got = trainer.model.eval()(tokens())
    expected = hf_logits(src)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    # what training did before: the config's args, the same weights
    plain = Transformer(model_args_for(cfg.model, trainer.tokenizer.vocab_size))
    plain.load_state_dict(trainer.model.state_dict())
    with torch.no_grad():
        assert (plain.eval()(tokens()) - expected).abs().max() > 1e-3
    records = trainer.train()
    assert [r["step"] for r in records if "loss" in r] == [1] and torch.isfinite(torch.tensor(records[-1]["loss"]))

    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main([*argv, "--model.rope_theta", "500000", "--job.dump_folder", str(tmp_path / "run2")])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1, err
    assert "model.rope_theta=500000.0" in err[0] and "rope_theta=10000.0" in err[0] and str(seed) in err[0], err


def test_a_seed_of_other_shapes_trains_with_no_model_flags(tmp_path, caplog):
    """An HF Llama whose every shape differs from the default flavor's (dim 80, 3 layers, 5 heads, 1 KV head, an
    MLP of 288, 576 tokens), converted and trained from with ``--checkpoint.initial_load_path`` as the only model
    option: the run takes the seed's recorded args (shapes included) and starts from transformers' logits."""
    from titanlite.models import load_config
    from titanlite.models.registry import RUN_ARGS
    from titanlite.trainer import Trainer

    odd = dict(dim=80, n_layers=3, n_heads=5, n_kv_heads=1, multiple_of=96, vocab_size=576, tie_word_embeddings=False)
    src = hf_model_folder(tmp_path, **odd)
    proc = run_cli("hf-to-dcp", str(src), str(tmp_path / "dcp"))
    assert proc.returncode == 0, proc.stderr
    run = ["--training.seq_len", "32", "--training.steps", "1", "--lr_scheduler.warmup_steps", "0"]
    cfg = load_config(
        [*run, "--job.dump_folder", str(tmp_path / "run"), "--checkpoint.initial_load_path", str(tmp_path / "dcp")]
    )
    assert cfg.model.overrides == {}
    with caplog.at_level("INFO", logger="titanlite"):
        trainer = Trainer(cfg)
        trainer.checkpointer.load()
    seed_args = layout.read_info(tmp_path / "dcp")["model"]["args"]
    assert {k: v for k, v in dataclasses.asdict(trainer.model_args).items() if k not in RUN_ARGS} == {
        k: v for k, v in seed_args.items() if k not in RUN_ARGS
    }
    assert "model.dim = 80 from the seed checkpoint" in caplog.text
    with torch.no_grad():
        got = trainer.model.eval()(tokens(576))
    hf = transformers.LlamaForCausalLM.from_pretrained(str(src), dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        torch.testing.assert_close(got, hf.eval()(tokens(576)).logits, rtol=0, atol=ATOL)
    records = trainer.train()
    assert [r["step"] for r in records if "loss" in r] == [1] and torch.isfinite(torch.tensor(records[-1]["loss"]))


@pytest.mark.parametrize(
    "key, value",
    [
        ("rope_theta", float("nan")),
        ("rms_norm_eps", float("inf")),
        ("num_hidden_layers", 5_000),  # 1e12 hung the converter (a dict of every layer's tensors)
        ("vocab_size", 10**11),
        ("max_position_embeddings", 10**12),
    ],
)
def test_non_finite_or_absurd_config_json_values_are_one_line_errors(tmp_path, capsys, key, value):
    """HF config.json values that no model has: converted to nothing, one line naming the file and the key (a NaN
    rope_theta converted, then generated token 0 forever and scored)."""
    src = hf_model_folder(tmp_path, tie_word_embeddings=False)
    config = src / "config.json"
    data = json.loads(config.read_text())
    if key == "rope_theta":  # the transformers 4 form: no rope_parameters
        data.pop("rope_parameters", None)
    data[key] = value
    config.write_text(json.dumps(data))  # NaN and Infinity as Python's json writes (and reads) them
    line = one_line_error(in_process(capsys, "hf-to-dcp", str(src), str(tmp_path / "out")))
    assert "config.json" in line and {"rms_norm_eps": "norm_eps"}.get(key, key) in line, line
    assert not (tmp_path / "out").exists()


def test_non_finite_args_in_checkpoint_json_and_huge_hf_sizes_are_refused(tmp_path, capsys):
    step = save_step_folder(titanlite_model(tiny_args()), tmp_path / "step-7")
    edit_json(step / "checkpoint.json", lambda j: j["model"]["args"].update(rope_theta=float("nan")))
    line = one_line_error(in_process(capsys, "dcp-to-hf", str(step), str(tmp_path / "hf")))
    assert "checkpoint.json" in line and "rope_theta = nan must be a finite number" in line
    config = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4}
    config.update(vocab_size=512, num_hidden_layers=10**12)
    with pytest.raises(ValueError, match=r"num_hidden_layers = 1000000000000 must be an integer in \[1, 4,096\]"):
        Llama3HFAdapter.args_from_hf_config(config)


def test_convert_into_a_symlinked_output(tmp_path, capsys):
    """dcp-to-hf into a link to an empty folder writes the export there (it used to write it all, then fail with
    "[Errno 20] Not a directory" and leave the partial folder); into a dangling link: one line, nothing written.
    The export through the link equals the one into a plain folder, byte for byte."""
    step = save_step_folder(titanlite_model(tiny_args()), tmp_path / "step-7")
    (tmp_path / "target").mkdir()
    (tmp_path / "to_target").symlink_to(tmp_path / "target")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    proc = in_process(capsys, "dcp-to-hf", str(step), str(tmp_path / "to_target"))
    assert proc.returncode == 0, proc.stderr
    assert in_process(capsys, "dcp-to-hf", str(step), str(tmp_path / "plain")).returncode == 0
    names = sorted(p.name for p in (tmp_path / "plain").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "to_target").iterdir()) and "model.safetensors" in names
    for name in names:
        assert (tmp_path / "to_target" / name).read_bytes() == (tmp_path / "plain" / name).read_bytes(), name
    assert (tmp_path / "to_target").is_symlink()
    before = sorted(os.listdir(tmp_path))
    line = one_line_error(in_process(capsys, "dcp-to-hf", str(step), str(tmp_path / "dangling")))
    assert line.startswith(f"error: output {tmp_path / 'dangling'} is a symbolic link to {tmp_path / 'nowhere'}")
    assert sorted(os.listdir(tmp_path)) == before and not list(tmp_path.glob("*.partial-*"))

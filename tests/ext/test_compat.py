"""torchtitan_ext.compat: torchtitan classic TOML configs and torchtitan DCP checkpoints on titanlite.

- Translation: a torchtitan v0.2 file maps key by key (new and legacy locations: ``[training]
  batch_size``, ``[training] tensor_parallel_degree``, ``[float8]`` + ``converters = ["float8"]``,
  ``lr_min`` ...), keys the file omits take torchtitan's defaults (bf16, selective AC every 2nd block,
  warmup 200 ...), unsupported keys warn exactly once (file + command line) and only when asked for,
  and every feature that would change the math is refused with a one-line error (exit status 2).
- Schedule: the compat trainer's LR factors are torchtitan v0.2's (values worked out by hand).
- Resume: a checkpoint laid out as torchtitan writes it (model flattened to the top level, flattened
  AdamW state under ``optimizer``, ``lr_scheduler``, ``dataloader``, ``train_state`` with ints; and
  the older layout with ``model.`` keys and tensor/BytesIO train state) restores weights, AdamW
  moments and step, the step counter, tokens seen and the LR position *exactly* (torch.equal), so
  the next optimizer step equals the one the saving run takes on the same batch (max abs diff 0:
  same ops in the same order). The same checkpoint resumes under FSDP 2 (DCP resharding): every
  gathered weight and moment equals the saved one. Training then continues and its own titanlite
  checkpoints (in ``checkpoint/titanlite``) take over on the next restart.
"""

from __future__ import annotations

import io
import json
import logging
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

from tests.helpers.compat import (
    FLAT,
    TINY,
    compat_trainer,
    take_steps,
    torchtitan_toml,
    write_data,
    write_torchtitan_checkpoint,
)
from tests.helpers.dist import run_workers
from tests.helpers.peaks import skip_peak_measurement
from torchtitan_ext.compat import CompatError, load_translated, translate
from torchtitan_ext.compat.checkpoint import choose_source, is_torchtitan_checkpoint, load_torchtitan_checkpoint
from torchtitan_ext.compat.train import CompatTrainer, main, torchtitan_lr_factor

# ----------------------------------------------------------------------------- translation


def test_legacy_and_current_keys_map_and_torchtitan_defaults_apply(tmp_path):
    data = write_data(tmp_path)
    toml = tmp_path / "old.toml"
    toml.write_text(f"""
[job]
dump_folder = "{tmp_path / "out"}"
[model]
name = "llama3"
flavor = "8B"
tokenizer_path = ""
converters = ["float8"]
[training]
batch_size = 2
seq_len = 8192
steps = 1000
warmup_steps = 50
data_parallel_shard_degree = 8
tensor_parallel_degree = 8
enable_loss_parallel = false
compile = true
dataset_path = "{data}"
[lr_scheduler]
lr_min = 0.1
[float8]
filter_fqns = ["output", "attention.wk"]
recipe_name = "tensorwise"
[checkpoint]
enable_checkpoint = true
model_weights_only = false
[validation]
enabled = true
dataset_path = "{data}"
""")
    tr = translate(str(toml))
    cfg = load_translated(tr)
    t, p = cfg.training, cfg.parallelism
    assert (t.local_batch_size, t.seq_len, t.steps, t.dataset, t.dataset_path) == (2, 8192, 1000, "text", str(data))
    assert (p.data_parallel_shard_degree, p.tensor_parallel_degree, p.enable_loss_parallel) == (8, 8, False)
    assert cfg.lr_scheduler.warmup_steps == 50 and cfg.lr_scheduler.min_lr_factor == 0.1
    assert cfg.lr_scheduler.decay_ratio == -1  # torchtitan's None: decay over every step after warmup
    assert cfg.compile.enable and cfg.compile.components == ["model", "loss"]
    assert cfg.quantize_linear_float8.enable and cfg.quantize_linear_float8.filter_fqns == ["output", "attention.wk"]
    assert cfg.checkpoint.enable and not cfg.checkpoint.last_save_model_only
    assert cfg.checkpoint.folder == "checkpoint/titanlite"
    assert cfg.validation.enable and cfg.validation.dataset == "text" and cfg.validation.freq == 10
    # what the file leaves out means what it means in torchtitan
    assert t.mixed_precision_param == "bfloat16" and cfg.optimizer.lr == 8e-4 and cfg.optimizer.weight_decay == 0.1
    assert (cfg.activation_checkpoint.mode, cfg.activation_checkpoint.selective_ac_option) == ("selective", "2")
    # the flavor's vocabulary stays torchtitan's (the byte tokenizer is smaller): its checkpoints fit
    assert (cfg.model.name, cfg.model.flavor, cfg.model.overrides) == ("llama3", "8B", {"vocab_size": 128256})
    assert cfg.metrics.log_freq == 10 and cfg.checkpoint.interval == 500 and cfg.checkpoint.keep_latest_k == 10
    assert tr.settings.torchtitan_folder == str(tmp_path / "out" / "checkpoint")


def test_debugmodel_flavor_is_torchtitans_architecture(tmp_path):
    cfg = load_translated(translate(str(torchtitan_toml(tmp_path))))
    o = cfg.model.overrides
    assert (cfg.model.flavor, o["dim"], o["n_layers"], o["n_heads"], o["n_kv_heads"]) == (
        "debugmodel",
        256,
        6,
        16,
        None,
    )
    assert o["rope_scaling_factor"] == 8.0 and o["rope_theta"] == 500000.0 and o["ffn_dim_multiplier"] is None


def test_unsupported_keys_warn_once_and_only_when_asked_for(tmp_path, caplog):
    toml = torchtitan_toml(
        tmp_path,
        body="""
[comm]
trace_buf_size = 0
[memory_estimation]
enabled = false
""",
    )
    text = toml.read_text().replace("enable_wandb = false", "enable_wandb = true\nshiny_new_key = 1")
    toml.write_text(text)
    with caplog.at_level(logging.WARNING, logger="torchtitan_ext.compat"):
        tr = translate(
            str(toml),
            [
                "--metrics.enable_wandb",
                "true",
                "--metrics.shiny_new_key",
                "2",
                "--parallelism.enable_async_tensor_parallel",
            ],
        )
    msgs = [r.getMessage() for r in caplog.records]
    for key in (
        "metrics.enable_wandb",
        "metrics.shiny_new_key",
        "comm.trace_buf_size",
        "parallelism.enable_async_tensor_parallel",
    ):
        assert sum(key + ":" in m for m in msgs) == 1, (key, msgs)
    assert not any("memory_estimation" in m or "disable_color_printing" in m for m in msgs)  # defaults: silent
    assert len([w for w in tr.settings.warnings if "model.vocab_size" not in w]) == 4


REFUSED = {
    "pipeline schedule from a CSV": (
        "--parallelism.pipeline_parallel_degree 2\n--parallelism.pipeline_parallel_schedule_csv s.csv",
        "schedule_csv",
    ),
    "context parallelism": ("--parallelism.context_parallel_degree 2", "context_parallel_degree=2"),
    "expert parallelism": ("--parallelism.expert_parallel_degree 4", "expert parallelism"),
    "MoE model": ("--model.name deepseek_v3", "mixture-of-experts"),
    "other family": ("--model.name flux", "llama3 only"),
    "rowwise float8": ('[quantize.linear.float8]\nrecipe_name = "rowwise"\n--model.converters float8', "tensorwise"),
    "MX converter": ("--model.converters quantize.linear.mx", "'quantize.linear.mx'"),
    "fault tolerance": ("[fault_tolerance]\nenable = true", "TorchFT"),
    "optimizer in backward": ("--optimizer.early_step_in_backward", "early_step_in_backward"),
    "other optimizer": ("--optimizer.name Muon", "Muon"),
    "plug-in code": ('[experimental]\ncustom_import = "my.model"', "custom_import"),
    "a different loss": ("--training.label_smoothing 0.1", "loss / experts"),
    "unknown loss section": ('[loss]\nname = "chunked_cross_entropy"', "loss / experts"),
    "HF weights": ("--checkpoint.initial_load_in_hf", "titanlite convert hf-to-dcp"),
    "seed checkpoint": ("--checkpoint.create_seed_checkpoint", "seed checkpoint"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_math_changing_features_are_refused(case, tmp_path, capsys):
    spec, message = REFUSED[case]
    body = "\n".join(line for line in spec.splitlines() if not line.startswith("--"))
    args = [tok for line in spec.splitlines() if line.startswith("--") for tok in line.split(" ", 1)]
    toml = torchtitan_toml(tmp_path, body="\n" + body)
    with pytest.raises(CompatError, match=message):
        translate(str(toml), args)
    with pytest.raises(SystemExit) as e:  # the entry point: one "error:" line, status 2
        main(["--config", str(toml), *args, "--translate-only"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and err.startswith("error: ") and "\n" not in err


def test_missing_data_and_tokenizer_are_explained(tmp_path):
    toml = torchtitan_toml(tmp_path)
    toml.write_text(toml.read_text().replace("dataset_path", "# dataset_path"))
    with pytest.raises(CompatError, match="titanlite prepare"):
        translate(str(toml))
    assert load_translated(translate(str(toml), ["--training.dataset", "embedded"])).training.dataset == "embedded"
    toml.write_text(torchtitan_toml(tmp_path).read_text().replace('tokenizer_path = ""', 'hf_assets_path = "/nope"'))
    with pytest.raises(CompatError, match="tokenizer"):
        translate(str(toml))


def test_lr_schedule_is_torchtitans():
    kw = dict(total_steps=10, warmup_steps=2, decay_ratio=0.8, decay_type="linear", min_lr_factor=0.0)
    got = [torchtitan_lr_factor(i, **kw) for i in range(10)]
    # warmup (i+1)/2; decay = 8 steps, stable = 10 + 1 - 2 - 8 = 1; decay progress (i+1-3)/8
    want = [0.5, 1.0, 1.0, 0.875, 0.75, 0.625, 0.5, 0.375, 0.25, 0.125]
    assert got == pytest.approx(want)
    cos = [
        torchtitan_lr_factor(i, **{**kw, "decay_type": "cosine", "min_lr_factor": 0.1, "decay_ratio": None})
        for i in range(10)
    ]
    assert cos[1] == 1.0 and cos[-1] > 0.1  # the virtual last step keeps the final lr above the minimum


# ----------------------------------------------------------------------------- resume


@pytest.mark.parametrize("legacy", [False, True], ids=["v0.2_layout", "pre_flattening_layout"])
def test_resume_from_a_torchtitan_checkpoint_continues_exactly(legacy, tmp_path, caplog, no_peak_probe):
    toml = torchtitan_toml(tmp_path)
    saver = compat_trainer(toml, ["--checkpoint.enable_checkpoint", "false"])
    data = iter(saver.train_loader)
    take_steps(saver, data, 3)
    ckpt = tmp_path / "out" / "checkpoint" / "step-3"
    write_torchtitan_checkpoint(ckpt, saver, legacy)
    assert is_torchtitan_checkpoint(ckpt)

    resumed = compat_trainer(toml)
    with caplog.at_level(logging.WARNING, logger="torchtitan_ext.compat"):
        assert resumed.resume() == 3
    assert "RESUMED from torchtitan checkpoint" in caplog.text and "data position is not restored" in caplog.text
    assert resumed.state.step == 3 and resumed.state.tokens_seen == (0 if legacy else saver.state.tokens_seen)
    for (name, a), b in zip(saver.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(a, b), name
    sa, sb = (get_optimizer_state_dict(t.model, t.optimizer, options=FLAT) for t in (saver, resumed))
    for k in (k for k in sa if k.startswith("state.")):
        assert torch.equal(sa[k], sb[k]), k
    assert resumed.optimizer.param_groups[0]["lr"] == saver.optimizer.param_groups[0]["lr"]

    batch = next(data)  # the next optimizer step on the same batch: identical weights afterwards
    saver.train_step(iter([batch]))
    resumed.train_step(iter([batch]))
    worst = max((a - b).abs().max().item() for a, b in zip(saver.model.parameters(), resumed.model.parameters()))
    assert worst == 0.0, worst
    assert resumed.optimizer.param_groups[0]["lr"] == saver.optimizer.param_groups[0]["lr"]


def test_entry_point_resumes_then_prefers_its_own_checkpoints(tmp_path, caplog, no_peak_probe):
    toml = torchtitan_toml(tmp_path, steps=5)
    saver = compat_trainer(toml, ["--checkpoint.enable_checkpoint", "false"])
    take_steps(saver, iter(saver.train_loader))
    write_torchtitan_checkpoint(tmp_path / "out" / "checkpoint" / "step-1", saver)
    with caplog.at_level(logging.WARNING):
        main(["--config", str(toml), *TINY])
    records = [json.loads(l) for l in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [2, 3, 4, 5]
    own = tmp_path / "out" / "checkpoint" / "titanlite" / "step-5"
    assert (own / "checkpoint.json").is_file() and (tmp_path / "out" / "checkpoint" / "step-1").is_dir()
    assert compat_trainer(toml).complete  # the same command again: the run is finished, nothing to do
    again = compat_trainer(toml, ["--training.steps", "7"])
    assert again.checkpointer.plan.kind == "resume" and again.resume() == 5  # titanlite's own now


def test_a_checkpoint_of_another_model_is_refused(tmp_path, no_peak_probe):
    toml = torchtitan_toml(tmp_path)
    small = compat_trainer(toml, ["--checkpoint.enable_checkpoint", "false"])
    write_torchtitan_checkpoint(tmp_path / "ckpt", small)
    tr = translate(
        str(toml),
        [
            "--model.dim",
            "128",
            "--model.n_layers",
            "2",
            "--model.n_heads",
            "4",
            "--checkpoint.enable_checkpoint",
            "false",
        ],
    )
    bigger = CompatTrainer(load_translated(tr), settings=tr.settings)
    with pytest.raises(ValueError, match="tok_embeddings.weight is .* in the checkpoint but"):
        load_torchtitan_checkpoint(tmp_path / "ckpt", bigger.model, bigger.optimizer)


class RunsCode:
    """Unpickling this object calls ``open(marker, "w")``: a file appears when the pickle is executed."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_checkpoint_item_that_would_run_code_is_refused(tmp_path):
    """A torchtitan checkpoint's non-tensor items (train_state ...) are unpickled as plain data only:
    a crafted one, which torch's default reader would execute, is a one-line error and never runs;
    a crafted ``.metadata`` is refused before anything else reads it."""
    from titanlite.models.llama3 import Llama3ModelArgs, Transformer

    marker = tmp_path / "marker"
    model = Transformer(Llama3ModelArgs(dim=64, n_layers=1, n_heads=4, vocab_size=64, max_seq_len=32))
    ckpt = tmp_path / "out" / "checkpoint" / "step-4"
    dcp.save(
        {**model.state_dict(), "train_state": {"step": RunsCode(marker), "ntokens_seen": 9}}, checkpoint_id=str(ckpt)
    )
    dcp.load({"train_state": {"step": 0}}, checkpoint_id=str(ckpt))  # torch's reader: the code runs
    assert marker.exists()
    marker.unlink()
    with pytest.raises(ValueError) as e:
        load_torchtitan_checkpoint(ckpt, model)
    msg = str(e.value)
    assert "\n" not in msg and "checkpoint item train_state.step is not plain data" in msg and str(ckpt) in msg, msg
    assert not marker.exists()
    out = load_torchtitan_checkpoint(ckpt, model, model_only=True)  # the weights alone read no pickle
    assert out["step"] == 0 and out["loaded"] == ["model"]
    # older torchtitan: a BytesIO holding a torch.save-d value; read as plain data too
    for value, expect in ((5, None), (RunsCode(marker), "train_state.step is not an integer")):
        inner = io.BytesIO()
        torch.save(value, inner)
        old = tmp_path / f"old-{expect is None}"
        dcp.save({**model.state_dict(), "train_state": {"step": inner}}, checkpoint_id=str(old))
        if expect is None:
            assert load_torchtitan_checkpoint(old, model)["step"] == 5
        else:
            with pytest.raises(ValueError, match=expect) as e:
                load_torchtitan_checkpoint(old, model)
            assert "\n" not in str(e.value) and "weights_only=False" not in str(e.value), str(e.value)
    assert not marker.exists()

    (ckpt / ".metadata").write_bytes(pickle.dumps(RunsCode(marker)))
    with pytest.raises(ValueError, match="refused to load global io.open"):
        load_torchtitan_checkpoint(ckpt, model, model_only=True)
    with pytest.raises(ValueError, match=r"step-4 is damaged: .*\.metadata: refused to load global io.open"):
        choose_source(str(ckpt.parent), -1, "", True)
    assert not marker.exists()


def fsdp_resume_worker(args: dict) -> dict:
    skip_peak_measurement()
    tr = translate(
        args["toml"], [*TINY, "--parallelism.data_parallel_shard_degree", "2", "--training.local_batch_size", "1"]
    )
    trainer = CompatTrainer(load_translated(tr), settings=tr.settings)
    step = trainer.resume()
    full = lambda v: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu()  # noqa: E731
    osd = get_optimizer_state_dict(trainer.model, trainer.optimizer, options=FLAT)
    return {
        "step": step,
        "model": {k: full(v) for k, v in trainer.model.state_dict().items()},
        "moments": {k: full(v) for k, v in osd.items() if k.startswith("state.") and not k.endswith(".step")},
        "lr": trainer.optimizer.param_groups[0]["lr"],
    }


@pytest.mark.multiprocess
def test_torchtitan_checkpoint_resumes_under_fsdp2(tmp_path, no_peak_probe):
    toml = torchtitan_toml(tmp_path)
    saver = compat_trainer(toml, ["--checkpoint.enable_checkpoint", "false"])
    take_steps(saver, iter(saver.train_loader), 2)
    write_torchtitan_checkpoint(tmp_path / "out" / "checkpoint" / "step-2", saver)
    saver.run_lock.release()  # the workers' run uses the same dump folder
    results = run_workers(fsdp_resume_worker, 2, {"toml": str(toml)}, timeout=180)
    want = get_optimizer_state_dict(saver.model, saver.optimizer, options=FLAT)
    for res in results:
        assert res["step"] == 2 and res["lr"] == saver.optimizer.param_groups[0]["lr"]
        for k, v in saver.model.state_dict().items():
            assert torch.equal(res["model"][k], v), k
        assert res["moments"] and all(torch.equal(v, want[k]) for k, v in res["moments"].items())

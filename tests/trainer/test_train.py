"""Trainer: learning on the embedded data, accumulation == big batch, bitwise reproducibility, CLI."""

import json
import os
import sys

import pytest
import torch

from tests.helpers.launch import run_python
from tests.helpers.tiny import TINY_MODEL
from titanlite.models import load_config
from titanlite.trainer import Trainer
from titanlite.trainer.step import grad_accum_steps

TINY = [
    *TINY_MODEL,
    "--training.seq_len",
    "64",
    "--metrics.log_freq",
    "1",
    "--training.seed",
    "7",
]


def make_trainer(tmp_path, *args):
    cfg = load_config(TINY + ["--job.dump_folder", str(tmp_path)] + list(args))
    return Trainer(cfg)


def test_grad_accum_steps():
    assert grad_accum_steps(-1, 8, 4) == 1
    assert grad_accum_steps(64, 8, 4) == 2
    with pytest.raises(ValueError, match="multiple of local_batch_size"):
        grad_accum_steps(60, 8, 4)


def test_loss_falls_within_50_steps(tmp_path):
    t = make_trainer(
        tmp_path,
        "--training.steps",
        "50",
        "--training.local_batch_size",
        "8",
        "--optimizer.lr",
        "3e-3",
        "--lr_scheduler.warmup_steps",
        "5",
        "--validation.enable",
        "true",
        "--validation.freq",
        "50",
        "--validation.steps",
        "2",
    )
    records = t.train()
    losses = [r["loss"] for r in records if "loss" in r]
    assert len(losses) == 50
    assert losses[0] > 5.5  # ~ln(512) at init
    assert sum(losses[-5:]) / 5 < 0.6 * losses[0], losses
    # metrics.jsonl holds the same records, validation included
    lines = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [l["loss"] for l in lines if "loss" in l] == losses
    val = [l for l in lines if "val_loss" in l]
    assert len(val) == 1 and val[0]["step"] == 50 and val[0]["val_loss"] < losses[0]
    for key in ("grad_norm", "lr", "tokens_per_s", "mfu", "tokens_seen"):
        assert key in lines[-2]
    assert lines[-2]["tokens_seen"] == 50 * 8 * 64


def test_accumulation_matches_one_big_batch(tmp_path):
    """2 micro-batches of 2 give the same update as one batch of 4 (fp32 summation-order tolerance)."""
    big = make_trainer(
        tmp_path / "a", "--training.steps", "3", "--training.local_batch_size", "4", "--training.global_batch_size", "4"
    )
    acc = make_trainer(
        tmp_path / "b", "--training.steps", "3", "--training.local_batch_size", "2", "--training.global_batch_size", "4"
    )
    assert acc.grad_accum_steps == 2 and big.grad_accum_steps == 1
    la = [r["loss"] for r in big.train()]
    lb = [r["loss"] for r in acc.train()]
    assert la == pytest.approx(lb, rel=1e-5)
    for (name, p), q in zip(big.model.named_parameters(), acc.model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6, msg=name)


def test_two_runs_are_bitwise_identical(tmp_path):
    a = make_trainer(tmp_path / "a", "--training.steps", "4", "--training.local_batch_size", "2").train()
    b = make_trainer(tmp_path / "b", "--training.steps", "4", "--training.local_batch_size", "2").train()
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    assert [r["grad_norm"] for r in a] == [r["grad_norm"] for r in b]


def test_sdpa_kernel_comes_first_in_every_forward_and_backward_and_is_restored(tmp_path):
    """``[training] sdpa_kernel = "cudnn"``: SDPA's priority order has cuDNN first while each training forward and
    backward and the validation forward run (what CUDA's dispatch reads), torch's order otherwise; on this CPU,
    whose dispatch ignores the order, the losses are bitwise the default run's."""
    from torch.nn.attention import SDPBackend

    default = torch._C._get_sdp_priority_order()
    args = [
        "--training.steps",
        "2",
        "--training.local_batch_size",
        "2",
        "--validation.enable",
        "--validation.freq",
        "2",
    ]
    seen = []
    trainer = make_trainer(tmp_path / "cudnn", *args, "--training.sdpa_kernel", "cudnn")
    block = trainer.model.layers["0"]
    block.register_forward_pre_hook(lambda *_: seen.append(("forward", torch._C._get_sdp_priority_order()[0])))
    block.register_full_backward_pre_hook(lambda *_: seen.append(("backward", torch._C._get_sdp_priority_order()[0])))
    got = trainer.train()
    cudnn = int(SDPBackend.CUDNN_ATTENTION)
    assert seen == [("forward", cudnn), ("backward", cudnn)] * 2 + [("forward", cudnn)] * len(seen[4:]) and seen[4:]
    assert torch._C._get_sdp_priority_order() == default and default[0] != cudnn
    want = make_trainer(tmp_path / "auto", *args).train()
    assert [(r.get("loss"), r.get("val_loss")) for r in got] == [(r.get("loss"), r.get("val_loss")) for r in want]


def test_dumped_config_reproduces_run(tmp_path):
    cfg = load_config(TINY + ["--job.dump_folder", str(tmp_path / "a"), "--training.steps", "2"])
    from titanlite.config import dump_config

    dump_config(cfg, tmp_path / "config.toml")
    assert load_config(["--config", str(tmp_path / "config.toml")]) == cfg


def test_lr_follows_schedule(tmp_path):
    t = make_trainer(
        tmp_path,
        "--training.steps",
        "4",
        "--training.local_batch_size",
        "2",
        "--optimizer.lr",
        "1e-3",
        "--lr_scheduler.warmup_steps",
        "1",
        "--lr_scheduler.decay_type",
        "linear",
        "--lr_scheduler.min_lr_factor",
        "0",
    )
    lrs = [r["lr"] for r in t.train()]
    # warmup step 1 = 1/2; then a 3-step linear decay: 2/3, 1/3, 0
    assert lrs == pytest.approx([0.5e-3, 2e-3 / 3, 1e-3 / 3, 0.0])


def run_cli(*args, cwd=None):
    return run_python([sys.executable, "-m", "titanlite.train", *args], timeout=120, cwd=cwd)


def test_cli_help_lists_sections_and_keys():
    out = run_cli("--help")
    assert out.returncode == 0
    for needle in (
        "[training]",
        "--training.local_batch_size",
        "--optimizer.lr",
        "[lr_scheduler]",
        "--validation.freq",
        "n_layers",
    ):
        assert needle in out.stdout


def test_cli_bad_value_is_one_line_error(tmp_path):
    out = run_cli("--training.seq_len", "0", "--job.dump_folder", str(tmp_path))
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and "training.seq_len" in out.stderr
    assert "Traceback" not in out.stderr


def test_cli_trains_and_writes_config(tmp_path):
    out = run_cli(
        "--config",
        "train_configs/debug_model.toml",
        *TINY,
        "--training.steps",
        "3",
        "--lr_scheduler.warmup_steps",
        "1",
        "--job.dump_folder",
        str(tmp_path),
        "--validation.enable",
        "false",
        cwd=str(__import__("pathlib").Path(__file__).parents[2]),
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "tok/s" in out.stdout and "mfu" in out.stdout
    assert (tmp_path / "config.toml").exists() and (tmp_path / "metrics.jsonl").exists()
    # the dumped config runs again as-is
    cfg = load_config(["--config", str(tmp_path / "config.toml")])
    assert cfg.training.steps == 3 and cfg.model.overrides["n_layers"] == 2


def test_repeated_validation_reads_the_same_windows(tmp_path):
    val = tmp_path / "val.jsonl"
    val.write_text("\n".join(json.dumps({"text": f"held-out document {i} " * 30}) for i in range(30)))
    t = make_trainer(
        tmp_path / "run",
        "--training.local_batch_size",
        "2",
        "--validation.enable",
        "true",
        "--validation.dataset",
        "text",
        "--validation.dataset_path",
        str(val),
        "--validation.steps",
        "-1",
    )
    first, second = t.validate()["val_loss"], t.validate()["val_loss"]
    assert first == second and first == first  # equal and not NaN


def test_deterministic_sets_the_cublas_workspace_before_any_matmul(monkeypatch):
    """torch refuses deterministic CUDA matmuls unless CUBLAS_WORKSPACE_CONFIG is set before cuBLAS's
    first use; set_seed(deterministic=True) sets it (keeping a value the user chose)."""
    from titanlite.trainer.trainer import set_seed

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    try:
        set_seed(0, deterministic=True)
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8" and torch.are_deterministic_algorithms_enabled()
        monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
        set_seed(0, deterministic=True)
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
    finally:
        torch.use_deterministic_algorithms(False)


@pytest.mark.parametrize(
    "args, culprit",
    [
        (["--model.vocab_size", "2e9"], "vocabulary 2,000,000,000"),  # torch's allocation failed with a traceback
        (["--training.local_batch_size", "9223372036854775807", "--training.global_batch_size", "-1"], "9,223,372"),
    ],
    ids=["vocab", "batch"],
)
def test_absurd_sizes_are_refused_before_allocating(tmp_path, capsys, args, culprit):
    """The planner's per-device memory estimate against this machine's memory, before the model or any batch
    exists (a 2**63 - 1 batch grew the process until the kernel killed it)."""
    from titanlite.train import main

    with pytest.raises(SystemExit) as e:
        main(TINY + ["--job.dump_folder", str(tmp_path), *args])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1, err
    assert "this run needs about" in err[0] and "per cpu device" in err[0] and culprit in err[0], err[0]

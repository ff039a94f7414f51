"""Expert parallelism against one process (CPU, gloo): parity, checkpoints across layouts, SIGKILL.

The model is a tiny ``llama3_moe`` (the parity harness' Llama: dim 64, 2 blocks, 4 heads / 2 kv heads;
both blocks MoE: 4 experts of hidden 32, top-2, one shared expert) with every balancing term on: a
batch-level aux loss (0.01), the router z-loss (0.001) and the aux-loss-free bias (rate 0.01, large
enough to move the routing within the 10 steps). Every run starts from the single-process run's
initial weights and reads the same data as in ``tests/test_parallel_parity.py`` (whose harness and
tolerance are reused: loss, grad norm and validation loss within ``RTOL = 2e-5`` relative).

Launches (each bounded by a timeout): 2 processes (EP 2, whose step-5 checkpoint then resumes under
FSDP 2 in the same launch); 4 processes (EP 2 x FSDP 2: dp_shard 4 split 2 x 2; PP 2 x EP 2); 2
processes killed by SIGKILL at step 7 under EP 2 and 2 more resuming them. In this process: the
single-process reference and the resume of the EP 2 checkpoint on one process.
"""

from __future__ import annotations

import copy
import os
import shutil
import signal
from pathlib import Path

import pytest
import torch
from dist_utils import cache_token_stores, run_workers
from test_parallel_parity import RTOL, STEPS, TINY, RecordingTrainer, check, check_data

from titanlite.hooks import Hook
from titanlite.models import load_config

MOE = [
    "--model.name",
    "llama3_moe",
    "--model.flavor",
    "debugmodel",
    "--model.n_dense_layers",
    "0",
    "--model.moe_num_experts",
    "4",
    "--model.moe_hidden_dim",
    "32",
    "--model.moe_aux_loss_coef",
    "0.01",
    "--model.moe_aux_loss_level",
    "batch",
    "--model.moe_z_loss_coef",
    "0.001",
    "--model.moe_bias_update_rate",
    "0.01",
]
CKPT = ["--checkpoint.enable", "--checkpoint.interval", "5", "--checkpoint.keep_latest_k", "0"]
CKPT += ["--checkpoint.last_save_model_only", "false"]
EP2 = ["--parallelism.data_parallel_shard_degree", "2", "--parallelism.expert_parallel_degree", "2"]
TWO_PROC = {"ep2": (2, EP2 + CKPT)}
FOUR_PROC = {
    "ep2_fsdp2": (4, ["--parallelism.data_parallel_shard_degree", "4", "--parallelism.expert_parallel_degree", "2"]),
    "pp2_ep2": (2, ["--parallelism.pipeline_parallel_degree", "2", *EP2]),
}

pytestmark = pytest.mark.usefixtures("one_thread")


def moe_config(dump: str, dp: int, extra: list[str]):
    return load_config(MOE + TINY + ["--job.dump_folder", dump, "--training.local_batch_size", str(8 // dp)] + extra)


def biases(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items() if k.endswith("expert_bias")}


def run(cfg, seed_state, kill_at: int | None = None) -> dict:
    """Train ``cfg`` from ``seed_state`` (rank 0's); the logged records, final biases, first inputs."""
    from titanlite.parallel.state_dict import load_full_state_dict

    trainer = RecordingTrainer(cfg)
    load_full_state_dict(trainer.model, seed_state)
    if kill_at is not None:
        trainer.hooks.append(KillAt(kill_at))
    records = trainer.train()
    steps = [r for r in records if "loss" in r]
    return {
        "loss": [r["loss"] for r in steps],
        "grad_norm": [r["grad_norm"] for r in steps],
        "val_loss": [r["val_loss"] for r in records if "val_loss" in r],
        "val_bpb": [r["val_bpb"] for r in records if "val_bpb" in r],
        "load": [r["moe/load_max_mean"] for r in steps],
        "inputs": torch.cat(trainer.first_step_inputs) if trainer.first_step_inputs else None,
        "dp_rank": trainer.dp_rank,
        "biases": biases(trainer.model),
    }


class KillAt(Hook):
    """SIGKILL rank 0 right after step ``step`` (its checkpoint, if any, not waited for)."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, state, result) -> None:
        if state.step == self.step and int(os.environ.get("RANK", "0")) == 0:
            os.kill(os.getpid(), signal.SIGKILL)


def worker(args: dict) -> dict:
    cache_token_stores()
    out = {}
    for name, (dp, extra) in args["configs"].items():
        dump = str(Path(args["dump"]) / name)
        out[name] = run(moe_config(dump, dp, extra), args["seed"], args.get("kill_at"))
    for name, (dp, extra, source) in args.get("resume", {}).items():  # from a copy of another run's step 5
        dump = Path(args["dump"]) / name
        if int(os.environ["RANK"]) == 0:
            resume_copy(Path(args["dump"]) / source, dump)
        torch.distributed.barrier()
        out[name] = run(moe_config(str(dump), dp, extra), args["seed"])
    return out


def resume_copy(source: Path, dest: Path, step: int = 5) -> None:
    (dest / "checkpoint").mkdir(parents=True)
    shutil.copytree(source / "checkpoint" / f"step-{step}", dest / "checkpoint" / f"step-{step}")
    lines = (source / "metrics.jsonl").read_text().splitlines(keepends=True)
    (dest / "metrics.jsonl").write_text("".join(lines[:step]))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    cache_token_stores()
    dump = tmp_path_factory.mktemp("moe")
    single = RecordingTrainer(moe_config(str(dump / "single"), 1, CKPT))
    seed = copy.deepcopy(single.model.state_dict())
    return {"seed": seed, "fp32": run_seeded(single, seed), "dump": dump}


def run_seeded(trainer, seed) -> dict:
    records = trainer.train()
    steps = [r for r in records if "loss" in r]
    return {
        "loss": [r["loss"] for r in steps],
        "grad_norm": [r["grad_norm"] for r in steps],
        "val_loss": [r["val_loss"] for r in records if "val_loss" in r],
        "val_bpb": [r["val_bpb"] for r in records if "val_bpb" in r],
        "load": [r["moe/load_max_mean"] for r in steps],
        "inputs": torch.cat(trainer.first_step_inputs),
        "biases": biases(trainer.model),
    }


def compare(name: str, results: list[dict], ref: dict, peers: int, report: list) -> None:
    for r in results[1:]:
        assert r[name]["loss"] == results[0][name]["loss"], f"{name}: ranks disagree on the loss"
        for k, v in r[name]["biases"].items():  # the aux-loss-free bias: identical on every rank
            assert torch.equal(v, results[0][name]["biases"][k]), (name, k)
    rtols = {"loss": RTOL, "grad_norm": RTOL, "val_loss": RTOL, "val_bpb": RTOL}
    check(name, results[0][name], ref, rtols, report)
    check_data(name, results, peers, ref["inputs"])
    for k, v in results[0][name]["biases"].items():
        assert v.abs().sum() > 0 and torch.allclose(v, ref["biases"][k], atol=1e-6), (name, k)


@pytest.mark.multiprocess
def test_expert_parallel_two_processes_and_resume(reference, tmp_path):
    """EP 2 = one process (losses, grad norms, aux loss and bias updates); its step-5 checkpoint resumes under
    FSDP 2 (same launch) and on one process (here), both continuing the single-process curve."""
    args = {"configs": TWO_PROC, "seed": reference["seed"], "dump": str(tmp_path)}
    args["resume"] = {"fsdp2_from_ep2": (2, ["--parallelism.data_parallel_shard_degree", "2", *CKPT], "ep2")}
    results = run_workers(worker, 2, args, timeout=300)
    report = []
    compare("ep2", results, reference["fp32"], 1, report)
    ref = reference["fp32"]
    resumed = results[0]["fsdp2_from_ep2"]
    for key in ("loss", "grad_norm"):
        got = torch.tensor(resumed[key], dtype=torch.float64)
        want = torch.tensor(ref[key][5:], dtype=torch.float64)
        rel = ((got - want).abs() / want.abs()).max().item()
        report.append(f"fsdp2 resumed from ep2 {key} max rel diff {rel:.2e}")
        assert len(got) == STEPS - 5 and rel <= RTOL, (key, got, want)
    # one process from the EP 2 step-5 checkpoint: the experts are loaded as stacked global tensors
    from titanlite.train import Trainer

    dump = tmp_path / "one_from_ep2"
    resume_copy(tmp_path / "ep2", dump)
    trainer = Trainer(moe_config(str(dump), 2, CKPT))  # local batch 4 (the EP ranks'), accumulated twice
    stored, resume = {}, trainer.resume
    trainer.resume = lambda: (resume(), stored.update(biases(trainer.model)))[0]
    records = [r for r in trainer.train() if "loss" in r]
    assert stored and all(v.abs().sum() > 0 for v in stored.values())  # the moved bias was saved at step 5
    for key in ("loss", "grad_norm"):
        got = torch.tensor([r[key] for r in records], dtype=torch.float64)
        want = torch.tensor(ref[key][5:], dtype=torch.float64)
        rel = ((got - want).abs() / want.abs()).max().item()
        report.append(f"one process resumed from ep2 {key} max rel diff {rel:.2e}")
        assert len(got) == STEPS - 5 and rel <= RTOL, (key, got, want)
    print("\n".join(report))

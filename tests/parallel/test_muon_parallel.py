"""Muon under every data and model parallelism equals Muon in one process (tests/helpers/parity.py's tiny run).

Each run starts from the one-process run's seed weights and trains 6 steps with ``[optimizer] name = "muon"`` and
an fp32 Newton-Schulz (``ns_dtype = "float32"``: a bf16 one rounds the layouts' fp32 differences, a few ulps, to bf16
ulps). Compared with one process: every step's loss and grad norm, the validation losses, and the final weights
(each tensor's difference in norm relative to its norm), within ``RTOL = 1e-5``. Measured on CPU/gloo:
see the report each test prints.

Launches (each bounded by a timeout): 2 processes (FSDP 2 with a checkpoint at step 3, TP 2, then EP 2 on the debug
MoE), 4 processes (FSDP 4, HSDP 2 x 2, FSDP 2 x TP 2, then FSDP 4 resuming a copy of FSDP 2's step-3 checkpoint);
in this process: the one-process references and one process resuming that checkpoint. A resumed run's steps 4-6
equal the uninterrupted one-process run's.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import torch

from tests.helpers.checkpoint_runs import resume_copy
from tests.helpers.dist import cache_token_stores, run_workers
from tests.helpers.parity import HALF, STEPS, TINY, RecordingTrainer, check, check_data

pytestmark = pytest.mark.usefixtures("one_thread")

RTOL = 1e-5
MUON = ["--optimizer.name", "muon", "--optimizer.ns_dtype", "float32", "--optimizer.lr", "1e-2"]
MOE = ["--model.name", "llama3_moe", "--model.flavor", "debugmodel", "--model.n_dense_layers", "0"]
MOE += ["--model.moe_num_experts", "4", "--model.moe_hidden_dim", "32"]
CKPT = ["--checkpoint.enable", "--checkpoint.interval", str(HALF), "--checkpoint.keep_latest_k", "0"]
CKPT += ["--checkpoint.last_save_model_only", "false"]


def shard(dp: int) -> list[str]:
    return ["--parallelism.data_parallel_shard_degree", str(dp)]


TP2 = ["--parallelism.tensor_parallel_degree", "2"]
HSDP = ["--parallelism.data_parallel_replicate_degree", "2", *shard(2)]
TWO_PROC = {
    "fsdp2": (2, [*shard(2), *CKPT]),
    "tp2": (1, TP2),
    "moe_ep2": (2, [*shard(2), "--parallelism.expert_parallel_degree", "2"]),
}
FOUR_PROC = {"fsdp4": (4, shard(4)), "hsdp2x2": (4, HSDP), "fsdp2_tp2": (2, [*shard(2), *TP2])}


def muon_config(dump: str, dp: int, extra: list[str], moe: bool = False):
    from titanlite.models import load_config

    base = [*(MOE if moe else []), *TINY, *MUON, "--job.dump_folder", dump]
    return load_config(base + ["--training.local_batch_size", str(8 // dp), *extra])


def full_weights(model) -> dict[str, torch.Tensor]:
    return {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in model.state_dict().items()
    }


def run(cfg, seed=None, trainer=None) -> dict:
    """Train ``cfg`` from the ``seed`` weights (or ``trainer`` as built); the logged values and final weights."""
    from titanlite.parallel.state_dict import load_full_state_dict

    if trainer is None:
        trainer = RecordingTrainer(cfg)
        if seed is not None:
            load_full_state_dict(trainer.model, seed)
    records = trainer.train()
    steps = [r for r in records if "loss" in r]
    out = {key: [r[key] for r in steps] for key in ("loss", "grad_norm")}
    out.update({key: [r[key] for r in records if key in r] for key in ("val_loss", "val_bpb")})
    out["inputs"] = torch.cat(trainer.first_step_inputs) if trainer.first_step_inputs else None
    out["dp_rank"], out["weights"] = trainer.dp_rank, full_weights(trainer.model)
    return out


def worker(args: dict) -> dict:
    cache_token_stores()
    out, rank = {}, int(os.environ["RANK"])
    for name, (dp, extra) in args["configs"].items():
        moe = name.startswith("moe")
        cfg = muon_config(str(Path(args["dump"]) / name), dp, extra, moe)
        out[name] = run(cfg, args["seeds"]["moe" if moe else "dense"])
    for name, (dp, extra, source) in args.get("resume", {}).items():
        dump = Path(args["dump"]) / name
        if rank == 0:
            resume_copy(Path(source), dump, step=HALF)
        torch.distributed.barrier()
        out[name] = run(muon_config(str(dump), dp, extra))
    if rank:  # every rank logs the same values; the weights come back from rank 0 only
        out = {k: {**v, "weights": None} for k, v in out.items()}
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process, dense (with checkpoints) and MoE, and their seed weights."""
    cache_token_stores()
    dump = tmp_path_factory.mktemp("muon")
    dense = RecordingTrainer(muon_config(str(dump / "one"), 1, CKPT))
    moe = RecordingTrainer(muon_config(str(dump / "one_moe"), 1, [], moe=True))
    seeds = {"dense": copy.deepcopy(dense.model.state_dict()), "moe": copy.deepcopy(moe.model.state_dict())}
    return {"dense": run(None, trainer=dense), "moe": run(None, trainer=moe), "seeds": seeds, "dump": dump}


def compare(name: str, results: list[dict], ref: dict, tp: int, report: list) -> None:
    """Losses, grad norms and validation as one process, the same batches, and the final weights."""
    for r in results:
        assert r[name]["loss"] == results[0][name]["loss"], f"{name}: ranks disagree on the loss"
    check(name, results[0][name], ref, {k: RTOL for k in ("loss", "grad_norm", "val_loss", "val_bpb")}, report)
    check_data(name, results, tp, ref["inputs"])
    compare_weights(name, results[0][name]["weights"], ref["weights"], report)


def compare_weights(name: str, got: dict, want: dict, report: list) -> None:
    assert got.keys() == want.keys()
    rels = {k: ((got[k] - want[k]).norm() / want[k].norm()).item() for k in want}
    worst = max(rels, key=rels.get)
    rel = rels[worst]
    report.append(f"{name:22s} weights   max rel diff {rel:.2e} (tolerance {RTOL:.0e}, {worst})")
    top = sorted(rels.items(), key=lambda kv: -kv[1])[:4]
    assert rel <= RTOL, f"{name}: final weights differ from one process by {rel:.2e}: {top}"


def check_continues(name: str, got: dict, ref: dict, report: list) -> None:
    """Steps HALF + 1 to STEPS of a run resumed from a step-HALF checkpoint continue the uninterrupted curve."""
    for key in ("loss", "grad_norm"):
        a, b = torch.tensor(got[key], dtype=torch.float64), torch.tensor(ref[key][HALF:], dtype=torch.float64)
        assert len(a) == STEPS - HALF, (name, key, a)
        rel = ((a - b).abs() / b.abs()).max().item()
        report.append(f"{name:22s} {key:9s} max rel diff {rel:.2e} (steps {HALF + 1}-{STEPS})")
        assert rel <= RTOL, (name, key, a, b)
    compare_weights(name, got["weights"], ref["weights"], report)


@pytest.fixture(scope="module")
def two_proc(reference, tmp_path_factory):
    dump = tmp_path_factory.mktemp("muon2")
    args = {"configs": TWO_PROC, "seeds": reference["seeds"], "dump": str(dump)}
    return run_workers(worker, 2, args, timeout=300), dump


@pytest.mark.multiprocess
def test_muon_two_processes_equal_one_process(reference, two_proc):
    """FSDP 2, TP 2 and EP 2 (the debug MoE, experts orthogonalized where they live)."""
    results, _ = two_proc
    report = []
    compare("fsdp2", results, reference["dense"], 1, report)
    compare("tp2", results, reference["dense"], 2, report)
    compare("moe_ep2", results, reference["moe"], 1, report)
    print("\n".join(report))


@pytest.mark.multiprocess
def test_muon_four_processes_equal_one_process_and_resume(reference, two_proc):
    """FSDP 4, HSDP 2 x 2, FSDP 2 x TP 2; FSDP 2's step-HALF checkpoint resumed under FSDP 4 continues the curve."""
    dump = two_proc[1]
    args = {"configs": FOUR_PROC, "seeds": reference["seeds"], "dump": str(dump)}
    args["resume"] = {"fsdp4_from_fsdp2": (4, [*shard(4), *CKPT], str(dump / "fsdp2"))}
    results = run_workers(worker, 4, args, timeout=300)
    report = []
    for name, (dp, _) in FOUR_PROC.items():
        compare(name, results, reference["dense"], 4 // dp, report)
    check_continues("fsdp4 from fsdp2", results[0]["fsdp4_from_fsdp2"], reference["dense"], report)
    print("\n".join(report))


def test_muon_fsdp2_checkpoint_resumes_on_one_process(reference, two_proc, tmp_path):
    """FSDP 2's step-HALF checkpoint (its momentum buffers resharded to whole tensors) continues the curve here."""
    cache_token_stores()
    resume_copy(two_proc[1] / "fsdp2", tmp_path / "one", step=HALF)
    report = []
    got = run(muon_config(str(tmp_path / "one"), 2, CKPT))  # local batch 4 accumulated twice: the saved data split
    check_continues("one from fsdp2", got, reference["dense"], report)
    print("\n".join(report))

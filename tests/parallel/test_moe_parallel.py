"""Expert parallelism against one process (CPU, gloo): parity, checkpoints across layouts, SIGKILL.

The model is a tiny ``llama3_moe`` (the parity harness' Llama: dim 64, 2 blocks, 4 heads / 2 kv heads;
both blocks MoE: 4 experts of hidden 32, top-2, one shared expert) with every balancing term on: a
batch-level aux loss (0.01), the router z-loss (0.001) and the aux-loss-free bias (rate 0.01, large
enough to move the routing within the 10 steps). Every run starts from the single-process run's
initial weights and reads the same data as in ``tests/parallel/test_parallel_parity.py`` (whose harness and
tolerance are reused: loss, grad norm and validation loss within ``RTOL = 2e-5`` relative).

Launches (each bounded by a timeout): 2 processes (EP 2, then TP 2 with the MoE layers replicated over
the TP ranks, then FSDP 2 resuming a copy of EP 2's step-5 checkpoint); 4 processes (EP 2 x FSDP 2,
dp_shard 4 split 2 x 2, with full AC; PP 2 x EP 2; EP 2 x TP 2; Qwen3-MoE under EP 2 x TP 2; CP 2 x EP 2, whose
final weights are compared too); 2 processes
killed by SIGKILL at step 7 under EP 2 and 2 more resuming them. In this process: the single-process
references (llama3_moe with a batch-level and with a sequence-level aux loss, Qwen3-MoE) and the resume of
the EP 2 checkpoint on one process.

PP 2 x EP 2 is compared with a sequence-level aux loss: a batch-level one counts each forward pass, and
under PP that is a pipeline microbatch. This comparison found that torch's pipeline shape inference (a
real forward of one microbatch at the first step) was counted in the expert loads, which changed the
first bias update: ``titanlite.trainer.pipeline_runner._Stage`` now turns the statistics off for it.
"""

from __future__ import annotations

import copy
import json
import os
import signal
from pathlib import Path

import pytest
import torch

from tests.helpers.checkpoint_runs import resume_copy
from tests.helpers.dist import cache_token_stores, run_workers
from tests.helpers.parity import RTOL, TINY, RecordingTrainer, check, check_data
from titanlite.models import load_config
from titanlite.trainer.hooks import Hook

BALANCE = [
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
MOE = ["--model.name", "llama3_moe", "--model.flavor", "debugmodel", "--model.n_dense_layers", "0", *BALANCE]
# Qwen3-MoE (its debug placement: block 0 dense, block 1 MoE), with Qwen3's TP plan (QK-norm) around the MoE
QWEN3_MOE = ["--job.extensions", "torchtitan_ext.qwen3_moe", "--model.name", "qwen3_moe"]
QWEN3_MOE += ["--model.flavor", "debugmodel", "--model.head_dim", "32", "--model.ffn_hidden_dim", "128", *BALANCE]
SEQ = ["--model.moe_aux_loss_level", "seq"]
# 10 steps, not the parity harness' 6: the bias moves by +-rate per step, and in 6 steps a block's bias came back
# to exactly 0 (alternating signs), which the comparison cannot tell from a bias never updated
STEPS = 10
LONGER = ["--training.steps", str(STEPS), "--validation.freq", str(STEPS // 2)]
CKPT = ["--checkpoint.enable", "--checkpoint.interval", "5", "--checkpoint.keep_latest_k", "0"]
CKPT += ["--checkpoint.last_save_model_only", "false"]
EP2 = ["--parallelism.data_parallel_shard_degree", "2", "--parallelism.expert_parallel_degree", "2"]
TP2 = ["--parallelism.tensor_parallel_degree", "2"]
TWO_PROC = {"ep2": (2, EP2 + CKPT), "tp2": (1, TP2)}  # TP 2: attention sharded, MoE layers replicated
FOUR_PROC = {
    # + full AC: each block's forward (its all-to-alls too) runs again in backward, counting its loads twice
    "ep2_fsdp2_ac": (
        4,
        [
            "--parallelism.data_parallel_shard_degree",
            "4",
            "--parallelism.expert_parallel_degree",
            "2",
            "--activation_checkpoint.mode",
            "full",
        ],
    ),
    # a batch-level aux loss counts each forward pass (here: each pipeline microbatch of two sequences): the
    # sequence-level one is the same whatever the pipeline cuts, so PP is compared under it
    "pp2_ep2_seq": (
        2,
        ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_microbatch_size", "2"]
        + [*EP2, *SEQ],
    ),
    "ep2_tp2": (2, [*EP2, *TP2]),
    "qwen3_moe_ep2_tp2": (2, [*EP2, *TP2]),
    # CP 2 x EP 2: dp_shard 2 is the expert group, the experts FSDP-sharded over the two CP ranks
    "cp2_ep2": (2, [*EP2, "--parallelism.context_parallel_degree", "2"]),
}

pytestmark = pytest.mark.usefixtures("one_thread")


def moe_config(dump: str, dp: int, extra: list[str], model: list[str] = MOE):
    return load_config(
        model + TINY + LONGER + ["--job.dump_folder", dump, "--training.local_batch_size", str(8 // dp)] + extra
    )


def model_of(name: str) -> list[str]:
    return QWEN3_MOE if name.startswith("qwen3_moe") else MOE


def biases(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items() if k.endswith("expert_bias")}


def run(cfg, seed_state=None, kill_at: int | None = None, trainer=None) -> dict:
    """Train ``cfg`` from ``seed_state`` (rank 0's; None: ``trainer``'s own start); the logged losses, grad
    norms, validation, loads, final biases, first inputs."""
    from titanlite.parallel.state_dict import load_full_state_dict

    if trainer is None:
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
        "weights": full_weights(trainer.model),
    }


def full_weights(model) -> dict[str, torch.Tensor]:
    """Every tensor of ``model``'s state as a whole tensor (a DTensor gathered: every rank calls this)."""
    return {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in model.state_dict().items()
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
        seed = args["seeds"]["qwen3_moe" if name.startswith("qwen3_moe") else "fp32"]
        out[name] = run(moe_config(dump, dp, extra, model_of(name)), seed, args.get("kill_at"))
    for name, (dp, extra, source) in args.get("resume", {}).items():  # from a copy of another run's step 5
        dump = Path(args["dump"]) / name
        if int(os.environ["RANK"]) == 0:
            resume_copy(Path(args["dump"]) / source, dump)
        torch.distributed.barrier()
        out[name] = run(moe_config(str(dump), dp, extra), args["seeds"]["fp32"])
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    cache_token_stores()
    dump = tmp_path_factory.mktemp("moe")
    single = RecordingTrainer(moe_config(str(dump / "single"), 1, CKPT))
    seed = copy.deepcopy(single.model.state_dict())
    out = {"seed": seed, "fp32": run(None, trainer=single), "dump": dump}
    out["seq"] = run(moe_config(str(dump / "seq"), 1, SEQ), seed)
    qwen = RecordingTrainer(moe_config(str(dump / "qwen3_moe"), 1, [], QWEN3_MOE))
    out["seeds"] = {"fp32": seed, "qwen3_moe": copy.deepcopy(qwen.model.state_dict())}
    out["qwen3_moe"] = run(None, trainer=qwen)
    return out


def compare(name: str, results: list[dict], ref: dict, peers: int, report: list) -> None:
    merged: dict[str, torch.Tensor] = {}  # a pipeline stage holds its own blocks' biases
    for r in results:
        assert r[name]["loss"] == results[0][name]["loss"], f"{name}: ranks disagree on the loss"
        for k, v in r[name]["biases"].items():  # the aux-loss-free bias: identical on every rank
            assert torch.equal(merged.setdefault(k, v), v), (name, k)
    rtols = {"loss": RTOL, "grad_norm": RTOL, "val_loss": RTOL, "val_bpb": RTOL}
    check(name, results[0][name], ref, rtols, report, steps=STEPS)
    check_data(name, results, peers, ref["inputs"])
    assert merged.keys() == ref["biases"].keys()
    for k, v in merged.items():
        diff = (v - ref["biases"][k]).abs().max().item()
        report.append(f"{name:22s} {k} moved {v.abs().max().item():.3f}, differs by {diff:.1e}")
        assert v.abs().sum() > 0 and diff <= 1e-6, (name, k)


@pytest.fixture(scope="module")
def ep2_run(reference, tmp_path_factory):
    """The 2-process launch: EP 2 from the seed (checkpoints at steps 5 and 10), then FSDP 2 resuming a copy
    of its step-5 checkpoint."""
    dump = tmp_path_factory.mktemp("ep2")
    args = {"configs": TWO_PROC, "seeds": reference["seeds"], "dump": str(dump)}
    args["resume"] = {"fsdp2_from_ep2": (2, ["--parallelism.data_parallel_shard_degree", "2", *CKPT], "ep2")}
    return run_workers(worker, 2, args, timeout=300), dump


def check_continues(name: str, got: dict, ref: dict, report: list) -> None:
    """Steps 6-10 of a run resumed from a step-5 checkpoint continue the one-process curve."""
    for key in ("loss", "grad_norm"):
        a = torch.tensor(got[key], dtype=torch.float64)
        b = torch.tensor(ref[key][5:], dtype=torch.float64)
        assert len(a) == STEPS - 5, (name, key, a)
        rel = ((a - b).abs() / b.abs()).max().item()
        report.append(f"{name:22s} {key:9s} max rel diff {rel:.2e} (steps 6-10)")
        assert rel <= RTOL, (name, key, a, b)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_expert_parallel_matches_one_process_and_resumes_under_fsdp(reference, ep2_run):
    """EP 2 = one process (losses, grad norms, validation; aux/z losses and bias updates on, the bias identical
    on both ranks and equal to one process's); its step-5 checkpoint resumed under FSDP 2 continues the curve."""
    results, _ = ep2_run
    report = []
    compare("ep2", results, reference["fp32"], 1, report)
    compare("tp2", results, reference["fp32"], 2, report)
    check_continues("fsdp2 from ep2", results[0]["fsdp2_from_ep2"], reference["fp32"], report)
    print("\n".join(report))


@pytest.mark.slow  # its fixture launches the EP 2 run
def test_expert_parallel_checkpoint_resumes_on_one_process(reference, ep2_run, tmp_path):
    """The EP 2 step-5 checkpoint (experts saved as stacked global tensors, the moved biases included) resumed
    by one process (local batch 4, accumulated twice) continues the one-process curve."""
    from titanlite.trainer import Trainer

    cache_token_stores()
    dump = tmp_path / "one_from_ep2"
    resume_copy(ep2_run[1] / "ep2", dump)
    trainer = Trainer(moe_config(str(dump), 2, CKPT))
    restored, resume = {}, trainer.resume
    trainer.resume = lambda: (resume(), restored.update(biases(trainer.model)))[0]
    records = [r for r in trainer.train() if "loss" in r]
    assert restored and all(v.abs().sum() > 0 for v in restored.values())  # the moved biases came back
    report = []
    check_continues(
        "one process from ep2", {k: [r[k] for r in records] for k in ("loss", "grad_norm")}, reference["fp32"], report
    )
    print("\n".join(report))


@pytest.mark.slow
@pytest.mark.multiprocess
def test_sigkill_under_expert_parallelism_resumes_bitwise(reference, ep2_run, tmp_path):
    """EP 2 killed (SIGKILL, rank 0) after step 7, then rerun: it resumes from step 5 and every logged record
    of steps 1-10 (losses, grad norms, MoE loads and aux losses) equals the uninterrupted EP 2 run's."""
    args = {"configs": {"ep2": TWO_PROC["ep2"]}, "seeds": reference["seeds"], "dump": str(tmp_path), "kill_at": 7}
    with pytest.raises(AssertionError, match="exited with -9"):
        run_workers(worker, 2, args, timeout=300)
    run_workers(worker, 2, {**args, "kill_at": None}, timeout=300)
    timing = {"tokens_per_s", "tokens_per_s_global", "mfu", "data_wait_frac", "eta_s"}
    got, want = (metrics(d / "ep2") for d in (tmp_path, ep2_run[1]))
    assert [r["step"] for r in got] == [r["step"] for r in want]  # each step once (+ validation records)
    assert sorted({r["step"] for r in got}) == list(range(1, STEPS + 1))
    for a, b in zip(got, want):
        assert {k: v for k, v in a.items() if k not in timing and "mem" not in k} == {
            k: v for k, v in b.items() if k not in timing and "mem" not in k
        }, a["step"]


def metrics(dump: Path) -> list[dict]:
    return [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_expert_parallel_four_processes(reference, tmp_path):
    """EP 2 x FSDP 2 (dp_shard 4 = 2 x 2: experts sharded over ep, and FSDP-sharded over the other 2),
    PP 2 x EP 2 (each stage's MoE block expert-parallel over its 2 data-parallel ranks), EP 2 x TP 2 and CP 2 x
    EP 2 (experts FSDP-sharded over the CP ranks; final weights too) = one process."""
    args = {"configs": FOUR_PROC, "seeds": reference["seeds"], "dump": str(tmp_path)}
    results = run_workers(worker, 4, args, timeout=360)
    report = []
    for name, (dp, _) in FOUR_PROC.items():
        ref = reference["seq" if name.endswith("_seq") else "qwen3_moe" if name.startswith("qwen3") else "fp32"]
        compare(name, results, ref, 4 // dp, report)
    check_weights("cp2_ep2", results[-1]["cp2_ep2"]["weights"], reference["fp32"]["weights"], report)
    print("\n".join(report))


def check_weights(name: str, got: dict, ref: dict, report: list) -> None:
    """Final weights within ``RTOL`` of one process's, by each tensor's norm (Adam moves an element whose gradient
    is near 0 by up to the learning rate on a summation-order difference)."""
    assert got.keys() == ref.keys(), name
    worst = max(((got[k] - ref[k]).norm() / ref[k].norm().clamp_min(1e-12)).item() for k in ref)
    report.append(f"{name:22s} weights   max rel diff {worst:.2e} (of a tensor's norm)")
    assert worst <= RTOL, f"{name}: final weights differ from one process by {worst:.2e}"

"""Numerical parity of every parallelism against one process (CPU, gloo; NCCL too where GPUs exist).

Every run starts from the same *seed* weights (the single-process Trainer's initial state dict,
loaded into the sharded model with ``load_full_state_dict``) and reads the same data, and trains
6 optimizer steps of a tiny Llama (dim 64, 2 layers, 4 heads / 2 kv heads, seq_len 32, byte
vocabulary 512) with a global batch of 8 sequences. The logged loss and grad norm of each step
are compared with the single-process run's.

Data: the loader gives rank r of D data-parallel ranks the windows ``perm[pos + r]`` with a global
cursor, so one process with a batch of 8 reads windows perm[0..7] and 2 ranks with 4 each read
perm[0,2,4,6] / perm[1,3,5,7]: the same *set* per optimizer step, and since the loss is a sum over
the step's tokens divided by the global token count, the same loss up to summation order.
:func:`test_data_parallel_ranks_cover_the_single_process_batch` checks this directly, and every
multi-process run also checks that the TP ranks of one DP rank see identical batches and that the
DP ranks together see exactly the single-process batch.

Tolerances (relative, on the logged loss, grad norm and final validation loss):

- ``RTOL = 2e-5`` for every eager configuration: all runs are fp32 and differ only in summation
  order (reduce-scatter/all-reduce of per-rank partial sums, K-split matmuls under TP, the
  loss-parallel log-sum-exp), each a few fp32 ulps (~1e-7 relative) per step, which Adam and 6
  steps amplify a little. Measured on CPU/gloo: loss <= 1.6e-7, grad norm <= 4.0e-6, validation
  loss <= 8e-8. Real errors are far larger: averaging instead of summing gradients over 2 ranks
  halves every logged grad norm (Adam itself is nearly scale-invariant, which is why the grad
  norm is compared too), a missed or doubled TP reduction changes the step-1 grad norm by tens of
  percent, and wrong data is caught by the explicit data checks below.
- ``RTOL_COMPILE = 2e-4`` for torch.compile with inductor (on NCCL): inductor fuses and reorders element-wise ops
  and reductions (RMSNorm, SiLU, RoPE, softmax) and may contract to FMA, so differences can exceed the eager ones;
  on this CPU they measured the same as eager (<= 2.3e-6). On gloo the compiled run uses the ``aot_eager`` backend:
  Dynamo and AOTAutograd trace the DTensor graphs (TP collectives, loss parallel, the AC higher-order op) exactly as
  for inductor, and eager kernels run them, so ``RTOL`` holds. Inductor's CPU code generation is checked by the
  single-process tests (tests/trainer/test_output_loss.py).
- float8 on FSDP x TP against float8 in one process: ``RTOL_FLOAT8 = 2e-3`` (loss, validation
  loss) and ``RTOL_FLOAT8_GRAD_NORM = 2e-2``. The scales are the same global amaxes, but an fp32
  difference of one ulp in an operand (from the different summation order) can flip a float8
  rounding, a 2^-4 (e4m3) or 2^-3 (e5m2, gradients) relative step, for some elements, and these
  flips compound over the steps. Measured: loss 2.5e-4, grad norm 7.3e-4.
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests.helpers.dist import backends, cache_token_stores, run_workers
from tests.helpers.parity import RTOL, RecordingTrainer, check, check_data, make_config
from titanlite.trainer import Trainer

RTOL_COMPILE = 2e-4
RTOL_FLOAT8 = 2e-3
RTOL_FLOAT8_GRAD_NORM = 2e-2

# name -> (data-parallel degree, extra options); each group runs in one multi-process launch
TWO_PROC = {
    "fsdp2": (2, ["--parallelism.data_parallel_shard_degree", "2"]),
    "tp2": (1, ["--parallelism.tensor_parallel_degree", "2"]),
    "tp2_no_loss_parallel": (
        1,
        ["--parallelism.tensor_parallel_degree", "2", "--parallelism.enable_loss_parallel", "false"],
    ),
    "fsdp2_ac_full": (2, ["--parallelism.data_parallel_shard_degree", "2", "--activation_checkpoint.mode", "full"]),
    "fsdp2_ac_op": (
        2,
        [
            "--parallelism.data_parallel_shard_degree",
            "2",
            "--activation_checkpoint.mode",
            "selective",
            "--activation_checkpoint.selective_ac_option",
            "op",
        ],
    ),
    "fsdp2_ac_every2": (
        2,
        [
            "--parallelism.data_parallel_shard_degree",
            "2",
            "--activation_checkpoint.mode",
            "selective",
            "--activation_checkpoint.selective_ac_option",
            "2",
        ],
    ),
    "tp2_ac_op": (1, ["--parallelism.tensor_parallel_degree", "2", "--activation_checkpoint.mode", "selective"]),
    # gradient accumulation under FSDP (2 micro-batches of 2 per rank): same step, same validation set
    "fsdp2_accum2": (2, ["--parallelism.data_parallel_shard_degree", "2", "--training.local_batch_size", "2"]),
    "fsdp2_reshard_never": (
        2,
        ["--parallelism.data_parallel_shard_degree", "2", "--parallelism.fsdp_reshard_after_forward", "never"],
    ),
    # compile (model + loss) with TP collectives and loss parallel inside the graphs, per-op AC traced as a
    # higher-order op. On two ranks, not FSDP 2 x TP 2's four: each rank compiles its own graphs, and FSDP's hooks
    # stay outside the graphs either way. No validation, whose no-grad graphs would be compiled as well.
    "tp2_compile_ac_op": (
        1,
        [
            "--parallelism.tensor_parallel_degree",
            "2",
            "--compile.enable",
            "true",
            "--activation_checkpoint.mode",
            "selective",
            "--validation.enable",
            "false",
        ],
    ),
}
FOUR_PROC = {
    "fsdp2_tp2": (2, ["--parallelism.data_parallel_shard_degree", "2", "--parallelism.tensor_parallel_degree", "2"]),
    "hsdp2x2": (
        4,
        ["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "2"],
    ),
    "hsdp2_tp2": (
        2,
        ["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.tensor_parallel_degree", "2"],
    ),
    # tied embedding/output (as Llama 3.2 1B/3B): one DTensor shared by the vocab-sharded embedding
    # and output under TP, one FSDP group (the root's)
    "tied_fsdp2_tp2": (
        2,
        [
            "--parallelism.data_parallel_shard_degree",
            "2",
            "--parallelism.tensor_parallel_degree",
            "2",
            "--model.tie_word_embeddings",
            "true",
        ],
    ),
    "float8_fsdp2_tp2": (
        2,
        [
            "--parallelism.data_parallel_shard_degree",
            "2",
            "--parallelism.tensor_parallel_degree",
            "2",
            "--quantize.linear.float8.enable",
            "true",
        ],
    ),
}


def ref_key(name: str) -> str:
    """Which single-process run a configuration is compared with (and starts from)."""
    return "float8" if name.startswith("float8") else "tied" if name.startswith("tied") else "fp32"


def train_from_seed(cfg, seed_state) -> dict:
    """Train ``cfg`` from ``seed_state`` (needed on rank 0 only); losses, grad norms, first inputs."""
    import time

    from torch._dynamo.utils import counters

    from titanlite.parallel.state_dict import load_full_state_dict

    start, graphs = time.perf_counter(), counters["stats"]["unique_graphs"]
    trainer = RecordingTrainer(cfg)
    params_before = [id(p) for p in trainer.model.parameters()]
    load_full_state_dict(trainer.model, seed_state)
    assert [id(p) for p in trainer.model.parameters()] == params_before  # the optimizer still holds them
    all_records = trainer.train()
    records = [r for r in all_records if "loss" in r]
    return {
        "loss": [r["loss"] for r in records],
        "grad_norm": [r["grad_norm"] for r in records],
        "val_loss": [r["val_loss"] for r in all_records if "val_loss" in r],
        "val_bpb": [r["val_bpb"] for r in all_records if "val_bpb" in r],
        "inputs": torch.cat(trainer.first_step_inputs),
        "dp_rank": trainer.dp_rank,
        "compiled_graphs": counters["stats"]["unique_graphs"] - graphs,
        "seconds": time.perf_counter() - start,
    }


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Single-process runs (fp32, and float8) and their common seed state dict."""
    cache_token_stores()
    dump = str(tmp_path_factory.mktemp("ref"))
    single = RecordingTrainer(make_config(dump, 1, []))
    seed = copy.deepcopy(single.model.state_dict())
    out = {"seed": seed}
    all_records = single.train()
    records = [r for r in all_records if "loss" in r]
    out["fp32"] = {
        "loss": [r["loss"] for r in records],
        "grad_norm": [r["grad_norm"] for r in records],
        "val_loss": [r["val_loss"] for r in all_records if "val_loss" in r],
        "val_bpb": [r["val_bpb"] for r in all_records if "val_bpb" in r],
        "inputs": torch.cat(single.first_step_inputs),
    }
    out["float8"] = train_from_seed(make_config(dump, 1, ["--quantize.linear.float8.enable", "true"]), seed)
    tied = RecordingTrainer(make_config(dump, 1, ["--model.tie_word_embeddings", "true"]))
    out["seeds"] = {"fp32": seed, "float8": seed, "tied": copy.deepcopy(tied.model.state_dict())}
    out["tied"] = train_from_seed(make_config(dump, 1, ["--model.tie_word_embeddings", "true"]), out["seeds"]["tied"])
    return out


def parity_worker(args: dict) -> dict:
    """Runs every configuration of ``args["configs"]`` on this rank, one after the other."""
    import tempfile

    cache_token_stores()
    results = {}
    for name, (dp, extra) in args["configs"].items():
        with tempfile.TemporaryDirectory() as dump:
            results[name] = train_from_seed(make_config(dump, dp, extra), args["seeds"][ref_key(name)])
    if "check_default_init" in args:  # weight_init=auto (rank0 on CPU) equals the one-process init
        with tempfile.TemporaryDirectory() as dump:
            dp, extra = args["check_default_init"]
            trainer = Trainer(make_config(dump, dp, extra))
            full = {
                k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in trainer.model.state_dict().items()
            }
            results["default_init"] = {k: v.cpu() for k, v in full.items()}
            dims = trainer.parallel_dims
            results["mesh"] = {
                "names": dims.mesh.mesh_dim_names,
                "shape": tuple(dims.mesh.shape),
                "dp_rank": trainer.dp_rank,
                "dp_size": dims.dp_mesh.size(),
                "tp_rank": dims.tp_mesh.get_local_rank(),
            }
    return results


def run_group(configs: dict, nprocs: int, backend: str, reference, extra_args=None) -> tuple[list, list]:
    compiler = "inductor" if backend == "nccl" else "aot_eager"
    configs = {name: (dp, [*a, "--compile.backend", compiler]) for name, (dp, a) in configs.items()}
    args = {"configs": configs, "seeds": reference["seeds"], **(extra_args or {})}
    results = run_workers(parity_worker, nprocs, args, backend=backend, timeout=240)
    report = []
    for name, (dp, _) in configs.items():
        for rank_res in results[1:]:  # every rank logs the same (global) values
            assert rank_res[name]["loss"] == results[0][name]["loss"], f"{name}: ranks disagree on the loss"
        ref = reference[ref_key(name)]
        if name.startswith("float8"):
            rtols = {"loss": RTOL_FLOAT8, "grad_norm": RTOL_FLOAT8_GRAD_NORM, "val_loss": RTOL_FLOAT8}
        else:
            compiled = "compile" in name
            rtol = RTOL_COMPILE if compiled and compiler == "inductor" else RTOL
            rtols = {"loss": rtol, "grad_norm": rtol} | ({} if compiled else {"val_loss": rtol, "val_bpb": rtol})
        check(name, results[0][name], ref, rtols, report)
        check_data(name, results, nprocs // dp, reference["fp32"]["inputs"])
        graphs = results[0][name]["compiled_graphs"]
        assert (graphs > 0) == ("compile" in name), f"{name}: {graphs} compiled graphs"
        report.append(f"{name:22s} ran in {results[0][name]['seconds']:.1f} s on rank 0")
    return results, report


@pytest.mark.multiprocess
@pytest.mark.parametrize("backend", backends(2))
def test_parity_two_processes(backend, reference):
    """FSDP 2, TP 2 (with and without loss parallel), each AC mode, FSDP reshard never, compiled TP 2 (+ AC)."""
    _, report = run_group(TWO_PROC, 2, backend, reference)
    print("\n".join(report))


@pytest.mark.multiprocess
@pytest.mark.parametrize("backend", backends(4))
def test_parity_four_processes(backend, reference):
    """FSDP 2 x TP 2, HSDP 2 x 2, HSDP 2 x TP 2, tied embeddings and float8 on FSDP 2 x TP 2; the mesh views,
    and the default (rank0) init equal to the one-process init."""
    results, report = run_group(FOUR_PROC, 4, backend, reference, {"check_default_init": FOUR_PROC["fsdp2_tp2"]})
    print("\n".join(report))
    for rank, res in enumerate(results):
        mesh = res["mesh"]
        assert mesh["names"] == ("pp", "dp_replicate", "dp_shard", "cp", "tp") and mesh["shape"] == (1, 1, 2, 1, 2)
        assert (mesh["dp_rank"], mesh["tp_rank"], mesh["dp_size"]) == (rank // 2, rank % 2, 2)
    # weight_init = auto -> rank0 on CPU: the sharded model starts from the one-process weights
    if backend == "gloo":
        init = results[0]["default_init"]
        assert set(init) == set(reference["seed"])
        for k, v in reference["seed"].items():
            assert torch.equal(init[k], v), k


def test_data_parallel_ranks_cover_the_single_process_batch():
    """The loader reasoning behind the parity tests, without processes: per step, 2 ranks x 4 windows
    are exactly the 8 windows one process reads (as a set), and a 4 x 2 split as well."""
    from titanlite.data.loader import build_dataloader

    store = torch.arange(100_000) % 509
    one = iter(build_dataloader(store, seq_len=32, batch_size=8, seed=5))
    splits = {
        d: [
            iter(build_dataloader(store, seq_len=32, batch_size=8 // d, dp_rank=r, dp_world=d, seed=5))
            for r in range(d)
        ]
        for d in (2, 4)
    }
    for _ in range(3):
        want = sorted(tuple(r.tolist()) for r in next(one)["input_ids"])
        for d, loaders in splits.items():
            got = sorted(tuple(r.tolist()) for it in loaders for r in next(it)["input_ids"])
            assert got == want, d

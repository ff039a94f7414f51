"""Pipeline parallelism: the split and its errors, parity with one process for every schedule and with
FSDP and TP, resumes across layouts, and the HF export of a pipelined checkpoint.

Parity runs reuse ``test_parallel_parity``'s harness (same seed weights, data and 6 steps) on a 4-block
tiny Llama, so that the interleaved and V schedules get one block per stage. Tolerance: ``RTOL = 2e-5``
relative on the loss, gradient norm and validation loss, as for the other layouts: the stages compute
each microbatch exactly as one process computes its rows, and only the summation order of the
microbatches' loss and gradient sums differs (measured below 1e-6, see the printed report). A loss not
shared with every stage, a gradient norm missing a stage, or gradients scaled by the microbatch count
all miss by far more (a missing stage's share of the norm is tens of percent).
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.dist import REPO, backends, cache_token_stores, run_workers
from tests.helpers.launch import run_python
from tests.helpers.parity import HALF, RTOL, STEPS, RecordingTrainer, check, check_data, make_config
from titanlite.models import load_config as parse_args
from titanlite.parallel.pipeline import PipelinePlan
from titanlite.parallel.pipeline_schedules import split_evenly

PP_MODEL = ["--model.n_layers", "4"]


def pp(schedule: str, *extra: str) -> list[str]:
    return [
        *PP_MODEL,
        "--parallelism.pipeline_parallel_degree",
        "2",
        "--parallelism.pipeline_parallel_schedule",
        schedule,
        *extra,
    ]


MB2 = ["--parallelism.pipeline_parallel_microbatch_size", "2"]  # fewer, larger microbatches: less per-op overhead
# name -> (data-parallel degree, options); local batch = 8 / dp sequences, microbatches of 2 unless set
TWO_PROC = {
    "pp2_gpipe": (1, pp("GPipe", *MB2)),
    "pp2_1f1b_mb1": (1, pp("1F1B")),  # 8 microbatches of 1
    "pp2_interleaved_1f1b": (1, pp("Interleaved1F1B", *MB2)),
    "pp2_interleaved_zb": (1, pp("InterleavedZeroBubble", *MB2)),
    "pp2_zbv": (1, pp("ZBVZeroBubble", *MB2)),
    "pp2_dualpipev": (1, pp("DualPipeV", *MB2)),
    "pp2_1f1b_ac_full": (1, pp("1F1B", "--activation_checkpoint.mode", "full", *MB2)),
    # gradient accumulation x PP: 2 schedule runs of 4 sequences (2 microbatches of 2) per optimizer step
    "pp2_1f1b_accum2": (
        1,
        pp("1F1B", "--training.local_batch_size", "4", "--parallelism.pipeline_parallel_microbatch_size", "2"),
    ),
}
FOUR_PROC = {
    "pp2_fsdp2": (2, pp("1F1B", "--parallelism.data_parallel_shard_degree", "2", *MB2)),
    "pp2_hsdp2": (2, pp("GPipe", "--parallelism.data_parallel_replicate_degree", "2", *MB2)),
    "pp2_tp2": (1, pp("1F1B", "--parallelism.tensor_parallel_degree", "2", *MB2)),
}


def pp_config(dump: str, dp: int, extra: list[str]):
    cfg = make_config(dump, dp, extra)
    local = [extra[i + 1] for i, a in enumerate(extra) if a == "--training.local_batch_size"]
    if local:  # make_config sets 8 / dp; an explicit value comes later and wins
        assert cfg.training.local_batch_size == int(local[-1])
    return cfg


def train_from_seed(cfg, seed_state) -> dict:
    from titanlite.parallel.state_dict import load_full_state_dict

    trainer = RecordingTrainer(cfg)
    load_full_state_dict(trainer.model, seed_state)
    records = trainer.train()
    steps = [r for r in records if "loss" in r]
    return {
        "loss": [r["loss"] for r in steps],
        "grad_norm": [r["grad_norm"] for r in steps],
        "val_loss": [r["val_loss"] for r in records if "val_loss" in r],
        "val_bpb": [r["val_bpb"] for r in records if "val_bpb" in r],
        "tokens_seen": [r["tokens_seen"] for r in steps],
        "inputs": torch.cat(trainer.first_step_inputs),
        "dp_rank": trainer.dp_rank,
        "stage_ids": getattr(trainer.model, "stage_ids", None),
        "keys": sorted(trainer.model.state_dict()),
    }


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    cache_token_stores()
    dump = str(tmp_path_factory.mktemp("ref"))
    single = RecordingTrainer(make_config(dump, 1, PP_MODEL))
    seed = copy.deepcopy(single.model.state_dict())
    records = single.train()
    steps = [r for r in records if "loss" in r]
    return {
        "seed": seed,
        "loss": [r["loss"] for r in steps],
        "grad_norm": [r["grad_norm"] for r in steps],
        "val_loss": [r["val_loss"] for r in records if "val_loss" in r],
        "val_bpb": [r["val_bpb"] for r in records if "val_bpb" in r],
        "tokens_seen": [r["tokens_seen"] for r in steps],
        "inputs": torch.cat(single.first_step_inputs),
    }


def pp_worker(args: dict) -> dict:
    import tempfile

    cache_token_stores()
    out = {}
    for name, (dp, extra) in args["configs"].items():
        with tempfile.TemporaryDirectory() as dump:
            out[name] = train_from_seed(pp_config(dump, dp, extra), args["seed"])
    return out


def run_parity(configs: dict, nprocs: int, backend: str, reference) -> None:
    results = run_workers(
        pp_worker, nprocs, {"configs": configs, "seed": reference["seed"]}, backend=backend, timeout=300
    )
    report = []
    for name, (dp, _) in configs.items():
        for rank_res in results[1:]:  # every stage logs the true loss, not just the last one
            assert rank_res[name]["loss"] == results[0][name]["loss"], f"{name}: ranks disagree on the loss"
            assert rank_res[name]["grad_norm"] == results[0][name]["grad_norm"], f"{name}: ranks disagree"
        check(
            name,
            results[0][name],
            reference,
            {"loss": RTOL, "grad_norm": RTOL, "val_loss": RTOL, "val_bpb": RTOL},
            report,
        )
        check_data(name, results, nprocs // dp, reference["inputs"])
        # tokens (and so tokens/s and MFU, which divide them by the world size) count each token once
        assert results[0][name]["tokens_seen"] == reference["tokens_seen"], name
        # each rank's module holds its stages' blocks under the full model's names: every key on exactly one
        # stage (ranks of one stage, FSDP or TP peers, hold the same names)
        by_stage = {tuple(r[name]["stage_ids"]): set(r[name]["keys"]) for r in results}
        assert sum(len(k) for k in by_stage.values()) == len(reference["seed"]), name
        assert set().union(*by_stage.values()) == set(reference["seed"]), name
    print("\n".join(report))


@pytest.mark.multiprocess
@pytest.mark.parametrize("backend", backends(2))
def test_pipeline_schedules_match_one_process(backend, reference):
    """PP 2 with GPipe, 1F1B, interleaved 1F1B and zero-bubble (2 virtual stages per rank), ZBV, DualPipeV,
    and 1F1B with gradient accumulation: the single process's losses and gradient norms."""
    run_parity(TWO_PROC, 2, backend, reference)


@pytest.mark.multiprocess
@pytest.mark.parametrize("backend", backends(4))
def test_pipeline_with_fsdp_and_tp_matches_one_process(backend, reference):
    """PP 2 x FSDP 2, PP 2 x HSDP (2 replicas) and PP 2 x TP 2 (loss parallel) on 4 processes."""
    run_parity(FOUR_PROC, 4, backend, reference)


# ---------------------------------------------------------------------------------------------- the split


def section(**kw):
    cfg = parse_args(
        ["--parallelism.pipeline_parallel_degree", str(kw.pop("pp", 2))]
        + sum(([f"--parallelism.pipeline_parallel_{k}", str(v)] for k, v in kw.items()), [])
    )
    return cfg.parallelism


def test_schedule_lists_agree_with_torch():
    """The config's choices, the planner's lists and the schedule classes name the same schedules."""
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle

    from titanlite.config.sections import PIPELINE_SCHEDULES
    from titanlite.parallel.pipeline import SCHEDULES, is_multi_stage
    from titanlite.parallel.pipeline_schedules import PIPELINE_SCHEDULES as PLANNED

    assert tuple(SCHEDULES) == PIPELINE_SCHEDULES == PLANNED
    for name, cls in SCHEDULES.items():
        assert is_multi_stage(name) == (not issubclass(cls, PipelineScheduleSingle)), name


def test_split_evenly_gives_extra_blocks_to_the_middle_stages():
    assert split_evenly(6, 2) == [3, 3]
    assert split_evenly(6, 4) == [1, 2, 2, 1]
    assert split_evenly(126, 8) == [15, 16, 16, 16, 16, 16, 16, 15]
    assert split_evenly(7, 3) == [2, 3, 2]
    assert sum(split_evenly(126, 16)) == 126


def test_plans_for_each_schedule():
    plan = PipelinePlan.from_config(section(schedule="1F1B"), 6, 8)
    assert (plan.stage_sizes, plan.n_microbatches, plan.stage_ids(0), plan.stage_ids(1)) == ((3, 3), 8, [0], [1])
    assert plan.stage_modules(0) == ["tok_embeddings", "layers.0", "layers.1", "layers.2"]
    assert plan.stage_modules(1) == ["layers.3", "layers.4", "layers.5", "norm", "output"]
    plan = PipelinePlan.from_config(section(schedule="Interleaved1F1B", microbatch_size=2), 8, 8)
    assert (plan.num_stages, plan.stage_ids(0), plan.stage_ids(1), plan.n_microbatches) == (4, [0, 2], [1, 3], 4)
    plan = PipelinePlan.from_config(section(schedule="ZBVZeroBubble"), 8, 8)
    assert (plan.stage_ids(0), plan.stage_ids(1)) == ([0, 3], [1, 2])  # the V
    plan = PipelinePlan.from_config(section(schedule="Interleaved1F1B", layers_per_stage=1), 8, 8)
    assert plan.num_stages == 8 and plan.stage_ids(1) == [1, 3, 5, 7]
    cfg = parse_args(
        ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_split_points", "layers.2"]
    )
    assert PipelinePlan.from_config(cfg.parallelism, 6, 8).stage_sizes == (2, 4)


@pytest.mark.parametrize(
    "kw, n_layers, batch, message",
    [
        (dict(layers_per_stage=4), 6, 8, "pipeline_parallel_layers_per_stage=4 does not divide model.n_layers (6)"),
        (dict(layers_per_stage=1), 6, 8, "1F1B runs one stage per rank, so it needs 2 stages"),
        (dict(schedule="Interleaved1F1B", layers_per_stage=3), 6, 8, "needs virtual stages"),
        (dict(schedule="ZBVZeroBubble", layers_per_stage=1), 6, 8, "needs exactly 2 stages per rank (4)"),
        (dict(microbatch_size=4), 6, 4, "1F1B needs at least as many microbatches"),
        (dict(schedule="DualPipeV", microbatch_size=2), 8, 4, "DualPipeV needs at least as many microbatches"),
        (dict(schedule="Interleaved1F1B"), 8, 5, "divisible by its rounds"),
        (dict(pp=4), 3, 8, "model.n_layers (3) cannot be split into 4 pipeline stages"),
    ],
)
def test_bad_splits_are_one_line_errors(kw, n_layers, batch, message):
    with pytest.raises(ValueError, match="pipeline") as e:
        PipelinePlan.from_config(section(**kw), n_layers, batch)
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    "points, message",
    [(["layers.0"], "0 < i < 6"), (["layers.3", "layers.2"], "strictly increasing"), (["norm"], "'layers.<i>'")],
)
def test_bad_split_points(points, message):
    cfg = parse_args(
        [
            "--parallelism.pipeline_parallel_degree",
            "2",
            "--parallelism.pipeline_parallel_split_points",
            ",".join(points),
        ]
    )
    with pytest.raises(ValueError, match="pipeline_parallel_split_points") as e:
        PipelinePlan.from_config(cfg.parallelism, 6, 8)
    assert message in str(e.value)


def cli_worker(args: dict) -> dict:
    """``titanlite.train``'s main on this rank: its exit status and what it wrote on stderr."""
    import contextlib
    import io

    from titanlite.train import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as e:
        main(args["argv"])
    return {"code": e.value.code, "stderr": err.getvalue()}


def test_config_errors_are_one_line_and_stop_the_run(tmp_path):
    """A microbatch size that does not divide the local batch: one line, exit status 2, when the config is read.
    A tied embedding and output under PP (refused like torchtitan): one line naming both parameters, and the
    run stops (each of the 2 ranks exits 2 while building the model)."""
    base = [
        "--config",
        str(REPO / "train_configs/debug_model.toml"),
        "--job.dump_folder",
        str(tmp_path),
        "--parallelism.pipeline_parallel_degree",
        "2",
    ]
    r = run_python(
        [sys.executable, "-m", "titanlite.train", *base, "--parallelism.pipeline_parallel_microbatch_size", "3"],
        timeout=60,
        cwd=REPO,
    )
    assert r.returncode == 2 and "pipeline_parallel_microbatch_size (3)" in r.stderr, r.stderr
    for rank, r in enumerate(run_workers(cli_worker, 2, {"argv": [*base, "--model.tie_word_embeddings", "true"]})):
        line = [x for x in r["stderr"].splitlines() if "tied parameter" in x]
        assert r["code"] == 2 and line and "tok_embeddings.weight and output.weight" in line[0], (rank, r)
        assert line[0].startswith(f"error: rank {rank}: ") and len(r["stderr"].strip().splitlines()) == 1, r


# ---------------------------------------------------------------------------------------------- checkpoints

CKPT = [
    "--checkpoint.enable",
    "true",
    "--checkpoint.interval",
    str(HALF),
    "--checkpoint.keep_latest_k",
    "0",
]


def ckpt_worker(args: dict) -> dict:
    """Train ``args["extra"]`` in ``args["dump"]`` (resuming whatever is there) from the seed; records."""
    cache_token_stores()
    cfg = pp_config(args["dump"], args["dp"], [*CKPT, *args["extra"]])
    trainer = RecordingTrainer(cfg)
    if args.get("seed") is not None:
        from titanlite.parallel.state_dict import load_full_state_dict

        load_full_state_dict(trainer.model, args["seed"])
    records = trainer.train()
    full = {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).cpu() for k, v in trainer.model.state_dict().items()
    }
    return {"records": [r for r in records if "loss" in r], "weights": full}


def steps_of(result: dict) -> dict[int, tuple[float, float]]:
    return {r["step"]: (r["loss"], r["grad_norm"]) for r in result["records"]}


def resume(tmp_path, name: str, src: Path, step: int) -> Path:
    """A dump folder holding ``src``'s checkpoint of ``step`` only."""
    dump = tmp_path / name
    shutil.copytree(src / "checkpoint" / f"step-{step}", dump / "checkpoint" / f"step-{step}")
    return dump


@pytest.mark.multiprocess
def test_pipelined_checkpoints_reshard_and_resume_exactly(tmp_path, reference):
    """PP 2 x FSDP 2 (4 processes) saves at steps HALF and STEPS. Its step HALF resumes
    - under PP 2 x FSDP 2 bitwise (each data-parallel rank's data position included),
    - in one process, with the single process's losses (RTOL);
    a plain FSDP 2 checkpoint resumes under PP 2. The HF export of the pipelined last step equals the
    export of the weights the stages held, bit for bit, and loads in ``transformers`` when installed."""
    seed, layout = reference["seed"], pp("1F1B", "--parallelism.data_parallel_shard_degree", "2", *MB2)
    ref = {i + 1: (loss, gn) for i, (loss, gn) in enumerate(zip(reference["loss"], reference["grad_norm"]))}

    def run(dump: Path, nprocs: int, dp: int, extra: list[str], seed=None) -> list[dict]:
        args = {"dump": str(dump), "dp": dp, "extra": extra, "seed": seed}
        return run_workers(ckpt_worker, nprocs, args, timeout=300)

    full = run(tmp_path / "pp", 4, 2, layout, seed)
    whole = steps_of(full[0])
    assert sorted(whole) == list(range(1, STEPS + 1))
    again = steps_of(run(resume(tmp_path, "pp_again", tmp_path / "pp", HALF), 4, 2, layout)[0])
    assert again == {s: v for s, v in whole.items() if s > HALF}  # bitwise: PP -> PP

    # (the resumed layouts keep the data-parallel ranks' batch of 4 and accumulate: a data loader re-partitions
    # only at a multiple of its batch)
    half = ["--training.local_batch_size", "4"]
    one = {"dump": str(resume(tmp_path, "one", tmp_path / "pp", HALF)), "dp": 1, "extra": [*PP_MODEL, *half]}
    single = steps_of(ckpt_worker(one))  # in this process
    assert sorted(single) == list(range(HALF + 1, STEPS + 1))
    for s, (loss, gn) in single.items():
        assert loss == pytest.approx(ref[s][0], rel=RTOL) and gn == pytest.approx(ref[s][1], rel=RTOL), s

    fsdp = ["--parallelism.data_parallel_shard_degree", "2", *PP_MODEL]
    run(tmp_path / "fsdp", 2, 2, fsdp, seed)
    into_pp = steps_of(run(resume(tmp_path, "fsdp_to_pp", tmp_path / "fsdp", HALF), 2, 1, pp("1F1B", *half))[0])
    for s, (loss, gn) in into_pp.items():
        assert loss == pytest.approx(ref[s][0], rel=RTOL) and gn == pytest.approx(ref[s][1], rel=RTOL), s

    # HF export of the pipelined checkpoint: the stages' weights, converted as one process converts its own
    from safetensors.torch import load_file

    from titanlite.models.llama3.hf_adapter import Llama3HFAdapter

    held = {k: v for rank in full for k, v in rank["weights"].items()}
    assert set(held) == set(seed)
    out = tmp_path / "hf"
    r = run_python(
        [
            sys.executable,
            "-m",
            "titanlite",
            "convert",
            "dcp-to-hf",
            str(tmp_path / f"pp/checkpoint/step-{STEPS}"),
            str(out),
        ],
        timeout=120,
        cwd=REPO,
    )
    assert r.returncode == 0, r.stderr
    exported = {}
    for f in out.glob("*.safetensors"):
        exported.update(load_file(f))
    cfg = pp_config(str(tmp_path / "x"), 1, PP_MODEL)
    from titanlite.models.registry import model_args_for

    adapter = Llama3HFAdapter(model_args_for(cfg.model, 512))
    expected = dict(adapter.to_hf(k, v) for k, v in held.items())
    assert set(exported) == set(expected)
    for k, v in expected.items():
        assert torch.equal(exported[k], v.to(exported[k].dtype)), k


# ---------------------------------------------------------------------------------------------- Qwen3, guard

QWEN3_ARGS = ["--model.name", "qwen3", "--model.head_dim", "32", "--model.ffn_hidden_dim", "128"]
QWEN3_ARGS += ["--model.tie_word_embeddings", "false"]  # the debug flavor ties them: refused under PP
BF16 = ["--training.mixed_precision_param", "bfloat16"]
GUARD = ["--guard.policy", "skip_step", "--guard.debug_inject_nan_at_step", "3", *PP_MODEL]
MORE = {
    "qwen3": ([*QWEN3_ARGS, *PP_MODEL], pp("1F1B", *QWEN3_ARGS)),
    "guard": (GUARD, pp("1F1B", *GUARD[:4])),
    # bf16 autocast without FSDP: only the stages' forwards autocast (the schedule also runs the backward)
    "bf16": ([*BF16, *PP_MODEL], pp("1F1B", *BF16)),
}
TOLERANCE = {"bf16": 2e-3}  # bf16 matmuls over microbatches of 1 vs a batch of 8: other rounding (measured 4.3e-4)


def diverge_at_step(trainer, step: int) -> None:
    """This rank's forward and backward of optimizer step ``step`` go NaN (the local loss and one gradient), before
    the step's reduction, as a diverging stage would."""
    inner = trainer.train_step.forward_backward

    def forward_backward(batch, tokens):
        loss = inner(batch, tokens)
        if trainer.state.step + 1 != step:
            return loss
        next(p for p in trainer.model.parameters() if p.grad is not None).grad.mul_(float("nan"))
        return loss * float("nan")

    trainer.train_step.forward_backward = forward_backward


def records_worker(args: dict) -> dict:
    import tempfile

    import torchtitan_ext.qwen3  # noqa: F401  (registers the family in this process)

    cache_token_stores()
    out = {}
    for name, extra in args["configs"].items():
        with tempfile.TemporaryDirectory() as dump:
            cfg = pp_config(dump, 1, extra)
            if name == "guard":  # a NaN arises on the last stage only (its loss and gradients): the verdict is shared
                cfg.guard.debug_inject_nan_at_step = -1
            trainer = RecordingTrainer(cfg)
            if name == "guard" and os.environ["RANK"] == "1":
                diverge_at_step(trainer, 3)
            if args["seeds"].get(name) is not None:
                from titanlite.parallel.state_dict import load_full_state_dict

                load_full_state_dict(trainer.model, args["seeds"][name])
            out[name] = [
                {k: r.get(k) for k in ("step", "loss", "grad_norm", "guard_skipped_steps")} for r in trainer.train()
            ]
    return out


@pytest.mark.multiprocess
def test_qwen3_the_guard_and_bf16_under_pipeline_parallelism(tmp_path):
    """Qwen3 (qk-norm) trains under PP 2 with one process's losses; a NaN arising on the last stage at step 3
    (its loss and gradients) under ``skip_step`` is skipped by every stage (the step's reduction carries it to
    all), as one process skips an injected NaN; bf16 autocast follows one process's bf16 run."""
    import torchtitan_ext.qwen3  # noqa: F401

    cache_token_stores()
    refs, seeds = {}, {}
    for name, (single, _) in MORE.items():
        trainer = RecordingTrainer(pp_config(str(tmp_path / name), 1, single))
        seeds[name] = copy.deepcopy(trainer.model.state_dict())
        refs[name] = [
            {k: r.get(k) for k in ("step", "loss", "grad_norm", "guard_skipped_steps")} for r in trainer.train()
        ]
    args = {"configs": {name: extra for name, (_, extra) in MORE.items()}, "seeds": seeds}
    results = run_workers(records_worker, 2, args, timeout=240)
    for name, ref in refs.items():
        if name == "guard":  # the NaN arose on the last stage only: both skipped step 3, then trained alike
            ranks = [
                [{k: v for k, v in r.items() if k not in ("loss", "grad_norm") or r["step"] != 3} for r in res[name]]
                for res in results
            ]
            assert json.dumps(ranks[0]) == json.dumps(ranks[1]), "the stages took different guard verdicts"
        else:
            same = json.dumps(results[0][name]) == json.dumps(results[1][name])  # (NaN != NaN in a comparison)
            assert same, f"{name}: the stages logged different records"
        got = [r for r in results[1][name] if r["loss"] is not None]  # rank 1: the last stage
        ref = [r for r in ref if r["loss"] is not None]
        assert [r["step"] for r in got] == [r["step"] for r in ref]
        worst = max(
            abs(a[k] - b[k]) / abs(b[k]) for a, b in zip(got, ref) for k in ("loss", "grad_norm") if b[k] == b[k]
        )
        print(f"{name}: max rel diff {worst:.1e}")
        for a, b in zip(got, ref):
            for key in ("loss", "grad_norm"):
                if b[key] != b[key]:  # the injected NaN
                    assert a[key] != a[key], (name, a)
                else:
                    assert a[key] == pytest.approx(b[key], rel=TOLERANCE.get(name, RTOL)), (name, key, a, b)
    for res in results:
        assert max(r["guard_skipped_steps"] or 0 for r in res["guard"]) == 1


def init_worker(args: dict) -> dict:
    import tempfile

    cache_token_stores()
    with tempfile.TemporaryDirectory() as dump:
        trainer = RecordingTrainer(pp_config(dump, 1, args["extra"]))
        return {k: v.clone() for k, v in trainer.model.state_dict().items()}


@pytest.mark.multiprocess
def test_sharded_init_draws_each_stage_from_its_own_seed():
    """``weight_init = sharded`` (the GPU default) on PP 4 with one block per stage: every rank starts from
    the same RNG state, so without a per-stage seed the middle stages (no embedding, no output) would draw
    the same block; here all four blocks differ, and a rerun draws the same values."""
    extra = [
        *pp("1F1B", "--parallelism.weight_init", "sharded"),
        "--parallelism.pipeline_parallel_degree",
        "4",
    ]
    runs = [run_workers(init_worker, 4, {"extra": extra}, timeout=120) for _ in range(2)]
    for a, b in zip(*runs):
        assert all(torch.equal(a[k], b[k]) for k in a)
    blocks = [runs[0][i][f"layers.{i}.attention.wq.weight"] for i in range(4)]
    for i in range(4):
        for j in range(i):
            assert not torch.equal(blocks[i], blocks[j]), (i, j)


def clip_worker(args: dict) -> list[dict]:
    import torch.distributed as dist

    from titanlite.parallel.grad_clip import clip_grad_norm_

    dist.init_process_group("gloo")
    out = []
    for grads in args["cases"]:
        p = torch.nn.Parameter(torch.zeros(3))
        p.grad = torch.tensor(grads[dist.get_rank()])
        norms = {
            str(t): clip_grad_norm_([p], 0.0, t, pp_group=dist.group.WORLD).item() for t in (2.0, 1.0, float("inf"))
        }
        out.append(norms)
    return out


@pytest.mark.multiprocess
def test_gradient_norm_over_stages():
    """Each stage holds other parameters: the 2-, 1- and inf-norms over 2 stages equal the norms of all the
    gradients in one vector, and a NaN on either stage makes every norm NaN on both ranks (a MAX all-reduce
    for the inf-norm would drop rank 1's NaN on gloo)."""
    grads = [[3.0, -4.0, 1.0], [2.0, 0.5, -6.0]]
    cases = [grads, [[3.0, float("nan"), 1.0], grads[1]], [grads[0], [2.0, float("nan"), -6.0]]]
    results = run_workers(clip_worker, 2, {"cases": cases}, timeout=60)
    everything = torch.tensor(grads[0] + grads[1])
    for case in range(3):
        for norm_type in (2.0, 1.0, float("inf")):
            want = torch.linalg.vector_norm(everything, norm_type).item()
            for r in results:
                got = r[case][str(norm_type)]
                assert (got != got) if case else got == pytest.approx(want, rel=1e-6), (case, norm_type, got)

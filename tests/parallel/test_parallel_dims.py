"""Parallel degrees and their one-line errors: ParallelDims, model checks, CLI and torchrun."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.launch import run_python
from tests.helpers.tiny import TINY_MODEL
from titanlite.config import parse_config
from titanlite.models import make_model_args
from titanlite.models.llama3.parallelize import check_llama_parallelism
from titanlite.parallel.parallel_dims import ParallelDims

REPO = Path(__file__).resolve().parents[2]
TINY = [
    *TINY_MODEL,
    "--training.seq_len",
    "32",
    "--training.steps",
    "2",
    "--lr_scheduler.warmup_steps",
    "1",
    "--validation.enable",
    "false",
]


def test_degrees_resolve_the_rest_of_the_world():
    d = ParallelDims(dp_replicate=2, dp_shard=-1, tp=2, world_size=8)
    assert (d.dp_replicate, d.dp_shard, d.tp, d.dp_degree) == (2, 2, 2, 4)
    assert d.fsdp_enabled and d.hsdp_enabled and d.tp_enabled and d.loss_parallel_enabled
    one = ParallelDims(world_size=1)
    assert (one.dp_shard, one.dp_degree, one.fsdp_enabled, one.tp_enabled) == (1, 1, False, False)
    assert one.dp_group is None and one.dp_rank(0) == 0 and one.build_mesh("cpu") is None
    assert ParallelDims(tp=2, world_size=4).dp_rank(3) == 1  # tp is the innermost dimension
    assert not ParallelDims(tp=2, world_size=2, enable_loss_parallel=False).loss_parallel_enabled
    # pp is the outermost dimension: ranks 0-3 are stage 0, 4-7 stage 1; the rest is left to FSDP
    d = ParallelDims(pp=2, tp=2, world_size=8)
    assert (d.dp_shard, d.dp_degree, d.pp_enabled, d.pp_rank, d.pp_group) == (2, 2, True, 0, None)
    assert [d.dp_rank(r) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            dict(dp_shard=2, tp=2, world_size=2),
            "parallelism degrees must multiply to the number of processes: data_parallel_replicate_degree (1) x "
            "data_parallel_shard_degree (2) x tensor_parallel_degree (2) = 4, but WORLD_SIZE=2",
        ),
        (
            dict(tp=3, world_size=4),
            "parallelism.data_parallel_replicate_degree (1) x parallelism.tensor_parallel_degree (3) = 3 does not "
            "divide the number of processes (WORLD_SIZE=4)",
        ),
        (dict(dp_shard=0, world_size=2), "parallelism.data_parallel_shard_degree=0 must be >= 1 (or -1 for the rest"),
        (dict(tp=0, world_size=2), "parallelism.tensor_parallel_degree=0 must be >= 1"),
        (
            dict(pp=2, dp_shard=2, tp=2, world_size=4),
            "pipeline_parallel_degree (2) x data_parallel_replicate_degree (1) x data_parallel_shard_degree (2) x "
            "tensor_parallel_degree (2) = 8, but WORLD_SIZE=4",
        ),
        (dict(pp=3, world_size=4), "parallelism.pipeline_parallel_degree (3) x parallelism.data_parallel_replicate"),
        (dict(pp=0, world_size=2), "parallelism.pipeline_parallel_degree=0 must be >= 1"),
    ],
)
def test_bad_degrees_are_one_line_errors(kwargs, message):
    with pytest.raises(ValueError) as e:
        ParallelDims(**kwargs)
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    "overrides, tp, message",
    [
        (dict(n_heads=4, n_kv_heads=1), 2, "parallelism.tensor_parallel_degree=2 must divide model.n_kv_heads (1)"),
        (
            dict(n_heads=6, n_kv_heads=6, dim=96),
            4,
            "parallelism.tensor_parallel_degree=4 must divide model.n_heads (6)",
        ),
        (dict(vocab_size=513), 2, "must divide model.vocab_size (513)"),
    ],
)
def test_model_that_tp_cannot_split(overrides, tp, message):
    args = make_model_args("llama3", "debugmodel", **overrides)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_llama_parallelism(args, ParallelDims(tp=tp, world_size=tp))


def test_sequence_length_must_split_under_tp():
    from titanlite.plan.dry_run import dry_run

    cfg = parse_config(["--training.seq_len", "33", "--parallelism.tensor_parallel_degree", "2"])
    with pytest.raises(ValueError, match=r"must divide training.seq_len \(sequence parallelism\) \(33\)"):
        dry_run(cfg, world_size=2, out=lambda line: None)


def test_cli_product_mismatch_is_one_line_error(tmp_path):
    out = run_python(
        [
            sys.executable,
            "-m",
            "titanlite.train",
            *TINY,
            "--job.dump_folder",
            str(tmp_path),
            "--parallelism.data_parallel_shard_degree",
            "2",
        ],
        timeout=120,
        cwd=REPO,
    )
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.startswith("error: parallelism degrees must multiply to the number of processes")
    assert "WORLD_SIZE=1" in out.stderr


def _torchrun_output(args: list[str], tmp_path) -> str:
    cmd = [
        str(Path(sys.executable).with_name("torchrun")),
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "titanlite.train",
        *TINY,
        "--job.dump_folder",
        str(tmp_path),
        *args,
    ]
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES=""),
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail("torchrun with a bad config did not exit within 180 s")
    assert proc.returncode != 0 and "exitcode  : 2" in output, output
    return output


@pytest.mark.multiprocess
def test_torchrun_bad_config_exits_nonzero_with_one_line_errors(tmp_path):
    """Under torchrun each rank exits 2 with no traceback of ours; torchrun then fails (its own
    launcher report follows, which we do not control). A command-line error is printed once (local
    rank 0: every rank parses the same arguments); an error found while building the trainer (here
    the layout against the model) by every rank, each line naming its rank. Hard timeout: the
    process group is killed."""
    output = _torchrun_output(["--training.steps", "many"], tmp_path / "cli")
    errors = [l for l in output.splitlines() if l.startswith("error:")]
    assert errors == ["error: invalid value 'many' for 'training.steps' on the command line: expected an integer"], (
        output
    )
    output = _torchrun_output(
        ["--model.n_kv_heads", "1", "--parallelism.tensor_parallel_degree", "2"], tmp_path / "layout"
    )
    errors = [l for l in output.splitlines() if l.startswith("error:")]
    # every rank that got to print (torchrun may stop the second one first) printed its line
    expected = {
        f"error: rank {r}: parallelism.tensor_parallel_degree=2 must divide model.n_kv_heads (1)" for r in (0, 1)
    }
    assert errors and set(errors) <= expected and len(errors) == len(set(errors)), output

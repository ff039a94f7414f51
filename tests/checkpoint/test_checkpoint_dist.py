"""Checkpointing across processes (gloo on CPU): exact resume under FSDP 2 (async save) and
resharding a FSDP 2 checkpoint to one process, to TP 2 and to FSDP 2 x TP 2 (4 processes).

One FSDP 2 run of 8 steps saves step-4 and step-8 asynchronously (``fsdp_run``). Every resume
starts from a copy of its step-4 folder and trains steps 5-8 again:

- FSDP 2 again: the same layout, so the losses must be bitwise those of the uninterrupted run;
- one process, TP 2 and FSDP 2 x TP 2: DCP re-partitions model and AdamW state, the data loader
  re-partitions its global cursor when the data-parallel degree changes (2 -> 1 for one process
  and TP 2), and the losses must match up to fp32 summation order (``RTOL``, as in
  ``test_parallel_parity.py``: measured differences are ~1e-6).

Every launch has a hard timeout (``tests.helpers.dist.run_workers``), so a hang fails instead of stalling.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers.checkpoint_runs import resume_copy
from tests.helpers.dist import cache_token_stores, run_workers
from tests.helpers.tiny import TINY_MODEL
from titanlite.models import load_config

STEPS = 8
HALF = STEPS // 2  # the checkpoint every resume starts from
RTOL = 2e-5
TINY = [
    *TINY_MODEL,
    "--training.seq_len",
    "32",
    "--training.local_batch_size",
    "4",
    "--training.global_batch_size",
    "8",
    "--training.steps",
    str(STEPS),
    "--optimizer.lr",
    "3e-3",
    "--lr_scheduler.warmup_steps",
    "2",
    "--metrics.log_freq",
    "1",
    "--checkpoint.enable",
    "--checkpoint.interval",
    str(HALF),
    "--checkpoint.keep_latest_k",
    "0",
    "--checkpoint.last_save_model_only",
    "false",
]
FSDP2 = ["--parallelism.data_parallel_shard_degree", "2"]
TP2 = ["--parallelism.tensor_parallel_degree", "2"]

pytestmark = pytest.mark.usefixtures("one_thread")


def train_worker(args: dict) -> dict:
    import titanlite.data.recipe as recipe
    import titanlite.train as train

    # save start-up time: the tokens this test process already has, no CPU peak-FLOPs probe
    tokens = torch.load(args["tokens"], weights_only=True)
    recipe.load_token_store = lambda dataset, path, split, tokenizer: tokens
    import titanlite.trainer.metrics as metrics

    metrics.peak_flops = lambda *a, **k: None
    trainer = train.Trainer(load_config(args["argv"]))
    trainer.train()
    return {"stats": [(s.step, s.blocked_s, s.write_s) for s in trainer.checkpointer.stats]}


def tokens_file(folder: Path) -> str:
    import titanlite.data.recipe as recipe
    from titanlite.tokenizer import build_tokenizer

    path = folder / "train_tokens.pt"
    if not path.exists():
        cache_token_stores()
        torch.save(recipe.load_token_store("embedded", "", "train", build_tokenizer("")), path)
    return str(path)


def metrics(dump: Path) -> list[dict]:
    return [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    dump = tmp_path_factory.mktemp("fsdp2")
    results = run_workers(
        train_worker,
        2,
        {
            "argv": TINY + FSDP2 + ["--job.dump_folder", str(dump), "--checkpoint.async_mode", "async"],
            "tokens": tokens_file(dump.parent),
        },
        timeout=240,
    )
    assert [s[0] for s in results[0]["stats"]] == [HALF, STEPS]
    half = dump / "checkpoint" / f"step-{HALF}"
    assert sorted(p.name for p in half.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    info = json.loads((half / "checkpoint.json").read_text())
    assert info["world_size"] == 2 and not info["model_only"]
    return dump, metrics(dump)


def test_fsdp2_resume_is_bitwise_identical(fsdp_run, tmp_path):
    source, reference = fsdp_run
    dump = resume_copy(source, tmp_path / "resumed", step=HALF)
    run_workers(
        train_worker,
        2,
        {
            "argv": TINY + FSDP2 + ["--job.dump_folder", str(dump), "--checkpoint.async_mode", "async_with_pinned_mem"],
            "tokens": tokens_file(source.parent),
        },
        timeout=240,
    )
    got = metrics(dump)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    for a, b in zip(got, reference):
        assert (a["loss"], a["lr"], a["tokens_seen"], a["grad_norm"]) == (
            b["loss"],
            b["lr"],
            b["tokens_seen"],
            b["grad_norm"],
        )


def _assert_close_run(dump: Path, reference: list[dict]) -> None:
    got = metrics(dump)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    assert got[:HALF] == reference[:HALF]
    for a, b in zip(got[HALF:], reference[HALF:]):
        assert a["lr"] == b["lr"] and a["tokens_seen"] == b["tokens_seen"]
        assert a["loss"] == pytest.approx(b["loss"], rel=RTOL), (a["step"], a["loss"], b["loss"])
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=10 * RTOL)


def test_fsdp2_checkpoint_resumes_on_one_process(fsdp_run, tmp_path, caplog):
    from titanlite.trainer import Trainer

    source, reference = fsdp_run
    dump = resume_copy(source, tmp_path / "one", step=HALF)
    cache_token_stores()
    with caplog.at_level("INFO", logger="titanlite"):
        Trainer(load_config(TINY + ["--job.dump_folder", str(dump)])).train()
    assert "RESUMED from" in caplog.text and "re-partitioning from 2 to 1" in caplog.text
    _assert_close_run(dump, reference)


def test_fsdp2_checkpoint_resumes_under_tp2(fsdp_run, tmp_path):
    source, reference = fsdp_run
    dump = resume_copy(source, tmp_path / "tp2", step=HALF)
    run_workers(
        train_worker,
        2,
        {"argv": TINY + TP2 + ["--job.dump_folder", str(dump)], "tokens": tokens_file(source.parent)},
        timeout=240,
    )
    _assert_close_run(dump, reference)


def test_fsdp2_checkpoint_resumes_under_fsdp2_x_tp2(fsdp_run, tmp_path):
    """A 1-D FSDP checkpoint loads into a 2-D (dp_shard x tp) layout: every parameter and AdamW
    moment is re-sliced along both mesh dimensions by DCP."""
    source, reference = fsdp_run
    dump = resume_copy(source, tmp_path / "fsdp2_tp2", step=HALF)
    run_workers(
        train_worker,
        4,
        {"argv": TINY + FSDP2 + TP2 + ["--job.dump_folder", str(dump)], "tokens": tokens_file(source.parent)},
        timeout=300,
    )
    _assert_close_run(dump, reference)

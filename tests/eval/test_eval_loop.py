"""``[sampling]`` and ``[eval]`` in the training loop: what they log, that training stays bitwise the same
with them on, that FSDP/TP runs log the single process's samples and scores, and that the watcher's
scores of the run's checkpoints equal the in-loop ones."""

from __future__ import annotations

import json
import math
import sys

import pytest

from tests.helpers.dist import REPO, cache_token_stores, run_workers
from tests.helpers.launch import run_python
from tests.helpers.shared_data import shared_file
from tests.helpers.tiny import TINY_MODEL
from titanlite.eval import cli as eval_cli
from titanlite.models import load_config
from titanlite.trainer import Trainer

STEPS = 6
TASKS = "hellaswag,arc_easy,arc_challenge,piqa,lambada_openai"


def args_for(dump, *extra: str) -> list[str]:
    base = [*TINY_MODEL, "--training.seq_len", "64", "--training.steps", str(STEPS), "--metrics.log_freq", "1"]
    return [*base, "--training.local_batch_size", "4", "--job.dump_folder", str(dump), *extra]


def with_sampling_and_eval(data_dir) -> list[str]:
    sampling = ["--sampling.enable", "--sampling.freq", "3", "--sampling.max_new_tokens", "8"]
    sampling += ["--sampling.temperature", "0.9", "--sampling.top_k", "20", "--sampling.prompts", "Hello,A"]
    evals = ["--eval.enable", "--eval.freq", "3", "--eval.limit", "6", "--eval.tasks", TASKS]
    return [*sampling, *evals, "--eval.data_dir", str(data_dir), "--eval.batch_size", "4"]


def train(args) -> list[dict]:
    return Trainer(load_config(args)).train()


@pytest.fixture(scope="module")
def eval_data():
    return shared_file("eval")


@pytest.fixture(scope="module")
def runs(tmp_path_factory, eval_data):
    """The same tiny run without and with [sampling] + [eval] (and checkpoints, for the watcher)."""
    plain = train(args_for(tmp_path_factory.mktemp("plain")))
    dump = tmp_path_factory.mktemp("evals")
    ckpt = ["--checkpoint.enable", "--checkpoint.interval", "3", "--checkpoint.keep_latest_k", "0"]
    extra = ["--metrics.enable_tensorboard", *ckpt, *with_sampling_and_eval(eval_data)]
    return plain, train(args_for(dump, *extra)), dump


def test_training_is_bitwise_the_same_with_sampling_and_eval_on(runs):
    plain, evals, _ = runs
    steps = lambda records: [(r["step"], r["loss"], r["grad_norm"]) for r in records if "loss" in r]  # noqa: E731
    assert steps(plain) == steps(evals) and len(steps(plain)) == STEPS


def test_samples_and_scores_are_logged_at_their_steps(runs):
    _, records, dump = runs
    samples = [r for r in records if "samples" in r]
    assert [r["step"] for r in samples] == [3, 6]
    for r in samples:
        assert [s["prompt"] for s in r["samples"]] == ["Hello", "A"]
        assert all(isinstance(s["completion"], str) for s in r["samples"])
    scores = [r for r in records if any(k.startswith("eval/") for k in r)]
    assert [r["step"] for r in scores] == [3, 6]
    for task in TASKS.split(","):
        assert scores[-1][f"eval/{task}/num_items"] == 6
        assert 0.0 <= scores[-1][f"eval/{task}/acc"] <= 1.0
    assert scores[-1]["eval/lambada_openai/perplexity"] > 1.0
    assert "eval/hellaswag/acc_norm" in scores[-1]
    logged = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    assert [r for r in logged if "samples" in r] == samples

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = EventAccumulator(str(dump / "tb"), size_guidance={"tensors": 0}).Reload()
    assert [e.step for e in tb.Tensors("samples/text_summary")] == [3, 6]
    assert [e.step for e in tb.Scalars("eval/piqa/acc")] == [3, 6]


def test_the_watcher_fills_in_the_in_loop_scores(runs, eval_data):
    _, records, dump = runs
    in_loop = {r["step"]: r for r in records if any(k.startswith("eval/") for k in r)}
    assert eval_cli.main(["--watch", str(dump), "--once"]) == 0  # data_dir, tasks and limit from its config.toml
    logged = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    watched = {r["step"]: r for r in logged if r.get("eval_source") == "watcher"}
    assert sorted(watched) == [3, 6]
    for step, record in watched.items():  # the same weights, the same batches: the same numbers, bit for bit
        assert {k: v for k, v in record.items() if k != "eval_source"} == in_loop[step]


FROZEN = ["--optimizer.lr", "1e-12"]  # the layouts then score the same weights (training parity: test_parallel_parity)
ONCE = ["--training.steps", "3"]  # one round of sampling and scoring (at step 3)


def parallel_worker(args: dict) -> dict:
    cache_token_stores()
    out = {}
    for name, extra in args["layouts"].items():
        run_args = args_for(f"{args['dump']}/{name}", *FROZEN, *ONCE, *extra, *with_sampling_and_eval(args["data"]))
        out[name] = [r for r in train(run_args) if "samples" in r or any(k.startswith("eval/") for k in r)]
    return out


def test_fsdp_and_tp_runs_log_the_single_process_samples_and_scores(tmp_path, eval_data):
    records = train(args_for(tmp_path / "one", *FROZEN, *ONCE, *with_sampling_and_eval(eval_data)))
    reference = [r for r in records if "samples" in r or any(k.startswith("eval/") for k in r)]
    layouts = {"fsdp": [], "tp": ["--parallelism.tensor_parallel_degree", "2"]}
    args = {"layouts": layouts, "dump": str(tmp_path), "data": str(eval_data)}
    results = run_workers(parallel_worker, 2, args, timeout=300)
    assert results[0]["fsdp"] == reference  # each rank scores half the batches: the numbers of one process
    assert results[1]["fsdp"] == reference
    assert results[0]["tp"] == results[1]["tp"], "the TP ranks logged different samples or scores"
    assert [r["step"] for r in results[0]["tp"]] == [r["step"] for r in reference] == [3, 3]
    for a, b in zip(results[0]["tp"], reference):  # TP sums in another order: equal to 1e-4, same samples
        if "samples" in b:
            assert a["samples"] == b["samples"]
        else:
            for key, value in b.items():
                if key.endswith("perplexity"):  # exp(-mean summed log-prob): compare the log-prob
                    a[key], value = math.log(a[key]), math.log(value)
                assert a[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--eval.enable"], "eval.data_dir must name the folder"),
        (["--eval.enable", "--eval.data_dir", "DATA", "--eval.tasks", "hellaswag,mmlu"], "mmlu"),
        (["--eval.enable", "--eval.data_dir", "/nonexistent"], "/nonexistent/hellaswag"),
        (["--eval.enable", "--eval.data_dir", "DATA", "--eval.tasks", "piqa,piqa"], "'piqa' more than once"),
        (["--sampling.enable", "--parallelism.pipeline_parallel_degree", "2"], "not supported with pipeline"),
        (["--sampling.enable", "--sampling.max_new_tokens", "5000"], "exceed the model's max_seq_len 2048"),
    ],
)
def test_bad_sampling_and_eval_settings_stop_the_run_at_start(tmp_path, eval_data, extra, message):
    extra = [str(eval_data) if a == "DATA" else a for a in extra]
    cmd = [sys.executable, "-m", "titanlite.train", *args_for(tmp_path / "run", *extra)]
    r = run_python(cmd, timeout=120, cwd=REPO)
    assert r.returncode == 2, r.stderr
    error = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(error) == 1 and message in error[0], r.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # nothing trained

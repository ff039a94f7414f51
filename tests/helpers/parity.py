"""The tiny run every parallelism is compared with one process on, and the comparisons.

tests/parallel/test_parallel_parity.py explains the run and the tolerance ``RTOL``; the pipeline, MoE and
Qwen3 parity tests reuse them.
"""

from __future__ import annotations

import torch

from tests.helpers.tiny import TINY_MODEL
from titanlite.models import load_config
from titanlite.trainer import Trainer

STEPS = 6
HALF = STEPS // 2  # the checkpoint that resumes start from
GLOBAL_BATCH = 8
RTOL = 2e-5  # see tests/parallel/test_parallel_parity.py
TINY = [
    *TINY_MODEL,
    "--training.seq_len",
    "32",
    "--training.steps",
    str(STEPS),
    "--training.global_batch_size",
    str(GLOBAL_BATCH),
    "--training.seed",
    "3",
    "--optimizer.lr",
    "3e-3",
    "--lr_scheduler.warmup_steps",
    "2",
    "--training.max_norm",
    "1.0",
    "--metrics.log_freq",
    "1",
    "--validation.enable",
    "true",
    "--validation.freq",
    str(HALF),
    "--validation.steps",
    "1",
    "--training.loss_chunks",  # chunked, and a quarter of the default's chunk calls (each a DTensor op under TP)
    "2",
]


def make_config(dump: str, dp: int, extra: list[str]):
    return load_config(
        TINY + ["--job.dump_folder", dump, "--training.local_batch_size", str(GLOBAL_BATCH // dp)] + extra
    )


class RecordingTrainer(Trainer):
    """Keeps the input batches of the first optimizer step."""

    def build_train_step(self, *args, **options):
        step = super().build_train_step(*args, **options)
        inner, self.first_step_inputs = step.forward_backward, []

        def forward_backward(batch, tokens):
            if self.state.step == 0:
                self.first_step_inputs.append(batch["input_ids"].clone())
            return inner(batch, tokens)

        step.forward_backward = forward_backward
        return step


def check(name: str, got: dict, ref: dict, rtols: dict, report: list, steps: int = STEPS) -> None:
    for key, rtol in rtols.items():
        a, b = torch.tensor(got[key], dtype=torch.float64), torch.tensor(ref[key], dtype=torch.float64)
        assert len(a) == len(b) == (2 if key.startswith("val_") else steps), (name, key, len(a))
        rel = ((a - b).abs() / b.abs()).max().item()
        report.append(f"{name:22s} {key:9s} max rel diff {rel:.2e} (tolerance {rtol:.0e})")
        assert rel <= rtol, f"{name}: {key} differs from one process by {rel:.2e} > {rtol:.0e}\n{a}\n{b}"
    # trained, as the references do (in 6 steps the loss of the dense Llama falls by 0.7)
    assert got["loss"][-1] < got["loss"][0] - 0.5, f"{name}: did not train {got['loss']}"


def check_data(name: str, per_rank: list[dict], tp: int, ref_inputs: torch.Tensor) -> None:
    """TP peers read identical batches; the DP ranks together read exactly the one-process step."""
    by_dp: dict[int, torch.Tensor] = {}
    for res in per_rank:
        seen = res[name]["inputs"]
        if res[name]["dp_rank"] in by_dp:
            assert torch.equal(by_dp[res[name]["dp_rank"]], seen), f"{name}: TP peers read different batches"
        by_dp[res[name]["dp_rank"]] = seen
    assert len(by_dp) * tp == len(per_rank)
    rows = sorted(tuple(r.tolist()) for t in by_dp.values() for r in t)
    assert rows == sorted(tuple(r.tolist()) for r in ref_inputs), f"{name}: DP ranks read other windows"

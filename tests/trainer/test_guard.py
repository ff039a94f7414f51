"""NaN / loss-spike guard: detection, agreement across ranks, and each policy on an injected NaN."""

import json
import math

import pytest
import torch

from tests.helpers.dist import run_workers
from tests.helpers.tiny import TINY_MODEL
from titanlite.config.sections import Guard
from titanlite.models import load_config
from titanlite.trainer import Trainer
from titanlite.trainer.guard import SpikeDetector, StepGuard, TrainingDivergedError
from titanlite.trainer.hooks import Hook

TINY = [
    *TINY_MODEL,
    "--training.seq_len",
    "32",
    "--training.local_batch_size",
    "2",
    "--metrics.log_freq",
    "1",
    "--lr_scheduler.warmup_steps",
    "1",
    "--training.seed",
    "3",
]


class Recording(Trainer):
    """Keeps the parameters after every step (a hook) and the input batches, to compare runs."""

    def __init__(self, cfg):
        self.snapshots, self.batches = [], []
        super().__init__(cfg)

    def build_train_step(self, *args, **options):
        step = super().build_train_step(*args, **options)
        inner = step.forward_backward

        def forward_backward(batch, tokens):
            self.batches.append(batch["input_ids"].clone())
            return inner(batch, tokens)

        step.forward_backward = forward_backward
        return step

    def build_hooks(self):
        trainer = self

        class Snapshot(Hook):
            def on_step_end(self, state, result):
                trainer.snapshots.append({n: p.detach().clone() for n, p in trainer.model.named_parameters()})

        return super().build_hooks() + [Snapshot()]


def trainer(tmp_path, *args, cls=Recording):
    return cls(load_config(TINY + ["--job.dump_folder", str(tmp_path)] + list(args)))


# ----------------------------------------------------------------------------- detection


def test_spike_detection_on_a_synthetic_series():
    det = SpikeDetector(factor=2.0, window=10, min_history=5)
    series = [6.0, 5.0, 4.2, 3.9, 3.7, 3.6, 3.5, 9.5, 3.4, 3.3, 8.0, 3.2]
    flags = [det.check(x) for x in series]
    # 9.5 > 2 x mean(6.0 .. 3.5) = 8.56: a spike. 8.0 later is below 2 x mean(6.0 .. 3.3, without 9.5) = 8.13
    assert flags == [False] * 7 + [True] + [False] * 4
    assert 9.5 not in det.history  # a spike does not raise the bar
    assert det.threshold() == pytest.approx(2.0 * sum(det.history) / len(det.history))
    quiet = SpikeDetector(factor=2.0, window=10, min_history=5)
    assert [quiet.check(x) for x in [5.0, 50.0]] == [False, False]  # no verdict before min_history losses
    assert not SpikeDetector(factor=0.0).enabled and SpikeDetector(factor=0.0).threshold() is None


@pytest.mark.parametrize("agreed", [False, True])
def test_step_guard_flags_nonfinite_and_spikes(agreed):
    """Both ways to the verdict: flags on the device (all-reduced when distributed), or, for values the
    training step already agreed over the ranks (``agreed``), on the host after the one transfer."""
    g = StepGuard(Guard(policy="skip_step", spike_factor=3.0, spike_window=4, spike_min_history=2), torch.device("cpu"))
    t = torch.tensor
    no = t(0.0) if agreed else False
    assert g.check(1, t(4.0), t(1.0), no, agreed=agreed).action == "update"
    assert g.check(2, t(4.0), t(1.0), no, agreed=agreed).action == "update"
    c = g.check(3, t(13.0), t(1.0), no, agreed=agreed)  # 13 > 3 x 4
    assert (c.action, c.event.kind, c.event.threshold) == ("skip", "spike", 12.0)
    c = g.check(4, t(4.0), t(float("inf")), no, agreed=agreed)  # finite loss, infinite grad norm
    assert (c.action, c.event.kind) == ("skip", "nonfinite")
    assert g.check(5, t(3.9), t(1.0), t(1.0) if agreed else True, agreed=agreed).stop_requested
    assert not g.check(6, t(3.9), t(1.0), no, agreed=agreed).stop_requested
    assert g.counters() == {"guard_nonfinite": 1, "guard_spikes": 1, "guard_skipped_steps": 2, "guard_rollbacks": 0}
    g.policy.max_consecutive = 1
    g.check(7, t(float("nan")), t(1.0), no, agreed=agreed)
    with pytest.raises(TrainingDivergedError, match="2 consecutive steps skipped"):
        g.check(8, t(float("nan")), t(1.0), no, agreed=agreed)


def agree_worker(args: dict) -> dict:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    g = StepGuard(Guard(policy="skip_step"), torch.device("cpu"))
    loss = torch.tensor(float("nan") if rank == 1 else 2.0)
    c = g.check(1, loss, torch.tensor(1.0), stop_requested=rank == 0)
    return {"rank": rank, "action": c.action, "stop": c.stop_requested}


def test_verdict_is_agreed_across_ranks():
    """Two gloo processes, only rank 1 sees a NaN (and only rank 0 a stop request): both decide alike."""
    outs = run_workers(agree_worker, 2, timeout=90)
    assert [(o["rank"], o["action"], o["stop"]) for o in outs] == [(0, "skip", True), (1, "skip", True)]


# ----------------------------------------------------------------------------- policies on an injected NaN


def test_raise_policy_stops_with_step_loss_and_grad_norm(tmp_path):
    t = trainer(tmp_path, "--training.steps", "4", "--guard.debug_inject_nan_at_step", "2")
    with pytest.raises(
        TrainingDivergedError, match=r"step 2: non-finite loss or gradient norm: loss nan, grad norm nan"
    ):
        t.train()
    assert t.state.step == 1
    for p in t.model.parameters():  # the poisoned update was never applied
        assert torch.isfinite(p).all()


# AdamW in both implementations, and Muon (its momentum buffers and the AdamW half it holds)
OPTIMIZERS = {
    "foreach": ["--optimizer.implementation", "foreach"],
    "fused": ["--optimizer.implementation", "fused"],
    "muon": ["--optimizer.name", "muon"],
}


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_skip_step_leaves_parameters_unchanged(tmp_path, optimizer):
    """With 2 accumulated micro-batches per step, the whole step 2 is dropped: no optimizer or LR step (also
    with the fused AdamW, which takes the clipping factor as grad_scale, and with Muon, whose momentum does not
    take the skipped step's gradient)."""
    t = trainer(
        tmp_path,
        *OPTIMIZERS[optimizer],
        "--training.steps",
        "4",
        "--training.global_batch_size",
        "4",
        "--guard.policy",
        "skip_step",
        "--guard.debug_inject_nan_at_step",
        "2",
    )
    assert t.grad_accum_steps == 2
    records = t.train()
    s1, s2, s3 = t.snapshots[:3]
    for name in s1:
        assert torch.equal(s1[name], s2[name]), name  # step 2 skipped: bit-identical parameters
    assert any(not torch.equal(s2[n], s3[n]) for n in s2)  # step 3 trained again
    assert all(torch.isfinite(p).all() for p in t.model.parameters())
    adam_steps = {float(s["step"]) for s in t.optimizer.state.values() if "step" in s}
    assert adam_steps == {3.0}  # 4 steps, one of them skipped
    if optimizer == "muon":  # the skipped step's NaN gradient never reached the momentum (it would stay in it)
        buffers = [s["momentum_buffer"] for s in t.optimizer.state.values() if "momentum_buffer" in s]
        assert buffers and all(torch.isfinite(b).all() for b in buffers)
    event = next(r for r in records if "guard_event" in r)
    assert (event["step"], event["guard_event"], event["guard_action"]) == (2, "nonfinite", "skip")
    losses = {r["step"]: r for r in records if "loss" in r}
    assert math.isnan(losses[2]["loss"]) and losses[4]["guard_skipped_steps"] == 1
    assert losses[3]["lr"] == losses[2]["lr"]  # the LR schedule did not advance on the skipped step


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_rollback_resumes_from_checkpoint_and_continues(tmp_path, optimizer):
    common = ["--training.steps", "6", "--checkpoint.interval", "2", *OPTIMIZERS[optimizer]]
    ref = trainer(tmp_path / "ref", *common)
    ref_records = ref.train()
    t = trainer(
        tmp_path / "run",
        *common,
        "--checkpoint.enable",
        "true",
        "--guard.policy",
        "rollback",
        "--guard.debug_inject_nan_at_step",
        "5",
        "--guard.rollback_lr_factor",
        "0.5",
        "--guard.rollback_lr_steps",
        "1",
    )
    records = t.train()
    ref_loss = {r["step"]: r for r in ref_records}
    loss = {r["step"]: r for r in records if "loss" in r}
    assert sorted(loss) == [1, 2, 3, 4, 5, 6] and t.state.step == 6
    for s in (1, 2, 3, 4):  # before the NaN: the same run
        assert loss[s]["loss"] == ref_loss[s]["loss"]
    # the batch of step 5 was skipped: post-rollback step 5 trains on the reference's step-6 batch
    assert len(ref.batches) == 6 and len(t.batches) == 7  # b1..b5 (NaN), rollback, b6, b7
    assert torch.equal(t.batches[5], ref.batches[5])
    assert loss[5]["lr"] == pytest.approx(0.5 * ref_loss[5]["lr"])  # LR factor for 1 step after the rollback
    assert loss[6]["lr"] == pytest.approx(ref_loss[6]["lr"])
    assert loss[6]["guard_rollbacks"] == 1 and loss[6]["guard_nonfinite"] == 1
    assert all(math.isfinite(r["loss"]) for r in loss.values())
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines if "loss" in x] == [1, 2, 3, 4, 5, 6]  # rewound: each step once
    assert [(x["step"], x["guard_action"]) for x in lines if "guard_event" in x] == [(5, "rollback")]


def test_rollback_without_a_checkpoint_stops(tmp_path):
    t = trainer(
        tmp_path, "--training.steps", "3", "--guard.policy", "rollback", "--guard.debug_inject_nan_at_step", "2"
    )
    with pytest.raises(TrainingDivergedError, match="no complete checkpoint to roll back to"):
        t.train()

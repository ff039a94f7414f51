"""One assembly: the Trainer's parts and ``build_training``'s, from the same config, are the same parts.

Built both ways on 2 gloo ranks from one config (the same seed first), the two must give: the learning rate of every
step of the run plan (a ``[training] tokens`` budget over a two-stage ``seq_len_schedule``, whose step count is not
``training.steps``), the float8 scale pre-compute after each optimizer step (FSDP 2 with float8 all-gather, on CPU),
the same initial weights, the same train-step options (accumulation, clipping, unmasked counting, the stop flag),
and bitwise the same first step's loss and gradient norm on the same batches; under pipeline parallelism, the same
pipeline split and again the same first step. The reference for the schedule is the run plan itself: the LR
schedule is built over ``run_plan.total_steps`` from the registered schedule, independently of both assemblies.
"""

from __future__ import annotations

import tempfile

import pytest
import torch

from tests.helpers.dist import run_workers
from tests.helpers.tiny import TINY_MODEL
from titanlite.models import load_config

BASE = [*TINY_MODEL, "--training.seq_len", "32", "--training.local_batch_size", "2", "--training.seed", "3"]
BASE += ["--checkpoint.enable", "false", "--lr_scheduler.warmup_steps", "2", "--training.steps", "5"]
FLOAT8 = ["--parallelism.data_parallel_shard_degree", "2", "--quantize.linear.float8.enable", "true"]
FLOAT8 += ["--quantize.linear.float8.enable_fsdp_float8_all_gather", "true", "--training.global_batch_size", "8"]
FLOAT8 += ["--training.tokens", "3000"]  # ~ 3000 / (8 x 16 or 8 x 32 tokens) steps: 16, not training.steps
PIPELINE = ["--model.n_layers", "4", "--parallelism.pipeline_parallel_degree", "2", "--training.loss_chunks", "2"]
PIPELINE += ["--parallelism.pipeline_parallel_schedule", "1F1B", "--parallelism.pipeline_parallel_microbatch_size", "1"]


def step_options(step) -> dict:
    """What a train step was built with, comparable across processes."""
    loss = step.loss
    return {
        "grad_accum_steps": step.grad_accum_steps,
        "max_norm": step.max_norm,
        "count_unmasked": step.count_unmasked,
        "stop_requested": None if step.stop_requested is None else step.stop_requested(),
        "autocast_dtype": str(step.autocast_dtype),
        "loss": (type(loss).__name__, getattr(loss, "chunks", 0), getattr(loss, "loss_parallel", False)),
        "pipeline": None if step.pipeline is None else step.pipeline.plan,
    }


def lr_curve(optimizer, scheduler, steps: int) -> list[float]:
    """The first group's learning rate at steps 1..``steps`` (the schedule stepped, the weights untouched)."""
    lrs = []
    for _ in range(steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        scheduler.step()
    return lrs


def first_step(step, batches: list[dict]) -> tuple[float, float]:
    """Loss and gradient norm of one optimizer step on ``batches``."""
    return step(iter(batches)).fetch()


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def compare(argv: list[str], dump: str) -> dict:
    """The Trainer's parts and ``build_training``'s for one config: what the test compares."""
    from titanlite import components
    from titanlite.trainer import Trainer
    from titanlite.trainer.assemble import RunFacts, build_training

    cfg = load_config([*argv, "--job.dump_folder", dump])
    trainer = Trainer(cfg)
    dims, total = trainer.parallel_dims, trainer.run_plan.total_steps
    torch.manual_seed(cfg.training.seed)
    parts = build_training(cfg, dims, trainer.device, trainer.tokenizer.vocab_size)  # a foreign loop's call
    weights = zip(trainer.model.state_dict().values(), parts.model.state_dict().values())
    sched = components.get("lr_scheduler", cfg.lr_scheduler.name)
    ref_opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=cfg.optimizer.lr)
    out = {
        "plan_steps": total,
        "reference_lr": lr_curve(ref_opt, sched(ref_opt, cfg.lr_scheduler, total), total),
        "library_lr": lr_curve(parts.optimizer, parts.lr_scheduler, total),
        "trainer_post_hooks": len(trainer.optimizer._optimizer_step_post_hooks),
        "library_post_hooks": len(parts.optimizer._optimizer_step_post_hooks),
        "same_weights": all(torch.equal(full(a), full(b)) for a, b in weights),
    }
    # the trainer's own facts (its data has no masked labels; its stop flag is the preemption handler's)
    facts = RunFacts(count_unmasked=trainer.count_unmasked, stop_requested=lambda: trainer.preemption.requested)
    torch.manual_seed(cfg.training.seed)
    again = build_training(cfg, dims, trainer.device, trainer.tokenizer.vocab_size, facts)
    out["trainer_step"], out["library_step"] = step_options(trainer.train_step), step_options(again.train_step)
    batches = [next(iter(trainer.train_loader)) for _ in range(trainer.grad_accum_steps)]
    out["trainer_first"] = first_step(trainer.train_step, batches)
    out["library_first"] = first_step(again.train_step, batches)
    out["trainer_lr"] = lr_curve(trainer.optimizer, trainer.lr_scheduler, total - 1)  # from step 2: one was run
    return out


def assembly_worker(args: dict) -> dict:
    results = {}
    for name, argv in args["configs"].items():
        with tempfile.TemporaryDirectory() as dump:
            results[name] = compare(argv, dump)
    return results


@pytest.mark.multiprocess
def test_the_trainer_and_build_training_assemble_the_same_parts(tmp_path):
    stages = tmp_path / "stages.toml"
    stages.write_text("[training]\nseq_len_schedule = [{seq_len = 16, fraction = 0.5}, {seq_len = 32}]\n")
    configs = {"float8_budget": ["--config", str(stages), *BASE, *FLOAT8], "pipeline": [*BASE, *PIPELINE]}
    per_rank = run_workers(assembly_worker, 2, {"configs": configs}, timeout=400)
    for rank, results in enumerate(per_rank):
        budget = results["float8_budget"]
        assert budget["plan_steps"] > 5  # the budget, not training.steps = 5, sets the run's length
        assert budget["library_lr"] == budget["reference_lr"], rank
        assert budget["trainer_lr"] == budget["reference_lr"][1:], rank
        assert budget["trainer_post_hooks"] == budget["library_post_hooks"] == 1, rank  # the float8 pre-compute
        assert budget["trainer_step"]["stop_requested"] is False and budget["trainer_step"]["grad_accum_steps"] == 2
        pipeline = results["pipeline"]["trainer_step"]
        assert pipeline["pipeline"] is not None and pipeline["loss"] == ("ChunkedLoss", 2, False)
        for name, res in results.items():
            assert res["same_weights"], (rank, name)
            assert res["library_step"] == res["trainer_step"], (rank, name)
            assert res["library_first"] == res["trainer_first"], (rank, name)


def test_eval_step_is_the_train_steps_forward_without_gradients():
    """``TrainStep.eval_step`` runs the model to the loss as the train step does (the same sum, bit for bit), without
    gradients; plain: ``cross_entropy_sum`` of the model's logits; chunked: that sum within fp32 summation order."""
    from titanlite.models.llama3 import Llama3ModelArgs, Transformer
    from titanlite.trainer.loss import cross_entropy_sum
    from titanlite.trainer.output_loss import output_loss
    from titanlite.trainer.runtime import Runtime
    from titanlite.trainer.step import TrainStep

    torch.manual_seed(0)
    model = Transformer(Llama3ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, max_seq_len=32))
    model.init_weights()
    tokens = torch.randint(0, 256, (2, 33))
    batch = {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]}
    with torch.no_grad():
        reference = cross_entropy_sum(model(batch["input_ids"]), batch["labels"])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    plain = TrainStep(model, optimizer)
    assert torch.equal(plain.eval_step(batch), reference)
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(plain.forward_backward(batch, 64), reference)  # the train path: the same sum
    chunked = TrainStep(model, optimizer, runtime=Runtime(torch.device("cpu"), loss=output_loss(cross_entropy_sum, 4)))
    assert chunked.eval_step(batch).item() == pytest.approx(reference.item(), rel=1e-6)

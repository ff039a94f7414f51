"""Assistant-only loss: ``TrainStep(count_unmasked=True)`` and validation with masked labels (-100).

References, independent of the code under test:

- a hand computation: log-softmax of the model's logits picked at the mask-1 positions, averaged over them;
- one big batch: 2 micro-batches with different unmasked counts give its gradients (fp32, 1e-6);
- one process: 2 gloo ranks (FSDP, TP with loss parallelism, 2 pipeline stages) give its losses over 3 updates;
- with the flag off, the old contract: the masked-label sum over every label (``numel``).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.helpers.dist import REPO, run_workers
from titanlite.data.chat import encode_conversations
from titanlite.models.llama3 import Llama3ModelArgs
from titanlite.tokenizer import build_byte_tokenizer
from titanlite.trainer.runtime import Runtime
from titanlite.trainer.step import TrainStep
from titanlite.trainer.validation import validation_loss

pytestmark = pytest.mark.usefixtures("one_thread")
SEQ = 48
ARGS = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=512, multiple_of=64, max_seq_len=SEQ)


def chat_batch(n: int, start: int = 0) -> dict[str, torch.Tensor]:
    """``n`` consecutive windows of the fixture conversations; labels -100 where the mask is 0."""
    tokens, mask, _ = encode_conversations(build_byte_tokenizer(), REPO / "tests/fixtures/chat/train.jsonl")
    rows = [slice(start + i * SEQ, start + (i + 1) * SEQ + 1) for i in range(n)]
    inputs = torch.stack([tokens[r][:-1] for r in rows])
    labels = torch.stack([tokens[r][1:].masked_fill(mask[r][1:] == 0, -100) for r in rows])
    return {"input_ids": inputs, "labels": labels}


def split(batch: dict, parts: int) -> list[dict]:
    return [dict(zip(batch, vals)) for vals in zip(*(v.chunk(parts) for v in batch.values()))]


def model_and_step(dims=None, **kw):
    from titanlite.models import get_model_spec
    from titanlite.parallel import build_parallel_model

    torch.manual_seed(0)
    model = build_parallel_model(get_model_spec("llama3"), Llama3ModelArgs(**ARGS), dims, device="cpu")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, TrainStep(model, optimizer, runtime=Runtime(torch.device("cpu"), dims), max_norm=0.0, **kw)


def pipelined_step(dims):
    from titanlite.models import get_model_spec
    from titanlite.parallel import build_parallel_model
    from titanlite.parallel.pipeline import PipelinePlan
    from titanlite.trainer.loss import cross_entropy_sum
    from titanlite.trainer.output_loss import LogitsLoss
    from titanlite.trainer.pipeline_runner import Pipeline

    plan = PipelinePlan(degree=dims.pp, schedule="1F1B", n_microbatches=2, stage_sizes=(1, 1))
    torch.manual_seed(0)
    model = build_parallel_model(get_model_spec("llama3"), Llama3ModelArgs(**ARGS), dims, device="cpu", pipeline=plan)
    runtime = Runtime(torch.device("cpu"), dims, loss=LogitsLoss(cross_entropy_sum))
    runtime = dataclasses.replace(runtime, pipeline=Pipeline(model, plan, runtime))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, TrainStep(model, optimizer, runtime=runtime, max_norm=0.0, count_unmasked=True)


def grads_of(step: TrainStep, batches: list[dict]):
    out = {}

    def keep(result):
        out["grads"] = [p.grad.detach().clone() for p in step.model.parameters()]
        result.action = "skip"

    result = step(iter(batches), before_update=keep)
    return result, out["grads"]


def test_assistant_only_loss_equals_a_hand_computation():
    batch = chat_batch(2)
    labels = batch["labels"]
    assert 0 < (labels != -100).sum() < labels.numel() // 4
    model, step = model_and_step(count_unmasked=True)
    with torch.no_grad():
        logp = model(batch["input_ids"]).float().log_softmax(-1)
    picked = [-logp[b, t, labels[b, t]] for b in range(2) for t in range(SEQ) if labels[b, t] != -100]
    expected = torch.stack(picked).mean()
    result = step(iter([batch]))
    torch.testing.assert_close(result.loss, expected, rtol=1e-6, atol=0)
    assert result.tokens == labels.numel() and result.extra["loss_tokens"] == len(picked)


def test_flag_off_keeps_the_old_divisor():
    batch = chat_batch(2)
    model, step = model_and_step()
    with torch.no_grad():
        logits = model(batch["input_ids"]).float()
    total = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), reduction="sum")
    result = step(iter([batch]))
    assert result.loss == total / batch["labels"].numel() and "loss_tokens" not in result.extra


def test_accumulation_with_unequal_masks_equals_one_big_batch():
    batch = chat_batch(4, start=300)
    counts = [int((b["labels"] != -100).sum()) for b in split(batch, 2)]
    assert counts[0] != counts[1], counts  # a per-micro-batch mean would weigh them wrongly
    _, big = model_and_step(count_unmasked=True)
    _, accum = model_and_step(count_unmasked=True, grad_accum_steps=2)
    big_result, big_grads = grads_of(big, [batch])
    acc_result, acc_grads = grads_of(accum, split(batch, 2))
    torch.testing.assert_close(acc_result.loss, big_result.loss, rtol=1e-6, atol=0)
    assert acc_result.extra["loss_tokens"] == big_result.extra["loss_tokens"] == sum(counts)
    for a, b in zip(acc_grads, big_grads):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_validation_counts_unmasked_labels_and_bytes():
    batch = chat_batch(2, start=100)
    labels = batch["labels"]
    model, _ = model_and_step()
    with torch.no_grad():
        logp = model(batch["input_ids"]).float().log_softmax(-1)
    keep = labels != -100
    nll = -logp.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)[keep]
    token_bytes = torch.ones(512, dtype=torch.int64)  # every label counts 1 byte: masked ones must count 0
    out = validation_loss(model, [batch], token_bytes=token_bytes)
    assert out["val_loss"] == pytest.approx(nll.mean().item(), rel=1e-6)
    assert out["val_bpb"] == pytest.approx(nll.sum().item() / torch.log(torch.tensor(2.0)).item() / keep.sum().item())


def dist_losses(args: dict) -> list[float]:
    """3 steps of assistant-only training on this rank's half of each batch (or all of it alone)."""
    from titanlite.parallel import ParallelDims, init_distributed, world_from_env

    world = world_from_env()
    init_distributed(world)
    dims = ParallelDims(tp=args["tp"], pp=args.get("pp", 1), world_size=world.world_size)
    dims.build_mesh("cpu")
    if dims.pp > 1:  # two stages of one block each, 2 microbatches through 1F1B
        _, step = pipelined_step(dims)
    else:
        _, step = model_and_step(dims, count_unmasked=True)
    dp_rank, dp = dims.dp_rank(world.rank), dims.dp_degree
    losses = []
    for i in range(3):
        batch = chat_batch(4, start=i * 4 * SEQ)
        mine = split(batch, dp)[dp_rank]
        losses.append(step(iter([mine])).loss_value)
    return losses


@pytest.mark.multiprocess
@pytest.mark.parametrize("tp, pp", [(1, 1), (2, 1), (1, 2)], ids=["fsdp2", "tp2", "pp2"])
def test_two_gloo_ranks_with_masks_equal_one_process(tp, pp):
    single = dist_losses({"tp": 1})
    results = run_workers(dist_losses, 2, {"tp": tp, "pp": pp}, timeout=240)
    assert results[0] == results[1]
    torch.testing.assert_close(torch.tensor(results[0]), torch.tensor(single), rtol=2e-5, atol=0)


def test_a_step_with_no_trainable_token_is_skipped_without_an_update(caplog):
    """Every label masked (an all-user window): no update at all, although AdamW's weight decay would move every
    matrix even with zero gradients; the LR schedule does not advance; the next step trains as usual."""
    empty = chat_batch(2)
    empty["labels"] = torch.full_like(empty["labels"], -100)
    model, step = model_and_step(count_unmasked=True)
    step.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    step.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(step.optimizer, lambda i: 1.0 / (i + 1))
    before = [p.detach().clone() for p in model.parameters()]
    called = []
    with caplog.at_level("WARNING", logger="titanlite"):
        result = step(iter([empty]), before_update=called.append, step=7)
    assert result.action == "skip" and result.extra["loss_tokens"] == 0 and not called
    assert torch.isnan(result.loss) and result.tokens == empty["labels"].numel()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert step.optimizer.param_groups[0]["lr"] == 1e-2 and "step 7: no label carries loss" in caplog.text
    result = step(iter([chat_batch(2)]))
    assert result.action == "update" and result.extra["loss_tokens"] > 0
    assert not all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


def test_validation_without_a_scored_token_says_so(caplog):
    """No loss of 0 / 0 = NaN, no bits per byte of 0: ``{"val_tokens": 0}``, and the hook's log line says it."""
    from titanlite.config.sections import Validation
    from titanlite.trainer.hooks import LoopState
    from titanlite.trainer.validation import ValidationHook, combine_validation

    batch = chat_batch(2)
    batch["labels"] = torch.full_like(batch["labels"], -100)
    model, _ = model_and_step()
    out = validation_loss(model, [batch], token_bytes=torch.ones(512, dtype=torch.int64))
    assert out == {"val_tokens": 0}
    state = LoopState(total_steps=1, step=1)
    with caplog.at_level("INFO", logger="titanlite"):
        ValidationHook(Validation(freq=1), lambda: out).on_step_end(state, None)
    assert state.records == [{"step": 1, "val_tokens": 0}] and "validation: no scored tokens" in caplog.text
    mixed = combine_validation({"a": (0.5, {"val_loss": 2.0, "val_perplexity": 7.4}), "b": (0.5, out)})
    assert mixed["val_loss"] == 2.0 and mixed["val_tokens/b"] == 0  # the mean over the sources that scored

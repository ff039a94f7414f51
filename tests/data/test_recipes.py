"""Training recipes end to end: a two-source mixture (accounting, per-source validation, exact resume),
an SFT stage started from a pretraining checkpoint with assistant-only loss, and packed conversations
kept apart by the block-causal mask."""

from __future__ import annotations

import json
import logging
import math
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.helpers.tiny import TINY_MODEL
from titanlite.data.chat import encode_conversations, render_conversation
from titanlite.data.recipe import SourceData, source_windows
from titanlite.models import load_config
from titanlite.train import main
from titanlite.trainer import Trainer
from titanlite.trainer.stages import StageHook

CHAT = Path(__file__).resolve().parents[1] / "fixtures" / "chat"
PACKAGE = Path(__file__).resolve().parents[2] / "titanlite"
BASE = [*TINY_MODEL, "--training.seq_len", "64", "--metrics.log_freq", "1", "--training.seed", "3"]
BASE += ["--lr_scheduler.warmup_steps", "1", "--training.local_batch_size", "4"]


def text_corpus(tmp_path: Path) -> Path:
    """A second corpus of real text: titanlite's own data modules."""
    folder = tmp_path / "corpus"
    folder.mkdir(exist_ok=True)
    for f in sorted((PACKAGE / "data").glob("*.py")):
        (folder / f"{f.stem}.txt").write_text(f.read_text())
    return folder


def mixture_toml(tmp_path: Path, corpus: Path, validation: bool = True) -> Path:
    body = f"""[training]
mixture = [{{dataset = "embedded", weight = 0.75}}, {{path = "{corpus}", weight = 0.25, name = "ours"}}]
"""
    if validation:
        body += f"""[validation]
enable = true
freq = 4
steps = 2
mixture = [{{dataset = "embedded", weight = 0.75}}, {{path = "{corpus}", weight = 0.25, name = "ours"}}]
"""
    path = tmp_path / "mixture.toml"
    path.write_text(body)
    return path


def records(dump: Path) -> list[dict]:
    return [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]


def train(dump: Path, *args: str) -> Trainer:
    trainer = Trainer(load_config(BASE + ["--job.dump_folder", str(dump), *args]))
    trainer.train()
    return trainer


def test_mixture_run_accounts_per_source_and_resumes_exactly(tmp_path):
    toml = mixture_toml(tmp_path, text_corpus(tmp_path))
    run = ["--config", str(toml), "--training.steps", "8", "--checkpoint.enable", "--checkpoint.interval", "4"]
    run += ["--checkpoint.last_save_model_only", "false"]
    full = train(tmp_path / "full", *run)
    steps = [r for r in records(tmp_path / "full") if "loss" in r]
    assert len(steps) == 8
    # tokens per source add up to the tokens seen, and follow the weights
    for r in steps:
        assert r["tokens_seen/embedded"] + r["tokens_seen/ours"] == r["tokens_seen"]
    share = steps[-1]["tokens_seen/ours"] / steps[-1]["tokens_seen"]
    n = 8 * 4  # windows
    assert abs(share - 0.25) < 4 * math.sqrt(0.25 * 0.75 / n)
    # validation reports each source and their weighted mean
    val = [r for r in records(tmp_path / "full") if "val_loss" in r]
    assert [v["step"] for v in val] == [4, 8]
    for v in val:
        assert v["val_loss"] == pytest.approx(0.75 * v["val_loss/embedded"] + 0.25 * v["val_loss/ours"], rel=1e-12)
    assert val[0]["val_loss/ours"] != val[0]["val_loss/embedded"]
    full.checkpointer.close()

    # resume from step 4: the same losses, bitwise, and the same accounting
    resumed = tmp_path / "resumed"
    (resumed / "checkpoint").mkdir(parents=True)
    shutil.copytree(tmp_path / "full" / "checkpoint" / "step-4", resumed / "checkpoint" / "step-4")
    train(resumed, *run)
    again = [r for r in records(resumed) if "loss" in r]
    for a, b in zip(again[-4:], steps[-4:]):
        assert a["step"] == b["step"]
        assert (a["loss"], a["tokens_seen/embedded"], a["tokens_seen/ours"]) == (
            b["loss"],
            b["tokens_seen/embedded"],
            b["tokens_seen/ours"],
        )


def test_a_source_that_runs_out_stops_the_run_with_one_line(tmp_path, caplog):
    small = tmp_path / "small"
    small.mkdir()
    (small / "a.txt").write_text("x" * 400)  # 6 windows of 65 tokens
    toml = tmp_path / "m.toml"
    toml.write_text(
        f'[training]\nmixture_on_exhausted = "stop"\n'
        f'mixture = [{{dataset = "embedded", weight = 0.5}}, {{path = "{small}", weight = 0.5}}]\n'
    )
    with pytest.raises(SystemExit) as e, caplog.at_level(logging.INFO, logger="titanlite"):
        main(BASE + ["--job.dump_folder", str(tmp_path / "run"), "--config", str(toml), "--training.steps", "20"])
    assert e.value.code == 1
    out = caplog.text
    assert "training stopped: training data source 'small' ran out after 1 epoch(s) of 6 windows" in out


def first_batch_loss(model, tokenizer, seq_len: int) -> float:
    """The assistant-only loss of the first SFT batch, computed here from the conversations themselves."""
    tokens, mask, offsets = encode_conversations(tokenizer, CHAT / "train.jsonl")
    data = SourceData("chat", tokens, mask, offsets)
    eos = tokenizer.eos_id
    windows = source_windows(data, seq_len, loss_mask="assistant", eos_id=eos, pad_id=eos, seed=3, batch_size=4)
    it = iter(windows)
    batch = [next(it) for _ in range(4)]
    inputs = torch.stack([b["input_ids"] for b in batch])
    labels = torch.stack([b["labels"] for b in batch])
    doc = torch.stack([b["document_ids"] for b in batch])
    with torch.no_grad():
        logits = model(inputs, document_ids=doc)
    logp = F.log_softmax(logits.float(), -1)
    keep = labels != -100
    return float(-logp[keep].gather(-1, labels[keep][:, None]).mean())


def test_sft_stage_from_a_pretraining_checkpoint_trains_on_assistant_tokens(tmp_path):
    pre = ["--training.steps", "4", "--checkpoint.enable", "--checkpoint.interval", "4"]
    train(tmp_path / "pretrain", *pre)
    seed = tmp_path / "pretrain" / "checkpoint" / "step-4"
    sft = ["--training.dataset", "chat", "--training.dataset_path", str(CHAT / "train.jsonl")]
    sft += ["--training.loss_mask", "assistant", "--model.attn_mask_type", "block_causal"]
    sft += ["--checkpoint.initial_load_path", str(seed), "--training.steps", "12", "--optimizer.lr", "1e-2"]
    trainer = Trainer(load_config(BASE + ["--job.dump_folder", str(tmp_path / "sft"), *sft]))
    trainer.resume()
    expected = first_batch_loss(trainer.model, trainer.tokenizer, 64)
    trainer.train()
    steps = [r for r in records(tmp_path / "sft") if "loss" in r]
    assert steps[0]["loss"] == pytest.approx(expected, rel=1e-5)  # the loaded weights, assistant tokens only
    assert 0 < steps[0]["loss_tokens"] < steps[0]["tokens_seen"]
    assert trainer.state.step == 12 and sum(r["loss"] for r in steps[-3:]) / 3 < 0.8 * steps[0]["loss"]


def test_packed_conversations_do_not_attend_to_each_other(tmp_path):
    """Block-causal packing: a conversation's logits do not depend on the one before it in its window
    (with plain causal attention they do: the check has teeth)."""
    trainer = Trainer(
        load_config(BASE + ["--job.dump_folder", str(tmp_path), "--model.attn_mask_type", "block_causal"])
    )
    tok, model = trainer.tokenizer, trainer.model
    convs = [
        [{"role": "user", "content": "Reverse: catdog"}, {"role": "assistant", "content": "godtac"}],
        [{"role": "user", "content": "Reverse: dogcat"}, {"role": "assistant", "content": "tacgod"}],  # same length
        [{"role": "user", "content": "Uppercase: moon"}, {"role": "assistant", "content": "MOON"}],
    ]
    ids = [render_conversation(tok, c)[0] + [tok.eos_id] for c in convs]
    assert len(ids[0]) == len(ids[1])
    first, second = torch.tensor([ids[0] + ids[2]]), torch.tensor([ids[1] + ids[2]])
    from titanlite.data.windows import document_ids

    with torch.no_grad():
        a = model(first, document_ids=document_ids(first, tok.eos_id))
        b = model(second, document_ids=document_ids(second, tok.eos_id))
        one_doc = torch.zeros_like(first)  # one document: plain causal attention
        causal_a, causal_b = model(first, document_ids=one_doc), model(second, document_ids=one_doc)
    tail = slice(len(ids[0]), None)
    assert torch.equal(a[0, tail], b[0, tail])
    assert not torch.allclose(causal_a[0, tail], causal_b[0, tail])


def stages_toml(tmp_path: Path) -> Path:
    path = tmp_path / "stages.toml"
    path.write_text("[training]\nseq_len_schedule = [{seq_len = 32, fraction = 0.5}, {seq_len = 64}]\n")
    return path


def test_seq_len_schedule_switches_mid_run_and_resumes_exactly_across_the_switch(tmp_path, caplog):
    run = ["--config", str(stages_toml(tmp_path)), "--training.steps", "6", "--checkpoint.enable"]
    run += ["--checkpoint.interval", "2", "--checkpoint.last_save_model_only", "false"]
    with caplog.at_level(logging.INFO, logger="titanlite"):
        full = train(tmp_path / "full", *run)
    steps = [r for r in records(tmp_path / "full") if "loss" in r]
    # the global batch in tokens is constant: 4 x 64 = 8 x 32 tokens per step
    assert [r["tokens_seen"] for r in steps] == [256 * k for k in range(1, 7)]
    assert "stage 2 of 2 from step 4: seq_len 64, 4 sequences per micro-batch" in caplog.text
    # MFU follows each stage's FLOPs per token (attention grows with seq_len)
    assert full.stage_flops[0] < full.stage_flops[1]
    full.checkpointer.close()
    # a checkpoint in stage 1 (step 2) resumed: the switch at step 4 and every loss as uninterrupted
    resumed = tmp_path / "resumed"
    (resumed / "checkpoint").mkdir(parents=True)
    shutil.copytree(tmp_path / "full" / "checkpoint" / "step-2", resumed / "checkpoint" / "step-2")
    train(resumed, *run)
    again = {r["step"]: r["loss"] for r in records(resumed) if "loss" in r}
    assert again == {r["step"]: r["loss"] for r in steps if r["step"] > 2}


def test_stage_batches_have_the_stage_shape(tmp_path):
    trainer = Trainer(load_config(BASE + ["--job.dump_folder", str(tmp_path), "--config", str(stages_toml(tmp_path))]))
    stages = next(h for h in trainer.hooks if isinstance(h, StageHook))
    stages.enter(1)
    first = next(iter(trainer.train_loader))
    stages.enter(trainer.run_plan.stages[1].first_step)
    second = next(iter(trainer.train_loader))
    assert first["input_ids"].shape == (8, 32) and second["input_ids"].shape == (4, 64)


def test_a_token_budget_stops_at_exactly_the_budget(tmp_path, caplog):
    budget = 5 * 4 * 64  # 5 steps of 4 sequences x 64 tokens
    with caplog.at_level(logging.INFO, logger="titanlite"):
        trainer = train(tmp_path / "run", "--training.tokens", str(budget), "--training.steps", "1000")
    assert trainer.state.step == 5 and trainer.state.tokens_seen == budget
    assert (
        "5 steps x 256 tokens (local batch 4 x dp 1 x grad accumulation 1 x seq_len 64) = 1,280 tokens" in caplog.text
    )
    assert "token budget training.tokens = 1,280: 5 steps train 1,280 tokens, exactly the budget" in caplog.text
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["tokens_seen"] == budget


def test_prepared_chat_shards_train_exactly_like_the_raw_conversations(tmp_path):
    """titanlite prepare --format chat + dataset = "shards" gives the losses of dataset = "chat"
    on the same JSONL (same conversations, same packing and masks); a mixture source of such shards
    made with another tokenizer is refused, naming the folder."""
    from titanlite.data.prepare import prepare

    shards = tmp_path / "shards"
    prepare(CHAT / "train.jsonl", shards, "", file_format="chat", log=None)
    common = ["--training.loss_mask", "assistant", "--model.attn_mask_type", "block_causal", "--training.steps", "3"]
    raw = train(
        tmp_path / "raw", *common, "--training.dataset", "chat", "--training.dataset_path", str(CHAT / "train.jsonl")
    )
    prepared = train(tmp_path / "prep", *common, "--training.dataset", "shards", "--training.dataset_path", str(shards))
    assert [r["loss"] for r in raw.state.records if "loss" in r] == [
        r["loss"] for r in prepared.state.records if "loss" in r
    ]

    from tests.helpers.shared_data import shared_file

    toml = tmp_path / "m.toml"
    toml.write_text(f'[training]\nmixture = [{{path = "{shards}", weight = 1.0}}]\n')
    other = ["--model.tokenizer_path", str(shared_file("tokenizers/test_tiktoken.model"))]
    with pytest.raises(ValueError, match=f"{shards}.*tokenizer"):
        Trainer(load_config(BASE + ["--job.dump_folder", str(tmp_path / "x"), "--config", str(toml), *other]))


def test_shipped_midtrain_and_sft_configs_run_from_a_pretraining_checkpoint(tmp_path, monkeypatch):
    """train_configs/debug_{model,midtrain,sft}.toml chain: a (short) pretraining run's final checkpoint
    seeds both stages, which run their mixture / chat data with the configs' own paths."""
    repo = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(repo)  # the configs name tests/fixtures/chat/... relative to the repository

    def run(config: str, *extra: str) -> Trainer:
        args = ["--config", str(repo / "train_configs" / config), "--job.dump_folder", str(tmp_path / config)]
        args += ["--metrics.enable_tensorboard", "false", "--lr_scheduler.warmup_steps", "1", *extra]
        trainer = Trainer(load_config(args))
        trainer.train()
        return trainer

    short = ["--training.steps", "2", "--training.global_batch_size", "8", "--validation.steps", "1"]
    run("debug_model.toml", *short, "--checkpoint.interval", "2")
    seed = str(tmp_path / "debug_model.toml" / "checkpoint" / "step-2")
    later = [*short, "--checkpoint.interval", "2", "--checkpoint.initial_load_path", seed, "--sampling.enable", "false"]
    mid = run("debug_midtrain.toml", *later, "--validation.freq", "2")
    last = [r for r in mid.state.records if "loss" in r][-1]
    assert last["tokens_seen/chat"] + last["tokens_seen/embedded"] == last["tokens_seen"] == 2 * 8 * 256
    assert {"val_loss/chat", "val_loss/embedded"} <= set([r for r in mid.state.records if "val_loss" in r][-1])
    sft = run("debug_sft.toml", *later, "--validation.freq", "2")
    record = [r for r in sft.state.records if "loss" in r][-1]
    assert 0 < record["loss_tokens"] < record["tokens_seen"] / 2  # the assistant's tokens only


def test_assistant_loss_needs_chat_training_data_but_validation_may_be_plain_text(tmp_path):
    with pytest.raises(ValueError, match="training.loss_mask = 'assistant' needs chat data, but no training source"):
        Trainer(load_config(BASE + ["--job.dump_folder", str(tmp_path / "a"), "--training.loss_mask", "assistant"]))
    sft = ["--training.dataset", "chat", "--training.dataset_path", str(CHAT / "train.jsonl")]
    sft += ["--training.loss_mask", "assistant", "--model.attn_mask_type", "block_causal", "--training.steps", "1"]
    sft += ["--validation.enable", "--validation.steps", "1"]  # the embedded corpus: forgetting is watched
    trainer = train(tmp_path / "b", *sft)
    assert [r["val_loss"] for r in trainer.state.records if "val_loss" in r][0] > 0


def test_a_missing_mixture_source_is_named_by_its_key(tmp_path, capsys):
    mixture = f'[{{dataset = "embedded", weight = 1}}, {{path = "{tmp_path / "nope.txt"}", weight = 1}}]'
    with pytest.raises(SystemExit) as e:
        main(BASE + ["--job.dump_folder", str(tmp_path / "run"), "--training.mixture", mixture])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "training.mixture[1] (source 'nope'): " in err[0] and "nope.txt: input not found" in err[0]


def test_a_token_budget_resumed_with_another_batch_trains_the_remaining_tokens(tmp_path, caplog):
    """640 tokens: 3 steps of 128 tokens saved, then resumed with 256 tokens per step: 1 more step makes the
    640 (the plan used to count 640 / 256 = 3 steps from zero, call the run complete and stop at 384)."""
    dump, save = tmp_path / "run", ["--checkpoint.enable", "true", "--checkpoint.last_save_model_only", "false"]
    first = train(dump, *save, "--training.tokens", "384", "--training.local_batch_size", "2")
    assert (first.state.step, first.state.tokens_seen) == (3, 384)
    with caplog.at_level(logging.INFO, logger="titanlite"):
        second = train(dump, *save, "--training.tokens", "640", "--training.local_batch_size", "4")
    assert (second.state.step, second.state.tokens_seen) == (4, 640)
    assert "resumed at step 3 with 384 tokens seen (not this config's 768: the batch changed)" in caplog.text
    assert "token budget training.tokens = 640: 4 steps train 640 tokens, exactly the budget" in caplog.text


@pytest.mark.parametrize("case", ["all_user", "truncated"])
def test_chat_data_with_no_trainable_token_is_refused_at_start(tmp_path, capsys, case):
    """loss_mask = "assistant" on conversations that leave nothing to train on (no assistant turn, or replies
    past seq_len + 1 = 65 tokens): one line and exit 2, before any step (it trained with a loss of 0.0 while
    weight decay moved the weights). An empty reply still trains its <|eot_id|> (the chat template's mask)."""
    user = {"role": "user", "content": "x" * (80 if case == "truncated" else 5)}
    reply = [] if case == "all_user" else [{"role": "assistant", "content": "ok"}]
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": [user, *reply]}) + "\n" for _ in range(20)))
    sft = ["--training.dataset", "chat", "--training.dataset_path", str(data), "--training.loss_mask", "assistant"]
    with pytest.raises(SystemExit) as e:
        main(BASE + ["--job.dump_folder", str(tmp_path / "run"), "--model.attn_mask_type", "block_causal", *sft])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1, err
    assert "training data has no token to train on with training.loss_mask = 'assistant'" in err[0]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()

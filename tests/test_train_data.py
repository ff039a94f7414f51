"""Training from prepared shards (test tokenizer, tinyshakespeare), block-causal masking, dataset errors."""

import json

import pytest
from shared_data import shared_file
from tiny import TINY_MODEL

from titanlite.data.prepare import prepare
from titanlite.models import load_config
from titanlite.train import Trainer

TINY = [
    *TINY_MODEL,
    "--training.seq_len",
    "64",
    "--training.local_batch_size",
    "8",
    "--metrics.log_freq",
    "5",
]


@pytest.fixture(scope="module")
def shakespeare_shards(tmp_path_factory):
    out = tmp_path_factory.mktemp("shards")
    tok = shared_file("tokenizers/test_tiktoken.model")
    prepare(shared_file("text/tinyshakespeare.txt"), out, str(tok), val_fraction=0.05, txt_split="paragraphs", log=None)
    return out, tok


def test_training_on_shards_lowers_validation_loss(shakespeare_shards, tmp_path):
    shards, tok = shakespeare_shards
    cfg = load_config(
        TINY
        + [
            "--model.tokenizer_path",
            str(tok),
            "--model.attn_mask_type",
            "block_causal",
            "--training.dataset",
            "shards",
            "--training.dataset_path",
            str(shards),
            "--validation.enable",
            "--validation.dataset",
            "shards",
            "--validation.dataset_path",
            str(shards),
            "--validation.freq",
            "30",
            "--validation.steps",
            "4",
            "--training.steps",
            "60",
            "--optimizer.lr",
            "3e-3",
            "--lr_scheduler.warmup_steps",
            "5",
            "--job.dump_folder",
            str(tmp_path),
        ]
    )
    trainer = Trainer(cfg)
    assert trainer.model_args.vocab_size == 2256  # 2,000 ranks + 256 Llama 3 specials
    records = trainer.train()
    val = [r["val_loss"] for r in records if "val_loss" in r]
    assert len(val) == 2 and val[1] < val[0] - 0.3, val
    train = [r["loss"] for r in records if "loss" in r]
    assert train[-1] < train[0] - 1.5


def test_shards_with_other_tokenizer_are_refused(shakespeare_shards, tmp_path):
    shards, _ = shakespeare_shards
    cfg = load_config(
        TINY
        + ["--training.dataset", "shards", "--training.dataset_path", str(shards), "--job.dump_folder", str(tmp_path)]
    )
    with pytest.raises(ValueError, match="vocabulary of 2256 tokens but model.tokenizer_path gives 512"):
        Trainer(cfg)


def test_text_dataset_tokenizes_on_the_fly(tmp_path):
    src = tmp_path / "docs.jsonl"
    src.write_text("\n".join(json.dumps({"text": f"document {i} " * 50}) for i in range(40)))
    cfg = load_config(
        TINY
        + [
            "--training.dataset",
            "text",
            "--training.dataset_path",
            str(src),
            "--training.steps",
            "3",
            "--lr_scheduler.warmup_steps",
            "1",
            "--job.dump_folder",
            str(tmp_path / "run"),
        ]
    )
    records = Trainer(cfg).train()
    assert len([r for r in records if "loss" in r]) == 2  # steps 1 and 3 (log_freq 5)

"""Training from prepared shards (test tokenizer, tinyshakespeare), block-causal masking, dataset errors."""

import base64
import json
import sys
from pathlib import Path

import pytest

from tests.helpers.launch import run_python
from tests.helpers.shared_data import shared_file
from tests.helpers.tiny import TINY_MODEL
from titanlite.config import parse_args_or_exit
from titanlite.data.loader import load_token_store
from titanlite.data.prepare import prepare
from titanlite.models import load_config
from titanlite.tokenizer import build_tokenizer, tokenizer_fingerprint
from titanlite.trainer import Trainer

REPO = Path(__file__).resolve().parents[2]

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
    with pytest.raises(ValueError, match=r"2256 tokens, fingerprint .*'bytes' \(built-in, 512 tokens"):
        Trainer(cfg)


def swapped_tokenizer(src: Path, dst: Path) -> Path:
    """``src`` with the tokens of ranks 97 and 101 ('a' and 'e') swapped: a valid tokenizer of the same
    size in which those two ids mean each other's byte."""
    lines = src.read_bytes().splitlines()
    (a, ra), (e, re_) = lines[97].split(), lines[101].split()
    assert {base64.b64decode(a), base64.b64decode(e)} == {b"a", b"e"}
    lines[97], lines[101] = e + b" " + ra, a + b" " + re_
    dst.write_bytes(b"\n".join(lines) + b"\n")
    return dst


def test_shards_of_a_same_size_tokenizer_are_refused(shakespeare_shards, tmp_path, caplog):
    shards, tok_path = shakespeare_shards
    other_path = swapped_tokenizer(tok_path, tmp_path / "swapped.model")
    tok, other = build_tokenizer(str(tok_path)), build_tokenizer(str(other_path))
    assert tok.vocab_size == other.vocab_size == 2256
    assert tok.encode("tea") != other.encode("tea")  # same size, different meaning of the ids
    assert tokenizer_fingerprint(other) != tokenizer_fingerprint(tok)
    copy = build_tokenizer(str(swapped_tokenizer(other_path, tmp_path / "back.model")))  # swapped back: equal
    assert tokenizer_fingerprint(copy) == tokenizer_fingerprint(tok)
    assert len(load_token_store("shards", str(shards), "train", copy)) > 0
    with pytest.raises(ValueError) as e:
        load_token_store("shards", str(shards), "val", other)
    msg = str(e.value)
    assert (
        msg.startswith(f"{shards / 'manifest.json'}: shards were tokenized with 'test_tiktoken.model' ")
        and "\n" not in msg
    )
    assert f"is 'swapped.model' ({other_path}, 2256 tokens, fingerprint {tokenizer_fingerprint(other)[:19]})" in msg
    cfg = load_config(
        TINY
        + ["--model.tokenizer_path", str(other_path), "--training.dataset", "shards"]
        + ["--training.dataset_path", str(shards), "--job.dump_folder", str(tmp_path / "run")]
    )
    with pytest.raises(ValueError, match="swapped.model"):
        Trainer(cfg)

    old = tmp_path / "old_shards"  # a manifest from before fingerprints: matched by size only, with a warning
    old.mkdir()
    for p in shards.iterdir():
        (old / p.name).symlink_to(p)
    manifest = json.loads((shards / "manifest.json").read_text())
    del manifest["tokenizer"]["fingerprint"]
    (old / "manifest.json").unlink()
    (old / "manifest.json").write_text(json.dumps(manifest))
    with caplog.at_level("WARNING", logger="titanlite.data.shards"):
        assert len(load_token_store("shards", str(old), "val", other)) > 0
    assert "no tokenizer fingerprint (prepared by an older titanlite)" in caplog.text


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


@pytest.mark.parametrize("section", ["training", "validation"])
def test_dataset_path_with_embedded_is_refused(section, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args_or_exit(
            ["--config", str(REPO / "train_configs" / "debug_model.toml"), f"--{section}.dataset_path", "x"]
        )
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1, err
    default = "'embedded'" if section == "training" else "'' (the training data's held-out split)"
    assert err[0].startswith(f"error: {section}.dataset_path = 'x' is ignored by {section}.dataset = {default}")
    assert f"set {section}.dataset = 'shards' or 'text'" in err[0]
    cfg = parse_args_or_exit([f"--{section}.dataset", "text", f"--{section}.dataset_path", "x"])  # the fix works
    assert getattr(cfg, section).dataset_path == "x"


def test_dataset_path_with_embedded_refused_by_the_launcher(tmp_path):
    cmd = [sys.executable, "-m", "titanlite.train", "--config", "train_configs/debug_model.toml"]
    cmd += ["--training.dataset_path", str(tmp_path), "--job.dump_folder", str(tmp_path / "run")]
    r = run_python(cmd, cwd=REPO, timeout=120)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0, r.stderr
    assert "training.dataset_path" in r.stderr and "training.dataset = 'embedded'" in r.stderr
    assert not (tmp_path / "run").exists()  # refused before anything was written


def test_validation_follows_the_training_shards_unless_set(shakespeare_shards, tmp_path, caplog):
    """The debug config trained on shards validates on their val split (it measured the built-in Python source,
    silently): the same figure as naming the split explicitly. Raw text has no held-out split: the built-in
    corpus, with a warning saying so."""
    import logging

    shards, tok = shakespeare_shards
    base = ["--config", str(REPO / "train_configs/debug_model.toml"), *TINY, "--model.tokenizer_path", str(tok)]
    base += ["--training.dataset", "shards", "--training.dataset_path", str(shards), "--validation.steps", "2"]

    def first_validation(*extra: str) -> float:
        trainer = Trainer(load_config(base + ["--job.dump_folder", str(tmp_path / str(len(extra))), *extra]))
        return trainer.validate()["val_loss"]

    with caplog.at_level(logging.INFO, logger="titanlite"):
        followed = first_validation()
    assert f"validation reads the held-out split of the training data (shards {shards})" in caplog.text
    assert followed == first_validation("--validation.dataset", "shards", "--validation.dataset_path", str(shards))
    assert followed != first_validation("--validation.dataset", "embedded")
    caplog.clear()
    text = ["--training.dataset", "text", "--training.dataset_path", str(shared_file("text/tinyshakespeare.txt"))]
    with caplog.at_level(logging.INFO, logger="titanlite"):
        assert Trainer(load_config(base + ["--job.dump_folder", str(tmp_path / "text"), *text])).val_loaders
    warned = [r for r in caplog.records if r.levelname == "WARNING" and "validation reads" in r.message]
    assert len(warned) == 1 and "the built-in corpus (Python source): training.dataset = 'text' has no held-out" in (
        warned[0].message
    )


def test_a_val_only_folder_is_a_validation_dataset_path(shakespeare_shards, tmp_path, capsys):
    """``titanlite prepare --val-only`` writes every document to the 'val' split: the same shards as
    ``--val-fraction 1.0``, and a folder that ``[validation] dataset_path`` reads (a folder without that split is
    refused with the flag to use). Both flags at once are a usage error."""
    from titanlite.data import prepare as prep

    shards, tok = shakespeare_shards
    text = tmp_path / "held_out.txt"
    text.write_text(shared_file("text/tinyshakespeare.txt").read_text()[-30000:])
    common = ["--input", str(text), "--tokenizer", str(tok), "--txt-split", "paragraphs", "--workers", "1", "--quiet"]
    assert prep.main([*common, "--output", str(tmp_path / "val_only"), "--val-only"]) == 0
    assert prep.main([*common, "--output", str(tmp_path / "all_val"), "--val-fraction", "1.0"]) == 0
    manifest = json.loads((tmp_path / "val_only" / "manifest.json").read_text())
    assert manifest["totals"]["train"]["docs"] == 0 and manifest["totals"]["val"]["docs"] > 100
    for f in sorted((tmp_path / "all_val").glob("*.bin")):
        assert (tmp_path / "val_only" / f.name).read_bytes() == f.read_bytes(), f.name
    with pytest.raises(SystemExit):
        prep.main([*common, "--output", str(tmp_path / "both"), "--val-only", "--val-fraction", "0.5"])
    assert "not allowed with argument" in capsys.readouterr().err

    base = [*TINY, "--model.tokenizer_path", str(tok), "--training.dataset", "shards"]
    base += ["--training.dataset_path", str(shards), "--validation.enable", "--validation.steps", "2"]
    base += ["--validation.dataset", "shards", "--job.dump_folder", str(tmp_path / "run")]

    def first_validation(folder) -> float:
        return Trainer(load_config([*base, "--validation.dataset_path", str(folder)])).validate()["val_loss"]

    assert first_validation(tmp_path / "val_only") == first_validation(tmp_path / "all_val")
    assert prep.main([*common, "--output", str(tmp_path / "train_only")]) == 0
    with pytest.raises(ValueError, match="split 'val' has no shards .*titanlite prepare --val-only"):
        first_validation(tmp_path / "train_only")

"""A mixture with chat data and the assistant-only loss on 2 data-parallel ranks (FSDP, gloo) equals one
process: the same losses (summation order aside) and the same per-source token counts, exactly."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from tests.helpers.dist import cache_token_stores, run_workers
from tests.helpers.tiny import TINY_MODEL
from titanlite.models import load_config
from titanlite.trainer import Trainer

CHAT = Path(__file__).resolve().parents[1] / "fixtures" / "chat" / "train.jsonl"
RTOL = 2e-5  # fp32, summation order only (tests/parallel/test_parallel_parity.py explains the figure)


def config(tmp: str, dp: int) -> object:
    toml = Path(tmp) / "mix.toml"
    sources = f'{{path = "{CHAT}", weight = 0.6, name = "chat"}}, {{dataset = "embedded", weight = 0.4}}'
    toml.write_text(f"[training]\nmixture = [{sources}]\n")
    args = [*TINY_MODEL, "--config", str(toml), "--job.dump_folder", str(Path(tmp) / "run"), "--training.seq_len", "64"]
    args += ["--training.loss_mask", "assistant", "--model.attn_mask_type", "block_causal", "--training.steps", "4"]
    args += [
        "--training.global_batch_size",
        "8",
        "--training.local_batch_size",
        str(8 // dp),
        "--metrics.log_freq",
        "1",
    ]
    args += ["--lr_scheduler.warmup_steps", "1", "--optimizer.lr", "3e-3", "--training.seed", "5"]
    if dp > 1:
        args += ["--parallelism.data_parallel_shard_degree", str(dp)]
    return load_config(args)


def run(cfg, seed_state) -> dict:
    from titanlite.parallel.state_dict import load_full_state_dict

    trainer = Trainer(cfg)
    load_full_state_dict(trainer.model, seed_state)
    records = [r for r in trainer.train() if "loss" in r]
    keys = ("loss", "grad_norm", "loss_tokens", "tokens_seen/chat", "tokens_seen/embedded")
    return {k: [r[k] for r in records] for k in keys}


def worker(args: dict) -> dict:
    import tempfile

    cache_token_stores()
    with tempfile.TemporaryDirectory() as tmp:
        return run(config(tmp, 2), args["seed"])


@pytest.mark.multiprocess
def test_mixture_with_assistant_loss_on_two_ranks_equals_one_process(tmp_path):
    cache_token_stores()
    single = Trainer(config(str(tmp_path), 1))
    seed = copy.deepcopy(single.model.state_dict())
    single.run_lock.release()
    (tmp_path / "ref").mkdir()
    reference = run(config(str(tmp_path / "ref"), 1), seed)
    ranks = run_workers(worker, 2, {"seed": seed}, timeout=240)
    for got in ranks:
        for key in ("loss_tokens", "tokens_seen/chat", "tokens_seen/embedded"):
            assert got[key] == reference[key], key
        for key in ("loss", "grad_norm"):
            a, b = torch.tensor(got[key], dtype=torch.float64), torch.tensor(reference[key], dtype=torch.float64)
            assert ((a - b).abs() / b.abs()).max().item() <= RTOL, (key, a, b)
    assert 0 < reference["tokens_seen/chat"][-1] and 0 < reference["tokens_seen/embedded"][-1]

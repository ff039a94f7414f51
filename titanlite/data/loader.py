"""Building resumable data loaders from the ``[training]`` / ``[validation]`` config."""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from titanlite.data.embedded import embedded_token_stream
from titanlite.data.encode import encode_documents
from titanlite.data.shards import ShardedTokens
from titanlite.data.sources import iter_documents
from titanlite.data.windows import CHANGE_OF_KIND, TokenWindows
from titanlite.errors import DataError
from titanlite.tokenizer import Tokenizer


def load_token_store(dataset: str, path: str, split: str, tokenizer: Tokenizer) -> Any:
    """The token stream of a dataset kind and split, as BOS + document + EOS runs: ``embedded`` (the built-in
    corpus), ``shards`` (a prepared folder, :mod:`titanlite.data.shards`) or ``text`` (files tokenized in memory at
    start, small data only; the whole ``path`` is the requested split, so give validation its own path)."""
    if dataset == "embedded":
        return embedded_token_stream(tokenizer, split)
    if dataset == "shards":
        return ShardedTokens(path, split, tokenizer=tokenizer)
    if dataset == "text":
        docs = list(iter_documents(path))
        if not docs:
            raise DataError(f"no documents found in {path}")
        return torch.from_numpy(encode_documents(tokenizer, docs)[0])
    raise DataError(f"unknown dataset kind {dataset!r}; expected embedded, shards or text")


class ResumableDataLoader(StatefulDataLoader):
    """A StatefulDataLoader that refuses, in one line, the state of a staged loader (``training.seq_len_schedule``,
    :class:`~titanlite.data.staged.StagedLoader`) instead of failing inside torchdata on its unknown keys."""

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if isinstance(state_dict, dict) and {"stage", "loader"} <= set(state_dict):
            raise DataError(
                "cannot resume the training data: the checkpoint was saved with training.seq_len_schedule (in stage "
                f"{int(state_dict['stage']) + 1}) and this run has none; {CHANGE_OF_KIND}"
            )
        super().load_state_dict(state_dict)


def build_dataloader(
    store: Any,
    *,
    dataset: Any = None,
    seq_len: int = 0,
    batch_size: int,
    dp_rank: int = 0,
    dp_world: int = 1,
    seed: int = 0,
    train: bool = True,
    eos_id: int | None = None,
    num_workers: int = 0,
    name: str = "train",
) -> ResumableDataLoader:
    """A :class:`ResumableDataLoader` over shuffled (train) or sequential (validation) windows of ``store`` (or
    ``dataset``, e.g. a :class:`~titanlite.data.mixture.MixtureWindows`): batches of ``input_ids``, ``labels`` and,
    with ``eos_id``, ``document_ids``."""
    kwargs = dict(dp_rank=dp_rank, dp_world=dp_world, seed=seed, batch_size=batch_size, eos_id=eos_id, name=name)
    windows = dataset if dataset is not None else TokenWindows(store, seq_len, shuffle=train, infinite=train, **kwargs)
    with warnings.catch_warnings():  # torchdata 0.11 calls the deprecated torch.set_vital here; harmless
        warnings.filterwarnings("ignore", message="'set_vital' is deprecated", category=UserWarning)
        pin = torch.cuda.is_available()
        return ResumableDataLoader(
            windows, batch_size=batch_size, num_workers=num_workers, drop_last=True, pin_memory=pin
        )

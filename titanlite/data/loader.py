"""Building resumable data loaders from the ``[training]`` / ``[validation]`` config."""
from __future__ import annotations

import warnings
from typing import Any, Optional

import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from titanlite.data.embedded import embedded_token_stream
from titanlite.data.tokenizer import Tokenizer
from titanlite.data.windows import TokenWindows


def load_token_store(dataset: str, path: str, split: str, tokenizer: Tokenizer) -> Any:
    """The token stream of a dataset kind ("embedded", "shards" or "text") and split."""
    if dataset == "embedded":
        return embedded_token_stream(tokenizer, split)
    raise ValueError(f"dataset {dataset!r} is not supported by this build")


def build_dataloader(store: Any, *, seq_len: int, batch_size: int, dp_rank: int = 0, dp_world: int = 1,
                     seed: int = 0, train: bool = True, eos_id: Optional[int] = None, num_workers: int = 0,
                     name: str = "train") -> StatefulDataLoader:
    """A StatefulDataLoader over shuffled (train) or sequential (validation) windows of ``store``.

    Batches are dicts of ``[batch_size, seq_len]`` int64 tensors: ``input_ids``, ``labels`` and, when
    ``eos_id`` is given, ``document_ids``. ``state_dict()``/``load_state_dict()`` resume exactly.
    """
    windows = TokenWindows(store, seq_len, dp_rank=dp_rank, dp_world=dp_world, seed=seed, shuffle=train,
                           infinite=train, batch_size=batch_size, eos_id=eos_id, name=name)
    # torchdata 0.11 calls the deprecated torch.set_vital when a loader is created; harmless.
    warnings.filterwarnings("ignore", message="'set_vital' is deprecated", category=UserWarning)
    return StatefulDataLoader(windows, batch_size=batch_size, num_workers=num_workers, drop_last=True,
                              persistent_workers=False, pin_memory=torch.cuda.is_available())

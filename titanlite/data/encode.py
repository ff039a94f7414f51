"""Turning documents into ``BOS + tokens + EOS`` arrays, in this process or in worker processes."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import sys
from collections.abc import Sequence
from concurrent.futures import Future, ProcessPoolExecutor

import numpy as np

from titanlite.tokenizer import Tokenizer, build_tokenizer


def encode_documents(tokenizer: Tokenizer, texts: Sequence[str], dtype=np.int64) -> tuple[np.ndarray, np.ndarray]:
    """``BOS + tokens + EOS`` of each text, concatenated: ``(flat tokens as dtype, per-document lengths)``."""
    batch = [tokenizer.encoding.encode_ordinary(t) for t in texts]
    lengths = np.array([len(ids) + 2 for ids in batch], dtype=np.int64)
    flat = np.empty(int(lengths.sum()), dtype=dtype)
    ends = np.cumsum(lengths)
    flat[ends - lengths] = tokenizer.bos_id
    flat[ends - 1] = tokenizer.eos_id
    for ids, end in zip(batch, ends.tolist()):
        flat[end - len(ids) - 1 : end - 1] = ids
    return flat, lengths


def default_start_method() -> str:
    """Worker start: "fork" on Linux (instant, as torch's DataLoader does), else "spawn"; ``TITANLITE_MP_START``
    overrides it."""
    return os.environ.get("TITANLITE_MP_START") or ("fork" if sys.platform.startswith("linux") else "spawn")


_worker: tuple[Tokenizer, np.dtype] | None = None  # set in each worker process by _start_worker


def _start_worker(tokenizer: Tokenizer | str, dtype: np.dtype) -> None:
    global _worker
    _worker = (tokenizer if isinstance(tokenizer, Tokenizer) else build_tokenizer(tokenizer), dtype)


def _encode_in_worker(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    return encode_documents(_worker[0], texts, _worker[1])


class ParallelEncoder(contextlib.AbstractContextManager):
    """:func:`encode_documents` on batches of documents, in ``workers`` processes (``<= 1``: in this one), with
    exactly the in-process results. A forked worker inherits the tokenizer, others rebuild it from its path.
    Processes, not tiktoken's threads: those encoded fewer tokens/s (docs/benchmarks.md, "Tokenizing")."""

    def __init__(self, tokenizer: Tokenizer, dtype: np.dtype, workers: int = 1, start_method: str | None = None):
        self.tokenizer, self.dtype, self._pool = tokenizer, np.dtype(dtype), None
        if workers > 1:
            method = start_method or default_start_method()
            init = (tokenizer if method == "fork" else tokenizer.path, self.dtype)
            ctx = multiprocessing.get_context(method)
            self._pool = ProcessPoolExecutor(workers, mp_context=ctx, initializer=_start_worker, initargs=init)

    def submit(self, texts: list[str]) -> Future:
        if self._pool is not None:
            return self._pool.submit(_encode_in_worker, texts)
        done: Future = Future()
        done.set_result(encode_documents(self.tokenizer, texts, self.dtype))
        return done

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)
            self._pool = None

    def __exit__(self, *exc) -> None:
        self.close()

"""prepare_data's encoding stage, printed as one JSON object: its process pool (``ParallelEncoder``, pool start-up
included, as ``prepare`` uses it) vs tiktoken's ``encode_ordinary_batch(num_threads=N)`` in this process, on the same
chunks (``CHUNK_CHARS``/``CHUNK_DOCS``) of the shared corpus with cl100k; every way's output is checked equal to the
one-process result. Interleaved rounds, best of ``--repeats`` (the machine may be shared)."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from titanlite.bench.common import shared_data
from titanlite.data.encode import ParallelEncoder
from titanlite.data.prepare import CHUNK_CHARS, CHUNK_DOCS
from titanlite.data.sources import iter_file_documents
from titanlite.tokenizer import build_tokenizer

TEXTS = ("c4_sample.jsonl", "tinyshakespeare.txt", "wikitext2/valid.txt", "wikitext2/test.txt")


def chunks_of(docs: list[str]) -> list[list[str]]:
    chunks, cur, chars = [], [], 0
    for d in docs:
        cur.append(d)
        chars += len(d)
        if chars >= CHUNK_CHARS or len(cur) >= CHUNK_DOCS:
            chunks, cur, chars = [*chunks, cur], [], 0
    return [*chunks, cur] if cur else chunks


def with_pool(tok, chunks: list[list[str]], workers: int) -> list:
    with ParallelEncoder(tok, np.dtype("uint32"), workers) as encoder:
        futures = [encoder.submit(c) for c in chunks]
        return [f.result() for f in futures]


def with_threads(tok, chunks: list[list[str]], threads: int) -> list:
    out = []
    for chunk in chunks:
        batch = tok.encoding.encode_ordinary_batch(chunk, num_threads=threads)
        lengths = np.array([len(ids) + 2 for ids in batch], dtype=np.int64)
        flat, ends = np.empty(int(lengths.sum()), dtype=np.uint32), np.cumsum(lengths)
        flat[ends - lengths], flat[ends - 1] = tok.bos_id, tok.eos_id
        for ids, end in zip(batch, ends.tolist()):
            flat[end - len(ids) - 1 : end - 1] = ids
        out.append((flat, lengths))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="titanlite bench encode", description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default=str(shared_data()))
    p.add_argument("--workers", type=int, default=2, help="Worker processes, and tiktoken threads.")
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args(argv)
    data = Path(a.data)
    tok = build_tokenizer(str(data / "tokenizers" / "cl100k_base.tiktoken"))
    docs = [t for name in TEXTS for t, _ in iter_file_documents(data / "text" / name, "text", "auto", "paragraphs")]
    chunks = chunks_of(docs)
    ways = {
        "one_process": lambda: with_pool(tok, chunks, 1),
        f"process_pool_{a.workers}": lambda: with_pool(tok, chunks, a.workers),
        f"tiktoken_threads_{a.workers}": lambda: with_threads(tok, chunks, a.workers),
    }
    reference, best = with_pool(tok, chunks, 1), dict.fromkeys(ways, float("inf"))
    for _ in range(a.repeats):
        for name, run in ways.items():
            t = time.perf_counter()
            got = run()
            best[name] = min(best[name], time.perf_counter() - t)
            same = all(np.array_equal(x[0], y[0]) and np.array_equal(x[1], y[1]) for x, y in zip(got, reference))
            assert same and len(got) == len(reference), f"{name}: output differs from one process"
    tokens = sum(int(flat.size) for flat, _ in reference)
    res = {"documents": len(docs), "chunks": len(chunks), "tokens": tokens}
    res.update({f"{name}_tokens_per_s": round(tokens / s) for name, s in best.items()})
    res["pool_vs_one_process"] = round(best["one_process"] / best[f"process_pool_{a.workers}"], 3)
    res["threads_vs_one_process"] = round(best["one_process"] / best[f"tiktoken_threads_{a.workers}"], 3)
    res["threads_vs_pool"] = round(best[f"process_pool_{a.workers}"] / best[f"tiktoken_threads_{a.workers}"], 3)
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

#!/usr/bin/env python
"""Decode speed with the KV cache against recomputing the whole prefix, side by side in one run.

    python scripts/bench_generate.py [--flavors debugmodel,1B] [--batch-sizes 1,8] [--prompt-len 128]
        [--new-tokens 32] [--device cpu|cuda] [--dtype float32|bfloat16] [--json FILE]

For each Llama 3 flavor (random weights, seeded) and batch size, :func:`titanlite.generate.generate`
runs greedily on random prompts of ``--prompt-len`` tokens, once with the cache (``use_cache=True``) and
once without (``use_cache=False``: the plain forward over the whole sequence at every step). Each is
timed twice, for 1 new token (the prefill: one forward over the prompts) and for ``--new-tokens``; the
difference is the decode time of the other ``N - 1`` tokens, so

    decode tokens/s = batch * (N - 1) / (t(N) - t(1))

counts the generated tokens of all rows. Decoding stops only at ``N`` (no EOS). The table shows the
prefill time, both decode rates and their ratio.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

try:
    import titanlite  # noqa: F401
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from titanlite.dtypes import DTYPES
from titanlite.generate import generate
from titanlite.models import build_model


def timed(model, prompts, new_tokens: int, use_cache: bool, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = generate(model, prompts, max_new_tokens=new_tokens, use_cache=use_cache)
    if device.type == "cuda":
        torch.cuda.synchronize()
    assert all(len(c) == new_tokens for c in out)
    return time.perf_counter() - start


def bench(flavor: str, batch_sizes: list[int], a: argparse.Namespace) -> list[dict]:
    device = torch.device(a.device)
    torch.manual_seed(0)
    model = build_model("llama3", flavor, device=device).to(DTYPES[a.dtype]).eval()
    params = sum(p.numel() for p in model.parameters())
    rows = []
    for batch in batch_sizes:
        gen = torch.Generator().manual_seed(batch)
        prompts = torch.randint(0, model.args.vocab_size, (batch, a.prompt_len), generator=gen).tolist()
        timed(model, prompts[:1], 2, True, device)  # warm-up: allocator, kernels
        row = {"flavor": flavor, "params": params, "batch": batch, "prompt_len": a.prompt_len, "new": a.new_tokens}
        for name, use_cache in (("cache", True), ("recompute", False)):
            first = timed(model, prompts, 1, use_cache, device)
            total = timed(model, prompts, a.new_tokens, use_cache, device)
            row[f"{name}_prefill_s"] = first
            row[f"{name}_decode_tok_s"] = batch * (a.new_tokens - 1) / (total - first)
        row["speedup"] = row["cache_decode_tok_s"] / row["recompute_decode_tok_s"]
        rows.append(row)
        print(format_row(row), flush=True)
    return rows


HEADER = (
    f"{'model':<11} {'params':>7} {'batch':>5} {'prompt':>6} {'new':>4} {'prefill s':>9} "
    f"{'cache tok/s':>11} {'recompute tok/s':>15} {'speedup':>7}"
)


def format_row(r: dict) -> str:
    return (
        f"{r['flavor']:<11} {r['params'] / 1e6:>6.0f}M {r['batch']:>5} {r['prompt_len']:>6} {r['new']:>4} "
        f"{r['cache_prefill_s']:>9.2f} {r['cache_decode_tok_s']:>11.1f} {r['recompute_decode_tok_s']:>15.1f} "
        f"{r['speedup']:>6.1f}x"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--flavors", default="debugmodel,1B", help="comma-separated llama3 flavors")
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=32, help="at least 2")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--json", help="also write the rows to this file")
    a = p.parse_args(argv)
    if a.new_tokens < 2 or a.prompt_len < 1:
        p.error("--new-tokens must be >= 2 and --prompt-len >= 1")
    batch_sizes = [int(b) for b in a.batch_sizes.split(",")]
    print(f"device {a.device}, {a.dtype}, {torch.get_num_threads()} threads; decode tokens/s over all rows")
    print(HEADER, flush=True)
    rows = [r for flavor in a.flavors.split(",") for r in bench(flavor, batch_sizes, a)]
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Decode speed, side by side in one run: eager and compiled KV-cache decoding and recomputing the prefix;
and the fraction of the bandwidth floor.

For each Llama 3 flavor (random weights, seeded) and batch size, :func:`titanlite.generate.generate` runs greedily
in each mode, every row to ``--new-tokens``; the modes, the decode rate and its floor: docs/benchmarks.md,
"Generation".
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time

import torch

from titanlite.bench.common import (
    add_device_args,
    append_jsonl,
    imported_from,
    interleaved,
    mode_caller,
    serve,
    sync,
    write_json,
)
from titanlite.generate import generate
from titanlite.models import build_model
from titanlite.utils.dtypes import DTYPES

MODES = ("eager", "compiled", "recompute")


class Runner:
    """One flavor's model and its timed ``generate`` calls (the same code serves a reference worker)."""

    def __init__(self, flavor: str, device: str, dtype: str):
        self.device = torch.device(device)
        torch.manual_seed(0)
        self.model = build_model("llama3", flavor, device=self.device).to(DTYPES[dtype]).eval()

    def timed(self, prompts: list[list[int]], new: int, mode: str) -> float:
        kw = {"compile": True} if mode == "compiled" else {"use_cache": mode != "recompute"}
        sync(self.device)
        start = time.perf_counter()
        out = generate(self.model, prompts, max_new_tokens=new, **kw)
        sync(self.device)
        assert all(len(c) == new for c in out)
        return time.perf_counter() - start

    def handle(self, r: dict) -> dict:
        """``{"prompts", "new", "mode"}`` -> ``{"prefill_s", "decode_s"}`` (one round: t(1), t(N) - t(1))."""
        if r.get("warmup"):
            self.timed(r["prompts"], r["new"], r["mode"])
            return {}
        first = self.timed(r["prompts"], 1, r["mode"])
        total = self.timed(r["prompts"], r["new"], r["mode"])
        return {"prefill_s": first, "decode_s": total - first}


def step_bytes(model: torch.nn.Module, batch: int, cached_tokens: float) -> float:
    """Bytes a decode step reads at least: the weights (the input embedding's looked-up rows only) and
    ``cached_tokens`` keys and values per row and layer."""
    a = model.args
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    if not a.tie_word_embeddings:  # only `batch` rows of the table are read
        table = model.tok_embeddings.weight
        weights -= (table.shape[0] - batch) * table.shape[1] * table.element_size()
    elem = next(model.parameters()).element_size()
    return weights + 2 * a.n_layers * batch * cached_tokens * a.kv_heads * a.head_dim * elem


def bench(flavor: str, batch_sizes: list[int], a: argparse.Namespace, bandwidth: float, reference=None) -> list[dict]:
    runner = Runner(flavor, a.device, a.dtype)
    model = runner.model
    worker = reference and reference.start("titanlite.bench.generate", ["--serve", "--flavor", flavor, *_common(a)])
    call, modes = mode_caller(runner.handle, worker), [*a.modes, *(["baseline"] if worker else [])]
    params = sum(p.numel() for p in model.parameters())
    rows = []
    for batch in batch_sizes:
        gen = torch.Generator().manual_seed(batch)
        prompts = torch.randint(0, model.args.vocab_size, (batch, a.prompt_len), generator=gen).tolist()
        request = {"prompts": prompts, "new": a.new_tokens}
        warmup = {**request, "warmup": True}  # allocator, kernels, the compiled step for this shape
        runs = interleaved(modes, a.repeats, functools.partial(call, request), functools.partial(call, warmup))
        row = {"flavor": flavor, "params": params, "batch": batch, "prompt_len": a.prompt_len, "new": a.new_tokens}
        row.update(device=a.device, dtype=a.dtype, repeats=a.repeats, baseline=reference and reference.ref)
        for mode, results in runs.items():
            row[f"{mode}_prefill_s"] = statistics.median(x["prefill_s"] for x in results)
            row[f"{mode}_tok_s"] = statistics.median(batch * (a.new_tokens - 1) / x["decode_s"] for x in results)
        row["bytes_per_step"] = step_bytes(model, batch, a.prompt_len + a.new_tokens / 2)
        row["copy_bandwidth_gb_s"] = bandwidth / 1e9
        row["floor_tok_s"] = batch * bandwidth / row["bytes_per_step"]
        for mode in modes:
            row[f"{mode}_floor_fraction"] = row[f"{mode}_tok_s"] / row["floor_tok_s"]
        rows.append(row)
        print(format_row(row, modes), flush=True)
        append_jsonl(a.jsonl, {"bench": "generate", **row})
    if worker:
        worker.close()
    return rows


RATIOS = (
    ("comp/eager", "compiled", "eager"),
    ("comp/base", "compiled", "baseline"),
    ("cache/recmp", "eager", "recompute"),
)


def header(modes: list[str]) -> str:
    cols = " ".join(f"{m + ' tok/s':>15}" for m in modes)
    ratios = "".join(f" {name:>11}" for name, num, den in RATIOS if num in modes and den in modes)
    best = "compiled" if "compiled" in modes else modes[0]
    head = f"{'model':<11} {'params':>7} {'batch':>5} {'prompt':>6} {'new':>4} {'prefill s':>9}"
    return f"{head} {cols}{ratios}  % floor ({best})"


def format_row(r: dict, modes: list[str]) -> str:
    cols = " ".join(f"{r[m + '_tok_s']:>15.1f}" for m in modes)
    ratios = "".join(
        f" {r[num + '_tok_s'] / r[den + '_tok_s']:>10.2f}x" for _, num, den in RATIOS if num in modes and den in modes
    )
    best = "compiled" if "compiled" in modes else modes[0]
    return (
        f"{r['flavor']:<11} {r['params'] / 1e6:>6.0f}M {r['batch']:>5} {r['prompt_len']:>6} {r['new']:>4} "
        f"{r[modes[0] + '_prefill_s']:>9.3f} {cols}{ratios}  {100 * r[best + '_floor_fraction']:>6.1f}%"
    )


def _common(a: argparse.Namespace) -> list[str]:
    return ["--device", a.device, "--dtype", a.dtype]


def main(argv: list[str] | None = None, reference=None) -> int:
    """``reference``: also time the ``baseline`` mode in its workers (``reference.ref`` names it, and
    ``reference.start(module, args)`` starts one; see :mod:`titanlite.bench.common`)."""
    p = argparse.ArgumentParser(prog="titanlite bench generate", description=__doc__.split("\n\n")[0])
    p.add_argument("--flavors", default="debugmodel,1B", help="comma-separated llama3 flavors")
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=32, help="at least 2")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    p.add_argument("--repeats", type=int, default=3, help="rounds of timings per mode (median reported)")
    add_device_args(p)
    p.add_argument("--json", help="also write the rows to this file (a JSON list)")
    p.add_argument("--jsonl", help="append one JSON object per row to this file")
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # a reference worker
    p.add_argument("--flavor", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.serve:
        serve(Runner(a.flavor, a.device, a.dtype).handle)
        return 0
    modes = [m for m in a.modes.split(",") if m]
    if a.new_tokens < 2 or a.prompt_len < 1 or a.repeats < 1 or not modes or set(modes) - set(MODES):
        p.error(f"--new-tokens must be >= 2, --prompt-len and --repeats >= 1, --modes of {', '.join(MODES)}")
    a.modes = modes
    batch_sizes = [int(b) for b in a.batch_sizes.split(",")]
    from titanlite.optim.bandwidth import measure_copy_bandwidth  # not in every reference titanlite

    device = torch.device(a.device)
    bandwidth = measure_copy_bandwidth(device, 2**30 if device.type == "cuda" else 2**28)
    print(
        f"device {a.device}, {a.dtype}, {torch.get_num_threads()} threads, torch {torch.__version__}, titanlite "
        f"from {imported_from()}; copy bandwidth {bandwidth / 1e9:.1f} GB/s (read + write); decode tokens/s over "
        f"all rows, median of {a.repeats}" + (f"; baseline: titanlite at {reference.ref}, eager" if reference else "")
    )
    all_modes = [*modes, *(["baseline"] if reference else [])]
    print(header(all_modes), flush=True)
    rows = [r for flavor in a.flavors.split(",") for r in bench(flavor, batch_sizes, a, bandwidth, reference)]
    if a.json:
        write_json(a.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())

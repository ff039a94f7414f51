"""The training benchmark's table (docs/benchmarks.md's format) from JSON lines of ``bench train`` and
``bench hf-baseline``, each with a ``"row"`` name added (``scripts/gpu_check.sh`` writes them): ``titanlite bench
table results.jsonl > table.md``. Columns: tokens/s, MFU, peak memory, the step split, the optimizer step against
its bandwidth floor, tokens/s against the ``transformers`` row of the same shape and, for a float8 row, against the
first plain bf16 row of the same shape (torch's SDPA order, compile's default mode); a profiled row (the profiler's
own work is in its time) has no ratios; a failed row is
``{"row": ..., "error": ...}``; ``bench optimizer`` rows get a table of their own.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from titanlite.errors import one_line
from titanlite.utils.argtypes import OneLineParser

HEADER = (
    "| run | tokens/s | MFU (bf16 peak) | peak memory | fwd+bwd / optimizer / other | optimizer / floor "
    "| vs transformers | float8 vs bf16 |\n|---|---:|---:|---:|---|---:|---:|---:|"
)

WAYS = ("clip_then_step", "merged", "step_only")  # the ways a bench optimizer row times
ROW_KEYS = {  # the number keys each kind of row needs (besides "row"): a failed row, bench optimizer, bench train
    "error": (),
    "merged_s": ("params", "floor_s", *(f"{w}_{k}" for w in WAYS for k in ("s", "floor_ratio"))),
    "tokens_per_s_per_device": ("tokens_per_s_per_device",),
}


def mfu_bf16(r: dict) -> float | None:
    return r.get("mfu_vs_bf16_peak", r.get("mfu"))


def same_shape(a: dict, b: dict) -> bool:
    keys = ("params", "local_batch_size", "seq_len", "compile")
    return all(a.get(k) == b.get(k) for k in keys)


def is_plain_bf16(r: dict) -> bool:
    """A row without float8, profiling, a chosen SDPA kernel or a compile mode: the baseline of a float8 row."""
    options = (r.get("sdpa_kernel", "auto"), r.get("compile_mode", "default"))
    return not r.get("float8") and not r.get("profiled") and options == ("auto", "default")


def ratio_to(r: dict, rows: list[dict]) -> str:
    """``r``'s tokens/s over those of the first of ``rows`` of the same shape, or "-"."""
    match = [b for b in rows if same_shape(r, b)]
    return f"{r['tokens_per_s_per_device'] / match[0]['tokens_per_s_per_device']:.2f}x" if match else "-"


def row_line(r: dict, baselines: list[dict], bf16: list[dict]) -> str:
    if "error" in r:
        return f"| {r['row']} | {r['error']} | | | | | | |"
    split = r.get("time_split_frac") or {}
    parts = [split.get("forward_backward"), split.get("optimizer")]
    other = None if None in parts else max(0.0, 1 - sum(parts))
    split_text = " / ".join("-" if v is None else f"{100 * v:.0f}%" for v in (*parts, other))
    opt = r.get("optimizer") if isinstance(r.get("optimizer"), dict) else {}
    floor = f"{opt['floor_ratio']:.2f}x" if opt.get("floor_ratio") else "-"
    mfu = mfu_bf16(r)
    ratio = "-" if r["row"].startswith("transformers") or r.get("profiled") else ratio_to(r, baselines)
    float8 = ratio_to(r, bf16) if r.get("float8") and not r.get("profiled") else "-"
    memory = r.get("peak_memory_gib")
    return (
        f"| {r['row']} | {r['tokens_per_s_per_device']:,.0f} | {'-' if mfu is None else f'{100 * mfu:.1f}%'} | "
        f"{'-' if memory is None else f'{memory:.1f} GiB'} | {split_text} | {floor} | {ratio} | {float8} |"
    )


OPTIMIZER_HEADER = (
    "| optimizer step alone | parameters | floor | clip, then step (5c7a1f4) | merged norm, clip in the kernel "
    "| step, no clip |\n|---|---:|---:|---:|---:|---:|"
)


def optimizer_line(r: dict) -> str:
    """A ``bench optimizer`` row: each way's milliseconds and its ratio to the floor."""
    cells = [f"{1e3 * r[f'{k}_s']:.1f} ms ({r[f'{k}_floor_ratio']:.2f}x)" for k in WAYS]
    return f"| {r['row']} | {r['params'] / 1e6:,.0f} M | {1e3 * r['floor_s']:.1f} ms | {' | '.join(cells)} |"


def table(records: list[dict]) -> str:
    baselines = [r for r in records if r.get("row", "").startswith("transformers") and "error" not in r]
    devices = sorted({r["device"] for r in records if "device" in r})
    steps = [r for r in records if "merged_s" in r]
    lines = [f"Device: {', '.join(devices) or 'unknown'}", "", HEADER]
    bf16 = [r for r in records if r not in baselines and "tokens_per_s_per_device" in r and is_plain_bf16(r)]
    lines += [row_line(r, baselines, bf16) for r in records if r not in steps]
    if steps:
        lines += ["", OPTIMIZER_HEADER, *map(optimizer_line, steps)]
    return "\n".join(lines)


def is_row(record: object) -> bool:
    """Whether a JSON line is a row this table shows: an object with a ``"row"`` name and the numbers its kind
    needs (:data:`ROW_KEYS`)."""
    if not isinstance(record, dict) or not isinstance(record.get("row"), str):
        return False
    kind = next((k for k in ROW_KEYS if k in record), None)
    number = (int, float)
    return kind is not None and all(
        isinstance(record.get(k), number) and not isinstance(record[k], bool) for k in ROW_KEYS[kind]
    )


def read_rows(path: Path) -> list[dict]:
    """The JSON lines of ``path`` (blank lines skipped); ValueError naming the first line that is no row."""
    records = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            records.append(json.loads(line))
            if not is_row(records[-1]):
                raise ValueError(
                    f"line {number} is no row of bench train, hf-baseline or optimizer (expected a JSON object with "
                    f'a "row" name and numbers for {" or ".join(map(repr, ROW_KEYS))})'
                )
    return records


def main(argv=None) -> None:
    p = OneLineParser(prog="titanlite bench table", description=__doc__.split("\n")[0])
    p.add_argument("results", type=Path)
    args = p.parse_args(argv)
    try:
        records = read_rows(args.results)
    except (OSError, ValueError) as e:
        sys.exit(f"error: cannot read {args.results}: {one_line(e)}")
    print(table(records))


if __name__ == "__main__":
    main()

"""Plot training curves from one or more runs' ``metrics.jsonl``, overlaid.

Panels against the optimizer step, each drawn when some run logged its metric: training loss (validation loss as
markers, NaN-guard events as dotted lines), learning rate, gradient norm, tokens/s per device, MFU, validation bits
per byte and the downstream scores (accuracies in one panel, perplexities in another). Runs are labelled by folder
name. Needs matplotlib, which titanlite itself does not depend on.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Collection
from pathlib import Path

from titanlite.errors import NotFoundError
from titanlite.utils.argtypes import OneLineParser, number
from titanlite.utils.metrics_records import read_records

PANELS = (  # (title, key, log scale)
    ("loss", "loss", False),
    ("learning rate", "lr", False),
    ("grad norm (before clipping)", "grad_norm", True),
    ("tokens/s per device", "tokens_per_s", False),
    ("MFU", "mfu", False),
)


def read_runs(args: list[str]) -> list[tuple[str, list[dict]]]:
    """``(label, records)`` of each run folder or ``metrics.jsonl`` path (labelled by its folder's name); the
    lines that hold no record (torn by a crash, not JSON, no object with a step) are skipped, as the trainer and
    the watcher skip them. FileNotFoundError naming a path with no ``metrics.jsonl``."""
    runs = []
    for arg in args:
        path = Path(arg) / "metrics.jsonl" if Path(arg).is_dir() else Path(arg)
        if not path.is_file():
            raise NotFoundError(f"no metrics.jsonl at {path}")
        runs.append((path.parent.name or str(path.parent), read_records(path)))
    return runs


def unsupported_output(output: str, supported: Collection[str]) -> str | None:
    """Why ``output`` cannot be written: its extension names no image type of ``supported`` (matplotlib's, without
    the dot); None when it can (no extension: matplotlib's default type)."""
    ext = Path(output).suffix.lower().removeprefix(".")
    if not ext or ext in supported:
        return None
    kinds = ", ".join(f".{e}" for e in sorted(supported))
    return f"-o {output}: matplotlib writes no '.{ext}' image (supported extensions: {kinds})"


def series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    """``key``'s values by step, in step order (a watcher appends its scores after later training steps)."""
    points = []
    for r in records:
        v = r.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and "step" in r:
            points.append((r["step"], float(v)))
    points.sort(key=lambda p: p[0])
    return [p[0] for p in points], [p[1] for p in points]


def base_panels(runs: list[tuple[str, list[dict]]]) -> list[tuple[str, str, bool]]:
    """The panels of ``PANELS`` that some run logged (a CPU run has no MFU when its peak is unknown, a run cut
    short may have no record yet): the loss panel also shows validation loss alone."""
    logged = {k for _, records in runs for r in records for k in r if series([r], k)[0]}
    return [p for p in PANELS if p[1] in logged or (p[1] == "loss" and "val_loss" in logged)]


def extra_panels(runs: list[tuple[str, list[dict]]]) -> list[tuple[str, list[str], bool]]:
    """``(title, keys, log scale)`` of the panels whose metrics some run logged: bits per byte, downstream
    accuracies (``eval/<task>/acc...``) and downstream perplexities."""
    keys = {k for _, records in runs for r in records for k in r}
    evals = sorted(k for k in keys if k.startswith("eval/"))
    panels = [("validation bits per byte", ["val_bpb"], False)] if "val_bpb" in keys else []
    if acc := [k for k in evals if k.rsplit("/", 1)[-1].startswith("acc")]:
        panels.append(("downstream accuracy", acc, False))
    if ppl := [k for k in evals if k.endswith("/perplexity")]:
        panels.append(("downstream perplexity", ppl, True))
    return panels


def ema(ys: list[float], alpha: float) -> list[float]:
    out, acc = [], None
    for y in ys:
        acc = y if acc is None else alpha * acc + (1 - alpha) * y
        out.append(acc)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(prog="titanlite plot", description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", help="dump folders (or metrics.jsonl files)")
    ap.add_argument("-o", "--output", default="metrics.png", help="output image (PNG, SVG or PDF by extension)")
    smooth = number(at_least=0, below=1)
    ap.add_argument("--smooth", type=smooth, default=0.0, help="EMA smoothing of the training loss, 0 <= s < 1")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(
            "error: titanlite plot needs matplotlib, which titanlite does not install; "
            "run `pip install matplotlib` (or `pip install -e .[test]`)",
            file=sys.stderr,
        )
        return 2
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    if reason := unsupported_output(args.output, FigureCanvasAgg.get_supported_filetypes()):
        print(f"error: {reason}", file=sys.stderr)
        return 2
    try:
        runs = read_runs(args.runs)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    base, extra = base_panels(runs), extra_panels(runs)
    n = len(base) + len(extra)
    if n == 0:
        print(f"error: no metric to plot in {', '.join(args.runs)} (no record with a step yet)", file=sys.stderr)
        return 2
    fig, axes = plt.subplots(n, 1, figsize=(9, 2.6 * n), sharex=True, squeeze=False)
    axes = list(axes[:, 0])
    for ax, (title, keys, log) in zip(axes[len(base) :], extra):
        for i, (label, records) in enumerate(runs):  # a color per metric, a line style per run
            for j, key in enumerate(keys):
                xs, ys = series(records, key)
                name = key.removeprefix("eval/")
                style = dict(marker="o", markersize=3, linestyle=("-", "--", ":")[i % 3], color=f"C{j % 10}")
                ax.plot(xs, ys, label=f"{label} {name}", **style)
        if log:
            ax.set_yscale("log")
        ax.set_ylabel(title)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    for i, (label, records) in enumerate(runs):
        color = f"C{i % 10}"
        for ax, (title, key, log) in zip(axes, base):
            xs, ys = series(records, key)
            if key == "loss" and args.smooth > 0:
                ys = ema(ys, args.smooth)
            if xs:
                ax.plot(xs, ys, color=color, label=label, linewidth=1.2)
            if key == "loss":
                vx, vy = series(records, "val_loss")
                if vx:
                    ax.plot(vx, vy, "o--", color=color, markersize=4, linewidth=0.8, label=f"{label} (validation)")
                for r in records:  # NaN-guard events: skipped steps and rollbacks
                    if "guard_event" in r:
                        ax.axvline(r["step"], color=color, linestyle=":", linewidth=1)
            if log and ys and min(ys) > 0:
                ax.set_yscale("log")
            ax.set_ylabel(title)
            ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=8)
    axes[-1].set_xlabel("step")
    fig.tight_layout()
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.output, dpi=110)
    titles = [p[0] for p in base] + [p[0] for p in extra]
    print(f"wrote {args.output} ({len(runs)} run(s); panels: {', '.join(titles)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

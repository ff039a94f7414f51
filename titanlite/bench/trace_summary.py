"""Where a profiled step's time goes: a summary of a ``torch.profiler`` Chrome trace (``[profiling]`` writes them).

For a GPU trace: the step's wall time, the time the GPU ran kernels (overlap counted once), that time by kind of
kernel from the names (float8 and other matmuls, attention, the optimizer's multi-tensor kernels, ``triton_*``
from torch.compile, collectives, copies, the rest) and the longest kernels; then per step the parts a step is judged
by (matmuls, attention, element-wise and norms, optimizer, communication, idle: the step's wall time the GPU ran
nothing, i.e. host-bound), each, with ``--floors`` (the JSON of ``titanlite bench train`` on the same config),
against its floor (:mod:`titanlite.bench.step_floors`). For a CPU trace the top-level operators. Markdown on stdout.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import re
import sys
from collections import defaultdict
from pathlib import Path

from titanlite.bench.common import busy_seconds
from titanlite.errors import one_line

KINDS = [  # (kind, pattern on the kernel name): the first match wins
    ("matmul, float8", r"e4m3|e5m2|f8f8|fp8|_f8_"),
    ("attention", r"flash|fmha|attention|sdpa|cudnn"),  # before matmuls: fmha_cutlass*, cuDNN's xmma-based SDPA
    ("matmul, other", r"gemm|xmma|cutlass|nvjet|cublas|s16816|h16816|bf16_s1688"),
    ("optimizer (multi-tensor)", r"multi_tensor_apply|fused_adam|adam"),
    ("fused by compile (triton)", r"^triton_"),
    ("collectives", r"nccl"),
    ("copies and fills", r"memcpy|memset|copy_kernel|fill_kernel"),
    ("element-wise / reductions (eager)", r"elementwise|reduce|vectorized|unrolled|index|scatter|gather"),
]


PARTS = {  # kind of kernel -> the part of the step it is counted in
    "matmul, float8": "matmul",
    "matmul, other": "matmul",
    "attention": "attention",
    "optimizer (multi-tensor)": "optimizer",
    "collectives": "communication",
}
PART_ORDER = ["matmul", "attention", "elementwise / norm", "optimizer", "communication", "idle (host-bound)"]


def load(path: Path) -> list[dict]:
    """The events of a Chrome trace (a JSON list of events, or an object with ``traceEvents``); ValueError for
    other JSON, or for a complete event (``"ph": "X"``) without a numeric ``ts`` and ``dur``."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        data = json.load(f)
    events = data.get("traceEvents") if isinstance(data, dict) else data
    if not isinstance(events, list) or not all(isinstance(e, dict) for e in events):
        raise ValueError("not a Chrome trace (expected a JSON list of event objects or an object with traceEvents)")
    for i, e in enumerate(events):
        if e.get("ph") == "X" and not all(type(e.get(k)) in (int, float) for k in ("ts", "dur")):
            raise ValueError(f"event {i} is a complete event (ph X) without numbers ts and dur")
    return events


def kind_of(name: str) -> str:
    for kind, pattern in KINDS:
        if re.search(pattern, name, re.IGNORECASE):
            return kind
    return "other"


def parts_table(by_kind: dict[str, float], step_us: float, steps: int, floors: dict[str, float] | None) -> list[str]:
    """Per step: each part's milliseconds, its share of the step and, with ``floors`` (seconds per step), its floor
    and the ratio to it; idle is the step's wall time the kernels leave (``step_us`` minus their busy time, summed
    over ``steps`` steps, given by the caller as ``by_kind["idle"]``)."""
    per_part = dict.fromkeys(PART_ORDER, 0.0)
    for kind, us in by_kind.items():
        per_part["idle (host-bound)" if kind == "idle" else PARTS.get(kind, "elementwise / norm")] += us
    head = "| part | ms per step | share of the step |" + (" floor ms | x floor |" if floors else "")
    lines = ["", head, "|---|---:|---:|" + ("---:|---:|" if floors else "")]
    for part in PART_ORDER:
        ms = per_part[part] / steps / 1e3
        row = f"| {part} | {ms:.2f} | {100 * per_part[part] / step_us:.1f}% |"
        if floors:
            floor_ms = 1e3 * floors.get(part, 0.0)
            ratio = f"{ms / floor_ms:.2f}x" if floor_ms > 0 else "(floor 0)"
            row += f" {floor_ms:.2f} | {ratio} |"
        lines.append(row)
    if floors:
        total = 1e3 * sum(floors.values())
        lines.append(
            f"| **step** | {step_us / steps / 1e3:.2f} | 100% | {total:.2f} | {step_us / steps / 1e3 / total:.2f}x |"
        )
    return lines


def summarize(events: list[dict], top: int = 15, floors: dict[str, float] | None = None) -> str:
    steps = [e for e in events if e.get("ph") == "X" and str(e.get("name", "")).startswith("ProfilerStep#")]
    step_us = sum(e["dur"] for e in steps)
    kernels = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    lines = [f"profiled steps: {len(steps)}, wall time {step_us / 1e3:.2f} ms"]
    if kernels:
        busy = busy_seconds([(e["ts"], e["ts"] + e["dur"]) for e in kernels], -math.inf, math.inf)
        share = f" ({100 * busy / step_us:.1f}% of the wall time)" if step_us else ""
        lines.append(f"GPU busy (kernels, overlap counted once): {busy / 1e3:.2f} ms{share}")
        by_kind, by_name = defaultdict(float), defaultdict(lambda: [0.0, 0])
        for e in kernels:
            name = str(e.get("name", ""))
            by_kind[kind_of(name) if e.get("cat") == "kernel" else "copies and fills"] += e["dur"]
            by_name[name][0] += e["dur"]
            by_name[name][1] += 1
        total = sum(by_kind.values())
        lines += ["", "| kernels | ms | share of kernel time |", "|---|---:|---:|"]
        for kind, us in sorted(by_kind.items(), key=lambda kv: -kv[1]):
            lines.append(f"| {kind} | {us / 1e3:.2f} | {100 * us / total:.1f}% |")
        if step_us:
            idle = {"idle": max(step_us - busy, 0.0)}
            lines += parts_table({**by_kind, **idle}, step_us, len(steps), floors)
        lines += ["", f"| top {top} kernels | calls | ms | kind |", "|---|---:|---:|---|"]
        for name, (us, calls) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]:
            lines.append(f"| `{name[:90]}` | {calls} | {us / 1e3:.2f} | {kind_of(name)} |")
    else:
        ops = [e for e in events if e.get("ph") == "X" and e.get("cat") == "cpu_op"]
        ends: list[float] = []
        by_name = defaultdict(float)
        for e in sorted(ops, key=lambda e: (e["ts"], -e["dur"])):  # top level: not inside an earlier operator
            if ends and e["ts"] < ends[-1]:
                continue
            ends.append(e["ts"] + e["dur"])
            by_name[str(e.get("name", ""))] += e["dur"]
        lines.append(
            "no GPU kernels (a CPU trace): top-level operators by time"
            + (" (the floors need kernels)" if floors else "")
        )
        lines += ["", "| operator | ms |", "|---|---:|"]
        for name, us in sorted(by_name.items(), key=lambda kv: -kv[1])[:top]:
            lines.append(f"| `{name}` | {us / 1e3:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="titanlite bench trace-summary", description=__doc__.split("\n")[0])
    p.add_argument("trace", type=Path)
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--floors", type=Path, help="the JSON of `titanlite bench train` on the profiled config")
    args = p.parse_args(argv)
    try:
        events = load(args.trace)
    except (OSError, ValueError, EOFError) as e:  # EOFError: a truncated .gz
        sys.exit(f"error: cannot read the trace {args.trace}: {one_line(e)}")
    print(summarize(events, args.top, load_floors(args.floors) if args.floors else None))


def load_floors(path: Path) -> dict[str, float]:
    """``floors.step_s`` of a ``titanlite bench train`` JSON; exits with one line when the file has none."""
    try:
        floors = json.loads(path.read_text())["floors"]["step_s"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        sys.exit(f"error: {path}: expected the JSON of `titanlite bench train` with floors.step_s ({one_line(e)})")
    return floors


if __name__ == "__main__":
    main()

"""How long does a checkpoint save block the training loop? disabled vs async vs async_with_pinned_mem.

Trains the same model once per ``[checkpoint] async_mode`` (a fresh dump folder each), saving full checkpoints
every ``--interval`` steps (long enough for one write to finish before the next save), and reports per save
``blocked`` (time in ``CheckpointManager.save`` plus ``wait_for_staging``: the figure of merit, against
``disabled``'s), ``write`` (the background or inline save), ``checksum`` (its CRC-32 part) and ``verify``
(checking the newest checkpoint before a load); the first save of each mode apart (pinned buffers are allocated
then). ``--checksum-gb N`` measures only the checksums, on N GB of freshly written data files. The model is the
usual config (without one, a 28M-parameter Llama); figures: docs/benchmarks.md, "Checkpoint saves".
"""

from __future__ import annotations

import logging
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from titanlite.bench.common import seconds, write_json
from titanlite.utils.argtypes import OneLineParser, number

MODES = ("disabled", "async", "async_with_pinned_mem")
DEFAULT_MODEL = "--model.dim 512 --model.n_layers 8 --model.n_heads 8 --model.n_kv_heads 8".split()
DEFAULT_MODEL += "--training.seq_len 64 --training.local_batch_size 2".split()


def bench_checkpoint(
    config_argv: Sequence[str] = (),
    *,
    modes: Sequence[str] = MODES,
    steps: int = 40,
    interval: int = 10,
    folder: str | None = None,
) -> dict:
    """Per mode: blocked / write seconds of every save, the state size and the mean step time."""
    from titanlite.checkpoint import layout
    from titanlite.models import load_config
    from titanlite.trainer import Trainer

    root = Path(folder or tempfile.mkdtemp(prefix="bench_ckpt_"))
    results: dict = {}
    for mode in modes:
        argv = [*config_argv, "--training.steps", str(steps), "--metrics.log_freq", str(steps)]
        argv += ["--validation.enable", "false", "--lr_scheduler.warmup_steps", "0"]
        argv += ["--job.dump_folder", str(root / mode)]
        argv += ["--checkpoint.enable", "--checkpoint.interval", str(interval), "--checkpoint.async_mode", mode]
        argv += ["--checkpoint.keep_latest_k", "2", "--checkpoint.last_save_model_only", "false"]
        trainer = Trainer(load_config(argv))
        state_bytes = sum(p.numel() * p.element_size() for p in trainer.model.parameters()) * 3  # + 2 Adam moments
        wall = seconds(trainer.train, trainer.device)
        keys = ("step", "blocked_s", "wait_prev_s", "write_s", "checksum_s")
        saves = [{k: getattr(s, k) for k in keys} for s in trainer.checkpointer.stats]
        newest = layout.list_step_folders(root / mode / "checkpoint")[-1].path
        t1 = time.perf_counter()
        assert layout.problem_with(newest, verify=True) is None
        verify_s = time.perf_counter() - t1
        later = saves[1:] or saves
        results[mode] = {
            "params": trainer.n_params,
            "state_mb": state_bytes / 1e6,
            "device": str(trainer.device),
            "saves": saves,
            "first_blocked_s": saves[0]["blocked_s"],
            "blocked_median_s": statistics.median(s["blocked_s"] for s in later),
            "write_median_s": statistics.median(s["write_s"] for s in later),
            "checksum_median_s": statistics.median(s["checksum_s"] for s in later),
            "verify_s": verify_s,
            "wall_s": wall,
            "step_s": (wall - sum(s["blocked_s"] for s in saves)) / steps,
            "waited_for_previous_write_s": sum(s["wait_prev_s"] for s in saves),
        }
    base = results.get("disabled", {}).get("blocked_median_s")
    for r in results.values():
        r["blocked_vs_disabled"] = r["blocked_median_s"] / base if base else None
    return results


def print_table(res: dict) -> None:
    first = next(iter(res.values()))
    print(
        f"model: {first['params']:,} parameters, {first['state_mb']:.0f} MB of model + AdamW state per save, "
        f"device {first['device']}"
    )
    print(
        f"{'mode':<24}{'blocked/save (median)':>24}{'first save':>12}{'write (median)':>16}{'vs disabled':>13}"
        f"{'step':>10}{'checksum':>11}{'verify':>9}"
    )
    for mode, r in res.items():
        ratio = "" if r["blocked_vs_disabled"] is None else f"{r['blocked_vs_disabled']:.3f}"
        print(
            f"{mode:<24}{1e3 * r['blocked_median_s']:>21.1f} ms{1e3 * r['first_blocked_s']:>9.1f} ms"
            f"{1e3 * r['write_median_s']:>13.1f} ms{ratio:>13}{1e3 * r['step_s']:>7.0f} ms"
            f"{1e3 * r['checksum_median_s']:>8.1f} ms{1e3 * r['verify_s']:>6.1f} ms"
        )
        if r["waited_for_previous_write_s"] > 0.05:
            print(
                f"  ({mode}: {r['waited_for_previous_write_s']:.2f} s of it waiting for a previous write; "
                "use a longer --interval)"
            )


def bench_checksums(gb: float, folder: str | None, files: int = 1) -> dict:
    """Time :func:`~titanlite.checkpoint.layout.file_checksums` (save side) and ``checksum_problem``
    (load side) on ``gb`` GB of data files, as a save leaves them (just written, page cache warm)."""
    import os

    from titanlite.checkpoint import layout

    root = Path(folder or tempfile.mkdtemp(prefix="bench_crc_")) / "step-0"
    root.mkdir(parents=True, exist_ok=True)
    block = os.urandom(64 << 20)
    per_file = int(gb * 1e9) // files
    for r in range(files):
        with open(root / f"__{r}_0.distcp", "wb") as f:
            for _ in range(per_file // len(block)):
                f.write(block)
    size = sum(p.stat().st_size for p in root.iterdir())
    t0 = time.perf_counter()
    recorded = layout.file_checksums(root)
    save_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    assert layout.checksum_problem(root, recorded) is None
    load_s = time.perf_counter() - t0
    for p in root.iterdir():
        p.unlink()
    root.rmdir()
    return {"bytes": size, "files": files, "save_s": save_s, "load_s": load_s, "gb_per_s": size / 1e9 / save_s}


def run(
    config_argv: Sequence[str],
    modes: Sequence[str],
    steps: int,
    interval: int,
    json_out: str | None = None,
    folder: str | None = None,
) -> dict:
    """Benchmark, print the table, optionally write the JSON (also used by ``bench train --checkpoint-modes``)."""
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        raise SystemExit(f"error: unknown checkpoint mode(s) {', '.join(unknown)}; choose from {', '.join(MODES)}")
    if not any(a == "--config" or a.startswith("--model.") for a in config_argv):
        config_argv = [*DEFAULT_MODEL, *config_argv]
    res = bench_checkpoint(config_argv, modes=modes, steps=steps, interval=interval, folder=folder)
    print_table(res)
    if json_out:
        write_json(json_out, res, indent=2)
    return res


def main(argv=None) -> int:
    p = OneLineParser(prog="titanlite bench checkpoint", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--interval", type=int, default=10, help="long enough for a write to finish before the next save")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--folder", default=None, help="where the checkpoints go (default: a temporary folder)")
    p.add_argument("--json", default=None, help="also write the results here")
    gb = number(at_least=0)
    p.add_argument("--checksum-gb", type=gb, default=0, help="only time the checksums of this many GB of files")
    files = number(int, at_least=1)
    p.add_argument("--checksum-files", type=files, default=1, help="split into this many files (one per rank)")
    a, rest = p.parse_known_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if a.checksum_gb:
        r = bench_checksums(a.checksum_gb, a.folder, a.checksum_files)
        print(
            f"checksums of {r['bytes'] / 1e9:.1f} GB in {r['files']} file(s): {r['save_s']:.2f} s at save "
            f"({r['gb_per_s']:.2f} GB/s), {r['load_s']:.2f} s to verify before a load"
        )
        return 0
    run(rest, a.modes.split(","), a.steps, a.interval, a.json, a.folder)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Peak memory of one attention layer's forward and backward under context parallelism, against one process.

    titanlite bench context-parallel [--seq-len 16384] [--cp 1,2] [--dim 256] [--heads 4] [--kv-heads 2]
        [--masks causal,documents] [--json-out FILE]

Each (mask, cp) setting runs in fresh processes (``cp`` of them, gloo on CPU), each with a Llama attention layer
(same weights) and its share of one sequence: one process holds the whole sequence with ``cp = 1`` (titanlite's
attention without context parallelism: SDPA causal, or its dense ``S x S`` document mask), and each of ``cp``
ranks holds ``S / cp`` tokens with ``cp > 1`` (the all-gathered keys and values, the prefix and diagonal parts).
The figure is the rise of the process's peak resident memory (``ru_maxrss``) over the forward and backward,
above what it held before (the layer and its input); the table gives rank 0's and the ratio to ``cp = 1``.
Documents: 16 equal documents, so every chunk boundary falls inside one.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from titanlite.models.llama3.args import Llama3ModelArgs
from titanlite.models.llama3.model import Attention, precompute_rope

GIB = 2**30


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _layer_inputs(args: argparse.Namespace, documents: bool):
    """The layer (seeded), the whole sequence's input, rotary table and document ids."""
    torch.manual_seed(0)
    model_args = Llama3ModelArgs(dim=args.dim, n_heads=args.heads, n_kv_heads=args.kv_heads, max_seq_len=args.seq_len)
    layer = Attention(model_args)
    x = torch.randn(1, args.seq_len, args.dim)
    rope = precompute_rope(model_args.head_dim, args.seq_len)
    ids = torch.arange(args.seq_len).div(args.seq_len // 16, rounding_mode="floor")[None] if documents else None
    return layer, x, rope, ids


def _measure(rank: int, cp: int, port: int, args: argparse.Namespace, documents: bool, out: dict) -> None:
    """One process's forward and backward; its peak-memory rise (GiB) and time in ``out[rank]``."""
    from titanlite.models.attention import block_causal_bool_mask
    from titanlite.models.context_attention import ContextMask
    from titanlite.parallel.context_parallel import ContextParallel

    torch.set_num_threads(1)
    layer, x, rope, ids = _layer_inputs(args, documents)
    if cp > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=cp)
        group = ContextParallel(dist.group.WORLD, cp, rank, args.seq_len)
        x = group.shard(x).requires_grad_()
        table = rope[group.positions()][None]
        mask = ContextMask.build(group, ids)  # the whole sequence's document ids
    else:
        x, table = x.requires_grad_(), rope
        mask = None if ids is None else block_causal_bool_mask(ids)
    before, start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, time.perf_counter()
    layer(x, table, mask).sum().backward()
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out[rank] = {"peak_rise_gib": (peak - before) * 1024 / GIB, "seconds": seconds}
    if cp > 1:
        dist.destroy_process_group()


def run_setting(args: argparse.Namespace, cp: int, documents: bool) -> dict:
    """Rank 0's figures for ``cp`` processes (fresh ones, so that each peak is the layer's own)."""
    with mp.Manager() as manager:
        out = manager.dict()
        mp.start_processes(_measure, (cp, _free_port(), args, documents, out), nprocs=cp, start_method="spawn")
        return dict(out[0])


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(prog="titanlite bench context-parallel", description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-len", type=int, default=16384)
    p.add_argument("--cp", default="1,2", help="context-parallel degrees, comma-separated (1 first: the baseline)")
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--masks", default="causal,documents", help="comma-separated: causal, documents (block-causal)")
    p.add_argument("--json-out", default="")
    args = p.parse_args(argv)
    if unknown := set(args.masks.split(",")) - {"causal", "documents"}:
        p.error(f"--masks: unknown mask {sorted(unknown)[0]!r} (expected causal and/or documents, comma-separated)")
    rows = []
    for mask in args.masks.split(","):
        base = None
        for cp in (int(c) for c in args.cp.split(",")):
            row = {"mask": mask, "cp": cp, "seq_len": args.seq_len, **run_setting(args, cp, mask == "documents")}
            base = base or row
            row["vs_first"] = row["peak_rise_gib"] / max(base["peak_rise_gib"], 1e-9)
            rows.append(row)
            print(json.dumps(row), flush=True)
    print("| mask | cp | seq_len | peak memory rise, rank 0 (GiB) | vs first | time, rank 0 (s) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['mask']} | {r['cp']} | {r['seq_len']} | {r['peak_rise_gib']:.3f} | {r['vs_first']:.2f} "
            f"| {r['seconds']:.1f} |"
        )
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()

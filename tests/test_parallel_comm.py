"""Collective timeouts ([comm]): a rank that never joins a collective makes the others fail fast."""

from __future__ import annotations

import time

import pytest
from dist_utils import backends, run_workers


def missing_rank_worker(args: dict) -> dict:
    """Rank 1 skips an all-reduce; rank 0 must get an error after ~the timeout, not hang."""
    import torch
    import torch.distributed as dist

    from titanlite.parallel.distributed import init_distributed, set_collective_timeout, world_from_env

    world = world_from_env()
    init_distributed(world, timeout_seconds=args["init_timeout"])
    dist.barrier()
    if args["train_timeout"] is not None:
        set_collective_timeout(args["train_timeout"])
    out = {"error": None, "seconds": None}
    if world.rank == 0:
        start = time.perf_counter()
        try:
            dist.all_reduce(torch.ones(4, device=world.device))
        except Exception as e:  # the timeout surfaces as a (backend-specific) RuntimeError
            out["error"] = f"{type(e).__name__}: {e}"
        out["seconds"] = time.perf_counter() - start
    else:
        time.sleep(args["sleep"])  # alive but absent: a hang, not a crash
    dist.destroy_process_group()  # the group is broken: leave without the launcher's final barrier
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize("backend", backends(2))
def test_hung_collective_fails_after_timeout(backend):
    """The process group starts with a long ([comm] init_timeout_seconds-like) timeout, lowered by
    set_collective_timeout as the Trainer does after its first step ([comm] train_timeout_seconds):
    the hung all-reduce then fails after ~1 s instead of waiting for the other rank."""
    res = run_workers(
        missing_rank_worker, 2, {"init_timeout": 300, "train_timeout": 1, "sleep": 5}, backend=backend, timeout=120
    )
    assert res[0]["error"] is not None, res[0]
    assert 0.8 <= res[0]["seconds"] < 4.5, res[0]

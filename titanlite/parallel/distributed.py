"""Process-group set-up from torchrun's environment (gloo on CPU, NCCL on CUDA), and timeouts (``[comm]``):
``init_timeout_seconds`` covers the start-up and the first step, which may include minutes of compilation on some
ranks while others already wait in a collective; ``train_timeout_seconds`` then bounds every collective, so that a
rank that dies or hangs makes the others fail (gloo raises, the NCCL watchdog aborts) instead of waiting forever.
"""

from __future__ import annotations

import datetime
import logging
import os
import sys
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import NoReturn

import torch
import torch.distributed as dist

from titanlite.errors import one_line
from titanlite.utils import torch_compat


@dataclass(frozen=True)
class WorldInfo:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def world_from_env() -> WorldInfo:
    """Rank, world size and device from torchrun's variables (one process when they are unset)."""
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", local_rank % torch.cuda.device_count()) if cuda else torch.device("cpu")
    return WorldInfo(rank, local_rank, world_size, device)


def init_distributed(world: WorldInfo, timeout_seconds: float = 300.0) -> None:
    """Join the process group when there is more than one process (no-op otherwise or when joined);
    ``timeout_seconds`` bounds the rendezvous and every collective until :func:`set_collective_timeout`."""
    if world.world_size == 1 or dist.is_initialized():
        return
    cuda = world.device.type == "cuda"
    if cuda:
        torch.cuda.set_device(world.device)
    dist.init_process_group(
        backend="nccl" if cuda else "gloo",
        timeout=datetime.timedelta(seconds=timeout_seconds),
        device_id=world.device if cuda else None,
    )


def set_collective_timeout(timeout_seconds: float, groups: Iterable[dist.ProcessGroup | None] = ()) -> None:
    """Set the timeout of the default group and of ``groups`` (e.g. the device mesh's groups), after a barrier so
    that no rank is still inside a collective started under the old timeout."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    dist.barrier()
    for group in {id(group): group for group in [None, *groups]}.values():  # each group once, in order
        torch_compat.set_pg_timeout(timeout_seconds, group)


def run_on_rank0(fn):
    """Run ``fn`` on rank 0 only and give every rank its result (broadcast). Any exception raised there
    is raised on every rank (rank 0 its own; the others the same type when it is a ValueError or
    FileNotFoundError, else a RuntimeError naming it), so no rank waits for a broadcast that never
    comes. Just ``fn()`` without a process group."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return fn()
    payload, error = None, None
    if dist.get_rank() == 0:
        try:
            payload = ("ok", fn())
        except Exception as e:  # noqa: BLE001 - re-raised below, after the others were told
            payload, error = (type(e).__name__, one_line(e)), e
    box = [payload]
    dist.broadcast_object_list(box, src=0)
    if error is not None:
        raise error
    kind, value = box[0]
    if kind == "ok":
        return value
    if kind in ("ValueError", "FileNotFoundError"):
        raise (FileNotFoundError if kind == "FileNotFoundError" else ValueError)(value)
    raise RuntimeError(f"on rank 0: {kind}: {value}")


def all_reduce_sum(t: torch.Tensor, group=None) -> torch.Tensor:
    """Sum of ``t`` over ``group`` (the default group when None; ``t`` itself when not distributed)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        t = t.clone()
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


def exit_skipping_finalization(code: int = 0) -> NoReturn:
    """End the process now with ``code``: flush logging and the standard streams, then ``os._exit``.

    For a process that has used a gloo group, once everything it writes is closed: Python's own finalization
    can abort a complete run ("terminate called without an active exception") when a gloo worker thread drops
    the last collective's work object and cannot take the GIL to free its tensors. ``barrier`` +
    ``destroy_process_group`` do not prevent it: the group lives on in the device meshes and DTensors.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main_then_exit(entry: Callable[[], object]) -> NoReturn:
    """Run a command line's ``entry`` and end the process with its exit status: ``SystemExit``'s code, 1
    with the traceback for any other exception. Under torchrun (``WORLD_SIZE`` > 1) the interpreter's
    finalization is skipped (:func:`exit_skipping_finalization`); a single process exits as usual."""
    if int(os.environ.get("WORLD_SIZE", "1") or 1) <= 1:
        entry()
        raise SystemExit(0)
    try:
        entry()
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if isinstance(e.code, str):
            sys.stderr.write(f"{e.code}\n")
    except BaseException as e:  # noqa: BLE001 - reported as Python would, then the same exit without finalizing
        traceback.print_exc()
        code = 130 if isinstance(e, KeyboardInterrupt) else 1
    exit_skipping_finalization(code)

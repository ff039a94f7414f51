"""Staging: a CPU copy of the state to save, so training can continue while it is written.

A :class:`Stager` walks a nested state dict (dicts, lists, tuples) and copies every tensor to CPU;
DTensors keep their sharding description around a CPU copy of the local shard, so DCP still writes
each rank's piece with its global offsets. Other leaves are deep-copied.

Options (``[checkpoint] async_mode``: ``async`` = fresh buffers, ``async_with_pinned_mem`` =
reused pinned buffers, both in the background):

- ``reuse_buffers``: CPU buffers allocated on the first save and reused (no allocation or page
  faults afterwards; the caller must not stage into them again before the previous save has been
  written); otherwise fresh CPU tensors per save.
- ``pin_memory`` (with CUDA only): page-locked buffers, so device-to-host copies are DMA.
- ``background``: the copy runs on a staging thread (on CUDA, on a side stream that first waits for
  the work already queued on the caller's stream) and :meth:`Stager.stage` returns a future; the
  caller must wait for it before anything modifies the staged tensors in place (the next optimizer
  step). Without it the copy is done before ``stage`` returns.
"""
from __future__ import annotations

import copy
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Optional

import torch

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - builds without distributed
    DTensor = None  # type: ignore[assignment]


class Stager:
    def __init__(self, *, reuse_buffers: bool = False, background: bool = False, pin_memory: bool = False):
        self.reuse_buffers = reuse_buffers
        self.pin_memory = pin_memory and torch.cuda.is_available()
        self._buffers: dict[str, torch.Tensor] = {}
        self._stream = torch.cuda.Stream() if background and torch.cuda.is_available() else None
        # A new thread starts on CUDA device 0: leaving a stream context there would switch the
        # thread to device 0 and create a CUDA context on GPU 0 for every rank, so the staging
        # thread is put on this rank's device first.
        init = {} if self._stream is None else {"initializer": torch.cuda.set_device,
                                                "initargs": (self._stream.device,)}
        self._executor = (ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-stage", **init)
                          if background else None)

    def stage(self, state: Any) -> Any | Future:
        """A CPU copy of ``state`` (a future of it with ``background=True``).

        Containers and non-tensor leaves (e.g. the optimizer's param groups) are copied before this
        returns, in any case: only tensor data is copied in the background.
        """
        state = _copy_structure(state)
        if self._executor is None:
            return self._stage(state, None)
        ready = None
        if self._stream is not None:  # the copies must see every kernel queued so far
            ready = torch.cuda.Event()
            ready.record()
        return self._executor.submit(self._stage, state, ready)

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        self._buffers.clear()

    # ---- internals ----
    def _stage(self, state: Any, ready: Optional[torch.cuda.Event]) -> Any:
        if self._stream is None:
            return self._walk(state, "")
        self._stream.wait_event(ready)
        with torch.cuda.stream(self._stream):
            out = self._walk(state, "")
        self._stream.synchronize()
        return out

    def _walk(self, obj: Any, path: str) -> Any:
        if isinstance(obj, dict):
            return {k: self._walk(v, f"{path}/{k}") for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            items = [self._walk(v, f"{path}/{i}") for i, v in enumerate(obj)]
            return items if isinstance(obj, list) else tuple(items)
        if DTensor is not None and isinstance(obj, DTensor):
            local = self._copy(obj._local_tensor, path)
            return DTensor(local, obj._spec, requires_grad=False)
        if isinstance(obj, torch.Tensor):
            return self._copy(obj, path)
        return obj  # already a private copy (_copy_structure)

    def _copy(self, src: torch.Tensor, path: str) -> torch.Tensor:
        src = src.detach()
        if not self.reuse_buffers:
            if src.device.type == "cpu":
                return src.clone(memory_format=torch.contiguous_format)
            return src.to("cpu", copy=True)
        buf = self._buffers.get(path)
        if buf is None or buf.shape != src.shape or buf.dtype != src.dtype:
            buf = torch.empty(src.shape, dtype=src.dtype, device="cpu", pin_memory=self.pin_memory)
            self._buffers[path] = buf
        buf.copy_(src, non_blocking=self.pin_memory and src.device.type == "cuda")
        return buf


def _copy_structure(obj: Any) -> Any:
    """Containers and non-tensor leaves copied; tensors (and DTensors) kept by reference."""
    if isinstance(obj, dict):
        return {k: _copy_structure(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        items = [_copy_structure(v) for v in obj]
        return items if isinstance(obj, list) else tuple(items)
    if isinstance(obj, torch.Tensor):
        return obj
    return copy.deepcopy(obj)

"""Every private torch (and torchdata) API titanlite calls, in one place, each where no public one does the job.

tests/test_torch_compat.py checks each (and the private names used in place, below) against the installed torch by
name, so an upgrade that moves one fails that test, not a run. Imports are lazy: a missing private module fails the
call that needs it, not ``import titanlite``.

Used in place (torch's own ops and extension points; checked by the test): ``torch._foreach_norm/_sub/_mul_``,
``torch._scaled_mm``, ``torch._grouped_mm``, ``torch.ops._c10d_functional`` (activation checkpointing's save list),
``torch.utils._pytree``, ``torch.Tensor._make_wrapper_subclass``, ``DTensor._local_tensor``,
``nn.Module._register_state_dict_hook``, ``torch.cuda.memory._dump_snapshot``, ``_StridedShard.split_factor``
(dry run) and the override of ``PipelineStage._prepare_forward_infra`` (parallel/pipeline.py).
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import Any


def loader_is_iterating(loader: Any) -> bool:
    """Whether a torchdata ``StatefulDataLoader`` has a live iterator (one a loaded state would not reach)."""
    return loader._iterator is not None and not loader._initial_iter_for_state_dict


def staging_executor(stager: Any) -> Any:
    """The one-thread executor a DCP ``DefaultStager`` stages on (None without async staging)."""
    return getattr(stager, "_staging_executor", None)


def set_element(root: dict, path: tuple, value: Any) -> None:
    """DCP's setter of a flattened state-dict item back into its nested place."""
    from torch.distributed.checkpoint._traverse import set_element as dcp_set_element

    dcp_set_element(root, path, value)


def local_shape_fn() -> Callable | None:
    """DTensor's ``(global_shape, mesh_shape, coordinate, placements, skip_offset) -> (local shape, offset)`` for
    any rank's coordinate (the public one computes only this rank's); None where torch lacks it."""
    try:
        from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset as fn
    except ImportError:
        return None
    return fn


def fake_store() -> Any:
    """A store for ``init_process_group("fake", ...)``; importing it registers the "fake" backend."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


def seed_dtensor_rng(seed: int, mesh: Any) -> None:
    """Seed DTensor's RNG on ``mesh`` where DTensor keeps one (CUDA meshes)."""
    from torch.distributed.tensor._random import is_rng_supported_mesh, manual_seed

    if is_rng_supported_mesh(mesh):
        manual_seed(seed, mesh)


def set_pg_timeout(seconds: float, group: Any = None) -> None:
    """Change a live process group's collective timeout (None: the default group)."""
    from torch.distributed import distributed_c10d

    distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=seconds), group)


def flatten_mesh(mesh: Any, name: str) -> Any:
    """A device mesh's dimensions as one dimension ``name`` of its root mesh."""
    return mesh._flatten(name)


def unflatten_mesh(mesh: Any, dim: str, sizes: tuple[int, ...], names: tuple[str, ...]) -> Any:
    return mesh._unflatten(dim, sizes, names)


def group_by_device_and_dtype(tensors: list) -> list[list]:
    """``tensors`` in one list per (device, dtype), each in input order."""
    from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype

    return [ts for (ts,), _ in _group_tensors_by_device_and_dtype([tensors]).values()]


def fx_config() -> Any:
    """``torch.fx.experimental._config``: the symbolic-shape switches (``.patch(**switches)``)."""
    from torch.fx.experimental import _config

    return _config


def record_memory_history(**kwargs: Any) -> None:
    """Start (``max_entries=N``) or stop (``enabled=None``) the CUDA caching allocator's history."""
    from torch.cuda import memory

    memory._record_memory_history(**kwargs)


def mark_static_address(tensor: Any) -> None:
    """Tell torch.compile that ``tensor`` keeps its storage (a KV cache), without a guard on it."""
    from torch import _dynamo

    _dynamo.mark_static_address(tensor, guard=False)


def set_scheduler_counters(scheduler: Any, step_count: int, last_lr: list[float]) -> None:
    """An LR scheduler's step counter and the learning rates ``get_last_lr()`` reports."""
    scheduler._step_count, scheduler._last_lr = step_count, last_lr

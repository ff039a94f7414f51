"""Every private torch API titanlite uses still exists with the signature and behaviour titanlite relies on.

Each check is one test whose id (and failure message) names the API, so a torch upgrade that moves one fails
here by name. References: torch.chunk for DTensor's shard sizes, a plain dict grouping for the device/dtype
groups, the public getters (``get_last_lr``, ``state_dict``, ``get_world_size``) for the private setters."""

from __future__ import annotations

import concurrent.futures
import contextlib
import importlib
import inspect

import pytest
import torch
import torch.distributed as dist

from titanlite.utils import torch_compat as tc


def params(fn) -> list[str]:
    return list(inspect.signature(fn).parameters)


def resolve(dotted: str):
    """``torch.a.b.c`` -> the object; a one-line failure naming what is missing."""
    parts = dotted.split(".")
    obj = importlib.import_module(parts[0])
    for i, part in enumerate(parts[1:], start=1):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            try:
                obj = importlib.import_module(".".join(parts[: i + 1]))
            except ImportError:
                pytest.fail(f"torch changed a private API titanlite uses: {dotted} is gone ({part} missing)")
    return obj


@contextlib.contextmanager
def fake_world(size: int = 4):
    dist.init_process_group("fake", rank=0, world_size=size, store=tc.fake_store())
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_StatefulDataLoader_iterator_state():
    from torchdata.stateful_dataloader import StatefulDataLoader

    loader = StatefulDataLoader(list(range(8)), batch_size=2)
    assert not tc.loader_is_iterating(loader), "StatefulDataLoader._iterator: set before iter()"
    state = loader.state_dict()  # makes the iterator that the next iter() hands out, flagged as such
    assert loader._iterator is not None, "StatefulDataLoader._iterator: not made by state_dict()"
    assert not tc.loader_is_iterating(loader), "StatefulDataLoader._initial_iter_for_state_dict: not set"
    next(iter(loader))
    assert tc.loader_is_iterating(loader), "StatefulDataLoader._iterator: not kept by iter()"
    loader.load_state_dict(state)
    assert not tc.loader_is_iterating(loader), "StatefulDataLoader.load_state_dict: kept the live iterator"


def test_DefaultStager_staging_executor():
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    options = dict(use_pinned_memory=False, use_shared_memory=False, use_non_blocking_copy=False)
    stager = DefaultStager(StagingOptions(use_async_staging=True, **options))
    try:
        assert isinstance(tc.staging_executor(stager), concurrent.futures.Executor), (
            "DefaultStager._staging_executor is gone: the staging thread would stay on CUDA device 0"
        )
    finally:
        stager.close()
    assert tc.staging_executor(DefaultStager(StagingOptions(use_async_staging=False, **options))) is None


def test_dcp_traverse_set_element():
    assert params(resolve("torch.distributed.checkpoint._traverse.set_element")) == ["root_dict", "path", "value"]
    root = {"a": {"b": [1, 2]}}
    tc.set_element(root, ("a", "b", 1), 5)
    tc.set_element(root, ("x", "y"), 7)
    assert root == {"a": {"b": [1, 5]}, "x": {"y": 7}}


def test_dtensor_compute_local_shape_and_global_offset():
    from torch.distributed.tensor import Replicate, Shard

    fn = tc.local_shape_fn()
    assert fn is not None, "torch.distributed.tensor._utils._compute_local_shape_and_global_offset is gone"
    assert params(fn)[:4] == ["global_shape", "mesh_shape", "my_coordinate", "placements"] and "skip_offset" in params(
        fn
    )
    for rank in range(4):  # torch.chunk's split: 3, 3, 3, 1 rows
        want = (torch.arange(10).chunk(4)[rank].numel(), 6)
        assert fn((10, 6), (4,), [rank], [Shard(0)], skip_offset=True)[0] == want
    assert fn((10, 6), (2, 2), [1, 0], [Shard(1), Replicate()], skip_offset=True)[0] == (10, 3)


def test_fake_process_group_and_device_mesh_flatten_unflatten():
    from torch.distributed.device_mesh import init_device_mesh

    with fake_world(4):
        assert dist.get_world_size() == 4 and dist.get_backend() == "fake"
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
        flat = tc.flatten_mesh(mesh["a", "b"], "ab")  # DeviceMesh._flatten
        assert (flat.size(), flat.mesh_dim_names) == (4, ("ab",))
        assert mesh["ab"].size() == 4, "DeviceMesh._flatten: the flattened dimension is not in the root mesh"
        line = init_device_mesh("cpu", (4,), mesh_dim_names=("x",))
        split = tc.unflatten_mesh(line, "x", (2, 2), ("p", "q"))  # DeviceMesh._unflatten
        assert tuple(split.mesh.shape) == (2, 2) and split.mesh_dim_names == ("p", "q")


def test_distributed_c10d_set_pg_timeout(recwarn):
    assert params(resolve("torch.distributed.distributed_c10d._set_pg_timeout")) == ["timeout", "group"]
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        tc.set_pg_timeout(123.0)
        tc.set_pg_timeout(45.0, dist.new_group([0]))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    assert not [w for w in recwarn if "timeout" in str(w.message).lower()], "_set_pg_timeout ignored on gloo"


def test_dtensor_random_manual_seed():
    from torch.distributed.device_mesh import init_device_mesh

    assert params(resolve("torch.distributed.tensor._random.manual_seed"))[:2] == ["seed", "device_mesh"]
    supported = resolve("torch.distributed.tensor._random.is_rng_supported_mesh")
    with fake_world(2):
        mesh = init_device_mesh("cpu", (2,))
        assert supported(mesh) is False  # DTensor keeps no RNG on a CPU mesh: seeding is a no-op there
        tc.seed_dtensor_rng(5, mesh)


def test_foreach_utils_group_tensors_by_device_and_dtype():
    ts = [torch.ones(2), torch.ones(3, dtype=torch.float64), torch.zeros(1), torch.zeros(2, dtype=torch.float64)]
    groups = tc.group_by_device_and_dtype(ts)
    reference: dict = {}
    for t in ts:
        reference.setdefault((t.device, t.dtype), []).append(t)
    got = sorted([id(t) for t in g] for g in groups)  # groups in torch's order, each in the input order
    assert got == sorted([id(t) for t in g] for g in reference.values())


def test_fx_experimental_config_switches():
    config = tc.fx_config()
    missing = [k for k in ("use_duck_shape", "backed_size_oblivious") if not hasattr(config, k)]
    assert not missing, f"torch.fx.experimental._config lacks {missing}: eval's compiled forward would specialize"
    with config.patch(use_duck_shape=False):
        assert config.use_duck_shape is False


def test_cuda_memory_history_and_snapshot():
    for name, want in (("_record_memory_history", {"enabled", "max_entries"}), ("_dump_snapshot", {"filename"})):
        assert want <= set(params(resolve(f"torch.cuda.memory.{name}"))), f"torch.cuda.memory.{name}"


def test_dynamo_mark_static_address():
    assert "guard" in params(resolve("torch._dynamo.mark_static_address"))
    tc.mark_static_address(torch.zeros(3))


def test_lr_scheduler_step_count_and_last_lr():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5**s)
    tc.set_scheduler_counters(sched, 4, [0.125])
    assert sched.get_last_lr() == [0.125] and sched.state_dict()["_step_count"] == 4
    assert {"_step_count", "_last_lr"} <= set(sched.state_dict())


@pytest.mark.parametrize(
    "api",
    [
        "torch._foreach_norm",
        "torch._foreach_sub",
        "torch._foreach_mul_",
        "torch._scaled_mm",
        "torch._grouped_mm",
        "torch.ops._c10d_functional.reduce_scatter_tensor.default",
        "torch.ops._c10d_functional.all_reduce.default",
        "torch.utils._pytree.tree_map_only",
        "torch.Tensor._make_wrapper_subclass",
        "torch.nn.Module._register_state_dict_hook",
        "torch.distributed.tensor.placement_types._StridedShard",
        "torch.distributed.pipelining.stage.PipelineStage._prepare_forward_infra",
    ],
)
def test_private_names_used_in_place_exist(api):
    assert resolve(api) is not None


def test_names_used_in_place_keep_their_shape():
    assert torch.equal(torch.stack(torch._foreach_norm([torch.tensor([3.0, 4.0])], 2.0)), torch.tensor([5.0]))
    assert "split_factor" in params(resolve("torch.distributed.tensor.placement_types._StridedShard"))
    assert params(torch.nn.Module._register_state_dict_hook)[1:] == ["hook"]
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    with fake_world(2):
        dt = distribute_tensor(torch.zeros(4, 2), init_device_mesh("cpu", (2,)), [Shard(0)])
        local = dt._local_tensor
        assert type(local) is torch.Tensor and local.data_ptr() == dt.to_local().data_ptr(), "DTensor._local_tensor"

"""``TrainStep`` on a model the user sharded with torch's own ``fully_shard`` (which averages gradients over the
data-parallel ranks, where TrainStep's per-rank shares must be summed): the loss and the gradient norm equal one
process's on the whole batch, so ``max_norm`` clips at its threshold."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.dist import run_workers
from titanlite.models import build_model
from titanlite.trainer.step import TrainStep

SEQ, BATCH = 32, 2  # per rank


def tiny_model():
    torch.manual_seed(0)
    model = build_model("llama3", "debugmodel", device="cpu", dim=64, n_layers=2, n_heads=4, n_kv_heads=2)
    model.init_weights()
    return model


def whole_batch() -> dict[str, torch.Tensor]:
    tokens = torch.randint(0, 512, (2 * BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))
    return {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]}


def own_fully_shard_worker(args: dict) -> tuple[float, float]:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from titanlite.parallel import ParallelDims
    from titanlite.trainer.runtime import Runtime

    dist.init_process_group("gloo")
    dims = ParallelDims(world_size=2)
    dims.build_mesh("cpu")
    model = tiny_model()
    for block in model.layers.values():
        fully_shard(block, mesh=dims.fsdp_mesh)
    fully_shard(model, mesh=dims.fsdp_mesh)  # torch's default: the mean over the ranks
    runtime = Runtime(torch.device("cpu"), parallel_dims=dims)
    step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), runtime=runtime, max_norm=0.0)
    rank = dims.dp_rank(dist.get_rank())
    mine = {k: v[rank * BATCH : (rank + 1) * BATCH] for k, v in whole_batch().items()}
    result = step(iter([mine]))
    dist.destroy_process_group()
    return result.loss_value, result.grad_norm_value


@pytest.mark.usefixtures("one_thread")
def test_own_fully_shard_gives_one_process_grad_norm():
    model = tiny_model()
    reference = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), max_norm=0.0)(iter([whole_batch()]))
    for loss, norm in run_workers(own_fully_shard_worker, 2, timeout=180):
        assert loss == pytest.approx(reference.loss_value, rel=1e-6)
        assert norm == pytest.approx(reference.grad_norm_value, rel=5e-6)

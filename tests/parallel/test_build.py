"""build_parallel_model's guarantees, and the checkpoint manager's refusal to load under a running iterator."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from tests.helpers.dist import run_workers
from titanlite.models import ModelSpec
from titanlite.parallel import ParallelDims, build_parallel_model
from titanlite.parallel.build import tied_parameters


@dataclasses.dataclass
class TinyArgs:
    vocab_size: int = 32
    dim: int = 8
    n_layers: int = 1
    n_heads: int = 2


class TiedLM(nn.Module):
    """Embedding and output share one tensor; ``retie_in_init=False`` leaves re-tying to the builder."""

    def __init__(self, a: TinyArgs, untie_in_init: bool = False):
        super().__init__()
        self.emb = nn.Embedding(a.vocab_size, a.dim)
        self.layers = nn.ModuleDict({"0": nn.Linear(a.dim, a.dim)})
        self.head = nn.Linear(a.dim, a.vocab_size, bias=False)
        self.head.weight = self.emb.weight
        self.untie_in_init = untie_in_init

    @torch.no_grad()
    def init_weights(self):
        nn.init.normal_(self.emb.weight, std=0.02)
        self.layers["0"].reset_parameters()
        if self.untie_in_init:  # a family bug: assigns a new tensor instead of initializing in place
            self.head.weight = nn.Parameter(torch.zeros_like(self.emb.weight))

    def forward(self, tokens):
        return self.head(self.layers["0"](self.emb(tokens)))


def spec(model_cls=TiedLM, parallelize_fn=None) -> ModelSpec:
    return ModelSpec(
        name="tiny", args_cls=TinyArgs, flavors={"x": TinyArgs()}, model_cls=model_cls, parallelize_fn=parallelize_fn
    )


def test_to_empty_unties_and_the_builder_reties():
    with torch.device("meta"):
        model = TiedLM(TinyArgs())
    assert tied_parameters(model) == [["emb.weight", "head.weight"]]
    model.to_empty(device="cpu")
    assert model.head.weight is not model.emb.weight  # what to_empty does on its own
    built = build_parallel_model(spec(), TinyArgs())
    assert built.head.weight is built.emb.weight and built.emb.weight.abs().sum() > 0
    loss = built(torch.arange(8)[None]).sum()
    loss.backward()  # one tensor, one gradient holding both uses
    assert built.emb.weight.grad is built.head.weight.grad


def test_an_init_that_unties_is_refused():
    class Untying(TiedLM):
        def __init__(self, a):
            super().__init__(a, untie_in_init=True)

    with pytest.raises(ValueError, match="init_weights\\(\\) untied the shared parameters emb.weight, head.weight"):
        build_parallel_model(spec(Untying), TinyArgs())


def fsdp_plan(model, dims, policies):
    """A parallelize function: the whole model one FSDP group."""
    return policies.fsdp(dims).finish(model)


def tied_fsdp_worker(args: dict) -> dict:
    from titanlite.parallel import init_distributed, world_from_env

    world = world_from_env()
    init_distributed(world)
    dims = ParallelDims(world_size=world.world_size)
    dims.build_mesh("cpu")
    torch.manual_seed(0)
    model = build_parallel_model(spec(parallelize_fn=fsdp_plan), TinyArgs(), dims)  # weight_init auto: rank0
    return {k: v.full_tensor() for k, v in model.state_dict().items()}


@pytest.mark.multiprocess
def test_rank0_init_keeps_a_tied_embedding_whose_init_writes_only_the_embedding():
    """``rank0`` initialization (FSDP on CPU) of a family whose ``init_weights`` writes the embedding and not
    the tied output: the reference copy is re-tied too, so the sharded model starts from the one-process
    weights (the untied reference's uninitialized output used to overwrite the embedding)."""
    torch.manual_seed(0)
    expected = build_parallel_model(spec(), TinyArgs()).state_dict()
    for got in run_workers(tied_fsdp_worker, 2, timeout=120):
        assert got.keys() == expected.keys()
        for k, v in expected.items():
            assert torch.equal(got[k], v), k
        assert got["emb.weight"].std() > 0.01 and torch.equal(got["emb.weight"], got["head.weight"])


@pytest.mark.parametrize("dims", [dict(dp_shard=2, world_size=2), dict(tp=2, world_size=2)], ids=["dp2", "tp2"])
def test_a_family_without_parallelize_is_refused_on_several_ranks(dims):
    with pytest.raises(ValueError, match="has no parallelize function, so it trains on one process only"):
        build_parallel_model(spec(), TinyArgs(), ParallelDims(**dims))


def test_checkpoint_load_is_refused_once_the_loader_iterates(tmp_path):
    from titanlite.checkpoint import CheckpointManager
    from titanlite.config.sections import Checkpoint
    from titanlite.data.loader import build_dataloader

    loader = build_dataloader(torch.arange(1000), seq_len=8, batch_size=2)
    manager = CheckpointManager(Checkpoint(enable=True), tmp_path, {"model": nn.Linear(2, 2), "data": loader})
    assert manager.load() is None  # nothing saved yet, and the loader is fresh
    next(iter(loader))
    with pytest.raises(RuntimeError, match="already being iterated"):
        manager.load()
    manager.close()


def test_an_unknown_component_name_names_the_key_and_the_closest_one():
    import titanlite.optim  # noqa: F401  (registers the built-in optimizers)
    from titanlite import components

    with pytest.raises(
        ValueError, match=r"^optimizer\.name='AdamX' is not a registered optimizer .*did you mean 'Adam'"
    ):
        components.get("optimizer", "AdamX")


def test_a_weights_only_checkpoint_manager_leaves_the_global_rng_alone(tmp_path):
    """A manager given the model only (a library user loading weights) restores the weights and never the
    process's random state (it restored the saving run's, silently changing every later draw)."""
    import random

    from titanlite.checkpoint import CheckpointManager
    from titanlite.config.sections import Checkpoint

    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    section = Checkpoint(enable=True, last_save_model_only=False)
    saver = CheckpointManager(section, tmp_path, {"model": model, "optimizer": optimizer})
    assert saver.save(1, last=True)
    saver.close()
    fresh = nn.Linear(4, 4)
    torch.manual_seed(123)
    random.seed(123)
    before = (torch.get_rng_state(), random.getstate())
    loader = CheckpointManager(section, tmp_path, {"model": fresh})
    assert loader.load() == 1 and torch.equal(fresh.weight, model.weight)
    assert torch.equal(torch.get_rng_state(), before[0]) and random.getstate() == before[1]
    loader.close()
    full = CheckpointManager(section, tmp_path, {"model": fresh, "optimizer": torch.optim.AdamW(fresh.parameters())})
    full.load()  # a training state: its RNG is restored, as the exact resume needs
    assert not torch.equal(torch.get_rng_state(), before[0])
    full.close()

"""Muon in one process (titanlite.optim.muon, muon_math, muon_split, muon_owners) against torch's own Muon.

The reference is ``torch.optim.Muon`` on the split's matrices plus ``torch.optim.AdamW`` on the rest, built here by
hand with titanlite's weight-decay groups, stepping on the clipped gradients the TrainStep under test hands its
optimizer (copied by a step pre-hook: clipping them again independently would differ by an ulp, and a bf16
Newton-Schulz turns an ulp of input into a bf16 ulp of update, 2e-4 here). With torch's bf16 Newton-Schulz the
parameters must agree within 1e-6 over 10 steps. The MoE model's stacked experts have no torch counterpart (torch's
Muon takes 2-D tensors only), so there torch's functional step runs on each expert's matrix, a view into the stack.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.optim._muon import _adjust_lr, _single_tensor_muon, _zeropower_via_newtonschulz

from titanlite.config.sections import Optimizer
from titanlite.errors import ConfigError
from titanlite.models import build_model
from titanlite.optim.muon import MuonAdamW, build_muon
from titanlite.optim.muon_math import DEFAULT_COEFFICIENTS, adjusted_lr, newton_schulz, newton_schulz_flops
from titanlite.optim.muon_owners import assign_owners, rank_loads
from titanlite.optim.muon_split import split_params
from titanlite.trainer.step import TrainStep

pytestmark = pytest.mark.usefixtures("one_thread")

STEPS, LR, MUON_LR, WD, MAX_NORM, TOL = 10, 1e-2, 2e-2, 0.1, 0.5, 1e-6
TINY = dict(device="cpu", dim=64, n_layers=2, n_heads=4, n_kv_heads=2)


def section(**overrides) -> Optimizer:
    """An ``[optimizer]`` section for Muon, torch's bf16 Newton-Schulz, the foreach AdamW kernel."""
    base = dict(name="muon", lr=LR, muon_lr=MUON_LR, weight_decay=WD, ns_dtype="bfloat16", implementation="foreach")
    return Optimizer(**{**base, **overrides})


@pytest.mark.parametrize("shape", [(48, 80), (80, 48), (64, 64)])
def test_newton_schulz_equals_torch_bf16(shape):
    g = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    want = _zeropower_via_newtonschulz(g, DEFAULT_COEFFICIENTS, 5, 1e-7)
    assert torch.equal(newton_schulz(g, DEFAULT_COEFFICIENTS, 5, torch.bfloat16), want)


def test_batched_newton_schulz_equals_each_matrix():
    g = torch.randn(3, 40, 24, generator=torch.Generator().manual_seed(2))
    got = newton_schulz(g, DEFAULT_COEFFICIENTS, 5, torch.float32)
    for e in range(3):
        want = newton_schulz(g[e], DEFAULT_COEFFICIENTS, 5, torch.float32)
        torch.testing.assert_close(got[e], want, rtol=1e-5, atol=1e-6)
    s = torch.linalg.svdvals(got[0].double())  # orthogonalized: singular values near 1 (the quintic's 0.7..1.2)
    assert 0.5 < s.min() and s.max() < 1.3


@pytest.mark.parametrize("rule", ["original", "match_rms_adamw"])
def test_adjusted_lr_equals_torch(rule):
    for shape in [(64, 256), (256, 64), (128, 128)]:
        assert adjusted_lr(0.02, rule, shape) == _adjust_lr(0.02, rule, torch.Size(shape))
    assert adjusted_lr(0.02, rule, (8, 64, 256)) == adjusted_lr(0.02, rule, (64, 256))


def test_newton_schulz_flops_count_the_three_products():
    m, n = 32, 96  # Gram (m x n x m), its square (m^3), times X (m x m x n): 2 FLOPs per multiply-add
    assert newton_schulz_flops((n, m), 5) == 5 * (2 * m * n * m + 2 * m**3 + 2 * m * m * n)
    assert newton_schulz_flops((4, m, n), 1) == 4 * newton_schulz_flops((m, n), 1)


def test_split_and_pattern_overrides():
    model = build_model("llama3", "debugmodel", **TINY)
    muon, adamw = split_params(model)
    names = {n for n, _ in muon}
    assert names == {n for n, p in model.named_parameters() if p.ndim == 2 and n.split(".")[0] == "layers"}
    assert len(muon) + len(adamw) == len(list(model.parameters()))
    muon, _ = split_params(model, muon_patterns=["output.weight"], adamw_patterns=["layers.1.*"])
    assert "output.weight" in {n for n, _ in muon} and not any(n.startswith("layers.1.") for n, _ in muon)
    with pytest.raises(ConfigError, match="Muon takes matrices"):
        split_params(model, muon_patterns=["norm.weight"])


def reference(model: torch.nn.Module) -> tuple[dict, list]:
    """Copies of the parameters and torch's optimizers on them: Muon on the 2-D matrices of the split, AdamW
    (decay on the output, none on the embedding and norms) on the rest."""
    ref = {n: p.detach().clone().requires_grad_() for n, p in model.named_parameters()}
    muon = {n for n, _ in split_params(model)[0]}
    mats = [ref[n] for n in muon if ref[n].ndim == 2]
    decay = [p for n, p in ref.items() if n not in muon and p.ndim >= 2 and "tok_embeddings" not in n]
    rest = [p for n, p in ref.items() if n not in muon and not (p.ndim >= 2 and "tok_embeddings" not in n)]
    groups = [{"params": decay, "weight_decay": WD}, {"params": rest, "weight_decay": 0.0}]
    opts = [torch.optim.AdamW(groups, lr=LR, betas=(0.9, 0.95), eps=1e-8, foreach=True)]
    opts.append(torch.optim.Muon(mats, lr=MUON_LR, weight_decay=WD, adjust_lr_fn="match_rms_adamw"))
    return ref, opts


def expert_step(stacks: list[torch.Tensor], bufs: dict) -> None:
    """torch's functional Muon step on each expert of each stacked weight (views into the stack)."""
    for w in stacks:
        buf = bufs.setdefault(id(w), torch.zeros_like(w))
        views = [(w[e], w.grad[e], buf[e]) for e in range(w.shape[0])]
        kw = dict(ns_coefficients=DEFAULT_COEFFICIENTS, ns_steps=5, eps=1e-7, has_complex=False, nesterov=True)
        params, grads, bufs_e = (list(t) for t in zip(*views))
        _single_tensor_muon(
            params, grads, bufs_e, lr=MUON_LR, weight_decay=WD, momentum=0.95, adjust_lr_fn="match_rms_adamw", **kw
        )


def batches(vocab: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(STEPS):
        tokens = torch.randint(0, vocab, (2, 33), generator=g)
        yield {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]}


@pytest.mark.parametrize("family", ["llama3", "llama3_moe"])
def test_one_process_equals_torch_muon_plus_adamw(family):
    """10 steps of TrainStep with Muon (clipping on) against torch's Muon + AdamW on the same gradients."""
    torch.manual_seed(0)
    small_moe = dict(moe_num_experts=4, moe_hidden_dim=32) if family == "llama3_moe" else {}
    model = build_model(family, "debugmodel", **TINY, **small_moe)
    ref, opts = reference(model)
    optimizer = build_muon(model, section())
    assert isinstance(optimizer, MuonAdamW) and not optimizer._step_supports_amp_scaling
    step = TrainStep(model, optimizer, grad_accum_steps=1, max_norm=MAX_NORM)
    stacks, bufs = [p for p in ref.values() if p.ndim == 3], {}
    assert (len(stacks) > 0) == (family == "llama3_moe")

    def copy_grads(*_):
        for n, p in model.named_parameters():
            ref[n].grad = p.grad.clone()

    optimizer.register_step_pre_hook(copy_grads)  # the clipped gradients the step's update reads
    for i, batch in enumerate(batches(model.tok_embeddings.num_embeddings)):
        result = step(iter([batch]), step=i + 1)
        assert result.grad_norm_value > MAX_NORM  # the clip acts
        with torch.no_grad():
            for opt in opts:
                opt.step()
            expert_step(stacks, bufs)
        for opt in opts:
            opt.zero_grad()
        err = max((p - ref[n]).abs().max().item() for n, p in model.named_parameters())
        assert err <= TOL, f"step {i + 1}: parameters differ by {err:.2e}"
    assert sum(len(optimizer.state[p]) == 1 for p in optimizer.param_groups[-1]["params"]) == len(
        optimizer.param_groups[-1]["params"]
    )  # one momentum buffer per Muon matrix


def test_owner_assignment_is_balanced_at_the_1b_shape():
    """Llama 3.2 1B (dim 2048, 16 layers, 32 / 8 heads of 64, FFN 8192) on 8 ranks: the largest rank's
    Newton-Schulz FLOPs are at most 1.25x the mean."""
    dim, kv, ffn = 2048, 8 * 64, 8192
    layer = [(dim, dim), (kv, dim), (kv, dim), (dim, dim), (ffn, dim), (dim, ffn), (ffn, dim)]
    costs = [newton_schulz_flops(s, 5) for _ in range(16) for s in layer]
    loads = rank_loads(costs, assign_owners(costs, 8), 8)
    assert max(loads) <= 1.25 * (sum(loads) / 8), [f"{x / sum(loads):.3f}" for x in loads]
    assert assign_owners([1.0] * 5, 2) == [0, 1, 0, 1, 0]  # equal sizes: plain round-robin
    assert math.isclose(sum(loads), sum(costs))


def test_config_rejects_bad_coefficients_and_pipeline_parallelism():
    with pytest.raises(ConfigError, match="3 numbers"):
        Optimizer(ns_coefficients=[1.0, 2.0]).validate()
    from titanlite.config import parse_config

    pipelined = ["--optimizer.name", "muon", "--parallelism.pipeline_parallel_degree", "2"]
    with pytest.raises(ConfigError, match="^optimizer.name = 'muon' does not run with parallelism.pipeline_parallel"):
        parse_config(pipelined)
    assert parse_config(pipelined[:2]).optimizer.name == "muon"


def test_planner_counts_one_buffer_for_muon_matrices():
    """The memory model's optimizer state: AdamW's 8 bytes per parameter, less 4 for each Muon matrix element."""
    from titanlite.models.flops import ModelShape, block_matmul_params
    from titanlite.plan.memory import RunSetup, memory_breakdown

    s = ModelShape(dim=2048, n_layers=16, n_heads=32, kv_heads=8, ffn_hidden_dim=8192, vocab_size=128256)
    adamw = memory_breakdown(s, RunSetup(num_gpus=8))
    muon = memory_breakdown(s, RunSetup(num_gpus=8, optimizer="muon"))
    matrices = s.n_layers * block_matmul_params(s) / 8
    assert muon["optimizer"] == pytest.approx(adamw["optimizer"] - 4 * matrices)
    assert muon["optimizer_scratch"] == pytest.approx(adamw["optimizer_scratch"] + 4 * 2 * matrices)  # bf16


def test_lr_schedule_moves_both_optimizers():
    from titanlite.config.sections import LRScheduler
    from titanlite.optim.lr_scheduler import build_lr_scheduler, lr_factor

    model = build_model("llama3", "debugmodel", **TINY)
    optimizer = build_muon(model, section())
    scheduler = build_lr_scheduler(optimizer, LRScheduler(warmup_steps=2), total_steps=6)
    for step in range(1, 6):
        factor = lr_factor(step, total_steps=6, warmup_steps=2)
        assert [g["lr"] for g in optimizer.param_groups] == pytest.approx(
            [g["initial_lr"] * factor for g in optimizer.param_groups]
        )
        optimizer.step()  # no gradients: nothing moves, but the schedule sees a step before its own
        scheduler.step()
    assert sorted({g["initial_lr"] for g in optimizer.param_groups}) == [LR, MUON_LR]

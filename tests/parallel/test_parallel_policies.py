"""Single-process checks of the parallelism policies: AC, compile, FSDP options, weight init, clipping."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from titanlite.config import ConfigError, JobConfig
from titanlite.models import build_model
from titanlite.parallel.activation_checkpoint import ActivationCheckpoint
from titanlite.parallel.compile import CompilePolicy
from titanlite.parallel.fsdp import FSDPPolicy
from titanlite.parallel.grad_clip import clip_grad_norm_
from titanlite.parallel.weight_init import resolve_weight_init
from titanlite.trainer.loss import cross_entropy_sum

TINY = dict(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=512, max_seq_len=64)


def tiny(seed=0):
    torch.manual_seed(seed)
    return build_model("llama3", "debugmodel", device="cpu", **TINY)


class CountMatmuls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.mm = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default):
            self.mm += 1
        return func(*args, **(kwargs or {}))


def grads_and_backward_matmuls(model, tokens):
    loss = cross_entropy_sum(model(tokens[:, :-1]), tokens[:, 1:])
    with CountMatmuls() as counter:
        loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}, counter.mm


def test_activation_checkpointing_same_gradients_and_recomputes_what_it_says():
    """Gradients are bitwise those without AC; backward re-runs forward matmuls for full AC (the
    recomputation stops early once the saved tensors it needs are rebuilt, so not all 7 per block),
    half as many with every 2nd block, and none with per-op selective AC (matmul outputs saved)."""
    tokens = torch.randint(0, 512, (2, 33))
    ref, ref_mm = grads_and_backward_matmuls(tiny(), tokens)
    recomputed = {}
    for mode, option, blocks in [
        ("full", "op", ["0", "1", "2", "3"]),
        ("selective", "2", ["1", "3"]),
        ("selective", "op", ["0", "1", "2", "3"]),
    ]:
        model = tiny()
        names = list(model.state_dict())
        assert ActivationCheckpoint(mode, option).apply(model) == blocks
        assert list(model.state_dict()) == names  # no wrapper: parameter names (checkpoints) unchanged
        grads, mm = grads_and_backward_matmuls(model, tokens)
        recomputed[mode + option] = mm - ref_mm
        for name, g in ref.items():
            assert torch.equal(grads[name], g), (mode, option, name)  # recomputation is bitwise the same
    assert recomputed["fullop"] >= 4 and recomputed["fullop"] % 4 == 0
    assert recomputed["selective2"] == recomputed["fullop"] // 2
    assert recomputed["selectiveop"] == 0


def test_activation_checkpoint_none_and_bad_options():
    assert ActivationCheckpoint("none").apply(tiny()) == []
    for mode, option, match in [
        ("selective", "x", "must be 'op' or a positive integer"),
        ("selective", "0", "must be 'op' or a positive integer"),
        ("some", "op", "activation_checkpoint.mode='some' must be one of none, full, selective"),
    ]:
        with pytest.raises(ValueError, match=match):
            ActivationCheckpoint(mode, option)


def test_compile_policy_keeps_parameter_names_and_components():
    model = tiny()
    names = list(model.state_dict())
    assert CompilePolicy(True, ["model"]).apply(model) == 4
    assert list(model.state_dict()) == names
    assert CompilePolicy(False, ["model", "loss"]).apply(tiny()) == 0
    policy = CompilePolicy(True, ["loss"])
    assert not policy.model and policy.loss
    assert CompilePolicy(True, ["model"]).compile_loss(cross_entropy_sum) is cross_entropy_sum
    with pytest.raises(ValueError, match="unknown component"):
        CompilePolicy(True, ["optimizer"])


def test_compile_backend_and_mode_reach_torch_compile(monkeypatch):
    """``[compile] backend`` and ``mode`` reach every ``torch.compile`` call (blocks, ends, loss); ``default`` mode
    is torch's own (not passed); a mode needs inductor, in one line naming both keys."""
    calls = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: calls.append(kw) or fn)
    section = JobConfig().compile
    section.enable, section.backend, section.mode = True, "inductor", "reduce-overhead"
    policy = CompilePolicy.from_config(section)
    policy.apply(tiny())
    policy.compile_loss(cross_entropy_sum)
    assert len(calls) == 4 + 2 + 1  # the blocks, the embedding and final norm, the loss
    assert all(kw["backend"] == "inductor" and kw["mode"] == "reduce-overhead" for kw in calls), calls
    calls.clear()
    section.backend, section.mode = "aot_eager", "default"
    CompilePolicy.from_config(section).compile_loss(cross_entropy_sum)
    assert calls == [{"fullgraph": False, "backend": "aot_eager"}]
    section.mode = "max-autotune"
    with pytest.raises(ConfigError, match=r"^compile.mode = 'max-autotune' needs compile.backend = 'inductor' \(got"):
        section.validate()


def test_a_chosen_sdpa_kernel_skips_the_autograd_cache_whose_key_does_not_hold_it(monkeypatch):
    """AOTAutograd's cache key does not include SDPA's kernel priority: with ``[training] sdpa_kernel`` set, every
    compiled call runs with that cache off (else an earlier run's graph, with torch's kernel, would be loaded);
    with ``auto`` the cache is as the process has it."""
    import torch._functorch.config as functorch_config

    seen = []
    record = lambda *args: seen.append(functorch_config.enable_autograd_cache)  # noqa: E731
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: record)
    section = JobConfig().compile
    section.enable = True
    with functorch_config.patch(enable_autograd_cache=True):  # torch's own scoped patch of its config
        for kernel in ("cudnn", "auto"):
            CompilePolicy.from_config(section, sdpa_kernel=kernel).compile_loss(cross_entropy_sum)(None, None)
        assert seen == [False, True] and functorch_config.enable_autograd_cache


def test_the_eager_backend_runs_the_blocks_traced_and_bitwise_equal():
    """``backend = "eager"``: Dynamo traces each block (a graph per distinct block code, no break) and hands the
    graph back to run as is, so the forward and every gradient are bitwise the uncompiled model's."""
    from torch._dynamo.utils import counters

    tokens = torch.randint(0, TINY["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(0))
    ref, model = tiny(), tiny()
    CompilePolicy(True, ["model"], backend="eager").apply(model)
    counters.clear()
    torch._dynamo.reset()
    grads = []
    for m in (ref, model):
        m(tokens).float().square().mean().backward()
        grads.append([p.grad for p in m.parameters()])
    assert counters["stats"]["unique_graphs"] >= 1 and not counters["graph_break"]
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_fsdp_reshard_choices():
    p = FSDPPolicy(mesh=None, reshard_after_forward="default")
    assert (p._reshard(last=False), p._reshard(last=True)) == (True, False)
    assert FSDPPolicy(None, reshard_after_forward="always")._reshard(True) is True
    assert FSDPPolicy(None, reshard_after_forward="never")._reshard(False) is False
    with pytest.raises(ValueError, match="fsdp_reshard_after_forward"):
        FSDPPolicy(None, reshard_after_forward="sometimes")


def test_weight_init_resolution():
    assert resolve_weight_init("auto", sharded=False, device_type="cpu") == "local"
    assert resolve_weight_init("auto", sharded=True, device_type="cpu") == "rank0"
    assert resolve_weight_init("auto", sharded=True, device_type="cuda") == "sharded"
    assert resolve_weight_init("rank0", sharded=True, device_type="cuda") == "rank0"
    with pytest.raises(ValueError, match="weight_init"):
        resolve_weight_init("random", True, "cpu")


@pytest.mark.parametrize("max_norm", [0.0, 0.05, 1e6])
def test_clip_grad_norm_matches_torch_on_plain_tensors(max_norm):
    tokens = torch.randint(0, 512, (2, 33))
    a, b = tiny(), tiny()
    for m in (a, b):
        cross_entropy_sum(m(tokens[:, :-1]), tokens[:, 1:]).backward()
    ours = clip_grad_norm_(a.parameters(), max_norm)
    theirs = torch.nn.utils.clip_grad_norm_(b.parameters(), max_norm if max_norm > 0 else float("inf"))
    if max_norm == 0:  # torch has no "measure only": compare the norm and check nothing was scaled
        theirs = torch.nn.utils.get_total_norm([p.grad for p in b.parameters()])
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=0)
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=0)

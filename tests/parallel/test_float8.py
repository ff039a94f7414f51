"""Float8Linear (titanlite.parallel.float8): error bounds, module swap rules, eval switch, training.

Error model. Casting ``t`` to float8 after scaling by ``s = fp8_max / amax(|t|)`` rounds to nearest,
so each element's error (in the original units) is at most ``u * |t| + a / s``: ``u`` is half a unit
in the last place relative to the value (2^-4 for e4m3 with 3 mantissa bits, 2^-3 for e5m2 with 2)
and ``a`` half the subnormal spacing for values that fall below the smallest normal (2^-10 for
e4m3, 2^-17 for e5m2). A product of two rounded operands then deviates from the exact one by at
most ``|x| dy + |y| dx + dx dy``, and a dot product by the sum of those: the bound each output
element of the forward and of both backward matmuls must satisfy (plus fp32 accumulation slack).
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.helpers.tiny import TINY_MODEL
from titanlite.parallel.float8 import E4M3, E5M2, Float8Linear, convert_to_float8, float8_disabled, to_float8

U = {E4M3: 2.0**-4, E5M2: 2.0**-3}
HALF_SUBNORMAL = {E4M3: 2.0**-10, E5M2: 2.0**-17}


def rounding_error(t: torch.Tensor, dtype, dim: int | None = None) -> torch.Tensor:
    """Element-wise bound of |dequant(quant(t)) - t| (module docstring); the scale is the whole tensor's
    (``dim`` None) or each row's / column's (amax along ``dim``)."""
    amax = t.abs().max() if dim is None else t.abs().amax(dim=dim, keepdim=True)
    scale = torch.finfo(dtype).max / amax
    return U[dtype] * t.abs() + HALF_SUBNORMAL[dtype] / scale


def matmul_bound(a, b, a_dtype, b_dtype, rowwise: bool = False) -> torch.Tensor:
    """Bound of |Q(a) @ Q(b) - a @ b| for ``a [M, K]``, ``b [K, N]``; rowwise: a scale per row of ``a`` and per
    column of ``b`` (amax along the contracted K)."""
    da = rounding_error(a, a_dtype, 1 if rowwise else None)
    db = rounding_error(b, b_dtype, 0 if rowwise else None)
    return a.abs() @ db + da @ b.abs() + da @ db


def dequant(t: torch.Tensor, dtype) -> torch.Tensor:
    t8, inv = to_float8(t, dtype)
    return t8.float() * inv


def check_within_bound(name, got, want, bound, magnitude):
    """``|got - want| <= bound`` plus fp32 accumulation slack; and the error is not zero (the
    computation really ran in float8)."""
    err = (got - want).abs()
    ratio = (err / (bound + 1e-5 * magnitude)).max().item()
    assert ratio <= 1.0, f"{name}: error exceeds the float8 rounding bound ({ratio:.2f}x)"
    assert (err.max() / want.abs().max()).item() > 1e-4, f"{name}: no float8 rounding error at all"
    return ratio


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("shape", [(64, 128, 96), (256, 64, 32)])
def test_forward_and_backward_within_float8_rounding_bound(shape, recipe):
    """Each of the three matmuls against the fp32 one, within the float8 rounding bound of its recipe: tensorwise
    casts gradients to e5m2 with one scale per tensor, rowwise everything to e4m3 with one scale per row or
    column along the contracted dimension."""
    m, k, n = shape
    torch.manual_seed(0)
    lin = nn.Linear(k, n, bias=False)
    f8 = Float8Linear.from_linear(lin, recipe)
    assert f8.weight is lin.weight
    w = lin.weight.detach()
    x = torch.randn(m, k)
    g = torch.randn(m, n) * 1e-3  # a realistic, small gradient scale

    def run(module):
        xi = x.clone().requires_grad_(True)
        lin.weight.grad = None
        y = module(xi)
        y.backward(g)
        return y.detach(), xi.grad, lin.weight.grad.clone()

    (y8, gx8, gw8), (y, gx, gw) = run(f8), run(lin)
    rowwise, g_dtype = recipe == "rowwise", E4M3 if recipe == "rowwise" else E5M2
    check_within_bound("forward", y8, y, matmul_bound(x, w.t(), E4M3, E4M3, rowwise), x.abs() @ w.abs().t())
    check_within_bound("grad_input", gx8, gx, matmul_bound(g, w, g_dtype, E4M3, rowwise), g.abs() @ w.abs())
    bound = matmul_bound(g.t(), x, g_dtype, E4M3, rowwise)
    check_within_bound("grad_weight", gw8, gw, bound, g.t().abs() @ x.abs())


def test_rowwise_scales_keep_an_outlier_row_to_itself():
    """One token 10^4 times larger than the rest: with one scale per tensor the other tokens fall among
    e4m3's subnormals and lose most of their precision; with one scale per row they keep e4m3's 2^-4."""
    torch.manual_seed(3)
    lin = nn.Linear(64, 32, bias=False)
    x = torch.randn(32, 64)
    x[0] *= 1e5
    want = lin(x).detach()
    errors = {}
    for recipe in ("tensorwise", "rowwise"):
        got = Float8Linear.from_linear(lin, recipe)(x).detach()
        errors[recipe] = ((got[1:] - want[1:]).norm() / want[1:].norm()).item()
    assert errors["rowwise"] < 0.05 and errors["tensorwise"] > 0.3, errors


def test_forward_equals_dequantized_matmul():
    """``_scaled_mm`` on the float8 operands is exactly the fp32 matmul of their dequantized values
    (fp32 accumulation, so equal to a few ulps)."""
    torch.manual_seed(1)
    lin = nn.Linear(64, 48, bias=True)
    f8 = Float8Linear.from_linear(lin)
    x = torch.randn(2, 16, 64)
    want = dequant(x.reshape(-1, 64), E4M3) @ dequant(lin.weight.detach(), E4M3).t() + lin.bias.detach()
    torch.testing.assert_close(f8(x).detach().reshape(-1, 48), want, rtol=1e-5, atol=1e-6)


def test_float8_disabled_runs_high_precision_and_restores():
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16))
    convert_to_float8(model, filter_fqns=())
    assert all(isinstance(model[i], Float8Linear) for i in (0, 2))
    x = torch.randn(4, 32)
    want = F.linear(torch.relu(F.linear(x, model[0].weight, model[0].bias)), model[2].weight, model[2].bias)
    with float8_disabled(model):
        assert torch.equal(model(x), want)
    assert model[0].enabled and model[2].enabled
    assert not torch.equal(model(x), want)


def test_conversion_skips_filtered_and_ineligible_shapes_and_logs(caplog):
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.ok = nn.Linear(64, 96)
            self.odd = nn.Linear(64, 40)  # 40 is not a multiple of 16
            self.tp_odd = nn.Linear(64, 16)  # fine alone, but 16 / tp 2 = 8 per shard
            self.output = nn.Linear(64, 64)  # filtered by name
            self.emb = nn.Embedding(10, 64)

    with caplog.at_level(logging.INFO, logger="titanlite.parallel.float8"):
        net = Net()
        report = convert_to_float8(net, filter_fqns=["output"])
    assert report.converted == ["ok", "tp_odd"]
    assert type(net.odd) is nn.Linear and type(net.output) is nn.Linear and isinstance(net.ok, Float8Linear)
    assert "multiple of 16" in report.skipped["odd"] and "filter_fqns" in report.skipped["output"]
    assert "keeping odd in high precision" in caplog.text and "keeping output in high precision" in caplog.text

    report = convert_to_float8(Net(), filter_fqns=["output"], shard_degree=2)
    assert report.converted == ["ok"] and "tensor_parallel_degree 2" in report.skipped["tp_odd"]


def test_float8_debug_model_trains(tmp_path):
    """A float8 run of a small debug model learns on CPU (loss falls) and keeps `output` in fp32."""
    from titanlite.models import load_config
    from titanlite.trainer import Trainer

    cfg = load_config(
        [
            *TINY_MODEL,
            "--training.seq_len",
            "32",
            "--training.local_batch_size",
            "4",
            "--training.steps",
            "20",
            "--optimizer.lr",
            "3e-3",
            "--lr_scheduler.warmup_steps",
            "3",
            "--metrics.log_freq",
            "1",
            "--quantize.linear.float8.enable",
            "true",
            "--job.dump_folder",
            str(tmp_path),
        ]
    )
    trainer = Trainer(cfg)
    f8 = [n for n, m in trainer.model.named_modules() if isinstance(m, Float8Linear)]
    assert len(f8) == 2 * 7 and "output" not in f8  # wq wk wv wo w1 w2 w3 per block
    losses = [r["loss"] for r in trainer.train() if "loss" in r]
    assert losses[0] > 6.0 and sum(losses[-5:]) / 5 < losses[0] - 1.0, losses


def test_float8_with_tp_is_refused_without_dtensor_support(monkeypatch):
    """float8 + TP needs DTensor's _scaled_mm rule: refused with a clear error, never run in fp32."""
    from titanlite.models import build_model
    from titanlite.models.llama3 import parallelize as par
    from titanlite.parallel import float8
    from titanlite.parallel.parallel_dims import ParallelDims
    from titanlite.parallel.policies import Policies

    monkeypatch.setattr(float8, "dtensor_supports_scaled_mm", lambda: False)
    policies = Policies(float8=float8.Float8Policy(enable=True))
    model = build_model("llama3", "debugmodel")  # meta
    with pytest.raises(
        ValueError, match="float8 with tensor_parallel_degree=2 needs DTensor support for torch._scaled_mm"
    ):
        par.parallelize_llama(model, ParallelDims(tp=2, world_size=2), policies)


def test_rowwise_float8_with_tp_is_refused():
    from titanlite.models import build_model
    from titanlite.models.llama3 import parallelize as par
    from titanlite.parallel import float8
    from titanlite.parallel.parallel_dims import ParallelDims
    from titanlite.parallel.policies import Policies

    policies = Policies(float8=float8.Float8Policy(enable=True, recipe_name="rowwise"))
    with pytest.raises(ValueError, match="recipe_name = 'rowwise' is not supported with tensor_parallel_degree=2"):
        par.parallelize_llama(build_model("llama3", "debugmodel"), ParallelDims(tp=2, world_size=2), policies)


def test_this_torch_supports_float8_with_tp():
    from titanlite.parallel.float8 import dtensor_supports_scaled_mm

    assert dtensor_supports_scaled_mm()  # so float8 x TP runs (and is parity-tested in test_parallel_parity)


def test_float8_model_meets_cuda_scaled_mm_layout_rules_on_meta():
    """On the meta device ``_scaled_mm`` applies the CUDA kernel's checks (row-major first operand,
    column-major second, every dimension divisible by 16), so a float8 debug model's forward and
    backward there exercise the layouts a GPU would see, without one. A micro-batch whose token
    count is not a multiple of 16 breaks the weight-gradient matmul, which the config refuses."""
    from titanlite.config import ConfigError
    from titanlite.models import build_model, load_config
    from titanlite.trainer.loss import cross_entropy_sum

    model = build_model("llama3", "debugmodel", device="meta").to(torch.bfloat16)  # as FSDP's bf16 params
    report = convert_to_float8(model)
    assert len(report.converted) == 7 * model.args.n_layers  # wq wk wv wo w1 w2 w3 of every block
    tokens = torch.randint(0, 512, (2, 64), device="meta")
    cross_entropy_sum(model(tokens), tokens).backward()
    assert all(p.grad is not None and p.grad.shape == p.shape for p in model.parameters())

    from titanlite.parallel.float8 import _Float8Matmul

    x = torch.empty(1000, 256, device="meta", requires_grad=True)  # 1000 tokens: not a multiple of 16
    w = torch.empty(512, 256, device="meta", requires_grad=True)
    out = _Float8Matmul.apply(x, w, torch.bfloat16)  # forward: [1000, 256] @ [256, 512] is fine
    with pytest.raises(RuntimeError, match="divisible by 16"):
        out.sum().backward()  # dW = dy^T x contracts over the 1000 tokens
    with pytest.raises(
        ConfigError,
        match=r"^quantize.linear.float8.enable needs training.local_batch_size x "
        r"training.seq_len \(5 x 200 = 1000 tokens",
    ):
        load_config(
            [
                "--quantize.linear.float8.enable",
                "--training.local_batch_size",
                "5",
                "--training.seq_len",
                "200",
                "--training.global_batch_size",
                "-1",
            ]
        )


def test_rowwise_float8_model_meets_cuda_scaled_mm_rules_on_meta():
    """Rowwise on the meta device, which checks ``_scaled_mm``'s rowwise rules as CUDA does (scales of shape
    [M, 1] and [1, N], operands divisible by 16): forward and both backward matmuls of the debug model."""
    from titanlite.models import build_model
    from titanlite.trainer.loss import cross_entropy_sum

    model = build_model("llama3", "debugmodel", device="meta").to(torch.bfloat16)
    assert len(convert_to_float8(model, recipe="rowwise").converted) == 7 * model.args.n_layers
    assert "float8=rowwise(e4m3 fwd, e4m3 grad)" in repr(model.layers["0"].attention.wq)
    tokens = torch.randint(0, 512, (2, 64), device="meta")
    cross_entropy_sum(model(tokens), tokens).backward()
    assert all(p.grad is not None and p.grad.shape == p.shape for p in model.parameters())


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_per_block_compile_captures_the_float8_casts(recipe, one_thread):
    """Per-block compile (fullgraph, no graph break) holds the float8 linears whole: the forward graph that
    AOTAutograd hands the compiler has the block's 7 ``_scaled_mm`` and the casts of activations and weights to
    float8 (so inductor fuses each amax-scale-cast), the backward graph the 14 gradient matmuls and their casts;
    run as traced, the graphs give eager float8's loss and gradients bitwise. Inductor's code for these graphs is
    not generated: on the CPU it would be C++, not a GPU's kernels (scripts/gpu_check.sh runs compiled float8 on the
    GPU; tests/trainer/test_output_loss.py and the compiled parity runs check inductor's code for titanlite's
    blocks)."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.utils import counters
    from torch._functorch.aot_autograd import make_boxed_func

    from titanlite.models import build_model
    from titanlite.trainer.loss import cross_entropy_sum

    torch._dynamo.reset()
    counters.clear()
    model = build_model("llama3", "debugmodel", device="cpu", n_layers=1)
    model.init_weights()
    convert_to_float8(model, recipe=recipe)
    eager = copy.deepcopy(model)
    graphs = {}

    def keep(name):
        def compiler(gm, example_inputs):
            graphs[name] = gm
            return make_boxed_func(gm.forward)

        return compiler

    block = model.layers["0"]
    backend = aot_autograd(fw_compiler=keep("forward"), bw_compiler=keep("backward"))
    block.forward = torch.compile(block.forward, backend=backend, fullgraph=True)
    tokens = torch.randint(0, 512, (2, 64))
    losses = [cross_entropy_sum(m(tokens), tokens) for m in (model, eager)]
    for loss in losses:
        loss.backward()
    assert torch.equal(losses[0], losses[1])  # the traced graphs run the eager ops in the eager order
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), eager.parameters()))

    def count(name, what):
        nodes = [n for n in graphs[name].graph.nodes if n.op == "call_function"]
        if what == "matmul":
            return sum(n.target == torch.ops.aten._scaled_mm.default for n in nodes)
        casts = [n for n in nodes if n.target == torch.ops.aten._to_copy.default]
        return sum(str(getattr(n.meta.get("val"), "dtype", "")).startswith("torch.float8") for n in casts)

    assert not counters["graph_break"]
    assert (count("forward", "matmul"), count("backward", "matmul")) == (7, 14)
    assert count("forward", "cast") == 14  # x and W of each linear
    assert count("backward", "cast") == (7 if recipe == "tensorwise" else 28)  # dy; rowwise also W, x again
    torch._dynamo.reset()

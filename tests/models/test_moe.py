"""The MoE layer (titanlite.models.moe) in one process, each part against an independent reference.

- Experts: the grouped GEMM path (``torch._grouped_mm``, and its custom-op form outside bf16) and the
  per-expert loop give the same outputs and gradients (fp32, 1e-6), and both equal a dense reference that
  runs every expert on every token and picks the routed ones by hand (no sorting, no grouping).
- Router: softmax / sigmoid scores, top-k, renormalization and scaling by the formulas; group-limited
  routing against a brute-force search over the allowed groups; the aux-loss-free bias moves the choice
  and never the weights.
- Losses: the gradients the layer injects (aux loss at sequence and batch level, z-loss) equal those of
  the loss written out by hand (Switch/GShard ``coef E sum_i f_i P_i``, ST-MoE ``coef mean lse^2``).
- The aux-loss-free bias, on a batch whose router prefers one expert, brings max/mean load down over 50
  updates; the metrics ``MoEStep.end_step`` logs are the loads counted by hand.
- Sizes: the planner's total and active counts equal the meta-built model's, and DeepSeek-V3's shape
  (``llama3_moe/671B``) gives its published 671 B total / 37 B active.
- Bad settings: one-line errors naming the keys.
"""

from __future__ import annotations

import copy
import itertools
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from titanlite.models import build_model, get_model_spec, load_config, make_model_args
from titanlite.models.flops import ModelShape, active_param_count, param_count
from titanlite.models.llama3.model import FeedForward
from titanlite.models.moe import MoE, MoEConfig, MoEStep
from titanlite.models.moe.router import limit_to_groups

DEBUG_MOE = str(Path(__file__).resolve().parents[2] / "train_configs" / "debug_moe.toml")
pytestmark = pytest.mark.usefixtures("one_thread")


def make_moe(seed: int = 0, dim: int = 32, **kw) -> MoE:
    torch.manual_seed(seed)
    cfg = MoEConfig(**{"num_experts": 6, "top_k": 2, "hidden_dim": 16, "num_shared_experts": 1, **kw})
    moe = MoE(dim, cfg, FeedForward)
    moe.init_weights(0.05)
    return moe


def dense_reference(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Every expert on every token, the routed ones picked and weighted by hand."""
    tokens = x.reshape(-1, x.shape[-1])
    r = moe.router(tokens)
    e = moe.experts
    every = torch.stack(
        [F.linear(F.silu(F.linear(tokens, e.w1[i])) * F.linear(tokens, e.w3[i]), e.w2[i]) for i in range(len(e.w1))]
    )  # [E, N, dim]
    picked = every[r.experts, torch.arange(len(tokens))[:, None]]  # [N, k, dim]
    out = (picked * r.weights[..., None]).sum(1) + moe.shared_experts(tokens)
    return out.view_as(x)


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"score_func": "sigmoid", "norm_topk_prob": True, "route_scale": 2.5},
        {"num_experts": 8, "top_k": 3, "n_groups": 4, "topk_groups": 2, "num_shared_experts": 0},
    ],
    ids=["softmax", "sigmoid_scaled", "grouped_routing"],
)
def test_grouped_gemm_equals_the_loop_and_a_dense_reference(kw):
    grouped = make_moe(**kw).eval()
    looped = copy.deepcopy(grouped)
    looped.experts.grouped_mm = False
    reference = copy.deepcopy(grouped)
    if not kw.get("num_shared_experts", 1):
        reference.shared_experts = lambda t: torch.zeros_like(t)
    x = torch.randn(3, 10, 32)
    g = torch.randn(3, 10, 32)
    outs, grads = [], []
    for m, fn in ((grouped, grouped), (looped, looped), (reference, lambda t: dense_reference(reference, t))):
        xi = x.clone().requires_grad_()
        y = fn(xi)
        (y * g).sum().backward()
        outs.append(y.detach())
        grads.append([xi.grad] + [p.grad for p in m.parameters()])
    for other in (1, 2):
        assert (outs[0] - outs[other]).abs().max() <= 1e-6
        for a, b in zip(grads[0], grads[other]):
            assert (a - b).abs().max() <= 1e-6
    assert all(gr.abs().sum() > 0 for gr in grads[0])  # every parameter took part


def test_grouped_gemm_in_bf16_matches_the_loop():
    """bf16 takes torch._grouped_mm itself (not the custom op): same result as the loop within bf16 rounding."""
    moe = make_moe(dim=64, hidden_dim=32).to(torch.bfloat16).eval()
    loop = copy.deepcopy(moe)
    loop.experts.grouped_mm = False
    x = torch.randn(2, 16, 64, dtype=torch.bfloat16)
    assert torch.allclose(moe(x).float(), loop(x).float(), atol=2e-2, rtol=2e-2)


def test_a_rank_with_no_tokens_for_an_expert():
    moe = make_moe(num_experts=8, top_k=1, num_shared_experts=0).eval()
    with torch.no_grad():
        moe.router.expert_bias[3] = 10.0  # every token to expert 3, the others empty
    x = torch.randn(1, 5, 32, requires_grad=True)
    moe(x).sum().backward()
    assert moe.experts.w1.grad[3].abs().sum() > 0 and moe.experts.w1.grad[0].abs().sum() == 0


# ----------------------------------------------------------------------------- router


def test_router_scores_and_weights_follow_the_formulas():
    moe = make_moe(score_func="sigmoid", norm_topk_prob=True, route_scale=2.5)
    x = torch.randn(7, 32)
    r = moe.router(x)
    logits = x @ moe.router.gate.weight.t()
    scores = logits.sigmoid()
    top = scores.topk(2, dim=-1)
    assert torch.equal(r.experts, top.indices)
    assert torch.allclose(r.weights, 2.5 * top.values / top.values.sum(-1, keepdim=True))
    softmax = make_moe().router(x)
    assert torch.allclose(softmax.scores.sum(-1), torch.ones(7)) and not make_moe().cfg.norm_topk_prob


def test_group_limited_routing_against_brute_force():
    torch.manual_seed(1)
    scores = torch.rand(50, 8)
    masked = limit_to_groups(scores, n_groups=4, topk_groups=2)
    for row, got in zip(scores, masked):
        groups = row.view(4, 2).sort(-1, descending=True).values[:, :2].sum(-1)  # a group: its two best
        best = max(itertools.combinations(range(4), 2), key=lambda c: sum(groups[list(c)]))
        allowed = {e for g in best for e in (2 * g, 2 * g + 1)}
        assert {i for i in range(8) if got[i] > float("-inf")} == allowed


def test_bias_moves_the_choice_not_the_weights():
    moe = make_moe(num_shared_experts=0)
    x = torch.randn(20, 32)
    plain = moe.router(x)
    with torch.no_grad():
        moe.router.expert_bias[5] = 1.0  # larger than any softmax score
    biased = moe.router(x)
    assert (biased.experts == 5).any(-1).all()
    assert torch.equal(biased.weights, plain.scores.gather(-1, biased.experts))  # weights: unbiased scores


# ----------------------------------------------------------------------------- losses


def hand_losses(moe: MoE, x: torch.Tensor, level: str) -> torch.Tensor:
    """``coef E sum_i f_i P_i`` (per sequence or over the batch, averaged) + ``z coef mean_t lse_t^2``."""
    cfg, (b, s, d) = moe.cfg, x.shape
    logits = x.reshape(-1, d) @ moe.router.gate.weight.t()
    probs = logits.softmax(-1)
    chosen = logits.topk(cfg.top_k, -1).indices  # softmax keeps the order, the bias is 0
    onehot = F.one_hot(chosen, cfg.num_experts).sum(1).float()  # [N, E]
    units = [slice(i * s, (i + 1) * s) for i in range(b)] if level == "seq" else [slice(0, b * s)]
    aux = 0.0
    for u in units:
        f = onehot[u].sum(0) / (cfg.top_k * onehot[u].shape[0])
        aux = aux + cfg.aux_loss_coef * cfg.num_experts * (f * probs[u].mean(0)).sum()
    z = cfg.z_loss_coef * torch.logsumexp(logits, -1).pow(2).mean()
    return aux / len(units) + z


@pytest.mark.parametrize("level", ["seq", "batch"])
def test_injected_loss_gradients_equal_the_hand_written_losses(level):
    moe = make_moe(aux_loss_coef=0.1, aux_loss_level=level, z_loss_coef=0.01)
    ref = copy.deepcopy(moe)
    x = torch.randn(3, 8, 32)
    g = torch.randn(3, 8, 32)
    (moe.train()(x) * g).sum().backward()  # divisor 0: this micro-batch's own tokens (24)
    ((ref.eval()(x) * g).sum() + hand_losses(ref, x, level)).backward()
    for (name, a), b in zip(moe.named_parameters(), ref.parameters()):
        assert torch.allclose(a.grad, b.grad, atol=1e-7, rtol=1e-5), name
    assert moe.router.gate.weight.grad.abs().sum() > 0
    stats = dict(zip(("tokens", "entropy", "aux", "z"), moe.stats.tolist()))
    with torch.no_grad():
        aux_sum = (
            hand_losses(ref, x, level)
            - ref.cfg.z_loss_coef * torch.logsumexp(x.reshape(-1, 32) @ ref.router.gate.weight.t(), -1).pow(2).mean()
        )
    assert stats["tokens"] == 24 and stats["aux"] / 24 == pytest.approx(aux_sum.item(), rel=1e-5)


def test_the_step_divisor_scales_the_injected_gradient():
    """With the step's token count set (as TrainStep does), the terms are divided by it, not the micro-batch's."""
    a, b = make_moe(aux_loss_coef=0.1), make_moe(aux_loss_coef=0.1)
    for m in (a, b):
        m.shared_experts = None
        for p in m.parameters():
            p.requires_grad_(p is m.router.gate.weight)
    x = torch.randn(2, 8, 32)
    MoEStep({0: b}, 1).begin_step(16 * 4)  # as if 4 micro-batches of 16 tokens made the step
    (a(x).sum() * 0).backward()
    (b(x).sum() * 0).backward()
    assert torch.allclose(b.router.gate.weight.grad * 4, a.router.gate.weight.grad, rtol=1e-5)


# ----------------------------------------------------------------------------- aux-loss-free bias


def test_aux_loss_free_bias_balances_a_skewed_batch():
    """A batch leaning one way and a router whose expert 0 leans the same way: expert 0 takes nearly every
    token (max/mean ~3.7 of 4 possible). 50 bias updates (rate 0.01, no weight updates) bring every one of the
    last 10 steps below half of that, and expert 0's bias is the lowest."""
    torch.manual_seed(0)
    moe = make_moe(num_experts=8, top_k=2, num_shared_experts=0, bias_update_rate=0.01).train()
    x = torch.randn(4, 64, 32)
    lean = x.mean((0, 1)).sign()
    with torch.no_grad():
        moe.router.gate.weight[0] += 0.1 * lean
    x += 0.3 * lean
    step = MoEStep({0: moe}, 1)
    loads = []
    for _ in range(50):
        with torch.no_grad():
            moe(x)
        loads.append(step.end_step(updated=True)["moe/load_max_mean"])
    assert loads[0] > 3.0 and max(loads[-10:]) < 0.5 * loads[0], loads
    bias = moe.router.expert_bias
    assert bias[0] == bias.min() < 0 < bias[1:].min()


def test_step_metrics_are_the_counted_loads():
    moe = make_moe(num_experts=4, top_k=1, num_shared_experts=0, aux_loss_coef=0.01).train()
    x = torch.randn(2, 16, 32)
    moe(x)
    chosen = moe.router(x.reshape(-1, 32)).experts.flatten()
    counts = torch.bincount(chosen, minlength=4).float()
    metrics = MoEStep({3: moe}, 4).end_step(updated=False)
    assert metrics["moe/layers.3/load_max_mean"] == pytest.approx((counts.max() / counts.mean()).item())
    assert metrics["moe/load_max_mean"] == metrics["moe/layers.3/load_max_mean"]
    assert 0 < metrics["moe/entropy"] <= torch.log(torch.tensor(4.0)).item() and metrics["moe/aux_loss"] > 0
    assert moe.stats.sum() == 0 and moe.router.expert_bias.abs().sum() == 0  # reset; no update asked


# ----------------------------------------------------------------------------- sizes


@pytest.mark.parametrize("flavor", ["debugmodel", "671B"])
def test_planner_counts_equal_the_meta_built_model(flavor):
    args = make_model_args("llama3_moe", flavor)
    model = build_model("llama3_moe", flavor)  # meta: nothing allocated
    total = sum(p.numel() for p in model.parameters())
    routed = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    active = total - routed + routed * args.moe_top_k // args.moe_num_experts
    shape = ModelShape.from_args(args)
    assert param_count(shape) == total and active_param_count(shape) == active
    spec = get_model_spec("llama3_moe")
    assert spec.num_params(args) == total and spec.active_params(args) == active
    if flavor == "671B":  # DeepSeek-V3: 671 B parameters, 37 B activated per token
        assert round(total / 1e9) == 671 and round(active / 1e9) in (37, 38)


def test_debug_moe_has_the_dense_debug_models_active_size():
    """The bench pair: per token, an MoE block computes as many FFN FLOPs as the dense debug block."""
    moe, dense = make_model_args("llama3_moe", "debugmodel"), make_model_args("llama3", "debugmodel")
    spec, dspec = get_model_spec("llama3_moe"), get_model_spec("llama3")
    routers = moe.n_moe_layers * moe.dim * moe.moe_num_experts
    assert spec.active_params(moe) - routers == dspec.num_params(dense)
    assert spec.flops_per_token(moe, 256) - 6 * routers == dspec.flops_per_token(dense, 256)


# ----------------------------------------------------------------------------- bad settings


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--model.moe_top_k", "9"], "model.moe_top_k (9) must be <= model.moe_num_experts (8)"),
        (["--model.moe_score_func", "relu"], "model.moe_score_func must be one of softmax, sigmoid"),
        (["--model.moe_n_groups", "3"], "model.moe_n_groups (3) must divide model.moe_num_experts (8)"),
        (["--parallelism.expert_tensor_parallel_degree", "2"], "expert_tensor_parallel_degree=2 is not supported"),
    ],
)
def test_bad_moe_settings_are_one_line_errors(argv, message):
    from titanlite.config import ConfigError
    from titanlite.models.registry import model_args_for

    with pytest.raises((ConfigError, ValueError)) as e:
        cfg = load_config(["--config", DEBUG_MOE, *argv])
        model_args_for(cfg.model, 512)
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    "argv,world,message",
    [
        (["--parallelism.expert_parallel_degree", "3"], 4, "expert_parallel_degree=3 must divide"),
        (["--parallelism.expert_parallel_degree", "3"], 6, "model.moe_num_experts (8) must be divisible by"),
    ],
)
def test_bad_expert_parallel_layouts_are_one_line_errors(argv, world, message):
    """Checked by the dry run exactly as by the trainer (fake process group, meta model)."""
    from titanlite.plan.dry_run import dry_run

    cfg = load_config(["--config", DEBUG_MOE, *argv])
    with pytest.raises(ValueError) as e:
        dry_run(cfg, world_size=world, out=lambda line: None)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_a_moe_checkpoint_loads_for_inference_with_its_routing_bias(tmp_path):
    """``load_model`` (generation, evaluation) of a llama3_moe step folder: a family without an HF adapter is
    read by its own state-dict names, and the routers' moved biases (buffers) are loaded with the weights."""
    import dataclasses

    import torch.distributed.checkpoint as dcp

    from titanlite.checkpoint import layout
    from titanlite.checkpoint.load_model import load_model

    torch.manual_seed(0)
    model = build_model("llama3_moe", "debugmodel", device="cpu", n_layers=2, dim=64, n_heads=4, n_kv_heads=2)
    with torch.no_grad():
        model.layers["1"].feed_forward.router.expert_bias.copy_(torch.linspace(-0.2, 0.2, 8))
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(tmp_path / "step-2"), no_dist=True)
    info = {"step": 2, "model_only": True, "dtype": "float32", "tokenizer": {"path": "", "bos_id": None, "eos_id": 1}}
    info["model"] = {"name": "llama3_moe", "flavor": None, "args": dataclasses.asdict(model.args)}
    layout.write_info(tmp_path / "step-2", info)
    loaded = load_model(tmp_path / "step-2", tokenizer_path="bytes")
    bias = loaded.model.layers["1"].feed_forward.router.expert_bias
    assert torch.equal(bias, model.layers["1"].feed_forward.router.expert_bias)
    tokens = torch.randint(0, 512, (2, 16))
    with torch.no_grad():
        assert torch.equal(loaded.model(tokens), model.eval()(tokens))

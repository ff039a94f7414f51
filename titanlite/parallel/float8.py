"""Float8 training for ``nn.Linear``: a native ``Float8Linear`` built on ``torch._scaled_mm``, no dependency beyond
PyTorch. On H100-class GPUs a float8 matmul runs at twice the bf16 rate; scaling each matmul input into the float8
range just before the matmul keeps training stable while everything else stays in high precision.

Default recipe, dynamic tensorwise (:class:`_Float8Matmul`): every step each operand ``t`` is cast as
``t * scale`` with ``scale = fp8_max / amax(|t|)``, and ``_scaled_mm`` multiplies ``1 / scale`` back into its fp32
accumulator. Activations and weights are ``float8_e4m3fn`` (precision), gradients ``float8_e5m2`` (range); the
relative rounding error per element is at most 2^-4 for e4m3 and 2^-3 for e5m2, plus a tiny absolute error in the
subnormal range. Rowwise: :class:`_Float8MatmulRowwise`. Formats, operand layouts and the multiple-of-16 rule:
docs/library.md, "Float8 linears"; with FSDP: :mod:`titanlite.parallel.float8_fsdp`.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch import nn

from titanlite.errors import ConfigError

logger = logging.getLogger(__name__)

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
AMAX_EPS = 1e-12  # an all-zero tensor gets a finite scale (and stays zero)


def to_float8(t: torch.Tensor, dtype: torch.dtype, dim: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(t * scale)`` cast to ``dtype`` and the fp32 inverse scale, with ``scale = max / amax(|t|)`` over the
    whole tensor (``dim`` None: tensorwise, a 0-d scale) or along ``dim`` (kept as a size-1 dimension: one
    scale per row with ``dim=-1``, per column with ``dim=0``)."""
    fp8_max = torch.finfo(dtype).max
    magnitude = t.detach().abs()
    amax = (magnitude.max() if dim is None else magnitude.amax(dim=dim, keepdim=True)).float()
    scale = fp8_max / amax.clamp(min=AMAX_EPS)
    t8 = (t.float() * scale).clamp(-fp8_max, fp8_max).to(dtype)
    return t8, scale.reciprocal()


def _col_major(t: torch.Tensor) -> torch.Tensor:
    return t.t().contiguous().t()


class _Float8Matmul(torch.autograd.Function):
    """``x [M, K] @ weight[N, K]^T`` with float8 operands in forward and backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        x8, x_inv = to_float8(x, E4M3)
        if isinstance(weight, Float8GatheredWeight):  # cast before FSDP's all-gather (float8_fsdp)
            w8, w_inv = weight._data, weight._inverse
        else:
            w8, w_inv = to_float8(weight, E4M3)
        ctx.save_for_backward(x8, x_inv, w8, w_inv)
        ctx.dtypes = (x.dtype, weight.dtype)
        # weight is [N, K] row-major, so w8.t() is the column-major [K, N] _scaled_mm wants
        return torch._scaled_mm(x8, w8.t(), scale_a=x_inv, scale_b=w_inv, out_dtype=out_dtype)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x8, x_inv, w8, w_inv = ctx.saved_tensors
        x_dtype, w_dtype = ctx.dtypes
        g8, g_inv = to_float8(grad_out, E5M2)
        grad_x = torch._scaled_mm(g8, _col_major(w8), scale_a=g_inv, scale_b=w_inv, out_dtype=x_dtype)
        grad_w = torch._scaled_mm(g8.t().contiguous(), _col_major(x8), scale_a=g_inv, scale_b=x_inv, out_dtype=w_dtype)
        return grad_x, grad_w, None


def _scaled_mm_rowwise(a8, b8, a_inv, b_inv, out_dtype: torch.dtype) -> torch.Tensor:
    """``_scaled_mm`` with a scale per row of ``a`` (M of them) and per column of ``b`` (N). CUDA's rowwise
    kernel (CUTLASS) writes bf16 only (cuBLAS on SM 9.0 also fp32): other outputs are cast from bf16 there."""
    direct = a8.device.type != "cuda" or out_dtype in (torch.bfloat16, torch.float16)
    scale_a, scale_b = a_inv.reshape(-1, 1), b_inv.reshape(1, -1)  # the shapes and strides the kernels check
    out = torch._scaled_mm(a8, b8, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype if direct else torch.bfloat16)
    return out if direct else out.to(out_dtype)


class _Float8MatmulRowwise(torch.autograd.Function):
    """``x [M, K] @ weight[N, K]^T`` with a scale per row (or column) of each operand along the dimension the
    matmul does *not* contract, so one outlier costs its own row's precision only. All e4m3 (CUDA's rowwise
    kernels take no other; per-row scales keep a gradient's range). As the scales depend on the contracted
    dimension, forward saves the high-precision ``x`` and ``weight`` and backward casts them again:

    - forward ``y = x W^T``: ``x`` per token (amax over K), ``W`` per output feature (amax over K);
    - ``dx = dy W``: ``dy`` per token (over N), ``W`` per input feature (over N);
    - ``dW = dy^T x``: ``dy`` per output feature (over the tokens), ``x`` per input feature (over the tokens).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        x8, x_inv = to_float8(x, E4M3, dim=-1)  # [M, 1]
        w8, w_inv = to_float8(weight, E4M3, dim=-1)  # [N, 1]
        ctx.save_for_backward(x, weight)
        return _scaled_mm_rowwise(x8, w8.t(), x_inv, w_inv, out_dtype)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, weight = ctx.saved_tensors
        g8, g_inv = to_float8(grad_out, E4M3, dim=-1)  # [M, 1]
        w8, w_inv = to_float8(weight, E4M3, dim=0)  # [1, K]
        grad_x = _scaled_mm_rowwise(g8, _col_major(w8), g_inv, w_inv, x.dtype)
        gt8, gt_inv = to_float8(grad_out, E4M3, dim=0)  # [1, N]: per output feature, over the tokens
        xt8, xt_inv = to_float8(x, E4M3, dim=0)  # [1, K]
        grad_w = _scaled_mm_rowwise(gt8.t().contiguous(), _col_major(xt8), gt_inv, xt_inv, weight.dtype)
        return grad_x, grad_w, None


RECIPES = {"tensorwise": _Float8Matmul, "rowwise": _Float8MatmulRowwise}


def wrapper_like(cls, t: torch.Tensor, dtype: torch.dtype, requires_grad: bool = False) -> torch.Tensor:
    """A tensor-subclass instance with ``t``'s size, strides and device, presenting ``dtype``."""
    return torch.Tensor._make_wrapper_subclass(
        cls,
        t.size(),
        strides=t.stride(),
        storage_offset=t.storage_offset(),
        dtype=dtype,
        layout=t.layout,
        device=t.device,
        requires_grad=requires_grad,
    )


_aten = torch.ops.aten
_GATHERED_KEEPS = {_aten.detach.default, _aten.alias.default, _aten.view.default, _aten.as_strided.default}


class Float8GatheredWeight(torch.Tensor):
    """A Float8Linear weight already in float8, as FSDP's float8 all-gather delivers it
    (:mod:`titanlite.parallel.float8_fsdp`): ``_data`` (float8, tensorwise) and ``_inverse`` (its fp32 inverse
    scale), presenting the high-precision ``dtype`` and shape. The tensorwise matmul takes data and scale as they
    are; any other op sees the weight dequantized."""

    @staticmethod
    def __new__(cls, data: torch.Tensor, inverse: torch.Tensor, dtype: torch.dtype):
        return wrapper_like(cls, data, dtype)

    def __init__(self, data: torch.Tensor, inverse: torch.Tensor, dtype: torch.dtype):
        self._data, self._inverse = data, inverse

    def __repr__(self) -> str:
        return f"Float8GatheredWeight(shape={tuple(self.shape)}, dtype={self.dtype}, float8={self._data.dtype})"

    def dequantize(self) -> torch.Tensor:
        return (self._data.float() * self._inverse).to(self.dtype)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        first = args[0] if args else None
        if func in _GATHERED_KEEPS and isinstance(first, cls):
            data = func(first._data, *args[1:], **kwargs)
            return cls(data, first._inverse, first.dtype)
        args, kwargs = pytree.tree_map_only(cls, lambda t: t.dequantize(), (args, kwargs))
        return func(*args, **kwargs)

    def __tensor_flatten__(self):
        return ["_data", "_inverse"], self.dtype

    @staticmethod
    def __tensor_unflatten__(inner: dict, dtype, outer_size, outer_stride):
        return Float8GatheredWeight(inner["_data"], inner["_inverse"], dtype)


class Float8Linear(nn.Linear):
    """Drop-in ``nn.Linear`` (same parameters and state-dict keys, same TP styles) whose matmul runs in
    float8 (see the module docstring); ``enabled = False`` makes it a plain linear."""

    enabled: bool = True
    recipe: str = "tensorwise"  # a key of RECIPES

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe: str = "tensorwise") -> Float8Linear:
        """A Float8Linear sharing ``linear``'s parameter objects (works on the meta device)."""
        if recipe not in RECIPES:
            raise ConfigError(f"float8 recipe {recipe!r}: expected one of {', '.join(RECIPES)}")
        new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta")
        new.weight = linear.weight
        new.bias = linear.bias
        new.recipe = recipe
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.enabled:
            return F.linear(x, self.weight, self.bias)
        # under autocast the output takes the autocast dtype, like a bf16 matmul's would
        device_type = x.device.type  # meta (shape-only runs) has no autocast state to ask
        autocast = device_type != "meta" and torch.is_autocast_enabled(device_type)
        out_dtype = torch.get_autocast_dtype(device_type) if autocast else x.dtype
        out = RECIPES[self.recipe].apply(x.reshape(-1, x.shape[-1]), self.weight, out_dtype)
        out = out.reshape(*x.shape[:-1], out.shape[-1])
        return out if self.bias is None else out + self.bias.to(out.dtype)

    def extra_repr(self) -> str:
        grads = "e5m2" if self.recipe == "tensorwise" else "e4m3"
        return super().extra_repr() + f", float8={self.recipe}(e4m3 fwd, {grads} grad)"


@dataclass
class Float8Report:
    converted: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)  # fqn -> reason


def convert_to_float8(
    model: nn.Module, filter_fqns: Sequence[str] = ("output",), shard_degree: int = 1, recipe: str = "tensorwise"
) -> Float8Report:
    """Swap every eligible ``nn.Linear`` of ``model`` (in place) for a :class:`Float8Linear` scaling by ``recipe``;
    a linear whose name contains one of ``filter_fqns``, or whose features are not multiples of ``16 *
    shard_degree`` (the TP degree: every shard a multiple of 16), is skipped and the reason logged."""
    report = Float8Report()
    multiple = 16 * shard_degree
    for fqn, module in list(model.named_modules()):
        if type(module) is not nn.Linear:
            continue
        if any(f and f in fqn for f in filter_fqns):
            report.skipped[fqn] = "filtered by quantize.linear.float8.filter_fqns"
        elif module.in_features % multiple or module.out_features % multiple:
            report.skipped[fqn] = (
                f"shape {module.out_features}x{module.in_features} is not a multiple of "
                f"{multiple}" + (f" (16 x tensor_parallel_degree {shard_degree})" if shard_degree > 1 else "")
            )
        else:
            parent_name, _, child = fqn.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, Float8Linear.from_linear(module, recipe))
            report.converted.append(fqn)
    for fqn, reason in report.skipped.items():
        logger.info("float8: keeping %s in high precision: %s", fqn, reason)
    logger.info("float8: converted %d linear layers to Float8Linear (%s scaling)", len(report.converted), recipe)
    return report


def float8_modules(model: nn.Module) -> Iterator[Float8Linear]:
    return (m for m in model.modules() if isinstance(m, Float8Linear))


@contextlib.contextmanager
def float8_disabled(model: nn.Module):
    """Run ``model``'s Float8Linear layers as plain high-precision linears inside the block."""
    previous = {m: m.enabled for m in float8_modules(model)}
    for m in previous:
        m.enabled = False
    try:
        yield
    finally:
        for m, flag in previous.items():
            m.enabled = flag


def dtensor_supports_scaled_mm() -> bool:
    """Whether this torch's DTensor has a sharding rule for ``aten._scaled_mm`` (float8 + TP)."""
    from titanlite.parallel.tensor_parallel import dtensor_supports

    return dtensor_supports(torch.ops.aten._scaled_mm.default)


@dataclass
class Float8Policy:
    """``[quantize.linear.float8]``: :meth:`apply` to the meta model first in a ``parallelize`` function."""

    enable: bool = False
    filter_fqns: Sequence[str] = ("output",)
    recipe_name: str = "tensorwise"
    enable_fsdp_float8_all_gather: bool = False

    @classmethod
    def from_config(cls, section) -> Float8Policy:
        return cls(
            section.enable, tuple(section.filter_fqns), section.recipe_name, section.enable_fsdp_float8_all_gather
        )

    def apply(self, model: nn.Module, tp_degree: int = 1) -> Float8Report | None:
        """Refuse float8 + TP where DTensor lacks ``_scaled_mm`` and GPUs without float8 tensor cores,
        then swap the eligible linears (every shard a multiple of 16 under TP)."""
        if not self.enable:
            return None
        if tp_degree > 1 and self.enable_fsdp_float8_all_gather:
            raise ConfigError(
                f"quantize.linear.float8.enable_fsdp_float8_all_gather is not supported with tensor_parallel_degree="
                f"{tp_degree}: the gathered weight would be a tensor-parallel DTensor, whose _scaled_mm takes plain "
                "float8 operands; disable one of them"
            )
        if tp_degree > 1 and self.recipe_name != "tensorwise":
            raise ConfigError(
                f"quantize.linear.float8.recipe_name = {self.recipe_name!r} is not supported with "
                f"tensor_parallel_degree={tp_degree}: per-row scales of sharded operands make DTensor move float8 "
                "tensors between ranks, which titanlite does not test (gloo cannot); use 'tensorwise' with TP"
            )
        if tp_degree > 1 and not dtensor_supports_scaled_mm():
            raise ConfigError(
                f"quantize.linear.float8 with tensor_parallel_degree={tp_degree} needs DTensor "
                f"support for torch._scaled_mm, which torch {torch.__version__} lacks; disable one of them"
            )
        if torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9):
            raise ConfigError(
                f"quantize.linear.float8 needs a GPU with float8 tensor cores (SM 8.9+: Ada, Hopper or later); "
                f"{torch.cuda.get_device_name()} has SM {'.'.join(map(str, torch.cuda.get_device_capability()))}"
            )
        return convert_to_float8(model, self.filter_fqns, shard_degree=tp_degree, recipe=self.recipe_name)

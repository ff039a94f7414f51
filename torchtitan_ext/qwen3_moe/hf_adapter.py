"""Qwen3-MoE <-> Hugging Face ``Qwen3MoeForCausalLM``: names, stacked <-> per-expert tensors, config.json.

Qwen3's adapter (names, QK-norm gains, half-split RoPE: tensors unchanged) plus the MoE blocks:

=================================================  ==============================================================
titanlite / torchtitan name                        Hugging Face name
=================================================  ==============================================================
``layers.N.feed_forward.router.gate.weight``       ``model.layers.N.mlp.gate.weight`` ``[E, dim]``
``layers.N.feed_forward.experts.w1`` ``[E,H,dim]``  ``model.layers.N.mlp.experts.<j>.gate_proj.weight`` ``[H, dim]``
``layers.N.feed_forward.experts.w3``               ``... .experts.<j>.up_proj.weight`` (``w2``: ``down_proj``)
``layers.N.feed_forward.router.expert_bias``       none: exported only when zero, imported as zeros
=================================================  ==============================================================

Expert ``j`` of a stacked tensor is its ``j``-th slice, so export unstacks and import stacks, bit for bit.
The aux-loss-free bias has no counterpart in ``Qwen3MoeForCausalLM`` (its routing is the plain top-k): a
model whose bias moved would route differently there, so its export is refused. Routing that
``Qwen3MoeForCausalLM`` cannot express (sigmoid scores, a route scale, group-limited routing, shared
experts) is refused the same way. ``config.json`` gets ``num_experts`` (transformers 5 reads it as its alias of
``num_local_experts``); reading, either name is taken (a transformers 5 ``save_pretrained`` writes the latter).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

import torch

from titanlite.errors import CheckpointError
from torchtitan_ext.qwen3.hf_adapter import Qwen3HFAdapter
from torchtitan_ext.qwen3_moe.args import Qwen3MoEArgs

_EXPERT_RE = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_STACKED = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
_ROUTER = ("feed_forward.router.gate.weight", "mlp.gate.weight")
_BIAS = "feed_forward.router.expert_bias"
# upper bounds of the MoE sizes in config.json, far above any published model's (see HF_SIZE_LIMITS)
_MOE_LIMITS = {
    "num_experts": 1 << 14,
    "num_local_experts": 1 << 14,
    "num_experts_per_tok": 1 << 14,
    "moe_intermediate_size": 1 << 22,
    "decoder_sparse_step": 1 << 12,
}


class Qwen3MoEHFAdapter(Qwen3HFAdapter):
    architecture = "Qwen3MoeForCausalLM"
    model_type = "qwen3_moe"
    family = "Qwen3-MoE"
    BLOCK = {**Qwen3HFAdapter.BLOCK, _ROUTER[0]: _ROUTER[1]}

    def from_hf_name(self, hf_name: str) -> str | None:
        if m := _EXPERT_RE.match(hf_name):
            proj = {v: k for k, v in _STACKED.items()}[m.group(3)]
            return f"layers.{m.group(1)}.feed_forward.experts.{proj}"
        return super().from_hf_name(hf_name)

    def unexpected_tensor(self, hf_name: str) -> str:
        """An expert index past ``num_experts``; a MoE tensor in a block ``config.json`` makes dense, or a dense
        MLP tensor in one it makes sparse (``mlp_only_layers``, ``decoder_sparse_step``); else Qwen3's reason."""
        a, block = self.args, re.match(r"^model\.layers\.(\d+)\.mlp\.", hf_name)
        if block is None or int(block.group(1)) >= a.n_layers:
            return super().unexpected_tensor(hf_name)
        i, expert = int(block.group(1)), _EXPERT_RE.match(hf_name)
        placement = f"mlp_only_layers = {list(a.mlp_only_layers)}, decoder_sparse_step = {a.decoder_sparse_step}"
        if not a.is_moe_layer(i) and (expert or hf_name.endswith(".mlp.gate.weight")):
            return f"is a MoE tensor, but config.json makes block {i} a dense MLP ({placement})"
        if expert and int(expert.group(2)) >= (n := a.moe_num_experts):
            return f"is expert {expert.group(2)}, but config.json has num_experts = {n} (experts 0 to {n - 1})"
        if a.is_moe_layer(i) and not expert:
            return f"is a dense MLP tensor, but config.json makes block {i} a MoE block ({placement})"
        return super().unexpected_tensor(hf_name)

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        a = self.args
        e, h, d = a.moe_num_experts, a.moe_hidden_dim, a.dim
        moe = {
            _ROUTER[0]: (e, d),
            _BIAS: (e,),
            "feed_forward.experts.w1": (e, h, d),
            "feed_forward.experts.w2": (e, d, h),
            "feed_forward.experts.w3": (e, h, d),
        }
        out = {}
        for name, shape in super().expected_shapes().items():
            m = re.match(r"^layers\.(\d+)\.feed_forward\.w1\.weight$", name)
            if m and a.is_moe_layer(int(m.group(1))):
                out.update({f"layers.{m.group(1)}.{k}": v for k, v in moe.items()})
            elif not (re.match(r"^layers\.(\d+)\.feed_forward\.w[23]\.weight$", name) and _is_moe(a, name)):
                out[name] = shape
        return out

    def hf_layout(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        out = {}
        for name, shape in self.expected_shapes().items():
            if name.endswith(_BIAS):
                continue  # no HF tensor
            if stacked := self._stacked(name):
                out.update({hf: (name, shape[1:]) for hf in stacked})
            else:
                out[self.to_hf_name(name)] = (name, shape)
        return out

    def _stacked(self, name: str) -> list[str]:
        m = re.match(r"^layers\.(\d+)\.feed_forward\.experts\.(w[123])$", name)
        if m is None:
            return []
        proj = _STACKED[m.group(2)]
        return [f"model.layers.{m.group(1)}.mlp.experts.{j}.{proj}.weight" for j in range(self.args.moe_num_experts)]

    def to_hf_tensors(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        if name.endswith(_BIAS):
            if tensor.abs().sum() != 0:
                raise CheckpointError(
                    f"{name} is not zero (aux-loss-free balancing moved it): Qwen3MoeForCausalLM routes without a "
                    "bias, so the export would route differently; train with model.moe_bias_update_rate = 0 to export"
                )
            return []
        if stacked := self._stacked(name):
            return list(zip(stacked, tensor.unbind(0)))
        return super().to_hf_tensors(name, tensor)

    def from_hf_parts(self, name: str, parts: list[torch.Tensor]) -> torch.Tensor:
        if name.endswith(_BIAS):
            return torch.zeros(self.args.moe_num_experts, dtype=torch.float32)
        if self._stacked(name):
            return torch.stack(parts)
        return super().from_hf_parts(name, parts)

    def extra_hf_config(self) -> dict[str, Any]:
        a = self.args
        cfg = a.moe_config()
        unsupported = {
            "moe_score_func": cfg.score_func != "softmax",
            "moe_route_scale": cfg.route_scale != 1.0,
            "moe_n_groups": cfg.n_groups > 1,
            "moe_num_shared_experts": cfg.num_shared_experts > 0,
        }
        if bad := [k for k, v in unsupported.items() if v]:
            raise CheckpointError(f"Qwen3MoeForCausalLM cannot express model.{bad[0]}={getattr(a, bad[0])!r}")
        return {
            **super().extra_hf_config(),
            "moe_intermediate_size": a.moe_hidden_dim,
            "num_experts": a.moe_num_experts,
            "num_experts_per_tok": a.moe_top_k,
            "norm_topk_prob": a.moe_norm_topk_prob,
            "decoder_sparse_step": a.decoder_sparse_step,
            "mlp_only_layers": list(a.mlp_only_layers),
            "router_aux_loss_coef": a.moe_aux_loss_coef,
            "output_router_logits": False,
        }

    @classmethod
    def args_from_hf_config(cls, config: Mapping[str, Any]) -> Qwen3MoEArgs:
        """Model args of an HF Qwen3-MoE ``config.json``; ValueError for what this model cannot express."""
        dense = super().args_from_hf_config(config)  # the Qwen3 checks and fields
        return Qwen3MoEArgs(
            **dataclasses.asdict(dense),
            decoder_sparse_step=_hf_int(config, "decoder_sparse_step", 1),
            mlp_only_layers=list(config.get("mlp_only_layers") or []),
            moe_num_experts=_num_experts(config),
            moe_top_k=_hf_int(config, "num_experts_per_tok"),
            moe_hidden_dim=_hf_int(config, "moe_intermediate_size"),
            moe_norm_topk_prob=bool(config.get("norm_topk_prob", False)),
            moe_aux_loss_coef=float(config.get("router_aux_loss_coef", 0.0)),
        )


def _hf_int(config: Mapping[str, Any], key: str, default: int | None = None) -> int:
    """``config[key]`` (``default`` when absent), which must be an integer in ``[1, _MOE_LIMITS[key]]``: a float
    such as 4.7 is refused, not truncated."""
    value = config.get(key, default)
    if value is None:
        raise CheckpointError(f"Qwen3-MoE config.json lacks an integer {key!r}")
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= _MOE_LIMITS[key]:
        raise CheckpointError(f"config.json {key} = {value!r} must be an integer in [1, {_MOE_LIMITS[key]:,}]")
    return value


def _num_experts(config: Mapping[str, Any]) -> int:
    """The routed experts: ``num_experts`` (transformers 4.x writes it) or ``num_local_experts`` (transformers 5,
    which keeps ``num_experts`` as an alias of it); two values that differ are refused."""
    keys = [key for key in ("num_experts", "num_local_experts") if config.get(key) is not None]
    spellings = {key: _hf_int(config, key) for key in keys}
    if not spellings:
        raise CheckpointError("Qwen3-MoE config.json lacks an integer 'num_experts' (or 'num_local_experts')")
    if len(set(spellings.values())) > 1:
        raise CheckpointError(
            f"config.json num_experts = {spellings['num_experts']} but num_local_experts = "
            f"{spellings['num_local_experts']} (transformers 5's name for it)"
        )
    return next(iter(spellings.values()))


def _is_moe(args: Qwen3MoEArgs, name: str) -> bool:
    return args.is_moe_layer(int(name.split(".")[1]))

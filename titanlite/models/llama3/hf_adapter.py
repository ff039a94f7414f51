"""Llama 3 <-> Hugging Face ``LlamaForCausalLM``: parameter names, rotary layout and config.json.

Names: titanlite keeps Meta's names (``layers.<i>.attention.wq.weight``); Hugging Face uses
``model.layers.<i>.self_attn.q_proj.weight`` and so on (table below).

Rotary layout: titanlite rotates feature pairs ``(2j, 2j+1)`` of each head (Meta's interleaved
layout); Hugging Face rotates ``(j, j + head_dim/2)`` ("rotate half"). The two models are the same
function once the output rows of ``wq`` and ``wk`` are reordered inside each head: HF row ``j`` of a
head is native row ``2j`` and HF row ``j + head_dim/2`` is native row ``2j + 1``. Only ``wq`` (per
query head) and ``wk`` (per key/value head) are permuted; ``wv``/``wo`` are unaffected because the
rotation is applied to q and k only.

Every conversion works on one tensor at a time, so converters can stream a checkpoint.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

import torch

from titanlite.models.hf_names import HFNameMap

from titanlite.models.llama3.args import LLAMA3_FLAVORS, Llama3ModelArgs

# native suffix inside a block -> HF suffix inside a block
_BLOCK = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_TOP = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def interleaved_to_half_split(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Reorder the output rows of a q/k projection from the interleaved to the rotate-half layout."""
    out_dim, in_dim = w.shape
    head_dim = out_dim // n_heads
    return w.reshape(n_heads, head_dim // 2, 2, in_dim).transpose(1, 2).reshape(out_dim, in_dim)


def half_split_to_interleaved(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of :func:`interleaved_to_half_split`."""
    out_dim, in_dim = w.shape
    head_dim = out_dim // n_heads
    return w.reshape(n_heads, 2, head_dim // 2, in_dim).transpose(1, 2).reshape(out_dim, in_dim)


class Llama3HFAdapter(HFNameMap):
    """Converts one Llama 3 model's tensors and config to and from Hugging Face ``LlamaForCausalLM``."""

    architecture = "LlamaForCausalLM"
    model_type = "llama"

    TOP = _TOP
    BLOCK = _BLOCK

    def __init__(self, args: Llama3ModelArgs):
        self.args = args

    def _heads(self, name: str) -> Optional[int]:
        if name.endswith("attention.wq.weight"):
            return self.args.n_heads
        if name.endswith("attention.wk.weight"):
            return self.args.kv_heads
        return None

    # ---- tensors ----
    def to_hf(self, name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor]:
        """``(hf_name, tensor)`` for one native tensor (q/k rows reordered)."""
        heads = self._heads(name)
        if heads is not None:
            tensor = interleaved_to_half_split(tensor, heads)
        return self.to_hf_name(name), tensor

    def from_hf(self, hf_name: str, tensor: torch.Tensor) -> Optional[tuple[str, torch.Tensor]]:
        """``(native_name, tensor)`` for one HF tensor, or None for tensors without weights."""
        name = self.from_hf_name(hf_name)
        if name is None:
            return None
        heads = self._heads(name)
        if heads is not None:
            tensor = half_split_to_interleaved(tensor, heads)
        return name, tensor

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """Native name -> shape of every parameter of a model with these args, in HF's usual order."""
        a = self.args
        hd = a.head_dim
        shapes: dict[str, tuple[int, ...]] = {"tok_embeddings.weight": (a.vocab_size, a.dim)}
        for i in range(a.n_layers):
            p = f"layers.{i}."
            shapes[p + "attention.wq.weight"] = (a.n_heads * hd, a.dim)
            shapes[p + "attention.wk.weight"] = (a.kv_heads * hd, a.dim)
            shapes[p + "attention.wv.weight"] = (a.kv_heads * hd, a.dim)
            shapes[p + "attention.wo.weight"] = (a.dim, a.n_heads * hd)
            shapes[p + "feed_forward.w1.weight"] = (a.ffn_hidden_dim, a.dim)
            shapes[p + "feed_forward.w2.weight"] = (a.dim, a.ffn_hidden_dim)
            shapes[p + "feed_forward.w3.weight"] = (a.ffn_hidden_dim, a.dim)
            shapes[p + "attention_norm.weight"] = (a.dim,)
            shapes[p + "ffn_norm.weight"] = (a.dim,)
        shapes["norm.weight"] = (a.dim,)
        shapes["output.weight"] = (a.vocab_size, a.dim)
        return shapes

    # ---- config ----
    def hf_config(self, *, dtype: torch.dtype, bos_token_id: Optional[int] = None,
                  eos_token_id: Optional[int] = None) -> dict[str, Any]:
        """``config.json`` of the equivalent ``LlamaForCausalLM``."""
        a = self.args
        rope_scaling = None
        if a.rope_scaling_factor > 0:
            rope_scaling = {
                "rope_type": "llama3",
                "factor": a.rope_scaling_factor,
                "low_freq_factor": a.rope_low_freq_factor,
                "high_freq_factor": a.rope_high_freq_factor,
                "original_max_position_embeddings": a.rope_original_max_position,
            }
        return {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "hidden_size": a.dim,
            "intermediate_size": a.ffn_hidden_dim,
            "num_hidden_layers": a.n_layers,
            "num_attention_heads": a.n_heads,
            "num_key_value_heads": a.kv_heads,
            "head_dim": a.head_dim,
            "vocab_size": a.vocab_size,
            "max_position_embeddings": a.max_seq_len,
            "rms_norm_eps": a.norm_eps,
            "rope_theta": a.rope_theta,
            "rope_scaling": rope_scaling,
            "tie_word_embeddings": a.tie_word_embeddings,
            "hidden_act": "silu",
            "attention_bias": False,
            "attention_dropout": 0.0,
            "mlp_bias": False,
            "initializer_range": 0.02,
            "pretraining_tp": 1,
            "use_cache": True,
            "bos_token_id": bos_token_id,
            "eos_token_id": eos_token_id,
            "torch_dtype": str(dtype).removeprefix("torch."),
        }

    @staticmethod
    def generation_config(bos_token_id: Optional[int], eos_token_id: Optional[int]) -> dict[str, Any]:
        return {"bos_token_id": bos_token_id, "eos_token_id": eos_token_id, "do_sample": False}

    @classmethod
    def args_from_hf_config(cls, config: Mapping[str, Any]) -> Llama3ModelArgs:
        """Model args equivalent to an HF Llama ``config.json``; ValueError when it is not one."""
        archs = config.get("architectures") or []
        if config.get("model_type") != cls.model_type and cls.architecture not in archs:
            raise ValueError(f"not a Llama config (model_type={config.get('model_type')!r}, "
                             f"architectures={archs}); expected {cls.architecture}")
        for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
            if not isinstance(config.get(key), int):
                raise ValueError(f"Llama config.json lacks an integer {key!r}")
        if config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {config['hidden_act']!r} (titanlite's Llama uses silu)")
        for key in ("attention_bias", "mlp_bias"):
            if config.get(key):
                raise ValueError(f"unsupported {key}=true (titanlite's Llama has no biases)")
        dim, n_heads = config["hidden_size"], config["num_attention_heads"]
        head_dim = config.get("head_dim")
        if head_dim is not None and n_heads * head_dim != dim:
            raise ValueError(f"unsupported head_dim={head_dim}: titanlite needs head_dim = hidden_size / "
                             f"num_attention_heads = {dim // n_heads if n_heads else '?'}")
        theta, scaling = _rope_from_hf(config)
        base = dict(
            dim=dim, n_layers=config["num_hidden_layers"], n_heads=n_heads,
            n_kv_heads=config.get("num_key_value_heads") or n_heads, vocab_size=config["vocab_size"],
            norm_eps=float(config.get("rms_norm_eps", 1e-5)), rope_theta=theta,
            max_seq_len=int(config.get("max_position_embeddings", 8192)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)), **scaling)
        return _with_ffn_hidden_dim(base, config["intermediate_size"])


def _rope_from_hf(config: Mapping[str, Any]) -> tuple[float, dict[str, Any]]:
    """``(rope_theta, scaling fields)`` from transformers 5 ``rope_parameters`` or 4.x ``rope_scaling``."""
    params = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or {}
    theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
    rope = scaling or params
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type in (None, "default"):
        return float(theta), {}
    if rope_type != "llama3":
        raise ValueError(f"unsupported rope_type {rope_type!r} (titanlite supports default and llama3)")
    return float(theta), dict(
        rope_scaling_factor=float(rope["factor"]), rope_low_freq_factor=float(rope["low_freq_factor"]),
        rope_high_freq_factor=float(rope["high_freq_factor"]),
        rope_original_max_position=int(rope["original_max_position_embeddings"]))


def _with_ffn_hidden_dim(base: dict[str, Any], hidden: int) -> Llama3ModelArgs:
    """Args whose SwiGLU size is ``hidden``: a published flavor's rounding rule when one fits,
    otherwise ``multiple_of = hidden`` (any raw size up to ``hidden`` rounds up to it)."""
    for flavor in LLAMA3_FLAVORS.values():
        args = Llama3ModelArgs(**base, multiple_of=flavor.multiple_of, ffn_dim_multiplier=flavor.ffn_dim_multiplier)
        if args.ffn_hidden_dim == hidden:
            return args
    raw = int(2 * 4 * base["dim"] / 3)
    multiplier = None if raw <= hidden else hidden / raw
    args = Llama3ModelArgs(**base, multiple_of=hidden, ffn_dim_multiplier=multiplier)
    if args.ffn_hidden_dim != hidden:
        raise ValueError(f"cannot express intermediate_size={hidden} with hidden_size={base['dim']}")
    return args


"""What every Llama-style decoder's Hugging Face adapter shares: names, shapes, config.json basics.

A family's adapter subclasses :class:`HFDecoderAdapter`, fills the two name tables (``TOP``: whole names,
``BLOCK``: suffixes inside ``layers.<i>``, which HF stores as ``model.layers.<i>``) and adds only what differs:
tensor layouts (``tensor_to_hf`` / ``tensor_from_hf``), extra block parameters, its own ``config.json`` keys and
``args_from_hf_config``. A native tensor may stand for several HF tensors or none (a MoE layer's stacked experts,
its routing bias: :meth:`~HFDecoderAdapter.hf_layout`). Conversions work one tensor at a time, so converters can
stream a checkpoint.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch

from titanlite.errors import CheckpointError

_NATIVE_BLOCK_RE = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_BLOCK_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# HF keys that carry no weights (older exports store the rotary inverse frequencies)
_HF_IGNORED_RE = re.compile(r"(^|\.)rotary_emb\.inv_freq$")

# the names every Llama-style family shares (a family may add entries)
DECODER_TOP = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
DECODER_BLOCK = {
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
_REQUIRED_INTS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
# upper bounds of config.json sizes, far above any published model's: a larger value is damage or a typo, and
# converting it would loop over (num_hidden_layers: 1e12 hung the converter) or allocate (a rotary table) it
HF_SIZE_LIMITS = {
    "hidden_size": 1 << 20,
    "intermediate_size": 1 << 22,
    "num_hidden_layers": 1 << 12,
    "num_attention_heads": 1 << 14,
    "num_key_value_heads": 1 << 14,
    "head_dim": 1 << 14,
    "vocab_size": 1 << 24,
    "max_position_embeddings": 1 << 24,
}


class HFDecoderAdapter:
    """Converts one model's tensors and config to and from a Hugging Face ``*ForCausalLM``."""

    architecture = "?"  # e.g. "LlamaForCausalLM"
    model_type = "?"  # config.json "model_type", e.g. "llama"
    family = "?"  # for messages, e.g. "Llama"
    TOP: dict[str, str] = DECODER_TOP
    BLOCK: dict[str, str] = DECODER_BLOCK

    def __init__(self, args: Any):
        self.args = args

    # ---- names
    def to_hf_name(self, name: str) -> str:
        if name in self.TOP:
            return self.TOP[name]
        m = _NATIVE_BLOCK_RE.match(name)
        if m and m.group(2) in self.BLOCK:
            return f"model.layers.{m.group(1)}.{self.BLOCK[m.group(2)]}"
        raise KeyError(f"no Hugging Face name for parameter {name!r}")

    def from_hf_name(self, hf_name: str) -> str | None:
        """The native name of an HF tensor; None for tensors that hold no weights (rotary tables)."""
        top, block = ({hf: native for native, hf in table.items()} for table in (self.TOP, self.BLOCK))
        m = _HF_BLOCK_RE.match(hf_name)
        if _HF_IGNORED_RE.search(hf_name):
            return None
        if hf_name in top:
            return top[hf_name]
        if m and m.group(2) in block:
            return f"layers.{m.group(1)}.{block[m.group(2)]}"
        raise KeyError(f"unexpected tensor {hf_name!r} for a {self.architecture}")

    def unexpected_tensor(self, hf_name: str) -> str:
        """Why the model of ``config.json`` has no tensor ``hf_name`` (a name :meth:`from_hf_name` reads), as the
        end of an import error: for a decoder, a block beyond ``num_hidden_layers``. Families with tensors that only
        some blocks have (MoE) name their own causes."""
        return f"does not belong to a model with {self.args.n_layers} layers (config.json num_hidden_layers)"

    # ---- tensors: the native and HF layouts (``name``: the native name) are the same unless overridden
    def tensor_to_hf(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def tensor_from_hf(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def to_hf(self, name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor]:
        """``(hf_name, tensor)`` for one native tensor."""
        return self.to_hf_name(name), self.tensor_to_hf(name, tensor)

    def from_hf(self, hf_name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        """``(native_name, tensor)`` for one HF tensor, or None for tensors without weights."""
        name = self.from_hf_name(hf_name)
        return None if name is None else (name, self.tensor_from_hf(name, tensor))

    # ---- one native tensor as several HF tensors (or none); one-to-one unless overridden
    def hf_layout(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        """``{HF name: (native name, HF shape)}`` of every HF tensor, in order; a native tensor's HF parts are its
        entries in this order (a native tensor with none is built by :meth:`from_hf_parts` from nothing)."""
        return {self.to_hf_name(name): (name, shape) for name, shape in self.expected_shapes().items()}

    def to_hf_tensors(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """``[(hf_name, tensor), ...]``: the HF tensors one native tensor becomes."""
        return [self.to_hf(name, tensor)]

    def from_hf_parts(self, name: str, parts: list[torch.Tensor]) -> torch.Tensor:
        """The native tensor ``name`` from its HF parts (in :meth:`hf_layout` order)."""
        (tensor,) = parts
        return self.tensor_from_hf(name, tensor)

    def extra_block_shapes(self) -> dict[str, tuple[int, ...]]:
        """Block parameters beyond the shared decoder block (suffix -> shape)."""
        return {}

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """Native name -> shape of every parameter of a model with these args, in HF's usual order."""
        a = self.args
        q, kv, f = a.n_heads * a.head_dim, a.kv_heads * a.head_dim, a.ffn_hidden_dim
        block = {
            "attention.wq.weight": (q, a.dim),
            "attention.wk.weight": (kv, a.dim),
            "attention.wv.weight": (kv, a.dim),
            "attention.wo.weight": (a.dim, q),
            **self.extra_block_shapes(),
            "feed_forward.w1.weight": (f, a.dim),
            "feed_forward.w2.weight": (a.dim, f),
            "feed_forward.w3.weight": (f, a.dim),
            "attention_norm.weight": (a.dim,),
            "ffn_norm.weight": (a.dim,),
        }
        layers = {f"layers.{i}.{suffix}": shape for i in range(a.n_layers) for suffix, shape in block.items()}
        embedding = (a.vocab_size, a.dim)
        return {"tok_embeddings.weight": embedding, **layers, "norm.weight": (a.dim,), "output.weight": embedding}

    # ---- config.json
    def hf_config(
        self, *, dtype: torch.dtype, bos_token_id: int | None = None, eos_token_id: int | None = None
    ) -> dict[str, Any]:
        """``config.json`` of the equivalent HF model: the keys every Llama-style family writes the same
        way, then the family's :meth:`extra_hf_config`."""
        a = self.args
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
            "tie_word_embeddings": a.tie_word_embeddings,
            "hidden_act": "silu",
            "attention_bias": False,
            "attention_dropout": 0.0,
            "initializer_range": 0.02,
            "use_cache": True,
            "bos_token_id": bos_token_id,
            "eos_token_id": eos_token_id,
            "torch_dtype": str(dtype).removeprefix("torch."),
            **self.extra_hf_config(),
        }

    def extra_hf_config(self) -> dict[str, Any]:
        return {}

    @staticmethod
    def generation_config(bos_token_id: int | None, eos_token_id: int | None) -> dict[str, Any]:
        return {"bos_token_id": bos_token_id, "eos_token_id": eos_token_id, "do_sample": False}

    @classmethod
    def check_hf_config(cls, config: Mapping[str, Any]) -> None:
        """ValueError unless ``config`` is this family's, with the core integer sizes, SwiGLU (silu)
        and no attention bias."""
        archs = config.get("architectures") or []
        if config.get("model_type") != cls.model_type and cls.architecture not in archs:
            raise CheckpointError(
                f"not a {cls.family} config (model_type={config.get('model_type')!r}, "
                f"architectures={archs}); expected {cls.architecture}"
            )
        for key in _REQUIRED_INTS:
            if not isinstance(config.get(key), int) or isinstance(config[key], bool):
                raise CheckpointError(f"{cls.family} config.json lacks an integer {key!r}")
        for key, limit in HF_SIZE_LIMITS.items():
            value = config.get(key)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= limit):
                raise CheckpointError(f"config.json {key} = {value!r} must be an integer in [1, {limit:,}]")
        if config.get("hidden_act", "silu") != "silu":
            raise CheckpointError(
                f"unsupported hidden_act {config['hidden_act']!r} (titanlite's {cls.family} uses silu)"
            )
        if config.get("attention_bias"):
            raise CheckpointError(f"unsupported attention_bias=true (titanlite's {cls.family} has no biases)")

    @staticmethod
    def rope_from_hf(config: Mapping[str, Any]) -> tuple[float, str, Mapping[str, Any]]:
        """``(rope_theta, rope_type, scaling fields)`` from transformers 5 ``rope_parameters`` or 4.x
        ``rope_theta`` + ``rope_scaling``; ``rope_type`` is ``"default"`` for plain RoPE."""
        params = config.get("rope_parameters") or {}
        rope = config.get("rope_scaling") or params
        theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
        return float(theta), rope.get("rope_type", rope.get("type")) or "default", rope

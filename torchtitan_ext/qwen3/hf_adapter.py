"""Qwen3 <-> Hugging Face ``Qwen3ForCausalLM``: parameter names and ``config.json``.

The model already uses Hugging Face's half-split RoPE layout, so every tensor converts unchanged;
only names differ:

=====================================  ==================================================
titanlite / torchtitan name            Hugging Face name
=====================================  ==================================================
``tok_embeddings.weight``              ``model.embed_tokens.weight``
``layers.N.attention.wq.weight``       ``model.layers.N.self_attn.q_proj.weight`` (k, v, o alike)
``layers.N.attention.q_norm.weight``   ``model.layers.N.self_attn.q_norm.weight`` (k_norm alike)
``layers.N.feed_forward.w1.weight``    ``model.layers.N.mlp.gate_proj.weight`` (w3: up, w2: down)
``layers.N.attention_norm.weight``     ``model.layers.N.input_layernorm.weight``
``layers.N.ffn_norm.weight``           ``model.layers.N.post_attention_layernorm.weight``
``norm.weight`` / ``output.weight``    ``model.norm.weight`` / ``lm_head.weight``
=====================================  ==================================================

Same interface as titanlite's ``Llama3HFAdapter`` (the ``ModelSpec.hf_adapter`` contract), so
``titanlite.checkpoint.hf`` (``scripts/convert_dcp_to_hf.py`` / ``convert_hf_to_dcp.py``) converts
Qwen3 checkpoints once the extension is imported.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

import torch

from titanlite.models.hf_names import HFNameMap

from torchtitan_ext.qwen3.args import Qwen3ModelArgs

_BLOCK = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_TOP = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}


class Qwen3HFAdapter(HFNameMap):
    architecture = "Qwen3ForCausalLM"
    model_type = "qwen3"

    TOP = _TOP
    BLOCK = _BLOCK

    def __init__(self, args: Qwen3ModelArgs):
        self.args = args

    # ---- tensors (same layout on both sides)
    def to_hf(self, name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor]:
        return self.to_hf_name(name), tensor

    def from_hf(self, hf_name: str, tensor: torch.Tensor) -> Optional[tuple[str, torch.Tensor]]:
        name = self.from_hf_name(hf_name)
        return None if name is None else (name, tensor)

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        a = self.args
        shapes: dict[str, tuple[int, ...]] = {"tok_embeddings.weight": (a.vocab_size, a.dim)}
        for i in range(a.n_layers):
            p = f"layers.{i}."
            shapes[p + "attention.wq.weight"] = (a.q_dim, a.dim)
            shapes[p + "attention.wk.weight"] = (a.kv_dim, a.dim)
            shapes[p + "attention.wv.weight"] = (a.kv_dim, a.dim)
            shapes[p + "attention.wo.weight"] = (a.dim, a.q_dim)
            if a.qk_norm:
                shapes[p + "attention.q_norm.weight"] = (a.head_dim,)
                shapes[p + "attention.k_norm.weight"] = (a.head_dim,)
            shapes[p + "feed_forward.w1.weight"] = (a.ffn_hidden_dim, a.dim)
            shapes[p + "feed_forward.w2.weight"] = (a.dim, a.ffn_hidden_dim)
            shapes[p + "feed_forward.w3.weight"] = (a.ffn_hidden_dim, a.dim)
            shapes[p + "attention_norm.weight"] = (a.dim,)
            shapes[p + "ffn_norm.weight"] = (a.dim,)
        shapes["norm.weight"] = (a.dim,)
        shapes["output.weight"] = (a.vocab_size, a.dim)
        return shapes

    # ---- config
    def hf_config(self, *, dtype: torch.dtype, bos_token_id: Optional[int] = None,
                  eos_token_id: Optional[int] = None) -> dict[str, Any]:
        a = self.args
        if not a.qk_norm:
            raise ValueError("Qwen3ForCausalLM always applies QK-norm; a model with qk_norm=false has no HF equivalent")
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
            "rope_theta": a.rope_theta,  # transformers 4.x
            "rope_parameters": {"rope_type": "default", "rope_theta": a.rope_theta},  # transformers 5
            "rope_scaling": None,
            "tie_word_embeddings": a.tie_word_embeddings,
            "hidden_act": "silu",
            "attention_bias": False,
            "attention_dropout": 0.0,
            "use_sliding_window": False,
            "sliding_window": None,
            "max_window_layers": a.n_layers,
            "initializer_range": 0.02,
            "use_cache": True,
            "bos_token_id": bos_token_id,
            "eos_token_id": eos_token_id,
            "torch_dtype": str(dtype).removeprefix("torch."),
        }

    @staticmethod
    def generation_config(bos_token_id: Optional[int], eos_token_id: Optional[int]) -> dict[str, Any]:
        return {"bos_token_id": bos_token_id, "eos_token_id": eos_token_id, "do_sample": False}

    @classmethod
    def args_from_hf_config(cls, config: Mapping[str, Any]) -> Qwen3ModelArgs:
        """Model args of an HF Qwen3 ``config.json``; ValueError for what this model cannot express."""
        archs = config.get("architectures") or []
        if config.get("model_type") != cls.model_type and cls.architecture not in archs:
            raise ValueError(f"not a Qwen3 config (model_type={config.get('model_type')!r}, architectures={archs})")
        for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
            if not isinstance(config.get(key), int):
                raise ValueError(f"Qwen3 config.json lacks an integer {key!r}")
        if config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {config['hidden_act']!r} (this Qwen3 uses silu)")
        if config.get("attention_bias"):
            raise ValueError("unsupported attention_bias=true (this Qwen3 has no biases)")
        if config.get("use_sliding_window"):
            raise ValueError("unsupported use_sliding_window=true (this Qwen3 attends to the whole window)")
        params = config.get("rope_parameters") or {}
        rope = config.get("rope_scaling") or params
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in (None, "default"):
            raise ValueError(f"unsupported rope_type {rope_type!r} (this Qwen3 supports plain RoPE only)")
        theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
        n_heads = config["num_attention_heads"]
        return Qwen3ModelArgs(
            dim=config["hidden_size"], n_layers=config["num_hidden_layers"], n_heads=n_heads,
            n_kv_heads=config.get("num_key_value_heads") or n_heads,
            head_dim=int(config.get("head_dim") or config["hidden_size"] // n_heads),
            ffn_hidden_dim=config["intermediate_size"], vocab_size=config["vocab_size"],
            norm_eps=float(config.get("rms_norm_eps", 1e-6)), rope_theta=float(theta),
            max_seq_len=int(config.get("max_position_embeddings", 40960)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)))

"""Llama 3 <-> Hugging Face ``LlamaForCausalLM``: parameter names (the shared tables of
:mod:`titanlite.models.hf_decoder`), rotary layout and config.json; one tensor at a time, so converters can stream.

Rotary layout: titanlite rotates feature pairs ``(2j, 2j+1)`` of each head (Meta's interleaved layout), Hugging
Face ``(j, j + head_dim/2)`` ("rotate half"). The models are the same function once the output rows of ``wq`` (per
query head) and ``wk`` (per key/value head) are reordered: HF row ``j`` of a head is native row ``2j``, HF row
``j + head_dim/2`` native row ``2j + 1``; ``wv`` and ``wo`` are unaffected, as only q and k are rotated.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from titanlite.errors import CheckpointError
from titanlite.models.hf_decoder import HFDecoderAdapter
from titanlite.models.llama3.args import LLAMA3_FLAVORS, Llama3ModelArgs


class Llama3HFAdapter(HFDecoderAdapter):
    """Converts one Llama 3 model's tensors and config to and from Hugging Face ``LlamaForCausalLM``
    (the shared decoder names; q/k rows reordered for the rotary layout)."""

    architecture = "LlamaForCausalLM"
    model_type = "llama"
    family = "Llama"

    def _reorder_qk_rows(self, name: str, w: torch.Tensor, to_hf: bool) -> torch.Tensor:
        """``wq``/``wk`` rows, per head, from the interleaved to the rotate-half layout (``to_hf``) or
        back; other tensors unchanged."""
        for suffix, heads in (("attention.wq.weight", self.args.n_heads), ("attention.wk.weight", self.args.kv_heads)):
            if name.endswith(suffix):
                out_dim, in_dim = w.shape
                pairs = (out_dim // heads // 2, 2)  # interleaved: row 2j + i of a head is pair j, member i
                split = pairs if to_hf else pairs[::-1]
                return w.reshape(heads, *split, in_dim).transpose(1, 2).reshape(out_dim, in_dim)
        return w

    def tensor_to_hf(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        return self._reorder_qk_rows(name, tensor, to_hf=True)

    def tensor_from_hf(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        return self._reorder_qk_rows(name, tensor, to_hf=False)

    def extra_hf_config(self) -> dict[str, Any]:
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
        extra = {"rope_theta": a.rope_theta, "rope_scaling": rope_scaling, "mlp_bias": False, "pretraining_tp": 1}
        if rope_scaling is not None and a.max_seq_len <= a.rope_original_max_position:
            # transformers warns unless the context is longer than RoPE's original one: give the scaled
            # context (what the scaling is for; max_seq_len is how long this run's sequences were)
            extra["max_position_embeddings"] = int(a.rope_original_max_position * max(a.rope_scaling_factor, 2.0))
        return extra

    @classmethod
    def args_from_hf_config(cls, config: Mapping[str, Any]) -> Llama3ModelArgs:
        """Model args equivalent to an HF Llama ``config.json``; ValueError when it is not one."""
        cls.check_hf_config(config)
        if config.get("mlp_bias"):
            raise CheckpointError("unsupported mlp_bias=true (titanlite's Llama has no biases)")
        dim, n_heads = config["hidden_size"], config["num_attention_heads"]
        head_dim = config.get("head_dim")
        if head_dim is not None and n_heads * head_dim != dim:
            raise CheckpointError(
                f"unsupported head_dim={head_dim}: titanlite needs head_dim = hidden_size / "
                f"num_attention_heads = {dim // n_heads if n_heads else '?'}"
            )
        theta, scaling = _rope_from_hf(config)
        base = dict(
            dim=dim,
            n_layers=config["num_hidden_layers"],
            n_heads=n_heads,
            n_kv_heads=config.get("num_key_value_heads") or n_heads,
            vocab_size=config["vocab_size"],
            norm_eps=float(config.get("rms_norm_eps", 1e-5)),
            rope_theta=theta,
            max_seq_len=int(config.get("max_position_embeddings", 8192)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            **scaling,
        )
        return _with_ffn_hidden_dim(base, config["intermediate_size"])


def _rope_from_hf(config: Mapping[str, Any]) -> tuple[float, dict[str, Any]]:
    """``(rope_theta, Llama 3.1 scaling fields)``; plain RoPE gives no fields."""
    theta, rope_type, rope = HFDecoderAdapter.rope_from_hf(config)
    if rope_type == "default":
        return theta, {}
    if rope_type != "llama3":
        raise CheckpointError(f"unsupported rope_type {rope_type!r} (titanlite supports default and llama3)")
    return theta, dict(
        rope_scaling_factor=float(rope["factor"]),
        rope_low_freq_factor=float(rope["low_freq_factor"]),
        rope_high_freq_factor=float(rope["high_freq_factor"]),
        rope_original_max_position=int(rope["original_max_position_embeddings"]),
    )


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
        raise CheckpointError(f"cannot express intermediate_size={hidden} with hidden_size={base['dim']}")
    return args

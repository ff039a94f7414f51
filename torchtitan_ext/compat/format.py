"""torchtitan's DCP names of a Llama 3 model, and the titanlite model args of a torchtitan step folder (which
records none): what :func:`titanlite.checkpoint.hf_export.dcp_to_hf` and :mod:`torchtitan_ext.compat.checkpoint` read
torchtitan folders (v0.2, 0.3.0, and the older ``model.``-prefixed layout) with.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from titanlite.errors import CheckpointError, one_line
from titanlite.models import get_model_spec
from titanlite.models.registry import check_arg_types, check_model_args

logger = logging.getLogger(__name__)

TORCHTITAN_QKV = ".attention.qkv_linear."  # torchtitan 0.3.0's Q/K/V projections inside a block
# n_heads of torchtitan's llama3 flavors (v0.2 and 0.3.0), by model dim
TORCHTITAN_LLAMA3_HEADS = {256: 16, 2048: 32, 3072: 24, 4096: 32, 8192: 64, 16384: 128}
# RoPE, norm eps and context of every torchtitan llama3 flavor (v0.2 and 0.3.0): Llama 3.1's (scaling
# factor 8), as titanlite's own 8B flavor has them
TORCHTITAN_LLAMA3_KEYS = (
    "rope_theta",
    "rope_scaling_factor",
    "rope_low_freq_factor",
    "rope_high_freq_factor",
    "rope_original_max_position",
    "max_seq_len",
    "norm_eps",
)


def torchtitan_version(keys: Mapping[str, Any], where: Path | str) -> str:
    """Which torchtitan wrote a Llama 3 DCP folder, from its keys: ``"0.3"`` (``lm_head``,
    ``attention.qkv_linear.*``), ``"0.2"`` (Meta's names at the top level) or ``"old"`` (Meta's
    names under ``model.``). A one-line ValueError when it holds no Llama 3 model."""
    if "tok_embeddings.weight" in keys:
        return "0.3" if any(k.startswith("layers.") and TORCHTITAN_QKV in k for k in keys) else "0.2"
    if "model.tok_embeddings.weight" in keys:
        return "old"
    raise CheckpointError(
        f"{where}: no checkpoint.json and no tok_embeddings.weight: neither a titanlite checkpoint "
        "nor a torchtitan checkpoint of a Llama 3 model"
    )


def torchtitan_name(name: str, version: str, fused: bool = False) -> str:
    """The name torchtitan ``version`` gives titanlite's Llama 3 parameter ``name``: 0.3.0 calls the
    output ``lm_head`` and keeps the Q/K/V projections in ``attention.qkv_linear`` (``fused``: the
    single ``qkv_linear.wqkv.weight`` parameter its optimizer state is keyed by); other versions
    (and titanlite) use Meta's names."""
    if version != "0.3":
        return name
    if name == "output.weight":
        return "lm_head.weight"
    block, sep, proj = name.rpartition(".attention.")
    if sep and proj in ("wq.weight", "wk.weight", "wv.weight"):
        return f"{block}{TORCHTITAN_QKV}{'wqkv.weight' if fused else proj}"
    return name


def torchtitan_model_args(
    keys: Mapping[str, Any], prefix: str, version: str, where: Path, given: Mapping[str, Any]
) -> Any:
    """titanlite Llama 3 args for a torchtitan checkpoint, which records none. ``given`` wins; then
    the shapes decide ``vocab_size``, ``dim``, ``n_layers``, ``n_kv_heads`` and the SwiGLU size;
    ``n_heads`` comes from the torchtitan flavor of that ``dim`` (else it must be given); RoPE and
    norm are torchtitan's llama3 constants (``TORCHTITAN_LLAMA3_KEYS`` of the Llama 3.1 8B flavor)."""
    spec = get_model_spec("llama3")
    fields = set(spec.args_cls.__dataclass_fields__)
    if unknown := sorted(set(given) - fields):
        raise CheckpointError(f"unknown llama3 model args: {', '.join(unknown)} (known: {', '.join(sorted(fields))})")
    check_arg_types(spec.args_cls, given)  # before any arithmetic with them (n_heads=abc: one line, not a TypeError)

    def shape(name: str) -> list[int]:
        md = keys.get(prefix + torchtitan_name(name, version))
        if md is None or not hasattr(md, "size"):
            raise CheckpointError(f"{where} has no tensor {prefix + torchtitan_name(name, version)}")
        return list(md.size)

    vocab, dim = shape("tok_embeddings.weight")
    layers = {k[len(prefix) :].split(".")[1] for k in keys if k.startswith(prefix + "layers.")}
    n_heads = given.get("n_heads", TORCHTITAN_LLAMA3_HEADS.get(dim))
    if n_heads is None:
        raise CheckpointError(
            f"{where} has no checkpoint.json, and its model dim {dim} is no torchtitan llama3 flavor's: "
            "give the model arg n_heads (--model-arg n_heads=N)"
        )
    kv_rows = shape("layers.0.attention.wk.weight")[0]
    inferred = dict(vocab_size=vocab, dim=dim, n_layers=len(layers), n_heads=n_heads)
    inferred["n_kv_heads"] = kv_rows // (dim // n_heads) if dim % n_heads == 0 else None
    llama31 = get_model_spec("llama3").flavors["8B"]
    base = {**{k: getattr(llama31, k) for k in TORCHTITAN_LLAMA3_KEYS}, **inferred, **given}
    try:
        args = spec.args_cls(**base)
        if "multiple_of" not in given and "ffn_dim_multiplier" not in given:
            hidden = shape("layers.0.feed_forward.w1.weight")[0]
            args = spec.args_cls(**{**base, "multiple_of": hidden, "ffn_dim_multiplier": None})
            if args.ffn_hidden_dim != hidden:  # Meta's rounding gives more than hidden: scale it down
                raw = int(2 * 4 * dim / 3)
                args = spec.args_cls(**{**base, "multiple_of": hidden, "ffn_dim_multiplier": hidden / raw})
        check_model_args(args)
    except (TypeError, ValueError, ArithmeticError) as e:
        raise CheckpointError(f"{where}: invalid model args {base} ({one_line(e)})") from None
    logger.info("%s: torchtitan %s checkpoint, exported with llama3 model args %s", where, version, args)
    return args


class TorchtitanFolder:
    """A torchtitan step folder of a Llama 3 model, from its DCP keys (``keys``: the ``.metadata``'s
    ``state_dict_metadata``): which version wrote it (a one-line ValueError when it holds no Llama 3 model),
    the DCP key of each titanlite parameter, and the model args."""

    def __init__(self, keys: Mapping[str, Any], where: Path):
        self.keys, self.where = keys, where
        self.version = torchtitan_version(keys, where)
        self.prefix = "model." if self.version == "old" else ""

    def key(self, name: str) -> str:
        return self.prefix + torchtitan_name(name, self.version)

    def model(self, given: Mapping[str, Any]) -> tuple[Any, Any]:
        """``(spec, args)``: titanlite's llama3 with :func:`torchtitan_model_args` (``given`` wins)."""
        return get_model_spec("llama3"), torchtitan_model_args(self.keys, self.prefix, self.version, self.where, given)

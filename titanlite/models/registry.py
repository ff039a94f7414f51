"""Model-family registry: a family registers one :class:`ModelSpec` (core's own, :data:`BUILTIN_FAMILIES`, on
their first lookup; an extension when imported) and core looks it up by name, never importing a family module, so
a new family plugs in without touching core (docs/extensions.md)."""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections import Counter
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import titanlite.config
from titanlite.components import resolve
from titanlite.config import ConfigError, JobConfig, did_you_mean
from titanlite.errors import UnknownNameError, one_line
from titanlite.extensions import load_extensions
from titanlite.models.flops import palm_flops_per_token
from titanlite.models.protocol import contract_breach

# Args that say how a run computes, not what trained weights mean: the rotary table's length, the
# attention kernel and mask, the initialization. A seed checkpoint's values of these are not taken.
RUN_ARGS: tuple[str, ...] = ("max_seq_len", "attn_backend", "attn_mask_type", "depth_init")
MAX_ARG_INT = 2**31 - 1  # no size of a model comes near it: a larger integer arg is damage or a typo (1e11)


@dataclass(frozen=True)
class ModelSpec:
    """Everything core needs to know about one model family (docs/extensions.md walks through one).

    ``model_cls(args)`` builds a :class:`titanlite.models.protocol.ModelFamily` from an ``args_cls`` instance;
    ``flavors`` maps preset names to args. ``parallelize_fn(model, parallel_dims, policies)`` and
    ``pipeline_fn(model, plan, stage_ids) -> stages`` run on the meta model (None: one process only / no pipeline
    parallelism). ``hf_adapter``: an :class:`titanlite.models.hf_decoder.HFDecoderAdapter` subclass (``titanlite
    convert``). ``num_params`` / ``flops_per_token`` / ``active_params`` (a mixture of experts' parameters used per
    token): the family's exact counts; None: counted on a meta-built model (:func:`model_counts`), all parameters
    active. ``run_args``: fields never taken from a seed checkpoint (:data:`RUN_ARGS`).
    """

    name: str
    args_cls: type
    flavors: dict[str, Any]
    model_cls: type
    parallelize_fn: Callable[..., nn.Module] | None = None
    pipeline_fn: Callable[..., list[nn.Module]] | None = None
    hf_adapter: Any = None
    tokenizer_builder: Callable[[str], Any] | None = None
    num_params: Callable[[Any], int] | None = None
    flops_per_token: Callable[[Any, int], int] | None = None
    run_args: tuple[str, ...] = RUN_ARGS
    active_params: Callable[[Any], int] | None = None


# core's families: name -> "module:attribute" of its ModelSpec, registered on the first lookup
BUILTIN_FAMILIES: dict[str, str] = {
    "llama3": "titanlite.models.llama3:LLAMA3_SPEC",
    "llama3_moe": "titanlite.models.llama3_moe:LLAMA3_MOE_SPEC",
}
_REGISTRY: dict[str, ModelSpec] = {}


def register_model(spec: ModelSpec) -> ModelSpec:
    """Register a family; registering the same name twice is an error, and so is a family that breaks the
    contract of :mod:`titanlite.models.protocol` (one line naming the family and the member it lacks)."""
    if (why := contract_breach(spec.model_cls, spec.args_cls)) is not None:
        raise ValueError(f"model family {spec.name!r} cannot register: {why}")
    builtin = BUILTIN_FAMILIES.get(spec.name)
    taken = spec.name in _REGISTRY and _REGISTRY[spec.name] is not spec
    if taken or builtin is not None and resolve(builtin) is not spec:
        raise ValueError(f"model family {spec.name!r} is already registered")
    _REGISTRY[spec.name] = spec
    return spec


def model_names() -> list[str]:
    return sorted({*BUILTIN_FAMILIES, *_REGISTRY})


def get_model_spec(name: str) -> ModelSpec:
    if name not in _REGISTRY and name in BUILTIN_FAMILIES:
        register_model(resolve(BUILTIN_FAMILIES[name]))
    if name not in _REGISTRY:
        raise UnknownNameError(f"unknown model family {name!r}; registered: {', '.join(model_names())}")
    return _REGISTRY[name]


def matching_flavor(spec: ModelSpec, args: Any) -> str | None:
    """The flavor whose args equal ``args`` in every field but ``spec.run_args`` (how a run computes:
    sequence length, attention kernel, ...), or None."""

    def model_fields(a: Any) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(a).items() if k not in spec.run_args}

    want = model_fields(args)
    return next((name for name, flavor in spec.flavors.items() if model_fields(flavor) == want), None)


_KINDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def check_arg_types(args_cls: type, values: Mapping[str, Any]) -> None:
    """ValueError unless each of ``values`` (field -> value, e.g. ``--model-arg`` ones) has the type its field of
    ``args_cls`` is annotated with (int, float, bool, str, or ``X | None``; other annotations are not checked)."""
    hints = typing.get_type_hints(args_cls)
    for key, v in values.items():
        tp, optional = hints.get(key), False
        if typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in typing.get_args(tp):
            rest = [a for a in typing.get_args(tp) if a is not type(None)]
            tp, optional = (rest[0] if len(rest) == 1 else None), True
        if tp not in _KINDS or v is None and optional:
            continue
        ok = isinstance(v, bool) if tp is bool else isinstance(v, tp if tp is not float else (int, float))
        if not ok or tp is not bool and isinstance(v, bool):
            raise ConfigError(f"model arg {key} = {v!r} must be {_KINDS[tp]}{' or null' * optional}")


def check_model_args(args: Any) -> Any:
    """``args`` after the checks every family needs whatever its ``validate()`` does: each field of its annotated
    type, each float finite (a NaN passes ``x <= 0`` tests) and each integer within ``MAX_ARG_INT``."""
    check_arg_types(type(args), {f.name: getattr(args, f.name) for f in dataclasses.fields(args)})
    for f in dataclasses.fields(args):
        v = getattr(args, f.name)
        if isinstance(v, float) and not math.isfinite(v):
            raise ConfigError(f"{type(args).__name__}.{f.name} = {v} must be a finite number")
        if isinstance(v, int) and not isinstance(v, bool) and abs(v) > MAX_ARG_INT:
            raise ConfigError(
                f"{type(args).__name__}.{f.name} = {v:,} is beyond any model's size (at most {MAX_ARG_INT:,})"
            )
    return args


def make_model_args(name: str, flavor: str, **overrides: Any) -> Any:
    """The flavor's args with ``overrides`` applied (each must be a field of the args class)."""
    spec = get_model_spec(name)
    if flavor not in spec.flavors:
        raise UnknownNameError(f"unknown flavor {flavor!r} for model {name!r}; available: {', '.join(spec.flavors)}")
    fields = {f.name for f in dataclasses.fields(spec.args_cls)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise UnknownNameError(f"unknown model args for {name!r}: {', '.join(unknown)}")
    return check_model_args(dataclasses.replace(spec.flavors[flavor], **overrides))


def model_args_for(section: Any, vocab_size: int) -> Any:
    """The family's args for a ``[model]`` section: its flavor, then its overrides; the vocabulary
    follows the tokenizer (``vocab_size``) unless ``model.vocab_size`` is set (not smaller)."""
    overrides = dict(section.overrides)
    if "vocab_size" not in overrides:
        overrides["vocab_size"] = vocab_size
    elif overrides["vocab_size"] < vocab_size:
        raise ConfigError(
            f"model.vocab_size={overrides['vocab_size']} is smaller than the tokenizer's vocabulary ({vocab_size})"
        )
    try:
        return make_model_args(section.name, section.flavor, **overrides)
    except ValueError as e:
        given = ", ".join(f"model.{k}={v}" for k, v in section.overrides.items())
        raise ConfigError(
            f"invalid [model] {section.name}/{section.flavor}{' with ' + given if given else ''}: {e}"
        ) from None


def check_seq_len(args: Any, seq_len: int) -> None:
    """Refuse ``training.seq_len`` above the model's ``max_seq_len`` (its rotary table) now, with the
    two keys named, instead of at the first forward pass."""
    max_len = args.max_seq_len
    if seq_len > max_len:
        raise ConfigError(
            f"training.seq_len={seq_len} is longer than the model's max_seq_len={max_len} (model.max_seq_len, "
            "the length of its rotary table): lower training.seq_len or raise model.max_seq_len"
        )


def state_shapes(spec: ModelSpec, args: Any) -> dict[str, tuple[int, ...]]:
    """``{state-dict key: shape}`` of ``spec``'s model with ``args``, built on the meta device (no memory)."""
    with torch.device("meta"):
        model = spec.model_cls(args)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def adopt_seed_args(
    args: Any,
    seed_args: Mapping[str, Any],
    explicit: Collection[str],
    *,
    run_args: Collection[str],
    same_shapes: Callable[[Any, Any], bool],
    seed: str,
    same_model: Callable[[Any, Any], bool] | None = None,
) -> tuple[Any, dict[str, Any]]:
    """The model args to train a seed checkpoint (``[checkpoint] initial_load_path``) with, and
    ``{field: value}`` of those taken from it (docs/checkpoints.md, "Checkpoints").

    Weights load by shape, but RoPE theta, norm eps ... change what they compute, silently; so every field
    ``seed_args`` records is taken but ``run_args`` and those set ``explicit``-ly. An explicit value unlike the
    seed's is an error unless ``same_model(config's, seed's)`` (an HF seed's ``multiple_of`` and
    ``ffn_dim_multiplier`` that give its ``intermediate_size``). ``seed`` names the checkpoint in messages.
    """
    fields = {f.name for f in dataclasses.fields(args)}
    if unknown := sorted(set(seed_args) - fields):
        raise ConfigError(f"{seed} has model args unknown to this titanlite: {', '.join(unknown)}")
    differ = {k: v for k, v in seed_args.items() if k not in run_args and getattr(args, k) != v}
    if conflicts := [k for k in differ if k in explicit]:
        try:
            seed_full = check_model_args(dataclasses.replace(args, **differ))
            kept = dataclasses.replace(seed_full, **{k: getattr(args, k) for k in conflicts})
        except (TypeError, ValueError) as e:
            raise ConfigError(f"{seed} has invalid model args ({one_line(e)})") from None
        if same_model is None or not same_model(kept, seed_full):
            _conflict_error(args, differ, conflicts[0], seed_full, same_shapes, seed)
        differ = {k: v for k, v in differ.items() if k not in explicit}  # the config's values mean the same
    if not differ:
        return args, {}
    try:
        adopted = check_model_args(dataclasses.replace(args, **differ))
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{seed} has invalid model args ({one_line(e)})") from None
    return adopted, differ


def _conflict_error(args: Any, differ: dict, key: str, seed_full: Any, same_shapes: Callable, seed: str) -> None:
    """The one-line error for the config's ``model.<key>``, which differs from the seed's: "drop it" when it sets no
    tensor shape (the seed's value is then taken), else the seed's values of every differing field that does."""
    what = (
        f"model.{key}={getattr(args, key)!r} is set in the config but the checkpoint {seed} has {key}={differ[key]!r}"
    )

    def sets_shape(k: str) -> bool:
        return not same_shapes(seed_full, dataclasses.replace(seed_full, **{k: getattr(args, k)}))

    shape_keys = [k for k in differ if sets_shape(k)]
    if key not in shape_keys:
        raise ConfigError(f"{what}: drop model.{key} to train with the checkpoint's value")
    values = ", ".join(f"model.{k}={_toml(differ[k])}" for k in shape_keys)
    raise ConfigError(f"{what}, which gives other tensor shapes: set {values} (the checkpoint's)")


def _toml(v: Any) -> str:
    return "none" if v is None else repr(v)


def build_model(name: str, flavor: str, device: str | torch.device = "meta", **overrides: Any) -> nn.Module:
    """Build a model of a registered family: on ``"meta"`` (the default) without memory (then ``to_empty`` and
    ``init_weights()``), on any other device allocated and initialized."""
    spec = get_model_spec(name)
    args = make_model_args(name, flavor, **overrides)
    with torch.device(device):
        model = spec.model_cls(args)
    if torch.device(device).type != "meta":
        model.init_weights()
    return model


def model_counts(spec: ModelSpec, args: Any, seq_len: int) -> tuple[int, int]:
    """``(parameters, training FLOPs per token at seq_len)`` of ``spec``'s model with ``args``: the family's own
    counts, else counted on a meta-built model (PaLM's formula; an embedding table only looked up is no matmul)."""
    if spec.num_params is not None and spec.flops_per_token is not None:
        return spec.num_params(args), spec.flops_per_token(args, seq_len)
    with torch.device("meta"):
        model = spec.model_cls(args)
    total = sum(p.numel() for p in model.parameters())
    owners = Counter(id(p) for module in model.modules() for p in module.parameters(recurse=False))
    lookup_only = sum(
        m.weight.numel() for m in model.modules() if isinstance(m, nn.Embedding) and owners[id(m.weight)] == 1
    )
    head_dim = getattr(args, "head_dim", None) or args.dim // args.n_heads
    flops = palm_flops_per_token(total - lookup_only, args.n_layers, args.n_heads, head_dim, seq_len)
    params = spec.num_params(args) if spec.num_params else total
    return params, (spec.flops_per_token(args, seq_len) if spec.flops_per_token else flops)


def active_params(spec: ModelSpec, args: Any, total: int) -> int:
    """Parameters used per token: the family's ``active_params``, else ``total`` (a dense model)."""
    return spec.active_params(args) if spec.active_params is not None else total


def model_schema(cfg: JobConfig) -> type:
    """The args dataclass of ``cfg.model.name`` (a :data:`titanlite.config.ModelSchema`), after importing
    ``cfg.job.extensions`` (they may register the family); ConfigError for an unknown family or flavor."""
    try:
        load_extensions(cfg.job.extensions)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return registered_schema(cfg)


def registered_schema(cfg: JobConfig) -> type:
    """:func:`model_schema` without importing anything: the family must already be registered (by core or by
    an extension the caller imported). For tools that read a config they did not write (the eval watcher
    reads a run's ``config.toml``): importing the modules a file names would run code on that file's word."""
    name, flavor, names = cfg.model.name, cfg.model.flavor, model_names()
    if name not in names:
        raise ConfigError(
            f"unknown model family '{name}' (model.name); registered: {', '.join(names)}{did_you_mean(name, names)}"
        )
    spec = get_model_spec(name)
    if flavor not in spec.flavors:
        raise ConfigError(
            f"unknown flavor '{flavor}' (model.flavor) for model '{name}'; available: {', '.join(spec.flavors)}"
            + did_you_mean(flavor, list(spec.flavors))
        )
    return spec.args_cls


def load_config(argv: Sequence[str] = (), **kwargs: Any) -> JobConfig:
    """:func:`titanlite.config.parse_config` with :func:`model_schema`: ``[job] extensions`` are imported,
    ``[model] name``/``flavor`` checked against the registry and the family's args fields accepted as
    ``[model]`` keys / ``--model.<field>`` options (``kwargs``: ``tables``, ``tables_source``)."""
    return titanlite.config.parse_config(argv, model_schema, **kwargs)

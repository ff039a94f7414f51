"""Strict config loader: TOML file, then ``--section.key value`` overrides.

Everything is derived from the dataclasses in :mod:`titanlite.config.sections` (field names, types
from ``typing.get_type_hints``, and the ``help``/``choices``/``min``/``max``/``gt`` metadata), so a
new section or key needs no change here.

- ``load_config(["--config", "run.toml", "--training.steps", "100"])`` returns a validated
  :class:`JobConfig`; any problem raises :class:`ConfigError` with a one-line message.
- Extra keys in ``[model]`` (or ``--model.<field>``) are fields of the model family's args
  dataclass; they are checked against ``get_model_spec(cfg.model.name).args_cls`` once the name is
  final and stored, converted, in ``cfg.model.overrides``.
- ``config_to_toml``/``dump_config`` write a complete TOML file that loads back to an equal config.
- ``parse_args_or_exit`` is the entry-point helper (``--help``, ``error: ...`` and exit code 2).
"""
from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import math
import os
import sys
import types
import typing
from typing import Any, Mapping, Sequence

try:  # Python >= 3.11
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

from titanlite.config.sections import JobConfig


# The section whose extra keys are model-args overrides, and the field that stores them.
_MODEL_SECTION = "model"
_OVERRIDES = "overrides"
_DATASETS = ("embedded", "shards", "text")
_DEFAULT_PROG = "python -m titanlite.train"

_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off")
_NONE = ("none", "null")


class ConfigError(ValueError):
    """A problem with the configuration (file or command line); the message is one line."""

    def __init__(self, msg: str) -> None:
        super().__init__(" ".join(str(msg).splitlines()))


class _Bad(Exception):
    """A value that does not fit a field; the argument says what is allowed."""


class _Bare:
    """Marker for a command-line flag given without a value (``--compile.enable``)."""

    def __repr__(self) -> str:
        return "<no value>"


_BARE = _Bare()


# --------------------------------------------------------------------------- schema


@dataclasses.dataclass(frozen=True)
class _Key:
    name: str
    type: Any
    meta: Mapping[str, Any]
    default: Any  # dataclasses.MISSING when the field has no plain default

    @property
    def help(self) -> str:
        return str(self.meta.get("help", ""))


@dataclasses.dataclass(frozen=True)
class _Section:
    attr: str  # attribute of JobConfig
    toml: str  # TOML table name, possibly dotted
    cls: type
    keys: dict[str, _Key]  # in declaration order

    @property
    def settable(self) -> dict[str, _Key]:
        """Keys that can be set directly (model.overrides is filled from the extra keys)."""
        if self.toml == _MODEL_SECTION:
            return {k: v for k, v in self.keys.items() if k != _OVERRIDES}
        return self.keys


@functools.lru_cache(maxsize=None)
def _class_keys(cls: type) -> dict[str, _Key]:
    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # unresolvable annotation: fall back to whatever the field holds
        hints = {}
    keys = {}
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        tp = hints.get(f.name, f.type)
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = dataclasses.MISSING
        keys[f.name] = _Key(f.name, tp, f.metadata, default)
    return keys


def _sections() -> dict[str, _Section]:
    """TOML section name -> section, in JobConfig order."""
    return _sections_of(JobConfig)


@functools.lru_cache(maxsize=None)
def _sections_of(root: type) -> dict[str, _Section]:
    hints = typing.get_type_hints(root)
    out: dict[str, _Section] = {}
    for f in dataclasses.fields(root):
        cls = hints[f.name]
        if not dataclasses.is_dataclass(cls):
            raise TypeError(f"JobConfig.{f.name} must be a section dataclass, got {cls!r}")
        toml_name = f.metadata.get("toml") or f.name
        if toml_name in out:
            raise TypeError(f"two JobConfig sections use the TOML name {toml_name!r}")
        out[toml_name] = _Section(f.name, toml_name, cls, _class_keys(cls))
    return out


def _is_section_prefix(name: str) -> bool:
    return any(s.startswith(name + ".") for s in _sections())


# --------------------------------------------------------------------------- types


def _split_optional(tp: Any) -> tuple[Any, bool]:
    """``X | None`` -> (X, True); anything else -> (tp, False)."""
    origin = typing.get_origin(tp)
    if origin is typing.Union or origin is types.UnionType:
        args = typing.get_args(tp)
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1 and len(args) == 2:
            return rest[0], True
    return tp, False


def _elem_type(tp: Any) -> Any:
    args = [a for a in typing.get_args(tp) if a is not Ellipsis]
    return args[0] if args else Any


def _type_name(tp: Any) -> str:
    inner, optional = _split_optional(tp)
    origin = typing.get_origin(inner)
    if inner in (str, int, float, bool):
        name = inner.__name__
    elif inner is dict or origin is dict:
        name = "table"
    elif inner in (list, tuple) or origin in (list, tuple):
        name = f"list[{_type_name(_elem_type(inner))}]"
    elif inner is Any:
        name = "any"
    else:
        name = getattr(inner, "__name__", None) or str(inner)
    return f"{name} | None" if optional else name


def _expected(tp: Any, cli: bool) -> str:
    inner, optional = _split_optional(tp)
    origin = typing.get_origin(inner)
    if inner is bool:
        text = "true or false"
    elif inner is int:
        text = "an integer"
    elif inner is float:
        text = "a number"
    elif inner is str:
        text = "a string"
    elif inner in (list, tuple) or origin in (list, tuple):
        elem = _expected(_elem_type(inner), cli)
        text = f"a list of {elem} values" + (" (comma-separated)" if cli else " (a TOML array)")
    elif inner is dict or origin is dict:
        text = "a TOML table"
    else:
        text = _type_name(inner)
    if optional and inner is not str:
        text += " or none"
    return text


def _convert(value: Any, tp: Any, cli: bool) -> Any:
    """Convert a command-line string (``cli``) or a TOML value to ``tp``; raise ``_Bad``."""
    inner, optional = _split_optional(tp)
    origin = typing.get_origin(inner)
    if value is _BARE:
        if inner is bool:
            return True
        raise _Bad(f"expected a value ({_expected(tp, cli)})")
    if optional and inner is not str and isinstance(value, str) and value.strip().lower() in _NONE:
        return None
    bad = _Bad(f"expected {_expected(tp, cli)}")
    if inner is Any or inner is object:
        return copy.deepcopy(value)
    if inner is bool:
        if cli:
            low = value.strip().lower()
            if low in _TRUE:
                return True
            if low in _FALSE:
                return False
            raise bad
        if isinstance(value, bool):
            return value
        raise bad
    if inner is int:
        if cli:
            try:
                return int(value)
            except ValueError:
                try:
                    value = float(value)
                except ValueError:
                    raise bad from None
        if isinstance(value, bool):
            raise bad
        if isinstance(value, int):
            return value
        if isinstance(value, float) and math.isfinite(value) and value.is_integer():
            return int(value)
        raise bad
    if inner is float:
        if cli:
            try:
                out = float(value)
            except ValueError:
                raise bad from None
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out = float(value)
        else:
            raise bad
        if math.isnan(out):
            raise bad
        return out
    if inner is str:
        if isinstance(value, str):
            return value
        raise bad
    if inner in (list, tuple) or origin in (list, tuple):
        if cli:
            items: list[Any] = [s.strip() for s in value.split(",")]
            items = [s for s in items if s]
        elif isinstance(value, list):
            items = value
        else:
            raise bad
        elem = _elem_type(inner)
        try:
            out_list = [_convert(v, elem, cli) for v in items]
        except _Bad:
            raise bad from None
        return tuple(out_list) if (inner is tuple or origin is tuple) else out_list
    if inner is dict or origin is dict:
        if cli:
            raise _Bad("a table cannot be set on the command line; use the config file")
        if isinstance(value, dict):
            return copy.deepcopy(value)
        raise bad
    raise _Bad(f"unsupported field type {_type_name(tp)}")


def _check(value: Any, meta: Mapping[str, Any]) -> str | None:
    """The ``choices``/``min``/``max``/``gt`` rule ``value`` breaks, or None."""
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        for v in value:
            reason = _check(v, meta)
            if reason:
                return f"{_fmt(v)}: {reason}"
        return None
    choices = meta.get("choices")
    if choices is not None and value not in choices:
        return "must be one of " + ", ".join(_fmt(c) for c in choices)
    lo, hi, gt = meta.get("min"), meta.get("max"), meta.get("gt")
    if lo is not None and hi is not None and not lo <= value <= hi:
        return f"must be in [{lo}, {hi}]"
    if lo is not None and value < lo:
        return f"must be >= {lo}"
    if hi is not None and value > hi:
        return f"must be <= {hi}"
    if gt is not None and not value > gt:
        return f"must be > {gt}"
    return None


def _rules(meta: Mapping[str, Any]) -> str:
    parts = []
    if meta.get("choices") is not None:
        parts.append("choices: " + ", ".join(str(c) for c in meta["choices"]))
    lo, hi = meta.get("min"), meta.get("max")
    if meta.get("gt") is not None:
        parts.append(f"> {meta['gt']}")
    if lo is not None and hi is not None:
        parts.append(f"in [{lo}, {hi}]")
    elif lo is not None:
        parts.append(f">= {lo}")
    elif hi is not None:
        parts.append(f"<= {hi}")
    return "; ".join(parts)


# --------------------------------------------------------------------------- messages


def _closest(word: str, candidates: Sequence[str]) -> str | None:
    match = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.6)
    return match[0] if match else None


def _all_dotted() -> list[str]:
    return [f"{s.toml}.{k}" for s in _sections().values() for k in s.settable]


def _suggest_key(section: str, key: str, section_keys: Sequence[str]) -> str:
    """'; did you mean ...?' for an unknown key of a known section."""
    hit = _closest(key, section_keys)
    if hit:
        return f"; did you mean '{section}.{hit}'?"
    by_key: dict[str, str] = {}
    for dotted in _all_dotted():
        by_key.setdefault(dotted.rpartition(".")[2], dotted)
    hit = _closest(key, list(by_key))
    if hit:
        return f"; did you mean '{by_key[hit]}'?"
    return f"; [{section}] accepts: " + ", ".join(section_keys)


def _suggest_section(name: str, key: str | None = None) -> str:
    if key is not None:
        hit = _closest(f"{name}.{key}", _all_dotted())
        if hit:
            return f"; did you mean '{hit}'?"
    hit = _closest(name, list(_sections()))
    if hit:
        return f"; did you mean '{hit}'?"
    return "; sections: " + ", ".join(_sections())


def _where_file(path: str) -> str:
    return f"in config file {path}"


_WHERE_CLI = "on the command line"


def _fmt(value: Any) -> str:
    """A value as it would appear in TOML (one line)."""
    if value is None:
        return "none"
    if isinstance(value, dict) and value:
        return "a table"
    try:
        return toml_value(value)
    except TypeError:
        return repr(value)


def _shown(value: Any, cli: bool) -> str:
    if value is _BARE:
        return "(no value)"
    return repr(value) if cli else _fmt(value)


def _set_value(obj: Any, section: str, key: _Key, raw: Any, cli: bool, where: str) -> None:
    value = _convert_checked(section, key, raw, cli, where)
    setattr(obj, key.name, value)


def _convert_checked(section: str, key: _Key, raw: Any, cli: bool, where: str) -> Any:
    dotted = f"{section}.{key.name}"
    try:
        value = _convert(raw, key.type, cli)
    except _Bad as e:
        raise ConfigError(f"invalid value {_shown(raw, cli)} for '{dotted}' {where}: {e}") from None
    reason = _check(value, key.meta)
    if reason:
        raise ConfigError(f"invalid value {_shown(raw, cli)} for '{dotted}' {where}: {reason}")
    return value


# --------------------------------------------------------------------------- loading


@dataclasses.dataclass
class _Extra:
    raw: Any
    cli: bool
    where: str


def split_cli_args(argv: Sequence[str], bare: Any = True) -> list[tuple[str, Any]]:
    """``--name value`` / ``--name=value`` / bare ``--name`` (value ``bare``) into ``(name, value)`` pairs.

    A token that does not start with ``--`` takes the place of a value, so ``--x.y -1`` works; a
    value that itself starts with ``--`` needs the ``=`` form. Shared by every TOML-config front end.
    """
    pairs: list[tuple[str, Any]] = []
    i = 0
    argv = list(argv)
    while i < len(argv):
        tok = argv[i]
        if not tok.startswith("--") or len(tok) == 2:
            raise ConfigError(f"unexpected argument {tok!r}; options look like --section.key value (see --help)")
        body = tok[2:]
        if "=" in body:
            pairs.append(tuple(body.split("=", 1)))
            i += 1
        elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            pairs.append((body, argv[i + 1]))
            i += 2
        else:
            pairs.append((body, bare))
            i += 1
    return pairs


def _parse_argv(argv: Sequence[str]) -> tuple[str | None, list[tuple[str, Any]]]:
    config_path: str | None = None
    overrides: list[tuple[str, Any]] = []
    for name, value in split_cli_args(argv, bare=_BARE):
        if name == "config":
            if value is _BARE or value == "":
                raise ConfigError("--config needs a file path")
            if config_path is not None:
                raise ConfigError(f"--config given twice ({config_path!r} and {value!r})")
            config_path = value
            continue
        overrides.append((name, value))
    return config_path, overrides


def read_toml(path: str) -> dict[str, Any]:
    """A TOML file as a dict; ConfigError naming the file when it is missing or malformed."""
    if not os.path.exists(path):
        raise ConfigError(f"config file {path} not found")
    if not os.path.isfile(path):
        raise ConfigError(f"config file {path} is not a file")
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"malformed TOML in config file {path}: {e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {path} is not valid UTF-8: {e}") from None
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror or e}") from None


def _apply_table(cfg: JobConfig, table: Mapping[str, Any], prefix: str, path: str, extras: dict[str, _Extra]) -> None:
    """Apply a TOML table whose dotted name is ``prefix`` ("" = the document)."""
    where = _where_file(path)
    sections = _sections()
    for k, v in table.items():
        name = f"{prefix}.{k}" if prefix else k
        if name in sections:
            if not isinstance(v, dict):
                raise ConfigError(f"'{name}' {where} must be a table ([{name}]), got {_fmt(v)}")
            _apply_section(cfg, sections[name], v, path, extras)
        elif isinstance(v, dict) and _is_section_prefix(name):
            _apply_table(cfg, v, name, path, extras)
        elif isinstance(v, dict) or not prefix:
            kind = "section" if isinstance(v, dict) else "top-level key"
            raise ConfigError(f"unknown {kind} '{name}' {where}{_suggest_section(name)}")
        else:  # a scalar inside a table that only groups sections, e.g. [quantize] foo = 1
            raise ConfigError(f"unknown key '{name}' {where}{_suggest_section(name)}")


def _apply_section(cfg: JobConfig, sec: _Section, table: Mapping[str, Any], path: str, extras: dict[str, _Extra]) -> None:
    where = _where_file(path)
    obj = getattr(cfg, sec.attr)
    settable = sec.settable
    for k, v in table.items():
        name = f"{sec.toml}.{k}"
        if k in settable:
            _set_value(obj, sec.toml, settable[k], v, False, where)
        elif isinstance(v, dict) and (name in _sections() or _is_section_prefix(name)):
            _apply_table(cfg, {k: v}, sec.toml, path, extras)
        elif sec.toml == _MODEL_SECTION and k == _OVERRIDES:
            raise ConfigError(_overrides_msg(where))
        elif sec.toml == _MODEL_SECTION:
            extras.pop(k, None)
            extras[k] = _Extra(v, False, where)
        else:
            raise ConfigError(f"unknown key '{name}' {where}{_suggest_key(sec.toml, k, list(settable))}")


def _overrides_msg(where: str) -> str:
    return (f"'model.overrides' cannot be set directly {where}; write model-args fields as [model] keys "
            "(e.g. n_layers = 4) or --model.<field> options")


def _apply_cli(cfg: JobConfig, name: str, raw: Any, extras: dict[str, _Extra]) -> None:
    where = _WHERE_CLI
    section, _, key = name.rpartition(".")
    if not section or not key:
        hint = ""
        matches = [d for d in _all_dotted() if d.rpartition(".")[2] == name]
        if matches:
            hint = f"; did you mean '--{matches[0]}'?"
        raise ConfigError(f"unknown option '--{name}'; options look like --section.key value{hint}")
    sec = _sections().get(section)
    if sec is None:
        raise ConfigError(f"unknown section '{section}' {where} (--{name}){_suggest_section(section, key)}")
    settable = sec.settable
    if key in settable:
        _set_value(getattr(cfg, sec.attr), sec.toml, settable[key], raw, True, where)
    elif sec.toml == _MODEL_SECTION and key == _OVERRIDES:
        raise ConfigError(_overrides_msg(where))
    elif sec.toml == _MODEL_SECTION:
        extras.pop(key, None)
        extras[key] = _Extra(raw, True, where)
    else:
        raise ConfigError(f"unknown key '{name}' {where}{_suggest_key(sec.toml, key, list(settable))}")


def _import_extensions(cfg: JobConfig) -> None:
    from titanlite.extensions import load_extensions

    try:
        load_extensions(cfg.job.extensions)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _resolve_model(cfg: JobConfig, extras: Mapping[str, _Extra]) -> None:
    """Check model.name/flavor against the registry and convert the model-args overrides."""
    from titanlite.models import get_model_spec, model_names

    name = cfg.model.name
    try:
        spec = get_model_spec(name)
    except KeyError:
        names = model_names()
        hit = _closest(name, names)
        hint = f"; did you mean '{hit}'?" if hit else ""
        raise ConfigError(f"unknown model family '{name}' (model.name); registered: {', '.join(names)}{hint}") from None
    flavor = cfg.model.flavor
    if flavor not in spec.flavors:
        hit = _closest(flavor, list(spec.flavors))
        hint = f"; did you mean '{hit}'?" if hit else ""
        raise ConfigError(f"unknown flavor '{flavor}' (model.flavor) for model '{name}'; "
                          f"available: {', '.join(spec.flavors)}{hint}")
    if not extras:
        return
    arg_keys = _class_keys(spec.args_cls)
    overrides = dict(cfg.model.overrides)
    for key, extra in extras.items():
        k = arg_keys.get(key)
        if k is None:
            candidates = list(_sections()[_MODEL_SECTION].settable) + list(arg_keys)
            hit = _closest(key, candidates)
            hint = f"; did you mean 'model.{hit}'?" if hit else f"; {name} args fields: {', '.join(arg_keys)}"
            raise ConfigError(f"unknown key 'model.{key}' {extra.where} (neither a [model] key nor a field of "
                              f"{spec.args_cls.__name__}){hint}")
        overrides[key] = _convert_checked(_MODEL_SECTION, k, extra.raw, extra.cli, extra.where)
    cfg.model.overrides = overrides


def load_config(argv: Sequence[str]) -> JobConfig:
    """Build the config from ``--config FILE`` (optional) and ``--section.key value`` overrides.

    The file is applied first, then the overrides in order; the result is validated. Raises
    :class:`ConfigError` (one-line message) on any problem.
    """
    if isinstance(argv, str):
        raise TypeError("load_config expects a list of arguments, not a string")
    config_path, cli = _parse_argv(argv)
    cfg = JobConfig()
    extras: dict[str, _Extra] = {}
    if config_path is not None:
        _apply_table(cfg, read_toml(config_path), "", config_path, extras)
    for name, raw in cli:
        _apply_cli(cfg, name, raw, extras)
    _import_extensions(cfg)  # they may register the model family that [model] names
    _resolve_model(cfg, extras)
    validate(cfg)
    return cfg


def validate(cfg: JobConfig) -> None:
    """Check every field's rules and the cross-field constraints; raise :class:`ConfigError`."""
    for sec in _sections().values():
        obj = getattr(cfg, sec.attr)
        for key in sec.keys.values():
            value = getattr(obj, key.name)
            reason = _check(value, key.meta)
            if reason:
                raise ConfigError(f"invalid value {_fmt(value)} for '{sec.toml}.{key.name}': {reason}")

    t, sched, val = cfg.training, cfg.lr_scheduler, cfg.validation
    if sched.warmup_steps > t.steps:
        raise ConfigError(f"lr_scheduler.warmup_steps ({sched.warmup_steps}) must be <= training.steps ({t.steps})")
    if sched.decay_ratio != -1 and not 0.0 <= sched.decay_ratio <= 1.0:
        raise ConfigError(f"invalid value {sched.decay_ratio} for 'lr_scheduler.decay_ratio': "
                          "must be -1 (decay over all steps after warmup) or in [0, 1]")
    gbs, lbs = t.global_batch_size, t.local_batch_size
    if gbs != -1 and (gbs <= 0 or gbs % lbs != 0):
        raise ConfigError(f"invalid value {gbs} for 'training.global_batch_size': must be -1 or a positive "
                          f"multiple of training.local_batch_size ({lbs})")
    tokens = lbs * t.seq_len
    if cfg.quantize_linear_float8.enable and tokens % 16:
        raise ConfigError(f"quantize.linear.float8.enable needs training.local_batch_size x training.seq_len "
                          f"({lbs} x {t.seq_len} = {tokens} tokens per micro-batch) to be a multiple of 16: "
                          "float8 matmuls (torch._scaled_mm) need every matrix dimension divisible by 16")
    if val.steps != -1 and val.steps < 1:
        raise ConfigError(f"invalid value {val.steps} for 'validation.steps': must be -1 (whole split) or >= 1")
    for section, obj in (("training", t), ("validation", val)):
        if obj.dataset not in _DATASETS:
            raise ConfigError(f"invalid value {_fmt(obj.dataset)} for '{section}.dataset': "
                              f"must be one of {', '.join(_DATASETS)}")
        if obj.dataset in ("shards", "text") and not obj.dataset_path:
            raise ConfigError(f"'{section}.dataset_path' must be set when {section}.dataset = \"{obj.dataset}\"")


# --------------------------------------------------------------------------- writing


_TOML_ESCAPES = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\t": "\\t", "\r": "\\r", "\b": "\\b", "\f": "\\f"}


def _toml_escape(ch: str) -> str:
    if ch in _TOML_ESCAPES:
        return _TOML_ESCAPES[ch]
    return f"\\u{ord(ch):04x}" if ord(ch) < 0x20 or ord(ch) == 0x7F else ch


def _toml_string(s: str) -> str:
    return '"' + "".join(_toml_escape(ch) for ch in s) + '"'


def _toml_key(k: str) -> str:
    if k and all(c.isascii() and (c.isalnum() or c in "_-") for c in k):
        return k
    return _toml_string(k)


def toml_value(v: Any) -> str:
    """``v`` (bool, int, float, str, list, dict) as a TOML value; TypeError for anything else."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return repr(v)
    if isinstance(v, str):
        return _toml_string(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        items = [f"{_toml_key(str(k))} = {toml_value(x)}" for k, x in v.items() if x is not None]
        return "{" + ", ".join(items) + "}" if items else "{}"
    raise TypeError(f"cannot write {type(v).__name__} value {v!r} as TOML")


def config_to_dict(cfg: JobConfig) -> dict[str, dict[str, Any]]:
    """``{toml section name: {key: value}}`` with every key; model overrides are flattened into
    ``"model"`` as in the TOML file. Dotted section names (``"quantize.linear.float8"``) are kept
    as single keys. Values are copies."""
    out: dict[str, dict[str, Any]] = {}
    for sec in _sections().values():
        obj = getattr(cfg, sec.attr)
        d = {}
        for k in sec.keys:
            v = getattr(obj, k)
            if sec.toml == _MODEL_SECTION and k == _OVERRIDES:
                d.update(copy.deepcopy(v))
            else:
                d[k] = copy.deepcopy(v)
        out[sec.toml] = d
    return out


def config_to_toml(cfg: JobConfig) -> str:
    """The whole config as TOML (every section and key, defaults included).

    TOML has no null: a ``None`` field whose default is None is left out (and comes back as None);
    a ``None`` model override, or a ``None`` in a field with another default, is written as
    ``"none"``, which ``X | None`` fields read as None.
    """
    lines = ["# titanlite job config; load with --config <this file>."]
    for sec in _sections().values():
        obj = getattr(cfg, sec.attr)
        lines.append("")
        lines.append(f"[{sec.toml}]")
        for k, key in sec.keys.items():
            v = getattr(obj, k)
            if sec.toml == _MODEL_SECTION and k == _OVERRIDES:
                for ok, ov in v.items():
                    lines.append(f"{_toml_key(ok)} = {toml_value('none' if ov is None else ov)}")
                continue
            if v is None:
                if key.default is not None:
                    lines.append(f"{k} = \"none\"")
                continue
            lines.append(f"{k} = {toml_value(v)}")
    return "\n".join(lines) + "\n"


def dump_config(cfg: JobConfig, path: str | os.PathLike[str]) -> None:
    """Write :func:`config_to_toml` to ``path`` (parent folders are created)."""
    parent = os.path.dirname(os.fspath(path))
    if parent:
        os.makedirs(parent, exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(config_to_toml(cfg))


# --------------------------------------------------------------------------- help


def _default_text(key: _Key) -> str:
    if key.default is dataclasses.MISSING:
        return "required"
    return _fmt(key.default)


def _key_line(dotted: str, key: _Key, indent: str = "  ") -> str:
    line = f"{indent}--{dotted}  ({_type_name(key.type)}, default {_default_text(key)})"
    if key.help:
        line += f"  {key.help}"
    rules = _rules(key.meta)
    if rules:
        line += f"  [{rules}]"
    return line


def _model_args_help(family: str) -> list[str]:
    try:
        from titanlite.models import get_model_spec

        spec = get_model_spec(family)
        keys = _class_keys(spec.args_cls)
    except Exception as e:  # the family cannot be imported: say so, help still works
        return [f"  ({family} args fields unavailable: {type(e).__name__}: {' '.join(str(e).splitlines())})"]
    flavors = ", ".join(spec.flavors)
    lines = [f"  {family} args fields (args-class defaults; the flavor sets its own values; flavors: {flavors}):"]
    lines += [_key_line(f"model.{k}", key, indent="    ") for k, key in keys.items()]
    return lines


def format_help(prog: str = _DEFAULT_PROG) -> str:
    """Usage, then every section and key with type, default, help and allowed values."""
    lines = [
        f"usage: {prog} [-h] [--config FILE] [--section.key VALUE | --section.key=VALUE ...]",
        "",
        "Loads the TOML file given with --config, then applies the --section.key overrides in order.",
        "Booleans: --key, --key true|false or --key=false. Lists: comma-separated (a,b,c).",
        "Integers accept 1_000 and 1e6; X | None fields accept none. Unknown keys are errors.",
    ]
    for sec in _sections().values():
        lines.append("")
        lines.append(f"[{sec.toml}]")
        for k, key in sec.settable.items():
            lines.append(_key_line(f"{sec.toml}.{k}", key))
        if sec.toml == _MODEL_SECTION:
            lines.append("  Any field of the model family's args dataclass is also accepted, as a [model] key or")
            lines.append("  --model.<field>; it overrides the flavor (stored in model.overrides).")
            family = sec.keys["name"].default if "name" in sec.keys else "llama3"
            lines += _model_args_help(str(family))
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- entry points


def parse_args_or_exit(argv: Sequence[str] | None = None, prog: str = _DEFAULT_PROG) -> JobConfig:
    """``load_config`` for entry points: ``-h``/``--help`` prints the help and exits 0; a
    :class:`ConfigError` prints ``error: <message>`` on stderr and exits 2 (no traceback)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if "-h" in args or "--help" in args:
        sys.stdout.write(format_help(prog))
        sys.stdout.flush()
        raise SystemExit(0)
    try:
        return load_config(args)
    except ConfigError as e:
        exit_with_error(e)


def exit_with_error(error: object, code: int = 2, every_rank: bool = False) -> typing.NoReturn:
    """Print ``error: <one line>`` on stderr and exit with ``code`` (no traceback).

    Under torchrun every process parses the same command line, so by default only local rank 0 of
    each node prints (one line per node instead of one per GPU). ``every_rank=True`` is for
    failures that may differ between ranks (building the model, reading a rank's data): each rank
    prints, prefixed with its rank when there are several.
    """
    if isinstance(error, KeyError) and error.args:
        error = error.args[0]
    msg = " ".join(str(error).split())
    rank, world = os.environ.get("RANK"), int(os.environ.get("WORLD_SIZE", "1") or 1)
    if every_rank:
        print(f"error: {f'rank {rank}: ' if rank is not None and world > 1 else ''}{msg}", file=sys.stderr)
    elif os.environ.get("LOCAL_RANK", "0") == "0":
        print(f"error: {msg}", file=sys.stderr)
    raise SystemExit(code)

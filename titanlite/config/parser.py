"""Strict config loader: TOML tables and file, then ``--section.key value`` options (argparse); keys, types and
checks come from the dataclasses of :mod:`titanlite.config.sections`, model-args fields from ``model_schema``."""

from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import dataclasses
import decimal
import difflib
import functools
import math
import os
import re
import sys
import time
import types
import typing
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NoReturn

try:  # Python >= 3.11
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

from titanlite.config.sections import ConfigError, JobConfig
from titanlite.config.shipped import list_configs, resolve_config
from titanlite.config.toml_io import read_toml, toml_key, toml_value
from titanlite.errors import one_line
from titanlite.utils.nesting import loads_toml

ModelSchema = Callable[[JobConfig], type]  # cfg -> the args dataclass of cfg.model.name, or ConfigError

_MODEL, _OVERRIDES = "model", "overrides"  # the section whose extra keys are model args, and where they go
_DEFAULT_PROG = "python -m titanlite.train"
_CLI = "on the command line"
_BOOLS = {"true": True, "yes": True, "on": True, "1": True, "false": False, "no": False, "off": False, "0": False}
_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string", dict: "a TOML table"}
_BARE = object()  # the value of an option given without one (--compile.enable)
_Key = collections.namedtuple("_Key", "type meta default")  # default: dataclasses.MISSING if none


@functools.cache
def _keys(cls: type) -> dict[str, _Key]:
    """The init fields of dataclass ``cls``, in order, with resolved types and defaults."""
    hints = typing.get_type_hints(cls)
    fields = [f for f in dataclasses.fields(cls) if f.init]
    defaults = [f.default if f.default_factory is dataclasses.MISSING else f.default_factory() for f in fields]
    return {f.name: _Key(hints[f.name], f.metadata, d) for f, d in zip(fields, defaults)}


@functools.cache
def _sections(root: type) -> dict[str, tuple[str, dict[str, _Key]]]:
    """TOML section name -> (``root`` attribute, settable keys), in order; ``root`` is JobConfig (or a test's)."""
    out, hints = {}, typing.get_type_hints(root)
    for f in dataclasses.fields(root):
        toml = f.metadata.get("toml") or f.name
        out[toml] = (f.name, {k: v for k, v in _keys(hints[f.name]).items() if (toml, k) != (_MODEL, _OVERRIDES)})
    return out


def _optional(tp: Any) -> tuple[Any, bool]:
    """``X | None`` -> (X, True); anything else -> (tp, False)."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and len(args) == 2 and type(None) in args:
        return next(a for a in args if a is not type(None)), True
    return tp, False


def _type_name(tp: Any) -> str:
    inner, optional = _optional(tp)
    origin = typing.get_origin(inner) or inner
    name = "table" if origin is dict else getattr(inner, "__name__", str(inner))
    if origin in (list, tuple):
        name = f"list[{_type_name((typing.get_args(inner) or (Any,))[0])}]"
    return name + " | None" * optional


def _convert(value: Any, tp: Any, cli: bool) -> Any:
    """A command-line string (``cli``) or a TOML value as type ``tp``; ConfigError saying what was expected."""
    inner, optional = _optional(tp)
    origin = typing.get_origin(inner) or inner
    what = (_NAMES.get(inner) or _type_name(inner)) + " or none" * (optional and inner is not str)
    if value is _BARE and inner is not bool:
        raise ConfigError(f"expected a value ({what}; one that starts with '-' needs --key=VALUE)")
    if optional and (value is None or inner is not str and str(value).strip().lower() in ("none", "null")):
        return None
    item = typing.get_origin(_item_type(inner)) or _item_type(inner)
    tables = origin is dict or origin in (list, tuple) and item is dict
    if cli and tables:  # a table, or a list of tables, is written as a TOML literal: [{path = "a", weight = 1.0}]
        value = _toml_literal(value, what)
        cli = False
    bad = ConfigError(f"expected {what}" + " (comma-separated)" * (cli and origin in (list, tuple)))
    if origin in (list, tuple):
        items = [s.strip() for s in value.split(",") if s.strip()] if cli else value
        if not isinstance(items, list):
            raise bad
        out = [_convert(v, (typing.get_args(inner) or (Any,))[0], cli) for v in items]
        return tuple(out) if origin is tuple else out
    if cli and inner is bool:
        value = True if value is _BARE else _BOOLS.get(value.strip().lower(), value)
    if cli and inner in (int, float):
        value = _number(value, inner)
    if inner in (Any, object) or (origin is dict or inner in (bool, str)) and isinstance(value, origin):
        return copy.deepcopy(value)
    if inner in (int, float) and isinstance(value, (int, float)) and not isinstance(value, bool):
        if inner is float:
            try:
                number = float(value)
            except OverflowError:  # an integer beyond any float
                number = math.inf
            if not math.isfinite(number):
                raise ConfigError("expected a finite number (not inf or nan)")
            return number
        if isinstance(value, int):
            return value
        if math.isfinite(value) and value.is_integer():
            if abs(value) > 2**53:  # a float this large is not the integer that was written (1e30 -> ...19884624838656)
                raise ConfigError(f"expected an integer: {value:g} as a float is not exact, write its digits")
            return int(value)
    raise bad


def _number(text: str, kind: type) -> Any:
    """A command-line number: ``1_000`` and, for an int field, ``1e6`` or ``1e30`` as the exact integer;
    the text itself when it is none (the caller says what was expected)."""
    t = text.strip().replace("_", "")
    if t.lstrip("+-").isdigit():
        return int(t)
    with contextlib.suppress(ValueError, ArithmeticError):
        exact = decimal.Decimal(t)
        if kind is int and exact.is_finite() and exact == exact.to_integral_value() and abs(exact) < 10**400:
            return int(exact)
    with contextlib.suppress(ValueError):
        return float(t)
    return text


def _item_type(tp: Any) -> Any:
    """The item type of a ``list[X]`` or ``tuple[X, ...]`` annotation."""
    return (typing.get_args(tp) or (Any,))[0]


def _toml_literal(value: str, what: str) -> Any:
    """A command-line value that is a TOML inline table or array (``{a = 1}``, ``[{a = 1}]``)."""
    try:
        return loads_toml(f"v = {value}")["v"]
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"expected {what} written as a TOML literal ({e})") from None


def _rules(meta: Mapping[str, Any]) -> list[tuple[Callable[[Any], bool], str]]:
    """(test, description) of each check in a field's metadata."""
    choices, lo, hi, gt = (meta.get(k) for k in ("choices", "min", "max", "gt"))
    rules = [(lambda v: v in choices, "one of " + ", ".join(map(str, choices)))] if choices is not None else []
    if lo is not None and hi is not None:
        rules.append((lambda v: lo <= v <= hi, f"in [{lo}, {hi}]"))
    elif lo is not None or hi is not None:
        rules.append((lambda v: v >= lo, f">= {lo}") if hi is None else (lambda v: v <= hi, f"<= {hi}"))
    return rules + ([(lambda v: v > gt, f"> {gt}")] if gt is not None else [])


def _check(value: Any, meta: Mapping[str, Any]) -> str | None:
    """What ``value`` (or an item of it) breaks of the field's checks, or None."""
    if isinstance(value, (list, tuple)):
        return next((f"{_fmt(v)}: {reason}" for v in value if (reason := _check(v, meta))), None)
    return next((f"must be {text}" for test, text in _rules(meta) if value is not None and not test(value)), None)


def _fmt(value: Any) -> str:
    """A value as it would appear in TOML (one line)."""
    try:
        return "none" if value is None else "a table" if isinstance(value, dict) and value else toml_value(value)
    except TypeError:
        return repr(value)


def _converted(key: _Key, dotted: str, raw: Any, cli: bool, where: str) -> Any:
    """``raw`` converted and checked for ``key``; ConfigError naming the key, the value and ``where``."""
    try:
        value = _convert(raw, key.type, cli)
        if key.meta.get("path") and isinstance(value, str):
            value = os.path.expanduser(value)  # "~/runs/x" in TOML (or --key=~/x) would be a folder named "~"
        reason = _check(value, key.meta)
    except ConfigError as e:
        reason = str(e)
    if reason:
        shown = "(no value)" if raw is _BARE else repr(raw) if cli else _fmt(raw)
        raise ConfigError(f"invalid value {shown} for '{dotted}' {where}: {reason}")
    return value


def _closest(word: str, candidates: Sequence[str]) -> str | None:
    return next(iter(difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.6)), None)


def did_you_mean(word: str, candidates: Sequence[str]) -> str:
    """``"; did you mean 'x'?"`` naming the closest of ``candidates``, or ``""``; for one-line errors."""
    hit = _closest(word, candidates)
    return f"; did you mean '{hit}'?" if hit else ""


def _unknown(name: str, where: str, args_cls: type | None = None, table: bool = False) -> ConfigError:
    """The error for an unknown dotted ``name`` (a TOML table when ``table``; on the command line the token no
    option took), with the closest valid name."""
    sections = _sections(JobConfig)
    if where == _CLI:
        if not name.startswith("--") or name == "--":
            return ConfigError(f"unexpected argument {name!r}; options look like --section.key value (see --help)")
        if "." not in (name := name[2:].partition("=")[0]):
            hit = next((f"; did you mean '--{s}.{name}'?" for s, (_, ks) in sections.items() if name in ks), "")
            return ConfigError(f"unknown option '--{name}'; options look like --section.key value{hit}")
    section, _, key = name.rpartition(".")
    if section == _MODEL and key == _OVERRIDES and not table:
        return ConfigError(f"'{name}' cannot be set directly {where}; write model-args fields as [model] keys")
    if section in sections and not table:  # same section first, then the same key name in another section
        keys = [*sections[section][1], *(_keys(args_cls) if args_cls and section == _MODEL else ())]
        by_key = {k: f"{s}.{k}" for s in reversed(sections) for k in sections[s][1]}
        hit = f"{section}.{hit}" if (hit := _closest(key, keys)) else by_key.get(_closest(key, by_key) or "")
        hint = f"did you mean '{hit}'?" if hit else f"[{section}] accepts: " + ", ".join(keys)
        if section == _MODEL and args_cls:
            where += f" (neither a [model] key nor a field of {args_cls.__name__})"
        elif section == _MODEL:
            where += " (not a [model] key; model-args fields need titanlite.models.load_config or a model_schema)"
        return ConfigError(f"unknown key '{name}' {where}; {hint}")
    dotted = [f"{s}.{k}" for s, (_, keys) in sections.items() for k in keys]
    hit = next(filter(None, (_closest(name, c) for c in ([*sections], dotted)[:: 1 if table else -1])), None)
    hint = f"did you mean '{hit}'?" if hit else "sections: " + ", ".join(sections)
    grouping = any(s.startswith(section + ".") for s in sections)  # [quantize] of [quantize.linear.float8]
    kind = "section" if table else "top-level key" if not section else "key" if grouping else "section"
    shown = f"'{name}'" if table or not section or grouping else f"'{section}' ({name})"
    return ConfigError(f"unknown {kind} {shown} {where}; {hint}")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # instead of printing the usage and exiting
        raise ConfigError(f"{message} ({_CLI})")


class _Store(argparse.Action):  # --section.key [VALUE]: converts and checks the value as it is parsed
    def __init__(self, option_strings: list[str], dest: str, key: _Key, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs="?", const=_BARE, default=argparse.SUPPRESS, **kwargs)
        self.key = key

    def __call__(self, parser: Any, namespace: Any, value: Any, option_string: Any = None) -> None:
        setattr(namespace, self.dest, _converted(self.key, self.dest, value, True, _CLI))


def _parser(fields: Mapping[str, _Key], prog: str | None = None, help: tuple[str, str] | None = None) -> _Parser:
    """Options in one group per section (model-args ``fields`` after [model]); ``help``: (note, title) for -h."""
    p = _Parser(
        prog=prog,
        add_help=help is not None,
        allow_abbrev=False,
        formatter_class=functools.partial(argparse.HelpFormatter, max_help_position=40),
        usage="%(prog)s [-h] [--config FILE] [--section.key VALUE | --section.key=VALUE ...]",
        description="Loads the TOML file given with --config, then applies the --section.key options in order. "
        "Booleans: --key, --key true|false or --key=false. Lists: comma-separated (a,b,c). Integers accept 1_000 "
        "and 1e6; X | None fields accept none. A value starting with '-' (other than a number) needs the = form.",
    )
    p._negative_number_matcher = re.compile(r"^-\.?\d")  # -1e6 is a value, not an option (as in Python >= 3.13)
    p.add_argument(
        "--config",
        action="append",
        nargs="?",
        const="",
        default=[],
        metavar="FILE",
        help="TOML file, or the name of a shipped recipe (debug_model, llama1b, ...) when no such file exists",
    )
    p.add_argument("--list-configs", action="store_true", help="list the shipped recipes and exit")
    for toml, (_, keys) in _sections(JobConfig).items():
        group = p.add_argument_group(f"[{toml}]", help[0] if help and toml == _MODEL else None)
        options = [(group, f"{toml}.{k}", key) for k, key in keys.items()]
        if toml == _MODEL and fields:
            family = p.add_argument_group(help[1]) if help else group
            options += [(family, f"model.{k}", key) for k, key in fields.items() if k not in keys]
        for g, dotted, key in options:
            default = "required" if key.default is dataclasses.MISSING else _fmt(key.default)
            text = "; ".join([f"{key.meta.get('help', '')} (default {default}", *(t for _, t in _rules(key.meta))])
            text = (text + ")").replace("%", "%%")
            g.add_argument(f"--{dotted}", action=_Store, key=key, metavar=_type_name(key.type), help=text)
    return p


def _flatten(table: Mapping[str, Any], prefix: str, where: str) -> Iterator[tuple[str, str, Any]]:
    """(section, key, value) for each key of a TOML document; ConfigError for a table that is no section."""
    sections = _sections(JobConfig)
    for k, v in table.items():
        name = f"{prefix}.{k}" if prefix else k
        if isinstance(v, dict) and any(s == name or s.startswith(name + ".") for s in sections):
            yield from _flatten(v, name, where)
        elif name in sections:
            raise ConfigError(f"'{name}' {where} must be a table ([{name}]), got {_fmt(v)}")
        elif prefix in sections:
            yield prefix, k, v
        else:
            raise _unknown(name, where, table=isinstance(v, dict))


def _load(argv: list[str], docs: list[tuple[Any, str]], args_cls: type | None, strict: bool) -> JobConfig:
    """``docs`` ((TOML document, where), in order), then ``--config``'s file, then ``argv`` applied to a fresh
    config; the fields of ``args_cls`` are [model] keys. Unless ``strict``, unknown [model] keys are skipped."""
    sections = _sections(JobConfig)
    fields = {k: v for k, v in (_keys(args_cls) if args_cls else {}).items() if k not in sections[_MODEL][1]}
    ns, unknown = _parser(fields).parse_known_args(argv)
    if bad := [t for t in unknown if strict or t.startswith("--") and not re.match(r"--model\.[^.=]+(=|$)", t)]:
        raise _unknown(bad[0], _CLI, args_cls)
    paths, cfg, overrides = vars(ns).pop("config"), JobConfig(), {}
    vars(ns).pop("list_configs")  # answered by parse_args_or_exit
    if "" in paths or len(paths) > 1:
        raise ConfigError("--config needs a file path" if "" in paths else f"--config given twice {paths[:2]}")
    paths = [resolve_config(p) for p in paths]
    for doc, where in docs + [(read_toml(p), f"in config file {p}") for p in paths]:
        for section, k, v in _flatten(doc, "", where):
            attr, keys = sections[section]
            if k in keys:
                setattr(getattr(cfg, attr), k, _converted(keys[k], f"{section}.{k}", v, False, where))
            elif section == _MODEL and k in fields:
                overrides[k] = _converted(fields[k], f"model.{k}", v, False, where)
            elif strict or section != _MODEL or k == _OVERRIDES:
                raise _unknown(f"{section}.{k}", where, args_cls)
    for dotted, value in vars(ns).items():
        section, _, k = dotted.rpartition(".")
        if section == _MODEL and k in fields:
            overrides[k] = value
        else:
            setattr(getattr(cfg, sections[section][0]), k, value)
    cfg.model.overrides = overrides
    return cfg


def parse_config(
    argv: Sequence[str] = (),
    model_schema: ModelSchema | None = None,
    *,
    tables: Mapping[str, Any] | None = None,
    tables_source: str = "the given tables",
) -> JobConfig:
    """The validated config from ``tables`` (shaped like a parsed TOML file), ``--config FILE``, then the options;
    the extra ``[model]`` keys are fields of the args dataclass that ``model_schema(cfg)`` returns once all of them
    are applied (the whole is then loaded again, strictly); without it they are errors. ConfigError (one line)."""
    if isinstance(argv, str):
        raise TypeError("parse_config expects a list of arguments, not a string")
    docs = [(tables, f"in {tables_source}")] if tables is not None else []
    cfg = _load(list(argv), docs, None, strict=model_schema is None)
    if model_schema is not None:
        cfg = _load(list(argv), docs, model_schema(cfg), strict=True)
    validate(cfg)
    return cfg


def validate(cfg: JobConfig) -> None:
    """Every field's ``choices``/``min``/``max``/``gt`` checks, then ``cfg.validate()``; ConfigError."""
    for toml, (attr, keys) in _sections(JobConfig).items():
        for k, key in keys.items():
            if reason := _check(value := getattr(getattr(cfg, attr), k), key.meta):
                raise ConfigError(f"invalid value {_fmt(value)} for '{toml}.{k}': {reason}")
    cfg.validate()


def config_to_dict(cfg: JobConfig) -> dict[str, dict[str, Any]]:
    """``{TOML section name: {key: value}}``, copies, model overrides flattened into ``"model"`` as in a file."""
    out = {}
    for toml, (attr, keys) in _sections(JobConfig).items():
        obj = getattr(cfg, attr)
        out[toml] = copy.deepcopy({k: getattr(obj, k) for k in keys} | (obj.overrides if toml == _MODEL else {}))
    return out


def config_to_toml(cfg: JobConfig) -> str:
    """Every key as TOML. A None that is the default is left out, any other is written "none" (read as None)."""
    lines = ["# titanlite job config; load with --config <this file>."]
    for toml, (attr, keys) in _sections(JobConfig).items():
        obj = getattr(cfg, attr)
        lines += ["", f"[{toml}]"]
        for k, key in keys.items():
            if (v := getattr(obj, k)) is not None or key.default is not None:
                lines.append(f"{k} = {toml_value('none' if v is None else v)}")
        if toml == _MODEL:
            lines += [f"{toml_key(k)} = {toml_value('none' if v is None else v)}" for k, v in obj.overrides.items()]
    return "\n".join(lines) + "\n"


def dump_config(cfg: JobConfig, path: str | os.PathLike[str]) -> None:
    """Write :func:`config_to_toml` to ``path`` (parent folders are created)."""
    os.makedirs(os.path.dirname(os.fspath(path)) or ".", exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(config_to_toml(cfg))


def format_help(prog: str = _DEFAULT_PROG, model_schema: ModelSchema | None = None) -> str:
    """The ``--help`` text: every key's type, default, help and checks (and the default family's args fields)."""
    cfg, fields, title = JobConfig(), {}, ""
    why = " Loaders that know the models (titanlite.models.load_config) check them."
    if model_schema is not None:
        try:
            args_cls, why = model_schema(cfg), ""
            fields = _keys(args_cls)
            title = f"{cfg.model.name} args fields ({args_cls.__name__}; flavors set their own)"
        except Exception as e:  # the family cannot be imported: say so, help still works
            why = f" ({cfg.model.name} args fields unavailable: {type(e).__name__}: {one_line(e)})"
    note = "Any field of the model family's args dataclass is also accepted, as a [model] key or --model.<field>; "
    note += f"it overrides the flavor (stored in model.overrides).{why}"
    return _parser(fields, prog, (note, title)).format_help()


def parse_args_or_exit(
    argv: Sequence[str] | None = None, prog: str = _DEFAULT_PROG, model_schema: ModelSchema | None = None
) -> JobConfig:
    """``parse_config`` for entry points: ``--help`` prints the help (exit 0), a ConfigError ``error: ...`` (exit 2)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if "-h" in args or "--help" in args:
        print(format_help(prog, model_schema), end="", flush=True)
        raise SystemExit(0)
    if "--list-configs" in args:
        print(list_configs(), flush=True)
        raise SystemExit(0)
    try:
        return parse_config(args, model_schema)
    except ConfigError as e:
        exit_with_error(e)


def exit_with_error(error: object, code: int | None = None, every_rank: bool = False) -> NoReturn:
    """Print ``error: <one line>`` on stderr and exit with ``code`` (default: a UserError's ``exit_code``, else 2):
    under torchrun only local rank 0 of each node (every rank parses the same command line), or with ``every_rank``
    each rank, prefixed ``rank N:``."""
    code = getattr(error, "exit_code", 2) if code is None else code
    msg = one_line(error)
    rank, world = os.environ.get("RANK"), int(os.environ.get("WORLD_SIZE", "1") or 1)
    if every_rank:
        sys.stderr.write(f"error: {f'rank {rank}: ' if rank is not None and world > 1 else ''}{msg}\n")
    elif os.environ.get("LOCAL_RANK", "0") == "0":
        sys.stderr.write(f"error: {msg}\n")
    else:  # torchrun stops every rank once one exits: give local rank 0, which says why, time to say it first
        time.sleep(5.0)
    raise SystemExit(code)

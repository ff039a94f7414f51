"""The config's data tables: dataset kinds, ``mixture`` sources and ``seq_len_schedule`` stages, checked as the
config is loaded (titanlite.config.sections), named as metrics and the data loaders name them."""

from __future__ import annotations

from typing import Any

from titanlite.errors import ConfigError

DATASETS = ("embedded", "shards", "text", "chat")
MIXTURE_KEYS = {"path": str, "weight": (int, float), "name": str, "dataset": str}
STAGE_KEYS = {"seq_len": int, "fraction": (int, float), "steps": int, "global_batch_size": int}


def check_dataset(section: str, dataset: str, path: str) -> None:
    """``[section] dataset`` is a known kind, with a ``dataset_path`` exactly when the kind reads files."""
    if dataset not in DATASETS:
        raise ConfigError(f"invalid value {dataset!r} for '{section}.dataset': must be one of {', '.join(DATASETS)}")
    if dataset != "embedded" and not path:
        raise ConfigError(f"{section}.dataset_path must be set when {section}.dataset = {dataset!r}")
    if dataset == "embedded" and path:  # the built-in text would be used and the path silently ignored
        raise ConfigError(
            f"{section}.dataset_path = {path!r} is ignored by {section}.dataset = 'embedded' (the built-in text): "
            f"set {section}.dataset = 'shards' or 'text' to use it, or leave {section}.dataset_path empty"
        )


def check_tables(key: str, tables: list, allowed: dict[str, Any], required: tuple[str, ...]) -> None:
    """Each entry of a list-of-tables key: a table with only ``allowed`` keys of their types, ``required`` present."""
    for i, entry in enumerate(tables):
        where = f"{key}[{i}]"
        if not isinstance(entry, dict):
            raise ConfigError(f"{where} must be a table such as {{{', '.join(f'{k} = ...' for k in required)}}}")
        for k, v in entry.items():
            if k not in allowed:
                raise ConfigError(f"unknown key {k!r} in {where}: expected {', '.join(allowed)}")
            if not isinstance(v, allowed[k]) or isinstance(v, bool):
                kind = allowed[k] if isinstance(allowed[k], type) else allowed[k][-1]
                raise ConfigError(f"{where}.{k} = {v!r} must be {'a string' if kind is str else 'a number'}")
        if missing := [k for k in required if k not in entry]:
            raise ConfigError(f"{where} has no {missing[0]!r} key")


def check_mixture(key: str, mixture: list) -> None:
    """``[{path, weight[, name, dataset]}, ...]``: positive weights, distinct names (default: the path's base name);
    ``{dataset = "embedded", weight}`` is the built-in corpus."""
    check_tables(key, mixture, MIXTURE_KEYS, ("weight",))
    names = []
    for i, entry in enumerate(mixture):
        if entry.get("dataset") != "embedded" and not entry.get("path"):
            raise ConfigError(f"{key}[{i}] has no 'path' key (only dataset = 'embedded' needs none)")
        if not 0 < entry["weight"] < float("inf"):  # NaN fails too
            raise ConfigError(f"{key}[{i}].weight = {entry['weight']} must be > 0 and finite")
        if entry.get("dataset", "auto") not in ("auto", *DATASETS):
            raise ConfigError(f"{key}[{i}].dataset = {entry['dataset']!r} must be auto or one of {', '.join(DATASETS)}")
        names.append(mixture_source_name(entry))
    if repeated := sorted({n for n in names if names.count(n) > 1}):
        raise ConfigError(f"{key} has two sources named {repeated[0]!r}: give them distinct 'name' keys")


def mixture_source_name(entry: dict) -> str:
    """A source's name in metrics (``tokens_seen/<name>``, ``val_loss/<name>``): ``name``, else the path's base name."""
    if "name" in entry or "path" not in entry:
        return entry.get("name") or "embedded"
    return entry["path"].rstrip("/\\").replace("\\", "/").rsplit("/", 1)[-1].split(".")[0]

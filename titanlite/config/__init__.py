"""Job configuration: section dataclasses and the strict TOML + command-line loader."""
from titanlite.config.parser import (
    ConfigError,
    config_to_dict,
    config_to_toml,
    dump_config,
    exit_with_error,
    format_help,
    load_config,
    parse_args_or_exit,
    split_cli_args,
    toml_value,
    validate,
)
from titanlite.config.sections import JobConfig

__all__ = [
    "ConfigError",
    "JobConfig",
    "config_to_dict",
    "config_to_toml",
    "dump_config",
    "exit_with_error",
    "format_help",
    "load_config",
    "parse_args_or_exit",
    "split_cli_args",
    "toml_value",
    "validate",
]

"""Job configuration: section dataclasses and the strict TOML + command-line parser, ``parse_config`` (imports
nothing from titanlite; ``titanlite.models.load_config`` adds the model registry)."""

from titanlite.config.parser import (
    ModelSchema,
    config_to_dict,
    config_to_toml,
    did_you_mean,
    dump_config,
    exit_with_error,
    format_help,
    parse_args_or_exit,
    parse_config,
    read_toml,
    toml_value,
    validate,
)
from titanlite.config.sections import ConfigError, JobConfig

__all__ = [
    "ConfigError",
    "JobConfig",
    "ModelSchema",
    "config_to_dict",
    "config_to_toml",
    "did_you_mean",
    "dump_config",
    "exit_with_error",
    "format_help",
    "parse_args_or_exit",
    "parse_config",
    "read_toml",
    "toml_value",
    "validate",
]

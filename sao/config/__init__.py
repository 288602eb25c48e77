"""The typed configuration of ``sao train``: the sections
(:mod:`~sao.config.schema`; ``model`` in :mod:`~sao.config.model`), resolving and validating them
(:mod:`~sao.config.resolve`), TOML/YAML files and ``--set`` overrides
(:mod:`~sao.config.sources`), named presets (:mod:`~sao.config.presets`) and
the generated reference (:mod:`~sao.config.reference`). It imports only
:mod:`sao.algo` and pydantic."""

from sao.config.model import LoraSettings, ModelConfig
from sao.config.presets import PRESETS
from sao.config.resolve import load_config, to_dict, validate
from sao.config.schema import (
    AlgoConfig,
    Config,
    EvalConfig,
    LogConfig,
    RolloutConfig,
    RuntimeConfig,
    TaskConfig,
    TrainConfig,
)
from sao.config.sources import ConfigError, parse_override, read_file

__all__ = [
    "PRESETS",
    "AlgoConfig",
    "Config",
    "ConfigError",
    "EvalConfig",
    "LogConfig",
    "LoraSettings",
    "ModelConfig",
    "RolloutConfig",
    "RuntimeConfig",
    "TaskConfig",
    "TrainConfig",
    "load_config",
    "parse_override",
    "read_file",
    "to_dict",
    "validate",
]

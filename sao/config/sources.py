"""Reading the sources of a :class:`~sao.config.Config`: TOML / YAML files and
``--set key=value`` overrides. Every mistake is a :class:`ConfigError` that
names its source: the file with the line and column of a syntax error, or the
``--set`` item; nothing else is read or written before it is raised.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import yaml

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = ["ConfigError", "parse_override", "read_file"]


class ConfigError(ValueError):
    """A configuration mistake the user can fix; the message says how."""


def read_file(path: str | Path) -> dict[str, Any]:
    """A TOML (``.toml``) or YAML (``.yaml``/``.yml``) config file as a dict."""
    p = Path(path)
    if not p.is_file():
        what = "is a directory, not a file" if p.is_dir() else "does not exist"
        raise ConfigError(f"config file {str(p)!r} {what}")
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file {str(p)!r} cannot be read as UTF-8 text: {e}") from None
    data = _parse_toml(p, text) if p.suffix == ".toml" else _parse_yaml(p, text)
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(p)!r} must hold a table of settings")
    return data


def _parse_toml(p: Path, text: str) -> dict[str, Any]:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        # tomllib's message ends with "(at line L, column C)" (or "(at end of document)")
        msg = str(e)
        at = re.search(r"\s*\(at line (\d+), column (\d+)\)$", msg)
        where = f"{p}:{at[1]}:{at[2]}" if at else str(p)
        reason = msg[: at.start()] if at else msg
        raise ConfigError(f"{where}: invalid TOML: {reason}") from None


def _parse_yaml(p: Path, text: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{_yaml_where(e, str(p))}: invalid YAML: {_yaml_reason(e)}") from None


def _yaml_where(e: yaml.YAMLError, source: str) -> str:
    """``source:line:column`` of a YAML error (1-based), or ``source``."""
    mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
    if mark is None:
        return source
    return f"{source}:{mark.line + 1}:{mark.column + 1}"


def _yaml_reason(e: yaml.YAMLError) -> str:
    if isinstance(e, yaml.MarkedYAMLError) and e.problem:
        return e.problem + (f" ({e.context})" if e.context else "")
    return " ".join(str(e).split())


def parse_override(item: str) -> dict[str, Any]:
    """``"a.b=c"`` -> ``{"a": {"b": c}}`` with ``c`` parsed as a YAML scalar."""
    if "=" not in item:
        raise ConfigError(f"--set expects key=value, got {item!r} (e.g. --set train.steps=100)")
    key, raw = item.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"--set {item!r}: the key has an empty part (e.g. --set train.steps=100)")
    try:
        value: Any = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise ConfigError(
            f"--set {item!r}: the value is not valid YAML ({_yaml_reason(e)}); "
            "quote it to pass a string"
        ) from None
    out: dict[str, Any] = {}
    node = out
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value
    return out

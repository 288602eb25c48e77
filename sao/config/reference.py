"""The configuration reference (docs/configuration.md, ``sao config
--reference``), generated from the field docs of :mod:`sao.config` and the
algorithm presets."""

from __future__ import annotations

from dataclasses import fields as dc_fields
from typing import get_args

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from sao.algo.presets import AlgoPreset, get_preset
from sao.config import PRESETS, Config

__all__ = ["reference_markdown"]


def reference_markdown() -> str:
    """The configuration reference (docs/configuration.md), generated from field docs."""
    import inspect

    from sao.algo.presets import PRESETS as ALGO_PRESETS
    from sao.algo.presets import field_docs

    def cell(text: str | None) -> str:
        # One table cell: a single line, with literal pipes escaped.
        return " ".join((text or "").split()).replace("|", "\\|")

    def value(v: object) -> str:
        return f"`{v!r}`".replace("|", "\\|")

    out = [
        "# Configuration reference",
        "",
        "Generated from the field docs in `sao/config/` by `sao config --reference`; do not edit.",
        "",
        "Settings are resolved in this order, later ones winning: a named preset",
        f"(`--preset`, one of {', '.join(f'`{n}`' for n in PRESETS)}; default `calc-tiny`),",
        "a TOML or YAML file (`--config`), then `--set key=value` overrides, e.g.",
        "`sao train --set algo=grpo --set train.steps=100`. Unknown keys are errors.",
        "`sao config` prints the resolved configuration.",
        "",
    ]
    for name, field in Config.model_fields.items():
        section = field.annotation
        if not (isinstance(section, type) and issubclass(section, BaseModel)):
            out += [f"- `{name}` (default {value(field.default)}): {cell(field.description)}", ""]
            continue
        out += [f"## `{name}`", "", inspect.cleandoc(section.__doc__ or ""), ""]
        out += ["| key | default | meaning |", "|---|---|---|"]
        for key, f in section.model_fields.items():
            out.append(f"| `{name}.{key}` | {value(f.default)} | {cell(f.description)} |")
            for sub, sf in _nested(f.annotation).items():
                out.append(
                    f"| `{name}.{key}.{sub}` | {value(sf.default)} | {cell(sf.description)} |"
                )
        out.append("")
    base = get_preset("sao")
    docs = field_docs()
    out += [
        "## Algorithm preset fields",
        "",
        "What `algo.preset` selects. Fields with an `algo.*` key above can be overridden;",
        "the value shown is the `sao` preset's.",
        "",
        "| field | `sao` value | meaning |",
        "|---|---|---|",
    ]
    out += [
        f"| `{f.name}` | {value(getattr(base, f.name))} | {cell(docs.get(f.name))} |"
        for f in dc_fields(AlgoPreset)
    ]
    out += ["", "## Algorithm presets", "", "| preset | differs from `sao` in |", "|---|---|"]
    for preset_name, preset in ALGO_PRESETS.items():
        diff = [
            f"`{f.name}={getattr(preset, f.name)!r}`".replace("|", "\\|")
            for f in dc_fields(AlgoPreset)
            if f.name != "name" and getattr(preset, f.name) != getattr(base, f.name)
        ]
        out.append(f"| `{preset_name}` | {', '.join(diff) or '(the reference)'} |")
    return "\n".join(out) + "\n"


def _nested(annotation: object) -> dict[str, FieldInfo]:
    """The fields of a settings object a key holds (``model.lora``: ``LoraSettings |
    None``), so its sub-keys are documented too; {} for a plain value."""
    for t in (annotation, *get_args(annotation)):
        if isinstance(t, type) and issubclass(t, BaseModel):
            return dict(t.model_fields)
    return {}

"""The base of every config section: unknown keys rejected, each field documented
by the string under it, frozen once validated."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, frozen=True)


_FINITE = ConfigDict(allow_inf_nan=False)
"""Merged into a section's config: its float fields reject nan and +-inf (YAML ``.inf``,
``1e400``), which would otherwise pass ``> 0`` checks and fail (or hang) later."""

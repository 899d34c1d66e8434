"""The schemas the admin API's resources share: :class:`Strict` inputs and the
:class:`Changed` answer of a change that may have had nothing to do."""

# No `from __future__ import annotations`: ninja reads the schemas' annotations.

from typing import Any

from ninja import Schema
from pydantic import ConfigDict, field_validator


class Strict(Schema):
    """Inputs refuse fields they do not know, so a typo is an error, not a silent no-op, and
    text with NUL characters (which PostgreSQL cannot store, and no name needs)."""

    model_config = ConfigDict(extra="forbid")

    @field_validator("*", mode="after")
    @classmethod
    def _no_nul(cls, value: Any) -> Any:
        if _has_nul(value):
            raise ValueError("must not contain NUL characters")
        return value


def _has_nul(value: Any) -> bool:
    if isinstance(value, str):
        return "\x00" in value
    if isinstance(value, list):
        return any(_has_nul(v) for v in value)
    if isinstance(value, dict):
        return any(_has_nul(k) or _has_nul(v) for k, v in value.items())
    return False


class Changed(Schema):
    changed: bool

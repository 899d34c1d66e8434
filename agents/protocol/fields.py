"""Typed reads from one decoded JSON object, for the protocol's messages: each read checks the
value's kind and bounds, and every failure is a :class:`ProtocolError` that names the field by
its full path (``shards[2].port``)."""

from __future__ import annotations

from enum import StrEnum
from typing import Any, Final, TypeVar

from agents.protocol.vocabulary import CloseCode, ProtocolError


class Fields:
    """Typed reads from one JSON object; every failure names the field by its full path."""

    def __init__(self, raw: object, path: str) -> None:
        if not isinstance(raw, dict):
            raise ProtocolError(CloseCode.MALFORMED, f"{path or 'message'} must be an object")
        self.raw: dict[str, Any] = raw
        self.path = path

    def _name(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def _get(self, key: str, default: Any) -> Any:
        if key in self.raw:
            return self.raw[key]
        if default is _REQUIRED:
            raise ProtocolError(CloseCode.MALFORMED, f"{self._name(key)} is required")
        return default

    def text(self, key: str, default: Any = None, *, max_len: int = 500) -> str:
        value = self._get(key, _REQUIRED if default is None else default)
        if not isinstance(value, str):
            raise ProtocolError(CloseCode.MALFORMED, f"{self._name(key)} must be a string")
        if len(value) > max_len:
            raise ProtocolError(
                CloseCode.MALFORMED, f"{self._name(key)} is longer than {max_len} characters"
            )
        return value

    def integer(self, key: str, default: Any = None, *, low: int = 0, high: int = 2**63 - 1) -> int:
        value = self._get(key, _REQUIRED if default is None else default)
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise ProtocolError(
                CloseCode.MALFORMED, f"{self._name(key)} must be an integer from {low} to {high}"
            )
        return value

    def opt_integer(self, key: str, *, low: int = -(2**31), high: int = 2**31 - 1) -> int | None:
        if self.raw.get(key) is None:
            return None
        return self.integer(key, low=low, high=high)

    def number(self, key: str, default: Any = None, *, low: float = 0.0) -> float:
        value = self._get(key, _REQUIRED if default is None else default)
        if isinstance(value, bool) or not isinstance(value, int | float) or not value >= low:
            raise ProtocolError(
                CloseCode.MALFORMED, f"{self._name(key)} must be a number of at least {low:g}"
            )
        return float(value)

    def choice(self, key: str, kind: type[_E], default: Any = None) -> _E:
        value = self.text(key, default, max_len=50)
        try:
            return kind(value)
        except ValueError:
            allowed = ", ".join(repr(str(v.value)) for v in kind)
            raise ProtocolError(
                CloseCode.MALFORMED, f"{self._name(key)} must be one of {allowed}"
            ) from None

    def items(self, key: str, *, max_items: int = 1000) -> list[Any]:
        value = self._get(key, [])
        if not isinstance(value, list):
            raise ProtocolError(CloseCode.MALFORMED, f"{self._name(key)} must be a list")
        if len(value) > max_items:
            raise ProtocolError(
                CloseCode.MALFORMED, f"{self._name(key)} has more than {max_items} items"
            )
        return value

    def objects(self, key: str, *, max_items: int = 1000) -> list[Fields]:
        return [
            Fields(item, f"{self._name(key)}[{i}]")
            for i, item in enumerate(self.items(key, max_items=max_items))
        ]

    def texts(self, key: str, *, max_items: int = 1000, max_len: int = 500) -> tuple[str, ...]:
        items = self.items(key, max_items=max_items)
        for i, item in enumerate(items):
            if not isinstance(item, str) or len(item) > max_len:
                raise ProtocolError(
                    CloseCode.MALFORMED,
                    f"{self._name(key)}[{i}] must be a string of at most {max_len} characters",
                )
        return tuple(items)

    def integers(self, key: str, *, low: int = 0, high: int = 1023) -> tuple[int, ...]:
        items = self.items(key, max_items=high - low + 1)
        for i, item in enumerate(items):
            if isinstance(item, bool) or not isinstance(item, int) or not low <= item <= high:
                raise ProtocolError(
                    CloseCode.MALFORMED,
                    f"{self._name(key)}[{i}] must be an integer from {low} to {high}",
                )
        return tuple(items)

    def text_map(self, key: str) -> dict[str, str]:
        value = self._get(key, {})
        if not isinstance(value, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in value.items()
        ):
            raise ProtocolError(
                CloseCode.MALFORMED, f"{self._name(key)} must be an object of strings"
            )
        return dict(value)


_REQUIRED: Final = object()
_E = TypeVar("_E", bound=StrEnum)

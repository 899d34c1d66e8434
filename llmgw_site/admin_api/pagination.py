"""The admin API's one pagination: every list takes ``limit`` and ``offset`` and answers
``{"items", "count"}``."""

# No `from __future__ import annotations`: ninja reads the input schema's annotations.

from typing import Any

from ninja import Field, Schema
from ninja.pagination import LimitOffsetPagination

MAX_PAGE = 500
MAX_OFFSET = 2**31 - 1  # past any table here; larger numbers overflow the stores' integers


class Page(LimitOffsetPagination):
    """``?limit=`` (at most 500, default 100) and ``?offset=``; answers ``items`` and ``count``."""

    class Input(Schema):
        limit: int = Field(100, ge=1, le=MAX_PAGE)
        offset: int = Field(0, ge=0, le=MAX_OFFSET)

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(max_limit=MAX_PAGE, **kwargs)

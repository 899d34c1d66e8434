"""The store under test, as real processes started by a test reach it."""

from __future__ import annotations

import os

from django.db import connection


def database_url_for_children() -> str:
    """The URL of the *test* database, for real processes a test starts."""
    settings_dict = connection.settings_dict
    if connection.vendor == "sqlite":
        return f"sqlite:///{settings_dict['NAME']}"
    user = settings_dict.get("USER") or "postgres"
    host = settings_dict.get("HOST") or "127.0.0.1"
    port = settings_dict.get("PORT") or "5432"
    password = settings_dict.get("PASSWORD")
    auth = f"{user}:{password}" if password else user
    return f"postgres://{auth}@{host}:{port}/{settings_dict['NAME']}"


def child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["DATABASE_URL"] = database_url_for_children()
    env.setdefault("SECRET_KEY", "llmgw-checks-only-not-a-secret")
    env.update(extra)
    return env

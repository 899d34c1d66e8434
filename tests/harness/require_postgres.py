"""Is the PostgreSQL for the test suite reachable? Exit 0: yes; 3: no, skip loudly on a
developer machine; 1: no, and this is CI (CI=true), where a skipped backend is a failure."""

from __future__ import annotations

import os
import sys

import psycopg

DEFAULT_URL = "postgres://postgres@127.0.0.1:5432/llmgw"


def main() -> int:
    url = os.environ.get("TEST_POSTGRES_URL", DEFAULT_URL)
    # The test database is created from the server's maintenance database, so that is what
    # must answer; the database named in the URL need not exist.
    server_url = url.rsplit("/", 1)[0] + "/postgres"
    try:
        with psycopg.connect(server_url, connect_timeout=5) as conn:
            conn.execute("SELECT 1")
    except psycopg.Error as exc:
        banner = "=" * 78
        message = f"PostgreSQL at {server_url} is not reachable: {exc}".strip()
        if os.environ.get("CI", "").lower() == "true":
            print(
                f"{banner}\nERROR: {message}\nCI must test both backends.\n{banner}",
                file=sys.stderr,
            )
            return 1
        print(
            f"{banner}\nWARNING: {message}\n"
            f"The PostgreSQL half of the suite was NOT run.\n{banner}",
            file=sys.stderr,
        )
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``make bench-usage``: usage at volume. Loads N usage rows (10 million by default) into
PostgreSQL, rolls them up as the beat task does, and times what reads them: the ``/admin/``
dashboard's JSON, a heavy user's ``/account/`` page, a budget check (a user's spend in the
month) and a key's ``/v1/keys/{prefix}/usage`` numbers. Goal: each under 200 ms.

Rows are made by the database itself (``INSERT ... SELECT`` over ``generate_series``): 90 days
of traffic from 3,000 keys of 1,000 users on 20 models, 2% errors, with the last hour denser
(what the dashboard reads raw). The database named by ``BENCH_POSTGRES_URL`` (default
``postgres://postgres@127.0.0.1:5432/llmgw_bench_usage``) is dropped and created.

    python -m bench.usage_volume [--rows 10000000]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

REPO = Path(__file__).resolve().parent.parent
USERS, KEYS, MODELS, DAYS = 1000, 3000, 20, 90


def recreate(url: str) -> None:
    import psycopg

    parts = urlsplit(url)
    name = parts.path.lstrip("/")
    admin = parts._replace(path="/postgres").geturl()
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{name}"')


def load(rows: int) -> dict[str, float]:
    from django.db import connection

    timings = {}
    started = time.perf_counter()
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO auth_user (password, is_superuser, username, first_name, last_name,"
            " email, is_staff, is_active, date_joined)"
            " SELECT '!', false, 'user' || i, '', '', '', false, true, now()"
            " FROM generate_series(1, %s) AS i",
            [USERS],
        )
        cursor.execute(
            "INSERT INTO gateway_apikey (user_id, name, prefix, key_hash, allowed_models,"
            " token_budget, budget_period, created_at)"
            " SELECT (SELECT min(id) FROM auth_user) + (i %% %s), 'k' || i,"
            " 'llmgw-b' || lpad(i::text, 7, '0'), md5(i::text) || md5((i * 7)::text), '[]',"
            " 1000000000, 'month', now()"
            " FROM generate_series(1, %s) AS i",
            [USERS, KEYS],
        )
        # started_at: 90% spread over 90 days, 10% in the last hour (the dashboard's window).
        cursor.execute(
            "INSERT INTO gateway_usagerecord (request_id, api_key_id, user_id, model, endpoint,"
            " upstream, status, stream, prompt_tokens, completion_tokens, cached_tokens,"
            " usage_source, ttft_ms, duration_ms, finish_reason, started_at, created_at)"
            " SELECT 'bench-' || i, k.id, k.user_id, 'model-' || (i %% %s), 'chat',"
            " 'replica:' || (i %% 7), CASE WHEN i %% 50 = 0 THEN 503 ELSE 200 END,"
            " i %% 2 = 0, 20 + i %% 400, 10 + i %% 300, 0, 'engine',"
            " 50 + (i %% 1000), 300 + (i %% 4000), 'stop', t.at, t.at"
            " FROM generate_series(1, %s) AS i"
            " JOIN gateway_apikey k ON k.name = 'k' || (1 + i %% %s)"
            " CROSS JOIN LATERAL (SELECT CASE WHEN i %% 10 = 0"
            "   THEN now() - (i %% 3600) * interval '1 second'"
            "   ELSE now() - (i %% (%s * 86400)) * interval '1 second' END AS at) t",
            [MODELS, rows, KEYS, DAYS],
        )
        cursor.execute("ANALYZE")
    timings["load_s"] = time.perf_counter() - started
    return timings


def roll_up_all() -> dict[str, float]:
    from django.utils import timezone

    from gateway.ledger import rollups

    started = time.perf_counter()
    runs = 0
    while True:
        run = rollups.roll_up()
        runs += 1
        if run.rolled_through is None or run.rolled_through >= rollups.hour_of(timezone.now()):
            break
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("ANALYZE")
    return {"rollup_s": time.perf_counter() - started, "rollup_runs": runs}


def timed(fn: Callable[[], Any], times: int = 7) -> dict[str, float]:
    first = time.perf_counter()
    fn()
    cold = time.perf_counter() - first
    samples = []
    for _ in range(times):
        started = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - started)
    return {"cold_ms": cold * 1000, "median_ms": statistics.median(samples) * 1000}


def measure() -> dict[str, Any]:
    from django.contrib.auth import get_user_model
    from django.test import Client

    from gateway.edge import api
    from gateway.identity import allowances, keys
    from gateway.ledger import rollups
    from gateway.models import ApiKey, UserLimits

    staff = get_user_model().objects.create_superuser("bench-root", password="x")
    # A host the settings allow (the test client's own "testserver" is refused with a 400).
    admin = Client(HTTP_HOST="localhost")
    admin.force_login(staff)
    # The user with the most rows, and a budget to check.
    heavy = get_user_model().objects.get(username="user1")
    UserLimits.objects.create(user=heavy, token_budget=10**12)
    account = Client(HTTP_HOST="localhost")
    account.force_login(heavy)
    key = ApiKey.objects.filter(user=heavy).first()
    assert key is not None
    info = keys._load(key.key_hash)
    assert info is not None

    def dashboard() -> None:
        assert admin.get("/admin/dashboard.json").status_code == 200

    def account_page() -> None:
        assert account.get("/account/").status_code == 200

    def budget() -> None:
        allowances.user_spend(UserLimits.objects.get(user=heavy))

    return {
        "dashboard_json": timed(dashboard),
        "account_page": timed(account_page),
        "budget_check": timed(budget),
        "key_usage": timed(lambda: api._usage_summary(info)),
        "rolled_through": str(rollups.mark()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.usage_volume")
    parser.add_argument("--rows", type=int, default=10_000_000)
    args = parser.parse_args()
    url = os.environ.get(
        "BENCH_POSTGRES_URL", "postgres://postgres@127.0.0.1:5432/llmgw_bench_usage"
    )
    recreate(url)
    os.environ.update(
        DATABASE_URL=url,
        SECRET_KEY=os.environ.get("SECRET_KEY") or "llmgw-bench-only",
        DJANGO_SETTINGS_MODULE="llmgw_site.settings",
        LLMGW_LOG_LEVEL="WARNING",
        LLMGW_VAR_DIR=str(REPO / "var" / "bench-usage"),
    )
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    report: dict[str, Any] = {"rows": args.rows}
    report |= load(args.rows)
    print(f"loaded {args.rows} rows in {report['load_s']:.0f} s", flush=True)
    report |= roll_up_all()
    print(f"rolled up in {report['rollup_s']:.0f} s ({report['rollup_runs']} runs)", flush=True)
    report |= measure()
    for name in ("dashboard_json", "account_page", "budget_check", "key_usage"):
        figure = report[name]
        verdict = "ok" if figure["median_ms"] < 200 else "OVER 200 ms"
        print(
            f"{name:15} median {figure['median_ms']:7.1f} ms  cold {figure['cold_ms']:7.1f} ms"
            f"  {verdict}"
        )
    path = Path(os.environ.get("BENCH_JSON", REPO / "var" / "bench-usage.json"))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

"""Security settings from the environment: secure by default with DEBUG off, and
``manage.py check --deploy`` clean with the production settings the README shows.

Settings are read once per process, so each case is a fresh ``manage.py`` process with the
environment under test (nothing here needs the store)."""

from __future__ import annotations

import json
import re
import secrets
import subprocess
import sys

import pytest

from tests.harness.procs import REPO_ROOT
from tests.harness.store import process_env

SHOW = (
    "from django.conf import settings as s; import json; print(json.dumps({k: getattr(s, k) "
    "for k in ['DEBUG', 'ALLOWED_HOSTS', 'CSRF_TRUSTED_ORIGINS', 'SESSION_COOKIE_SECURE', "
    "'CSRF_COOKIE_SECURE', 'SECURE_HSTS_SECONDS', 'SECURE_PROXY_SSL_HEADER', "
    "'SECURE_SSL_REDIRECT', 'SESSION_COOKIE_HTTPONLY', 'X_FRAME_OPTIONS']}))"
)
# Variables of ours a developer's shell might hold; each case sets what it means.
OURS = re.compile(r"^LLMGW_(DEBUG|ALLOWED_HOSTS|CSRF_TRUSTED_ORIGINS|HTTPS|SSL_REDIRECT|HSTS_\w+"
                  r"|PROXY_TLS_HEADER|CLIENT_IP_HEADER)$")  # fmt: skip


def manage(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in process_env().items() if not OURS.match(k)}
    return subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=REPO_ROOT,
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def settings_with(**env: str) -> dict[str, object]:
    result = manage("shell", "-c", SHOW, **env)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def readme_production_env() -> dict[str, str]:
    """The variables of the README's "Production settings" block, placeholders filled in."""
    readme = (REPO_ROOT / "README.md").read_text()
    block = readme.split("### Production settings", 1)[1].split("```", 2)[1]
    pairs = dict(re.findall(r"\b([A-Z_][A-Z0-9_]*)=(\S+)", block))
    assert "SECRET_KEY" in pairs and "LLMGW_ALLOWED_HOSTS" in pairs, pairs
    pairs["SECRET_KEY"] = secrets.token_urlsafe(50)  # the README shows a placeholder
    pairs.pop("DATABASE_URL", None)
    pairs.pop("REDIS_URL", None)
    return pairs


def test_with_debug_off_and_nothing_set_the_site_is_secure_by_default() -> None:
    got = settings_with()
    assert got["DEBUG"] is False
    assert "*" not in got["ALLOWED_HOSTS"]  # type: ignore[operator]
    assert got["SESSION_COOKIE_SECURE"] is True and got["CSRF_COOKIE_SECURE"] is True
    assert got["SECURE_HSTS_SECONDS"] == 31_536_000
    assert got["SESSION_COOKIE_HTTPONLY"] is True and got["X_FRAME_OPTIONS"] == "DENY"


def test_debug_on_relaxes_what_a_laptop_needs() -> None:
    got = settings_with(LLMGW_DEBUG="true")
    assert got["ALLOWED_HOSTS"] == ["*"]
    assert got["SESSION_COOKIE_SECURE"] is False and got["SECURE_HSTS_SECONDS"] == 0


def test_the_settings_come_from_the_environment() -> None:
    got = settings_with(
        LLMGW_ALLOWED_HOSTS="llmgw.example.com, .internal",
        LLMGW_CSRF_TRUSTED_ORIGINS="https://llmgw.example.com",
        LLMGW_PROXY_TLS_HEADER="X-Forwarded-Proto",
        LLMGW_SSL_REDIRECT="true",
        LLMGW_HSTS_SECONDS="600",
    )
    assert got["ALLOWED_HOSTS"] == ["llmgw.example.com", ".internal"]
    assert got["CSRF_TRUSTED_ORIGINS"] == ["https://llmgw.example.com"]
    assert got["SECURE_PROXY_SSL_HEADER"] == ["HTTP_X_FORWARDED_PROTO", "https"]
    assert got["SECURE_SSL_REDIRECT"] is True and got["SECURE_HSTS_SECONDS"] == 600
    plain = settings_with(LLMGW_HTTPS="false")
    assert plain["SESSION_COOKIE_SECURE"] is False and plain["SECURE_HSTS_SECONDS"] == 0


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"LLMGW_CSRF_TRUSTED_ORIGINS": "llmgw.example.com"}, "needs its scheme"),
        ({"LLMGW_HTTPS": "maybe"}, "LLMGW_HTTPS='maybe' is not a boolean"),
        ({"LLMGW_LOGIN_FAILURE_LIMIT": "0"}, "LLMGW_LOGIN_FAILURE_LIMIT='0' must be at least 1"),
        ({"LLMGW_LOGIN_PACE_SECONDS": "0"}, "LLMGW_LOGIN_PACE_SECONDS='0' must be at least 1"),
    ],
)
def test_a_bad_value_stops_start_up_naming_the_variable(env: dict[str, str], message: str) -> None:
    result = manage("check", **env)
    assert result.returncode != 0 and message in result.stderr


def test_check_deploy_is_clean_with_the_readme_production_settings() -> None:
    result = manage("check", "--deploy", "--fail-level", "WARNING", **readme_production_env())
    assert result.returncode == 0, result.stdout + result.stderr
    assert "System check identified no issues" in result.stdout


def test_check_deploy_complains_about_the_defaults_it_should_complain_about() -> None:
    result = manage("check", "--deploy", "--fail-level", "WARNING", LLMGW_DEBUG="true")
    assert result.returncode != 0
    assert "security.W018" in result.stderr + result.stdout  # DEBUG on

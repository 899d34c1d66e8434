"""Bad configuration stops start-up with a message that names the variable."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest
from channels_redis.core import RedisChannelLayer

from llmgw_site import config
from tests.harness.procs import REPO_ROOT
from tests.harness.redis import RedisServer


def test_boolean_accepts_the_usual_spellings() -> None:
    assert config.env_bool({"X": "yes"}, "X", False) is True
    assert config.env_bool({"X": "0"}, "X", True) is False
    assert config.env_bool({}, "X", True) is True


@pytest.mark.parametrize(
    ("reader", "value", "fragment"),
    [
        (
            lambda env: config.env_bool(env, "LLMGW_X", False),
            "maybe",
            "LLMGW_X='maybe' is not a boolean",
        ),
        (lambda env: config.env_float(env, "LLMGW_X", 1.0), "ten", "LLMGW_X='ten' is not a number"),
        (lambda env: config.env_float(env, "LLMGW_X", 1.0, minimum=1), "0.5", "must be at least 1"),
        (lambda env: config.env_float(env, "LLMGW_X", 1.0), "nan", "must be at least 0"),
        (lambda env: config.env_int(env, "LLMGW_X", 1), "1.5", "LLMGW_X='1.5' is not an integer"),
        (lambda env: config.env_port_range(env, "LLMGW_X", (1, 2)), "9000", "not a port range"),
        (lambda env: config.env_port_range(env, "LLMGW_X", (1, 2)), "9-70000", "not a port range"),
    ],
)
def test_malformed_values_name_the_variable(reader, value: str, fragment: str) -> None:
    with pytest.raises(config.ConfigError, match=fragment.replace("(", r"\(")):
        reader({"LLMGW_X": value})


def test_port_range_parses() -> None:
    assert config.env_port_range({"P": "20000-20100"}, "P", (1, 2)) == (20000, 20100)


def test_static_endpoints_parse_id_url_models() -> None:
    parsed = config.parse_static_endpoints(
        {"E": "a=http://10.0.0.1:8000/=m1,m2; b=https://x.example/v=m3"}, "E"
    )
    assert parsed == (
        config.StaticEndpoint("a", "http://10.0.0.1:8000", ("m1", "m2")),
        config.StaticEndpoint("b", "https://x.example/v", ("m3",)),
    )


@pytest.mark.parametrize(
    "value",
    ["a=http://x", "a=ftp://x=m", "=http://x=m", "a=http://x=,", "a=http://x=m a=http://y=n"],
)
def test_static_endpoints_reject_bad_entries(value: str) -> None:
    with pytest.raises(config.ConfigError, match=r"^E"):
        config.parse_static_endpoints({"E": value}, "E")


def test_endpoint_flags_add_to_the_variable_and_write_back_as_it_reads() -> None:
    env = {"E": "a=http://10.0.0.1:8000=m1"}
    flags = ["b=http://10.0.0.2:8000/=m2,m3", "c=https://x.example=m4; d=http://10.0.0.4=m5"]
    both = config.static_endpoints_with_flags(env, "E", "--endpoint", flags)
    assert [e.id for e in both] == ["a", "b", "c", "d"]
    assert both[1] == config.StaticEndpoint("b", "http://10.0.0.2:8000", ("m2", "m3"))
    text = config.static_endpoints_text(both)
    assert config.parse_static_endpoints({"E": text}, "E") == both
    assert config.static_endpoints_with_flags({}, "E", "--endpoint", []) == ()


@pytest.mark.parametrize(
    ("variable", "flags", "message"),
    [
        (
            "a=http://x=m",
            ["a=http://y=n"],
            r"--endpoint: endpoint id 'a' appears twice \(it is in E",
        ),
        ("", ["a=http://x=m", "a=http://y=n"], "--endpoint: endpoint id 'a' appears twice$"),
        ("", ["a=http://x"], "--endpoint: 'a=http://x' is not of the form"),
        ("a=http://x", ["b=http://y=n"], "E: 'a=http://x' is not of the form"),
    ],
)
def test_endpoint_flags_are_refused_naming_the_flag_or_the_variable(
    variable: str, flags: list[str], message: str
) -> None:
    with pytest.raises(config.ConfigError, match=f"^{message}"):
        config.static_endpoints_with_flags({"E": variable}, "E", "--endpoint", flags)


def run_manage(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=REPO_ROOT,
        env={"PATH": "/usr/bin:/bin", **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_start_up_fails_naming_every_bad_variable_without_a_traceback(tmp_path) -> None:
    result = run_manage(
        {
            "LLMGW_VAR_DIR": str(tmp_path),
            "LLMGW_LEASE_TTL": "soon",
            "LLMGW_LOST_AFTER": "5",
            "REDIS_URL": "localhost:6379",
        },
        "check",
    )
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    for fragment in [
        "SECRET_KEY is required",
        "LLMGW_LEASE_TTL='soon' is not a number",
        "LLMGW_LOST_AFTER (5s) must be longer",
        "REDIS_URL='localhost:6379'",
    ]:
        assert fragment in result.stderr


def test_renew_deadline_must_be_shorter_than_the_ttl(tmp_path) -> None:
    result = run_manage(
        {
            "LLMGW_VAR_DIR": str(tmp_path),
            "SECRET_KEY": "x",
            "LLMGW_LEASE_TTL": "5",
            "LLMGW_LEASE_RENEW_DEADLINE": "5",
        },
        "check",
    )
    assert result.returncode == 2
    assert (
        "LLMGW_LEASE_RENEW_DEADLINE (5s) must be shorter than LLMGW_LEASE_TTL (5s)" in result.stderr
    )


def test_a_good_configuration_passes_django_checks(tmp_path) -> None:
    result = run_manage({"LLMGW_VAR_DIR": str(tmp_path), "SECRET_KEY": "x"}, "check")
    assert result.returncode == 0, result.stderr
    assert "no issues" in result.stdout


@pytest.mark.parametrize(("command", "daphne"), [("runserver", True), ("check", False)])
def test_daphne_serves_runserver_and_no_other_process_loads_it(
    tmp_path, command: str, daphne: bool
) -> None:
    """`runserver` is Daphne's (development, WebSockets included); every other process (web
    processes, worker, beat, commands) starts without Daphne and Twisted."""
    code = (
        f"import sys; sys.argv = ['manage.py', {command!r}]; import django; django.setup(); "
        "from django.core.management import get_commands; "
        "print(get_commands()['runserver'], 'twisted' in sys.modules)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO_ROOT,
        env={
            "PATH": "/usr/bin:/bin",
            "DJANGO_SETTINGS_MODULE": "llmgw_site.settings",
            "LLMGW_VAR_DIR": str(tmp_path),
            "SECRET_KEY": "x",
        },
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == (
        ["daphne", "True"] if daphne else ["django.contrib.staticfiles", "False"]
    )


async def test_the_redis_channel_layer_waits_out_a_quiet_spell(redis_server: RedisServer) -> None:
    """With redis-py 8's default read timeout (5 s) every quiet wait for a group message ended
    in a TimeoutError, and the streams waiting on it took Redis for down. A message sent after
    the layer's own blocking pop (5 s) has come round once is received, and nothing raised."""
    layer = RedisChannelLayer(**config.redis_channel_layer(redis_server.url)["CONFIG"])  # type: ignore[arg-type]
    channel = await layer.new_channel()
    quiet = RedisChannelLayer.brpop_timeout + 1

    async def send_later() -> None:
        await asyncio.sleep(quiet)
        await layer.send(channel, {"type": "after.quiet"})

    sender = asyncio.create_task(send_later())
    # A generous guard against hanging the suite, not a measure.
    message = await asyncio.wait_for(layer.receive(channel), timeout=quiet + 60)
    await sender
    assert message == {"type": "after.quiet"}
    await layer.flush()


@pytest.mark.parametrize(
    ("argv", "name"),
    [
        (["/srv/llmgw/llmgw_site/webserver.py", "--listen", "client=3"], "web"),
        (["/venv/lib/python3.11/site-packages/celery/__main__.py", "-A", "x", "worker"], "worker"),
        (["/venv/bin/celery", "--quiet", "-A", "llmgw_site", "beat", "--schedule", "s"], "beat"),
        (["manage.py", "run", "--port", "8000"], "run"),
        (["/srv/llmgw/manage.py", "diagnose", "stacks"], "diagnose"),
        (["manage.py"], "manage"),
        (["/venv/bin/pytest", "-q"], "pytest"),
        ([], "python"),
    ],
)
def test_a_process_is_named_by_its_command_line(argv: list[str], name: str) -> None:
    assert config.process_name(argv) == name


def test_a_bad_log_format_or_diagnostics_switch_stops_start_up_naming_it(tmp_path) -> None:
    result = run_manage(
        {"LLMGW_VAR_DIR": str(tmp_path), "LLMGW_LOG_FORMAT": "xml", "LLMGW_DIAGNOSTICS": "maybe"},
        "check",
    )
    assert result.returncode == 2
    assert "LLMGW_LOG_FORMAT='xml' is not one of plain, json" in result.stderr
    assert "LLMGW_DIAGNOSTICS='maybe' is not a boolean" in result.stderr

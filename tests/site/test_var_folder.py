"""`make run`'s var folder is its owner's alone: the store (sessions, engine keys, profile
environments), the secret key, the CA, the usage journals and the broker are never readable by
another local user, whatever umask the operator's shell has, and a folder an older version left
open is closed at start, saying what it closed.

Each process here starts from a shell with the common umask 022 (never this test process's),
with the embedded default's store (SQLite under the var folder)."""

from __future__ import annotations

import logging
import re
import signal
import stat
import subprocess
import sys
from pathlib import Path

import openai
import pytest

from llmgw_site import owner_only
from tests.harness.modes import (
    assert_owner_only,
    everything_under,
    mode,
    run_from_a_shell,
    shell_argv,
)
from tests.harness.procs import REPO_ROOT, Proc, free_port, port_window
from tests.harness.store import process_env
from tests.harness.waits import wait_until

# The tests that start llmgw's processes.
e2e = pytest.mark.e2e
slow = pytest.mark.timeout(300)


def embedded_env(var: Path, **extra: str) -> dict[str, str]:
    """``make run``'s environment: nothing set but the var folder, so the store is SQLite in it."""
    env = process_env(LLMGW_VAR_DIR=str(var), LLMGW_WEB_PROCESSES="1", **extra)
    for name in ("DATABASE_URL", "REDIS_URL", "LLMGW_CA_DIR", "LLMGW_USAGE_JOURNAL_DIR"):
        env.pop(name, None)
    return env


def start_run(var: Path, env: dict[str, str], *flags: str) -> tuple[Proc, str]:
    """``manage.py run`` from a shell, until it has printed its banner; the banner."""
    port = free_port()
    argv = shell_argv(sys.executable, "manage.py", "run", "--port", str(port), *flags)
    proc = Proc("run", argv, var.parent / "logs", env, port=port).start()
    banner = wait_until(
        lambda: "Ctrl-C stops everything" in (text := proc.log()) and text,
        what="the banner",
        logs=[proc],
    )
    return proc, banner


def stop(proc: Proc) -> None:
    if proc.running():
        proc.signal(signal.SIGINT)
        proc.wait(120)


def manage(env: dict[str, str], *args: str) -> str:
    done = run_from_a_shell([sys.executable, "manage.py", *args], env, REPO_ROOT)
    assert done.returncode == 0, done.stderr
    return done.stdout


@e2e
@slow
def test_everything_make_run_writes_is_owner_only_from_a_shell_with_umask_022(
    tmp_path: Path,
) -> None:
    var = tmp_path / "var"
    env = embedded_env(var, LLMGW_PORT_RANGE="{}-{}".format(*port_window()))
    proc, banner = start_run(var, env)
    try:
        key = re.search(r"API key:\s+(\S+)", banner)
        model = re.search(r'"model": "([^"]+)"', banner)
        assert key and model, banner
        client = openai.OpenAI(
            base_url=f"{proc.url}/v1", api_key=key.group(1), max_retries=0, timeout=120
        )

        def answered() -> bool:
            # The local agent may not have registered yet: the model then cannot start.
            try:
                reply = client.chat.completions.create(
                    model=model.group(1), messages=[{"role": "user", "content": "Hello"}]
                )
            except openai.APIStatusError:
                return False
            return bool(reply.choices[0].message.content)

        wait_until(answered, timeout=180, what="the demo model's answer", logs=[proc])
        # The usage journal of the web process that answered, beside the store it fills.
        assert list((var / "usage").glob("*.journal")), everything_under(var)
        manage(env, "init_ca")
        manage(env, "issue_node_cert", "n1")

        written = everything_under(var)
        for expected in (
            "llmgw.sqlite3",
            "llmgw.sqlite3-wal",
            "llmgw.sqlite3-shm",
            "broker",
            "agent/token",
            "reconciler.lock",
            "ca/ca.key",
            "ca/ca.pem",
            "ca/server.pem",
            "ca/nodes/n1/n1.key",
            "ca/nodes/n1/n1.pem",
        ):
            assert expected in written, sorted(written)
        assert any(name.startswith("prometheus/") for name in written), sorted(written)
        assert_owner_only(var)
    finally:
        stop(proc)
    assert_owner_only(var)  # and what stopping wrote


@e2e
@slow
def test_make_run_closes_a_var_folder_an_older_version_left_open_and_says_what_it_closed(
    tmp_path: Path,
) -> None:
    var = tmp_path / "var"
    (var / "usage").mkdir(parents=True)
    (var / "secret_key").write_text("an older run's key\n")
    (var / "usage" / "dead-letter.jsonl").write_text("{}\n")
    for path, loose in ((var, 0o755), (var / "usage", 0o755), (var / "secret_key", 0o644)):
        path.chmod(loose)
    (var / "usage" / "dead-letter.jsonl").chmod(0o644)
    env = embedded_env(var, LLMGW_STATIC_ENDPOINTS="e1=http://127.0.0.1:9/v1=m")
    proc, banner = start_run(var, env, "--router-only")
    try:
        assert_owner_only(var)
        assert mode(var) == 0o700
        assert mode(var / "secret_key") == 0o600
        assert mode(var / "usage" / "dead-letter.jsonl") == 0o600
        (line,) = [line for line in banner.splitlines() if "owner-only" in line]
        assert f"{var} (was 0755)" in line
        assert f"{var / 'secret_key'} (was 0644)" in line
        assert f"{var / 'usage' / 'dead-letter.jsonl'} (was 0644)" in line
    finally:
        stop(proc)
    second, banner = start_run(var, env, "--router-only")
    stop(second)
    assert "owner-only" not in banner  # nothing left to close: nothing said


@e2e
@slow
def test_the_makefiles_run_writes_its_secret_key_owner_only_from_a_shell_with_umask_022(
    tmp_path: Path,
) -> None:
    # The recipe as make would run it (make -n prints it and runs nothing), in a fresh folder.
    recipe = subprocess.run(
        ["make", "-s", "-n", "run", f"PY={sys.executable}"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    (line,) = [
        line for line in recipe.splitlines() if "secret_key" in line and "manage" not in line
    ]
    done = run_from_a_shell(["/bin/bash", "-c", line], process_env(), tmp_path)
    assert done.returncode == 0, done.stderr
    assert mode(tmp_path / "var") == 0o700
    assert mode(tmp_path / "var" / "secret_key") == 0o600
    assert len((tmp_path / "var" / "secret_key").read_text().strip()) >= 50


def test_closing_the_var_folder_never_follows_a_link_out_of_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A link in the var folder (planted, or an operator's) is not a way to change the modes of
    what lies outside it."""
    var, outside = tmp_path / "var", tmp_path / "outside"
    (outside / "folder").mkdir(parents=True)
    for path in (outside / "file", outside / "folder" / "file", var / "store"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("x")
        path.chmod(0o644)
    for folder in (var, outside / "folder"):
        folder.chmod(0o755)
    (var / "to-a-file").symlink_to(outside / "file")
    (var / "to-a-folder").symlink_to(outside / "folder")

    with caplog.at_level(logging.WARNING, logger="llmgw_site.owner_only"):
        closed = owner_only.tighten([var])
    assert closed == [(var, 0o755), (var / "store", 0o644)]
    assert (mode(var), mode(var / "store")) == (0o700, 0o600)
    assert mode(outside / "file") == mode(outside / "folder" / "file") == 0o644
    assert mode(outside / "folder") == 0o755
    (record,) = caplog.records
    assert record.getMessage() == (
        f"made owner-only what other local users could open: {var} (was 0755), "
        f"{var / 'store'} (was 0644)"
    )
    assert owner_only.tighten([var]) == []  # nothing left to close


def test_a_store_outside_the_var_folder_is_closed_with_its_wal_and_journal(
    tmp_path: Path,
) -> None:
    store = tmp_path / "elsewhere" / "llmgw.sqlite3"
    files = owner_only.store_files({"ENGINE": "django.db.backends.sqlite3", "NAME": str(store)})
    assert [path.name for path in files] == [
        "llmgw.sqlite3",
        "llmgw.sqlite3-wal",
        "llmgw.sqlite3-shm",
        "llmgw.sqlite3-journal",
    ]
    assert owner_only.store_files({"ENGINE": "django.db.backends.postgresql", "NAME": "x"}) == []
    store.parent.mkdir()
    for path in files[:2]:
        path.write_text("x")
        path.chmod(0o644)
    closed = owner_only.tighten(files)  # the -shm and -journal do not exist: nothing to do
    assert sorted(path.name for path, _ in closed) == ["llmgw.sqlite3", "llmgw.sqlite3-wal"]
    assert mode(files[0]) == mode(files[1]) == 0o600


def test_closing_a_store_never_opens_its_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``manage.py run`` tightens the store in a process that may hold SQLite connections to
    it (tests call it in-process): POSIX record locks go with the first close of any descriptor
    of the file, so opening and closing the store there dropped that process's SQLite locks, and
    the next writer of another process corrupted what it read ("disk I/O error"). Files are
    changed by name, never opened."""
    import os

    from llmgw_site import owner_only

    store = tmp_path / "store.sqlite3"
    for name in ("store.sqlite3", "store.sqlite3-wal", "store.sqlite3-shm"):
        (tmp_path / name).write_bytes(b"x")
        (tmp_path / name).chmod(0o644)
    opened: list[str] = []
    real_open = os.open

    def watching_open(path: object, *args: object, **kwargs: object) -> int:
        opened.append(str(path))
        return real_open(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "open", watching_open)
    closed = owner_only.tighten(
        owner_only.store_files({"ENGINE": "django.db.backends.sqlite3", "NAME": str(store)})
    )
    assert {p.name for p, _ in closed} == {
        "store.sqlite3",
        "store.sqlite3-wal",
        "store.sqlite3-shm",
    }
    assert not [p for p in opened if "store.sqlite3" in p]
    assert all(stat.S_IMODE((tmp_path / p.name).stat().st_mode) == 0o600 for p, _ in closed)

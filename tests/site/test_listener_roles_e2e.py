"""A listener's role is the socket a connection arrived on, not its port (issue 28, item 6).

Two listeners on one port at two addresses (all of 127/8 is loopback here: the client role on
127.0.0.2, the admin on 127.0.0.1, as ``--host 10.0.0.5 --port 8000`` beside ``--admin-listen
127.0.0.1:8000`` would be): a real web process, started the way ``manage.py run`` starts it,
serves the admin only at the admin's address. ``manage.py run`` itself refuses two roles on one
port, naming the flags."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from llmgw_site import launcher
from tests.harness.procs import REPO_ROOT, Proc, free_port
from tests.harness.store import process_env

pytestmark = [pytest.mark.e2e]

CLIENT_ADDRESS = "127.0.0.2"
ADMIN_ADDRESS = "127.0.0.1"
OUR_404 = b'{"error":"not found"}'


@dataclass
class Web:
    proc: Proc
    port: int

    def get(self, address: str, path: str) -> httpx.Response:
        # The first admin page imports the admin (seconds on a loaded machine).
        return httpx.get(f"http://{address}:{self.port}{path}", timeout=60)


@pytest.fixture(scope="module")
def web(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Web]:
    tmp = tmp_path_factory.mktemp("listener-roles")
    env = process_env(
        LLMGW_VAR_DIR=str(tmp),
        DATABASE_URL=f"sqlite:///{tmp / 'web.sqlite3'}",
        # Both addresses are this deployment's names, as a public one would be in production.
        LLMGW_ALLOWED_HOSTS=f"{CLIENT_ADDRESS},{ADMIN_ADDRESS}",
    )
    env.pop("REDIS_URL", None)
    migrated = subprocess.run(
        [sys.executable, str(REPO_ROOT / "manage.py"), "migrate", "--verbosity", "0"],
        env=env,
        capture_output=True,
        text=True,
        check=False,
        cwd=REPO_ROOT,
    )
    assert migrated.returncode == 0, migrated.stderr
    admin = launcher.bind_listener(ADMIN_ADDRESS, 0)
    port = int(admin.getsockname()[1])
    client = launcher.bind_listener(CLIENT_ADDRESS, port)
    fds = {"client": client.fileno(), "admin": admin.fileno()}
    proc = Proc("web", launcher.web_command(fds), tmp / "logs", env, port=port)
    try:
        proc.start(pass_fds=tuple(fds.values()))
    finally:
        client.close()
        admin.close()
    live = Web(proc, port)
    try:
        proc.wait_answering("/healthz")
        yield live
    finally:
        proc.stop()


def test_the_admin_is_not_served_at_the_client_address_of_a_shared_port(web: Web) -> None:
    for path in ("/admin/login/", "/admin/", "/account/"):
        answer = web.get(CLIENT_ADDRESS, path)
        assert (answer.status_code, answer.content) == (404, OUR_404), path
    assert web.get(CLIENT_ADDRESS, "/healthz").status_code == 200
    # A Host header naming the admin's address changes nothing: the socket decides.
    spoofed = httpx.get(
        f"http://{CLIENT_ADDRESS}:{web.port}/admin/login/",
        headers={"Host": f"{ADMIN_ADDRESS}:{web.port}"},
        timeout=60,
    )
    assert (spoofed.status_code, spoofed.content) == (404, OUR_404)


def test_the_admin_is_served_at_its_own_address_and_v1_is_not(web: Web) -> None:
    login = web.get(ADMIN_ADDRESS, "/admin/login/")
    assert login.status_code == 200
    assert b'name="password"' in login.content
    answer = web.get(ADMIN_ADDRESS, "/v1/models")
    assert (answer.status_code, answer.content) == (404, OUR_404)


def run_command(tmp: Path, *flags: str) -> Proc:
    env = process_env(LLMGW_VAR_DIR=str(tmp), DATABASE_URL=f"sqlite:///{tmp / 'run.sqlite3'}")
    env.pop("REDIS_URL", None)
    argv = [sys.executable, "manage.py", "run", "--no-agent", "--web-processes", "1", *flags]
    return Proc("run", argv, tmp / "logs", env).start()


def test_run_refuses_two_roles_on_one_port_and_names_the_flags(tmp_path: Path) -> None:
    port = free_port()
    run = run_command(
        tmp_path, "--host", CLIENT_ADDRESS, "--port", str(port), "--admin-listen",
        f"{ADMIN_ADDRESS}:{port}",
    )  # fmt: skip
    try:
        code = run.wait(120)
    finally:
        run.stop()
    assert code != 0
    said = run.log()
    assert "--port" in said and "--admin-listen" in said and str(port) in said, said
    # Refused before anything was bound or started.
    with socket.socket() as probe:
        assert probe.connect_ex((CLIENT_ADDRESS, port)) != 0
    assert not (tmp_path / "run.sqlite3").exists()

"""``manage.py run`` with its agent listeners, as an operator sets up a secured node plane:
``init_ca``, ``issue_node_cert``, ``LLMGW_AGENT_GRPC_REQUIRE_IDENTITY`` on (certificates on the
gRPC listener; WebSocket streams keep node tokens), ``--agent-listen`` (the gRPC listener, a
child of ``run``) and ``--agent-ws-listen`` (the agents' WebSocket streams moved off the client
port). A real agent dials the gRPC listener with its node certificate, is
served its desired state (the demo model is placed on it and answers the ``openai`` client
through the gateway); once its certificate is revoked its open stream ends and the certificate
is refused. A SIGTERM to ``run`` stops the gRPC listener with the rest. No Redis: nudges stay
inside each process, so the gRPC listener learns of changes at its resyncs."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import openai
import pytest
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from agents import grpc_wire
from agents.agent_pb2 import AgentFrame
from agents.protocol.codec import encode
from agents.protocol.messages import Hello
from agents.protocol.vocabulary import NODE_HEADER, STREAM_PATH
from tests.harness.procs import (
    REPO_ROOT,
    Proc,
    alive,
    connections_to,
    free_port,
    port_open,
    port_window,
)
from tests.harness.store import process_env
from tests.harness.waits import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

NODE = "g1"


@dataclass
class Plane:
    run: Proc
    port: int
    grpc_port: int
    ws_port: int
    key: str
    env: dict[str, str]
    tls: Path
    agent: Proc | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def manage(self, *args: str) -> str:
        done = subprocess.run(
            [sys.executable, str(REPO_ROOT / "manage.py"), *args],
            env=self.env,
            capture_output=True,
            text=True,
            check=False,
            cwd=REPO_ROOT,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout


def child_pids(pid: int) -> set[int]:
    found = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True, check=False)
    return {int(p) for p in found.stdout.split()}


def cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


@pytest.fixture(scope="module")
def plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Plane]:
    tmp = tmp_path_factory.mktemp("agent-listeners")
    port, grpc_port, ws_port = free_port(), free_port(), free_port()
    env = process_env(
        LLMGW_VAR_DIR=str(tmp),
        LLMGW_WEB_PROCESSES="1",
        LLMGW_CA_DIR=str(tmp / "ca"),
        LLMGW_AGENT_GRPC_REQUIRE_IDENTITY="true",
        LLMGW_AGENT_RESYNC_INTERVAL="2",
        LLMGW_RECONCILE_INTERVAL="0.5",
        LLMGW_SHUTDOWN_GRACE="5",
        DATABASE_URL=f"sqlite:///{tmp / 'run.sqlite3'}",
    )
    env.pop("REDIS_URL", None)
    plane = Plane(
        Proc("run", [], tmp / "logs", env), port, grpc_port, ws_port, "", env, tmp / "tls"
    )
    plane.manage("migrate", "--verbosity", "0")
    plane.manage("init_ca")
    plane.manage("issue_node_cert", NODE, "--output-dir", str(plane.tls))
    command = [
        sys.executable, "manage.py", "run", "--no-agent", "--port", str(port),
        "--agent-listen", f"127.0.0.1:{grpc_port}", "--agent-ws-listen", f"127.0.0.1:{ws_port}",
    ]  # fmt: skip
    plane.run = Proc("run", command, tmp / "logs", env, port=port).start()
    low, high = port_window(set())
    agent_argv = [
        sys.executable, "-m", "agents", "--transport", "grpc", "--node", NODE,
        "--control-plane", f"grpcs://127.0.0.1:{grpc_port}",
        "--tls-ca", str(plane.tls / "ca.pem"), "--tls-cert", str(plane.tls / f"{NODE}.pem"),
        "--tls-key", str(plane.tls / f"{NODE}.key"),
        "--simulate-gpus", "1x80GiB", "--port-range", f"{low}-{high}",
        "--advertise-address", "127.0.0.1", "--engine-host", "127.0.0.1",
        "--state-dir", str(tmp / "agent" / "state"), "--weights-dir", str(tmp / "agent" / "w"),
        # A refused or revoked agent must not come back within this module: what it sees
        # after the revocation is the stream's end, not a retry.
        "--backoff-base", "600", "--backoff-max", "1200", "--stop-grace", "3",
    ]  # fmt: skip
    agent_env = {
        k: v for k, v in env.items() if not k.startswith(("DATABASE_", "LLMGW_", "SECRET_"))
    }
    try:
        found = wait_until(
            lambda: re.search(r"API key:\s+(\S+)", plane.run.log()),
            what="the banner",
            logs=[plane.run],
        )
        plane.key = found.group(1)
        wait_until(lambda: port_open(port) and port_open(grpc_port), what="client and gRPC ports")
        plane.agent = Proc("agent", agent_argv, tmp / "logs", agent_env).start()
        yield plane
    finally:
        if plane.agent is not None:
            plane.agent.stop()
        plane.run.stop(timeout=60)


def grpc_hello(plane: Plane) -> grpc.StatusCode | None:
    """Open a stream with the node's certificate and say hello: None when the listener welcomes
    it, else the status it ended the call with."""
    credentials = grpc.ssl_channel_credentials(
        (plane.tls / "ca.pem").read_bytes(),
        (plane.tls / f"{NODE}.key").read_bytes(),
        (plane.tls / f"{NODE}.pem").read_bytes(),
    )
    hello = grpc_wire.to_frame(Hello(node=NODE, boot_id="probe", agent_version="t"), AgentFrame)
    with grpc.secure_channel(f"127.0.0.1:{plane.grpc_port}", credentials) as channel:
        call = channel.stream_stream(
            grpc_wire.METHOD,
            request_serializer=grpc_wire.serialize,
            response_deserializer=grpc_wire.parse_server_frame,
        )
        try:
            for frame in call(iter([hello]), timeout=120):
                if frame.WhichOneof("message") == "welcome":
                    return None
        except grpc.RpcError as ended:
            return ended.code()
    return grpc.StatusCode.OK


def test_a_certified_grpc_agent_is_served_and_its_model_answers_through_the_gateway(
    plane: Plane,
) -> None:
    assert plane.agent is not None
    client = openai.OpenAI(base_url=plane.url + "/v1", api_key=plane.key, max_retries=0, timeout=90)

    def answered() -> str | None:
        try:
            reply = client.chat.completions.create(
                model="demo", messages=[{"role": "user", "content": "Hello"}], max_tokens=4
            )
        except openai.APIError:
            return None  # the model is still being placed and started
        return reply.choices[0].message.content

    content = wait_until(
        answered, timeout=180, what="demo answers from the agent's engine", logs=[plane.run]
    )
    assert content
    # The engine is the agent's: a child of the agent process, in its port window.
    assert child_pids(plane.agent.pid)
    assert connections_to(plane.agent.pid, plane.grpc_port)


def test_the_agent_websocket_path_is_served_only_on_its_own_port(plane: Plane) -> None:
    token = plane.manage("issue_node_token", "w1").strip()
    headers = {NODE_HEADER: "w1", "Authorization": f"Bearer {token}"}
    with pytest.raises(InvalidStatus) as refused:
        connect(f"ws://127.0.0.1:{plane.port}{STREAM_PATH}", additional_headers=headers)
    # Refused before the handshake completes (a WebSocket closed before it is accepted is an
    # HTTP 403); the same credentials are welcomed on the agent port below, so this is the
    # client port refusing the path, not the token.
    assert refused.value.response.status_code == 403
    with connect(
        f"ws://127.0.0.1:{plane.ws_port}{STREAM_PATH}", additional_headers=headers, open_timeout=30
    ) as ws:
        ws.send(encode(Hello(node="w1", boot_id="probe", agent_version="t")))
        assert '"welcome"' in str(ws.recv(timeout=30))
    # An agent gone while the control plane still writes to it (hello, then away before the
    # welcome): the stream ends there; the last test finds no failure in the run's log.
    for _ in range(3):
        with connect(
            f"ws://127.0.0.1:{plane.ws_port}{STREAM_PATH}", additional_headers=headers
        ) as ws:
            ws.send(encode(Hello(node="w1", boot_id="probe", agent_version="t")))


def test_a_revoked_certificate_ends_the_open_stream_and_is_refused(plane: Plane) -> None:
    assert plane.agent is not None
    pid = plane.agent.pid
    wait_until(lambda: connections_to(pid, plane.grpc_port), what="the agent's open stream")
    plane.manage("revoke_node_cert", NODE)
    # Its backoff is 600 s: a connection gone is the revoked stream ended, not a retry.
    wait_until(
        lambda: not connections_to(pid, plane.grpc_port),
        what="the revoked stream ended",
        logs=[plane.run, plane.agent],
    )
    assert grpc_hello(plane) == grpc.StatusCode.UNAUTHENTICATED
    assert alive(pid)


def test_sigterm_stops_run_and_its_grpc_listener_cleanly(plane: Plane) -> None:
    listener = [p for p in child_pids(plane.run.pid) if b"serve_agents_grpc" in cmdline(p)]
    assert len(listener) == 1
    assert plane.run.stop(timeout=60) == 0
    assert not alive(listener[0])
    assert not port_open(plane.grpc_port)
    assert "Traceback" not in plane.run.log()

"""Fixtures of the agents' tests: simulators started in the test's own event loop."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest_asyncio

from agents.sim import SimConfig, SimServer, serve

SIM_MODEL = "sim-model"

Starter = Callable[..., Awaitable[SimServer]]


@pytest_asyncio.fixture
async def start_sim() -> AsyncIterator[Starter]:
    """Start in-process simulators on free ports; all are closed after the test."""
    servers: list[SimServer] = []

    async def start(**overrides: Any) -> SimServer:
        server = await serve(SimConfig(model=SIM_MODEL, **overrides))
        servers.append(server)
        return server

    yield start
    for server in servers:
        await server.close(grace=0)

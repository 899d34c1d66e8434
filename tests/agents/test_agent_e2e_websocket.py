"""Agents end to end over WebSocket with node tokens: the cases of tests/agents/agent_e2e.py
on a cluster of this module's own."""

from tests.agents.agent_e2e import *  # noqa: F403 (the cases, their fixtures and marks)
from tests.harness.cluster import WEBSOCKET

TRANSPORT = WEBSOCKET

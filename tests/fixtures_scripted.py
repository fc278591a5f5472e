"""The scripted OpenAI-compatible server (agent/testing/scripted_server.py) as a fixture."""

from __future__ import annotations

import pytest

from agent.testing.scripted_server import ScriptedServer

__all__ = ["ScriptedServer", "scripted_server"]


@pytest.fixture
def scripted_server():
    server = ScriptedServer()
    yield server
    server.close()

"""ReplayPolicy: the successful calls of a recorded world state, in order, with exact parameters."""

from __future__ import annotations

from typing import Any

import orjson

from agent.policies.base import Decision, ToolCall
from agent.record.world_state import WorldState


class ReplayPolicy:
    def __init__(self, recorded: WorldState):
        self.calls = [e for e in recorded.entries if e.status == "ok"]
        self._next = 0

    def decide(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]], world: WorldState
    ) -> Decision:
        if self._next >= len(self.calls):
            return Decision(text="the recording has no further calls", finish_reason="stop")
        e = self.calls[self._next]
        self._next += 1
        return Decision([ToolCall(f"replay-{e.step}", e.tool, orjson.dumps(e.params).decode())])

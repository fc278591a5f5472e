"""The scanpy tools the agent can call: the ``@tool`` functions of the modules that
``agent.tool_declarations.TOOL_MODULES`` names, in its order (that of a standard analysis)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from agent.registry import ToolRegistry, declared_tools
from agent.tool_declarations import TOOL_MODULES
from agent.tools.session import Session

TOOLS: list[Callable[..., dict[str, Any]]] = declared_tools(
    f"agent.tools.{name}" for name in TOOL_MODULES
)


def build_registry() -> ToolRegistry:
    return ToolRegistry(TOOLS)


__all__ = ["TOOLS", "Session", "build_registry"]

"""What a policy returns, and the one method every policy has."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from agent.record.world_state import WorldState

DEFAULT_MAX_TOKENS = 1024  # a reply's budget when neither the run nor the model's family sets one


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, exactly as the decider produced it


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int | None = None
    reasoning_tokens: int | None = None  # of completion_tokens, spent thinking (server's count)


@dataclass(frozen=True)
class Timing:
    """Where a request's time went, as the server measured it (vLLM's per-request metrics):
    waiting for a slot, prefill up to the first token, decoding the rest. None: not reported."""

    queue_seconds: float | None = None
    ttft_seconds: float | None = None  # scheduled -> first token: prefill, queue excluded
    decode_seconds: float | None = None  # first token -> last token


@dataclass
class Decision:
    calls: list[ToolCall] = field(default_factory=list)
    text: str | None = None
    usage: Usage | None = None
    finish_reason: str | None = None
    # Waits for the decider (e.g. a server that died and came back), for the record's meta: the
    # loop writes them; a policy never edits the record itself.
    outages: list[dict[str, Any]] = field(default_factory=list)
    # The model's thinking, kept apart from the text: the history sends it back only as the
    # family's template renders it (ContextManager.history_reasoning).
    reasoning: str | None = None
    timing: Timing | None = None
    # whether the thinking reached the request's thinking_token_budget (None: no budget sent, or
    # the server did not count reasoning tokens)
    thinking_budget_hit: bool | None = None


class PromptTooLong(Exception):
    """The server refused the prompt as longer than its context; carries its token count if known."""

    def __init__(self, message: str, prompt_tokens: int | None = None):
        super().__init__(message)
        self.prompt_tokens = prompt_tokens


class Policy(Protocol):
    def decide(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]], world: WorldState
    ) -> Decision: ...

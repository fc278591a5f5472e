"""Context engineering: token counting that calibrates itself, the budget, and truncation.

Prompt layout (cache-aware): [system: fixed instructions] + tool schemas (the chat template puts
them right after the system text) + history (grows at the end) + [user: rendered world state].
Everything before the world state is byte-identical from one request to the next until a
truncation, so the server's prefix cache serves it; the world state changes every step, so it sits
last, where it invalidates nothing that follows. Putting it in the first system message would force
the whole tool-schema block to be prefilled again on every step (Qwen-style templates render the
system text before the tools). Truncation cuts down to a fraction of the budget at once
(hysteresis), so the prefix breaks once per many steps, not on every step.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from agent.policies.base import Decision, Usage
from agent.registry import Outcome

Message = dict[str, Any]

# Per-message framing tokens of chat templates (role markers, separators): a small constant.
MESSAGE_OVERHEAD = 6


class ContextOverflow(Exception):
    """What must stay in the prompt does not fit the context even after truncation."""


def char_estimate(text: str) -> int:
    # JSON-heavy agent prompts run at ~3 characters per token with BPE vocabularies; the
    # calibration factor below corrects this from the server's own counts.
    return math.ceil(len(text) / 3.0)


def tokenizer_estimate(model_path: str | Path | None) -> Callable[[str], int] | None:
    """Exact counts from the model's own tokenizer.json when it is on disk, else None."""
    path = Path(model_path) / "tokenizer.json" if model_path else None
    if path is None or not path.is_file():
        return None
    from tokenizers import Tokenizer  # installed with transformers/vLLM; only needed here

    tok = Tokenizer.from_file(str(path))
    return lambda text: len(tok.encode(text, add_special_tokens=False).ids)


class TokenCounter:
    """Local estimate x a correction factor learnt from the server's usage; the factor only rises."""

    def __init__(self, encode: Callable[[str], int] | None = None):
        self._encode = encode or char_estimate
        self._cache: dict[str, int] = {}
        self._by_message: dict[int, tuple[Message, int]] = {}  # id -> (message, raw count)
        self.factor = 1.0

    def raw(self, text: str) -> int:
        n = self._cache.get(text)
        if n is None:
            n = self._cache[text] = self._encode(text)
            if len(self._cache) > 4096:  # bounded: old history strings are never asked for again
                self._cache.pop(next(iter(self._cache)))
        return n

    def raw_message(self, m: Message) -> int:
        """Counted once per message object: the history's messages are never changed in place
        (truncation replaces them), and each is counted several times per step."""
        hit = self._by_message.get(id(m))
        if hit is not None and hit[0] is m:
            return hit[1]
        text = m.get("content") or ""
        if m.get("tool_calls"):
            text += orjson.dumps(m["tool_calls"]).decode()
        n = self._by_message[id(m)] = (m, self.raw(text) + MESSAGE_OVERHEAD)
        if len(self._by_message) > 4096:
            self._by_message.pop(next(iter(self._by_message)))
        return n[1]

    def raw_prompt(self, messages: list[Message], tools: list[dict[str, Any]]) -> int:
        return sum(self.raw_message(m) for m in messages) + self.raw(orjson.dumps(tools).decode())

    def scaled(self, raw: int) -> int:
        return math.ceil(raw * self.factor)

    def calibrate(self, raw_estimate: int, actual: int) -> None:
        """Learn from the server's count for the exact prompt that was sent (never lowers)."""
        if raw_estimate > 0 and actual > 0:
            self.factor = max(self.factor, actual / raw_estimate)


@dataclass
class ContextManager:
    system_prompt: str
    tools: list[dict[str, Any]]
    context_limit: int
    completion_reserve: int = 1024
    safety_margin: int = 256
    keep_ratio: float = 0.7
    counter: TokenCounter = field(default_factory=TokenCounter)
    history: list[Message] = field(default_factory=list)
    truncations: int = 0
    last: dict[str, int] = field(default_factory=dict)
    _sent_raw: int = 0

    def budget(self, world_text: str) -> int:
        """available_history = limit - tool schemas - system (instructions + world state) - reserves."""
        fixed = self.counter.scaled(
            self.counter.raw(orjson.dumps(self.tools).decode())
            + self.counter.raw_message({"content": self.system_prompt})
            + self.counter.raw_message({"content": world_text})
        )
        return self.context_limit - fixed - self.completion_reserve - self.safety_margin

    def prompt(self, world_text: str) -> list[Message]:
        """The messages to send now: truncates the history first if it is over budget."""
        budget = self.budget(world_text)
        if budget <= 0:
            raise ContextOverflow(
                f"context limit {self.context_limit} leaves no room for history after tool schemas, "
                f"instructions, world state and the completion reserve {self.completion_reserve}"
            )
        removed = truncate(self.history, self.counter, budget, self.keep_ratio)
        self.truncations += removed > 0
        messages = [
            {"role": "system", "content": self.system_prompt},
            *self.history,
            {"role": "user", "content": world_text},
        ]
        self._sent_raw = self.counter.raw_prompt(messages, self.tools)
        self.last = {
            "budget": budget,
            "history_tokens": self.counter.scaled(sum(map(self.counter.raw_message, self.history))),
            "estimated_prompt_tokens": self.counter.scaled(self._sent_raw),
            "truncated_messages": removed,
        }
        return messages

    def observe(self, usage: Usage | None) -> None:
        if usage is not None:
            self.last["estimate_error"] = self.last["estimated_prompt_tokens"] - usage.prompt_tokens
            self.counter.calibrate(self._sent_raw, usage.prompt_tokens)

    def observe_overflow(self, prompt_tokens: int | None) -> None:
        """The server refused the last prompt as too long: our estimate was low, so raise it."""
        self.counter.calibrate(self._sent_raw, prompt_tokens or 0)
        self.counter.factor *= 1.05  # strictly more, even when the server gave no count

    def add_user(self, text: str) -> None:
        self.history.append({"role": "user", "content": text})

    def add_decision(self, decision: Decision) -> None:
        message: Message = {"role": "assistant", "content": decision.text or ""}
        if decision.calls:
            message["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments},
                }
                for c in decision.calls
            ]
        self.history.append(message)

    def add_result(self, call_id: str, outcome: Outcome) -> None:
        content = orjson.dumps(outcome.for_model(), option=orjson.OPT_SERIALIZE_NUMPY).decode()
        self.history.append(
            {"role": "tool", "tool_call_id": call_id, "name": outcome.tool, "content": content}
        )


def _stub(m: Message, tokens: int) -> str:
    return orjson.dumps(
        {
            "truncated": True,
            "tool": m.get("name"),
            "removed_tokens": tokens,
            "note": "result removed to fit the context; the world state holds its key facts",
        }
    ).decode()


def truncate(
    history: list[Message], counter: TokenCounter, budget: int, keep_ratio: float = 0.7
) -> int:
    """Shrink `history` in place to <= keep_ratio x budget when it exceeds budget.

    First tool results, largest first, become stubs; then the oldest assistant turns (with their
    tool results) go. User messages and the latest assistant turn always stay. Returns how many
    messages were changed or removed; raises ContextOverflow when what must stay does not fit.
    """
    size = [counter.scaled(counter.raw_message(m)) for m in history]
    total = sum(size)
    if total <= budget:
        return 0
    goal = int(budget * keep_ratio)
    changed = 0
    tool_idx = sorted(
        (
            i
            for i, m in enumerate(history)
            if m["role"] == "tool" and not m["content"].startswith('{"truncated"')
        ),
        key=lambda i: -size[i],
    )
    for i in tool_idx:
        if total <= goal:
            break
        stub = _stub(history[i], size[i])
        new = counter.scaled(counter.raw_message({"content": stub}))
        if new >= size[i]:
            continue
        history[i] = {**history[i], "content": stub}
        total, size[i], changed = total - size[i] + new, new, changed + 1
    last_assistant = max((i for i, m in enumerate(history) if m["role"] == "assistant"), default=-1)
    i = 0
    while total > goal and i < last_assistant:
        if history[i]["role"] != "assistant":
            i += 1
            continue
        j = i + 1
        while j < len(history) and history[j]["role"] == "tool":
            j += 1
        total -= sum(size[i:j])
        changed += j - i
        del history[i:j], size[i:j]
        last_assistant -= j - i
    if total > budget:
        raise ContextOverflow(
            f"history needs {total} tokens after truncation but the budget is {budget}: the user "
            "messages and the latest turn alone exceed it; raise the context limit or shorten the brief"
        )
    return changed

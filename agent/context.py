"""Context engineering: token counting that calibrates itself, the budget, and truncation.

Prompt layout (append-only): [system: fixed instructions] + tool schemas (the chat template puts
them right after the system text) + [user: the full compact world-state rendering, then the brief]
+ history, in which every tool result starts with its entry's line of the world state
(``#step tool(params) -> numbers``). The rendering is written at the start and again at each cut
of the history; between cuts a step only appends its own turn, so every byte of a request before
the newest turn is the previous request's, and the server's prefix cache serves all of it. The
model reads the whole world state (the rendering plus the lines since), and no part of it is ever
truncated. Nothing changing sits in the system message: Qwen-style templates render the system
text before the tools, so a change there would make the whole tool-schema block be prefilled again.

Earlier thoughts (``history_reasoning``, the model family's catalogue field) go back as each
assistant turn's ``reasoning`` the way the family's template renders them: ``none`` drops them,
``current_turn`` keeps those after the last user message (a new user message, such as a nudge,
makes the template drop the ones before it, so they are dropped here too: the prompt changes
from the first of them, like at a cut), ``preserve`` keeps all (the policy sends the template's
switch). Kept thoughts count towards the budget like any other text.

Truncation is planned for growth: a cut goes down far enough to leave room for ``plan_steps``
steps of the run's own mean growth per step, so a cut (which re-prefills everything after the
instructions and tools) comes once per many steps, also on small contexts.
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
        text = (m.get("content") or "") + (m.get("reasoning") or "")
        if m.get("tool_calls"):
            text += orjson.dumps(m["tool_calls"]).decode()
        n = self._by_message[id(m)] = (m, self.raw(text) + MESSAGE_OVERHEAD)
        if len(self._by_message) > 4096:
            self._by_message.pop(next(iter(self._by_message)))
        return n[1]

    def scaled(self, raw: int) -> int:
        return math.ceil(raw * self.factor)

    def calibrate(self, raw_estimate: int, actual: int) -> None:
        """Learn from the server's count for the exact prompt that was sent (never lowers)."""
        if raw_estimate > 0 and actual > 0:
            self.factor = max(self.factor, actual / raw_estimate)


@dataclass
class ContextManager:
    """The messages of every request. Change ``history`` only through the ``add_*`` methods: the
    running token count of the history is kept by them (O(1) per step)."""

    system_prompt: str
    tools: list[dict[str, Any]]
    context_limit: int
    completion_reserve: int = 1024
    safety_margin: int = 256
    plan_steps: int = 40  # a cut leaves room for this many steps of the run's mean growth
    min_headroom: float = 0.3  # and for at least this share of the history budget
    history_reasoning: str = "none"  # none | current_turn | preserve (the family's catalogue field)
    counter: TokenCounter = field(default_factory=TokenCounter)
    history: list[Message] = field(default_factory=list)
    truncations: int = 0
    last: dict[str, int] = field(default_factory=dict)
    world_text: str | None = None  # the full world-state rendering, as of the last cut
    _sent_raw: int = 0
    _history_raw: int = 0  # raw tokens of `history`
    _raw_after: int | None = None  # raw tokens of `history` when the last prompt was built
    _grown: tuple[int, int] = (0, 0)  # raw tokens the history grew by, over how many steps
    _head: Message | None = None  # the first user message: world-state rendering and brief
    _lead: int = 0  # leading user messages of `history` (the brief) that `_head` holds
    _rewritten: int = 0  # raw tokens of history the last add_user changed (dropped thoughts)

    def budget(self, world_text: str) -> int:
        """available_history = limit - tool schemas - instructions - world-state rendering - reserves."""
        fixed = self._fixed_raw() + self.counter.raw_message({"content": world_text})
        return (
            self.context_limit
            - self.counter.scaled(fixed)
            - self.completion_reserve
            - self.safety_margin
        )

    def _fixed_raw(self) -> int:
        """Raw tokens of what every request starts with: the instructions and the tool schemas."""
        c = self.counter
        return c.raw_message({"content": self.system_prompt}) + c.raw(
            orjson.dumps(self.tools).decode()
        )

    def headroom(self, budget: int) -> int:
        """Tokens a cut frees below ``budget``: ``plan_steps`` of the mean step, at least
        ``min_headroom`` of the budget, at most all of it."""
        grown, steps = self._grown
        per_step = self.counter.scaled(grown / steps) if steps else 0
        return min(budget, max(self.plan_steps * per_step, int(self.min_headroom * budget)))

    def prompt(self, render: Callable[[], str]) -> list[Message]:
        """The messages to send now; ``render`` gives the world state's full rendering, asked for
        at the first prompt and at each cut. Cuts the history first if it is over budget."""
        if self._raw_after is not None and self._history_raw > self._raw_after:
            grown, steps = self._grown
            self._grown = (grown + self._history_raw - self._raw_after, steps + 1)
        if self.world_text is None:
            self.world_text, self._head = render(), None
        budget, removed, reprefilled = self._checked_budget(), 0, 0
        cut = self.counter.scaled(self._history_raw) > budget
        if cut:
            self.world_text, self._head = render(), None  # the cut changes all after it anyway
            budget = self._checked_budget()
            removed = truncate(self.history, self.counter, budget, budget - self.headroom(budget))
            self._history_raw = sum(map(self.counter.raw_message, self.history))
            self.truncations += 1
        lead = next(
            (i for i, m in enumerate(self.history) if m["role"] != "user"), len(self.history)
        )
        if self._head is None or lead != self._lead:
            texts = [self.world_text, *(m["content"] for m in self.history[:lead])]
            self._head, self._lead = {"role": "user", "content": "\n\n".join(texts)}, lead
        system = {"role": "system", "content": self.system_prompt}
        messages = [system, self._head, *self.history[lead:]]
        c = self.counter
        after = c.raw_message(self._head) + self._history_raw
        after -= sum(map(c.raw_message, self.history[:lead]))
        self._sent_raw, self._raw_after = self._fixed_raw() + after, self._history_raw
        if cut:  # everything after the instructions and tools is new to the server's cache
            reprefilled = c.scaled(after)
        elif self._rewritten:  # thoughts dropped: the history from the first of them is new
            reprefilled = c.scaled(self._rewritten)
        self._rewritten = 0
        self.last = {
            "budget": budget,
            "history_tokens": c.scaled(self._history_raw),
            "estimated_prompt_tokens": c.scaled(self._sent_raw),
            "truncated_messages": removed,
            "truncations": self.truncations,
            "reprefilled_tokens": reprefilled,
        }
        return messages

    def _checked_budget(self) -> int:
        budget = self.budget(self.world_text or "")
        if budget <= 0:
            raise ContextOverflow(
                f"context limit {self.context_limit} leaves no room for history after tool schemas, "
                f"instructions, world state and the completion reserve {self.completion_reserve}"
            )
        return budget

    def observe(self, usage: Usage | None) -> None:
        if usage is not None:
            self.last["estimate_error"] = self.last["estimated_prompt_tokens"] - usage.prompt_tokens
            self.counter.calibrate(self._sent_raw, usage.prompt_tokens)

    def observe_overflow(self, prompt_tokens: int | None) -> None:
        """The server refused the last prompt as too long: our estimate was low, so raise it."""
        self.counter.calibrate(self._sent_raw, prompt_tokens or 0)
        self.counter.factor *= 1.05  # strictly more, even when the server gave no count

    def _append(self, message: Message) -> None:
        self.history.append(message)
        self._history_raw += self.counter.raw_message(message)

    def add_user(self, text: str, line: str | None = None) -> None:
        """A user message; ``line``: the world-state line of the entry it stands beside (a reply
        without a call), first."""
        if self.history_reasoning == "current_turn":
            self._drop_thoughts()
        self._append({"role": "user", "content": f"{line}\n{text}" if line else text})

    def _drop_thoughts(self) -> None:
        """A new user turn: the template no longer renders the thoughts of the turns before it,
        so they leave the history too (as new message objects: messages are never changed in
        place), and the prompt changes from the first of them on."""
        first = next((i for i, m in enumerate(self.history) if m.get("reasoning")), None)
        if first is None:
            return
        c = self.counter
        self.history[first:] = [
            {k: v for k, v in m.items() if k != "reasoning"} if m.get("reasoning") else m
            for m in self.history[first:]
        ]
        self._history_raw = sum(map(c.raw_message, self.history))
        self._rewritten = sum(map(c.raw_message, self.history[first:]))

    def add_decision(self, decision: Decision) -> None:
        message: Message = {"role": "assistant", "content": decision.text or ""}
        if self.history_reasoning != "none" and decision.reasoning:
            message["reasoning"] = decision.reasoning  # vLLM hands it to the template
        if decision.calls:
            message["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments},
                }
                for c in decision.calls
            ]
        self._append(message)

    def add_result(self, call_id: str, outcome: Outcome, line: str | None = None) -> None:
        """A tool result; ``line``: its entry's world-state line, first, then the result's JSON."""
        content = orjson.dumps(outcome.for_model(), option=orjson.OPT_SERIALIZE_NUMPY).decode()
        self._append(
            {
                "role": "tool",
                "tool_call_id": call_id,
                "name": outcome.tool,
                "content": f"{line}\n{content}" if line else content,
            }
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


def truncate(history: list[Message], counter: TokenCounter, budget: int, goal: int) -> int:
    """Shrink `history` in place to <= ``goal`` (<= budget) when it exceeds budget.

    First tool results, largest first, become stubs; then the oldest assistant turns (with their
    tool results) go. User messages and the latest assistant turn always stay. Returns how many
    messages were changed or removed; raises ContextOverflow when what must stay does not fit.
    """
    size = [counter.scaled(counter.raw_message(m)) for m in history]
    total = sum(size)
    if total <= budget:
        return 0
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

"""A real model's replies forced to the reference recipe: the parse path of a model family, for real.

``ForcedPolicy`` asks the ReferencePolicy for the next call, spells it as the family's model would
write it (with a thinking block where the family thinks), and sends the real request through
``LLMPolicy`` with that text as a structured-outputs regex. The server's grammar makes the
random-weight model write exactly that text; the server's own tool-call and reasoning parsers
turn it back into an OpenAI tool call and a ``reasoning`` field, which is what the loop runs.
A logit bias on the family's marker tokens makes the model write each marker as its one token
(as a trained model does), not spelled out in bytes, since the parsers find markers by token id.
``pinned=True`` writes the call under vLLM's own tool grammar instead (the structural tag of the
production strict level, asked by a strict tool whose arguments are ``const``): no regex of ours.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from typing import Any

from agent.policies.base import Decision
from agent.policies.llm import LLMPolicy
from agent.policies.reference import ReferencePolicy
from agent.record.world_state import WorldState
from agent.registry import ToolRegistry

_REGEX_SPECIAL = set("\\.^$*+?{}[]|()")


def literal(text: str) -> str:
    """A regex matching exactly ``text`` (newlines as \\n, which the grammar compilers read)."""
    return "".join("\\n" if c == "\n" else "\\" + c if c in _REGEX_SPECIAL else c for c in text)


def _gemma4_value(v: Any) -> str:
    """A value as Gemma 4 writes it (vLLM's tool_chat_template_gemma4.jinja, format_argument)."""
    if isinstance(v, str):
        return f'<|"|>{v}<|"|>'
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, dict):
        return "{" + ",".join(f"{k}:{_gemma4_value(x)}" for k, x in v.items()) + "}"
    if isinstance(v, list):
        return "[" + ",".join(_gemma4_value(x) for x in v) + "]"
    return json.dumps(v)


def _xml_value(v: Any) -> str:
    """A parameter value as Qwen3-Coder writes it: strings bare, the rest as JSON."""
    return v if isinstance(v, str) else json.dumps(v)


Spell = Callable[[str, dict[str, Any]], str]

# How each family's model writes one call: the format its tool-call parser reads.
CALLS: dict[str, Spell] = {
    "hermes": lambda name, args: (
        f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"
    ),
    "qwen3_coder": lambda name, args: (
        f"<tool_call>\n<function={name}>\n"
        + "".join(f"<parameter={k}>\n{_xml_value(v)}\n</parameter>\n" for k, v in args.items())
        + "</function>\n</tool_call>"
    ),
    "gemma4": lambda name, args: (
        f"<|tool_call>call:{name}{{"
        + ",".join(f"{k}:{_gemma4_value(v)}" for k, v in args.items())
        + "}<tool_call|>"
    ),
    # Python literals: the pythonic parser reads the reply with ast
    "pythonic": lambda name, args: (
        f"[{name}(" + ", ".join(f"{k}={v!r}" for k, v in args.items()) + ")]"
    ),
    "llama3_json": lambda name, args: json.dumps({"name": name, "parameters": args}),
}

# How each thinking family's reply opens and closes a thought, after its generation prompt:
# Qwen3 writes <think> itself, Qwen3.5/3.6's prompt has opened it, Gemma 4 opens a channel.
THOUGHTS: dict[str, tuple[str, str]] = {
    "qwen3": ("<think>\n", "\n</think>\n\n"),
    "qwen3.5": ("", "\n</think>\n\n"),
    "gemma4": ("<|channel>thought\n", "<channel|>"),
}
# Families whose thinking is off unless the request asks for it.
THINKING_ON: dict[str, dict[str, Any]] = {
    "gemma4": {"chat_template_kwargs": {"enable_thinking": True}},
}


class ForcedPolicy:
    """The reference recipe's calls, written by a real model through a real server.

    ``family``: the model family (a key of THOUGHTS where it thinks); ``parser``: the server's
    tool-call parser (a key of CALLS); ``markers``: the family's marker token ids; ``endless``:
    how many first requests get an open-ended thought instead of a call, so that they are cut at
    max_tokens (the policy's recovery is then under test)."""

    def __init__(
        self,
        llm: LLMPolicy,
        registry: ToolRegistry,
        family: str,
        parser: str,
        markers: list[int],
        thinking: bool,
        endless: int = 0,
        pinned: bool = False,
        blanks: Iterable[int] = (),
    ):
        self.llm = llm
        # the grammar writes the whole reply, thought included; vLLM 0.32's thinking budget beside
        # it and the markers' logit bias derails the reply (a call cut at max_tokens, or a 500
        # when the budget forces its end), so forced replies carry no budget
        llm.thinking_budget = None
        # the grammar fixes every token, so sampling changes nothing; greedy also spares vLLM-CPU
        # a seeded request's generator, which it cannot rewind when a prefill is split (hybrid
        # models with prefix caching split every prompt): "CPU Generator does not use offset"
        llm.sampling = {**llm.sampling, "temperature": 0.0}
        self.reference = ReferencePolicy(registry)
        self.spell = CALLS[parser]
        self.thought = THOUGHTS[family] if thinking else None
        self.thinking_on = THINKING_ON.get(family, {}) if thinking else {}
        self.bias = {str(i): 100 for i in markers}
        self.endless = endless
        self.pinned = pinned
        # vLLM's JSON grammars allow any whitespace between values, which a trained model writes
        # sparingly and a random one without end: pinned calls are written without it
        self.pinned_bias = {**self.bias, **{str(i): -100 for i in blanks}}
        self.thoughts: list[str] = []  # what each forced reply thought, in order
        self.reasoning: list[str | None] = []  # what the server said each reply thought

    def decide(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]], world: WorldState
    ) -> Decision:
        planned = self.reference.decide(messages, tools, world)
        if not planned.calls:
            return planned
        call = planned.calls[0]
        if self.pinned:
            return self._pinned(messages, tools, world, call.name, json.loads(call.arguments))
        text = self.spell(call.name, json.loads(call.arguments))
        pattern = literal(text)
        thinks = self.thought and not self.llm.thinking_off
        if thinks:
            opener, closer = self.thought
            if self.endless > 0:  # a thought that never ends: the reply is cut at max_tokens
                self.endless -= 1
                pattern = literal(opener) + "(think ){1000}"
            else:
                thought = f"The recipe calls {call.name} next."
                self.thoughts.append(thought)
                pattern = literal(opener + thought + closer) + pattern
        body = {
            **(self.thinking_on if thinks else {}),
            "structured_outputs": {"regex": pattern},
            "logit_bias": self.bias,
        }
        decision = self.llm.decide(messages, tools, world, extra_body=body)
        self.reasoning.append(decision.reasoning)
        return decision

    def _pinned(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]],
        world: WorldState,
        name: str,
        args: dict[str, Any],
    ) -> Decision:
        """The call written under vLLM's own tool grammar (the structural tag the production strict
        level builds, here asked by a strict tool): the tool named, its arguments pinned by
        ``const``; no regex of ours, no thought."""
        schema = next(t for t in tools if t["function"]["name"] == name)
        pinned = {
            "type": "object",
            "properties": {k: {"const": v} for k, v in args.items()},
            "required": list(args),
            "additionalProperties": False,
        }
        tool = {**schema, "function": {**schema["function"], "parameters": pinned, "strict": True}}
        self.llm.tool_choice = {"type": "function", "function": {"name": name}}
        decision = self.llm.decide(
            messages, [tool], world, extra_body={"logit_bias": self.pinned_bias}
        )
        self.reasoning.append(decision.reasoning)
        return decision

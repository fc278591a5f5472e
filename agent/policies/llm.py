"""LLMPolicy: the next tool call from any OpenAI-compatible server (vLLM in production)."""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path
from typing import Any, TextIO

import openai

from agent.endpoint import EndpointError, KeyRefused, PolicyUnavailable, describe, read_endpoint
from agent.policies.base import (
    DEFAULT_MAX_TOKENS,
    Decision,
    PromptTooLong,
    Timing,
    ToolCall,
    Usage,
)
from agent.record.world_state import WorldState

_TOO_LONG = re.compile(r"maximum context length|context length|too long", re.I)
_TOKENS = re.compile(r"(\d+) (?:input )?tokens", re.I)
# sampling fields the OpenAI client takes as keywords; the others go in extra_body
_OPENAI_FIELDS = {"temperature", "top_p", "presence_penalty", "frequency_penalty", "seed"}
_CONTEXT_SLACK = 512  # tokens a raised budget leaves free for the prompt's growth
# The switch that makes a template render every earlier thought, not only the current turn's: the
# name Qwen3.6's and Gemma 4's templates both read (history_reasoning: preserve)
PRESERVE_THINKING = {"chat_template_kwargs": {"preserve_thinking": True}}
# How a tool call opens in the families' formats (hermes and qwen3_coder, gemma4, deepseek_v3,
# llama3_json); a pythonic call list opens with "[". A reply cut before its call closed keeps the
# opening in its content, which the parser could not read as a call.
_CALL_OPENINGS = ("<tool_call>", "<|tool_call>", "<｜tool▁calls▁begin｜>", '{"name"')


class ServerUnavailable(PolicyUnavailable):
    """The server stayed down or stalled past the configured wait."""


class LLMPolicy:
    """Chat completions with tools. The `openai` client retries connection errors, 408/429 and
    5xx with exponential backoff (`max_retries`) and gives up on a slow answer after `timeout`.

    With `endpoint_file`, a server that went away is looked for again through that file: a
    restarted `agent serve` writes it anew, with its new port and API key. A refused key (HTTP
    401/403) is final (KeyRefused), once the endpoint file has been read again for a new key.
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key: str = "EMPTY",
        timeout: float = 300.0,
        max_retries: int = 5,
        max_tokens: int = DEFAULT_MAX_TOKENS,
        seed: int = 0,
        sampling: dict[str, Any] | None = None,
        no_thinking: dict[str, Any] | None = None,
        thinking_off: bool = False,
        thinking_budget: int | None = None,
        preserve_thinking: bool = False,
        tool_choice: str | dict[str, Any] = "auto",
        outage_wait: float = 600.0,
        endpoint_file: str | Path | None = None,
        key_file: str | Path | None = None,
        extra_body: dict[str, Any] | None = None,
        log: TextIO = sys.stderr,
    ):
        """``sampling``: the family's recommended settings (temperature, top_p, top_k, min_p,
        presence_penalty...; greedy when not given); ``no_thinking``: the request fields that
        switch the family's thinking off (None: it has no switch); ``thinking_off``: use that switch
        from the first request; ``thinking_budget``: thinking tokens per reply at most (vLLM's
        ``thinking_token_budget``: the server then closes the thought itself; None: unbounded);
        ``preserve_thinking``: ask the template to render every earlier thought the history
        sends back (PRESERVE_THINKING); ``extra_body``: further vLLM request fields, e.g.
        {"ignore_eos": true}."""
        self.client = openai.OpenAI(
            base_url=base_url, api_key=api_key, timeout=timeout, max_retries=max_retries
        )
        self.model = model
        self.sampling: dict[str, Any] = {"temperature": 0.0, **(sampling or {}), "seed": seed}
        self.max_tokens = self.base_max_tokens = max_tokens
        self.no_thinking = no_thinking
        # from the start when asked, else once a reply was cut while thinking at the largest budget
        self.thinking_off = thinking_off
        self.thinking_budget = thinking_budget
        self.preserve_thinking = preserve_thinking
        self.extra_body = dict(extra_body or {})
        self.tool_choice = tool_choice
        self.outage_wait = outage_wait
        self.endpoint_file = Path(endpoint_file) if endpoint_file else None
        self.key_file = key_file  # where api_key came from, for the refusal's message
        self.log = log
        self._limit: int | None = None  # the server's context length, once asked
        self._sent_budget: int | None = None  # thinking_token_budget of the last request

    def context_limit(self) -> int | None:
        """The server's max_model_len (vLLM lists it with the model), if it says."""
        for m in self.client.models.list().data:
            if m.id == self.model:
                self._limit = getattr(m, "max_model_len", None) or (m.model_extra or {}).get(
                    "max_model_len"
                )
                return self._limit
        return None

    def request_settings(self, extra_body: dict[str, Any] | None = None) -> dict[str, Any]:
        """The sampling fields of the next request: the OpenAI ones as keywords, vLLM's own
        (top_k, min_p, chat_template_kwargs...) in ``extra_body``."""
        settings: dict[str, Any] = {"max_tokens": self.max_tokens}
        body = _merge(self.extra_body, extra_body or {})
        for key, value in self.sampling.items():
            if key in _OPENAI_FIELDS:
                settings[key] = value
            else:
                body[key] = value
        if self.preserve_thinking:
            body = _merge(body, PRESERVE_THINKING)
        if self.thinking_off and self.no_thinking:
            body = _merge(body, self.no_thinking)
        elif self.thinking_budget:
            body["thinking_token_budget"] = self.thinking_budget
        if body:
            settings["extra_body"] = body
        return settings

    def _recover_from_cut(self, prompt_tokens: int) -> str:
        """After a reply cut while thinking or inside a tool call: the next request gets twice the
        completion budget (as far as the context leaves room for), else the family's no-thinking
        switch; says which.
        Never more than that: a reply cut again without thinking is an ordinary failed step."""
        room = self._limit - prompt_tokens - _CONTEXT_SLACK if self._limit else 2 * self.max_tokens
        if min(2 * self.max_tokens, room) > self.max_tokens:
            self.max_tokens = min(2 * self.max_tokens, room)
            return f"next request: max_tokens {self.max_tokens}"
        if self.no_thinking and not self.thinking_off:
            self.thinking_off = True
            return f"next request: thinking off ({json.dumps(self.no_thinking)})"
        return "no larger budget fits the context and thinking cannot be switched off"

    def _follow_endpoint(self) -> bool:
        """Point the client at the server the endpoint file names now (a restart moves it and
        changes its key); True when that is another address or key."""
        if self.endpoint_file is None:
            return False
        try:
            ep = read_endpoint(self.endpoint_file)
        except EndpointError:  # not there (yet): a restarting server writes it once ready
            return False
        if ep.model != self.model:
            return False
        self.key_file = ep.key_file
        current = (str(self.client.base_url).rstrip("/"), self.client.api_key)
        if (ep.url.rstrip("/"), ep.api_key or "EMPTY") == current:
            return False
        self.client = self.client.with_options(base_url=ep.url, api_key=ep.api_key or "EMPTY")
        return True

    def _refused(
        self, error: openai.APIStatusError, what: str, outages: list[dict[str, Any]] | None = None
    ) -> KeyRefused:
        return KeyRefused(
            str(self.client.base_url).rstrip("/"),
            f"{what} answered {error.status_code}",
            self.key_file,
            self.endpoint_file,
            outages,
        )

    def _wait_for_server(self, error: Exception, world: WorldState) -> dict[str, Any]:
        """After the client's own retries failed: poll the server with bounded backoff until it
        answers again, or give up with a clear error once `outage_wait` seconds have passed.
        Returns the outage (step, error, seconds waited) for the record; ServerUnavailable
        carries it when the server did not come back."""
        start = time.monotonic()
        deadline, delay = start + self.outage_wait, 1.0
        print(
            f"server {self.client.base_url} unavailable at step {world.next_step} "
            f"({type(error).__name__}); waiting up to {self.outage_wait:.0f} s for it",
            file=self.log,
            flush=True,
        )
        outage = {"step": world.next_step, "error": f"{type(error).__name__}: {error}"[:300]}
        while time.monotonic() < deadline:
            time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(delay * 2, 15.0)
            self._follow_endpoint()
            try:
                self.client.with_options(max_retries=0, timeout=10).models.list()
            except (openai.AuthenticationError, openai.PermissionDeniedError) as e:
                # up, but refusing the key, even after the endpoint file (if any) was read again
                outage["waited_s"] = round(time.monotonic() - start, 1)
                raise self._refused(e, "/v1/models", [outage]) from e
            except openai.APIError:
                continue
            outage["waited_s"] = round(time.monotonic() - start, 1)
            print(
                f"server {self.client.base_url} back after {outage['waited_s']:.0f} s",
                file=self.log,
                flush=True,
            )
            return outage
        outage["waited_s"] = round(time.monotonic() - start, 1)
        where = f"; {describe(self.endpoint_file)}" if self.endpoint_file else ""
        raise ServerUnavailable(
            f"server {self.client.base_url} did not come back within {self.outage_wait:.0f} s "
            f"(last error: {type(error).__name__}: {error}){where}; the run can resume from its "
            f"world state",
            [outage],
        ) from error

    def _complete(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]],
        extra_body: dict[str, Any] | None = None,
        follow: bool = True,
    ) -> Any:
        settings = self.request_settings(extra_body)
        # the budget this request carries, which its reply's thinking is measured against
        self._sent_budget = settings.get("extra_body", {}).get("thinking_token_budget")
        try:
            return self.client.chat.completions.create(
                model=self.model,
                messages=messages,
                tools=tools,
                tool_choice=self.tool_choice,
                **settings,
            )
        except openai.BadRequestError as e:
            if _TOO_LONG.search(str(e)):
                counts = [int(n) for n in _TOKENS.findall(str(e))]
                if self.max_tokens > self.base_max_tokens:
                    # a budget raised after a cut no longer fits beside the grown prompt: the
                    # context manager reserves only the base budget, so give the rest back
                    self.max_tokens = self.base_max_tokens
                    return self._complete(messages, tools, extra_body, follow)
                raise PromptTooLong(str(e), max(counts) if counts else None) from e
            raise
        except (openai.AuthenticationError, openai.PermissionDeniedError) as e:
            # a restarted server writes its new key to the endpoint file: follow that once
            if follow and self._follow_endpoint():
                return self._complete(messages, tools, extra_body, follow=False)
            raise self._refused(e, "chat request") from e

    def decide(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]],
        world: WorldState,
        extra_body: dict[str, Any] | None = None,
    ) -> Decision:
        """The next call(s). ``extra_body``: fields for this request only (e.g. a structured-
        outputs constraint)."""
        outages = []
        try:
            resp = self._complete(messages, tools, extra_body)
        except (openai.APIConnectionError, openai.InternalServerError) as e:
            # a dead or stalled server: wait, then one more try
            outages.append(self._wait_for_server(e, world))
            try:
                resp = self._complete(messages, tools, extra_body)
            except (openai.APIConnectionError, openai.InternalServerError) as again:
                raise ServerUnavailable(
                    f"server {self.client.base_url} answered its health check but failed the "
                    f"request again ({type(again).__name__}: {again}); the run can resume",
                    outages,
                ) from again
        choice = resp.choices[0]
        message = choice.message
        calls = [
            ToolCall(
                c.id or f"call-{world.next_step}-{i}", c.function.name, c.function.arguments or ""
            )
            for i, c in enumerate(message.tool_calls or [])
        ]
        # vLLM's reasoning parser puts the thinking in `reasoning` (`reasoning_content` in
        # older servers), apart from the content that enters the history
        extra = message.model_extra or {}
        reasoning = extra.get("reasoning") or extra.get("reasoning_content")
        usage = _usage(resp.usage)
        finish = choice.finish_reason
        cut = _cut_where(message.content, reasoning) if finish == "length" and not calls else None
        if cut:
            spent = f"at max_tokens {self.max_tokens}"
            if usage and usage.reasoning_tokens:
                spent = f"{usage.reasoning_tokens} reasoning tokens, {spent}"
            plan = self._recover_from_cut(usage.prompt_tokens if usage else 0)
            # the loop records a reply without a call with its finish_reason: this says why
            finish = f"length: cut {cut} ({spent}); {plan}"
            print(f"step {world.next_step}: reply {finish}", file=self.log, flush=True)
        return Decision(
            calls,
            message.content,
            usage,
            finish,
            outages,
            reasoning,
            _timing(resp),
            self._budget_hit(usage),
        )

    def _budget_hit(self, usage: Usage | None) -> bool | None:
        """Whether the reply's thinking reached the budget its request carried (the server then
        forced the end of the thought): None when no budget was sent or no count came back.
        vLLM 0.32 forces the end in place of the budget-th token, so a cut thought counts one
        token less than the budget."""
        if not self._sent_budget or usage is None or usage.reasoning_tokens is None:
            return None
        return usage.reasoning_tokens >= self._sent_budget - 1


def _timing(resp: Any) -> Timing | None:
    """vLLM's per-request timing (``metrics`` beside ``usage``, served with
    --enable-per-request-metrics), in seconds; None from a server that does not send it."""
    m = (resp.model_extra or {}).get("metrics") or {}
    seconds = {
        key: m[ms] / 1000 if m.get(ms) is not None else None
        for key, ms in (
            ("queue_seconds", "queue_time_ms"),
            ("ttft_seconds", "time_to_first_token_ms"),
            ("decode_seconds", "generation_time_ms"),
        )
    }
    return Timing(**seconds) if any(v is not None for v in seconds.values()) else None


def _cut_where(content: str | None, reasoning: str | None) -> str | None:
    """Where a reply that ran out of tokens stopped: inside a tool call (its opening is in the
    content), while thinking (a thought and no answer yet), else None (an ordinary cut reply)."""
    text = (content or "").strip()
    # a JSON list of calls or a pythonic one ("[{..." / "[name(..."), not any text in brackets
    if re.match(r"\[\s*(\{|\w+\()", text) or any(o in text for o in _CALL_OPENINGS):
        return "inside a tool call"
    return "while thinking" if reasoning and not text else None


def _usage(u: Any) -> Usage | None:
    if u is None:
        return None
    prompt = getattr(u, "prompt_tokens_details", None)
    completion = getattr(u, "completion_tokens_details", None)
    return Usage(
        u.prompt_tokens,
        u.completion_tokens,
        getattr(prompt, "cached_tokens", None),
        getattr(completion, "reasoning_tokens", None),
    )


def _merge(base: dict[str, Any], more: dict[str, Any]) -> dict[str, Any]:
    """``base`` updated by ``more``, one level deep (chat_template_kwargs from both survive)."""
    merged = dict(base)
    for key, value in more.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = {**merged[key], **value}
        else:
            merged[key] = value
    return merged

"""LLMPolicy: the next tool call from any OpenAI-compatible server (vLLM in production)."""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path
from typing import Any, TextIO

import openai

from agent.endpoint import EndpointError, KeyRefused, describe, read_endpoint
from agent.policies.base import (
    DEFAULT_MAX_TOKENS,
    Decision,
    PolicyUnavailable,
    PromptTooLong,
    ToolCall,
    Usage,
)
from agent.world_state import WorldState

_TOO_LONG = re.compile(r"maximum context length|context length|too long", re.I)
_TOKENS = re.compile(r"(\d+) (?:input )?tokens", re.I)
# sampling fields the OpenAI client takes as keywords; the others go in extra_body
_OPENAI_FIELDS = {"temperature", "top_p", "presence_penalty", "frequency_penalty", "seed"}
_CONTEXT_SLACK = 512  # tokens a raised budget leaves free for the prompt's growth


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
        from the first request; ``extra_body``: further vLLM request fields, e.g.
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
        self.extra_body = dict(extra_body or {})
        self.tool_choice = tool_choice
        self.outage_wait = outage_wait
        self.endpoint_file = Path(endpoint_file) if endpoint_file else None
        self.key_file = key_file  # where api_key came from, for the refusal's message
        self.log = log
        self._limit: int | None = None  # the server's context length, once asked

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
        if self.thinking_off and self.no_thinking:
            body = _merge(body, self.no_thinking)
        if body:
            settings["extra_body"] = body
        return settings

    def _recover_from_cut(self, prompt_tokens: int) -> str:
        """After a reply cut while thinking: the next request gets twice the completion budget
        (as far as the context leaves room for), else the family's no-thinking switch; says which.
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
        try:
            return self.client.chat.completions.create(
                model=self.model,
                messages=messages,
                tools=tools,
                tool_choice=self.tool_choice,
                **self.request_settings(extra_body),
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
        if finish == "length" and not calls and reasoning:
            spent = f"at max_tokens {self.max_tokens}"
            if usage and usage.reasoning_tokens:
                spent = f"{usage.reasoning_tokens} reasoning tokens, {spent}"
            plan = self._recover_from_cut(usage.prompt_tokens if usage else 0)
            # the loop records a reply without a call with its finish_reason: this says why
            finish = f"length: cut while thinking ({spent}); {plan}"
            print(f"step {world.next_step}: reply {finish}", file=self.log, flush=True)
        return Decision(calls, message.content, usage, finish, outages, reasoning)


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

"""Deciders of the next tool call: one loop, three policies (LLM, reference recipe, replay)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from agent.config import RunConfig
from agent.policies.base import DEFAULT_MAX_TOKENS, Policy
from agent.record.models import RunMeta
from agent.registry import ToolRegistry


@dataclass
class PolicySetup:
    """A ready policy and what the run's record should say about it."""

    policy: Policy
    context_limit: int | None = None  # the server's max_model_len, when it tells one
    tokenizer: str | None = None  # where the model's tokenizer lies, when on this file system
    # model, server, flags, sampling (agent.record.models.RunMeta.part)
    meta: dict[str, Any] = field(default_factory=dict)
    max_tokens: int = DEFAULT_MAX_TOKENS  # the completion budget a reply gets (context reserve)
    history_reasoning: str = "none"  # which earlier thoughts the history sends back (catalogue)


def make_policy(config: RunConfig, registry: ToolRegistry) -> PolicySetup:
    """The policy ``config`` asks for, over the run's tools; an LLM policy once its server
    answers."""
    if config.policy == "reference":
        from agent.policies.reference import ReferencePolicy

        return PolicySetup(ReferencePolicy(registry))
    if config.policy == "replay":
        from agent.policies.replay import ReplayPolicy
        from agent.record.world_state import WorldState

        return PolicySetup(ReplayPolicy(WorldState.load(config.world_state)))
    from agent.endpoint import read_api_key, read_endpoint, wait_until_ready
    from agent.policies.llm import LLMPolicy

    meta: dict[str, Any] = {}
    family: dict[str, Any] = {}
    if config.endpoint_file:
        ep = read_endpoint(config.endpoint_file)
        url, model, key = ep.url, ep.model, ep.api_key
        server = {k: ep.info[k] for k in SERVER_FIELDS if ep.info.get(k) is not None}
        meta.update(RunMeta.part(server_flags=ep.flags, server=server))
        # absent from older endpoint files: then today's defaults (greedy, 1024, no switch)
        family = ep.info.get("family") or {}
        tokenizer = config.tokenizer or ep.info.get("model_path")
    else:
        url, model, tokenizer = config.base_url, config.model, config.tokenizer
        key = read_api_key(config.api_key_file) if config.api_key_file else "EMPTY"
    meta.update(RunMeta.part(model=model))
    key_file = ep.key_file if config.endpoint_file else config.api_key_file
    wait_until_ready(
        url,
        api_key=key,
        model=model,
        timeout_s=config.server_wait,
        key_file=key_file,
        endpoint_file=config.endpoint_file,
    )
    policy = LLMPolicy(
        url,
        model,
        api_key=key,
        timeout=config.request_timeout,
        max_retries=config.request_retries,
        seed=config.seed,
        max_tokens=config.max_tokens or family.get("max_tokens") or DEFAULT_MAX_TOKENS,
        sampling=family.get("sampling"),
        no_thinking=family.get("no_thinking"),
        thinking_off=config.no_thinking,
        preserve_thinking=family.get("history_reasoning") == "preserve",
        thinking_budget=thinking_budget(config, family, meta.get("server_flags")),
        outage_wait=config.outage_wait,
        endpoint_file=config.endpoint_file,
        key_file=key_file,
    )
    sampling = {
        **policy.sampling,
        "max_tokens": policy.max_tokens,
        "thinking": bool(family.get("thinking"))
        and not (config.no_thinking and family.get("no_thinking")),
        # what the requests carry: none while thinking is switched off
        "thinking_budget": policy.request_settings()
        .get("extra_body", {})
        .get("thinking_token_budget"),
        "history_reasoning": family.get("history_reasoning", "none"),
    }
    meta.update(RunMeta.part(sampling=sampling))
    return PolicySetup(
        policy,
        policy.context_limit(),
        tokenizer,
        meta,
        policy.max_tokens,
        meta["sampling"]["history_reasoning"],
    )


def thinking_budget(
    config: RunConfig, family: dict[str, Any], server_flags: list[dict[str, Any]] | None
) -> int | None:
    """The run's budget (0: none), else the family's unless the server runs no reasoning
    parser (vLLM refuses thinking_token_budget without one)."""
    if config.thinking_budget is not None:
        return config.thinking_budget or None
    parser = server_flags is None or any(
        f.get("name") == "--reasoning-parser" and f.get("chosen") for f in server_flags
    )
    return family.get("thinking_budget") if parser else None


# what the record keeps of the endpoint file's `info` about the server (contract item 3);
# `started_at` names the server itself, as its metrics rows do (the report's performance section)
SERVER_FIELDS = ("vllm_version", "model_id", "revision", "family", "started_at")

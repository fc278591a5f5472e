"""Layer 3, prefix caching: on, with cached-token counts in the usage the agent records."""

from __future__ import annotations

from agent.serve.flags.plan import Flag, Overrides


def flags(o: Overrides) -> list[Flag]:
    layer = "prefix-caching"
    if not o.prefix_caching:
        return [
            Flag(
                layer,
                "--no-enable-prefix-caching",
                None,
                True,
                "disabled by config (prefix_caching: false)",
            )
        ]
    return [
        Flag(
            layer,
            "--enable-prefix-caching",
            None,
            True,
            "every step resends the same instructions and tool schemas first, then the growing"
            " history; their cached KV blocks skip prefill",
        ),
        Flag(
            layer,
            "--enable-prompt-tokens-details",
            None,
            True,
            "usage reports prompt_tokens_details.cached_tokens, which the agent records per step",
        ),
    ]

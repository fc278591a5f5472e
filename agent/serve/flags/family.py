"""The model family's flags (agent/serve/models.yaml): the tool-call parser and its strict level,
the reasoning parser and what the agents send as thinking budget, a tool chat template where the
checkpoint's lacks tools, ``--language-model-only`` for a multimodal checkpoint."""

from __future__ import annotations

from agent.serve.catalogue import Family
from agent.serve.flags.plan import Flag, Overrides
from agent.serve.model_config import ModelShape


def flags(shape: ModelShape, o: Overrides, family: Family | None, why_none: str) -> list[Flag]:
    """Tool-call parser, its strict level, reasoning parser, chat template, text-only serving."""
    layer = "tools"
    parser = o.tool_call_parser or (family.tool_call_parser if family else None)
    if parser is None:
        return [
            Flag(
                layer,
                "--enable-auto-tool-choice",
                None,
                False,
                f"{why_none}; set tool_call_parser (or family) in the overrides",
            ),
            Flag(layer, "--tool-call-parser", None, False, "see above"),
        ]
    source = "asked by config" if o.tool_call_parser else _note(family, why_none)
    flags = [
        Flag(
            layer,
            "--enable-auto-tool-choice",
            None,
            True,
            "the agent sends its tools with every request and the model picks the call",
        ),
        Flag(
            layer,
            "--tool-call-parser",
            parser,
            True,
            f"{source}: the model writes tool calls in the {parser} format",
        ),
        _strict_level(o, family, parser),
        _reasoning(o, family, why_none),
        _reasoning_config(o, family),
        _chat_template(o, family),
    ]
    if isinstance(shape.raw.get("vision_config"), dict):
        text_only = bool(family and family.language_model_only)
        flags.append(
            Flag(
                layer,
                "--language-model-only",
                None,
                text_only,
                "the checkpoint has a vision tower the agent never uses: vLLM skips loading it and"
                " reserves no memory for image inputs"
                if text_only
                else f"{_note(family, why_none)} keeps the vision tower",
            )
        )
    return flags


def _note(family: Family | None, why_none: str) -> str:
    return f"the {family.name} family (catalogue)" if family else why_none


def _strict_level(o: Overrides, family: Family | None, parser: str) -> Flag:
    name = "--tool-strict-level"
    if o.tool_strict_level:
        return Flag("tools", name, o.tool_strict_level, True, "asked by config")
    if family and family.strict_tools and parser == family.tool_call_parser:
        return Flag(
            "tools",
            name,
            "parameter",
            True,
            f"the {parser} parser builds a structural tag, so tool-call arguments are decoded"
            " against each tool's JSON schema: a call the model starts is well-formed (a"
            " malformed call wastes an agent step)",
        )
    return Flag(
        "tools",
        name,
        "parameter",
        False,
        f"the {parser} parser builds no structural tag in vLLM 0.32 (catalogue strict_tools:"
        " false), so a strict level would constrain nothing; arguments are checked by the agent's"
        " registry instead",
    )


def _reasoning(o: Overrides, family: Family | None, why_none: str) -> Flag:
    name = "--reasoning-parser"
    if o.reasoning_parser == "none":
        return Flag("tools", name, None, False, "disabled by config (reasoning_parser: none)")
    if o.reasoning_parser:
        return Flag("tools", name, o.reasoning_parser, True, "asked by config")
    if family and family.reasoning_parser:
        return Flag(
            "tools",
            name,
            family.reasoning_parser,
            True,
            f"the {family.name} family thinks"
            f"{' by default' if family.thinking else ' when asked'}: the server returns the"
            " thought as message.reasoning, so it stays out of the content the agent keeps",
        )
    return Flag(
        "tools",
        name,
        None,
        False,
        f"{_note(family, why_none)} has no thinking format (reasoning_parser: null)",
    )


def _reasoning_config(o: Overrides, family: Family | None) -> Flag:
    """Not passed: what it would give is the default, or impossible; the reason says which."""
    name = "--reasoning-config"
    if o.reasoning_parser == "none" or not (
        o.reasoning_parser or (family and family.reasoning_parser)
    ):
        return Flag(
            "tools",
            name,
            None,
            False,
            "no reasoning parser: the server would refuse a request's thinking_token_budget, so"
            " the agents send none and a long thought meets only max_tokens",
        )
    budget = family.thinking_budget if family else None
    return Flag(
        "tools",
        name,
        None,
        False,
        "vLLM 0.32 builds it from --reasoning-parser (the parser's start and end of thought), so"
        " each request may carry a thinking_token_budget, after which the server closes the"
        " thought; the agents send "
        + (
            f"{budget} tokens (the {family.name} family's thinking_budget)"
            if budget
            else "none unless a run asks (no thinking_budget in the catalogue)"
        )
        + "; agent run --thinking-budget N sets another",
    )


def _chat_template(o: Overrides, family: Family | None) -> Flag:
    name = "--chat-template"
    if o.chat_template == "none":
        return Flag("tools", name, None, False, "disabled by config (chat_template: none)")
    if o.chat_template:
        return Flag("tools", name, o.chat_template, True, "asked by config")
    path = family.chat_template_path() if family else None
    if path is not None:
        return Flag(
            "tools",
            name,
            str(path),
            True,
            f"the checkpoint's own template does not describe tools in the {family.tool_call_parser}"
            " format; this one (shipped in agent/serve/templates) does",
        )
    return Flag("tools", name, None, False, "the checkpoint's own chat template describes tools")

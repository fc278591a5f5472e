"""Layer 4, speculative decoding: MTP when the model's config declares MTP heads, drafting as many
tokens as the family's catalogue entry says; else a drafter checkpoint the catalogue names for the
model (Gemma 4's "assistant" models) or the overrides give; n-gram drafting only when asked."""

from __future__ import annotations

import json
from typing import Any

from agent.serve.catalogue import Family
from agent.serve.flags.plan import Flag, Overrides
from agent.serve.gpu import GPU
from agent.serve.model_config import ModelShape

LAYER, NAME = "speculative", "--speculative-config"
HEADS_DECLARED = "num_nextn_predict_layers / mtp_num_hidden_layers"  # where a config says so


def flags(
    gpu: GPU, shape: ModelShape, o: Overrides, family: Family | None, model_id: str | None
) -> list[Flag]:
    _refuse(gpu, shape, o)
    if o.speculative == "off":
        return [Flag(LAYER, NAME, None, False, "disabled by config (speculative: off)")]
    if gpu.is_cpu and o.speculative == "auto":
        declared = f"the config declares {_heads(shape)}, but " if shape.mtp_layers else ""
        return [
            Flag(
                LAYER,
                NAME,
                None,
                False,
                f"cpu: {declared}off unless asked (speculative: mtp or ngram): vLLM-CPU drafts"
                " slowly and ignores logit_bias and min_p while drafting",
            )
        ]
    if o.speculative == "ngram":
        return [_ngram(o)]
    recipe = (family.speculative if family else None) or {}
    drafter = o.draft_model or (
        None if shape.mtp_layers or not family else family.drafters.get(model_id or "")
    )
    if drafter:
        return [_drafter(o, recipe, drafter, family, model_id)]
    if shape.mtp_layers:
        return [_mtp(shape, o, recipe, family)]
    return [
        Flag(
            LAYER,
            NAME,
            None,
            False,
            f"the config declares no MTP heads ({HEADS_DECLARED}); n-gram drafting only when"
            " configured (speculative: ngram)",
        )
    ]


def _heads(shape: ModelShape) -> str:
    return f"{shape.mtp_layers} MTP head(s)"


def _refuse(gpu: GPU, shape: ModelShape, o: Overrides) -> None:
    """The drafting asked that this model or platform cannot do, as an error saying why."""
    if o.speculative == "mtp" and not shape.mtp_layers:
        raise ValueError(
            f"{shape.source}: speculative: mtp asked, but the config declares no MTP heads"
            f" ({HEADS_DECLARED})"
        )
    if gpu.is_cpu and o.speculative in ("mtp", "ngram") and shape.linear and o.prefix_caching:
        # align mode's state copy while drafting (any method) is a Triton kernel with no CPU
        # fallback ("'function' object is not subscriptable" at the first request)
        raise ValueError(
            f"{shape.source}: speculative: {o.speculative} on the CPU needs prefix_caching: false"
            " for this hybrid model (vLLM-CPU 0.32 cannot keep linear-attention states for prefix"
            " caching while drafting)"
        )


def _config(spec: dict[str, Any]) -> str:
    return json.dumps(spec, separators=(",", ":"))


def _ngram(o: Overrides) -> Flag:
    k = o.num_speculative_tokens or 3
    return Flag(
        LAYER,
        NAME,
        _config({"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4}),
        True,
        "asked by config (speculative: ngram): drafts from n-grams of the prompt, where"
        " tool arguments and results repeat earlier text",
    )


def _drafter(
    o: Overrides,
    recipe: dict[str, Any],
    drafter: str,
    family: Family | None,
    model_id: str | None,
) -> Flag:
    k = o.num_speculative_tokens or recipe.get("num_speculative_tokens") or 1
    spec = {"model": drafter, "num_speculative_tokens": k}
    if "method" in recipe and not o.draft_model:  # else vLLM tells it from the drafter
        spec = {"method": recipe["method"], **spec}
    whence = (
        "asked by config (draft_model)"
        if o.draft_model
        else f"the {family.name} family's drafter for {model_id} (catalogue drafters)"
    )
    return Flag(
        LAYER,
        NAME,
        _config(spec),
        True,
        f"{whence}: the small drafter proposes {k} token(s) per step and the model verifies"
        " them in one pass (the drafter is fetched beside the model and read offline)",
    )


def _mtp(shape: ModelShape, o: Overrides, recipe: dict[str, Any], family: Family | None) -> Flag:
    method = recipe.get("method", "mtp")
    k = o.num_speculative_tokens or recipe.get("num_speculative_tokens") or shape.mtp_layers
    if k > shape.mtp_layers and k % shape.mtp_layers:
        raise ValueError(
            f"{shape.source}: num_speculative_tokens {k} with {_heads(shape)}: vLLM reuses the"
            f" heads, so it must be a multiple of {shape.mtp_layers}"
        )
    whence = (
        "asked by config"
        if o.num_speculative_tokens
        else f"the {family.name} recipe in the catalogue"
        if recipe
        else "one per head"
    )
    return Flag(
        LAYER,
        NAME,
        _config({"method": method, "num_speculative_tokens": k}),
        True,
        f"the config declares {_heads(shape)} ({HEADS_DECLARED}):"
        f" the model drafts {k} token(s) per step itself ({whence}) and verifies them in"
        " one pass",
    )

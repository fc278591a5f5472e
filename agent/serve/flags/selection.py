"""``select_flags``: every flag for serving a model on a GPU, chosen and left out, each with its
reason, in the order the explanation shows the layers."""

from __future__ import annotations

import json
from typing import Any

from agent.serve import catalogue as catalogues
from agent.serve.catalogue import Catalogue, CatalogueError, Family
from agent.serve.flags import cuda_graphs, family, fp8, prefix_caching, server, speculative
from agent.serve.flags.plan import FlagPlan, Overrides
from agent.serve.gpu import GPU
from agent.serve.kvplan import KVPlan, plan_capacity, read_drafter
from agent.serve.model_config import model_shape


def select_flags(
    gpu: GPU,
    config: dict[str, Any],
    overrides: dict[str, Any] | Overrides | None = None,
    catalogue: Catalogue | None = None,
    model_id: str | None = None,
) -> FlagPlan:
    """All flags for serving ``config`` on ``gpu``, chosen and left out, each with its reason;
    the model family comes from ``catalogue`` (default: the packaged one and $SCAGENT_MODELS);
    ``model_id``: the Hub id served, for the family's published FP8 checkpoint and drafter."""
    o = Overrides.parse(overrides)
    shape = model_shape(config)
    found, why_none = _family(config, o, catalogue)
    fp8_choice = fp8.choose(gpu, shape, o)
    drafting_flags = speculative.flags(gpu, shape, o, found, model_id)
    drafting = next((json.loads(f.value) for f in drafting_flags if f.chosen and f.value), {})
    draft = drafting.get("num_speculative_tokens", 0)
    # a drafter model's weights and own KV share the GPUs (MTP drafts with the model's own layers)
    drafter = (
        read_drafter(drafting["model"], drafting.get("method")) if "model" in drafting else None
    )

    def plan_for(kv: str) -> KVPlan:
        return plan_capacity(
            shape,
            gpu,
            agents=o.agents,
            kv_dtype=kv,
            weight_dtype="fp8" if fp8_choice.fp8_weights else "auto",
            max_model_len=o.max_model_len,
            gpu_memory_utilization=o.gpu_memory_utilization,
            params=o.params,
            language_model_only=bool(found and found.language_model_only),
            # what vLLM reserves per request with these flags: linear states, MTP layers' KV
            prefix_caching=o.prefix_caching,
            speculative_tokens=draft,
            mtp=drafting.get("method") == "mtp" and "model" not in drafting,
            skip_sliding=True,  # an FP8 KV cache always comes with the skip (fp8._kv_skip_sliding)
            drafter=drafter,
        )

    plan = plan_for("fp8" if fp8_choice.fp8_kv else "auto")
    known = found.fp8_checkpoints.get(model_id or "") if found else None
    published = known if fp8_choice.fp8_weights and o.fp8_checkpoint else None
    model_kv = plan_for("auto") if fp8_choice.fp8_kv else plan
    flags = [
        *cuda_graphs.flags(gpu, o, plan, draft),
        *fp8.flags(fp8_choice, gpu, shape, plan, model_kv, published),
        *prefix_caching.flags(o),
        *drafting_flags,
        *server.capacity(gpu, shape, o, plan),
        *family.flags(shape, o, found, why_none),
        *server.measurement(),
        *server.environment(gpu),
    ]
    return FlagPlan(gpu=gpu, shape=shape, plan=plan, overrides=o, family=found, flags=flags)


def _family(
    config: dict[str, Any], o: Overrides, catalogue: Catalogue | None
) -> tuple[Family | None, str]:
    """The model's catalogue family, or None and why there is none; a family asked by name must
    exist."""
    try:
        return catalogues.family_for(config, o.family, catalogue), ""
    except CatalogueError as exc:
        if o.family:
            raise
        return None, str(exc)

"""vLLM flags as a pure function of (GPU, model config, overrides, catalogue), each with the reason it was chosen or left out.

The four layers that make each agent step fast:
1. CUDA graphs: never ``--enforce-eager`` unless the config asks; capture sizes fitted to the agents
   times the tokens each verifies per step (1 + draft tokens).
2. FP8: FP8 weights only where FP8 tensor cores exist (compute capability 8.9+: H100, H200, L40S;
   not A100), as vLLM 0.32's online ``fp8_per_tensor`` (``fp8`` now means an FP8 checkpoint only);
   FP8 KV cache on A100 and H100 alike (cc 8.0+).
3. Prefix caching: on, with cached-token counts in the usage the agent records.
4. Speculative decoding: MTP when the model's config declares MTP heads, drafting as many
   tokens as the family's catalogue entry says; else a drafter checkpoint the catalogue names
   for the model (Gemma 4's "assistant" models) or the overrides give.
FP8 weights come from the publisher's FP8 checkpoint where the catalogue names one, and an FP8
KV cache leaves sliding-window layers at the model's dtype.
Plus tensor parallelism from the GPU count, ``--max-model-len`` / ``--max-num-seqs`` from the KV plan,
and from the model's family in the catalogue (agent/serve/models.yaml): the tool-call and reasoning
parsers, a tool chat template where the checkpoint's lacks tools, ``--language-model-only`` for a
multimodal checkpoint. Nothing here touches the machine but a drafter's config.json, read offline
from its folder or the local Hub cache for the KV plan: the same inputs give the same flags, so
they can be explained for an H100 on a laptop and recorded in the endpoint file. `agent serve`
and `agent plan` both plan through ``select_flags``, so they print one capacity.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from agent.serve import catalogue as catalogues
from agent.serve.catalogue import Catalogue, CatalogueError, Family
from agent.serve.gpu import GPU
from agent.serve.kvplan import GIB, KVPlan, plan_capacity, read_drafter
from agent.serve.model_config import ModelShape, model_shape

FP8_TENSOR_CORES_CC = 8.9  # Ada / Hopper and newer
FP8_KV_CACHE_CC = 8.0  # Ampere and newer
# vLLM 0.32's online FP8 for a bf16 checkpoint (vllm/config/quantization.py _ONLINE_SHORTHANDS);
# its `--quantization fp8` refuses a checkpoint that is not FP8 already.
FP8_ONLINE = "fp8_per_tensor"
CHECKPOINT = "checkpoint"  # the launch flag naming the checkpoint served instead of --model

LAYERS = {
    "cuda-graphs": "Layer 1 - CUDA graphs",
    "fp8": "Layer 2 - FP8 weights and KV cache",
    "prefix-caching": "Layer 3 - prefix caching",
    "speculative": "Layer 4 - speculative decoding (MTP or a drafter)",
    "capacity": "Parallelism and capacity (KV plan)",
    "tools": "Tool calling and thinking (model family)",
    "measurement": "Measurement (per-request timing)",
    "environment": "Environment",
    "server": "Server (set at launch)",
}


class Overrides(BaseModel):
    """Server settings a config may set; anything else is an error naming the key."""

    model_config = ConfigDict(extra="forbid")

    agents: int = Field(8, ge=1, description="concurrent agents the server is planned for")
    max_model_len: int | None = Field(None, ge=256)
    enforce_eager: bool = False
    quantization: Literal["auto", "fp8", "none"] = "auto"
    kv_cache_dtype: Literal["auto", "fp8", "model"] = "auto"
    prefix_caching: bool = True
    speculative: Literal["auto", "off", "mtp", "ngram"] = "auto"
    num_speculative_tokens: int | None = Field(None, ge=1, le=8)
    draft_model: str | None = Field(
        None, description="a drafter checkpoint (Hub id or folder) instead of the catalogue's"
    )
    fp8_checkpoint: bool = Field(
        True, description="serve the publisher's FP8 checkpoint where the catalogue names one"
    )
    family: str | None = Field(None, description="catalogue family, instead of the config's match")
    tool_call_parser: str | None = None
    reasoning_parser: str | None = Field(None, description="a vLLM name, or 'none' for no parser")
    chat_template: str | None = Field(
        None, description="a template file, or 'none' for the model's"
    )
    tool_strict_level: Literal["auto", "function", "parameter"] | None = Field(
        None, description="default: parameter where the parser supports it, else left out"
    )
    gpu_memory_utilization: float = Field(0.90, gt=0, le=1)
    params: int | None = Field(
        None, ge=1, description="parameter count, if not estimated from config"
    )
    seed: int = 0

    @classmethod
    def parse(cls, overrides: dict[str, Any] | Overrides | None) -> Overrides:
        if isinstance(overrides, Overrides):
            return overrides
        try:
            return cls.model_validate(overrides or {})
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in e['loc']) or '(top)'}: {e['msg']} (got {e.get('input')!r})"
                for e in exc.errors()
            )
            raise ValueError(
                f"server overrides: {problems}; allowed keys: {sorted(cls.model_fields)}"
            ) from None


@dataclass(frozen=True)
class Flag:
    layer: str
    name: str
    value: str | None
    chosen: bool
    reason: str
    env: bool = False  # an environment variable for the server process, not an argument
    launch: bool = False  # a choice the launcher carries out (the checkpoint), not an argument

    def argv(self) -> list[str]:
        if not self.chosen or self.env or self.launch:
            return []
        return [self.name] if self.value is None else [self.name, self.value]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class FlagPlan:
    gpu: GPU
    shape: ModelShape
    plan: KVPlan
    overrides: Overrides
    family: Family | None
    flags: list[Flag] = field(default_factory=list)

    def argv(self) -> list[str]:
        return [a for f in self.flags for a in f.argv()]

    def environment(self) -> dict[str, str]:
        return {f.name: f.value or "" for f in self.flags if f.env and f.chosen}

    def chosen(self, name: str) -> Flag | None:
        return next((f for f in self.flags if f.name == name and f.chosen), None)

    def checkpoint(self) -> str | None:
        """The Hub id to serve instead of the given model (a published FP8 checkpoint), if any."""
        flag = self.chosen(CHECKPOINT)
        return flag.value if flag else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "gpu": self.gpu.to_dict(),
            "family": self.family.to_dict() if self.family else None,
            "overrides": self.overrides.model_dump(),
            "flags": [f.to_dict() for f in self.flags],
            "argv": self.argv(),
            "environment": self.environment(),
            "kv_plan": self.plan.to_dict(),
        }

    def explain(self) -> str:
        lines = [
            f"vLLM flags for {self.shape.source} ({self.shape.model_type}) on {self.gpu.label()}",
            f"model family: {self.family.name} (catalogue {self.family.source})"
            if self.family
            else "model family: none in the catalogue",
            f"KV cache: {self.plan.kv_summary()}",
        ]
        if self.plan.drafter is not None:
            lines.append(f"drafter: {self.plan.drafter_summary()}")
        for layer, title in LAYERS.items():
            flags = [f for f in self.flags if f.layer == layer]
            if not flags:
                continue
            lines += ["", title]
            for f in flags:
                mark = "+" if f.chosen else "-"
                shown = f.name if f.value is None else f"{f.name} {f.value}"
                lines.append(f"  {mark} {shown}")
                lines.append(f"      {f.reason}")
        lines += ["", "(+ chosen, - left out)", "arguments: " + " ".join(self.argv())]
        return "\n".join(lines)


def _capture_size(tokens: int) -> int:
    """vLLM captures [1, 2, 4, 8, 16, ...]; the largest must cover a decode batch of every agent."""
    return tokens if tokens <= 4 else -(-tokens // 8) * 8


def _cuda_graphs(gpu: GPU, o: Overrides, plan: KVPlan, draft: int) -> list[Flag]:
    layer = "cuda-graphs"
    if o.enforce_eager:
        return [
            Flag(
                layer,
                "--enforce-eager",
                None,
                True,
                "asked by config (enforce_eager: true): no CUDA graphs and no torch.compile",
            )
        ]
    if gpu.is_cpu:
        return [
            Flag(
                layer,
                "--enforce-eager",
                None,
                False,
                "cpu: there are no CUDA graphs; vLLM's CPU backend compiles with torch.compile",
            )
        ]
    tokens = plan.max_num_seqs * (1 + draft)
    size = _capture_size(tokens)
    batch = (
        f"{plan.max_num_seqs} planned concurrent agents x (1 + {draft} draft tokens) = {tokens}"
        " tokens verified per step"
        if draft
        else f"the {plan.max_num_seqs} planned concurrent agents"
    )
    return [
        Flag(
            layer,
            "--enforce-eager",
            None,
            False,
            "CUDA graphs stay on: each decode step replays a captured graph instead of launching"
            " every kernel, which dominates small-batch agent decoding",
        ),
        Flag(
            layer,
            "--max-cudagraph-capture-size",
            str(size),
            True,
            f"capture batch sizes up to {size}, enough for {batch}, without spending start-up"
            " time and memory on batch sizes they never reach",
        ),
    ]


def _fp8(
    gpu: GPU,
    shape: ModelShape,
    o: Overrides,
    plan: KVPlan,
    plan_model_kv: KVPlan,
    published: str | None,
) -> list[Flag]:
    """FP8 weights (online, or ``published``: the publisher's FP8 checkpoint of the model), the FP8
    KV cache, and the sliding layers it leaves at the model's dtype."""
    layer = "fp8"
    cc = f"cc {gpu.cc:.1f}"
    if shape.checkpoint_fp8:
        kernels = (
            "on FP8 tensor cores"
            if gpu.cc >= FP8_TENSOR_CORES_CC
            else "with weight-only FP8 kernels (no FP8 tensor cores here)"
        )
        weights = Flag(
            layer,
            "--quantization",
            FP8_ONLINE,
            False,
            f"the checkpoint is already FP8 (quantization_config.quant_method=fp8); vLLM"
            f" loads it as it is, {'cpu' if gpu.is_cpu else kernels}",
        )
    elif o.quantization == "none":
        weights = Flag(
            layer, "--quantization", FP8_ONLINE, False, "disabled by config (quantization: none)"
        )
    elif o.quantization == "fp8" and not gpu.is_cpu:
        weights = Flag(
            layer,
            "--quantization",
            FP8_ONLINE,
            True,
            f"asked by config (quantization: fp8) on {cc}",
        )
    elif gpu.is_cpu:
        weights = Flag(
            layer, "--quantization", FP8_ONLINE, False, "cpu: FP8 weight kernels need a CUDA GPU"
        )
    elif gpu.cc >= FP8_TENSOR_CORES_CC:
        weights = Flag(
            layer,
            "--quantization",
            FP8_ONLINE,
            True,
            f"FP8 tensor cores ({cc} >= {FP8_TENSOR_CORES_CC}): online FP8 weights take"
            f" {plan.weights_gib:.1f} GiB instead of {plan.params * shape.dtype_bytes / GIB:.1f}"
            " (embeddings, lm_head and any vision tower stay bf16) and run the GEMMs at FP8 rate",
        )
    else:
        weights = Flag(
            layer,
            "--quantization",
            FP8_ONLINE,
            False,
            f"{cc} < {FP8_TENSOR_CORES_CC}: no FP8 tensor cores (A100 and older), so FP8"
            " weights would save memory but slow every step",
        )

    checkpoint = []
    if weights.chosen and published:
        weights = Flag(
            layer,
            "--quantization",
            FP8_ONLINE,
            False,
            "the publisher's FP8 checkpoint is served instead: its weights are FP8 already",
        )
        checkpoint = [
            Flag(
                layer,
                CHECKPOINT,
                published,
                True,
                f"FP8 weights chosen and {published} is the publisher's FP8 checkpoint of this"
                " model (catalogue fp8_checkpoints): its scales were calibrated by the publisher,"
                " not computed online from the bf16 weights at start-up; `fetch_model` fetches it"
                " (fp8_checkpoint: false in the overrides keeps online quantisation)",
                launch=True,
            )
        ]
    kv_name = "--kv-cache-dtype"
    if o.kv_cache_dtype == "model":
        kv = Flag(layer, kv_name, "fp8", False, "disabled by config (kv_cache_dtype: model)")
    elif gpu.is_cpu and o.kv_cache_dtype != "fp8":
        kv = Flag(layer, kv_name, "fp8", False, "cpu: the KV cache keeps the model's dtype")
    elif not gpu.is_cpu and gpu.cc < FP8_KV_CACHE_CC:
        kv = Flag(
            layer, kv_name, "fp8", False, f"{cc} < {FP8_KV_CACHE_CC}: no FP8 KV cache kernels"
        )
    else:
        before, length = plan_model_kv.kv_bytes_per_token, plan.max_model_len
        kv = Flag(
            layer,
            kv_name,
            "fp8",
            True,
            f"halves KV bytes per token ({before:,.0f} -> {plan.kv_bytes_per_token:,.0f} B):"
            f" {plan.seqs_fit(length)} sequences of {length:,} tokens fit instead of"
            f" {plan_model_kv.seqs_fit(length)}"
            + (
                " (asked by config)"
                if o.kv_cache_dtype == "fp8"
                else f" ({cc} >= {FP8_KV_CACHE_CC})"
            ),
        )
    return [weights, *checkpoint, kv, *_kv_skip_sliding(shape, kv, plan)]


def _kv_skip_sliding(shape: ModelShape, kv: Flag, plan: KVPlan) -> list[Flag]:
    """Sliding-window layers keep the model's dtype under an FP8 KV cache: they hold only their
    window, so FP8 saves little there, and their few recent tokens are where precision tells."""
    sliding = shape.count("sliding")
    if not (kv.chosen and sliding):
        return []
    window = min(plan.max_model_len, shape.sliding_window or plan.max_model_len)
    per_token = shape.kv_bytes_per_token_per_layer(1, "sliding", plan.tp)  # per byte of dtype
    extra = sliding * window * per_token * (shape.dtype_bytes - plan.kv_bytes)
    fp8 = plan.sequence_bytes(plan.max_model_len) - extra  # had the sliding layers been FP8
    return [
        Flag(
            "fp8",
            "--kv-cache-dtype-skip-layers",
            "sliding_window",
            True,
            f"the {sliding} sliding-window layers hold {window:,} tokens at most: at the model's"
            f" dtype they add {extra / 2**20:,.0f} MiB per sequence ({100 * extra / fp8:.0f}% of"
            f" its {plan.max_model_len:,}-token FP8 KV), and FP8 there would blur the recent"
            " context the model reads most closely",
        )
    ]


def _prefix_caching(o: Overrides) -> list[Flag]:
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


def _speculative(
    gpu: GPU, shape: ModelShape, o: Overrides, family: Family | None, model_id: str | None
) -> list[Flag]:
    layer, name = "speculative", "--speculative-config"
    heads = f"{shape.mtp_layers} MTP head(s)"
    if o.speculative == "mtp" and not shape.mtp_layers:
        raise ValueError(
            f"{shape.source}: speculative: mtp asked, but the config declares no MTP heads"
            " (num_nextn_predict_layers / mtp_num_hidden_layers)"
        )
    if o.speculative == "off":
        return [Flag(layer, name, None, False, "disabled by config (speculative: off)")]
    if gpu.is_cpu and o.speculative in ("mtp", "ngram") and shape.linear and o.prefix_caching:
        # align mode's state copy while drafting (any method) is a Triton kernel with no CPU
        # fallback ("'function' object is not subscriptable" at the first request)
        raise ValueError(
            f"{shape.source}: speculative: {o.speculative} on the CPU needs prefix_caching: false"
            " for this hybrid model (vLLM-CPU 0.32 cannot keep linear-attention states for prefix"
            " caching while drafting)"
        )
    if gpu.is_cpu and o.speculative == "auto":
        declared = f"the config declares {heads}, but " if shape.mtp_layers else ""
        return [
            Flag(
                layer,
                name,
                None,
                False,
                f"cpu: {declared}off unless asked (speculative: mtp or ngram): vLLM-CPU drafts"
                " slowly and ignores logit_bias and min_p while drafting",
            )
        ]
    if o.speculative == "ngram":
        k = o.num_speculative_tokens or 3
        value = json.dumps(
            {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4},
            separators=(",", ":"),
        )
        return [
            Flag(
                layer,
                name,
                value,
                True,
                "asked by config (speculative: ngram): drafts from n-grams of the prompt, where"
                " tool arguments and results repeat earlier text",
            )
        ]
    recipe = (family.speculative if family else None) or {}
    drafter = o.draft_model or (
        None if shape.mtp_layers or not family else family.drafters.get(model_id or "")
    )
    if drafter:
        k = o.num_speculative_tokens or recipe.get("num_speculative_tokens") or 1
        spec = {"model": drafter, "num_speculative_tokens": k}
        if "method" in recipe and not o.draft_model:  # else vLLM tells it from the drafter
            spec = {"method": recipe["method"], **spec}
        whence = (
            "asked by config (draft_model)"
            if o.draft_model
            else f"the {family.name} family's drafter for {model_id} (catalogue drafters)"
        )
        return [
            Flag(
                layer,
                name,
                json.dumps(spec, separators=(",", ":")),
                True,
                f"{whence}: the small drafter proposes {k} token(s) per step and the model verifies"
                " them in one pass (the drafter is fetched beside the model and read offline)",
            )
        ]
    if shape.mtp_layers:
        method = recipe.get("method", "mtp")
        k = o.num_speculative_tokens or recipe.get("num_speculative_tokens") or shape.mtp_layers
        if k > shape.mtp_layers and k % shape.mtp_layers:
            raise ValueError(
                f"{shape.source}: num_speculative_tokens {k} with {heads}: vLLM reuses the heads,"
                f" so it must be a multiple of {shape.mtp_layers}"
            )
        whence = (
            "asked by config"
            if o.num_speculative_tokens
            else f"the {family.name} recipe in the catalogue"
            if recipe
            else "one per head"
        )
        value = json.dumps({"method": method, "num_speculative_tokens": k}, separators=(",", ":"))
        return [
            Flag(
                layer,
                name,
                value,
                True,
                f"the config declares {heads} (num_nextn_predict_layers / mtp_num_hidden_layers):"
                f" the model drafts {k} token(s) per step itself ({whence}) and verifies them in"
                " one pass",
            )
        ]
    return [
        Flag(
            layer,
            name,
            None,
            False,
            "the config declares no MTP heads (num_nextn_predict_layers / mtp_num_hidden_layers);"
            " n-gram drafting only when configured (speculative: ngram)",
        )
    ]


def _capacity(gpu: GPU, shape: ModelShape, o: Overrides, plan: KVPlan) -> list[Flag]:
    layer = "capacity"
    flags = []
    if gpu.is_cpu:
        flags.append(Flag(layer, "--tensor-parallel-size", None, False, "cpu: one process"))
    elif gpu.count > 1:
        if shape.num_attention_heads % gpu.count:
            raise ValueError(
                f"{shape.source}: {shape.num_attention_heads} attention heads do not split over"
                f" {gpu.count} GPUs (tensor parallel needs a divisor)"
            )
        flags.append(
            Flag(
                layer,
                "--tensor-parallel-size",
                str(gpu.count),
                True,
                f"{gpu.count} GPUs allocated: weights and KV heads are sharded over all of them",
            )
        )
    else:
        flags.append(Flag(layer, "--tensor-parallel-size", None, False, "one GPU allocated"))
    if o.max_model_len is None:
        why = (
            f"{plan.agents} agents x {plan.max_model_len:,} tokens fit in the"
            f" {plan.kv_budget_gib:.1f} GiB KV budget at {plan.kv_dtype}"
        )
        if shape.max_position_embeddings and plan.max_model_len == shape.max_position_embeddings:
            why += " (the model's full context)"
    else:
        why = f"asked by config; {plan.seqs_fit_at_max_len} sequences of it fit in the KV budget"
    flags.append(Flag(layer, "--max-model-len", str(plan.max_model_len), True, why))
    flags.append(
        Flag(
            layer,
            "--max-num-seqs",
            str(plan.max_num_seqs),
            True,
            f"{plan.agents} agents planned, {plan.seqs_fit_at_max_len} full-length sequences"
            " fit: every agent is served at once, none is preempted",
        )
    )
    if gpu.is_cpu:
        flags.extend(
            (
                Flag(
                    layer,
                    "--gpu-memory-utilization",
                    None,
                    False,
                    "cpu: the KV cache size is VLLM_CPU_KVCACHE_SPACE",
                ),
                Flag(
                    layer,
                    "--max-num-batched-tokens",
                    str(plan.max_model_len),
                    True,
                    "cpu: a whole prompt is prefilled in one step; vLLM 0.32's CPU worker dies on a"
                    " seeded request whose prompt is prefilled in chunks ('CPU Generator does not use"
                    " offset'), and every agent request is seeded",
                ),
            )
        )
    else:
        flags.append(
            Flag(
                layer,
                "--gpu-memory-utilization",
                f"{o.gpu_memory_utilization:g}",
                True,
                f"the KV plan's budget assumes this share of each GPU's {gpu.memory_gib:g} GiB",
            )
        )
    flags.append(
        Flag(layer, "--seed", str(o.seed), True, "recorded sampling seed (reproducibility)")
    )
    return flags


def _family_note(family: Family | None, why_none: str) -> str:
    return f"the {family.name} family (catalogue)" if family else why_none


def _tools(shape: ModelShape, o: Overrides, family: Family | None, why_none: str) -> list[Flag]:
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
    source = "asked by config" if o.tool_call_parser else _family_note(family, why_none)
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
                else f"{_family_note(family, why_none)} keeps the vision tower",
            )
        )
    return flags


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
        f"{_family_note(family, why_none)} has no thinking format (reasoning_parser: null)",
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


def _measurement() -> list[Flag]:
    return [
        Flag(
            "measurement",
            "--enable-per-request-metrics",
            None,
            True,
            "each reply carries its own queue, time-to-first-token and decode seconds, which the"
            " agent writes into every step's metrics row",
        )
    ]


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


def _environment(gpu: GPU) -> list[Flag]:
    if not gpu.is_cpu:
        return []
    return [
        Flag(
            "environment",
            "VLLM_CPU_KVCACHE_SPACE",
            f"{gpu.memory_gib:g}",
            True,
            "KV cache space of the CPU backend in GiB (the KV plan's budget)",
            env=True,
        ),
        Flag(
            "environment",
            "VLLM_CPU_OMP_THREADS_BIND",
            "nobind",
            True,
            "let the OS place OpenMP threads: on a shared node the cores are not ours alone",
            env=True,
        ),
    ]


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
    family, why_none = None, ""
    try:
        family = catalogues.family_for(config, o.family, catalogue)
    except CatalogueError as exc:
        if o.family:  # a family asked by name must exist
            raise
        why_none = str(exc)
    if gpu.is_cpu:
        fp8_weights, fp8_kv = False, o.kv_cache_dtype == "fp8"
    else:
        fp8_weights = not shape.checkpoint_fp8 and (
            o.quantization == "fp8" or (o.quantization == "auto" and gpu.cc >= FP8_TENSOR_CORES_CC)
        )
        fp8_kv = o.kv_cache_dtype == "fp8" or (
            o.kv_cache_dtype == "auto" and gpu.cc >= FP8_KV_CACHE_CC
        )
    text_only = bool(family and family.language_model_only)
    speculative = _speculative(gpu, shape, o, family, model_id)
    drafting = next((json.loads(f.value) for f in speculative if f.chosen and f.value), {})
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
            weight_dtype="fp8" if fp8_weights else "auto",
            max_model_len=o.max_model_len,
            gpu_memory_utilization=o.gpu_memory_utilization,
            params=o.params,
            language_model_only=text_only,
            # what vLLM reserves per request with these flags: linear states, MTP layers' KV
            prefix_caching=o.prefix_caching,
            speculative_tokens=draft,
            mtp=drafting.get("method") == "mtp" and "model" not in drafting,
            skip_sliding=True,  # an FP8 KV cache always comes with the skip (_kv_skip_sliding)
            drafter=drafter,
        )

    plan = plan_for("fp8" if fp8_kv else "auto")
    known = family.fp8_checkpoints.get(model_id or "") if family else None
    published = known if fp8_weights and o.fp8_checkpoint else None
    flags = [
        *_cuda_graphs(gpu, o, plan, draft),
        *_fp8(gpu, shape, o, plan, plan_for("auto") if fp8_kv else plan, published),
        *_prefix_caching(o),
        *speculative,
        *_capacity(gpu, shape, o, plan),
        *_tools(shape, o, family, why_none),
        *_measurement(),
        *_environment(gpu),
    ]
    return FlagPlan(gpu=gpu, shape=shape, plan=plan, overrides=o, family=family, flags=flags)

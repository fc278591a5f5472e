"""The plan of a server's flags and its types: the overrides a config may set, one flag with the
reason it was chosen or left out, and the plan of all of them (its arguments, environment and
explanation)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from agent.serve import kvplan_text
from agent.serve.catalogue import Family
from agent.serve.gpu import GPU
from agent.serve.kvplan import KVPlan
from agent.serve.model_config import ModelShape

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
            "kv_plan": kvplan_text.as_dict(self.plan),
        }

    def explain(self) -> str:
        lines = [
            f"vLLM flags for {self.shape.source} ({self.shape.model_type}) on {self.gpu.label()}",
            f"model family: {self.family.name} (catalogue {self.family.source})"
            if self.family
            else "model family: none in the catalogue",
            f"KV cache: {kvplan_text.kv_summary(self.plan)}",
        ]
        if self.plan.drafter is not None:
            lines.append(f"drafter: {kvplan_text.drafter_summary(self.plan)}")
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

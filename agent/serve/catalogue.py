"""The model catalogue: per model family, how vLLM serves it and how the agent samples from it.

The families live in ``models.yaml`` beside this module (a data file, one entry per family). A site
extends or overrides it with its own YAML file, named by ``SCAGENT_MODELS`` and/or the launcher's
``--catalogue``: an entry whose key exists replaces only the fields it names, a new key adds a
family (then every field is required). The flags (``agent.serve.flags``) and the endpoint file's
``info["family"]`` (read by the client's policy) both come from the chosen ``Family``, so the
parser the server runs and the sampling the agent uses cannot disagree.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

PACKAGED = Path(__file__).with_name("models.yaml")
TEMPLATES = Path(__file__).with_name("templates")
SITE_ENV = "SCAGENT_MODELS"


class CatalogueError(ValueError):
    """A catalogue file that cannot be used, or a model no family matches; names file and key."""


class _Match(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model_types: list[str] = Field(default_factory=list)
    architectures: list[str] = Field(default_factory=list)


class _Speculative(BaseModel):
    model_config = ConfigDict(extra="forbid")

    method: str
    num_speculative_tokens: int = Field(ge=1, le=8)


class _Entry(BaseModel):
    """One family as written in a catalogue file (all fields required: no silent defaults)."""

    model_config = ConfigDict(extra="forbid")

    match: _Match
    tool_call_parser: str
    reasoning_parser: str | None
    chat_template: str | None
    strict_tools: bool
    speculative: _Speculative | None
    sampling: dict[str, float | int]
    max_tokens: int = Field(ge=16)
    thinking: bool
    no_thinking: dict[str, Any] | None
    thinking_budget: int | None = Field(ge=1)
    language_model_only: bool
    history_reasoning: Literal["none", "current_turn", "preserve"]
    # published FP8 checkpoints (Hub id -> its FP8 Hub id) and speculative drafters (Hub id ->
    # drafter Hub id): most families have none, so these two may be left out
    fp8_checkpoints: dict[str, str] = Field(default_factory=dict)
    drafters: dict[str, str] = Field(default_factory=dict)


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]
    architectures: tuple[str, ...]
    tool_call_parser: str
    reasoning_parser: str | None
    chat_template: str | None
    strict_tools: bool
    speculative: dict[str, Any] | None
    sampling: dict[str, float | int]
    max_tokens: int
    thinking: bool
    no_thinking: dict[str, Any] | None
    thinking_budget: int | None
    language_model_only: bool
    history_reasoning: str  # none | current_turn | preserve: which earlier thoughts are sent back
    fp8_checkpoints: dict[str, str]
    drafters: dict[str, str]
    source: str  # the catalogue file(s) the entry came from

    def chat_template_path(self) -> Path | None:
        """The template file: a name in agent/serve/templates/, or a path a site file gives."""
        if self.chat_template is None:
            return None
        given = Path(self.chat_template).expanduser()
        return given if given.is_absolute() else TEMPLATES / given

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (lists, not tuples): the endpoint file's ``info["family"]``."""
        d = asdict(self)
        d["model_types"], d["architectures"] = list(self.model_types), list(self.architectures)
        return d


def _read(path: Path) -> dict[str, dict[str, Any]]:
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise CatalogueError(f"model catalogue {path}: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise CatalogueError(f"model catalogue {path}: not valid YAML ({exc})") from exc
    if not isinstance(data, dict) or not all(isinstance(v, dict) for v in data.values()):
        raise CatalogueError(
            f"model catalogue {path}: expected a mapping of family name to its fields"
        )
    return data


def _family(name: str, fields: dict[str, Any], source: str) -> Family:
    try:
        entry = _Entry.model_validate(fields)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or '(entry)'}: {e['msg']}" for e in exc.errors()
        )
        raise CatalogueError(
            f"model catalogue {source}: family {name!r}: {problems}; fields are"
            f" {sorted(_Entry.model_fields)}"
        ) from None
    family = Family(
        name=name,
        model_types=tuple(entry.match.model_types),
        architectures=tuple(entry.match.architectures),
        tool_call_parser=entry.tool_call_parser,
        reasoning_parser=entry.reasoning_parser,
        chat_template=entry.chat_template,
        strict_tools=entry.strict_tools,
        speculative=entry.speculative.model_dump() if entry.speculative else None,
        sampling=dict(entry.sampling),
        max_tokens=entry.max_tokens,
        thinking=entry.thinking,
        no_thinking=entry.no_thinking,
        thinking_budget=entry.thinking_budget,
        language_model_only=entry.language_model_only,
        history_reasoning=entry.history_reasoning,
        fp8_checkpoints=dict(entry.fp8_checkpoints),
        drafters=dict(entry.drafters),
        source=source,
    )
    template = family.chat_template_path()
    if template is not None and not template.is_file():
        raise CatalogueError(
            f"model catalogue {source}: family {name!r}: chat_template {template}: no such file"
        )
    return family


@dataclass(frozen=True)
class Catalogue:
    families: dict[str, Family]

    def get(self, name: str) -> Family:
        if name not in self.families:
            raise CatalogueError(
                f"model family {name!r} is not in the catalogue; known: {sorted(self.families)}"
            )
        return self.families[name]

    def family_for(self, config: dict[str, Any], name: str | None = None) -> Family:
        """The family ``name`` names, else the one whose match lists the config's model_type
        (text_config's first: that is the model that generates), else its architectures."""
        if name:
            return self.get(name)
        text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
        types = [t for t in (text.get("model_type"), config.get("model_type")) if t]
        for model_type in types:
            for family in self.families.values():
                if model_type in family.model_types:
                    return family
        architectures = list(config.get("architectures") or [])
        for family in self.families.values():
            if set(architectures) & set(family.architectures):
                return family
        raise CatalogueError(
            f"no model family in the catalogue matches model_type {' / '.join(types) or '?'}"
            f" (architectures {architectures}); known families: {sorted(self.families)}. Force one"
            f" with --override family=NAME, or add an entry in a site catalogue (${SITE_ENV} or"
            " --catalogue FILE)"
        )


def load(extra: str | Path | None = None) -> Catalogue:
    """The packaged catalogue, then ``$SCAGENT_MODELS``, then ``extra``; later files win field by field."""
    raw: dict[str, dict[str, Any]] = {}
    sources: dict[str, str] = {}
    files = [PACKAGED]
    if os.environ.get(SITE_ENV):
        files.append(Path(os.environ[SITE_ENV]))
    if extra:
        files.append(Path(extra))
    for path in files:
        for name, fields in _read(path).items():
            raw[name] = {**raw.get(name, {}), **fields}
            sources[name] = (
                f"{sources[name]} + {path}" if name in sources and path != PACKAGED else str(path)
            )
    return Catalogue({name: _family(name, fields, sources[name]) for name, fields in raw.items()})


def family_for(
    config: dict[str, Any], name: str | None = None, catalogue: Catalogue | None = None
) -> Family:
    """The family serving ``config`` (``name`` forces one), from ``catalogue`` or the default load."""
    return (catalogue or load()).family_for(config, name)

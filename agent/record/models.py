"""The record's types: a run's ``meta``, a step entry and a metrics row, and the whole file.

Every writer of a record goes through them: ``RunMeta.part`` checks the fields a writer sets
against their types and gives them back in the record's JSON form (in the order given, so a record
reads as it always has); ``StepEntry`` checks each entry before it is first saved and fixes the
order of its keys; the loop builds a ``MetricsRow`` per iteration. Readers (``check_record``,
the report) validate a whole meta (``RunMeta.problem``). ``WorldStateFile`` is the file; its schema,
``agent/schemas/world_state.schema.json``, is generated (``python -m agent.record.schema``).

Records of earlier versions read: fields added since are optional, with the value the runs before
them had where that matters (``doublets``); ``meta.record_version`` says which rules a record was
written under (agent/record/world_state.py).
"""

from __future__ import annotations

from functools import cache
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, TypeAdapter, ValidationError

from agent.checks import Check

SHA256 = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]
Status = Literal[
    "running", "finished", "partial", "step_limit", "repeated_failures", "input_refused",
    "failed", "interrupted",
]  # fmt: skip


class Resumed(BaseModel):
    """One time a run continued an unfinished record (agent.resume.catch_up)."""

    model_config = ConfigDict(extra="forbid")

    at_step: int = Field(description="The step the run went on from.")
    checkpoint_step: int = Field(description="The step of the checkpoint it loaded (0: none).")
    time: str
    rejected_checkpoints: list[str] = Field(
        None, description="Newer checkpoints passed over, and why; absent when none was."
    )


class Outage(BaseModel):
    """One time the model server stopped answering (agent/policies/llm.py)."""

    model_config = ConfigDict(extra="forbid")

    step: int
    error: str
    waited_s: float = Field(None, description="Seconds the agent waited for the server.")


class Versions(BaseModel):
    """Python's version and each installed package's (agent.record.provenance.PACKAGES)."""

    model_config = ConfigDict(extra="allow")
    __pydantic_extra__: dict[str, str]

    python: str


class RunMeta(BaseModel):
    """A run's ``meta``, in the order a new record has its fields. Optional fields without
    ``null`` among their types are absent where a record does not have them."""

    model_config = ConfigDict(extra="allow")  # fields a later release adds read here too

    # What decides an analysis besides its code (agent.runner.run_sample's settings): a record is
    # kept or resumed only under the same (agent.resume.differences).
    sample: str = Field(min_length=1)
    input_sha256: SHA256 = Field(
        description="sha256 of the input file, or of a 10x folder's used files (name and sha256 "
        "of each, in order)."
    )
    policy: Literal["reference", "llm", "replay"]
    seed: int
    brief: str | None = Field(None, description="Extra instructions the run was given.")
    layer: str | None = Field(None, description="load_data's layer (agent.config.LOAD_OPTIONS).")
    gene_symbols: str | None = Field(None, description="load_data's gene_symbols.")
    celltypist_model_sha256: SHA256 | None = Field(
        None, description="sha256 of the CellTypist model the run was given; null: none."
    )
    doublets: Literal["remove", "flag"] = Field(
        "remove", description="What became of predicted doublets; records before it removed them."
    )
    raw_input_sha256: SHA256 | None = Field(
        None, description="sha256 of the unfiltered droplet matrix; null: none."
    )
    # Where the run began.
    input: str
    input_files: dict[str, SHA256] = Field(
        None,
        description="sha256 of each file the reader used, by file name (content, not location).",
    )
    celltypist_model: str | None = None
    raw_input: str | None = None
    started: str = Field(json_schema_extra={"format": "date-time"})
    resumed: list[Resumed] = Field(
        None,
        description="Each time a run continued an unfinished record: the step it went on from "
        "and the checkpoint it loaded.",
    )
    # Each attempt's (agent.runner._run, agent.policies.make_policy).
    model: str | None
    server_flags: Any
    server: dict[str, Any] | None = Field(
        None,
        description="The model server as its endpoint file names it (vllm_version, model_id, "
        "revision, family, started_at: the server's start, as its SHARD.metrics.jsonl rows name "
        "it); null without a model or an endpoint file.",
    )
    sampling: dict[str, Any] | None = Field(
        None,
        description="The effective request settings (temperature, top_p, top_k, max_tokens, "
        "seed, thinking); null without a model.",
    )
    prompt_digest: SHA256 | None = Field(
        None,
        description="sha256 of the system prompt and tool schemas as sent "
        "(agent.runner.prompt_digest); null for policies that send no prompt.",
    )
    versions: Versions
    digest_version: int = Field(
        None,
        description="Version of the data digest scheme (agent.digest.DIGEST_VERSION); a record of "
        "another is replayed without comparing digests.",
    )
    host: str = None
    slurm_job_id: str | None = None
    ended: str | None
    status: Status = Field(
        description="finished: finish succeeded with every stage of an analysis reached; "
        "partial: finish was told why the analysis cannot be completed (meta.error says why and "
        "what is missing); the others: the run ended without finish."
    )
    record_version: int = Field(
        None,
        ge=1,
        description="Version of the record (agent.record.world_state.RECORD_VERSION); from 2 "
        "every entry carries its chain and a final meta its seal, and load_data names the run's "
        "input <input>. Absent: 1.",
    )
    context_limit: int = Field(None, ge=1)
    # How it went and ended (agent.loop.run_loop, agent.runner).
    outages: list[Outage] = Field(
        None,
        description="Each time the model server stopped answering: the step, the error, and how "
        "long the agent waited.",
    )
    thinking_budget_hits: int = Field(
        None,
        ge=0,
        description="Steps whose thinking reached the request's thinking_token_budget "
        "(meta.sampling.thinking_budget), where the server closed the thought.",
    )
    truncations: int = Field(None, ge=0)
    error: str = None
    checks: list[Check] = Field(
        None,
        description="Every check of the run's decisions (agent/checks.py): those the steps' "
        "results carry and those of the record as a whole, written when the run ends.",
    )
    seal: SHA256 = Field(
        None,
        description="sha256 over the last entry's chain and meta without the seal, written with "
        "a final status (agent/record/integrity.py).",
    )

    @classmethod
    def problem(cls, meta: dict[str, Any]) -> str | None:
        """Why ``meta`` does not read as a run's meta, in one line; None when it does."""
        try:
            cls.model_validate(meta)
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "meta"
            return f"meta does not read as a run's meta: {where}: {first['msg']}" + (
                f" (and {e.error_count() - 1} more)" if e.error_count() > 1 else ""
            )
        return None

    @classmethod
    def since_added(cls, name: str) -> Any:
        """What a record made before field ``name`` existed had in it: the field's default
        (None for a field every record has)."""
        field = cls.model_fields[name]
        return None if field.is_required() else field.default

    @classmethod
    def part(cls, **values: Any) -> dict[str, Any]:
        """``values``, each checked against its field's type, as the record writes them (in the
        order given; keys a nested value lacks stay absent): how every writer sets fields of a
        record's meta. An unknown field is a KeyError."""
        return {name: _dumped(_field(name), value) for name, value in values.items()}


@cache
def _field(name: str) -> TypeAdapter[Any]:
    info = RunMeta.model_fields[name]  # KeyError: not a field of meta
    typed = Annotated[info.annotation, *info.metadata] if info.metadata else info.annotation
    return TypeAdapter(typed)


def _dumped(adapter: TypeAdapter[Any], value: Any) -> Any:
    return adapter.dump_python(adapter.validate_python(value), exclude_unset=True)


class StepEntry(BaseModel):
    """One finished tool call as the record keeps it, its keys in the record's order. An entry
    is checked against it when first saved (agent.record.world_state.WorldState)."""

    model_config = ConfigDict(extra="forbid")

    step: int = Field(ge=1)
    tool: str = Field(min_length=1)
    params: dict[str, Any]
    status: Literal["ok", "error"]
    result: dict[str, Any] | None
    error: str | None
    seconds: float = Field(ge=0)
    digest_before: str | None
    digest_after: str | None
    call_id: str | None
    checkpoint: str | None
    rejected_arguments: Any = Field(
        None,
        description="The arguments as sent, for a call refused before it ran (params is then "
        "empty); absent otherwise. Records of schema version 1 before this field held them as "
        "params._raw.",
    )
    chain: SHA256 = Field(
        None,
        description="sha256 over the previous entry's chain and this entry "
        "(agent/record/integrity.py): an entry altered or removed breaks it.",
    )


# What an entry's status says of its result and error, as agent/schemas/world_state.schema.json
# has always said (the schema's generator adds it: pydantic leaves conditions to JSON schema): an
# ok step has a result and no error; a failed one an error, and no result or the check that
# refused it.
ENTRY_STATUS_RULES: list[dict[str, Any]] = [
    {
        "if": {"properties": {"status": {"const": "ok"}}},
        "then": {"properties": {"result": {"type": "object"}, "error": {"type": "null"}}},
    },
    {
        "if": {"properties": {"status": {"const": "error"}}},
        "then": {
            "properties": {
                "result": {
                    "anyOf": [
                        {"type": "null"},
                        {
                            "type": "object",
                            "required": ["checks"],
                            "additionalProperties": False,
                            "properties": {
                                "checks": {"type": "array", "items": {"$ref": "#/$defs/Check"}}
                            },
                        },
                    ],
                    "description": "null, or the check that refused the call",
                },
                "error": {"type": "string"},
            }
        },
    },
]
# An entry's keys that every entry has, in the record's order.
ENTRY_KEYS = tuple(name for name, f in StepEntry.model_fields.items() if f.is_required())


class WorldStateFile(BaseModel):
    """world_state.json: the provenance record of one agent run, its meta and one entry per
    finished tool call."""

    model_config = ConfigDict(
        extra="forbid",
        title="scagent world state",
        json_schema_extra={
            "description": "The provenance record of one agent run: run metadata and one entry "
            "per finished tool call."
        },
    )

    schema_version: Literal[1]
    meta: RunMeta
    entries: list[StepEntry]


class MetricsRow(BaseModel):
    """One row of a sample's metrics.jsonl: one loop iteration (agent.loop.run_loop)."""

    model_config = ConfigDict(extra="forbid")

    step: int = Field(description="The iteration's last step.")
    tools: list[str]
    status: list[str]
    decide_seconds: float
    tool_seconds: float
    prompt_tokens: int | None
    completion_tokens: int | None
    cached_tokens: int | None
    reasoning_tokens: int | None
    # the server's split of decide_seconds (vLLM per-request metrics; null where not sent)
    queue_seconds: float | None = None
    ttft_seconds: float | None = None
    decode_seconds: float | None = None
    thinking_budget_hit: bool | None
    calibration: float = Field(description="The token counter's factor (agent/context.py).")
    time: float
    # the prompt's budget and what its cut did (agent.context.ContextManager.last)
    budget: int = None
    history_tokens: int = None
    estimated_prompt_tokens: int = None
    truncated_messages: int = None
    truncations: int = None
    reprefilled_tokens: int = None
    estimate_error: int = Field(None, description="Estimated minus served prompt tokens.")

    def row(self) -> dict[str, Any]:
        """The row as metrics.jsonl has it: the context's keys only where it gave them."""
        return self.model_dump(exclude_unset=True)

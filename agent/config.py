"""RunConfig: everything one sample run needs, in one validated object.

`python -m agent run` only builds it from its options (one option per field, the field's
description as its help); replay, the benchmarks and the tests build the same object and call
``agent.runner.run_sample(config)``.
"""

from __future__ import annotations

import argparse
import os
import types
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, model_validator

from agent.record.layout import SampleLayout

NAME_MAX = 255  # bytes of one file or folder name (Linux's file systems, NFS, Lustre)


class RunConfig(BaseModel):
    """One sample, one policy, one output folder."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    input: Path = Field(description="10x mtx folder, 10x .h5 or .h5ad of raw counts")
    outdir: Path = Field(description="the sample's output folder")
    sample: str | None = Field(
        None,
        description="sample name (default: the input's name; for a generic one such as "
        "counts.h5ad or filtered_feature_bc_matrix, the first folder above it named otherwise)",
    )
    layer: str | None = Field(
        None,
        description="read the counts from this layer of an .h5ad ('raw': adata.raw), as "
        "load_data's layer",
    )
    gene_symbols: str | None = Field(
        None,
        description="column of the gene annotations (var) holding gene symbols, as load_data's "
        "gene_symbols ('var_names' keeps Ensembl IDs knowingly)",
    )
    celltypist_model: Path | None = Field(
        None,
        description="CellTypist model file (.pkl, e.g. from celltypist.train) whose labels become "
        "the cell types, voted per Leiden cluster (annotate_celltypist; default: marker sets "
        "only); its sha256 is one of the run's settings. A model is a pickle, which can run code "
        "when loaded: give only a model you trust. No other file is unpickled; this one is read "
        "through an allow-list of a model's classes (another refused before it runs) and its "
        "sha256 checked at every use",
    )
    raw_input: Path | None = Field(
        None,
        description="the sample's unfiltered droplet matrix (10x mtx folder, .h5 or .h5ad, e.g. "
        "Cell Ranger's raw_feature_bc_matrix) beside a filtered input: remove_ambient takes the "
        "soup of ambient RNA from its empty droplets (SoupX); its checksum is one of the run's "
        "settings",
    )
    doublets: Literal["remove", "flag"] = Field(
        "remove",
        description="what becomes of the cells detect_doublets predicts to be doublets: removed "
        "(remove_doublets), or flagged and kept (obs['predicted_doublet']), left out of the "
        "markers and of the labels' evidence; one of the run's settings",
    )
    policy: Literal["reference", "llm", "replay"] = Field(
        "reference",
        description="who decides the next call: the reference recipe, a model, or a record",
    )
    endpoint_file: Path | None = Field(
        None, description="endpoint JSON written by `python -m agent serve` (llm policy)"
    )
    base_url: str | None = Field(
        None, description="OpenAI-compatible base URL, e.g. http://host:8000/v1 (llm policy)"
    )
    model: str | None = Field(None, description="model name on that server (llm policy)")
    api_key_file: Path | None = Field(None, description="file holding the server's API key")
    brief: str | None = Field(None, description="extra instructions for this sample")
    world_state: Path | None = Field(
        None, description="recorded world_state.json whose calls to repeat (replay policy)"
    )
    seed: int = Field(0, description="seed of every random step (PCA, UMAP, Leiden, Scrublet...)")
    fresh: bool = Field(
        False,
        description="start over even if the folder holds an analysis of this sample (it is moved "
        "to previous/)",
    )
    replace_changed: bool = Field(
        False,
        description="start over, as --fresh, only when the folder's analysis was made with other "
        "settings or another input (default: refuse, naming them); the workflow passes it, as "
        "an edited sample sheet or input asks for a new analysis",
    )
    max_steps: int = Field(120, ge=1, description="tool calls at most")
    context_limit: int = Field(
        32768, ge=1, description="used when the server does not report max_model_len"
    )
    max_tokens: int | None = Field(
        None,
        ge=1,
        description="completion limit per reply, reserved in the context budget (default: the "
        "model family's, which leaves thinking models room to think; else 1024)",
    )
    no_thinking: bool = Field(
        False,
        description="switch the model's thinking off from the first request, where its family "
        "has a switch (Qwen3, Qwen3.5/3.6: enable_thinking false): shorter, faster replies "
        "(llm policy)",
    )
    thinking_budget: int | None = Field(
        None,
        ge=0,
        description="thinking tokens per reply at most, closed by the server (vLLM "
        "thinking_token_budget; needs its reasoning parser); default: the model family's; 0: "
        "unbounded (llm policy)",
    )
    tokenizer: str | None = Field(
        None, description="model folder with tokenizer.json, for exact local token counts"
    )
    request_timeout: float = Field(
        300.0, gt=0, description="seconds one model request may take before it is retried"
    )
    request_retries: int = Field(
        5,
        ge=0,
        description="retries of a failed or timed-out request (exponential backoff) before the "
        "outage wait",
    )
    server_wait: float = Field(600.0, ge=0, description="seconds to wait for server health")
    outage_wait: float = Field(
        900.0,
        ge=0,
        description="seconds to wait for a server that died or stalled mid-run before failing "
        "(the record stays resumable; with --endpoint-file a restarted server is followed)",
    )

    @model_validator(mode="after")
    def _name_lengths(self) -> RunConfig:
        """A name longer than file systems allow is refused as the mistake it is (a rerun
        cannot resume what could never be written or read)."""
        paths = (("--input", self.input), ("--outdir", self.outdir))
        for flag, path in (*paths, ("--celltypist-model", self.celltypist_model)):
            for part in path.parts if path is not None else ():
                if len(os.fsencode(part)) > NAME_MAX:
                    raise ValueError(
                        f"{flag} {path}: the name {part[:24]}... is {len(os.fsencode(part))} "
                        f"bytes long; file systems allow {NAME_MAX}"
                    )
        return self

    @model_validator(mode="after")
    def _policy_inputs(self) -> RunConfig:
        if self.policy == "replay" and self.world_state is None:
            raise ValueError(
                "--policy replay needs --world-state FILE (the recorded run to replay)"
            )
        if self.policy == "llm" and not (self.endpoint_file or (self.base_url and self.model)):
            raise ValueError(
                "--policy llm needs --endpoint-file FILE, or --base-url URL and --model NAME"
            )
        if self.raw_input is not None and not self.raw_input.exists():
            raise ValueError(f"--raw-input {self.raw_input}: no such file or folder")
        if self.celltypist_model is not None and not self.celltypist_model.is_file():
            raise ValueError(f"--celltypist-model {self.celltypist_model}: no such file")
        if self.celltypist_model is not None:  # a non-model refused now, not at annotation
            from agent.celltypist_model import ModelRefused, read_model

            try:
                read_model(self.celltypist_model)
            except ModelRefused as e:
                raise ValueError(f"--celltypist-model {e}") from None
            except OSError as e:
                raise ValueError(f"--celltypist-model {self.celltypist_model}: {e}") from None
        return self

    @property
    def layout(self) -> SampleLayout:
        return SampleLayout(self.outdir)

    @property
    def sample_name(self) -> str:
        return self.sample or default_sample_name(self.input)

    @property
    def load_options(self) -> dict[str, str]:
        """The load_data arguments this run sets (the reference policy passes them)."""
        return {k: getattr(self, k) for k in LOAD_OPTIONS if getattr(self, k)}

    # The command line: one option per field, so that the two never disagree.

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        for name, field in cls.model_fields.items():
            flag = "--" + name.replace("_", "-")
            kind = _plain(field.annotation)
            if kind is bool:
                parser.add_argument(flag, action="store_true", help=field.description)
                continue
            extra: dict[str, Any] = {}
            if get_origin(kind) is Literal:
                extra["choices"] = list(get_args(kind))
            else:
                extra["type"] = kind
            if field.is_required():
                extra["required"] = True
                help_text = field.description
            else:
                extra["default"] = field.default
                shown = f" (default: {field.default})" if field.default is not None else ""
                help_text = f"{field.description}{shown}"
            parser.add_argument(flag, help=help_text, **extra)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> RunConfig:
        return cls(**{name: getattr(args, name) for name in cls.model_fields})


# Run options that are load_data arguments of the same name; the record's meta keeps them.
LOAD_OPTIONS = ("layer", "gene_symbols")
# Names that say what a file or folder holds, not whose it is: a sample is named by the first
# folder above them.
GENERIC_NAMES = frozenset(
    {
        "counts",
        "matrix",
        "outs",
        "filtered_feature_bc_matrix",
        "raw_feature_bc_matrix",
        "sample_filtered_feature_bc_matrix",
    }
)
# Cell Ranger v2 puts its matrix in one of these, in a folder named by the genome (hg19, mm10).
GENOME_PARENTS = frozenset({"filtered_gene_bc_matrices", "raw_gene_bc_matrices"})


def default_sample_name(path: Path) -> str:
    """The input's name (less .h5/.h5ad), or the first folder above it not named generically."""
    path = path.absolute()
    for part in (path, *path.parents):
        name = part.stem if part == path and part.suffix in (".h5", ".h5ad") else part.name
        generic = name.lower() in GENERIC_NAMES | GENOME_PARENTS
        if name and not generic and part.parent.name not in GENOME_PARENTS:
            return name
    return path.stem


def _plain(annotation: Any) -> Any:
    """``X | None`` -> X."""
    if get_origin(annotation) in (Union, types.UnionType):
        return next(a for a in get_args(annotation) if a is not type(None))
    return annotation

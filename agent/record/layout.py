"""SampleLayout: the one place that names every path of a sample's output folder.

The loop, the record, the tools' session, replay, the report, the RO-Crate and the workflow's
rules (through ``workflow/rules/common.smk``) all take their paths from here, so renaming a file
is a one-line change below.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

# Names inside a sample's folder. Kept beside the checkpoints are copies (hard links) of every
# published file (record, metrics, final data, plots): Snakemake deletes a job's declared outputs
# when it fails (also after the agent finished, e.g. an input "newer" than its outputs), and a
# resumed or kept job reads the copies, which Snakemake does not own, and publishes them again.
RECORD = "world_state.json"
METRICS = "metrics.jsonl"
FINAL = "adata.h5ad"
REPLAY = "replay.json"
PLOTS = "plots"
CHECKPOINTS = "checkpoints"
PREVIOUS = "previous"
LOCK = ".lock"


class Kept(NamedTuple):
    """A published file or folder and its copy beside the checkpoints."""

    name: Path
    copy: Path
    written_as_copy: bool  # the runs write the copy and the name follows it, else the reverse


@dataclass(frozen=True)
class SampleLayout:
    """Paths of one sample's folder; ``root`` may be a Snakemake pattern such as
    ``results/samples/{sample}``, since paths are only joined, never resolved."""

    root: Path

    def __init__(self, root: str | Path):
        object.__setattr__(self, "root", Path(root))

    @property
    def record(self) -> Path:
        """The provenance record (world state), a declared output."""
        return self.root / RECORD

    @property
    def metrics(self) -> Path:
        """One JSON line per loop iteration, a declared output."""
        return self.root / METRICS

    @property
    def final(self) -> Path:
        """The analysed AnnData, written by ``finish``."""
        return self.root / FINAL

    @property
    def replay(self) -> Path:
        """The replay verdict, written by ``agent replay``."""
        return self.root / REPLAY

    @property
    def plots(self) -> Path:
        """Figures the ``plot`` tool draws."""
        return self.root / PLOTS

    @property
    def checkpoints(self) -> Path:
        """Checkpoints and the kept copies of record and metrics (not declared outputs)."""
        return self.root / CHECKPOINTS

    @property
    def record_copy(self) -> Path:
        return self.checkpoints / RECORD

    @property
    def metrics_copy(self) -> Path:
        return self.checkpoints / METRICS

    @property
    def final_copy(self) -> Path:
        return self.checkpoints / FINAL

    @property
    def plots_copy(self) -> Path:
        return self.checkpoints / PLOTS

    def kept_copies(self) -> list[Kept]:
        """Each published file or folder and its copy beside the checkpoints: the record and the
        metrics are written as their copies, the final data and the plots under their names."""
        return [
            Kept(self.record, self.record_copy, written_as_copy=True),
            Kept(self.metrics, self.metrics_copy, written_as_copy=True),
            Kept(self.final, self.final_copy, written_as_copy=False),
            Kept(self.plots, self.plots_copy, written_as_copy=False),
        ]

    @property
    def lock(self) -> Path:
        """Held by the one run writing this folder (agent/record/lock.py)."""
        return self.root / LOCK

    def previous(self, stamp: str) -> Path:
        """Where ``--fresh`` keeps the analysis it replaces (record, metrics, final data, plots)."""
        return self.root / PREVIOUS / stamp

    def kept_results(self) -> list[Path]:
        """What ``--fresh`` moves to ``previous/``: everything a finished analysis published."""
        return [self.record, self.metrics, self.final, self.replay, self.plots]

    def checkpoint(self, step: int) -> Path:
        """The AnnData checkpoint written after ``step``; its sidecar is the same name in .json."""
        return self.checkpoints / f"step_{step:04d}.h5ad"

    @staticmethod
    def checkpoint_step(path: Path) -> int | None:
        """The step a checkpoint file name stands for, or None for any other file."""
        stem = path.stem
        return int(stem[5:]) if stem.startswith("step_") and stem[5:].isdigit() else None

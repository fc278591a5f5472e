"""The state one run's tools share: the AnnData, the sample's output folder, the seed, checkpoints."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import anndata as ad

from agent.digest import digest_adata
from agent.record.durable import atomic_write_h5ad, atomic_write_json
from agent.record.layout import SampleLayout
from agent.registry import STAGE_COLUMNS, STAGES, ToolError, ToolSpec


class Session:
    """Holds the AnnData of one sample between tool calls.

    Tools write only inside ``outdir``; ``path_inside`` enforces it for any path a tool is given.
    They read only the run's input (``input_path``, a file or a 10x folder) or files in ``outdir``.
    ``done`` holds the names of the tools that have succeeded since the data were loaded (each tool
    adds itself; see ``agent.registry.tool``). The loop reports each success through
    ``after_step``, which writes checkpoints.
    """

    def __init__(
        self,
        outdir: str | Path,
        seed: int = 0,
        input_path: str | Path | None = None,
        checkpoint_every: int = 4,
        keep_checkpoints: int = 2,
        celltypist_model: str | Path | None = None,
        celltypist_model_sha256: str | None = None,
        doublets: str = "remove",
        raw_input: str | Path | None = None,
    ):
        self.outdir = Path(outdir).resolve()
        self.outdir.mkdir(parents=True, exist_ok=True)
        self.layout = SampleLayout(self.outdir)
        self.seed = seed
        self.input_path = Path(input_path).resolve() if input_path else None
        # the run's CellTypist model (--celltypist-model): readable like the input, wherever it is
        self.celltypist_model = Path(celltypist_model).resolve() if celltypist_model else None
        self.celltypist_model_sha256 = celltypist_model_sha256  # the run's; None: not checked
        self.doublets = doublets  # the run's setting: "remove", or "flag" (cells kept)
        # the unfiltered droplets beside a filtered input (--raw-input), whose soup remove_ambient reads
        self.raw_input = Path(raw_input).resolve() if raw_input else None
        self.checkpoint_every = checkpoint_every
        self.keep_checkpoints = keep_checkpoints
        self._adata: Any = None
        self.done: set[str] = set()  # names of tools that have succeeded, for prerequisites
        # stage -> how the current data reached it ({"tool", "clustering"}), for finish
        self.stages: dict[str, dict[str, Any]] = {}
        self.stale: dict[str, str] = {}  # stage -> the tool whose success made it stale
        self._checkpoint_step = 0

    @property
    def adata(self) -> Any:
        if self._adata is None:
            raise ToolError("no data loaded yet: call load_data first")
        return self._adata

    @adata.setter
    def adata(self, value: Any) -> None:
        self._adata = value

    @property
    def has_data(self) -> bool:
        return self._adata is not None

    def digest(self) -> str | None:
        return digest_adata(self._adata) if self._adata is not None else None

    def path_inside(self, relative: str | Path) -> Path:
        """Resolve a tool-given path under the output folder, refusing anything outside it."""
        path = (self.outdir / relative).resolve()
        if not path.is_relative_to(self.outdir):
            raise ToolError(
                f"path {str(relative)!r} leaves the sample's output folder {self.outdir}"
            )
        return path

    def readable_path(self, given: str | Path | None) -> Path:
        """A path a tool may read: the run's input (or a file in its 10x folder) or one in outdir.

        ``None`` or the input's own file name means the run's input; any other relative path is
        taken from the output folder.
        """
        if given is None:
            if self.input_path is None:
                raise ToolError("this run has no input file: give a path inside the output folder")
            return self.input_path
        path = Path(given)
        named_input = self.input_path is not None and path == Path(self.input_path.name)
        if (
            named_input and not (self.outdir / path).exists()
        ):  # the input by name, as the brief has it
            return self.input_path
        path = (path if path.is_absolute() else self.outdir / path).resolve()
        allowed = [self.outdir] + [p for p in (self.input_path, self.celltypist_model) if p]
        if not any(path == root or path.is_relative_to(root) for root in allowed):
            raise ToolError(
                f"path {str(given)!r} is neither the run's input ({self.input_path}) nor inside "
                f"the sample's output folder {self.outdir}"
            )
        return path

    def require(self, tool: str, *steps: str) -> None:
        """Refuse a tool whose prerequisite steps (in pipeline order) have not succeeded yet."""
        missing = [s for s in steps if s not in self.done]
        if missing:
            raise ToolError(
                f"{tool} needs {', '.join(missing)} first (not done yet): call {missing[0]} next"
            )

    def replace_data(self, adata: Any) -> None:
        """New data from a file: everything done before applied to other data."""
        self._adata = adata
        self.done.clear()
        self.stages, self.stale = {}, {}

    def reached(self, tool: str, spec: ToolSpec, params: dict[str, Any]) -> None:
        """A tool succeeded: the stages it makes stale (``spec.resets`` and every later one) are
        gone, and the stage it reaches is reached, for the clustering it names."""
        if spec.resets:
            for stage in STAGES[STAGES.index(spec.resets) :]:
                if self.stages.pop(stage, None) is not None:
                    self.stale[stage] = tool
        if spec.stage:
            clustering = params.get(spec.clustering) if spec.clustering else None
            column = params.get("key_added")  # the obs column it wrote, where it names one
            self.stages[spec.stage] = {"tool": tool, "clustering": clustering, "column": column}
            self.stale.pop(spec.stage, None)

    def missing_stages(self) -> dict[str, str]:
        """The stages of a complete analysis the current data have not reached, each with why:
        never reached, made stale by a later tool, or reached for another clustering than the
        current one."""
        current = self.stages.get("clusters", {}).get("clustering")
        missing = {}
        for stage in STAGES:
            got = self.stages.get(stage)
            if got is None:
                missing[stage] = (
                    f"stale after {self.stale[stage]}" if stage in self.stale else "not done"
                )
            elif stage != "clusters" and got["clustering"] not in (None, current):
                missing[stage] = (
                    f"{got['tool']} ran on {got['clustering']!r}, not the current clustering "
                    f"{current!r}"
                )
            elif stage in STAGE_COLUMNS and got.get("column") not in (None, STAGE_COLUMNS[stage]):
                missing[stage] = (
                    f"{got['tool']} wrote {got['column']!r}; the object's readers take "
                    f"{STAGE_COLUMNS[stage]!r}"
                )
        return missing

    def after_step(self, step: int, tool: str, spec: ToolSpec) -> str | None:
        """Record a successful tool; write a checkpoint of the data when one is due.

        One is due after an expensive step, or when ``checkpoint_every`` steps have passed since
        the last one, so a crash costs at most a few cheap steps; never after a step that leaves
        the data as they were. Returns the checkpoint's path, or None when none was written.
        """
        self.done.add(tool)
        if self._adata is None or not spec.mutates:
            return None
        if not spec.expensive and step - self._checkpoint_step < self.checkpoint_every:
            return None
        path = self.layout.checkpoint(step)
        atomic_write_h5ad(self._adata, path)
        # the sidecar is written last: a checkpoint without one is incomplete and never restored
        sidecar = {
            "step": step, "tool": tool, "done": sorted(self.done), "seed": self.seed,
            "stages": self.stages, "stale": self.stale,
        }  # fmt: skip
        atomic_write_json(path.with_suffix(".json"), sidecar)
        self._checkpoint_step = step
        for old, _ in self._checkpoints()[: -self.keep_checkpoints]:
            old.unlink(missing_ok=True)
            old.with_suffix(".json").unlink(missing_ok=True)
        return str(path)

    def _checkpoints(self) -> list[tuple[Path, int]]:
        """Complete checkpoints (data and sidecar), oldest first."""
        found = []
        for path in self.layout.checkpoints.glob("step_*.h5ad"):
            step = SampleLayout.checkpoint_step(path)
            if step is not None and path.with_suffix(".json").is_file():
                found.append((path, step))
        return sorted(found, key=lambda item: item[1])

    def restore(
        self, step: int, digests: Mapping[int, str | None] | None = None
    ) -> tuple[int | None, list[str]]:
        """Load the newest usable checkpoint at or before ``step`` (data and done set).

        A checkpoint is usable when it reads and, given ``digests`` (step -> recorded data digest
        after it), holds exactly the recorded data: a damaged or foreign file is passed over for
        an older one. Returns its step (None: none usable, nothing loaded) and why others were not.
        """
        rejected = []
        for path, found in reversed([(p, s) for p, s in self._checkpoints() if s <= step]):
            try:
                meta = json.loads(path.with_suffix(".json").read_text())
                adata = ad.read_h5ad(path)
            except Exception as e:  # truncated, corrupt or unreadable: an older one may serve
                rejected.append(f"{path.name}: unreadable ({type(e).__name__}: {e})"[:300])
                continue
            if digests is not None and digest_adata(adata) != digests.get(found):
                rejected.append(f"{path.name}: data differ from the record of step {found}")
                continue
            self._adata, self.done, self._checkpoint_step = adata, set(meta["done"]), found
            # a checkpoint written before stages were kept: None, and catch_up derives them
            self.stages, self.stale = meta.get("stages"), meta.get("stale", {})
            return found, rejected
        return None, rejected

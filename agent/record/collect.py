"""Everything the report knows about one sample, read from its folder; never raises for a sample.

A sample's folder (its paths: agent.record.layout.SampleLayout) holds world_state.json, metrics.jsonl,
adata.h5ad, plots/*.png and, after the replay rule, replay.json. Whatever is missing or
unreadable becomes a problem noted on the sample (shown as failed in the report), never an
exception that would lose the other samples.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import orjson
import pandas as pd

from agent.record.checks import SampleChecks
from agent.record.durable import read_appended_rows
from agent.record.layout import SampleLayout
from agent.record.lock import holder_of
from agent.record.models import RunMeta
from agent.record.truth import read_truth, score
from agent.record.world_state import Entry, WorldState
from agent.tool_declarations import DECLARED

TRUTH_FILE = "truth.tsv"
CLUSTER_KEY = "leiden"
# What the model was and what it was told, as the report names it (Sample.model_provenance).
MODEL_PROVENANCE = ("model_id", "revision", "vllm_version", "family", "sampling", "prompt_digest")
# Tools that leave the data as they were: their parameters are bookkeeping (file names, prose),
# not analysis choices.
NOT_CHOICES = frozenset(name for name, declared in DECLARED.items() if not declared.mutates)


@dataclass
class Sample:
    name: str
    folder: Path
    world_state: Path
    status: str  # the run's meta.status, or "missing" / "unreadable"
    world: WorldState | None = None
    metrics: list[dict[str, Any]] = field(default_factory=list)
    replay: dict[str, Any] | None = None
    replay_path: Path | None = None
    truth_path: Path | None = None
    scores: dict[str, Any] | None = None
    final: Path | None = None
    final_obs: pd.DataFrame | None = None
    plots: list[Path] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    running: str | None = None  # who holds the folder of a run going on now (not failed)

    @property
    def meta(self) -> dict[str, Any]:
        return self.world.meta if self.world else {}

    @property
    def entries(self) -> list[Entry]:
        return self.world.entries if self.world else []

    @property
    def model_provenance(self) -> dict[str, Any]:
        """MODEL_PROVENANCE -> value, None where the record does not say: the reference and
        replay policies ask no model, an external server has no endpoint file, and records
        made before these fields have none of them."""
        meta = self.meta
        server = meta.get("server") if isinstance(meta.get("server"), dict) else {}
        family = server.get("family")
        return {
            "model_id": server.get("model_id"),
            "revision": server.get("revision"),
            "vllm_version": server.get("vllm_version"),
            "family": family.get("name") if isinstance(family, dict) else family,
            "sampling": meta.get("sampling"),
            "prompt_digest": meta.get("prompt_digest"),
        }

    @property
    def reference_model(self) -> dict[str, Any] | None:
        """The CellTypist model the final labels came from (annotate_celltypist's result: name,
        path, version, sha256, genes found), None where none labelled the cells."""
        entry = self.last_ok("annotate_celltypist")
        return (entry.result or {}).get("model") if entry else None

    @property
    def reference_annotation(self) -> str | None:
        """The reference model in one line, for the sample page and the cohort table."""
        model = self.reference_model
        if not model:
            return None
        return (
            f"model {model.get('name')} version {model.get('version')} sha256 "
            f"{model.get('sha256')} ({model.get('n_genes_found')} of {model.get('n_model_genes')} "
            "model genes in the data)"
        )

    @property
    def failed(self) -> bool:
        """Neither finished nor partial (a partial analysis ended by finish, told why)."""
        return self.status not in ("finished", "partial") and self.running is None

    @property
    def error(self) -> str | None:
        """Why the sample failed, or why it is partial, in one line; None when it finished."""
        if self.status == "finished":
            return None
        return self.meta.get("error") or "; ".join(self.problems) or f"run status {self.status}"

    def last_ok(self, tool: str) -> Entry | None:
        return self.world.last_ok(tool) if self.world else None

    @functools.cached_property
    def checks(self) -> SampleChecks:
        """The checks of the run's decisions: the record's, else computed from its steps."""
        return SampleChecks.of(self.world)


def match_replays(world_states: list[Path], replays: list[Path]) -> dict[Path, Path]:
    """world state -> its replay: the one in the same folder, else the one naming it."""
    by_folder = {p.parent.resolve(): p for p in replays}
    by_source: dict[Path, Path] = {}
    for p in replays:
        if p.parent.resolve() in {w.parent.resolve() for w in world_states}:
            continue
        try:
            source = orjson.loads(p.read_bytes()).get("world_state")
        except (OSError, orjson.JSONDecodeError, AttributeError):
            continue
        if source:
            by_source[Path(source).resolve()] = p
    matched = {}
    for w in world_states:
        found = by_folder.get(w.parent.resolve()) or by_source.get(w.resolve())
        if found is not None:
            matched[w] = found
    return matched


def read_replay(path: Path) -> dict[str, Any]:
    """replay.json as `agent replay` writes it, or ValueError saying what it lacks."""
    doc = orjson.loads(path.read_bytes())
    if not isinstance(doc, dict) or not isinstance(doc.get("verdict"), str):
        raise ValueError("not a replay record (expected an object with a 'verdict' string)")
    if not isinstance(doc.get("steps", []), list):
        raise ValueError("its 'steps' is not a list")
    return doc


def read_obs(path: Path, columns: list[str] | None = None) -> pd.DataFrame:
    """The cell annotations of an .h5ad (the matrix is never read); with ``columns``, only the
    cell names and those columns (at 1,000 samples the whole obs is a third of the report's time).
    """
    import h5py
    from anndata.io import read_elem

    with h5py.File(path, "r") as f:
        obs = f["obs"]
        if columns is None:
            return read_elem(obs)
        index = pd.Index(read_elem(obs[obs.attrs["_index"]]))
        return pd.DataFrame({c: read_elem(obs[c]) for c in columns if c in obs}, index=index)


def find_truth(sample: str, input_path: str | None, truth_dir: Path | None) -> Path | None:
    """truth.tsv in --truth-dir (DIR/SAMPLE/truth.tsv or DIR/SAMPLE.tsv), else beside the input."""
    candidates = []
    if truth_dir is not None:
        candidates += [truth_dir / sample / TRUTH_FILE, truth_dir / f"{sample}.tsv"]
    if input_path:
        data = Path(input_path)
        candidates.append((data if data.is_dir() else data.parent) / TRUTH_FILE)
    return next((p for p in candidates if p.is_file()), None)


def seconds_between(start: str | None, end: str | None) -> float | None:
    try:
        return round(
            (datetime.fromisoformat(end) - datetime.fromisoformat(start)).total_seconds(), 1
        )  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None


def load_sample(
    world_state: Path, replay_path: Path | None = None, truth_dir: Path | None = None
) -> Sample:
    folder = world_state.parent
    sample = Sample(folder.name, folder, world_state, "missing")
    if not world_state.is_file():
        sample.problems.append(
            f"no world state at {world_state}: the analysis did not run or was lost"
        )
        return sample
    try:
        sample.world = WorldState.load(world_state)
    except ValueError as e:
        sample.status = "unreadable"
        sample.problems.append(str(e))
        return sample
    if problem := RunMeta.problem(sample.meta):  # shown, and the fields the report reads as found
        sample.problems.append(f"{world_state}: {problem}")
    sample.name = str(sample.meta.get("sample") or folder.name)
    sample.status = str(sample.meta.get("status") or "unknown")
    if sample.status == "running":  # going on while the report is built, or killed unawares
        sample.running = holder_of(SampleLayout(folder).lock)
        if sample.running:
            sample.problems.append(f"still running ({sample.running}) as the report was built")

    def attempt(what: str, fn: Any) -> Any:
        try:
            return fn()
        except Exception as e:  # one bad artifact must not lose the sample, nor the cohort
            sample.problems.append(f"{what}: {type(e).__name__}: {e}")
            return None

    layout = SampleLayout(folder)
    if layout.metrics.is_file():
        sample.metrics = (
            attempt(str(layout.metrics), lambda: read_appended_rows(layout.metrics)) or []
        )
    replay_path = replay_path or layout.replay
    if replay_path.is_file():
        sample.replay_path = replay_path
        sample.replay = attempt(str(replay_path), lambda: read_replay(replay_path))
    if layout.final.is_file():
        sample.final = layout.final
        key = cluster_key(sample)
        sample.final_obs = attempt(str(sample.final), lambda: read_obs(layout.final, [key]))
    if layout.plots.is_dir():
        sample.plots = plots_in_order(sample)
    sample.truth_path = find_truth(sample.name, sample.meta.get("input"), truth_dir)
    if sample.truth_path and sample.final_obs is not None:
        sample.scores = attempt(
            str(sample.truth_path),
            lambda: score(sample.final_obs, _truth(sample.truth_path), cluster_key(sample)),
        )
    return sample


@functools.lru_cache(maxsize=64)
def _cached_truth(path: Path, stamp: tuple[int, int]) -> pd.DataFrame:
    return read_truth(path)


def _truth(path: Path) -> pd.DataFrame:
    """read_truth, once per file and version: samples of one input share its truth table."""
    st = path.stat()
    return _cached_truth(path.resolve(), (st.st_mtime_ns, st.st_size))


def plots_in_order(sample: Sample) -> list[Path]:
    """The sample's PNGs in the order the analysis drew them, then any others by name."""
    drawn = [
        sample.folder / str(e.result["path"])
        for e in sample.entries
        if e.tool == "plot" and e.status == "ok" and (e.result or {}).get("path")
    ]
    found = sorted(SampleLayout(sample.folder).plots.glob("*.png"))
    ordered = [p for p in dict.fromkeys(drawn) if p in found]
    return ordered + [p for p in found if p not in ordered]


def cluster_key(sample: Sample) -> str:
    """The obs column the final Leiden call wrote."""
    leiden = sample.last_ok("leiden")
    return str((leiden.params.get("key_added") if leiden else None) or CLUSTER_KEY)


def chosen_parameters(sample: Sample) -> dict[str, Any]:
    """``tool.param`` -> value of the last successful call of each analysis tool, in call order;
    a filter applied more than once shows the thresholds in force, the strictest of its
    applications (its filter_repeated check)."""
    latest = {e.tool: e for e in sample.entries if e.status == "ok" and e.tool not in NOT_CHOICES}
    ordered = sorted(latest.values(), key=lambda e: e.step)
    repeated = sample.checks.repeated_filters()
    return {
        f"{e.tool}.{k}": v
        for e in ordered
        for k, v in {**e.params, **repeated.get(e.tool, {}).get("effective", {})}.items()
    }

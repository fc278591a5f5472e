"""Marker files: cell-type gene sets, the lineages that gate them and each set's defining genes,
read, checked and matched to the genes a data set has."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from agent.registry import ToolError
from agent.tools.session import Session
from agent.tools.species import HUMAN, MOUSE

MIN_GENES_PER_SET = 2
MARKER_FILES = {MOUSE: "markers_mouse.json"}  # every other species: the human sets


@dataclass(frozen=True)
class Markers:
    """A marker file's content: ``sets`` (cell type -> genes); ``lineages`` (name -> "present",
    "absent" genes, its "cell_types" and "groups": a label -> the genes that define it, for
    clusters whose type cannot be told, e.g. "CD8 T": CD8A, CD8B), empty where the file has
    none (no gate then);
    ``defining`` (cell type -> genes of which the data must hold one for the set to be used)."""

    sets: dict[str, list[str]]
    lineages: dict[str, dict[str, Any]] = field(default_factory=dict)
    defining: dict[str, list[str]] = field(default_factory=dict)
    where: str = ""


@dataclass(frozen=True)
class Matched:
    """Markers as the data spell them, and what could not be used, with the reason."""

    sets: dict[str, list[str]]
    lineages: dict[str, dict[str, Any]]
    defining: dict[str, list[str]]
    missing: dict[str, list[str]]  # set -> its genes the data lack
    sets_skipped: dict[str, str]
    lineages_skipped: dict[str, str]
    lineage_of: dict[str, str]  # usable set -> its lineage ('' without lineages)


def marker_file(species: str) -> str:
    """The package's marker file for a species: mouse sets for mouse, human sets otherwise."""
    return f"agent/data/{MARKER_FILES.get(species, 'markers.json')}"


def default_markers(species: str = HUMAN) -> Markers:
    """The package's marker sets, lineages and defining genes for a species."""
    where = marker_file(species)
    text = resources.files("agent.data").joinpath(where.rsplit("/", 1)[1]).read_text()
    return parse_markers(json.loads(text), where)


def default_marker_sets(species: str = HUMAN) -> dict[str, list[str]]:
    """The package's marker sets for a species (agent/data/markers*.json)."""
    return default_markers(species).sets


def _genes(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(g, str) and g for g in value)


def _mapping(value: Any, where: str, field_name: str) -> dict[str, Any]:
    """A field that must be a JSON object (or left out), else a clear error naming it."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ToolError(
            f"{where}: {field_name} must be a JSON object (name -> ...), got {value!r:.100}"
        )
    return value


def parse_markers(doc: Any, where: str) -> Markers:
    """{"cell_types": {name: [gene, ...]}} (or the inner mapping alone), optionally with
    "lineages" ({name: {"present": [...], "absent": [...], "cell_types": [...], "groups":
    {label: [...]}}}, every cell type in exactly one lineage) and "defining_genes" ({cell type:
    [...]}), checked."""
    sets = doc.get("cell_types", doc) if isinstance(doc, dict) else doc
    if not isinstance(sets, dict) or not sets:
        raise ToolError(
            f'{where}: expected a JSON object {{"cell_types": {{name: [genes]}}}} with at least one cell type'
        )
    for name, genes in sets.items():
        if not genes or not _genes(genes):
            raise ToolError(
                f"{where}: cell_types[{name!r}] must be a non-empty list of gene symbols, got {genes!r:.100}"
            )
        if "/" in name:  # names become keys of uns, which an .h5ad file cannot hold with '/'
            raise ToolError(f"{where}: cell type {name!r} contains '/'; name it without one")
    sets = {str(k): list(dict.fromkeys(v)) for k, v in sets.items()}
    if "cell_types" not in doc:
        return Markers(sets, where=where)
    lineages = _mapping(doc.get("lineages"), where, "lineages")
    lineage_of: dict[str, str] = {}
    for name, spec in lineages.items():
        if (
            not isinstance(spec, dict)
            or not spec.get("present")
            or not all(_genes(spec.get(k, [])) for k in ("present", "absent", "cell_types"))
        ):
            raise ToolError(
                f"{where}: lineages[{name!r}] must hold 'present' (a non-empty list of genes), "
                f"'absent' and 'cell_types' (lists) and optionally 'groups' (label -> genes), "
                f"got {spec!r:.100}"
            )
        groups = _mapping(spec.get("groups"), where, f"lineages[{name!r}]['groups']")
        if not all(g and _genes(g) for g in groups.values()):
            raise ToolError(
                f"{where}: lineages[{name!r}]['groups'] must map each label to a non-empty list "
                f"of genes, got {groups!r:.100}"
            )
        unknown = set(spec.get("cell_types", [])) - set(sets)
        if unknown:
            raise ToolError(
                f"{where}: lineages[{name!r}] names unknown cell types {sorted(unknown)}"
            )
        for cell_type in spec.get("cell_types", []):
            if cell_type in lineage_of:  # a type's gate must be one lineage's
                raise ToolError(
                    f"{where}: cell type {cell_type!r} is in two lineages "
                    f"({lineage_of[cell_type]!r} and {name!r}); give each type one lineage"
                )
            lineage_of[cell_type] = name
    outside = [t for t in sets if t not in lineage_of]
    if lineages and outside:  # no gate could ever pass for them
        raise ToolError(
            f"{where}: cell types {outside} are in no lineage; with 'lineages' every cell type "
            "must be listed in one lineage's 'cell_types'"
        )
    defining = _mapping(doc.get("defining_genes"), where, "defining_genes")
    for name, genes in defining.items():
        if name not in sets or not genes or not _genes(genes) or set(genes) - set(sets[name]):
            raise ToolError(
                f"{where}: defining_genes[{name!r}] must be a non-empty list of genes of the "
                f"cell type's own set, got {genes!r:.100}"
            )
    return Markers(
        sets,
        {n: {**{k: list(s.get(k, [])) for k in ("present", "absent", "cell_types")},
             "groups": dict(s.get("groups") or {})}
         for n, s in lineages.items()},
        {n: list(g) for n, g in defining.items()},
        where,
    )  # fmt: skip


def load_markers(session: Session, markers_file: str | None, species: str) -> Markers:
    """The run's markers: a JSON file in the output folder, else the package's for the species."""
    if markers_file is None:
        return default_markers(species)
    path: Path = session.readable_path(markers_file)
    if not path.is_file():
        raise ToolError(f"markers file {markers_file!r} does not exist ({path})")
    try:
        doc = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ToolError(f"markers file {path}: not valid JSON ({e})") from None
    return parse_markers(doc, str(path))


def _speller(names: Any) -> Any:
    """A gene as the data spell it (exact, else ignoring case), or None."""
    exact = set(names)
    by_upper: dict[str, str] = {}
    for name in names:
        by_upper.setdefault(name.upper(), name)
    return lambda g: g if g in exact else by_upper.get(g.upper())


def _spelled(genes: list[str], spell: Any) -> list[str]:
    return list(dict.fromkeys(s for s in map(spell, genes) if s is not None))


def match(markers: Markers, names: Any, undetected: Any = ()) -> Matched:
    """The sets, lineages and defining genes the data can use, spelled as the data spell them.
    A set is left out when fewer than MIN_GENES_PER_SET of its genes, or none of its defining
    genes, are in the data; a lineage when none of its present genes are. ``undetected``: genes
    the input had but a gene filter removed as detected in too few cells: absent from every
    cluster, so a lineage that lacks them is judged (its lacked genes' "undetected"); one whose
    lacked genes were never measured (a targeted panel without CD3) cannot be."""
    spell, lost = _speller(names), _speller(undetected)
    sets, missing, skipped = {}, {}, {}
    for name, genes in markers.sets.items():
        present = _spelled(genes, spell)
        if len(present) < len(genes):
            missing[name] = [g for g in genes if spell(g) is None]
        defining = markers.defining.get(name)
        if len(present) < MIN_GENES_PER_SET:
            skipped[name] = f"{len(present)} of its {len(genes)} genes in the data"
        elif defining and not _spelled(defining, spell):
            skipped[name] = f"none of its defining genes ({', '.join(defining)}) in the data"
        else:
            sets[name] = present
    lineages, lineages_skipped, lineage_of = {}, {}, dict.fromkeys(sets, "")
    for name, spec in markers.lineages.items():
        present, absent = _spelled(spec["present"], spell), _spelled(spec["absent"], spell)
        filtered = [g for g in spec["absent"] if spell(g) is None and lost(g) is not None]
        if not present:
            lineages_skipped[name] = (
                f"none of its genes ({', '.join(spec['present'])}) in the data "
                f"({_why_missing(spec['present'], lost)})"
            )
        elif spec["absent"] and not absent and not filtered:
            lineages_skipped[name] = (
                f"none of the genes it lacks ({', '.join(spec['absent'])}) was measured: its "
                "gate cannot be judged"
            )
        else:
            types = [t for t in spec["cell_types"] if t in sets]
            groups = {g: _spelled(genes, spell) for g, genes in spec["groups"].items()}
            lineages[name] = {
                "present": present, "absent": absent, "undetected": filtered,
                "cell_types": types, "groups": {g: genes for g, genes in groups.items() if genes},
            }  # fmt: skip
            lineage_of.update(dict.fromkeys(types, name))
    if markers.lineages:  # a set outside every usable lineage cannot pass a gate
        for name in [s for s, lineage in lineage_of.items() if not lineage]:
            skipped[name] = "its lineage cannot be judged in these data (lineages_skipped)"
            del sets[name], lineage_of[name]
    defining = {n: _spelled(g, spell) for n, g in markers.defining.items() if n in sets}
    return Matched(sets, lineages, defining, missing, skipped, lineages_skipped, lineage_of)


def _why_missing(genes: list[str], lost: Any) -> str:
    """Why none of ``genes`` is in the data: filtered out as undetected, or never measured."""
    if any(lost(g) is not None for g in genes):
        return "filtered out as detected in too few cells"
    return "not measured"

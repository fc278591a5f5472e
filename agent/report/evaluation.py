"""The model's evaluation (`agent eval`'s eval.json, eval.html beside it) in the cohort report.

Linked only when it evaluated the model the samples' records name: the Hub id and revision
(``meta.server``, from the server's endpoint file), or, where a record names none (an external
server), the served model name alone, which the report then says is all it matched on. An
evaluation of another model, or of none (the reference recipe), is named as such in the index,
not copied, linked or put in the crate. The report's copies are removed when there is nothing to
link: an earlier report's would describe another evaluation.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

if TYPE_CHECKING:
    from agent.record.collect import Sample

JSON, HTML = "eval.json", "eval.html"  # as `agent eval` writes them, and the report's copies


@dataclass(frozen=True)
class Evaluation:
    """What the index says of an evaluation and what the crate describes."""

    source: Path  # the eval.json given
    model: str  # the evaluated model, as named
    score: float | None
    linked: bool  # the samples' model: copied and linked
    basis: str  # what the match rests on, or why it is not linked
    files: list[Path] = field(default_factory=list)  # the report's copies, when linked
    doc: dict[str, Any] = field(default_factory=dict)


def _name(model_id: str | None, revision: str | None, served: str | None) -> str:
    if model_id:
        return f"{model_id} at {revision or 'an unrecorded revision'}"
    return served or "no model"


def _sample_models(samples: list[Sample]) -> set[tuple[str | None, str | None, str | None]]:
    """(model id, revision, served name) of each llm sample's record; the name only where no
    endpoint file named the model."""
    found = set()
    for s in samples:
        if s.meta.get("policy") != "llm":
            continue
        server = s.meta.get("server") if isinstance(s.meta.get("server"), dict) else {}
        if server.get("model_id"):
            found.add((server["model_id"], server.get("revision"), None))
        elif s.meta.get("model"):
            found.add((None, None, s.meta["model"]))
    return found


def include(path: Path | None, samples: list[Sample], outdir: Path) -> Evaluation | None:
    """The evaluation at ``path`` judged against ``samples``, and copied into ``outdir`` when it
    is of their model; None without one. ValueError for a file that is not an evaluation."""
    from agent.record.durable import publish

    doc = read(path) if path is not None else None
    found = judge(path, doc, samples) if doc is not None else None
    copies = {JSON: path, HTML: path.with_name(HTML)} if found and found.linked else {}
    for name in (JSON, HTML):
        source = copies.get(name)
        if source is not None and source.is_file():
            publish(outdir / name, source.read_bytes())
        else:  # an earlier report's copy would pass another evaluation off as this one's
            (outdir / name).unlink(missing_ok=True)
            copies.pop(name, None)
    return replace(found, files=[outdir / n for n in copies]) if found is not None else None


def read(path: Path) -> dict[str, Any]:
    try:
        doc = orjson.loads(path.read_bytes())
    except (OSError, orjson.JSONDecodeError) as e:
        raise ValueError(f"--eval {path}: not readable as agent eval's eval.json ({e})") from e
    if not isinstance(doc, dict) or not isinstance(doc.get("model"), dict) or "score" not in doc:
        raise ValueError(f"--eval {path}: no 'model' and 'score': not agent eval's eval.json")
    return doc


def judge(path: Path, doc: dict[str, Any], samples: list[Sample]) -> Evaluation:
    """Whether ``doc`` evaluated the model the samples' records name, and on what grounds."""
    model = doc["model"]
    evaluated = (model.get("model_id"), model.get("revision"), None)
    if not model.get("model_id"):
        evaluated = (None, None, model.get("model"))
    llm = model.get("policy") == "llm"
    name = _name(*evaluated) if llm else "the reference recipe (no model)"
    cohort = _sample_models(samples)
    if llm and evaluated in cohort:
        basis = "model id and revision" if evaluated[0] else "the served model's name only"
        return Evaluation(path, name, doc["score"], True, basis, doc=doc)
    named = "; ".join(sorted(_name(*m) for m in cohort)) or "none: no llm sample"
    return Evaluation(path, name, doc["score"], False, f"the samples' model is {named}", doc=doc)


def view(found: Evaluation | None) -> dict[str, Any] | None:
    """What the index shows: the score and the model; the page, when linked."""
    if found is None:
        return None
    pages = [f.name for f in found.files]
    return {
        "page": HTML if HTML in pages else (JSON if JSON in pages else None),
        "score": "no score" if found.score is None else f"score {found.score:.2f}",
        "model": found.model,
        "basis": found.basis,
    }

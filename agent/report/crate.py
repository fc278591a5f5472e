"""The provenance export: a Workflow Run RO-Crate of the cohort run (the `rocrate` package).

The crate (``ro-crate/`` beside the report) holds copies of the small artifacts (world states,
replays, metrics, the cohort table and page, the workflow's Snakefile and rules) and refers to
the large ones (inputs, final AnnData objects) by absolute ``file://`` URI with their size and,
for inputs, the sha256 the world state recorded. Each sample's analysis and replay is a
CreateAction whose instrument is the agent with its package versions; the analysis' results
carry its checks (``samples/NAME/checks.json``, and each that warned or was refused as a
PropertyValue), and a partial analysis is a failed action whose error says why. The cohort run
is one more CreateAction whose instrument is the workflow (Workflow Run Crate profile 0.5). What
reprocessing changed (`agent compare`, when the report has it) is a CreateAction whose objects
are every record it read, old and new, by URI and sha256. The cohort object (`agent integrate`,
when the report has it) is one too: every input record and final object by sha256, the
integration library as instrument. The model's evaluation (`agent eval`, when the report links
it: the samples' model) is one too: its eval.json and page as results, its score and model named.
"""

from __future__ import annotations

import io
import re
import shutil
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

import orjson
from rocrate.model.contextentity import ContextEntity
from rocrate.model.softwareapplication import SoftwareApplication
from rocrate.rocrate import ROCrate

from agent.cohort.compare import TSV, input_records
from agent.cohort.integrate import SUMMARY, is_integrated, read_summary
from agent.record.checks import SOURCES
from agent.record.collect import Sample
from agent.record.layout import SampleLayout
from agent.record.provenance import versions
from agent.report.evaluation import Evaluation

PROFILES = {
    "https://w3id.org/ro/wfrun/process/0.5": "Process Run Crate",
    "https://w3id.org/ro/wfrun/workflow/0.5": "Workflow Run Crate",
}
# the main Snakefile first (the catalog's layout; the root Snakefile includes it)
WORKFLOW_FILES = (
    "workflow/Snakefile", "Snakefile", "workflow/rules/*.smk", "workflow/schemas/*", "config/*",
)  # fmt: skip
CHECKS = "checks.json"  # the crate's file of a sample's checks, beside its copied record
STATUS = {
    True: "http://schema.org/CompletedActionStatus",
    False: "http://schema.org/FailedActionStatus",
}


def _uri(path: Path) -> str:
    return path.resolve().as_uri()


def _software(crate: ROCrate, versions: dict[str, str]) -> list[ContextEntity]:
    """One SoftwareApplication per package and version (shared between samples that agree)."""
    out = []
    for name, version in sorted(versions.items()):
        ident = f"#software/{name}/{version}"
        entity = crate.get(ident) or crate.add(
            SoftwareApplication(crate, ident, properties={"name": name, "version": version})
        )
        out.append(entity)
    return out


def _agent(crate: ROCrate, versions: dict[str, str]) -> ContextEntity:
    version = versions.get("scagent", "unknown")
    ident = f"#scagent/{version}"
    agent = crate.get(ident)
    if agent is None:
        agent = crate.add(
            SoftwareApplication(
                crate,
                ident,
                properties={
                    "name": "scagent (python -m agent)",
                    "version": version,
                    "description": "LLM agent loop with scanpy tools; the policy decides, the "
                    "world state records every call",
                },
            )
        )
        agent["softwareRequirements"] = _software(
            crate, {k: v for k, v in versions.items() if k != "scagent"}
        )
    return agent


def _add_workflow(crate: ROCrate, root: Path) -> ContextEntity | None:
    snakefile = root / WORKFLOW_FILES[0]
    if not snakefile.is_file():
        return None
    workflow = crate.add_workflow(
        snakefile,
        WORKFLOW_FILES[0],  # the repository's layout, so the crate's copy runs as it is
        main=True,
        lang="snakemake",
        lang_version=metadata.version("snakemake"),
        properties={"name": "scagent cohort workflow"},
    )
    parts = []
    for pattern in WORKFLOW_FILES[1:]:
        for f in sorted(root.glob(pattern)):
            if f.is_file():
                parts.append(crate.add_file(f, str(f.relative_to(root))))
    if parts:
        workflow["hasPart"] = parts
    return workflow


def _model_settings(crate: ROCrate, sample: Sample) -> list[ContextEntity]:
    """The model behind a sample's analysis as PropertyValues among the action's objects (the
    Process Run Crate's place for the settings a run was given); only those the record has."""
    out = []
    for key, value in sample.model_provenance.items():
        if value in (None, "", {}):
            continue
        text = orjson.dumps(value).decode() if isinstance(value, dict) else str(value)
        out.append(
            crate.add(
                ContextEntity(
                    crate,
                    f"#analyze-{sample.name}/{key}",
                    properties={"@type": "PropertyValue", "name": key, "value": text},
                )
            )
        )
    return out


def _checks(crate: ROCrate, sample: Sample, base: SampleLayout) -> list[ContextEntity]:
    """The checks of a sample's decisions (agent/record/checks.py) among its analysis' results:
    every check, with its evidence, in ``samples/NAME/checks.json``; each that was refused or
    warned also as a PropertyValue (name: the rule and step, value: the verdict, description:
    the message), so a reader of the metadata alone sees them. None without a record."""
    found = sample.checks
    if found.source == "none":
        return []
    doc = {
        "source": found.source,
        "source_says": SOURCES[found.source],
        **({"note": found.note} if found.note else {}),
        "checks": [c.model_dump() for c in found.checks],
    }
    listed = crate.add_file(
        io.BytesIO(orjson.dumps(doc, option=orjson.OPT_INDENT_2)),
        str(base.root / CHECKS),
        properties={
            "name": f"checks of {sample.name}: {found.summary() or 'none'} ({found.source})",
            "description": "each check of the model's decisions: rule, verdict (pass, warn, "
            "refused), message, evidence, step and tool (agent/checks.py RULES)",
            "encodingFormat": "application/json",
        },
    )
    flagged = [
        crate.add(
            ContextEntity(
                crate,
                f"#analyze-{sample.name}/check-{i}",
                properties={
                    "@type": "PropertyValue", "value": c.verdict, "description": c.message,
                    "name": f"check {c.rule}" + (f" (step {c.step}, {c.tool})" if c.step else ""),
                },
            )
        )
        for i, c in enumerate(found.checks, 1)
        if c.verdict != "pass"
    ]  # fmt: skip
    return [listed, *flagged]


def _sample_actions(
    crate: ROCrate, sample: Sample, agent_for: Any
) -> tuple[list[ContextEntity], list[Any], list[Any]]:
    """Analysis and replay actions of one sample; (actions, inputs, outputs)."""
    meta = sample.meta
    # the crate's copy of the sample folder, under the same names
    base = SampleLayout(f"samples/{re.sub(r'[^A-Za-z0-9._-]+', '_', sample.name)}")
    metrics = SampleLayout(sample.folder).metrics
    inputs: list[Any] = []
    if meta.get("input"):
        path = Path(meta["input"])
        props = {"name": f"input of {sample.name}", "sha256": meta.get("input_sha256")}
        inputs.append(
            crate.add_dataset(_uri(path), properties=props)
            if path.is_dir()
            else crate.add_file(_uri(path), properties=props)
        )
    if meta.get("celltypist_model"):  # the reference model the run was given (--celltypist-model)
        model = sample.reference_model or {}
        props = {
            "name": f"CellTypist model {Path(meta['celltypist_model']).name}",  # samples share it
            "sha256": meta.get("celltypist_model_sha256"),
            **({"version": model["version"]} if model.get("version") else {}),
        }
        inputs.append(crate.add_file(_uri(Path(meta["celltypist_model"])), properties=props))
    outputs: list[Any] = []
    if sample.world_state.is_file():
        outputs.append(
            crate.add_file(
                sample.world_state,
                str(base.record),
                properties={"name": f"world state of {sample.name}",
                            "encodingFormat": "application/json"},
            )
        )  # fmt: skip
    if metrics.is_file():
        outputs.append(crate.add_file(metrics, str(base.metrics)))
    if sample.final is not None:
        outputs.append(
            crate.add_file(
                _uri(sample.final),
                properties={"name": f"final AnnData of {sample.name}",
                            "contentSize": sample.final.stat().st_size},
            )
        )  # fmt: skip
    instrument = agent_for(meta.get("versions") or versions())  # never ran: today's software
    settings = _model_settings(crate, sample)
    analysis = crate.add_action(
        instrument,
        f"#analyze-{sample.name}",
        object=[*inputs, *settings],
        result=[*outputs, *_checks(crate, sample, base)],
        properties={
            "name": f"analyse {sample.name} ({meta.get('policy', 'unknown')} policy)"
            + ("" if sample.status == "finished" else f": {sample.status}"),
            # partial too: the analysis the action set out to do was not completed
            "actionStatus": {"@id": STATUS[sample.status == "finished"]},
            **({"startTime": meta["started"]} if meta.get("started") else {}),
            **({"endTime": meta["ended"]} if meta.get("ended") else {}),
            **({"error": sample.error} if sample.error else {}),
            **({"description": f"model {meta['model']}"} if meta.get("model") else {}),
        },
    )
    actions = [analysis]
    if sample.replay is not None and sample.replay_path is not None:
        replay_file = crate.add_file(sample.replay_path, str(base.replay))
        actions.append(
            crate.add_action(
                instrument,
                f"#replay-{sample.name}",
                object=[*outputs[:1], *inputs],
                result=[replay_file],
                properties={
                    "name": f"replay {sample.name}: {sample.replay.get('verdict')}",
                    "description": sample.replay.get("summary", ""),
                    # "altered" (meta) and "not replayed" have no step, and did not succeed
                    "actionStatus": {
                        "@id": STATUS[
                            sample.replay.get("verdict") in ("reproduced", "within tolerance")
                        ]
                    },
                    **(
                        {"startTime": sample.replay["started"]}
                        if sample.replay.get("started")
                        else {}
                    ),
                },
            )
        )
        outputs.append(replay_file)
    return actions, inputs, outputs


def _records(crate: ROCrate, records: list[dict[str, str]]) -> list[ContextEntity]:
    """Each finished sample's world state and final AnnData (integrate.InputRecord) by URI and
    sha256, shared between the actions that read them."""
    inputs = []
    for record in records:
        for key, what in (("world_state", "world state"), ("adata", "final AnnData")):
            uri = _uri(Path(record[key]))
            props = {"name": f"{what} of {record['sample']}", "sha256": record[f"{key}_sha256"]}
            entity = crate.get(uri) or crate.add_file(uri, properties=props)
            entity["sha256"] = props["sha256"]
            inputs.append(entity)
    return inputs


def _settings(crate: ROCrate, action: str, settings: dict[str, Any]) -> list[ContextEntity]:
    """A cohort step's settings as PropertyValues among its action's objects (lists and
    mappings as JSON); those without a value left out."""
    return [
        crate.add(
            ContextEntity(
                crate, f"#{action}/{key}",
                properties={
                    "@type": "PropertyValue", "name": key,
                    "value": value if isinstance(value, str) else orjson.dumps(value).decode(),
                },
            )
        )
        for key, value in settings.items()
        if value not in (None, "", {}, [])
    ]  # fmt: skip


def _composition_action(crate: ROCrate, folder: Path, summary: dict[str, Any]) -> ContextEntity:
    """`agent composition`: the records and final objects it read, its settings and design
    (samples per condition, those left out) as PropertyValues; its summary, table and figure."""
    from agent.cohort.composition import SUMMARY as COMPOSITION

    results = [crate.add_file(folder / COMPOSITION, f"cohort/composition/{COMPOSITION}")]
    for name in (summary.get("table"), summary.get("plot")):
        if name and (folder / name).is_file():
            results.append(crate.add_file(folder / name, f"cohort/composition/{name}"))
    design = summary["design"]
    settings = {
        **summary["parameters"], "method": summary.get("method"),
        "labels_from": summary["labels_from"]["labels"], "samples_per_condition": design["samples"],
        "left_out": {**summary["left_out"], **design["left_out"]}, "no_test": summary["statement"],
    }  # fmt: skip
    tested = f"; {summary['method'].split(':')[0]}" if summary.get("method") else ""
    return crate.add_action(
        _agent(crate, versions()),
        "#cohort-composition",
        object=_records(crate, summary["inputs"])
        + _settings(crate, "cohort-composition", settings),
        result=results,
        properties={
            "name": f"cell-type composition of {len(summary['samples'])} samples{tested}",
            "actionStatus": {"@id": STATUS[True]},
        },
    )


def _de_action(crate: ROCrate, folder: Path, summary: dict[str, Any]) -> ContextEntity:
    """`agent de`: the records and final objects it read; the design, minimum cells per
    pseudobulk and samples per condition, the samples each comparison used and the labels not
    tested as PropertyValues; PyDESeq2 as instrument; its summary, pseudobulk counts (by URI),
    tables and volcanoes as results."""
    from agent.cohort.de import SUMMARY as DE

    results = [crate.add_file(folder / DE, f"cohort/de/{DE}")]
    if summary.get("pseudobulk") and (folder / summary["pseudobulk"]).is_file():
        bulk = folder / summary["pseudobulk"]
        results.append(crate.add_file(_uri(bulk), properties={
            "name": "pseudobulk counts per sample and label (AnnData)",
            "contentSize": bulk.stat().st_size,
        }))  # fmt: skip
    for t in summary["tested"]:
        for name in (t["table"], t["plot"]):
            if (folder / name).is_file():
                results.append(crate.add_file(folder / name, f"cohort/de/{name}"))
    settings = {
        key: summary.get(key)
        for key in ("design", "condition_column", "reference", "min_cells", "min_samples",
                    "gene_filter", "alpha", "method", "statement")
    }  # fmt: skip
    settings["samples_used"] = {
        f"{t['label']}: {t['condition']}": t["samples"] for t in summary["tested"]
    }
    settings["not_tested"] = summary["not_tested"]
    settings["left_out"] = summary["left_out"]
    library = summary.get("library") or {}
    instrument = _software(crate, library)[0] if library else _agent(crate, versions())
    name = (
        f"differential expression of {len(summary['tested'])} label comparison(s)"
        if not summary["statement"]
        else f"differential expression: no test ({summary['statement']})"
    )
    return crate.add_action(
        instrument,
        "#cohort-de",
        object=_records(crate, summary["inputs"]) + _settings(crate, "cohort-de", settings),
        result=results,
        properties={"name": name, "actionStatus": {"@id": STATUS[True]}},
    )


def _cohort_action(crate: ROCrate, folder: Path, summary: dict[str, Any]) -> ContextEntity:
    """The integration (`agent integrate`): every input record and final object by sha256, the
    library and its version as instrument, the cohort object, its summary and UMAPs as results.
    A cohort not integrated (too few finished samples): the agent as instrument, the summary the
    only result, failed with the summary's statement as its error."""
    inputs = _records(crate, summary["inputs"])
    if not is_integrated(summary):
        return crate.add_action(
            _agent(crate, versions()),
            "#integrate-cohort",
            object=inputs,
            result=[crate.add_file(folder / SUMMARY, f"cohort/{SUMMARY}")],
            properties={
                "name": f"integrate the cohort ({summary['method']}): {summary['statement']}",
                "error": summary["statement"],
                "actionStatus": {"@id": STATUS[False]},
            },
        )
    obj = folder / summary["object"]
    results = [
        crate.add_file(
            _uri(obj), properties={"name": "the cohort object (integrated AnnData)"}
            | ({"contentSize": obj.stat().st_size} if obj.is_file() else {}),
        ),
        crate.add_file(folder / SUMMARY, f"cohort/{SUMMARY}"),
        *[crate.add_file(folder / p, f"cohort/{p}") for p in summary["plots"].values()
          if (folder / p).is_file()],
    ]  # fmt: skip
    (library,) = _software(crate, {summary["library"]: summary["library_version"]})
    return crate.add_action(
        library,
        "#integrate-cohort",
        object=inputs,
        result=results,
        properties={
            "name": f"integrate {len(summary['inputs'])} samples ({summary['method']})",
            "description": "parameters: " + orjson.dumps(summary["parameters"]).decode(),
            "actionStatus": {"@id": STATUS[True]},
        },
    )


def _comparison_action(crate: ROCrate, files: list[Path]) -> ContextEntity:
    """What reprocessing changed (`agent compare`): every record it read, old and new side, by
    sha256, as objects; its table and page (the report's copies) as results."""
    (table,) = [f for f in files if f.name == TSV]
    records = []
    for r in input_records(table):
        uri = _uri(Path(r["path"]))
        props = {"name": f"world state of {r['sample']} ({r['side']} side)", "sha256": r["sha256"]}
        entity = crate.get(uri) or crate.add_file(uri, properties=props)
        entity["sha256"] = r["sha256"]
        records.append(entity)
    return crate.add_action(
        _agent(crate, versions()),  # the report's software, which the workflow compares with
        "#compare-reprocessing",
        object=records,
        result=[crate.add_file(f, f.name) for f in files],
        properties={
            "name": "what reprocessing changed: each sample's analysis against its earlier one",
            "actionStatus": {"@id": STATUS[True]},
        },
    )


def _evaluation_action(crate: ROCrate, found: Evaluation) -> ContextEntity:
    """The model's evaluation before the cohort (`agent eval`), which the report links: its file
    and page (the report's copies) as results, the agent at the eval's versions as instrument."""
    score = "no score" if found.score is None else f"score {found.score:.4g}"
    return crate.add_action(
        _agent(crate, found.doc.get("versions") or versions()),
        "#evaluate-model",
        result=[crate.add_file(f, f.name) for f in found.files],
        properties={
            "name": f"evaluation of {found.model}: {score} (matched on {found.basis})",
            "actionStatus": {"@id": STATUS[True]},
            **({"startTime": found.doc["started"]} if found.doc.get("started") else {}),
        },
    )


def write_crate(
    outdir: Path,
    samples: list[Sample],
    report_files: list[Path],
    workflow_root: Path,
    pages: Path | None = None,
    cohort_dir: Path | None = None,
    comparison: list[Path] | None = None,
    evaluation: Evaluation | None = None,
    composition_dir: Path | None = None,
    de_dir: Path | None = None,
) -> Path:
    """Write ``outdir/ro-crate/``; returns the path of its ro-crate-metadata.json."""
    target = outdir / "ro-crate"
    if target.exists():
        shutil.rmtree(target)  # a crate describes one run: never mix in files of an earlier one
    crate = ROCrate(version="1.1")  # the version the Workflow Run Crate profiles build on
    crate.name = f"scagent cohort run: {len(samples)} samples"
    crate.description = (
        "Single-cell RNA-seq samples analysed by scanpy tool-calling agents, with each run's "
        "world state (every tool call, its exact parameters, results and data digests), its "
        "replay, and the cohort report."
    )
    crate.license = "MIT"
    profiles = [
        crate.add(ContextEntity(crate, uri, properties={"@type": "CreativeWork", "name": name,
                                                        "version": uri.rsplit("/", 1)[-1]}))
        for uri, name in PROFILES.items()
    ]  # fmt: skip
    workflow = _add_workflow(crate, workflow_root)
    for p in profiles:
        crate.root_dataset.append_to("conformsTo", p)
    actions, inputs, outputs = [], [], []
    for s in samples:
        a, i, o = _sample_actions(crate, s, lambda v: _agent(crate, v))
        actions += a
        inputs += i
        outputs += o
    report = [crate.add_file(f, f.name) for f in report_files if f.is_file()]
    if pages is not None and pages.is_dir():
        # referred to, not copied: the pages embed every plot (hundreds of MB at 1,000 samples)
        report.append(
            crate.add_dataset(
                _uri(pages), properties={"name": "the report's page per sample (HTML)"}
            )
        )
    started = sorted(s.meta["started"] for s in samples if s.meta.get("started"))
    run = crate.add_action(
        workflow or _agent(crate, versions()),
        "#cohort-run",
        object=inputs,
        result=[*outputs, *report],
        properties={
            "name": f"cohort run of {len(samples)} samples",
            "actionStatus": {"@id": STATUS[all(s.status == "finished" for s in samples)]},
            "endTime": datetime.now(UTC).isoformat(timespec="seconds"),
            **({"startTime": started[0]} if started else {}),
        },
    )
    if cohort_dir is not None and (summary := read_summary(cohort_dir)) is not None:
        actions.append(_cohort_action(crate, cohort_dir, summary))
    if comparison:  # agent compare's table and page, copied into the report
        actions.append(_comparison_action(crate, comparison))
    if evaluation is not None and evaluation.files:  # linked: an evaluation of the samples' model
        actions.append(_evaluation_action(crate, evaluation))
    from agent.cohort import composition, de

    for folder, read, action in ((composition_dir, composition.read_summary, _composition_action),
                                 (de_dir, de.read_summary, _de_action)):  # fmt: skip
        if folder is not None and (summary := read(folder)) is not None:
            actions.append(action(crate, folder, summary))
    crate.root_dataset["mentions"] = [run, *actions]
    crate.write(target)
    return target / "ro-crate-metadata.json"

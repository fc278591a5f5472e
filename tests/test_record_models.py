"""The record's types (agent/record/models.py): the schema file is theirs, writers go through them,
and records of every earlier version still read and replay."""

from __future__ import annotations

from pathlib import Path

import jsonschema
import orjson
import pytest
from pydantic import ValidationError

from agent.record.integrity import check_record, unchained
from agent.record.layout import SampleLayout
from agent.record.models import ENTRY_KEYS, MetricsRow, RunMeta, StepEntry
from agent.record.schema import text
from agent.record.world_state import RECORD_VERSION, WorldState, record_version

SCHEMA_FILE = Path(__file__).parents[1] / "agent/schemas/world_state.schema.json"

# The meta of the first release's records (no record_version, no chain, no seal; agent/runner.py
# at 021da6c), and of the last release before version 2 (chained and sealed already, and the
# settings of that time; 814627f^).
FIRST_META = (
    "sample", "input", "input_sha256", "policy", "model", "server_flags", "seed", "versions",
    "started", "ended", "status", "context_limit", "truncations",
)  # fmt: skip
LAST_V1_META = (
    "sample", "input_sha256", "policy", "seed", "brief", "layer", "gene_symbols", "input",
    "input_files", "started", "resumed", "model", "server_flags", "server", "sampling",
    "prompt_digest", "versions", "digest_version", "host", "slurm_job_id", "ended", "status",
    "context_limit", "truncations",
)  # fmt: skip


def test_the_schema_file_is_the_one_the_models_generate():
    """`python -m agent.record.schema > agent/schemas/world_state.schema.json` makes it again."""
    assert SCHEMA_FILE.read_text() == text()


def test_the_schema_requires_what_records_have_always_had():
    schema = orjson.loads(SCHEMA_FILE.read_bytes())
    assert set(schema["required"]) == {"schema_version", "meta", "entries"}
    assert set(schema["$defs"]["RunMeta"]["required"]) == {
        "sample", "input", "input_sha256", "policy", "model", "server_flags", "seed", "versions",
        "started", "ended", "status",
    }  # fmt: skip
    assert tuple(schema["$defs"]["StepEntry"]["required"]) == ENTRY_KEYS
    assert schema["$defs"]["StepEntry"]["additionalProperties"] is False


def test_a_writer_sets_only_fields_of_meta_and_each_of_its_type():
    part = RunMeta.part(status="finished", ended="2026-01-01T00:00:00+00:00", truncations=2)
    assert list(part) == ["status", "ended", "truncations"]  # in the order given
    with pytest.raises(KeyError):
        RunMeta.part(stauts="finished")
    with pytest.raises(ValidationError):
        RunMeta.part(status="done")
    with pytest.raises(ValidationError):
        RunMeta.part(seal="not a sha256")
    # keys a nested value lacks stay absent: the record reads as its writer gave it
    resumed = {"at_step": 4, "checkpoint_step": 3, "time": "t"}
    assert RunMeta.part(resumed=[resumed]) == {"resumed": [resumed]}
    outage = {"step": 2, "error": "APIConnectionError: x", "waited_s": 12.5}
    assert RunMeta.part(outages=[outage]) == {"outages": [outage]}


def test_an_entry_and_a_metrics_row_are_checked_as_written(tmp_path):
    with pytest.raises(ValidationError):
        StepEntry.model_validate(
            {k: None for k in ENTRY_KEYS} | {"step": 0, "tool": "x", "status": "ok"}
        )
    row = MetricsRow(
        step=1, tools=["qc_metrics"], status=["ok"], decide_seconds=0.1, tool_seconds=0.2,
        prompt_tokens=None, completion_tokens=None, cached_tokens=None, reasoning_tokens=None,
        queue_seconds=None, ttft_seconds=None, decode_seconds=None, thinking_budget_hit=None,
        calibration=1.0, time=1.5, budget=100,
    )  # fmt: skip
    assert list(row.row())[-1] == "budget" and "estimate_error" not in row.row()
    with pytest.raises(ValidationError):
        MetricsRow.model_validate({**row.row(), "unknown": 1})


def _as_version_1(doc: dict, keys: tuple[str, ...]) -> None:
    """``doc`` (a record of today) as a release before version 2 wrote it: its meta's fields of
    that time, and load_data naming the input by its file name."""
    doc["meta"] = {k: doc["meta"][k] for k in keys if k in doc["meta"]}
    load = doc["entries"][0]
    assert load["tool"] == "load_data" and load["result"]["path"] == "<input>"
    load["result"]["path"] = Path(doc["meta"]["input"]).name
    for entry in doc["entries"]:
        del entry["chain"]


def _old_record(demo_run, folder: Path, keys: tuple[str, ...], chained: bool) -> Path:
    folder.mkdir(parents=True)
    (folder / "adata.h5ad").hardlink_to(demo_run.world_state.parent / "adata.h5ad")
    doc = orjson.loads(demo_run.world_state.read_bytes())
    _as_version_1(doc, keys)
    path = folder / "world_state.json"
    path.write_bytes(orjson.dumps(doc))
    if chained:  # as the last releases of version 1 saved it: each entry chained, meta sealed
        WorldState.load(path).save_record(SampleLayout(folder))
    return path


@pytest.mark.parametrize(
    "keys, chained",
    [(FIRST_META, False), (LAST_V1_META, True)],
    ids=["version 1, first release", "version 1, last release"],
)
def test_a_record_of_version_1_reads_validates_and_replays(demo_run, tmp_path, keys, chained):
    from agent.replay import replay

    path = _old_record(demo_run, tmp_path / "old", keys, chained)
    jsonschema.validate(orjson.loads(path.read_bytes()), orjson.loads(SCHEMA_FILE.read_bytes()))
    world = WorldState.load(path)
    assert record_version(world.meta) == 1 < RECORD_VERSION
    assert RunMeta.problem(world.meta) is None
    assert RunMeta.model_validate(world.meta).doublets == "remove"  # as runs then did
    assert unchained(world) is not chained
    assert check_record(world, path.parent) == []
    doc = replay(path)
    assert doc["verdict"] == "reproduced", doc["summary"]
    assert doc["integrity"] == [] and ("no hash chain" in doc["summary"]) is not chained


def test_a_record_of_this_version_validates(demo_run):
    doc = orjson.loads(demo_run.world_state.read_bytes())
    assert doc["meta"]["record_version"] == RECORD_VERSION
    meta = RunMeta.model_validate(doc["meta"])
    assert meta.versions.python and meta.status == "finished"
    assert [list(e)[: len(ENTRY_KEYS)] for e in doc["entries"]] == [list(ENTRY_KEYS)] * len(
        doc["entries"]
    )
    for entry in doc["entries"]:
        StepEntry.model_validate(entry)

"""Replay: a real reference run reproduces exactly, also from a moved input; a hand-edited record
is caught at the step edited; an edited parameter in a record made whole again diverges at its
step; a missing or changed input is not replayed; and the comparison rules on their own."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import anndata as ad
import numpy as np
import orjson
import pytest
from scipy import sparse

from agent.cli import main as cli
from agent.record.integrity import check_record
from agent.record.layout import SampleLayout
from agent.record.provenance import checksum, input_checksums
from agent.record.world_state import Entry, WorldState
from agent.replay.compare import (
    StepComparison,
    Tolerance,
    as_now,
    compare_step,
    compare_values,
    verdict,
)
from agent.replay.run import NotReplayed, check_input
from agent.report.html import verdict_class


def edited_copy(world_state: Path, folder: Path, edit, reseal: bool = False) -> Path:
    """A copy of a sample's record and final data in their own folder, the record changed by
    ``edit(doc)``; ``reseal``: its chain and seal made whole again, as a forger would."""
    folder.mkdir(parents=True)
    shutil.copy(world_state.parent / "adata.h5ad", folder / "adata.h5ad")
    doc = orjson.loads(world_state.read_bytes())
    edit(doc)
    target = folder / "world_state.json"
    target.write_bytes(orjson.dumps(doc))
    if reseal:
        world = WorldState.load(target)
        for e in world.entries:
            e.chain = None
        world.save_record(SampleLayout(folder))
    return target


def replay_cli(tmp_path: Path, edited: Path, *args: str) -> tuple[int, dict]:
    out = tmp_path / "replay.json"
    code = cli(["replay", "--world-state", str(edited), "--out", str(out), *args])
    return code, orjson.loads(out.read_bytes())


def test_reference_run_is_reproduced(demo_run, demo_replay):
    recorded = WorldState.load(demo_run.world_state)
    assert demo_replay["verdict"] == "reproduced", demo_replay["summary"]
    assert demo_replay["diverged_step"] is None and demo_replay["replay_status"] == "finished"
    assert demo_replay["replayed_calls"] == len(recorded.entries)
    assert [s["step"] for s in demo_replay["steps"]] == [e.step for e in recorded.entries]
    assert all(s["comparison"] == "identical" for s in demo_replay["steps"])
    assert demo_replay["input_sha256"] == recorded.meta["input_sha256"]
    assert demo_replay["tolerance"]["rtol"] > 0 and demo_replay["workdir"] is None
    assert demo_replay["integrity"] == [] and "hash chain" not in demo_replay["summary"]


def _without(step: int):
    return lambda doc: doc["entries"].pop(step - 1)


def _conclusion(doc):
    doc["entries"][-1]["params"]["conclusion"] = "Ten clusters, all of them T cells."


def _seed(doc):
    doc["meta"]["seed"] += 1


def _final_data(folder: Path) -> None:
    adata = ad.read_h5ad(folder / "adata.h5ad")
    adata[1:].copy().write_h5ad(folder / "adata.h5ad")  # one cell less


# tampering: (step of the first problem found, "last" meaning the finish step; what it says)
TAMPERING = {
    "finish": ("last", "the record says finished but has no successful finish"),
    "middle": (8, "step 8 is missing (step 7 is followed by step 9)"),
    "conclusion": ("last", "entry of step {last} (finish) was altered"),
    "meta": (None, "meta was altered or the last entry removed"),
    "final data": ("last", "adata.h5ad is not the data step {last} (finish) wrote"),
}


@pytest.mark.parametrize("tamper", [*TAMPERING, "nothing"])
def test_tampering_is_caught_at_its_step(demo_run, tmp_path, tamper):
    n = len(WorldState.load(demo_run.world_state).entries)
    edit = {
        "finish": _without(n),
        "middle": _without(8),
        "conclusion": _conclusion,
        "meta": _seed,
    }.get(tamper, lambda doc: None)
    edited = edited_copy(demo_run.world_state, tmp_path / "s", edit)
    if tamper == "final data":
        _final_data(edited.parent)
    problems = check_record(WorldState.load(edited), edited.parent)
    if tamper == "nothing":
        assert problems == []
        return
    at, what = TAMPERING[tamper]
    assert problems[0].step == (n if at == "last" else at), problems
    assert what.format(last=n) in problems[0].what, problems


def test_altered_record_is_replayed_and_says_where(demo_run, tmp_path, capsys):
    """A deleted middle step is named, not the step after it, and the calls are still compared."""
    edited = edited_copy(demo_run.world_state, tmp_path / "s", _without(8))
    code, doc = replay_cli(tmp_path, edited)
    assert code == 1
    assert (doc["verdict"], doc["diverged_step"]) == ("altered at step 8", 8)
    assert doc["summary"].startswith("step 8 is missing (step 7 is followed by step 9)")
    assert "(the replay: " in doc["summary"] and doc["steps"] and doc["replay_status"]
    assert doc["integrity"][0] == {
        "step": 8,
        "what": "step 8 is missing (step 7 is followed by step 9)",
    }
    assert verdict_class(doc["verdict"]) == "bad"
    assert "altered at step 8" in capsys.readouterr().out


def test_altered_meta_is_reported_even_when_not_replayed(demo_run, tmp_path):
    edited = edited_copy(demo_run.world_state, tmp_path / "s", _seed)
    code, doc = replay_cli(tmp_path, edited, "--input", str(tmp_path / "gone.h5ad"))
    assert code == 1
    assert (doc["verdict"], doc["diverged_step"]) == ("altered", None)
    assert "meta was altered" in doc["summary"] and "not replayed: input" in doc["summary"]
    assert doc["steps"] == []


def test_moved_and_renamed_input_is_reproduced(demo_run, tmp_path):
    """The input is known by its content: moved elsewhere under another name (as pbmc1 ->
    pbmc1_renamed), with a stray file beside it, the record is reproduced."""
    moved = tmp_path / "elsewhere" / "data"
    shutil.copytree(demo_run.input.parent, moved)
    new_input = moved / f"renamed{demo_run.input.suffix}"  # the suffix names the format
    (moved / demo_run.input.name).rename(new_input)
    (moved / ".DS_Store").write_bytes(b"\0\1")
    code, doc = replay_cli(tmp_path, demo_run.world_state, "--input", str(new_input))
    assert code == 0 and doc["verdict"] == "reproduced", doc["summary"]
    assert doc["input"] == str(new_input)
    load = WorldState.load(demo_run.world_state).entries[0]
    assert load.tool == "load_data" and load.result["path"] == "<input>"


def test_a_record_made_before_version_2_names_its_input_the_old_way_and_still_compares(demo_run):
    """Records before version 2 name the input in load_data's result by its folder's name: read
    as "<input>" for the comparison, so old records still reproduce."""
    world = WorldState.load(demo_run.world_state)
    meta = {k: v for k, v in world.meta.items() if k != "record_version"}
    name = Path(meta["input"]).name
    load = world.entries[0]
    old = dataclasses.replace(load, result={**load.result, "path": name})
    assert as_now(old, meta).result == load.result
    assert as_now(old, world.meta).result["path"] == name  # a version 2 record: as it says


def test_edited_resolution_diverges_at_its_step(demo_run, tmp_path, capsys):
    recorded = WorldState.load(demo_run.world_state)
    leiden = recorded.last_ok("leiden")
    assert leiden is not None
    # far from the recorded one: on the planted types a range of resolutions gives the same clusters
    new_resolution = 4.0 if leiden.params["resolution"] < 2 else 0.1

    def edit(doc):
        doc["entries"][leiden.step - 1]["params"]["resolution"] = new_resolution
        doc["meta"]["digest_version"] = 0  # as if recorded before the digest last changed

    edited = edited_copy(demo_run.world_state, tmp_path / "edited", edit, reseal=True)
    out, work = tmp_path / "replay.json", tmp_path / "work"
    code = cli(["replay", "--world-state", str(edited), "--out", str(out), "--workdir", str(work)])
    doc = orjson.loads(out.read_bytes())
    assert code == 1
    assert doc["verdict"] == f"diverged at step {leiden.step}"
    assert doc["diverged_step"] == leiden.step
    assert f"step {leiden.step} (leiden)" in doc["summary"]
    assert "digest version 0" in doc["summary"] and doc["digest_versions"]["recorded"] == 0
    step = doc["steps"][leiden.step - 1]
    fields = {d["field"]: d for d in step["differences"]}
    assert fields["result.resolution"]["replayed"] == new_resolution
    assert "digest_after" in fields and step["comparison"] == "diverged"
    assert all(s["comparison"] == "identical" for s in doc["steps"][: leiden.step - 1])
    assert (work / "world_state.json").is_file() and doc["workdir"] == str(work)
    assert f"diverged at step {leiden.step}" in capsys.readouterr().out


def test_missing_or_changed_input_is_not_replayed(demo_run, tmp_path):
    gone = tmp_path / "gone" / "counts.h5ad"
    edited = edited_copy(
        demo_run.world_state, tmp_path / "s", lambda d: d["meta"].update(input=str(gone)), True
    )
    code, doc = replay_cli(tmp_path, edited)
    assert (code, doc["verdict"], doc["diverged_step"]) == (3, "not replayed", None)
    assert doc["steps"] == [] and doc["replay_status"] is None
    assert f"input {gone} (recorded in {edited}, meta.input) does not exist" in doc["summary"]
    assert verdict_class(doc["verdict"]) == "muted"

    changed = tmp_path / "counts.h5ad"
    shutil.copy(demo_run.input, changed)
    with open(changed, "ab") as f:
        f.write(b"\0")
    code, doc = replay_cli(tmp_path, demo_run.world_state, "--input", str(changed))
    assert (code, doc["verdict"]) == (3, "not replayed")
    assert (
        f"input {changed} (given with --input) is not the data the analysis read" in doc["summary"]
    )


def test_input_folder_is_checked_by_the_files_the_reader_uses(tmp_path):
    """A moved 10x folder with a stray file is the same input; a changed or missing file is named."""
    first = tmp_path / "first"
    first.mkdir()
    for name in ("matrix.mtx.gz", "features.tsv.gz", "barcodes.tsv.gz"):
        (first / name).write_bytes(name.encode())
    sums = input_checksums(first)
    world = WorldState(
        meta={"input": str(first), "input_sha256": checksum(first, sums), "input_files": sums}
    )
    moved = tmp_path / "moved"
    shutil.copytree(first, moved)
    (moved / ".DS_Store").write_bytes(b"\0")
    source = tmp_path / "world_state.json"
    assert check_input(world, source, moved) == moved
    (moved / "features.tsv.gz").write_bytes(b"other genes")
    (moved / "barcodes.tsv.gz").unlink()
    with pytest.raises(
        NotReplayed, match=r"features\.tsv\.gz differs, barcodes\.tsv\.gz is missing"
    ):
        check_input(world, source, moved)


def test_bad_world_state_is_not_replayed_and_busy_workdir_refused(demo_run, tmp_path, capsys):
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    code, doc = replay_cli(tmp_path, broken)
    assert (code, doc["verdict"]) == (3, "not replayed")
    assert f"{broken}: not a readable world state" in doc["summary"]
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("mine")
    args = ["replay", "--world-state", str(demo_run.world_state), "--workdir", str(busy)]
    assert cli(args) == 2
    assert f"--workdir {busy} is not empty" in capsys.readouterr().err
    assert (busy / "keep.txt").read_text() == "mine"


def entry(step: int, result: dict, digest: str = "d1", checkpoint: str | None = None) -> Entry:
    return Entry(
        tool="pca", params={"n_comps": 30}, status="ok", result=result, error=None, seconds=0.1,
        step=step, digest_before="d0", digest_after=digest, checkpoint=checkpoint,
    )  # fmt: skip


def compare(recorded: Entry, replayed: Entry, tmp_path: Path) -> StepComparison:
    return compare_step(recorded, replayed, Tolerance(1e-6, 1e-9), (tmp_path, tmp_path), ("", ""))


def test_numbers_within_tolerance_name_step_and_field(tmp_path):
    old = entry(7, {"variance": [0.5, 0.25], "n": 3, "label": "x"})
    new = entry(1, {"variance": [0.5 * (1 + 1e-9), 0.25], "n": 3, "label": "x"})
    cmp = compare(old, new, tmp_path)
    assert cmp.kind == "within tolerance"
    assert [d.field for d in cmp.differences] == ["result.variance.0"]
    text, step, summary = verdict([cmp])
    assert (text, step) == ("within tolerance", None)
    assert "step 7 (pca) result.variance.0" in summary


def test_differences_beyond_tolerance_diverge():
    tol = Tolerance(1e-6, 1e-9)
    out = StepComparison(3, 3, "leiden")
    recorded = {"n": 8, "sizes": [1, 2], "key": "leiden", "gone": 1, "nan": float("nan")}
    replayed = {"n": 9, "sizes": [1], "key": "other", "new": 2, "nan": float("nan")}
    compare_values(recorded, replayed, "result", tol, out)
    found = {d.field: d for d in out.differences}
    assert set(found) == {"result.n", "result.sizes", "result.key", "result.gone", "result.new"}
    assert all(d.kind == "diverged" for d in out.differences)
    assert found["result.gone"].note == "missing in the replay"
    assert verdict([StepComparison(1, 1, "load_data"), out])[:2] == ("diverged at step 3", 3)
    assert verdict([StepComparison(1, 1, "load_data")])[0] == "reproduced"


def test_bool_is_not_a_number_to_round():
    out = StepComparison(1, 1, "scale")
    compare_values({"zero_center": True}, {"zero_center": 1}, "result", Tolerance(), out)
    assert out.kind == "diverged"


def _checkpoint(path: Path, x: np.ndarray) -> str:
    adata = ad.AnnData(sparse.csr_matrix(x.astype(np.float32)))
    adata.obsm["X_pca"] = x[:, :2].astype(np.float64)
    adata.write_h5ad(path)
    return str(path)


def test_digest_change_is_settled_by_checkpoints(tmp_path):
    x = np.random.default_rng(0).random((20, 5)) + 1
    (tmp_path / "checkpoints").mkdir()
    _checkpoint(tmp_path / "checkpoints" / "a.h5ad", x)
    base = "/results/moved/away/checkpoints/a.h5ad"  # found by name in the record's folder
    close = _checkpoint(tmp_path / "b.h5ad", x * (1 + 1e-8))
    far = _checkpoint(tmp_path / "c.h5ad", x + 0.5)
    same_result = {"n_comps": 30}
    cmp = compare(entry(5, same_result, "d1", base), entry(5, same_result, "d2", close), tmp_path)
    assert cmp.kind == "within tolerance"
    assert "checkpoints agree within tolerance" in cmp.differences[0].note
    cmp = compare(entry(5, same_result, "d1", base), entry(5, same_result, "d2", far), tmp_path)
    assert cmp.kind == "diverged" and "X differs beyond tolerance" in cmp.differences[0].note
    cmp = compare(entry(5, same_result, "d1"), entry(5, same_result, "d2"), tmp_path)
    assert cmp.kind == "diverged" and "no checkpoints" in cmp.differences[0].note


def test_replay_that_stops_early_or_errors_diverges(tmp_path):
    old = entry(4, {"n": 1})
    assert compare_step(old, None, Tolerance(), (tmp_path, tmp_path), ("", "")).kind == "diverged"
    failed = Entry(
        tool="pca", params={"n_comps": 30}, status="error", result=None, error="boom",
        seconds=0.1, step=4, digest_before="d0", digest_after="d0",
    )  # fmt: skip
    cmp = compare(old, failed, tmp_path)
    assert cmp.kind == "diverged" and cmp.differences[0].note == "boom"


@pytest.mark.parametrize("flag", ["--rtol", "--atol"])
def test_negative_tolerance_is_refused(flag, tmp_path, capsys):
    assert cli(["replay", "--world-state", str(tmp_path / "x.json"), flag, "-1"]) == 2
    assert "tolerances must be >= 0" in capsys.readouterr().err

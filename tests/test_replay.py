"""Replay: a real reference run reproduces exactly, a hand-edited parameter diverges at its step,
a changed input is refused; and the comparison rules on their own."""

from __future__ import annotations

import shutil
from pathlib import Path

import anndata as ad
import numpy as np
import orjson
import pytest
from scipy import sparse

from agent.cli import main as cli
from agent.replay import (
    StepComparison,
    Tolerance,
    compare_step,
    compare_values,
    verdict,
)
from agent.world_state import Entry, WorldState


def edited_copy(world_state: Path, folder: Path, edit) -> Path:
    """A copy of a world state in its own folder, changed by ``edit(doc)``."""
    folder.mkdir(parents=True)
    doc = orjson.loads(world_state.read_bytes())
    edit(doc)
    target = folder / "world_state.json"
    target.write_bytes(orjson.dumps(doc))
    return target


def test_reference_run_is_reproduced(demo_run, demo_replay):
    recorded = WorldState.load(demo_run.world_state)
    assert demo_replay["verdict"] == "reproduced", demo_replay["summary"]
    assert demo_replay["diverged_step"] is None and demo_replay["replay_status"] == "finished"
    assert demo_replay["replayed_calls"] == len(recorded.entries)
    assert [s["step"] for s in demo_replay["steps"]] == [e.step for e in recorded.entries]
    assert all(s["comparison"] == "identical" for s in demo_replay["steps"])
    assert demo_replay["input_sha256"] == recorded.meta["input_sha256"]
    assert demo_replay["tolerance"]["rtol"] > 0 and demo_replay["workdir"] is None


def test_edited_resolution_diverges_at_its_step(demo_run, tmp_path, capsys):
    recorded = WorldState.load(demo_run.world_state)
    leiden = recorded.last_ok("leiden")
    assert leiden is not None
    new_resolution = 1.5 if leiden.params["resolution"] < 1 else 0.2

    def edit(doc):
        doc["entries"][leiden.step - 1]["params"]["resolution"] = new_resolution
        doc["meta"]["digest_version"] = 0  # as if recorded before the digest last changed

    edited = edited_copy(demo_run.world_state, tmp_path / "edited", edit)
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


def test_changed_input_is_refused(demo_run, tmp_path, capsys):
    copy = tmp_path / "counts.h5ad"
    shutil.copy(demo_run.input, copy)
    edited = edited_copy(
        demo_run.world_state, tmp_path / "s", lambda doc: doc["meta"].update(input=str(copy))
    )
    with open(copy, "ab") as f:
        f.write(b"\0")
    out = tmp_path / "replay.json"
    assert cli(["replay", "--world-state", str(edited), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"input {copy} has changed" in err and "meta.input_sha256" in err
    assert not out.exists()

    copy.unlink()
    assert cli(["replay", "--world-state", str(edited), "--out", str(out)]) == 2
    assert (
        f"input {copy} (recorded in {edited}, meta.input) does not exist" in capsys.readouterr().err
    )


def test_bad_world_state_and_workdir_are_refused(demo_run, tmp_path, capsys):
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    assert cli(["replay", "--world-state", str(broken)]) == 2
    assert f"{broken}: not a readable world state" in capsys.readouterr().err
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

"""The record's hash chain and seal: written once, kept through load and save, checked whole."""

from __future__ import annotations

import numpy as np
import orjson

from agent.record.integrity import check_record, unchained
from agent.record.layout import SampleLayout
from agent.record.world_state import Entry, WorldState

# a run's meta as check_record reads it (agent.record.models.RunMeta)
META = {
    "sample": "S1", "input_sha256": "0" * 64, "policy": "reference", "seed": 0, "input": "in.h5ad",
    "started": "2026-01-01T00:00:00+00:00", "resumed": [], "model": None, "server_flags": None,
    "versions": {"python": "3.11"}, "ended": None,
}  # fmt: skip


def record(status: str, n: int = 3) -> WorldState:
    """A small record whose results hold numpy values and a NaN, as tools return them."""
    world = WorldState(meta={**META, "status": status})
    for step in range(1, n + 1):
        world.add(
            Entry(
                tool="pca", params={"n_comps": np.int64(30)}, status="ok", seconds=0.5,
                result={"variance": np.array([0.5, 0.25], dtype=np.float32), "x": float("nan"),
                        "n": np.int64(step), "ratio": np.float32(0.1)},
                error=None, step=step, digest_before=f"d{step - 1}", digest_after=f"d{step}",
            )
        )  # fmt: skip
    return world


def test_chain_and_seal_survive_load_and_are_recomputed_the_same(tmp_path):
    world = record("finished")
    world.save_record(SampleLayout(tmp_path))
    path = tmp_path / "world_state.json"
    saved = path.read_bytes()
    doc = orjson.loads(saved)
    assert all(len(e["chain"]) == 64 for e in doc["entries"]) and len(doc["meta"]["seal"]) == 64
    assert doc["entries"][0]["result"]["x"] is None and doc["entries"][0]["result"]["ratio"] == 0.1
    loaded = WorldState.load(path)
    assert check_record(loaded, tmp_path, final=False) == [] and not unchained(loaded)
    assert loaded.to_json() == saved  # the loaded chains and seal, kept
    recomputed = WorldState.load(path)
    for e in recomputed.entries:
        e.chain = None
    assert recomputed.to_json() == saved  # and computed again from the content, the same


def test_a_running_record_is_not_sealed_and_a_resumed_one_drops_its_seal(tmp_path):
    running = record("running")
    assert "seal" not in orjson.loads(running.to_json())["meta"]
    running.save_record(SampleLayout(tmp_path), step=True)
    assert check_record(WorldState.load(tmp_path / "world_state.json"), tmp_path) == []
    running.meta["status"] = "failed"
    running.save_record(SampleLayout(tmp_path))
    resumed = WorldState.load(tmp_path / "world_state.json")
    assert "seal" in resumed.meta
    resumed.meta["status"] = "running"
    assert "seal" not in orjson.loads(resumed.to_json())["meta"]


def test_a_record_made_before_the_chain_is_noted_not_failed(tmp_path):
    doc = orjson.loads(record("finished").to_json())
    del doc["meta"]["seal"]
    for e in doc["entries"]:
        del e["chain"]
    del doc["entries"][1]  # gaps and digests are still checked
    path = tmp_path / "world_state.json"
    path.write_bytes(orjson.dumps(doc))
    old = WorldState.load(path)
    assert unchained(old)
    problems = check_record(old, tmp_path, final=False)
    assert [(p.step, p.what) for p in problems] == [
        (2, "step 2 is missing (step 1 is followed by step 3)")
    ]


def test_rendering_folded_step_by_step_is_the_rendering_from_scratch():
    """The rendering keeps its fold of older entries from call to call; after every step it is
    the one a fresh object renders from the same entries."""
    world = WorldState()
    tools = ["qc", "pca", "leiden", "qc", "plot"]
    for step in range(1, 40):
        ok = step % 6 != 0
        world.add(
            Entry(
                tool=tools[step % 5], params={"n": step % 4}, status="ok" if ok else "error",
                result={"n": step} if ok else None, error=None if ok else f"bad {step}",
                seconds=0.1, step=step, digest_before=None, digest_after=None,
            )
        )  # fmt: skip
        fresh = WorldState(entries=list(world.entries))
        assert world.render() == fresh.render(), step
        assert world.render(recent=5) == fresh.render(recent=5)  # fewer folded: folded anew
    text = world.render()
    assert (
        "\n#35 qc(n=3) -> n=35 (12 calls)\n" in text and "at steps 6, 12, 18, 24, 30, 36 " in text
    )
    assert text.endswith(
        "Latest:\n#37 leiden(n=1) -> n=37\n#38 qc(n=2) -> n=38\n#39 plot(n=3) -> n=39"
    )
    assert world.line(world.entries[35]) == "#36 pca(n=0) -> ERROR bad 36"

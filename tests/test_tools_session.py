"""The session: paths kept inside, checkpoints written atomically and restored, stable digests."""

from __future__ import annotations

import json

import pytest

from agent.digest import digest_adata
from agent.record.durable import atomic_write_h5ad
from agent.registry import ToolError
from agent.tools import build_registry
from agent.tools.session import Session

SPECS = build_registry().specs()


def test_path_inside_and_readable_path(tmp_path, small_input):
    session = Session(tmp_path / "out", input_path=small_input)
    assert session.path_inside("plots/a.png") == session.outdir / "plots/a.png"
    for bad in ("../x", "/etc/passwd", "plots/../../x"):
        with pytest.raises(ToolError, match="leaves the sample's output folder"):
            session.path_inside(bad)
    assert session.readable_path(None) == small_input.resolve()
    assert session.readable_path(str(small_input)) == small_input.resolve()
    assert session.readable_path("local.json") == session.outdir / "local.json"
    assert session.readable_path(small_input.name) == small_input.resolve()
    link = session.outdir / "sneaky"
    link.symlink_to("/etc")
    for bad in ("/etc/passwd", "../out2/x", "sneaky/passwd", str(small_input.parent / "truth.tsv")):
        with pytest.raises(ToolError, match="neither the run's input"):
            session.readable_path(bad)


def test_readable_path_inside_a_10x_folder(tmp_path, demo_inputs):
    folder = demo_inputs["pbmc1"]
    session = Session(tmp_path, input_path=folder)
    assert (
        session.readable_path(str(folder / "matrix.mtx.gz")) == (folder / "matrix.mtx.gz").resolve()
    )


def test_checkpoints_after_expensive_steps_and_every_few_steps(session_at):
    session = session_at("filter_genes")
    session.checkpoint_every = 3
    written = {step: session.after_step(step, tool, SPECS[tool]) for step, tool in [
        (1, "filter_cells"), (2, "plot"), (3, "qc_metrics"), (4, "filter_by_qc"),
        (5, "pca"), (6, "plot"), (7, "save"), (8, "normalize"),
    ]}  # fmt: skip
    assert written[1] is None and written[2] is None  # cheap, and too soon
    assert written[3].endswith("checkpoints/step_0003.h5ad")  # three steps since the start
    assert written[4] is None
    assert written[5].endswith("step_0005.h5ad")  # expensive
    assert written[6] is None and written[7] is None  # read-only steps never
    assert written[8].endswith("step_0008.h5ad")
    folder = session.outdir / "checkpoints"
    assert sorted(p.name for p in folder.glob("step_*.h5ad")) == [
        "step_0005.h5ad",
        "step_0008.h5ad",
    ]
    meta = json.loads((folder / "step_0008.json").read_text())
    assert meta["step"] == 8 and "normalize" in meta["done"] and "pca" in meta["done"]
    assert not list(folder.glob(".*"))  # no temporary files left


def test_restore_loads_the_newest_checkpoint_at_or_before_a_step(session_at, small_input, tmp_path):
    session = session_at("normalize")
    first = session.digest()
    session.after_step(9, "load_data", SPECS["load_data"])
    call_done = set(session.done)
    session.adata = session.adata[:100].copy()
    session.after_step(12, "pca", SPECS["pca"])
    resumed = Session(session.outdir, input_path=small_input)
    assert resumed.restore(8) == (None, [])
    assert resumed.restore(11) == (9, [])
    assert resumed.digest() == first and resumed.done == call_done
    assert resumed.restore(99) == (12, []) and resumed.adata.n_obs == 100
    step, rejected = Session(session.outdir).restore(99, {9: first, 12: "another digest"})
    assert step == 9 and rejected == ["step_0012.h5ad: data differ from the record of step 12"]
    (session.outdir / "checkpoints" / "step_0012.json").unlink()  # incomplete: never used
    assert Session(session.outdir).restore(99) == (9, [])
    data = session.outdir / "checkpoints" / "step_0009.h5ad"
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])  # a torn file
    fresh = Session(session.outdir)
    step, rejected = fresh.restore(99)
    assert step is None and not fresh.has_data
    assert len(rejected) == 1 and rejected[0].startswith("step_0009.h5ad: unreadable")


@pytest.mark.parametrize(
    "stage",
    [
        "filter_by_qc",
        "detect_doublets",
        "normalize",
        "scale",
        "neighbors",
        "leiden",
        "rank_genes_groups",
        "annotate_clusters",
    ],
)
def test_digest_survives_an_h5ad_round_trip(session_at, stage, tmp_path):
    import anndata as ad

    session = session_at(stage)
    path = tmp_path / "x.h5ad"
    atomic_write_h5ad(session.adata, path)
    assert digest_adata(ad.read_h5ad(path)) == session.digest()


def test_digest_sees_graphs_layers_and_raw(session_at):
    session = session_at("pca")
    before = session.digest()
    session.adata.obsp["connectivities"] = session_at("neighbors").adata.obsp["connectivities"]
    assert session.digest() != before
    after_graph = session.digest()
    session.adata.layers["counts"].data[0] += 1
    assert session.digest() != after_graph
    after_layer = session.digest()
    session.adata.raw = session.adata  # the recipe sets no .raw; a model's tools may
    assert session.digest() != after_layer


@pytest.fixture
def full_disk(tmp_path):
    """A real, nearly full file system: an 8 MiB tmpfs (needs the right to mount, as root has)."""
    import subprocess

    mount = tmp_path / "small_disk"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mount)],
                          capture_output=True, text=True)  # fmt: skip
    if made.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {made.stderr.strip()}")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


def test_a_save_that_cannot_fit_is_a_fault_refused_before_writing(full_disk, small_input):
    """A full disk can crash h5py mid-write: the space is checked first, and the call ends the run
    as a fault of the machine (ENOSPC, retried), leaving no partial file."""
    from agent.registry import InfrastructureError

    session = Session(full_disk / "out", input_path=small_input)
    registry = build_registry()
    assert registry.call("load_data", {}, session).ok
    with pytest.raises(
        InfrastructureError, match=r"No space left on device: writing about \d+ MiB"
    ):
        registry.call("save", {"path": "copy.h5ad"}, session)
    assert [p.name for p in (full_disk / "out").iterdir()] == []

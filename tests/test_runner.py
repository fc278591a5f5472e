"""`python -m agent run` end to end with the reference policy: the record, its schema, resume."""

import itertools
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import jsonschema
import pytest

from agent.config import RunConfig
from agent.context import TokenCounter
from agent.digest import DIGEST_VERSION
from agent.exit_status import ExitStatus
from agent.record import layout as layout_names
from agent.record.layout import SampleLayout
from agent.record.world_state import WorldState
from agent.replay import replay
from agent.runner import _brief, run_sample
from agent.tools import build_registry

SCHEMA = json.loads(
    (Path(__file__).parents[1] / "agent/schemas/world_state.schema.json").read_text()
)


def test_world_state_validates_and_chains(demo_run):
    doc = json.loads(demo_run.world_state.read_text())
    jsonschema.validate(doc, SCHEMA)
    meta = doc["meta"]
    assert meta["status"] == "finished" and meta["policy"] == "reference"
    assert {"scanpy", "anndata", "numpy", "python"} <= meta["versions"].keys()
    assert meta["digest_version"] == DIGEST_VERSION and meta["host"]
    entries = doc["entries"]
    assert entries[-1]["tool"] == "finish"
    for a, b in itertools.pairwise(entries):  # the data digests form one chain
        assert a["digest_after"] == b["digest_before"]
    assert (demo_run.outdir / "adata.h5ad").exists()
    assert any(e["checkpoint"] for e in entries)
    rows = (demo_run.outdir / "metrics.jsonl").read_text().splitlines()
    assert len(rows) == len(entries)


def test_a_run_without_a_model_records_no_server_sampling_or_prompt(demo_run):
    meta = WorldState.load(demo_run.world_state).meta
    assert meta["policy"] == "reference"
    assert (meta["server"], meta["sampling"], meta["prompt_digest"]) == (None, None, None)


def test_an_llm_run_records_the_digest_of_the_prompt_it_sent(small_input, tmp_path):
    """The digest is over the system prompt and tool schemas the server received, in the order
    it received them; another instruction or another key order gives another digest."""
    import hashlib

    import orjson

    from agent.runner import prompt_digest
    from agent.testing.scripted_server import ScriptedServer

    server = ScriptedServer(max_model_len=65536)  # the tool schemas alone exceed 8K test tokens
    server.script = [{"tool": "load_data", "arguments": "{}"}]
    config = RunConfig(
        input=small_input, outdir=tmp_path / "o", sample="s", policy="llm",
        base_url=server.base_url, model="scripted", max_steps=2,
    )  # fmt: skip
    try:
        run_sample(config)
    finally:
        server.close()
    doc = json.loads(SampleLayout(tmp_path / "o").record.read_text())
    jsonschema.validate(doc, SCHEMA)
    first, *later = server.requests
    system, tools = first["messages"][0], first["tools"]
    assert system["role"] == "system" and tools
    sent = orjson.dumps({"system": system["content"], "tools": tools})
    assert doc["meta"]["prompt_digest"] == hashlib.sha256(sent).hexdigest()
    assert all(r["messages"][0] == system and r["tools"] == tools for r in later)
    assert prompt_digest(system["content"] + " ", tools) != doc["meta"]["prompt_digest"]
    reordered = [dict(reversed(t.items())) for t in tools]
    assert prompt_digest(system["content"], reordered) != doc["meta"]["prompt_digest"]


def test_rendering_of_a_60_step_analysis_stays_under_1000_tokens(demo_run):
    world = WorldState.load(demo_run.world_state)
    real = world.entries
    extended = WorldState(meta=world.meta)
    while len(extended.entries) < 60:  # a long session: the same kinds of calls, repeated
        for e in real:
            if len(extended.entries) < 60:
                extended.add(replace(e, step=len(extended.entries) + 1))
    text = extended.render(defaults=build_registry().defaults())
    assert TokenCounter().raw(text) < 1000, text
    assert "#60 finish" in text or "#60 " in text


def run_cmd(
    input_path: Path, outdir: Path, *more: str, sample: str = "pbmc2", module: str = "agent"
) -> list[str]:
    """`python -m agent run` on one sample (or a module that wraps it and adds `run` itself)."""
    run = ["run"] if module == "agent" else []
    args = ["--input", str(input_path), "--outdir", str(outdir), "--sample", sample]
    return [sys.executable, "-m", module, *run, *args, *more]


def facts(world: WorldState) -> list[tuple]:
    """What two runs must agree on, step by step."""
    return [(e.step, e.tool, e.params, e.status, e.result, e.digest_after) for e in world.entries]


def steps_done(outdir: Path) -> int:
    try:  # the copy beside the checkpoints: written atomically, so always whole
        return len(json.loads(SampleLayout(outdir).record_copy.read_bytes())["entries"])
    except (OSError, ValueError):
        return 0


@pytest.mark.slow
def test_killed_run_resumes_to_the_same_result(demo_run, tmp_path):
    outdir = tmp_path / "killed"
    proc = subprocess.Popen(run_cmd(demo_run.input, outdir), stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while steps_done(outdir) < 14 and time.monotonic() < deadline:  # after a checkpoint exists
        time.sleep(0.2)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    (outdir / "world_state.json").unlink()  # as Snakemake does with a failed job's outputs
    done = subprocess.run(
        run_cmd(demo_run.input, outdir), capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr
    assert "resuming after step" in done.stderr
    resumed = WorldState.load(outdir / "world_state.json")
    original = WorldState.load(demo_run.world_state)
    assert resumed.meta["status"] == "finished" and resumed.meta["resumed"]
    assert facts(resumed) == facts(original)


def test_every_run_option_is_a_config_field_and_back():
    """The command line is built from RunConfig: same names, defaults and help."""
    import argparse

    parser = argparse.ArgumentParser()
    RunConfig.add_arguments(parser)
    args = parser.parse_args(["--input", "x.h5ad", "--outdir", "out", "--seed", "3", "--fresh"])
    config = RunConfig.from_args(args)
    assert config == RunConfig(input="x.h5ad", outdir="out", seed=3, fresh=True)
    dests = {a.dest for a in parser._actions} - {"help"}
    assert dests == set(RunConfig.model_fields)
    assert all(a.help for a in parser._actions)
    with pytest.raises(ValueError, match="policy llm needs --endpoint-file"):
        RunConfig(input="x.h5ad", outdir="out", policy="llm")


def test_renaming_a_sample_file_is_one_line_in_the_layout(small_input, tmp_path, monkeypatch):
    """Every reader and writer of a sample's folder takes its names from agent.record.layout: rename the
    record, metrics and checkpoint folder there, and a run and its replay use the new names."""
    monkeypatch.setattr(layout_names, "RECORD", "provenance.json")
    monkeypatch.setattr(layout_names, "METRICS", "steps.jsonl")
    monkeypatch.setattr(layout_names, "CHECKPOINTS", "ckpt")
    outdir = tmp_path / "renamed"
    status = run_sample(RunConfig(input=small_input, outdir=outdir, sample="s", max_steps=4))
    assert status == "step_limit"
    names = sorted(p.relative_to(outdir).as_posix() for p in outdir.rglob("*"))
    assert "provenance.json" in names and "ckpt/provenance.json" in names
    assert "steps.jsonl" in names and "ckpt/steps.jsonl" in names
    assert any(n.startswith("ckpt/step_") for n in names)
    assert not any("world_state" in n or "metrics" in n or "checkpoints" in n for n in names)
    world = WorldState.load(outdir / "provenance.json")
    assert [e.tool for e in world.entries][:1] == ["load_data"] and len(world.entries) == 4
    assert replay(outdir / "provenance.json")["verdict"] == "reproduced"


def test_input_checksum_is_of_the_files_the_reader_uses_not_their_place(tmp_path):
    """A stray file in a 10x folder is not the input; the same bytes in a moved folder are."""
    from agent.record.provenance import checksum, input_checksums

    folder = tmp_path / "a" / "sample"
    folder.mkdir(parents=True)
    for name in ("matrix.mtx.gz", "features.tsv.gz", "barcodes.tsv.gz"):
        (folder / name).write_bytes(name.encode())
    before = checksum(folder)
    (folder / ".DS_Store").write_bytes(b"finder")
    (folder / "truth.tsv").write_text("cell\ttype\n")
    assert checksum(folder) == before
    moved = tmp_path / "b" / "elsewhere"
    moved.parent.mkdir()
    folder.rename(moved)
    assert checksum(moved) == before
    assert set(input_checksums(moved)) == {"matrix.mtx.gz", "features.tsv.gz", "barcodes.tsv.gz"}
    (moved / "barcodes.tsv.gz").write_bytes(b"other")
    assert checksum(moved) != before


def test_folder_lock_refuses_a_second_holder_by_name_and_frees_on_exit(tmp_path):
    from agent.record.lock import FolderBusy, FolderLock

    path = tmp_path / "sample" / ".lock"
    with FolderLock(path), pytest.raises(FolderBusy, match=rf"another run \(pid {os.getpid()} on "):
        FolderLock(path).__enter__()
    path.write_text('{"pid": 999999, "host": "gone"}')  # a holder killed before it let go
    with FolderLock(path) as lock:
        assert lock.previous == {"pid": 999999, "host": "gone"}


def test_input_the_machine_cannot_read_or_that_is_no_file_ends_the_run_clearly(tmp_path):
    """An I/O error while reading the input is a fault (exit 1, retried); a FIFO would hang the
    reader: refused (exit 2); neither leaves a traceback."""
    if not os.access("/proc/self/mem", os.R_OK):
        pytest.skip("/proc/self/mem not readable here")
    failing = tmp_path / "counts.h5ad"
    failing.symlink_to("/proc/self/mem")  # reading it from offset 0 fails with EIO
    fifo = tmp_path / "fifo.h5ad"
    os.mkfifo(fifo)
    for path, code, text in ((failing, 1, "Input/output error"), (fifo, 2, "not a regular file")):
        out = subprocess.run(
            run_cmd(path, tmp_path / path.stem), capture_output=True, text=True, timeout=60
        )
        assert out.returncode == code and text in out.stderr, out.stderr
        assert "Traceback" not in out.stderr


def test_a_stop_signal_swallowed_by_a_finalizer_still_stops_at_the_next_step():
    """Python runs signal handlers inside __del__ too, where the raise is printed and lost: the
    signal is kept, and the loop's check at each step boundary raises it."""
    import gc

    from agent import signals

    class Finalized:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(1000):  # the handler runs between these bytecodes, inside __del__
                pass

    with signals.interruptible():
        Finalized()
        gc.collect()
        with pytest.raises(signals.Interrupted, match="stopped by SIGTERM"):
            signals.check()
    signals.check()  # outside the block nothing is pending


def _hidden_counts(small_input: Path, tmp_path: Path) -> Path:
    """The small sample as .h5ad files often come: log-normalised X, the counts in a layer,
    Ensembl IDs as names and the symbols in a column under an unusual name."""
    import anndata as ad
    import scanpy as sc

    adata = ad.read_h5ad(small_input)
    adata.layers["counts"] = adata.X.copy()
    sc.pp.normalize_total(adata)
    sc.pp.log1p(adata)
    adata.var["hgnc"] = adata.var_names.to_numpy()
    adata.var_names = [f"ENSG{i:011d}" for i in range(adata.n_vars)]
    path = tmp_path / "hidden.h5ad"
    adata.write_h5ad(path)
    return path


def test_the_reference_retries_load_data_with_the_option_each_error_names(small_input, tmp_path):
    path = _hidden_counts(small_input, tmp_path)
    status = run_sample(RunConfig(input=path, outdir=tmp_path / "o", sample="h", max_steps=3))
    world = WorldState.load(SampleLayout(tmp_path / "o").record)
    loads = [(e.status, e.params["layer"], e.params["gene_symbols"]) for e in world.entries]
    assert status == "step_limit" and loads == [
        ("error", None, None),
        ("error", "counts", None),
        ("ok", "counts", "hgnc"),
    ]
    assert world.entries[-1].result["n_mt_genes"] == 13


def test_run_options_layer_and_gene_symbols_reach_load_data(small_input, tmp_path):
    path = _hidden_counts(small_input, tmp_path)
    config = RunConfig(
        input=path, outdir=tmp_path / "o", max_steps=1, layer="counts", gene_symbols="hgnc"
    )
    assert run_sample(config) == "step_limit"
    world = WorldState.load(config.layout.record)
    first = world.entries[0]
    assert first.status == "ok" and (first.params["layer"], first.params["gene_symbols"]) == (
        "counts",
        "hgnc",
    )
    assert (world.meta["layer"], world.meta["gene_symbols"]) == ("counts", "hgnc")
    assert "load_data(layer='counts', gene_symbols='hgnc')" in _brief(config)  # told to a model


def test_a_refused_input_ends_at_once_with_its_reason_and_exit_3(tmp_path, capsys):
    import argparse

    import anndata as ad
    import numpy as np

    from agent import runner

    path = tmp_path / "tiny" / "counts.h5ad"
    path.parent.mkdir()
    ad.AnnData(np.ones((5, 30), np.float32)).write_h5ad(path)
    parser = argparse.ArgumentParser()
    runner.add_arguments(parser)
    args = parser.parse_args(["--input", str(path), "--outdir", str(tmp_path / "o")])
    for _ in range(2):  # a rerun keeps the refusal (or comes to it again) and says so
        assert runner.main(args) == ExitStatus.INPUT_REFUSED
        err = capsys.readouterr().err
        assert "[tiny] input refused (exit 3)" in err and "holds 5 cells" in err, err
        world = WorldState.load(tmp_path / "o" / "world_state.json")
        assert world.meta["sample"] == "tiny" and world.meta["status"] == "input_refused"
        assert world.meta["error"].startswith(f"input refused: {path} holds 5 cells")
        assert [e.tool for e in world.entries] == ["load_data"]  # no "(no tool call)" nudges


def test_a_refusal_recorded_before_version_2_is_redone_not_kept(tmp_path, capsys):
    """Before record version 2 too little memory for the input ended as input_refused too, which
    a rerun kept for good: such a record (unchained, as that version wrote it) is set aside and
    the input read again."""
    import anndata as ad
    import numpy as np

    from agent.resume import plan

    path = tmp_path / "tiny.h5ad"
    ad.AnnData(np.ones((5, 30), np.float32)).write_h5ad(path)
    config = RunConfig(input=path, outdir=tmp_path / "o")
    assert run_sample(config) == "input_refused"
    layout = config.layout
    doc = json.loads(layout.record_copy.read_text())
    assert doc["meta"].pop("record_version") == 2
    del doc["meta"]["seal"]
    for entry in doc["entries"]:
        del entry["chain"]
    layout.record_copy.write_text(json.dumps(doc))  # the record file is the same inode
    old = WorldState.load(layout.record_copy).meta
    wanted = {k: old.get(k) for k in ("sample", "input_sha256", "policy", "seed", "brief")}
    assert plan(layout, wanted, 10)[0] == "new"
    assert len(list(layout.root.glob("previous/*/world_state.json"))) == 1
    # the user is told why, and where the earlier analysis went
    said = capsys.readouterr().err
    assert "o: input refused before record version 2" in said and "/previous/" in said
    # the same refusal recorded by this version is the result, kept
    assert run_sample(config) == "input_refused"
    assert plan(layout, wanted, 10)[0] == "keep"


@pytest.mark.parametrize(
    ("path", "name"),
    [
        ("data/pbmc2/counts.h5ad", "pbmc2"),
        ("runs/pbmc1/outs/filtered_feature_bc_matrix", "pbmc1"),
        ("runs/pbmc1/outs/raw_feature_bc_matrix.h5", "pbmc1"),
        ("s3/filtered_gene_bc_matrices/hg19", "s3"),
        ("data/liver.v2.h5ad", "liver.v2"),
    ],
)
def test_the_default_sample_name_skips_generic_names(path, name):
    assert RunConfig(input=path, outdir="o").sample_name == name


@pytest.mark.parametrize("gives_up", [True, False])
def test_a_model_that_cannot_load_the_input_ends_with_input_refused(tmp_path, gives_up):
    """A reply without a call after load_data failed gives up at once (no nudge); failing
    load_data until the failure limit is a refused input too, not repeated_failures."""
    import io

    from agent.context import ContextManager
    from agent.loop import run_loop
    from agent.policies.base import Decision, ToolCall
    from agent.tools.session import Session

    calls = [
        Decision([ToolCall(f"c{i}", "load_data", f'{{"path": "gone{i}.h5ad"}}')])
        for i in range(1 if gives_up else 6)
    ]
    replies = iter([*calls, Decision(text="The input cannot be read.", finish_reason="stop")])
    policy = type("Scripted", (), {"decide": lambda self, m, t, w: next(replies)})()
    registry = build_registry()
    context = ContextManager("instructions", registry.schemas(), context_limit=100_000)
    world = WorldState(meta={"sample": "s"})
    session = Session(tmp_path, input_path=None)
    status = run_loop(
        policy, registry, session, world, context, SampleLayout(tmp_path), log=io.StringIO()
    )
    assert status == "input_refused"
    assert [e.tool for e in world.entries] == ["load_data"] * len(calls)
    assert "gone" in world.entries[-1].error and "does not exist" in world.entries[-1].error


def _record(status, tools=("load_data",), **meta):
    """An earlier record of sample "s" with seed 0, one ok entry per tool."""
    from agent.record.world_state import Entry

    entries = [
        Entry(step=i, tool=t, params={}, status="ok", result={}, error=None, seconds=0.0,
              digest_before=None, digest_after=None)
        for i, t in enumerate(tools, 1)
    ]  # fmt: skip
    meta = {"sample": "s", "seed": 0, "status": status, "record_version": 2, **meta}
    return WorldState(meta=meta, entries=entries)


@pytest.mark.parametrize(
    ("earlier", "damage", "options", "action", "why"),
    [
        (None, None, {}, "new", "no earlier record"),
        (_record("finished"), None, {"fresh": True}, "new", "--fresh"),
        (None, "cannot resume: x", {}, "refuse", "cannot resume: x; rerun with --fresh"),
        (_record("finished"), "o was altered: y", {}, "refuse", "altered: y; rerun with --fresh"),
        (_record("finished", seed=1), None, {}, "refuse", "other settings: seed 1 (this run: 0)"),
        (_record("finished", seed=1), None, {"replace_changed": True}, "new", "seed 1"),
        (_record("input_refused", record_version=1), None, {}, "new", "before record version 2"),
        (_record("input_refused"), None, {}, "keep", "its result (input_refused)"),
        (_record("running", ("load_data", "finish")), None, {}, "keep", "finish succeeded"),
        (_record("step_limit"), None, {"max_steps": 1}, "keep", "step limit"),
        (_record("step_limit"), None, {}, "resume", "unfinished (step_limit)"),
        (_record("interrupted", model="a"), None, {}, "resume", "unfinished (interrupted)"),
        # once the policy is set up: a resumed analysis goes on with its steps' model only
        (_record("failed", model="a"), None, {"served_model": "b"}, "refuse", "model 'a' (this"),
        (_record("failed", model=None), None, {"served_model": "b"}, "resume", "unfinished"),
        (_record("failed", (), model="a"), None, {"served_model": "b"}, "resume", "unfinished"),
    ],
)
def test_the_rule_table_for_an_earlier_record(earlier, damage, options, action, why):
    from agent.resume import decide

    options = {"max_steps": 10, **options}
    choice = decide(SampleLayout("o"), earlier, damage, {"sample": "s", "seed": 0}, **options)
    assert (choice.action, why in choice.why) == (action, True), choice


def test_another_model_is_refused_once_the_policy_is_set_up():
    """The rule table's second look, with the served model: too late to set the analysis aside,
    so it is refused, naming how the earlier run ended."""
    from agent.resume import CannotReuse, refuse_another_model

    layout, wanted = SampleLayout("o"), {"sample": "s", "seed": 0}
    refuse_another_model(layout, None, wanted, 10, "b")  # a new analysis takes any model
    refuse_another_model(layout, _record("failed", model="b"), wanted, 10, "b")
    with pytest.raises(CannotReuse, match=r"\(failed\) made with other settings: model 'a' \(th"):
        refuse_another_model(layout, _record("failed", model="a"), wanted, 10, "b")


def test_a_record_from_before_a_setting_existed_matches_its_value_then():
    """A record written before the doublets setting existed was a run that removed doublets:
    kept under 'remove', redone under 'flag'."""
    from agent.resume import differences

    earlier = {"sample": "s", "seed": 0}
    assert differences(earlier, {"sample": "s", "seed": 0, "doublets": "remove"}) == []
    assert differences(earlier, {"sample": "s", "seed": 0, "doublets": "flag"}) == [
        "doublets 'remove' (this run: 'flag')"
    ]

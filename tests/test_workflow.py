"""The Snakemake workflow: lint, dry runs of each server mode, parse-time sheet errors, and the
demo cohort end to end with `snakemake --cores 2` (the README's main command)."""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from agent.data.synthetic import load_truth
from tests.fixtures_cohort import check_demo_conditions
from tests.fixtures_workflow import (
    DEMO_SAMPLES,
    REPO,
    StandinHub,
    WorkflowDir,
    check_cohort_outputs,
    make_workflow_dir,
    workflow_env,
)


def job_counts(output: str) -> dict[str, int]:
    """The 'Job stats' table of a snakemake run or dry run."""
    table = output.split("Job stats:")[1].split("\n\n")[0]
    rows = (line.split() for line in table.strip().splitlines()[2:])
    return {row[0]: int(row[1]) for row in rows if len(row) == 2 and row[0] != "total"}


def shell_commands(output: str, rule: str) -> list[str]:
    """The shell commands of `rule`'s jobs in a `snakemake -n -p` output, one string per job."""
    # a job starts at its "[date]" line, a group's jobs after "[date] Group job NAME ..."
    blocks = re.split(r"\n\s*\[[^\]]+\][^\n]*\n", output)
    found = []
    for block in blocks:
        if re.search(rf"^\s*rule {rule}:", block, re.MULTILINE):
            command = block.split("Shell command:", 1)[-1]
            # a temp() output's clean-up note may follow the job that frees it
            found.append(command.split("\nWould remove temporary output", 1)[0])
    return found


def resources(output: str, rule: str) -> list[str]:
    """The 'resources:' line of each of `rule`'s jobs in a dry run."""
    blocks = re.split(r"\n\s*\[[^\]]+\][^\n]*\n", output)
    return [
        re.search(r"^\s*resources: (.*)$", block, re.MULTILINE).group(1)
        for block in blocks
        if re.search(rf"^\s*rule {rule}:", block, re.MULTILINE)
    ]


def test_server_job_is_one_task_on_one_node():
    """The Slurm plugin's sbatch line for the server's resources (common.smk server_resources)
    with several GPUs: --nodes=1 and no --ntasks-per-gpu, which would make N GPUs N tasks that
    Slurm may spread over nodes (shown beside the plugin's default, which does that)."""
    from types import SimpleNamespace

    from snakemake_executor_plugin_slurm.submit_string import get_submit_command

    class Resources(dict):
        __getattr__ = dict.get

    params = {"run_uuid": "u", "slurm_logfile": "log", "comment_str": "c", "account": "",
              "partition": "", "workdir": "."}  # fmt: skip
    ours = Resources(gpu=4, nodes=1, tasks_per_gpu=0, mem_mb=1000, runtime=60, cpus_per_task=8)
    line = get_submit_command(SimpleNamespace(resources=ours, threads=1), params)
    assert "--nodes=1" in line and "--ntasks" not in line, line
    default = Resources(gpu=4, mem_mb=1000, runtime=60, cpus_per_task=8)
    line = get_submit_command(SimpleNamespace(resources=default, threads=1), params)
    assert "--ntasks-per-gpu=1" in line and "--nodes" not in line, line


def groups(output: str) -> dict[str, list[str]]:
    """{group id: [rule:wildcards, ...]} from the 'Group job' sections of a dry run."""
    found: dict[str, list[str]] = {}
    for section in re.split(r"Group job ", output)[1:]:
        name = section.split()[0]
        section = re.split(r"^\[|^Job stats", section, flags=re.MULTILINE)[0]  # next top-level job
        members = re.findall(
            r"^    rule (\w+):.*?wildcards: (\S+)", section, re.DOTALL | re.MULTILINE
        )
        found[name] = sorted(f"{rule}:{wc}" for rule, wc in members)
    return found


@pytest.fixture
def inputs(workflow_dir: WorkflowDir) -> Path:
    """A folder of existing (empty) input files a sheet can point at."""
    folder = workflow_dir.path / "inputs"
    folder.mkdir()
    for name in "abcdef":
        (folder / f"{name}.h5ad").touch()
    return folder


def test_lint_is_clean():
    out = subprocess.run(
        [sys.executable, "-m", "snakemake", "--lint"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Congratulations, your workflow is in a good condition!" in out.stdout + out.stderr


def test_demo_dry_run_plans_the_whole_cohort(workflow_dir: WorkflowDir):
    out = workflow_dir.snakemake("-n", "-p")
    assert out.returncode == 0, out.stdout
    counts = job_counts(out.stdout)
    assert counts == {
        "demo_data": 6,
        "analyze": 6,
        "replay": 6,
        "compare": 1,
        "cohort_composition": 1,
        "cohort_de": 1,  # the demo sheet names conditions
        "report": 1,
        "all": 1,
    }
    commands = shell_commands(out.stdout, "analyze")
    assert len(commands) == 6
    for cmd in commands:
        assert "--policy reference" in cmd
        assert "--endpoint-file" not in cmd and "--base-url" not in cmd
    assert any("--input data/demo/pbmc1 " in cmd for cmd in commands)  # the 10x folder itself
    synth = shell_commands(out.stdout, "demo_data")
    assert sorted(re.search(r"--sample (\S+)", c).group(1) for c in synth) == list(DEMO_SAMPLES)


def test_vllm_mode_shards_llm_samples_into_server_groups(workflow_dir: WorkflowDir, inputs: Path):
    rows = [{"sample": f"s{i}", "path": f"inputs/{name}.h5ad"} for i, name in enumerate("abcde")]
    rows.append({"sample": "ref", "path": "inputs/f.h5ad", "policy": "reference"})
    workflow_dir.write_sheet(rows)
    workflow_dir.configure(
        analysis={"policy": "llm"},
        server={"mode": "vllm", "samples_per_server": 2, "gres": "gpu:h100:1", "thinking": False},
    )
    out = workflow_dir.snakemake("-n", "-p", "--cores", "16")
    assert out.returncode == 0, out.stdout
    assert job_counts(out.stdout)["serve_vllm"] == 3
    assert groups(out.stdout) == {
        "server_shard000": ["analyze:sample=s0", "analyze:sample=s1", "serve_vllm:shard=shard000"],
        "server_shard001": ["analyze:sample=s2", "analyze:sample=s3", "serve_vllm:shard=shard001"],
        "server_shard002": ["analyze:sample=s4", "serve_vllm:shard=shard002"],
    }
    serve = shell_commands(out.stdout, "serve_vllm")
    assert any(
        "--endpoint-file results/servers/shard002.json" in c and "--agents 1" in c for c in serve
    )
    assert all("--agents" in c and "--gpus 1" in c and "--timeout 1800" in c for c in serve)
    # the Hub id at its revision, offline, and one compile cache for every shard
    cache = workflow_dir.path / "results" / "vllm_cache"
    assert all("--model Qwen/Qwen3.6-27B --revision main " in c for c in serve)
    assert all(f"--cache-dir {cache}" in c and "exec env HF_HUB_OFFLINE=1 " in c for c in serve)
    assert "fetch_model" not in job_counts(out.stdout)  # only when asked
    assert "gres=gpu:h100:1" in out.stdout and "gpu=1," not in out.stdout  # typed gres replaces gpu
    # one node, one task (no --ntasks-per-gpu): see test_server_job_is_one_task_on_one_node
    serve_resources = resources(out.stdout, "serve_vllm")
    assert len(serve_resources) == 3
    assert all("nodes=1" in r and "tasks_per_gpu=0" in r for r in serve_resources), serve_resources
    analyze = {
        re.search(r"--sample (\S+)", c).group(1): c for c in shell_commands(out.stdout, "analyze")
    }
    assert "--endpoint-file results/servers/shard001.json" in analyze["s3"]
    assert "--outage-wait 900" in analyze["s3"]  # server.outage_wait reaches the agent
    assert "--no-thinking" in analyze["s3"]  # and so does server.thinking
    assert "until test -s results/servers/shard001.json" in analyze["s3"]  # waits for health
    assert "--policy reference" in analyze["ref"] and "results/servers" not in analyze["ref"]


def test_fetch_model_fills_the_hf_cache_before_the_first_server_only_when_asked(
    workflow_dir: WorkflowDir, inputs: Path
):
    """server.fetch: one fetch_model job (a localrule) before the servers, which read the same
    HF_HOME offline; without it, `snakemake fetch_model` plans that job alone."""
    workflow_dir.write_sheet([{"sample": "a", "path": "inputs/a.h5ad", "policy": "llm"}])
    workflow_dir.configure(
        server={"mode": "vllm", "model": "google/gemma-4-31B-it", "revision": "v1.0",
                "hf_home": "shared/hf", "cache_dir": "", "fetch": True},
    )  # fmt: skip
    out = workflow_dir.snakemake("-n", "-p", "--cores", "4")
    assert out.returncode == 0, out.stdout
    assert job_counts(out.stdout)["fetch_model"] == 1
    marker = "results/models/google_gemma-4-31B-it_v1.0.json"
    assert f"rule fetch_model:\n    output: {marker}" in out.stdout
    assert f"Input files updated by another job: {marker}" in out.stdout  # serve_vllm waits
    fetch_rule = (REPO / "workflow/rules/serve.smk").read_text().split("rule fetch_model:")[1]
    # the login node runs it (compute nodes: no internet), under a module's prefix too
    assert "localrule: True" in fetch_rule.split("\n\n")[0]
    (serve,) = shell_commands(out.stdout, "serve_vllm")
    hf_home = workflow_dir.path / "shared" / "hf"  # absolute: the same folder on every node
    assert f"exec env HF_HOME={hf_home} HF_HUB_OFFLINE=1 " in serve
    assert "--model google/gemma-4-31B-it --revision v1.0 " in serve
    assert "--cache-dir" not in serve  # "": vLLM's own default

    workflow_dir.configure(server={"fetch": False})
    out = workflow_dir.snakemake("-n", "fetch_model")
    assert out.returncode == 0, out.stdout
    assert job_counts(out.stdout) == {"fetch_model": 1}

    (inputs / "model").mkdir()  # a folder has nothing to fetch
    workflow_dir.configure(server={"fetch": True, "model": "inputs/model"})
    out = workflow_dir.snakemake("-n")
    assert out.returncode != 0
    assert "config server.fetch: server.model 'inputs/model' is a folder" in out.stdout


def test_fetch_model_downloads_what_the_server_then_finds_offline(workflow_dir: WorkflowDir):
    """`snakemake fetch_model` for real (the rule, its script, huggingface_hub over HTTP from a
    stand-in Hub) fills server.hf_home; then, with no Hub at all, the launcher resolves the Hub
    id from that cache offline, as a serve job does, to the commit fetch_model recorded."""
    config = (REPO / "tests" / "data" / "model_configs" / "qwen3.6-27b.json").read_bytes()
    hub = StandinHub("Qwen/Qwen3.6-27B", {"config.json": config, "model.safetensors": b"w"})
    workflow_dir.configure(server={"model": "Qwen/Qwen3.6-27B", "hf_home": "hf"})
    try:  # HF_HUB_OFFLINE from the environment too: the fetch job is the one asked to download
        out = workflow_dir.snakemake(
            "--cores", "1", "fetch_model", env={"HF_ENDPOINT": hub.url, "HF_HUB_OFFLINE": "1"}
        )
    finally:
        hub.close()
    log = workflow_dir.path / "logs" / "fetch_model.log"
    assert out.returncode == 0, out.stdout + (log.read_text() if log.exists() else "")
    assert any("/resolve/" in r for r in hub.requests)
    fetched = json.loads(
        (workflow_dir.path / "results/models/Qwen_Qwen3.6-27B_main.json").read_text()
    )
    snapshot = workflow_dir.path / "hf/hub/models--Qwen--Qwen3.6-27B/snapshots" / hub.commit
    assert fetched["commit"] == hub.commit and Path(fetched["path"]) == snapshot
    assert (snapshot / "config.json").read_bytes() == config
    assert f"(commit {hub.commit})" in log.read_text()

    env = {**os.environ, "HF_HOME": str(workflow_dir.path / "hf"), "HF_HUB_OFFLINE": "1"}
    env.pop("HF_ENDPOINT", None)
    served = subprocess.run(
        [sys.executable, "-m", "agent", "serve", "--explain", "--gpu", "cpu",
         "--model", "Qwen/Qwen3.6-27B", "--revision", "main"],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert served.returncode == 0, served.stderr
    assert hub.commit in served.stdout, served.stdout


def test_the_cluster_example_serves_a_hub_id(workflow_dir: WorkflowDir):
    """config/cluster.example.yaml over the defaults: one server per 8 samples, started from the
    Hub id it names, offline, with the shared compile cache."""
    import yaml

    example = yaml.safe_load((REPO / "config" / "cluster.example.yaml").read_text())
    example.pop("samples")  # the demo sheet, copied into the working directory
    workflow_dir.configure(**example)
    out = workflow_dir.snakemake("-n", "-p", "--cores", "32")
    assert out.returncode == 0, out.stdout
    assert job_counts(out.stdout)["serve_vllm"] == 1
    (serve,) = shell_commands(out.stdout, "serve_vllm")
    assert f"--model {example['server']['model']} --revision main " in serve
    assert "/" in example["server"]["model"] and not (REPO / example["server"]["model"]).exists()
    assert "HF_HUB_OFFLINE=1" in serve and "--max-model-len 32768" in serve
    assert f"--cache-dir {workflow_dir.path / 'results' / 'vllm_cache'}" in serve


def test_external_mode_passes_the_given_endpoint(workflow_dir: WorkflowDir, inputs: Path):
    key = workflow_dir.path / "api.key"
    key.write_text("secret\n")
    key.chmod(0o600)
    workflow_dir.write_sheet([{"sample": "a", "path": "inputs/a.h5ad", "policy": "llm"}])
    workflow_dir.configure(
        server={"mode": "external", "base_url": "http://node7:8000/v1", "api_key_file": str(key)}
    )
    out = workflow_dir.snakemake("-n", "-p")
    assert out.returncode == 0, out.stdout
    assert "serve_vllm" not in job_counts(out.stdout)
    (cmd,) = shell_commands(out.stdout, "analyze")
    assert f"--base-url http://node7:8000/v1 --model Qwen/Qwen3.6-27B --api-key-file {key}" in cmd

    key.chmod(0o644)  # refused at parse time, as the agent would refuse it at job time
    out = workflow_dir.snakemake("-n")
    assert out.returncode != 0
    assert f"config server.api_key_file: API key file {key}: mode 644" in out.stdout
    assert f"(chmod 600 {key})" in out.stdout

    workflow_dir.configure(server={"api_key_file": str(workflow_dir.path / "missing.key")})
    out = workflow_dir.snakemake("-n")
    assert out.returncode != 0
    assert "config server.api_key_file" in out.stdout and "missing.key" in out.stdout


def test_sheet_overrides_reach_the_job(workflow_dir: WorkflowDir, inputs: Path):
    brief = "focus on 'T cells'; expect ~10% doublets"
    workflow_dir.write_sheet(
        [
            {"sample": "a", "path": "inputs/a.h5ad", "brief": brief, "mem_mb": "1234",
             "runtime": "7", "cpus_per_task": "3", "seed": "42", "max_steps": "9"},
            {"sample": "b", "path": str(inputs / "b.h5ad")},  # absolute paths are fine too
        ]
    )  # fmt: skip
    out = workflow_dir.snakemake("-n", "-p", "--cores", "4")
    assert out.returncode == 0, out.stdout
    a, b = sorted(shell_commands(out.stdout, "analyze"), key=lambda c: "--sample b" in c)
    assert "'--brief=focus on '\"'\"'T cells'\"'\"'; expect ~10% doublets'" in a
    assert "--seed 42 --max-steps 9" in a and "--seed 0 --max-steps 120" in b
    assert "OMP_NUM_THREADS=3" in a and "OMP_NUM_THREADS=2" in b
    resources = re.findall(r"rule analyze:.*?resources: ([^\n]+)", out.stdout, re.DOTALL)
    assert any(
        "runtime=7" in r and "cpus_per_task=3" in r and "mem_mb=1234" in r for r in resources
    )
    assert any("runtime=60" in r and "mem_mb=8000" in r for r in resources)


BAD_SHEETS = {
    "missing column": (
        [{"sample": "a", "policy": "reference"}],
        "line 1, column 'path': missing column",
    ),
    "duplicate sample": (
        [{"sample": "a", "path": "inputs/a.h5ad"}, {"sample": "a", "path": "inputs/b.h5ad"}],
        "line 3 (sample 'a'), column 'sample': duplicate sample (first on line 2)",
    ),
    "missing path": (
        [{"sample": "a", "path": "inputs/a.h5ad"}, {"sample": "b", "path": "inputs/nope.h5ad"}],
        "line 3 (sample 'b'), column 'path': 'inputs/nope.h5ad' does not exist",
    ),
    "unknown policy": (
        [{"sample": "a", "path": "inputs/a.h5ad", "policy": "gpt-9"}],
        "line 2 (sample 'a'), column 'policy': 'gpt-9' is not one of ['reference', 'llm']",
    ),
    "negative resource": (
        [{"sample": "a", "path": "inputs/a.h5ad"}, {"sample": "b", "path": "inputs/b.h5ad", "mem_mb": "-4000"}],
        "line 3 (sample 'b'), column 'mem_mb': -4000 is less than the minimum of 1",
    ),
    "resource not a number": (
        [{"sample": "a", "path": "inputs/a.h5ad", "runtime": "2h"}],
        "line 2 (sample 'a'), column 'runtime': expected a whole number, got '2h'",
    ),
    "unknown column": (
        [{"sample": "a", "path": "inputs/a.h5ad", "mem_MB": "100"}],
        "line 1, column 'mem_MB': unknown column",
    ),
    "empty path": (
        [{"sample": "a", "path": "inputs/a.h5ad"}, {"sample": "b", "policy": "llm"}],
        "line 3 (sample 'b'), column 'path': empty cell, a value is required",
    ),
    "bad sample name": (
        [{"sample": "a/b", "path": "inputs/a.h5ad"}],
        "line 2 (sample 'a/b'), column 'sample': 'a/b' does not match",
    ),
    "llm without a server": (
        [{"sample": "a", "path": "inputs/a.h5ad"}, {"sample": "b", "path": "inputs/b.h5ad", "policy": "llm"}],
        "line 3 (sample 'b'), column 'policy': policy 'llm' needs a model server but config "
        "server.mode is 'none'",
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD_SHEETS))
def test_bad_sheet_fails_before_any_job(workflow_dir: WorkflowDir, inputs: Path, case: str):
    rows, expected = BAD_SHEETS[case]
    workflow_dir.write_sheet(rows)
    out = workflow_dir.snakemake("--cores", "1")  # a real run: nothing may start
    assert out.returncode != 0
    assert f"sample sheet samples.tsv, {expected}" in out.stdout, out.stdout
    assert "Job stats" not in out.stdout
    assert (
        not (workflow_dir.path / "logs").exists() and not (workflow_dir.path / "results").exists()
    )


def test_llm_default_without_server_names_the_config_key(workflow_dir: WorkflowDir):
    workflow_dir.configure(analysis={"policy": "llm"})
    out = workflow_dir.snakemake("-n")
    assert out.returncode != 0
    assert "config analysis.policy: policy 'llm' needs a model server" in out.stdout, out.stdout


def test_missing_sheet_is_named(workflow_dir: WorkflowDir):
    workflow_dir.configure(samples="nowhere.tsv")
    out = workflow_dir.snakemake("-n")
    assert out.returncode != 0
    assert "sample sheet nowhere.tsv does not exist (config key 'samples')" in out.stdout


def test_unreadable_input_is_a_recorded_result(workflow_dir: WorkflowDir, inputs: Path):
    """An analysis that cannot finish still completes its job with a record (shown as failed in
    the report); only the final AnnData is missing."""
    workflow_dir.write_sheet([{"sample": "a", "path": "inputs/a.h5ad"}])  # an empty file
    out = workflow_dir.snakemake("--cores", "1", "results/samples/a/world_state.json")
    assert out.returncode == 0, out.stdout
    folder = workflow_dir.path / "results" / "samples" / "a"
    state = json.loads((folder / "world_state.json").read_text())
    assert state["meta"]["status"] != "finished"
    assert state["entries"][0]["tool"] == "load_data" and state["entries"][0]["status"] == "error"
    assert not (folder / "adata.h5ad").exists()
    assert state["meta"]["status"] == "input_refused"
    assert state["meta"]["error"].startswith("input refused: ")
    assert "input refused (exit 3)" in (workflow_dir.path / "logs/analyze/a.log").read_text()


def comparison_rows(tsv: Path) -> dict[str, dict[str, str]]:
    """results/comparison/comparison.tsv by sample."""
    with tsv.open() as handle:
        return {r["sample"]: r for r in csv.DictReader(handle, delimiter="\t")}


# How far remove_ambient's estimate may lie from the demo's planted ambient share. The demo's
# inputs are filtered (called cells), so the estimate is DecontX's: bench/ambient_scale.py
# measured its error at -0.020 to +0.027 on synthetic samples (loads 0.05-0.2) and up to +0.069
# on real cells (CellTypist's sample, planted 0.02; bench/README.md, "Ambient RNA"), and with
# no load it estimates 0.035-0.065 on the demo's samples. 0.08: the largest error, with margin.
AMBIENT_TOLERANCE = 0.08


def check_demo_ambient(path: Path) -> None:
    """Each demo sample's estimated contamination (the report's cohort.tsv) within
    AMBIENT_TOLERANCE of its planted ambient share (truth.tsv: the mean over its cell barcodes;
    0 where no load was planted; agent/data/synthetic.py plants loads in pbmc4 to pbmc6)."""
    with (path / "results" / "report" / "cohort.tsv").open() as handle:
        estimated = {r["sample"]: r for r in csv.DictReader(handle, delimiter="\t")}
    planted = {}
    for sample in DEMO_SAMPLES:
        cells = load_truth(path / "data" / "demo" / sample).query("not is_empty")
        planted[sample] = cells["ambient_fraction"].mean() if "ambient_fraction" in cells else 0.0
        row = estimated[sample]
        found = float(row["ambient_contamination"])
        assert row["ambient_method"] == "decontx", (sample, row["ambient_method"])
        assert abs(found - planted[sample]) <= AMBIENT_TOLERANCE, (sample, planted[sample], found)
    loaded = sorted((s for s, share in planted.items() if share > 0), key=planted.get)
    assert len(loaded) >= 2 and len(loaded) < len(planted), planted  # loads, and samples without
    # the tolerance holds the method's bias where nothing was planted; the loads, 0.05 apart,
    # must still come out in their planted order
    found = [float(estimated[s]["ambient_contamination"]) for s in loaded]
    assert found == sorted(found), (loaded, found)


@pytest.mark.slow
def test_demo_cohort_end_to_end_and_reprocessed_after_a_sheet_edit(workflow_dir: WorkflowDir):
    """`snakemake --cores 2` on the demo cohort: data, analyses, replays and the report. Then a
    user edits one sample's sheet row (another seed) and reruns `snakemake`: only that sample is
    redone (--replace-changed sets its first analysis aside in previous/), the comparison names
    the setting that changed, and the report links it."""
    out = workflow_dir.snakemake("--cores", "2", timeout=1200)
    wd = workflow_dir.path
    logs = "\n".join(f"== {p}\n{p.read_text()[-3000:]}" for p in sorted(wd.glob("logs/*/*.log")))
    assert out.returncode == 0, out.stdout[-5000:] + logs
    check_cohort_outputs(wd)
    check_demo_conditions(wd)  # the planted condition found by the composition and de jobs
    check_demo_ambient(wd)  # the planted ambient loads estimated by remove_ambient
    # a second run has nothing to do: outputs are complete and up to date
    again = workflow_dir.snakemake("--cores", "2", "-n")
    assert "Nothing to be done" in again.stdout, again.stdout

    records = {s: wd / "results" / "samples" / s / "world_state.json" for s in DEMO_SAMPLES}
    before = {s: path.read_bytes() for s, path in records.items()}
    with (wd / "samples.tsv").open() as handle:
        rows = list(csv.DictReader(handle, delimiter="\t"))
    next(r for r in rows if r["sample"] == "pbmc2")["seed"] = "1"  # others: empty, seed 0
    workflow_dir.write_sheet(rows)
    redo = workflow_dir.snakemake("--cores", "2", timeout=1200)
    assert redo.returncode == 0, redo.stdout[-5000:]
    counts = job_counts(redo.stdout)
    assert counts == {
        "analyze": 1, "replay": 1, "compare": 1, "cohort_composition": 1, "cohort_de": 1,
        "report": 1, "all": 1,
    }, counts  # fmt: skip
    assert all(records[s].read_bytes() == before[s] for s in DEMO_SAMPLES if s != "pbmc2")
    (previous,) = (wd / "results/samples/pbmc2/previous").glob("*/world_state.json")
    assert previous.read_bytes() == before["pbmc2"]

    table = wd / "results" / "comparison" / "comparison.tsv"
    compared = comparison_rows(table)
    assert set(compared) == set(DEMO_SAMPLES)
    pbmc2 = compared["pbmc2"]
    assert "run.seed: 0 -> 1" in pbmc2["parameters_changed"].split("; "), pbmc2
    assert pbmc2["old_record"] == str(previous.resolve())
    assert pbmc2["new_record"] == str(records["pbmc2"].resolve())
    assert 0 <= float(pbmc2["same_label"]) <= 1 and int(pbmc2["shared_cells"]) > 0
    for kept in set(DEMO_SAMPLES) - {"pbmc2"}:  # never redone: nothing in previous/ to compare with
        assert compared[kept]["outcome"] == "not reprocessed", compared[kept]
    report = wd / "results" / "report"
    assert 'href="comparison.html"' in (report / "index.html").read_text()
    assert (report / "comparison.tsv").read_bytes() == table.read_bytes()


def test_adding_a_sample_analyses_only_it_and_restarts_no_finished_shard(
    workflow_dir: WorkflowDir, demo_run, tmp_path: Path
):
    """vllm mode, one server per sample: after a second sample joins the sheet, only its shard's
    server starts and only it is analysed; the first sample's record stays byte for byte."""
    recorded = tmp_path / "recorded"  # the calls the stand-in server answers with, per sample
    for name in ("a", "b"):
        doc = json.loads(demo_run.world_state.read_text())
        doc["meta"]["sample"] = name
        (recorded / name).mkdir(parents=True)
        (recorded / name / "world_state.json").write_text(json.dumps(doc))
    standin = f"{sys.executable} {REPO / 'tests' / 'fixtures_workflow.py'} --recorded {recorded}"
    workflow_dir.configure(
        analysis={"policy": "llm"},
        server={"mode": "vllm", "samples_per_server": 1, "command": standin},
        resources={"analyze": {"cpus_per_task": 1}},
    )
    rows = [{"sample": "a", "path": str(demo_run.input)}]
    records = {name: f"results/samples/{name}/world_state.json" for name in ("a", "b")}
    workflow_dir.write_sheet(rows)
    first = workflow_dir.snakemake("--cores", "2", records["a"])
    assert first.returncode == 0, first.stdout
    record_a = (workflow_dir.path / records["a"]).read_bytes()
    assert not list((workflow_dir.path / "results" / "servers").glob("*.json"))  # temporary

    workflow_dir.write_sheet([*rows, {"sample": "b", "path": str(demo_run.input)}])
    second = workflow_dir.snakemake("--cores", "2", *records.values())
    assert second.returncode == 0, second.stdout
    assert job_counts(second.stdout) == {"serve_vllm": 1, "analyze": 1}, second.stdout
    assert "serve_vllm:shard=shard001" in second.stdout or "shard=shard001" in second.stdout
    assert "shard=shard000" not in second.stdout
    assert (workflow_dir.path / records["a"]).read_bytes() == record_a
    meta = json.loads((workflow_dir.path / records["b"]).read_text())["meta"]
    assert meta["status"] == "finished"
    # the model the config named reached the record through the server's endpoint file
    assert meta["server"]["model_id"] == "Qwen/Qwen3.6-27B"
    assert meta["server"]["revision"] == "main" and re.fullmatch(
        "[0-9a-f]{64}", meta["prompt_digest"]
    )


def test_the_schemas_eval_cases_are_agent_evals(workflow_dir: WorkflowDir):
    """The config schema names `agent eval`'s cases (checked at parse time, before a server
    starts for an evaluation that would refuse its options)."""
    import yaml

    from agent.eval.cases import CASES

    schema = yaml.safe_load((REPO / "workflow" / "schemas" / "config.schema.yaml").read_text())
    assert schema["$defs"]["eval_case"]["enum"] == list(CASES)
    workflow_dir.configure(eval={"cases": ["pbmc3k"]})
    out = workflow_dir.snakemake("-n")
    assert out.returncode != 0 and "'pbmc3k' is not one of" in out.stdout, out.stdout[-2000:]


def test_eval_model_serves_evaluates_and_gates_the_cohort(workflow_dir: WorkflowDir, inputs: Path):
    """vllm mode with the stand-in server and eval.min_score: the evaluation's own server (a
    service in one group with the eval job) serves `agent eval` on one case and is stopped. The
    stand-in has no calls for the case, so every decision fails and the score (0) is below 0.5:
    the llm sample is refused in one line before its server starts. At min_score 0 the same
    evaluation passes (not redone); the report is given it (its link: tests/test_report.py)."""
    standin = f"{sys.executable} {REPO / 'tests' / 'fixtures_workflow.py'} --recorded {inputs}"
    workflow_dir.write_sheet([{"sample": "a", "path": "inputs/a.h5ad"}])
    workflow_dir.configure(
        analysis={"policy": "llm"},
        server={"mode": "vllm", "samples_per_server": 1, "command": standin},
        eval={"cases": ["synthetic_tiny"], "end_to_end": [], "min_score": 0.5},
        resources={"analyze": {"cpus_per_task": 1}, "eval": {"cpus_per_task": 1}},
    )
    (inputs / "x").mkdir()  # the stand-in's recorded runs: one, empty, of another sample
    record = {"meta": {"sample": "x"}, "entries": [], "schema_version": 1}
    (inputs / "x" / "world_state.json").write_text(json.dumps(record))
    wd = workflow_dir.path
    plan = workflow_dir.snakemake("-n", "-p", "--cores", "2")
    assert plan.returncode == 0, plan.stdout
    group = plan.stdout.split("Group job server_eval ", 1)[1].split("\n[", 1)[0]  # to the next job
    assert "rule eval_model:" in group and "wildcards: shard=eval" in group
    (command,) = shell_commands(plan.stdout, "eval_model")
    wanted = "--cases synthetic_tiny --end-to-end none --endpoint-file results/servers/eval.json"
    assert wanted in command
    (report,) = shell_commands(plan.stdout, "report")
    assert "--eval results/eval/eval.json" in report

    refused = workflow_dir.snakemake("--cores", "2")
    assert refused.returncode != 0
    line = (
        "eval_min_score: the model's evaluation gave score 0, below config eval.min_score 0.5: "
        "no llm sample is analysed (model Qwen/Qwen3.6-27B at revision main; see "
        "results/eval/eval.html)"
    )
    assert line in refused.stdout.splitlines(), refused.stdout[-3000:]
    evaluation = json.loads((wd / "results/eval/eval.json").read_text())
    assert evaluation["score"] == 0 and len(evaluation["points"]) > 10
    # as the samples' records name their model (test_adding_a_sample_...: meta.server)
    assert (evaluation["model"]["model_id"], evaluation["model"]["revision"]) == (
        "Qwen/Qwen3.6-27B", "main"
    )  # fmt: skip
    assert (wd / "results/eval/eval.html").is_file()
    assert "stopped by SIGTERM" in (wd / "logs/serve_vllm/eval.log").read_text()
    assert not list((wd / "results/servers").glob("*.json"))  # the endpoint was temporary
    assert not (wd / "logs/serve_vllm/shard000.log").exists()  # the cohort's never started
    assert not (wd / "logs/analyze/a.log").exists()

    workflow_dir.configure(eval={"min_score": 0.0})
    passed = workflow_dir.snakemake("--cores", "2", "results/eval/min_score.json")
    assert passed.returncode == 0, passed.stdout[-5000:]
    assert job_counts(passed.stdout) == {"eval_min_score": 1}  # the evaluation is not redone
    assert json.loads((wd / "results/eval/min_score.json").read_text())["min_score"] == 0


@pytest.mark.parametrize("source", [pytest.param("path", marks=pytest.mark.slow), "git"])
def test_works_as_a_module_from_another_folder(tmp_path: Path, source: str):
    """Another project's Snakefile imports the workflow as a `module`, from the checkout's path
    or from its git repository (`gitfile`, a `git+file://` source, as snakedeploy's remote ones
    are read), under a prefix, with the small `.test` config: its own files (schemas, rules,
    report captions, the `agent` package) are found from the source, data and results stay in
    the host. From the path, the demo sample runs to the cohort report and `snakemake --report`;
    from git, a dry run."""
    import shutil
    import zipfile

    host = tmp_path / "host"
    shutil.copytree(REPO / ".test" / "config", host / "config")
    snakefile = {
        "path": f'"{REPO / "workflow" / "Snakefile"}"',
        "git": f'gitfile(repo_path="{REPO}", path="workflow/Snakefile", ref="HEAD")',
    }[source]
    (host / "Snakefile").write_text(
        'configfile: "config/config.yaml"\n\n\n'
        f"module scagent:\n    snakefile:\n        {snakefile}\n"
        "    config:\n        config\n\n\n"
        "use rule * from scagent as scagent_*\n"
    )

    def snakemake(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "snakemake", *args],
            cwd=host, env=workflow_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, timeout=600,
        )  # fmt: skip

    out = snakemake("-n", "-p")
    assert out.returncode == 0, out.stdout
    counts = job_counts(out.stdout)  # every rule under the prefix (other rules may join)
    assert all(rule.startswith("scagent_") for rule in counts), counts
    assert {rule: counts.get(f"scagent_{rule}") for rule in ("demo_data", "analyze", "report")} == {
        "demo_data": 1, "analyze": 1, "report": 1
    }  # fmt: skip
    (report,) = shell_commands(out.stdout, "scagent_report")
    assert "--outdir results/report" in report
    if source == "git":  # no folder to copy from a remote source, and no error for it
        assert "--workflow-root" not in report
        return
    # the repository, whose files the crate copies
    assert f"--workflow-root {os.path.relpath(REPO, host)} " in report
    out = snakemake("--cores", "2")
    logs = "\n".join(f"== {p}\n{p.read_text()[-2000:]}" for p in host.glob("logs/*/*.log"))
    assert out.returncode == 0, out.stdout[-5000:] + logs
    check_cohort_outputs(host, ("pbmc1",))
    assert not (REPO / ".test" / "results").exists()  # nothing written beside the source
    assert (host / "results/samples/pbmc1/plots").is_dir()
    assert (host / "benchmarks/analyze/pbmc1.tsv").is_file()

    # `snakemake --report`: the zip holds the cohort report folder (its links included), the
    # sample's world state and plots
    out = snakemake("--report", "report.zip")
    assert out.returncode == 0, out.stdout[-5000:]
    names = zipfile.ZipFile(host / "report.zip").namelist()
    # the cohort report's folder, whole: index.html beside what it links
    (index,) = [n for n in names if n.endswith("/index.html") and "/ro-crate/" not in n]
    folder = index.removesuffix("index.html")
    for linked in ("cohort.tsv", "ro-crate/ro-crate-metadata.json"):
        assert folder + linked in names, (linked, names)
    assert any(n.endswith("/world_state.json") and not n.startswith(folder) for n in names)
    plots = sorted(p.name for p in (host / "results/samples/pbmc1/plots").glob("*.png"))
    assert plots and all(any(n.endswith(f"/{p}") for n in names) for p in plots), names
    again = snakemake("--cores", "2", "-n")  # nothing reruns after the report
    assert "Nothing to be done" in again.stdout, again.stdout


def test_declared_outputs_benchmarks_and_report_items(workflow_dir: WorkflowDir):
    """Every file a rule writes is declared; plots/ survives reruns (update), the record, plots
    and the cohort report folder are report items; analyze and serve write benchmarks."""
    out = workflow_dir.snakemake("-n", "results/samples/pbmc1/world_state.json")
    assert out.returncode == 0, out.stdout
    assert (
        "output: results/samples/pbmc1/world_state.json, results/samples/pbmc1/metrics.jsonl, "
        "results/samples/pbmc1/plots (update)" in out.stdout
    )
    assert "benchmark: benchmarks/analyze/pbmc1.tsv" in out.stdout
    assert "checkpoints" not in out.stdout and "adata.h5ad" not in out.stdout
    rules = {p.stem: p.read_text() for p in (REPO / "workflow" / "rules").glob("*.smk")}
    assert '"benchmarks/serve_vllm/{shard}.tsv"' in rules["serve"]
    assert 'htmlindex="index.html"' in rules["report"]


# A stand-in `singularity` (the command Snakemake calls, also under Apptainer): it writes what a
# container would get (image, binds, PYTHONPATH) to $STANDIN_LOG, then runs the job's command
# (the last three arguments: SHELL -c COMMAND) on the host.
STANDIN_SINGULARITY = """#!/bin/sh
if [ "$1" = --version ]; then echo 'apptainer version 1.4.0'; exit 0; fi
eval "image=\\${$(($# - 3))}"
printf 'image=%s\\nbind=%s\\npythonpath=%s\\n' "$image" "$APPTAINER_BIND" "$PYTHONPATH" >> "$STANDIN_LOG"
shift $(($# - 3))
exec "$@"
"""


def test_apptainer_jobs_get_the_workflows_image_package_and_shared_folders(tmp_path: Path):
    """A real job under `--sdm apptainer` (through a stand-in runtime): its image is the one
    beside the workflow's definitions, not in the working directory; the workflow's repository
    is on its PYTHONPATH; the folders outside the working directory it needs (the repository,
    server.hf_home, server.cache_dir, the input's folder) are bound; the working directory, which
    Snakemake mounts itself, is not."""
    bin_dir, shared, elsewhere = tmp_path / "bin", tmp_path / "shared", tmp_path / "elsewhere"
    for folder in (bin_dir, shared / "hf", shared / "cache", elsewhere, tmp_path / "wd"):
        folder.mkdir(parents=True)
    (bin_dir / "singularity").write_text(STANDIN_SINGULARITY)
    (bin_dir / "singularity").chmod(0o755)
    (elsewhere / "a.h5ad").touch()  # unreadable: the agent records an input refusal (exit 3)
    wd = make_workflow_dir(tmp_path / "wd")
    wd.write_sheet([{"sample": "a", "path": str(elsewhere / "a.h5ad")}])
    wd.configure(server={"hf_home": str(shared / "hf"), "cache_dir": str(shared / "cache")})
    log = tmp_path / "standin.log"
    env = {"PATH": f"{bin_dir}:{workflow_env()['PATH']}", "STANDIN_LOG": str(log)}
    env["APPTAINER_BIND"] = "/site/data"  # a site's own binds stay
    out = wd.snakemake(
        "--sdm", "apptainer", "--cores", "1", "results/samples/a/world_state.json", env=env
    )
    assert out.returncode == 0, out.stdout
    seen = dict(line.split("=", 1) for line in log.read_text().splitlines())
    assert seen["image"] == str(REPO / "envs" / "agent.sif")
    assert seen["bind"].split(",") == [
        "/site/data", str(REPO), str(shared / "hf"), str(shared / "cache"), str(elsewhere)
    ]  # fmt: skip
    assert seen["pythonpath"].split(os.pathsep)[0] == str(REPO)
    assert (wd.path / "results/samples/a/world_state.json").is_file()

    wd.configure(containers={"agent": "oras://registry.example/scagent-agent:0.1.0"})
    out = wd.snakemake(
        "--sdm", "apptainer", "-n", "--forceall", "results/samples/a/world_state.json", env=env
    )
    assert out.returncode == 0, out.stdout
    assert "oras://registry.example/scagent-agent:0.1.0" in out.stdout


def test_apptainer_deployment_plans_every_job_in_its_image(workflow_dir: WorkflowDir, tmp_path):
    """`--sdm apptainer` with the Slurm profile, as docs/installation.md says, dry: each job in its rule's
    image. Snakemake asks the runtime for its version first; where none is installed a stand-in
    answers (the images themselves are built on the cluster: `apptainer build envs/*.sif ...`)."""
    import shutil

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    if not (shutil.which("apptainer") or shutil.which("singularity")):
        for name in ("apptainer", "singularity"):
            stub = bin_dir / name
            stub.write_text("#!/bin/sh\necho 'apptainer version 1.4.0'\n")
            stub.chmod(0o755)
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}"}
    out = workflow_dir.snakemake(
        "-n", "--sdm", "apptainer", "--profile", str(REPO / "profiles" / "slurm"), env=env
    )
    assert out.returncode == 0, out.stdout
    assert job_counts(out.stdout)["analyze"] == len(DEMO_SAMPLES)

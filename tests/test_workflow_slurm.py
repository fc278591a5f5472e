"""The workflow on the real single-node Slurm cluster (tests/slurm/start.sh), with the profile.

1. The demo cohort with the reference policy: every job is submitted with sbatch, has a sacct
   row that says COMPLETED, and every artifact exists.
2. One sample switched to the llm policy with `server.mode: vllm`: its shard's serve_vllm job and
   its analyze job go to Slurm as ONE group job (one allocation holding the fake GPU). The server
   is the stand-in from tests/fixtures_workflow.py (an OpenAI-compatible server that answers the
   agent with the tool calls of its run 1), so this proves the workflow's server plumbing on Slurm:
   the GPU request, the group allocation, the agent waiting for the endpoint file, the agent
   talking to the server through the real LLMPolicy, and Snakemake stopping the server (SIGTERM)
   once its agents are done. vLLM itself is tested in tests/test_serve_*.py.
"""

from __future__ import annotations

import csv
import json
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures_slurm import FAST_POLLING, SlurmCluster
from tests.fixtures_workflow import (
    DEMO_SAMPLES,
    REPO,
    WorkflowDir,
    check_cohort_outputs,
    make_workflow_dir,
)

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

# The test node has 2 CPUs: one per job, so a server group (server + one agent) fits on it.
SLURM_SAMPLES = DEMO_SAMPLES[:2]
SMALL = {"runtime": 30, "mem_mb": 2000, "cpus_per_task": 1, "slurm_partition": ""}
SMALL_RESOURCES = {
    "demo_data": SMALL,
    "analyze": SMALL,
    "replay": {"runtime": 30, "mem_mb": 2000},  # replay takes its sample's analyze CPUs
    "report": SMALL,
}


def submissions(output: str) -> dict[str, tuple[str, str]]:
    """{snakemake job id: (Slurm job id, Slurm log path)} from the executor's 'submitted' lines."""
    found = re.findall(
        r"Job (\S+) has been submitted with SLURM jobid (\d+) \(log: (\S+)\)", output
    )
    return {job: (slurm_id, log.rstrip(").")) for job, slurm_id, log in found}


def run_with_profile(
    wd: WorkflowDir, env: dict[str, str], *args: str
) -> subprocess.CompletedProcess[str]:
    """`snakemake --profile slurm`, the profile found by its bare name as a user's link finds it."""
    out = wd.snakemake("--profile", "slurm", *FAST_POLLING, *args, env=env, timeout=1800)
    logs = "\n".join(
        f"== {p}\n{p.read_text()[-2000:]}" for p in sorted(wd.path.glob("logs/*/*.log"))
    )
    assert out.returncode == 0, out.stdout[-6000:] + logs
    return out


def assert_all_through_slurm(
    cluster: SlurmCluster, output: str, expected_jobs: int
) -> dict[str, dict[str, str]]:
    """Every planned job (all but the local `all`) was submitted and COMPLETED in sacct.

    Returns the sacct rows by Slurm job id."""
    submitted = submissions(output)
    assert len(submitted) == expected_jobs, output[-4000:]
    rows = cluster.sacct([slurm_id for slurm_id, _ in submitted.values()])
    for slurm_id, log in submitted.values():
        assert slurm_id in rows, f"no sacct row for Slurm job {slurm_id} ({log})"
        row = rows[slurm_id]
        assert (row["State"], row["ExitCode"]) == ("COMPLETED", "0:0"), (log, row)
    return rows


@pytest.fixture(scope="module")
def cohort(slurm_profile_env, tmp_path_factory) -> tuple[WorkflowDir, str]:
    """Run 1: the demo cohort's first samples, reference policy, through Slurm (the whole
    cohort and its conditions run in tests/test_workflow.py; here every job kind matters, not
    how many of each)."""
    wd = make_workflow_dir(tmp_path_factory.mktemp("slurm_cohort"))
    with (wd.path / "samples.tsv").open() as handle:
        rows = list(csv.DictReader(handle, delimiter="\t"))
    wd.write_sheet([row for row in rows if row["sample"] in SLURM_SAMPLES])
    wd.configure(resources=SMALL_RESOURCES, server={"resources": SMALL})
    return wd, run_with_profile(wd, slurm_profile_env).stdout


def test_demo_cohort_runs_through_slurm(slurm_cluster, cohort: tuple[WorkflowDir, str]):
    wd, output = cohort
    # 2 demo_data + 2 analyze + 2 replay + 1 compare + 1 cohort_composition + 1 cohort_de +
    # 1 report; `all` is a local rule with nothing to run
    slurm_ids = set(assert_all_through_slurm(slurm_cluster, output, expected_jobs=10))
    check_cohort_outputs(wd.path, SLURM_SAMPLES)
    for sample in SLURM_SAMPLES:
        first = (wd.path / "logs" / "analyze" / f"{sample}.log").read_text().splitlines()[0]
        # the attempt's start (UTC), then where it ran
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\S+Z host \S+, slurm job \d+", first), first
        assert first.split()[-1] in slurm_ids


def test_server_group_shares_one_allocation(
    slurm_cluster, slurm_profile_env, cohort: tuple[WorkflowDir, str], tmp_path: Path
):
    """pbmc2 switches to the llm policy: one server group; the other samples are up to date."""
    wd, _ = cohort
    sample = "pbmc2"
    recorded = tmp_path / "recorded"
    (recorded / sample).mkdir(parents=True)
    shutil.copy(wd.path / "results" / "samples" / sample / "world_state.json", recorded / sample)
    standin = f"{sys.executable} {REPO / 'tests' / 'fixtures_workflow.py'} --recorded {recorded}"
    with (wd.path / "samples.tsv").open() as handle:
        rows = list(csv.DictReader(handle, delimiter="\t"))
    wd.write_sheet([{**row, "policy": "llm" if row["sample"] == sample else ""} for row in rows])
    wd.configure(server={"mode": "vllm", "samples_per_server": 1, "command": standin})
    output = run_with_profile(wd, slurm_profile_env).stdout

    # the server group (serve_vllm + analyze of pbmc2), its replay, the comparison, the
    # composition and differential expression (pbmc2 has no condition, but its record changed)
    # and the report
    rows = assert_all_through_slurm(slurm_cluster, output, expected_jobs=6)
    groups = [(log, i) for i, log in submissions(output).values() if "group_server_" in log]
    assert len(groups) == 1 and "/group_server_shard000_" in groups[0][0], groups
    slurm_job = groups[0][1]
    assert "gres/gpu=1" in rows[slurm_job]["AllocTRES"], rows  # the allocation holds the GPU
    serve_log = (wd.path / "logs" / "serve_vllm" / "shard000.log").read_text()
    assert f"in slurm job {slurm_job}" in serve_log, serve_log  # server and agent: one allocation
    analyze_log = (wd.path / "logs" / "analyze" / f"{sample}.log").read_text()
    first = analyze_log.split("\n", 1)[0]
    assert first.endswith(f"Z host {socket.gethostname()}, slurm job {slurm_job}"), first
    served = re.search(r"stopped by SIGTERM after (\d+) requests", serve_log)
    assert served, f"Snakemake did not stop the server:\n{serve_log}"

    run = json.loads((wd.path / "results" / "samples" / sample / "world_state.json").read_text())
    original = json.loads((recorded / sample / "world_state.json").read_text())
    assert run["meta"]["policy"] == "llm" and run["meta"]["model"] == "scripted"
    assert [(e["tool"], e["params"]) for e in run["entries"]] == [
        (e["tool"], e["params"]) for e in original["entries"]
    ]
    assert int(served.group(1)) == len(original["entries"])  # one request per step
    assert not list((wd.path / "results" / "servers").glob("*.json"))  # service file removed
    check_cohort_outputs(wd.path, SLURM_SAMPLES)

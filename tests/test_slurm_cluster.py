"""The single-node test cluster (tests/slurm/start.sh) and the Slurm profile, with real jobs.

Plain and GPU jobs go through sbatch and srun and show up in sacct; cancelling a job ends even
its detached processes; the smoke workflow (tests/slurm/smoke) runs through `snakemake --profile
slurm`, every job with a Slurm job id in the logs and a sacct row; a job that exits 1 or is
cancelled makes Snakemake fail instead of wait.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import pytest

from tests.fixtures_slurm import FAST_POLLING, REPO, SlurmCluster, slurm_command

pytestmark = pytest.mark.slurm

SMOKE = REPO / "tests" / "slurm" / "smoke" / "Snakefile"
SUBMITTED = re.compile(r"has been submitted with SLURM jobid (\d+)")


@pytest.fixture
def workdir(tmp_path: Path) -> Iterator[Path]:
    """A scratch directory; any job still queued from it is cancelled afterwards."""
    yield tmp_path
    for line in slurm_command("squeue", "-h", "-o", "%i|%Z").splitlines():
        job_id, job_dir = line.split("|", 1)
        if Path(job_dir) == tmp_path:
            subprocess.run(["scancel", job_id], check=False)


def sbatch(cluster: SlurmCluster, workdir: Path, *options: str, wrap: str) -> str:
    """Submit `wrap` as a batch job, wait for it to end, return its job id."""
    return slurm_command(
        "sbatch", "--parsable", "--wait", "-p", cluster.partition, "--time=1",
        f"--chdir={workdir}", "--output=%j.out", *options, "--wrap", wrap,
        timeout=120,
    ).strip()  # fmt: skip


def smoke_command(*targets: str) -> list[str]:
    """`snakemake --profile slurm` on the smoke workflow; failed jobs are not retried."""
    return [
        sys.executable, "-m", "snakemake", "--profile", "slurm", "--snakefile", str(SMOKE),
        "--retries", "0", *FAST_POLLING, *targets,
    ]  # fmt: skip


def job_ids_in(path: Path) -> list[str]:
    """The Slurm job ids that an output of the smoke workflow recorded, line by line."""
    return re.findall(r"slurm_job_id=(\d+)", path.read_text())


def test_plain_and_gpu_batch_jobs_reach_sacct(slurm_cluster: SlurmCluster, workdir: Path):
    gpu = sbatch(slurm_cluster, workdir, "--gres=gpu:1", wrap='echo "gpus=$CUDA_VISIBLE_DEVICES"')
    plain = sbatch(slurm_cluster, workdir, wrap='echo "gpus=${CUDA_VISIBLE_DEVICES:-none}"')

    assert (workdir / f"{gpu}.out").read_text() == "gpus=0\n"
    assert (workdir / f"{plain}.out").read_text() == "gpus=none\n"
    rows = slurm_cluster.sacct([gpu, plain])
    for job in (gpu, plain):
        assert rows[job]["State"] == "COMPLETED", rows[job]
        assert rows[job]["NodeList"] == slurm_cluster.node
    assert "gres/gpu=1" in rows[gpu]["AllocTRES"]
    assert "gres/gpu" not in rows[plain]["AllocTRES"]


def test_srun_runs_a_step_with_the_fake_gpu(slurm_cluster: SlurmCluster):
    out = slurm_command(
        "srun", "-p", slurm_cluster.partition, "--time=1", "--gres=gpu:1",
        "bash", "-c", 'echo "$SLURMD_NODENAME $CUDA_VISIBLE_DEVICES"',
        timeout=60,
    )  # fmt: skip
    assert out.split() == [slurm_cluster.node, "0"]


def test_cancelled_job_leaves_no_processes_behind(slurm_cluster: SlurmCluster, workdir: Path):
    config = slurm_command("scontrol", "show", "config")
    if not re.search(r"^ProctrackType\s*=\s*proctrack/cgroup$", config, re.MULTILINE):
        pytest.skip("without proctrack/cgroup Slurm loses processes that leave the job's tree")
    # A process that detaches from the job (new session, re-parented to init), as daemons do.
    marker = f"{time.time_ns() % 10**9}"
    job = slurm_command(
        "sbatch", "--parsable", "-p", slurm_cluster.partition, "--time=1", f"--chdir={workdir}",
        "--output=%j.out", "--wrap", f"(setsid sleep 600.{marker} &); sleep 600",
    ).strip()  # fmt: skip
    detached = wait_for_pids(f"sleep 600.{marker}", present=True, timeout=60)
    slurm_command("scancel", job)
    left = wait_for_pids(f"sleep 600.{marker}", present=False, timeout=30)
    for pid in left:
        subprocess.run(["kill", pid], check=False)
    assert detached and not left, f"processes of cancelled job {job} still run: {left}"


def wait_for_pids(pattern: str, *, present: bool, timeout: float) -> list[str]:
    """Poll `pgrep -f pattern` until it finds processes (present) or none; return the pids."""
    deadline = time.monotonic() + timeout
    while True:
        pids = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout
        if bool(pids.split()) == present or time.monotonic() > deadline:
            return pids.split()
        time.sleep(0.2)


@pytest.mark.slow
def test_smoke_workflow_runs_every_job_through_slurm(
    slurm_cluster: SlurmCluster, slurm_profile_env: dict[str, str], workdir: Path
):
    done = subprocess.run(
        smoke_command(),
        cwd=workdir,
        env=slurm_profile_env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]

    submitted = SUBMITTED.findall(done.stderr)
    assert len(submitted) == 4, done.stderr[-4000:]  # plain x2, gpu, the server+client group
    out = workdir / "out"
    plain = [job_ids_in(out / f"plain_{i}.txt")[0] for i in (1, 2)]
    gpu = job_ids_in(out / "gpu.txt")[0]
    server, client = job_ids_in(out / "client.txt")  # the client copies the server's endpoint
    assert server == client, "the group's service and consumer ran in different allocations"
    assert sorted([*plain, gpu, client]) == sorted(submitted)

    rows = slurm_cluster.sacct(submitted)
    for job in submitted:
        assert rows[job]["State"] == "COMPLETED", rows[job]
        assert rows[job]["Partition"] == slurm_profile_env["SCAGENT_SLURM_PARTITION"]
        # The profile keeps every job's Slurm log.
        assert list((workdir / ".snakemake" / "slurm_logs").rglob(f"{job}.log")), job
    for job in (gpu, client):
        assert "gres/gpu=1" in rows[job]["AllocTRES"], rows[job]
    for job in plain:
        assert "gres/gpu" not in rows[job]["AllocTRES"], rows[job]


@pytest.mark.slow
def test_failing_job_fails_the_workflow_promptly(
    slurm_cluster: SlurmCluster, slurm_profile_env: dict[str, str], workdir: Path
):
    done = subprocess.run(
        smoke_command("out/fail.txt"),
        cwd=workdir,
        env=slurm_profile_env,
        capture_output=True,
        text=True,
        timeout=240,  # a hang fails the test here
    )
    exited = time.time()

    assert done.returncode != 0
    [job] = SUBMITTED.findall(done.stderr)
    assert f"SLURM-job '{job}' failed, SLURM status is: 'FAILED'" in done.stderr
    row = slurm_cluster.sacct([job])[job]
    assert (row["State"], row["ExitCode"]) == ("FAILED", "1:0")
    noticed = exited - datetime.fromisoformat(row["End"]).timestamp()
    assert noticed < 60, f"Snakemake exited {noticed:.0f} s after its job failed"


def test_cancelled_job_fails_the_workflow(
    slurm_cluster: SlurmCluster, slurm_profile_env: dict[str, str], workdir: Path
):
    log = workdir / "snakemake.log"
    with log.open("w") as sink:
        run = subprocess.Popen(
            smoke_command("out/sleeper.txt"),
            cwd=workdir,
            env=slurm_profile_env,
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
    try:
        job = wait_for_running_job(log, timeout=180)
        slurm_command("scancel", job)
        returncode = run.wait(timeout=120)  # a hang fails the test here
        exited = time.time()
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()

    assert returncode != 0
    assert f"SLURM-job '{job}' failed, SLURM status is: 'CANCELLED'" in log.read_text()
    row = slurm_cluster.sacct([job])[job]
    assert row["State"].startswith("CANCELLED"), row  # sacct says "CANCELLED by <uid>"
    noticed = exited - datetime.fromisoformat(row["End"]).timestamp()
    assert noticed < 60, f"Snakemake exited {noticed:.0f} s after its job was cancelled"


def wait_for_running_job(log: Path, timeout: float) -> str:
    """The Slurm id of the job that Snakemake's log says it submitted, once the job runs."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        submitted = SUBMITTED.findall(log.read_text())
        if submitted:
            state = slurm_command("squeue", "-h", "-j", submitted[0], "-o", "%T").strip()
            if state == "RUNNING":
                return submitted[0]
        time.sleep(0.5)
    pytest.fail(f"no running Slurm job within {timeout:.0f} s; Snakemake said:\n{log.read_text()}")

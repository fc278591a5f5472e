"""The single-node Slurm test cluster of tests/slurm/start.sh, for tests that submit real jobs.

`slurm_cluster` finds the cluster up (a responding node, sacct answering) or skips the test with
the command that starts it; its `sacct()` returns the accounting rows of given jobs.
`slurm_profile_env` is an environment in which `snakemake --profile slurm` finds profiles/slurm,
the way a user's ~/.config/snakemake/slurm link does; add FAST_POLLING to such a command line.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
START_HINT = "start it with `bash tests/slurm/start.sh` (as root; installs and starts Slurm)"
# Node states in which the node answers and can run jobs (a busy node is still up; sinfo marks a
# node that does not answer with a trailing "*").
USABLE_NODE_STATES = {"idle", "mixed", "allocated", "completing"}
# sacct states of a job that has not ended yet.
UNFINISHED_STATES = {"PENDING", "RUNNING", "REQUEUED", "SUSPENDED", "RESIZING"}
# Status polling for tests: the profile's 10 s pauses are for real clusters.
FAST_POLLING = [
    "--slurm-init-seconds-before-status-checks",
    "1",
    "--seconds-between-status-checks",
    "1",
]


def slurm_command(*args: str, timeout: float = 30) -> str:
    """Run a Slurm client command and return its stdout; fail the test with its stderr."""
    done = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        pytest.fail(f"`{' '.join(args)}` exited {done.returncode}: {done.stderr.strip()}")
    return done.stdout


@dataclass(frozen=True)
class SlurmCluster:
    """The running test cluster: its one node and default partition."""

    node: str
    partition: str

    def sacct(
        self, job_ids: list[str], *, final: bool = True, timeout: float = 60
    ) -> dict[str, dict[str, str]]:
        """sacct rows (JobID, JobName, Partition, State, ExitCode, AllocTRES, NodeList, End) by id.

        With `final`, wait until every job has a row in a final state: slurmctld sends job ends
        to slurmdbd asynchronously, so a row can lag the job by a moment.
        """
        fields = [
            "JobID", "JobName", "Partition", "State", "ExitCode", "AllocTRES", "NodeList", "End",
        ]  # fmt: skip
        deadline = time.monotonic() + timeout
        while True:
            out = slurm_command(
                "sacct", "-X", "-n", "--parsable2", f"--format={','.join(fields)}",
                "-j", ",".join(job_ids),
            )  # fmt: skip
            rows = {}
            for line in out.splitlines():
                row = dict(zip(fields, line.split("|"), strict=True))
                rows[row["JobID"]] = row
            pending = [
                j for j in job_ids if rows.get(j, {}).get("State", "PENDING") in UNFINISHED_STATES
            ]
            if not final or not pending or time.monotonic() > deadline:
                return rows
            time.sleep(0.5)


@pytest.fixture(scope="session")
def slurm_cluster() -> SlurmCluster:
    """The test cluster, up and answering; skips (with how to start it) when it is not."""
    if shutil.which("sinfo") is None or shutil.which("sacct") is None:
        pytest.skip(f"no Slurm client commands (sinfo, sacct) on PATH: {START_HINT}")
    try:
        nodes = subprocess.run(
            ["sinfo", "-h", "-N", "-o", "%N|%P|%T"], capture_output=True, text=True, timeout=20
        )
        accounting = subprocess.run(
            ["sacct", "-n", "-X", "--starttime", "now-1hours"],
            capture_output=True,
            text=True,
            timeout=20,
        )
    except subprocess.TimeoutExpired as err:
        pytest.skip(f"Slurm did not answer within 20 s ({err.cmd[0]}): {START_HINT}")
    if nodes.returncode != 0:
        pytest.skip(f"slurmctld is not answering ({nodes.stderr.strip()}): {START_HINT}")
    if accounting.returncode != 0:
        pytest.skip(f"sacct fails, slurmdbd is down ({accounting.stderr.strip()}): {START_HINT}")
    usable = [
        line.split("|")
        for line in nodes.stdout.splitlines()
        if line.split("|")[2] in USABLE_NODE_STATES
    ]
    if not usable:
        pytest.skip(f"no usable Slurm node (sinfo: {nodes.stdout.strip()!r}): {START_HINT}")
    node, partitions = usable[0][0], [row[1] for row in usable]
    default = next((p.rstrip("*") for p in partitions if p.endswith("*")), partitions[0])
    return SlurmCluster(node=node, partition=default)


@pytest.fixture(scope="session")
def slurm_profile_env(
    slurm_cluster: SlurmCluster, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, str]:
    """os.environ with XDG_CONFIG_HOME holding snakemake/slurm -> profiles/slurm.

    SCAGENT_SLURM_PARTITION defaults to the cluster's default partition.
    """
    config_home = tmp_path_factory.mktemp("xdg-config")
    (config_home / "snakemake").mkdir()
    (config_home / "snakemake" / "slurm").symlink_to(REPO / "profiles" / "slurm")
    env = {**os.environ, "XDG_CONFIG_HOME": str(config_home)}
    env.setdefault("SCAGENT_SLURM_PARTITION", slurm_cluster.partition)
    return env

"""Fault injection, for real: a real vLLM server stalled (SIGSTOP) and killed (SIGKILL) mid-run and
restarted; an agent that gives up on a server and is run again; a damaged checkpoint; a damaged
record. Every case must end with the same record as an uninterrupted run: the same tools, parameters,
results and data digests, step for step.

The agents here run ``python -m tests.fault_agent``: the real ``agent run --policy llm`` (every
request goes to the server and meets its faults) with the reference policy's tool calls, so that
a whole analysis runs. docs/operations.md's table of faults lists these tests.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from agent.record.durable import Unsupported
from agent.record.integrity import check_record, unchained
from agent.record.layout import SampleLayout
from agent.record.lock import FolderLock
from agent.record.world_state import WorldState
from agent.resume import keep_metrics, publish, publish_unless_held
from agent.runner import _record_ending
from agent.testing.local_server import REPO, launcher_stderr, stop_launcher
from agent.tools.input_size import cgroup_room
from tests.fixtures_vllm import group_alive, start_server, vllm_skip_reason
from tests.fixtures_workflow import make_workflow_dir, workflow_env
from tests.test_runner import facts, run_cmd, steps_done

SAMPLE = "small"
# BLAS threads change the last bits of PCA: every run here uses the one thread that the workflow's
# job gets with --cores 1, so that records can be compared bit for bit.
ONE_THREAD = {f"{lib}_NUM_THREADS": "1" for lib in ("OMP", "OPENBLAS", "MKL")}
ENV = {**os.environ, **ONE_THREAD}
# thinking off: a random model never closes its thought, and each reply cut while thinking would
# double the next one's budget until requests outlast the 5 s timeout under test
REQUEST = ["--request-timeout", "5", "--request-retries", "1", "--max-tokens", "8", "--no-thinking"]


def start(cmd: list[str], log: Path) -> subprocess.Popen:
    with open(log, "w") as err:  # a file, not a pipe: it never fills up
        return subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=subprocess.DEVNULL, stderr=err)


def read(path: Path) -> str:
    return path.read_bytes().decode(errors="replace")


def run(cmd: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=600)


def wait_for_steps(outdir: Path, n: int, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + 300
    while steps_done(outdir) < n:
        assert proc.poll() is None, f"the agent ended before step {n}:\n{log.read_text()}"
        assert time.monotonic() < deadline, f"no step {n} after 300 s:\n{log.read_text()}"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def baseline_dir(small_input: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder of the uninterrupted run every faulty one must reproduce (never changed)."""
    outdir = tmp_path_factory.mktemp("baseline")
    done = run(run_cmd(small_input, outdir, sample=SAMPLE))
    assert done.returncode == 0, done.stderr
    return outdir


@pytest.fixture(scope="module")
def baseline(baseline_dir: Path) -> WorldState:
    world = WorldState.load(baseline_dir / "world_state.json")
    assert world.meta["status"] == "finished"
    return world


@dataclass
class FaultyServer:
    """The test's own vLLM server (the session's shared one must not be harmed)."""

    model_dir: Path
    workdir: Path
    launcher: subprocess.Popen
    endpoint_file: Path

    @property
    def pgid(self) -> int:  # vLLM runs in its own session: its pid is its group's id
        return int(json.loads(self.endpoint_file.read_text())["pid"])

    def signal(self, signum: int) -> None:
        os.killpg(self.pgid, signum)

    def kill_and_restart(self) -> tuple[str, str]:
        """SIGKILL every vLLM process, check the launcher withdrew the endpoint file, start a
        new server (new port, new key) under the same endpoint file; returns (old, new) URL."""
        old = json.loads(self.endpoint_file.read_text())
        self.signal(signal.SIGKILL)
        assert self.launcher.wait(60) == 1
        assert not self.endpoint_file.exists(), "a dead server's endpoint file was left behind"
        assert "vLLM exited with status" in launcher_stderr(self.endpoint_file)
        self.launcher, _ = start_server(self.model_dir, self.workdir)
        new = json.loads(self.endpoint_file.read_text())
        assert new["port"] != old["port"] or new["pid"] != old["pid"]
        return old["url"], new["url"]


@pytest.fixture(scope="module")
def faulty_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    reason = vllm_skip_reason()
    if reason:
        pytest.skip(reason)
    workdir = tmp_path_factory.mktemp("faulty_server")
    launcher, endpoint = start_server(tiny_model_dir, workdir)
    server = FaultyServer(tiny_model_dir, workdir, launcher, endpoint)
    yield server
    pgid = server.pgid if server.endpoint_file.exists() else None
    if pgid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGCONT)  # a stopped server cannot act on SIGTERM
    stop_launcher(server.launcher)
    assert pgid is None or not group_alive(pgid), f"vLLM processes (group {pgid}) remain"


def llm_run(input_path: Path, outdir: Path, server: FaultyServer, outage_wait: int) -> list[str]:
    llm = ["--policy", "llm", "--endpoint-file", str(server.endpoint_file), *REQUEST]
    return run_cmd(
        input_path,
        outdir,
        *llm,
        "--outage-wait",
        str(outage_wait),
        sample=SAMPLE,
        module="tests.fault_agent",
    )


@pytest.mark.vllm
def test_server_that_stays_down_fails_clearly_and_the_run_resumes(
    faulty_server, baseline, small_input, tmp_path
):
    """The server stalls for longer than the outage wait: the agent gives up within a bounded
    time with a clear error and its record intact; run again once the server is back, it resumes
    and ends with the uninterrupted run's record."""
    outdir, log = tmp_path / "out", tmp_path / "agent.log"
    proc = start(llm_run(small_input, outdir, faulty_server, outage_wait=10), log)
    wait_for_steps(outdir, 5, proc, log)
    faulty_server.signal(signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        code = proc.wait(180)
        gave_up_after = time.monotonic() - t0
    finally:
        faulty_server.signal(signal.SIGCONT)
    err = log.read_text()
    assert code != 0, err
    # one request timeout, a retry and its backoff, then the 10 s wait: bounded, not a hang
    assert gave_up_after < 60, err
    assert "did not come back within 10 s" in err and "can resume from its world state" in err
    failed = WorldState.load(outdir / "checkpoints/world_state.json")
    assert failed.meta["status"] == "failed"
    assert failed.meta["error"].startswith("ServerUnavailable: server http")
    assert len(failed.entries) >= 5 and facts(failed) == facts(baseline)[: len(failed.entries)]
    assert failed.meta["outages"][-1]["waited_s"] >= 10

    done = run(llm_run(small_input, outdir, faulty_server, outage_wait=600))
    assert done.returncode == 0, done.stderr
    assert f"resuming after step {len(failed.entries)}" in done.stderr
    resumed = WorldState.load(outdir / "world_state.json")
    assert resumed.meta["status"] == "finished" and len(resumed.meta["resumed"]) == 1
    assert facts(resumed) == facts(baseline)


@pytest.mark.vllm
def test_stalled_then_killed_and_restarted_server_is_waited_out(
    faulty_server, baseline, small_input, tmp_path
):
    """In one run the server first stalls (requests time out rather than hang; the agent waits
    and goes on when it answers again), then dies and is started anew on another port with
    another key: the agent finds it through the endpoint file and finishes the analysis."""
    outdir, log = tmp_path / "out", tmp_path / "agent.log"
    proc = start(llm_run(small_input, outdir, faulty_server, outage_wait=600), log)
    wait_for_steps(outdir, 3, proc, log)
    faulty_server.signal(signal.SIGSTOP)
    time.sleep(25)  # past the request timeout, the retry and its backoff: into the outage wait
    faulty_server.signal(signal.SIGCONT)
    wait_for_steps(outdir, 10, proc, log)
    _, new_url = faulty_server.kill_and_restart()  # a new key: only a followed endpoint works
    assert proc.wait(600) == 0, log.read_text()
    err = log.read_text()
    assert err.count("unavailable at step") >= 2 and f"server {new_url}/ back after" in err, err
    world = WorldState.load(outdir / "world_state.json")
    assert world.meta["status"] == "finished" and not world.meta["resumed"]
    waits = [o["waited_s"] for o in world.meta["outages"]]
    assert len(waits) >= 2 and all(w > 0 for w in waits), world.meta["outages"]
    assert facts(world) == facts(baseline)
    rows = (outdir / "metrics.jsonl").read_text().splitlines()
    assert len(rows) == len(world.entries)
    key = (faulty_server.workdir / "server.key").read_text().strip()
    assert (faulty_server.workdir / "server.key").stat().st_mode & 0o777 == 0o600
    written = [p for folder in (outdir, faulty_server.workdir) for p in folder.rglob("*")]
    leaks = [p for p in written if p.is_file() and p.suffix != ".key" and key in read(p)]
    assert not leaks, f"the API key is written in {leaks}"


def test_damaged_checkpoint_is_passed_over_on_resume(baseline, small_input, tmp_path):
    """A torn checkpoint (as a full disk or a crashed copy leaves it) is never trusted: the
    resumed run loads an older one, re-runs the steps after it and ends identical."""
    outdir = tmp_path / "out"
    cmd = run_cmd(small_input, outdir, sample=SAMPLE)
    first = run([*cmd, "--max-steps", "14"])
    assert first.returncode == 0, first.stderr
    newest = sorted((outdir / "checkpoints").glob("step_*.h5ad"))[-1]
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 3])
    done = run(cmd)
    assert done.returncode == 0, done.stderr
    assert f"passed over {newest.name}: unreadable" in done.stderr
    world = WorldState.load(outdir / "world_state.json")
    resumed = world.meta["resumed"][0]
    assert resumed["checkpoint_step"] < int(newest.stem[5:])
    assert resumed["rejected_checkpoints"][0].startswith(f"{newest.name}: unreadable")
    assert facts(world) == facts(baseline)


def test_damaged_record_is_refused_by_name_and_fresh_starts_over(baseline, small_input, tmp_path):
    outdir = tmp_path / "out"
    cmd = run_cmd(small_input, outdir, sample=SAMPLE)
    first = run([*cmd, "--max-steps", "6"])
    assert first.returncode == 0, first.stderr
    record = outdir / "checkpoints/world_state.json"
    record.write_bytes(record.read_bytes()[:-100])  # damaged from outside: writes are atomic
    again = run(cmd)
    assert again.returncode != 0
    assert f"cannot resume: {record}: not a readable world state" in again.stderr
    assert "rerun with --fresh" in again.stderr
    done = run([*cmd, "--max-steps", "6", "--fresh"])
    assert done.returncode == 0, done.stderr
    assert facts(WorldState.load(outdir / "world_state.json")) == facts(baseline)[:6]


def test_killed_snakemake_resumes_with_rerun_incomplete(workflow_dir, baseline, small_input):
    """The whole workflow (Snakemake, its job, the agent) killed mid-analysis, as a node failure
    does: `--rerun-incomplete` reruns the job, which resumes from the checkpoints that Snakemake's
    clean-up of the job's outputs leaves, and ends with the uninterrupted run's record."""
    workflow_dir.write_sheet([{"sample": SAMPLE, "path": str(small_input)}])
    target = f"results/samples/{SAMPLE}/world_state.json"
    outdir = workflow_dir.path / "results" / "samples" / SAMPLE
    log = workflow_dir.path / "snakemake.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            workflow_dir.command("--cores", "1", target),
            cwd=workflow_dir.path,
            env=workflow_env(),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    wait_for_steps(outdir, 12, proc, log)
    os.killpg(proc.pid, signal.SIGKILL)  # snakemake, the job's shell and the agent at once
    proc.wait()
    killed_at = steps_done(outdir)
    assert workflow_dir.snakemake("--unlock").returncode == 0  # the killed run's lock stays
    done = workflow_dir.snakemake("--cores", "1", "--rerun-incomplete", target)
    assert done.returncode == 0, done.stdout
    analyze_log = (workflow_dir.path / "logs" / "analyze" / f"{SAMPLE}.log").read_text()
    assert f"resuming after step {killed_at}" in analyze_log, analyze_log
    world = WorldState.load(outdir / "world_state.json")
    assert world.meta["status"] == "finished" and facts(world) == facts(baseline)
    rows = [json.loads(x) for x in (outdir / "metrics.jsonl").read_text().splitlines()]
    # the rows of the killed attempt were kept (one may be lost if the kill fell between writes)
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))
    assert len(rows) >= len(world.entries) - 1


def leftovers(outdir: Path) -> list[str]:
    """Temporary files of interrupted writes: hidden files (the folder's lock aside) and *.tmp."""
    return sorted(
        str(p.relative_to(outdir))
        for p in outdir.rglob("*")
        if p.is_file() and p.name != ".lock" and (p.name.startswith(".") or p.suffix == ".tmp")
    )


def test_second_agent_is_refused_and_sigterm_marks_the_record_and_resumes(
    baseline, small_input, tmp_path
):
    """One writer per folder: a second agent on a folder in use (a requeued job beside the old
    one) refuses, naming the holder. SIGTERM, as Slurm sends at a time limit: the run stops, its
    record says so, no temporary file is left, the exit status is 128+15, and the rerun resumes to
    the uninterrupted run's record."""
    outdir = tmp_path / "out"
    cmd = run_cmd(small_input, outdir, sample=SAMPLE)
    log = tmp_path / "first.log"
    first = start(cmd, log)
    wait_for_steps(outdir, 10, first, log)
    second = run(cmd)
    assert second.returncode == 1, second.stderr
    assert f"is being written by another run (pid {first.pid} on " in second.stderr
    first.send_signal(signal.SIGTERM)
    assert first.wait(60) == 128 + signal.SIGTERM, read(log)
    world = WorldState.load(outdir / "checkpoints" / "world_state.json")
    assert world.meta["status"] == "interrupted", world.meta
    assert world.meta["error"].startswith("stopped by SIGTERM after step "), world.meta
    assert leftovers(outdir) == []
    done = run(cmd)
    assert done.returncode == 0, done.stderr
    assert "resuming after step" in done.stderr
    world = WorldState.load(outdir / "world_state.json")
    assert world.meta["status"] == "finished" and facts(world) == facts(baseline)


def test_rerun_keeps_a_finished_analysis_refuses_other_settings_and_fresh_sets_it_aside(
    baseline_dir, small_input, tmp_path
):
    outdir = tmp_path / "out"
    shutil.copytree(baseline_dir, outdir)
    record = (outdir / "world_state.json").read_bytes()
    for name in ("world_state.json", "metrics.jsonl"):  # a rerun job's outputs: Snakemake deletes
        (outdir / name).unlink()
    cmd = run_cmd(small_input, outdir, sample=SAMPLE)
    kept = run(cmd)
    assert kept.returncode == 0 and "kept the analysis" in kept.stderr, kept.stderr
    assert (outdir / "world_state.json").read_bytes() == record
    assert (outdir / "metrics.jsonl").read_bytes() == (baseline_dir / "metrics.jsonl").read_bytes()

    other = run([*cmd, "--seed", "1"])
    assert other.returncode == 2, other.stderr
    assert "made with other settings: seed 0 (this run: 1)" in other.stderr
    assert (outdir / "world_state.json").read_bytes() == record

    fresh = run([*cmd, "--seed", "1", "--fresh", "--max-steps", "3"])
    assert fresh.returncode == 0, fresh.stderr
    [previous] = (outdir / "previous").iterdir()
    assert (previous / "world_state.json").read_bytes() == record
    assert {"metrics.jsonl", "adata.h5ad", "plots"} <= {p.name for p in previous.iterdir()}
    steps = [SampleLayout.checkpoint_step(p) for p in (outdir / "checkpoints").glob("step_*")]
    assert steps and max(steps) <= 3  # the old run's checkpoints went with it
    world = WorldState.load(outdir / "world_state.json")
    assert world.meta["seed"] == 1 and len(world.entries) == 3


def test_run_killed_after_finish_is_kept_as_finished(baseline_dir, baseline, small_input, tmp_path):
    """A kill between `finish` and the record's last save leaves a complete analysis whose record
    says running: the next start completes the record instead of throwing the analysis away."""
    outdir = tmp_path / "out"
    shutil.copytree(baseline_dir, outdir)
    copy = outdir / "checkpoints" / "world_state.json"
    doc = json.loads(copy.read_text())
    doc["meta"].update(status="running", ended=None)
    doc["meta"].pop("seal", None)
    copy.write_text(json.dumps(doc))  # as the loop's save after the finish step left it
    (outdir / "world_state.json").unlink()
    done = run(run_cmd(small_input, outdir, sample=SAMPLE))
    assert done.returncode == 0 and "kept the analysis" in done.stderr, done.stderr
    world = WorldState.load(outdir / "world_state.json")
    assert world.meta["status"] == "finished" and world.meta["ended"]
    assert facts(world) == facts(baseline)


def test_io_error_ends_the_run_for_a_retry_and_is_no_result(baseline, small_input, tmp_path):
    """An EIO while reading the input is the machine's fault, not the data's: no error entry, the
    record says failed with the reason, exit 1 (Snakemake retries), and the retry finishes."""
    outdir, marker = tmp_path / "out", tmp_path / "eio-happened"
    cmd = run_cmd(small_input, outdir, sample=SAMPLE, module="tests.eio_agent")
    env = {**ENV, "EIO_ONCE": str(marker)}
    first = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert first.returncode == 1 and marker.exists(), first.stderr
    assert "Input/output error" in first.stderr and "Traceback" not in first.stderr
    world = WorldState.load(outdir / "checkpoints" / "world_state.json")
    assert world.meta["status"] == "failed" and "Input/output error" in world.meta["error"]
    assert world.entries == []  # nothing of the analysis was recorded as its result
    again = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr
    assert facts(WorldState.load(outdir / "world_state.json")) == facts(baseline)


def test_sigterm_to_a_replay_removes_its_scratch_folder(baseline_dir, tmp_path):
    scratch_parent = tmp_path / "tmp"
    scratch_parent.mkdir()
    log = tmp_path / "replay.log"
    record = baseline_dir / "world_state.json"
    out = tmp_path / "replay.json"
    with open(log, "w") as err:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "agent",
                "replay",
                "--world-state",
                str(record),
                "--out",
                str(out),
            ],
            cwd=REPO,
            env={**ENV, "TMPDIR": str(scratch_parent)},
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
    deadline = time.monotonic() + 300
    while not any(steps_done(d) >= 5 for d in scratch_parent.glob("scagent-replay-*")):
        assert proc.poll() is None and time.monotonic() < deadline, read(log)
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 128 + signal.SIGTERM, read(log)
    assert "stopped by SIGTERM; nothing written" in read(log)
    assert list(scratch_parent.iterdir()) == [] and not out.exists()


def test_too_little_memory_is_a_fault_of_the_job_and_a_rerun_with_more_goes_on(
    baseline, small_input, tmp_path
):
    """A job given too little memory for its input (Slurm's own figure, SLURM_MEM_PER_NODE, as
    Slurm sets it for a job with --mem) is no verdict on the sample: exit 1, which Snakemake
    retries with more, the record says failed and why, and the rerun with more memory (the
    workflow's --replace-changed too) analyses it instead of keeping a refusal."""
    outdir = tmp_path / "out"
    cmd = run_cmd(small_input, outdir, "--replace-changed", sample=SAMPLE)
    short = subprocess.run(
        cmd, cwd=REPO, env={**ENV, "SLURM_MEM_PER_NODE": "1"}, capture_output=True, text=True
    )
    assert short.returncode == 1, short.stderr
    assert "SLURM_MEM_PER_NODE=1 MB); give the job more memory" in short.stderr
    assert "a rerun resumes" in short.stderr and "Traceback" not in short.stderr
    world = WorldState.load(SampleLayout(outdir).record_copy)
    assert world.meta["status"] == "failed" and "MemoryError" in world.meta["error"]
    assert world.entries == []  # no refusal was recorded as the sample's result
    more = run([*cmd, "--max-steps", "1"])  # the first step shows it: not a whole analysis again
    assert more.returncode == 0, more.stderr
    assert facts(WorldState.load(outdir / "world_state.json")) == facts(baseline)[:1]


def test_the_memory_limit_is_read_from_cgroup_v1_and_v2(tmp_path):
    """cgroup v1 and v2 trees written into a folder (the test cannot set the machine's
    cgroups): the limit less usage, page cache added back, of the cgroup and those above it."""
    v1 = tmp_path / "memory" / "slurm" / "job_7"
    (v1 / "step_0").mkdir(parents=True)
    for folder, limit in ((v1, 700 << 20), (v1 / "step_0", 2**63 - 4096)):  # the step: no limit
        (folder / "memory.limit_in_bytes").write_text(f"{limit}\n")
        (folder / "memory.usage_in_bytes").write_text(f"{300 << 20}\n")
        (folder / "memory.stat").write_text(f"total_inactive_file {100 << 20}\ncache 0\n")
    v2 = tmp_path / "job_8"
    v2.mkdir()
    (v2 / "memory.max").write_text(f"{3 << 30}\n")
    (v2 / "memory.current").write_text(f"{1 << 30}\n")
    (v2 / "memory.stat").write_text("inactive_file 0\n")
    lines = ["12:memory:/slurm/job_7/step_0", "3:cpu,cpuacct:/slurm/job_7", "0::/job_8"]
    assert cgroup_room(lines, tmp_path) == [
        (500 << 20, f"the memory limit of cgroup {v1}"),
        (2 << 30, f"the memory limit of cgroup {v2}"),
    ]


@pytest.fixture
def small_tmpdir(tmp_path):
    """An 8 MiB tmpfs (root only; the test is skipped elsewhere), unmounted afterwards."""
    folder = tmp_path / "tmpfs"
    folder.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(folder)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=True)


def test_full_tmpdir_during_replay_is_not_replayed_and_the_next_run_replays(
    baseline_dir, small_tmpdir, tmp_path
):
    """A replay whose scratch folder fills up says "not replayed" and why, never "diverged";
    exit 4, which the workflow's replay job does not accept, so the next run replays it: with
    the space back, reproduced."""
    out = tmp_path / "replay.json"
    cmd = [sys.executable, "-m", "agent", "replay", "--world-state"]
    cmd += [str(baseline_dir / "world_state.json"), "--out", str(out)]
    full = subprocess.run(
        cmd, cwd=REPO, env={**ENV, "TMPDIR": str(small_tmpdir)}, capture_output=True, text=True
    )
    assert full.returncode == 4, full.stdout + full.stderr
    doc = json.loads(out.read_text())
    assert doc["verdict"] == "not replayed" and doc["machine_fault"] and doc["steps"] == []
    assert "No space left on device" in doc["summary"] and "a rerun replays" in doc["summary"]
    assert list(small_tmpdir.iterdir()) == []  # its scratch folder went
    back = run(cmd)
    assert back.returncode == 0, back.stdout + back.stderr
    assert json.loads(out.read_text())["verdict"] == "reproduced"


def test_a_record_stripped_of_its_chain_and_seal_is_altered(baseline_dir, tmp_path):
    """An edited result, then every entry's chain and the seal deleted: a record of this version
    must carry them, so that is an alteration, not an old record. Only a record whose version
    predates the chain (no record_version) is let through with a note."""
    doc = json.loads((baseline_dir / "world_state.json").read_text())
    doc["entries"][4]["result"]["n_cells"] = 1
    for e in doc["entries"]:
        del e["chain"]
    del doc["meta"]["seal"]
    stripped = tmp_path / "world_state.json"
    stripped.write_text(json.dumps(doc))
    problems = check_record(WorldState.load(stripped), baseline_dir)
    assert [(p.step, p.what) for p in problems] == [
        (1, "entry of step 1 (load_data) has no chain: it was removed"),
        (None, "meta has no seal though the record says finished"),
    ]
    del doc["meta"]["record_version"]  # as records made before the chain are
    stripped.write_text(json.dumps(doc))
    old = WorldState.load(stripped)
    assert unchained(old) and check_record(old, baseline_dir) == []


def test_outputs_snakemake_deletes_come_back_and_a_second_workflow_is_stopped(
    workflow_dir, baseline, small_input, tmp_path
):
    """Clock skew: an input modified in the future makes Snakemake fail the job after the agent
    finished and delete its outputs; the copies beside the checkpoints keep them, and the next
    run (clock fixed) publishes them again, plots included, though Snakemake then finds nothing
    to do: the workflow publishes every sample's as it starts. A second
    workflow on the same results folder (its results/ a link to the first's) stops before any
    job while the folder's lock is held; the holder here is a real process holding the lock as
    an agent does (the test does not need a second analysis for it)."""
    data = tmp_path / "data" / "small.h5ad"
    data.parent.mkdir()
    shutil.copy(small_input, data)
    future = time.time() + 3600
    os.utime(data, (future, future))
    workflow_dir.write_sheet([{"sample": SAMPLE, "path": str(data), "brief": "--focus on T cells"}])
    target = f"results/samples/{SAMPLE}/world_state.json"
    layout = SampleLayout(workflow_dir.path / "results" / "samples" / SAMPLE)
    skewed = workflow_dir.snakemake("--cores", "1", target)
    log = workflow_dir.path / "logs" / "analyze" / f"{SAMPLE}.log"
    assert "s in the future: Snakemake will find every output older" in log.read_text()
    assert skewed.returncode != 0 and not layout.record.exists(), skewed.stdout
    kept = WorldState.load(layout.record_copy)
    assert kept.meta["status"] == "finished" and kept.meta["brief"] == "--focus on T cells"
    plots = {p.name: p.read_bytes() for p in layout.plots_copy.iterdir()}
    rows = layout.metrics_copy.read_bytes()
    assert plots and rows.count(b"\n") >= len(baseline.entries) - 1

    day_ago = time.time() - 86400
    os.utime(data, (day_ago, day_ago))  # the clock fixed: the outputs are newer than the input
    again = workflow_dir.snakemake("--cores", "1", target)
    assert again.returncode == 0, again.stdout
    # Snakemake finds nothing to do and starts no job, so no agent publishes: the workflow
    # itself did, as it started
    assert "Nothing to be done" in again.stdout, again.stdout
    attempts = log.with_name(f"{SAMPLE}.attempts.log").read_text()  # the skewed run's log
    assert attempts.count(" host ") == 1 and "s in the future" in attempts
    assert facts(WorldState.load(layout.record)) == facts(baseline)
    shown = {p.name: p.read_bytes() for p in layout.plots.iterdir() if p.name[0] != "."}
    assert shown == plots  # (Snakemake's hidden timestamp aside)
    assert layout.metrics.read_bytes() == rows and layout.final.is_file()

    (tmp_path / "second").mkdir()
    other = make_workflow_dir(tmp_path / "second")
    other.write_sheet([{"sample": SAMPLE, "path": str(data), "brief": "--focus on T cells"}])
    (other.path / "results").symlink_to(workflow_dir.path / "results")
    os.utime(data)  # newer than the outputs: the second workflow would rerun the job
    hold = "import sys, time; from pathlib import Path; from agent.record.lock import FolderLock\n"
    hold += "with FolderLock(Path(sys.argv[1])):\n"
    hold += "    print('held', flush=True); time.sleep(120)"
    holder = subprocess.Popen(
        [sys.executable, "-c", hold, str(layout.lock)], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline() == "held\n"
        second = other.snakemake("--cores", "1", target)
    finally:
        holder.kill()
        holder.wait()
    assert second.returncode != 0 and "one results folder per workflow" in second.stdout
    assert f"is being written by another run (pid {holder.pid} on " in second.stdout
    assert facts(WorldState.load(layout.record)) == facts(baseline)
    assert layout.metrics.read_bytes() == rows and sorted(p.name for p in layout.plots.iterdir())


def test_a_folder_without_hard_links_or_flock_is_refused_in_one_line(
    small_input, tmp_path, monkeypatch, capsys
):
    """File systems without hard links (vfat, some FUSE) or mounted without flock: simulated by
    the errors their calls return (the test cannot mount one). Refused before anything starts,
    exit 2, one line; never "a rerun resumes", which cannot happen there."""
    import errno
    import fcntl

    from agent import cli
    from agent.record.lock import FolderLock

    args = ["run", "--input", str(small_input), "--outdir", str(tmp_path / "out")]

    def no_links(*_):
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert "is on a file system without hard links (Operation not permitted)" in err
    assert "a rerun resumes" not in err and len(err.splitlines()) == 1
    monkeypatch.undo()

    def no_flock(*_):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_flock)
    with pytest.raises(Unsupported, match="does not support flock \\(No locks available\\)"):
        FolderLock(tmp_path / "lock").__enter__()
    assert cli.main(args) == 2 and "write the results to a file system with locks" in (
        capsys.readouterr().err
    )


def test_a_record_the_full_disk_keeps_running_says_why_in_the_log(tmp_path, monkeypatch, capsys):
    """ENOSPC at the very save that would say the run failed (simulated at the save: filling
    the disk under a live run is not repeatable): the log says what the record could not."""
    world = WorldState(meta={"sample": "s", "status": "failed", "error": "InfrastructureError: x"})

    def full(*_, **__):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(WorldState, "save_record", full)
    _record_ending(world, SampleLayout(tmp_path))
    err = capsys.readouterr().err
    assert "could not save the record to say 'failed' (InfrastructureError: x)" in err
    assert "No space left on device" in err and "still says running after step 0" in err


def test_metrics_rows_written_to_a_name_made_anew_are_kept(tmp_path):
    """Snakemake deleted metrics.jsonl (another workflow's refused job) while the run went on:
    the rows the loop then wrote to the new file go after the kept copy's, and a kept rerun
    publishes them all instead of the copy alone."""
    layout = SampleLayout(tmp_path)
    keep_metrics(layout, fresh=True)
    layout.metrics.write_bytes(b"")  # the loop's first rows...
    with open(layout.metrics, "ab") as f:
        f.write(b'{"step": 1}\n')
    layout.metrics.unlink()  # ...then Snakemake's clean-up, and the loop's open makes it anew
    layout.metrics.write_bytes(b'{"step": 2}\n')
    publish(layout)
    assert layout.metrics.read_bytes() == b'{"step": 1}\n{"step": 2}\n'
    assert os.path.samefile(layout.metrics, layout.metrics_copy)


def test_the_workflow_publishes_again_only_results_in_folders_no_run_holds(tmp_path):
    """What the workflow publishes as it starts: a finished analysis whose outputs Snakemake
    deleted; not a failed one (its job must rerun), nor a folder whose lock a run holds."""
    finished, failed = SampleLayout(tmp_path / "finished"), SampleLayout(tmp_path / "failed")
    for layout, status in ((finished, "finished"), (failed, "failed")):
        layout.checkpoints.mkdir(parents=True)
        layout.record_copy.write_bytes(json.dumps({"meta": {"status": status}}).encode())
        layout.metrics_copy.write_bytes(b'{"step": 1, "time": 1}\n')
    assert not publish_unless_held(failed) and not failed.record.exists()
    with FolderLock(finished.lock):
        assert not publish_unless_held(finished) and not finished.record.exists()
    assert publish_unless_held(finished)
    assert os.path.samefile(finished.record, finished.record_copy)
    assert os.path.samefile(finished.metrics, finished.metrics_copy)
    assert not publish_unless_held(finished)  # nothing missing: nothing done


def test_a_hand_written_endpoint_file_is_not_waited_on_for_long(tmp_path, monkeypatch):
    """An endpoint file written by hand names no launcher: no server is starting behind it, so
    the wait is the short one (shortened further here), and the error says why."""
    from agent import endpoint

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    file = tmp_path / "endpoint.json"
    file.write_text(
        json.dumps({"url": f"http://127.0.0.1:{port}/v1", "model": "m", "max_model_len": 4096})
    )
    monkeypatch.setattr(endpoint, "UNLAUNCHED_WAIT_S", 1.0)
    start = time.monotonic()
    with pytest.raises(endpoint.EndpointError, match="names no launcher, so no server is start"):
        endpoint.wait_until_ready(f"http://127.0.0.1:{port}/v1", endpoint_file=file)
    assert time.monotonic() - start < 10


def test_sigterm_inside_numba_is_the_stop_not_a_tool_error(baseline, small_input, tmp_path):
    """SIGTERM while scanpy's numba kernel runs (under rank_genes_groups): numba turns the
    handler's exception into a SystemError on return, which the tool raises. A stop was pending,
    so that is the signal's doing, not the tool's: the call is not in the record, the run ends
    interrupted (128+15), and the rerun resumes to the uninterrupted run's record."""
    outdir, marker = tmp_path / "out", tmp_path / "sigterm-happened"
    cmd = run_cmd(small_input, outdir, sample=SAMPLE, module="tests.signal_agent")
    env = {**ENV, "SIGTERM_ONCE": str(marker)}
    first = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert marker.exists() and first.returncode == 128 + signal.SIGTERM, first.stderr
    world = WorldState.load(SampleLayout(outdir).record_copy)
    assert world.meta["status"] == "interrupted", world.meta
    assert [e for e in world.entries if e.status != "ok"] == [], "a stop recorded as an error"
    assert world.entries and world.entries[-1].tool != "rank_genes_groups"
    assert facts(world) == facts(baseline)[: len(world.entries)]
    again = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr
    assert f"resuming after step {len(world.entries)}" in again.stderr
    assert facts(WorldState.load(outdir / "world_state.json")) == facts(baseline)

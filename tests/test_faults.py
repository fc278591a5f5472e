"""Fault injection, for real: a real vLLM server stalled (SIGSTOP) and killed (SIGKILL) mid-run and
restarted; an agent that gives up on a server and is run again; a damaged checkpoint; a damaged
record. Every case must end with the same record as an uninterrupted run: the same tools, parameters,
results and data digests, step for step.

The agents here run ``python -m tests.fault_agent``: the real ``agent run --policy llm`` (every
request goes to the server and meets its faults) with the reference policy's tool calls, so that
a whole analysis runs. The README's table of faults lists these tests.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from agent.layout import SampleLayout
from agent.testing.local_server import REPO, launcher_stderr, stop_launcher
from agent.world_state import WorldState
from tests.fixtures_vllm import group_alive, start_server, vllm_skip_reason
from tests.fixtures_workflow import workflow_env
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

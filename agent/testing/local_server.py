"""``python -m agent serve`` as a child process, for the tests' fixtures and the benchmarks: start it,
wait for its endpoint file, stop it (its Prometheus series: ``agent.serve.metrics.scrape``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


class ServerFailed(RuntimeError):
    """The server did not become ready, did not answer, or did not stop; the message says why."""


def launch(
    workdir: Path, *args: str, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen, Path]:
    """Start ``agent serve ARGS --endpoint-file WORKDIR/server.json``; returns (launcher, endpoint
    file). The launcher's stderr goes to WORKDIR/launcher.err (a file, not a pipe: it never fills)."""
    workdir.mkdir(parents=True, exist_ok=True)
    endpoint = workdir / "server.json"
    endpoint.unlink(missing_ok=True)  # an earlier server's file must not be taken for this one
    argv = [sys.executable, "-m", "agent", "serve", *args, "--endpoint-file", str(endpoint)]
    with open(workdir / "launcher.err", "w") as err:
        launcher = subprocess.Popen(
            argv, cwd=REPO, env={**os.environ, **(env or {})}, stdout=subprocess.DEVNULL, stderr=err
        )
    return launcher, endpoint


def launcher_stderr(endpoint_file: Path) -> str:
    return (endpoint_file.parent / "launcher.err").read_text()


def wait_for_endpoint(launcher: subprocess.Popen, endpoint_file: Path, timeout_s: float) -> None:
    """Until the endpoint file exists (the server is ready); stops the launcher and raises
    ServerFailed with its stderr when it exits first or the time is up."""
    deadline = time.monotonic() + timeout_s
    while not endpoint_file.exists():
        if launcher.poll() is not None or time.monotonic() > deadline:
            stop_launcher(launcher)
            raise ServerFailed(
                f"the vLLM server did not start (launcher status {launcher.returncode}):\n"
                + launcher_stderr(endpoint_file)[-4000:]
            )
        time.sleep(0.5)


def stop_launcher(launcher: subprocess.Popen, timeout_s: float = 90) -> int:
    """SIGTERM the launcher (which stops vLLM's process group) and wait; SIGKILL it, and raise,
    only if it ignores SIGTERM for ``timeout_s``. Returns its exit status."""
    if launcher.poll() is None:
        launcher.send_signal(signal.SIGTERM)
        try:
            launcher.wait(timeout_s)
        except subprocess.TimeoutExpired:
            launcher.kill()
            launcher.wait()
            raise ServerFailed(
                f"launcher {launcher.pid} ignored SIGTERM for {timeout_s} s"
            ) from None
    return launcher.returncode

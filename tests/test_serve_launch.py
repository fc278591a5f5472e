"""The launcher against a real vLLM (CPU backend): readiness, endpoint and key files, failures, SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from agent.endpoint import http_json, root_url, wait_until_ready
from agent.serve import launch
from agent.testing.local_server import launcher_stderr, stop_launcher
from tests.fixtures_vllm import (
    MAX_MODEL_LEN,
    group_alive,
    launch_serve,
    server_pid,
    vllm_skip_reason,
)

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(vllm_skip_reason() is not None, reason=str(vllm_skip_reason())),
]


def test_endpoint_file_describes_a_ready_server(vllm_server):
    info = json.loads(vllm_server.endpoint_file.read_text())
    assert info["url"] == vllm_server.base_url and info["model"] == "tiny-qwen3"
    assert info["max_model_len"] == MAX_MODEL_LEN == vllm_server.max_model_len
    assert info["vllm_version"].startswith("vllm")
    t = info["timings"]
    assert 0 < t["health_s"] <= t["models_s"] < t["ready_s"] and t["warmup_s"] > 0
    # every flag carries its reason; the GPU-only layers are recorded as left out on cpu
    assert all(f["reason"] for f in info["flags"])
    left_out = {f["name"] for f in info["flags"] if not f["chosen"]}
    assert {"--quantization", "--kv-cache-dtype", "--speculative-config"} <= left_out
    assert "--enable-prefix-caching" in info["argv"] and "--tool-call-parser" in info["argv"]
    # `vllm serve MODEL_DIR` of this environment's vLLM, not the deprecated api_server module
    command = launch.vllm_command(Path(info["model_path"]))
    assert info["argv"][: len(command) - 1] == command[1:]
    assert "vllm.entrypoints.openai.api_server" not in info["argv"]
    # a plain directory: no Hub revision; the family the client reads its sampling from
    assert (
        info["revision"] is None
        and Path(info["model_id"]).name == info["model_path"].split("/")[-1]
    )
    assert info["family"]["name"] == "qwen3" and info["family"]["reasoning_parser"] == "qwen3"
    assert info["argv"][info["argv"].index("--reasoning-parser") + 1] == "qwen3"
    assert Path(info["log"]).is_file()
    # the endpoint is already usable: no wait left
    assert (
        wait_until_ready(vllm_server.base_url, vllm_server.api_key, vllm_server.model, timeout_s=5)
        < 2
    )


def test_api_key_is_private_and_required(vllm_server):
    info = json.loads(vllm_server.endpoint_file.read_text())
    key_file = Path(info["api_key_file"])
    assert key_file.stat().st_mode & 0o777 == 0o600
    key = vllm_server.api_key
    assert len(key) >= 32 and key not in vllm_server.endpoint_file.read_text()
    cmdline = Path(f"/proc/{info['pid']}/cmdline").read_bytes().decode()
    assert key not in cmdline, "the key must not show in the process list"
    models = root_url(vllm_server.base_url) + "/v1/models"
    assert http_json("GET", models)[0] == 401
    assert http_json("GET", models, "wrong-key")[0] == 401
    status, body = http_json("GET", models, key)
    assert status == 200 and [m["id"] for m in body["data"]] == ["tiny-qwen3"]


def test_vllm_exiting_early_fails_with_the_log_tail(tiny_model_dir, tmp_path):
    # the config is readable (so flags are chosen) but vLLM cannot load the model path
    launcher, endpoint = launch_serve(
        tmp_path / "no-such-model",
        tmp_path,
        "--model-config",
        str(tiny_model_dir / "config.json"),
        "--timeout",
        "300",
    )
    code = launcher.wait(300)
    err = launcher_stderr(endpoint)
    assert code == 1, err
    assert "vLLM exited with status" in err and "before it was ready" in err
    assert f"last lines of {tmp_path / 'server.log'}" in err
    assert "no-such-model" in err.split("last lines of", 1)[1]  # vLLM's own complaint, from its log
    assert not endpoint.exists()


def test_readiness_timeout_fails_and_stops_the_server(tiny_model_dir, tmp_path):
    launcher, endpoint = launch_serve(tiny_model_dir, tmp_path, "--timeout", "3")
    code = launcher.wait(120)
    err = launcher_stderr(endpoint)
    assert code == 1 and "vLLM not ready after 3 s" in err, err
    pid = server_pid(endpoint)
    assert pid is not None and not group_alive(pid)
    assert not endpoint.exists()


def test_sigterm_while_starting_stops_every_process(tiny_model_dir, tmp_path):
    launcher, endpoint = launch_serve(tiny_model_dir, tmp_path, "--timeout", "300")
    deadline = time.monotonic() + 60
    while server_pid(endpoint) is None and time.monotonic() < deadline:
        time.sleep(0.2)
    pid = server_pid(endpoint)
    assert pid is not None, launcher_stderr(endpoint)
    time.sleep(8)  # vLLM is importing / spawning its engine by now
    started = time.monotonic()
    assert stop_launcher(launcher, timeout_s=90) == 0
    assert time.monotonic() - started < 60
    assert "SIGTERM received, vLLM stopped" in launcher_stderr(endpoint)
    assert not group_alive(pid)
    assert not endpoint.exists()


def test_killed_launcher_takes_the_server_with_it(tiny_model_dir, tmp_path):
    # SIGKILL cannot be caught: the server's parent-death signal stops it instead
    launcher, endpoint = launch_serve(tiny_model_dir, tmp_path, "--timeout", "300")
    deadline = time.monotonic() + 60
    while server_pid(endpoint) is None and time.monotonic() < deadline:
        time.sleep(0.2)
    pid = server_pid(endpoint)
    assert pid is not None
    os.kill(launcher.pid, signal.SIGKILL)
    launcher.wait()
    deadline = time.monotonic() + 60
    while group_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not group_alive(pid)
